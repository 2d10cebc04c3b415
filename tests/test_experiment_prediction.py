"""``audit:`` in an experiment spec: the credit audit of the starting policy predicts each arm before training
(:mod:`turnrl.experiments.prediction`), and the predicted ordering is compared with the measured one."""

from __future__ import annotations

import io
import json
import math

import pytest

from test_experiments import _write_spec, fake_runner
from toy_envs import CountEnv
from turnrl.envs import register_env
from turnrl.experiments import ExperimentError, load_spec, run_experiment
from turnrl.experiments.prediction import compare_ordering, predict


def _est(**corr_by_arm):
    return {arm: {t: {"corr": c, "corr_se_total": 0.1, "snr": 1.0} for t, c in per.items()} for arm, per in
            corr_by_arm.items()}  # fmt: skip


def test_the_variance_ratio_is_the_baselines_correlation_squared_over_the_arms_by_hand():
    p = predict(_est(flat={"1": 0.5, "all": 0.4}, tree={"1": 0.8, "all": 0.2}), "flat")
    assert p["arms"]["flat"]["1"]["variance_ratio"] == pytest.approx(1.0)
    assert p["arms"]["tree"]["1"]["variance_ratio"] == pytest.approx(0.25 / 0.64)  # 0.390625: less noise
    assert p["arms"]["tree"]["all"]["variance_ratio"] == pytest.approx(0.16 / 0.04)  # 4.0: more
    assert p["arms"]["tree"]["1"]["corr_se"] == 0.1
    zero = predict(_est(flat={"1": 0.5}, none={"1": 0.0}), "flat")
    assert math.isnan(zero["arms"]["none"]["1"]["variance_ratio"])


def test_the_ordering_is_spearmans_rank_correlation_by_hand():
    p = predict(_est(a={"all": 0.9}, b={"all": 0.5}, c={"all": 0.7}), "a")
    assert compare_ordering(p, {"a": 0.6, "b": 0.2, "c": 0.4})["spearman"] == pytest.approx(1.0)
    assert compare_ordering(p, {"a": 0.1, "b": 0.5, "c": 0.3})["spearman"] == pytest.approx(-1.0)
    assert compare_ordering(p, {"a": 0.6, "b": 0.2, "c": 0.5})["spearman"] == pytest.approx(1.0)  # ranks only
    two = compare_ordering(p, {"a": 0.6, "b": 0.2})
    assert math.isnan(two["spearman"]) and two["arms"] == ["a", "b"]  # fewer than three arms: no ranking


@pytest.mark.filterwarnings("ignore:Mean of empty slice")
def test_the_experiment_audits_the_starting_policy_with_its_own_arms_before_training(tmp_path):
    register_env("count", CountEnv)  # three turns, rewards that vary with the tiny model's replies
    audit = {"episodes": 3, "continuations": 2, "repeats": 2, "split": "eval"}
    spec_path = _write_spec(tmp_path, audit=audit, overrides={"env.name": "count", "sampler.max_tokens": 6})
    exp_dir = tmp_path / "runs" / "exp"
    run_experiment(load_spec(spec_path), fake_runner([]), output_root=tmp_path / "runs", out=io.StringIO())
    saved = json.loads((exp_dir / "audit" / "credit_audit.json").read_text())
    assert list(saved["estimators"]) == ["a", "b"]  # the spec's arms, as configured
    assert [a["estimator"] for a in saved["arms"]] == ["group_mean", "batch_mean"]
    assert saved["settings"]["leaves"] == 4  # the baseline's episodes per task: equal leaves
    payload = json.loads((exp_dir / "experiment.json").read_text())
    prediction = payload["prediction"]
    assert set(prediction["arms"]) == {"a", "b"} and prediction["baseline"] == "b"
    for arm in ("a", "b"):
        corr = prediction["arms"][arm]["all"]["corr"]
        assert corr == saved["estimators"][arm]["all"]["corr"] and -1 <= corr <= 1
    assert prediction["arms"]["b"]["all"]["variance_ratio"] == pytest.approx(1.0)  # the baseline against itself
    assert payload["ordering"]["arms"] == ["a", "b"] and payload["ordering"]["measured"] == [0.6, 0.2]
    assert "Credit audit of the starting policy" in (exp_dir / "summary.md").read_text()

    again = io.StringIO()
    from rich.console import Console

    run_experiment(load_spec(spec_path), fake_runner([]), output_root=tmp_path / "runs", out=io.StringIO(),
                   console=Console(file=again))  # fmt: skip
    assert "reusing the credit audit" in again.getvalue()


def test_audit_options_are_typed_and_bounded(tmp_path):
    with pytest.raises(ExperimentError, match="audit.repeats"):
        load_spec(_write_spec(tmp_path, audit={"repeats": 1}))
    with pytest.raises(ExperimentError, match="audit.leaves"):  # the leaves are the baseline's, not a choice
        load_spec(_write_spec(tmp_path, audit={"leaves": 8}))
