"""The regime map's specs (``experiments/regime/``, issue 31 part 5) and ``scripts/regime_map.py``'s statistics.

The specs resolve to the design results §17 reports: the position rule, five seeds, the primary outcome at
step 5 stated before the runs, equal leaves per step in every arm but the batch ladder's rungs; the map's
paired differences follow the experiments' verdict rule (s_d/√m, t critical value), checked by hand.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from turnrl.experiments import load_spec, plan_runs
from turnrl.experiments.results import RunResult

REPO = Path(__file__).resolve().parent.parent
SPECS = sorted((REPO / "experiments" / "regime").glob("regime_*.yaml"))


def _map_module():
    spec = importlib.util.spec_from_file_location("regime_map", REPO / "scripts" / "regime_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_variant_of_the_map_has_a_spec():
    names = {p.stem for p in SPECS}
    assert names == {v[0] for v in _map_module().VARIANTS}


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_regime_specs_resolve_to_their_design(path, tmp_path):
    spec = load_spec(path)
    runs = plan_runs(spec, tmp_path)
    assert spec.seeds == [0, 1, 2, 3, 4] and spec.primary is not None and spec.primary.at_step == 5
    assert spec.primary.baseline == "group_mean" and spec.audit is not None
    for run in runs:
        env = run.config.env
        word = "_word" in spec.name or spec.name == "regime_corridor"  # the word rule: decisions that share no reply
        rule = "word" if word else "position"
        assert env.name == "decisions" and env.options["rule"] == rule
        assert run.config.train.steps == 10 and run.config.eval.every == 5
    leaves = {r.arm: r.config.rollout.tasks_per_step * r.config.episodes_per_task for r in runs if "_x" not in r.arm}
    assert set(leaves.values()) == {24}  # equal sampled leaves per step in every arm
    for r in runs:
        if "_x" in r.arm:  # a ladder rung: k× the leaves
            k = int(r.arm.rsplit("_x", 1)[1])
            assert r.config.rollout.tasks_per_step * r.config.episodes_per_task == 24 * k


def _run(arm: str, seed: int, values: dict[int, float]) -> RunResult:
    rows = [{"step": s, "mean_reward": v, "num_tasks": 150} for s, v in values.items()]
    return RunResult(arm, seed, Path("."), rows, [])


def test_the_maps_paired_difference_is_the_verdict_rule_by_hand():
    m = _map_module()
    base = {s: _run("group_mean", s, {0: 0.5, 5: 0.60, 10: 0.70}) for s in range(3)}
    treat = {s: _run("stepwise", s, {0: 0.5, 5: 0.60 + d, 10: 0.70}) for s, d in enumerate([0.05, 0.10, 0.15])}
    out = m._paired({"group_mean": base, "stepwise": treat}, "stepwise", "mean_reward", 5)
    # d = 0.05, 0.10, 0.15: mean 0.10, s_d = 0.05, SE = 0.05/√3 = 0.0289, t = 3.46 < t_2 = 4.30: not resolved
    assert out["diff"] == pytest.approx(0.10) and out["se"] == pytest.approx(0.05 / math.sqrt(3))
    assert out["critical"] == pytest.approx(4.3027, abs=1e-3) and out["verdict"] == "no difference resolved"
    final = m._paired({"group_mean": base, "stepwise": treat}, "stepwise", "mean_reward", None)
    assert final["diff"] == pytest.approx(0.0)


def test_the_maps_per_decision_rates_by_hand(tmp_path):
    """Per position: the share of held-out games whose turn earned a reward, and the paired difference per
    position by the verdict's rule."""
    m = _map_module()

    def run_dir(arm: str, seed: int, games: list[list[float]]) -> dict:
        d = tmp_path / arm / f"seed{seed}"
        (d / "rollouts").mkdir(parents=True)
        lines = [json.dumps({"turns": [{"index": i, "reward": r} for i, r in enumerate(g)]}) for g in games]
        (d / "rollouts" / "eval_step_00005.jsonl").write_text("\n".join(lines) + "\n")
        return {"arm": arm, "seed": seed, "run_dir": str(d)}

    # 4 games, 2 decisions; group_mean: position 1 right in 2 and 1 games, position 2 in 4 and 3;
    # stepwise: position 1 right in 4 and 4, position 2 in 2 and 3
    runs = [
        run_dir("group_mean", 0, [[0.5, 0.5], [0.5, 0.5], [0, 0.5], [0, 0.5]]),
        run_dir("group_mean", 1, [[0.5, 0.5], [0, 0.5], [0, 0.5], [0, 0]]),
        run_dir("stepwise", 0, [[0.5, 0.5], [0.5, 0.5], [0.5, 0], [0.5, 0]]),
        run_dir("stepwise", 1, [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [0.5, 0]]),
    ]
    out = m.per_decision({"runs": runs}, 5)
    assert out["group_mean"]["mean"] == pytest.approx([(0.5 + 0.25) / 2, (1.0 + 0.75) / 2])
    assert out["stepwise"]["mean"] == pytest.approx([1.0, (0.5 + 0.75) / 2])
    # position 1: d = 0.5, 0.75 -> mean 0.625, s_d = 0.1768, SE = s_d/√2 = 0.125
    first = out["stepwise"]["vs"][0]
    assert (first["diff"], first["se"], first["seeds"]) == (pytest.approx(0.625), pytest.approx(0.125), 2)
    assert first["critical"] == pytest.approx(12.706, abs=1e-3)  # t_1 at 97.5 %
    # position 2: d = -0.5, 0.0 -> mean -0.25
    assert out["stepwise"]["vs"][1]["diff"] == pytest.approx(-0.25)
    assert "vs" not in out["group_mean"]


def test_the_map_records_each_variant_and_reads_it_back(tmp_path, monkeypatch):
    """Run directories are not kept in git: a variant read from its runs is recorded, read back when its runs
    are absent, and replaced only by runs covering at least as many (arm, seed) pairs."""
    m = _map_module()
    runs, rec = tmp_path / "runs", tmp_path / "recorded"
    five = {"arms": {"group_mean": {"seeds": [0, 1, 2, 3, 4]}, "stepwise": {"seeds": [0, 1, 2, 3, 4]}}}
    two = {"arms": {"group_mean": {"seeds": [0, 1]}}}
    monkeypatch.setattr(m, "read_variant", lambda root, name: dict(five))
    first = m.load_variant(runs, "regime_x", rec)
    assert first["source"].startswith("runs/regime_x") and (rec / "regime_x.json").exists()
    monkeypatch.setattr(m, "read_variant", lambda root, name: None)
    assert m.load_variant(runs, "regime_x", rec) == first
    monkeypatch.setattr(m, "read_variant", lambda root, name: dict(two))
    assert m.load_variant(runs, "regime_x", rec) == first  # fewer runs than recorded: the record stands
    assert m.load_variant(runs, "regime_y", rec)["arms"] == two["arms"]


def test_an_experiment_json_of_one_arm_is_not_read_as_a_cell(tmp_path, capsys):
    m = _map_module()
    (tmp_path / "regime_x").mkdir()
    for arms in (["stepwise"], ["group_mean"], []):
        runs = [{"arm": a, "seed": s, "run_dir": str(tmp_path / "absent")} for a in arms for s in range(5)]
        (tmp_path / "regime_x" / "experiment.json").write_text(json.dumps({"metric": "mean_reward", "runs": runs}))
        assert m.read_variant(tmp_path, "regime_x") is None
    assert "not a cell" in capsys.readouterr().err


def test_the_recorded_summaries_are_variants_of_the_map_with_a_source():
    m = _map_module()
    names = {v[0] for v in m.VARIANTS}
    for path in sorted(m.RECORDED.glob("*.json")):
        v = json.loads(path.read_text())
        assert path.stem in names and v["name"] == path.stem and v["source"]
        assert all(len(a["seeds"]) >= 5 for a in v["arms"].values()), path.stem  # the map's cells: 5 seeds or more


def test_an_arm_against_the_ladders_rung_is_paired_by_seed():
    """arm − rung per seed = (arm − group_mean) − (rung − group_mean): d = 0.02, 0.04, 0.06 → +4.0 ± 1.2."""
    m = _map_module()
    arm = {"seeds": [0, 1, 2], "vs_mid": {"per_seed": [0.10, 0.12, 0.14]}}
    rung = {"seeds": [0, 1, 2], "vs_mid": {"per_seed": [0.08, 0.08, 0.08]}}
    v = {"arms": {"group_mean": {"vs_mid": None}, "stepwise": arm, "group_mean_x2": rung}}
    (line,) = m.against_rungs([(("regime_x", 4, "per_turn", "x"), v)])
    assert "stepwise vs group_mean_x2" in line and "+4.0 ± 1.2" in line and "no difference resolved" in line
    other = {"seeds": [0, 1, 3], "vs_mid": {"per_seed": [0.08, 0.08, 0.08]}}
    v["arms"]["group_mean_x2"] = other  # other seeds: no pairing by position
    assert m.against_rungs([(("regime_x", 4, "per_turn", "x"), v)]) == []
