"""Several processes: every rank collects the same batch, trains on its shard of rows, gradients are summed.

Launch with accelerate (``accelerate launch --multi_gpu --num_processes N -m turnrl
train CONFIG``, or ``turnrl train --processes N``, which re-launches itself so).
accelerate's launcher starts the processes; :func:`setup` joins them into one
process group through accelerate's ``PartialState`` (``nccl`` on GPUs, ``gloo``
on CPUs).

The design, chosen because it is exact and simple:

* **Collection is sharded.** Each rank collects its share of the step's tasks
  (:func:`task_share`: a contiguous block, so a task's group or tree stays whole
  on one rank), and the episodes are gathered to every rank
  (:func:`gather_episodes`), in the order one process collects them; credit is
  then assigned on the whole gathered batch, on every rank alike. So that the
  gathered episodes are those of one process, every draw is seeded from (step
  seed, task index, branch, turn) rather than from its place in the sampler call
  (``rollout.task_seeds``, on by default under a multi-process launch; one
  process keeps the per-call seeds unless it is set). Generation then scales
  with the ranks. Exception: under FSDP with a sampler that runs the trainer's
  own (sharded) module, collection stays replicated (:func:`shards_collection`).
* **Rows are sharded.** :class:`DistributedTrainer` trains each rank on its
  share of the batch's rows (:func:`shard_rows`), with the normaliser constants
  of the *global* batch (:func:`global_totals`: token and row counts summed over
  ranks, ``max_len`` the maximum), so the ranks' losses add up to the
  single-process loss.
* **Gradients are summed by one ``all_reduce``** of the trainable (LoRA)
  gradients, flattened into one buffer, before clipping. The loss is a sum over
  ranks, so the summed gradient is the single-process gradient, up to float
  summation order. DDP is not used: the trainer computes log-probs from the
  backbone and the output head directly (``turnrl.train.step.token_logprobs``),
  which bypasses a DDP wrapper's ``forward`` and so its gradient hooks, and a
  step makes several backward passes (micro-batches) that need one reduction,
  not one each.
* **Weights stay identical.** The trainable weights are broadcast from rank 0
  at the start, every rank applies the same summed gradient with the same
  optimizer, and a cheap fingerprint check after each step refuses to go on if
  they ever differ — so every rank's sampler refreshes to the same policy.
* **Only rank 0 writes** the run directory (checkpoints, progress, rollouts,
  adapters, reports); :func:`is_main` guards those writes in the loop. Every
  rank reads the same checkpoint on resume.

Exact to float tolerance for every loss except where a step draws random
numbers per row: the centered loss's auxiliary tokens and LoRA dropout are
drawn per rank, so they match the single-process step in distribution only.

**FSDP** (``accelerate launch --config_file configs/accelerate_fsdp.yaml``, or
``turnrl train --processes N --fsdp``): :class:`ShardedTrainer` is the same
trainer with the *frozen base* sharded across ranks by PyTorch's FSDP2
(``fully_shard`` on every decoder layer), so a base too large for one device's
memory fits N of them. What is sharded and what is not:

* Each decoder layer's frozen weights live 1/N per rank; FSDP gathers a layer's
  weights for its forward (and again for its backward) and frees them after.
  The LoRA weights are left out of FSDP (``ignored_params``): they stay whole on
  every rank and are summed by the same ``all_reduce`` as above, so adapters,
  checkpoints, the weight check and the sampler refresh are unchanged. The
  embeddings, final norm and output head (outside the layers) stay whole.
* Gathers are collectives: every rank must run the same forwards and backwards.
  Collection and evaluation through the trainer's module therefore stay
  replicated under FSDP (every rank collects every task, with the same seeds). Training runs a
  *lock-step plan* (:func:`lockstep_plan`): every rank computes the same global
  micro-batches of ``micro_batch_size × N`` rows and takes its share of each; a
  rank whose share is empty runs one placeholder row with no trained token
  (loss 0). Each micro-batch is one forward of the model (one row at a time,
  not shared-prefix packs, whose number of forwards depends on the rows).

DeepSpeed launches (``configs/accelerate_deepspeed_zero3.yaml``) are refused
with a message: ZeRO-3's engine owns the backward and the parameter hooks, and
for a LoRA on a frozen base it shards the same thing FSDP does here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib
from typing import Any

import torch

from turnrl.train.batch import Row
from turnrl.train.step import (
    LocalTrainer,
    StepSettings,
    StepTotals,
    Trainer,
    accumulate_gradients,
    micro_batches,
    pass_groups,
)
from turnrl.types import Episode


def launched_world_size() -> int:
    """Processes the launcher started (``WORLD_SIZE``; 1 without a launcher)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def is_main() -> bool:
    """True on the process that writes the run directory (rank 0, or the only process)."""
    return rank() == 0


def active() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and launched_world_size() > 1


def _env_flag(var: str) -> bool:
    return os.environ.get(var, "false").lower() == "true"


def fsdp_launched() -> bool:
    """accelerate launched these processes with ``distributed_type: FSDP``."""
    return _env_flag("ACCELERATE_USE_FSDP")


def _refuse_unsupported_launches() -> None:
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise ValueError(
            "accelerate launched turnrl with DeepSpeed, which turnrl does not run (ZeRO-3's engine owns the"
            " backward; for a LoRA on a frozen base it shards what FSDP shards). Launch with"
            " configs/accelerate_fsdp.yaml (the base sharded across processes) or configs/accelerate_multi_gpu.yaml"
        )
    if fsdp_launched() and _env_flag("FSDP_OFFLOAD_PARAMS"):
        raise ValueError(
            "accelerate launched turnrl with FSDP and fsdp_offload_params: true; turnrl shards the base across"
            " processes but does not offload it to CPU memory. Set fsdp_offload_params: false in the accelerate config"
        )


def setup() -> None:
    """Join the launcher's processes into one process group (a no-op for one process)."""
    if launched_world_size() <= 1 or active():
        return
    _refuse_unsupported_launches()
    from accelerate import PartialState

    PartialState(cpu=not torch.cuda.is_available())


def barrier() -> None:
    if active():
        torch.distributed.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` run on rank 0 only, its result sent to every rank.

    If it raises, rank 0 raises (and reports); the other ranks exit quietly with status 2.
    """
    if not active():
        return fn(*args, **kwargs)
    if is_main():
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            broadcast_object(("failed", None))
            raise
        return broadcast_object(("ok", result))[1]
    status, result = broadcast_object(None)
    if status != "ok":
        raise SystemExit(2)  # rank 0 says why
    return result


def shards_collection(shares_module: bool) -> bool:
    """Each rank collects its own share of a step's tasks: under a multi-process launch, except FSDP with a
    sampler that generates through the trainer's module (its sharded layers' forwards are collectives
    that every rank must run together, so that collection stays replicated)."""
    return launched_world_size() > 1 and not (fsdp_launched() and shares_module)


def task_share(n: int, rank: int, world: int) -> range:
    """The indices of ``n`` tasks that ``rank`` collects: a contiguous block; block sizes differ by at most one.

    In rank order the blocks are ``range(n)``, so the ranks' episodes, gathered in rank order, are in the
    order one process collects them.
    """
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def gather_episodes(episodes: list[Episode]) -> list[Episode]:
    """Every rank's ``episodes`` on every rank, concatenated in rank order (``all_gather_object``)."""
    if not active():
        return list(episodes)
    parts: list[list[Episode] | None] = [None] * launched_world_size()
    torch.distributed.all_gather_object(parts, episodes)
    return [ep for part in parts for ep in part or []]


def shard_rows(rows: list[Row], rank: int, world: int) -> list[Row]:
    """This rank's rows: dealt round-robin in order of trained tokens (longest first), so shards balance.

    Deterministic in ``rows`` alone; the shards partition ``rows``.
    """
    order = sorted(range(len(rows)), key=lambda i: (-sum(rows[i].mask), -len(rows[i].ids), i))
    mine = sorted(order[rank::world])
    return [rows[i] for i in mine]


def _local_totals(rows: list[Row], max_tokens: int) -> StepTotals:
    return StepTotals.of(rows, max_tokens) if rows else StepTotals(0, 0, 0)


def global_totals(shard: list[Row], max_tokens: int, device: torch.device | None = None) -> StepTotals:
    """The batch-wide constants of the union of every rank's shard: tokens and rows summed, max_len the maximum."""
    local = _local_totals(shard, max_tokens)
    if not active():
        return local
    counts = torch.tensor([local.tokens, local.rows], dtype=torch.int64, device=device)
    longest = torch.tensor([local.max_len], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(counts)
    torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
    return StepTotals(int(counts[0]), int(counts[1]), int(longest[0]))


def all_reduce_sums(sums: dict[str, float], device: torch.device | None = None) -> dict[str, float]:
    """Metric sums added over ranks (a rank with no rows contributes zeros for every key)."""
    if not active():
        return dict(sums)
    keys: list[list[str]] = [[] for _ in range(launched_world_size())]
    torch.distributed.all_gather_object(keys, sorted(sums))
    names = sorted({k for ks in keys for k in ks})
    values = torch.tensor([float(sums.get(k, 0.0)) for k in names], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values)
    return dict(zip(names, values.tolist(), strict=True))


def _any_rank(flag: bool, device: torch.device | None = None) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    if active():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


class DistributedTrainer(LocalTrainer):
    """:class:`LocalTrainer` on one rank's shard of rows, with the global normalisers and summed gradients."""

    def __init__(self, model, settings: StepSettings, pad_id: int) -> None:
        super().__init__(model, settings, pad_id)
        self.rank, self.world = rank(), launched_world_size()
        self.device = next(model.parameters()).device
        self._reduced = False
        with torch.no_grad():  # every rank starts from rank 0's weights
            for p in self.params:
                torch.distributed.broadcast(p.data, src=0)

    def shard(self, rows: list[Row]) -> tuple[list[Row], list[list[Row]] | None]:
        """This rank's rows and their micro-batches (None: the usual :func:`micro_batch_plan` of them)."""
        return shard_rows(rows, self.rank, self.world), None

    def forward_backward(self, rows: list[Row], totals: StepTotals) -> dict[str, float]:
        """``rows`` is the whole batch (the same on every rank); this rank trains on its shard of it."""
        shard, plan = self.shard(rows)
        self._check_shards(shard, totals)
        sums: dict[str, float] = {}
        if shard or plan:
            sums = accumulate_gradients(
                self.model,
                shard,
                self.settings,
                pad_id=self.pad_id,
                totals=totals,
                old_logprobs=self.old_logprobs,
                generator=self._rank_generator(),
                plan=plan,
            )
        self._reduced = False
        return all_reduce_sums(sums, self.device)

    def _check_shards(self, shard: list[Row], totals: StepTotals) -> None:
        """The ranks' shards together must be the batch every rank holds (gathered, or collected alike)."""
        totals_global = global_totals(shard, self.settings.max_tokens_per_turn, self.device)
        if _any_rank(totals_global != totals, self.device):
            raise RuntimeError(
                f"the ranks hold different batches (this rank: {totals}, the ranks' shards together:"
                f" {totals_global}); every rank must train on the same episodes — with replicated collection"
                " (FSDP), check that sampling is deterministic on this hardware (same seeds, same weights)"
            )

    def _rank_generator(self) -> torch.Generator | None:
        """Each rank draws its own auxiliary tokens (centered loss)."""
        generator = self.generator
        if generator is not None and self.rank > 0:
            generator = torch.Generator().manual_seed((generator.initial_seed() * 1_000_003 + self.rank) % 2**63)
        return generator

    def reduce_gradients(self) -> None:
        """Sum the accumulated gradients over ranks (once per optimizer step)."""
        if self._reduced:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, g in zip(self.params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        self._reduced = True

    def optim_step(self) -> float:
        self.reduce_gradients()
        grad_norm = super().optim_step()
        self._reduced = False
        self.check_weights_agree()
        return grad_norm

    def save_adapter(self, path) -> None:
        if self.rank == 0:  # every rank holds the same adapter; rank 0 writes it
            super().save_adapter(path)

    def weights_fingerprint(self) -> int:
        """A CRC of the trainable weights' bytes: equal on every rank while the ranks agree."""
        crc = 0
        for p in self.params:
            crc = zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
        return crc

    def check_weights_agree(self) -> None:
        mine = self.weights_fingerprint()
        t = torch.tensor([mine, -mine], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        if int(t[0]) != mine or int(-t[1]) != mine:
            raise RuntimeError(
                "the ranks' LoRA weights differ after an optimizer step; their samplers would diverge."
                " This is a bug (or non-deterministic hardware): report it with the config"
            )


def placeholder_row(like: Row) -> Row:
    """A two-token row with no trained token: its loss, gradient and metric sums are 0."""
    n = min(2, len(like.ids))
    ids, lps = like.topk_ids, like.topk_logprobs
    topk = (ids[:n], lps[:n]) if ids is not None and lps is not None else (None, None)
    return Row(like.ids[:n], [0] * n, [0.0] * n, like.behavior_logprobs[:n], like.turn, "", *topk)


def lockstep_plan(rows: list[Row], settings: StepSettings, rank: int, world: int) -> list[list[Row]]:
    """This rank's micro-batches when every rank must run the same forwards and backwards (FSDP).

    Every rank builds the same global plan from the whole batch: per turn index when
    decomposing, rows longest first, in micro-batches of ``micro_batch_size × world`` rows;
    rank r takes rows r, r + world, ... of each. A rank with no row in a micro-batch gets a
    :func:`placeholder_row`. The real rows of all ranks' plans partition ``rows``.
    """
    size = settings.micro_batch_size * world
    plan = []
    for group in pass_groups(rows, settings.decompose_turns):
        group = sorted(group, key=lambda r: (-len(r.ids), -sum(r.mask)))
        for chunk in micro_batches(group, size):
            plan.append(chunk[rank::world] or [placeholder_row(chunk[0])])
    return plan


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class is in ``_no_split_modules`` (or
    ``$FSDP_TRANSFORMER_CLS_TO_WRAP``, comma-separated, as accelerate's config sets it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or ",".join(getattr(base, "_no_split_modules", None) or [])
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    layers = [m for m in base.modules() if type(m).__name__ in wanted]
    if not layers:
        raise ValueError(
            f"FSDP: no decoder layers found in {type(base).__name__} (looked for {sorted(wanted) or 'nothing'});"
            " set fsdp_transformer_layer_cls_to_wrap in the accelerate config to the model's layer class"
        )
    return layers


class ShardedTrainer(DistributedTrainer):
    """:class:`DistributedTrainer` with each decoder layer's frozen weights sharded over the ranks (FSDP2)."""

    def __init__(self, model, settings: StepSettings, pad_id: int) -> None:
        from torch.distributed.fsdp import fully_shard

        # one forward per micro-batch (the row-at-a-time path) keeps the ranks' gathers paired
        if settings.shared_prefix:
            logging.getLogger(__name__).warning(
                "train.shared_prefix: true is turned off under FSDP (the sharded trainer runs one forward per"
                " micro-batch so the ranks' gathers pair up); set train.shared_prefix: false to silence this"
            )
            settings = dataclasses.replace(settings, shared_prefix=False)
        super().__init__(model, settings, pad_id)
        reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() != "false"
        for layer in decoder_layers(model):
            trainable = {p for p in layer.parameters() if p.requires_grad}
            fully_shard(layer, reshard_after_forward=reshard, ignored_params=trainable)

    def shard(self, rows: list[Row]) -> tuple[list[Row], list[list[Row]] | None]:
        """This rank's share of the :func:`lockstep_plan` (placeholder rows are not in the shard)."""
        plan = lockstep_plan(rows, self.settings, self.rank, self.world)
        return [r for mb in plan for r in mb if any(r.mask)], plan


def make_trainer(model, settings: StepSettings, pad_id: int) -> Trainer:
    """The trainer for this process: :class:`ShardedTrainer` under an FSDP launch,
    :class:`DistributedTrainer` under another multi-process launch, else local."""
    if active():
        return (ShardedTrainer if fsdp_launched() else DistributedTrainer)(model, settings, pad_id)
    return LocalTrainer(model, settings, pad_id)
