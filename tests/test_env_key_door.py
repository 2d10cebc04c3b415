"""Key and door: rewards, horizon, potential, parsing, the tool env, deep copy."""

from __future__ import annotations

import copy
import inspect

import pytest

from turnrl.envs import StopReason, Task, get_env_class
from turnrl.envs.key_door import (
    Action,
    KeyDoorEnv,
    KeyDoorGame,
    generate_tasks,
    parse_action,
)
from turnrl.integrations.trl_key_door import (
    KeyDoorToolEnv,
    key_door_reward,
    key_door_tool_dataset,
)

PARAMS = {"colors": ["red", "blue", "green"], "target": "blue", "seed": 3}
SOLVE = ["inspect", "pickup_blue", "open_blue", "finish"]


def make(**options) -> KeyDoorEnv:
    return KeyDoorEnv(Task(task_id="kd", env="key_door", params=dict(PARAMS)), **options)


def test_registry_points_here():
    assert get_env_class("key_door") is KeyDoorEnv


def test_solve_path_reward_1():
    env = make()
    msgs = env.initial_messages()
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "blue" in msgs[1]["content"] and "exit is" not in msgs[1]["content"]
    results = [env.step(a) for a in SOLVE]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
    assert "the exit is the blue door" in results[0].messages[0]["content"]
    assert all(not r.done and len(r.messages) == 1 for r in results[:-1])
    last = results[-1]
    assert last.terminated and not last.truncated and last.stop_reason == StopReason.SUCCESS
    assert last.messages == []
    assert last.metrics["success"] == 1.0 and last.metrics["turns"] == 4.0


def test_wrong_door_is_reward_0():
    env = make()
    results = [env.step(a) for a in ["pickup_red", "open_red"]]
    assert results[-1].terminated and results[-1].stop_reason == StopReason.FAILURE
    assert sum(r.reward for r in results) == 0.0
    assert results[-1].messages == []


def test_finish_without_exit_open_is_reward_0():
    env = make()
    env.step("inspect")
    r = env.step("finish")
    assert r.reward == 0.0 and r.terminated and r.stop_reason == StopReason.FAILURE


def test_locked_door_and_unknown_colour_continue():
    env = make()
    r = env.step("open_blue")
    assert not r.done and "locked" in r.messages[0]["content"] and r.metrics["invalid"] == 0.0
    r = env.step("pickup_purple")
    assert not r.done and "no purple key" in r.messages[0]["content"]
    r = env.step("inspect")
    r = env.step("inspect")
    assert "crumbled" in r.messages[0]["content"] and "blue" not in r.messages[0]["content"]


def test_horizon_is_truncation_not_termination():
    env = make(horizon=3)
    assert env.max_turns == 3
    results = [env.step(a) for a in ["inspect", "pickup_blue", "pickup_red"]]
    last = results[-1]
    assert last.truncated and not last.terminated
    assert last.stop_reason == StopReason.MAX_TURNS
    assert last.reward == 0.0 and last.messages == []
    with pytest.raises(RuntimeError):
        env.step("finish")


def test_ending_on_the_last_turn_is_termination():
    env = make(horizon=4)
    results = [env.step(a) for a in SOLVE]
    assert results[-1].terminated and not results[-1].truncated
    assert results[-1].stop_reason == StopReason.SUCCESS


def test_horizon_from_task_params_and_default():
    assert make().max_turns == 8
    env = KeyDoorEnv(Task(task_id="kd", env="key_door", params={**PARAMS, "horizon": 5}))
    assert env.max_turns == 5


def test_potential_along_solve_path():
    env = make()
    values = [env.potential()]
    for a in SOLVE:
        env.step(a)
        values.append(env.potential())
    assert values == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 0.0])  # terminal state: 0


def test_potential_details():
    game = KeyDoorGame(colors=("red", "blue"), target="blue")
    game.act(Action("pickup", "blue"))
    assert game.potential() == pytest.approx(1 / 3)  # right key without inspecting
    game.act(Action("pickup", "red"))
    assert game.potential() == 0.0  # wrong key held
    game.act(Action("inspect"))
    assert game.potential() == pytest.approx(1 / 3)
    truncated = KeyDoorGame(colors=("red", "blue"), target="blue", horizon=1)
    truncated.act(Action("inspect"))
    assert truncated.truncated and truncated.potential() == pytest.approx(1 / 3)  # not terminal
    failed = KeyDoorGame(colors=("red", "blue"), target="blue")
    failed.act(Action("finish"))
    assert failed.potential() == 0.0


def test_shaped_return_telescopes():
    # gamma = 1: sum of r + Φ(s') − Φ(s) equals the base return when Φ(terminal) = 0
    env = make()
    total, phi = 0.0, env.potential()
    for a in SOLVE:
        r = env.step(a)
        total += r.reward + env.potential() - phi
        phi = env.potential()
    assert total == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("inspect", Action("inspect")),
        ("finish", Action("finish")),
        ("pickup_red", Action("pickup", "red")),
        ("PICKUP_RED", Action("pickup", "red")),
        ("pick_up_red", Action("pickup", "red")),
        ("open_green", Action("open", "green")),
        ("open_door_green", Action("open", "green")),
        (
            "I will first inspect the room. Then pickup_blue",
            Action("pickup", "blue"),
        ),  # last counts
        ('{"name": "pickup", "arguments": {"color": "Red"}}', Action("pickup", "red")),
        ('{"name": "open_door", "arguments": {"color": "blue"}}', Action("open", "blue")),
        ('{"name": "inspect", "arguments": {}}', Action("inspect")),
        ('{"name": "finish"}', Action("finish")),
        (
            '<tool_call>\n{"name": "pickup", "arguments": {"colour": "green"}}\n</tool_call>',
            Action("pickup", "green"),
        ),
        (
            '{"name": "pickup", "arguments": "{\\"color\\": \\"red\\"}"}',
            Action("pickup", "red"),
        ),  # string args
        (
            '{"type": "function", "function": {"name": "finish", "arguments": "{}"}}',
            Action("finish"),
        ),
        ('{"name": "pickup_red"}', Action("pickup", "red")),
        # JSON beats bare words, wherever they are
        ('finish {"name": "inspect", "arguments": {}} then open_red', Action("inspect")),
        (
            '{"name": "pickup", "arguments": {"color": "red"}} {"name": "open_door", "arguments": {"color": "red"}}',
            Action("open", "red"),
        ),
        ('{"name": "pickup", "arguments": {}}', Action("pickup", None)),
        ("open_door", Action("open", None)),
    ],
)
def test_parse_json_and_bare(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello there",
        "pickup",
        "{}",
        '{"name": "dance"}',
        "{not json",
        '{"name": 3}',
        "inspection",
        "open the door",
    ],
)
def test_unparseable(text):
    assert parse_action(text) is None


def test_json_and_bare_drive_the_env_identically():
    bare = make()
    tool = make()
    calls = [
        '{"name": "inspect", "arguments": {}}',
        '{"name": "pickup", "arguments": {"color": "blue"}}',
        '{"name": "open_door", "arguments": {"color": "blue"}}',
        '{"name": "finish", "arguments": {}}',
    ]
    a = [bare.step(x) for x in SOLVE]
    b = [tool.step(x) for x in calls]
    assert [(r.messages, r.reward, r.stop_reason) for r in a] == [(r.messages, r.reward, r.stop_reason) for r in b]


def test_invalid_action_continues_by_default():
    env = make()
    r = env.step("I am not sure what to do")
    assert not r.done and r.reward == 0.0 and r.metrics["invalid"] == 1.0
    assert "Invalid action" in r.messages[0]["content"] and "pickup_" in r.messages[0]["content"]
    assert env.game.turns == 1  # it still costs a turn
    r = env.step('{"name": "pickup", "arguments": {}}')  # tool name without its colour
    assert not r.done and r.metrics["invalid"] == 1.0 and "colour" in r.messages[0]["content"]
    rest = [env.step(a) for a in SOLVE]
    assert rest[-1].reward == 1.0


def test_invalid_action_can_end_the_episode():
    env = make(end_on_invalid=True)
    r = env.step("no idea")
    assert r.terminated and r.reward == 0.0 and r.stop_reason == StopReason.MALFORMED and r.messages == []
    assert env.potential() == 0.0


def test_never_raises_on_odd_model_output():
    for text in [
        "{" * 100,
        '{"name": null}',
        '{"name": "pickup", "arguments": [1]}',
        "\x00\x01",
        "open_" * 50,
        "🙂 finish_",
        '{"a":' * 5000,  # deep nesting: json raises RecursionError, which must be caught
        "{" * 10000,
        '{"name": "pickup", "arguments": "' + "[" * 5000 + '"}',  # a nested arguments string: RecursionError
    ]:
        result = make().step(text)  # an unparseable reply is an invalid action: the game goes on
        assert not result.done and result.reward == 0.0 and result.metrics["invalid"] == 1.0, text[:40]
        assert result.messages[0]["content"].startswith("Invalid action."), text[:40]
        ended = make(end_on_invalid=True).step(text)  # ... or ends with the failure reward
        assert ended.stop_reason == StopReason.MALFORMED and ended.reward == KeyDoorEnv.failure_reward, text[:40]


def test_default_tasks_are_deterministic_and_disjoint():
    train = KeyDoorEnv.default_tasks("train")
    eval_ = KeyDoorEnv.default_tasks("eval", horizon=6)
    assert len(train) == 45 and len(eval_) == 15  # C(6,3) colour sets x 3 targets, 25% eval
    assert train == KeyDoorEnv.default_tasks("train")
    key = lambda t: (frozenset(t.params["colors"]), t.params["target"])  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in eval_}
    assert len({t.task_id for t in train + eval_}) == 60
    for t in train + eval_:
        assert t.env == "key_door" and t.params["target"] in t.params["colors"]
        assert len(set(t.params["colors"])) == 3
    assert all(t.split == "eval" for t in eval_)
    assert (
        len(KeyDoorEnv.default_tasks("train", num_colors=2)) + len(KeyDoorEnv.default_tasks("eval", num_colors=2)) == 30
    )
    with pytest.raises(ValueError, match="num_colors"):
        KeyDoorEnv.default_tasks("train", num_colors=9)
    with pytest.raises(ValueError, match="split"):
        KeyDoorEnv.default_tasks("valid")


def test_every_default_task_is_solvable():
    for t in generate_tasks("train") + generate_tasks("eval"):
        env = KeyDoorEnv(t)
        c = t.params["target"]
        results = [env.step(a) for a in ["inspect", f"pickup_{c}", f"open_{c}", "finish"]]
        assert results[-1].reward == 1.0


def test_bad_task_params_are_clear_errors():
    with pytest.raises(ValueError, match="target"):
        KeyDoorEnv(Task(task_id="kd", env="key_door", params={"colors": ["red", "blue"], "target": "pink"}))
    with pytest.raises(ValueError, match="colou?r"):
        KeyDoorEnv(Task(task_id="kd", env="key_door", params={"colors": "red", "target": "red"}))
    with pytest.raises(ValueError, match="horizon"):
        make(horizon=0)
    with pytest.raises(ValueError, match="unknown option"):
        make(horizn=3)


def test_deepcopy_mid_episode_is_independent_and_identical():
    env = make()
    env.step("inspect")
    clone = copy.deepcopy(env)
    a = [env.step(x) for x in SOLVE[1:]]
    b = [clone.step(x) for x in SOLVE[1:]]
    assert [(r.messages, r.reward, r.stop_reason, r.metrics) for r in a] == [
        (r.messages, r.reward, r.stop_reason, r.metrics) for r in b
    ]
    env2 = make()
    env2.step("inspect")
    clone2 = copy.deepcopy(env2)
    clone2.step("pickup_blue")
    assert env2.game.held is None and env2.potential() == pytest.approx(1 / 3)
    assert clone2.potential() == pytest.approx(2 / 3)


# ------------------------------------------------------------------ tool env


def trl_tools(env) -> list[str]:
    """The tools TRL's environment_factory would expose: public methods other than reset/get_reward."""
    return sorted(
        name
        for name, _ in inspect.getmembers(env, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    )


def test_tool_env_exposes_exactly_the_four_tools():
    env = KeyDoorToolEnv()  # the factory is called with no arguments
    assert trl_tools(env) == ["finish", "inspect", "open_door", "pickup"]
    for name in ("inspect", "pickup", "open_door", "finish", "get_reward"):
        assert getattr(KeyDoorToolEnv, name).__doc__
    sig = inspect.signature(KeyDoorToolEnv.pickup)
    assert sig.parameters["color"].annotation in (str, "str")
    assert "Args:" in KeyDoorToolEnv.pickup.__doc__ and "Args:" in KeyDoorToolEnv.open_door.__doc__


def test_tool_env_schemas_build_with_transformers():
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    env = KeyDoorToolEnv()
    schema = get_json_schema(env.pickup)["function"]
    assert schema["name"] == "pickup"
    assert schema["parameters"]["required"] == ["color"]
    assert get_json_schema(env.inspect)["function"]["parameters"]["properties"] == {}


def test_tool_env_reset_tools_and_reward():
    env = KeyDoorToolEnv()
    obs = env.reset(prompt=[{"role": "user", "content": "x"}], task_id="kd", **PARAMS)
    assert isinstance(obs, str) and "red, blue and green" in obs
    assert env.get_reward() == 0.0
    assert "blue door" in env.inspect()
    assert "blue key" in env.pickup("Blue")
    assert "exit" in env.open_door("blue")
    assert env.game.potential() == pytest.approx(1.0)
    assert "escaped" in env.finish()
    assert env.get_reward() == 1.0
    assert key_door_reward([env]) == [1.0]
    with pytest.raises(ValueError, match="Game over"):
        env.inspect()
    # reset starts a fresh episode
    env.reset(**PARAMS)
    assert env.get_reward() == 0.0 and env.game.turns == 0 and not env.game.done


def test_tool_env_wrong_door_and_horizon():
    env = KeyDoorToolEnv()
    env.reset(colors=["red", "blue"], target="blue")
    env.pickup("red")
    assert "not the exit" in env.open_door("red")
    assert env.get_reward() == 0.0 and env.game.stop_reason == StopReason.FAILURE
    env = KeyDoorToolEnv(horizon=2)
    env.reset(**PARAMS)
    env.inspect()
    assert "out of actions" in env.inspect()
    assert env.game.truncated and env.game.stop_reason == StopReason.MAX_TURNS
    with pytest.raises(ValueError):
        env.finish()
    assert env.get_reward() == 0.0


def test_tool_env_reset_from_seed_and_task_dict():
    a, b = KeyDoorToolEnv(), KeyDoorToolEnv()
    assert a.reset(seed=11) == b.reset(seed=11)
    assert a.game.target in a.game.colors
    task = generate_tasks("eval")[0]
    c = KeyDoorToolEnv()
    c.reset(**task.to_dict())
    assert c.game.target == task.params["target"] and list(c.game.colors) == task.params["colors"]


def test_tool_env_shares_the_text_env_state_machine():
    text = make()
    tool = KeyDoorToolEnv()
    tool.reset(**PARAMS)
    assert type(text.game) is type(tool.game) is KeyDoorGame
    pairs = [
        ("inspect", tool.inspect),
        ("pickup_red", lambda: tool.pickup("red")),
        ("open_blue", lambda: tool.open_door("blue")),
    ]
    for word, call in pairs:
        assert text.step(word).messages[0]["content"] == call()


def test_tool_dataset_rows_feed_reset():
    rows = key_door_tool_dataset("train")
    assert len(rows) == 45
    row = rows[0]
    assert row["prompt"][0]["role"] == "user" and row["task_id"].startswith("key_door-train-")
    env = KeyDoorToolEnv()
    env.reset(**row)
    assert env.game.target == row["target"]


def test_tool_env_deepcopy():
    env = KeyDoorToolEnv()
    env.reset(**PARAMS)
    env.inspect()
    clone = copy.deepcopy(env)
    clone.pickup("blue")
    assert env.game.held is None and clone.game.held == "blue"
