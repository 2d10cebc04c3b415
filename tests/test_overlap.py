"""Collection overlapped with training (``sampler.max_staleness: 1``, ``turnrl.train.overlap``).

On the tiny model with the toy env: with the weights frozen (no update) the overlapped loop collects exactly the
synchronous loop's batches; with learning, every batch after an iteration's first is one version behind and
the mismatch correction sees it; a killed overlapped run resumes to the uninterrupted one (the batch in flight
is collected again from the checkpointed snapshot, in the main thread: the same bytes as the one collected
while the trainer stepped); the detached sampler reads nothing of the module; what cannot overlap is refused.
"""

from __future__ import annotations

import threading

import pytest
import torch

import turnrl.train.loop as loop
from test_resume import COMPARED, _run, _table
from test_train_e2e import tiny_config
from toy_envs import CountEnv
from turnrl.chat import ChatTemplate
from turnrl.config import LoraConfig
from turnrl.envs import register_env
from turnrl.models import attach_lora
from turnrl.rundir import RunDir, read_jsonl
from turnrl.sampling.hf import HFSampler
from turnrl.sections import ConfigError
from turnrl.tracking import read_csv
from turnrl.train.loop import train
from turnrl.types import SamplingParams

STEPS = 4


@pytest.fixture(autouse=True)
def _register():
    register_env("count", CountEnv)


def _train(tmp_path, name, staleness, **sections):
    cfg = tiny_config(
        tmp_path,
        run_name=name,
        sampler={"max_tokens": 6, "max_staleness": staleness},
        train={"steps": STEPS, "lr": 1e-2, "micro_batch_size": 4},
        eval={"every": 2},
        **sections,
    )
    train(cfg)
    run = RunDir(tmp_path / "runs" / name)
    return run, read_csv(run.train_csv)


def _turns(run: RunDir):
    """Per step: every turn's (episode, tokens, behaviour log-probs, policy version), in collection order."""
    steps: dict[int, list] = {}
    for ep in read_jsonl(run.train_rollouts(0)):
        steps.setdefault(int(ep.metrics["step"]), []).extend(
            (ep.episode_id, tuple(t.action_ids), tuple(t.action_logprobs), t.policy_version) for t in ep.turns
        )
    return steps


def test_frozen_weights_collect_the_synchronous_batches(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "update", lambda trainer, rows, settings, seed: loop.idle_metrics(settings))
    sync, sync_rows = _train(tmp_path, "sync", 0)
    over, over_rows = _train(tmp_path, "over", 1)
    a, b = _turns(sync), _turns(over)
    assert len(sync_rows) == len(over_rows) == STEPS
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:  # the same tasks, seeds, tokens and log-probs (the versions differ: refreshes come later)
        assert [t[:3] for t in a[step]] == [t[:3] for t in b[step]]
    assert [r["reward"] for r in sync_rows] == [r["reward"] for r in over_rows]
    assert [r["collect/ahead"] for r in over_rows] == [0.0] + [1.0] * (STEPS - 1)
    assert "collect/ahead" not in sync_rows[0]


def test_overlapped_batches_are_one_version_behind_and_corrected(tmp_path):
    run, rows = _train(tmp_path, "stale", 1)
    cfg = tiny_config(tmp_path, sampler={"max_staleness": 1})
    assert cfg.loss.mismatch.mode == "mask"  # auto: the stale turns are weighed against the trainer's log-probs
    versions = {step: {t[3] for t in turns} for step, turns in _turns(run).items()}
    # batch 1 by v0 (the start); batch n >= 2 collected during step n-1, before that step's refresh: v(n-2)
    assert versions == {1: {0}, **{n: {n - 2} for n in range(2, STEPS + 1)}}
    gaps = [float(r["mismatch/abs_logp_gap_mean"]) for r in rows]
    assert gaps[0] < 1e-4 and all(g > 1e-4 for g in gaps[1:]), gaps  # stale by one update, seen by the loss
    groups: dict[str, int] = {}
    for ep in read_jsonl(run.train_rollouts(0)):
        groups[ep.group_id] = groups.get(ep.group_id, 0) + 1
    assert set(groups.values()) == {4}  # complete groups only


def test_staleness_zero_runs_no_collector(tmp_path, monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("max_staleness 0 must not build a collector")

    monkeypatch.setattr(loop, "Collector", refuse)
    _, rows = _train(tmp_path, "zero", 0)
    assert len(rows) == STEPS


RESUME = """
run_name: {name}
seed: 3
model: {{name: tiny}}
env: {{name: count}}
sampler: {{max_tokens: 4, max_staleness: 1}}
rollout: {{tasks_per_step: 2, group_size: 2}}
train: {{steps: 4, lr: 0.01, micro_batch_size: 4}}
loop: {{iterations: 2}}
eval: {{every: 2}}
data: {{num_eval_tasks: 2}}
tracking: {{backends: [csv], plots: false, report: false}}
paths: {{output_dir: {out}}}
"""


def _resume_config(tmp, name):
    path = tmp / f"{name}.yaml"
    path.write_text(RESUME.format(name=name, out=tmp / "runs"))
    return path


@pytest.fixture(scope="module")
def overlapped_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlap-ref")
    ref = _run(["train", str(_resume_config(tmp, "ref"))])
    assert ref.returncode == 0, ref.stderr[-3000:]
    return tmp / "runs" / "ref"


@pytest.mark.parametrize("kill_at", ["step:2", "checkpoint:6"])
def test_a_killed_overlapped_run_resumes_to_the_uninterrupted_one(tmp_path, overlapped_reference, kill_at):
    config = lambda name: _resume_config(tmp_path, name)  # noqa: E731
    run_dir = tmp_path / "runs" / "run"
    killed = _run(["train", str(config("run"))], kill_at=kill_at)
    assert killed.returncode == -9, (kill_at, killed.stderr[-2000:])
    resumed = _run(["train", str(config("run")), "--resume", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for it in (0, 1):  # every batch, the ones collected while the trainer stepped and the ones collected again
        a = (run_dir / f"rollouts/iter_{it:03d}.jsonl").read_text().splitlines()
        b = (overlapped_reference / f"rollouts/iter_{it:03d}.jsonl").read_text().splitlines()
        assert len(a) == len(b) == 4 * 2 * 2
        assert a == b
    keys = (*COMPARED, "mismatch/abs_logp_gap_mean")  # not collect/ahead: the resumed step's batch is collected now
    resumed_rows = _table(tmp_path / "runs" / "run" / "progress/train.csv", keys)
    assert resumed_rows == _table(overlapped_reference / "progress/train.csv", keys)


def test_a_sampler_on_the_trainers_module_is_refused_in_one_line(tmp_path):
    cfg = tiny_config(tmp_path, run_name="refused", sampler={"max_staleness": 1, "fast_decode": False})
    with pytest.raises(ValueError, match=r"sampler.max_staleness: 1 needs a sampler with its own copy") as err:
        train(cfg)
    assert "\n" not in str(err.value) and "fast_decode is off" in str(err.value)
    assert not (tmp_path / "runs" / "refused" / "checkpoint").exists()


def test_max_staleness_above_one_is_refused_by_the_config(tmp_path):
    with pytest.raises(ConfigError, match=r"sampler.max_staleness: Input should be less than or equal to 1 \(got 2\)"):
        tiny_config(tmp_path, sampler={"max_staleness": 2})


def _updated(model, scale: float) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(scale)


def test_the_detached_sampler_reads_nothing_of_the_module_between_refreshes(tiny_model, tokenizer):
    torch.manual_seed(0)
    model = attach_lora(tiny_model, LoraConfig(r=4, alpha=8))
    _updated(model, 0.05)  # a policy other than the base
    ctx = ChatTemplate(tokenizer).initial([{"role": "user", "content": "Count to three."}])
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    sampler = HFSampler(model, tokenizer, stale=True)
    assert sampler.detached
    first = sampler.sample([ctx] * 4, params)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    during: list = []
    worker = threading.Thread(target=lambda: during.extend(sampler.sample([ctx] * 4, params)))
    worker.start()
    for _ in range(20):  # the trainer steps while the sampler samples
        _updated(model, 0.01)
    worker.join()
    assert [s.ids for s in during] == [s.ids for s in first]
    assert [s.logprobs for s in during] == [s.logprobs for s in first]
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all("lora_B" in n for n in moved)  # only the trainer's own updates changed the module

    sampler.refresh()  # now the sampler takes the moved weights
    after = sampler.sample([ctx] * 4, params)
    assert [s.logprobs for s in after] != [s.logprobs for s in first]
    fresh = HFSampler(model, tokenizer).sample([ctx] * 4, params)  # the module's weights, shared
    assert [s.ids for s in after] == [s.ids for s in fresh]
    for a, b in zip(after, fresh, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
