"""Hostile input from outside (issue 33): task files, server replies, adapters, command-line sizes, replies
that make a parser crawl or an observation swell. The cases are in ``tests/hostile/input_cases.py``; each
must end in one line naming the culprit (exit 2, no traceback) before anything is imported, allocated or
trained on. ``tests/test_unprivileged.py`` runs this file again as an ordinary user.

The mechanisms under test: :func:`turnrl.tasks.check_task_file` (task files name the config's environment,
compared by name, never imported), :mod:`turnrl.sampling.replies` and the sampler's one deadline per attempt,
:mod:`turnrl.adapterfile`, the bounded options (``AuditSettings``, typer ranges), the linear scans
:func:`turnrl.envs.tools.tool_call_blocks` and :func:`turnrl.envs.slosh_tank.extract.fenced_blocks`, and
:func:`turnrl.envs.base.echo`.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import random
import re
import sys

import pytest
import yaml
from typer.testing import CliRunner

from hostile.input_cases import (
    ADAPTER_CASES,
    CANARY_MODULE,
    CANARY_SOURCE,
    CLI_CASES,
    ECHO_REPLIES,
    ENV_SPELLINGS,
    HUGE,
    PARSER_TEXTS,
    SERVER_CASES,
    TASK_FILES,
    VOCAB,
    FakeTokenizer,
    HostileServer,
    Reply,
    _Pickled,
    completion,
    task_line,
    write_adapter,
)
from turnrl.adapterfile import check_adapter_dir
from turnrl.cli import app
from turnrl.envs import ENV_REGISTRY, Task, get_env_class, tasks_from_file
from turnrl.envs.base import ECHO_CHARS
from turnrl.envs.slosh_tank.extract import extract_code, fenced_blocks
from turnrl.envs.tools import ToolEnv, parse_tool_calls, tool_call_blocks
from turnrl.sampling.openai import OpenAISampler, OpenAISamplerParams
from turnrl.sampling.replies import ServerError
from turnrl.types import SamplingParams

MESSAGE_LIMIT = 1500


def _invoke(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out[-2000:], result.exception)
    assert "Traceback" not in out, out[-2000:]
    assert len(out) < MESSAGE_LIMIT, f"{len(out)} characters: {out[:300]}"
    return " ".join(out.split())


def _config(tmp_path, **sections) -> str:
    data = {
        "run_name": "r",
        "model": {"name": "tiny"},
        "env": {"name": "number_guess"},
        "sampler": {"max_tokens": 4},
        "rollout": {"tasks_per_step": 1, "group_size": 2},
        "train": {"steps": 1, "lr": 1e-3},
        "eval": {"before": False},
        "data": {"num_eval_tasks": 1},
        "tracking": {"backends": ["csv"], "plots": False, "report": False},
        "paths": {"output_dir": str(tmp_path / "runs")},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ---- 1. a task line cannot choose what is imported


@pytest.fixture()
def canary(tmp_path, monkeypatch):
    """A module on sys.path that writes ``tmp_path/imported`` when imported; yields that file."""
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{CANARY_MODULE}.py").write_text(CANARY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    monkeypatch.setenv("TURNRL_CANARY", str(tmp_path / "imported"))
    assert importlib.util.find_spec(CANARY_MODULE) is not None  # an import would find it: the check can fail
    yield tmp_path / "imported"
    sys.modules.pop(CANARY_MODULE, None)


@pytest.mark.parametrize("env", ENV_SPELLINGS, ids=lambda e: ascii(e)[1:-1][:40])
def test_a_task_line_cannot_choose_code(env, tmp_path, canary):
    (tmp_path / "t.jsonl").write_text(task_line(env) + "\n")
    cfg = _config(tmp_path)
    out = _invoke(["eval", cfg, "--tasks", str(tmp_path / "t.jsonl")])
    assert "t.jsonl:1" in out and "field 'env'" in out and "env.name" in out, out
    assert not canary.exists() and CANARY_MODULE not in sys.modules


@pytest.mark.parametrize("env", ENV_SPELLINGS[:4] + ["this:Anything"], ids=lambda e: ascii(e)[1:-1][:40])
def test_a_train_file_cannot_choose_code(env, tmp_path, canary):
    (tmp_path / "t.jsonl").write_text(task_line("number_guess", "ok") + "\n" + task_line(env, "bad") + "\n")
    out = _invoke(["train", _config(tmp_path, data={"train_file": str(tmp_path / "t.jsonl")})])
    assert "t.jsonl:2" in out and "field 'env'" in out, out
    assert not canary.exists() and CANARY_MODULE not in sys.modules
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.csv"))


def test_task_files_name_the_environment_by_the_configs_name_or_its_registered_one(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(task_line("number_guess", "a") + "\n" + task_line("number_guess", "b", split="train") + "\n")
    by_path = tasks_from_file("turnrl.envs.number_guess:NumberGuessEnv", path, "train")  # config: an import path
    assert [t.env for t in by_path] == ["turnrl.envs.number_guess:NumberGuessEnv"] * 2  # each names env.name now
    assert [t.task_id for t in tasks_from_file("number_guess", path, "train")] == ["a", "b"]


# ---- 2. task files that break the file rules


@pytest.mark.parametrize("case", TASK_FILES, ids=lambda c: c[0])
def test_task_file_rules(case, tmp_path):
    _, lines, needles = case
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    out = _invoke(["train", _config(tmp_path, data={"train_file": str(tmp_path / "t.jsonl")})])
    for needle in needles:
        assert needle in out, (needle, out)


def test_an_eval_file_of_train_lines_is_refused(tmp_path):
    (tmp_path / "t.jsonl").write_text(task_line("number_guess", "a", split="train") + "\n")
    out = _invoke(["eval", _config(tmp_path), "--tasks", str(tmp_path / "t.jsonl")])
    assert "t.jsonl:1" in out and "'split'" in out and "'eval'" in out, out


# ---- 3. server replies


def _sampler(url: str, **kw) -> OpenAISampler:
    params = {"base_url": url, "served_model": "base", "retries": 1, "retry_backoff": 0.01, "request_timeout": 5.0}
    return OpenAISampler(None, FakeTokenizer(), OpenAISamplerParams(**{**params, **kw}), stale=True)


@pytest.mark.parametrize("case", SERVER_CASES, ids=lambda c: c[0])
def test_a_wrong_server_reply_is_one_error_naming_the_server(case):
    name, reply, needles = case
    server = HostileServer([reply])
    trickle = reply.trickle_s > 0
    try:
        sampler = _sampler(server.url, **({"request_timeout": 1.0, "retries": 0} if trickle else {}))
        with pytest.raises(ServerError) as err:
            sampler.sample([[5]], SamplingParams(max_tokens=4, top_k_logprobs=1))
    finally:
        server.close()
    text = str(err.value)
    assert f"sampler.base_url={server.url}" in text and "\n" not in text and len(text) < MESSAGE_LIMIT, text
    for needle in needles:
        assert needle in text, (needle, text)
    retried = not trickle and reply.status not in (400, 404)
    assert len(server.requests) == (2 if retried else 1), len(server.requests)  # retries=1 where it may help


def test_a_bad_reply_then_a_good_one_is_retried_and_rounding_reads_as_zero():
    server = HostileServer([Reply(completion([1], [5.0])), Reply(completion([7, 8], [0.0004, -0.25]))])
    try:
        sample = _sampler(server.url).sample([[5]], SamplingParams(max_tokens=4, top_k_logprobs=1))[0]
    finally:
        server.close()
    assert sample.ids == [7, 8] and sample.logprobs == [0.0, -0.25] and len(server.requests) == 2


def test_eval_against_a_wrong_server_is_one_line(tmp_path):
    server = HostileServer([Reply(completion([10**6]))])  # past the real tokenizer's 49,152 ids
    try:
        sampler = {"backend": "openai", "base_url": server.url, "served_model": "base", "retries": 0, "max_tokens": 4}
        out = _invoke(["eval", _config(tmp_path, sampler=sampler)])
    finally:
        server.close()
    assert out.startswith("error:") and f"sampler.base_url={server.url}" in out and "vocabulary" in out, out


# ---- 4. adapter directories


@pytest.mark.parametrize("case", ADAPTER_CASES, ids=lambda c: c.name)
def test_a_bad_adapter_is_one_line_naming_the_file(case, tmp_path):
    adapter = write_adapter(tmp_path / "ad")
    check_adapter_dir(adapter)  # the unspoilt adapter passes: what fails below is the spoiling
    canary = tmp_path / "unpickled"
    if case.pickle_canary:
        (adapter / "adapter_model.safetensors").unlink()
        (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Pickled(str(canary))))
    else:
        case.spoil(adapter)
    out = _invoke(["eval", _config(tmp_path), "--adapter", str(adapter)])
    assert out.startswith("error:") and str(tmp_path / "ad") in out, out
    for needle in case.needles:
        assert needle in out, (needle, out)
    assert not canary.exists()


def test_the_pickle_canary_would_fire_if_unpickled(tmp_path):
    pickle.loads(pickle.dumps(_Pickled(str(tmp_path / "c"))))  # noqa: S301 - our own payload, to prove the test
    assert (tmp_path / "c").read_text() == "unpickled"


def test_audit_and_run_dir_adapters_are_checked_the_same_way(tmp_path):
    adapter = write_adapter(tmp_path / "ad", r=10**9)
    out = _invoke(["credit-audit", _config(tmp_path), "--adapter", str(adapter), "--out", str(tmp_path / "o")])
    assert "field r" in out, out
    run = tmp_path / "run"
    write_adapter(run / "adapters" / "iter_000", peft_type="IA3")
    out = _invoke(["eval", _config(tmp_path), "--run-dir", str(run), "--iteration", "0"])
    assert "iter_000" in out and "peft_type" in out, out


# ---- 5. command-line sizes


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c[0])
def test_an_option_past_its_bound_fails_before_anything_is_read(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name, args, needles = case
    out = _invoke(args)
    assert out.startswith("error:") and out.count("error:") == 1, out  # one line, not a usage box
    for needle in needles:
        assert needle in out, (needle, out)
    assert "no-such-config" not in out and "no-run" not in out  # refused before the config or run was read


def test_the_bounds_are_in_the_help(tmp_path):
    result = CliRunner().invoke(app, ["credit-audit", "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    assert "1..4,096" in text and "1..1,000" in text and "N x M <= 65,536" in text, text


# ---- 6. linear scans; bounded echoes


class _Spy(str):
    """A text that counts what ``find`` looks at: the characters from each search's start to where it stopped."""

    def find(self, sub, start=0, end=None):  # noqa: D102
        stop = len(self) if end is None else end
        hit = str.find(self, sub, start, stop)
        self.scanned += (hit + len(sub) if hit != -1 else stop) - start
        self.calls += 1
        return hit


def _spy(text: str) -> _Spy:
    spy = _Spy(text)
    spy.scanned = spy.calls = 0
    return spy


@pytest.mark.parametrize("text", PARSER_TEXTS, ids=lambda t: ascii(t[:24]))
def test_tool_call_blocks_scan_each_character_at_most_three_times(text):
    spy = _spy(text)
    try:
        tool_call_blocks(spy)
    except ValueError:
        pass
    assert spy.scanned <= 3 * len(text) + 12 * spy.calls, (spy.scanned, len(text))
    assert spy.calls <= 3 * text.count("<tool_call>") + 1  # one search per opening, closing and check
    if "<tool_call>" in text:  # every opening in these texts lacks its closing
        with pytest.raises(ValueError, match="not closed"):
            parse_tool_calls(text)
    else:
        assert parse_tool_calls(text) == []


@pytest.mark.parametrize("text", PARSER_TEXTS, ids=lambda t: ascii(t[:24]))
def test_fenced_blocks_scan_each_character_at_most_three_times(text):
    spy = _spy(text)
    fenced_blocks(spy)
    assert spy.scanned <= 3 * len(text) + 3 * spy.calls, (spy.scanned, len(text))
    assert spy.calls <= 3 * text.count("```") + 1
    assert extract_code(text, "policy") is None


_OLD_TOOL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OLD_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def test_the_scans_agree_with_the_regular_expressions_they_replace():
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "x", "{}", "\n", "```", "```py", " ", "`", "<tool_"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        old = _OLD_TOOL_RE.findall(text)
        if text.count("<tool_call>") != len(old):
            with pytest.raises(ValueError, match="not closed"):
                tool_call_blocks(text)
        else:
            assert tool_call_blocks(text) == old, text
        assert fenced_blocks(text) == _OLD_FENCE.findall(text), text


def _env_cases():
    for name in sorted(ENV_REGISTRY):
        if name == "slosh_tank":
            continue  # its replies are programs run in the sandbox; their output is clipped (tests/test_slosh_tank.py)
        yield name


def _fresh_env(name: str):
    cls = get_env_class(name)
    task = Task("m", "math", {"question": "1 + 1?", "answer": "2"}) if name == "math" else cls.default_tasks("train")[0]
    env = cls(task)
    env.initial_messages()
    return env


@pytest.mark.parametrize("name", list(_env_cases()))
def test_observations_bound_what_they_echo(name):
    for reply in ECHO_REPLIES:
        result = _fresh_env(name).step(reply)
        for message in result.messages:
            content = str(message.get("content", ""))
            assert len(content) < 4 * ECHO_CHARS + 1000, (name, reply[:40], len(content))
        error = (result.assistant_message or {}).get("error", "")
        assert len(str(error)) < 4 * ECHO_CHARS + 1000, (name, reply[:40], len(str(error)))


def test_key_door_says_what_it_cut():
    result = _fresh_env("key_door").step("pickup_" + "a" * HUGE)
    text = result.messages[0]["content"]
    assert "There is no aaaa" in text and f"{HUGE - 40:,} more characters" in text, text


def test_a_tool_that_repeats_its_argument_is_cut():
    class Echo(ToolEnv):
        name = "echo"

        def reset(self, **params):
            return "say something"

        def say(self, text: str) -> str:
            """
            Repeat the text.

            Args:
                text: what to repeat.
            """
            return text

    env = Echo(Task("e", "echo"))
    env.initial_messages()
    call = json.dumps({"name": "say", "arguments": {"text": "z" * HUGE}})
    reply = env.step(f"<tool_call>{call}</tool_call>").messages[0]["content"]
    assert len(reply) < Echo.max_reply_chars + 100 and "more characters" in reply


def test_llama_cpp_replies_are_checked_too():
    good = {"tokens": [7], "stop_type": "eos", "completion_probabilities": [{"id": 7, "prob": 0.5, "top_probs": []}]}
    cases = [
        ({"tokens": list(range(10)), "completion_probabilities": []}, "10 tokens for a request of n_predict=4"),
        ({**good, "tokens": [VOCAB + 5]}, "outside the vocabulary"),
        ({**good, "completion_probabilities": [{"id": 7, "prob": 1.5, "top_probs": []}]}, "not a probability"),
        ({**good, "completion_probabilities": "x"}, "completion_probabilities"),
        ({"completion_probabilities": []}, "has no 'tokens'"),
    ]
    params = SamplingParams(temperature=0.7, max_tokens=4)
    for body, needle in cases:
        server = HostileServer([Reply(body)])
        try:
            with pytest.raises(ServerError, match=re.escape(needle)):
                _sampler(server.url, server="llama_cpp", retries=0).sample([[5]], params)
        finally:
            server.close()
    server = HostileServer([Reply(good)])
    try:
        sample = _sampler(server.url, server="llama_cpp").sample([[5]], params)[0]
    finally:
        server.close()
    assert (
        sample.ids == [7] and sample.logprobs == [pytest.approx(-0.6931, abs=1e-4)] and sample.finish_reason == "stop"
    )
