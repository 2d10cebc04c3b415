"""Plug-ins added from test code alone: a new estimator, loss, sampler and tracking sink each run one step.

Each is one definition plus one registry call; no file of the package is edited.
The config accepts the plug-in's own parameters (validated by its own pydantic
model) and the loop, credit, loss, sampler and tracking seams use it. The registries
are restored after each test (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from pydantic import Field

from factories import tiny_run_config
from toy_envs import CountEnv
from turnrl import credit, losses, sampling, tracking
from turnrl.config import ConfigError
from turnrl.credit import CreditResult, EstimatorParams, EstimatorSpec
from turnrl.envs import register_env
from turnrl.losses import LossParams, LossSpec
from turnrl.rundir import read_jsonl
from turnrl.sampling import SamplerParams, SamplerSpec
from turnrl.sampling.hf import HFSampler
from turnrl.tracking import SinkContext, SinkParams, SinkSpec, read_csv
from turnrl.train.loop import train


# ---- a new estimator: only the last turn is trained, with reward minus a constant baseline
class LastTurnParams(EstimatorParams):
    baseline: float = Field(0.5, description="subtracted from every episode reward")


def last_turn_credit(episodes, params: LastTurnParams) -> CreditResult:
    advantages = {e.episode_id: [None] * (e.num_turns - 1) + [e.reward - params.baseline] for e in episodes}
    return CreditResult(advantages, {"last_turn/baseline": params.baseline})


# ---- a new loss: plain REINFORCE with a scale
class ReinforceParams(LossParams):
    scale: float = Field(1.0, gt=0)


def reinforce(x: losses.LossInputs, params: ReinforceParams) -> torch.Tensor:
    return -params.scale * x.advantages * x.logp


# ---- a new sampler: the HF sampler, counting its calls
CALLS: list[int] = []


class CountingSampler(HFSampler):
    def sample(self, contexts, params, messages=None):
        CALLS.append(len(contexts))
        return super().sample(contexts, params, messages)


class CountingParams(SamplerParams):
    label: str = "counted"


def counting_factory(model, tokenizer, cfg, *, stale=False):
    assert cfg.params.label == "from-test"  # the backend's own parameter reached its factory
    return CountingSampler(model, tokenizer, batch_size=cfg.batch_size, stale=stale)


# ---- a new tracking sink: keeps every row it is given, in memory
class MemoryParams(SinkParams):
    memory_tag: str = "kept"


class MemorySink:
    runs: list[MemorySink] = []

    def __init__(self, context: SinkContext) -> None:
        self.context, self.steps, self.evals, self.closed = context, [], [], False
        MemorySink.runs.append(self)

    def log_step(self, step, metrics):
        self.steps.append((step, dict(metrics)))

    def log_eval(self, step, metrics):
        self.evals.append((step, dict(metrics)))

    def log_iteration(self, iteration, metrics):
        pass

    def close(self):
        self.closed = True


@pytest.fixture(autouse=True)
def _plugins():  # conftest's fixture puts every registry back afterwards
    register_env("count", CountEnv)
    credit.register_estimator("last_turn", EstimatorSpec(last_turn_credit, LastTurnParams, per_turn_rows=True))
    losses.register_loss("reinforce", LossSpec(reinforce, ReinforceParams))
    sampling.register_sampler("counting", SamplerSpec(counting_factory, CountingParams))
    tracking.register_sink("memory", SinkSpec(MemorySink, MemoryParams))


def _config(tmp_path, name, **sections):
    sections.setdefault("sampler", {}).setdefault("max_tokens", 5)
    return tiny_run_config(tmp_path, name, **sections)


def _trained(tmp_path, name) -> dict:
    rows = read_csv(tmp_path / name / "progress" / "train.csv")
    assert len(rows) == 1 and rows[0]["num_tokens"] > 0 and rows[0]["grad_norm"] > 0
    return rows[0]


def test_new_estimator_trains_one_step(tmp_path):
    cfg = _config(tmp_path, "est", credit={"estimator": "last_turn", "baseline": 0.25})
    assert cfg.credit.params == LastTurnParams(baseline=0.25)
    assert cfg.per_turn_rows  # the spec's need reaches the row builder
    train(cfg)
    row = _trained(tmp_path, "est")
    assert row["last_turn/baseline"] == 0.25


def _token_sum_loss(episodes, per_token) -> tuple[float, int]:
    """A loss with the ``token_sum`` normaliser, by hand: Σ over trained action tokens of
    ``per_token(A, logp)`` / their count, with the sampler's log-probs (on-policy: the trainer's)."""
    total, count = 0.0, 0
    for ep in episodes:
        for turn in ep.turns:
            if turn.advantage is not None:
                total += sum(per_token(turn.advantage, lp) for lp in turn.action_logprobs)
                count += len(turn.action_ids)
    return total / count, count


def test_new_loss_trains_one_step(tmp_path):
    """The logged loss is the registered function's on the step's rows, not the default clip loss's."""
    cfg = _config(tmp_path, "loss", loss={"type": "reinforce", "scale": 2.0})
    assert cfg.loss.params == ReinforceParams(scale=2.0)
    train(cfg)
    row = _trained(tmp_path, "loss")
    episodes = read_jsonl(tmp_path / "loss" / "rollouts" / "iter_000.jsonl")
    want, tokens = _token_sum_loss(episodes, lambda a, lp: -2.0 * a * lp)  # reinforce, scale 2
    clip, _ = _token_sum_loss(episodes, lambda a, lp: -a)  # clip at ratio 1: what ignoring loss.type logs
    assert row["num_tokens"] == tokens
    assert abs(want - clip) > 0.1 * abs(want)  # the two losses are told apart on these rows
    assert row["loss"] == pytest.approx(want, rel=1e-3, abs=1e-5)


def test_new_sink_receives_the_step_rows(tmp_path):
    MemorySink.runs.clear()
    cfg = _config(tmp_path, "sink", tracking={"backends": ["csv", "memory"], "memory_tag": "from-test"})
    assert cfg.tracking.params_of("memory") == MemoryParams(memory_tag="from-test")
    cfg.train.steps = 2
    train(cfg)
    (sink,) = MemorySink.runs
    assert sink.context.params.memory_tag == "from-test" and sink.context.run_name == "sink"
    assert sink.context.config["tracking"]["backends"] == ["csv", "memory"] and sink.closed
    logged = read_csv(tmp_path / "sink" / "progress" / "train.csv")
    assert [step for step, _ in sink.steps] == [1, 2] == [int(r["step"]) for r in logged]
    for (_, metrics), r in zip(sink.steps, logged, strict=True):  # the same rows the CSV sink wrote
        assert metrics["loss"] == pytest.approx(r["loss"]) and metrics["num_tokens"] == r["num_tokens"]
    assert sink.evals and sink.evals[-1][1]["label"] == "final"


def test_unknown_sink_is_one_line_naming_the_registered_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, "bad", tracking={"backends": ["csv", "mlflow"]})
    (line,) = str(info.value).splitlines()[1:]
    assert "tracking.backends: 'mlflow' is not registered" in line
    assert all(repr(name) in line for name in ("console", "csv", "memory", "tensorboard", "wandb"))
    with pytest.raises(ConfigError, match="memory_tag"):
        _config(tmp_path, "bad", tracking={"backends": ["memory"], "memory_tag": 3})


def test_new_sampler_trains_one_step(tmp_path):
    CALLS.clear()
    cfg = _config(tmp_path, "smp", sampler={"backend": "counting", "label": "from-test", "max_tokens": 5})
    train(cfg)
    _trained(tmp_path, "smp")
    assert CALLS and sum(CALLS) >= 2 * 2  # collection went through the new backend (and evaluation)


def test_plugin_parameters_are_validated_by_the_plugin(tmp_path):
    with pytest.raises(ConfigError, match="scale"):
        _config(tmp_path, "bad", loss={"type": "reinforce", "scale": -1.0})
    with pytest.raises(ConfigError, match="unknown key 'credit.nonsense'"):
        _config(tmp_path, "bad", credit={"estimator": "last_turn", "nonsense": 1})
