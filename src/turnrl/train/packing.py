"""Shared-prefix training: the rows of a micro-batch as one token trie, each unique token run once.

Rows that share a token prefix (a group's prompt, a tree's first turns, the earlier
turns of an episode for per-turn rows) are merged into a prefix tree. Its nodes are
the unique (prefix, token) pairs; they run as one packed sequence per *pack* with a
4D attention mask in which a node attends only to its trie ancestors and itself, and
``position_ids`` = the node's depth (its position in every row that contains it).
Each node's hidden state is therefore exactly the hidden state of that position in
every row through it, and with LoRA on the attention projections the prefix's
keys/values stay in the autograd graph: the gradient through a shared prefix is the
sum over every suffix that attends to it, as in the per-row computation — this is not
a no-grad KV cache.

A trained token's log-prob is computed from its trie parent's hidden state, once per
*row position* (rows sharing a trained token each get their own term, with their own
auxiliary tokens), and scattered into the ``[B, T]`` layout of
:func:`turnrl.train.batch.collate`, so the loss code is unchanged. Log-probs come
from hidden states in checkpointed chunks, as in :mod:`turnrl.train.step`: the full
``[tokens × vocab]`` tensor never exists.

The mask is ``N × N`` for a pack of ``N`` unique tokens; ``max_pack_tokens`` bounds
it. Rows are added to a pack in order while its trie stays within the bound; a row
that does not fit starts a new pack (a prefix split across packs runs once per pack).

The pack's *trunk* — the prefix every row of the pack shares (a group's prompt, a
tree's root context) — runs first as an ordinary causal sequence, with its keys and
values kept (in the graph, with grad) as the past of a second call that runs the rest
of the trie with the ancestor mask. SDPA's CPU and GPU kernels skip the masked-out half
of a causal sequence but compute every score of an arbitrary mask, so the trunk's
``t²/2`` causal scores replace ``t²`` masked ones, and the mask shrinks to
``(N − t) × N``; with a 3,000-token slosh prompt in front of 300 branch tokens this
halves the attention work. With gradient checkpointing (which turns off the key/value
cache) the pack runs as one masked sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from turnrl.models import CACHE_KWARG
from turnrl.train.batch import Batch, Row, collate
from turnrl.train.logprobs import _backbone_and_head, logprobs_from_hidden, trained_positions

DEFAULT_MAX_PACK_TOKENS = 8192


@dataclass
class Pack:
    """One packed sequence: unique tokens in trie order (every parent before its children)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    """Index of each node's parent within the pack; -1 for a root."""
    depths: list[int] = field(default_factory=list)
    trunk: int = 0
    """Nodes ``[0, trunk)`` are a chain on every row's path (the prefix all rows of the pack share)."""

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class PackStats:
    rows: int
    total_tokens: int
    """Sum of the row lengths (what the per-row path runs, padding excluded)."""
    padded_tokens: int
    """``rows × longest row`` (what the per-row path runs, padding included)."""
    unique_tokens: int
    """Trie nodes over all packs (what the packed path runs)."""
    packs: int

    @property
    def sharing(self) -> float:
        """total / unique tokens: how many times fewer tokens the packed path runs."""
        return self.total_tokens / max(self.unique_tokens, 1)


@dataclass
class PackPlan:
    packs: list[Pack]
    node_of: list[list[int]]
    """``node_of[i][p]``: the global node index (packs concatenated in order) of row i's position p."""
    stats: PackStats


def plan_packs(sequences: list[list[int]], max_pack_tokens: int = DEFAULT_MAX_PACK_TOKENS) -> PackPlan:
    """Merge token sequences into tries of at most ``max_pack_tokens`` nodes (a longer row gets its own pack)."""
    if max_pack_tokens < 1:
        raise ValueError("max_pack_tokens must be at least 1")
    packs: list[Pack] = []
    node_of: list[list[int]] = []
    offset = 0  # global index of the current pack's first node
    pack: Pack | None = None
    children: dict[tuple[int, int], int] = {}  # (parent, token) -> node, within the current pack
    for seq in sequences:
        if pack is not None and len(pack) > 0:
            # count the nodes this row would add; start a new pack if the trie would overflow
            parent, new = -1, 0
            for p, tok in enumerate(seq):
                child = children.get((parent, tok))
                if child is None:
                    new = len(seq) - p
                    break
                parent = child
            if len(pack) + new > max_pack_tokens:
                offset += len(pack)
                pack = None
        if pack is None:
            pack = Pack()
            packs.append(pack)
            children = {}
        nodes = []
        parent = -1
        fresh = len(pack) == 0
        for depth, tok in enumerate(seq):
            child = children.get((parent, tok))
            if child is None:
                child = len(pack)
                children[(parent, tok)] = child
                pack.tokens.append(tok)
                pack.parents.append(parent)
                pack.depths.append(depth)
            nodes.append(offset + child)
            parent = child
        # the first row's nodes are 0..len-1; the trunk is the longest prefix of them on every row's path
        reach = len(seq) if fresh else min(len(nodes), pack.trunk)
        pack.trunk = next((p for p in range(reach) if nodes[p] - offset != p), reach)
        node_of.append(nodes)
    total = sum(len(s) for s in sequences)
    width = max((len(s) for s in sequences), default=0)
    stats = PackStats(len(sequences), total, width * len(sequences), sum(len(p) for p in packs), len(packs))
    return PackPlan(packs, node_of, stats)


def _row_sequences(batch: Batch) -> list[list[int]]:
    lengths = batch.attention_mask.sum(-1).tolist()
    ids = batch.input_ids.tolist()
    return [row[:n] for row, n in zip(ids, lengths, strict=True)]


def plan_batch(batch: Batch, max_pack_tokens: int = DEFAULT_MAX_PACK_TOKENS) -> PackPlan:
    """The pack plan for a right-padded batch (rows are the unpadded prefixes of ``input_ids``)."""
    return plan_packs(_row_sequences(batch), max_pack_tokens)


def ancestor_mask(parents: list[int], device=None) -> torch.Tensor:
    """``[N, N]`` bool: entry (j, k) true iff node k is node j or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    idx = torch.arange(n, device=device)
    mask[idx, idx] = True
    # parents precede children, so each row is its parent's row plus itself; do it level by level
    parent = torch.tensor(parents, dtype=torch.long, device=device)
    depth = torch.zeros(n, dtype=torch.long)
    for j, p in enumerate(parents):
        depth[j] = depth[p] + 1 if p >= 0 else 0
    depth = depth.to(device)
    for d in range(1, int(depth.max()) + 1 if n else 0):
        at = (depth == d).nonzero().squeeze(-1)
        mask[at] |= mask[parent[at]]
    return mask


def _attention_mask(pack: Pack, model, dtype: torch.dtype, device, start: int = 0) -> torch.Tensor:
    """The 4D mask of nodes ``[start, N)`` over all N, which transformers takes as-is: bool for sdpa
    (True = attend), additive for eager."""
    allowed = ancestor_mask(pack.parents, device)[None, None, start:]
    impl = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def _pack_hidden(backbone, model, pack: Pack, device) -> torch.Tensor:
    ids = torch.tensor([pack.tokens], dtype=torch.long, device=device)
    positions = torch.tensor([pack.depths], dtype=torch.long, device=device)
    dtype = backbone.get_input_embeddings().weight.dtype
    t = pack.trunk
    if t == 0 or (backbone.training and backbone.gradient_checkpointing):
        mask = _attention_mask(pack, model, dtype, device)
        out = backbone(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
        return out.last_hidden_state[0]
    # the trunk causally; its keys/values (with grad) are the past of the rest of the trie
    trunk = backbone(input_ids=ids[:, :t], position_ids=positions[:, :t], use_cache=True)
    if t == len(pack):
        return trunk.last_hidden_state[0]
    rest = backbone(
        input_ids=ids[:, t:],
        attention_mask=_attention_mask(pack, model, dtype, device, start=t),
        position_ids=positions[:, t:],
        **{CACHE_KWARG: getattr(trunk, CACHE_KWARG)},
        use_cache=True,
    )
    return torch.cat([trunk.last_hidden_state[0], rest.last_hidden_state[0]])


def packed_token_logprobs(
    model,
    batch: Batch,
    chunk: int = 256,
    temperature: float = 1.0,
    aux_ids: torch.Tensor | None = None,
    max_pack_tokens: int = DEFAULT_MAX_PACK_TOKENS,
    plan: PackPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drop-in for :func:`turnrl.train.step.token_logprobs`, with every shared prefix run once.

    Same arguments and outputs (``[B, T]`` log-probs at ``loss_mask`` positions, 0 elsewhere;
    ``[B, T, K]`` auxiliary log-probs with ``aux_ids``), laid out as ``batch``.
    """
    plan = plan or plan_batch(batch, max_pack_tokens)
    backbone, head = _backbone_and_head(model)
    device = batch.input_ids.device
    B, T = batch.input_ids.shape
    hidden = torch.cat([_pack_hidden(backbone, model, pack, device) for pack in plan.packs])
    node = torch.zeros(B, T, dtype=torch.long)
    for i, nodes in enumerate(plan.node_of):
        node[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
    node = node.to(device)
    # the hidden state at p-1 (the trie parent) predicts token p
    h = hidden[node[:, :-1][trained_positions(batch)]]
    return logprobs_from_hidden(h, batch, head, chunk, temperature, aux_ids)


def packed_row_logprobs(
    model,
    rows: list[Row],
    pad_id: int,
    chunk: int = 256,
    temperature: float = 1.0,
    aux_ids: torch.Tensor | None = None,
    max_pack_tokens: int = DEFAULT_MAX_PACK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`packed_token_logprobs` on ``collate(rows, pad_id)`` (on the model's device)."""
    device = next(model.parameters()).device
    batch = collate(rows, pad_id).to(device)
    plan = plan_packs([r.ids for r in rows], max_pack_tokens)
    return packed_token_logprobs(model, batch, chunk, temperature, aux_ids, plan=plan)


def row_stats(rows: list[Row], max_pack_tokens: int = DEFAULT_MAX_PACK_TOKENS) -> PackStats:
    """Unique vs total tokens of the packed path for these rows (one micro-batch)."""
    return plan_packs([r.ids for r in rows], max_pack_tokens).stats
