"""The trainer seam and the local trainer: log-probs, loss, backward (optionally per turn), update.

:class:`Trainer` is what the loop needs from a trainer: ``forward_backward(rows,
totals)`` accumulates gradients (and returns metric sums), ``optim_step()``
clips and applies them, ``policy_weights()`` hands the trainable weights to a
sampler's ``refresh``, plus state for checkpoints and the adapter. A
multi-process trainer is one more class with the same methods.
:class:`LocalTrainer` is the single-process one.

Log-probs come from :func:`turnrl.train.logprobs.token_logprobs` (one row at a time) or,
with ``train.shared_prefix`` (the default), from
:func:`turnrl.train.packing.packed_token_logprobs`: the rows of a micro-batch as one token
trie, every shared prefix run once, with exactly the same loss and gradients.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from turnrl import losses
from turnrl.config import RunConfig
from turnrl.losses import LossPlan
from turnrl.train.batch import Row, collate
from turnrl.train.logprobs import token_logprobs
from turnrl.train.packing import packed_token_logprobs


@dataclass(frozen=True)
class StepSettings:
    """How a run updates the policy, resolved once: micro-batching, the log-prob path, the optimizer
    and its schedule, and the loss plan."""

    loss: LossPlan
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    shared_prefix: bool = True
    max_pack_tokens: int = 8192
    num_iterations: int = 1
    target_kl: float | None = None
    """Stop a step's passes once approx-KL exceeds this (:func:`update`)."""
    decompose_turns: bool = False
    logprob_chunk: int = 256
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    schedule_steps: int = 1
    """Optimizer steps of one outer iteration (steps × ``num_iterations``): the schedule's length."""
    max_tokens_per_turn: int = 64
    """``sampler.max_tokens``: L_max of the ``constant`` normaliser is turns × this."""
    temperature: float = 1.0
    """The sampling temperature the log-probs are computed at (``sampler.temperature``, 0 → 1)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> StepSettings:
        t = cfg.train
        return cls(
            loss=LossPlan.from_config(cfg.loss),
            lr=t.lr,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            micro_batch_size=t.micro_batch_size,
            shared_prefix=t.shared_prefix,
            max_pack_tokens=t.max_pack_tokens,
            num_iterations=t.num_iterations,
            target_kl=t.target_kl,
            decompose_turns=t.decompose_turns,
            logprob_chunk=t.logprob_chunk,
            lr_scheduler=t.lr_scheduler,
            warmup_steps=t.warmup_steps,
            schedule_steps=max(1, (cfg.loop.steps_per_iteration or t.steps) * t.num_iterations),
            max_tokens_per_turn=cfg.sampler.max_tokens,
            temperature=cfg.sampler.temperature or 1.0,
        )


@dataclass
class StepTotals:
    """Batch-wide constants the normalizers need, so micro-batch losses add up exactly."""

    tokens: int
    rows: int
    max_len: int

    @classmethod
    def of(cls, rows: list[Row], max_tokens_per_turn: int) -> StepTotals:
        """L_max for the ``constant`` normalizer: the token budget of the longest row (turns × max tokens)."""
        turns = max(r.turns_trained for r in rows)
        return cls(sum(sum(r.mask) for r in rows), len(rows), turns * max_tokens_per_turn)


def pass_groups(rows: list[Row], decompose_turns: bool) -> list[list[Row]]:
    """Rows grouped into forward/backward passes: one group per turn index when decomposing."""
    if not decompose_turns:
        return [rows]
    by_turn: dict[int, list[Row]] = defaultdict(list)
    for r in rows:
        by_turn[r.turn].append(r)
    return [by_turn[k] for k in sorted(by_turn)]


def micro_batches(rows: list[Row], size: int) -> Iterator[list[Row]]:
    for s in range(0, len(rows), size):
        yield rows[s : s + size]


def micro_batch_plan(rows: list[Row], settings: StepSettings) -> list[list[Row]]:
    """The micro-batches of one pass over ``rows``, in order: ``train.micro_batch_size`` rows each, per turn
    index when decomposing."""
    size = settings.micro_batch_size
    return [mb for group in pass_groups(rows, settings.decompose_turns) for mb in micro_batches(group, size)]


def logprob_function(settings: StepSettings):
    """The log-prob path: shared-prefix packing (default) or one row at a time."""
    if not settings.shared_prefix:
        return token_logprobs
    budget = settings.max_pack_tokens

    def packed(model, batch, chunk=256, temperature=1.0, aux_ids=None):
        return packed_token_logprobs(model, batch, chunk, temperature, aux_ids, max_pack_tokens=budget)

    return packed


def accumulate_gradients(
    model,
    rows: list[Row],
    settings: StepSettings,
    *,
    pad_id: int,
    totals: StepTotals | None = None,
    old_logprobs: dict[int, torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    plan: list[list[Row]] | None = None,
) -> dict[str, float]:
    """Forward/backward over ``rows`` (micro-batched, per turn when decomposing); gradients accumulate.

    ``old_logprobs`` maps micro-batch number → the old policy's log-probs (for num_iterations > 1);
    missing entries are filled in with the current (detached) log-probs. ``plan`` replaces
    :func:`micro_batch_plan` (the sharded trainer's lock-step micro-batches).
    """
    totals = totals or StepTotals.of(rows, settings.max_tokens_per_turn)
    logprobs = logprob_function(settings)
    device = next(model.parameters()).device
    temperature = settings.temperature
    chunk, loss_plan = settings.logprob_chunk, settings.loss
    sums: dict[str, float] = defaultdict(float)
    for mb_index, mb in enumerate(micro_batch_plan(rows, settings) if plan is None else plan):
        batch = collate(mb, pad_id).to(device)
        aux_ids = None
        spec = loss_plan.spec
        if spec.num_aux is not None:
            params = loss_plan.params
            if batch.topk_ids is None or batch.topk_logprobs is None:
                raise ValueError(f"loss.type {loss_plan.type} needs the sampler's top-k log-probs on every row")
            top_k = spec.aux_top_k(params) if spec.aux_top_k is not None else None
            aux_ids = losses.sample_aux_tokens(
                batch.topk_ids, batch.topk_logprobs, spec.num_aux(params), generator, top_k=top_k
            )
        logp, aux_logp = logprobs(model, batch, chunk, temperature, aux_ids)
        ref_logp = None
        if loss_plan.beta > 0:
            with torch.no_grad(), model.disable_adapter():
                ref_logp, _ = logprobs(model, batch, chunk, temperature)
        if old_logprobs is not None and mb_index in old_logprobs:
            old = old_logprobs[mb_index]
        else:
            old = logp.detach()
            if old_logprobs is not None:
                old_logprobs[mb_index] = old
        per_token, metrics = losses.per_token_loss(
            loss_plan,
            logp,
            old,
            batch.behavior_logprobs,
            batch.advantages,
            batch.loss_mask,
            aux_logp=aux_logp,
            ref_logp=ref_logp,
        )
        loss = losses.normalize(
            per_token,
            batch.loss_mask,
            loss_plan.norm,
            total_tokens=totals.tokens,
            total_rows=totals.rows,
            max_len=totals.max_len,
        )
        loss.backward()
        sums["loss"] += float(loss.detach())
        for key, value in metrics.items():
            sums[key] += float(value)
    return dict(sums)


class Trainer(Protocol):
    """What the training loop needs from a trainer (local, or several processes)."""

    last_lr: float
    """The learning rate of the last optimizer step (after any schedule)."""

    def begin_batch(self, seed: int | None) -> None:
        """Start a new batch of rows: forget its old-policy log-probs; seed its auxiliary-token draws."""
        ...

    def forward_backward(self, rows: list[Row], totals: StepTotals) -> dict[str, float]:
        """Accumulate the gradient of the batch loss over ``rows``; return metric sums."""
        ...

    def optim_step(self) -> float:
        """Clip, apply and clear the accumulated gradients; return the gradient norm before clipping."""
        ...

    def zero_grad(self) -> None:
        """Clear the accumulated gradients without applying them (a pass stopped by ``train.target_kl``)."""
        ...

    def policy_weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights, for ``Sampler.refresh``."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_adapter(self, path: Path) -> None: ...


def make_scheduler(optimizer: torch.optim.Optimizer, settings: StepSettings):
    """``train.lr_scheduler`` with ``train.warmup_steps`` over one iteration's optimizer steps
    (steps × ``num_iterations``), through transformers' ``get_scheduler``."""
    from transformers import get_scheduler

    name = settings.lr_scheduler
    if name == "constant" and settings.warmup_steps:
        name = "constant_with_warmup"
    return get_scheduler(
        name, optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=settings.schedule_steps
    )


class LocalTrainer:
    """One process: a peft model with a trainable LoRA and its AdamW optimizer."""

    def __init__(self, model, settings: StepSettings, pad_id: int) -> None:
        self.model = model
        self.settings = settings
        self.pad_id = pad_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.scheduler = make_scheduler(self.optimizer, settings)
        self.last_lr = settings.lr
        """The learning rate of the last optimizer step."""
        self.generator: torch.Generator | None = None
        """Draws auxiliary tokens (centered loss); seeded by the loop every step."""
        self.old_logprobs: dict[int, torch.Tensor] | None = None
        """The batch's old-policy log-probs per micro-batch, while ``num_iterations`` > 1."""

    def begin_batch(self, seed: int | None) -> None:
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.old_logprobs = {} if self.settings.num_iterations > 1 else None

    def forward_backward(self, rows: list[Row], totals: StepTotals) -> dict[str, float]:
        return accumulate_gradients(
            self.model,
            rows,
            self.settings,
            pad_id=self.pad_id,
            totals=totals,
            old_logprobs=self.old_logprobs,
            generator=self.generator,
        )

    def optim_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.settings.grad_clip)
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}

    def state_dict(self) -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        return {
            "adapter": get_peft_model_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state["adapter"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:  # checkpoints from before the schedule existed ran a constant lr
            self.scheduler.load_state_dict(state["scheduler"])

    def save_adapter(self, path: Path) -> None:
        from turnrl.models import save_adapter

        save_adapter(self.model, path)


def update(trainer: Trainer, rows: list[Row], settings: StepSettings, seed: int | None = None) -> dict[str, float]:
    """All ``train.num_iterations`` passes over one batch of rows, each ending in an optimizer step.

    With several passes, the first pass's log-probs are the old policy's for the later ones.
    ``seed`` seeds the batch's auxiliary-token draws (centered loss). The metrics are the last
    pass's (so ``approx_kl`` is KL(π_old ‖ π) after the updates before it; 0 for one pass), with
    ``grad_norm`` of the last optimizer step and ``passes`` the optimizer steps taken.

    ``train.target_kl`` (KL*): pass k measures approx_kl of the policy after k − 1 updates; when it
    exceeds KL* that pass's gradient is dropped and the step ends (``passes`` = k − 1), as
    Stable-Baselines3's PPO stops its epochs. Pass 1 measures 0, so one pass always runs.
    """
    totals = StepTotals.of(rows, settings.max_tokens_per_turn)
    trainer.begin_batch(seed)
    metrics: dict[str, float] = {}
    sums: dict[str, float] = {}
    grad_norm, passes = 0.0, 0
    for _ in range(settings.num_iterations):
        sums = trainer.forward_backward(rows, totals)
        metrics = losses.finalize_metrics(sums, exclude=("loss",))
        if settings.target_kl is not None and metrics["approx_kl"] > settings.target_kl:
            trainer.zero_grad()  # drifted past the target: this pass is not applied
            break
        grad_norm = trainer.optim_step()
        passes += 1
    metrics.update(loss=sums["loss"], grad_norm=grad_norm, num_tokens=sums["trained_tokens"], passes=float(passes))
    metrics["lr"] = trainer.last_lr
    return metrics


def idle_metrics(settings: StepSettings) -> dict[str, float]:
    """The metrics of a step with no row to train (every group dropped, every turn masked): the keys
    :func:`update` reports for this run's loss, at 0 (the loss over zero tokens), so such a step's row
    has the same columns as every other step's."""
    plan = settings.loss
    none = torch.zeros(1, 0)
    aux = torch.zeros(1, 0, 1) if plan.spec.num_aux is not None else None
    ref = none if plan.beta > 0 else None
    _, sums = losses.per_token_loss(plan, none, none, none, torch.zeros(1), none, aux_logp=aux, ref_logp=ref)
    metrics = losses.finalize_metrics({k: float(v) for k, v in sums.items()})
    metrics.update(loss=0.0, grad_norm=0.0, num_tokens=0.0, passes=0.0)
    return metrics
