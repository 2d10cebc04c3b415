"""``turnrl export``: a trained iteration as a Hugging Face directory that transformers loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from toy_envs import CountEnv
from turnrl.cli import app
from turnrl.config import parse_config
from turnrl.envs import register_env
from turnrl.models import load_model, merge_adapters
from turnrl.train.loop import train

IDS = torch.tensor([[1, 28, 3064, 198, 9690, 2, 30, 481, 216, 17, 33]])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run of two outer iterations, one step each (adapters iter_000 and iter_001)."""
    register_env("count", CountEnv)
    root = tmp_path_factory.mktemp("export")
    cfg = parse_config(
        {
            "run_name": "exp",
            "model": {"name": "tiny"},
            "env": {"name": "count"},
            "sampler": {"max_tokens": 6},
            "rollout": {"tasks_per_step": 2, "group_size": 4},
            "train": {"steps": 1, "lr": 5e-2, "micro_batch_size": 8},
            "loop": {"iterations": 2},
            "eval": {"before": False, "every": 0},
            "data": {"num_eval_tasks": 1},
            "tracking": {"backends": ["csv"], "plots": False, "report": False},
            "paths": {"output_dir": str(root / "runs")},
        }
    )
    train(cfg)
    return root / "runs" / "exp", cfg


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def test_exported_iteration_1_gives_the_logits_of_base_plus_adapters_0_and_1(run, tmp_path):
    run_dir, cfg = run
    out = tmp_path / "model"
    result = CliRunner().invoke(app, ["export", str(run_dir), "--iteration", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ["config.json", "model.safetensors", "tokenizer.json", "turnrl_export.json"]:
        assert (out / name).exists(), name
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base, _ = load_model(cfg.model.model_copy(update={"device": "cpu"}), seed=cfg.seed)
    base_logits = _logits(base)
    expected = _logits(merge_adapters(base, [run_dir / "adapters/iter_000", run_dir / "adapters/iter_001"]))
    got = _logits(exported)
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got - expected).abs().max()
    # the adapters changed the model, so the comparison above can fail
    assert (expected - base_logits).abs().max() > 1e-3
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert json.loads((out / "turnrl_export.json").read_text())["adapters"] == ["iter_000", "iter_001"]


def test_export_casts_to_the_run_dtype(run, tmp_path):
    run_dir, cfg = run
    bf16 = tmp_path / "bf16run"
    shutil.copytree(run_dir, bf16)
    data = yaml.safe_load((bf16 / "config.yaml").read_text())
    data["model"]["dtype"] = "bfloat16"
    (bf16 / "config.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["export", str(bf16), "--iteration", "1", "--out", str(tmp_path / "m")])
    assert result.exit_code == 0, result.output
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {torch.bfloat16}
    # merged in float32, then cast: equal to casting the float32 merge
    base, _ = load_model(cfg.model.model_copy(update={"device": "cpu"}), seed=cfg.seed)
    ref = merge_adapters(base, [run_dir / "adapters/iter_000", run_dir / "adapters/iter_001"]).to(torch.bfloat16)
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    for (name, a), (_, b) in zip(ref.state_dict().items(), got.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_adapter_only_copies_iteration_0_and_refuses_later_ones(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["export", str(run_dir), "--iteration", "0", "--out", str(out), "--adapter-only"])
    assert result.exit_code == 0, result.output
    assert (out / "adapter_config.json").read_bytes() == (
        run_dir / "adapters/iter_000/adapter_config.json"
    ).read_bytes()
    assert (out / "adapter_model.safetensors").read_bytes() == (
        run_dir / "adapters/iter_000/adapter_model.safetensors"
    ).read_bytes()
    result = CliRunner().invoke(
        app, ["export", str(run_dir), "--iteration", "1", "--out", str(tmp_path / "x"), "--adapter-only"]
    )
    assert result.exit_code == 2 and "drop --adapter-only" in result.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--iteration", "5"], "no adapter iter_002"),
        (["--iteration", "-1"], "--iteration must be >= 0"),
    ],
)
def test_bad_iteration_is_one_clear_error(run, tmp_path, args, message):
    run_dir, _ = run
    result = CliRunner().invoke(app, ["export", str(run_dir), *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_export_refuses_a_non_empty_out_and_a_non_run(run, tmp_path):
    run_dir, _ = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    result = CliRunner().invoke(app, ["export", str(run_dir), "--iteration", "0", "--out", str(tmp_path / "full")])
    assert result.exit_code == 2 and "not an empty directory" in result.output
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    result = CliRunner().invoke(app, ["export", str(tmp_path), "--iteration", "0", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "not a run directory" in result.output
