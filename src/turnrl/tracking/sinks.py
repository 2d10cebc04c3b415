"""Metrics sinks: where the trainer's numbers go.

Every sink takes the same four calls (:class:`MetricsSink`) and is one entry of
:data:`turnrl.tracking.registry.SINKS`; the trainer holds one :class:`MultiSink`
built by :func:`make_sinks` and never knows which backends are behind it.

- :class:`CsvSink` (always on) owns the run directory's ``progress/train.csv``,
  ``progress/steps.jsonl`` and ``progress/eval.csv`` (paths from
  :class:`~turnrl.rundir.RunDir`). Columns are the union of the keys seen so
  far; when a new key appears the file is rewritten with the wider header
  (temp file + rename), otherwise a row is appended in one write. A fresh run
  replaces the files; a resumed run opens them and appends, dropping no row:
  cutting the files back to the checkpoint is the training loop's job (one
  rule, by row count, before the sinks are made).
- :class:`ConsoleSink` prints one line per step and a rich table per evaluation.
- W&B and TensorBoard live in :mod:`turnrl.tracking.remote`; a sink of your own
  is a class and one :func:`~turnrl.tracking.registry.register_sink` call.

Metric values are numbers; an evaluation row may also carry a string
``label`` (``base``, ``step``, ``final``). Rows carry ``iteration`` when the
trainer puts it in the metrics.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turnrl.rundir import RunDir, append_text, atomic_write_text
from turnrl.terminal import make_console, styled
from turnrl.tracking.registry import (
    Metrics,
    MetricsSink,
    SinkContext,
    SinkSpec,
    build_sink,
    register_sink,
    require,
)

if TYPE_CHECKING:
    from turnrl.config import TrackingConfig

_TRAIN_LEAD = ("step", "iteration")
_EVAL_LEAD = ("step", "iteration", "label")


def _scalar(value: Any) -> Any:
    """A plain Python value: tensors and numpy scalars become int/float, bools ints."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    return value


def _numeric(metrics: Metrics) -> dict[str, float]:
    """The finite-or-not numeric entries of ``metrics`` (strings and None dropped)."""
    out = {}
    for key, value in metrics.items():
        value = _scalar(value)
        if isinstance(value, int | float):
            out[key] = float(value)
    return out


def _cell(value: Any) -> str:
    value = _scalar(value)
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # shortest exact round-trip; nan/inf as "nan"/"inf"
    return str(value)


def _json_value(value: Any) -> Any:
    value = _scalar(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # strict JSON has no NaN/Infinity
    return value


def _complete_lines(text: str) -> str:
    """``text`` without an unterminated last line (torn by a kill mid-append)."""
    return text if not text or text.endswith("\n") else text[: text.rfind("\n") + 1]


def _csv_rows(text: str) -> Iterable[dict[str, str]]:
    """Each complete CSV row; rows with a missing or extra field are skipped."""
    for row in csv.DictReader(io.StringIO(text)):
        if None not in row and None not in row.values():
            yield row


def _row_step(row: Mapping[str, Any]) -> float | None:
    try:
        return float(row["step"])
    except (KeyError, TypeError, ValueError):
        return None


class _CsvTable:
    """One CSV file whose header is the union of the keys seen so far.

    ``resume``: keep the file's rows and columns and append to it; otherwise the
    first row written replaces the file.
    """

    def __init__(self, path: Path, lead: Sequence[str], resume: bool) -> None:
        self.path = path
        self.columns: list[str] = list(lead)
        self.rows: list[dict[str, str]] = []
        self._in_sync = False  # may a row be appended (the file's header is self.columns)?
        if resume and path.exists():
            self._load()

    def _load(self) -> None:
        text = self.path.read_text()
        complete = _complete_lines(text)
        header = next(csv.reader(io.StringIO(complete)), [])
        self.columns += [name for name in header if name not in self.columns]
        self.rows = [{k: v for k, v in row.items() if v != ""} for row in _csv_rows(complete)]
        if header == self.columns and complete == text:
            self._in_sync = True  # append from here on
        else:  # a torn last line or a header without the lead columns: rewrite once, now
            self._rewrite()

    def add(self, row: Mapping[str, Any]) -> None:
        cells = {key: _cell(value) for key, value in row.items() if _scalar(value) is not None}
        grew = False
        for key in cells:
            if key not in self.columns:
                self.columns.append(key)
                grew = True
        self.rows.append(cells)
        if grew or not self._in_sync:
            self._rewrite()
        else:  # one write: a kill tears at most this line
            append_text(self.path, self._render([cells], header=False))

    def _render(self, rows: Iterable[Mapping[str, str]], header: bool) -> str:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.columns, lineterminator="\n")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()

    def _rewrite(self) -> None:
        atomic_write_text(self.path, self._render(self.rows, header=True))
        self._in_sync = True


class _JsonlLog:
    """Append-only JSONL; on resume the existing lines are kept and appended to."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self._in_sync = False  # False: the next write replaces the file (a fresh run)
        if resume and path.exists():
            text = path.read_text()
            if _complete_lines(text) != text:  # a torn last line would swallow the next row
                atomic_write_text(path, _complete_lines(text))
            self._in_sync = True

    def add(self, row: Mapping[str, Any]) -> None:
        line = json.dumps({k: _json_value(v) for k, v in row.items()}, allow_nan=False) + "\n"
        if self._in_sync:
            append_text(self.path, line)
        else:
            atomic_write_text(self.path, line)
            self._in_sync = True


class CsvSink:
    """``progress/train.csv``, ``progress/steps.jsonl`` and ``progress/eval.csv``.

    A fresh run (``resume=False``) replaces existing progress files with its
    first row. A resumed run appends to them and never drops a row: the loop
    has already cut them back to their row counts at the checkpoint. A column
    that first appears after resume widens the header (the file is rewritten
    with every kept row, as in a fresh run).
    """

    def __init__(self, run_dir: str | Path, resume: bool = False) -> None:
        run = RunDir(run_dir)
        run.progress.mkdir(parents=True, exist_ok=True)
        self.train = _CsvTable(run.train_csv, _TRAIN_LEAD, resume)
        self.eval = _CsvTable(run.eval_csv, _EVAL_LEAD, resume)
        self.steps = _JsonlLog(run.steps_jsonl, resume)

    @classmethod
    def from_context(cls, context: SinkContext) -> CsvSink:
        return cls(context.run_dir, resume=context.resume_step is not None)

    @staticmethod
    def _row(step: int, metrics: Metrics) -> dict[str, Any]:
        row = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        for key in ("step", "iteration"):  # counters stay integers even when passed as floats
            value = _scalar(row.get(key))
            if isinstance(value, float) and value.is_integer():
                row[key] = int(value)
        return row

    def log_step(self, step: int, metrics: Metrics) -> None:
        row = self._row(step, metrics)
        self.train.add(row)
        self.steps.add(row)

    def log_eval(self, step: int, metrics: Metrics) -> None:
        self.eval.add(self._row(step, metrics))

    def log_iteration(self, iteration: int, metrics: Metrics) -> None:
        """Iteration summaries are derivable from train.csv's ``iteration`` column; not stored."""

    def close(self) -> None:
        pass


_STEP_LINE_KEYS = (
    ("reward", "reward", "{:.3f}"),
    ("reward_std", "±", "{:.3f}"),
    ("loss", "loss", "{:.4g}"),
    ("grad_norm", "|g|", "{:.3g}"),
    ("completions/mean_length", "len", "{:.1f}"),
    ("num_turns/mean", "turns", "{:.2f}"),
    ("time/step_s", "s", "{:.1f}"),
)

_EVAL_ROWS = (
    ("success_rate", "success rate", True),
    ("mean_reward", "mean reward", False),
    ("mean_turns", "mean turns", False),
    ("malformed_rate", "malformed rate", True),
    ("wellformed_success_rate", "well-formed success", True),
    ("num_wellformed", "well-formed games", False),
    ("num_tasks", "tasks", False),
)


def _fmt(value: float, pct: bool = False) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if pct:
        return f"{100 * value:.1f}%"
    if float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    return f"{value:.4g}"


class ConsoleSink:
    """A rich table per evaluation (with Δ vs the base row), a rule per iteration and, with
    ``step_lines``, one line per optimizer step (off by default: the trainer's progress bar
    already shows the step; pass the trainer's ``console`` so tables print above a live bar).
    """

    def __init__(self, console: Any = None, step_lines: bool = False) -> None:
        self.console = console if console is not None else make_console()
        self.step_lines = step_lines
        self._base: dict[str, float] | None = None

    @classmethod
    def from_context(cls, context: SinkContext) -> ConsoleSink:
        return cls(context.console)

    def log_step(self, step: int, metrics: Metrics) -> None:
        if not self.step_lines:
            return
        nums = _numeric(metrics)
        line = styled((f"step {step}", "bold"))
        if "iteration" in nums:
            line.append(f" (iter {int(nums['iteration'])})", "dim")
        for key, short, fmt in _STEP_LINE_KEYS:
            if key in nums:
                line.append(f"  {short} {fmt.format(nums[key])}")
        self.console.print(line, highlight=False)

    def log_eval(self, step: int, metrics: Metrics) -> None:
        from rich.table import Table

        nums = _numeric(metrics)
        label = str(metrics.get("label", "eval"))
        if label == "base" and self._base is None:
            self._base = nums
        base = self._base if self._base is not nums else None
        table = Table(title=f"evaluation · {label} · step {step}", title_justify="left")
        table.add_column("metric")
        table.add_column("value", justify="right")
        if base is not None:
            table.add_column("base", justify="right")
            table.add_column("Δ", justify="right")
        shown = [key for key, _, _ in _EVAL_ROWS]
        errors = {k for k in nums if k.endswith("_se") and k[:-3] in nums}  # shown as "value ± se"
        extra = [(k, k, False) for k in nums if k not in shown and k not in errors and k not in ("step", "iteration")]
        for key, name, pct in [*_EVAL_ROWS, *extra]:
            if key not in nums:
                continue
            value = _fmt(nums[key], pct)
            if f"{key}_se" in errors:
                value += " ± " + _fmt(nums[f"{key}_se"], pct)
            cells = [name, value]
            if base is not None:
                if key in base:
                    delta = nums[key] - base[key]
                    sign = "+" if delta >= 0 else "-"
                    cells += [_fmt(base[key], pct), sign + _fmt(abs(delta), pct)]
                else:
                    cells += ["", ""]
            table.add_row(*cells)
        self.console.print(table)

    def log_iteration(self, iteration: int, metrics: Metrics) -> None:
        nums = _numeric(metrics)
        summary = "  ".join(f"{k} {_fmt(v)}" for k, v in nums.items())
        self.console.rule(f"iteration {iteration} done" + (f" · {summary}" if summary else ""))

    def close(self) -> None:
        pass


class MultiSink:
    """Fans each call out to several sinks; ``close`` closes every one even if one fails."""

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self.sinks = list(sinks)

    def log_step(self, step: int, metrics: Metrics) -> None:
        for sink in self.sinks:
            sink.log_step(step, metrics)

    def log_eval(self, step: int, metrics: Metrics) -> None:
        for sink in self.sinks:
            sink.log_eval(step, metrics)

    def log_iteration(self, iteration: int, metrics: Metrics) -> None:
        for sink in self.sinks:
            sink.log_iteration(iteration, metrics)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # close the rest before reporting
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ALWAYS_ON = "csv"
"""The sink every run has (the loop, plots and report read its progress files)."""


def make_sinks(
    cfg: TrackingConfig,
    run_dir: str | Path,
    run_name: str,
    config_dict: Mapping[str, Any],
    resume_step: int | None = None,
    *,
    console: Any = None,
) -> list[MetricsSink]:
    """The sinks ``tracking.backends`` asks for, each made by its registry entry; the CSV/JSONL sink first.

    ``resume_step``: the step a resumed run continues from (None: a fresh run).
    The CSV/JSONL sink then appends to the progress files as they are (the
    loop has cut them back to the checkpoint); W&B continues the same run and
    TensorBoard purges its events after ``resume_step``.
    ``console``: the rich Console the console sink prints to (default: a new one).

    Every chosen sink's modules are checked before anything is created, so a missing
    package fails fast with :class:`MissingBackendError` (its install hint) and leaves no files.
    Wrap the result in :class:`MultiSink` to hand the trainer one object.
    """
    names = [ALWAYS_ON, *(name for name in cfg.chosen if name != ALWAYS_ON)]
    for name in names:
        require(name)
    sinks: list[MetricsSink] = []
    try:
        for name in names:
            context = SinkContext(Path(run_dir), run_name, config_dict, cfg.params_of(name), resume_step, console)
            sinks.append(build_sink(name, context))
    except BaseException:
        MultiSink(sinks).close()
        raise
    return sinks


register_sink(ALWAYS_ON, SinkSpec(CsvSink.from_context))
register_sink("console", SinkSpec(ConsoleSink.from_context))


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a progress CSV with numbers parsed (empty cells absent); [] if the file is missing.

    A torn last line (a kill mid-append) is skipped.
    """
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for row in _csv_rows(_complete_lines(path.read_text())):
        parsed: dict[str, Any] = {}
        for key, cell in row.items():
            if cell == "":
                continue
            try:
                parsed[key] = float(cell)
            except ValueError:
                parsed[key] = cell
        if _row_step(parsed) is not None:
            rows.append(parsed)
    return rows
