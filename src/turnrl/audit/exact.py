"""Exact ground truth A* (``turnrl credit-audit --exact``): the policy's probability of every reply of a
finite menu, then dynamic programming over the episode tree.

Where the environment declares the replies a turn can give (:meth:`Env.action_choices`), a state s
has finitely many children: one per choice a, and one *malformed* branch for every other reply (the
environment treats them all alike, with a deterministic outcome). Scoring each choice with the
policy's model gives π(a|s); the rest of the mass is the malformed branch's. Then, with r(s, a) the
turn's reward, s' the next state and γ the audit's discount,

    π(a|s)       = Σ_{e ∈ end-of-turn ids} exp log π(tokens(a) + e | context(s))        (the model at the sampler's T)
    π(mal|s)     = 1 − Σ_a π(a|s)
    Q(s, a)      = r(s, a) + γ V(s')        (r(s, a) alone where the episode ends after a)
    V(s)         = Σ_a π(a|s) Q(s, a) + π(mal|s) Q(s, mal)
    A*_k         = Q(s_k, a_k) − V(s_k),     se_k = 0

for the turns k of each audited episode, with s_k the state it acted from (its recorded context,
the environment stepped through its recorded replies) and Q(s_k, a_k) = r_k + γ V(s_{k+1}) (r_k on
the last turn), as in the Monte-Carlo audit (:func:`turnrl.audit.core.ground_truth`).

A choice's tokens are those of a sampled reply that says it: the text's canonical encoding closed
by an end-of-turn token (:meth:`ChatTemplate.encode_reply`); every end-of-turn id the sampler
stops at is summed, and the next context is the collector's (:meth:`ChatTemplate.extend` of the
canonical tokens). Non-canonical tokenisations of a choice (other token splits of the same text)
are not enumerated: their mass, negligible for a trained model, is counted in the malformed branch.
The malformed branch is stepped with the empty reply (the end-of-turn token alone). Where it ends
the episode (or the environment's outcome does not depend on the reply's text and nothing follows),
its value is exact. Where the episode continues after it, the policy's later turns see the malformed
text itself, which differs from reply to reply: the subtree is enumerated from the empty reply's
context, an approximation. The DP carries how much mass that concerns,

    W(s) = Σ_a π(a|s) W(s'_a) + π(mal|s) · [the episode continues after a malformed reply]

(W = 0 at an end), so V(s) is exact where W(s) = 0 and off by at most W(s)·(G_max − G_min)
otherwise; the report gives W at the audited states. A malformed branch of mass ≤
:data:`NEGLIGIBLE` is dropped.

Limits: the sampler's temperature T > 0 and ``top_p`` = 1 (the scored distribution is the sampled
one: log-softmax of logits / T, as the trainer's forward and the sampler's log-probs); no reward
shaping, truncation reward or group reward; a tree of at most ``max_nodes`` states where the policy
acts (per task, checked before the model loads); replies never cut by ``rollout.max_context_tokens``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from turnrl.audit.core import GroundTruth, Rollouts
from turnrl.chat import ChatTemplate
from turnrl.envs import Env, get_env_class, make_env
from turnrl.rollout.concurrent import run_concurrently
from turnrl.rollout.guard import guarded_step
from turnrl.rollout.settings import RolloutSettings
from turnrl.types import Episode, Message, SamplingParams, StepResult, Task

DEFAULT_MAX_NODES = 1000
"""``--max-nodes``: states where the policy acts in one task's tree (each one scoring call)."""
MAX_EXACT_NODES = 100_000
"""The most ``--max-nodes`` allows."""
NEGLIGIBLE = 1e-9
"""A malformed branch of at most this mass is dropped (its value is not enumerated)."""
_FIX = "drop --exact for the Monte-Carlo audit"


class ExactAuditError(ValueError):
    """The exact audit cannot be had here (one line: what, where, and the fix)."""


class Scorer(Protocol):
    """log π(reply | context) for each reply (token ids, end-of-turn included) of one state."""

    def __call__(self, context: list[int], messages: list[Message], replies: list[list[int]]) -> list[float]: ...


def model_scorer(model: Any, chat: ChatTemplate, temperature: float) -> Scorer:
    """The trainer's scoring forward (:func:`turnrl.train.actions.sequence_logprobs`) on the sampler's
    model, at the sampler's temperature, in eval mode (as the sampler generates)."""
    from turnrl.train.actions import sequence_logprobs

    def score(context: list[int], messages: list[Message], replies: list[list[int]]) -> list[float]:
        was_training = model.training
        model.eval()
        try:
            return sequence_logprobs(model, context, replies, pad_id=chat.pad_id, temperature=temperature)
        finally:
            model.train(was_training)

    return score


def policy_scorer(sampler: Any, chat: ChatTemplate, params: SamplingParams) -> Scorer:
    """The scorer of a sampler's policy: its local model (``sampler.model``), or one clear error."""
    model = getattr(sampler, "model", None)
    if model is None:
        raise ExactAuditError(
            f"--exact scores each choice with the policy's local model; the {type(sampler).__name__} sampler"
            f" has none (use sampler.backend: hf, or {_FIX})"
        )
    return model_scorer(model, chat, params.temperature)


def check_sampling(params: SamplingParams, settings: RolloutSettings) -> None:
    """Refuse what the exact tree does not model: a greedy or truncated sampling distribution, and
    reward changes that are not one turn's own (shaping, the truncation reward)."""
    if params.temperature <= 0:
        raise ExactAuditError(
            "--exact: sampler.temperature is 0 (greedy): the policy is deterministic and A* is 0 on its own turns;"
            f" set sampler.temperature > 0 or {_FIX}"
        )
    if params.top_p < 1:
        raise ExactAuditError(
            f"--exact scores the full distribution at temperature T; sampler.top_p {params.top_p} samples a"
            f" truncated one: set sampler.top_p: 1 or {_FIX}"
        )
    if settings.shaping_gamma is not None or settings.truncated_reward is not None:
        raise ExactAuditError(
            f"--exact models each turn's own reward: turn off rollout.shaping and the truncation reward, or {_FIX}"
        )


def _malformed_reply(choices: Sequence[str]) -> str:
    """The text standing for every reply outside the menu: the empty reply, else a '?' run not offered."""
    text = ""
    while text in choices:
        text += "?"
    return text


def _one(call: Any) -> Any:
    return run_concurrently([call], None)[0]


@dataclass
class _State:
    """A state where the policy acts: its environment (never stepped itself), conversation, context."""

    task: Task
    env: Env
    messages: list[Message]
    context: list[int] | None
    """None in the counting pass (no tokenizer)."""
    texts: tuple[str, ...]
    turns: int


def _choices(state: _State) -> list[str]:
    choices = state.env.action_choices()
    if choices is None:
        raise ExactAuditError(
            f"environment {type(state.env).name!r} declares no finite action set at turn {state.turns + 1} of task"
            f" {state.task.task_id!r} (Env.action_choices() is None); --exact needs one: {_FIX}"
        )
    return list(dict.fromkeys(str(c) for c in choices))


def _children(state: _State, texts: list[str]) -> list[tuple[Env, StepResult]]:
    """Each reply text stepped on its own deep copy of the state's environment (guarded as the collector does)."""
    envs = [copy.deepcopy(state.env) for _ in texts]
    results = run_concurrently([guarded_step(e, t) for e, t in zip(envs, texts, strict=True)], None)
    return list(zip(envs, results, strict=True))


def _ends(state: _State, result: StepResult, settings: RolloutSettings) -> bool:
    return result.done or (settings.max_turns is not None and state.turns + 1 >= settings.max_turns)


def _root(task: Task, settings: RolloutSettings) -> tuple[Env, list[Message]]:
    env = make_env(task, **settings.env_options)
    return env, list(_one(env.initial_messages))


def _refuse_group_rewards(task: Task) -> None:
    cls = get_env_class(task.env)
    if getattr(cls.group_rewards, "__func__", None) is not getattr(Env.group_rewards, "__func__", None):
        raise ExactAuditError(
            f"environment {cls.name!r} gives group rewards (Env.group_rewards): an episode's return depends on"
            f" the other episodes of its group, which the exact tree does not enumerate; {_FIX}"
        )


def tree_size(task: Task, settings: RolloutSettings, max_nodes: int) -> int:
    """The states where the policy acts in ``task``'s tree (every choice and the malformed reply expanded),
    counted without a model; one error past ``max_nodes`` or where a state offers no finite menu."""
    _refuse_group_rewards(task)
    env, messages = _root(task, settings)
    stack = [_State(task, env, messages, None, (), 0)]
    nodes = 0
    while stack:
        state = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ExactAuditError(
                f"--exact: the episode tree of task {state.task.task_id!r} has more than --max-nodes {max_nodes:,}"
                f" states where the policy acts; raise --max-nodes (at most {MAX_EXACT_NODES:,}), audit fewer turns"
                f" (rollout.max_turns), or {_FIX}"
            )
        choices = _choices(state)
        texts = [*choices, _malformed_reply(choices)]
        for text, (child, result) in zip(texts, _children(state, texts), strict=True):
            if not _ends(state, result, settings):
                msgs = [*state.messages, result.assistant_message or {"role": "assistant", "content": text}]
                stack.append(_State(task, child, msgs + result.messages, None, (*state.texts, text), state.turns + 1))
    return nodes


def check_trees(tasks: Sequence[Task], settings: RolloutSettings, max_nodes: int) -> dict[str, int]:
    """:func:`tree_size` of each distinct task (before any model loads): ``{task_id: states}``."""
    out: dict[str, int] = {}
    for task in tasks:
        if task.task_id not in out:
            out[task.task_id] = tree_size(task, settings, max_nodes)
    return out


@dataclass
class ExactTree:
    """Values of states by dynamic programming, memoised by (task, replies so far, context)."""

    scorer: Scorer
    chat: ChatTemplate
    params: SamplingParams
    settings: RolloutSettings
    max_nodes: int = DEFAULT_MAX_NODES
    gamma: float = 1.0
    memo: dict[tuple, float] = field(default_factory=dict)
    malformed: dict[tuple, float] = field(default_factory=dict)
    """π(mal|s) of each scored state."""
    approx: dict[tuple, float] = field(default_factory=dict)
    """W(s) of each scored state: the probability, from s, of passing a malformed reply after which the
    episode continues (the subtree is enumerated from the representative reply's context: approximate)."""
    replies_scored: int = 0
    context_tokens: int = 0
    _budget: int = 0

    def _key(self, state: _State) -> tuple:
        return (state.task.task_id, state.texts, tuple(state.context or ()))

    def value(self, state: _State) -> float:
        """V(state), scoring at most ``max_nodes`` new states (one error past it)."""
        self._budget = self.max_nodes
        return self._value(state)

    def _probabilities(self, state: _State, choices: list[str]) -> tuple[list[list[int]], list[float]]:
        """Each choice's canonical reply tokens and π(choice|s) (summed over the end-of-turn ids)."""
        assert state.context is not None
        limit = self.settings.max_context_tokens
        if limit is not None and len(state.context) + self.params.max_tokens > limit:
            raise ExactAuditError(
                f"--exact: at turn {state.turns + 1} of task {state.task.task_id!r} the context ({len(state.context):,}"
                f" tokens) plus sampler.max_tokens {self.params.max_tokens} passes rollout.max_context_tokens"
                f" {limit:,}, where replies may be cut (not modelled); raise the limit, or {_FIX}"
            )
        canonical = [list(self.chat.encode_reply(c)) for c in choices]
        for c, ids in zip(choices, canonical, strict=True):
            if len(ids) > self.params.max_tokens:
                raise ExactAuditError(
                    f"--exact: choice {c[:40]!r} of task {state.task.task_id!r} is {len(ids)} tokens with its end of"
                    f" turn, over sampler.max_tokens {self.params.max_tokens}; raise sampler.max_tokens"
                )
        if len({tuple(ids) for ids in canonical}) < len(canonical):
            raise ExactAuditError(f"--exact: two choices of task {state.task.task_id!r} encode to the same tokens")
        eots = list(self.chat.eot_ids)
        replies = [ids[:-1] + [e] for ids in canonical for e in eots]
        logps = self.scorer(state.context, state.messages, replies)
        self.replies_scored += len(replies)
        self.context_tokens += len(state.context) * len(replies)
        n = len(eots)
        probs = [sum(math.exp(lp) for lp in logps[i * n : (i + 1) * n]) for i in range(len(choices))]
        if sum(probs) > 1 + 1e-6:
            raise ExactAuditError(f"--exact: the scorer's probabilities of the choices sum to {sum(probs):.6f} > 1")
        return canonical, probs

    def _value(self, state: _State) -> float:
        key = self._key(state)
        if key in self.memo:
            return self.memo[key]
        self._budget -= 1
        if self._budget < 0:
            raise ExactAuditError(
                f"--exact: scoring the tree of task {state.task.task_id!r} passed --max-nodes {self.max_nodes:,}"
                f" states; raise --max-nodes (at most {MAX_EXACT_NODES:,}) or {_FIX}"
            )
        choices = _choices(state)
        canonical, probs = self._probabilities(state, choices)
        p_mal = max(0.0, 1.0 - sum(probs))
        # (π, reply tokens, text the environment sees, malformed?) of each branch
        branches = [(p, ids, self.chat.decode(ids), False) for p, ids in zip(probs, canonical, strict=True) if p > 0]
        if p_mal > NEGLIGIBLE:
            rep = _malformed_reply(choices)
            branches.append((p_mal, list(self.chat.encode_reply(rep)), rep, True))
        stepped = _children(state, [text for _, _, text, _ in branches])
        tools = state.env.tools()
        v = w = 0.0
        for (p, ids, text, malformed), (child, result) in zip(branches, stepped, strict=True):
            q, w_next, continues = self._q(state, ids, text, child, result, tools)
            v += p * q
            # W(s): the mass whose value passes a malformed reply after which the episode continues
            w += p * (float(continues) if malformed else w_next)
        self.memo[key], self.approx[key], self.malformed[key] = v, w, p_mal
        return v

    def _q(
        self, state: _State, ids: list[int], text: str, child: Env, result: StepResult, tools
    ) -> tuple[float, float, bool]:
        """Q(s, a) = r + γ V(s') (r alone where the episode ends after a), W(s') (0 at an end), whether it continues."""
        r = float(result.reward or 0.0)
        if _ends(state, result, self.settings):
            return r, 0.0, False
        assert state.context is not None
        history = [*state.messages, result.assistant_message or {"role": "assistant", "content": text}]
        context = self.chat.extend(state.context, ids, history, result.messages, tools)
        limit = self.settings.max_context_tokens
        if limit is not None and len(context) >= limit:  # the collector ends the episode there
            return r, 0.0, False
        nxt = _State(state.task, child, history + result.messages, context, (*state.texts, text), state.turns + 1)
        v = self._value(nxt)
        return r + self.gamma * v, self.approx[self._key(nxt)], True


def _returns_to_go(rewards: list[float], values: list[float], gamma: float) -> list[float]:
    """Q(s_k, a_k) = r_k + γ V(s_{k+1}), r_k on the last turn."""
    return [r + gamma * values[k + 1] if k + 1 < len(rewards) else r for k, r in enumerate(rewards)]


def exact_ground_truth(
    tasks: list[Task],
    episodes: list[Episode],
    rollouts: Rollouts,
    scorer: Scorer,
    max_nodes: int = DEFAULT_MAX_NODES,
    gamma: float = 1.0,
) -> tuple[GroundTruth, dict[str, Any]]:
    """Exact A*_k for every turn of every audited episode (module doc), se = 0, and the enumeration's
    statistics: states and replies scored, the fraction of audited states (k ≥ 1) on the enumerated tree, and
    at the audited states π(mal|s_k) and W(s_k) (module doc; V(s_k) is exact where W = 0, else within
    W·(G_max − G_min))."""
    check_sampling(rollouts.params, rollouts.settings)
    t0 = time.perf_counter()
    tree = ExactTree(scorer, rollouts.chat, rollouts.params, rollouts.settings, max_nodes, gamma)
    rows, on_tree, path_malformed, path_approx = [], [], [], []
    for i, (task, ep) in enumerate(zip(tasks, episodes, strict=True)):
        _refuse_group_rewards(task)
        env, messages = _root(task, rollouts.settings)
        texts: tuple[str, ...] = ()
        values = []
        for k, turn in enumerate(ep.turns):
            state = _State(task, copy.deepcopy(env), list(messages), list(turn.prompt_ids), texts, k)
            if k > 0:
                on_tree.append(tree._key(state) in tree.memo)
            values.append(tree.value(state))
            path_malformed.append(tree.malformed[tree._key(state)])
            path_approx.append(tree.approx[tree._key(state)])
            if k + 1 < ep.num_turns:
                result = _one(guarded_step(env, turn.action_text))
                if result.done:
                    raise ExactAuditError(
                        f"episode {ep.episode_id!r} of task {task.task_id!r}: its recorded reply at turn {k + 1}"
                        " ends the episode when replayed; the environment is not deterministic in its task and replies"
                    )
                assistant = result.assistant_message or {"role": "assistant", "content": turn.action_text}
                messages = [*messages, assistant, *result.messages]
                texts = (*texts, turn.action_text)
        rewards = [float(t.reward or 0.0) for t in ep.turns]
        for k, q in enumerate(_returns_to_go(rewards, values, gamma)):
            rows.append((i, k, q, values[k], q - values[k], 0.0))
    table = np.asarray(rows, dtype=float).reshape(-1, 6)  # episode, turn, Q, V, A*, se
    truth = GroundTruth(
        episode=table[:, 0].astype(int),
        turn=table[:, 1].astype(int),
        q=table[:, 2],
        v=table[:, 3],
        a_star=table[:, 4],
        se=table[:, 5],
        replay_exact_frac=float(np.mean(on_tree)) if on_tree else 1.0,
    )
    stats = {
        "states_scored": len(tree.memo),
        "replies_scored": tree.replies_scored,
        "context_tokens_scored": tree.context_tokens,
        "max_nodes": max_nodes,
        "on_tree_frac": truth.replay_exact_frac,
        "malformed_mass_mean": float(np.mean(path_malformed)) if path_malformed else float("nan"),
        "malformed_mass_max": float(np.max(path_malformed)) if path_malformed else float("nan"),
        "approx_mass_mean": float(np.mean(path_approx)) if path_approx else float("nan"),
        "approx_mass_max": float(np.max(path_approx)) if path_approx else float("nan"),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return truth, stats
