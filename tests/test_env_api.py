"""The environment API: async and concurrent steps, tool calling, rubrics, provenance, the record contract.

Environments written here are loaded by ``env.name: test_env_api:Class`` (tests/ is on sys.path),
as a user's own package would be, and train one step each.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from factories import tiny_run_config
from turnrl.chat import ChatTemplate
from turnrl.envs import Env, StepResult, StopReason, Task, get_env_class, make_env
from turnrl.envs.key_door import KeyDoorGame
from turnrl.envs.key_door.env import KeyDoorToolsEnv
from turnrl.envs.rubric import Rubric
from turnrl.envs.tools import ToolCallError, ToolEnv, parse_tool_calls, tool_env_from_factory
from turnrl.integrations.trl_key_door import KeyDoorToolEnv
from turnrl.rollout.collect import RolloutContractError, RolloutSettings, collect
from turnrl.rollout.concurrent import run_concurrently
from turnrl.rundir import RunDir, read_jsonl
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.tracking import read_csv
from turnrl.train.loop import train
from turnrl.types import SOURCES, Sample, SamplingParams, token_sources

PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=0)
HERE = "test_env_api"


# ---- a tinker-style async environment ----------------------------------------------------------
class AsyncEchoEnv(Env):
    """Two turns; every step awaits (a stand-in for a service call). Counts steps in flight."""

    name = f"{HERE}:AsyncEchoEnv"
    max_turns = 2
    in_flight = 0
    max_in_flight = 0

    @classmethod
    def default_tasks(cls, split, **options):
        return [Task(f"async-{split}-{k}", cls.name, {"k": k}, split) for k in range(4)]

    async def initial_messages(self):
        await asyncio.sleep(0)
        return [{"role": "system", "content": "Reply."}, {"role": "user", "content": f"Task {self.task.params['k']}"}]

    async def step(self, action_text: str) -> StepResult:
        cls = type(self)
        cls.in_flight += 1
        cls.max_in_flight = max(cls.max_in_flight, cls.in_flight)
        await asyncio.sleep(0.01)
        cls.in_flight -= 1
        self.turn = getattr(self, "turn", 0) + 1
        if self.turn < 2:
            return StepResult([{"role": "user", "content": "again"}])
        reward = float(len(action_text) % 2)
        return StepResult(
            [], reward=reward, terminated=True, stop_reason=StopReason.SUCCESS if reward else StopReason.FAILURE
        )


# ---- a tool environment: public methods are the tools ------------------------------------------
class CalcToolEnv(ToolEnv):
    """Reach the target with add(); the episode ends when the model stops calling tools."""

    name = f"{HERE}:CalcToolEnv"
    max_turns = 3
    failure_reward = -1.0

    @classmethod
    def default_tasks(cls, split, **options):
        return [Task(f"calc-{split}-{k}", cls.name, {"target": 3 + k}, split) for k in range(4)]

    def reset(self, target: int) -> str:
        self.target, self.total = target, 0
        return f"Reach {target} starting from 0."

    def add(self, x: int) -> str:
        """
        Add a number to the running total.

        Args:
            x: The number to add.
        """
        if not isinstance(x, int):
            raise ValueError("x must be an integer")
        self.total += x
        return f"total = {self.total}"

    def get_reward(self) -> float:  # partial credit from the final answer, so a random model's rewards vary
        return 1.0 if self.total == self.target else 0.1 * (len(self.final_text or "") % 3)

    def state_key(self):
        return self.total


def _scripted(tokenizer, policy):
    return ScriptedSampler(policy, tokenizer)


def _config(tmp_path, name, env, **sections):
    return tiny_run_config(tmp_path, name, env, **sections)


def _trained_one_step(tmp_path, name) -> dict:
    rows = read_csv(tmp_path / name / "progress" / "train.csv")
    assert len(rows) == 1 and rows[0]["num_tokens"] > 0 and rows[0]["grad_norm"] > 0
    return rows[0]


def _episodes(tmp_path, name):
    return read_jsonl(RunDir(tmp_path / name).train_rollouts(0))


def test_env_classes_load_by_module_path():
    assert get_env_class(f"{HERE}:AsyncEchoEnv") is AsyncEchoEnv
    assert get_env_class(f"{HERE}:CalcToolEnv") is CalcToolEnv
    assert get_env_class("key_door_tools") is KeyDoorToolsEnv


def test_async_env_trains_one_step(tmp_path):
    AsyncEchoEnv.max_in_flight = 0
    # groups of 4: a reward (the reply's parity) that varies within some group, whatever the draws
    train(_config(tmp_path, "async", AsyncEchoEnv.name, rollout={"group_size": 4}, train={"micro_batch_size": 8}))
    _trained_one_step(tmp_path, "async")
    assert AsyncEchoEnv.max_in_flight == 8  # the 2 tasks × 4 episodes stepped together, not one by one
    assert [ep.num_turns for ep in _episodes(tmp_path, "async")] == [2] * 8


def test_tool_env_trains_one_step(tmp_path):
    train(_config(tmp_path, "tools", CalcToolEnv.name))
    _trained_one_step(tmp_path, "tools")
    eps = _episodes(tmp_path, "tools")  # the random tiny model writes no tool call: one turn, final answer
    assert {ep.stop_reason for ep in eps} <= {"failure", "success", "malformed"} and all(
        ep.num_turns >= 1 for ep in eps
    )


def test_plain_env_steps_run_concurrently(tokenizer):
    """Four plain steps meet at a barrier: it only opens when all four run at the same time."""
    barrier = threading.Barrier(4, timeout=20)

    class BarrierEnv(Env):
        name = "barrier"

        def initial_messages(self):
            return [{"role": "user", "content": "hi"}]

        def step(self, action_text):
            barrier.wait()
            return StepResult([], reward=1.0, terminated=True, stop_reason=StopReason.SUCCESS)

    from turnrl.envs import ENV_REGISTRY, register_env

    register_env("barrier", BarrierEnv)
    try:
        eps = collect(
            [Task("b", "barrier")],
            _scripted(tokenizer, lambda m: "ok"),
            ChatTemplate(tokenizer),
            PARAMS,
            [4],
            RolloutSettings(env_workers=4),
        )
    finally:
        del ENV_REGISTRY["barrier"]
    assert [e.reward for e in eps] == [1.0] * 4


def test_run_concurrently_keeps_order_and_raises_after_all():
    async def double(x):
        await asyncio.sleep(0.001 * (3 - x))
        return 2 * x

    calls = [lambda: 1, lambda: double(2), lambda: 3]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        assert run_concurrently(calls, pool) == [1, 4, 3]
        done = []

        def boom():
            raise KeyError("x")

        with pytest.raises(KeyError):
            run_concurrently([boom, lambda: done.append(1)], pool)
        assert done == [1]


# ---- tool calls --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, calls",
    [
        ('<tool_call>{"name": "add", "arguments": {"x": 2}}</tool_call>', [("add", {"x": 2})]),
        (
            'think first\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>{"name": "b"}</tool_call>',  # noqa: E501
            [("a", {}), ("b", {})],
        ),
        ('{"name": "add", "arguments": "{\\"x\\": 1}"}', [("add", {"x": 1})]),  # OpenAI-style string arguments
        ('Sure: {"name": "add", "parameters": {"x": 5}} done', [("add", {"x": 5})]),
        ("no call here {not json}", []),
        ('{"x": 1}', []),  # JSON without a name is not a call
    ],
)
def test_parse_tool_calls(text, calls):
    assert parse_tool_calls(text) == calls


@pytest.mark.parametrize(
    "text, match",
    [
        ('<tool_call>{"name": "add", "arguments": {"x": 2}}', "not closed"),
        ("<tool_call>{name: add}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        ('<tool_call>{"name": "add", "arguments": "{bad"}</tool_call>', "not valid JSON"),
    ],
)
def test_malformed_tool_calls_raise(text, match):
    with pytest.raises(ToolCallError, match=match):
        parse_tool_calls(text)


def test_tool_env_schema_replies_and_ends():
    env = CalcToolEnv(Task("c", CalcToolEnv.name, {"target": 3}))
    (schema,) = env.tools()
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["x"]["type"] == "integer"
    opening = env.initial_messages()
    assert "add(x)" in opening[0]["content"] and opening[-1]["content"] == "Reach 3 starting from 0."
    r = env.step('<tool_call>{"name": "add", "arguments": {"x": 2}}</tool_call>')
    assert r.messages == [{"role": "tool", "name": "add", "content": "total = 2"}] and not r.done
    assert r.assistant_message["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"x": 2}}}
    ]
    r = env.step('<tool_call>{"name": "add", "arguments": {"x": "1"}}</tool_call>')  # the tool raises: its reply
    assert r.messages[0]["content"] == "Error: x must be an integer" and not r.done
    r = env.step("I am done.")  # no tool call: the final answer
    assert r.terminated and r.stop_reason == StopReason.SUCCESS and r.reward == pytest.approx(0.1)  # len 10 % 3
    assert env.final_text == "I am done."


@pytest.mark.parametrize(
    "reply",
    [
        '<tool_call>{"name": "mul", "arguments": {"x": 2}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"y": 2}}</tool_call>',
        "<tool_call>{oops</tool_call>",
    ],
)
def test_malformed_call_gets_the_env_failure_reward(reply):
    env = CalcToolEnv(Task("c", CalcToolEnv.name, {"target": 3}))
    env.initial_messages()
    r = env.step(reply)
    assert r.terminated and r.stop_reason == StopReason.MALFORMED and r.reward == -1.0 and r.messages == []


def test_tool_env_turn_limit_truncates():
    env = CalcToolEnv(Task("c", CalcToolEnv.name, {"target": 30}))
    env.initial_messages()
    call = '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>'
    results = [env.step(call) for _ in range(3)]
    assert results[-1].truncated and results[-1].stop_reason == StopReason.MAX_TURNS


def _key_door_policy(task: Task):
    """Scripted tool calls that win: inspect, pick up the exit's key, open its door, finish."""
    target = task.params["target"]
    plan = [("inspect", {}), ("pickup", {"color": target}), ("open_door", {"color": target}), ("finish", {})]

    def policy(messages):
        k = sum(m["role"] == "assistant" for m in messages)
        name, args = plan[k]
        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    return policy


@pytest.mark.parametrize("which", ["native", "factory"])
def test_key_door_tool_form_is_won_by_tool_calls(tokenizer, which):
    from turnrl.envs import ENV_REGISTRY, register_env

    task = KeyDoorToolsEnv.default_tasks("train")[0]
    if which == "factory":  # TRL's environment_factory class itself, in turnrl's collector
        cls = tool_env_from_factory(KeyDoorToolEnv, name="kd_factory", max_turns=8, done=lambda t: t.game.done)
        register_env("kd_factory", cls)
        task = Task(task.task_id, "kd_factory", task.params)
    try:
        (ep,) = collect([task], _scripted(tokenizer, _key_door_policy(task)), ChatTemplate(tokenizer), PARAMS, [1])
    finally:
        ENV_REGISTRY.pop("kd_factory", None)
    assert ep.stop_reason == StopReason.SUCCESS and ep.reward == 1.0 and ep.num_turns == 4
    sources = token_sources(ep.turns[-1])
    assert "tool" in sources and set(sources) <= set(SOURCES)
    if which == "native":
        assert [t.state_key for t in ep.turns][:2] == ["[false,null,null]", "[true,null,null]"]


def test_key_door_tools_state_key_and_potential_match_the_game():
    task = KeyDoorToolsEnv.default_tasks("eval")[1]
    env = make_env(task)
    game = KeyDoorGame(**{k: v for k, v in task.params.items() if k in ("colors", "target")})
    assert env.state_key() == game.visible_state() and env.potential() == game.potential()
    assert {t["function"]["name"] for t in env.tools()} == {"inspect", "pickup", "open_door", "finish"}


# ---- chat template: tools= and provenance --------------------------------------------------------
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"  # noqa: E501
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_reach_the_chat_template(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    chat = ChatTemplate(tok)
    env = CalcToolEnv(Task("c", CalcToolEnv.name, {"target": 3}))
    messages = env.initial_messages()
    text = tok.decode(chat.initial(messages, env.tools()))
    assert "TOOLS add" in text and "TOOLS" not in tok.decode(chat.initial(messages))


def test_provenance_runs_cover_each_message(tokenizer):
    chat = ChatTemplate(tokenizer)
    messages = [{"role": "system", "content": "S" * 5}, {"role": "user", "content": "hello there"}]
    ids, runs = chat.initial_with_sources(messages)
    assert sum(n for _, n in runs) == len(ids)
    assert [s for s, _ in runs] == ["system", "user", "assistant"]  # the generation prompt opens the assistant turn
    user = ids[runs[0][1] : runs[0][1] + runs[1][1]]
    assert "hello there" in tokenizer.decode(user)
    action = tokenizer("hi", add_special_tokens=False).input_ids + [chat.eot_ids[-1]]
    history = messages + [{"role": "assistant", "content": "hi"}]
    reply = [{"role": "tool", "name": "add", "content": "total = 2"}, {"role": "user", "content": "go on"}]
    new, new_runs = chat.extend_with_sources(ids, runs, action, history, reply)
    assert new == chat.extend(ids, action, history, reply)
    flat = [s for s, n in new_runs for _ in range(n)]
    assert len(flat) == len(new) and flat[len(ids) : len(ids) + len(action)] == ["assistant"] * len(action)
    tool_tokens = [t for t, s in zip(new, flat, strict=True) if s == "tool"]
    assert "total = 2" in tokenizer.decode(tool_tokens)


# ---- rubric and the group hook ---------------------------------------------------------------------
class RubricEnv(Env):
    name = f"{HERE}:RubricEnv"
    rubric = Rubric(
        [
            ("length", lambda completion: float(len(completion) % 3), 1.0),
            ("has_a", lambda completion: float("a" in completion), 0.5),
        ],
        group=[("rank", lambda episodes: [float(i == 0) for i in range(len(episodes))], 2.0)],
    )

    def initial_messages(self):
        return [{"role": "user", "content": "Say something."}]

    def step(self, action_text):
        reward, metrics = self.rubric.score(completion=action_text, unused=1)
        return StepResult([], reward=reward, terminated=True, stop_reason=StopReason.FAILURE, metrics=metrics)

    @classmethod
    def group_rewards(cls, episodes):
        return cls.rubric.score_group(episodes)


def test_rubric_weights_metrics_and_group_reward(tokenizer):
    from turnrl.credit import reward_metrics
    from turnrl.envs import ENV_REGISTRY, register_env

    register_env("rubric", RubricEnv)
    replies = iter(["aaaa", "bb", "c", "dddd"])
    try:
        eps = collect(
            [Task("r", "rubric")], _scripted(tokenizer, lambda m: next(replies)), ChatTemplate(tokenizer), PARAMS, [4]
        )
    finally:
        del ENV_REGISTRY["rubric"]
    # "aaaa": length 4 % 3 = 1, has_a 1 → 1 + 0.5 = 1.5, plus the group rank bonus 2 × 1 for the first
    assert [e.reward for e in eps] == [3.5, 2.0, 1.0, 1.0]
    assert [e.metrics["reward/length"] for e in eps] == [1.0, 2.0, 1.0, 1.0]
    assert [e.metrics["reward/group"] for e in eps] == [2.0, 0.0, 0.0, 0.0]
    m = reward_metrics(eps)
    assert m["reward/has_a"] == 0.25 and m["reward/rank"] == 0.25 and m["reward/length"] == 1.25


class GroupRaisesEnv(RubricEnv):
    name = f"{HERE}:GroupRaisesEnv"

    @classmethod
    def group_rewards(cls, episodes):
        return [1.0 / len(ep.turns[-1].action_text.strip("x")) for ep in episodes]  # "xx": ZeroDivisionError


def test_a_group_reward_that_raises_on_model_output_costs_the_group_its_bonus_not_the_run(tokenizer, caplog):
    from turnrl.envs import ENV_REGISTRY, register_env

    register_env("group_raises", GroupRaisesEnv)
    replies = iter(["aaaa", "xx", "c", "dd"])  # two groups of two: the first group's "xx" makes the hook raise
    try:
        eps = collect(
            [Task("r", "group_raises"), Task("s", "group_raises")],
            _scripted(tokenizer, lambda m: next(replies)), ChatTemplate(tokenizer), PARAMS, [2],
        )  # fmt: skip
    finally:
        del ENV_REGISTRY["group_raises"]
    assert [e.reward for e in eps] == [1.5, 2.0, 1.0 + 1.0, 2.0 + 0.5]  # own rubric rewards; only group 2 has a bonus
    assert [e.metrics.get("group_reward_error") for e in eps] == [1.0, 1.0, None, None]
    assert "reward/group" not in eps[0].metrics and eps[2].metrics["reward/group"] == 1.0
    assert any("raised ZeroDivisionError on a group of episodes" in r.getMessage() for r in caplog.records)


def test_rubric_rejects_bad_entries():
    with pytest.raises(ValueError, match="unique"):
        Rubric([("a", len), ("a", len)])
    with pytest.raises(ValueError, match="not finite"):
        Rubric([("nan", lambda: float("nan"))]).score()


# ---- the record contract on every collected episode ------------------------------------------------
class BadSampler(ScriptedSampler):
    def sample(self, contexts, params, messages=None):
        return [Sample(ids=[5, 6], logprobs=[-0.1, 0.3], finish_reason="stop", text="x") for _ in contexts]


def test_contract_violation_stops_collection_with_the_episode_id(tokenizer):
    task = Task("t", "number_guess", {"target": 3})
    with pytest.raises(RolloutContractError, match=r"episode g0-e0-0: turn 0: 1 log-probs not finite or > 0"):
        collect([task], BadSampler(lambda m: "x", tokenizer), ChatTemplate(tokenizer), PARAMS, [1])


def test_collected_turns_record_state_keys_and_provenance(tokenizer):
    guesses = iter(["<answer>10</answer>", "<answer>15</answer>", "<answer>12</answer>"])
    (ep,) = collect(
        [Task("t", "number_guess", {"target": 12})],
        _scripted(tokenizer, lambda m: next(guesses)),
        ChatTemplate(tokenizer),
        PARAMS,
        [1],
    )
    assert [t.state_key for t in ep.turns] == ["[1,20]", "[11,20]", "[11,14]"]
    for t in ep.turns:
        assert sum(n for _, n in t.prompt_sources) == len(t.prompt_ids)
    assert ep.validate() == []


# ---- course toolkit: macro-action log-probs and semantic actions ---------------------------------
def test_macro_and_semantic_action_probabilities(tiny_model, tokenizer):
    import math

    import torch

    from turnrl.envs.number_guess import parse_guess
    from turnrl.sampling.hf import HFSampler
    from turnrl.train.actions import (
        action_logprobs,
        macro_logprob,
        semantic_action_distribution,
        semantic_action_prob,
        sequence_logprobs,
    )

    chat = ChatTemplate(tokenizer)
    ctx = chat.initial([{"role": "user", "content": "Guess a number."}])
    cont = [tokenizer.encode("<answer>7</answer>", add_special_tokens=False) + [chat.eot_ids[-1]], [42, 43]]
    with torch.no_grad():  # by hand: one forward of the whole sequence, log-softmax, sum over the continuation
        by_hand = []
        for c in cont:
            logits = tiny_model(torch.tensor([ctx + c])).logits[0].float()
            lp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
            by_hand.append(float(lp.gather(-1, torch.tensor(c)[:, None]).sum()))
    assert sequence_logprobs(tiny_model, ctx, cont, pad_id=chat.pad_id) == pytest.approx(by_hand, abs=1e-4)

    # a sampled turn's macro-action log-prob (sampler's record) = the model's sequence log-prob of it
    (ep,) = collect(
        [Task("t", "number_guess", {"target": 3})],
        HFSampler(tiny_model, tokenizer, batch_size=4),
        chat,
        SamplingParams(temperature=1.0, max_tokens=5, seed=1),
        [1],
    )
    turn = ep.turns[0]
    (model_lp,) = sequence_logprobs(tiny_model, turn.prompt_ids, [turn.action_ids], pad_id=chat.pad_id)
    assert macro_logprob(turn) == pytest.approx(model_lp, abs=1e-3)

    strings = ["<answer>7</answer>", "<answer> 7 </answer>", "<answer>7</answer>"]  # the repeat counts once
    lps = action_logprobs(tiny_model, chat, ctx, strings[:2])
    assert semantic_action_prob(tiny_model, chat, ctx, strings) == pytest.approx(sum(math.exp(v) for v in lps))
    dist = semantic_action_distribution(tiny_model, chat, ctx, strings + ["<answer>8</answer>", "eight"], parse_guess)
    assert set(dist) == {7, 8} and dist[7] == pytest.approx(sum(math.exp(v) for v in lps))
