"""Hostile input from outside the repository (issue 33), one list per surface, each spelled as an
attacker or a careless user would: task files that name code, servers that answer wrong, adapter
directories that lie, command-line sizes with no end, replies that make a parser crawl or an
observation swell. ``tests/test_hostile_input_cases.py`` runs them; every case must end in one
line naming the file/field/option/server (or, for model text, in a bounded observation), before
anything is imported, allocated or trained on.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import save_file

CANARY_MODULE = "turnrl_canary_mod"
"""A module that, if ever imported, writes the file named by its ``CANARY`` environment variable."""

CANARY_SOURCE = """
import os, pathlib
pathlib.Path(os.environ["TURNRL_CANARY"]).write_text("imported")
class Env:  # would be an environment class, were it ever resolved
    pass
"""

# ---- 1. a task line names the code to import (class 3): refused unread, never imported

ENV_SPELLINGS = [
    f"{CANARY_MODULE}:Env",
    f"{CANARY_MODULE}.sub:Env",
    f"{CANARY_MODULE}:Env:Other",
    CANARY_MODULE,
    f" {CANARY_MODULE}:Env",
    f"{CANARY_MODULE}:Env\n",
    "\uff54urnrl_canary_mod:Env",  # a fullwidth t: NFKC turns it into the canary's name
    f"{CANARY_MODULE}\u200b:Env",  # a zero-width space
    "os:system",
    "builtins:exec",
    "__main__:Env",
    "this:Anything",
    "turnrl.envs.number_guess:NumberGuessEnv",  # the right class, but an import path: only the config names paths
    "NUMBER_GUESS",
    "number_guess ",
    "number\u2010guess",  # a hyphen lookalike
    "slosh_tank",  # a registered environment, not this run's
]


def task_line(env: str, task_id: str = "t0", **extra) -> str:
    return json.dumps({"task_id": task_id, "env": env, "target": 3, **extra})


# ---- 2. task files that break the file rules (class 5): (name, lines, needles)

TASK_FILES = [
    ("duplicate_id", [task_line("number_guess", "a"), task_line("number_guess", "a")], ("t.jsonl:2", "'task_id'", "t.jsonl:1")),  # noqa: E501
    ("duplicate_id_far_apart", [task_line("number_guess", "a"), "", task_line("number_guess", "b"), task_line("number_guess", "a")], ("t.jsonl:4", "first at", "t.jsonl:1")),  # noqa: E501
    ("foreign_env", [task_line("number_guess", "a"), task_line("key_door", "b")], ("t.jsonl:2", "'env'", "'key_door'")),  # noqa: E501
    ("other_split", [task_line("number_guess", "a", split="eval")], ("t.jsonl:1", "'split'", "'eval'", "'train'")),
    ("other_split_second_line", [task_line("number_guess", "a"), task_line("number_guess", "b", split="EVAL")], ("t.jsonl:2", "'split'")),  # noqa: E501
    ("split_smoke_in_train", [task_line("number_guess", "a", split="smoke")], ("t.jsonl:1", "'split'", "'smoke'")),
]  # fmt: skip

# ---- 3. server replies (classes 5, 6, 7): (name, reply spec, needles of the one-line error)


def completion(ids, logprobs=None, as_ints=False, **logprob_fields) -> dict:
    """A vLLM-shaped completions reply: int ids as ``"token_id:N"`` (or JSON ints), other values as they are."""
    spell = (lambda t: t) if as_ints else (lambda t: f"token_id:{t}")
    lps = {"tokens": [spell(t) if isinstance(t, int) and not isinstance(t, bool) else t for t in ids]}
    lps["token_logprobs"] = [-0.5] * len(ids) if logprobs is None else logprobs
    lps["top_logprobs"] = [{f"token_id:{t}": -0.5} if isinstance(t, int) else {} for t in ids]
    lps.update(logprob_fields)
    return {"choices": [{"index": 0, "text": "", "finish_reason": "length", "logprobs": lps}]}


@dataclass
class Reply:
    """What the hostile server sends: a body (JSON value or raw bytes), a status, and optionally one byte at a time."""

    body: object
    status: int = 200
    content_type: str = "application/json"
    trickle_s: float = 0.0

    def data(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode()


VOCAB = 1000
"""The vocabulary of the fake tokenizer the server cases sample with."""

SERVER_CASES = [
    # replies past the request
    ("5001_tokens_for_4", Reply(completion(list(range(5001)))), ("5,001 tokens", "max_tokens=4")),
    ("id_at_vocab_size", Reply(completion([1, VOCAB])), ("token id 1000", "vocabulary")),
    ("id_negative", Reply(completion([-1], as_ints=True)), ("token id -1", "vocabulary")),
    ("id_huge", Reply(completion([10**30])), ("vocabulary",)),
    ("id_int_past_vocab", Reply(completion([3, 10**6], as_ints=True)), ("token id 1000000",)),
    ("id_as_word", Reply(completion(["hello"])), ("as text, not as an id",)),
    ("id_not_digits", Reply(completion(["token_id:12a"])), ("as text, not as an id",)),
    ("id_as_bool", Reply(completion([True])), ("bool", "not a token id")),
    ("id_as_float", Reply(completion([1.5])), ("float", "not a token id")),
    ("logprob_plus_5", Reply(completion([1], [5.0])), ("+5", "above 0")),
    ("logprob_just_above_rounding", Reply(completion([1], [0.01])), ("above 0",)),
    ("logprob_nan", Reply(b'{"choices": [{"finish_reason": "stop", "logprobs": {"tokens": ["token_id:1"], "token_logprobs": [NaN], "top_logprobs": [{}]}}]}'), ("nan", "finite")),  # noqa: E501
    ("logprob_minus_infinity", Reply(b'{"choices": [{"finish_reason": "stop", "logprobs": {"tokens": ["token_id:1"], "token_logprobs": [-Infinity], "top_logprobs": [{}]}}]}'), ("finite",)),  # noqa: E501
    ("logprob_null", Reply(completion([1], [None])), ("NoneType", "not a number")),
    ("logprob_string", Reply(completion([1], ["-0.5"])), ("str", "not a number")),
    ("top_logprob_plus_3", Reply(completion([1], top_logprobs=[{"token_id:1": 3.0}])), ("top_logprobs", "above 0")),
    # lengths that must agree
    ("fewer_logprobs_than_tokens", Reply(completion([1, 2, 3], [-0.5, -0.5])), ("token_logprobs has 2 entries for 3 tokens",)),  # noqa: E501
    ("more_offsets_than_tokens", Reply(completion([1], text_offset=[0, 1, 2])), ("text_offset has 3 entries for 1",)),
    ("top_logprobs_short", Reply(completion([1, 2], top_logprobs=[{}])), ("top_logprobs has 1 entries for 2",)),
    # fields missing or of the wrong type
    ("no_choices", Reply({"object": "text_completion"}), ("has no 'choices'",)),
    ("empty_choices", Reply({"choices": []}), ("empty 'choices'",)),
    ("choices_a_string", Reply({"choices": "x"}), ("choices is str",)),
    ("choice_a_list", Reply({"choices": [[1, 2]]}), ("list", "not a JSON object")),
    ("logprobs_null", Reply({"choices": [{"finish_reason": "stop", "logprobs": None}]}), ("logprobs is NoneType",)),
    ("tokens_a_dict", Reply({"choices": [{"logprobs": {"tokens": {"a": 1}, "token_logprobs": []}}]}), ("tokens is dict",)),  # noqa: E501
    ("finish_reason_number", Reply({**completion([1]), "choices": [{**completion([1])["choices"][0], "finish_reason": 7}]}), ("finish_reason",)),  # noqa: E501
    ("reply_a_json_list", Reply([1, 2, 3]), ("list, not a JSON object",)),
    ("html_page_200", Reply(b"<html><body>502 Bad Gateway</body></html>", content_type="text/html"), ("not JSON", "<html>")),  # noqa: E501
    ("empty_body_200", Reply(b""), ("not JSON",)),
    ("deep_json", Reply(b"[" * 100_000 + b"]" * 100_000), ("nested too deeply",)),
    # HTTP errors
    ("http_400", Reply({"error": {"message": "bad request"}}, status=400), ("HTTP 400", "not retried")),
    ("http_404_html", Reply(b"<html>not found</html>", status=404, content_type="text/html"), ("HTTP 404",)),
    ("http_500", Reply({"error": {"message": "boom"}}, status=500), ("HTTP 500", "after 1 retries")),
    ("http_503_html", Reply(b"<html>busy</html>" * 1000, status=503, content_type="text/html"), ("HTTP 503",)),
    # a reply that never finishes: one byte every 0.2 s, under a 1 s deadline per attempt
    ("trickle", Reply(completion([1, 2]), trickle_s=0.2), ("within sampler.request_timeout=1.0 s",)),
]  # fmt: skip


class HostileServer:
    """An OpenAI-compatible server that answers every completion request with the reply it is given."""

    def __init__(self, replies: list[Reply]):
        self.replies = list(replies)
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(Reply({"object": "list", "data": [{"id": "base"}]}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    reply = server.replies[min(len(server.requests), len(server.replies)) - 1]
                self._send(reply)

            def _send(self, reply: Reply):
                data = reply.data()
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", reply.content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if not reply.trickle_s:
                        self.wfile.write(data)
                        return
                    for i in range(len(data)):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(reply.trickle_s)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what the deadline is for
                    pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_port}/v1"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


class FakeTokenizer:
    """What the OpenAI sampler reads of a tokenizer: its size and its end-of-turn ids."""

    eos_token_id = 2
    unk_token_id = 0

    def __len__(self) -> int:
        return VOCAB

    def convert_tokens_to_ids(self, token: str) -> int:
        return 2


# ---- 4. adapter directories (class 6): (name, how to spoil a valid adapter, needles)

RANK, HIDDEN = 4, 8


def write_adapter(path: Path, **config) -> Path:
    """A small valid LoRA adapter (rank 4 on one 8x8 projection) written with safetensors, no model needed."""
    path.mkdir(parents=True, exist_ok=True)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(RANK, HIDDEN), f"{prefix}.lora_B.weight": torch.zeros(HIDDEN, RANK)},
        str(path / "adapter_model.safetensors"),
    )
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8.0, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM"}
    cfg |= {"loftq_config": {}, "megatron_config": None, "megatron_core": "megatron.core", "rank_pattern": {}}
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def _config(**kw):
    return lambda d: write_adapter(d, **kw)


def _raw_config(text: str):
    return lambda d: (d / "adapter_config.json").write_text(text)


def _safetensors(header: bytes, tail: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + tail


def _weights(data: bytes):
    return lambda d: (d / "adapter_model.safetensors").write_bytes(data)


class _Pickled:
    """A pickle that, unpickled, would write the canary file: proof that nothing reads it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "unpickled"))


@dataclass
class AdapterCase:
    name: str
    spoil: object
    needles: tuple[str, ...]
    pickle_canary: bool = False
    extra: dict = field(default_factory=dict)


def _fifo(name: str):
    import os

    def spoil(d: Path):
        (d / name).unlink()
        os.mkfifo(d / name)

    return spoil


def _link_to(name: str, target: str):
    def spoil(d: Path):
        (d / name).unlink()
        (d / name).symlink_to(target)

    return spoil


ADAPTER_CASES = [
    AdapterCase("r_1e9", _config(r=1e9), ("adapter_config.json", "field r", "4096")),
    AdapterCase("r_zero", _config(r=0), ("field r", "greater than or equal to 1")),
    AdapterCase("r_string", _config(r="4"), ("field r", "must be a number")),
    AdapterCase("r_true", _config(r=True), ("field r", "must be a number")),
    AdapterCase("r_not_the_tensors", _config(r=2), ("adapter_model.safetensors", "shape [4, 8]", "'r'")),
    AdapterCase("rank_pattern_huge", _config(rank_pattern={"q_proj": 10**9}), ("rank_pattern",)),
    AdapterCase("peft_type_unknown", _config(peft_type="NOT_A_PEFT"), ("field peft_type", "'LORA'")),
    AdapterCase("peft_type_other_method", _config(peft_type="PROMPT_TUNING"), ("field peft_type",)),
    AdapterCase("peft_type_missing", _raw_config('{"r": 4, "lora_alpha": 8}'), ("peft_type", "Field required")),
    AdapterCase("alpha_infinite", _raw_config('{"peft_type": "LORA", "r": 4, "lora_alpha": 1e999}'), ("lora_alpha", "finite")),  # noqa: E501
    AdapterCase("alpha_nan", _raw_config('{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}'), ("lora_alpha", "finite")),
    AdapterCase("target_modules_regex", _config(target_modules="(a+)+$"), ("target_modules",)),
    AdapterCase("target_module_with_regex_syntax", _config(target_modules=["q_proj|.*"]), ("target_modules",)),
    AdapterCase("rank_pattern_regex_key", _config(rank_pattern={"(.*)+x": 4}), ("rank_pattern",)),
    AdapterCase("megatron_core_module", _config(megatron_core="os", megatron_config={"x": 1}), ("megatron_core",)),
    AdapterCase("loftq_config_set", _config(loftq_config={"loftq_bits": 4}), ("loftq_config", "sub-configuration")),
    AdapterCase("eva_config_set", _config(eva_config={"rho": 2.0}), ("eva_config",)),
    AdapterCase("layer_replication", _config(layer_replication=[[0, 1]]), ("layer_replication",)),
    AdapterCase("init_pissa", _config(init_lora_weights="pissa"), ("init_lora_weights",)),
    AdapterCase("unknown_key_nested", _config(future_field={"a": {"b": [1, 2]}}), ("future_field", "plain value")),
    AdapterCase("config_a_list", _raw_config("[1, 2, 3]"), ("expected a JSON object",)),
    AdapterCase("config_not_json", _raw_config("{'peft_type': 'LORA'}"), ("not valid JSON",)),
    AdapterCase("config_deep", _raw_config('{"a": ' + "[" * 5000 + "]" * 5000 + "}"), ("larger or deeper",)),
    AdapterCase("config_oversized", _raw_config('{"peft_type": "LORA", "pad": "' + "x" * 100_000 + '"}'), ("bytes", "at most 65,536")),  # noqa: E501
    AdapterCase("config_fifo", _fifo("adapter_config.json"), ("not a regular file",)),
    AdapterCase("config_link_to_dev_zero", _link_to("adapter_config.json", "/dev/zero"), ("not a regular file",)),
    AdapterCase("weights_fifo", _fifo("adapter_model.safetensors"), ("adapter_model.safetensors", "not a regular file")),  # noqa: E501
    AdapterCase("weights_empty", _weights(b""), ("header length",)),
    AdapterCase("header_length_huge", _weights((1 << 62).to_bytes(8, "little") + b"{}"), ("header length",)),
    AdapterCase("header_not_json", _weights((12).to_bytes(8, "little") + b"{not json!!}" + b"\0" * 64), ("not a valid safetensors file",)),  # noqa: E501
    AdapterCase("header_offsets_past_end", _weights(_safetensors(b'{"x.lora_A.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}', b"\0" * 16)), ("not a valid safetensors file",)),  # noqa: E501
    AdapterCase("weights_missing", lambda d: (d / "adapter_model.safetensors").unlink(), ("adapter_model.safetensors", "missing")),  # noqa: E501
    AdapterCase("config_missing", lambda d: (d / "adapter_config.json").unlink(), ("adapter_config.json", "missing")),
    AdapterCase("pickle_only", None, ("adapter_model.bin", "pickle", "not loaded"), pickle_canary=True),
]  # fmt: skip

# ---- 5. command-line sizes (classes 6, 7): (name, argv after the command's positional, needles)

CONFIG = "no-such-config.yaml"
"""Options are checked before the config is read: a case that reached the config would say so."""

CLI_CASES = [
    ("audit_repeats_1e12", ["credit-audit", CONFIG, "--repeats", str(10**12)], ("--repeats", "1000")),
    ("audit_episodes_1e12", ["credit-audit", CONFIG, "--episodes", str(10**12)], ("--episodes", "4096")),
    ("audit_continuations_1e9", ["credit-audit", CONFIG, "--continuations", str(10**9)], ("--continuations", "65536")),
    ("audit_leaves_1e9", ["credit-audit", CONFIG, "--leaves", str(10**9)], ("--leaves", "65536")),
    ("audit_three_at_once", ["credit-audit", CONFIG, "--episodes", "1000000000000", "--continuations", "1000000000", "--leaves", "1000000000"], ("--episodes", "--continuations", "--leaves")),  # noqa: E501
    ("audit_product_past_one_call", ["credit-audit", CONFIG, "--episodes", "4096", "--continuations", "65536"], ("--episodes 4096 x --continuations 65536", "65,536")),  # noqa: E501
    ("audit_repeats_zero", ["credit-audit", CONFIG, "--repeats", "0"], ("--repeats", "greater than or equal to 1")),
    ("audit_continuations_one", ["credit-audit", CONFIG, "--continuations", "1"], ("--continuations",)),
    ("audit_gamma_nan", ["credit-audit", CONFIG, "--gamma", "nan"], ("--gamma", "(got nan)")),
    ("audit_gamma_inf", ["credit-audit", CONFIG, "--gamma", "inf"], ("--gamma",)),
    ("audit_gamma_two", ["credit-audit", CONFIG, "--gamma", "2"], ("--gamma", "less than or equal to 1")),
    ("audit_split_test", ["credit-audit", CONFIG, "--split", "test"], ("--split", "'train' or 'eval'")),
    ("audit_split_newline", ["credit-audit", CONFIG, "--split", "train\n"], ("--split",)),
    ("audit_shapes_huge", ["credit-audit", CONFIG, "--shapes", "2x999999"], ("--shapes",)),
    ("audit_shapes_superscript", ["credit-audit", CONFIG, "--shapes", "\u00b2x4"], ("--shapes", "G1xG2")),
    ("audit_shapes_repeated", ["credit-audit", CONFIG, "--shapes", "2x4,2x4"], ("--shapes", "twice")),
    ("audit_shapes_many", ["credit-audit", CONFIG, "--shapes", ",".join(f"2x{k}" for k in range(2, 40))], ("--shapes",)),  # noqa: E501
    ("audit_shapes_long", ["credit-audit", CONFIG, "--shapes", "2x4," * 10_000], ("--shapes", "characters")),
    ("audit_num_tasks_zero", ["credit-audit", CONFIG, "--num-tasks", "0"], ("--num-tasks",)),
    ("audit_num_tasks_1e12", ["credit-audit", CONFIG, "--num-tasks", str(10**12)], ("--num-tasks",)),
    ("export_iteration_1e11", ["export", "no-run", "--iteration", str(10**11), "--out", "x"], ("--iteration", "<= 10,000")),  # noqa: E501
    ("export_iteration_negative", ["export", "no-run", "--iteration", "-1", "--out", "x"], ("--iteration",)),
    ("rows_limit_1e12", ["rows", "no-run", "--limit", str(10**12)], ("--limit", "<= 100,000")),
    ("eval_max_turns_zero", ["eval", CONFIG, "--max-turns", "0"], ("--max-turns must be >= 1",)),
    ("eval_max_turns_1e9", ["eval", CONFIG, "--max-turns", str(10**9)], ("--max-turns", "<= 65,536")),
    ("eval_iteration_1e11", ["eval", CONFIG, "--run-dir", "r", "--iteration", str(10**11)], ("--iteration",)),
    ("eval_iteration_negative", ["eval", CONFIG, "--run-dir", "r", "--iteration", "-3"], ("--iteration",)),
    ("train_start_iter_1e11", ["train", CONFIG, "--start-iter", str(10**11)], ("--start-iter",)),
    ("train_processes_1e9", ["train", CONFIG, "--processes", str(10**9)], ("--processes", "<= 64")),
]  # fmt: skip

# ---- 6. replies that made a parser crawl or an observation swell (class 7)

HUGE = 500_000
PARSER_TEXTS = [
    "<tool_call>" * 16_000,
    "<tool_call>" * 8_000 + "</tool_call>",
    "</tool_call>" * 16_000,
    "<tool_call>x</tool_call>" * 8_000 + "<tool_call>",
    "<tool_call><tool_call>" + "x" * HUGE + "</tool_call>",
    "<tool_" * 30_000,
    "```" * 60_000,
    "```python" * 20_000,
    "```\n" * 40_000,
]
ECHO_REPLIES = [
    "pickup_" + "a" * HUGE,
    "open_" + "b" * HUGE,
    '{"name": "pickup", "arguments": {"color": "' + "c" * HUGE + '"}}',
    '<tool_call>{"name": "open_door", "arguments": {"color": "' + "d" * HUGE + '"}}</tool_call>',
    '<tool_call>{"name": "' + "e" * HUGE + '", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "pickup", "arguments": {"' + "f" * HUGE + '": 1}}</tool_call>',
    "<answer>" + "9" * HUGE + "</answer>",
    "<probe>" + "g" * HUGE + "</probe>",
]
