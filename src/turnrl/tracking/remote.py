"""Optional metrics backends: W&B and TensorBoard, each one class and one registry entry.

Their packages are imported only when configured; the entries name the modules and the
install hint, so :func:`~turnrl.tracking.sinks.make_sinks` raises
:class:`~turnrl.tracking.registry.MissingBackendError` with the hint before any file is written.
Their own state lives in the run directory: ``wandb/`` (the run id a resumed run
reuses) and ``tensorboard/`` (event files).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from turnrl.rundir import atomic_write_text
from turnrl.tracking.registry import SinkContext, SinkParams, SinkSpec, register_sink
from turnrl.tracking.sinks import Metrics, _numeric


class WandbParams(SinkParams):
    project: str = "turnrl"
    """The W&B project the run is logged to (``tracking.project``)."""


class WandbSink:
    """Weights & Biases: one run per run directory; train/*, eval/* on the step axis, iteration/* on its own.

    The mode comes from ``WANDB_MODE`` (``offline`` works with no network; sync later
    with ``wandb sync``). A resumed run reuses the run id stored in ``wandb/turnrl_run_id``.
    """

    def __init__(
        self,
        project: str,
        run_name: str,
        run_dir: str | Path,
        config_dict: Mapping[str, Any],
        resume_step: int | None = None,
    ) -> None:
        import wandb

        run_dir = Path(run_dir)
        id_file = run_dir / "wandb" / "turnrl_run_id"
        if resume_step is not None and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:12]  # W&B ids: lowercase letters and digits
            atomic_write_text(id_file, run_id + "\n")
        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow",
            config=dict(config_dict),
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE") or None,
        )
        self.run.define_metric("step")
        self.run.define_metric("train/*", step_metric="step")
        self.run.define_metric("eval/*", step_metric="step")
        self.run.define_metric("iteration")
        self.run.define_metric("iteration/*", step_metric="iteration")

    @classmethod
    def from_context(cls, context: SinkContext) -> WandbSink:
        return cls(context.params.project, context.run_name, context.run_dir, context.config, context.resume_step)

    def log_step(self, step: int, metrics: Metrics) -> None:
        nums = _numeric(metrics)
        self.run.log({"step": step, **{f"train/{k}": v for k, v in nums.items() if k != "step"}})

    def log_eval(self, step: int, metrics: Metrics) -> None:
        nums = _numeric(metrics)
        self.run.log({"step": step, **{f"eval/{k}": v for k, v in nums.items() if k != "step"}})

    def log_iteration(self, iteration: int, metrics: Metrics) -> None:
        nums = _numeric(metrics)
        self.run.log({"iteration": iteration, **{f"iteration/{k}": v for k, v in nums.items()}})

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """TensorBoard event files: ``tensorboard/steps`` (train/*, eval/* by step) and
    ``tensorboard/iterations`` (iteration/* by iteration), two runs side by side.

    On resume, events after the resumed step are purged from the step run.
    """

    def __init__(self, run_dir: str | Path, config_dict: Mapping[str, Any], resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        root = Path(run_dir) / "tensorboard"
        purge = None if resume_step is None else resume_step + 1
        self.steps = SummaryWriter(log_dir=str(root / "steps"), purge_step=purge)
        self.iterations = SummaryWriter(log_dir=str(root / "iterations"))
        if resume_step is None:
            import yaml

            text = yaml.safe_dump(dict(config_dict), sort_keys=False)
            self.steps.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    @classmethod
    def from_context(cls, context: SinkContext) -> TensorBoardSink:
        return cls(context.run_dir, context.config, context.resume_step)

    def _scalars(self, writer: Any, prefix: str, step: int, metrics: Metrics) -> None:
        for key, value in _numeric(metrics).items():
            if key != "step":
                writer.add_scalar(f"{prefix}/{key}", value, step)
        writer.flush()

    def log_step(self, step: int, metrics: Metrics) -> None:
        self._scalars(self.steps, "train", step, metrics)

    def log_eval(self, step: int, metrics: Metrics) -> None:
        self._scalars(self.steps, "eval", step, metrics)

    def log_iteration(self, iteration: int, metrics: Metrics) -> None:
        self._scalars(self.iterations, "iteration", iteration, metrics)

    def close(self) -> None:
        self.steps.close()
        self.iterations.close()


register_sink(
    "wandb", SinkSpec(WandbSink.from_context, WandbParams, requires=("wandb",), install="pip install 'turnrl[wandb]'")
)
register_sink(
    "tensorboard",
    SinkSpec(
        TensorBoardSink.from_context,
        # tensorboard first: torch's wrapper needs it and its own ImportError names torch
        requires=("tensorboard", "torch.utils.tensorboard"),
        install="pip install 'turnrl[tensorboard]'",
    ),
)
