"""Per-token log-probs from hidden states, in checkpointed chunks (the per-row path).

Log-probs are computed from hidden states at the trained positions only, in
chunks of positions, each chunk's ``[chunk × vocab]`` logits recomputed in the
backward pass (activation checkpointing), so the full ``[tokens × vocab]``
float32 tensor never exists. :mod:`turnrl.train.packing` is the shared-prefix
path with the same inputs and outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from turnrl.train.batch import Batch


def _backbone_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def _chunk_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    aux: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = F.linear(hidden, weight, bias).float() / temperature
    norm = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm
    aux_lp = logits.gather(-1, aux) - norm.unsqueeze(-1) if aux is not None else None
    return lp, aux_lp


def trained_positions(batch: Batch) -> torch.Tensor:
    """``[B, T-1]`` bool: position p−1 whose logits predict a trained token p."""
    return batch.loss_mask[:, 1:] > 0


def logprobs_from_hidden(
    h: torch.Tensor,
    batch: Batch,
    head,
    chunk: int,
    temperature: float,
    aux_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the trained tokens from the hidden states that predict them.

    ``h`` is ``[N, H]``: the hidden states at :func:`trained_positions` (in its order), each
    predicting the next token. They are projected in checkpointed chunks; the result is
    scattered into ``[B, T]`` (0 elsewhere), and ``[B, T, K]`` for ``aux_ids``.
    """
    select = trained_positions(batch)
    targets = batch.input_ids[:, 1:][select]
    aux = aux_ids[:, 1:][select] if aux_ids is not None else None
    pieces, aux_pieces = [], []
    for s in range(0, h.shape[0], chunk):
        a = aux[s : s + chunk] if aux is not None else None
        lp, alp = checkpoint(
            _chunk_logprobs,
            h[s : s + chunk],
            targets[s : s + chunk],
            head.weight,
            head.bias,
            temperature,
            a,
            use_reentrant=False,
        )
        pieces.append(lp)
        aux_pieces.append(alp)
    B, T = batch.input_ids.shape
    # no trained position: an empty slice of h, so the backward still runs through the model (FSDP lock-step)
    flat = torch.cat(pieces) if pieces else h.float().sum(-1)
    logp = F.pad(torch.zeros(B, T - 1, dtype=torch.float32, device=h.device).masked_scatter(select, flat), (1, 0))
    aux_logp = None
    if aux_ids is not None:
        K = aux_ids.shape[-1]
        flat_aux = torch.cat(aux_pieces) if aux_pieces else h.float().sum(-1, keepdim=True).expand(-1, K)
        aux_out = torch.zeros(B, T - 1, K, dtype=torch.float32, device=h.device)
        aux_out = aux_out.masked_scatter(select.unsqueeze(-1).expand(-1, -1, K), flat_aux)
        aux_logp = F.pad(aux_out, (0, 0, 1, 0))
    return logp, aux_logp


def token_logprobs(
    model,
    batch: Batch,
    chunk: int = 256,
    temperature: float = 1.0,
    aux_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_p | y_<p) at every position p with ``loss_mask`` 1, as a ``[B, T]`` tensor (0 elsewhere).

    With ``aux_ids`` ``[B, T, K]``, also the log-probs of those auxiliary tokens at the same
    positions (``[B, T, K]``), from the same forward pass.
    """
    backbone, head = _backbone_and_head(model)
    hidden = backbone(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    h = hidden[:, :-1][trained_positions(batch)]
    return logprobs_from_hidden(h, batch, head, chunk, temperature, aux_ids)
