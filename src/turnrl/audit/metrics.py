"""How right an estimator is, per turn index, against Monte-Carlo ground truth (pure numpy).

Inputs: ``ahat[r, j]``, the estimator's advantage of audited turn j in repeat r (NaN where it
gave none); ``a_star[j]`` and ``se[j]``, the ground truth and its standard error; ``turn[j]``,
the turn index. Definitions (ALGORITHMS.md §5, docs/algorithms.md "Credit audit"):

* ``corr``: per repeat, Pearson r(Â_r, A*) over the turns of that index; mean over repeats,
  ``corr_se`` = std over repeats / √R (the audited games held fixed). ``corr_se_games``: the
  bootstrap SE over the audited games (the episodes resampled with replacement, each with all its
  turns, ``corr`` recomputed; std over :data:`GAME_DRAWS` draws), the spread a fresh set of audited
  games would show; ``corr_se_total`` = √(corr_se² + corr_se_games²), the ± the table prints.
* ``mse``: mean over (r, j) of (Â − A*)²; ``mse_std`` the same after standardising Â_r and A*
  over all audited turns of a repeat (scale-free: GRPO-style estimators are scaled).
* ``sign``: the fraction of (r, j) with sign(Â) = sign(A*) among turns with |A*| > 2·se
  (Â = 0 disagrees); ``sign_n`` such turns.
* ``var``: mean over turns of the variance of Â across repeats (ddof 1).
* ``snr``: with u = A*/|A*| over the turns of that index, p_r = ⟨Â_r, u⟩ (the projection of
  g_r = Σ_j Â_rj e_j on ĝ* = u, the per-turn score directions e_j taken orthonormal);
  SNR = mean_r p_r / std_r p_r; ``snr_se`` = sqrt((1 + SNR²/2) / R), the large-sample SE of a
  mean-over-std ratio of normal draws.
"""

from __future__ import annotations

import numpy as np


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    ok = ~np.isnan(x)
    x, y = x[ok], y[ok]
    if x.size < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _standardise(x: np.ndarray) -> np.ndarray:
    ok = ~np.isnan(x)
    s = np.std(x[ok]) if ok.sum() > 1 else 0.0
    return (x - np.nanmean(x)) / s if s > 0 else np.zeros_like(x)


def snr(projections: np.ndarray) -> float:
    """mean / std (ddof 1) of the per-repeat projections; inf when they do not vary and are not 0."""
    p = np.asarray(projections, dtype=float)
    if p.size < 2:
        return float("nan")
    sd = float(np.std(p, ddof=1))
    mean = float(np.mean(p))
    if sd == 0:
        return float("inf") if mean else float("nan")
    return mean / sd


def _finite_std(x: list[float]) -> float:
    v = np.asarray([a for a in x if np.isfinite(a)])
    return float(np.std(v, ddof=1)) if v.size > 1 else float("nan")


GAME_DRAWS = 200
"""Bootstrap draws of the audited games behind ``corr_se_games``."""


def _mean_corr(ahat: np.ndarray, a_star: np.ndarray) -> float:
    corrs = [c for c in (_corr(ahat[r], a_star) for r in range(ahat.shape[0])) if np.isfinite(c)]
    return float(np.mean(corrs)) if corrs else float("nan")


def games_se(ahat: np.ndarray, a_star: np.ndarray, episode: np.ndarray, draws: int = GAME_DRAWS) -> float:
    """Bootstrap SE of the mean-over-repeats correlation over the audited games: each draw takes as
    many episodes as were audited, with replacement, each with all of its turns (columns); seeded, so
    an audit's report is reproducible. NaN with fewer than two games."""
    ahat, a_star, episode = np.asarray(ahat, dtype=float), np.asarray(a_star, dtype=float), np.asarray(episode)
    games = np.unique(episode)
    if games.size < 2:
        return float("nan")
    columns = [np.flatnonzero(episode == g) for g in games]
    rng = np.random.default_rng(0)
    values = []
    for _ in range(draws):
        pick = np.concatenate([columns[i] for i in rng.integers(0, games.size, games.size)])
        values.append(_mean_corr(ahat[:, pick], a_star[pick]))
    return _finite_std(values)


def turn_metrics(ahat: np.ndarray, a_star: np.ndarray, se: np.ndarray) -> dict[str, float]:
    """The metrics of one estimator on one set of turns (columns of ``ahat``)."""
    ahat = np.asarray(ahat, dtype=float)
    a_star = np.asarray(a_star, dtype=float)
    se = np.asarray(se, dtype=float)
    reps = ahat.shape[0]
    corrs = [_corr(ahat[r], a_star) for r in range(reps)]
    finite = [c for c in corrs if np.isfinite(c)]
    diff = ahat - a_star[None, :]
    sure = np.abs(a_star) > 2 * se
    signs = np.sign(ahat[:, sure]) == np.sign(a_star[sure])[None, :]
    var = np.nanvar(ahat, axis=0, ddof=1) if reps > 1 else np.full(ahat.shape[1], np.nan)
    norm = np.linalg.norm(a_star)
    u = a_star / norm if norm > 0 else np.zeros_like(a_star)
    proj = np.nan_to_num(ahat) @ u
    ratio = snr(proj) if norm > 0 else float("nan")
    return {
        "n_turns": int(ahat.shape[1]),
        "corr": float(np.mean(finite)) if finite else float("nan"),
        "corr_se": _finite_std(finite) / np.sqrt(len(finite)) if len(finite) > 1 else float("nan"),
        "mse": float(np.nanmean(diff**2)),
        "sign": float(signs.mean()) if signs.size else float("nan"),
        "sign_n": int(sure.sum()),
        "var": float(np.nanmean(var)) if var.size else float("nan"),
        "snr": ratio,
        "snr_se": float(np.sqrt((1 + ratio**2 / 2) / reps)) if np.isfinite(ratio) else float("nan"),
        "projection_mean": float(np.mean(proj)),
    }


def audit_metrics(
    ahat: np.ndarray, a_star: np.ndarray, se: np.ndarray, turn: np.ndarray, episode: np.ndarray | None = None
) -> dict[str, dict[str, float]]:
    """Metrics per turn index (keys ``"1"``, ``"2"``, … 1-based) and over all turns (``"all"``).

    ``mse_std`` standardises Â_r and A* over all audited turns of the repeat, then splits by index.
    ``episode`` (each column's audited episode) adds ``corr_se_games`` and ``corr_se_total``.
    """
    ahat = np.asarray(ahat, dtype=float)
    a_star = np.asarray(a_star, dtype=float)
    turn = np.asarray(turn)
    z_hat = np.stack([_standardise(row) for row in ahat]) if ahat.size else ahat
    z_star = _standardise(a_star)
    out: dict[str, dict[str, float]] = {}
    for t in [*sorted(set(turn.tolist())), None]:
        cols = np.ones_like(turn, dtype=bool) if t is None else turn == t
        m = turn_metrics(ahat[:, cols], a_star[cols], np.asarray(se)[cols])
        m["mse_std"] = float(np.nanmean((z_hat[:, cols] - z_star[None, cols]) ** 2))
        if episode is not None:
            m["corr_se_games"] = games_se(ahat[:, cols], a_star[cols], np.asarray(episode)[cols])
            parts = [x for x in (m["corr_se"], m["corr_se_games"]) if np.isfinite(x)]
            m["corr_se_total"] = float(np.sqrt(sum(x * x for x in parts))) if parts else float("nan")
        out["all" if t is None else str(int(t) + 1)] = m
    return out
