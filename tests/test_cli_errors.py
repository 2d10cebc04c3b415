"""Bad input and faults end in one clear line (exit 2, no traceback), and nothing is lost or left behind."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from toy_envs import CountEnv
from turnrl.cli import app
from turnrl.envs import register_env
from turnrl.rundir import RunDir
from turnrl.train.checkpoint import RunLock


@pytest.fixture(autouse=True)
def _register():
    register_env("count", CountEnv)


def _config(tmp_path, **sections) -> str:
    data = {
        "run_name": "r",
        "model": {"name": "tiny"},
        "env": {"name": "count"},
        "sampler": {"max_tokens": 4},
        "rollout": {"tasks_per_step": 1, "group_size": 2},
        "train": {"steps": 1, "lr": 1e-3, "checkpoint_every": 1},
        "eval": {"before": False},
        "data": {"num_eval_tasks": 1},
        "tracking": {"backends": ["csv"], "plots": False, "report": False},
        "paths": {"output_dir": str(tmp_path / "runs")},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value) if isinstance(value, dict) else data.__setitem__(key, value)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _fails(args: list[str], *needles: str) -> str:
    result = CliRunner().invoke(app, args)
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out, result.exception)
    assert "Traceback" not in out
    for needle in needles:
        assert needle in out.replace("\n", " "), (needle, out)
    return out


def _nothing_written(tmp_path) -> None:
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ---- bad input: the message names the file/field/line; a failed start writes nothing


def test_task_file_that_is_a_directory(tmp_path):
    (tmp_path / "tasks").mkdir()
    _fails(["train", _config(tmp_path, data={"train_file": str(tmp_path / "tasks")})], "is a directory")
    _nothing_written(tmp_path)


def test_task_file_with_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"task_id": "a", "env": "count"}\n{"task_id": "\xff", "env": "count"}\n')
    _fails(["train", _config(tmp_path, data={"train_file": str(path)})], "t.jsonl:2", "UTF-8")
    _nothing_written(tmp_path)


def test_unknown_builtin_split(tmp_path):
    _fails(
        ["train", _config(tmp_path, env={"name": "number_guess"}, data={"train_split": "nope"})], "unknown split 'nope'"
    )
    _nothing_written(tmp_path)


def test_unknown_environment_option(tmp_path):
    _fails(["train", _config(tmp_path, env={"name": "number_guess", "options": {"bogus": 1}})], "bogus", "allowed")
    _nothing_written(tmp_path)


def test_unknown_slosh_option_and_sandbox_field(tmp_path):
    cfg = _config(tmp_path, env={"name": "slosh_tank", "options": {"nonsense": 1}}, data={"train_split": "smoke"})
    _fails(["train", cfg], "nonsense")
    cfg = _config(
        tmp_path, env={"name": "slosh_tank", "options": {"sandbox": {"bogus_field": 1}}}, data={"train_split": "smoke"}
    )
    _fails(["train", cfg], "bogus_field")
    _nothing_written(tmp_path)


def test_unknown_scripted_policy(tmp_path):
    _fails(["eval", _config(tmp_path, env={"name": "number_guess"}), "--scripted", "nope"], "no scripted policy 'nope'")


def test_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    _fails(
        ["train", _config(tmp_path, paths={"output_dir": str(tmp_path / "afile")})],
        "paths.output_dir",
        "not a directory",
    )


def test_non_finite_learning_rate(tmp_path):
    _fails(["train", _config(tmp_path, train={"lr": float("inf")})], "train.lr", "finite")


def test_negative_start_iter(tmp_path):
    result = CliRunner().invoke(app, ["train", _config(tmp_path), "--start-iter", "-1"])
    assert result.exit_code == 2 and "Traceback" not in result.output and "start-iter" in result.output
    _nothing_written(tmp_path)


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/b", ".."])
def test_run_name_must_be_a_name(tmp_path, name):
    _fails(["train", _config(tmp_path), "--run-name", name], "--run-name")
    assert not (tmp_path / "escape").exists()
    _nothing_written(tmp_path)


# ---- resume faults (one real one-step run, copied per case)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    register_env("count", CountEnv)
    root = tmp_path_factory.mktemp("done")
    cfg = _config(root, train={"steps": 2, "lr": 1e-3, "checkpoint_every": 1})
    result = CliRunner().invoke(app, ["train", cfg])
    assert result.exit_code == 0, result.output
    return root


def _copy(finished_run, tmp_path):
    shutil.copytree(finished_run / "runs", tmp_path / "runs")
    cfg = yaml.safe_load((finished_run / "cfg.yaml").read_text())
    cfg["paths"]["output_dir"] = str(tmp_path / "runs")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "cfg.yaml"), RunDir(tmp_path / "runs" / "r")


def test_truncated_checkpoint_on_resume(finished_run, tmp_path):
    cfg, run = _copy(finished_run, tmp_path)
    run.checkpoint.write_bytes(run.checkpoint.read_bytes()[:100])
    _fails(["train", cfg, "--resume", str(run.root)], "state.pt", "cannot be read")


def test_broken_saved_config_on_resume(finished_run, tmp_path):
    cfg, run = _copy(finished_run, tmp_path)
    run.config.write_text("train: [unclosed\n")
    _fails(["train", cfg, "--resume", str(run.root)], "config.yaml", "cannot be read")


def test_deleted_progress_file_on_resume(finished_run, tmp_path):
    cfg, run = _copy(finished_run, tmp_path)
    run.train_csv.unlink()
    _fails(["train", cfg, "--resume", str(run.root)], "train.csv", "is missing")


def test_resume_given_an_absolute_path_is_the_same_run(finished_run, tmp_path):
    cfg, run = _copy(finished_run, tmp_path)
    result = CliRunner().invoke(app, ["train", cfg, "--resume", str(run.root.resolve())])
    assert result.exit_code == 0, result.output  # finished already: nothing to do, nothing refused
    assert len(run.train_csv.read_text().splitlines()) == 3  # header + 2 steps, no row duplicated


def test_second_trainer_on_the_same_run_directory_is_refused(finished_run, tmp_path):
    cfg, run = _copy(finished_run, tmp_path)
    with RunLock(run):
        _fails(["train", cfg, "--resume", str(run.root)], "in use")
    # the lock of a holder that is gone is taken over (the kernel drops it with its process)
    result = CliRunner().invoke(app, ["train", cfg, "--resume", str(run.root)])
    assert result.exit_code == 0, result.output


def test_full_disk_during_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import torch

    cfg = _config(tmp_path, train={"steps": 2, "lr": 1e-3, "checkpoint_every": 1})
    real_save = torch.save
    calls = {"n": 0}

    def save(obj, path, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint write hits a full disk half-way
            path.write(b"partial")  # the checkpoint's temp file, open
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    _fails(["train", cfg], "No space left", "previous checkpoint is intact")
    run = RunDir(tmp_path / "runs" / "r")
    assert run.checkpoint.exists() and not list(run.checkpoint_dir.glob("*.tmp"))
    state = torch.load(run.checkpoint, weights_only=True)
    assert state["state"]["step"] == 1  # the first checkpoint, intact


# ---- messages that name the culprit (issue 22, class 7): real failures, not faked ones


@pytest.fixture()
def small_fs(tmp_path):
    """A real tiny file system (tmpfs), so a full disk fails the way it does in the field."""
    import subprocess

    def mount(size: str):
        where = tmp_path / f"fs_{size}"
        where.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root/CAP_SYS_ADMIN): {result.stderr.decode()[:200]}")
        mounted.append(where)
        return where

    mounted: list = []
    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


class _Stub:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state


def test_real_full_disk_while_writing_a_checkpoint_says_so(small_fs):
    import torch

    from turnrl.train.checkpoint import RunState, load_checkpoint, save_checkpoint
    from turnrl.train.summary import Summary

    run = RunDir(small_fs("64k") / "r")
    save_checkpoint(run, _Stub({"w": torch.zeros(1000)}), _Stub({}), RunState(step=1), Summary())
    with pytest.raises(Exception) as err:  # torch itself raises RuntimeError("... unexpected pos N vs M")
        save_checkpoint(run, _Stub({"w": torch.zeros(100_000)}), _Stub({}), RunState(step=2), Summary())
    text = str(err.value)
    assert "state.pt" in text and "is full" in text and "previous checkpoint is intact" in text, text
    assert not list(run.checkpoint_dir.glob("*.tmp"))
    assert load_checkpoint(run).state.step == 1


def test_real_full_disk_in_a_run_names_the_file_and_the_disk(tmp_path, small_fs):
    fs = small_fs("100k")  # the run's first files fit, its first checkpoint (~200 kB for tiny) does not
    cfg = _config(tmp_path, train={"steps": 2, "lr": 1e-3, "checkpoint_every": 1}, paths={"output_dir": str(fs)})
    _fails(["train", cfg], "state.pt", "is full", "--resume")


def test_real_full_disk_while_saving_the_adapter_names_it(tmp_path, small_fs):
    fs = small_fs("64k")  # the adapter (~60 kB for tiny) is written first and does not fit
    cfg = _config(tmp_path, train={"steps": 1, "lr": 1e-3}, paths={"output_dir": str(fs)})
    _fails(["train", cfg], "could not write the adapter", "iter_000", "is full")


def test_a_lock_the_file_system_refuses_names_the_lock_and_the_fix(tmp_path, monkeypatch):
    import fcntl

    def no_locks(*args, **kwargs):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)  # what flock does on a network file system without locks
    _fails(["train", _config(tmp_path)], ".lock", os.strerror(errno.ENOLCK), "local disk")


def test_config_file_with_invalid_utf8_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"run_name: r\ntrain: {steps: 1}  # caf\xe9\n")
    _fails(["train", str(path)], "bad.yaml", "UTF-8", "line 2")
    _fails(["eval", str(path)], "bad.yaml", "UTF-8")


@pytest.mark.parametrize(
    "name",
    [":Foo", "Foo:", "a b:C", "pkg..mod:C", "os:path:join"],
    ids=["no-module", "no-class", "space", "dots", "two"],
)
def test_env_name_that_is_not_a_target_names_the_key(tmp_path, name):
    _fails(["train", _config(tmp_path, env={"name": name})], "env.name", "package.module:Class")
    _nothing_written(tmp_path)


def test_hostile_input_in_a_real_process_is_one_line(tmp_path):
    """The CLI as users run it (``python -m turnrl``): a bad override, an alias bomb, a deep task line."""
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    bomb = "\n".join(
        ["    l0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
        + [f"    l{k}: &x{k} [" + ", ".join([f"*x{k - 1}"] * 9) + "]" for k in range(1, 9)]
    )
    (tmp_path / "bomb.yaml").write_text("model:\n  name: tiny\n  chat_template_kwargs:\n" + bomb + "\n")
    (tmp_path / "deep.jsonl").write_text(
        '{"task_id": "a", "env": "number_guess", "x": ' + "[" * 5000 + "]" * 5000 + "}\n"
    )
    plain = _config(tmp_path, env={"name": "number_guess"}, data={"train_file": str(tmp_path / "deep.jsonl")})
    runs = [
        (["train", plain, "--set", "train.steps=[1,"], "train.steps=[1,"),
        (["train", str(tmp_path / "bomb.yaml")], "expands to more than"),
        (["train", plain], "deep.jsonl:1"),
    ]
    env = {**os.environ, "PYTHONPATH": str(src)}
    for args, needle in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "turnrl", *args], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, (args, out[-2000:])
        assert "Traceback" not in out and needle in " ".join(out.split()), (args, out[-2000:])
        assert len(out.strip().splitlines()) <= 4 and len(out) < 1500, out[-2000:]


# ---- input from outside (issue 33): task files, adapters, option sizes (more spellings: tests/hostile/input_cases.py)


@pytest.mark.parametrize("env", ["json:JSONDecoder", "importlib:import_module", "count.x", "c\u043eunt"])
def test_a_task_line_naming_other_code_is_refused_unread(tmp_path, env):
    path = tmp_path / "t.jsonl"  # (that nothing is imported is shown with a canary module: test_hostile_input_cases)
    path.write_text('{"task_id": "a", "env": "count"}\n' + json.dumps({"task_id": "b", "env": env}) + "\n")
    _fails(["train", _config(tmp_path, data={"train_file": str(path)})], "t.jsonl:2", "field 'env'", "env.name")
    _nothing_written(tmp_path)


def test_duplicate_task_ids_name_both_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"task_id": "a", "env": "count"}\n{"task_id": "b", "env": "count"}\n{"task_id": "a", "env": "count"}\n'
    )
    _fails(["train", _config(tmp_path, data={"train_file": str(path)})], "t.jsonl:3", "'task_id'", "t.jsonl:1")
    _nothing_written(tmp_path)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["credit-audit", "cfg.yaml", "--repeats", str(10**12)], "--repeats"),
        (["credit-audit", "cfg.yaml", "--leaves", "65536", "--episodes", "2"], "--episodes 2 x --leaves 65536"),
        (["export", "run", "--iteration", str(10**11), "--out", "o"], "--iteration"),
        (["rows", "run", "--limit", str(10**9)], "--limit"),
    ],
    ids=["repeats", "leaves-product", "export-iteration", "rows-limit"],
)
def test_an_option_past_its_bound_is_refused_first(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)  # neither the config nor the run exists: the option is refused before either is read
    _fails(args, needle)


def test_a_pickle_adapter_is_refused_unread(tmp_path):
    import pickle

    class Boom:
        def __reduce__(self):
            return (os.makedirs, (str(tmp_path / "unpickled"),))

    adapter = tmp_path / "ad"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(Boom()))
    _fails(["eval", _config(tmp_path), "--adapter", str(adapter)], "adapter_model.bin", "pickle", "not loaded")
    assert not (tmp_path / "unpickled").exists()


# ---- user values printed as text, never as console markup (issue 33, class 7)

MARKUP = "a[/]b[bold red]c[/bold red][link=x]"


def test_markup_in_a_path_is_printed_as_text_in_the_one_line_error(tmp_path):
    missing = tmp_path / f"{MARKUP}.yaml"
    result = CliRunner().invoke(app, ["train", str(missing)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert MARKUP in " ".join(result.output.split()) and "MarkupError" not in result.output


def test_markup_in_the_output_directory_does_not_stop_a_run(tmp_path):
    out = tmp_path / MARKUP
    result = CliRunner().invoke(app, ["train", _config(tmp_path, paths={"output_dir": str(out)})])
    assert result.exit_code == 0, result.output
    assert RunDir(out / "r").summary.exists() and "run directory" in result.output
    assert MARKUP in " ".join(result.output.split())  # the run directory, shown as it is
