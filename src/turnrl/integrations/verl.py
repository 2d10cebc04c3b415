"""turnrl's credit estimators as verl advantage estimators (``verl/trainer/ppo/core_algos.py``).

verl calls a registered estimator as ``fn(token_level_rewards=[bs, L], response_mask=[bs, L],
config=AlgoConfig, index=uid array)`` and takes ``(advantages [bs, L], returns [bs, L])`` back. Two row
layouts are served:

* **Trajectory rows** (verl's multi-turn agent loop: one row per episode, the environment's tokens in
  the response with ``response_mask`` 0): :func:`verl_estimator` wraps any registered turnrl estimator.
  Row i is episode i of group ``index[i]``; its turns are the maximal runs of ``response_mask == 1``;
  turn k's reward is Σ ``token_level_rewards`` from turn k's first token up to turn k+1's (a reward on an
  environment token belongs to the turn before it); the episode's reward is the row's sum (verl's
  score). Every token of turn k gets turn k's advantage, 0 off the mask; ``returns`` = ``advantages``
  (as verl's outcome estimators return). :func:`register_verl` registers them as ``turnrl_<name>``
  through ``register_adv_est`` (``algorithm.adv_estimator: turnrl_stepwise``).
* **Step rows** (verl-agent's GiGPO layout: one row per turn, ``traj_index`` its episode,
  ``anchor_obs`` its state, ``step_rewards`` the discounted return from that step):
  :func:`gigpo_step_advantage` has verl-agent's ``compute_gigpo_outcome_advantage`` signature and
  computes with turnrl's own :func:`~turnrl.credit.gigpo.per_step_episode_advantages` and
  :func:`~turnrl.credit.gigpo.anchor_advantages`.

Differences from verl's own functions, all by design: a group of one episode gets 0 (verl's GRPO
divides by 1 + ε instead: A = R / (1 + ε)); a group whose values are all equal gets exactly 0 (verl
subtracts a float mean, which may leave a residue); turnrl's ε is 1e-4 (verl's default 1e-6, verl-agent's
1e-6: ``gigpo_step_advantage`` takes ``epsilon`` as verl-agent does). Trees (``branched``) need tree
rollouts, which verl does not collect: no ``turnrl_branched`` is registered. docs/integrations.md.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from turnrl.credit import ESTIMATORS, get_estimator
from turnrl.credit.gigpo import anchor_advantages, per_step_episode_advantages
from turnrl.integrations.credit import settings_from_mapping
from turnrl.types import Episode, Turn

if TYPE_CHECKING:
    from verl.trainer.config import AlgoConfig

Spans = list[tuple[int, int]]
"""A row's turns as (first, end) token positions: the run of mask 1 is [first, end_of_run)."""


def turn_spans(mask_row: Sequence[int]) -> tuple[Spans, Spans]:
    """(the runs of 1 in ``mask_row`` as [start, stop), each turn's reward span [start, next turn's start))."""
    runs: Spans = []
    start = None
    for t, m in enumerate(list(mask_row) + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    rewards = [(s, runs[k + 1][0] if k + 1 < len(runs) else len(mask_row)) for k, (s, _) in enumerate(runs)]
    if rewards:  # a reward before the first action (none is expected) counts for the first turn
        rewards[0] = (0, rewards[0][1])
    return runs, rewards


def trajectory_episodes(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Sequence[Hashable]
) -> tuple[list[Episode], list[Spans]]:
    """verl's trajectory rows as episodes (module doc) and each row's turn spans. The episodes carry no
    token ids: the estimators read rewards, groups and keys only."""
    rewards = token_level_rewards.detach().double().cpu().numpy()
    mask = response_mask.detach().cpu().numpy()
    if rewards.shape != mask.shape or len(index) != rewards.shape[0]:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)}, response_mask {tuple(mask.shape)} and index"
            f" ({len(index)}) must describe the same rows"
        )
    episodes, spans = [], []
    for i in range(rewards.shape[0]):
        runs, reward_spans = turn_spans(mask[i].tolist())
        turns = [
            Turn(k, [], [], [], "", reward=float(rewards[i, a:b].sum()), policy_version=0)
            for k, (a, b) in enumerate(reward_spans)
        ]
        episodes.append(
            Episode(f"row{i}", str(index[i]), turns, float(rewards[i].sum()), True, False, group_id=str(index[i]))
        )
        spans.append(runs)
    return episodes, spans


def verl_estimator(name: str, **params: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The turnrl estimator ``name`` (with its own ``params``, validated as ``credit.*``) as a verl
    advantage estimator over trajectory rows."""
    settings = settings_from_mapping({"estimator": name, **params})
    spec = settings.spec
    if spec.needs_tree:
        raise ValueError(f"credit estimator {name!r} needs tree rollouts, which verl does not collect")

    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Sequence[Hashable] | None = None,
        config: AlgoConfig | None = None,  # verl's algorithm config: the parameters are fixed at registration
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if index is None:
            raise ValueError(f"turnrl_{name} needs verl's uid index (the group of each row)")
        episodes, spans = trajectory_episodes(token_level_rewards, response_mask, index)
        result = spec.fn(episodes, settings.params)
        out = torch.zeros_like(token_level_rewards, dtype=torch.float32)
        for i, (ep, runs) in enumerate(zip(episodes, spans, strict=True)):
            for adv, (a, b) in zip(result.advantages[ep.episode_id], runs, strict=True):
                out[i, a:b] = 0.0 if adv is None else adv
        out = out * response_mask
        return out, out

    estimator.__name__ = f"turnrl_{name}"
    estimator.__doc__ = f"turnrl's {name!r} credit over verl trajectory rows (turnrl.integrations.verl)."
    return estimator


def register_verl(
    params: dict[str, dict[str, Any]] | None = None, register: Callable[[str], Callable] | None = None
) -> list[str]:
    """Register every turnrl estimator that needs no tree as ``turnrl_<name>`` in verl's registry
    (``register``: verl's ``register_adv_est`` by default); ``params[name]``: that estimator's parameters.
    Returns the registered names."""
    if register is None:
        try:
            from verl.trainer.ppo.core_algos import register_adv_est as register
        except ImportError as exc:
            raise ImportError("register_verl needs verl: pip install verl (see docs/integrations.md)") from exc
    names = []
    for name in sorted(ESTIMATORS):
        if get_estimator(name).needs_tree:
            continue
        register(f"turnrl_{name}")(verl_estimator(name, **(params or {}).get(name, {})))
        names.append(f"turnrl_{name}")
    return names


def gigpo_step_advantage(
    token_level_rewards: torch.Tensor,
    step_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    anchor_obs: Sequence[Any],
    index: Sequence[Hashable],
    traj_index: Sequence[Hashable],
    epsilon: float = 1e-6,
    step_advantage_w: float = 1.0,
    mode: str = "mean_norm",
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO over step rows (verl-agent's ``compute_gigpo_outcome_advantage`` signature and layout).

    A_row = A^E + ω A^S on the row's masked tokens: A^E from the rows' scores (Σ token_level_rewards)
    with mean and std over the rows of the group (verl-agent's ``compute_mean_std_cross_steps``; a group
    of one row: μ = 0, σ = 1), A^S from ``step_rewards`` (the returns from each step) over the rows of the
    group with the same anchor observation. ``mode``: ``mean_norm`` (R − μ at both levels) or
    ``mean_std_norm`` ((R − μ) / (σ + ε)). ``traj_index`` is not needed by the formula (each row counts
    once, as in verl-agent) and is accepted for its signature.
    """
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"mode must be mean_norm or mean_std_norm (got {mode!r})")
    scores = token_level_rewards.detach().double().sum(-1).cpu().numpy()
    groups = [str(g) for g in index]
    n = len(groups)
    episode = per_step_episode_advantages(
        scores, [1] * n, groups, "group" if mode == "mean_std_norm" else "none", epsilon
    )
    anchors = [(g, _hashable(o)) for g, o in zip(groups, anchor_obs, strict=True)]
    returns = step_rewards.detach().double().cpu().numpy().reshape(n)
    step = anchor_advantages(returns, anchors, "mean_std" if mode == "mean_std_norm" else "mean", epsilon)
    per_row = torch.tensor(episode + step_advantage_w * step, dtype=torch.float32, device=response_mask.device)
    out = per_row.unsqueeze(-1) * response_mask
    return out, out


def _hashable(x: Any) -> Hashable:
    """An anchor observation as a hashable key (verl-agent's ``to_hashable``: arrays and lists by value)."""
    if isinstance(x, np.ndarray):
        return tuple(x.flatten().tolist())
    if isinstance(x, list | tuple):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    return x.item() if isinstance(x, np.generic) else x
