"""Math word problems in GSM8K format: one turn, graded against a gold number.

The prompt is the question plus an instruction to end with ``#### <number>``.
Grading (:func:`grade`):

- the prediction is the number right after the last ``####`` that is followed
  by a number; with no such marker, the last number anywhere in the reply;
- numbers are normalised before comparison: ``,`` and ``$`` are stripped, a
  trailing ``.`` is dropped, and values compare numerically (``"3.0" == "3"``,
  ``"1,000" == "1000"``, ``"$5" == "5"``);
- reward 1.0 when equal (``SUCCESS``), else 0.0 (``FAILURE``); a reply with no
  number at all gets 0.0 and ``MALFORMED``.

Tasks come from GSM8K JSONL (``question``/``answer``, gold = text after ``####``)
via :func:`load_gsm8k`, or from the hub dataset ``openai/gsm8k`` (config
``main``) when no path is given.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from turnrl.envs.base import (
    Env,
    EnvOptions,
    Message,
    SplitName,
    StepResult,
    StopReason,
    Task,
    check_split,
)
from turnrl.tasks import TaskFileError, read_json_lines

INSTRUCTION = (
    "Solve the problem step by step. On the last line, write the final answer as a "
    "number after four hash signs, like this:\n#### 42"
)

# A number as it appears in text: optional minus (not right after a digit or letter, so
# "2023-2020" is two positive numbers), optional $, digits with thousands commas,
# optional decimal part. A trailing "." (end of sentence) is not captured.
_NUMBER = r"(?:(?<![\w.])-)?\$?\d[\d,]*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_NUMBER_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_PLAIN_NUMBER_RE = re.compile(r"(?=\.?\d)(\d*)(?:\.(\d*))?")  # "12", "12.50", ".5"

HUB_DATASET = ("openai/gsm8k", "main")
_HUB_SPLITS = {SplitName.TRAIN: "train", SplitName.EVAL: "test"}


def normalize_number(text: str) -> str | None:
    """Canonical string of a number: strip ``,`` ``$``, a trailing ``.``; integers as integers.

    ``"1,000"`` -> ``"1000"``, ``"$3.50"`` -> ``"3.5"``, ``"3.0"`` -> ``"3"``,
    ``"-$4"`` -> ``"-4"``. Returns ``None`` when the text is not a number. Pure
    string work (no float or int conversion), so it is exact for any length.
    """
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    negative = s.startswith("-")
    m = _PLAIN_NUMBER_RE.fullmatch(s.lstrip("-"))
    if m is None:
        return None
    whole = m.group(1).lstrip("0") or "0"
    frac = (m.group(2) or "").rstrip("0")
    out = whole + ("." + frac if frac else "")
    return "-" + out if negative and out != "0" else out


def extract_prediction(text: str) -> tuple[str | None, bool]:
    """The predicted number of a reply (normalised) and whether it came from a ``####`` marker.

    The number after the last ``####`` wins; without one, the last number in the text.
    """
    marked = _HASH_NUMBER_RE.findall(text)
    if marked:
        return normalize_number(marked[-1]), True
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return normalize_number(numbers[-1]), False
    return None, False


def gold_from_answer(answer: str) -> str | None:
    """The gold number of a GSM8K ``answer`` field: the text after the last ``####``, normalised.

    A bare number (no ``####``) is accepted as the gold itself.
    """
    tail = answer.rsplit("####", 1)[-1]
    return normalize_number(tail)


def grade(text: str, gold: str) -> tuple[float, StopReason]:
    """Reward and stop reason for a reply against a gold number (see module docstring)."""
    predicted, _ = extract_prediction(text)
    if predicted is None:
        return 0.0, StopReason.MALFORMED
    gold_norm = normalize_number(gold)
    if gold_norm is not None and predicted == gold_norm:
        return 1.0, StopReason.SUCCESS
    return 0.0, StopReason.FAILURE


class MathOptions(EnvOptions):
    train_path: str | None = None
    eval_path: str | None = None
    """GSM8K JSONL files per split (unset: the hub dataset)."""
    limit: int | None = Field(None, ge=1)
    """Keep the first ``limit`` problems of the split."""


class MathEnv(Env):
    """Single-turn GSM8K-style math word problem.

    Task params: ``question`` (str) and ``answer`` (the gold number, or a full
    GSM8K answer whose gold follows ``####``).

    Options (used by :meth:`default_tasks`; accepted and ignored by the env itself):
        train_path, eval_path (str | None): GSM8K JSONL files for each split;
            when unset, the hub dataset ``openai/gsm8k`` is used.
        limit (int | None): keep the first ``limit`` problems of the split.
    """

    name: ClassVar[str] = "math"
    max_turns: int = 1
    Options = MathOptions

    def __init__(self, task: Task, **options: Any) -> None:
        super().__init__(task, **options)
        question = task.params.get("question")
        answer = task.params.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"task {task.task_id!r}: params.question must be a non-empty string")
        gold = gold_from_answer(str(answer)) if isinstance(answer, str | int | float) else None
        if gold is None:
            raise ValueError(
                f"task {task.task_id!r}: params.answer must be a number or a GSM8K answer ending "
                f"in '#### <number>', got {answer!r}"
            )
        self.question = question
        self.gold = gold
        self.done = False

    def initial_messages(self) -> list[Message]:
        return [{"role": "user", "content": f"{self.question.strip()}\n\n{INSTRUCTION}"}]

    def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError(f"math episode {self.task.task_id!r} is over (single turn); build a new env")
        self.done = True
        text = action_text if isinstance(action_text, str) else ""
        reward, reason = grade(text, self.gold)
        _, marked = extract_prediction(text)
        return StepResult(
            messages=[],
            reward=reward,
            terminated=True,
            truncated=False,
            stop_reason=reason,
            metrics={
                "success": float(reason == StopReason.SUCCESS),
                "malformed": float(reason == StopReason.MALFORMED),
                "format_ok": float(marked),
                "turns": 1.0,
            },
        )

    @classmethod
    def default_tasks(cls, split: str, **options: Any) -> list[Task]:
        """GSM8K tasks for a split: from ``train_path``/``eval_path`` if set, else the hub."""
        opts = cls.parse_options(options)
        split = check_split(split)
        path = opts.train_path if split == SplitName.TRAIN else opts.eval_path
        return load_gsm8k(path, split, limit=opts.limit)


def load_gsm8k(path: str | Path | None, split: str, limit: int | None = None) -> list[Task]:
    """GSM8K problems as :class:`Task` objects for environment ``math``.

    ``path`` is a JSONL file with ``question`` and ``answer`` per line (the original
    GSM8K format; the gold is the text after ``####``). With ``path=None`` the hub
    dataset ``openai/gsm8k`` (config ``main``; split ``train`` or ``test`` for eval)
    is loaded with the ``datasets`` library. Task ids are stable:
    ``gsm8k-<split>-<row:06d>``, the 0-based row in the file/dataset.
    """
    split = check_split(split)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    if path is None:
        rows = _hub_rows(split, limit)
        source = f"hub dataset {HUB_DATASET[0]} ({HUB_DATASET[1]}, split {_HUB_SPLITS[split]})"
    else:
        rows = _jsonl_rows(Path(path), limit)
        source = str(path)
    tasks: list[Task] = []
    for index, where, row in rows:
        question, answer = row.get("question"), row.get("answer")
        for key, value in (("question", question), ("answer", answer)):
            if not isinstance(value, str) or not value.strip():
                raise TaskFileError(f"{where}: missing or empty field {key!r} (a string)")
        gold = gold_from_answer(answer)
        if gold is None:
            raise TaskFileError(f"{where}: field 'answer' has no number after '####' (got ...{answer[-40:]!r})")
        tasks.append(
            Task(
                task_id=f"gsm8k-{split}-{index:06d}",
                env=MathEnv.name,
                params={"question": question, "answer": gold},
                split=split,
            )
        )
    if not tasks:
        raise TaskFileError(f"{source}: no problems found")
    return tasks


def _jsonl_rows(path: Path, limit: int | None) -> list[tuple[int, str, dict[str, Any]]]:
    if not path.is_file():
        raise TaskFileError(
            f"GSM8K file {path} does not exist; pass the path of a JSONL file with 'question' and "
            "'answer' fields (e.g. train.jsonl/test.jsonl from GSM8K), or no path to use the hub"
        )
    rows: list[tuple[int, str, dict[str, Any]]] = []
    for where, obj in read_json_lines(path):
        if limit is not None and len(rows) >= limit:
            break
        rows.append((len(rows), where, obj))
    return rows


def _hub_rows(split: str, limit: int | None) -> list[tuple[int, str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "loading GSM8K from the hub needs the 'datasets' package: pip install datasets "
            "(or pass a local GSM8K JSONL path: train_path/eval_path)"
        ) from exc
    name, config = HUB_DATASET
    hub_split = _HUB_SPLITS[split]
    try:
        data = datasets.load_dataset(name, config, split=hub_split)
    except Exception as exc:  # network, auth, cache: one clear message
        raise RuntimeError(
            f"could not load {name} ({config}, split {hub_split}) from the hub: {exc}; "
            "pass a local GSM8K JSONL path instead (train_path/eval_path)"
        ) from exc
    n = len(data) if limit is None else min(limit, len(data))
    return [(i, f"{name}[{hub_split}][{i}]", dict(data[i])) for i in range(n)]
