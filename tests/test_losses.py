"""Losses: values and gradients against hand-computed numbers (ALGORITHMS.md §2)."""

from __future__ import annotations

import math

import pytest
import torch

from turnrl.config import LossConfig, MismatchConfig
from turnrl.losses import (
    LOSSES,
    LossPlan,
    MismatchCorrection,
    centered_loss,
    cispo_loss,
    clip_loss,
    finalize_metrics,
    importance_sampling_loss,
    kl_k3,
    mismatch_weights,
    normalize,
    per_token_loss,
    sample_aux_tokens,
)

LOG = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def leaf(x):
    return t(x).requires_grad_(True)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss.sum(), x)
    return g


def test_clip_loss_all_four_cases():
    # old_logp = 0 → ρ = exp(logp); ε_lo = .2, ε_hi = .28
    logp = leaf([LOG(1.5), LOG(0.5), LOG(0.5), LOG(1.5)])
    adv = t([1.0, 1.0, -1.0, -1.0])
    loss = clip_loss(logp, torch.zeros_like(logp), adv, 0.2, 0.28)
    # ρ=1.5,A=1: −min(1.5, 1.28) = −1.28 (clipped, no grad); ρ=.5,A=1: −.5 (grad −ρA = −.5)
    # ρ=.5,A=−1: −min(−.5, −.8) = .8 (clipped);            ρ=1.5,A=−1: 1.5 (grad 1.5)
    torch.testing.assert_close(loss, t([-1.28, -0.5, 0.8, 1.5]))
    torch.testing.assert_close(grad_of(loss, logp), t([0.0, -0.5, 0.0, 1.5]))


def test_importance_sampling_loss():
    logp = leaf([LOG(0.5)])
    loss = importance_sampling_loss(logp, t([LOG(0.25)]), t([3.0]))  # ρ = 2: ℓ = −6, ∇ = −ρA = −6
    torch.testing.assert_close(loss, t([-6.0]))
    torch.testing.assert_close(grad_of(loss, logp), t([-6.0]))


def test_cispo_loss_truncates_the_detached_weight():
    logp = leaf([LOG(0.5), LOG(0.5)])
    old = t([LOG(0.05), LOG(0.25)])  # ρ = 10 → capped at 5; ρ = 2
    loss = cispo_loss(logp, old, t([2.0, 2.0]), eps_max=5.0)
    # ℓ = −w A log .5 = [10 log 2, 4 log 2]; ∇ = −w A = [−10, −4]
    torch.testing.assert_close(loss, t([10 * LOG(2), 4 * LOG(2)]))
    torch.testing.assert_close(grad_of(loss, logp), t([-10.0, -4.0]))


def test_centered_value_is_pg_and_gradient_is_centered():
    logp, aux = leaf([LOG(0.5), LOG(0.2)]), leaf([[LOG(0.1), LOG(0.3)], [LOG(0.2), LOG(0.4)]])
    adv = t([2.0, -1.0])
    loss = centered_loss(logp, aux, adv)
    torch.testing.assert_close(loss, -adv * logp.detach())  # same value as plain PG
    g_logp, g_aux = torch.autograd.grad(loss.sum(), (logp, aux))
    torch.testing.assert_close(g_logp, -adv)  # PG's gradient …
    torch.testing.assert_close(g_aux, t([[1.0, 1.0], [-0.5, -0.5]]))  # … plus +A/K per aux token


def test_centered_gradient_wrt_logits():
    # logp and aux log-probs come from the same logits: ∇_z ℓ = −A (e_y − mean_k e_{a_k})
    z = leaf([0.3, -0.2, 1.0])
    lsm = torch.log_softmax(z, dim=-1)
    a = 2.0
    pg = torch.autograd.grad(-a * lsm[0], z)[0]
    lsm = torch.log_softmax(z, dim=-1)
    cen = torch.autograd.grad(centered_loss(lsm[0], lsm[[1, 1]], torch.tensor(a)), z)[0]
    p = torch.softmax(z.detach(), -1)
    torch.testing.assert_close(pg, -a * (t([1.0, 0, 0]) - p))
    torch.testing.assert_close(cen, t([-a, a, 0.0]))  # the p terms cancel


def test_kl_k3():
    logp = leaf([LOG(0.5)])
    k3 = kl_k3(logp, t([LOG(0.25)]))  # d = log .5: .5 + log 2 − 1; ∇ = 1 − e^d = .5
    torch.testing.assert_close(k3, t([0.5 + LOG(2) - 1]))
    torch.testing.assert_close(grad_of(k3, logp), t([0.5]))
    assert kl_k3(t([LOG(0.3)]), t([LOG(0.3)])).item() == 0.0


# ---- mismatch ---------------------------------------------------------------------------

OLD = t([[LOG(0.9), LOG(0.5), LOG(0.1)]])
Q = t([[LOG(0.3), LOG(0.5), LOG(0.4)]])  # w = exp(old − q) = [3, 1, .25]


@pytest.mark.parametrize(
    "mode, level, mask, expected",
    [
        ("none", "token", [1, 1, 1], [1.0, 1.0, 1.0]),
        ("truncate", "token", [1, 1, 1], [2.0, 1.0, 0.25]),  # min(w, 2)
        ("mask", "token", [1, 1, 1], [0.0, 1.0, 0.0]),  # outside [.5, 2] → 0
        ("truncate", "sequence", [1, 1, 1], [0.75] * 3),  # 3 · 1 · .25 = .75
        ("mask", "sequence", [1, 1, 1], [0.75] * 3),
        ("truncate", "sequence", [1, 1, 0], [2.0, 2.0, 0.0]),  # 3 · 1 = 3 → 2
        ("mask", "sequence", [1, 1, 0], [0.0, 0.0, 0.0]),  # 3 > 2 → 0
    ],
)
def test_mismatch_weights(mode, level, mask, expected):
    cfg = MismatchCorrection(mode=mode, level=level, c=2.0, c_min=0.5, c_max=2.0)
    w, metrics = mismatch_weights(OLD, Q, t([mask]), cfg)
    torch.testing.assert_close(w, t([expected]))


@pytest.mark.parametrize(
    "level, mask, expected",
    [
        ("token", [1, 1, 1], [2.0, 1.0, 0.5]),  # w = [3, 1, .25] → clamp to [.5, 2]
        ("sequence", [0, 1, 1], [0.0, 0.5, 0.5]),  # 1 · .25 = .25 → .5
        ("sequence", [1, 1, 1], [0.75] * 3),  # inside [.5, 2]: unchanged
    ],
)
def test_truncate_with_trls_lower_clamp(level, mask, expected):
    """TRL's token_truncate / sequence_truncate: clamp(w, min=vllm_importance_sampling_clip_min, max=C)."""
    cfg = MismatchCorrection(mode="truncate", level=level, c=2.0, clip_min=0.5)
    w, metrics = mismatch_weights(OLD, Q, t([mask]), cfg)
    torch.testing.assert_close(w, t([expected]))
    if level == "token":
        assert float(metrics["mismatch/frac_truncated"]) == 2  # 3 → 2 above, .25 → .5 below


def test_truncate_lower_clamp_closes_the_gap_to_trl():
    """One token with w = exp(old − q) = 0.433, A = 1, on-policy clip loss −w·ρ·A = −w.

    TRL with vllm_importance_sampling_clip_min = 0.5 weights it 0.5 (loss −0.5); without the
    lower clamp turnrl weighted it 0.433 (loss −0.433): the 0.067 gap.
    """
    logp = t([[LOG(0.433)]])
    q = t([[0.0]])
    ones = t([[1.0]])
    plain = LossConfig(type="clip", mismatch=MismatchConfig(mode="truncate", c=2.0))
    trl = LossConfig(type="clip", mismatch=MismatchConfig(mode="truncate", c=2.0, clip_min=0.5))
    before, _ = per_token_loss(plain, logp, None, q, ones, ones)
    after, _ = per_token_loss(trl, logp, None, q, ones, ones)
    assert float(before) == pytest.approx(-0.433) and float(after) == pytest.approx(-0.5)
    assert float(before - after) == pytest.approx(0.067)
    with pytest.raises(ValueError, match="clip_min"):
        MismatchConfig(mode="truncate", c=2.0, clip_min=3.0)


def test_mismatch_metrics_and_application():
    cfg = LossConfig(type="clip", mismatch=MismatchConfig(mode="truncate", c=2.0))
    logp = OLD.clone().requires_grad_(True)
    mask = t([[1.0, 1.0, 1.0]])
    # on-policy clip: value −ρA = −A; times w = [2, 1, .25]
    loss, m = per_token_loss(LossPlan.from_config(cfg), logp, None, Q, t([[1.0, 1.0, 1.0]]), mask)
    torch.testing.assert_close(loss, t([[-2.0, -1.0, -0.25]]))
    torch.testing.assert_close(grad_of(loss, logp), t([[-2.0, -1.0, -0.25]]))
    out = finalize_metrics(m)
    assert out["mismatch/frac_truncated"] == pytest.approx(1 / 3)
    assert out["mismatch/weight_mean"] == pytest.approx(3.25 / 3)
    assert out["mismatch/abs_logp_gap_mean"] == pytest.approx((LOG(3) + LOG(4)) / 3)


def test_importance_sampling_refuses_double_correction():
    cfg = LossConfig(type="importance_sampling", mismatch=MismatchConfig(mode="truncate"))
    with pytest.raises(ValueError, match="correct"):
        per_token_loss(LossPlan.from_config(cfg), OLD, None, Q, t([[1.0, 1.0, 1.0]]), t([[1.0, 1.0, 1.0]]))


# ---- the entry point --------------------------------------------------------------------


def test_per_token_loss_clip_metrics_and_mask():
    cfg = LossConfig(type="clip")
    logp = leaf([LOG(1.5), LOG(0.5), LOG(0.5), LOG(1.5), 0.0])
    old = torch.zeros_like(logp)
    adv = t([1.0, 1.0, -1.0, -1.0, 5.0])
    mask = t([1.0, 1.0, 1.0, 1.0, 0.0])
    loss, m = per_token_loss(LossPlan.from_config(cfg), logp[None], old[None], None, adv[None], mask[None])
    torch.testing.assert_close(loss, t([[-1.28, -0.5, 0.8, 1.5, 0.0]]))
    out = finalize_metrics(m)
    assert m["trained_tokens"].item() == 4
    assert out["clip_ratio/low_mean"] == 0.25  # ρ = .5 < .8 with A < 0
    assert out["clip_ratio/high_mean"] == 0.25  # ρ = 1.5 > 1.28 with A > 0
    assert out["clip_ratio/region_mean"] == 0.5


def test_per_token_loss_padding_never_makes_nan():
    cfg = LossConfig(type="clip", mismatch=MismatchConfig(mode="mask", level="sequence"))
    logp = leaf([-0.5, -1000.0, float("-inf")])
    old = t([-0.4, 50.0, float("nan")])
    beh = t([-0.4, float("-inf"), 3.0])
    mask = t([1.0, 0.0, 0.0])
    loss, m = per_token_loss(LossPlan.from_config(cfg), logp[None], old[None], beh[None], t([1.0]), mask[None])
    assert torch.isfinite(loss).all() and loss[0, 1:].eq(0).all()
    assert torch.isfinite(grad_of(loss, logp)).all()
    assert all(math.isfinite(float(v)) for v in m.values())


def test_per_token_loss_kl_term_and_row_advantages():
    cfg = LossConfig(type="importance_sampling", beta=0.1)
    logp = leaf([[LOG(0.5), LOG(0.5)]])
    ref = t([[LOG(0.25), LOG(0.5)]])
    beh = t([[LOG(0.5), LOG(0.5)]])
    loss, m = per_token_loss(LossPlan.from_config(cfg), logp, None, beh, t([2.0]), t([[1.0, 1.0]]), ref_logp=ref)
    k3 = 0.5 + LOG(2) - 1
    torch.testing.assert_close(loss, t([[-2.0 + 0.1 * k3, -2.0]]))
    assert finalize_metrics(m)["kl"] == pytest.approx(k3 / 2)
    with pytest.raises(ValueError, match="ref_logp"):
        per_token_loss(LossPlan.from_config(cfg), logp, None, beh, t([2.0]), t([[1.0, 1.0]]))


def test_per_token_loss_centered_needs_aux():
    cfg = LossConfig(type="centered")
    logp = leaf([[LOG(0.5)]])
    loss, _ = per_token_loss(
        LossPlan.from_config(cfg), logp, None, None, t([[3.0]]), t([[1.0]]), aux_logp=t([[[-1.0, -2.0]]])
    )
    torch.testing.assert_close(loss, t([[3.0 * LOG(2)]]))
    with pytest.raises(ValueError, match="aux_logp"):
        per_token_loss(LossPlan.from_config(cfg), logp, None, None, t([[3.0]]), t([[1.0]]))


def test_registry_has_every_config_loss():
    assert set(LOSSES) == {"clip", "importance_sampling", "cispo", "centered"}


# ---- auxiliary tokens -------------------------------------------------------------------


def test_sample_aux_tokens_renormalised_top_k():
    ids = torch.tensor([[[7, 8, 9]]]).expand(2, 3, 3).contiguous()
    lp = torch.log(torch.tensor([0.3, 0.1, 0.0])).expand(2, 3, 3)  # renormalised: [.75, .25, 0]
    g = torch.Generator().manual_seed(0)
    out = sample_aux_tokens(ids, lp, 4000, g)
    assert out.shape == (2, 3, 4000) and out.dtype == torch.long
    assert set(out.unique().tolist()) == {7, 8}
    assert (out == 7).float().mean().item() == pytest.approx(0.75, abs=0.01)
    again = sample_aux_tokens(ids, lp, 4000, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    # keep only the most likely candidate
    assert sample_aux_tokens(ids, lp, 5, g, top_k=1).eq(7).all()
    # padding rows (all −inf) draw uniformly instead of failing
    pad = torch.full((1, 1, 3), float("-inf"))
    assert sample_aux_tokens(ids[:1, :1], pad, 3, g).shape == (1, 1, 3)


# ---- normalisers ------------------------------------------------------------------------


def test_normalizers_hand_computed():
    lt, mask = t([[1.0, 2.0], [3.0, 0.0]]), t([[1.0, 1.0], [1.0, 0.0]])
    kw = dict(total_tokens=3, total_rows=2, max_len=2)
    assert normalize(lt, mask, "token_sum", **kw).item() == pytest.approx(6 / 3)
    assert normalize(lt, mask, "seq_mean", **kw).item() == pytest.approx((3 / 2 + 3 / 1) / 2)
    assert normalize(lt, mask, "constant", **kw).item() == pytest.approx(6 / 4)


@pytest.mark.parametrize("norm", ["token_sum", "seq_mean", "constant"])
def test_normalizers_add_up_over_micro_batches(norm):
    g = torch.Generator().manual_seed(3)
    lt = torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=g) > 0.4).double()
    kw = dict(total_tokens=float(mask.sum()), total_rows=6, max_len=5)
    full = normalize(lt, mask, norm, **kw)
    parts = sum(normalize(lt[s : s + 2], mask[s : s + 2], norm, **kw) for s in (0, 2, 4))
    torch.testing.assert_close(parts, full)


def test_token_sum_gradient_decomposes_over_turn_rows():
    # token_sum with batch-wide N: per-turn passes accumulate the whole-batch gradient
    cfg = LossConfig(type="clip")
    g = torch.Generator().manual_seed(4)
    logp = (-torch.rand(4, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(4, 6)
    mask = t([[1, 1, 1, 0, 0, 0]] * 2 + [[1, 1, 1, 1, 1, 0]] * 2)
    n = float(mask.sum())

    def total(rows):
        lt, _ = per_token_loss(LossPlan.from_config(cfg), logp[rows], old[rows], None, adv[rows], mask[rows])
        return normalize(lt, mask[rows], "token_sum", total_tokens=n, total_rows=4, max_len=6)

    (whole,) = torch.autograd.grad(total(slice(0, 4)), logp)
    (first,) = torch.autograd.grad(total(slice(0, 2)), logp)
    (second,) = torch.autograd.grad(total(slice(2, 4)), logp)
    torch.testing.assert_close(first + second, whole)
