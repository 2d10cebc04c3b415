"""The credit audit's two stages: Monte-Carlo ground truth A*, then every estimator at equal leaves.

Ground truth (ALGORITHMS.md §5). For an audited episode of K turns and return-to-go
G_k = Σ_{u≥k} γ^{u−k} r_u, let S_k be M rollouts that replay turns 0..k−1 and let the policy
act from s_k on (k = 0: M fresh episodes of the task; :mod:`turnrl.audit.replay`). Then

    V̂(s_k)      = mean of G over S_k                            (M fresh actions at s_k, continued)
    Q̂(s_k, a_k) = r_k + γ V̂(s_{k+1})   (k < K − 1),   r_k (k = K − 1: the episode ended there)
    A*_k         = Q̂ − V̂,   se_k² = γ² s²(S_{k+1})/M + s²(S_k)/M

(the M rollouts continuing after a_k are S_{k+1}: environments are deterministic, so Q(s_k, a_k)
= r_k + γ V(s_{k+1})). One collector call runs every S_k of every episode (M-way flat groups:
the replayed prefix is stepped once and deep-copied M times).

Estimators. In repeat r, each audited episode e of task τ becomes one member of a group of
``leaves`` episodes of τ, the others fresh: flat groups (e + L − 1 fresh episodes) for the
episode-level and step-level estimators; for ``branched`` with shape G1 × G2, e is leaf (0, 0),
leaves (0, 1..G2−1) continue e after its first turn, and G1 − 1 fresh subtrees of G2 leaves
complete the tree. The estimator's advantages of e's turns are compared with A*.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from turnrl.audit.replay import replay_task
from turnrl.chat import ChatTemplate
from turnrl.credit import get_estimator
from turnrl.credit.returns import discounted_return
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.sampling.base import Sampler
from turnrl.types import Episode, SamplingParams, Task


@dataclass
class Rollouts:
    """The policy on its environment: the one place the audit calls the collector; counts the cost."""

    sampler: Sampler
    chat: ChatTemplate
    params: SamplingParams
    settings: RolloutSettings = field(default_factory=RolloutSettings)
    """The run's collector limits and environment options (a replayed task's own horizon replaces
    ``max_turns``)."""
    calls: int = 0
    episodes: int = 0
    model_turns: int = 0
    """Turns sampled (one sampler completion each)."""
    new_tokens: int = 0
    context_tokens: int = 0
    """Sum of the contexts' lengths over sampled turns (prefill work without prefix caching)."""

    def __call__(self, tasks: list[Task], shape: list[int], tag: str, *, replayed: bool = False) -> list[Episode]:
        if not tasks:
            return []
        self.calls += 1
        params = replace(self.params, seed=self.params.seed + 7919 * self.calls)
        settings = replace(self.settings, max_turns=None) if replayed else self.settings  # a replay's own horizon
        episodes = collect(tasks, self.sampler, self.chat, params, shape, settings, id_prefix=f"{tag}-")
        self.account(episodes)
        return episodes

    def account(self, episodes: list[Episode]) -> None:
        """Count each distinct sampled turn once (tree leaves share their prefix turns)."""
        distinct = _distinct_turns(episodes)
        self.episodes += len(episodes)
        self.model_turns += len(distinct)
        self.new_tokens += sum(len(t.action_ids) for t in distinct)
        self.context_tokens += sum(len(t.prompt_ids) for t in distinct)

    def cost(self) -> dict[str, int]:
        return {
            "collector_calls": self.calls,
            "episodes": self.episodes,
            "model_turns": self.model_turns,
            "new_tokens": self.new_tokens,
            "context_tokens": self.context_tokens,
        }


def _distinct_turns(episodes: list[Episode]):
    """Turns of a batch with a tree's shared prefix turns once (same group, same branch prefix)."""
    out, seen = [], set()
    for ep in episodes:
        for k, turn in enumerate(ep.turns):
            key = (ep.group_id, tuple(ep.branch[: k + 1])) if k < len(ep.branch) - 1 else (ep.episode_id, k)
            if key not in seen:
                seen.add(key)
                out.append(turn)
    return out


@dataclass
class GroundTruth:
    """A* of every audited turn, flattened: episode index, turn index, Q̂, V̂, A*, se."""

    episode: np.ndarray
    turn: np.ndarray
    q: np.ndarray
    v: np.ndarray
    a_star: np.ndarray
    se: np.ndarray
    replay_exact_frac: float
    """Fraction of replayed openings whose tokens equal the recorded context of that turn."""

    def rows(self) -> list[dict[str, float]]:
        keys = ("episode", "turn", "q", "v", "a_star", "se")
        return [
            {k: (int(getattr(self, k)[j]) if k in ("episode", "turn") else float(getattr(self, k)[j])) for k in keys}
            for j in range(self.episode.size)
        ]


def sample_episodes(tasks: list[Task], n: int, rollouts: Rollouts) -> tuple[list[Task], list[Episode]]:
    """``n`` audited episodes, one per task in turn (tasks cycled): (their tasks, the episodes)."""
    chosen = [tasks[i % len(tasks)] for i in range(n)]
    return chosen, rollouts(chosen, [1], "audit")


def _returns(ep: Episode, gamma: float) -> np.ndarray:
    return discounted_return([t.reward or 0.0 for t in ep.turns], gamma)


def ground_truth(
    tasks: list[Task], episodes: list[Episode], rollouts: Rollouts, m: int, gamma: float = 1.0
) -> GroundTruth:
    """Monte-Carlo A*_k for every turn of every audited episode (module doc); one collector call
    for the replayed starts S_k (k ≥ 1) and one for the fresh S_0."""
    fresh = rollouts(list(tasks), [m], "gt0")
    starts: list[tuple[int, int]] = [(i, k) for i, ep in enumerate(episodes) for k in range(1, ep.num_turns)]
    replays = [replay_task(tasks[i], episodes[i], k, rollouts.settings.max_turns) for i, k in starts]
    continued = rollouts(replays, [m], "gt", replayed=True)
    values: dict[tuple[int, int], np.ndarray] = {}
    for i in range(len(episodes)):
        values[(i, 0)] = np.array([_returns(e, gamma)[0] for e in fresh[i * m : (i + 1) * m]])
    exact = []
    for s, (i, k) in enumerate(starts):
        group = continued[s * m : (s + 1) * m]
        values[(i, k)] = np.array([_returns(e, gamma)[0] for e in group])
        exact.append(group[0].turns[0].prompt_ids == episodes[i].turns[k].prompt_ids)
    rows = []
    for i, ep in enumerate(episodes):
        r = [t.reward or 0.0 for t in ep.turns]
        for k in range(ep.num_turns):
            v_k = values[(i, k)]
            if k < ep.num_turns - 1:
                nxt = values[(i, k + 1)]
                q = r[k] + gamma * nxt.mean()
                var_q = gamma**2 * nxt.var(ddof=1) / m if m > 1 else float("nan")
            else:
                q, var_q = r[k], 0.0
            var_v = v_k.var(ddof=1) / m if m > 1 else float("nan")
            rows.append((i, k, q, v_k.mean(), q - v_k.mean(), np.sqrt(var_q + var_v)))
    cols = list(zip(*rows, strict=True)) if rows else [()] * 6
    return GroundTruth(
        *(np.asarray(c, dtype=float if j > 1 else int) for j, c in enumerate(cols)),
        replay_exact_frac=float(np.mean(exact)) if exact else 1.0,
    )


# ---------------------------------------------------------------- estimators at equal leaves


@dataclass(frozen=True)
class EstimatorArm:
    """One estimator of the audit: a label, a registered estimator, its parameters, its rollout shape."""

    label: str
    estimator: str
    params: dict[str, Any] = field(default_factory=dict)
    shape: tuple[int, int] | None = None
    """G1 × G2 for tree estimators; None = flat groups of ``leaves``."""


def default_arms(leaves: int, shapes: Sequence[tuple[int, int]] | None = None) -> list[EstimatorArm]:
    """Every registered built-in estimator: group_mean at each scale, batch_mean, loo_similarity,
    stepwise (both baselines), gigpo (both episode statistics), the critic (λ 0.9 and 0: fresh each
    call, fitted on the audit's own batch without the audited episode) and branched at each shape."""
    arms = [EstimatorArm(f"group_mean/{s}", "group_mean", {"scale": s}) for s in ("group", "batch", "none")]
    arms += [
        EstimatorArm("batch_mean", "batch_mean"),
        EstimatorArm("loo_similarity", "loo_similarity"),
        EstimatorArm("stepwise", "stepwise"),
        EstimatorArm("stepwise/per_turn_index", "stepwise", {"baseline": "per_turn_index"}),
        EstimatorArm("gigpo", "gigpo"),
        EstimatorArm("gigpo/per_step", "gigpo", {"episode_stats": "per_step", "std_eps": 1e-6}),
        EstimatorArm("critic", "critic"),
        EstimatorArm("critic/lam0", "critic", {"lam": 0.0}),
    ]
    for g1, g2 in shapes if shapes is not None else default_shapes(leaves):
        if g1 * g2 != leaves:
            raise ValueError(f"branched shape {g1}x{g2} has {g1 * g2} leaves, not --leaves {leaves}")
        arms.append(EstimatorArm(f"branched/{g1}x{g2}", "branched", {}, (g1, g2)))
    return arms


def default_shapes(leaves: int) -> list[tuple[int, int]]:
    """G1 = 2 and the divisor of ``leaves`` nearest √leaves (both with G2 ≥ 2)."""
    divisors = [g for g in range(2, leaves // 2 + 1) if leaves % g == 0]
    if not divisors:
        return []
    near = min(divisors, key=lambda g: (abs(g - leaves**0.5), g))
    return [(g, leaves // g) for g in sorted({divisors[0], near})]


def estimate(arm: EstimatorArm, episodes: list[Episode]) -> dict[str, list[float | None]]:
    """The one place the audit runs an estimator: its registry function on a batch (no Turn writes)."""
    spec = get_estimator(arm.estimator)
    return spec.fn(episodes, spec.params.model_validate(arm.params)).advantages


def _member(ep: Episode, gid: str, eid: str, branch: list[int], prompt: str) -> Episode:
    out = copy.copy(ep)
    out.group_id, out.episode_id, out.branch, out.prompt = gid, eid, branch, prompt
    return out


def _flat_batch(audited: list[Episode], fresh: list[Episode], leaves: int) -> list[Episode]:
    batch = []
    n = leaves - 1
    for i, ep in enumerate(audited):
        gid = f"a{i}"
        batch.append(_member(ep, gid, f"{gid}-audit", [], ep.prompt))
        batch += [_member(f, gid, f"{gid}-f{j}", [], ep.prompt) for j, f in enumerate(fresh[i * n : (i + 1) * n])]
    return batch


def _continue_after_first(ep: Episode, cont: Episode) -> Episode:
    """The audited episode's first turn followed by a continuation's turns (one leaf)."""
    turns = [ep.turns[0], *cont.turns]
    return replace(ep, turns=turns, reward=float((ep.turns[0].reward or 0.0) + cont.reward))


def _tree_batch(
    audited: list[Episode], cont: dict[int, list[Episode]], fresh: list[Episode], shape: tuple[int, int]
) -> list[Episode]:
    g1, g2 = shape
    per_tree = (g1 - 1) * g2
    batch = []
    for i, ep in enumerate(audited):
        gid = f"a{i}"
        batch.append(_member(ep, gid, f"{gid}-audit", [0, 0], ep.prompt))
        for j in range(1, g2):
            leaf = _continue_after_first(ep, cont[i][j - 1]) if i in cont else ep  # a one-turn episode: replicas
            batch.append(_member(leaf, gid, f"{gid}-c{j}", [0, j], ep.prompt))
        for f in fresh[i * per_tree : (i + 1) * per_tree]:
            a, b = f.branch
            batch.append(_member(f, gid, f"{gid}-t{a + 1}.{b}", [a + 1, b], ep.prompt))
    return batch


def estimator_runs(
    tasks: list[Task],
    audited: list[Episode],
    rollouts: Rollouts,
    arms: list[EstimatorArm],
    leaves: int,
    repeats: int,
) -> dict[str, np.ndarray]:
    """``{label: Â[r, j]}``: each arm's advantages of the audited turns (flattened as in
    :func:`ground_truth`), per repeat; NaN where an estimator gives a turn none."""
    if leaves < 2:
        raise ValueError(f"--leaves must be at least 2 (got {leaves})")
    shapes = sorted({a.shape for a in arms if a.shape is not None})
    out = {a.label: np.full((repeats, sum(e.num_turns for e in audited)), np.nan) for a in arms}
    for r in range(repeats):
        batches: dict[tuple[int, int] | None, list[Episode]] = {}
        if any(a.shape is None for a in arms):
            fresh = rollouts(list(tasks), [leaves - 1], f"r{r}-flat")
            batches[None] = _flat_batch(audited, fresh, leaves)
        for g1, g2 in shapes:
            two_turn = [i for i, e in enumerate(audited) if e.num_turns > 1]
            replays = [replay_task(tasks[i], audited[i], 1, rollouts.settings.max_turns) for i in two_turn]
            conts = rollouts(replays, [g2 - 1], f"r{r}-c{g1}x{g2}", replayed=True) if g2 > 1 else []
            cont = {i: conts[s * (g2 - 1) : (s + 1) * (g2 - 1)] for s, i in enumerate(two_turn)}
            fresh = rollouts(list(tasks), [g1 - 1, g2], f"r{r}-t{g1}x{g2}") if g1 > 1 else []
            batches[(g1, g2)] = _tree_batch(audited, cont, fresh, (g1, g2))
        for arm in arms:
            adv = estimate(arm, batches[arm.shape])
            row = [a for i, ep in enumerate(audited) for a in adv[f"a{i}-audit"][: ep.num_turns]]
            out[arm.label][r] = [np.nan if a is None else a for a in row]
    return out
