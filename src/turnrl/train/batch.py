"""Episodes → training rows → padded tensors.

A *row* is one sequence with a loss mask: either a whole episode (every trained
turn's tokens masked in, the episode as one sequence) or a single turn (the
turn's full context as masked prompt, its action as the trained tokens). The
advantages are the turns' own ``Turn.advantage`` (set by credit); turns whose
advantage is None (a tree's shared prefix, trained in another leaf) are masked
out. :func:`mask_truncated_turns` (``train.mask_truncated_completions``) sets it to
None on length-cut turns after credit, so they are masked out the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnrl.types import Episode, Turn, new_prompt_lengths


@dataclass
class Row:
    ids: list[int]
    mask: list[int]
    advantages: list[float]
    behavior_logprobs: list[float]
    turn: int
    """Turn index of a per-turn row; -1 for a whole-episode row."""
    episode_id: str
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    turns_trained: int = 1
    """How many turns of this row carry trained tokens."""


def _turn_tokens(turn: Turn, advantage: float | None, n_prompt: int) -> tuple[list[int], list[float], list[float]]:
    """Mask, advantages and behavior log-probs for ``n_prompt`` untrained tokens followed by a turn's action."""
    n = len(turn.action_ids)
    mask = [0] * n_prompt + [int(advantage is not None)] * n
    adv = [0.0] * n_prompt + [0.0 if advantage is None else advantage] * n
    lps = [0.0] * n_prompt + list(turn.action_logprobs)
    return mask, adv, lps


def _topk(turns_and_prompts: list[tuple[Turn, int]]) -> tuple[list[list[int]] | None, list[list[float]] | None]:
    ids: list[list[int]] = []
    lps: list[list[float]] = []
    for turn, n_prompt in turns_and_prompts:
        if turn.topk_ids is None or turn.topk_logprobs is None:
            return None, None
        k = len(turn.topk_ids[0]) if turn.topk_ids else 0
        ids += [[0] * k] * n_prompt + turn.topk_ids
        lps += [[0.0] * k] * n_prompt + turn.topk_logprobs
    return ids, lps


def turn_rows(episode: Episode) -> list[Row]:
    """One row per trained turn: context (masked) + action (trained)."""
    rows = []
    for turn in episode.turns:
        adv = turn.advantage
        if adv is None:
            continue
        mask, advs, lps = _turn_tokens(turn, adv, len(turn.prompt_ids))
        topk_ids, topk_lps = _topk([(turn, len(turn.prompt_ids))])
        rows.append(Row(turn.sequence_ids, mask, advs, lps, turn.index, episode.episode_id, topk_ids, topk_lps))
    return rows


def episode_row(episode: Episode) -> Row:
    """The whole episode as one row; requires each turn's context to extend the previous one."""
    mask: list[int] = []
    advs: list[float] = []
    lps: list[float] = []
    parts: list[tuple[Turn, int]] = []
    for turn, n_prompt in zip(episode.turns, new_prompt_lengths(episode), strict=True):
        m, a, lp = _turn_tokens(turn, turn.advantage, n_prompt)
        mask, advs, lps = mask + m, advs + a, lps + lp
        parts.append((turn, n_prompt))
    last = episode.turns[-1]
    ids = last.prompt_ids + last.action_ids
    topk_ids, topk_lps = _topk(parts)
    trained = sum(t.advantage is not None for t in episode.turns)
    return Row(ids, mask, advs, lps, -1, episode.episode_id, topk_ids, topk_lps, trained)


def build_rows(episodes: list[Episode], per_turn: bool) -> list[Row]:
    """Training rows for a batch (after credit); rows with no trained token are dropped."""
    rows: list[Row] = []
    for ep in episodes:
        rows += turn_rows(ep) if per_turn else [episode_row(ep)]
    return [r for r in rows if any(r.mask)]


def mask_truncated_turns(episodes: list[Episode]) -> dict[str, float]:
    """``train.mask_truncated_completions``: a length-cut turn is not trained (advantage None).

    Call after credit. Returns ``completions/masked_truncated``: the fraction of turns masked.
    """
    turns = [t for ep in episodes for t in ep.turns]
    masked = 0
    for t in turns:
        if t.finish_reason == "length" and t.advantage is not None:
            t.advantage = None
            masked += 1
    return {"completions/masked_truncated": masked / len(turns) if turns else 0.0}


@dataclass
class Batch:
    """Right-padded tensors for a list of rows; log-prob-like tensors align with token positions."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    behavior_logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            self.advantages.to(device),
            self.behavior_logprobs.to(device),
            move(self.topk_ids),
            move(self.topk_logprobs),
        )


def collate(rows: list[Row], pad_id: int) -> Batch:
    width = max(len(r.ids) for r in rows)

    def pad(values: list, fill) -> list:
        return values + [fill] * (width - len(values))

    batch = Batch(
        input_ids=torch.tensor([pad(r.ids, pad_id) for r in rows], dtype=torch.long),
        attention_mask=torch.tensor([pad([1] * len(r.ids), 0) for r in rows], dtype=torch.long),
        loss_mask=torch.tensor([pad(r.mask, 0) for r in rows], dtype=torch.float32),
        advantages=torch.tensor([pad(r.advantages, 0.0) for r in rows], dtype=torch.float32),
        behavior_logprobs=torch.tensor([pad(r.behavior_logprobs, 0.0) for r in rows], dtype=torch.float32),
    )
    ids = [r.topk_ids for r in rows if r.topk_ids is not None]
    lps = [r.topk_logprobs for r in rows if r.topk_logprobs is not None]
    if len(ids) == len(lps) == len(rows):  # every row carries the sampler's top-k
        k = max(len(x) for row in ids for x in row)
        batch.topk_ids = torch.tensor([pad(row, [0] * k) for row in ids], dtype=torch.long)
        batch.topk_logprobs = torch.tensor([pad(row, [0.0] * k) for row in lps], dtype=torch.float32)
    return batch
