"""Hostile user input (issue 22, classes 1-3 and 7): each case is one config, override or task file
written as an attacker or a careless user would; each must end in one short line naming the key,
file or line (exit 2, no traceback), before anything grows or runs.

The mechanisms under test: strict typed models for every option (``turnrl.sections``: sections,
plug-in parameters, ``EnvOptions``), the bounded YAML loader and size measure
(``turnrl.bounded``), the per-step budget (``RunConfig._check_budget``) and the task-file reader.
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass, field

import pytest
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from toy_envs import CountEnv
from turnrl.bounded import (
    MAX_DEPTH,
    MAX_NODES,
    BoundedYAMLError,
    InputTooLarge,
    check_bounded,
    load_yaml,
    short_repr,
)
from turnrl.cli import app
from turnrl.config import ConfigError, parse_config
from turnrl.envs import ENV_REGISTRY, get_env_class, register_env
from turnrl.sections import strict_validate

MESSAGE_LIMIT = 1500
"""Longest error output a case may print (a message that quotes an expanded value is a failure)."""


@pytest.fixture(autouse=True)
def _register():
    register_env("count", CountEnv)


BASE = {
    "run_name": "r",
    "model": {"name": "tiny"},
    "env": {"name": "count"},
    "sampler": {"max_tokens": 4},
    "rollout": {"tasks_per_step": 1, "group_size": 2},
    "train": {"steps": 1, "lr": 1e-3},
    "eval": {"before": False},
    "data": {"num_eval_tasks": 1},
    "tracking": {"backends": ["csv"], "plots": False, "report": False},
}


def bomb(levels: int, anchor: str = "x") -> list[str]:
    """YAML lines of a "billion laughs" chain: level k is 9 aliases of level k − 1 (9**levels strings)."""
    lines = [f"&{anchor}0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for k in range(1, levels):
        lines.append(f"&{anchor}{k} [" + ", ".join([f"*{anchor}{k - 1}"] * 9) + "]")
    return lines


def bomb_mapping(levels: int, indent: int) -> str:
    pad = " " * indent
    return "\n".join(f"{pad}l{k}: {line}" for k, line in enumerate(bomb(levels)))


@dataclass
class Case:
    name: str
    cls: int
    """The issue's class: 1 typed values, 2 exceptions from input, 3 unbounded expansion, 7 naming."""
    needles: tuple[str, ...]
    sections: dict = field(default_factory=dict)
    """Merged into BASE (section → keys), dumped with yaml.safe_dump."""
    text: str = ""
    """Raw YAML appended to the dump (for aliases, .inf, nesting), sections named here are dropped from BASE."""
    overrides: tuple[str, ...] = ()
    tasks: bytes | None = None
    """A task file (data.train_file) for the count environment."""


DEEP = b'{"task_id": "a", "env": "count", "params": {"k": ' + b"[" * 5000 + b"]" * 5000 + b"}}\n"
CASES = [
    # ---- 1. values are validated by type, sign and range (plug-in params and env options included)
    Case("plugin_float_inf", 1, ("eps_hi", "finite"), text="loss: {eps_hi: .inf}"),
    Case("plugin_float_nan_override", 1, ("eps_lo", "(got nan)"), overrides=("loss.eps_lo=.nan",)),
    Case("other_plugin_float_nan", 1, ("gamma",), text="credit: {estimator: stepwise, gamma: .nan}"),
    Case("nested_plugin_float", 1, ("top_k", "finite"), text="loss: {centered: {top_k: -.inf}}"),
    Case("plugin_bool_string", 1, ("enforce_eager", "true or false"), text="sampler: {enforce_eager: 'false'}"),
    Case("section_bool_string", 1, ("rollout.shaping", "true or false"), text="rollout: {shaping: 'no'}"),
    Case("section_bool_int", 1, ("train.shared_prefix", "true or false"), overrides=("train.shared_prefix=0",)),
    Case("env_option_inf", 1, ("env.options.probe_steps", "finite"), text="env: {name: slosh_tank, options: {probe_steps: .inf}}", sections={"data": {"train_split": "smoke"}}),  # noqa: E501
    Case("env_option_huge_float", 1, ("env.options.max_turns",), text="env: {name: number_guess, options: {max_turns: 1e400}}"),  # noqa: E501
    Case("env_option_bool_string", 1, ("env.options.few_shot", "true or false"), text="env: {name: number_guess, options: {few_shot: 'false'}}"),  # noqa: E501
    Case("env_option_bool_int", 1, ("env.options.end_on_invalid", "true or false"), text="env: {name: key_door, options: {end_on_invalid: 1}}"),  # noqa: E501
    Case("env_option_fraction", 1, ("env.options.horizon", "integer"), text="env: {name: key_door, options: {horizon: 2.5}}"),  # noqa: E501
    Case("env_option_negative", 1, ("env.options.num_colors", "greater than or equal to 2"), text="env: {name: key_door_tools, options: {num_colors: -1}}"),  # noqa: E501
    Case("seed_30_digits", 1, ("seed", "less than or equal to 4294967295"), text="seed: 123456789012345678901234567890"),  # noqa: E501
    Case("number_as_string", 1, ("train.lr", "must be a number"), text="train: {lr: '1e-3'}"),
    Case("number_as_bool", 1, ("env.options.probe_steps", "must be a number"), text="env: {name: slosh_tank, options: {probe_steps: true}}", sections={"data": {"train_split": "smoke"}}),  # noqa: E501
    Case("seed_negative", 1, ("seed", "greater than or equal to 0"), overrides=("seed=-1",)),
    # ---- 2. input that used to raise outside the user-error list
    Case("task_line_5000_deep", 2, ("t.jsonl:1", "nests"), tasks=DEEP),
    Case("task_params_int", 2, ("t.jsonl:2", "'params'"), tasks=b'{"task_id": "a", "env": "count"}\n{"task_id": "b", "env": "count", "params": 7}\n'),  # noqa: E501
    Case("task_params_list", 2, ("t.jsonl:1", "'params'"), tasks=b'{"task_id": "a", "env": "count", "params": [1, 2]}\n'),  # noqa: E501
    Case("task_split_not_a_string", 2, ("t.jsonl:1", "'split'"), tasks=b'{"task_id": "a", "env": "count", "split": {}}\n'),  # noqa: E501
    Case("override_unclosed_list", 2, ("override", "train.steps=[1,", "not valid YAML"), overrides=("train.steps=[1,",)),  # noqa: E501
    Case("override_unclosed_mapping", 2, ("override", "not valid YAML"), overrides=("model.chat_template_kwargs={a: ",)),  # noqa: E501
    Case("override_recursive_alias", 2, ("override", "refers to the value"), overrides=("train.steps=&a [*a]",)),
    Case("override_tab_indent", 2, ("override", "not valid YAML"), overrides=("train.steps=\t- 1\n\t- 2",)),
    Case("config_5000_deep", 2, ("cfg.yaml", "deeper than"), text="extra: " + "[" * 5000 + "]" * 5000),
    Case("config_recursive_alias", 2, ("cfg.yaml", "refers to the value"), text="model: {name: tiny, chat_template_kwargs: &k {a: *k}}"),  # noqa: E501
    Case("config_duplicate_section", 2, ("cfg.yaml", "'train' is given twice"), text="train: {steps: 5}\ntrain: {lr: 0.1}"),  # noqa: E501
    # ---- 3. input that expands without bound
    Case("alias_bomb_field_value", 3, ("cfg.yaml", "expands to more than"), text="train:\n  lr:\n" + bomb_mapping(9, 4)),  # noqa: E501
    Case("alias_bomb_chat_template_kwargs", 3, ("cfg.yaml", "expands to more than"), text="model:\n  name: tiny\n  chat_template_kwargs:\n" + bomb_mapping(9, 4)),  # noqa: E501
    Case("alias_bomb_env_options", 3, ("cfg.yaml", "expands to more than"), text="env:\n  name: count\n  options:\n" + bomb_mapping(9, 4)),  # noqa: E501
    Case("alias_bomb_override", 3, ("override", "expands to more than"), overrides=("model.chat_template_kwargs={" + ", ".join(f"l{k}: {v}" for k, v in enumerate(bomb(9))) + "}",)),  # noqa: E501
    Case("merge_key_bomb", 3, ("cfg.yaml", "expands to more than"), text="m: &m {" + ", ".join(f"k{i}: {i}" for i in range(400)) + "}\nmodel:\n  chat_template_kwargs:\n    <<: [" + ", ".join(["*m"] * 400) + "]"),  # noqa: E501
    Case("huge_list_in_error_message", 3, ("train.lr",), text="train: {lr: [" + ", ".join(["9" * 40] * 20_000) + "]}"),  # noqa: E501
    Case("free_form_too_large", 3, ("model.chat_template_kwargs", "more than 10,000"), text="model: {name: tiny, chat_template_kwargs: {a: [" + ", ".join(["1"] * 20_000) + "]}}"),  # noqa: E501
    Case("config_over_a_mebibyte", 3, ("cfg.yaml", "bytes of YAML"), text="extra: '" + "x" * (1 << 20) + "'"),
    Case("max_tokens_10_12", 3, ("sampler.max_tokens", "less than or equal"), sections={"sampler": {"max_tokens": 10**12}}),  # noqa: E501
    Case("group_size_10_9", 3, ("rollout.group_size", "less than or equal"), sections={"rollout": {"group_size": 10**9}}),  # noqa: E501
    Case("branching_product", 3, ("rollout.branching", "episodes per task"), sections={"rollout": {"branching": [65536, 65536]}, "credit": {"estimator": "branched"}}),  # noqa: E501
    Case("episodes_per_step", 3, ("rollout.tasks_per_step", "episodes per step"), sections={"rollout": {"tasks_per_step": 1024, "group_size": 1024}}),  # noqa: E501
    Case("tokens_per_step", 3, ("sampler.max_tokens", "rollout.max_turns", "tokens"), sections={"rollout": {"tasks_per_step": 64, "group_size": 64, "max_turns": 100}, "sampler": {"max_tokens": 100_000}}),  # noqa: E501
    # ---- 7. messages that name the culprit
    Case("env_name_empty_module", 7, ("env.name", "package.module:Class"), sections={"env": {"name": ":Foo"}}),
    Case("env_name_empty_class", 7, ("env.name", "package.module:Class"), sections={"env": {"name": "os.path:"}}),
    Case("env_name_module_missing", 7, ("env.name", "cannot import"), sections={"env": {"name": "no_such_mod_xyz:Env"}}),  # noqa: E501
    Case("env_name_not_an_env", 7, ("not a subclass",), sections={"env": {"name": "json:JSONDecoder"}}),
]  # fmt: skip


def _write_case(case: Case, tmp_path) -> str:
    data = json.loads(json.dumps(BASE))
    data["paths"] = {"output_dir": str(tmp_path / "runs")}
    for key, value in case.sections.items():
        data.setdefault(key, {}).update(value)
    if case.tasks is not None:
        (tmp_path / "t.jsonl").write_bytes(case.tasks)
        data["data"]["train_file"] = str(tmp_path / "t.jsonl")
    for key in _top_keys(case.text):  # a section the raw text gives replaces BASE's (no key twice)
        data.pop(key, None)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data) + case.text + "\n")
    return str(path)


def _top_keys(text: str) -> list[str]:
    return [line.split(":", 1)[0] for line in text.splitlines() if line and not line[0].isspace() and ":" in line]


def test_the_hostile_input_set_covers_every_class():
    assert len(CASES) >= 30
    assert {c.cls for c in CASES} == {1, 2, 3, 7}
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_hostile_input(case, tmp_path):
    cfg = _write_case(case, tmp_path)
    args = ["train", cfg]
    for item in case.overrides:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out[:2000], result.exception)
    assert "Traceback" not in out and out.startswith("error:"), out[:2000]
    assert len(out) < MESSAGE_LIMIT, f"{len(out)} characters: {out[:300]}..."
    flat = " ".join(out.split())
    for needle in case.needles:
        assert needle in flat, (needle, out)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.csv"))


# ---- the mechanisms, for every registered plug-in and environment


def _fields(model: type[BaseModel], wanted: type) -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        args = typing.get_args(f.annotation) or (f.annotation,)
        if wanted in args and not (wanted is int and bool in args):
            out.append(name)
    return out


def _plugins():
    from turnrl.credit import ESTIMATORS
    from turnrl.losses import LOSSES
    from turnrl.sampling import SAMPLERS

    for section, field_name, registry in (
        ("credit", "estimator", ESTIMATORS),
        ("loss", "type", LOSSES),
        ("sampler", "backend", SAMPLERS),
    ):
        for name, spec in registry.items():
            yield section, field_name, name, spec.params


PLUGINS = list(_plugins())


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda p: f"{p[0]}.{p[2]}")
def test_every_plugin_parameter_is_strict(plugin):
    section, field_name, name, params = plugin
    checked = 0
    for key in _fields(params, float):
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ConfigError, match=rf"{key}.*finite|{key}.*(greater|less)"):
                parse_config({section: {field_name: name, key: bad}})
            checked += 1
    for key in _fields(params, bool):
        for bad in ("false", "true", 0, 1, "no"):
            with pytest.raises(ConfigError, match=rf"{key}.*true or false"):
                parse_config({section: {field_name: name, key: bad}})
            checked += 1
    for key in _fields(params, int):
        with pytest.raises(ConfigError, match=key):
            parse_config({section: {field_name: name, key: math.inf}})
        checked += 1
    if not checked:
        pytest.skip(f"{section} {name!r} has no float, bool or int parameter")


ENVS = sorted(ENV_REGISTRY)


@pytest.mark.parametrize("env_name", ENVS)
def test_every_env_validates_its_options_strictly(env_name):
    cls = get_env_class(env_name)
    with pytest.raises(ValueError, match="unknown option"):
        cls.parse_options({"no_such_option": 1})
    for key in _fields(cls.Options, bool):
        for bad in ("false", 0, "yes"):
            with pytest.raises(ValueError, match=rf"env\.options\.{key}: .*true or false"):
                cls.parse_options({key: bad})
    for key in _fields(cls.Options, int) + _fields(cls.Options, float):
        for bad in (math.inf, math.nan, "3"):
            with pytest.raises(ValueError, match=rf"env\.options\.{key}: "):
                cls.parse_options({key: bad})
    cls.parse_options({})  # the defaults are valid


def test_strict_validate_applies_to_any_model():
    class Plain(BaseModel):  # a user's plug-in model on plain BaseModel: the rules still apply
        x: float = 1.0
        flag: bool = False

    assert strict_validate(Plain, {"x": 2, "flag": True}).x == 2.0
    for bad in ({"x": math.inf}, {"flag": "false"}, {"flag": 1}):
        with pytest.raises(Exception, match="finite|true or false"):
            strict_validate(Plain, bad)


# ---- the bounded reader


def test_loader_refuses_a_bomb_while_it_is_small():
    text = "a:\n" + bomb_mapping(9, 2)
    assert len(text) < 1000
    with pytest.raises(BoundedYAMLError, match="expands to more than"):
        load_yaml(text)
    assert load_yaml("a:\n" + bomb_mapping(4, 2))["a"]["l3"][0][0][0][0] == "lol"  # 9**4 = 6,561 values: fine


def test_loader_limits_depth_before_python_does():
    ok = "x: " + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    load_yaml(ok)
    for n in (MAX_DEPTH + 1, 5000, 200_000):
        with pytest.raises(BoundedYAMLError, match="deeper than"):
            load_yaml("x: " + "[" * n + "]" * n)
    # aliases that stack shallow values into a deep one are measured as expanded
    chain = ["a0: &a0 " + "[" * 20 + "]" * 20] + [f"a{k}: &a{k} " + "[" * 10 + f"*a{k - 1}" + "]" * 10 for k in (1, 2)]
    with pytest.raises(BoundedYAMLError, match="deeper than"):
        load_yaml("\n".join(chain))


def test_loader_refuses_repeated_keys_and_size():
    with pytest.raises(BoundedYAMLError, match="'a' is given twice"):
        load_yaml("a: 1\nb: 2\na: 3\n")
    with pytest.raises(BoundedYAMLError, match="given twice"):
        load_yaml("s: {x: 1, x: 2}")
    assert load_yaml("base: &b {x: 1}\nd: {<<: *b, x: 2}")["d"] == {"x": 2}  # a merge key may be overridden
    with pytest.raises(InputTooLarge, match="bytes of YAML"):
        load_yaml("a: " + "b" * 100, max_bytes=50)


def test_check_bounded_counts_shared_references_as_copies():
    shared = [1] * 10
    for _ in range(6):
        shared = [shared] * 10  # 10**7 leaves in a few kilobytes of objects
    with pytest.raises(InputTooLarge, match="more than 100"):
        check_bounded(shared, "x", max_nodes=100)
    loop: list = []
    loop.append(loop)
    with pytest.raises(InputTooLarge, match="deeper"):
        check_bounded(loop, "x")
    check_bounded({"a": list(range(MAX_NODES - 3))}, "x", max_nodes=MAX_NODES)  # dict, key, list + items


def test_short_repr_is_short_for_any_value():
    shared = ["lol"] * 9
    for _ in range(8):
        shared = [shared] * 9
    for value in (shared, "x" * 10**6, 10**5000, {i: i for i in range(10**5)}, b"\xff" * 10**6):
        assert len(short_repr(value)) <= 120
