"""Every shipped config and experiment base config validates."""

from pathlib import Path

import pytest

from turnrl.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


# accelerate_*.yaml are launcher configs (tests/test_distributed.py), not run configs
RUN_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.yaml") if not p.name.startswith("accelerate_"))


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid_and_its_tasks_load(path):
    """Validates, names a registered environment and plug-ins, and its train/eval tasks load and build."""
    from turnrl.envs import get_env_class, make_env
    from turnrl.envs.splits import TaskSource

    cfg = load_config(path)
    assert cfg.run_name == path.stem  # a run directory named after its config
    get_env_class(cfg.env.name)
    assert cfg.credit.spec and cfg.loss.spec and cfg.sampler.spec
    for split in ("train", "eval"):
        tasks = TaskSource.from_config(cfg).tasks(split)
        assert tasks, split
        assert {t.env for t in tasks} == {cfg.env.name}, split
    opts = dict(cfg.env.options)
    if cfg.env.name == "slosh_tank":  # building checks the sandbox layers; the kernel sandbox may be absent here
        opts["sandbox"] = {**opts.get("sandbox", {}), "allow_weaker": True}
    make_env(tasks[0], **opts)


def test_branched_needs_branching():
    with pytest.raises(ConfigError, match="rollout.branching"):
        parse_config({"credit": {"estimator": "branched"}})


def test_centered_needs_topk_from_the_sampler():
    with pytest.raises(ConfigError, match="top_k_logprobs"):
        parse_config({"loss": {"type": "centered"}})


def test_importance_sampling_refuses_double_correction():
    with pytest.raises(ConfigError, match="correct twice"):
        parse_config({"loss": {"type": "importance_sampling", "mismatch": {"mode": "truncate"}}})


def test_unknown_section_lists_allowed_keys():
    with pytest.raises(ConfigError) as err:
        parse_config({"trainer": {}})
    assert "unknown key 'trainer'" in str(err.value) and "train" in str(err.value)
