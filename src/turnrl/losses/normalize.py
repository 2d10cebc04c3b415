"""Normalisers: a micro-batch's per-token loss to the scalar whose micro-batch sum is the batch loss."""

from __future__ import annotations

from torch import Tensor


def normalize(
    per_token: Tensor,
    mask: Tensor,
    norm: str,
    *,
    total_tokens: float,
    total_rows: float,
    max_len: float,
) -> Tensor:
    """Scalar loss of one micro-batch; summing over micro-batches gives the batch loss.

    The totals are constants of the whole optimizer batch (not of the
    micro-batch), so micro-batch values add up exactly:

      * ``token_sum`` (DAPO):    Σ_{b,t} ℓ m / N,   N = ``total_tokens`` (trained tokens in the batch)
      * ``seq_mean`` (GRPO):     Σ_b (Σ_t ℓ m / Σ_t m) / ``total_rows``   (a row without trained tokens adds 0)
      * ``constant`` (Dr. GRPO): Σ_{b,t} ℓ m / (``total_rows`` · ``max_len``)

    ``total_rows`` = rows in the optimizer batch; ``max_len`` should be a
    constant L_max (e.g. the configured token budget per row), not the
    longest row of the batch, so the scale does not depend on the batch.
    """
    lm = per_token * mask
    if norm == "token_sum":
        return lm.sum() / max(float(total_tokens), 1.0)
    if norm == "seq_mean":
        return (lm.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).sum() / max(float(total_rows), 1.0)
    if norm == "constant":
        return lm.sum() / max(float(total_rows) * float(max_len), 1.0)
    raise ValueError(f"loss.norm must be token_sum, seq_mean or constant (got {norm!r})")
