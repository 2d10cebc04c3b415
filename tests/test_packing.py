"""Shared-prefix (trie-packed) log-probs: loss and LoRA gradients equal the per-row computation."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from factories import set_advantages
from turnrl.config import LoraConfig, parse_config
from turnrl.models import attach_lora
from turnrl.train import step as step_mod
from turnrl.train.batch import Row, build_rows, collate
from turnrl.train.packing import (
    ancestor_mask,
    packed_row_logprobs,
    packed_token_logprobs,
    plan_packs,
    row_stats,
)
from turnrl.types import Episode, Turn

LOSSES = ["clip", "importance_sampling", "cispo", "centered"]
TOPK = 4


def _rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(5, 1000, (n,), generator=g).tolist()


def _turn(index: int, prompt: list[int], action: list[int], g: torch.Generator) -> Turn:
    lps = (-0.2 - torch.rand(len(action), generator=g)).tolist()
    topk_ids = [[a] + _rand(g, TOPK - 1) for a in action]
    topk_lps = [sorted((-0.1 - 3 * torch.rand(TOPK, generator=g)).tolist(), reverse=True) for _ in action]
    return Turn(index, prompt, action, lps, "", policy_version=0, topk_ids=topk_ids, topk_logprobs=topk_lps)


def tree_episodes(branching: list[int], seed: int = 0, prompt_len: int = 9, action_len=(3, 6), env_len: int = 3):
    """Episodes of a rollout tree: level d has branching[d] children; leaves are episodes.

    Episodes below the same level-d node share its first d+1 turns (the same Turn objects' tokens);
    a shared turn is trained in the first leaf below it and masked (advantage None) in the others.
    Flat groups are ``[G]``: every episode shares only the prompt.
    """
    g = torch.Generator().manual_seed(seed)
    prompt = _rand(g, prompt_len)
    episodes, advantages = [], {}
    depth = len(branching)
    shared: dict[tuple[int, ...], Turn] = {}
    for leaf in itertools.product(*[range(b) for b in branching]):
        turns, context, advs = [], list(prompt), []
        for d in range(depth):
            key = leaf[: d + 1]
            if key not in shared:
                n = int(torch.randint(action_len[0], action_len[1] + 1, (1,), generator=g))
                shared[key] = _turn(d, list(context), _rand(g, n), g)
                first = True
            else:
                first = False
            turn = shared[key]
            turns.append(copy.deepcopy(turn))  # same tokens; each leaf holds its own record
            advs.append(round(float(torch.randn(1, generator=g)), 3) if first else None)
            context = turn.prompt_ids + turn.action_ids + _rand(torch.Generator().manual_seed(hash(key) % 997), env_len)
        eid = "e" + "".join(map(str, leaf))
        episodes.append(
            Episode(
                eid,
                "t",
                turns,
                reward=0.0,
                terminated=True,
                truncated=False,
                group_id="g",
                branch=list(leaf),
            )
        )
        advantages[eid] = advs
    return episodes, advantages


SHAPES = {
    "flat": ([4, 1], False),  # a group of 4 two-turn episodes sharing only the prompt
    "tree2": ([2, 3], False),
    "tree3": ([2, 2, 2], False),
    "per_turn": ([3, 1, 1], True),  # per-turn rows: each turn's row re-contains earlier turns
}


def _lora_model(tiny_model):
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    for n, p in model.named_parameters():  # B non-zero so every LoRA weight has a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _run(model, rows, cfg, packed: bool, old: dict, monkeypatch, max_pack_tokens: int = 8192):
    """step.accumulate_gradients with ``train.shared_prefix`` on (packed) or off (per-row)."""
    cfg.train.shared_prefix = packed
    cfg.train.max_pack_tokens = max_pack_tokens
    monkeypatch.setattr(step_mod, "token_logprobs", _PER_ROW)
    model.zero_grad(set_to_none=True)
    metrics = step_mod.accumulate_gradients(
        model,
        rows,
        step_mod.StepSettings.from_config(cfg),
        pad_id=2,
        old_logprobs=old,
        generator=torch.Generator().manual_seed(7),
    )
    return metrics, _grads(model)


_PER_ROW = step_mod.token_logprobs


def _old_logprobs(model, rows, cfg, monkeypatch) -> dict[int, torch.Tensor]:
    """Old-policy log-probs per micro-batch, perturbed so ratios leave 1 and clipping/truncation act."""
    old: dict[int, torch.Tensor] = {}
    _run(model, rows, cfg, False, old, monkeypatch)
    g = torch.Generator().manual_seed(3)
    return {k: v + 0.4 * torch.randn(v.shape, generator=g) for k, v in old.items()}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-5):
    scale = max(float(g.abs().max()) for g in a.values())
    assert scale > 0
    for name, g in a.items():
        assert float((b[name] - g).abs().max()) / scale <= tol, name


def _compare(model, rows, cfg, monkeypatch, max_pack_tokens: int = 8192):
    old = _old_logprobs(model, rows, cfg, monkeypatch)
    m_row, g_row = _run(model, rows, cfg, False, dict(old), monkeypatch)
    m_pack, g_pack = _run(model, rows, cfg, True, dict(old), monkeypatch, max_pack_tokens)
    assert m_row.keys() == m_pack.keys()
    for key, value in m_row.items():
        assert m_pack[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    _assert_close(g_row, g_pack)
    return m_row


CASES = [(shape, loss, False) for shape in SHAPES for loss in LOSSES]
CASES += [(shape, loss, True) for shape in SHAPES for loss in ("clip", "centered")]


@pytest.mark.parametrize("shape, loss_type, decompose", CASES)
def test_packed_loss_and_gradients_equal_per_row(tiny_model, monkeypatch, shape, loss_type, decompose):
    branching, per_turn = SHAPES[shape]
    model = _lora_model(tiny_model)
    episodes, advantages = tree_episodes(branching, seed=len(shape))
    rows = build_rows(set_advantages(episodes, advantages), per_turn=per_turn or decompose)
    loss = {"type": loss_type, "centered": {"top_k": TOPK, "num_aux": 3}}
    cfg = parse_config(
        {
            "loss": loss,
            "sampler": {"top_k_logprobs": TOPK},
            "train": {"micro_batch_size": 64, "decompose_turns": decompose},
        }
    )
    metrics = _compare(model, rows, cfg, monkeypatch)
    assert metrics["loss"] != 0
    if not decompose:
        assert row_stats(rows).unique_tokens < row_stats(rows).total_tokens


def test_micro_batches_small_packs_and_kl_term(tiny_model, monkeypatch):
    """Several micro-batches, packs split by a small token bound, and the β > 0 reference pass."""
    model = _lora_model(tiny_model)
    episodes, advantages = tree_episodes([2, 2, 2], seed=5)
    rows = build_rows(set_advantages(episodes, advantages), per_turn=True)
    plan = plan_packs([r.ids for r in rows], max_pack_tokens=40)
    assert plan.stats.packs > 1 and all(
        len(p) <= 40 or len(p) == max(map(len, (r.ids for r in rows))) for p in plan.packs
    )
    cfg = parse_config({"loss": {"type": "clip", "beta": 0.1}, "train": {"micro_batch_size": 3}})
    _compare(model, rows, cfg, monkeypatch, max_pack_tokens=40)


def test_rows_without_shared_prefix_give_identical_results(tiny_model):
    model = _lora_model(tiny_model)
    g = torch.Generator().manual_seed(11)
    rows = []
    for k in range(3):
        ids = [10 + k] + _rand(g, 6 + 2 * k)  # distinct first tokens: nothing shared
        mask = [0] * 4 + [1] * (len(ids) - 4)
        rows.append(Row(ids, mask, [0.5 - k] * len(ids), [-1.0] * len(ids), -1, f"e{k}"))
    assert row_stats(rows).unique_tokens == row_stats(rows).total_tokens
    batch = collate(rows, pad_id=2)
    lp_row, _ = step_mod.token_logprobs(model, batch)
    (lp_row * batch.advantages).sum().backward()
    g_row = _grads(model)
    model.zero_grad(set_to_none=True)
    lp_pack, _ = packed_row_logprobs(model, rows, pad_id=2)
    (lp_pack * batch.advantages).sum().backward()
    assert torch.allclose(lp_pack, lp_row, atol=1e-6, rtol=1e-5)
    assert (lp_pack[batch.loss_mask == 0] == 0).all()
    _assert_close(g_row, _grads(model))


def test_eager_attention_takes_the_additive_mask(tiny_model):
    model = _lora_model(tiny_model)
    episodes, advantages = tree_episodes([2, 2], seed=2)
    rows = build_rows(set_advantages(episodes, advantages), per_turn=True)
    batch = collate(rows, pad_id=2)
    aux = torch.randint(0, 900, (*batch.input_ids.shape, 2), generator=torch.Generator().manual_seed(0))
    ref, ref_aux = step_mod.token_logprobs(model, batch, chunk=5, aux_ids=aux)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    lp, lp_aux = packed_token_logprobs(model, batch, chunk=5, aux_ids=aux)
    assert torch.allclose(lp, ref, atol=1e-5) and torch.allclose(lp_aux, ref_aux, atol=1e-5)


def test_trie_plan_and_mask():
    plan = plan_packs([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3, 6], [7]])
    (pack,) = plan.packs
    assert pack.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert pack.parents == [-1, 0, 1, 1, 3, 2, -1]
    assert pack.depths == [0, 1, 2, 2, 3, 3, 0]
    assert plan.node_of == [[0, 1, 2], [0, 1, 3, 4], [0, 1, 2, 5], [6]]
    assert (plan.stats.total_tokens, plan.stats.unique_tokens, plan.stats.padded_tokens) == (
        12,
        7,
        16,
    )
    mask = ancestor_mask(pack.parents)
    assert mask[4].tolist() == [True, True, False, True, True, False, False]
    assert mask[6].tolist() == [False] * 6 + [True]
    assert not mask.triu(1).any()  # ancestors precede their descendants
    split = plan_packs([[1, 2, 3], [1, 2, 4, 5], [1, 2, 3, 6], [7]], max_pack_tokens=4)
    # greedy in row order: each row that would push the trie past 4 nodes starts a new pack
    assert [len(p) for p in split.packs] == [3, 4, 4, 1]
    assert split.node_of[1] == [3, 4, 5, 6] and split.node_of[3] == [11]
    # the trunk: the prefix on every row's path of a pack (run causally, before the masked rest)
    assert pack.trunk == 0 and [p.trunk for p in split.packs] == [3, 4, 4, 1]
    assert plan_packs([[1, 2, 3], [1, 2, 4]]).packs[0].trunk == 2
    assert plan_packs([[1, 2], [1, 2, 3]]).packs[0].trunk == 2  # a later row extending the first
    assert plan_packs([[1, 2, 3, 4], [1, 2], [1, 2, 3]]).packs[0].trunk == 2
    assert plan_packs([[5, 1, 2], [5, 1, 2]]).packs[0].trunk == 3  # identical rows: all trunk


def test_gradient_checkpointing_runs_the_pack_as_one_masked_sequence(tiny_model, monkeypatch):
    """Checkpointed layers drop the key/value cache, so the trunk is not split off; same results."""
    model = _lora_model(tiny_model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    episodes, advantages = tree_episodes([2, 2], seed=4)
    rows = build_rows(set_advantages(episodes, advantages), per_turn=True)
    assert plan_packs([r.ids for r in rows]).packs[0].trunk > 0
    _compare(model, rows, parse_config({"train": {"micro_batch_size": 64}}), monkeypatch)


def test_per_turn_rows_cost_no_more_unique_tokens_than_episode_rows():
    """A depth-3 number-guess-like batch: per-turn rows repeat earlier turns; the trie runs them once."""
    episodes, advantages = tree_episodes([4, 1, 1], seed=1, prompt_len=150, action_len=(8, 16), env_len=12)
    per_turn = build_rows(set_advantages(episodes, advantages), per_turn=True)
    whole = build_rows(set_advantages(episodes, advantages), per_turn=False)
    s_turn, s_whole = row_stats(per_turn), row_stats(whole)
    print(f"\nper-turn rows: {s_turn}\nepisode rows: {s_whole}")
    # every per-turn row is a prefix of its episode row
    assert s_turn.unique_tokens == s_whole.unique_tokens
    assert s_turn.total_tokens > 2.5 * s_turn.unique_tokens
