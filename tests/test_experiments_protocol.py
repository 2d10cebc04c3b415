"""The experiment protocol of issue 31: the primary outcome, the batch ladder, extra held-out games, compute
and advantage-scale accounting (fake trainer and evaluator; one real run on the tiny model)."""

import io
import json
from pathlib import Path

import pytest
import yaml

from turnrl.config import RunConfig, dump_config
from turnrl.experiments import (
    EvalPoint,
    ExperimentError,
    config_diff,
    extra_seed,
    load_spec,
    plan_runs,
    pool_points,
    run_experiment,
)
from turnrl.rundir import RunDir, write_jsonl
from turnrl.tracking.sinks import CsvSink
from turnrl.train.summary import Summary, new_run_id
from turnrl.types import Episode, StopReason, Turn

BASE = {
    "run_name": "base",
    "model": {"name": "tiny"},
    "env": {"name": "number_guess"},
    "rollout": {"tasks_per_step": 2, "group_size": 4},
    "train": {"steps": 2},
    "eval": {"samples_per_task": 3},
    "tracking": {"backends": ["csv"], "plots": False, "report": False},
}


def _spec(tmp_path: Path, base=BASE, **extra) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {
        "title": "t",
        "hypothesis": "h",
        "base_config": "base.yaml",
        "seeds": [0, 1],
        "evaluation": {"n": 5},
        "arms": [
            {"name": "flat", "overrides": {"credit.estimator": "group_mean"}},
            {"name": "tree", "overrides": {"credit.estimator": "branched", "rollout.branching": [2, 2]}},
        ],
        "primary": {"treatment": "tree", "baseline": "flat"},
    }
    spec.update(extra)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _error(tmp_path, **extra) -> str:
    with pytest.raises(ExperimentError) as info:
        load_spec(_spec(tmp_path, **extra))
    return " ".join(str(info.value).split())


# ----------------------------------------------------------------------------- the spec


def test_the_primary_outcome_is_required_and_must_be_a_judged_comparison(tmp_path):
    assert "primary: missing; state the primary outcome before running" in _error(tmp_path, primary=None)
    assert "primary.baseline: unknown arm 'nope'" in _error(tmp_path, primary={"treatment": "tree", "baseline": "nope"})
    assert "treatment and baseline are both 'flat'" in _error(
        tmp_path, primary={"treatment": "flat", "baseline": "flat"}
    )
    crit = {"type": "margin", "treatment": "tree", "baseline": "flat", "metric": "mean_reward"}
    message = _error(tmp_path, criterion=crit)  # the primary is on success_rate, the criterion on mean_reward
    assert "primary: tree vs flat on success_rate is not a comparison the criterion judges" in message
    one_arm = load_spec(_spec(tmp_path, arms=[{"name": "flat"}], primary=None))  # no comparison to state
    assert one_arm.primary_margin() is None


def test_ladder_spec_errors(tmp_path):
    assert "ladder.arm: unknown arm 'zz'" in _error(tmp_path, ladder={"arm": "zz", "factors": [2]})
    assert "ladder.factors: duplicate factor" in _error(tmp_path, ladder={"arm": "flat", "factors": [2, 2]})
    assert "ladder.factors[0]" in _error(tmp_path, ladder={"arm": "flat", "factors": [0]})
    message = _error(tmp_path, ladder={"arm": "tree", "factors": [2]})
    assert "arm 'tree' samples trees" in message and "scale: tasks_per_step" in message
    trees = {**BASE, "rollout": {"tasks_per_step": 2, "branching": [2, 2]}, "credit": {"estimator": "branched"}}
    arms = [{"name": "g", "overrides": {"credit.estimator": "gigpo"}}, {"name": "tree"}]
    spec = load_spec(  # the trees come from the base config, not the arm's overrides: the plan sees them
        _spec(
            tmp_path,
            base=trees,
            arms=arms,
            ladder={"arm": "g", "factors": [2]},
            primary={"treatment": "g", "baseline": "tree"},
        )
    )
    with pytest.raises(ExperimentError, match=r"ladder: arm 'g' samples trees \(rollout.branching \[2, 2\]\)"):
        plan_runs(spec, tmp_path / "runs")
    taken = [{"name": "flat"}, {"name": "flat_x2"}]
    assert "duplicate arm name(s) 'flat_x2'" in _error(tmp_path, arms=taken, ladder={"arm": "flat", "factors": [2]})


def test_the_ladder_scales_the_leaves_and_nothing_else(tmp_path):
    spec = load_spec(_spec(tmp_path, ladder={"arm": "flat", "factors": [1, 4, 2]}))
    assert [a.name for a in spec.all_arms()] == ["flat", "tree", "flat_x2", "flat_x4"]
    runs = {(r.arm, r.seed): r.config for r in plan_runs(spec, tmp_path / "runs")}
    assert len(runs) == 8
    for k in (2, 4):  # same tasks in the same order, k× the episodes per task
        assert config_diff(runs[("flat", 0)], runs[(f"flat_x{k}", 0)]) == {"rollout.group_size": (4, 4 * k)}
    spec = load_spec(_spec(tmp_path, ladder={"arm": "tree", "factors": [3], "scale": "tasks_per_step"}))
    runs = {(r.arm, r.seed): r.config for r in plan_runs(spec, tmp_path / "runs")}
    assert config_diff(runs[("tree", 1)], runs[("tree_x3", 1)]) == {"rollout.tasks_per_step": (2, 6)}
    assert runs[("tree_x3", 1)].rollout.branching == [2, 2]


def test_extra_games_need_sampled_evaluation(tmp_path):
    greedy = {**BASE, "eval": {"samples_per_task": 0}}
    with pytest.raises(ExperimentError, match=r"evaluation\.extra_games: the evaluation is greedy only"):
        plan_runs(load_spec(_spec(tmp_path, base=greedy, evaluation={"n": 5, "extra_games": 40})), tmp_path / "r")


def test_pooling_two_evaluations_by_hand():
    # [1, 0, 1] (mean 2/3, s² 1/3) and [0, 0] (mean 0, s² 0) together: [1, 0, 1, 0, 0], mean 0.4, s² 0.3
    pooled = pool_points(EvalPoint(8, 2 / 3, 3, 1 / 3), EvalPoint(99, 0.0, 2, 0.0))
    assert (pooled.step, pooled.n) == (8, 5)
    assert pooled.value == pytest.approx(0.4) and pooled.sample_var == pytest.approx(0.3)
    assert pool_points(EvalPoint(8, 0.5, 4), EvalPoint(8, 0.0, 4, 0.0)).sample_var is None


# ----------------------------------------------------------------------------- runs, with a fake trainer

FINAL = {"flat": [0.4, 0.6], "tree": [0.6, 0.6]}  # success at the last evaluation, per seed (of 5 games)


def _turn(index: int, n_tokens: int, advantage: float | None) -> Turn:
    return Turn(index, [1, 2], [7] * n_tokens, [-1.0] * n_tokens, "x", advantage=advantage)


def _rollouts(arm: str) -> list[Episode]:
    """One step: flat = 2 two-turn episodes; tree = a 2 × 2 tree whose first turns are shared by 2 leaves."""
    if arm == "flat":
        return [
            Episode(f"s1-g0-e{k}", "t", [_turn(0, 3, a), _turn(1, 5, -a)], 0.0, True, False, group_id="s1-g0")
            for k, a in enumerate((1.0, -1.0))
        ]
    leaves = []
    for i, a1 in enumerate((0.5, -0.5)):
        for j, a2 in enumerate((2.0, -2.0)):
            first = a1 if j == 0 else None  # the shared turn is trained once, on its first leaf
            turns = [_turn(0, 4, first), _turn(1, 6, a2)]
            leaves.append(Episode(f"s1-g0-e{2 * i + j}", "t", turns, 0.0, True, False, group_id="s1-g0", branch=[i, j]))
    return leaves


def fake_runner(calls: list):
    def run(cfg: RunConfig, console=None):
        calls.append(cfg)
        rd = RunDir(Path(cfg.paths.output_dir) / cfg.run_name)
        rd.root.mkdir(parents=True, exist_ok=True)
        rd.config.write_text(dump_config(cfg))
        arm = Path(cfg.paths.output_dir).name
        sink = CsvSink(rd.root)
        for step, value in ((0, 0.2), (cfg.train.steps, FINAL[arm][cfg.seed])):
            sink.log_eval(step, {"iteration": 0, "label": "x", "success_rate": value, "num_tasks": 5})
        for step in range(1, cfg.train.steps + 1):
            row = {"iteration": 0, "reward": 0.0, "num_tokens": 10.0 * step, "time/collect_s": 1.5, "time/train_s": 0.5}
            sink.log_step(step, row)
        write_jsonl(rd.train_rollouts(0), _rollouts(arm))
        Summary(new_run_id(), {}, [{}], complete=True).write(rd)
        return {}

    return run


def fake_evaluator(calls: list):
    """Extra games: 20 per run; flat wins 10, tree 16 (so the pooled rates are known by hand)."""

    def evaluate(cfg: RunConfig, run_dir: Path, games: int, seed: int) -> list[Episode]:
        calls.append((Path(cfg.paths.output_dir).name, cfg.seed, games, seed, run_dir))
        wins = 10 if Path(cfg.paths.output_dir).name == "flat" else 16
        reasons = [StopReason.SUCCESS] * wins + [StopReason.FAILURE] * (games - wins)
        return [
            Episode(f"x{k}", "t", [], float(r == StopReason.SUCCESS), True, False, r) for k, r in enumerate(reasons)
        ]

    return evaluate


def test_compute_and_advantage_scale_per_arm_by_hand(tmp_path):
    spec = load_spec(_spec(tmp_path))
    console = io.StringIO()
    from rich.console import Console

    out = io.StringIO()
    result = run_experiment(
        spec, fake_runner([]), output_root=tmp_path / "runs", out=out, console=Console(file=console, width=200)
    )
    flat, tree = result.arms["flat"], result.arms["tree"]
    # tokens generated per run: flat 2 × (3 + 5) = 16; tree: 2 shared first turns × 4 + 4 leaves × 6 = 32
    assert (flat["tokens_generated"], tree["tokens_generated"]) == (16, 32)
    # tokens trained: Σ num_tokens = 10 + 20; train seconds: 2 steps × (1.5 + 0.5)
    assert flat["tokens_trained"] == 30 and flat["train_s"] == pytest.approx(4.0)
    # advantage scale: flat |A| = 1 on both turns; tree turn 1: the 2 trained copies (0.5), turn 2: 2.0
    assert flat["adv_scale"] == {1: 1.0, 2: 1.0} and tree["adv_scale"] == {1: 0.5, 2: 2.0}
    assert tree["trained_turns"] == {1: 2.0, 2: 4.0}
    assert (flat["leaves_per_step"], tree["leaves_per_step"]) == (8, 8)
    text = console.getvalue()
    assert text.index("primary outcome (stated before the runs): tree ≥ flat") < text.index("held-out success_rate")
    assert "advantage scale" in text and "0.500 (2)" in text
    payload = json.loads(out.getvalue().splitlines()[-1].removeprefix("RESULT "))
    assert payload["primary"]["treatment"] == "tree" and payload["arms"]["tree"]["tokens_generated"] == 32
    summary = (result.directory / "summary.md").read_text()
    assert summary.index("**Primary outcome**") < summary.index("**Hypothesis.**")
    assert "| tree | 8 | 32 | 30 | 4 |" in summary


def test_extra_games_are_pooled_by_the_verdict_rule_and_reused(tmp_path):
    spec_path = _spec(tmp_path, evaluation={"n": 5, "extra_games": 20})
    runs, evals = [], []
    result = run_experiment(
        load_spec(spec_path), fake_runner(runs), output_root=tmp_path / "runs", out=io.StringIO(),
        evaluator=fake_evaluator(evals),
    )  # fmt: skip
    assert sorted(e[:4] for e in evals) == sorted(
        (arm, s, 20, extra_seed(s)) for arm in ("flat", "tree") for s in (0, 1)
    )  # the same fresh seed in both arms of a seed
    assert extra_seed(0) != extra_seed(1)
    # pooled per seed: flat (0.4·5 + 10)/25 = 0.48, (0.6·5 + 10)/25 = 0.52; tree (3 + 16)/25 = 0.76 twice
    d = result.primary.numbers
    assert d["per_seed_diff"] == pytest.approx([0.28, 0.24])
    assert d["se"] == pytest.approx(0.02) and d["df"] == 1  # s_d = 0.0283, /√2; t_1 = 12.7
    assert result.arms["tree"]["eval_n"] == 25 and result.arms["tree"]["extra_games"] == [20, 20]
    assert json.loads((result.runs[0].run_dir / "extra_eval.json").read_text())["n"] == 20

    again = []  # a rerun reuses the runs and their extra games
    rerun = run_experiment(
        load_spec(spec_path), fake_runner(runs), output_root=tmp_path / "runs", out=io.StringIO(),
        evaluator=fake_evaluator(again),
    )  # fmt: skip
    assert len(runs) == 4 and again == [] and rerun.primary.numbers["diff"] == pytest.approx(0.26)
    more = _spec(tmp_path, evaluation={"n": 5, "extra_games": 30})  # a changed request plays them again
    run_experiment(load_spec(more), fake_runner(runs), output_root=tmp_path / "runs", out=io.StringIO(),
                   evaluator=fake_evaluator(again))  # fmt: skip
    assert len(again) == 4 and {e[2] for e in again} == {30}


def test_extra_games_on_the_tiny_model(tmp_path):
    """The real path: train_run on the tiny model, then evaluate_final on the run's merged final adapter."""
    base = {
        "run_name": "base",
        "model": {"name": "tiny"},
        "env": {"name": "number_guess"},
        "sampler": {"max_tokens": 4},
        "rollout": {"tasks_per_step": 1, "group_size": 2},
        "train": {"steps": 1, "lr": 1e-2, "micro_batch_size": 4},
        "eval": {"samples_per_task": 1},
        "tracking": {"backends": ["csv"], "plots": False, "report": False},
    }
    evaluation = {"n": 2, "extra_games": 3, "before": False}
    path = _spec(tmp_path, base=base, seeds=[3], evaluation=evaluation, arms=[{"name": "flat"}], primary=None)
    result = run_experiment(load_spec(path), output_root=tmp_path / "runs", out=io.StringIO())
    (run,) = result.runs
    record = json.loads((run.run_dir / "extra_eval.json").read_text())
    assert record["n"] == 4 and record["request"] == {"games": 3, "seed": extra_seed(3), "step": 1}  # ⌈3/2⌉ × 2
    episodes = (run.run_dir / "rollouts" / "extra_eval.jsonl").read_text().splitlines()
    assert len(episodes) == 4 and all(json.loads(e)["episode_id"].startswith("eval-") for e in episodes)
    assert run.curve("success_rate")[-1].n == 2 * 2 + 4  # 1 greedy + 1 sampled per task, pooled with 4
    # a flat group shares no turn: every sampled token of the saved rollouts counts
    train = [json.loads(line) for line in RunDir(run.run_dir).train_rollouts(0).read_text().splitlines()]
    assert len(train) == result.arms["flat"]["leaves_per_step"] == 2
    tokens = sum(len(t["action_ids"]) for e in train for t in e["turns"])
    assert result.arms["flat"]["tokens_generated"] == tokens > 0
    assert result.primary is None  # one arm: nothing to compare
