"""Names that become paths, and deletes and copies that follow them (issue 33, class 1).

The mechanisms: :func:`turnrl.bounded.path_component` (the one rule of a name a path is built from: run,
arm and experiment names, a spec file's stem) and :func:`turnrl.rundir.contained` (a path resolved, links
followed, must lie under its root before anything there is deleted or copied out). Run as root and again as
an ordinary user (``tests/test_unprivileged.py``).
"""

from __future__ import annotations

import io
import shutil

import pytest
from typer.testing import CliRunner

from test_experiments import _write_spec
from turnrl.bounded import path_component
from turnrl.cli import app
from turnrl.config import RunConfig, dump_config
from turnrl.experiments import load_spec, run_experiment
from turnrl.rundir import RunDirError


def _spec(tmp_path, file_name: str = "exp.yaml"):
    """test_experiments' two-arm spec (and its base config), saved as ``file_name`` without a ``name:``."""
    return _write_spec(tmp_path).rename(tmp_path / file_name)


def _refuse(cfg, console=None):
    raise AssertionError("nothing is trained")


@pytest.mark.parametrize("name", [".", "..", "...", "a/b", "/abs", "a\\b", "a\x00b", "a\nb", "", " a", "-a", "ü"])
def test_path_component_refuses_every_name_that_is_not_one_plain_component(name):
    with pytest.raises(ValueError, match="cannot be a directory name"):
        path_component(name, "the name")
    assert path_component("seed0.v2-b_x", "the name") == "seed0.v2-b_x"


@pytest.mark.parametrize("stem", ["..", ".", ".hidden", "-rf", "a b", "x\x01y", "café", "a" * 201])
def test_a_spec_files_stem_is_checked_like_any_name(tmp_path, stem):
    """Without ``name:``, the spec file's stem names the experiment's directory: held to the same rule, so
    ``...yaml`` cannot send ``--fresh`` to ``out/..``."""
    spec = _spec(tmp_path, f"{stem}.yaml")
    victim = tmp_path / "a" / "seed0"  # where out/../a/seed0 lands
    victim.mkdir(parents=True)
    (victim / "keep.txt").write_text("x")
    result = CliRunner().invoke(app, ["experiment", str(spec), "--output-dir", str(tmp_path / "out"), "--fresh"])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "cannot be a directory name" in said and "set 'name'" in said, result.output
    assert "Traceback" not in result.output and (victim / "keep.txt").read_text() == "x"


@pytest.mark.parametrize("where", ["run", "experiment"])
def test_fresh_deletes_nothing_a_link_points_out_of_the_output_directory(tmp_path, where):
    spec_path = _spec(tmp_path)
    victim = tmp_path / "victim"
    (victim / "a" / "seed0").mkdir(parents=True)
    (victim / "keep.txt").write_text("x")
    (victim / "a" / "seed0" / "keep.txt").write_text("x")
    out = tmp_path / "runs"
    if where == "run":  # runs/exp/a/seed0 -> victim
        (out / "exp" / "a").mkdir(parents=True)
        (out / "exp" / "a" / "seed0").symlink_to(victim)
    else:  # runs/exp -> victim (victim/a/seed0 would be deleted)
        out.mkdir()
        (out / "exp").symlink_to(victim)
    with pytest.raises(RunDirError, match="outside"):
        run_experiment(load_spec(spec_path), _refuse, output_root=out, out=io.StringIO(), fresh=True)
    assert (victim / "keep.txt").read_text() == "x" and (victim / "a" / "seed0" / "keep.txt").read_text() == "x"


@pytest.mark.parametrize("plant", ["file", "directory", "adapter", "adapters"])
def test_adapter_only_never_copies_through_a_link_planted_in_the_run(tmp_path, plant):
    """A run directory someone sent: a link inside the adapter (to a file or a folder outside), or the adapter
    folder (or the adapters folder) itself a link out of the run. One line; nothing outside is copied."""
    run = tmp_path / "run"
    adapter = run / "adapters" / "iter_000"
    adapter.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(RunConfig(run_name="run")))
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("private")
    if plant == "file":
        (adapter / "notes.txt").symlink_to(secret / "key.txt")
    elif plant == "directory":
        (adapter / "extra").symlink_to(secret)
    else:
        moved = tmp_path / "elsewhere" / "iter_000"
        shutil.move(adapter, moved)
        if plant == "adapter":
            adapter.symlink_to(moved)
        else:
            shutil.rmtree(run / "adapters")
            (run / "adapters").symlink_to(moved.parent)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", str(run), "--iteration", "0", "--out", str(out), "--adapter-only"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 3
    assert ("symbolic link" in result.output) if plant in ("file", "directory") else ("outside" in result.output)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing copied, no temporary left


def test_a_plain_adapter_is_still_exported(tmp_path):
    run = tmp_path / "run"
    adapter = run / "adapters" / "iter_000"
    adapter.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(RunConfig(run_name="run")))
    (adapter / "adapter_config.json").write_text("{}")
    result = CliRunner().invoke(
        app, ["export", str(run), "--iteration", "0", "--out", str(tmp_path / "o"), "--adapter-only"]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "o" / "adapter_config.json").read_text() == "{}"
