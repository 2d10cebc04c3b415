"""Probe, then commit: the slosh tank's structure, sized for a 135M model.

A machine has a hidden best setting s* (a whole number 1..9) for one named quantity, e.g.
``speed``. Three gauges can be read, one per quantity; only the gauge named like the target
shows s*, the others show unrelated numbers. Two turns, reward only at the end:

1. probe: ``<probe>NAME</probe>`` reads gauge NAME. Parsing is lenient (the format is not what
   this task tests): without a probe tag, the first of this machine's gauge names the reply
   mentions is read; a reply naming none reads nothing (the observation says what was read). A
   first reply that names no gauge but holds ``<answer>N</answer>`` commits blind and ends the game.
2. commit: ``<answer>N</answer>`` with N in 1..9 (the last tag counts); without a tag, the last
   whole number of the reply.

Reward of a commit N: ``1 − |N − s*| / 8`` (1.0 exactly right, ≥ 0 anywhere in range);
success = N = s*. A missing or out-of-range answer is malformed: reward ``MALFORMED_REWARD``
(−0.5, below any commit) and the game ends. An informed policy (read the gauge named like the
target, commit its reading) succeeds always; a blind one (commit 5) succeeds when s* = 5 and
earns 1 − E|5 − s*|/8 on average.

Tasks ship as files (``turnrl/data/probe_commit_{train,eval}.jsonl``, rebuilt by
:func:`build_tasks`): train quantities and gauge names come from one word pool, held-out ones
from another (names never seen in training), and every value 1..9 occurs as s* in both.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, ClassVar

from turnrl.envs.base import Env, EnvOptions
from turnrl.tasks import load_task_file, shipped_task_file, write_task_files
from turnrl.types import Message, StepResult, StopReason, Task

LOW, HIGH = 1, 9
MALFORMED_REWARD = -0.5
TRAIN_WORDS = ("speed", "heat", "flow", "pressure", "volume", "weight", "light", "noise", "depth", "spin")
EVAL_WORDS = ("torque", "voltage", "height", "salt", "wind", "glow")
EXAMPLES = (
    {"target": "width", "gauges": ["color", "width", "age"], "readings": {"color": 2, "width": 6, "age": 8}},
    {"target": "size", "gauges": ["size", "smell", "taste"], "readings": {"size": 3, "smell": 9, "taste": 4}},
)
"""The worked example games of the prompt (their words are in neither pool)."""
FILE_NAMES = {"train": "probe_commit_train.jsonl", "eval": "probe_commit_eval.jsonl"}
TASKS_PER_SPLIT = {"train": 45, "eval": 27}

_PROBE_RE = re.compile(r"<probe>\s*([A-Za-z_]+)\s*</probe>", re.IGNORECASE)
_ANSWER_RE = re.compile(r"<answer>\s*([+-]?\d{1,9})\.?\s*</answer>", re.IGNORECASE)
_NUMBER_RE = re.compile(r"(?<![\w.])\d{1,9}(?![\w.])")


def parse_probe(text: str, gauges: list[str]) -> str | None:
    """The gauge read: the name in the last ``<probe>NAME</probe>`` when it is one of ``gauges``,
    else the gauge name mentioned first in the reply (whole words, any case), else None."""
    found = [f.lower() for f in _PROBE_RE.findall(text)]
    if found and found[-1] in gauges:
        return found[-1]
    hits = [(m.start(), g) for g in gauges if (m := re.search(rf"\b{re.escape(g)}\b", text, re.IGNORECASE))]
    return min(hits)[1] if hits else None


def parse_answer(text: str, lenient: bool = True) -> int | None:
    """The integer in the last ``<answer>N</answer>``; else (``lenient``) the reply's last whole number; else None."""
    found = _ANSWER_RE.findall(text)
    if found:
        return int(found[-1])
    numbers = _NUMBER_RE.findall(text) if lenient else []
    return int(numbers[-1]) if numbers else None


def commit_reward(answer: int, best: int) -> float:
    """1 − |N − s*| / 8: 1.0 at the best setting, 0.0 at the far end of 1..9."""
    return round(1.0 - abs(answer - best) / (HIGH - LOW), 9)


def _system() -> str:
    return (
        "You are tuning a machine. It has a hidden best setting, a whole number from 1 to 9, for one quantity.\n"
        "The machine has three gauges. Only the gauge with the same name as the quantity shows the best setting;"
        " the other gauges show unrelated numbers.\n"
        "You have two replies. First reply: read one gauge by writing <probe>NAME</probe>."
        " Second reply: commit a setting by writing <answer>N</answer> with N from 1 to 9.\n"
        "The closer your setting is to the best setting, the higher your score."
    )


def _question(target: str, gauges: list[str]) -> str:
    return f"Find the best {target} setting. The gauges are: {', '.join(gauges)}. Which gauge do you read?"


def _reading(name: str | None, readings: dict[str, int]) -> str:
    if name is None or name not in readings:
        return "<result>No gauge was read.</result> Now commit your setting."
    return f"<result>The {name} gauge reads {readings[name]}.</result> Now commit your setting."


class ProbeCommitOptions(EnvOptions):
    few_shot: bool = True
    """Open with one worked example game (two in the prompt's examples)."""


class ProbeCommitEnv(Env):
    """Read one of three gauges, then commit a setting 1..9 (module doc).

    Task params: ``target`` (the quantity), ``gauges`` (three names, the target among them),
    ``readings`` (gauge → number 1..9; ``readings[target]`` is s*). Options: ``few_shot``
    (default True: one worked example game opens the conversation).
    """

    name: ClassVar[str] = "probe_commit"
    max_turns = 2
    Options = ProbeCommitOptions
    options: ProbeCommitOptions
    failure_reward: ClassVar[float] = MALFORMED_REWARD

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        _validate(task, f"task {task.task_id!r}")
        self.target: str = task.params["target"]
        self.gauges: list[str] = list(task.params["gauges"])
        self.readings: dict[str, int] = dict(task.params["readings"])
        self.best = self.readings[self.target]
        self.few_shot: bool = self.options.few_shot
        self.turn = 0
        self.probed: str | None = None

    def initial_messages(self) -> list[Message]:
        messages: list[Message] = [{"role": "system", "content": _system()}]
        if self.few_shot:
            for n, ex in enumerate(EXAMPLES):
                intro = "Example game. " if n == 0 else ""
                messages += [
                    {"role": "user", "content": intro + _question(ex["target"], ex["gauges"])},
                    {"role": "assistant", "content": f"<probe>{ex['target']}</probe>"},
                    {"role": "user", "content": _reading(ex["target"], ex["readings"])},
                    {"role": "assistant", "content": f"<answer>{ex['readings'][ex['target']]}</answer>"},
                    {
                        "role": "user",
                        "content": "Score 1.0: that was the best setting. Now a new game with a new machine.",
                    },
                ]
        messages.append({"role": "user", "content": _question(self.target, self.gauges)})
        return messages

    def state_key(self) -> str:
        """What the next turn acts from: the start, or the gauge read (anchor states for gigpo)."""
        return "start" if self.turn == 0 else f"read:{self.probed}"

    def step(self, action_text: str) -> StepResult:
        if self.turn >= 2:
            raise RuntimeError(f"probe_commit episode {self.task.task_id!r} is over; build a new env")
        text = action_text if isinstance(action_text, str) else ""
        self.turn += 1
        if self.turn == 1:
            self.probed = parse_probe(text, self.gauges)
            if self.probed is None and parse_answer(text, lenient=False) is not None:
                return self._commit(text)  # a blind commit on the first reply
            return StepResult(
                [{"role": "user", "content": _reading(self.probed, self.readings)}],
                metrics={"probed_target": float(self.probed == self.target), "probed_any": float(bool(self.probed))},
            )
        return self._commit(text)

    def _commit(self, text: str) -> StepResult:
        self.turn = 2
        answer = parse_answer(text)
        informed = float(self.probed == self.target)
        if answer is None or not LOW <= answer <= HIGH:
            metrics = {"success": 0.0, "malformed": 1.0, "probed_target": informed}
            return StepResult([], MALFORMED_REWARD, terminated=True, stop_reason=StopReason.MALFORMED, metrics=metrics)
        reward = commit_reward(answer, self.best)
        success = answer == self.best
        return StepResult(
            [],
            reward,
            terminated=True,
            stop_reason=StopReason.SUCCESS if success else StopReason.FAILURE,
            metrics={
                "success": float(success),
                "malformed": 0.0,
                "probed_target": informed,
                "error": abs(answer - self.best),
            },
        )

    # ------------------------------------------------------------------ tasks and policies

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """The shipped tasks: ``train`` (45, train word pool) or ``eval`` (27, held-out words)."""
        cls.parse_options(options)
        return cls.load_tasks(shipped_task_file(cls.name, FILE_NAMES, split), split)

    @classmethod
    def load_tasks(cls, path: str | Path, split: str | None = None) -> list[Task]:
        return load_task_file(path, split, validate=_validate)

    @classmethod
    def scripted_policies(cls):
        return {"oracle": oracle_policy, "blind": blind_policy, "random_gauge": random_gauge_policy(0)}


def _validate(task: Task, where: str) -> None:
    p = task.params
    gauges, readings, target = p.get("gauges"), p.get("readings"), p.get("target")
    if not (isinstance(gauges, list) and len(gauges) == 3 and all(isinstance(g, str) and g for g in gauges)):
        raise ValueError(f"{where}: params.gauges must be a list of three names")
    if not isinstance(target, str) or target not in gauges:
        raise ValueError(f"{where}: params.target must be one of params.gauges {gauges}")
    if not isinstance(readings, dict) or set(readings) != set(gauges):
        raise ValueError(f"{where}: params.readings must give one number per gauge {gauges}")
    for g, v in readings.items():
        if isinstance(v, bool) or not isinstance(v, int) or not LOW <= v <= HIGH:
            raise ValueError(f"{where}: params.readings[{g!r}] must be an integer in [{LOW}, {HIGH}], got {v!r}")


# --------------------------------------------------------------------------- scripted policies

_QUESTION_RE = re.compile(r"Find the best (\w+) setting\. The gauges are: ([\w, ]+)\.")
_READING_RE = re.compile(r"The (\w+) gauge reads (\d+)\.")


def oracle_policy(messages: list[Message]) -> str:
    """Read the gauge named like the target, then commit its reading (always right)."""
    last = str(messages[-1]["content"])
    question = _QUESTION_RE.search(last)
    if question:
        return f"<probe>{question.group(1)}</probe>"
    reading = _READING_RE.search(last)
    return f"<answer>{reading.group(2) if reading else 5}</answer>"


def blind_policy(messages: list[Message]) -> str:
    """Read nothing, commit the middle setting 5."""
    return "<probe>none</probe>" if _QUESTION_RE.search(str(messages[-1]["content"])) else "<answer>5</answer>"


def random_gauge_policy(seed: int):
    """Read a uniformly random gauge, commit its reading (right one time in three)."""
    rng = random.Random(seed)

    def policy(messages: list[Message]) -> str:
        last = str(messages[-1]["content"])
        question = _QUESTION_RE.search(last)
        if question:
            return f"<probe>{rng.choice(question.group(2).split(', '))}</probe>"
        reading = _READING_RE.search(last)
        return f"<answer>{reading.group(2) if reading else 5}</answer>"

    return policy


# --------------------------------------------------------------------------- the task files


def make_tasks(split: str, seed: int = 0) -> list[Task]:
    """The task set of a split: target and two distractor gauges from the split's word pool, in a
    random order; s* cycles through 1..9; distractor readings differ from s* and each other."""
    words = TRAIN_WORDS if split == "train" else EVAL_WORDS
    rng = random.Random(f"probe_commit-{split}-{seed}")
    out = []
    for i in range(TASKS_PER_SPLIT[split]):
        target = words[i % len(words)]
        gauges = [target, *rng.sample([w for w in words if w != target], 2)]
        rng.shuffle(gauges)
        best = LOW + i % (HIGH - LOW + 1)
        others = rng.sample([v for v in range(LOW, HIGH + 1) if v != best], 2)
        readings = {g: best if g == target else others.pop() for g in gauges}
        out.append(
            Task(
                f"probe_commit-{split}-{i:02d}",
                ProbeCommitEnv.name,
                {"target": target, "gauges": gauges, "readings": readings},
                split,
            )
        )
    return out


def build_tasks(out_dir: str | Path) -> list[Path]:
    """Write ``probe_commit_train.jsonl`` and ``probe_commit_eval.jsonl`` (the shipped files)."""
    return write_task_files(out_dir, FILE_NAMES, make_tasks)
