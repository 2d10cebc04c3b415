"""Decisions: hand-checked rewards per timing mode, free and lottery turns, the corridor, parsing,
action_choices / state_key, determinism and deep copies, the shipped task files, scripted policies."""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from turnrl.envs import get_env_class, make_env
from turnrl.envs.decisions import (
    CATEGORIES,
    FILE_NAMES,
    TURN_MENUS,
    WORD_CATEGORY,
    WORD_RULE,
    DecisionsEnv,
    build_tasks,
    choices,
    lottery_payoffs,
    make_tasks,
    oracle_policy,
    parse_choice,
    random_policy,
    shrink,
)
from turnrl.types import StopReason, Task

EVAL = DecisionsEnv.default_tasks("eval")
TASK = EVAL[0]


def _right(env: DecisionsEnv) -> str:
    """The canonical right reply to the decision the env asks next."""
    words, letter = env.items[env.room]
    return choices(words)["ABC".index(letter)]


def _wrong(env: DecisionsEnv) -> str:
    words, letter = env.items[env.room]
    return next(c for c in choices(words) if not c.startswith(letter))


def _rewards(env: DecisionsEnv, replies) -> tuple[list[float], object]:
    env.initial_messages()
    out, result = [], None
    for reply in replies:
        result = env.step(reply(env) if callable(reply) else reply)
        out.append(result.reward)
    return out, result


def test_the_first_task_reads_as_built():
    env = make_env(TASK)
    # eval task 0, decision 0: three options lion, mist, indigo with lion right (A); two options keep lion + mist
    assert TASK.params["decisions"][0] == {"options": ["lion", "mist", "indigo"], "answer": "A"}
    assert env.items[0] == (["lion", "mist"], "A")
    last = env.initial_messages()[-1]["content"]
    assert last == "Now the quiz. Question 1 of 4: Which one is an animal? A) lion B) mist"
    assert env.action_choices() is None  # lenient parsing: off-menu replies are not one outcome
    assert make_env(TASK, strict=True).action_choices() == ["A) lion", "B) mist"]


def test_per_turn_rewards_by_hand():
    env = make_env(TASK, decisions=4)
    rewards, end = _rewards(env, [_right, _wrong, "no idea", _right])
    assert rewards == [0.25, 0.0, 0.0, 0.25]
    assert end.done and end.stop_reason == StopReason.MALFORMED  # not all right, one reply malformed
    assert end.metrics == {"success": 0.0, "decision_accuracy": 0.5, "malformed": 1.0}
    env = make_env(TASK, decisions=4)
    rewards, end = _rewards(env, [_right] * 4)
    assert rewards == [0.25] * 4 and end.stop_reason == StopReason.SUCCESS and end.metrics["success"] == 1.0


def test_terminal_pays_the_same_total_at_the_end():
    env = make_env(TASK, decisions=4, reward="terminal")
    rewards, end = _rewards(env, [_right, _wrong, "no idea", _right])
    assert rewards == [0.0, 0.0, 0.0, 0.5] and end.stop_reason == StopReason.MALFORMED
    env = make_env(TASK, decisions=3, reward="terminal")
    rewards, end = _rewards(env, [_wrong, _wrong, _wrong])
    assert rewards == [0.0, 0.0, 0.0] and end.stop_reason == StopReason.FAILURE


def test_free_turns_carry_no_reward_effect():
    base, _ = _rewards(make_env(TASK, decisions=2), [_right, _wrong])
    for junk in ("A) left", "B) right", "", "anything at all", "<answer>7</answer>"):
        env = make_env(TASK, decisions=2, fillers=2)
        assert env.layout == ["free", "free", "decision"] * 2
        rewards, end = _rewards(env, [junk, junk, _right, junk, junk, _wrong])
        assert rewards == [0.0, 0.0, base[0], 0.0, 0.0, base[1]] == [0.0, 0.0, 0.5, 0.0, 0.0, 0.0]
        assert end.metrics["malformed"] == 0.0  # a free turn's reply is never malformed
    env = make_env(TASK, fillers=1, reward="terminal", decisions=1)
    assert _rewards(env, ["whatever", _right])[0] == [0.0, 1.0]


def test_noisy_prefix_paid_per_turn_or_hidden_in_the_terminal_reward():
    two = lottery_payoffs(TASK.task_id, 0, 0.5, 2)
    assert sorted(two.values()) == [-0.5, 0.5] and set(two) == {"A", "B"}
    assert sorted(lottery_payoffs(TASK.task_id, 1, 0.5, 3).values()) == [-0.5, 0.0, 0.5]
    p0, p1 = lottery_payoffs(TASK.task_id, 0, 0.5, 2)["A"], lottery_payoffs(TASK.task_id, 1, 0.5, 2)["B"]
    env = make_env(TASK, decisions=1, noise_turns=2, noise=0.5)
    assert env.layout == ["lottery", "lottery", "decision"]
    rewards, end = _rewards(env, ["A) left", "B) right", _right])
    assert rewards == [p0, p1, 1.0] and end.stop_reason == StopReason.SUCCESS
    env = make_env(TASK, decisions=1, noise_turns=2, noise=0.5, reward="terminal")
    assert _rewards(env, ["A) left", "B) right", _right])[0] == [0.0, 0.0, p0 + p1 + 1.0]
    env = make_env(TASK, decisions=1, noise_turns=1)  # a malformed lottery reply pays 0, and is told so
    env.initial_messages()
    result = env.step("hmm")
    assert result.reward == 0.0 and "names no option" in result.messages[0]["content"]
    # the payoffs are fixed by task and turn, and differ across tasks (noise, not a learnable rule)
    assert lottery_payoffs("t", 0, 1.0) == lottery_payoffs("t", 0, 1.0)
    assert len({tuple(lottery_payoffs(t.task_id, 0, 1.0).values()) for t in EVAL}) > 1


def test_corridor_walk_by_hand_and_recurring_state_keys():
    env = make_env(TASK, mode="corridor", decisions=3)
    assert env.layout == ["decision"] * 6  # horizon 2·D
    env.initial_messages()
    keys, rewards = [], []
    for reply in (_right, _wrong, _right, _right, _right):
        keys.append(env.state_key())
        result = env.step(reply(env))
        rewards.append(result.reward)
    assert keys == [("room", 0), ("room", 1), ("room", 0), ("room", 1), ("room", 2)]
    assert rewards == pytest.approx([1 / 3, 0.0, 0.0, 1 / 3, 1 / 3])  # room 2 reached again pays nothing
    assert result.done and result.stop_reason == StopReason.SUCCESS and result.metrics["progress"] == 1.0
    env = make_env(TASK, mode="corridor", decisions=3, reward="terminal", horizon=3)
    rewards, end = _rewards(env, [_right, _right, _wrong])
    assert rewards == [0.0, 0.0, pytest.approx(2 / 3)] and end.stop_reason == StopReason.FAILURE
    env = make_env(TASK, mode="corridor", decisions=2)
    env.initial_messages()
    wrong = env.step(_wrong(env))
    assert "back to room 1" in wrong.messages[0]["content"] and "Room 1 of 2" in wrong.messages[0]["content"]


def test_position_rule_fixes_each_decisions_letter_by_its_index():
    from turnrl.envs.decisions import POSITION_KEYS

    for task in EVAL[:3]:
        env = make_env(task, rule="position", decisions=8)
        assert [letter for _, letter in env.items] == list(POSITION_KEYS[2]) == list("BAABABBA")
        assert env.initial_messages()[-1]["content"].startswith("Now the quiz. Question 1 of 8: Guess. A) ")
        rewards, end = _rewards(env, ["B", "A", "A", "B", "A", "B", "B", "A"])
        assert rewards == [0.125] * 8 and end.stop_reason == StopReason.SUCCESS
    assert [x for _, x in make_env(TASK, rule="position", choices=3, decisions=8).items] == list("CABBCAAC")


def test_word_rule_gives_each_decision_its_own_words_and_bare_word_replies():
    """rule: word: decision k offers WORD_RULE[k]'s words in the task's order (the right one, the
    first, at the task's letter), menus and examples carry no letters, a reply counts by the word it
    names (never by a letter), and no word is shared by two decisions or with the category pools."""
    words = [w for triple in WORD_RULE for w in triple]
    assert len(set(words)) == len(words) and not set(words) & set(WORD_CATEGORY)
    env = make_env(TASK, rule="word", decisions=8)
    letters = [shrink(x["options"], x["answer"], 2)[1] for x in TASK.params["decisions"]]
    for k, (menu_words, letter) in enumerate(env.items):
        assert letter == letters[k] and menu_words[" AB".index(letter) - 1] == WORD_RULE[k][0]
        assert sorted(menu_words) == sorted(WORD_RULE[k][:2])
    messages = env.initial_messages()
    assert not any(") " in str(m["content"]) for m in messages[1:])  # no lettered menu or reply
    assert messages[-1]["content"] == f"Now the quiz. Question 1 of 8: Say one word: {' or '.join(env.items[0][0])}."
    first, second = env.items[0][0], env.items[1][0]
    wrong_letter = "A" if env.items[0][1] == "B" else "B"  # the letter of the wrong word: means nothing
    step = env.step(f"{wrong_letter}) {WORD_RULE[0][0].upper()}!")
    assert step.reward == 0.125 and step.messages[0]["content"].endswith(f"{' or '.join(second)}.")
    assert env.step(wrong_letter).reward == 0.0 and env.malformed == 1  # a lone letter names no word
    assert [parse_choice(r, first, words_only=True) for r in (first[1], f"{first[0]} or {first[1]}", "A")] == [
        "B",
        "A",
        None,
    ]
    strict = make_env(TASK, rule="word", strict=True, fillers=1)
    strict.initial_messages()
    assert strict.action_choices() == list(TURN_MENUS[2])  # the free turn's words, bare
    strict.step("left")
    assert strict.action_choices() == strict.items[0][0]
    assert strict.step(f"A) {WORD_RULE[0][0]}").reward == 0.0 and strict.malformed == 1


def test_chain_state_key_is_the_position():
    env = make_env(TASK, decisions=2, fillers=1)
    env.initial_messages()
    keys = []
    for _ in range(4):
        keys.append(env.state_key())
        env.step("B) right")
    assert keys == [("turn", 0), ("turn", 1), ("turn", 2), ("turn", 3)]
    json.dumps(keys)  # the collector records keys as JSON


def test_malformed_replies_get_failure_reward_and_never_raise():
    assert DecisionsEnv.failure_reward == 0.0
    for bad in ("", "zzz", "D) cat", "C", "<answer>1</answer>", "x" * 100_000, None, 42):
        env = make_env(TASK, decisions=2)
        env.initial_messages()
        result = env.step(bad)
        assert result.reward == DecisionsEnv.failure_reward and not result.done
        assert result.messages[0]["content"].startswith("(Your reply names no option of the menu: it counts as wrong.)")
    env = make_env(TASK, decisions=1)
    env.initial_messages()
    env.step("A")
    with pytest.raises(RuntimeError, match="over"):
        env.step("A")


def test_parsing_is_lenient_and_strict_accepts_only_the_menu():
    opts = ["lion", "mist"]
    lenient = [("A", "A"), ("b", "B"), ("(B).", "B"), ("B) mist", "B"), ("A) crowbar", "A"), ("D) lion", "A")]
    lenient += [("The answer is B", "B"), ("answer: A", "A"), ("I pick mist", "B"), ("Lion!", "A")]
    for text, letter in lenient:
        assert parse_choice(text, opts) == letter, text
    for text in ("", "C", "C) tiger", "answer is a dog", "nothing", "D) cat"):
        assert parse_choice(text, opts) is None, text
    assert parse_choice("C) indigo", ["lion", "mist", "indigo"]) == "C"
    assert parse_choice(" B) mist\n", opts, strict=True) == "B"
    for text in ("B", "b) mist", "B) mist.", "mist", "B) lion"):
        assert parse_choice(text, opts, strict=True) is None, text


def test_action_choices_enumerate_the_turn_and_off_menu_replies_share_one_outcome():
    env = make_env(TASK, decisions=2, fillers=1, noise_turns=1, strict=True)
    env.initial_messages()
    assert env.action_choices() == choices(TURN_MENUS[2]) == ["A) left", "B) right"]
    env.step("A) left")
    assert env.action_choices() == ["A) left", "B) right"]  # the free turn
    env.step("B) right")
    menu = env.action_choices()
    assert menu == choices(env.items[0][0])
    outcomes = []
    for reply in menu + ["B", "mist", "totally off the menu"]:
        twin = copy.deepcopy(env)
        r = twin.step(reply)
        outcomes.append((r.reward, r.messages, twin.correct, twin.malformed))
    assert sorted(o[0] for o in outcomes[:2]) == [0.0, 0.5]  # exactly one choice is right
    assert outcomes[2] == outcomes[3] == outcomes[4] and outcomes[2][3] == 1  # one malformed branch
    assert make_env(TASK, choices=3, strict=True).action_choices() == ["A) lion", "B) mist", "C) indigo"]


def test_deterministic_and_deep_copyable_after_turn_one():
    env = make_env(TASK, decisions=4, fillers=1, noise_turns=2)
    first = env.initial_messages()
    assert first == make_env(TASK, decisions=4, fillers=1, noise_turns=2).initial_messages()
    env.step("A) left")
    twin = copy.deepcopy(env)
    replies = ["B) right", "A) left", "A", "x", "B"]
    a = [env.step(r) for r in replies]
    b = [twin.step(r) for r in replies]
    assert a == b
    fresh = make_env(TASK, decisions=4, fillers=1, noise_turns=2)
    fresh.initial_messages()
    fresh.step("A) left")
    assert [fresh.step(r) for r in replies] == a


def test_options_are_checked():
    with pytest.raises(ValueError, match="corridor mode has neither"):
        make_env(TASK, mode="corridor", fillers=1)
    with pytest.raises(ValueError, match="horizon"):
        make_env(TASK, horizon=5)
    with pytest.raises(ValueError, match="decisions"):
        make_env(TASK, decisions=9)
    with pytest.raises(ValueError, match="reward"):
        make_env(TASK, reward="sometimes")
    bad = Task("t", "decisions", {"decisions": [{"options": ["a", "b", "c"], "answer": "D"}] * 8})
    with pytest.raises(ValueError, match=r"decisions\[0\]\.answer"):
        make_env(bad)


def test_shipped_tasks_are_the_builders_and_held_out_words_are_unseen(tmp_path):
    cls = get_env_class("decisions")
    assert cls is DecisionsEnv
    for path in build_tasks(tmp_path):  # the shipped files are byte for byte what the builder writes
        assert path.read_text() == (resources.files("turnrl") / "data" / path.name).read_text()
    assert set(FILE_NAMES.values()) == {p.name for p in tmp_path.iterdir()}
    train, held = cls.default_tasks("train"), cls.default_tasks("eval")
    assert [t.params for t in train] == [t.params for t in make_tasks("train")]
    assert [t.params for t in held] == [t.params for t in make_tasks("eval")]
    words = {
        s: {w for t in ts for d in t.params["decisions"] for w in d["options"]}
        for s, ts in (("train", train), ("eval", held))
    }
    assert not words["train"] & words["eval"]
    for tasks in (train, held):
        for t in tasks:
            for k, d in enumerate(t.params["decisions"]):
                right = d["options"]["ABC".index(d["answer"])]
                assert WORD_CATEGORY[right] == CATEGORIES[k][0]
                assert all(WORD_CATEGORY[w] != CATEGORIES[k][0] for w in d["options"] if w != right)
    letters = [shrink(d["options"], d["answer"], 2)[1] for t in held for d in t.params["decisions"]]
    assert 0.4 < letters.count("A") / len(letters) < 0.6  # "always A" is no strategy


def _play(env, policy) -> tuple[float, object]:
    messages = env.initial_messages()
    total = 0.0
    while True:
        result = env.step(policy(messages))
        total += result.reward
        if result.done:
            return total, result
        messages = messages + [{"role": "assistant", "content": "x"}, *result.messages]


@pytest.mark.parametrize(
    "options",
    [{}, {"decisions": 8, "choices": 3}, {"reward": "terminal", "fillers": 2}, {"mode": "corridor", "decisions": 3},
     {"show_rule": False, "strict": True}, {"rule": "position"},
     {"rule": "position", "choices": 3, "mode": "corridor"}, {"rule": "word", "fillers": 1},
     {"rule": "word", "choices": 3, "mode": "corridor", "strict": True}],
)  # fmt: skip
def test_oracle_scores_the_max_and_random_the_chance_rate(options):
    oracle = [_play(make_env(t, **options), oracle_policy) for t in EVAL]
    assert all(r == pytest.approx(1.0) and end.stop_reason == StopReason.SUCCESS for r, end in oracle)
    policy = random_policy(1)
    accuracy = [_play(make_env(t, **options), policy)[1].metrics["decision_accuracy"] for t in EVAL]
    chance = 1 / options.get("choices", 2)
    assert abs(sum(accuracy) / len(accuracy) - chance) < 0.15


def test_through_the_collector_the_corridor_gives_gigpo_large_anchor_groups(tokenizer):
    """Collected with the scripted random policy (groups of 8 walks): the recorded state keys are the
    rooms, room 1 recurs, and gigpo's anchor groups are larger than the group; the chain's keys are
    positions, one per episode, so its anchor groups are the group itself."""
    from turnrl.chat import ChatTemplate
    from turnrl.credit import gigpo_advantages
    from turnrl.credit.gigpo import GigpoParams
    from turnrl.rollout.collect import RolloutSettings, collect
    from turnrl.sampling.scripted import ScriptedSampler
    from turnrl.types import SamplingParams

    sampler, chat = ScriptedSampler(random_policy(3), tokenizer), ChatTemplate(tokenizer)
    chain = collect(EVAL[:2], sampler, chat, SamplingParams(), [8], RolloutSettings())
    assert {len(e.turns) for e in chain} == {4}  # default options: the 4-decision chain
    assert {t.state_key for e in chain for t in e.turns} == {f'["turn",{k}]' for k in range(4)}
    assert gigpo_advantages(chain, GigpoParams()).metrics["gigpo/anchor_group_size"] == pytest.approx(8.0)
    corridor = {"mode": "corridor", "decisions": 3}
    walks = collect(EVAL[:2], sampler, chat, SamplingParams(), [8], RolloutSettings(env_options=corridor))
    keys = [t.state_key for e in walks for t in e.turns]
    assert set(keys) <= {f'["room",{r}]' for r in range(3)} and keys.count('["room",0]') > 16
    assert all(e.turns[0].state_key == '["room",0]' for e in walks)
    assert gigpo_advantages(walks, GigpoParams()).metrics["gigpo/anchor_group_size"] > 8.0
