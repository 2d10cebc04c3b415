"""The run directory may be hostile: planted links, odd files, torn records, duplicate YAML keys (issue 22, class 4)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from factories import random_episode
from turnrl.bounded import BoundedYAMLError, load_yaml, yaml_problem
from turnrl.config import ConfigError, apply_overrides, read_config_data
from turnrl.rundir import RunDir, RunDirError, atomic_write_text, read_jsonl, write_jsonl
from turnrl.tracking.sinks import CsvSink
from turnrl.train.checkpoint import (
    ResumeError,
    RunLock,
    RunState,
    cut_back,
    read_saved_config,
    row_counts,
    save_checkpoint,
    truncate_to,
)
from turnrl.train.summary import Summary

SECRET = "root:x:0:0:do not touch\n"


@pytest.fixture()
def run(tmp_path):
    r = RunDir(tmp_path / "runs" / "r")
    r.root.mkdir(parents=True)
    return r


@pytest.fixture()
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text(SECRET)
    return path


# ----------------------------------------------------------------------------- (a) links and odd files


def test_lock_symlink_is_refused_and_its_target_untouched(run, victim):
    (run.root / ".lock").symlink_to(victim)
    with pytest.raises(RunDirError, match=r"\.lock is a symbolic link"):
        with RunLock(run):
            pass
    assert victim.read_text() == SECRET


def test_lock_hard_link_is_refused(run, victim):
    os.link(victim, run.root / ".lock")
    with pytest.raises(RunDirError, match="hard link"):
        with RunLock(run):
            pass
    assert victim.read_text() == SECRET


def test_lock_fifo_is_refused_without_hanging(run):
    os.mkfifo(run.root / ".lock")
    with pytest.raises(RunDirError, match="not a regular file"):
        with RunLock(run):
            pass


@pytest.mark.parametrize("where", ["progress", "rollouts/iter_000.jsonl", "checkpoint/state.pt", "adapters"])
def test_a_link_anywhere_in_the_run_directory_is_refused_when_the_lock_is_taken(run, victim, tmp_path, where):
    link = run.root / where
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim if "." in where else tmp_path)
    with pytest.raises(RunDirError, match=f"{where} is a symbolic link"):
        with RunLock(run):
            pass
    with pytest.raises(RunDirError):  # the lock was released on refusal: a second try is refused alike
        RunLock(run).__enter__()
    assert victim.read_text() == SECRET


def test_a_clean_run_directory_is_locked_and_the_lock_names_its_holder(run):
    with RunLock(run):
        assert (run.root / ".lock").read_text() == f"pid {os.getpid()}\n"


def test_rollout_append_does_not_follow_a_planted_link(run, victim):
    run.rollouts.mkdir()
    run.train_rollouts(0).symlink_to(victim)
    with pytest.raises(RunDirError, match="symbolic link"):
        write_jsonl(run.train_rollouts(0), [random_episode("e", 1)], append=True)
    assert victim.read_text() == SECRET


def test_progress_appends_do_not_follow_a_planted_link(run, victim):
    sink = CsvSink(run.root)
    sink.log_step(1, {"reward": 1.0})  # the first row of a fresh run replaces the file
    run.steps_jsonl.unlink()
    run.steps_jsonl.symlink_to(victim)
    with pytest.raises(RunDirError, match="symbolic link"):
        sink.log_step(2, {"reward": 2.0})
    assert victim.read_text() == SECRET


def test_an_atomic_write_replaces_a_link_not_its_target(run, victim):
    run.summary.parent.mkdir()
    run.summary.symlink_to(victim)
    atomic_write_text(run.summary, "{}")
    assert not run.summary.is_symlink() and run.summary.read_text() == "{}"
    assert victim.read_text() == SECRET


def test_checkpoint_temp_file_is_never_a_planted_one(run, victim):
    run.checkpoint_dir.mkdir()
    (run.checkpoint_dir / "state.pt.tmp").symlink_to(victim)  # the name the writer used to reuse
    stub = SimpleNamespace(state_dict=lambda: {"w": torch.zeros(2)})
    save_checkpoint(run, stub, stub, RunState(step=3), Summary())
    assert victim.read_text() == SECRET
    assert torch.load(run.checkpoint, weights_only=True)["state"]["step"] == 3
    assert sorted(p.name for p in run.checkpoint_dir.iterdir()) == ["state.pt", "state.pt.tmp"]


# ----------------------------------------------------------------------------- (b) torn records


def _rollouts(run: RunDir, n: int, tail: str = "") -> str:
    write_jsonl(run.train_rollouts(0), [random_episode(f"e{k}", k) for k in range(n)])
    with open(run.train_rollouts(0), "a") as fh:
        fh.write(tail)
    return str(run.train_rollouts(0).relative_to(run.root))


def test_a_torn_last_line_is_not_a_row(run):
    rel = _rollouts(run, 3, tail='{"episode_id": "torn')
    assert row_counts(run)[rel] == 3


def test_resume_cuts_a_torn_tail_so_appended_episodes_are_kept(run):
    rel = _rollouts(run, 3, tail='{"episode_id": "torn')
    truncate_to(run, {rel: 3})
    write_jsonl(run.train_rollouts(0), [random_episode("new", 9)], append=True)
    assert [ep.episode_id for ep in read_jsonl(run.train_rollouts(0))] == ["e0", "e1", "e2", "new"]


def test_a_damaged_counted_record_refuses_the_resume_naming_file_and_line(run):
    rel = _rollouts(run, 2)
    lines = run.train_rollouts(0).read_text().splitlines(keepends=True)
    run.train_rollouts(0).write_text(lines[0] + '{"episode_id": "cut short\n')
    with pytest.raises(ResumeError, match=r"iter_000\.jsonl:2 is not a complete record"):
        truncate_to(run, {rel: 2})


def test_a_separator_inside_a_csv_value_is_not_a_row_break(run):
    sink = CsvSink(run.root)
    sink.log_step(1, {"note": "a\u2028b\x85c"})  # str.splitlines() breaks lines there; a CSV reader does not
    assert row_counts(run)["progress/train.csv"] == 2  # header + one row


# ----------------------------------------------------------------------------- (c) resume with no checkpoint


def test_resume_without_a_checkpoint_starts_clean(run):
    CsvSink(run.root).log_step(1, {"reward": 1.0})
    _rollouts(run, 4, tail="{")
    run.iteration_rows.write_text("{}")
    cut_back(run, None)
    assert row_counts(run) == {p: 0 for p in row_counts(run)}
    assert not run.iteration_rows.exists()


def test_resume_removes_the_temp_files_a_kill_left_half_written(run):
    run.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    half = run.checkpoint_dir / ".state.pt.k3j9x.tmp"  # what atomic_file leaves when SIGKILL lands mid-write
    half.write_bytes(b"\x80half")
    outside = run.root.parent / "outside.txt"
    outside.write_text("keep")
    (run.root / ".planted.tmp").symlink_to(outside)  # a link of that name is not ours: left, target untouched
    (run.root / ".dir.tmp").mkdir()
    elsewhere = run.root.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".theirs.tmp").write_text("keep")
    (run.root / "linked").symlink_to(elsewhere)  # a linked directory is not searched
    assert run.stale_temp_files() == [half]
    cut_back(run, None)
    assert not half.exists() and outside.read_text() == "keep" and (run.root / ".dir.tmp").is_dir()
    assert (elsewhere / ".theirs.tmp").read_text() == "keep"


# ----------------------------------------------------------------------------- (d) duplicate YAML keys

DUPLICATED = [
    ("train:\n  steps: 3\nmodel:\n  name: tiny\ntrain:\n  lr: 0.1\n", "train", 5, 1),
    ("train:\n  steps: 3\n  lr: 0.1\n  steps: 4\n", "steps", 4, 2),
    ("env: {name: key_door, name: math}\n", "name", 1, 1),
    ("rollout:\n  branching: [{a: 1, b: 2, a: 3}]\n", "a", 2, 2),
    ("1: one\n1: uno\n", 1, 2, 1),
]


@pytest.mark.parametrize(("text", "key", "line", "first"), DUPLICATED)
def test_a_key_given_twice_is_refused_naming_key_and_lines(tmp_path, text, key, line, first):
    with pytest.raises(BoundedYAMLError, match=rf"the key {key!r} is given twice \(first on line {first}\)") as err:
        load_yaml(text)
    assert f"(line {line}, column" in yaml_problem(err.value)
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"c\.yaml: .*key {key!r} is given twice"):
        read_config_data(path)


def test_merge_keys_and_distinct_keys_still_load():
    assert load_yaml("base: &b {lr: 1, steps: 2}\ntrain:\n  <<: *b\n  lr: 3\n") == {
        "base": {"lr": 1, "steps": 2},
        "train": {"lr": 3, "steps": 2},
    }
    assert load_yaml("a: 1\nb: {a: 2}\n") == {"a": 1, "b": {"a": 2}}


def test_duplicate_keys_are_refused_in_overrides_and_saved_configs(run):
    with pytest.raises(ConfigError, match="key 'x' is given twice"):
        apply_overrides({}, ["model.chat_template_kwargs={x: 1, x: 2}"])
    run.config.write_text("seed: 1\nseed: 2\n")
    with pytest.raises(ResumeError, match="key 'seed' is given twice"):
        read_saved_config(run)


def test_experiment_specs_refuse_duplicate_keys(tmp_path):
    from turnrl.experiments.spec import ExperimentError, load_spec

    path = tmp_path / "spec.yaml"
    path.write_text("name: x\nname: y\n")
    with pytest.raises((ExperimentError, ConfigError), match="key 'name' is given twice"):
        load_spec(path)
