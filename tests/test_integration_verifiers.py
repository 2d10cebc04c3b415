"""verifiers traces → turnrl records and per-step advantages in ``MessageNode.advantages``.

The test venv has no verifiers (0.4 would replace its openai 3 with 2.x and bring the v1 stack's
~100 packages; a v1 rollout also needs an inference endpoint and an agent harness): the adapter is
tested on verifiers' documented shapes (a trace's JSON dump), and on verifiers' own ``Trace`` and
``MessageNode`` classes where verifiers imports (run with ``--noconftest`` in a venv with it).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from turnrl.credit import CreditSettings, assign_credit
from turnrl.credit.stepwise import StepwiseParams
from turnrl.integrations.verifiers import assign_advantages, trace_episode, trace_episodes, traces_to_records
from turnrl.records import read_records


def _trace(first: str, second: str, reward: float, key: str = "ex0", parts: bool = False) -> dict:
    """A two-turn rollout as ``Trace.model_dump()`` writes it: system+user, answer, the reply, answer."""
    return {
        "id": f"tr-{first}{second}",
        "task": {"type": "Pick", "data": {}, "key": key, "hash": "h"},
        "nodes": [
            {"parent": None, "message": {"role": "system", "content": "Choose."}, "token_ids": [1, 2], "mask": [0, 0]},
            {"parent": 0, "message": {"role": "user", "content": "a or b?"}, "token_ids": [3, 4], "mask": [0, 0]},
            {
                "parent": 1,
                "message": {"role": "assistant", "content": first},
                "sampled": True,
                "token_ids": [5, 10 + ord(first), 6],  # generation prompt, then the sampled reply and its end
                "mask": [False, True, True],
                "logprobs": [-0.5, -0.1],
                "advantages": None,
            },
            {"parent": 2, "message": {"role": "user", "content": f"you said {first}"}, "token_ids": [7], "mask": [0]},
            {
                "parent": 3,
                "message": {"role": "assistant", "content": [{"type": "text", "text": second}] if parts else second},
                "sampled": True,
                "token_ids": [5, 10 + ord(second)],
                "mask": [False, True],
                "logprobs": [-0.25],
                "advantages": None,
            },
        ],
        "rewards": {"correct": {"score": reward, "weight": 1.0}},
        "is_completed": True,
        "is_timeout": False,
    }


def test_a_trace_is_an_episode_of_its_sampled_turns():
    ep, owners = trace_episode(_trace("a", "x", 1.0, parts=True), "v0")  # content as a list of parts, too
    assert owners == [2, 4] and ep.group_id == "ex0" and ep.prompt == "a or b?"
    t0, t1 = ep.turns
    assert (t0.prompt_ids, t0.action_ids, t0.action_logprobs) == ([1, 2, 3, 4, 5], [107, 6], [-0.5, -0.1])
    assert (t1.prompt_ids, t1.action_ids, t1.action_text) == ([1, 2, 3, 4, 5, 107, 6, 7, 5], [130], "x")
    assert t0.observation == "you said a" and (t0.reward, t1.reward, ep.reward) == (None, 1.0, 1.0)
    assert ep.validate() == []


def test_stepwise_advantages_land_on_each_sampled_node():
    traces = [_trace("a", "x", 1.0), _trace("b", "y", 0.0), _trace("a", "y", 3.0)]
    assign_advantages(traces, "stepwise", {"gamma": 0.5})
    # by hand: returns (r on the last turn): [0.5, 1], [0, 0], [1.5, 3]; pooled z-score, ddof 0
    r = np.array([0.5, 1.0, 0.0, 0.0, 1.5, 3.0])
    z = (r - r.mean()) / (r.std() + 1e-8)
    got = [(t["nodes"][2]["advantages"], t["nodes"][4]["advantages"]) for t in traces]
    assert got == [
        (pytest.approx([z[0]] * 2), pytest.approx([z[1]])),
        (pytest.approx([z[2]] * 2), pytest.approx([z[3]])),
        (pytest.approx([z[4]] * 2), pytest.approx([z[5]])),
    ]
    assert all("advantages" not in t["nodes"][k] for t in traces for k in (0, 1, 3))  # inputs untouched


def test_traces_become_records_and_round_trip(tmp_path):
    traces = [_trace("a", "x", 1.0), _trace("b", "y", 0.0)]
    assign_advantages(traces, "group_mean")
    path = traces_to_records(traces, tmp_path / "vf.jsonl")
    back = read_records(path)
    assert [e.episode_id for e in back] == ["v0", "v1"] and {e.group_id for e in back} == {"ex0"}
    assert back == trace_episodes(traces)[0]
    assert [t.advantage for t in back[0].turns] == pytest.approx([0.7070, 0.7070], abs=1e-3)  # (1 − .5) / std
    fresh = copy.deepcopy(back)
    for e in fresh:
        for t in e.turns:
            t.advantage = None
    assign_credit(fresh, CreditSettings("stepwise", StepwiseParams(gamma=0.5)))
    assert fresh[0].turns[0].advantage != back[0].turns[0].advantage  # another estimator, other credit


def test_anchors_group_turns_that_answered_the_same_observation():
    traces = [_trace("a", "x", 1.0), _trace("a", "y", 0.0), _trace("b", "y", 3.0)]
    episodes, _ = trace_episodes(traces, anchors=True)
    keys = [[t.state_key for t in e.turns] for e in episodes]
    assert keys[0][0] == keys[1][0] == keys[2][0]  # every first turn answered "a or b?"
    assert keys[0][1] == keys[1][1] != keys[2][1]  # "you said a" twice, "you said b" once
    assign_advantages(traces, "gigpo", {"gamma": 1.0, "omega": 1.0, "step_norm": "mean"}, anchors=True)
    first = [t["nodes"][2]["advantages"][0] for t in traces]
    second = [t["nodes"][4]["advantages"][0] for t in traces]
    # by hand, γ = 1 (every turn's return is R): episode level GRPO over R = 1, 0, 3; step level R − mean over
    # the turns with the same anchor: all three first turns, the two second turns after "you said a"
    r = np.array([1.0, 0.0, 3.0])
    episode = (r - r.mean()) / (np.std(r, ddof=1) + 1e-4)
    assert first == pytest.approx(episode + (r - r.mean()))
    assert second == pytest.approx(episode + np.array([0.5, -0.5, 0.0]))


def test_a_trace_with_several_branches_is_refused():
    trace = _trace("a", "x", 1.0)
    trace["nodes"].append({"parent": 1, "message": {"role": "user", "content": "compacted"}, "token_ids": [9]})
    with pytest.raises(ValueError, match="2 branches; a trace with several .* is not one episode"):
        trace_episode(trace, "v0")


def test_on_verifiers_own_classes_where_it_imports():
    trace_mod = pytest.importorskip("verifiers.v1.trace", reason="verifiers is not installed in this venv")
    from verifiers.v1.graph import MessageNode

    def real(d: dict):
        nodes = [MessageNode(**{k: v for k, v in n.items()}) for n in d["nodes"]]
        rewards = {k: trace_mod.Reward(**v) for k, v in d["rewards"].items()}
        task = trace_mod.TraceTask(**d["task"])
        return trace_mod.Trace(task=task, agent=trace_mod.AgentInfo(config={}), nodes=nodes, rewards=rewards)

    dumps = [_trace("a", "x", 1.0), _trace("b", "y", 0.0), _trace("a", "y", 3.0)]
    traces = [real(d) for d in dumps]
    assign_advantages(traces, "stepwise", {"gamma": 0.5})
    assign_advantages(dumps, "stepwise", {"gamma": 0.5})
    for trace, dump in zip(traces, dumps, strict=True):
        spread = trace.branches[0].advantages  # what a verifiers trainer reads, per token of the sample
        a0, a1 = dump["nodes"][2]["advantages"][0], dump["nodes"][4]["advantages"][0]
        assert spread == pytest.approx([0, 0, 0, 0, 0, a0, a0, 0, 0, a1])


def test_a_runs_own_settings_keep_its_critic_across_steps():
    """``settings=``: the run's CreditSettings passed at every step, so the critic values step 2 from step 1."""
    from turnrl.integrations.credit import settings_from_mapping

    run = settings_from_mapping({"estimator": "critic", "lam": 1.0, "shrinkage": 0.0, "scale": "none"})
    assign_advantages([_trace("a", "x", 1.0)], settings=run)  # one trace: valued by nothing, learnt from
    step2 = [_trace("a", "x", 0.0)]
    assign_advantages(step2, settings=run)
    alone = [_trace("a", "x", 0.0)]
    assign_advantages(alone, "critic", {"lam": 1.0, "shrinkage": 0.0, "scale": "none"})
    assert alone[0]["nodes"][2]["advantages"] == [0.0, 0.0]  # a fresh critic on one trace: no value
    assert step2[0]["nodes"][2]["advantages"][0] < 0  # valued from step 1's return (1): 0 − V < 0
