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

Requests run concurrently (``max_concurrency`` threads); the openai client retries
connection errors, 408/409/429 and 5xx with exponential backoff (``retries``). A server
that cannot be reached raises ``ConnectionError`` naming the URL.

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

import math
import os
import secrets
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from turnrl.chat import end_of_turn_ids
from turnrl.sampling.base import SamplerParams
from turnrl.types import Message, Sample, SamplingParams

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
    request_timeout: float = Field(120.0, gt=0)
    """Seconds per request before it counts as failed (and is retried)."""
    retries: int = Field(3, ge=0)
    """Retries of a failed request (exponential backoff, by the openai client)."""
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
    return openai.OpenAI(base_url=p.base_url, api_key=key, timeout=p.request_timeout, max_retries=p.retries)


def _connection_error(url: str, exc: BaseException) -> ConnectionError:
    return ConnectionError(
        f"cannot reach the OpenAI-compatible server at sampler.base_url={url} ({type(exc).__name__}: {exc});"
        " start the server or fix sampler.base_url"
    )


def _token_id(token: Any) -> int:
    """vLLM's ``return_tokens_as_token_ids`` spelling ``"token_id:123"`` → 123."""
    if isinstance(token, int):
        return token
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token[len("token_id:") :])
    raise ValueError(
        f"the server returned the token {token!r} as text, not as an id; with sampler.server: vllm the server"
        " must honour return_tokens_as_token_ids (vLLM >= 0.6); other servers: set sampler.server"
    )


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -math.inf


def parse_choice(choice: dict, server: str, top_k: int, post_sampling: bool) -> Sample:
    """One completion choice (as JSON) → :class:`Sample` (ids, log-probs, optional top-k)."""
    finish = "stop" if choice.get("finish_reason") == "stop" else "length"
    lp = choice.get("logprobs") or {}
    ids: list[int]
    logprobs: list[float]
    tk_ids: list[list[int]] | None = None
    tk_lps: list[list[float]] | None = None
    if server == "llama_cpp":
        content = lp.get("content")
        if content is None:
            raise ValueError("the llama.cpp reply has no logprobs.content; is sampler.server right?")
        ids = [int(t["id"]) for t in content]
        if post_sampling:
            logprobs = [_log(float(t["prob"])) for t in content]
        else:
            logprobs = [float(t["logprob"]) for t in content]
        if top_k:
            key, val = ("top_probs", "prob") if post_sampling else ("top_logprobs", "logprob")
            tk_ids = [[int(c["id"]) for c in t[key][:top_k]] for t in content]
            tk_lps = [[_log(c[val]) if post_sampling else float(c[val]) for c in t[key][:top_k]] for t in content]
    else:
        tokens, token_lps = lp.get("tokens"), lp.get("token_logprobs")
        if tokens is None or token_lps is None:
            raise ValueError("the reply has no logprobs.tokens / token_logprobs; is sampler.server right?")
        ids = [_token_id(t) for t in tokens]
        logprobs = [float(x) if x is not None else -math.inf for x in token_lps]
        if top_k:
            tops = lp.get("top_logprobs") or [{}] * len(ids)
            pairs = [
                sorted(((_token_id(t), float(v)) for t, v in d.items()), key=lambda kv: -kv[1])[:top_k] for d in tops
            ]
            tk_ids = [[i for i, _ in row] for row in pairs]
            tk_lps = [[v for _, v in row] for row in pairs]
    bad = [x for x in logprobs if not math.isfinite(x)]
    if bad:
        raise ValueError(f"the server returned {len(bad)} sampled token(s) with log-prob -inf or null")
    return Sample(ids, [min(x, 0.0) for x in logprobs], finish, tk_ids, tk_lps)


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
        self.client = _client(params)
        self._base_name = params.served_model

    @classmethod
    def from_config(cls, model, tokenizer, settings: SamplerSettings, *, stale: bool = False) -> OpenAISampler:
        """The ``openai`` entry of the sampler registry (``settings``: the run's sampler settings)."""
        return cls(model, tokenizer, settings.params, stale=stale)

    # -- server calls ----------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        import openai

        try:
            return fn(*args, **kwargs)
        except (openai.APIConnectionError, openai.APITimeoutError) as exc:
            raise _connection_error(self.p.base_url, exc) from exc
        except openai.APIStatusError as exc:
            raise RuntimeError(
                f"the server at sampler.base_url={self.p.base_url} answered {exc.status_code}"
                f" (after {self.p.retries} retries for transient errors): {exc.message}"
            ) from exc

    def base_model_name(self) -> str:
        if self._base_name is None:
            models = self._call(self.client.models.list).data
            if not models:
                raise ValueError(f"the server at {self.p.base_url} serves no model; set sampler.served_model")
            self._base_name = models[0].id
        return self._base_name

    def _request(self, context: list[int], params: SamplingParams, seed: int) -> Sample:
        if self.p.server == "llama_cpp":
            return self._llama_cpp_request(context, params, seed)
        greedy = params.temperature == 0
        resp = self._call(
            self.client.completions.create,
            model=self.adapter_name or self.base_model_name(),
            prompt=list(context),
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            logprobs=max(params.top_k_logprobs, 1),
            seed=seed,
            extra_body={
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
                "stop_token_ids": self.stop_ids,
                "top_k": -1,
                "min_p": 0.0,
                "repetition_penalty": 1.0,
            },
        )
        return parse_choice(resp.to_dict()["choices"][0], "vllm", params.top_k_logprobs, post_sampling=False)

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

    def _llama_cpp_request(self, context: list[int], params: SamplingParams, seed: int) -> Sample:
        """llama-server's own ``/completion``: its ``tokens`` are every sampled id.

        Its probability list leaves out tokens that end inside a UTF-8 character (byte
        tokens); each of those is asked for again with the context up to it and the full
        distribution (``n_probs`` = vocabulary size), so every id has its log-prob.
        """
        root = self.p.base_url.rstrip("/").removesuffix("/v1")
        post = params.temperature > 0
        k = max(params.top_k_logprobs, 1)
        reply = self._call(
            self.client.post,
            f"{root}/completion",
            cast_to=dict,
            body=self._llama_cpp_body(list(context), params, seed, params.max_tokens, k),
        )
        ids = [int(t) for t in reply["tokens"]]
        entries, probs = [], list(reply.get("completion_probabilities") or [])
        for i, tok in enumerate(ids):
            if probs and int(probs[0]["id"]) == tok:
                entries.append(probs.pop(0))
                continue
            full = self._call(
                self.client.post,
                f"{root}/completion",
                cast_to=dict,
                body=self._llama_cpp_body(list(context) + ids[:i], params, seed, 1, len(self.tokenizer)),
            )["completion_probabilities"][0]
            key, val = ("top_probs", "prob") if post else ("top_logprobs", "logprob")
            mine = [c for c in full[key] if int(c["id"]) == tok]
            if not mine:
                raise ValueError(f"llama-server at {self.p.base_url} gave no probability for sampled token {tok}")
            entries.append({"id": tok, val: mine[0][val], key: full[key][:k]})
        finish = "stop" if reply.get("stop_type") in ("eos", "word") else "length"
        return parse_choice(
            {"finish_reason": finish, "logprobs": {"content": entries}},
            "llama_cpp",
            params.top_k_logprobs,
            post_sampling=post,
        )

    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        if not self.stale:
            self._sync_if_changed()
        seeds = [params.row_seed(i) for i in range(len(contexts))]
        with ThreadPoolExecutor(max_workers=self.p.max_concurrency) as pool:
            return list(pool.map(lambda cs: self._request(cs[0], params, cs[1]), zip(contexts, seeds, strict=True)))

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
        self._call(
            self.client.post, "/load_lora_adapter", body={"lora_name": name, "lora_path": str(path)}, cast_to=str
        )
        if self.adapter_name is not None:
            self._call(self.client.post, "/unload_lora_adapter", body={"lora_name": self.adapter_name}, cast_to=str)
