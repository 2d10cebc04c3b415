"""The ``turnrl`` command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from turnrl.bounded import (
    MAX_AUDIT_EPISODES,
    MAX_AUDIT_REPEATS,
    MAX_AUDIT_SHAPES,
    MAX_AUDIT_TASKS,
    MAX_GROUP,
    MAX_ITERATIONS,
)
from turnrl.bounded import MAX_EPISODES_PER_STEP as _CALL
from turnrl.lab.cli import lab_app
from turnrl.terminal import make_console, styled

MAX_PROCESSES = 64
"""``train --processes``: processes on one machine (one per accelerator)."""
MAX_ROWS = 100_000
"""``rows --limit``: rows listed (more than anyone reads on a terminal)."""

app = typer.Typer(
    help="Reinforcement learning of language models on multi-turn tasks, with turn-level credit.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
tasks_app = typer.Typer(help="Task sets.", no_args_is_help=True)
model_app = typer.Typer(help="Models.", no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")
app.add_typer(model_app, name="model")
app.add_typer(lab_app, name="lab")
console = make_console()

ConfigArg = Annotated[Path, typer.Argument(help="YAML run config (see configs/).")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a config key: --set train.steps=5 (repeatable).")
]


def _quiet_libraries() -> None:
    """Keep library chatter (weight-loading bars, deprecation notes of transformers internals) off the console."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


@app.callback()
def _main() -> None:
    _quiet_libraries()


def _user_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises: reported as one line (``TURNRL_DEBUG=1`` shows the traceback instead).

    ``ValueError`` covers the checks of environments, estimators and losses (unknown option,
    split, scripted policy...) and every input error of the project (``ConfigError``,
    ``TaskFileError``, ``ExperimentError``, ``AdapterError``: each names its file, line or key); ``ServerError``
    a server that failed or answered wrong (naming it); ``OSError``
    unreadable or unwritable paths; ``yaml.YAMLError`` and ``RecursionError`` are the last resort
    for input read outside those readers (a YAML file, a value nested too deeply).
    """
    import os

    if os.environ.get("TURNRL_DEBUG"):
        return ()
    import yaml

    from turnrl.models import ModelNotFoundError
    from turnrl.sampling.replies import ServerError
    from turnrl.sandbox import SandboxUnavailable
    from turnrl.train.checkpoint import ResumeError

    return (
        ValueError,
        OSError,
        ModelNotFoundError,
        ResumeError,
        ServerError,
        ImportError,
        SandboxUnavailable,
        yaml.YAMLError,
        RecursionError,
    )


def _fail(exc: BaseException) -> None:
    from turnrl.bounded import yaml_problem

    if isinstance(exc, OSError) and exc.filename:
        message = f"{exc.filename}: {exc.strerror}"
    elif isinstance(exc, RecursionError):
        message = "the input nests too deeply to process; flatten it (TURNRL_DEBUG=1 shows where)"
    elif type(exc).__module__.startswith("yaml"):
        message = f"not valid YAML: {yaml_problem(exc)}"  # type: ignore[arg-type]
    else:
        message = str(exc)
    if len(message) > 4000:  # a message quoting user input never floods the terminal
        message = message[:4000] + " ..."
    console.print(styled(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _within(option: str, value: int | None, low: int, high: int) -> None:
    """Refuse an option outside ``low..high`` in one line (the bounds the help text states), before the
    command reads anything; None (not given) passes."""
    if value is not None and value < low:
        raise ValueError(f"{option} must be >= {low} (got {value})")
    if value is not None and value > high:
        raise ValueError(f"{option} must be <= {high:,} (got {value:,}); the help text gives each option's range")


def _load(config: Path, overrides: list[str] | None, run_name: str | None = None):
    from turnrl.config import ConfigError, load_config

    cfg = load_config(config, overrides or [])
    if run_name:
        try:
            cfg.run_name = run_name
        except ValueError:
            raise ConfigError(
                f"--run-name {run_name!r}: use letters, digits, '.', '_' and '-' only (a name, not a path);"
                " the run is written under paths.output_dir"
            ) from None
    return cfg


@app.command()
def train(
    config: ConfigArg,
    run_name: Annotated[
        str | None, typer.Option(help="Name of the run directory (default: the config's run_name).")
    ] = None,
    set_: SetOpt = None,
    resume: Annotated[
        Path | None, typer.Option(help="Continue the run in this directory from its last checkpoint.")
    ] = None,
    start_iter: Annotated[
        int | None,
        typer.Option(help=f"Start at outer iteration N (0..{MAX_ITERATIONS:,}), on adapters 0..N-1."),
    ] = None,
    allow_config_change: Annotated[bool, typer.Option(help="Resume even if the config changed.")] = False,
    processes: Annotated[
        int,
        typer.Option(
            help=f"Train on N processes (one per GPU, 1..{MAX_PROCESSES}), launched through accelerate.",
        ),
    ] = 1,
    fsdp: Annotated[
        bool, typer.Option(help="With --processes N: shard the frozen base over the processes (FSDP2).")
    ] = False,
) -> None:
    """Train: evaluate the base, then collect → credit → update, evaluating every N steps and at the end."""
    try:
        _within("--start-iter", start_iter, 0, MAX_ITERATIONS)
        _within("--processes", processes, 1, MAX_PROCESSES)
    except ValueError as exc:
        _fail(exc)
    if fsdp and processes == 1:
        _fail(ValueError("--fsdp shards the base over several processes: add --processes N (N >= 2)"))
    if processes > 1:
        _launch_processes(processes, fsdp)
    try:
        cfg = _load(config, set_, run_name)
        if resume is not None:
            if not resume.is_dir():
                raise FileNotFoundError(f"--resume {resume}: not a run directory")
            cfg.paths.output_dir, cfg.run_name = str(resume.resolve().parent), resume.resolve().name
        from turnrl.train.loop import train as run_training

        run_training(
            cfg,
            resume=resume is not None,
            start_iter=start_iter,
            allow_config_change=allow_config_change,
            console=console,
        )
    except _user_errors() as exc:
        _fail(exc)


def _launch_processes(processes: int, fsdp: bool) -> None:
    """``--processes N``: re-run this very command under ``accelerate launch`` (returns inside the launched ranks)."""
    import os

    from turnrl.train.distributed import fsdp_launched

    launched = os.environ.get("WORLD_SIZE")
    if launched is not None:  # we are one of the launched processes
        if launched != str(processes) or fsdp != fsdp_launched():
            how = f"{launched} processes" + (" with FSDP" if fsdp_launched() else " without FSDP")
            _fail(
                ValueError(
                    f"--processes {processes}{' --fsdp' if fsdp else ''}, but the launcher started {how};"
                    " drop --processes and --fsdp when launching with accelerate launch yourself"
                )
            )
        return
    import socket
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser

    with socket.socket() as sock:  # a free rendezvous port, so two runs on one machine do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = sys.argv[0]
    target = ["-m", "turnrl"] if script.endswith("__main__.py") or not Path(script).is_file() else [script]
    args = launch_command_parser().parse_args(
        [
            *(["--use_fsdp", "--fsdp_version", "2"] if fsdp else ["--multi_gpu"]),
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(port),
            *target,
            *sys.argv[1:],
        ]
    )
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:
        raise typer.Exit(exc.returncode if exc.returncode > 0 else 1) from None
    except Exception as exc:  # torch's ChildFailedError: rank 0 has printed why; exit with its status
        failure = getattr(exc, "get_first_failure", None)
        code = failure()[1].exitcode if failure else 1
        raise typer.Exit(code if isinstance(code, int) and code > 0 else 1) from None
    raise typer.Exit(0)


@app.command("eval")
def eval_(
    config: ConfigArg,
    adapter: Annotated[Path | None, typer.Option(help="A saved peft adapter directory to evaluate.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run directory whose adapters --iteration refers to.")] = None,
    iteration: Annotated[
        int | None,
        typer.Option(
            help=f"Evaluate the merged model after iteration N (0..{MAX_ITERATIONS:,}; needs --run-dir).",
        ),
    ] = None,
    tasks: Annotated[Path | None, typer.Option(help="Task JSONL file (default: the config's eval tasks).")] = None,
    scripted: Annotated[
        str | None, typer.Option(help="Evaluate a scripted policy of the environment instead of a model.")
    ] = None,
    max_turns: Annotated[int | None, typer.Option(help=f"Collector turn limit (1..{MAX_GROUP:,}).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the metrics as a CSV row to this file.")] = None,
    set_: SetOpt = None,
) -> None:
    """Evaluate the base model, an adapter, a merged iteration, or a scripted policy on held-out tasks."""
    try:
        _within("--iteration", iteration, 0, MAX_ITERATIONS)
        _within("--max-turns", max_turns, 1, MAX_GROUP)
        from turnrl.train.standalone import run_eval

        cfg = _load(config, set_)
        run_eval(
            cfg,
            console,
            adapter=adapter,
            run_dir=run_dir,
            iteration=iteration,
            tasks=tasks,
            scripted=scripted,
            max_turns=max_turns,
            out=out,
        )
    except _user_errors() as exc:
        _fail(exc)


@app.command("credit-audit")
def credit_audit_(
    config: ConfigArg,
    adapter: Annotated[Path | None, typer.Option(help="Audit a saved peft adapter instead of the base.")] = None,
    scripted: Annotated[str | None, typer.Option(help="Audit a scripted policy of the environment.")] = None,
    episodes: Annotated[int, typer.Option(help=f"Audited episodes N (tasks in turn; 1..{MAX_AUDIT_EPISODES:,}).")] = 8,
    continuations: Annotated[
        int, typer.Option(help=f"Monte-Carlo rollouts M per value estimate (2..{MAX_GROUP:,}; N x M <= {_CALL:,}).")
    ] = 8,
    leaves: Annotated[
        int, typer.Option(help=f"Sampled leaves L per task for every estimator (2..{MAX_GROUP:,}; N x L <= {_CALL:,}).")
    ] = 8,
    repeats: Annotated[int, typer.Option(help=f"Independent estimator batches R (1..{MAX_AUDIT_REPEATS:,}).")] = 4,
    shapes: Annotated[
        str | None,
        typer.Option(help=f"Branched shapes G1xG2 (product = leaves; at most {MAX_AUDIT_SHAPES}), e.g. 2x4."),
    ] = None,
    gamma: Annotated[float, typer.Option(help="Discount of the return A* is defined on, in [0, 1].")] = 1.0,
    split: Annotated[str, typer.Option(help="Task split: train or eval.")] = "train",
    num_tasks: Annotated[
        int | None, typer.Option(help=f"Use the first N tasks of the split (1..{MAX_AUDIT_TASKS:,}).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for credit_audit.json and credit_audit.png.")] = Path(
        "credit_audit"
    ),
    records: Annotated[
        Path | None,
        typer.Option(help="Audit the first --episodes episodes of this record file (written by TRL, verl, ...)."),
    ] = None,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact", help="Exact A* where the environment offers a finite menu of replies (each choice scored)."
        ),
    ] = False,
    max_nodes: Annotated[
        int, typer.Option(help="--exact: most states where the policy acts in one task's tree (1..100,000).")
    ] = 1000,
    set_: SetOpt = None,
) -> None:
    """How right each credit estimator is, per turn, against A* = Q − V: Monte-Carlo, or exact with --exact
    (docs/algorithms.md)."""
    try:
        from turnrl.audit.run import AuditSettings, credit_audit, parse_shapes

        settings = AuditSettings.from_options(
            episodes=episodes,
            continuations=continuations,
            leaves=leaves,
            repeats=repeats,
            gamma=gamma,
            split=split,
            shapes=parse_shapes(shapes),
            num_tasks=num_tasks,
            exact=exact,
            max_nodes=max_nodes,
        )  # before the config and the model: a bad option costs nothing
        cfg = _load(config, set_)
        credit_audit(cfg, settings, out, console, adapter=adapter, scripted=scripted, records=records)
    except _user_errors() as exc:
        _fail(exc)


# ---- turnrl credit: advantages for records written elsewhere (turnrl.integrations.credit)


@app.command("credit")
def credit_(
    records: Annotated[Path, typer.Argument(help="A record file (JSONL, one episode a line; docs/integrations.md).")],
    estimator: Annotated[str, typer.Option(help="A registered credit estimator: group_mean, branched, stepwise, ...")],
    out: Annotated[Path, typer.Option(help="Where to write the records with every turn's advantage filled in.")],
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="The estimator's parameters: --set credit.gamma=0.9 (repeatable).")
    ] = None,
) -> None:
    """Assign a credit estimator's per-turn advantages to recorded episodes; write them back as records."""
    try:
        from turnrl.integrations.credit import run_credit

        run_credit(records, estimator, set_ or [], out, console)
    except _user_errors() as exc:
        _fail(exc)


@tasks_app.command("build")
def tasks_build(
    family: Annotated[str, typer.Argument(help="Task family: slosh.")],
    out: Annotated[Path, typer.Option(help="Output directory.")] = Path("tasks"),
) -> None:
    """Regenerate a task set from its environment source."""
    if family != "slosh":
        _fail(ValueError(f"unknown task family {family!r}; available: slosh"))
    from turnrl.envs.slosh_tank import build_tasks

    for path in build_tasks(out):
        console.print(f"wrote {path}")


@model_app.command("prepare")
def model_prepare() -> None:
    """Convert the embedded model (GGUF → cached safetensors) so later loads take a second."""
    try:
        from turnrl.models import embedded_model_dir

        console.print(f"embedded model ready at {embedded_model_dir()}")
    except _user_errors() as exc:
        _fail(exc)


@app.command("export")
def export_(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    iteration: Annotated[
        int,
        typer.Option(
            help=f"The outer iteration to export (0..{MAX_ITERATIONS:,}; its adapters 0..N merged).",
        ),
    ],
    out: Annotated[Path, typer.Option(help="Output directory (new or empty).")],
    adapter_only: Annotated[bool, typer.Option(help="Copy the peft adapter instead (iteration 0 only).")] = False,
) -> None:
    """Write iteration N as a Hugging Face model directory (base + adapters 0..N merged) that vLLM serves."""
    try:
        _within("--iteration", iteration, 0, MAX_ITERATIONS)
        from turnrl.export import export

        console.print(f"wrote {export(run_dir, iteration, out, adapter_only=adapter_only)}")
    except _user_errors() as exc:
        _fail(exc)


@app.command()
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory.")]) -> None:
    """Write the run's plots to RUN_DIR/plots/."""
    try:
        from turnrl.tracking import make_plots

        for path in make_plots(run_dir):
            console.print(f"wrote {path}")
    except _user_errors() as exc:
        _fail(exc)


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    plots: Annotated[bool, typer.Option(help="Regenerate the plots first.")] = True,
) -> None:
    """Write a self-contained RUN_DIR/report.html (plots, tables, transcript browser)."""
    try:
        from turnrl.config import load_run_config
        from turnrl.models import load_tokenizer
        from turnrl.tracking import make_plots, write_report

        cfg = load_run_config(run_dir / "config.yaml")
        if plots:
            make_plots(run_dir)
        console.print(f"wrote {write_report(run_dir, tokenizer=load_tokenizer(cfg.model.name))}")
    except _user_errors() as exc:
        _fail(exc)


@app.command()
def rows(
    run_dir: Annotated[Path, typer.Argument(help="A run directory.")],
    limit: Annotated[int, typer.Option(help=f"Rows listed before the totals (0..{MAX_ROWS:,}; 0: totals only).")] = 20,
) -> None:
    """The mask report: each training row's tokens by source and the dilution of the policy's own tokens."""
    try:
        _within("--limit", limit, 0, MAX_ROWS)
        from turnrl.tracking.provenance import print_mask_report

        print_mask_report(run_dir, console, limit=limit)
    except _user_errors() as exc:
        _fail(exc)


def main() -> None:  # pragma: no cover
    sys.exit(app())


@app.command()
def experiment(
    spec: Annotated[Path, typer.Argument(help="Experiment spec YAML (see experiments/).")],
    output_dir: Annotated[
        Path, typer.Option(help="Root of experiment directories: OUTPUT_DIR/<name>/<arm>/seed<k>.")
    ] = Path("runs"),
    set_: SetOpt = None,
    fresh: Annotated[bool, typer.Option(help="Delete this experiment's existing runs and rerun every arm.")] = False,
    dry_run: Annotated[
        bool, typer.Option(help="Validate the spec and show how the arms' configs differ; train nothing.")
    ] = False,
) -> None:
    """Run an experiment: every arm × seed on the same data and budget, then a table, a plot and a verdict."""
    try:
        from turnrl.experiments import main as run_spec

        run_spec(spec, output_root=output_dir, overrides=set_ or [], fresh=fresh, dry_run=dry_run, console=console)
    except _user_errors() as exc:
        _fail(exc)
