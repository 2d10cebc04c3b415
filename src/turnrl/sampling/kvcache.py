"""Key/value caches for transformers' ``generate`` in the HF sampler: per-layer views of a cache, and a cache whose
buffers are allocated once per call (``sampler.preallocate_kv``) instead of grown by concatenation at every decode
step (the same keys/values, so the same logits bit for bit)."""

from __future__ import annotations

import torch


def layer_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each ``[B, H, T, D]``, of a transformers cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def preallocated_layer_class():
    """:class:`transformers.cache_utils.DynamicLayer` with its keys/values in preallocated buffers (built on first use:
    this module is imported before transformers is needed)."""
    global _PREALLOCATED_LAYER
    if _PREALLOCATED_LAYER is not None:
        return _PREALLOCATED_LAYER
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A growing cache layer whose ``[B, H, capacity, D]`` buffers are allocated once (on the first ``update``,
        or given filled up to ``length``): ``update`` writes the new positions in place and ``keys``/``values`` are
        views of the filled part. ``DynamicLayer`` concatenates instead, copying the whole cache at every decode
        step; the views have the shapes and values the concatenation would have."""

        def __init__(self, capacity: int, keys=None, values=None, length: int = 0) -> None:
            super().__init__()
            self.capacity, self._length = capacity, 0
            self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
            if keys is not None:
                self.device, self.is_initialized = keys.device, True
                self._buffers, self._length = (keys, values), length
                self._view()

        def _view(self) -> None:
            if self._buffers is None:
                return
            keys, values = self._buffers
            self.keys, self.values = keys[:, :, : self._length], values[:, :, : self._length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if self._buffers is None:
                b, h, _, d = key_states.shape
                self.device, self.is_initialized = key_states.device, True
                self._buffers = (
                    key_states.new_empty(b, h, self.capacity, d),
                    value_states.new_empty(b, h, self.capacity, d),
                )
            keys, values = self._buffers
            end = self._length + key_states.shape[-2]
            if end > keys.shape[-2]:  # past the capacity (not expected): grow, as DynamicLayer would
                grow = [*keys.shape[:2], end - keys.shape[-2], keys.shape[3]]
                keys = torch.cat([keys, keys.new_zeros(grow)], dim=-2)
                values = torch.cat([values, values.new_zeros(grow)], dim=-2)
                self._buffers = (keys, values)
            keys[:, :, self._length : end] = key_states
            values[:, :, self._length : end] = value_states
            self._length = end
            self._view()
            return self.keys, self.values

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self._length = self.keys.shape[-2]

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("a preallocated cache is built for its batch")

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            raise NotImplementedError("a preallocated cache is built for its batch")

    _PREALLOCATED_LAYER = PreallocatedLayer
    return PreallocatedLayer


_PREALLOCATED_LAYER: type | None = None


def preallocated_cache(capacity: int, filled: list[tuple[torch.Tensor, torch.Tensor]] | None = None, rows: int = 0):
    """A ``DynamicCache`` of preallocated layers of ``capacity`` positions: empty, or starting with ``filled``
    (per layer ``[R, H, L, D]`` keys and values; R = 1 is repeated for ``rows`` rows)."""
    from functools import partial

    from transformers import DynamicCache

    layer = preallocated_layer_class()
    cache = DynamicCache()
    if filled is None:
        cache.layer_class_to_replicate = partial(layer, capacity)
        return cache
    cache.layer_class_to_replicate = None
    cache.layers = []
    for keys, values in filled:
        n = keys.shape[-2]
        bufs = []
        for t in (keys, values):
            buf = t.new_empty(rows or t.shape[0], t.shape[1], capacity, t.shape[3])
            buf[:, :, :n] = t
            bufs.append(buf)
        cache.layers.append(layer(capacity, *bufs, length=n))
    return cache
