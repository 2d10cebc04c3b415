"""Several processes (gloo on CPU): the 2-process step equals the 1-process step, with the base replicated on
every rank or sharded over them (FSDP2); a killed 2-process run (either way) resumes to the uninterrupted one.

Tolerances, and what was measured (4 loss set-ups, tiny model, 2 ranks vs 1 process).
Gradients: ``|diff| <= 1e-5 · max|g|`` against the single process (measured ≤ 4e-6 ·
max|g|, i.e. 1.4e-7 at max|g| 0.037: the float32 summation order of two shards plus
the ranks' thread counts); the ranks' gradients and weights are bitwise equal to
each other. Post-step weights (AdamW, lr 0.01): ``atol 5e-5`` = lr·5e-3 (measured
1.4e-5 after two passes) — Adam moves an element by about lr·g/(|g|+ε), which
magnifies the float error of near-zero gradient elements. Metrics: ``rel 1e-5``
(measured 5e-7).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from factories import join_gloo, random_episode, set_advantages
from turnrl.config import parse_config
from turnrl.tracking import read_csv
from turnrl.train import distributed
from turnrl.train.batch import build_rows
from turnrl.train.distributed import (
    DistributedTrainer,
    ShardedTrainer,
    global_totals,
    lockstep_plan,
    make_trainer,
    shard_rows,
)
from turnrl.train.policy import PolicySettings, build_policy
from turnrl.train.step import LocalTrainer, StepSettings, StepTotals, accumulate_gradients, update

HERE = Path(__file__).parent
ROOT = HERE.parent
GRAD_SCALE_TOL = 1e-5
WEIGHT_ATOL = 5e-5
METRIC_TOL = {"rel_tol": 1e-5, "abs_tol": 1e-6}

CASES = {
    "token_sum": ({"micro_batch_size": 2}, {}, False),
    "seq_mean_per_turn": ({"micro_batch_size": 3}, {"norm": "seq_mean"}, True),
    "constant_two_passes_kl": ({"micro_batch_size": 2, "num_iterations": 2}, {"norm": "constant", "beta": 0.1}, False),
    "decompose_turns": ({"micro_batch_size": 2, "decompose_turns": True}, {}, True),
}


def _case(name: str):
    train, loss, per_turn = CASES[name]
    cfg = parse_config(
        {
            "model": {"name": "tiny"},
            "sampler": {"max_tokens": 6},
            "seed": 5,
            "train": {"lr": 0.01, **train},
            "loss": loss,
        }
    )
    episodes = [random_episode(f"e{i}", seed=i) for i in range(5)]  # 5 episodes: shards of unequal size
    advantages = {f"e{i}": [0.5 * (i - 2), 1.0 - 0.3 * i] for i in range(5)}
    set_advantages(episodes, advantages)
    return cfg, build_rows(episodes, per_turn=per_turn)


def _one_step(trainer, cfg, rows) -> dict:
    """Gradients of one forward/backward, then the full update's metrics and post-step weights."""
    totals = StepTotals.of(rows, cfg.sampler.max_tokens)
    sums = trainer.forward_backward(rows, totals)
    if isinstance(trainer, DistributedTrainer):
        trainer.reduce_gradients()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer._reduced = False
    metrics = update(trainer, rows, StepSettings.from_config(cfg))
    out = {
        "sums": sums,
        "grads": grads,
        "metrics": metrics,
        "weights": {n: w.clone() for n, w in trainer.policy_weights().items()},
    }
    if isinstance(trainer, DistributedTrainer):
        out["fingerprint"] = trainer.weights_fingerprint()
    return out


def _worker(rank: int, world: int, port: int, out: str, names: list[str], fsdp: bool) -> None:
    if fsdp:
        os.environ["ACCELERATE_USE_FSDP"] = "true"
    join_gloo(rank, world, port)
    results = {}
    for name in names:
        cfg, rows = _case(name)
        model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
        trainer = make_trainer(model, StepSettings.from_config(cfg), tok.pad_token_id)
        assert type(trainer) is (ShardedTrainer if fsdp else DistributedTrainer)
        results[name] = _one_step(trainer, cfg, rows)
        results[name]["frozen"] = _frozen_layout(model)
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _frozen_layout(model) -> dict[str, list]:
    """Each frozen decoder-layer weight's local shape, and whether it is an FSDP shard."""
    from torch.distributed.tensor import DTensor

    return {
        n: [isinstance(p, DTensor), list(p.to_local().shape if isinstance(p, DTensor) else p.shape)]
        for n, p in model.named_parameters()
        if not p.requires_grad and ".layers." in n
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(world: int, out: Path, names: list[str], fsdp: bool = False, timeout: float = 300) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker, args=(world, _free_port(), str(out), names, fsdp), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} processes did not finish within {timeout}s")


# ---- in one process: the sharding arithmetic -----------------------------------------------


def test_shards_partition_the_rows_and_balance_tokens():
    _, rows = _case("seq_mean_per_turn")
    shards = [shard_rows(rows, r, 3) for r in range(3)]
    ids = sorted(id(r) for s in shards for r in s)
    assert ids == sorted(id(r) for r in rows)
    tokens = [sum(sum(r.mask) for r in s) for s in shards]
    longest = max(sum(r.mask) for r in rows)
    assert max(tokens) - min(tokens) <= longest
    assert shard_rows(rows, 1, 3) == shards[1]  # deterministic
    assert shard_rows(rows[:1], 1, 2) == []  # fewer rows than ranks: a rank may get none


def test_without_a_launch_the_trainer_is_local_and_totals_are_the_shards():
    cfg, rows = _case("token_sum")
    assert not distributed.active() and distributed.is_main()
    assert global_totals(rows, cfg.sampler.max_tokens) == StepTotals.of(rows, cfg.sampler.max_tokens)
    assert global_totals([], 6) == StepTotals(0, 0, 0)
    model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
    assert type(make_trainer(model, StepSettings.from_config(cfg), tok.pad_token_id)) is LocalTrainer


@pytest.mark.parametrize("name", ["seq_mean_per_turn", "constant_two_passes_kl"])
def test_shard_gradients_with_global_totals_add_up_to_the_batch_gradient(name):
    """The identity the multi-process step rests on, checked in one process against autograd on the whole batch."""
    cfg, rows = _case(name)
    model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
    with torch.no_grad():  # non-zero LoRA B, so every LoRA gradient is non-zero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    params = [p for p in model.parameters() if p.requires_grad]
    totals = StepTotals.of(rows, cfg.sampler.max_tokens)
    full = accumulate_gradients(model, rows, StepSettings.from_config(cfg), pad_id=tok.pad_token_id, totals=totals)
    want = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    sums: dict[str, float] = {}
    for r in range(2):
        part = accumulate_gradients(
            model, shard_rows(rows, r, 2), StepSettings.from_config(cfg), pad_id=tok.pad_token_id, totals=totals
        )
        for k, v in part.items():
            sums[k] = sums.get(k, 0.0) + v
    scale = max(float(w.abs().max()) for w in want)
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, atol=GRAD_SCALE_TOL * scale, rtol=0)
    assert sums.keys() == full.keys()
    for k in full:
        assert math.isclose(sums[k], full[k], **METRIC_TOL), k


# ---- two processes -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["replicated", "fsdp"])
def two_ranks(request, tmp_path_factory):
    """Both ranks' results: the base replicated on each rank, or sharded over the two by FSDP."""
    out = tmp_path_factory.mktemp("ranks")
    _spawn(2, out, list(CASES), fsdp=request.param)
    return request.param, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_two_process_step_equals_the_one_process_step(two_ranks, name):
    fsdp, two_ranks = two_ranks
    cfg, rows = _case(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = build_policy(PolicySettings.from_config(cfg), None, 0)
        ref = _one_step(LocalTrainer(model, StepSettings.from_config(cfg), tok.pad_token_id), cfg, rows)
    finally:
        torch.set_num_threads(threads)
    r0, r1 = two_ranks[0][name], two_ranks[1][name]
    whole = _frozen_layout(model)
    assert whole and r0["frozen"].keys() == whole.keys()
    for n, (_, shape) in whole.items():  # FSDP: each rank holds half of every frozen layer weight
        want = [True, [shape[0] // 2, *shape[1:]]] if fsdp else [False, shape]
        assert r0["frozen"][n] == r1["frozen"][n] == want, n
    assert r0["fingerprint"] == r1["fingerprint"]  # the ranks' samplers refresh to the same weights
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    assert scale > 0
    for n, g in ref["grads"].items():
        assert torch.equal(r0["grads"][n], r1["grads"][n]), n
        torch.testing.assert_close(r0["grads"][n], g, atol=GRAD_SCALE_TOL * scale, rtol=0)
    for n, w in ref["weights"].items():
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n
        torch.testing.assert_close(r0["weights"][n], w, atol=WEIGHT_ATOL, rtol=0)
    for key in ("sums", "metrics"):
        assert r0[key] == r1[key]
        assert r0[key].keys() == ref[key].keys()
        for k, v in ref[key].items():
            assert math.isclose(r0[key][k], v, **METRIC_TOL), (key, k, r0[key][k], v)


# ---- the command: turnrl train --processes 2, killed and resumed ---------------------------

CONFIG = """
run_name: {name}
seed: 3
model: {{name: tiny}}
env: {{name: count}}
sampler: {{max_tokens: 4}}
rollout: {{tasks_per_step: 2, group_size: 2{rollout}}}
train: {{steps: 2, lr: 0.01, micro_batch_size: 3}}
loop: {{iterations: 2}}
eval: {{every: 0}}
data: {{num_eval_tasks: 2}}
tracking: {{backends: [csv], plots: false, report: false}}
paths: {{output_dir: {out}}}
"""
COMPARED = ("step", "iteration", "reward", "reward_std", "loss", "grad_norm", "num_tokens", "policy_version")


def _train(config: Path, *extra: str, kill_at: str = "", timeout: int = 400) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "KILL_AT": kill_at,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, str(HERE / "resume_runner.py"), "train", str(config), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _config(tmp: Path, name: str, task_seeds: bool = False) -> Path:
    """The run's config; ``task_seeds``: seed one process (or replicated FSDP collection) as sharded collection."""
    path = tmp / f"{name}.yaml"
    path.write_text(CONFIG.format(name=name, out=tmp / "runs", rollout=", task_seeds: true" if task_seeds else ""))
    return path


def _rows(run: Path, name: str = "progress/train.csv"):
    return [{k: r.get(k) for k in COMPARED} for r in read_csv(run / name)]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    result = _train(_config(tmp, "ref"), "--processes", "2")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return tmp / "runs" / "ref"


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    result = _train(_config(tmp, "ref", task_seeds=True))  # the seeding of the 2-process run's sharded collection
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp / "runs" / "ref"


def _assert_same_training(run: Path, one: Path) -> None:
    """Same logged steps (to float tolerance) and adapters as the one-process run; rank 0 wrote once."""
    rows, one_rows = _rows(run), _rows(one)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one row per step: only rank 0 logs
    for a, b in zip(rows, one_rows, strict=True):
        for k in COMPARED:
            assert math.isclose(float(a[k]), float(b[k]), **METRIC_TOL), (a["step"], k, a[k], b[k])
    from safetensors.torch import load_file

    for it in (0, 1):
        wa = load_file(str(run / f"adapters/iter_{it:03d}/adapter_model.safetensors"))
        wb = load_file(str(one / f"adapters/iter_{it:03d}/adapter_model.safetensors"))
        assert wa.keys() == wb.keys()
        for k in wb:
            torch.testing.assert_close(wa[k], wb[k], atol=WEIGHT_ATOL, rtol=0)
    lines = (run / "rollouts/iter_000.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2  # 2 steps x 2 tasks x 2 episodes, written once


def test_two_process_run_matches_the_one_process_run(two_process_run, one_process_run):
    _assert_same_training(two_process_run, one_process_run)


def test_killed_fsdp_run_resumes_and_matches_the_one_process_run(one_process_run, tmp_path):
    """accelerate launch with FSDP (the base sharded over 2 ranks, sampling through the sharded layers):
    killed mid-iteration 1, resumed, and the same training as one process."""
    config = _config(tmp_path, "ref", task_seeds=True)  # FSDP collects replicated: the one process's seeding
    run = tmp_path / "runs" / "ref"
    killed = _train(config, "--processes", "2", "--fsdp", kill_at="step:4")
    assert killed.returncode != 0, killed.stderr[-2000:]
    resumed = _train(config, "--processes", "2", "--fsdp", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "train.shared_prefix: true is turned off under FSDP" in resumed.stdout + resumed.stderr  # not silent
    _assert_same_training(run, one_process_run)


def test_killed_two_process_run_resumes_to_the_uninterrupted_one(two_process_run, tmp_path):
    config = _config(tmp_path, "ref")
    run = tmp_path / "runs" / "ref"
    killed = _train(config, "--processes", "2", kill_at="step:4")  # mid-iteration 1: resumes from step 3
    assert killed.returncode != 0, killed.stderr[-2000:]
    assert not (run / "adapters/iter_001").exists()
    resumed = _train(config, "--processes", "2", "--resume", str(run))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert _rows(run) == _rows(two_process_run)
    eval_keys = ("step", "iteration", "label", "mean_reward", "success_rate")
    ref_eval = [{k: r.get(k) for k in eval_keys} for r in read_csv(two_process_run / "progress/eval.csv")]
    assert [{k: r.get(k) for k in eval_keys} for r in read_csv(run / "progress/eval.csv")] == ref_eval
    for it in (0, 1):
        a = (run / f"rollouts/iter_{it:03d}.jsonl").read_text().splitlines()
        b = (two_process_run / f"rollouts/iter_{it:03d}.jsonl").read_text().splitlines()
        assert a == b
    again = _train(config, "--processes", "2")  # rank 0's refusal ends every rank: one line, status 2
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "already holds a run" in again.stdout and "Traceback" not in again.stdout + again.stderr


def _cli_train(tmp_path, *extra: str, world: str | None) -> subprocess.CompletedProcess:
    """``turnrl train`` in a subprocess, as a rank of a launch of ``world`` processes (None: no launcher)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    if world is not None:
        env["WORLD_SIZE"] = world
    cmd = [sys.executable, "-m", "turnrl", "train", str(_config(tmp_path, "x")), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_processes_must_match_the_launcher(tmp_path):
    result = _cli_train(tmp_path, "--processes", "2", world="3")
    assert result.returncode == 2
    assert "--processes 2" in result.stdout and "3 processes" in result.stdout


def test_fsdp_flag_needs_processes_and_a_matching_launch(tmp_path):
    alone = _cli_train(tmp_path, "--fsdp", world=None)
    assert alone.returncode == 2 and "--processes N" in alone.stdout
    mismatch = _cli_train(tmp_path, "--processes", "2", "--fsdp", world="2")  # a rank of a launch without FSDP
    assert mismatch.returncode == 2 and "without FSDP" in mismatch.stdout


# ---- the lock-step plan of the sharded trainer ---------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_lockstep_plans_have_equal_length_and_partition_the_rows(name):
    cfg, rows = _case(name)
    for world in (2, 3, 11):
        plans = [lockstep_plan(rows, StepSettings.from_config(cfg), r, world) for r in range(world)]
        assert len({len(p) for p in plans}) == 1  # every rank runs the same number of micro-batches
        real = [r for p in plans for mb in p for r in mb if any(r.mask)]
        assert sorted(map(id, real)) == sorted(map(id, rows))
        for p in plans:
            assert all(0 < len(mb) <= cfg.train.micro_batch_size for mb in p)
            if cfg.train.decompose_turns:  # a micro-batch holds one turn index
                assert all(len({r.turn for r in mb}) == 1 for mb in p)
    placeholders = [
        mb
        for p in (lockstep_plan(rows, StepSettings.from_config(cfg), r, 11) for r in range(11))
        for mb in p
        if not any(mb[0].mask)
    ]
    assert placeholders and all(len(mb) == 1 for mb in placeholders)  # 11 ranks, 5-10 rows: some get none


def test_deepspeed_and_fsdp_offload_launches_are_refused_with_the_way_out(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="accelerate_fsdp.yaml"):
        distributed.setup()
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match="fsdp_offload_params: false"):
        distributed.setup()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("accelerate_*.yaml")), ids=lambda p: p.name)
def test_shipped_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 2 and str(cfg.distributed_type) in {
        "DistributedType.MULTI_GPU",
        "DistributedType.FSDP",
        "DistributedType.DEEPSPEED",
    }
