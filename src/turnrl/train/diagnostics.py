"""The step row's numbers about its episodes: lengths, turns, success, why episodes stopped, their own metrics."""

from __future__ import annotations

import numpy as np

from turnrl.types import Episode, StopReason

_IN_THE_ROW = ("num_turns", "step")
"""Episode metrics the row already carries under another name (``num_turns/mean``, the row's ``step``)."""


def rollout_metrics(episodes: list[Episode]) -> dict[str, float]:
    """What a step's episodes did, with the same keys whatever they did (N = the step's episodes):

    * ``completions/mean_length``: mean action tokens per turn; ``completions/clipped_ratio``: the
      fraction of turns cut by the token limit (``finish_reason`` length); ``num_turns/mean``;
      ``success_rate``; ``num_episodes`` = N.
    * ``stop/<reason>`` for every :class:`~turnrl.types.StopReason`: (episodes that stopped for it) / N,
      0 for a reason none did; they add up to 1 less the episodes an environment ended without a reason.
    * ``episode/<name>`` for every numeric episode metric (the environment's own, and the collector's
      ``env_error``, ``truncated_reward``, ...): Σ over the episodes that report it / N, an episode that
      does not report it counting 0 — so a flag set when something happened (``env_error``) reads as the
      fraction of episodes it happened to. ``reward/<name>`` metrics are in the row already (credit's
      means over the episodes that report them).

    A step without episodes (every group dropped by dynamic sampling) reports N = 0 and every rate 0.
    """
    n = len(episodes)
    turns = [t for ep in episodes for t in ep.turns]
    out = {
        "completions/mean_length": float(np.mean([len(t.action_ids) for t in turns])) if turns else 0.0,
        "completions/clipped_ratio": float(np.mean([t.finish_reason == "length" for t in turns])) if turns else 0.0,
        "num_turns/mean": float(np.mean([ep.num_turns for ep in episodes])) if episodes else 0.0,
        "success_rate": float(np.mean([ep.success for ep in episodes])) if episodes else 0.0,
        "num_episodes": float(n),
    }
    for reason in StopReason:
        out[f"stop/{reason.value}"] = sum(ep.stop_reason == reason for ep in episodes) / n if n else 0.0
    names = sorted({k for ep in episodes for k in ep.metrics if k not in _IN_THE_ROW and not k.startswith("reward/")})
    for name in names:
        out[f"episode/{name}"] = sum(float(ep.metrics.get(name, 0.0)) for ep in episodes) / n
    return out
