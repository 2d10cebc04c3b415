"""verifiers (0.4, ``verifiers.v1``) rollouts as turnrl records, and turnrl's per-step advantages written
where verifiers' trainers read them.

A verifiers rollout is a ``Trace``: a graph of ``MessageNode`` s (``message``, ``parent``, ``sampled``,
``token_ids`` = the tokens the node adds to the sequence, ``mask`` = True on its sampled tokens,
``logprobs`` and ``advantages`` over the sampled tokens) with ``rewards`` (``trace.reward`` = their
weighted sum) and a ``task`` (``key`` / ``hash``). Each sampled assistant node is one turn:

* its context (``prompt_ids``) = the ``token_ids`` of every node before it on the path plus its own
  unsampled prefix (the generation prompt); its ``action_ids`` = its sampled tokens, ``action_logprobs``
  = ``node.logprobs``; ``observation`` = the text of the messages after it up to the next turn;
* the episode's reward is ``trace.reward``, on its last turn (verifiers scores a rollout, not a step);
  ``group_id`` is the task's ``key`` (else ``hash``): the rollouts of one example form a group;
* with ``anchors=True`` a turn's ``state_key`` is the text of the messages it answered (the
  observation, verl-agent's anchor), so ``gigpo`` groups turns that acted on equal observations.

:func:`assign_advantages` runs any registered estimator on a batch of traces and sets every sampled
node's ``advantages`` to its turn's advantage on each of its sampled tokens (the field
``Branch.advantages`` spreads to a training sample). Objects or their JSON dumps (``trace.model_dump()``)
both work. A trace with several branches (compaction, subagents) is refused: its turns are not one
episode. Trees (``branched``) need turnrl's tree rollouts. docs/integrations.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turnrl.credit import CreditSettings, assign_credit
from turnrl.integrations.credit import settings_from_mapping
from turnrl.records import write_records
from turnrl.types import Episode, StopReason, Turn


def _get(obj: Any, key: str, default: Any = None) -> Any:
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _text(message: Any) -> str:
    content = _get(message, "content", "")
    if isinstance(content, list):  # content parts
        return "".join(str(_get(part, "text", "")) for part in content)
    return "" if content is None else str(content)


def _reward(trace: Any) -> float:
    if not isinstance(trace, dict):
        return float(trace.reward)
    rewards = trace.get("rewards") or {}
    return float(sum(r["score"] * r.get("weight", 1.0) for r in rewards.values() if r is not None))


def _path(nodes: Sequence[Any], where: str) -> list[int]:
    children: dict[int | None, list[int]] = {}
    for i, node in enumerate(nodes):
        children.setdefault(_get(node, "parent"), []).append(i)
    leaves = [i for i in range(len(nodes)) if i not in children]
    if len(leaves) != 1 or len(children.get(None, [])) != 1:
        raise ValueError(
            f"{where}: {len(leaves)} branches; a trace with several (compaction, subagents) is not one episode"
        )
    path, node = [], leaves[0]
    while node is not None:
        path.append(node)
        node = _get(nodes[node], "parent")
    return path[::-1]


def trace_episode(trace: Any, episode_id: str, *, anchors: bool = False) -> tuple[Episode, list[int]]:
    """The episode of one trace, and the node index of each of its turns (module doc)."""
    nodes = list(_get(trace, "nodes") or [])
    task = _get(trace, "task")
    group = str(_get(task, "key") or _get(task, "hash") or _get(task, "type") or "")
    turns: list[Turn] = []
    owners: list[int] = []
    before: list[int] = []
    seen: list[str] = []  # the texts since the previous turn: the observation it answers
    opening = ""
    for i in _path(nodes, f"trace {_get(trace, 'id', episode_id)}"):
        node = nodes[i]
        ids, mask = list(_get(node, "token_ids") or []), list(_get(node, "mask") or [])
        if not (_get(node, "sampled") and any(mask)):
            before += ids
            seen.append(_text(_get(node, "message")))
            continue
        if turns:
            turns[-1].observation = "\n".join(seen)
        else:
            opening = next((t for t in reversed(seen) if t), "")
        cut = mask.index(True)
        if not all(mask[cut:]):
            raise ValueError(f"trace {_get(trace, 'id', episode_id)}: node {i}'s sampled tokens are not one span")
        turns.append(
            Turn(
                index=len(turns),
                prompt_ids=before + ids[:cut],
                action_ids=ids[cut:],
                action_logprobs=[float(x) for x in _get(node, "logprobs") or []],
                action_text=_text(_get(node, "message")),
                policy_version=0,
                state_key=json.dumps(seen) if anchors else None,
                advantage=_turn_advantage(node, i),
            )
        )
        owners.append(i)
        before += ids
        seen = []
    if not turns:
        raise ValueError(f"trace {_get(trace, 'id', episode_id)} has no sampled turn")
    if seen:
        turns[-1].observation = "\n".join(seen)
    reward = _reward(trace)
    turns[-1].reward = reward
    ok = bool(_get(trace, "is_completed", True)) and not _get(trace, "is_timeout", False)
    episode = Episode(
        episode_id,
        group,
        turns,
        reward,
        terminated=ok,
        truncated=not ok,
        stop_reason=None if ok else StopReason.COLLECTOR_LIMIT,
        group_id=group,
        prompt=opening,
    )
    return episode, owners


def _turn_advantage(node: Any, i: int) -> float | None:
    """A node's advantages as one turn's (None when unassigned; they must be one value: credit is per turn)."""
    values = _get(node, "advantages")
    if not values:
        return None
    if len(set(values)) > 1:
        raise ValueError(f"node {i}'s advantages differ between tokens; a turnrl record holds one per turn")
    return float(values[0])


def trace_episodes(traces: Sequence[Any], *, anchors: bool = False) -> tuple[list[Episode], list[list[int]]]:
    """The episodes of a batch of traces (ids ``v0``, ``v1``, ... in order) and each one's turn nodes."""
    pairs = [trace_episode(t, f"v{k}", anchors=anchors) for k, t in enumerate(traces)]
    return [e for e, _ in pairs], [o for _, o in pairs]


def traces_to_records(traces: Sequence[Any], path: str | Path, *, anchors: bool = False) -> Path:
    """Write the traces as a turnrl record file (``source: verifiers``; their advantages where assigned)."""
    return write_records(path, trace_episodes(traces, anchors=anchors)[0], source="verifiers")


def assign_advantages(
    traces: Sequence[Any],
    estimator: str = "stepwise",
    params: dict[str, Any] | None = None,
    *,
    anchors: bool = False,
    settings: CreditSettings | None = None,
) -> dict[str, float]:
    """Run the estimator on the traces and write each sampled node's ``advantages`` (its turn's advantage
    on every sampled token; a turn the estimator leaves untrained gets zeros). Returns its metrics.

    ``settings`` (instead of ``estimator`` and ``params``): a run's own :class:`~turnrl.credit.CreditSettings`,
    made once (``settings_from_mapping``) and passed at every step, so a stateful estimator (the ``critic``)
    learns across steps instead of cross-fitting each batch on itself alone."""
    if settings is None:
        settings = settings_from_mapping({"estimator": estimator, **(params or {})})
    episodes, owners = trace_episodes(traces, anchors=anchors)
    metrics = assign_credit(episodes, settings)
    for trace, ep, nodes_of in zip(traces, episodes, owners, strict=True):
        nodes = _get(trace, "nodes")
        for turn, i in zip(ep.turns, nodes_of, strict=True):
            values = [0.0 if turn.advantage is None else float(turn.advantage)] * len(turn.action_ids)
            if isinstance(nodes[i], dict):
                nodes[i]["advantages"] = values
            else:
                nodes[i].advantages = values
    return metrics
