"""The turn-level critic (credit/critic.py): GAE by hand, cross-fitting, convergence, state, config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnrl import credit
from turnrl.audit.core import EstimatorArm, default_arms, estimate
from turnrl.config import parse_config
from turnrl.credit import CreditSettings, CriticState, assign_credit, gae
from turnrl.credit.critic import CriticParams, Table, table_value
from turnrl.sections import ConfigError
from turnrl.train.checkpoint import Checkpoint, RunState
from turnrl.train.summary import Summary
from turnrl.types import Episode, Turn


def episode(eid, rewards, keys=None, group="g", task="t", texts=None, truncated=False) -> Episode:
    """A flat-group episode: turn k pays ``rewards[k]`` and acts from state ``keys[k]`` (None: no key)."""
    keys = keys or [None] * len(rewards)
    texts = texts or ["a"] * len(rewards)
    turns = [
        Turn(k, [1], [2], [-0.1], texts[k], observation=f"obs {k}", reward=float(r), state_key=s, policy_version=0)
        for k, (r, s) in enumerate(zip(rewards, keys, strict=True))
    ]
    return Episode(eid, task, turns, float(sum(rewards)), not truncated, truncated, group_id=group, prompt="p")


def settings(**params) -> CreditSettings:
    return CreditSettings("critic", CriticParams(**params))


def advantages(episodes):
    return {e.episode_id: [t.advantage for t in e.turns] for e in episodes}


# ---- GAE by hand ------------------------------------------------------------------------


def test_gae_over_three_turns_by_hand():
    # r = (1, 0, 2), V(s_0..s_2) = (0.5, 1.0, 1.5), terminal, γ = 0.9, λ = 0.8 (γλ = 0.72):
    # δ_2 = 2 − 1.5 = 0.5;  δ_1 = 0 + 0.9·1.5 − 1.0 = 0.35;  δ_0 = 1 + 0.9·1.0 − 0.5 = 1.4
    # A_2 = 0.5;  A_1 = 0.35 + 0.72·0.5 = 0.71;  A_0 = 1.4 + 0.72·0.71 = 1.9112
    assert gae([1, 0, 2], [0.5, 1.0, 1.5, 9.9], 0.9, 0.8, terminated=True) == pytest.approx([1.9112, 0.71, 0.5])
    # the same through assign_credit: a critic whose history holds V(s0) = 0.5, V(s1) = 1.0, V(s2) = 1.5
    # (κ = 0: a state's cell is its mean; a one-episode batch is valued from the history alone)
    s = settings(gamma=0.9, lam=0.8, shrinkage=0.0, scale="none", decay=0.5)
    history = {"": [3.0, 3.0]}
    for key, v in (("s0", 0.5), ("s1", 1.0), ("s2", 1.5)):
        history[f"k\x1f{key}"] = [1.0, v]
    s.load_state_dict({"mode": "state_key", "dim": 256, "steps": 1, "table": history, "xtx": [], "xty": []})
    ep = episode("e", [1, 0, 2], ["s0", "s1", "s2"])
    metrics = assign_credit([ep], s)
    assert advantages([ep])["e"] == pytest.approx([1.9112, 0.71, 0.5])
    # targets G = (1 + 0.9·0 + 0.81·2, 0 + 0.9·2, 2) = (2.62, 1.8, 2.0); G − V = (2.12, 0.8, 0.5)
    assert metrics["critic/value_loss"] == pytest.approx((2.12**2 + 0.8**2 + 0.5**2) / 3)
    assert metrics["critic/value_abs"] == pytest.approx(1.0)
    # EV = 1 − Var(G − V) / Var(G) = 1 − 0.4952 / 0.121867 (population variances)
    assert metrics["critic/explained_variance"] == pytest.approx(1 - 0.4952 / (0.3656 / 3))
    assert metrics["critic/tabular"] == 1.0
    # then the batch joins the history: H ← 0.5 · H + B
    cells = s.state_dict()["table"]
    assert cells["k\x1fs0"] == pytest.approx([0.5 * 1 + 1, 0.5 * 0.5 + 2.62])
    assert cells["t\x1ft\x1fs2"] == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize("features", ["state_key", "text"])
def test_lambda_one_gamma_one_and_no_value_is_the_return_to_go(features):
    # a fresh critic and a one-episode batch: V ≡ 0 (nothing but the episode itself, which is left out)
    ep = episode("e", [1, 0, 2], ["a", "b", "c"] if features == "state_key" else None)
    assign_credit([ep], settings(gamma=1.0, lam=1.0, scale="none", features=features))
    assert advantages([ep])["e"] == pytest.approx([3.0, 2.0, 2.0])


def test_lambda_zero_is_the_one_step_residual_and_truncation_bootstraps_from_the_history():
    s = settings(gamma=0.5, lam=0.0, shrinkage=0.0, scale="none")
    s.load_state_dict(
        {"mode": "state_key", "dim": 256, "steps": 1, "xtx": [], "xty": [],
         "table": {"": [2.0, 4.0], "k\x1fs0": [1.0, 1.0], "k\x1fs1": [1.0, 3.0]}}
    )  # fmt: skip
    ep = episode("e", [1, 1], ["s0", "s1"], truncated=True)
    assign_credit([ep], s)
    # V(s_2) of the truncated episode: the history's mean μ = 4/2 = 2 (s_2 has no key)
    # δ_0 = 1 + 0.5·3 − 1 = 1.5;  δ_1 = 1 + 0.5·2 − 3 = −1
    assert advantages([ep])["e"] == pytest.approx([1.5, -1.0])


# ---- cross-fitting on hand-made episodes ------------------------------------------------


def test_each_episode_is_valued_without_its_own_return():
    eps = [episode(e, [r], ["s"]) for e, r in (("a", 1), ("b", 0), ("c", 0))]
    metrics = assign_credit(eps, settings(shrinkage=0.0, scale="none"))
    # V_a = mean of b, c = 0;  V_b = V_c = mean of the other two = 0.5
    assert advantages(eps) == {"a": [1.0], "b": [-0.5], "c": [-0.5]}
    assert metrics["reward"] == pytest.approx(1 / 3)
    eps = [episode(e, [r], ["s"]) for e, r in (("a", 1), ("b", 0), ("c", 0))]
    assign_credit(eps, settings(shrinkage=0.0, scale="batch"))  # ÷ RMS = sqrt((1 + 0.25 + 0.25) / 3)
    rms = np.sqrt(0.5) + 1e-4
    assert [t.advantage for e in eps for t in e.turns] == pytest.approx([1 / rms, -0.5 / rms, -0.5 / rms])


def test_the_shrinkage_hierarchy_by_hand():
    # κ = 1; tasks t1: a (R 1), b (R 0); t2: c (R 1); one state s.
    eps = [
        episode("a", [1], ["s"], "g1", "t1"),
        episode("b", [0], ["s"], "g1", "t1"),
        episode("c", [1], ["s"], "g2", "t2"),
    ]
    assign_credit(eps, settings(shrinkage=1.0, scale="none"))
    # a: without a, μ = 1/2, V(s) = (1 + 0.5)/(2 + 1) = 0.5, V(t1, s) = (0 + 0.5)/(1 + 1) = 0.25 → A = 0.75
    # b: μ = 1, V(s) = (2 + 1)/3 = 1, V(t1, s) = (1 + 1)/2 = 1 → A = −1
    # c: μ = 0.5, V(s) = 0.5, V(t2, s) = (0 + 0.5)/(0 + 1) = 0.5 → A = 0.5
    assert [t.advantage for e in eps for t in e.turns] == pytest.approx([0.75, -1.0, 0.5])


def test_text_features_cross_fit_by_fold_and_report_their_metrics():
    rng = np.random.default_rng(0)
    eps = [episode(f"e{i}", [0, float(rng.random() < 0.5)], texts=[rng.choice(["x", "y"]), "z"]) for i in range(12)]
    s = settings(features="text", folds=3)
    metrics = assign_credit(eps, s)
    assert metrics["critic/tabular"] == 0.0
    assert {"critic/value_loss", "critic/explained_variance", "critic/value_abs"} <= set(metrics)
    assert all(t.advantage is not None and np.isfinite(t.advantage) for e in eps for t in e.turns)
    assert s.state is not None and np.asarray(s.state_dict()["xtx"])[-1, -1] == pytest.approx(24.0)  # 24 turns


def test_a_state_key_critic_refuses_a_turn_without_a_key_and_trees_are_refused():
    s = settings(features="state_key")
    with pytest.raises(ValueError, match="credit.features.*turn 1 of episode 'e'.*features: text"):
        assign_credit([episode("e", [0, 1], ["s", None])], s)
    empty = CriticState(CriticParams())
    assert empty.credit([], CriticParams()).advantages == {} and empty.mode is None
    tree = episode("e", [1], ["s"])
    tree.branch = [0, 0]
    with pytest.raises(ValueError, match="flat groups.*rollout.branching"):
        assign_credit([tree], settings())


# ---- a toy with known values ------------------------------------------------------------


def _toy_batch(rng, n, step):
    """Two turns. From 'start' a coin (p 0.5) pays r_0 = 1 and leads to 'good', else r_0 = 0 and 'bad';
    from 'good' r_1 ~ Bernoulli(0.6), from 'bad' Bernoulli(0.4). With γ = 1:
    V(good) = 0.6, V(bad) = 0.4, V(start) = 0.5·1.6 + 0.5·0.4 = 1.0;  A*_0 = ±0.6 (good / bad)."""
    eps, a_star = [], []
    for i in range(n):
        good = rng.random() < 0.5
        r1 = float(rng.random() < (0.6 if good else 0.4))
        eps.append(episode(f"s{step}-{i}", [float(good), r1], ["start", "good" if good else "bad"], task="toy"))
        a_star.append(0.6 if good else -0.6)
    return eps, np.array(a_star)


def test_the_tabular_critic_converges_to_the_true_values_and_lambda_zero_removes_the_future():
    rng = np.random.default_rng(1)
    s = settings(gamma=1.0, lam=0.0, decay=1.0, scale="none")
    for step in range(150):
        assign_credit(_toy_batch(rng, 16, step)[0], s)
    assert isinstance(s.state, CriticState)
    table = s.state.table
    for key, true in (("start", 1.0), ("good", 0.6), ("bad", 0.4)):
        assert table_value(table.cell, "toy", key, 1.0) == pytest.approx(true, abs=0.05)
    # turn 0's advantage: λ = 0 gives r_0 + V(s_1) − V(s_0) ≈ A*_0; λ = 1 adds the future's noise
    # r_1 − V(s_1) (corr ≈ sqrt(0.36 / (0.36 + 0.24)) = 0.77)
    corr = {}
    for lam in (0.0, 1.0):
        eps, a_star = _toy_batch(np.random.default_rng(2), 400, 999)
        trained = settings(gamma=1.0, lam=lam, decay=1.0, scale="none")
        trained.load_state_dict(s.state_dict())
        assign_credit(eps, trained)
        a0 = np.array([e.turns[0].advantage for e in eps])
        corr[lam] = float(np.corrcoef(a0, a_star)[0, 1])
        if lam == 0.0:
            assert np.max(np.abs(a0 - a_star)) < 0.08
    assert corr[0.0] > 0.99 and corr[1.0] < 0.85


# ---- state across steps and runs ----------------------------------------------------------


@pytest.mark.parametrize("features", ["state_key", "text"])
def test_the_critic_state_round_trips_through_a_checkpoint(tmp_path, features):
    rng = np.random.default_rng(3)
    s = settings(features=features, decay=0.9)
    for step in range(3):
        assign_credit(_toy_batch(rng, 8, step)[0], s)
    path = tmp_path / "c.pt"
    ckpt = Checkpoint(RunState(step=3), Summary("x"), {}, {}, {}, {}, s.state_dict())
    torch.save(ckpt.to_payload(), path)
    back = Checkpoint.from_payload(torch.load(path, weights_only=True))
    fresh, again = settings(features=features, decay=0.9), settings(features=features, decay=0.9)
    again.load_state_dict(back.credit)
    eps = {name: _toy_batch(np.random.default_rng(4), 8, 7)[0] for name in ("s", "again", "fresh")}
    assign_credit(eps["s"], s)
    assign_credit(eps["again"], again)
    assign_credit(eps["fresh"], fresh)
    assert [t.advantage for e in eps["again"] for t in e.turns] == [t.advantage for e in eps["s"] for t in e.turns]
    assert [t.advantage for e in eps["fresh"] for t in e.turns] != [t.advantage for e in eps["s"] for t in e.turns]
    with pytest.raises(ValueError, match="credit.dim 256.*asks for 64"):
        settings(features=features, dim=64).load_state_dict(back.credit)


def test_an_older_checkpoint_without_credit_state_loads_with_a_fresh_critic():
    payload = Checkpoint(RunState(), Summary("x")).to_payload()
    del payload["credit"]
    assert Checkpoint.from_payload(payload).credit == {}
    s = settings()
    s.load_state_dict({})
    assert isinstance(s.state, CriticState) and s.state.steps == 0
    assert CreditSettings("group_mean", credit.ESTIMATORS["group_mean"].params()).state_dict() == {}


# ---- config and audit ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [("lam", 1.5, "less than or equal to 1"), ("gamma", -0.1, "greater than or equal to 0"), ("folds", 1, "2")],
)
def test_bad_critic_parameters_are_one_error_naming_the_key(key, value, says):
    with pytest.raises(ConfigError) as err:
        parse_config({"credit": {"estimator": "critic", key: value}})
    lines = [line for line in str(err.value).splitlines() if line.strip() and "invalid config" not in line]
    assert len(lines) == 1 and f"{key}:" in lines[0] and says in lines[0] and "critic" in lines[0]
    cfg = parse_config({"credit": {"estimator": "critic", "lam": 0.0, "gamma": 0.95}})
    assert cfg.credit.params == CriticParams(lam=0.0, gamma=0.95) and cfg.per_turn_rows


def test_the_audit_runs_the_critic_fitted_on_its_own_batch():
    labels = {a.label: a for a in default_arms(8)}
    assert labels["critic"].estimator == "critic" and labels["critic/lam0"].params == {"lam": 0.0}
    # the audit's batch: the audited episode and its group's fresh episodes; the critic (fresh each call)
    # values the audited episode from the others
    eps = [episode("a0-audit", [1], ["s"], "a0"), *(episode(f"a0-f{j}", [0], ["s"], "a0") for j in range(3))]
    adv = estimate(EstimatorArm("critic", "critic", {"scale": "none", "shrinkage": 0.0}), eps)
    assert adv["a0-audit"] == [1.0] and adv["a0-f0"] == pytest.approx([-1 / 3])
    assert Table().cells == {}


CONFIG = """
run_name: {name}
seed: 5
model: {{name: tiny}}
env: {{name: count}}
sampler: {{max_tokens: 4}}
rollout: {{tasks_per_step: 2, group_size: 3}}
credit: {{estimator: critic, decay: 1.0}}
train: {{steps: 4, lr: 0.01, micro_batch_size: 6}}
eval: {{before: false}}
data: {{num_eval_tasks: 1}}
tracking: {{backends: [csv], plots: false, report: false}}
paths: {{output_dir: {out}}}
"""
CRITIC_COLUMNS = ("step", "critic/value_loss", "critic/explained_variance", "critic/value_abs", "loss")


def test_a_killed_critic_run_resumes_with_its_critic(tmp_path):
    """Killed after step 3's row (its checkpoint is step 2's): the resumed run's step 3 and 4 must value
    states with the critic of steps 1-2, as the uninterrupted run did (a fresh critic gives other values)."""
    from test_resume import _run, _table

    paths = {}
    for name in ("ref", "killed"):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(CONFIG.format(name=name, out=tmp_path / "runs"))
    ref = _run(["train", str(paths["ref"])])
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = _run(["train", str(paths["killed"])], kill_at="step:3")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = _run(["train", str(paths["killed"]), "--resume", str(tmp_path / "runs" / "killed")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = _table(tmp_path / "runs/ref/progress/train.csv", CRITIC_COLUMNS)
    assert [r[0] for r in want] == [1, 2, 3, 4]
    assert _table(tmp_path / "runs/killed/progress/train.csv", CRITIC_COLUMNS) == want
    ckpt = Checkpoint.from_payload(torch.load(tmp_path / "runs/killed/checkpoint/state.pt", weights_only=True))
    assert ckpt.credit["mode"] == "text" and ckpt.credit["steps"] == 4


# ---- other frameworks keep the run's critic ----------------------------------------------


def test_the_trl_rollout_keeps_one_critic_across_generations():
    """TRL's rollout_func holds the run's CreditSettings across generations, so the critic's second batch is valued
    from the first (one-episode batches: alone, a batch values nothing); evaluation rollouts get fresh ones."""
    pytest.importorskip("trl", reason="TRL is not installed (the dev extra has it)")
    from turnrl.integrations.trl import TurnrlRollout

    rollout = TurnrlRollout(estimator="critic", params={"lam": 1.0, "shrinkage": 0.0, "scale": "none"})
    kept = rollout.credit("group")
    assert rollout.credit("group") is kept and rollout.credit("group", fresh=True) is not kept
    first, second = episode("a", [1.0], ["s"]), episode("b", [0.0], ["s"])
    assign_credit([first], kept)
    assign_credit([second], kept)  # V(s) = 1 from the first batch: A = 0 − 1
    assert advantages([second])["b"] == pytest.approx([-1.0])
    fresh = episode("c", [0.0], ["s"])
    assign_credit([fresh], rollout.credit("group", fresh=True))
    assert advantages([fresh])["c"] == pytest.approx([0.0])  # a fresh critic has nothing to value it with
