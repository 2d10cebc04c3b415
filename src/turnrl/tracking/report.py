"""A self-contained ``report.html`` for a run directory.

One file, no network: CSS and JS are inline, plots are embedded as base64
PNGs, and a Content-Security-Policy forbids the page from loading anything
else and runs only the one script whose SHA-256 it names (so no inline event
handler, ``onerror=…``, would run even if a field of a hostile run directory
reached the markup unescaped; every field is escaped, and typed when read). It
shows the config, the plots, the base-vs-trained comparison and a transcript
browser. The page template, style sheet and script are real files
(``assets/report.html``, ``report.css``, ``report.js``, shipped as package
data) that are read with :mod:`importlib.resources` and inlined.

Rollouts are read as :class:`~turnrl.types.Episode` objects
(:func:`turnrl.rundir.iter_episodes`, which skips a torn line), and a turn's
"new" context is the one rule of :func:`turnrl.types.new_prompt_lengths`: an
episode whose context was rebuilt (e.g. ``exclude_think``) is trained as
per-turn rows, so each of its turns shows its whole context.

The transcript browser embeds a sample of the run's episodes (training and
evaluation rollouts, whole groups/trees at a time, at most ``max_episodes``)
as one compact JSON blob: token strings and token runs are stored once in
tables and referenced by index, so a tree whose leaves share their first turns
or a group that shares its prompt costs little. The list is paginated and an
episode's tokens become DOM nodes only when it is opened.

With a tokenizer, every token is its own span: action tokens coloured by the
advantage they were trained with (green positive, red negative, intensity by
|A| relative to the run's 95th percentile), context and environment tokens
grey; a toggle colours every token by its provenance instead (system, user,
assistant, tool: ``Turn.prompt_sources``). Without one, each action is a single
span of its ``action_text`` and the environment's replies are shown as text.

The mask report (:mod:`turnrl.tracking.provenance`) is shown twice: a table of the
training rows' tokens per source and the dilution of the policy's own tokens over
every training rollout, and, for an opened episode, each of its rows.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from turnrl.bounded import load_yaml
from turnrl.rundir import RunDir, atomic_write_text, iter_episodes
from turnrl.tracking.plots import PLOT_NAMES, make_plots, rollout_files
from turnrl.tracking.provenance import SOURCE_NAMES, episode_rows, mask_report, rows_per_turn, summarize
from turnrl.tracking.sinks import read_csv
from turnrl.types import SOURCES, Episode, Turn, new_prompt_lengths, run_lengths, token_sources

ASSETS = ("report.html", "report.css", "report.js")
"""The page template, its style sheet and its script: package data in ``turnrl/tracking/assets/``."""

_PLOT_CAPTIONS = {
    "reward": "Train reward per optimizer step (batch mean, ± sd of episode rewards) and held-out success rate.",
    "iterations": "Mean train reward and the last held-out success rate of each outer iteration.",
    "eval_rewards": "Distribution of episode rewards in each evaluation.",
    "advantage_by_turn": "Mean |advantage| the trained turns received, by turn index (error bars: standard error).",
    "lengths": "Completion length (tokens per turn) and turns per episode.",
    "credit": "Credit-assignment diagnostics logged by the estimator.",
    "optimization": "Optimizer-side diagnostics.",
}

_COMPARE = (  # key, name, is a rate, which direction is better (None: neither)
    ("success_rate", "success rate", True, 1),
    ("mean_reward", "mean reward", False, 1),
    ("mean_turns", "mean turns", False, None),
    ("malformed_rate", "malformed rate", True, -1),
    ("wellformed_success_rate", "success of well-formed games", True, 1),
)
_DENOMINATOR = {"wellformed_success_rate": "num_wellformed"}  # a rate's games, if not all of them


# ----------------------------------------------------------------------------- episodes


class _TokenTable:
    """Interns token strings and token runs so the embedded JSON stays small."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.piece_of: dict[int, int] = {}
        self.pieces: list[str] = []
        self.ids: list[int] = []
        self.run_of: dict[tuple[int, ...], int] = {}
        self.runs: list[list[int]] = []

    def _decode(self, token_id: int) -> str:
        tok = self.tokenizer
        attempts = (
            lambda: tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False),
            lambda: tok.decode([token_id]),  # a decode() without HF's keyword arguments
            lambda: tok.convert_ids_to_tokens([token_id])[0],
        )
        for attempt in attempts:
            try:
                text = attempt()
            except Exception:
                continue
            if isinstance(text, str):
                return text
        return f"<{token_id}>"

    def run(self, token_ids: Sequence[int]) -> int:
        key = tuple(token_ids)
        if key not in self.run_of:
            row = []
            for tid in key:
                if tid not in self.piece_of:
                    self.piece_of[tid] = len(self.pieces)
                    self.pieces.append(self._decode(tid))
                    self.ids.append(tid)
                row.append(self.piece_of[tid])
            self.run_of[key] = len(self.runs)
            self.runs.append(row)
        return self.run_of[key]


def _num(value: Any, digits: int = 4) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return round(float(value), digits)


def _source_runs(turn: Turn, start: int) -> list[list[int]] | None:
    """Provenance of ``turn.prompt_ids[start:]`` as ``[[index in SOURCES, count], ...]`` (None: not recorded)."""
    sources = token_sources(turn)
    if sources is None:
        return None
    return [[SOURCES.index(name), n] for name, n in run_lengths(sources[start : len(turn.prompt_ids)])]


def _encode_episode(ep: Episode, src: str, kind: str, table: _TokenTable | None, per_turn: bool) -> dict[str, Any]:
    if table is not None:
        try:  # each turn shows only the context tokens its predecessor did not
            new = new_prompt_lengths(ep)
            rebuilt = False
        except ValueError:  # a rebuilt context (e.g. exclude_think): every turn is its own row
            new = [len(t.prompt_ids) for t in ep.turns]
            rebuilt = True
    turns = []
    for k, t in enumerate(ep.turns):
        logprobs = [_num(lp, 3) for lp in t.action_logprobs]  # aligned with the tokens
        finite = [lp for lp in logprobs if lp is not None]
        turn: dict[str, Any] = {
            "k": t.index,
            "A": _num(t.advantage, 6),
            "r": _num(t.reward),
            "f": t.finish_reason,
            "v": t.policy_version,
            "n": len(t.action_ids),
            "t": t.action_text or "",
            "o": t.observation,
        }
        if finite:
            turn["mlp"] = _num(sum(finite) / len(finite), 3)
        if table is not None:
            turn["c"] = table.run(t.prompt_ids[len(t.prompt_ids) - new[k] :])
            turn["a"] = table.run(t.action_ids)
            runs = _source_runs(t, len(t.prompt_ids) - new[k])
            if runs is not None:
                turn["cs"] = runs
            turn["lp"] = logprobs
            if rebuilt and k > 0:
                turn["rebuilt"] = True
        turns.append(turn)
    return {
        "id": str(ep.episode_id),
        "task": str(ep.task_id),
        "g": str(ep.group_id or ""),
        "b": list(ep.branch),
        "R": _num(ep.reward),
        "s": None if ep.stop_reason is None else str(ep.stop_reason),
        "term": bool(ep.terminated),
        "trunc": bool(ep.truncated),
        "src": src,
        "kind": kind,
        "step": _num(ep.metrics.get("step")),
        "p": None if table is not None else ep.prompt or "",
        "m": {k: _num(v) for k, v in ep.metrics.items() if _num(v) is not None},
        "T": turns,
        "rows": [
            [r.turn, [r.tokens[n] for n in SOURCE_NAMES], r.sampled, r.trained] for r in episode_rows(ep, per_turn)
        ],
    }


def _line_counts(paths: Iterable[Path]) -> dict[Path, int]:
    counts = {}
    for path in paths:
        with path.open("rb") as fh:
            counts[path] = sum(1 for line in fh if line.strip())
    return counts


def _sample_file(path: Path, count: int, budget: int) -> list[Episode]:
    """The file's records, or whole groups of them (a task's G episodes, a tree) up to ``budget``
    episodes, chosen with a seed fixed by the file name; file order is kept.

    Large files are read twice rather than held in memory whole.
    """
    if count <= budget:
        return list(iter_episodes(path))
    groups: dict[str, list[int]] = {}
    for i, ep in enumerate(iter_episodes(path)):
        groups.setdefault(ep.group_id or f"#{i}", []).append(i)
    order = list(groups)
    random.Random(path.name).shuffle(order)
    keep: set[int] = set()
    for key in order:
        if keep and len(keep) + len(groups[key]) > budget:
            continue
        keep.update(groups[key])
    return [ep for i, ep in enumerate(iter_episodes(path)) if i in keep]


def collect_episodes(
    run_dir: str | Path, tokenizer: Any = None, max_episodes: int = 2000, per_turn: bool = False
) -> dict[str, Any]:
    """The transcript browser's data: sampled episodes plus the token tables (JSON-ready).

    ``per_turn``: the run trained per-turn rows (each episode's mask report lists its rows so)."""
    train_files, eval_files = rollout_files(run_dir)
    sources = [(p, "train", f"iteration {it}") for it, p in train_files]
    sources += [(p, "eval", f"eval @ step {step}") for step, p in eval_files]
    counts = _line_counts(p for p, _, _ in sources)
    total = sum(counts.values())
    table = _TokenTable(tokenizer) if tokenizer is not None else None
    episodes, src_info = [], []
    for path, kind, label in sources:
        budget = max(1, round(max_episodes * counts[path] / total)) if total else 0
        records = _sample_file(path, counts[path], budget)
        src_info.append(
            {
                "name": path.stem,
                "kind": kind,
                "label": label,
                "total": counts[path],
                "shown": len(records),
            }
        )
        episodes += [_encode_episode(ep, path.stem, kind, table, per_turn) for ep in records]
    mags = sorted(abs(t["A"]) for ep in episodes for t in ep["T"] if t["A"] is not None)
    scale = mags[min(len(mags) - 1, int(0.95 * len(mags)))] if mags else 1.0
    return {
        "E": episodes,
        "S": table.pieces if table else [],
        "I": table.ids if table else [],
        "G": table.runs if table else [],
        "sources": src_info,
        "scale": scale if scale > 0 else 1.0,
        "tokenized": table is not None,
        "total": total,
        "P": list(SOURCE_NAMES),
    }


def _json_for_script(obj: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` ("<" escaped so "</script>" cannot occur)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


# ----------------------------------------------------------------------------- static sections


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, pct: bool = False) -> str:
    if not isinstance(value, int | float):
        return _esc(value) if value is not None else "–"
    if not math.isfinite(value):
        return str(value)
    if pct:
        return f"{100 * value:.1f}%"
    if float(value).is_integer() and abs(value) < 1e12:
        return str(int(value))
    return f"{value:.4g}"


def _wilson(p: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p observed on n trials."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _rate_cell(row: Mapping[str, Any], key: str, pct: bool) -> str:
    value = row.get(key)
    text = _fmt(value, pct)
    n = row.get(_DENOMINATOR.get(key, "num_tasks"))
    if pct and isinstance(value, float) and isinstance(n, float) and n > 0 and 0 <= value <= 1:
        lo, hi = _wilson(value, n)
        text += f' <span class="ci">[{100 * lo:.0f}–{100 * hi:.0f}%]</span>'
    return text


def _comparison_html(evals: list[dict[str, Any]]) -> str:
    if not evals:
        return '<p class="muted">No evaluations recorded (progress/eval.csv is missing or empty).</p>'
    base = next((r for r in evals if r.get("label") == "base"), None)
    last = evals[-1]
    cols = [(base, "base")] if base is not None else []
    if last is not base:
        cols.append((last, str(last.get("label") or "last")))
    head = "".join(
        f"<th>{_esc(name)}<br><span class='muted'>step {_fmt(row.get('step'))}</span></th>" for row, name in cols
    )
    if len(cols) == 2:
        head += "<th>Δ</th>"
    body = []
    for key, name, pct, better in _COMPARE:
        if not any(isinstance(row.get(key), float) for row, _ in cols):
            continue
        cells = "".join(f"<td>{_rate_cell(row, key, pct)}</td>" for row, _ in cols)
        if len(cols) == 2:
            a, b = cols[0][0].get(key), cols[1][0].get(key)
            if isinstance(a, float) and isinstance(b, float) and math.isfinite(b - a):
                d = b - a
                cls = "" if not better or d == 0 else ("up" if d * better > 0 else "down")
                text = f"{100 * abs(d):.1f} pp" if pct else _fmt(abs(d))
                cells += f'<td class="{cls}">{"+" if d >= 0 else "−"}{text}</td>'
            else:
                cells += "<td>–</td>"
        body.append(f"<tr><th>{_esc(name)}</th>{cells}</tr>")
    n = last.get("num_tasks")
    note = f"<p class='muted'>Held-out tasks: {_fmt(n)}; brackets: 95% Wilson interval.</p>" if n else ""
    if base is None:
        note += "<p class='muted'>No <code>base</code> evaluation row: only the last evaluation is shown.</p>"
    return f'<table class="cmp"><tr><th></th>{head}</tr>{"".join(body)}</table>{note}'


def _table_html(rows: list[dict[str, Any]], max_rows: int = 400) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    cols = list(dict.fromkeys(k for row in rows for k in row))
    shown = rows if len(rows) <= max_rows else rows[: max_rows // 2] + rows[-max_rows // 2 :]
    head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in shown)
    note = f"<p class='muted'>{len(rows) - len(shown)} middle rows omitted.</p>" if shown is not rows else ""
    return f'<div class="scroll"><table class="data"><tr>{head}</tr>{body}</table></div>{note}'


def _mask_html(run_dir: Path, per_turn: bool) -> str:
    """The mask report over every training rollout: tokens per source, sampled, trained, dilution."""
    train_files, _ = rollout_files(run_dir)
    summary = summarize(row for _, path in train_files for row in mask_report(iter_episodes(path), per_turn))
    if not summary["rows"]:
        return '<p class="muted">No training rows (no training rollouts with advantages).</p>'
    total = summary["total"]
    names = [n for n in SOURCE_NAMES if summary["tokens"][n] or n != "unknown"]
    head = "".join(f'<th><span class="src-swatch" data-src="{_esc(n)}"></span>{_esc(n)}</th>' for n in names)
    counts = "".join(f"<td>{summary['tokens'][n]}</td>" for n in names)
    shares = "".join(f"<td>{100 * summary['tokens'][n] / total:.1f}%</td>" for n in names)
    kind = "per-turn rows" if per_turn else "whole-episode rows"
    return (
        f'<table class="cmp mask"><tr><th></th>{head}<th>all</th><th>sampled</th><th>trained</th></tr>'
        f"<tr><th>tokens</th>{counts}<td>{total}</td><td>{summary['sampled']}</td><td>{summary['trained']}</td></tr>"
        f"<tr><th>share</th>{shares}<td>100%</td><td>{100 * summary['sampled'] / total:.1f}%</td>"
        f"<td>{100 * summary['trained'] / total:.1f}%</td></tr></table>"
        f"<p class='muted'>{summary['rows']} {kind} of every training rollout. Dilution of the policy's own tokens"
        f" (1 − sampled / all): <b>{summary['dilution']:.3f}</b> over all tokens,"
        f" {summary['mean_row_dilution']:.3f} averaged over rows. <code>turnrl rows RUN_DIR</code> lists each row.</p>"
    )


def _plots_html(run: RunDir) -> str:
    folder = run.plots
    if not folder.is_dir() or not any(folder.glob("*.png")):
        make_plots(run.root)
    if not folder.is_dir():
        return '<p class="muted">No plots (nothing to plot yet).</p>'
    files = {p.stem: p for p in folder.glob("*.png")}
    order = [n for n in PLOT_NAMES if n in files] + sorted(n for n in files if n not in PLOT_NAMES)
    out = []
    for name in order:
        data = base64.b64encode(files[name].read_bytes()).decode("ascii")
        caption = _PLOT_CAPTIONS.get(name, name)
        out.append(
            f'<figure><img alt="{_esc(name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_esc(caption)}</figcaption></figure>"
        )
    return "".join(out) or '<p class="muted">No plots.</p>'


def _summary_html(config: Mapping[str, Any], train: list[dict[str, Any]]) -> str:
    def get(*path: str) -> Any:
        node: Any = config
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        return node

    items = [
        ("model", get("model", "name")),
        ("environment", get("env", "name")),
        ("estimator", get("credit", "estimator")),
        ("loss", get("loss", "type")),
        ("steps logged", len(train) if train else 0),
    ]
    if train:
        items.append(("last step", _fmt(train[-1].get("step"))))
        its = {r.get("iteration") for r in train if r.get("iteration") is not None}
        if len(its) > 1:
            items.append(("iterations", len(its)))
    return "".join(f"<div><span>{_esc(k)}</span><b>{_esc(v)}</b></div>" for k, v in items if v is not None)


# ----------------------------------------------------------------------------- page


def write_report(run_dir: str | Path, tokenizer: Any = None, *, max_episodes: int = 2000) -> Path:
    """Write ``report.html`` into ``run_dir`` (atomically) and return its path.

    ``tokenizer``: an HF tokenizer (anything with ``decode(list[int])``) to show
    every token as its own span; without it each action is shown as its text.
    Plots are taken from ``plots/`` (drawn first if that folder has none).
    ``max_episodes`` bounds the episodes embedded in the transcript browser.
    """
    run = RunDir(run_dir)
    config_text = run.config.read_text() if run.config.exists() else ""
    try:
        config = load_yaml(config_text) or {}
    except yaml.YAMLError:
        config = {}
    if not isinstance(config, dict):
        config = {}
    train = read_csv(run.train_csv)
    evals = read_csv(run.eval_csv)
    per_turn = rows_per_turn(config)
    data = collect_episodes(run.root, tokenizer, max_episodes, per_turn)
    name = str(config.get("run_name") or run.name)
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")

    parts = {
        "TITLE": _esc(name),
        "GENERATED": _esc(generated),
        "SUMMARY": _summary_html(config, train),
        "COMPARE": _comparison_html(evals),
        "EVALS": _table_html(evals),
        "LAST": _table_html([train[-1]]) if train else '<p class="muted">No steps logged.</p>',
        "MASK": _mask_html(run.root, per_turn),
        "CONFIG": _esc(config_text) if config_text else "(config.yaml missing)",
        "CSS": _asset("report.css"),
        "JS": _asset("report.js"),
        "SCRIPT_HASH": _script_hash(_asset("report.js")),
        "PLOTS": _plots_html(run),
        "DATA": _json_for_script(data),
    }
    # one pass: text inserted for one marker is never scanned for another
    page = re.sub(r"@@([A-Z_]+)@@", lambda m: parts[m.group(1)], _asset("report.html"))
    atomic_write_text(run.report, page)
    return run.report


def _script_hash(script: str) -> str:
    """The CSP source that allows exactly ``script`` inline (and, with a hash listed, no event handler)."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii") + "'"


@cache
def _asset(name: str) -> str:
    """One of :data:`ASSETS`, read from the installed package (a wheel ships them as package data)."""
    text = (resources.files("turnrl.tracking") / "assets" / name).read_text(encoding="utf-8")
    closing = {"report.css": "</style", "report.js": "</script"}.get(name)
    if closing and closing in text.lower():  # inlined, it would end its own element early
        raise ValueError(f"turnrl/tracking/assets/{name} contains {closing!r}; it cannot be inlined")
    return text
