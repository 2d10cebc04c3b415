"""Turn-level critic: a value V(s_t) of the state each turn acts from, advantages by GAE over turns.

An episode of K turns acts from states s_0 .. s_{K−1} and ends in s_K (returns.py's convention):

    G_t = Σ_{u≥t} γ^{u−t} r_u  (+ γ^{K−t} V(s_K) when truncated)     the critic's regression target
    δ_t = r_t + γ V(s_{t+1}) − V(s_t),   V(s_K) = 0 unless truncated
    A_t = Σ_l (γλ)^l δ_{t+l}             (λ = 1: A_t = G_t − V(s_t);  λ = 0: A_t = δ_t)

The target is the Monte-Carlo return-to-go (not a TD(λ) target): it does not lean on a critic that
is still learning, and turnrl's episodes are a few turns long. Bootstrapping with V(s_{t+1}) (λ < 1)
is what removes the future's noise F_t from turn t (ALGORITHMS.md §6), at the price of V's error.

The critic is a small model this module owns (not a value head on the policy; pure numpy):

* ``state_key`` (tabular, used when every turn carries ``Turn.state_key``): a regularised mean per
  key, shrunk down a hierarchy (task and state → state → all turns) with strength κ:

      μ = Σ w G / Σ w,   V(k) = (S_k + κ μ) / (W_k + κ),   V(τ, k) = (S_{τ,k} + κ V(k)) / (W_{τ,k} + κ)

  (W, S: the weight and weighted sum of the targets seen in that cell) — exact as the data grows.
* ``text`` (otherwise): ridge regression on hashed features of the state's text (the task prompt,
  then each earlier reply and observation): L2-normalised counts of word unigrams and bigrams hashed
  into ``dim`` bins (crc32), one bin for the turn index, and an unpenalised intercept b:

      (w, b) = argmin Σ (G − b − x·w)² + κ |w|²

Both keep sufficient statistics (per-cell sums; XᵀX and Xᵀy), so fitting is adding them up.

Cross-fitting: no turn's value uses its own episode's return. A turn of episode i in fold f is valued
from the history (earlier steps) plus this batch minus fold f (tabular: each episode is its own fold,
leave-one-episode-out; text: ``folds`` folds, episode i in fold i mod F). The flat group's other
episodes are independent draws of the same task, so V is a baseline free of episode i's actions and
the critic helps from the first step. After the advantages, the batch joins the history:
H ← decay · H + B. V(s_K) of a truncated episode comes from the history alone (its targets must
exist before the batch is fitted); in tabular mode s_K has no key and gets the history's μ.

A run keeps one :class:`CriticState` (``EstimatorSpec.state``): it learns across steps and is saved
with the checkpoint (``state_dict``). The registry function alone (``critic_advantages``: the credit
audit, ``turnrl credit --records``) starts from an empty history: the batch is cross-fitted on itself.

``scale`` divides by the root mean square of the advantages (over the batch, over each group's
turns, or not at all); the advantages are not centred, and an all-zero set stays zero.

ALGORITHMS.md §1 "returns toolkit"; docs/algorithms.md "critic" has the worked example.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field

from turnrl.credit.group import tokenize
from turnrl.credit.result import STD_EPS, CreditResult, EstimatorParams, EstimatorSpec, Scale, group_indices
from turnrl.credit.returns import discounted_return, gae
from turnrl.types import Episode

Features = Literal["auto", "state_key", "text"]
Mode = Literal["state_key", "text"]


class CriticParams(EstimatorParams):
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount γ of the return and of the TD residuals."""
    lam: float = Field(0.9, ge=0, le=1)
    """GAE's λ: 1 = return-to-go minus V (no bootstrap), 0 = one-step TD residual."""
    features: Features = "auto"
    """What the critic reads: ``state_key`` (tabular), ``text`` (hashed ridge), ``auto`` (``state_key``
    when every turn of the first batch has one, else ``text``; kept for the run)."""
    shrinkage: float = Field(1.0, ge=0)
    """κ: prior weight of a cell's parent (tabular), ridge penalty (text)."""
    decay: float = Field(0.8, ge=0, le=1)
    """Weight the history keeps per step (H ← decay · H + batch): 1 = remember everything, 0 = the last batch."""
    folds: int = Field(2, ge=2, le=16)
    """Cross-fitting folds of episodes in ``text`` mode (tabular mode leaves each episode out)."""
    dim: int = Field(256, ge=8, le=2048)
    """Hashed feature bins in ``text`` mode."""
    scale: Scale = "batch"
    """Divide by the RMS of the advantages over the ``batch``, each ``group``, or ``none``."""


# ---------------------------------------------------------------- the two value models


Cell = Callable[[str], tuple[float, float]]
"""A table's lookup: key → (W, S), the weight and weighted sum of the targets in that cell."""


@dataclass
class Table:
    """Per-cell weight and weighted sum of targets: ``cells[key] = [W, S]``; ``""`` is the whole table."""

    cells: dict[str, list[float]] = field(default_factory=dict)

    def add(self, task_id: str, state_key: str, target: float) -> None:
        for key in ("", *cell_keys(task_id, state_key)):
            cell = self.cells.setdefault(key, [0.0, 0.0])
            cell[0] += 1.0
            cell[1] += target

    def cell(self, key: str) -> tuple[float, float]:
        w, s = self.cells.get(key, (0.0, 0.0))
        return w, s

    def merged(self, *signed: tuple[float, Table]) -> Table:
        """self + Σ sign · other (cell by cell)."""
        out = Table({k: list(v) for k, v in self.cells.items()})
        for sign, other in signed:
            for key, (w, s) in other.cells.items():
                cell = out.cells.setdefault(key, [0.0, 0.0])
                cell[0] += sign * w
                cell[1] += sign * s
        return out

    def scaled(self, factor: float) -> Table:
        return Table({k: [factor * w, factor * s] for k, (w, s) in self.cells.items()})


def cell_keys(task_id: str, state_key: str) -> tuple[str, str]:
    """The state's cell and the (task, state) cell."""
    return f"k\x1f{state_key}", f"t\x1f{task_id}\x1f{state_key}"


def signed_cells(*parts: tuple[float, Table]) -> Cell:
    """The lookup of Σ sign · table, without building it (history + batch − own episode)."""

    def cell(key: str) -> tuple[float, float]:
        w = s = 0.0
        for sign, table in parts:
            tw, ts = table.cell(key)
            w, s = w + sign * tw, s + sign * ts
        return w, s

    return cell


def table_mean(cell: Cell) -> float:
    w, s = cell("")
    return s / w if w > 1e-9 else 0.0


def table_value(cell: Cell, task_id: str, state_key: str, kappa: float) -> float:
    """V(τ, k) = (S_{τ,k} + κ V(k)) / (W_{τ,k} + κ),  V(k) = (S_k + κ μ) / (W_k + κ),  μ = S / W.

    A cell with W + κ = 0 (κ = 0, no data) takes its parent's value."""

    def shrunk(key: str, parent: float) -> float:
        w, s = cell(key)
        return (s + kappa * parent) / (w + kappa) if w + kappa > 1e-9 else parent

    k, tk = cell_keys(task_id, state_key)
    return shrunk(tk, shrunk(k, table_mean(cell)))


@dataclass
class Ridge:
    """Sufficient statistics of a ridge fit with an intercept (the last column of x is 1)."""

    xtx: np.ndarray
    xty: np.ndarray

    @classmethod
    def zeros(cls, d: int) -> Ridge:
        return cls(np.zeros((d + 1, d + 1)), np.zeros(d + 1))

    @classmethod
    def of(cls, x: np.ndarray, y: np.ndarray) -> Ridge:
        return cls(x.T @ x, x.T @ y)

    def merged(self, *signed: tuple[float, Ridge]) -> Ridge:
        xtx, xty = self.xtx.copy(), self.xty.copy()
        for sign, other in signed:
            xtx += sign * other.xtx
            xty += sign * other.xty
        return Ridge(xtx, xty)

    def scaled(self, factor: float) -> Ridge:
        return Ridge(factor * self.xtx, factor * self.xty)

    def solve(self, kappa: float) -> np.ndarray:
        """θ = (XᵀX + κ diag(1, …, 1, 0))⁻¹ Xᵀy (least-norm when singular); θ = 0 with no data."""
        if self.xtx[-1, -1] <= 1e-12:
            return np.zeros_like(self.xty)
        penalty = np.full(self.xty.size, kappa)
        penalty[-1] = 0.0
        return np.linalg.lstsq(self.xtx + np.diag(penalty), self.xty, rcond=None)[0]


def state_text(ep: Episode, t: int) -> str:
    """The text of the state turn t acts from: the task prompt, then each earlier reply and observation."""
    parts = [ep.prompt]
    for turn in ep.turns[:t]:
        parts += [turn.action_text, turn.observation or ""]
    return "\n".join(parts)


def hashed_features(text: str, turn: int, dim: int) -> np.ndarray:
    """x ∈ R^{dim+1}: L2-normalised hashed counts of word unigrams, bigrams and the turn index; x[dim] = 1."""
    words = tokenize(text)
    grams = [*words, *(f"{a} {b}" for a, b in zip(words, words[1:], strict=False)), f"\x00turn{turn}"]
    x = np.zeros(dim + 1)
    for g in grams:
        x[zlib.crc32(g.encode("utf-8")) % dim] += 1.0
    x[:dim] /= np.linalg.norm(x[:dim])
    x[dim] = 1.0
    return x


# ---------------------------------------------------------------- the estimator


def turn_rewards(ep: Episode) -> np.ndarray:
    """r_t = ``Turn.reward`` (None → 0); an episode whose turns carry none is paid ``Episode.reward`` on its
    last turn."""
    r = np.array([t.reward or 0.0 for t in ep.turns], dtype=float)
    if r.size and all(t.reward is None for t in ep.turns):
        r[-1] = ep.reward
    return r


def _check_flat(episodes: list[Episode]) -> None:
    if any(e.branch for e in episodes):
        raise ValueError(
            "credit.estimator critic takes flat groups (its cross-fitting leaves one episode out; tree leaves share"
            " turns): remove rollout.branching"
        )


def _rms_scale(adv: dict[str, np.ndarray], episodes: list[Episode], scale: Scale) -> None:
    """Divide by sqrt(mean A²) (+ 1e-4) over the batch / each group; ``none`` leaves A as it is."""
    if scale == "none":
        return
    if scale == "batch":
        pools = [[e.episode_id for e in episodes]]
    else:
        pools = [
            [episodes[i].episode_id for i in idx] for idx in group_indices([e.group_id for e in episodes]).values()
        ]
    for ids in pools:
        flat = np.concatenate([adv[i] for i in ids])
        if flat.size and np.any(flat != 0):
            s = float(np.sqrt(np.mean(flat**2))) + STD_EPS
            for i in ids:
                adv[i] = adv[i] / s


class CriticState:
    """A run's critic: the history's statistics (one of the two models), learning across steps."""

    def __init__(self, params: CriticParams) -> None:
        self.mode: Mode | None = None if params.features == "auto" else params.features
        self.dim = params.dim
        self.table = Table()
        self.ridge = Ridge.zeros(params.dim)
        self.steps = 0

    # ---- state across steps and runs

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (the checkpoint loads with ``weights_only=True``)."""
        return {
            "mode": self.mode,
            "dim": self.dim,
            "steps": self.steps,
            "table": {k: list(v) for k, v in self.table.cells.items()},
            "xtx": self.ridge.xtx.tolist(),
            "xty": self.ridge.xty.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["dim"] != self.dim:
            raise ValueError(
                f"the saved critic has credit.dim {state['dim']} but the config asks for {self.dim}; restore it"
            )
        self.mode, self.steps = state["mode"], int(state["steps"])
        self.table = Table({k: [float(w), float(s)] for k, (w, s) in state["table"].items()})
        self.ridge = Ridge(np.asarray(state["xtx"], dtype=float), np.asarray(state["xty"], dtype=float))

    # ---- one batch

    def _mode_for(self, episodes: list[Episode]) -> Mode:
        keyed = all(t.state_key is not None for e in episodes for t in e.turns)
        if self.mode is None:
            self.mode = "state_key" if keyed else "text"
        if self.mode == "state_key" and not keyed:
            e, t = next((e, t) for e in episodes for t in e.turns if t.state_key is None)
            raise ValueError(
                f"credit.features is state_key (or auto chose it on the first batch) but turn {t.index} of episode"
                f" {e.episode_id!r} has no state_key (its environment defines none); set credit.features: text"
            )
        return self.mode

    def _crossfit(self, episodes: list[Episode], targets: list[np.ndarray], cfg: CriticParams):
        """(V of every turn's state from history + batch − the episode's fold, the batch's statistics)."""
        if self.mode == "state_key":
            own = [Table() for _ in episodes]
            for table, e, g in zip(own, episodes, targets, strict=True):
                for turn, y in zip(e.turns, g, strict=True):
                    table.add(e.task_id, str(turn.state_key), float(y))
            batch = Table().merged(*((1.0, t) for t in own))
            values = []
            for e, mine in zip(episodes, own, strict=True):
                cell = signed_cells((1.0, self.table), (1.0, batch), (-1.0, mine))
                values.append(
                    np.array([table_value(cell, e.task_id, str(t.state_key), cfg.shrinkage) for t in e.turns])
                )
            return values, batch
        feats = [
            np.stack([hashed_features(state_text(e, t), t, self.dim) for t in range(e.num_turns)]) for e in episodes
        ]
        fold_of = [i % cfg.folds for i in range(len(episodes))]
        folds = [Ridge.zeros(self.dim) for _ in range(cfg.folds)]
        for f, x, g in zip(fold_of, feats, targets, strict=True):
            if len(g):
                folds[f] = folds[f].merged((1.0, Ridge.of(x, g)))
        ridge_batch = Ridge.zeros(self.dim).merged(*((1.0, r) for r in folds))
        thetas = [self.ridge.merged((1.0, ridge_batch), (-1.0, r)).solve(cfg.shrinkage) for r in folds]
        return [x @ thetas[f] if len(x) else np.zeros(0) for x, f in zip(feats, fold_of, strict=True)], ridge_batch

    def _bootstrap(self, episodes: list[Episode], cfg: CriticParams) -> list[float]:
        """V(s_K) of each truncated episode from the history alone (0 when it terminated); tabular: μ."""
        if not any(e.truncated for e in episodes):
            return [0.0] * len(episodes)
        if self.mode == "state_key":
            mu = table_mean(self.table.cell)
            return [mu if e.truncated else 0.0 for e in episodes]
        theta = self.ridge.solve(cfg.shrinkage)
        return [
            float(hashed_features(state_text(e, e.num_turns), e.num_turns, self.dim) @ theta) if e.truncated else 0.0
            for e in episodes
        ]

    def credit(self, episodes: list[Episode], cfg: CriticParams) -> CreditResult:
        """Advantages by GAE from the cross-fitted critic, then the batch joins the history (module doc)."""
        _check_flat(episodes)
        if not episodes:  # nothing to credit or learn (and no mode to choose from)
            return CreditResult({}, {})
        mode = self._mode_for(episodes)
        rewards = [turn_rewards(e) for e in episodes]
        boot = self._bootstrap(episodes, cfg)
        targets = [discounted_return(r, cfg.gamma, bootstrap=b) for r, b in zip(rewards, boot, strict=True)]
        values, batch = self._crossfit(episodes, targets, cfg)

        adv: dict[str, np.ndarray] = {}
        for e, r, v, b in zip(episodes, rewards, values, boot, strict=True):
            #  δ_t = r_t + γ V(s_{t+1}) − V(s_t),  A_t = δ_t + γλ A_{t+1}  (V(s_K) = b: 0 unless truncated)
            adv[e.episode_id] = gae(r, np.append(v, b), cfg.gamma, cfg.lam, terminated=not e.truncated)
        flat = np.concatenate(list(adv.values())) if adv else np.zeros(0)
        raw_abs = float(np.mean(np.abs(flat))) if flat.size else 0.0
        _rms_scale(adv, episodes, cfg.scale)

        self.steps += 1
        if isinstance(batch, Table):  # H ← decay · H + B
            self.table = self.table.scaled(cfg.decay).merged((1.0, batch))
        else:
            self.ridge = self.ridge.scaled(cfg.decay).merged((1.0, batch))
        g = np.concatenate(targets) if targets else np.zeros(0)
        metrics = value_metrics(g, np.concatenate(values) if values else np.zeros(0))
        metrics |= {"critic/adv_abs_raw": raw_abs, "critic/tabular": float(mode == "state_key")}
        return CreditResult({k: [float(a) for a in v] for k, v in adv.items()}, metrics)


def value_metrics(targets: np.ndarray, values: np.ndarray) -> dict[str, float]:
    """Of the cross-fitted values (each predicted without its own episode): ``critic/value_loss`` =
    mean (G − V)², ``critic/explained_variance`` = 1 − Var(G − V) / Var(G) (0 when Var(G) = 0),
    ``critic/value_abs`` = mean |V|."""
    if not targets.size:
        return {"critic/value_loss": 0.0, "critic/explained_variance": 0.0, "critic/value_abs": 0.0}
    var_g = float(np.var(targets))
    return {
        "critic/value_loss": float(np.mean((targets - values) ** 2)),
        "critic/explained_variance": 1.0 - float(np.var(targets - values)) / var_g if var_g > 1e-12 else 0.0,
        "critic/value_abs": float(np.mean(np.abs(values))),
    }


def critic_advantages(episodes: list[Episode], cfg: CriticParams) -> CreditResult:
    """The critic on one batch from an empty history (cross-fitted on the batch itself)."""
    return CriticState(cfg).credit(episodes, cfg)


CRITIC = EstimatorSpec(critic_advantages, CriticParams, per_turn_rows=True, state=CriticState)
