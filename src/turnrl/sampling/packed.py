"""A Llama-family forward over weights packed for oneDNN, for the HF sampler on CPU (``sampler.fast_decode``).

At ~16 rows a decode step multiplies a ``[16, d]`` activation by every weight once, so its time is the
weights' read. ``torch.nn.functional.linear`` hands MKL the ``[out, in]`` weight, which it repacks at every
call: the weights stream at ~5 GB/s. Here every weight is packed once for oneDNN's matmul
(``torch.ops.mkldnn._reorder_linear_weight``), and q/k/v and gate/up are concatenated so that a layer's
input is multiplied by them in one pass. The loop over the layers is written out (no module calls, mask
objects or cache classes); per layer, with the formulas of transformers' ``LlamaForCausalLM``:

    x = RMSNorm(h);  [q | k | v] = x W_qkvᵀ;  q, k = RoPE(q, k);  K[:, :, t], V[:, :, t] = k, v
    h = h + Attention(q, K, V) W_oᵀ;  x = RMSNorm(h);  [g | u] = x W_guᵀ;  h = h + (SiLU(g) · u) W_downᵀ

RMSNorm in float32; RoPE from the model's own ``inv_freq`` and attention scaling, ``rotate_half(x) · sin``
computed as ``swap(x) · [−sin₁, sin₂]`` (the same products); grouped-query attention without repeating the
keys/values (the G query heads of a key/value head are G·T query rows); logits only at each row's last
position.

Shared prefix (cascade attention): the keys/values of a prefix every row shares are kept once
(``[1, KV, P, D]``) instead of once per row. Attention splits over the two parts: the prefix's softmax
output ``o_p`` and log-sum-exp ``ℓ_p = log Σ_{j ≤ P} exp(s_j)`` come from one attention call for all rows'
queries at once, the row's own columns' scores ``s_j`` from a matmul, and

    softmax over [ℓ_p, s_{P+1}, …] = [w_p, w_{P+1}, …],   out = w_p · o_p + Σ_{j > P} w_j v_j

which is the attention over all columns (``exp(ℓ_p) = Σ_{j ≤ P} exp(s_j)`` and ``o_p`` is the prefix's
weighted mean). So each row reads the prefix's keys/values once per step with all the others, not its own copy.

The result is transformers' forward up to float rounding (the matmuls accumulate in another order: the
embedded model's logits agree to ~1e-4 of values ~30), so the same tokens at T = 0 except where rounding
breaks a near-tie, and log-probs within ~1e-5 of the trainer's.

LoRA and versions of the weights: a LoRA layer runs as the trainer's does, ``x Wᵀ + s · (x Aᵀ) Bᵀ``, with
the frozen ``W`` packed once and the adapters' small matrices taken at each :meth:`PackedDecoder.refresh` (a
new version: an optimizer step, a refresh, another stale snapshot), the ``A`` of q/k/v concatenated and their
``s · B`` placed block-diagonally so that the group's low-rank part is two small matmuls. Nothing large is
repacked per version: only a frozen weight that changes (its storage or version counter) or one that is
itself trainable (full fine-tuning) is packed again.

``bfloat16`` (``sampler.decode_dtype``): the packed weights in bfloat16 (oneDNN's AVX-512 bf16 kernels),
each matmul's input rounded to bfloat16 and its output taken back to float32; the norms, RoPE, attention,
the residual stream and the logits stay float32. Half the bytes to read, but not the trainer's weights: the
log-probs differ from the trainer's by the rounding of every matmul (the loss's ``mismatch`` correction is
for that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama",)
_STATIC_ROPE = ("default", "linear", "llama3")
"""RoPE types whose frequencies do not depend on the sequence length (``dynamic``/``longrope`` rescale per call)."""
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""SDPA's CPU kernel, called for its log-sum-exp too (the public function returns only the output)."""


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_reason(model) -> str | None:
    """Why :class:`PackedDecoder` cannot run ``model`` (None: it can)."""
    base = _base(model)
    cfg = base.config
    if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if next(base.parameters()).device.type != "cpu":
        return "not on the CPU (oneDNN's packed matmul is a CPU kernel)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    if any(type(p).__name__ == "DTensor" for p in base.parameters()):
        return "weights sharded across processes (FSDP's DTensor); the packed matmul needs whole local weights"
    if next(base.parameters()).dtype != torch.float32:
        return f"weights in {next(base.parameters()).dtype} (supported: float32)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (supported: silu)"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE:
        return f"RoPE type {rope!r} (supported: {', '.join(_STATIC_ROPE)})"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    for layer in base.model.layers:
        for linear in (*_attention_linears(layer), *_mlp_linears(layer)):
            if (reason := _lora_unsupported(linear)) is not None:
                return reason
    return _lora_unsupported(base.get_output_embeddings())


def _attention_linears(layer) -> tuple:
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _mlp_linears(layer) -> tuple:
    m = layer.mlp
    return m.gate_proj, m.up_proj, m.down_proj


def _adapters(linear) -> list[str]:
    """The active adapters of a peft LoRA layer (none for a plain linear layer)."""
    if not hasattr(linear, "get_base_layer") or linear.disable_adapters:
        return []
    return [a for a in linear.active_adapters if a in linear.lora_A]


def _lora_unsupported(linear) -> str | None:
    """Why a layer is not one this module can run: a linear layer, or a vanilla peft LoRA layer over one."""
    if not hasattr(linear, "get_base_layer"):
        return None if isinstance(linear, torch.nn.Linear) else f"{type(linear).__name__} is not a linear layer"
    if not isinstance(linear.get_base_layer(), torch.nn.Linear):
        return f"a LoRA layer over {type(linear.get_base_layer()).__name__}"
    if linear.merged:
        return "a merged LoRA layer"
    for a in _adapters(linear):
        if a in getattr(linear, "lora_variant", {}) or linear.lora_B[a].bias is not None:
            return f"LoRA adapter {a!r} is not vanilla LoRA (a variant such as DoRA, or a bias)"
    if getattr(linear, "fan_in_fan_out", False):
        return "a LoRA layer with fan_in_fan_out"
    return None


def _base_linear(linear) -> torch.nn.Linear:
    return linear.get_base_layer() if hasattr(linear, "get_base_layer") else linear


class PackedLinear:
    """``x Wᵀ + b + (x Aᵀ) Bᵀ`` through oneDNN: ``W`` the concatenation of the layers' base weights, packed
    once; ``A``/``B`` their LoRA adapters' (``A`` stacked, ``s · B`` block-diagonal), None without LoRA."""

    ROWS = 16
    """The row count the packing is tuned for (a hint: any row count runs)."""

    def __init__(self, linears: tuple, dtype: torch.dtype) -> None:
        bases = [_base_linear(m) for m in linears]
        weight = torch.cat([b.weight.detach() for b in bases]).to(dtype).contiguous()
        self.bias = None
        if any(b.bias is not None for b in bases):
            parts = [b.bias.detach() if b.bias is not None else b.weight.new_zeros(b.out_features) for b in bases]
            self.bias = torch.cat(parts).to(dtype)
        self.dtype, self.out_features = dtype, weight.shape[0]
        self.nbytes = weight.numel() * weight.element_size()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.ROWS)
        self.low_rank(linears)

    def low_rank(self, linears: tuple) -> None:
        """Take the layers' current LoRA adapters (float32: the trainable part is not rounded)."""
        a_rows, blocks, row = [], [], 0
        for m in linears:
            out = _base_linear(m).out_features
            for a in _adapters(m):
                a_rows.append(m.lora_A[a].weight.detach())
                blocks.append((row, out, m.lora_B[a].weight.detach() * m.scaling[a]))
            row += out
        if not a_rows:
            self.lora = None
            return
        A = torch.cat(a_rows).float()
        B = A.new_zeros(row, A.shape[0])
        col = 0
        for start, out, b in blocks:
            B[start : start + out, col : col + b.shape[1]] = b
            col += b.shape[1]
        self.lora = (A, B)

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """``x Wᵀ + b`` plus the low-rank part and ``add`` (fused into the matmul in float32), in float32."""
        if self.lora is not None:
            low = F.linear(F.linear(x, self.lora[0]), self.lora[1])
            add = low if add is None else add + low
        if add is not None and self.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise.binary(x, add, self.weight, self.bias, "add")
        y = torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.weight, self.bias, "none", [], "").float()
        return y if add is None else add + y


def _frozen_key(linears: tuple) -> tuple | None:
    """Storage and version of every base tensor when none is trainable (None: one is, so it is packed again at
    each version; a stale snapshot is copied in without a version change)."""
    bases = [_base_linear(m) for m in linears]
    tensors = [t for b in bases for t in (b.weight, b.bias) if t is not None]
    if any(t.requires_grad for t in tensors):
        return None
    return tuple((t.data_ptr(), t._version) for t in tensors)


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: PackedLinear
    o: PackedLinear
    norm2: torch.Tensor
    gate_up: PackedLinear
    down: PackedLinear


class PackedDecoder:
    """The model's forward over packed weights: :meth:`forward` runs new tokens of every row against
    preallocated key/value buffers and returns the logits at each row's last position."""

    def __init__(self, model, dtype: torch.dtype = torch.float32) -> None:
        base = _base(model)
        cfg = base.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        self._packed: dict[int, tuple[tuple | None, PackedLinear]] = {}
        self.layers: list[_Layer] = []
        rotary = base.model.rotary_emb
        self.inv_freq, self.rope_scale = rotary.inv_freq.detach().float(), rotary.attention_scaling
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self.refresh(model)

    def _pack(self, *linears) -> PackedLinear:
        """``linears`` packed together: their packing of before when their base weights are frozen and unchanged
        (with their adapters taken again), else packed now."""
        key = _frozen_key(linears)
        kept = self._packed.get(id(linears[0]))
        if kept is not None and key is not None and kept[0] == key:
            kept[1].low_rank(linears)
            return kept[1]
        packed = PackedLinear(linears, self.dtype)
        self._packed[id(linears[0])] = (key, packed)
        return packed

    def refresh(self, model) -> None:
        """Take the model's current weights: its adapters, and any base weight that changed or is trainable."""
        base = _base(model)
        self.embed = base.model.embed_tokens.weight.detach()
        self.layers = [
            _Layer(
                layer.input_layernorm.weight.detach(),
                self._pack(*_attention_linears(layer)[:3]),
                self._pack(layer.self_attn.o_proj),
                layer.post_attention_layernorm.weight.detach(),
                self._pack(*_mlp_linears(layer)[:2]),
                self._pack(layer.mlp.down_proj),
            )
            for layer in base.model.layers
        ]
        self.norm = base.model.norm.weight.detach()
        self.head = self._pack(base.get_output_embeddings())

    @property
    def nbytes(self) -> int:
        """Bytes of packed weights a decode step reads (every layer's and the output head's)."""
        linears = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(m.nbytes for m in (*linears, self.head))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``[−sin₁, sin₂]`` at ``positions`` (``[..., D]``), from a table grown as needed; each entry
        is transformers' ``cos(p · inv_freq)`` (one float32 product, then the same scaling)."""
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:
            size = max(need, 2 * self._cos.shape[0], 512)
            freqs = torch.arange(size, dtype=torch.float32)[:, None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos() * self.rope_scale
            sin = emb.sin() * self.rope_scale
            half = self.head_dim // 2
            self._sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return self._cos[positions], self._sin[positions]

    def new_cache(self, rows: int, columns: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``[rows, kv_heads, columns, head_dim]`` key and value buffers (unfilled)."""
        shape = (rows, self.kv_heads, columns, self.head_dim)
        return [(torch.empty(shape), torch.empty(shape)) for _ in self.layers]

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: list[tuple[torch.Tensor, torch.Tensor]],
        start: int,
        valid: torch.Tensor,
        prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        logits: bool = True,
    ) -> torch.Tensor | None:
        """Logits ``[B, V]`` after ``ids`` (``[B, T]``, written at columns ``start … start+T−1`` of ``cache``);
        None without ``logits`` (only the keys/values are wanted).

        ``positions`` are the tokens' RoPE positions, ``valid`` (``[B, start+T]`` bool) says which of the
        row's columns are tokens (False: padding), ``prefix`` (per layer ``[1, KV, P, D]``) is a shared
        prefix every row attends to before its own columns. A new token attends to the prefix, to its row's
        valid columns up to its own, and always to itself (a padding query's output is never used; attending
        to itself keeps it finite). Its keys/values are written into ``cache`` in place.
        """
        B, T = ids.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        G, end = H // KV, start + T
        cos, sin = self._rope(positions)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]
        allowed = torch.ones(T, end, dtype=torch.bool).tril(start)
        allowed = valid[:, None, :] & allowed
        allowed[:, :, start:] |= torch.eye(T, dtype=torch.bool)
        # the G query heads of a key/value head as G·T query rows (g-major): [B, 1, G·T, end]
        bias = torch.zeros(B, T, end).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None].expand(B, G, T, end).reshape(B, 1, G * T, end)
        h = F.embedding(ids, self.embed)
        for k, (layer, (keys, values)) in enumerate(zip(self.layers, cache, strict=True)):
            x = torch.rms_norm(h, (h.shape[-1],), layer.norm1, self.eps)
            qkv = layer.qkv(x).view(B, T, H + 2 * KV, D)
            qk = qkv[:, :, : H + KV]
            swapped = qk.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
            qk = qk * cos + swapped * sin
            keys[:, :, start:end] = qk[:, :, H:].transpose(1, 2)
            values[:, :, start:end] = qkv[:, :, H + KV :].transpose(1, 2)
            q = qk[:, :, :H].reshape(B, T, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * T, D)
            att = self._attend(q, keys[:, :, :end], values[:, :, :end], bias, prefix[k] if prefix else None)
            att = att.view(B, KV, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)
            h = layer.o(att, add=h)
            x = layer.gate_up(torch.rms_norm(h, (h.shape[-1],), layer.norm2, self.eps))
            gate, up = x.chunk(2, dim=-1)
            h = layer.down(F.silu(gate) * up, add=h)
        return self.head(torch.rms_norm(h[:, -1], (h.shape[-1],), self.norm, self.eps)) if logits else None

    def _attend(self, q, keys, values, bias, prefix) -> torch.Tensor:
        """Attention of ``q`` (``[B, KV, GT, D]``) over the shared ``prefix`` and the row's own columns."""
        if prefix is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
        B, KV, GT, D = q.shape
        out_p, lse_p = _FLASH(q.transpose(0, 1).reshape(1, KV, B * GT, D), *prefix)
        out_p = out_p.view(KV, B, GT, D).transpose(0, 1)
        lse_p = lse_p.view(KV, B, GT, 1).transpose(0, 1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(D**-0.5).add_(bias)
        weights = torch.cat([lse_p, scores], dim=-1).softmax(-1)
        return torch.matmul(weights[..., 1:], values).addcmul_(out_p, weights[..., :1])
