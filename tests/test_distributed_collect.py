"""Sharded collection (gloo on CPU): with 2 processes each collects its share of a step's tasks (a task's
group or tree whole on one rank), the episodes are gathered to every rank, and the steps equal one
process's on the same episodes.

What makes the gathered episodes one process's: with ``rollout.task_seeds`` every draw is seeded from
(step seed, task index, branch, turn), not from its place in the sampler call; the HF sampler then draws
each row from its own generator (:class:`turnrl.sampling.hf._RowDraws`). Token ids, rewards, ids and order
are compared exactly; log-probs and advantages to 1e-5 (a row's logits depend, at float level, on the
batch it was computed in); gradients and weights with the tolerances of ``test_distributed.py``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from factories import join_gloo
from test_distributed import GRAD_SCALE_TOL, METRIC_TOL, WEIGHT_ATOL, _free_port
from toy_envs import CountEnv, EarlyEndEnv
from turnrl.chat import ChatTemplate
from turnrl.config import parse_config
from turnrl.envs import register_env
from turnrl.envs.splits import TaskSource
from turnrl.rollout.collect import RolloutSettings, collect
from turnrl.sampling import make_sampler
from turnrl.sampling.hf import HFSampler
from turnrl.train import distributed
from turnrl.train.checkpoint import RunState
from turnrl.train.loop import train_step
from turnrl.train.policy import build_policy
from turnrl.train.settings import RunSettings
from turnrl.types import SamplingParams

LOGPROB_ATOL = 1e-5
STEPS = 2
CASES = {
    "flat": {"env": {"name": "count"}, "rollout": {"tasks_per_step": 3, "group_size": 4}},
    "tree": {
        "env": {"name": "early"},
        "rollout": {"tasks_per_step": 3, "branching": [2, 2]},
        "credit": {"estimator": "branched"},
    },
}
COMPARED_METRICS = ("loss", "grad_norm", "num_tokens", "success_rate", "num_episodes", "completions/mean_length")


def _register() -> None:
    register_env("count", CountEnv)
    register_env("early", EarlyEndEnv)


@pytest.fixture(autouse=True)
def _envs():
    _register()


def _cfg(case: str, task_seeds: bool | None = None):
    data = {
        "model": {"name": "tiny"},
        "seed": 5,
        "sampler": {"max_tokens": 6, "temperature": 1.0},
        "train": {"lr": 0.01, "micro_batch_size": 2},
        **{k: dict(v) for k, v in CASES[case].items()},
    }
    if task_seeds is not None:
        data["rollout"]["task_seeds"] = task_seeds
    return parse_config(data)


def _episode(ep) -> dict:
    return {
        "id": ep.episode_id,
        "group": ep.group_id,
        "task": ep.task_id,
        "branch": list(ep.branch),
        "reward": ep.reward,
        "turns": [
            {
                "prompt": t.prompt_ids,
                "action": t.action_ids,
                "reward": t.reward,
                "logprobs": t.action_logprobs,
                "advantage": t.advantage,
            }
            for t in ep.turns
        ],
    }


def _train_steps(cfg) -> dict:
    """``STEPS`` training steps of the loop (collect, credit, update, refresh): each step's episodes,
    metrics and (reduced, clipped) gradients, and the final weights."""
    settings = RunSettings.from_config(cfg)
    model, tok = build_policy(settings.policy, None, 0)
    trainer = distributed.make_trainer(model, settings.step, tok.pad_token_id)
    sampler = make_sampler(settings.sampler, model, tok)
    chat = settings.chat.template(tok)
    tasks = TaskSource.from_config(cfg).tasks("train")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads: list[dict] = []
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append({n: p.grad.detach().clone() for n, p in named}))
    state = RunState()
    steps = []
    for _ in range(STEPS):
        episodes, metrics = train_step(settings, trainer, sampler, chat, tasks, state)
        steps.append({"episodes": [_episode(e) for e in episodes], "metrics": metrics, "grads": grads[-1]})
    weights = {n: w.detach().clone() for n, w in trainer.policy_weights().items()}
    return {"shard_collection": settings.shard_collection, "steps": steps, "weights": weights}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    _register()
    join_gloo(rank, world, port)
    local: list[list[str]] = []  # the episode ids this rank collected itself, per collect call
    gather = distributed.gather_episodes

    def recording_gather(episodes):
        local.append([e.episode_id for e in episodes])
        return gather(episodes)

    distributed.gather_episodes = recording_gather
    results = {}
    for case in CASES:
        local.clear()
        results[case] = _train_steps(_cfg(case))  # task_seeds left at its default
        results[case]["local"] = [list(ids) for ids in local]
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("collect")
    ctx = mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 300
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("2 processes did not finish within 300s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_same_episodes(got: list[dict], want: list[dict]) -> None:
    assert [e["id"] for e in got] == [e["id"] for e in want]  # same episodes, same order
    for a, b in zip(got, want, strict=True):
        assert (a["group"], a["task"], a["branch"], a["reward"]) == (b["group"], b["task"], b["branch"], b["reward"])
        assert len(a["turns"]) == len(b["turns"]), a["id"]
        for ta, tb in zip(a["turns"], b["turns"], strict=True):
            assert ta["prompt"] == tb["prompt"] and ta["action"] == tb["action"], a["id"]
            assert ta["reward"] == tb["reward"], a["id"]
            assert max((abs(x - y) for x, y in zip(ta["logprobs"], tb["logprobs"], strict=True)), default=0) < (
                LOGPROB_ATOL
            )
            assert (ta["advantage"] is None) == (tb["advantage"] is None)
            if ta["advantage"] is not None:
                assert math.isclose(ta["advantage"], tb["advantage"], rel_tol=1e-5, abs_tol=1e-5), a["id"]


# ---- two processes: disjoint shares, gathered episodes and steps equal one process's ------------


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_collect_disjoint_halves_and_train_as_one_process(two_ranks, case):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = _train_steps(_cfg(case, task_seeds=True))  # one process, the same seeding
    finally:
        torch.set_num_threads(threads)
    r0, r1 = two_ranks[0][case], two_ranks[1][case]
    assert not ref["shard_collection"] and r0["shard_collection"] and r1["shard_collection"]
    scales = []
    for k in range(STEPS):
        want = ref["steps"][k]["episodes"]
        # each rank collected a non-empty share; the shares are disjoint, whole groups, and in rank order the step
        mine0, mine1 = r0["local"][k], r1["local"][k]
        assert mine0 and mine1 and not set(mine0) & set(mine1)
        assert mine0 + mine1 == [e["id"] for e in want]
        groups = [{e["group"] for e in want if e["id"] in mine} for mine in (mine0, mine1)]
        assert not groups[0] & groups[1]
        # the gathered episodes (on both ranks) are one process's
        _assert_same_episodes(r0["steps"][k]["episodes"], want)
        _assert_same_episodes(r1["steps"][k]["episodes"], want)
        # and so is the update: gradients, metrics
        g_ref, g0, g1 = ref["steps"][k]["grads"], r0["steps"][k]["grads"], r1["steps"][k]["grads"]
        scale = max(float(g.abs().max()) for g in g_ref.values())  # 0 when every advantage is 0
        scales.append(scale)
        for n, g in g_ref.items():
            assert torch.equal(g0[n], g1[n]), n
            torch.testing.assert_close(g0[n], g, atol=GRAD_SCALE_TOL * scale, rtol=0)
        for key in COMPARED_METRICS:
            a, b = r0["steps"][k]["metrics"][key], ref["steps"][k]["metrics"][key]
            assert math.isclose(a, b, **METRIC_TOL), (k, key, a, b)
    assert max(scales) > 0  # some step learned something
    for n, w in ref["weights"].items():
        assert torch.equal(r0["weights"][n], r1["weights"][n]), n
        torch.testing.assert_close(r0["weights"][n], w, atol=WEIGHT_ATOL, rtol=0)


# ---- one process: the arithmetic and the seeding the sharding rests on ------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 7])
def test_task_shares_are_contiguous_balanced_and_partition_the_tasks(n, world):
    shares = [distributed.task_share(n, r, world) for r in range(world)]
    assert [i for s in shares for i in s] == list(range(n))  # in rank order: every task once, in order
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_without_a_launch_collection_is_not_sharded():
    assert not distributed.shards_collection(shares_module=False)
    s = RunSettings.from_config(_cfg("flat"))
    assert not s.shard_collection and not s.rollout.task_seeds  # one process keeps the per-call seeds
    assert RunSettings.from_config(_cfg("flat", task_seeds=True)).rollout.task_seeds
    assert distributed.gather_episodes([]) == []


def test_a_launch_shards_collection_except_fsdp_through_the_trainers_module(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.shards_collection(shares_module=True)
    s = RunSettings.from_config(_cfg("flat"))
    assert s.shard_collection and s.rollout.task_seeds
    assert not RunSettings.from_config(_cfg("flat", task_seeds=False)).rollout.task_seeds
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert not distributed.shards_collection(shares_module=True)  # the sharded layers' gathers: replicated
    assert distributed.shards_collection(shares_module=False)  # a vLLM engine or server has its own weights


class _Recording:
    def __init__(self, inner):
        self.inner, self.params = inner, []
        self.policy_version = 0

    def sample(self, contexts, params, messages=None):
        self.params.append(params)
        return self.inner.sample(contexts, params, messages)


def _collect_shares(model, tok, case: str, task_seeds: bool, world: int) -> list:
    cfg = _cfg(case)
    tasks = TaskSource.from_config(cfg).tasks("train")[:3]
    settings = RolloutSettings.from_config(cfg)
    settings = RolloutSettings(**{**settings.__dict__, "task_seeds": task_seeds})
    chat = ChatTemplate(tok, {})
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11)
    episodes = []
    for r in range(world):
        share = distributed.task_share(len(tasks), r, world)
        episodes += collect(
            [tasks[i] for i in share], HFSampler(model, tok), chat, params, settings.shape, settings,
            first_task=share.start,
        )  # fmt: skip
    return [_episode(e) for e in episodes]


@pytest.mark.parametrize("case", list(CASES))
def test_with_task_seeds_a_share_collected_alone_is_its_part_of_the_whole(tiny_model, tokenizer, case):
    whole = _collect_shares(tiny_model, tokenizer, case, task_seeds=True, world=1)
    _assert_same_episodes(_collect_shares(tiny_model, tokenizer, case, task_seeds=True, world=2), whole)
    _assert_same_episodes(_collect_shares(tiny_model, tokenizer, case, task_seeds=True, world=3), whole)
    # the per-call seeds (one process's default) do not have this property: the later share draws differently
    per_call = _collect_shares(tiny_model, tokenizer, case, task_seeds=False, world=1)
    split = _collect_shares(tiny_model, tokenizer, case, task_seeds=False, world=2)
    assert [e["id"] for e in split] == [e["id"] for e in per_call]
    assert [t["action"] for e in split for t in e["turns"]] != [t["action"] for e in per_call for t in e["turns"]]


def test_task_seeds_reach_the_sampler_only_when_on(tiny_model, tokenizer):
    cfg = _cfg("flat")
    tasks = TaskSource.from_config(cfg).tasks("train")[:2]
    chat = ChatTemplate(tokenizer, {})
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    for on in (False, True):
        settings = RolloutSettings(shape=(2,), task_seeds=on)
        sampler = _Recording(HFSampler(tiny_model, tokenizer))
        collect(tasks, sampler, chat, params, settings.shape, settings)
        assert sampler.params and all((p.row_seeds is not None) == on for p in sampler.params)
        if on:  # one seed per row, different rows, different turns
            seeds = [s for p in sampler.params for s in p.row_seeds]
            assert len(set(seeds)) == len(seeds) and all(len(p.row_seeds) == 4 for p in sampler.params)


def _contexts(n: int = 4):
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 4000, (24,), generator=g).tolist()
    return [prefix + torch.randint(100, 4000, (3 + 2 * k,), generator=g).tolist() for k in range(n)]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_hf_row_seeds_make_a_rows_draws_its_own(tiny_model, tokenizer, temperature, top_p):
    contexts = _contexts()
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=8, seed=1, row_seeds=(7, 8, 9, 10))
    together = HFSampler(tiny_model, tokenizer).sample(contexts, params)
    alone = HFSampler(tiny_model, tokenizer, batch_size=1).sample(contexts[2:3], SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=8, seed=99, row_seeds=(9,)))  # fmt: skip
    assert alone[0].ids == together[2].ids
    assert max(abs(a - b) for a, b in zip(alone[0].logprobs, together[2].logprobs, strict=True)) < LOGPROB_ATOL
    reordered = HFSampler(tiny_model, tokenizer, batch_size=2).sample(
        contexts[::-1], SamplingParams(temperature=temperature, top_p=top_p, max_tokens=8, row_seeds=(10, 9, 8, 7))
    )
    assert [s.ids for s in reordered[::-1]] == [s.ids for s in together]
    other = HFSampler(tiny_model, tokenizer).sample(contexts, SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=8, row_seeds=(1, 2, 3, 4)))  # fmt: skip
    assert [s.ids for s in other] != [s.ids for s in together]  # the seeds are used


def test_hf_row_seeded_draws_follow_the_sampling_distribution(tiny_model, tokenizer):
    """First tokens of one context drawn under 600 row seeds: their mean log-prob estimates
    Σ p log p (−entropy) of the temperature-0.1 distribution (the random tiny model's logits are
    nearly flat; at 0.1 its top token has p 0.18 and a sampler ignoring the scores is ~29 SE off);
    their log-probs are the model's."""
    context = _contexts(1)[0]
    n, temperature = 600, 0.1
    params = SamplingParams(temperature=temperature, max_tokens=1, row_seeds=tuple(range(1000, 1000 + n)))
    samples = HFSampler(tiny_model, tokenizer, batch_size=100).sample([context] * n, params)
    with torch.no_grad():
        logits = tiny_model(input_ids=torch.tensor([context])).logits[0, -1].float()
    logp = (logits / temperature).log_softmax(-1)
    drawn = torch.tensor([s.ids[0] for s in samples])
    torch.testing.assert_close(torch.tensor([s.logprobs[0] for s in samples]), logp[drawn], atol=1e-4, rtol=0)
    p = logp.exp()
    want = float((p * logp).sum())
    sd = float(((p * (logp - want) ** 2).sum()).sqrt())
    got = float(logp[drawn].mean())
    assert abs(got - want) < 4 * sd / math.sqrt(n), (got, want, sd)
    uniform = float(logp.mean())  # what a sampler ignoring the scores would give: far outside the bound
    assert abs(uniform - want) > 12 * sd / math.sqrt(n), (uniform, want, sd)
