"""The step row's diagnostics: stop reasons as fractions, episode metrics averaged, the zero-row step with the
same columns, and train.target_kl stopping a step's passes."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from factories import make_turn, tiny_run_config
from toy_envs import CountEnv
from turnrl.config import LoraConfig, parse_config
from turnrl.envs import register_env
from turnrl.models import attach_lora
from turnrl.train.batch import Row
from turnrl.train.diagnostics import rollout_metrics
from turnrl.train.loop import train
from turnrl.train.step import LocalTrainer, StepSettings, idle_metrics, update
from turnrl.types import Episode, StopReason


def _episode(eid: str, reason: StopReason | None, **metrics: float) -> Episode:
    turns = [make_turn(0, [1, 2], [3, 4, 5]), make_turn(1, [1, 2, 3, 4, 5, 6], [7], finish_reason="length")]
    return Episode(eid, "t", turns, 1.0, True, False, stop_reason=reason, metrics=dict(metrics))


def test_stop_reasons_are_fractions_and_episode_metrics_are_averaged_over_the_step():
    episodes = [
        _episode("a", StopReason.SUCCESS, len=4.0, num_turns=2.0),
        _episode("b", StopReason.MALFORMED, len=2.0, env_error=1.0, num_turns=2.0),
        _episode("c", StopReason.SUCCESS, num_turns=2.0, **{"reward/group": 0.5}),
        _episode("d", None, num_turns=2.0),
    ]
    m = rollout_metrics(episodes)
    assert m["stop/success"] == 0.5 and m["stop/malformed"] == 0.25 and m["stop/max_turns"] == 0.0
    assert set(k for k in m if k.startswith("stop/")) == {f"stop/{r.value}" for r in StopReason}
    assert sum(v for k, v in m.items() if k.startswith("stop/")) == 0.75  # d ended without a reason
    assert m["episode/len"] == (4 + 2) / 4 and m["episode/env_error"] == 1 / 4  # not reported: counts 0
    assert "episode/num_turns" not in m and "episode/reward/group" not in m  # already in the row
    assert m["completions/clipped_ratio"] == 0.5 and m["completions/mean_length"] == 2.0
    empty = rollout_metrics([])
    assert empty["num_episodes"] == 0 and empty["stop/success"] == 0.0 and set(empty) <= set(m)


class ScriptedKL:
    """A trainer whose pass k reports approx_kl = kls[k]; counts what the update asks of it."""

    last_lr = 0.1

    def __init__(self, kls: list[float]) -> None:
        self.kls, self.calls = list(kls), []

    def begin_batch(self, seed):
        self.calls.append("begin")

    def forward_backward(self, rows, totals):
        self.calls.append("fb")
        return {"loss": 1.0, "trained_tokens": 4.0, "approx_kl": 4.0 * self.kls.pop(0), "entropy": 8.0}

    def optim_step(self):
        self.calls.append("step")
        return 2.0

    def zero_grad(self):
        self.calls.append("zero")


ROWS = [Row([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], [1.0] * 6, [0.0] * 6, 0, "e")]


@pytest.mark.parametrize(
    "target, passes, calls, reported_kl",
    [
        (None, 4, ["fb", "step"] * 4, 0.2),
        (0.05, 2, ["fb", "step", "fb", "step", "fb", "zero"], 0.1),  # pass 3 measures 0.1 > 0.05: not applied
        (0.5, 4, ["fb", "step"] * 4, 0.2),
    ],
)
def test_target_kl_stops_the_passes_before_the_one_past_it(target, passes, calls, reported_kl):
    settings = StepSettings.from_config(parse_config({"train": {"num_iterations": 4, "target_kl": target}}))
    trainer = ScriptedKL([0.0, 0.01, 0.1, 0.2])
    m = update(trainer, ROWS, settings)
    assert trainer.calls == ["begin", *calls]
    assert m["passes"] == passes and m["approx_kl"] == pytest.approx(reported_kl) and m["grad_norm"] == 2.0
    # one pass: its KL is 0, so target_kl never acts
    one = StepSettings.from_config(parse_config({"train": {"target_kl": 1e-12}}))
    assert update(ScriptedKL([0.0]), ROWS, one)["passes"] == 1


def test_the_zero_row_step_has_the_columns_of_an_update(tiny_model):
    cfg = parse_config(
        {
            "train": {"lr": 1e-2, "num_iterations": 2},
            "loss": {"beta": 0.1, "mismatch": {"mode": "mask"}},
        }
    )
    settings = StepSettings.from_config(cfg)
    trainer = LocalTrainer(attach_lora(tiny_model, LoraConfig(r=4, alpha=8)), settings, pad_id=2)
    real = update(trainer, ROWS, settings)
    idle = idle_metrics(settings)
    assert set(idle) | {"lr"} == set(real)  # lr: the loop fills in the configured one
    assert all(v == 0.0 for v in idle.values())
    assert {"kl", "mismatch/frac_masked", "clip_ratio/high_mean", "passes"} <= set(idle)


def test_a_run_logs_the_diagnostics_and_a_step_without_rows_logs_the_same_columns(tmp_path):
    register_env("count", CountEnv)
    quiet = Console(quiet=True)
    common = {"train": {"steps": 1, "num_iterations": 2, "target_kl": 1e-9}}
    train(tiny_run_config(tmp_path, "rows", **common), console=quiet)
    # every turn cut by the token limit and masked: no row to train
    masked = {"sampler": {"max_tokens": 1}, "train": {**common["train"], "mask_truncated_completions": True}}
    train(tiny_run_config(tmp_path, "none", **masked), console=quiet)
    (full,) = [json.loads(x) for x in (tmp_path / "rows/progress/steps.jsonl").read_text().splitlines()]
    (idle,) = [json.loads(x) for x in (tmp_path / "none/progress/steps.jsonl").read_text().splitlines()]
    assert idle["num_tokens"] == 0 and idle["passes"] == 0 and idle["completions/masked_truncated"] == 1.0
    assert set(full) | {"completions/masked_truncated"} == set(idle)
    assert full["passes"] == 1  # target_kl 1e-9: the second pass measured KL > 0 and was not applied
    assert full["approx_kl"] > 1e-9
    stops = [v for k, v in full.items() if k.startswith("stop/")]
    assert len(stops) == len(StopReason) and sum(stops) == pytest.approx(1.0)
    assert "episode/len" in full  # CountEnv's own metric, averaged over the step's episodes
