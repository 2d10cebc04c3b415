"""Log-prob computation and the per-turn decomposition, checked against autograd."""

import copy

import pytest
import torch

from factories import random_episode, set_advantages
from turnrl.config import ConfigError, LoraConfig, parse_config
from turnrl.models import attach_lora
from turnrl.train.batch import build_rows, collate
from turnrl.train.step import StepSettings, accumulate_gradients, token_logprobs

_episode = random_episode


def test_chunked_logprobs_equal_full_softmax(tiny_model):
    ep = _episode("e", 1)
    rows = build_rows(set_advantages([ep], {"e": [0.5, -0.5]}), per_turn=False)
    batch = collate(rows, pad_id=2)
    for chunk in (1, 3, 1000):
        logp, _ = token_logprobs(tiny_model, batch, chunk=chunk)
        full = tiny_model(input_ids=batch.input_ids).logits.float().log_softmax(-1)
        naive = torch.zeros_like(logp)
        naive[:, 1:] = full[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
        naive = naive * batch.loss_mask
        assert torch.allclose(logp, naive, atol=1e-5), chunk
        assert (logp[batch.loss_mask == 0] == 0).all()


def test_aux_logprobs_come_from_the_same_positions(tiny_model):
    ep = _episode("e", 2)
    batch = collate(build_rows(set_advantages([ep], {"e": [1.0, 1.0]}), per_turn=False), pad_id=2)
    aux = torch.randint(0, 500, (*batch.input_ids.shape, 3))
    _, aux_lp = token_logprobs(tiny_model, batch, chunk=4, aux_ids=aux)
    full = tiny_model(input_ids=batch.input_ids).logits.float().log_softmax(-1)
    expect = torch.zeros_like(aux_lp)
    expect[:, 1:] = full[:, :-1].gather(-1, aux[:, 1:])
    expect = expect * batch.loss_mask[..., None]
    assert torch.allclose(aux_lp, expect, atol=1e-5)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("loss_type", ["clip", "importance_sampling", "cispo"])
def test_decomposed_gradient_equals_single_pass(tiny_model, loss_type):
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    for p in model.parameters():  # make B non-zero so every LoRA weight has a gradient
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    episodes = [_episode(f"e{k}", k) for k in range(4)]
    advantages = {f"e{k}": [0.3 * (k - 1.5), -0.2 * k + 0.1] for k in range(4)}
    cfg = parse_config({"loss": {"type": loss_type}, "train": {"micro_batch_size": 2}})
    dcfg = parse_config({"loss": {"type": loss_type}, "train": {"micro_batch_size": 2, "decompose_turns": True}})

    # single pass: whole episodes as rows, both turns trained in one sequence
    whole = build_rows(set_advantages(episodes, advantages), per_turn=False)
    model.zero_grad()
    accumulate_gradients(model, whole, StepSettings.from_config(cfg), pad_id=2)
    single = _grads(model)

    # decomposed: turn-1 rows, then turn-2 rows (turn 2 carries turn 1 as masked prompt)
    per_turn = build_rows(set_advantages(episodes, advantages), per_turn=True)
    assert sorted({r.turn for r in per_turn}) == [0, 1]
    model.zero_grad()
    accumulate_gradients(model, per_turn, StepSettings.from_config(dcfg), pad_id=2)
    decomposed = _grads(model)

    # mixed: turn-1 and turn-2 rows in the same micro-batches, no decomposition
    model.zero_grad()
    accumulate_gradients(model, per_turn, StepSettings.from_config(cfg), pad_id=2)
    mixed = _grads(model)

    # max abs difference relative to the largest gradient entry (float32 summation order differs)
    scale = max(float(g.abs().max()) for g in single.values())
    assert scale > 0
    for name, g in single.items():
        assert float((decomposed[name] - g).abs().max()) / scale <= 1e-5, name
        assert float((mixed[name] - g).abs().max()) / scale <= 1e-5, name


def test_tree_prefix_trained_once():
    a, b = _episode("a", 1, branch=[0, 0]), _episode("b", 1, branch=[0, 1])
    b.turns[0] = copy.deepcopy(a.turns[0])  # same tokens; each leaf holds its own turn record
    rows = build_rows(set_advantages([a, b], {"a": [0.5, 0.1], "b": [None, -0.1]}), per_turn=True)
    assert [(r.episode_id, r.turn) for r in rows] == [("a", 0), ("a", 1), ("b", 1)]
    assert rows[2].ids[: len(a.turns[1].prompt_ids)] == a.turns[1].prompt_ids
    assert sum(rows[2].mask) == len(b.turns[1].action_ids)


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"loss": {"norm": "seq_mean"}}, "loss.norm is 'seq_mean'"),
        ({"loss": {"beta": 0.1}}, "loss.beta is 0.1"),
        ({"train": {"num_iterations": 2}}, "train.num_iterations is 2"),
    ],
)
def test_decomposition_rejects_inexact_settings(override, needle):
    data = {"train": {"decompose_turns": True}}
    for k, v in override.items():
        data.setdefault(k, {}).update(v)
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert needle in str(err.value) and "additive over turns" in str(err.value)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_optimizer_step_moves_logprob_with_the_advantage_sign(tiny_model, sign):
    from turnrl.train.batch import Row
    from turnrl.train.step import LocalTrainer, update

    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    ids = list(range(100, 120))
    rows = [Row(ids, [0] * 10 + [1] * 10, [sign] * 20, [0.0] * 10 + [-5.0] * 10, 0, "e")]
    batch = collate(rows, pad_id=2)
    with torch.no_grad():
        before = float(token_logprobs(model, batch)[0].sum())
    cfg = parse_config({"train": {"lr": 1e-2}})
    trainer = LocalTrainer(model, StepSettings.from_config(cfg), pad_id=2)
    for _ in range(3):
        metrics = update(trainer, rows, StepSettings.from_config(cfg))
    with torch.no_grad():
        after = float(token_logprobs(model, batch)[0].sum())
    assert (after - before) * sign > 0.5
    assert metrics["num_tokens"] == 10 and metrics["grad_norm"] > 0


def test_gradient_checkpointing_gives_the_same_gradient(tokenizer):
    from turnrl.config import ModelConfig
    from turnrl.models import enable_gradient_checkpointing, load_model

    episodes = [_episode(f"e{k}", k) for k in range(2)]
    advantages = {"e0": [0.5, -0.3], "e1": [-0.2, 0.4]}
    cfg = parse_config({"train": {"decompose_turns": True}})
    rows = build_rows(set_advantages(episodes, advantages), per_turn=True)
    grads = []
    for gc in (False, True):
        base = load_model(ModelConfig(name="tiny"))[0]
        if gc:
            enable_gradient_checkpointing(base)
        base.train()
        model = attach_lora(base, LoraConfig(r=4, alpha=8))
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(n)))
        accumulate_gradients(model, rows, StepSettings.from_config(cfg), pad_id=2)
        grads.append(_grads(model))
    scale = max(float(g.abs().max()) for g in grads[0].values())
    for name, g in grads[0].items():
        assert float((grads[1][name] - g).abs().max()) / scale <= 1e-5, name
