"""What an OpenAI-compatible server's reply must be, checked against the request that asked for it.

A reply is input from another program: it is trained on only when it is one the request can
have produced. :func:`parse_choice` (vLLM's completions shape, and llama-server's
``completion_probabilities``) refuses, with one :class:`BadReply` line saying what is wrong:

* a missing field or one of the wrong JSON type (an HTML page, a reply without ``choices``,
  ``token_logprobs`` that is not a list, a token id that is a string or a boolean);
* more tokens than the request's ``max_tokens`` (a server past the budget the config was
  checked against);
* a token id outside the vocabulary, ``0 <= id < vocab`` (the larger of the tokenizer's size and
  the model's output width: the ids the trainer can score);
* lists that must pair up and do not (``tokens`` / ``token_logprobs`` / ``text_offset`` /
  ``top_logprobs``: one entry per sampled token);
* a log-prob that is not finite, or above :data:`LOGPROB_ROUNDING` (a log-probability is at
  most 0; a float32 log-softmax rounds to at most ~1e-6 above it, so values in
  (0, LOGPROB_ROUNDING] are read as 0 and anything higher is a wrong reply, never clamped).
  A top-k alternative may be ``-inf`` (probability 0 after top-p), never NaN or above the bound.

The sampler (:mod:`turnrl.sampling.openai`) retries a bad reply like a failed request, then
stops the run with one :class:`ServerError` naming the server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from turnrl.types import Sample

LOGPROB_ROUNDING = 1e-3
"""Largest positive log-prob read as rounding (and as 0); a larger one makes the reply wrong."""
MAX_REPLY_CHARS = 1 << 20
"""Characters of a reply beyond those its tokens need (:func:`reply_limit`)."""


class ServerError(RuntimeError):
    """The server failed, or kept answering what the request cannot have produced; names the server."""


class BadReply(ValueError):
    """One reply breaks the rules of the module doc; the message says which (without the server)."""


@dataclass(frozen=True)
class ReplyRules:
    """What the request allows: at most ``max_tokens`` ids below ``vocab``, ``top_k`` alternatives each."""

    max_tokens: int | None = None
    vocab: int | None = None
    top_k: int = 0


def reply_limit(rules: ReplyRules) -> int:
    """The longest reply text read for a request: :data:`MAX_REPLY_CHARS` plus 512 characters per
    token and 128 per top-k alternative (vLLM's JSON spends ~60 and ~30)."""
    return MAX_REPLY_CHARS + (rules.max_tokens or 0) * (512 + 128 * rules.top_k)


def parse_json(text: Any, rules: ReplyRules) -> Any:
    """The reply body as JSON, or :class:`BadReply` (not text, too long, not JSON: an HTML error page)."""
    if not isinstance(text, str):
        raise BadReply(f"a reply body of type {type(text).__name__}, not text")
    if len(text) > reply_limit(rules):
        raise BadReply(f"a reply of {len(text):,} characters, more than {reply_limit(rules):,} for this request")
    try:
        return json.loads(text)
    except RecursionError:
        raise BadReply("a reply nested too deeply") from None
    except ValueError:
        start = " ".join(text[:60].split())
        raise BadReply(f"a reply that is not JSON (it starts {start!r})") from None


def field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``obj[key]`` when ``obj`` is an object holding a ``kind`` there, else :class:`BadReply`."""
    if not isinstance(obj, dict):
        raise BadReply(f"{where} is {type(obj).__name__}, not a JSON object")
    if key not in obj:
        raise BadReply(f"{where} has no {key!r}")
    value, kinds = obj[key], kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # JSON true is no number
        raise BadReply(f"{where}.{key} is {type(value).__name__}, not {'/'.join(k.__name__ for k in kinds)}")
    return value


def _number(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise BadReply(f"{where} is {type(x).__name__}, not a number")
    return float(x)


def _logprob(x: Any, where: str, *, may_be_inf: bool = False) -> float:
    v = -math.inf if x is None and may_be_inf else _number(x, where)
    if math.isnan(v) or (v == -math.inf and not may_be_inf) or v == math.inf:
        raise BadReply(f"{where} is {x!r}, not a finite log-prob")
    if v > LOGPROB_ROUNDING:
        raise BadReply(f"{where} is {v:+.4g}: a log-prob above 0 (beyond rounding, {LOGPROB_ROUNDING})")
    return min(v, 0.0)


def _log_prob_of(p: Any, where: str) -> float:
    v = _number(p, where)
    if not 0 <= v <= math.exp(LOGPROB_ROUNDING):
        raise BadReply(f"{where} is {v!r}, not a probability")
    return min(math.log(v), 0.0) if v > 0 else -math.inf


def token_id(token: Any, rules: ReplyRules, where: str) -> int:
    """A sampled id (an int, or vLLM's ``"token_id:123"``) inside the vocabulary."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isascii() and token[9:].isdigit():
        token = int(token[9:])
    elif isinstance(token, str):
        raise BadReply(
            f"{where} is the token {token[:40]!r} as text, not as an id; with sampler.server: vllm the server must"
            " honour return_tokens_as_token_ids (vLLM >= 0.6); other servers: set sampler.server"
        )
    if isinstance(token, bool) or not isinstance(token, int):
        raise BadReply(f"{where} is {type(token).__name__}, not a token id")
    if token < 0 or (rules.vocab is not None and token >= rules.vocab):
        raise BadReply(f"{where} is token id {token}, outside the vocabulary 0..{(rules.vocab or 0) - 1}")
    return token


def _count(n: int, rules: ReplyRules) -> None:
    if rules.max_tokens is not None and n > rules.max_tokens:
        raise BadReply(f"{n:,} tokens for a request of max_tokens={rules.max_tokens}")


def _same_length(name: str, items: Any, n: int) -> list:
    if not isinstance(items, list):
        raise BadReply(f"logprobs.{name} is {type(items).__name__}, not a list")
    if len(items) != n:
        raise BadReply(f"logprobs.{name} has {len(items)} entries for {n} tokens")
    return items


def _vllm(choice: dict, rules: ReplyRules) -> Sample:
    lp = field(choice, "logprobs", dict, "choices[0]")
    tokens = field(lp, "tokens", list, "logprobs")
    _count(len(tokens), rules)
    ids = [token_id(t, rules, f"logprobs.tokens[{i}]") for i, t in enumerate(tokens)]
    token_lps = _same_length("token_logprobs", lp.get("token_logprobs"), len(ids))
    logprobs = [_logprob(x, f"logprobs.token_logprobs[{i}]") for i, x in enumerate(token_lps)]
    if lp.get("text_offset") is not None:
        _same_length("text_offset", lp["text_offset"], len(ids))
    tk_ids = tk_lps = None
    if rules.top_k:
        tops = _same_length("top_logprobs", lp.get("top_logprobs"), len(ids))
        tk_ids, tk_lps = [], []
        for i, d in enumerate(tops):
            where = f"logprobs.top_logprobs[{i}]"
            if not isinstance(d, dict) or len(d) > rules.top_k + 1:
                raise BadReply(f"{where} is not an object of at most {rules.top_k + 1} alternatives")
            pairs = sorted(
                ((token_id(t, rules, where), _logprob(v, f"{where}[{t!r}]", may_be_inf=True)) for t, v in d.items()),
                key=lambda kv: -kv[1],
            )[: rules.top_k]
            tk_ids.append([t for t, _ in pairs])
            tk_lps.append([v for _, v in pairs])
    return Sample(ids, logprobs, _finish(choice), tk_ids, tk_lps)


def _llama(choice: dict, rules: ReplyRules, post_sampling: bool) -> Sample:
    lp = field(choice, "logprobs", dict, "the reply")
    content = field(lp, "content", list, "logprobs")
    _count(len(content), rules)
    ids, logprobs, tk_ids, tk_lps = [], [], [], []
    key, val = ("top_probs", "prob") if post_sampling else ("top_logprobs", "logprob")
    read = _log_prob_of if post_sampling else _logprob
    for i, t in enumerate(content):
        where = f"completion_probabilities[{i}]"
        ids.append(token_id(field(t, "id", int, where), rules, f"{where}.id"))
        logprobs.append(read(field(t, val, (int, float), where), f"{where}.{val}"))
        if rules.top_k:
            alts = field(t, key, list, where)[: rules.top_k]
            tk_ids.append([token_id(field(c, "id", int, f"{where}.{key}"), rules, f"{where}.{key}") for c in alts])
            tk_lps.append(
                [
                    _log_prob_of(c.get(val), f"{where}.{key}")
                    if post_sampling
                    else _logprob(c.get(val), where, may_be_inf=True)
                    for c in alts
                ]
            )
    return Sample(ids, logprobs, _finish(choice), tk_ids or None, tk_lps or None)


def _alt(value: Any, where: str, post_sampling: bool) -> float:
    """A top-k alternative's log-prob (from a probability after sampling); -inf (probability 0) allowed."""
    return _log_prob_of(value, where) if post_sampling else _logprob(value, where, may_be_inf=True)


def _finish(choice: dict) -> str:
    reason = choice.get("finish_reason")
    if reason is not None and not isinstance(reason, str):
        raise BadReply(f"finish_reason is {type(reason).__name__}, not a string")
    return "stop" if reason == "stop" else "length"


def parse_choice(
    choice: Any,
    server: str,
    top_k: int,
    post_sampling: bool,
    *,
    max_tokens: int | None = None,
    vocab: int | None = None,
) -> Sample:
    """One completion choice (JSON) → :class:`Sample` (ids, log-probs, optional top-k), checked
    against the request (``max_tokens``, the vocabulary size ``vocab``): :class:`BadReply` otherwise."""
    if not isinstance(choice, dict):
        raise BadReply(f"choices[0] is {type(choice).__name__}, not a JSON object")
    rules = ReplyRules(max_tokens, vocab, top_k)
    if server == "llama_cpp":
        return _llama(choice, rules, post_sampling)
    return _vllm(choice, rules)


def completion_choice(reply: Any) -> Any:
    """``choices[0]`` of a completions reply, or :class:`BadReply`."""
    choices = field(reply, "choices", list, "the reply")
    if not choices:
        raise BadReply("the reply has an empty 'choices'")
    return choices[0]
