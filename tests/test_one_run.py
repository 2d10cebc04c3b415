"""One config, one run: the same contexts through every command that builds one; the typed run record;
the run directory locked before it is inspected, its identity, and requests a run cannot honour refused."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from factories import tiny_run_config
from toy_envs import CountEnv
from turnrl.audit.run import AuditSettings, credit_audit
from turnrl.cli import app
from turnrl.config import ConfigError, dump_config, load_run_config, parse_config, resume_conflicts, upgrade_saved
from turnrl.envs import register_env
from turnrl.experiments import load_spec, run_experiment
from turnrl.experiments.results import is_complete
from turnrl.rundir import RunDir
from turnrl.sampling import SamplerSpec, register_sampler
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.tracking import read_csv
from turnrl.train.checkpoint import Checkpoint, ResumeError, RunLock, RunState
from turnrl.train.loop import train
from turnrl.train.run import Run
from turnrl.train.standalone import run_eval
from turnrl.train.summary import Summary, SummaryError, read_summary

HERE = Path(__file__).parent
QUIET = Console(quiet=True)


@pytest.fixture(autouse=True)
def _count_env():
    register_env("count", CountEnv)


# ---- one resolution point: the same contexts through training's evaluation, `turnrl eval`, the audit


class ThinkingSampler(ScriptedSampler):
    """Replies ``<think>…</think>ok`` to every context and records each call's temperature and contexts."""

    calls: list[tuple[float, list[tuple[int, ...]]]] = []

    def __init__(self, tokenizer) -> None:
        super().__init__(lambda messages: f"<think>turn {len(messages)}</think>ok", tokenizer)

    def sample(self, contexts, params, messages=None):
        ThinkingSampler.calls.append((params.temperature, [tuple(c) for c in contexts]))
        return super().sample(contexts, params, messages)


def _contexts(calls, greedy: bool | None = None) -> set[tuple[int, ...]]:
    return {c for temperature, cs in calls if greedy is None or (temperature == 0) == greedy for c in cs}


@pytest.mark.filterwarnings("ignore:Mean of empty slice")  # one audit repeat: no variance across repeats
def test_one_config_gives_the_same_contexts_in_training_eval_and_the_audit(tmp_path, tokenizer):
    register_sampler("thinking", SamplerSpec(lambda model, tok, settings, stale: ThinkingSampler(tok)))
    cfg = tiny_run_config(
        tmp_path, "same", model={"exclude_think": True}, sampler={"backend": "thinking"}, data={"num_eval_tasks": 2}
    )
    ThinkingSampler.calls = []
    train(cfg, console=QUIET)
    in_training = _contexts(ThinkingSampler.calls, greedy=True)  # the held-out evaluation is greedy
    ThinkingSampler.calls = []
    run_eval(cfg, QUIET)
    standalone = _contexts(ThinkingSampler.calls)
    ThinkingSampler.calls = []
    audit = AuditSettings(episodes=2, continuations=2, leaves=2, repeats=1, split="eval")
    credit_audit(cfg, audit, tmp_path / "audit", QUIET)
    audited = _contexts(ThinkingSampler.calls)

    assert len(in_training) == 2 * 3  # two tasks, three turns each
    assert standalone == in_training  # token for token
    assert in_training <= audited  # the audit's episodes of the eval tasks (and its replays of them)
    # model.exclude_think applied everywhere: no context shows an earlier turn's thinking
    texts = [tokenizer.decode(list(c)) for c in audited | standalone]
    assert not any("</think>" in t for t in texts) and any("ok" in t for t in texts)


def test_a_moved_key_names_its_new_place_and_saved_configs_read_it_there(tmp_path):
    with pytest.raises(ConfigError, match=r"credit\.exclude_think moved to model\.exclude_think \(the chat template"):
        parse_config({"credit": {"exclude_think": True}})
    cfg = parse_config({"model": {"exclude_think": True}})
    old = cfg.model_dump(mode="json")  # a config.yaml written before the key moved
    del old["model"]["exclude_think"]
    old["credit"]["exclude_think"] = True
    assert resume_conflicts(upgrade_saved(old), cfg) == []
    assert "model.exclude_think" in resume_conflicts(upgrade_saved({**old, "credit": {"exclude_think": False}}), cfg)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert load_run_config(tmp_path / "config.yaml").model.exclude_think is True


# ---- the typed run record ----------------------------------------------------------------------


def test_the_record_reads_back_and_older_or_damaged_files_are_handled(tmp_path):
    run = RunDir(tmp_path / "r")
    run.progress.mkdir(parents=True)
    assert read_summary(run) is None
    record = Summary("abc", {"success_rate": 0.25}, [{"success_rate": 0.5}], complete=False)
    record.end_iteration(1, {"success_rate": 0.75}, last=True)
    record.write(run)
    assert read_summary(run) == record and record.final == {"success_rate": 0.75} and record.complete
    assert record.before(1) == Summary("abc", {"success_rate": 0.25}, [{"success_rate": 0.5}])
    assert record.before(0) == Summary("abc")  # a restart at 0 evaluates the base again
    # the {"base", "final"} file of older runs: that evaluation, not known to be complete
    run.summary.write_text(json.dumps({"base": {"success_rate": 0.1}, "final": {"success_rate": 0.2}}))
    assert read_summary(run) == Summary("", {"success_rate": 0.1}, [{"success_rate": 0.2}], complete=False)
    run.summary.write_text('{"iterations": 3}')
    with pytest.raises(SummaryError, match=r"summary\.json is not a turnrl run summary \(iterations:"):
        read_summary(run)
    assert not is_complete(run.root)


def _two_iteration_spec(tmp_path: Path) -> Path:
    base = {
        "model": {"name": "tiny"},
        "env": {"name": "count"},
        "sampler": {"max_tokens": 4},
        "rollout": {"tasks_per_step": 1, "group_size": 2},
        "train": {"lr": 1e-2, "micro_batch_size": 4},
        "loop": {"iterations": 2},
        "tracking": {"backends": ["csv"], "plots": False, "report": False},
    }
    spec = {
        "title": "t",
        "hypothesis": "h",
        "base_config": "base.yaml",
        "seeds": [0],
        "budget": {"steps": 1},
        "evaluation": {"every": 0, "n": 1, "before": False},
        "arms": [{"name": "a", "overrides": {}}],
    }
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "exp.yaml"


class Killed(BaseException):
    """What a kill after iteration 0's checkpoint looks like to the test."""


def test_a_two_iteration_run_killed_after_iteration_0_is_resumed_not_reused(tmp_path, monkeypatch):
    spec = load_spec(_two_iteration_spec(tmp_path))
    real_sync = Run.sync

    def killed_after_iteration_0(self, iteration):
        real_sync(self, iteration)
        raise Killed

    monkeypatch.setattr(Run, "sync", killed_after_iteration_0)
    with pytest.raises(Killed):
        run_experiment(spec, output_root=tmp_path / "runs", out=io.StringIO(), console=QUIET)
    run = RunDir(tmp_path / "runs" / "exp" / "a" / "seed0")
    record = read_summary(run)
    assert record is not None and len(record.iterations) == 1 and not record.complete  # one evaluation, not done
    assert not is_complete(run.root)

    monkeypatch.setattr(Run, "sync", real_sync)
    result = run_experiment(spec, output_root=tmp_path / "runs", out=io.StringIO(), console=QUIET)
    assert [r.reused for r in result.runs] == [False]  # resumed, not reused as if finished
    record = read_summary(run)
    assert record is not None and record.complete and len(record.iterations) == 2
    assert [r["label"] for r in read_csv(run.eval_csv)] == ["iter", "final"]
    again = run_experiment(spec, output_root=tmp_path / "runs", out=io.StringIO(), console=QUIET)
    assert [r.reused for r in again.runs] == [True]  # now it is finished


# ---- the run directory: lock first, its identity, requests it cannot honour ------------------------


def test_a_trainer_refused_by_the_lock_removes_nothing(tmp_path, monkeypatch):
    """The race of two trainers on a new run directory: the loser creates the directory, the winner locks it
    before the loser does; the loser is refused and leaves the winner's directory as it is."""
    cfg = tiny_run_config(tmp_path, "race")
    root = tmp_path / "race"
    real_take = RunLock._take
    winner: list[RunLock] = []

    def winner_locks_first(self):
        if not winner:  # the other trainer takes the lock and writes its config in between
            winner.append(RunLock(RunDir(root)))
            winner[0].__enter__()
            (root / "config.yaml").write_text(dump_config(cfg))
        return real_take(self)

    monkeypatch.setattr(RunLock, "_take", winner_locks_first)
    with pytest.raises(ResumeError, match="is in use by pid"):
        train(cfg, console=QUIET)
    assert (root / "config.yaml").is_file() and (root / ".lock").is_file()  # the winner's, untouched
    winner[0].__exit__()


def test_two_trainers_started_on_one_run_dir_leave_one_complete_run(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_name": "both",
                "model": {"name": "tiny"},
                "env": {"name": "count"},
                "sampler": {"max_tokens": 4},
                "rollout": {"tasks_per_step": 1, "group_size": 2},
                "train": {"steps": 1, "lr": 1e-2},
                "eval": {"before": False},
                "data": {"num_eval_tasks": 1},
                "tracking": {"backends": ["csv"], "plots": False, "report": False},
                "paths": {"output_dir": str(tmp_path / "runs")},
            }
        )
    )
    go = tmp_path / "go"
    env = {**os.environ, "START_WHEN": str(go), "KILL_AT": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "resume_runner.py"), "train", str(config)],
            env={**env, "READY_FILE": str(tmp_path / f"ready{k}")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in range(2)
    ]
    deadline = time.monotonic() + 300
    while not all((tmp_path / f"ready{k}").exists() for k in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()  # both have imported everything: they start training at the same moment
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outputs
    loser = outputs[[p.returncode for p in procs].index(2)]
    # the holder is named once it has written its pid; a loser that arrives first sees "another process"
    assert "is in use by" in loser or "already holds a run" in loser, loser
    record = read_summary(RunDir(tmp_path / "runs" / "both"))
    assert record is not None and record.complete  # the winner's run, whole


def _crafted_run(tmp_path: Path, cfg, state: RunState, run_id: str, checkpoint_id: str) -> RunDir:
    """A run directory as a finished or interrupted trainer leaves it, without training."""
    run = Run.dir_for(cfg)
    run.checkpoint_dir.mkdir(parents=True)
    run.config.write_text(dump_config(cfg))
    Summary(run_id).write(run)
    torch.save(Checkpoint(state, Summary(checkpoint_id)).to_payload(), run.checkpoint)
    return run


def test_a_checkpoint_copied_from_another_run_is_refused_in_one_line(tmp_path):
    cfg = tiny_run_config(tmp_path, "mine")
    run = _crafted_run(tmp_path, cfg, RunState(step=1, iteration_step=1), "aaaa", "bbbb")
    with pytest.raises(ResumeError, match=r"belongs to run bbbb, not to this run \(aaaa"):
        train(cfg, resume=True, console=QUIET)
    assert read_summary(run) == Summary("aaaa")  # nothing was rewritten


def test_steps_added_to_a_finished_run_are_refused_in_one_line(tmp_path):
    cfg = tiny_run_config(tmp_path, "done")
    config = tmp_path / "cfg.yaml"
    config.write_text(dump_config(cfg))
    _crafted_run(tmp_path, cfg, RunState(step=1, iteration=1, cursor=2), "cccc", "cccc")
    result = CliRunner().invoke(
        app,
        ["train", str(config), "--resume", str(tmp_path / "done"), "--set", "train.steps=3", "--allow-config-change"],
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "has finished its 1 iteration(s) (1 steps): a changed train.steps would apply to no step" in " ".join(
        result.output.split()
    )
    # mid-iteration, the checkpoint past the steps the config now asks for
    cfg = tiny_run_config(tmp_path, "mid", train={"steps": 4})
    _crafted_run(tmp_path, cfg, RunState(step=3, iteration_step=3, cursor=6), "dddd", "dddd")
    with pytest.raises(ResumeError, match="at step 3 of iteration 0, past the 2 steps per iteration"):
        train(tiny_run_config(tmp_path, "mid", train={"steps": 2}), resume=True, allow_config_change=True)


def test_an_iteration_added_to_a_finished_run_is_trained_on_top_of_it(tmp_path):
    train(tiny_run_config(tmp_path, "more"), console=QUIET)
    more = tiny_run_config(tmp_path, "more", loop={"iterations": 2})
    with pytest.raises(ResumeError, match=r"loop\.iterations"):  # a changed config still needs the flag
        train(more, resume=True, console=QUIET)
    record = train(more, resume=True, allow_config_change=True, console=QUIET)
    assert record.complete and len(record.iterations) == 2
    assert (tmp_path / "more/adapters/iter_001/adapter_config.json").is_file()
