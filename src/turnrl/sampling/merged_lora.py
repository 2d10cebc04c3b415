"""Generation with each LoRA adapter merged into its base weight (``sampler.merge_lora``).

A LoRA layer computes ``x Wᵀ + s · (x Aᵀ) Bᵀ``: two more matmuls and two elementwise passes over its
output per layer and token, ~25 % of a prefill forward of the embedded model on CPU and ~15 % of a decode
step. While the sampler generates, each LoRA layer's base weight is replaced by ``W' = W + s · B A``
(peft's ``get_delta_weight``) and the layer marked merged, so its forward is the base layer's one
matmul; afterwards the original weight tensor is put back (the same tensor: the frozen base is never
modified, unlike peft's ``merge``/``unmerge``, whose subtraction does not restore it exactly).

The merged weights are computed once per version of the trainable weights (the sampler's key) and kept
until they change. ``x W'ᵀ`` equals ``x Wᵀ + s (x Aᵀ) Bᵀ`` up to float rounding (the logits agree to
~1e-6), so a merged sampler's log-probs are the trainer's within rounding; a T > 0 draw can differ from the
unmerged one only where that rounding moves a token across the draw's threshold.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch


def _plain_weight(layer) -> bool:
    """Whether the layer's base weight is an ordinary local tensor. A sharded one (FSDP's DTensor, all-gathered by
    hooks at each forward) is not merged: its layer keeps peft's forward."""
    from torch.distributed.tensor import DTensor

    weight = getattr(layer.get_base_layer(), "weight", None)
    return isinstance(weight, torch.Tensor) and not isinstance(weight, DTensor) and not isinstance(weight.data, DTensor)


def lora_layers(model: torch.nn.Module) -> list:
    """The model's unmerged, enabled peft LoRA layers over a plain local weight (empty for a model without LoRA)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # peft absent: no LoRA layers
        return []
    return [
        m
        for m in model.modules()
        if isinstance(m, LoraLayer)
        and not m.merged
        and not m.disable_adapters
        and _plain_weight(m)
        and any(a in m.lora_A for a in m.active_adapters)
    ]


class MergedLoRA:
    """Each LoRA layer's merged weight, kept per weights key; :meth:`applied` swaps them in."""

    def __init__(self) -> None:
        self._key: Sequence | None = None
        self._merged: list[tuple[Any, torch.Tensor]] = []  # (a peft LoraLayer, its merged weight)

    def _weights(self, model: torch.nn.Module, key: Sequence) -> list[tuple[Any, torch.Tensor]]:
        if key != self._key:
            self._merged = []  # free the previous version's tensors before computing the next
            with torch.no_grad():
                for layer in lora_layers(model):
                    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
                    weight = layer.get_base_layer().weight
                    merged = weight.detach().clone()
                    for a in adapters:
                        merged += layer.get_delta_weight(a).to(merged.dtype)
                    self._merged.append((layer, merged))
            self._key = key
        return self._merged

    @contextmanager
    def applied(self, model: torch.nn.Module, key: Sequence) -> Iterator[None]:
        """Within: every LoRA layer runs as its base layer with the merged weight."""
        saved = []
        try:
            for layer, merged in self._weights(model, key):
                base = layer.get_base_layer()
                saved.append((layer, base.weight.data, list(layer.merged_adapters)))
                base.weight.data = merged
                layer.merged_adapters = [a for a in layer.active_adapters if a in layer.lora_A]
            yield
        finally:
            for layer, data, merged_adapters in saved:
                layer.get_base_layer().weight.data = data
                layer.merged_adapters = merged_adapters
