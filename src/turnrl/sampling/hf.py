"""Local transformers generation backend.

Samples a batch of chat contexts at once with ``model.generate`` and returns the
sampled ids with their log-probs under the sampling distribution (the
processed scores: logits after temperature and top-p). Generation stops at the
chat template's end-of-turn token.

Shared prefixes: contexts of one call often share a long prefix (the system prompt,
a few-shot game, a task's source code, a tree's first turn). With ``prefix_cache``
the longest common prefix is run once and its key/value cache is repeated for the
batch; each row's remaining tokens follow, left-padded after the prefix (the
attention mask skips the padding, so positions stay those of the unpadded row).

Earlier turns (``sampler.reuse_kv_gib``, on by default): after each call the
sampler keeps every context's own keys/values (the context plus the sampled
tokens it fed), up to a memory budget, until the next call. A multi-turn episode's
next context extends its last one, so the next call finds, for each context, the
kept sequence sharing its longest prefix and feeds only the rest: earlier turns are
not run again. The kept keys/values are right-aligned in one batch cache, the left
padding masked, so positions are those of the unpadded rows (the same layout as the
shared prefix). Kept keys/values are dropped when the weights change (a refresh, or
any in-place update of the trainable tensors, seen by their version counters).

Generation with the LoRA merged (``merge_lora``, ``turnrl.sampling.merged_lora``) and the sampler's own draw
at T > 0 (``turnrl.sampling.draws``: the inverse CDF at one uniform per row, per-row seeds for
``SamplingParams.row_seeds``).

The packed decoder (``fast_decode``, on by default; Llama-family models on the CPU): instead of transformers'
``generate``, the sampler runs its own forward over weights packed for oneDNN, repacked when the weights
change (``turnrl.sampling.packed``), with the shared prefix's keys/values kept once for all rows and
``generate``'s greedy loop (``turnrl.sampling.decode``). The same tokens and log-probs up to float rounding;
for another model (or device) the sampler uses ``generate`` (``fast_decode_unsupported`` says why).

Staleness: with ``stale=True`` the sampler keeps its own snapshot of the
trainable (LoRA) weights, taken at each :meth:`refresh`, so rollouts come from the policy of the last refresh
(``sampler.refresh_every``, ``sampler.max_staleness``); with ``stale=False`` it shares the trainer's weights.
On the packed decoder with only adapters trainable the snapshot is packed once per refresh and generation
never touches the module (``detached``: collection may run while the trainer steps); otherwise the snapshot
is swapped into the module while generating.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from pydantic import Field

from turnrl.chat import end_of_turn_ids
from turnrl.sampling import decode
from turnrl.sampling.base import SamplerParams
from turnrl.sampling.draws import InverseCDFDraws
from turnrl.sampling.kvcache import layer_kv, preallocated_cache, preallocated_layer_class
from turnrl.sampling.merged_lora import MergedLoRA
from turnrl.sampling.packed import PackedDecoder, unsupported_reason
from turnrl.types import Message, Sample, SamplingParams

if TYPE_CHECKING:
    from turnrl.sampling.base import SamplerSettings


class HFSamplerParams(SamplerParams):
    """``sampler.*`` keys of ``backend: hf``."""

    reuse_kv_gib: float = Field(2.0, ge=0)
    """GiB of keys/values kept between calls so a context's next turn does not rerun its
    earlier turns (0: off)."""
    preallocate_kv: bool = True
    """Write each new position's keys/values into buffers allocated once per call (the call's
    width plus ``max_tokens``) instead of growing the cache by concatenation every decode step
    (False: transformers' growing cache). Same logits bit for bit, so the same tokens at any temperature."""
    merge_lora: bool = True
    """Generate with each LoRA adapter merged into its base weight (``turnrl.sampling.merged_lora``): one matmul
    per layer instead of three; the log-probs equal the trainer's within float rounding (False: peft's LoRA forward)."""
    fast_decode: bool = True
    """Generate with the packed decoder (``turnrl.sampling.packed``: weights packed for oneDNN once per version,
    a hand-written loop over the layers, the shared prefix's keys/values once for all rows) where the model
    supports it (a Llama-family model in float32 on the CPU), else with transformers' ``generate``. Same tokens
    and log-probs up to float rounding (False: always ``generate``)."""
    decode_dtype: Literal["float32", "bfloat16"] = "float32"
    """The packed decoder's weights: ``bfloat16`` halves the bytes each step reads, but its log-probs are no longer
    the trainer's (so ``loss.mismatch.mode: auto`` turns the correction on). Opt-in: on the main job it collects
    1.41× faster but saves 2.5 % of the run (docs/results.md §4)."""

    @property
    def differs_from_trainer(self) -> bool:
        return self.fast_decode and self.decode_dtype != "float32"


@dataclass
class _Past:
    """One context's own keys/values, kept from a call: the tokens fed, per layer ``[H, L, D]`` keys and values."""

    ids: np.ndarray
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def _longest_match(ctx: np.ndarray, pasts: list[_Past]) -> tuple[_Past | None, int]:
    """The kept past sharing the longest prefix with ``ctx`` (at most ``len(ctx) − 1`` tokens), and that length."""
    best, best_m = None, 0
    for past in pasts:
        n = min(len(past.ids), len(ctx) - 1)
        if n <= best_m:
            continue
        same = past.ids[:n] == ctx[:n]
        m = n if same.all() else int(same.argmin())
        if m > best_m:
            best, best_m = past, m
    return best, best_m


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest prefix shared by every row."""
    first, n = rows[0], min(len(r) for r in rows)
    for k in range(n):
        if any(r[k] != first[k] for r in rows):
            return k
    return n


def _only_adapters_train(model) -> bool:
    """Every trainable tensor is a LoRA adapter's (the base frozen: the packed copy of it stays the trainer's)."""
    return all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


class HFSampler:
    MIN_SHARED_PREFIX = 16
    """Shorter common prefixes are not worth a separate forward pass."""
    DRAWS = InverseCDFDraws
    """The draw at T > 0 (a logits processor built per call; a subclass may draw otherwise)."""

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 32,
        stale: bool = False,
        prefix_cache: bool = True,
        reuse_kv_gib: float = 2.0,
        preallocate_kv: bool = True,
        merge_lora: bool = True,
        fast_decode: bool = True,
        decode_dtype: str = "float32",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.prefix_cache = prefix_cache
        self.reuse_kv_bytes = int(reuse_kv_gib * 2**30)
        self.preallocate_kv = preallocate_kv
        self._merged = MergedLoRA() if merge_lora else None
        self.fast_decode_unsupported = unsupported_reason(model) if fast_decode else "fast_decode is off"
        """Why this sampler runs transformers' ``generate`` instead of the packed decoder (None: it does not)."""
        self._decode_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[decode_dtype]
        self._decoder: PackedDecoder | None = None
        self._decoder_key: tuple | None = None
        self._pasts: list[_Past] = []
        self._pasts_key: tuple | None = None
        self.reused_tokens = 0
        """Context tokens the last :meth:`sample` call took from kept keys/values instead of running them."""
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.policy_version = 0
        self._snapshot: dict[str, torch.Tensor] | None = None
        if stale:
            self._snapshot = self._trainable_state()
        self.detached = stale and self.fast_decode_unsupported is None and _only_adapters_train(model)
        """Generates from its own packed copy of the weights, taken at :meth:`refresh` (and when a checkpoint is
        loaded): sampling reads none of the trainer's tensors, so it may run while the trainer steps
        (``sampler.max_staleness``). A stale sampler on the packed decoder with only LoRA adapters trainable."""
        if self.detached:
            self._pack_snapshot()

    @classmethod
    def from_config(
        cls, model, tokenizer, settings: SamplerSettings[HFSamplerParams], *, stale: bool = False
    ) -> HFSampler:
        """The ``hf`` entry of the sampler registry (``settings``: the run's sampler settings)."""
        return cls(
            model,
            tokenizer,
            batch_size=settings.batch_size,
            stale=stale,
            reuse_kv_gib=settings.params.reuse_kv_gib,
            preallocate_kv=settings.params.preallocate_kv,
            merge_lora=settings.params.merge_lora,
            fast_decode=settings.params.fast_decode,
            decode_dtype=settings.params.decode_dtype,
        )

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def refresh(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Take the trainer's current weights; the policy version increments.

        This backend generates with the trainer's own module: a fresh sampler needs no
        copy; a stale one snapshots ``weights`` (or the module's trainable tensors).
        """
        self.policy_version += 1
        if self._snapshot is not None:
            source = weights if weights is not None else self._trainable_state()
            self._snapshot = {n: t.detach().clone() for n, t in source.items()}
            if self.detached:
                self._pack_snapshot()

    def _pack_snapshot(self) -> None:
        """Pack the decoder from the snapshot: swapped into the module for the packing, the module's own weights
        put back (called between steps, never while the trainer runs: at construction, refresh and load)."""
        assert self._snapshot is not None
        params = dict(self.model.named_parameters())
        current = {n: params[n].detach().clone() for n in self._snapshot}
        try:
            for n, t in self._snapshot.items():
                params[n].data.copy_(t)
            if self._decoder is None:
                self._decoder = PackedDecoder(self.model, self._decode_dtype)
            else:
                self._decoder.refresh(self.model)
        finally:
            for n, t in current.items():
                params[n].data.copy_(t)
        self._decoder_key = ("snapshot", self.policy_version)

    def state_dict(self) -> dict:
        """What a checkpoint needs to restore this sampler: its version and stale snapshot."""
        return {"policy_version": self.policy_version, "snapshot": self._snapshot}

    def load_state_dict(self, state: dict) -> None:
        self.policy_version = state["policy_version"]
        if self._snapshot is not None and state["snapshot"] is not None:
            self._snapshot = state["snapshot"]
        if self.detached:
            self._pack_snapshot()

    @torch.no_grad()
    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        if self.detached:  # the decoder packed at the last refresh: nothing of the module is read or changed
            key = ("snapshot", self.policy_version)
            previous = self._pasts if key == self._pasts_key else []
            self._pasts, self._pasts_key, self.reused_tokens = [], key, 0
            return self._chunks(contexts, params, previous)
        params_by_name = dict(self.model.named_parameters())
        weights_key = (self.policy_version, *(p._version for p in params_by_name.values() if p.requires_grad))
        previous = self._pasts if weights_key == self._pasts_key else []
        self._pasts, self._pasts_key, self.reused_tokens = [], weights_key, 0
        current = None
        if self._snapshot is not None:  # swap the stale weights in for generation
            current = {n: params_by_name[n].detach().clone() for n in self._snapshot}
            for n, t in self._snapshot.items():
                params_by_name[n].data.copy_(t)
        was_training = self.model.training
        self.model.eval()
        if self._decoder is None and self.fast_decode_unsupported is None:  # again: FSDP may have sharded it since
            self.fast_decode_unsupported = unsupported_reason(self.model)
        fast = self.fast_decode_unsupported is None
        merged: AbstractContextManager[None] = nullcontext()
        if self._merged is not None and not fast:
            merged = self._merged.applied(self.model, weights_key)
        try:
            if fast and weights_key != self._decoder_key:  # pack this version of the weights
                if self._decoder is None:
                    self._decoder = PackedDecoder(self.model, self._decode_dtype)
                else:
                    self._decoder.refresh(self.model)
                self._decoder_key = weights_key
            with merged:
                return self._chunks(contexts, params, previous)
        finally:
            if current is not None:
                for n, t in current.items():
                    params_by_name[n].data.copy_(t)
            self.model.train(was_training)

    def _chunks(self, contexts: list[list[int]], params: SamplingParams, previous: list[_Past]) -> list[Sample]:
        out: list[Sample] = []
        for start in range(0, len(contexts), self.batch_size):
            chunk = contexts[start : start + self.batch_size]
            chunk_params = params
            if params.row_seeds is not None:  # each row keeps its own seed
                chunk_params = replace(params, row_seeds=params.row_seeds[start : start + self.batch_size])
            seed = params.seed * 100_003 + start
            out += self._generate(chunk, chunk_params, seed=seed, previous=previous)
        return out

    def _generate(
        self, contexts: list[list[int]], params: SamplingParams, seed: int, previous: list[_Past]
    ) -> list[Sample]:
        device = next(self.model.parameters()).device
        arrays = [np.asarray(c, dtype=np.int64) for c in contexts]
        matches = [_longest_match(a, previous) for a in arrays] if previous else []
        reuse = bool(matches) and all(m >= self.MIN_SHARED_PREFIX for _, m in matches)
        if reuse:  # every row continues a kept past
            cached = [m for _, m in matches]
            self.reused_tokens += sum(cached)
        else:  # the prefix every row shares, run once
            shared = common_prefix_length(contexts) if self.prefix_cache and len(contexts) > 1 else 0
            shared = min(shared, min(len(c) for c in contexts) - 1)  # every row keeps >= 1 token to feed
            cached = [shared if shared >= self.MIN_SHARED_PREFIX else 0] * len(contexts)
        # T > 0: the warpers and the draw are ours (DRAWS); the decode loop is greedy on what they return
        draws = self.DRAWS(params, device, seed) if params.temperature > 0 else None
        run = self._decode_packed if self.fast_decode_unsupported is None else self._decode_hf
        new_tokens, scores, kv_of = run(contexts, params, matches if reuse else None, cached, draws)
        # scores: one [B, V] tensor per generated position, after temperature/top-p processing
        logprobs = torch.stack([s.float().log_softmax(-1) for s in scores], dim=1).cpu()
        samples = []
        for row in range(len(contexts)):
            ids = new_tokens[row].tolist()
            end = next((k for k, t in enumerate(ids) if t in self.stop_ids), None)
            finish = "stop" if end is not None else "length"
            n = end + 1 if end is not None else len(ids)
            ids = ids[:n]
            lp_rows = logprobs[row, :n]
            lps = lp_rows.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()
            topk_ids = topk_lps = None
            if params.top_k_logprobs:
                vals, idx = lp_rows.topk(params.top_k_logprobs, dim=-1)
                topk_ids, topk_lps = idx.tolist(), vals.tolist()
            samples.append(Sample(ids, [min(lp, 0.0) for lp in lps], finish, topk_ids, topk_lps))
        if self.reuse_kv_bytes and kv_of is not None:
            self._remember(arrays, samples, kv_of)
        return samples

    def _decode_packed(self, contexts, params: SamplingParams, matches, cached: list[int], draws):
        """The packed decoder's call: new tokens ``[B, n]``, the scores, and each row's keys/values by
        ``(row, fed)``. With kept pasts, the prefix every row shares is taken once from the first row's."""
        shared = cached[0]
        if matches is not None:
            shared = min(common_prefix_length(contexts), *cached) if self.prefix_cache and len(contexts) > 1 else 0
            shared = shared if shared >= self.MIN_SHARED_PREFIX else 0
        decoder = self._decoder
        assert decoder is not None  # packed in generate before any call
        call = decode.prepare(decoder, contexts, matches, shared, params.max_tokens, self.tokenizer.pad_token_id)
        draw = draws.draw if draws is not None else None
        new_tokens, scores = decode.generate(
            decoder, call, params.max_tokens, self.stop_ids, self.tokenizer.pad_token_id, draw
        )
        if draws is not None:  # the sampling distribution: the scores after the warpers
            scores = draws.scores
        return new_tokens, scores, lambda row, fed: decode.row_kv(call, row, fed)

    def _decode_hf(self, contexts, params: SamplingParams, matches, cached: list[int], draws):
        """transformers' ``generate``: new tokens ``[B, n]``, the scores, and each row's keys/values by
        ``(row, fed)`` (None: a sliding-window layer keeps only its window)."""
        from turnrl.models import CACHE_KWARG  # not at import: turnrl.models -> config -> this registry

        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        extra = {}
        cache_width = max(cached)
        suffix_width = max(len(c) - k for c, k in zip(contexts, cached, strict=True))
        width = cache_width + suffix_width
        input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, (ctx, k) in enumerate(zip(contexts, cached, strict=True)):
            # [left padding | cached tokens | left padding | rest of the row]: masked padding, unpadded positions
            input_ids[row, cache_width - k : cache_width] = torch.tensor(ctx[:k], dtype=torch.long)
            attention[row, cache_width - k : cache_width] = 1
            input_ids[row, width - (len(ctx) - k) :] = torch.tensor(ctx[k:], dtype=torch.long)
            attention[row, width - (len(ctx) - k) :] = 1
        # positions the call's cache will hold: the cached width, the rows' rest, the new tokens
        capacity = width + params.max_tokens if self.preallocate_kv else None
        if matches is not None:
            kept = [(past, m) for past, m in matches if past is not None]  # all of them: every m > 0
            extra[CACHE_KWARG] = self._assemble(kept, cache_width, device, capacity)
        elif cache_width:
            # logits only at the last position: the prefix's own logits are never used
            prefix = self.model(input_ids=input_ids[:1, :cache_width].to(device), use_cache=True, logits_to_keep=1)
            cache = getattr(prefix, CACHE_KWARG)
            if capacity is None:
                cache.batch_repeat_interleave(len(contexts))
            else:
                cache = preallocated_cache(capacity, layer_kv(cache), len(contexts))
            extra[CACHE_KWARG] = cache
        elif capacity is not None:  # nothing cached: each layer's buffers are allocated by its first update
            extra[CACHE_KWARG] = preallocated_cache(capacity)
        if draws is not None:
            extra["logits_processor"] = draws.processors
        gen = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            max_new_tokens=params.max_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad,
            output_scores=draws is None,
            return_dict_in_generate=True,
            **extra,
        )
        scores = draws.scores if draws is not None else gen.scores
        cache = getattr(gen, CACHE_KWARG)
        if any(getattr(cache, "is_sliding", None) or []):  # a sliding-window layer keeps only its window
            return gen.sequences[:, width:].cpu(), scores, None
        layers = layer_kv(cache)

        def kv_of(row: int, fed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            cols = torch.cat([attention[row].nonzero().squeeze(-1), torch.arange(width, width + fed)])
            cols = cols.to(layers[0][0].device)
            return [(k[row].index_select(1, cols), v[row].index_select(1, cols)) for k, v in layers]

        return gen.sequences[:, width:].cpu(), scores, kv_of

    def _assemble(self, matches: list[tuple[_Past, int]], width: int, device, capacity: int | None = None) -> object:
        """One batch cache of ``width`` positions: row r's kept keys/values (its first m_r) right-aligned, the left
        padding zero; with ``capacity``, in preallocated buffers of that many positions."""
        from transformers import DynamicCache

        cache = DynamicCache()
        layers = []
        for layer in range(len(matches[0][0].kv)):
            k0 = matches[0][0].kv[layer][0]
            size = width if capacity is None else capacity
            keys = k0.new_empty(len(matches), k0.shape[0], size, k0.shape[2], device=device)
            values = torch.empty_like(keys)
            keys[:, :, :width] = 0
            values[:, :, :width] = 0
            for row, (past, m) in enumerate(matches):
                keys[row, :, width - m : width] = past.kv[layer][0][:, :m]
                values[row, :, width - m : width] = past.kv[layer][1][:, :m]
            if capacity is None:
                cache.update(keys, values, layer)
            else:
                layers.append(preallocated_layer_class()(capacity, keys, values, length=width))
        if capacity is not None:
            cache.layers, cache.layer_class_to_replicate = layers, None
        return cache

    def _remember(self, contexts: list[np.ndarray], samples: list[Sample], kv_of) -> None:
        """Keep each row's own keys/values (its context and the sampled tokens it fed), within the budget."""
        used = sum(p.nbytes for p in self._pasts)
        for row, (ctx, sample) in enumerate(zip(contexts, samples, strict=True)):
            fed = len(sample.ids) - 1  # the last sampled token was never fed
            past = _Past(np.concatenate([ctx, np.asarray(sample.ids[:fed], dtype=np.int64)]), kv_of(row, fed))
            if used + past.nbytes > self.reuse_kv_bytes:
                return
            used += past.nbytes
            self._pasts.append(past)
