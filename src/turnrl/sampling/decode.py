"""One generation call of the HF sampler over :class:`turnrl.sampling.packed.PackedDecoder` (``fast_decode``).

The call's cache: the prefix every context shares, kept once (``[1, KV, c, D]`` per layer; from a kept
past of an earlier turn, or run once), and per row its own columns,

    [left padding | its kept keys/values after the prefix | left padding | the rest of its context | new tokens]

in buffers allocated once for the call (the new tokens' columns included). RoPE positions count each row's
tokens, padding excluded, as transformers' ``attention_mask.cumsum − 1`` does.

Rows of the call that are the same context (a group's first turn: G rows of one prompt) are run through it
once; after that forward each row gets its own copy of the keys/values and decodes on its own.

The loop is ``generate``'s greedy loop: each step's token is the argmax of the logits, or at T > 0 the
sampler's draw (its warpers and inverse CDF, :mod:`turnrl.sampling.draws`); a row that emitted a stop token
is padded until every row has stopped or ``max_tokens`` is reached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnrl.sampling.packed import PackedDecoder


@dataclass
class Call:
    """A call's inputs laid out for the decoder (see the module docstring)."""

    ids: torch.Tensor
    """``[U, W]`` the distinct rows' own columns (padding: the pad id)."""
    attention: torch.Tensor
    """``[U, W]`` 1 where a column is a token."""
    cached: int
    """Row columns already in ``cache`` (the kept keys/values after the prefix)."""
    cache: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer the rows' ``[U, KV, W + max_tokens, D]`` key and value buffers (``[B, …]`` once generating)."""
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None
    """Per layer the shared prefix's ``[1, KV, c, D]`` keys and values (None: no shared prefix)."""
    prefix_len: int
    rows: torch.Tensor
    """``[B]`` each row's distinct row: the rows of a call that are the same context continuing the same kept
    past (a group's first turn) are run once through the context, then each decodes on its own."""


def prepare(
    decoder: PackedDecoder, contexts: list[list[int]], kept: list | None, shared: int, max_tokens: int, pad_id: int
) -> Call:
    """The call's layout: ``kept`` (per row the kept past to continue and its match length, or None: nothing
    kept) and ``shared`` (the prefix length to share; with ``kept``, at most every match length)."""
    distinct: dict[tuple, int] = {}
    rows = [
        distinct.setdefault((tuple(c), id(kept[r][0]) if kept else None), len(distinct)) for r, c in enumerate(contexts)
    ]
    firsts = [rows.index(u) for u in range(len(distinct))]
    contexts = [contexts[r] for r in firsts]
    kept = [kept[r] for r in firsts] if kept is not None else None
    U = len(contexts)
    if kept is not None:
        starts = [m for _, m in kept]
        prefix = [(k[None, :, :shared], v[None, :, :shared]) for k, v in kept[0][0].kv] if shared else None
    else:
        starts = [shared] * U
        prefix = None
        if shared:  # run the shared prefix once, for no logits
            prefix = decoder.new_cache(1, shared)
            ids = torch.tensor(contexts[0][:shared]).unsqueeze(0)
            every = torch.ones(1, shared, dtype=torch.bool)
            decoder.forward(ids, torch.arange(shared)[None], prefix, 0, every, logits=False)
    cached = max(m - shared for m in starts)
    width = cached + max(len(c) - m for c, m in zip(contexts, starts, strict=True))
    ids = torch.full((U, width), pad_id, dtype=torch.long)
    attention = torch.zeros((U, width), dtype=torch.long)
    cache = decoder.new_cache(U, width + max_tokens)
    for keys, values in cache:  # the kept columns' padding is read (masked): zeros, not garbage
        keys[:, :, :cached] = 0
        values[:, :, :cached] = 0
    for row, (ctx, m) in enumerate(zip(contexts, starts, strict=True)):
        n = m - shared
        attention[row, cached - n : cached] = 1
        ids[row, cached - n : cached] = torch.tensor(ctx[shared:m], dtype=torch.long)
        if n:  # a kept past to continue (n > 0 only with kept)
            assert kept is not None
            for (keys, values), (k, v) in zip(cache, kept[row][0].kv, strict=True):
                keys[row, :, cached - n : cached] = k[:, shared:m]
                values[row, :, cached - n : cached] = v[:, shared:m]
        rest = len(ctx) - m
        ids[row, width - rest :] = torch.tensor(ctx[m:], dtype=torch.long)
        attention[row, width - rest :] = 1
    return Call(ids, attention, cached, cache, prefix, shared, torch.tensor(rows))


@torch.no_grad()
def generate(
    decoder: PackedDecoder, call: Call, max_new_tokens: int, stop_ids: list[int], pad_id: int, draw=None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The new tokens ``[B, n]`` and each step's logits ``[B, V]``. ``draw`` (``(input_ids, logits) → tokens``,
    given the rows' own columns so far) picks each step's tokens (None: the argmax)."""
    c, rows = call.prefix_len, call.rows
    positions = (call.attention.cumsum(-1) - 1 + c).masked_fill(call.attention == 0, 0)
    k = call.cached
    U, W = call.ids.shape
    valid = torch.zeros(U, W + max_new_tokens, dtype=torch.bool)
    valid[:, :W] = call.attention.bool()
    logits = decoder.forward(call.ids[:, k:], positions[:, k:], call.cache, k, valid[:, :W], call.prefix)
    assert logits is not None  # forward returns None only when asked for no logits
    if U < len(rows):  # every row its own copy of its distinct row's keys/values from here on
        call.cache = [(keys.index_select(0, rows), values.index_select(0, rows)) for keys, values in call.cache]
        call.ids, call.attention, valid, positions = (
            t.index_select(0, rows) for t in (call.ids, call.attention, valid, positions)
        )
        logits = logits.index_select(0, rows)
    B = len(rows)
    sequences = torch.full((B, W + max_new_tokens), pad_id, dtype=torch.long)
    sequences[:, :W] = call.ids
    stops = torch.tensor(stop_ids, dtype=torch.long)
    running = torch.ones(B, dtype=torch.bool)
    scores: list[torch.Tensor] = []
    last = positions[:, -1:]
    for step in range(max_new_tokens):
        col = W + step
        scores.append(logits)
        token = draw(sequences[:, :col], logits) if draw is not None else logits.argmax(-1)
        token = torch.where(running, token, pad_id)
        sequences[:, col] = token
        running &= ~torch.isin(token, stops)
        if not running.any() or step + 1 == max_new_tokens:
            break
        valid[:, col] = True
        last = last + 1
        logits = decoder.forward(token[:, None], last, call.cache, col, valid[:, : col + 1], call.prefix)
        assert logits is not None
    return sequences[:, W : W + len(scores)], scores


def row_kv(call: Call, row: int, fed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer row ``row``'s own ``[KV, L, D]`` keys and values: the shared prefix, its context's tokens and
    the ``fed`` new tokens it fed."""
    W = call.ids.shape[1]
    cols = torch.cat([call.attention[row].nonzero().squeeze(-1), torch.arange(W, W + fed)])
    out = []
    for k, (keys, values) in enumerate(call.cache):
        mine = keys[row].index_select(1, cols), values[row].index_select(1, cols)
        if call.prefix is not None:
            pk, pv = call.prefix[k]
            mine = torch.cat([pk[0], mine[0]], dim=1), torch.cat([pv[0], mine[1]], dim=1)
        out.append(mine)
    return out
