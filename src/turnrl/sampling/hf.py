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

Staleness: with ``stale=True`` the sampler keeps its own snapshot of the
trainable (LoRA) weights, taken at each :meth:`refresh`, and swaps it in while
generating, so rollouts come from the policy of the last refresh
(``sampler.refresh_every``); with ``stale=False`` it shares the trainer's weights.
"""

from __future__ import annotations

import torch

from turnrl.chat import end_of_turn_ids
from turnrl.models import CACHE_KWARG
from turnrl.types import Message, Sample, SamplingParams


def common_prefix_length(rows: list[list[int]]) -> int:
    """Length of the longest prefix shared by every row."""
    first, n = rows[0], min(len(r) for r in rows)
    for k in range(n):
        if any(r[k] != first[k] for r in rows):
            return k
    return n


class HFSampler:
    MIN_SHARED_PREFIX = 16
    """Shorter common prefixes are not worth a separate forward pass."""

    def __init__(self, model, tokenizer, batch_size: int = 32, stale: bool = False, prefix_cache: bool = True) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.prefix_cache = prefix_cache
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.policy_version = 0
        self._snapshot: dict[str, torch.Tensor] | None = None
        if stale:
            self._snapshot = self._trainable_state()

    @classmethod
    def from_config(cls, model, tokenizer, cfg, *, stale: bool = False) -> HFSampler:
        """The ``hf`` entry of the sampler registry (``cfg`` = the ``sampler`` config section)."""
        return cls(model, tokenizer, batch_size=cfg.batch_size, stale=stale)

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

    def state_dict(self) -> dict:
        """What a checkpoint needs to restore this sampler: its version and stale snapshot."""
        return {"policy_version": self.policy_version, "snapshot": self._snapshot}

    def load_state_dict(self, state: dict) -> None:
        self.policy_version = state["policy_version"]
        if self._snapshot is not None and state["snapshot"] is not None:
            self._snapshot = state["snapshot"]

    @torch.no_grad()
    def sample(
        self, contexts: list[list[int]], params: SamplingParams, messages: list[list[Message]] | None = None
    ) -> list[Sample]:
        out: list[Sample] = []
        params_by_name = dict(self.model.named_parameters())
        current = None
        if self._snapshot is not None:  # swap the stale weights in for generation
            current = {n: params_by_name[n].detach().clone() for n in self._snapshot}
            for n, t in self._snapshot.items():
                params_by_name[n].data.copy_(t)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(contexts), self.batch_size):
                chunk = contexts[start : start + self.batch_size]
                out += self._generate(chunk, params, seed=params.seed * 100_003 + start)
        finally:
            if current is not None:
                for n, t in current.items():
                    params_by_name[n].data.copy_(t)
            self.model.train(was_training)
        return out

    def _generate(self, contexts: list[list[int]], params: SamplingParams, seed: int) -> list[Sample]:
        device = next(self.model.parameters()).device
        pad = self.tokenizer.pad_token_id
        shared = common_prefix_length(contexts) if self.prefix_cache and len(contexts) > 1 else 0
        shared = min(shared, min(len(c) for c in contexts) - 1)  # every row keeps >= 1 token to feed
        if shared < self.MIN_SHARED_PREFIX:
            shared = 0
        suffix_width = max(len(c) - shared for c in contexts)
        width = shared + suffix_width
        input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, ctx in enumerate(contexts):  # [shared prefix | left padding | rest of the row]
            input_ids[row, :shared] = torch.tensor(ctx[:shared], dtype=torch.long)
            attention[row, :shared] = 1
            input_ids[row, width - (len(ctx) - shared) :] = torch.tensor(ctx[shared:], dtype=torch.long)
            attention[row, width - (len(ctx) - shared) :] = 1
        extra = {}
        if shared:
            prefix = self.model(input_ids=input_ids[:1, :shared].to(device), use_cache=True)
            cache = getattr(prefix, CACHE_KWARG)
            cache.batch_repeat_interleave(len(contexts))
            extra[CACHE_KWARG] = cache
        greedy = params.temperature == 0
        torch.manual_seed(seed)
        gen = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None,
            max_new_tokens=params.max_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
        new_tokens = gen.sequences[:, width:].cpu()
        # scores: one [B, V] tensor per generated position, after temperature/top-p processing
        logprobs = torch.stack([s.float().log_softmax(-1) for s in gen.scores], dim=1).cpu()
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
        return samples
