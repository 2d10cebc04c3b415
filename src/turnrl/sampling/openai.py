"""OpenAI-compatible completions server backend (vLLM ``serve``, SGLang, llama.cpp's ``llama-server``).

Token in, token out: each context goes to the server as a list of token ids; the reply
must carry the sampled token ids and their log-probs. ``sampler.server`` says which
protocol:

- ``vllm`` (also SGLang's vLLM-compatible mode): the OpenAI ``logprobs`` object
  (``tokens``, ``token_logprobs``, ``top_logprobs``) with ``return_tokens_as_token_ids``,
  so tokens come back as ``"token_id:<id>"``. The server must run with
  ``--logprobs-mode processed_logprobs`` so the log-probs are those of the sampling
  distribution (temperature and top-p applied), as the trainer's mismatch correction
  and the HF sampler assume; vLLM's default (``raw_logprobs``) ignores temperature.
- ``llama_cpp``: llama-server's own ``POST /completion`` (beside its ``/v1``), whose reply
  lists every sampled id (``return_tokens``) with ``completion_probabilities``. For
  temperature > 0 the request asks for ``post_sampling_probs`` with the sampler chain
  ``temperature → top_p`` (HF's order) and nothing else (no top-k, min-p, penalties), so
  the probabilities are those of the sampling distribution; greedy requests read the raw
  log-probs, as HF's greedy scores. llama-server leaves tokens that end inside a UTF-8
  character out of its probability list; those are asked for again (the full
  distribution at that position), so every id has its log-prob.

Requests run concurrently (``max_concurrency`` at once, on the openai client's asyncio API).
Each attempt has ONE deadline, ``request_timeout`` seconds for all of it (connecting, sending,
waiting, reading the whole reply: a server trickling a byte every half second is cut off there,
which a per-read timeout never does). Every reply is checked against its request before it is
used (:mod:`turnrl.sampling.replies`: token count <= ``max_tokens``, ids in the vocabulary,
finite log-probs <= 0 up to rounding, lists that pair up, fields of the right JSON type). What a
failed attempt does to the run: a connection error, a missed deadline, HTTP 408/409/429/5xx or
a reply that breaks those rules is retried, ``retries`` times, after ``retry_backoff`` seconds
doubling up to 8; then the run stops with one line naming the server and what it did
(``ConnectionError`` when it could not be reached, :class:`~turnrl.sampling.replies.ServerError`
otherwise). Another HTTP status (400, 404, ...) stops it at once: a refused request is not
retried. A run stopped so resumes from its last checkpoint (``--resume``) once the server is
fixed; nothing a bad reply held is trained on.

Weight sync: the policy is the served base model plus the trainer's LoRA adapter. At
each sync the adapter is written with peft (``save_pretrained``) to ``adapter_dir``
(which the server must be able to read) and loaded with vLLM's dynamic LoRA endpoint
(``POST /v1/load_lora_adapter``; the server needs ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) under a new name per sampler and policy version
(``{adapter_prefix}-{sampler id}-v{N}``, the id random per sampler); the previous one is
unloaded. vLLM refuses a name it already holds, so the id is what lets several processes
share one server (each rank loads and unloads its own copy) and a resumed run load again
into the server its killed predecessor used. Requests then name that
adapter as their ``model``. llama.cpp cannot load adapters at run time (its
``/lora-adapters`` only rescales adapters given at start), so there a sync is refused
with an error. A fresh sampler (``stale=False``, as for evaluation) syncs before
sampling whenever the trainer's weights changed since the last sync; a stale one
syncs at :meth:`refresh` only.

The served base must be the policy's base: for outer iteration n ≥ 1 (adapters
0..n−1 merged), serve ``turnrl export RUN_DIR --iteration n-1``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import Field

from turnrl.chat import end_of_turn_ids
from turnrl.sampling.base import SamplerParams
from turnrl.sampling.replies import (
    BadReply,
    ReplyRules,
    ServerError,
    completion_choice,
    field,
    parse_choice,
    parse_json,
    token_id,
)
from turnrl.types import Message, Sample, SamplingParams

__all__ = ["LoraFollower", "OpenAISampler", "OpenAISamplerParams", "ServerError", "parse_choice"]

T = TypeVar("T")
RETRIED_STATUS = frozenset({408, 409, 429})
"""HTTP statuses retried besides 5xx (timeout, conflict, rate limit): the server may answer later."""
MAX_BACKOFF_S = 8.0

if TYPE_CHECKING:
    import torch

    from turnrl.sampling.base import SamplerSettings


class OpenAISamplerParams(SamplerParams):
    """``sampler.*`` keys of ``backend: openai``."""

    base_url: str = "http://127.0.0.1:8000/v1"
    """The server's OpenAI API root (ends in ``/v1``)."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the API key (unset: ``EMPTY``, what local servers accept)."""
    served_model: str | None = None
    """The base model's name on the server (unset: the first of ``GET /v1/models``)."""
    server: Literal["vllm", "llama_cpp"] = "vllm"
    """Reply shape and sampling extras to use (see the module doc)."""
    max_concurrency: int = Field(8, ge=1)
    """Requests in flight at once."""
    request_timeout: float = Field(120.0, gt=0, le=86_400)
    """Seconds one attempt may take in all (connect, send, wait, read the whole reply): one deadline, not per read."""
    retries: int = Field(3, ge=0, le=100)
    """Retries of a failed attempt (unreachable, past the deadline, 408/409/429/5xx, or a wrong reply)."""
    retry_backoff: float = Field(0.5, ge=0, le=60)
    """Seconds before the first retry; doubled for each next one, at most 8."""
    lora_sync: bool = True
    """Load the trainer's LoRA adapter into the server at every sync (vLLM only)."""
    adapter_dir: str | None = None
    """Where adapters are written for the server to load (unset: a temporary directory)."""
    adapter_prefix: str = "turnrl"
    """Adapter names on the server: ``{adapter_prefix}-{sampler id}-v{policy_version}``."""


def _client(p: OpenAISamplerParams):
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("sampler.backend 'openai' needs the openai client: pip install 'turnrl[openai]'") from exc
    key = os.environ.get(p.api_key_env) or "EMPTY"
    return openai.AsyncOpenAI(base_url=p.base_url, api_key=key, timeout=p.request_timeout, max_retries=0)


def _connection_error(url: str, exc: BaseException) -> ConnectionError:
    return ConnectionError(
        f"cannot reach the OpenAI-compatible server at sampler.base_url={url} ({type(exc).__name__}: {exc});"
        " start the server or fix sampler.base_url"
    )


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``await make()`` from synchronous code: in a new event loop here, or in a thread of its own when
    this thread already runs one (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


class LoraFollower:
    """Follows the trainer's LoRA weights by writing them as peft adapters, one new name per sync.

    A backend that generates outside the trainer's module subclasses this and implements
    :meth:`_load` (make ``path`` the adapter later requests use). A fresh follower
    (``stale=False``) syncs before sampling whenever the weights changed since the last
    sync; a stale one at :meth:`refresh` only. While the LoRA ``B`` matrices are all zero
    (a fresh adapter) the policy is the base model and nothing is loaded.
    """

    def __init__(self, model, stale: bool, adapter_dir: str | None, prefix: str) -> None:
        self.model = model
        self.stale = stale
        self.detached = stale
        """A stale follower reads the trainer's weights only at :meth:`refresh`, so it may sample while the trainer
        steps (``sampler.max_staleness``)."""
        self.policy_version = 0
        self.adapter_name: str | None = None
        """The adapter requests go to (None: the base model)."""
        self.prefix = prefix
        self._synced: dict[str, torch.Tensor] | None = None
        self._syncs = 0
        self._own_dir = adapter_dir is None
        self._dir = Path(adapter_dir or tempfile.mkdtemp(prefix="turnrl-adapters-"))

    def __del__(self) -> None:
        if getattr(self, "_own_dir", False):
            shutil.rmtree(self._dir, ignore_errors=True)

    def _load(self, name: str, path: Path) -> None:
        raise NotImplementedError

    def _trainable(self) -> dict[str, torch.Tensor]:
        return {n: q.detach() for n, q in self.model.named_parameters() if q.requires_grad}

    def _changed(self, weights: dict[str, torch.Tensor]) -> bool:
        import torch

        if self._synced is None:  # nothing loaded yet: the backend has the base, equal while LoRA B == 0
            return any(bool(t.any()) for n, t in weights.items() if "lora_B" in n)
        return any(not torch.equal(self._synced[n], t) for n, t in weights.items())

    def _sync_if_changed(self) -> None:
        weights = self._trainable()
        if weights and self._changed(weights):
            self.sync(weights)

    def write_adapter(self, weights: dict[str, torch.Tensor], name: str) -> Path:
        """Write ``weights`` (the trainer's LoRA tensors) as the peft adapter directory ``adapter_dir/name``."""
        path = self._dir / name
        shutil.rmtree(path, ignore_errors=True)
        self.model.save_pretrained(str(path), state_dict={n: t.detach().cpu() for n, t in weights.items()})
        return path

    def sync(self, weights: dict[str, torch.Tensor]) -> None:
        """Load ``weights`` as a new adapter (``{prefix}-v{policy_version}``); later requests use it."""
        self._syncs += 1
        name = f"{self.prefix}-v{self.policy_version}"
        if name == self.adapter_name:  # a second sync at one version (a fresh sampler): a new name all the same
            name = f"{name}-s{self._syncs}"
        path = self.write_adapter(weights, name)
        self._load(name, path)
        self.adapter_name = name
        self._synced = {n: t.detach().clone() for n, t in weights.items()}

    def refresh(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Take the trainer's weights; the version increments. A stale sampler loads them now."""
        self.policy_version += 1
        if self.stale:
            source = weights if weights is not None else self._trainable()
            if self._changed(source):
                self.sync(source)

    def state_dict(self) -> dict:
        """The version and the weights last loaded (a resumed sampler loads them again)."""
        return {"policy_version": self.policy_version, "synced": self._synced}

    def load_state_dict(self, state: dict) -> None:
        self.policy_version = state["policy_version"]
        if state.get("synced") is not None:
            self.sync(state["synced"])


class OpenAISampler(LoraFollower):
    """A Sampler that asks an OpenAI-compatible completions server."""

    def __init__(self, model, tokenizer, params: OpenAISamplerParams, stale: bool = False) -> None:
        # one server may serve several samplers (ranks, a resumed run): names of this sampler's own
        super().__init__(model, stale, params.adapter_dir, f"{params.adapter_prefix}-{secrets.token_hex(4)}")
        self.tokenizer = tokenizer
        self.p = params
        self.stop_ids = end_of_turn_ids(tokenizer)
        config = getattr(model, "config", None)  # ids the trainer can score: its output width may pad the tokenizer's
        self.vocab = max(len(tokenizer), int(getattr(config, "vocab_size", 0) or 0))
        self._base_name = params.served_model

    @classmethod
    def from_config(
        cls, model, tokenizer, settings: SamplerSettings[OpenAISamplerParams], *, stale: bool = False
    ) -> OpenAISampler:
        """The ``openai`` entry of the sampler registry (``settings``: the run's sampler settings)."""
        return cls(model, tokenizer, settings.params, stale=stale)

    # -- server calls ----------------------------------------------------------------
    def _with_client(self, work: Callable[[Any], Awaitable[T]]) -> T:
        """``work(client)`` with a fresh asyncio client, from synchronous code (see :func:`_run`)."""

        async def main() -> T:
            async with _client(self.p) as client:
                return await work(client)

        return _run(main)

    async def _call(self, send: Callable[[], Awaitable[Any]], path: str, read: Callable[[Any], T]) -> T:
        """``read(await send())``: each attempt under ONE deadline (``request_timeout`` for all of it),
        retried as the module doc says; ``read`` may refuse a reply (:class:`BadReply`, retried too)."""
        import openai

        problem, unreachable, attempt = "", None, 0
        for attempt in range(self.p.retries + 1):  # noqa: B007 - the count is reported below
            if attempt:
                await asyncio.sleep(min(self.p.retry_backoff * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                async with asyncio.timeout(self.p.request_timeout):
                    reply = await send()
                return read(reply)
            except openai.APIStatusError as exc:
                problem, unreachable = f"answered HTTP {exc.status_code} ({str(exc.message)[:200]})", None
                if exc.status_code < 500 and exc.status_code not in RETRIED_STATUS:
                    break  # a refused request: asking again gets the same answer
            except TimeoutError:
                problem = f"sent no complete reply within sampler.request_timeout={self.p.request_timeout} s"
                unreachable = None
            except openai.APIConnectionError as exc:
                problem, unreachable = "could not be reached", exc
            except BadReply as exc:
                problem, unreachable = f"sent a reply the request cannot have produced: {exc}", None
        if unreachable is not None:
            raise _connection_error(self.p.base_url, unreachable)
        raise ServerError(
            f"the server at sampler.base_url={self.p.base_url} {problem} (POST {path},"
            f" {f'after {attempt} retries' if attempt else 'not retried'}); fix the server, or sampler.server"
            f" ({self.p.server!r}) if another kind answers there"
        )

    async def _json(self, client, path: str, body: dict | None, rules: ReplyRules, check=None) -> Any:
        """POST ``body`` (GET without one) and read the reply as JSON checked by ``check`` (module doc)."""

        def send() -> Awaitable[str]:
            return client.get(path, cast_to=str) if body is None else client.post(path, cast_to=str, body=body)

        def read(text: Any) -> Any:
            data = parse_json(text, rules)
            return check(data) if check is not None else data

        return await self._call(send, path, read)

    async def _model_name(self, client) -> str:
        if self._base_name is None:

            def first(reply: Any) -> str:
                models = field(reply, "data", list, "the /models reply")
                if not models:
                    raise ValueError(f"the server at {self.p.base_url} serves no model; set sampler.served_model")
                return str(field(models[0], "id", str, "the /models reply's data[0]"))[:200]

            self._base_name = await self._json(client, "/models", None, ReplyRules(), first)
        return self._base_name

    def base_model_name(self) -> str:
        """The served base model's name (``sampler.served_model``, else the first of ``GET /models``)."""
        return self._with_client(self._model_name)

    async def _request(self, client, context: list[int], params: SamplingParams, seed: int) -> Sample:
        rules = ReplyRules(params.max_tokens, self.vocab, params.top_k_logprobs)
        if self.p.server == "llama_cpp":
            return await self._llama_cpp_request(client, context, params, seed, rules)
        greedy = params.temperature == 0
        body = {
            "model": self.adapter_name or await self._model_name(client),
            "prompt": list(context),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": 1.0 if greedy else params.top_p,
            "logprobs": max(params.top_k_logprobs, 1),
            "seed": seed,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": self.stop_ids,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        }

        def check(reply: Any) -> Sample:
            return parse_choice(
                completion_choice(reply),
                "vllm",
                params.top_k_logprobs,
                False,
                max_tokens=rules.max_tokens,
                vocab=self.vocab,
            )

        return await self._json(client, "/completions", body, rules, check)

    def _llama_cpp_body(self, prompt: list[int], params: SamplingParams, seed: int, n_predict: int, n_probs: int):
        greedy = params.temperature == 0
        return {
            "prompt": prompt,
            "n_predict": n_predict,
            "temperature": params.temperature,
            "top_p": 1.0 if greedy else params.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "samplers": ["temperature", "top_p"],
            "n_probs": n_probs,
            "post_sampling_probs": not greedy,
            "return_tokens": True,
            "seed": seed,
            "cache_prompt": True,
        }

    async def _llama_cpp_request(
        self, client, context: list[int], params: SamplingParams, seed: int, rules: ReplyRules
    ) -> Sample:
        """llama-server's own ``/completion``: its ``tokens`` are every sampled id.

        Its probability list leaves out tokens that end inside a UTF-8 character (byte
        tokens); each of those is asked for again with the context up to it and the full
        distribution (``n_probs`` = vocabulary size), so every id has its log-prob.
        """
        root = self.p.base_url.rstrip("/").removesuffix("/v1")
        post = params.temperature > 0
        k = max(params.top_k_logprobs, 1)
        key, val = ("top_probs", "prob") if post else ("top_logprobs", "logprob")

        def check(reply: Any) -> tuple[list[int], list, Any]:
            tokens = field(reply, "tokens", list, "the reply")
            if len(tokens) > params.max_tokens:
                raise BadReply(f"{len(tokens):,} tokens for a request of n_predict={params.max_tokens}")
            probs = reply.get("completion_probabilities") or []
            if not isinstance(probs, list) or not all(isinstance(p, dict) for p in probs):
                raise BadReply("completion_probabilities is not a list of objects")
            return [token_id(t, rules, f"tokens[{i}]") for i, t in enumerate(tokens)], probs, reply.get("stop_type")

        body = self._llama_cpp_body(list(context), params, seed, params.max_tokens, k)
        ids, probs, stop_type = await self._json(client, f"{root}/completion", body, rules, check)
        entries = []
        for i, tok in enumerate(ids):
            if probs and probs[0].get("id") == tok:
                entries.append(probs.pop(0))
                continue
            again = self._llama_cpp_body(list(context) + ids[:i], params, seed, 1, len(self.tokenizer))
            full = await self._json(client, f"{root}/completion", again, ReplyRules(1, self.vocab, self.vocab))
            first = field(full, "completion_probabilities", list, "the reply")
            alts = field(first[0] if first else {}, key, list, "completion_probabilities[0]")
            mine = [c for c in alts if isinstance(c, dict) and c.get("id") == tok]
            if not mine:
                raise ServerError(f"llama-server at {self.p.base_url} gave no probability for sampled token {tok}")
            entries.append({"id": tok, val: mine[0].get(val), key: alts[:k]})
        finish = "stop" if stop_type in ("eos", "word") else "length"
        try:
            return parse_choice(
                {"finish_reason": finish, "logprobs": {"content": entries}},
                "llama_cpp",
                params.top_k_logprobs,
                post,
                max_tokens=params.max_tokens,
                vocab=self.vocab,
            )
        except BadReply as exc:
            raise ServerError(f"the server at sampler.base_url={self.p.base_url} sent a wrong reply: {exc}") from None

    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        if not self.stale:
            self._sync_if_changed()
        seeds = [params.row_seed(i) for i in range(len(contexts))]

        async def all_of(client) -> list[Sample]:
            bound = asyncio.Semaphore(self.p.max_concurrency)

            async def one(context: list[int], seed: int) -> Sample:
                async with bound:
                    return await self._request(client, context, params, seed)

            if self.p.server == "vllm" and self.adapter_name is None:
                await self._model_name(client)  # once, before the requests ask for it together
            try:
                async with asyncio.TaskGroup() as group:  # the first failure cancels the others
                    tasks = [group.create_task(one(c, s)) for c, s in zip(contexts, seeds, strict=True)]
            except BaseExceptionGroup as eg:
                raise eg.exceptions[0] from None
            return [t.result() for t in tasks]

        return self._with_client(all_of)

    def _load(self, name: str, path: Path) -> None:
        """vLLM's dynamic LoRA endpoints: load ``name`` from ``path``, then unload the previous adapter."""
        if not self.p.lora_sync:
            raise ValueError(
                "the policy changed but sampler.lora_sync is false: the server would keep sampling the old"
                " weights; set sampler.lora_sync: true (vLLM server) or sample with a fixed policy only"
            )
        if self.p.server != "vllm":
            raise NotImplementedError(
                f"the server at {self.p.base_url} (sampler.server: {self.p.server}) cannot load a LoRA adapter at"
                " run time (llama.cpp's /lora-adapters only rescales adapters given at start), so it cannot"
                " follow the trainer's weights; train with a vLLM server (vllm serve --enable-lora, with"
                " VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) or sampler.backend: hf / vllm"
            )
        previous = self.adapter_name

        async def load(client) -> None:
            await self._post_text(client, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            if previous is not None:
                await self._post_text(client, "/unload_lora_adapter", {"lora_name": previous})

        self._with_client(load)

    async def _post_text(self, client, path: str, body: dict) -> None:
        """An admin call whose reply is text ("Success"), not JSON: the same deadline and retries."""
        await self._call(lambda: client.post(path, cast_to=str, body=body), path, lambda _: None)
