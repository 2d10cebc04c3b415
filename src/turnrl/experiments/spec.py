"""The experiment spec: a strict pydantic schema, and loading it from YAML.

A spec names a base run config, the overrides every arm shares, the budget, the
seeds, the evaluation, the arms (each a set of dotted config overrides) and an
optional success criterion (see ``docs/experiments.md``). Validation errors
name the key and the fix, formatted by :func:`turnrl.config.format_errors`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    model_validator,
)

from turnrl.bounded import (
    MAX_AUDIT_EPISODES,
    MAX_AUDIT_REPEATS,
    MAX_AUDIT_TASKS,
    MAX_GROUP,
    NAME_PATTERN,
    path_component,
)
from turnrl.config import ConfigError, format_errors, read_config_data

MetricName = Literal["success_rate", "mean_reward"]

SHARED_KEYS = (
    "seed",
    "run_name",
    "paths",
    "env",
    "data",
    "eval",
    "loop",
    "train.steps",
    "train.max_seconds",
)
"""Config keys (and sections) every arm shares; an arm's overrides may not touch them."""

MANAGED_KEYS = {
    "seed": "seeds",
    "run_name": "(set by the runner: seed<k>)",
    "paths.output_dir": "(set by the runner: <output root>/<name>/<arm>)",
    "train.steps": "budget.steps",
    "train.max_seconds": "budget.max_seconds",
    "eval.every": "evaluation.every",
    "eval.temperature": "evaluation.greedy",
    "eval.before": "evaluation.before",
    "data.num_eval_tasks": "evaluation.n",
}
"""Config keys the spec sets through its own fields; ``overrides`` may not set them."""


class ExperimentError(ConfigError):
    """An experiment spec is invalid or cannot be run; the message names the key and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Arm(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    """Directory-safe name: letters, digits, ``_``, ``.``, ``-``."""
    overrides: dict[str, Any] = {}
    """Dotted config keys → values (YAML values, not strings)."""
    description: str = ""


class Budget(_Strict):
    steps: int | None = Field(None, ge=1)
    """``train.steps`` for every arm (default: the base config's)."""
    max_seconds: float | None = Field(None, gt=0)
    """``train.max_seconds`` for every arm: wall-clock budget of the training steps."""


class Evaluation(_Strict):
    every: int = Field(0, ge=0)
    """Evaluate every N steps (``eval.every``); 0: only before and after."""
    n: int | None = Field(None, ge=1)
    """Held-out examples (``data.num_eval_tasks``); default: the base config's."""
    greedy: bool = True
    """``eval.temperature: 0``; false keeps the base config's temperature."""
    before: bool = True
    """Evaluate the base model at step 0 (``eval.before``)."""
    metric: MetricName = "success_rate"
    """The metric of the table and the plot."""
    extra_games: int = Field(0, ge=0)
    """More held-out games for each finished run's final policy, sampled with fresh seeds and pooled with
    its last evaluation (:mod:`turnrl.experiments.extra`); 0: none."""


class AuditPlan(_Strict):
    """``audit:``: the credit audit of the starting policy before any arm trains (``turnrl credit-audit``'s
    options; the leaves are the primary baseline's episodes per task, so every arm is audited at equal
    leaves; :mod:`turnrl.experiments.prediction`)."""

    episodes: int = Field(8, ge=1, le=MAX_AUDIT_EPISODES)
    continuations: int = Field(8, ge=2, le=MAX_GROUP)
    repeats: int = Field(4, ge=2, le=MAX_AUDIT_REPEATS)
    split: Literal["train", "eval"] = "train"
    num_tasks: int | None = Field(None, ge=1, le=MAX_AUDIT_TASKS)


class MarginCriterion(_Strict):
    """ "treatment ≥ baseline + min_diff at step S"."""

    type: Literal["margin"]
    treatment: str
    baseline: str
    metric: MetricName = "success_rate"
    at_step: int | Literal["final"] = "final"
    min_diff: float = 0.0


class CollapseCriterion(_Strict):
    """ "baseline drops more than ``drop`` from its peak while treatment does not"."""

    type: Literal["collapse"]
    treatment: str
    baseline: str
    metric: MetricName = "success_rate"
    drop: float = Field(0.10, gt=0)


class Primary(_Strict):
    """The primary outcome, stated before the runs: the one comparison the verdict is about."""

    treatment: str
    baseline: str
    metric: MetricName = "success_rate"
    at_step: int | Literal["final"] = "final"


class Ladder(_Strict):
    """The batch-ladder control: ``arm`` again at ``factors`` × its leaves per step (1 = the arm itself)."""

    arm: str
    factors: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    scale: Literal["group_size", "tasks_per_step"] = "group_size"
    """What grows: ``rollout.group_size`` (the same tasks, k× leaves per task) or ``rollout.tasks_per_step``."""


class LadderRung(Arm):
    """An arm the ladder adds: ``base``'s overrides, ``rollout.<scale>`` × ``factor`` (set by the plan)."""

    base: str
    factor: int
    scale: str


def _criterion_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        if "any_of" in value:
            return "<any_of>"
        if "all_of" in value:
            return "<all_of>"
        kind = value.get("type")
        return f"<{kind}>" if kind in ("margin", "collapse") else None
    return {v: k for k, v in _TAGS.items()}.get(type(value))


Criterion = Annotated[
    Annotated[MarginCriterion, Tag("<margin>")]
    | Annotated[CollapseCriterion, Tag("<collapse>")]
    | Annotated["AnyOf", Tag("<any_of>")]
    | Annotated["AllOf", Tag("<all_of>")],
    Discriminator(
        _criterion_tag,
        custom_error_type="criterion_kind",
        custom_error_message=(
            "a criterion needs 'type: margin' or 'type: collapse', or is 'any_of: [...]' / 'all_of: [...]'"
        ),
    ),
]


class AnyOf(_Strict):
    any_of: list[Criterion] = Field(min_length=1)


class AllOf(_Strict):
    all_of: list[Criterion] = Field(min_length=1)


_TAGS: dict[str, type[BaseModel]] = {
    "<margin>": MarginCriterion,
    "<collapse>": CollapseCriterion,
    "<any_of>": AnyOf,
    "<all_of>": AllOf,
}


def leaves(criterion: Any) -> list[MarginCriterion | CollapseCriterion]:
    """The margin and collapse criteria inside a (possibly combined) criterion."""
    if isinstance(criterion, AnyOf):
        return [leaf for c in criterion.any_of for leaf in leaves(c)]
    if isinstance(criterion, AllOf):
        return [leaf for c in criterion.all_of for leaf in leaves(c)]
    return [criterion]


def is_under(key: str, prefixes: Sequence[str]) -> str | None:
    """The first of ``prefixes`` that ``key`` equals or lies under (``a.b`` is under ``a``)."""
    for p in prefixes:
        if key == p or key.startswith(p + "."):
            return p
    return None


class ExperimentSpec(_Strict):
    name: str | None = Field(None, pattern=NAME_PATTERN)
    title: str = Field(min_length=1)
    hypothesis: str = Field(min_length=1)
    base_config: str
    """Path of the base run config, relative to the spec file."""
    overrides: dict[str, Any] = {}
    budget: Budget = Budget()
    seeds: list[int] = Field(min_length=1)
    evaluation: Evaluation = Evaluation()
    arms: list[Arm] = Field(min_length=1)
    ladder: Ladder | None = None
    audit: AuditPlan | None = None
    """The credit audit of the starting policy and its per-arm prediction, before training (None: none)."""
    criterion: Criterion | None = None
    primary: Primary | None = None
    """Required with two or more arms (the validator says how to state it); None so the message is ours."""

    _source: Path | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> ExperimentSpec:
        self._check_ladder()
        names = [a.name for a in self.all_arms()]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"arms: duplicate arm name(s) {', '.join(map(repr, dupes))}; names must be unique")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: duplicate seed in {self.seeds}; each seed runs once per arm")
        for key in self.overrides:
            if key in MANAGED_KEYS:
                raise ValueError(f"overrides: key {key!r} is set by the spec; use {MANAGED_KEYS[key]} instead")
        for i, arm in enumerate(self.arms):
            for key in arm.overrides:
                if key in MANAGED_KEYS:
                    raise ValueError(
                        f"arms[{i}] ({arm.name!r}).overrides: key {key!r} must be the same for"
                        f" every arm; use {MANAGED_KEYS[key]} instead"
                    )
                shared = is_under(key, SHARED_KEYS)
                if shared:
                    raise ValueError(
                        f"arms[{i}] ({arm.name!r}).overrides: key {key!r} must be the same for"
                        f" every arm ({shared!r} is shared: seeds, data, evaluation, budget and"
                        " paths are common); set it in the top-level overrides, budget or"
                        " evaluation instead"
                    )
        if self.criterion is not None:
            for leaf in leaves(self.criterion):
                for role in ("treatment", "baseline"):
                    arm = getattr(leaf, role)
                    if arm not in names:
                        raise ValueError(
                            f"criterion.{role}: unknown arm {arm!r}; the arms are {', '.join(map(repr, names))}"
                        )
                if leaf.treatment == leaf.baseline:
                    raise ValueError(f"criterion: treatment and baseline are both {leaf.treatment!r}")
        self._check_primary(names)
        return self

    def _check_ladder(self) -> None:
        if self.ladder is None:
            return
        arms = {a.name: a for a in self.arms}
        if self.ladder.arm not in arms:
            raise ValueError(f"ladder.arm: unknown arm {self.ladder.arm!r}; the arms are {', '.join(map(repr, arms))}")
        if len(set(self.ladder.factors)) != len(self.ladder.factors):
            raise ValueError(f"ladder.factors: duplicate factor in {self.ladder.factors}")
        if self.ladder.scale == "group_size" and "rollout.branching" in arms[self.ladder.arm].overrides:
            raise ValueError(
                f"ladder: arm {self.ladder.arm!r} samples trees (rollout.branching), which group_size does not"
                " size; use scale: tasks_per_step"
            )

    def _check_primary(self, names: list[str]) -> None:
        p = self.primary
        if p is None and len(names) < 2:
            return  # one arm: no comparison to state
        if p is None:
            raise ValueError(
                "primary: missing; state the primary outcome before running, e.g. primary: {treatment: <arm>,"
                " baseline: <arm>, metric: success_rate, at_step: final} (the comparison the verdict is about,"
                " printed first; docs/experiments.md)"
            )
        for role in ("treatment", "baseline"):
            if getattr(p, role) not in names:
                raise ValueError(
                    f"primary.{role}: unknown arm {getattr(p, role)!r}; the arms are {', '.join(map(repr, names))}"
                )
        if p.treatment == p.baseline:
            raise ValueError(f"primary: treatment and baseline are both {p.treatment!r}; name two arms")
        if self.criterion is not None:
            judged = {(leaf.treatment, leaf.baseline, leaf.metric) for leaf in leaves(self.criterion)}
            if (p.treatment, p.baseline, p.metric) not in judged:
                raise ValueError(
                    f"primary: {p.treatment} vs {p.baseline} on {p.metric} is not a comparison the criterion"
                    " judges; name one of its (treatment, baseline, metric) or add it to the criterion"
                )

    def primary_margin(self) -> MarginCriterion | None:
        """The primary outcome as the margin it is judged by (min_diff 0); None for a one-arm spec."""
        return None if self.primary is None else MarginCriterion(type="margin", **self.primary.model_dump())

    def all_arms(self) -> list[Arm]:
        """The arms, then the ladder's added rungs (``<arm>_x<k>`` for each factor k > 1)."""
        if self.ladder is None:
            return list(self.arms)
        base = next(a for a in self.arms if a.name == self.ladder.arm)
        scale = self.ladder.scale
        rungs = [
            LadderRung(
                name=f"{base.name}_x{k}",
                overrides=base.overrides,
                description=f"batch ladder: {base.name} at {k}× the leaves (rollout.{scale} × {k})",
                base=base.name,
                factor=k,
                scale=scale,
            )
            for k in sorted(self.ladder.factors)
            if k > 1
        ]
        return [*self.arms, *rungs]

    def metrics(self) -> list[str]:
        """The metrics the table, the primary outcome and the criterion use."""
        used = [self.evaluation.metric]
        if self.primary is not None:
            used.append(self.primary.metric)
        if self.criterion is not None:
            used += [leaf.metric for leaf in leaves(self.criterion)]
        return list(dict.fromkeys(used))

    @property
    def source(self) -> Path | None:
        return self._source

    def experiment_name(self) -> str:
        if self.name:
            return self.name
        if self._source is not None:  # the spec file's stem: a name from outside, like any other
            try:
                return path_component(self._source.stem, f"the experiment's name (the stem of {self._source.name})")
            except ValueError as exc:
                raise ExperimentError(f"{exc}; or set 'name' in the spec") from None
        raise ExperimentError("the experiment needs a name: set 'name' in the spec")

    def base_config_path(self) -> Path:
        path = Path(self.base_config)
        if not path.is_absolute() and self._source is not None:
            path = self._source.parent / path
        return path


# ----------------------------------------------------------------------------- errors


def _loc(parts: Sequence[Any]) -> str:
    """``arms[0].overrides``: list indexes in brackets, tagged-union branches left out."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith("<"):
            continue  # a tagged-union branch, not a key
        else:
            out += ("." if out else "") + str(part)
    return out


def _keys_at(parts: Sequence[Any]) -> list[str] | None:
    """The keys of the spec model a location points into (in definition order)."""
    model: type[BaseModel] | None = ExperimentSpec
    for part in parts:
        if isinstance(part, int):
            continue
        if part in _TAGS:
            model = _TAGS[part]
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _single_model(model.model_fields[part].annotation)
    return list(model.model_fields) if model is not None else None


def _single_model(annotation: Any) -> type[BaseModel] | None:
    found: list[type[BaseModel]] = []

    def walk(a: Any) -> None:
        if isinstance(a, type) and issubclass(a, BaseModel):
            found.append(a)
            return
        for arg in getattr(a, "__args__", ()) or ():
            walk(arg)
        origin = getattr(a, "__origin__", None)
        if origin is not None and origin is not a:
            walk(origin)

    walk(annotation)
    unique = list(dict.fromkeys(found))
    return unique[0] if len(unique) == 1 else None


def parse_spec(data: Any, source: str | Path | None = None) -> ExperimentSpec:
    """Validate a spec mapping; ``source`` (the spec file) anchors ``base_config`` and the default name."""
    label = str(source) if source is not None else ""
    if not isinstance(data, dict):
        raise ExperimentError(f"invalid experiment spec {label}: the top level must be a mapping")
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        header = f"invalid experiment spec{' ' + label if label else ''}:"
        raise ExperimentError(format_errors(exc, header, _loc, _keys_at)) from None
    spec._source = Path(source) if source is not None else None
    return spec


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and validate a spec YAML file."""
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment spec {path} does not exist")
    try:
        data = read_config_data(path)
    except ConfigError as exc:
        raise ExperimentError(f"experiment spec {exc}") from None
    return parse_spec(data, path)
