"""The HF sampler's own draw of each new token: the inverse CDF of softmax(scores) at one uniform per row.

transformers' ``do_sample`` draws with ``torch.multinomial``, which on CPU draws one exponential per
vocabulary entry and row (49k for the embedded model), ~14 ms of a ~150 ms decode step of 16 rows. The
inverse CDF needs one uniform per row and a cumulative sum:

    p = softmax(s),  C_j = Σ_{i ≤ j} p_i,  u ~ U(0, 1],  token = min { j : C_j ≥ u · C_V }

which is a draw from p exactly (up to the float64 rounding of the sum); a token of probability 0 (one top-p
removed) is never drawn, since C_j ≥ u · C_V > C_{j−1} implies p_j > 0. The uniforms come from the
call's own generator (seeded by the call's seed) or, with ``SamplingParams.row_seeds``, from each row's
own generator, so that a row's tokens do not depend on the other rows of the batch.

transformers' warpers (temperature, top-p) process the scores first; the processed scores are kept as the
sampling distribution (the log-probs the sampler returns). ``generate`` then runs greedy on the returned
scores, which are 0 at the drawn token and −inf elsewhere.
"""

from __future__ import annotations

import torch

from turnrl.types import SamplingParams


class InverseCDFDraws:
    """A logits processor list for ``generate(do_sample=False, logits_processor=draws.processors)``, or the
    tokens themselves for a decode loop of the sampler's own (:meth:`draw`)."""

    def __init__(self, params: SamplingParams, device, seed: int) -> None:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        if params.row_seeds is not None:
            self.generators = [torch.Generator(device=device).manual_seed(s) for s in params.row_seeds]
        else:
            self.generators = [torch.Generator(device=device).manual_seed(seed)]
        self.scores: list[torch.Tensor] = []
        warpers: list = []
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        self.warpers = LogitsProcessorList(warpers)
        self.processors = LogitsProcessorList([*warpers, self])

    def uniforms(self, rows: int, device) -> torch.Tensor:
        """One U(0, 1] per row: from each row's generator, or ``rows`` from the call's one."""
        if len(self.generators) == 1:
            u = torch.rand(rows, generator=self.generators[0], device=device, dtype=torch.float64)
        else:
            u = torch.cat([torch.rand(1, generator=g, device=device, dtype=torch.float64) for g in self.generators])
        return 1.0 - u  # torch.rand is in [0, 1)

    def token(self, scores: torch.Tensor) -> torch.Tensor:
        """The drawn token of each row (``[B]``) from the processed ``scores``, which are kept."""
        self.scores.append(scores)
        cdf = scores.float().softmax(-1).cumsum(-1, dtype=torch.float64)
        u = self.uniforms(scores.shape[0], scores.device) * cdf[:, -1]
        return torch.searchsorted(cdf, u.unsqueeze(-1)).clamp_max(scores.shape[-1] - 1).squeeze(-1)

    def draw(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The warpers, then :meth:`token`: the drawn tokens (a decode loop of its own calls this)."""
        return self.token(self.warpers(input_ids, logits))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = self.token(scores)
        return torch.full_like(scores, float("-inf")).scatter_(-1, token.unsqueeze(-1), 0.0)
