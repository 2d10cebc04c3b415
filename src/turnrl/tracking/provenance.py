"""The mask report: what a training row is made of, by token provenance.

A row (:mod:`turnrl.train.batch`: a whole episode, or one turn with its context) is a
token sequence and a loss mask. Its tokens come from the ``system`` prompt, the
``user`` (or environment) messages, the ``assistant`` (the policy's sampled actions and
the template tokens that open them) and ``tool`` results, as recorded in
``Turn.prompt_sources`` (:func:`turnrl.types.token_sources`). For each row this counts

    tokens[s]  = #{ positions of the row whose token came from source s }
    sampled    = #{ positions the policy sampled (the row's turns' action tokens) }
    trained    = #{ positions in the loss mask (sampled, in a turn with an advantage) }
    dilution   = 1 − sampled / Σ_s tokens[s]

so ``dilution`` is the share of the sequence the policy did not write: the context its
own tokens are conditioned on and diluted by. A turn recorded without provenance
counts its context as ``unknown`` (its action tokens are still ``assistant``).

The rows are the trainer's (the same rule as :func:`turnrl.train.batch.build_rows`):
per-turn rows for the turns that have an advantage, or one row per episode with at least
one trained turn; an episode whose context was rebuilt (e.g. ``exclude_think``) can only
be per-turn rows and is counted so.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnrl.bounded import load_yaml
from turnrl.rundir import RunDir, iter_episodes
from turnrl.types import SOURCES, Episode, Turn, new_prompt_lengths, token_sources

UNKNOWN = "unknown"
SOURCE_NAMES: tuple[str, ...] = (*SOURCES, UNKNOWN)
"""The columns of a mask report: the recorded sources, then context without provenance."""


@dataclass(frozen=True)
class RowSources:
    """One training row's tokens by source, and how many of them the policy sampled and trains on."""

    episode_id: str
    turn: int
    """The turn of a per-turn row; -1 for a whole-episode row."""
    tokens: dict[str, int]
    """Tokens of the row's sequence per name of :data:`SOURCE_NAMES` (every name present)."""
    sampled: int
    trained: int

    @property
    def total(self) -> int:
        return sum(self.tokens.values())

    @property
    def dilution(self) -> float:
        """1 − sampled / total: the share of the row's tokens the policy did not sample."""
        return 1.0 - self.sampled / self.total if self.total else 0.0


def _counts(turn: Turn) -> dict[str, int]:
    """Tokens of ``turn.sequence_ids`` per source (context without provenance: ``unknown``)."""
    sources = token_sources(turn)
    if sources is None:
        sources = [UNKNOWN] * len(turn.prompt_ids) + ["assistant"] * len(turn.action_ids)
    found = Counter(sources)
    return {name: found.get(name, 0) for name in SOURCE_NAMES}


def _turn_row(episode: Episode, turn: Turn) -> RowSources:
    n = len(turn.action_ids)
    return RowSources(episode.episode_id, turn.index, _counts(turn), n, n if turn.advantage is not None else 0)


def episode_rows(episode: Episode, per_turn: bool) -> list[RowSources]:
    """The rows the trainer builds from one episode (after credit), by source; [] when nothing is trained."""
    if not episode.turns:
        return []
    if not per_turn:
        try:
            new_prompt_lengths(episode)
        except ValueError:  # a rebuilt context: the trainer can only take this episode as per-turn rows
            per_turn = True
    if per_turn:
        return [_turn_row(episode, t) for t in episode.turns if t.advantage is not None]
    trained = sum(len(t.action_ids) for t in episode.turns if t.advantage is not None)
    if not trained:
        return []
    sampled = sum(len(t.action_ids) for t in episode.turns)
    last = episode.turns[-1]  # the whole episode is the last turn's sequence
    tokens = _counts(last)
    if last.prompt_sources is None:  # the earlier actions lie in the unknown context: count them as the policy's
        moved = sampled - len(last.action_ids)
        tokens[UNKNOWN] -= moved
        tokens["assistant"] += moved
    return [RowSources(episode.episode_id, -1, tokens, sampled, trained)]


def mask_report(episodes: Iterable[Episode], per_turn: bool) -> list[RowSources]:
    """Every training row of ``episodes`` by source (see the module docstring)."""
    return [row for ep in episodes for row in episode_rows(ep, per_turn)]


def summarize(rows: Iterable[RowSources]) -> dict[str, Any]:
    """Totals over rows: tokens per source, sampled, trained, the token-weighted dilution
    (1 − Σ sampled / Σ tokens) and the mean of the rows' dilutions."""
    rows = list(rows)
    tokens = {name: sum(r.tokens[name] for r in rows) for name in SOURCE_NAMES}
    total = sum(tokens.values())
    sampled = sum(r.sampled for r in rows)
    return {
        "rows": len(rows),
        "tokens": tokens,
        "total": total,
        "sampled": sampled,
        "trained": sum(r.trained for r in rows),
        "dilution": 1.0 - sampled / total if total else 0.0,
        "mean_row_dilution": sum(r.dilution for r in rows) / len(rows) if rows else 0.0,
    }


def rows_per_turn(config: Mapping[str, Any]) -> bool:
    """Whether the run of this saved config trained per-turn rows (False when it cannot be told:
    a config that no longer validates, e.g. naming a plug-in this process has not registered)."""
    from turnrl.config import parse_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(parse_config(dict(config)).per_turn_rows)
    except ValueError:
        return False


def run_mask_report(run_dir: str | Path) -> tuple[list[RowSources], bool]:
    """Every training row of a run directory's training rollouts, and whether they are per-turn rows."""
    run = RunDir(run_dir)
    if not run.root.is_dir():
        raise FileNotFoundError(f"{run.root}: not a run directory")
    config = load_yaml(run.config.read_text()) if run.config.exists() else None
    per_turn = rows_per_turn(config) if isinstance(config, dict) else False
    return [row for path in run.train_rollout_files() for row in mask_report(iter_episodes(path), per_turn)], per_turn


def print_mask_report(run_dir: str | Path, console: Any, limit: int = 20) -> dict[str, Any]:
    """Print the first ``limit`` training rows of a run and the totals as rich tables; return the totals."""
    from rich.table import Table

    rows, per_turn = run_mask_report(run_dir)
    summary = summarize(rows)
    names = [n for n in SOURCE_NAMES if n != UNKNOWN or summary["tokens"][UNKNOWN]]
    kind = "per-turn rows" if per_turn else "whole-episode rows"
    table = Table(title=f"training rows by token source · {summary['rows']} {kind}", title_justify="left")
    for column in ("episode", "turn", *names, "sampled", "trained", "dilution"):
        table.add_column(column, justify="left" if column == "episode" else "right")
    for r in rows[:limit]:
        cells = [str(r.tokens[n]) for n in names]
        turn = "all" if r.turn < 0 else str(r.turn)
        table.add_row(r.episode_id, turn, *cells, str(r.sampled), str(r.trained), f"{r.dilution:.3f}")
    if len(rows) > limit:
        table.caption = f"{len(rows) - limit} more rows not listed (--limit)"
    if limit:
        console.print(table)
    total = summary["total"] or 1
    totals = Table(title="all training rows", title_justify="left")
    for column in ("", *names, "all", "sampled", "trained"):
        totals.add_column(column, justify="right")
    counts = [summary["tokens"][n] for n in names] + [summary["total"], summary["sampled"], summary["trained"]]
    totals.add_row("tokens", *map(str, counts))
    totals.add_row("share", *(f"{100 * c / total:.1f}%" for c in counts))
    console.print(totals)
    console.print(
        f"dilution of the policy's own tokens (1 − sampled / all): {summary['dilution']:.3f} over all tokens,"
        f" {summary['mean_row_dilution']:.3f} averaged over rows",
        highlight=False,
    )
    return summary
