"""Every shipped config and experiment base config validates."""

from pathlib import Path

import pytest

from turnrl.config import ConfigError, RunConfig, load_config, parse_config, read_config_data

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
    _check_plugins(cfg, read_config_data(path))
    for split in ("train", "eval"):
        tasks = TaskSource.from_config(cfg).tasks(split)
        assert tasks, split
        assert {t.env for t in tasks} == {cfg.env.name}, split
    opts = dict(cfg.env.options)
    if cfg.env.name == "slosh_tank":  # building checks the sandbox layers; the kernel sandbox may be absent here
        opts["sandbox"] = {**opts.get("sandbox", {}), "allow_weaker": True}
    make_env(tasks[0], **opts)


def _check_plugins(cfg: RunConfig, raw: dict) -> None:
    """Each plug-in section chose the plug-in its file names (the default when it names none), hands
    that plug-in every parameter the file sets for it, and the file sets none its plug-in ignores."""
    for section_name in ("credit", "loss", "sampler", "tracking"):
        section, given = getattr(cfg, section_name), raw.get(section_name) or {}
        field = section._registry[2]
        default = type(section).model_fields[field].default
        assert section.kind == given.get(field, default), section_name
        own = set(type(section).model_fields)
        specs = {name: section.registry()[name] for name in section.chosen}
        for key, value in given.items():
            if key in own:
                continue
            owners = [name for name, spec in specs.items() if key in spec.params.model_fields]
            assert owners, f"{section_name}.{key} is a parameter of no chosen plug-in of {sorted(specs)}"
            for name in owners:
                params = section.params_of(name)
                assert isinstance(params, specs[name].params)
                assert params.model_dump(mode="json")[key] == value, f"{section_name}.{key} for {name}"


def test_plugin_check_catches_a_parameter_of_another_plugin():
    """What the shipped-config check above refuses: a key only a plug-in that was not chosen reads."""
    raw = {"credit": {"estimator": "group_mean", "gamma": 0.9}}  # gamma is stepwise's
    with pytest.raises(AssertionError, match="credit.gamma is a parameter of no chosen plug-in"):
        _check_plugins(parse_config(raw), raw)
    raw = {"loss": {"type": "clip", "eps_hi": 0.28}}
    _check_plugins(parse_config(raw), raw)


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
