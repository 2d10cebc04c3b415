"""The exact credit audit (``turnrl credit-audit --exact``): A* by enumerating a finite menu of replies.

(a) a hand-computed toy; (b) agreement with the Monte-Carlo audit within its se, where the sampler draws
from the scorer's distribution; (c) the refusals, as one-line CLI errors; (d) the real scoring path: a
reply's score is the sampler's log-prob of that reply.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from toy_envs import FORK_P_A, FORK_P_X, FORK_REWARD, ForkEnv, fork_policy
from turnrl.audit import Rollouts, default_arms, ground_truth, sample_episodes
from turnrl.audit.exact import ExactAuditError, exact_ground_truth, model_scorer, tree_size
from turnrl.audit.run import AuditSettings, run_audit
from turnrl.chat import ChatTemplate
from turnrl.envs import Env, StepResult, StopReason, Task, register_env
from turnrl.rollout.settings import RolloutSettings
from turnrl.sampling.scripted import ScriptedSampler
from turnrl.types import SamplingParams

# ---- (a) the hand-computed toy: two turns, 2 then 2 or 3 choices, a malformed branch on each

DUO_P1 = {"L": 0.5, "R": 0.3}  # turn 1; π(malformed) = 0.2
DUO_P2 = {"L": {"x": 0.6, "y": 0.4}, "R": {"x": 0.1, "y": 0.2, "z": 0.5}}  # turn 2; after R π(malformed) = 0.2
DUO_R1 = {"L": 0.0, "R": 0.5, None: -1.0}  # turn-1 rewards; a malformed first reply ends the episode at −1
DUO_R2 = {"L": {"x": 1.0, "y": 0.0, None: -0.5}, "R": {"x": 0.0, "y": 2.0, "z": 1.0, None: -0.5}}


class DuoEnv(Env):
    """Pick L or R (reward DUO_R1), then one of the offered letters (DUO_R2); anything else is malformed."""

    name = "duo"
    max_turns = 2
    failure_reward = -1.0

    def __init__(self, task: Task, **options) -> None:
        super().__init__(task, **options)
        self.first: str | None = None

    @classmethod
    def default_tasks(cls, split: str, **options) -> list[Task]:
        return [Task(f"duo-{split}-0", "duo", {}, split)]

    def initial_messages(self):
        return [{"role": "user", "content": "Pick L or R."}]

    def action_choices(self) -> list[str]:
        return ["L", "R"] if self.first is None else list(DUO_P2[self.first])

    def step(self, action_text: str) -> StepResult:
        if self.first is None:
            if action_text not in ("L", "R"):
                return StepResult([], DUO_R1[None], terminated=True, stop_reason=StopReason.MALFORMED)
            self.first = action_text
            letters = " or ".join(DUO_P2[action_text])
            reply = [{"role": "user", "content": f"After {action_text}: pick {letters}."}]
            return StepResult(reply, DUO_R1[action_text])
        key = action_text if action_text in DUO_P2[self.first] else None
        return StepResult([], DUO_R2[self.first][key], terminated=True, stop_reason=StopReason.SUCCESS)


def _menu_state(messages) -> str | None:
    """None at the first turn, else the first choice (read from the last user message)."""
    last = str(messages[-1]["content"])
    return None if last.startswith("Pick") else last.split(":")[0].removeprefix("After ")


def table_scorer(chat: ChatTemplate, table):
    """A fake policy's log-probs: ``table(messages) -> {choice: π}``; the reply ``choice + <|im_end|>`` (the
    canonical end of turn) gets log π, any other reply −inf."""

    def score(context, messages, replies):
        probs = table(messages)
        by_ids = {tuple(chat.encode_reply(c)): p for c, p in probs.items()}
        return [float(np.log(by_ids[tuple(r)])) if tuple(r) in by_ids else -np.inf for r in replies]

    return score


def _duo_table(messages):
    first = _menu_state(messages)
    return DUO_P1 if first is None else DUO_P2[first]


def _fixed(*replies: str):
    def policy(messages) -> str:
        return replies[0] if _menu_state(messages) is None else replies[1]

    return policy


@pytest.fixture(autouse=True)
def _envs():
    register_env("duo", DuoEnv)
    register_env("fork", ForkEnv)
    register_env("menu_fork", MenuForkEnv)


def _duo_episodes(tokenizer, plays):
    tasks, episodes = [], []
    for play in plays:
        r = Rollouts(ScriptedSampler(_fixed(*play), tokenizer), ChatTemplate(tokenizer), SamplingParams(max_tokens=4))
        t, (ep,) = sample_episodes(DuoEnv.default_tasks("train"), 1, r)
        tasks += t
        episodes.append(ep)
    return tasks, episodes, r


def test_exact_a_star_of_the_hand_computed_toy(tokenizer):
    """γ = 1. V(L) = 0.6·1 + 0.4·0 = 0.6; V(R) = 0.1·0 + 0.2·2 + 0.5·1 + 0.2·(−0.5) = 0.8.
    Q(s0, L) = 0 + 0.6 = 0.6, Q(s0, R) = 0.5 + 0.8 = 1.3, Q(s0, malformed) = −1 (ends);
    V0 = 0.5·0.6 + 0.3·1.3 + 0.2·(−1) = 0.49.
    (R, y): A*_1 = 1.3 − 0.49 = 0.81, A*_2 = 2 − 0.8 = 1.2;   (L, x): A*_1 = 0.11, A*_2 = 1 − 0.6 = 0.4;
    (R, "w" malformed): A*_1 = 0.81, A*_2 = −0.5 − 0.8 = −1.3;   ("?" malformed, one turn): A*_1 = −1 − 0.49 = −1.49.
    """
    tasks, episodes, rollouts = _duo_episodes(tokenizer, [("R", "y"), ("L", "x"), ("R", "w"), ("?", "x")])
    scorer = table_scorer(rollouts.chat, _duo_table)
    truth, stats = exact_ground_truth(tasks, episodes, rollouts, scorer)
    assert truth.episode.tolist() == [0, 0, 1, 1, 2, 2, 3] and truth.turn.tolist() == [0, 1, 0, 1, 0, 1, 0]
    assert truth.a_star == pytest.approx([0.81, 1.2, 0.11, 0.4, 0.81, -1.3, -1.49])
    assert truth.v == pytest.approx([0.49, 0.8, 0.49, 0.6, 0.49, 0.8, 0.49])
    assert truth.q == pytest.approx([1.3, 2.0, 0.6, 1.0, 1.3, -0.5, -1.0])
    assert np.all(truth.se == 0)
    # three states scored (the root, after L, after R: a malformed first reply ends the episode), each once
    assert stats["states_scored"] == 3 and stats["on_tree_frac"] == 1.0
    assert stats["malformed_mass_max"] == pytest.approx(0.2) and stats["approx_mass_max"] == 0.0


class GoOnDuoEnv(DuoEnv):
    """:class:`DuoEnv` where a malformed first reply costs −1 and the episode goes on as after L."""

    name = "go_on_duo"

    def step(self, action_text: str) -> StepResult:
        if self.first is None and action_text not in ("L", "R"):
            self.first = "L"
            return StepResult([{"role": "user", "content": "After L: pick x or y."}], DUO_R1[None])
        return super().step(action_text)


def test_a_malformed_reply_that_continues_is_flagged_approximate(tokenizer):
    """Q(s0, mal) = −1 + V(after the empty reply) = −1 + 0.6 = −0.4, so V0 = 0.3 + 0.39 + 0.2·(−0.4) = 0.61;
    W(s0) = π(mal) = 0.2 (the later turn sees the malformed text: enumerated from the empty reply's context),
    W = 0 after L and after R (their malformed replies end the episode)."""
    register_env("go_on_duo", GoOnDuoEnv)
    task = Task("g", "go_on_duo", {}, "train")
    rollouts = Rollouts(ScriptedSampler(_fixed("R", "y"), tokenizer), ChatTemplate(tokenizer), SamplingParams())
    (ep,) = rollouts([task], [1], "g")
    truth, stats = exact_ground_truth([task], [ep], rollouts, table_scorer(rollouts.chat, _duo_table))
    assert truth.v == pytest.approx([0.61, 0.8])
    assert stats["approx_mass_max"] == pytest.approx(0.2) and stats["approx_mass_mean"] == pytest.approx(0.1)
    assert stats["states_scored"] == 4  # the root, after L, after R, after the empty malformed reply
    assert tree_size(task, RolloutSettings(), 10) == 4


def test_exact_a_star_discounted(tokenizer):
    """γ = 0.5: Q(s0, L) = 0 + 0.5·0.6 = 0.3, Q(s0, R) = 0.5 + 0.5·0.8 = 0.9, V0 = 0.15 + 0.27 − 0.2 = 0.22;
    (R, y): A*_1 = 0.68, A*_2 = 1.2 (the last turn is undiscounted)."""
    tasks, episodes, rollouts = _duo_episodes(tokenizer, [("R", "y")])
    truth, _ = exact_ground_truth(tasks, episodes, rollouts, table_scorer(rollouts.chat, _duo_table), gamma=0.5)
    assert truth.a_star == pytest.approx([0.68, 1.2])


def test_the_tree_bound_and_the_horizon(tokenizer):
    settings = RolloutSettings()
    task = DuoEnv.default_tasks("train")[0]
    assert tree_size(task, settings, 10) == 3  # root + after L + after R (the malformed first reply ends)
    with pytest.raises(ExactAuditError, match="more than --max-nodes 2"):
        tree_size(task, settings, 2)
    tasks, episodes, rollouts = _duo_episodes(tokenizer, [("R", "y")])
    with pytest.raises(ExactAuditError, match="passed --max-nodes 2"):
        exact_ground_truth(tasks, episodes, rollouts, table_scorer(rollouts.chat, _duo_table), max_nodes=2)
    # a collector horizon of one turn: the tree is the root alone, Q(s0, a) = r(a) → V0 = 0.3·0.5 + 0.2·(−1)
    rollouts.settings = RolloutSettings(max_turns=1)
    (ep,) = rollouts(tasks, [1], "h")
    truth, stats = exact_ground_truth(tasks, [ep], rollouts, table_scorer(rollouts.chat, _duo_table))
    assert tree_size(task, rollouts.settings, 10) == 1 and stats["states_scored"] == 1
    assert truth.v == pytest.approx([-0.05]) and truth.q == pytest.approx([0.5])


def test_what_the_exact_tree_does_not_model_is_refused(tokenizer):
    tasks, episodes, rollouts = _duo_episodes(tokenizer, [("R", "y")])
    scorer = table_scorer(rollouts.chat, _duo_table)
    for params, needle in (
        (SamplingParams(temperature=0.0, max_tokens=4), "temperature is 0"),
        (SamplingParams(top_p=0.9, max_tokens=4), "top_p"),
        (SamplingParams(max_tokens=1), "over sampler.max_tokens 1"),
    ):
        rollouts.params = params
        with pytest.raises(ExactAuditError, match=needle):
            exact_ground_truth(tasks, episodes, rollouts, scorer)
    rollouts.params = SamplingParams(max_tokens=4)
    rollouts.settings = RolloutSettings(shaping_gamma=1.0)
    with pytest.raises(ExactAuditError, match="shaping"):
        exact_ground_truth(tasks, episodes, rollouts, scorer)
    rollouts.settings = RolloutSettings(max_context_tokens=len(episodes[0].turns[1].prompt_ids) + 2)
    with pytest.raises(ExactAuditError, match="rollout.max_context_tokens"):
        exact_ground_truth(tasks, episodes, rollouts, scorer)


# ---- (b) agreement with the Monte-Carlo audit: the fork toy with a menu, the sampler drawing from π


class MenuForkEnv(ForkEnv):
    """:class:`ForkEnv` with its menus declared (a reply outside them counts as b, then y: deterministic)."""

    name = "menu_fork"

    @classmethod
    def default_tasks(cls, split: str, **options) -> list[Task]:
        return [Task(f"menu-fork-{split}-0", "menu_fork", {}, split)]

    def action_choices(self) -> list[str]:
        return ["a", "b"] if self.first is None else ["x", "y"]


def _fork_table(messages):
    last = str(messages[-1]["content"])
    if last.startswith("Pick a or b"):
        return {"a": FORK_P_A, "b": 1 - FORK_P_A}
    first = "a" if "picked a" in last else "b"
    return {"x": FORK_P_X[first], "y": 1 - FORK_P_X[first]}


def _fork_rollouts(tokenizer, seed: int) -> Rollouts:
    sampler = ScriptedSampler(fork_policy(seed), tokenizer)
    return Rollouts(sampler, ChatTemplate(tokenizer), SamplingParams(max_tokens=4))


def test_exact_agrees_with_monte_carlo_within_its_se(tokenizer):
    """The scripted sampler draws from π = the scorer's table, so the MC A* is an unbiased estimate of the
    exact one; exact A* is also the hand enumeration Q(a) = 0.7, Q(b) = 1.5, V0 = 1.02 (tests/test_audit.py)."""
    rollouts = _fork_rollouts(tokenizer, 3)
    tasks, audited = sample_episodes(MenuForkEnv.default_tasks("train"), 16, rollouts)
    mc = ground_truth(tasks, audited, rollouts, m=200)
    exact, stats = exact_ground_truth(tasks, audited, rollouts, table_scorer(rollouts.chat, _fork_table))
    q1 = {"a": 0.7, "b": 1.5}
    hand = []
    for ep in audited:
        c1, c2 = ep.turns[0].action_text, ep.turns[1].action_text
        hand += [q1[c1] - 1.02, FORK_REWARD[(c1, c2)] - q1[c1]]
    assert exact.a_star == pytest.approx(hand)
    z = (mc.a_star - exact.a_star) / mc.se
    assert np.all(np.abs(z) < 4), z
    assert np.mean(np.abs(z) < 2) >= 0.75, z
    assert stats["states_scored"] == 3 and stats["malformed_mass_max"] < 1e-9


def test_the_estimator_stage_runs_unchanged_on_exact_a_star(tokenizer):
    rollouts = _fork_rollouts(tokenizer, 6)
    settings = AuditSettings(episodes=6, leaves=4, repeats=3, exact=True)
    arms = default_arms(settings.leaves)
    scorer = table_scorer(rollouts.chat, _fork_table)
    report = run_audit(rollouts, MenuForkEnv.default_tasks("train"), settings, arms, scorer=scorer)
    gt = report["ground_truth"]
    assert gt["method"] == "exact" and gt["mean_se"] == 0.0 and gt["exact"]["states_scored"] == 3
    assert len(gt["turns"]) == 12 and set(report["estimators"]) == {a.label for a in arms}
    gm = report["estimators"]["group_mean/none"]["1"]
    assert gm["n_turns"] == 6 and np.isfinite(gm["corr"]) and gm["sign_n"] == 6  # se = 0: every A* ≠ 0 resolved
    # the Monte-Carlo stage sampled nothing: only the audited episodes and the estimators' batches
    assert report["cost"]["ground_truth"]["episodes"] == 6
    with pytest.raises(ValueError, match="needs a scorer"):
        run_audit(rollouts, MenuForkEnv.default_tasks("train"), settings, arms)


# ---- (c) the refusals, as one-line CLI errors (before any model loads)


def _config(tmp_path, env: str, **extra) -> str:
    data = {"model": {"name": "tiny"}, "env": {"name": env}, "sampler": {"max_tokens": 4}, **extra}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _fails(args, *needles):
    result = CliRunner().invoke(app_(), args)
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out, result.exception)
    assert out.startswith("error:") and out.count("error:") == 1 and "Traceback" not in out, out
    for needle in needles:
        assert needle in " ".join(out.split()), (needle, out)


def app_():
    from turnrl.cli import app

    return app


def test_cli_refuses_an_environment_without_a_menu(tmp_path, monkeypatch):
    import turnrl.train.standalone as standalone

    monkeypatch.setattr(standalone, "load_model", _no_model)
    _fails(["credit-audit", _config(tmp_path, "fork"), "--exact"], "declares no finite action set", "drop --exact")


def test_cli_refuses_a_tree_over_the_bound(tmp_path, monkeypatch):
    import turnrl.train.standalone as standalone

    monkeypatch.setattr(standalone, "load_model", _no_model)
    _fails(["credit-audit", _config(tmp_path, "duo"), "--exact", "--max-nodes", "2"], "more than --max-nodes 2")
    _fails(["credit-audit", _config(tmp_path, "duo"), "--exact", "--scripted", "x"], "scripted policy")
    _fails(["credit-audit", _config(tmp_path, "duo", sampler={"max_tokens": 4, "top_p": 0.5}), "--exact"], "top_p")
    bf16 = {"max_tokens": 4, "decode_dtype": "bfloat16"}  # samples from another distribution
    _fails(["credit-audit", _config(tmp_path, "duo", sampler=bf16), "--exact"], "decode_dtype is not float32")


def test_cli_bounds_of_max_nodes(tmp_path, monkeypatch):
    from turnrl.audit.exact import DEFAULT_MAX_NODES, MAX_EXACT_NODES

    monkeypatch.chdir(tmp_path)  # no config exists: the option is refused before it is read
    _fails(["credit-audit", "cfg.yaml", "--exact", "--max-nodes", "0"], "--max-nodes")
    _fails(["credit-audit", "cfg.yaml", "--exact", "--max-nodes", str(MAX_EXACT_NODES + 1)], "--max-nodes")
    text = " ".join(CliRunner().invoke(app_(), ["credit-audit", "--help"], terminal_width=200).output.split())
    assert f"1..{MAX_EXACT_NODES:,}" in text and f"default: {DEFAULT_MAX_NODES}" in text, text


def _no_model(*args, **kwargs):
    raise AssertionError("the model loaded before the refusal")


def test_cli_exact_end_to_end_with_the_tiny_model(tmp_path):
    """The tiny random model puts almost no mass on the menu: A* is mostly the malformed branch's, but
    every number is the enumeration's (V0 = Σ π(a) Q(a) + π(mal) Q(mal), checked from the report)."""
    out = tmp_path / "audit"
    args = ["credit-audit", _config(tmp_path, "duo"), "--exact", "--episodes", "2", "--leaves", "2"]
    result = CliRunner().invoke(app_(), [*args, "--repeats", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "credit_audit.json").read_text())
    gt = report["ground_truth"]
    assert gt["method"] == "exact" and report["settings"]["exact"] and gt["mean_se"] == 0.0
    assert 0.9 < gt["exact"]["malformed_mass_mean"] <= 1.0
    assert "exact A*" in result.output
    first = [t for t in gt["turns"] if t["turn"] == 0]
    assert all(t["v"] == pytest.approx(first[0]["v"]) for t in first)  # one root, one V0
    assert -1.0 <= first[0]["v"] < -0.5  # mostly the malformed first reply's −1


# ---- (d) the real scoring path: a reply's score is the sampler's log-prob of it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_reply_scores_its_sampler_log_prob(tokenizer, tiny_model, temperature):
    from turnrl.sampling.hf import HFSampler

    chat = ChatTemplate(tokenizer)
    context = chat.initial([{"role": "user", "content": "Pick L or R."}])
    params = SamplingParams(temperature=temperature, max_tokens=6, seed=random.Random(0).randrange(1000))
    samples = HFSampler(tiny_model, tokenizer).sample([context] * 3, params)
    score = model_scorer(tiny_model, chat, temperature)
    got = score(context, [], [s.ids for s in samples])
    assert got == pytest.approx([sum(s.logprobs) for s in samples], abs=1e-3)
    # a choice's tokens are a sampled reply's: its canonical encoding closed by <|im_end|>, decoding to it
    assert chat.decode(chat.encode_reply("L")) == "L" and chat.encode_reply("L")[-1] in chat.eot_ids


# ---- the embedded model: exact A* against Monte Carlo on a two-question quiz (slow)

QUIZ = [
    ("Which one is a fruit? A (apple) or B (brick).", "A"),
    ("Which one is an animal? A (table) or B (dog).", "B"),
]


class QuizEnv(Env):
    """Two questions, menu A/B: 1 for the right letter, 0 for the wrong one; any other reply −0.5 and the end."""

    name = "quiz"
    max_turns = 2

    def __init__(self, task: Task, **options) -> None:
        super().__init__(task, **options)
        self.k = 0

    @classmethod
    def default_tasks(cls, split: str, **options) -> list[Task]:
        return [Task(f"quiz-{split}-0", "quiz", {}, split)]

    def initial_messages(self):
        return [
            {"role": "system", "content": "Answer every question with a single letter, A or B, and nothing else."},
            {"role": "user", "content": "Which one is a colour? A (red) or B (spoon)."},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "Which one is a number? A (cat) or B (seven)."},
            {"role": "assistant", "content": "B"},
            {"role": "user", "content": QUIZ[0][0]},
        ]

    def action_choices(self) -> list[str]:
        return ["A", "B"]

    def step(self, action_text: str) -> StepResult:
        right = QUIZ[self.k][1]
        reward = 1.0 if action_text == right else (0.0 if action_text in ("A", "B") else -0.5)
        self.k += 1
        if self.k == len(QUIZ) or reward < 0:
            return StepResult([], reward, terminated=True, stop_reason=StopReason.SUCCESS)
        return StepResult([{"role": "user", "content": QUIZ[self.k][0]}], reward)


@pytest.mark.slow
def test_embedded_model_exact_agrees_with_monte_carlo(report_line):
    """The sampler draws from the distribution the scorer enumerates (a malformed reply ends the episode, so
    W = 0). Measured: 6 episodes, 11 turns with se > 0, max |z| 1.13 (19 s); with 8 episodes 15 of 15 within
    2 se; π(A), π(B) at the root 0.125, 0.704 exact against 0.112, 0.716 in 1,024 samples (docs/algorithms.md)."""
    from turnrl.config import ModelConfig
    from turnrl.models import load_model
    from turnrl.sampling.hf import HFSampler

    register_env("quiz", QuizEnv)
    model, tok = load_model(ModelConfig(name="embedded"))
    chat = ChatTemplate(tok)
    rollouts = Rollouts(HFSampler(model, tok), chat, SamplingParams(temperature=1.0, max_tokens=8, seed=1))
    tasks, audited = sample_episodes(QuizEnv.default_tasks("train"), 6, rollouts)
    exact, stats = exact_ground_truth(tasks, audited, rollouts, model_scorer(model, chat, 1.0))
    mc = ground_truth(tasks, audited, rollouts, m=64)
    assert stats["approx_mass_max"] == 0.0 and 0.05 < stats["malformed_mass_mean"] < 0.5, stats
    resolved = mc.se > 0  # a turn whose every continuation returned the same is compared exactly
    z = (mc.a_star - exact.a_star)[resolved] / mc.se[resolved]
    assert np.all(np.abs(z) < 3.5) and np.mean(np.abs(z) < 2) >= 0.75, z
    assert np.all(np.abs(mc.a_star - exact.a_star)[~resolved] < 0.05)
    report_line(f"exact vs MC audit, embedded model, quiz: {z.size} turns, max |z| {np.abs(z).max():.2f}")
