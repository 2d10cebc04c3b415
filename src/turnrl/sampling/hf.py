"""Local transformers generation backend.

Samples a batch of chat contexts at once with ``model.generate`` and returns the
sampled ids with their log-probs under the sampling distribution (the
processed scores: logits after temperature and top-p). Generation stops at the
chat template's end-of-turn token.

Staleness: with ``stale=True`` the sampler keeps its own snapshot of the
trainable (LoRA) weights, taken at each :meth:`refresh`, and swaps it in while
generating, so rollouts come from the policy of the last refresh
(``sampler.refresh_every``); with ``stale=False`` it shares the trainer's weights.
"""

from __future__ import annotations

import torch

from turnrl.envs.base import Message
from turnrl.sampling.base import Sample, SamplingParams


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the eos token and ``<|im_end|>`` when present."""
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


class HFSampler:
    def __init__(self, model, tokenizer, batch_size: int = 32, stale: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.stop_ids = end_of_turn_ids(tokenizer)
        self.policy_version = 0
        self._snapshot: dict[str, torch.Tensor] | None = None
        if stale:
            self._snapshot = self._trainable_state()

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def refresh(self) -> None:
        """Take the trainer's current weights; the policy version increments."""
        self.policy_version += 1
        if self._snapshot is not None:
            self._snapshot = self._trainable_state()

    def set_model(self, model) -> None:
        """Point the sampler at a new model (outer iterations build a fresh adapter)."""
        self.model = model
        if self._snapshot is not None:
            self._snapshot = self._trainable_state()

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
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, ctx in enumerate(contexts):  # left padding
            input_ids[row, width - len(ctx) :] = torch.tensor(ctx)
            attention[row, width - len(ctx) :] = 1
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
