"""Tracking: metrics sinks (CSV/JSONL, console, W&B, TensorBoard), plots and the HTML report.

``registry`` holds :data:`SINKS` and ``register_sink`` (a sink is a class plus one
registry call); ``sinks`` the always-available sinks (CSV/JSONL, console, multi),
``make_sinks`` and ``read_csv``; ``remote`` the optional W&B/TensorBoard sinks;
``provenance`` what a training row is made of (tokens per source).

``make_plots`` and ``write_report`` load matplotlib on first use, so a process that
only logs metrics does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnrl.tracking.registry import (
    SINKS,
    MetricsSink,
    MissingBackendError,
    SinkContext,
    SinkParams,
    SinkSpec,
    get_sink,
    register_sink,
)
from turnrl.tracking.remote import TensorBoardSink, WandbSink
from turnrl.tracking.sinks import ConsoleSink, CsvSink, MultiSink, make_sinks, read_csv

if TYPE_CHECKING:
    from turnrl.tracking.plots import make_plots
    from turnrl.tracking.report import write_report

__all__ = [
    "SINKS",
    "ConsoleSink",
    "CsvSink",
    "MetricsSink",
    "MissingBackendError",
    "MultiSink",
    "SinkContext",
    "SinkParams",
    "SinkSpec",
    "TensorBoardSink",
    "WandbSink",
    "get_sink",
    "make_plots",
    "make_sinks",
    "read_csv",
    "register_sink",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name == "make_plots":
        from turnrl.tracking.plots import make_plots

        return make_plots
    if name == "write_report":
        from turnrl.tracking.report import write_report

        return write_report
    raise AttributeError(f"module 'turnrl.tracking' has no attribute {name!r}")
