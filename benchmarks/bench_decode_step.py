"""One decode step of the embedded model at 16 rows: transformers' forward against the packed decoder; interleaved.

Workload: SmolLM2-135M (30 layers, hidden 576, 9/3 heads, MLP 1536, vocab 49,152, tied head) with a fresh
LoRA merged into its weights (what the HF sampler generates with), ``--rows`` rows (16) whose caches hold
``--context`` (160) positions: a shared ``--context − 20``-token prompt and 20 tokens of each row's own.
Every arm computes the logits of one new token per row and writes its keys/values into a preallocated cache:

- ``hf``: the model's forward as the HF sampler runs it without ``fast_decode`` (transformers' module stack,
  its preallocated cache layer, ``F.linear`` on the ``[out, in]`` weights);
- ``loop``: :class:`turnrl.sampling.decode.PackedDecoder`'s hand-written loop with plain ``F.linear`` on the
  concatenated q/k/v and gate/up weights (not packed): the loop's share of the gain;
- ``packed``: the same loop over weights packed once for oneDNN (``sampler.fast_decode``, the default);
- ``packed_bf16``: ``packed`` with bfloat16 weights (``sampler.decode_dtype: bfloat16``).

Printed per arm: the median step over ``--rounds`` rounds (each round ``--steps`` steps per arm, the arms
alternating), the spread across rounds, the weights' streaming rate (the bytes of the weights a step reads /
its time), and the largest logit difference from ``hf``. Measured in the same run: the machine's read
bandwidth (sum of a 1 GiB float32 tensor, best of 3), its float32 matmul rate on cache-resident operands
(``[4096, 576] @ [576, 1536]``, best of 5), and from them the step's floors: the fp32 compute floor
``rows × 2 × (parameters) / matmul rate`` and the weight-read floor ``weight bytes / read bandwidth``. The
``packed`` arm's time is split into its matmuls (the same packed matmuls on the step's shapes, timed
alone) and the rest (norms, RoPE, attention, cache writes).

Run (under the machine's lock, ~1-2 min): ``PYTHONPATH=src python benchmarks/bench_decode_step.py
[--rounds 5] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from _common import load, matmul_rate, read_bandwidth  # the script's directory is on sys.path

from turnrl.config import ModelConfig, parse_config
from turnrl.models import attach_lora, load_model
from turnrl.sampling.kvcache import preallocated_cache
from turnrl.sampling.merged_lora import MergedLoRA
from turnrl.sampling.packed import PackedDecoder


class PlainLinear:
    """``x Wᵀ`` by ``F.linear`` on the unpacked weight: the ``loop`` arm's matmul."""

    def __init__(self, packed, weight: torch.Tensor) -> None:
        self.weight, self.nbytes = weight, packed.nbytes

    def __call__(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return y if add is None else add + y


def merged_weight(linear) -> torch.Tensor:
    """The layer's weight with its LoRA merged (``W + s · B A``, peft's ``get_delta_weight``)."""
    if not hasattr(linear, "get_base_layer"):
        return linear.weight.detach()
    weight = linear.get_base_layer().weight.detach().clone()
    for a in linear.active_adapters:
        weight += linear.get_delta_weight(a)
    return weight


def plain_decoder(model, packed: PackedDecoder) -> PackedDecoder:
    """A copy of ``packed`` whose linear layers are :class:`PlainLinear` over the merged weights."""
    from copy import copy

    from turnrl.sampling.packed import _attention_linears, _mlp_linears

    plain = copy(packed)
    plain.layers = []
    for layer, src in zip(packed.layers, model.get_base_model().model.layers, strict=True):
        q, k, v, o = (merged_weight(m) for m in _attention_linears(src))
        g, u, d = (merged_weight(m) for m in _mlp_linears(src))
        new = copy(layer)
        new.qkv, new.o = PlainLinear(layer.qkv, torch.cat([q, k, v])), PlainLinear(layer.o, o)
        new.gate_up, new.down = PlainLinear(layer.gate_up, torch.cat([g, u])), PlainLinear(layer.down, d)
        plain.layers.append(new)
    plain.head = PlainLinear(packed.head, model.get_output_embeddings().weight.detach())
    return plain


def matmul_seconds(decoder: PackedDecoder, rows: int, repeats: int = 3) -> float:
    """The packed arm's matmuls alone: every packed linear of a step on ``[rows, in]`` inputs (best of ``repeats``)."""
    calls = []
    for layer in decoder.layers:
        for linear, n_in in ((layer.qkv, None), (layer.o, None), (layer.gate_up, None), (layer.down, None)):
            calls.append((linear, n_in))
    head = decoder.head
    d = decoder.embed.shape[1]
    ff = decoder.layers[0].gate_up.out_features // 2
    x_d, x_ff = torch.randn(rows, 1, d), torch.randn(rows, 1, ff)
    x_att = torch.randn(rows, 1, decoder.heads * decoder.head_dim)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for layer in decoder.layers:
            layer.qkv(x_d)
            layer.o(x_att, add=x_d)
            layer.gate_up(x_d)
            layer.down(x_ff, add=x_d)
        head(x_d[:, 0])
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = load_model(ModelConfig(name="embedded"))
    model = attach_lora(model, parse_config({}).model.lora)
    with torch.no_grad():  # a LoRA that is not zero (a fresh one's B is), so the merge matters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)
    model.eval()
    B, L = args.rows, args.context
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (1, L - 20), generator=g).expand(B, -1)
    ids = torch.cat([prompt, torch.randint(100, 40000, (B, 20), generator=g)], dim=1)
    new = torch.randint(100, 40000, (B, 1), generator=g)
    attention = torch.ones(B, L + 1, dtype=torch.long)
    positions = torch.full((B, 1), L)

    merged = MergedLoRA()
    with torch.no_grad():
        t = time.perf_counter()
        packed = PackedDecoder(model)
        pack_s = time.perf_counter() - t
        t = time.perf_counter()
        packed_bf16 = PackedDecoder(model, torch.bfloat16)
        pack_bf16_s = time.perf_counter() - t
        loop = plain_decoder(model, packed)
        merged.applied(model, (0,)).__enter__()  # the hf arm: the LoRA merged, as the HF sampler generates
        # the context's keys/values (from the packed decoder's own prefill): per row, and the shared prompt once
        P = L - 20
        base_cache = packed.new_cache(B, L + 1)
        packed.forward(ids, torch.arange(L).expand(B, -1), base_cache, 0, torch.ones(B, L, dtype=torch.bool))
        filled = [(k[:, :, :L].clone(), v[:, :, :L].clone()) for k, v in base_cache]
        prefix = [(k[:1, :, :P].clone(), v[:1, :, :P].clone()) for k, v in filled]
        hf_cache = preallocated_cache(L + 8, filled)

        def hf_step():
            for layer in hf_cache.layers:  # back to the context's L positions
                layer._length = L
                layer._view()
            return model(
                input_ids=new, attention_mask=attention, position_ids=positions, cache=hf_cache, logits_to_keep=1
            ).logits[:, -1]

        def decoder_step(decoder, shared: bool):
            start = P if shared else 0
            cache = [
                (torch.cat([k, k[:, :, :8]], 2)[:, :, start:], torch.cat([v, v[:, :, :8]], 2)[:, :, start:])
                for k, v in filled
            ]
            cache = [(k.contiguous(), v.contiguous()) for k, v in cache]
            valid = torch.ones(B, L + 1 - start, dtype=torch.bool)

            def step():
                return decoder.forward(new, positions, cache, L - start, valid, prefix if shared else None)

            return step

        arms = {
            "hf": hf_step,
            "loop": decoder_step(loop, False),
            "packed_rows": decoder_step(packed, False),
            "packed": decoder_step(packed, True),
            "packed_bf16": decoder_step(packed_bf16, True),
        }
        ref = hf_step()
        diff = {k: (f() - ref).abs().max().item() for k, f in arms.items()}

        bw, rate = read_bandwidth(), matmul_rate()
        params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
        flop = 2 * B * params  # every weight (the tied embedding once, as the output head) at B rows
        weight_bytes = packed.nbytes
        print(f"threads {torch.get_num_threads()}, {B} rows, {L} cached positions  {load()}")
        print(f"packing the weights: fp32 {pack_s:.2f} s, bf16 {pack_bf16_s:.2f} s (once per version of the weights)")
        print(
            f"read bandwidth {bw / 1e9:.1f} GB/s -> weight-read floor {weight_bytes / bw * 1e3:.1f} ms"
            f" ({weight_bytes / 1e6:.0f} MB fp32); matmul rate {rate / 1e9:.0f} GFLOP/s -> fp32 compute floor"
            f" {flop / rate * 1e3:.1f} ms ({flop / 1e9:.2f} GFLOP)"
        )
        times: dict[str, list[float]] = {k: [] for k in arms}
        for r in range(args.rounds):
            for name, f in arms.items():
                f()
                t = time.perf_counter()
                for _ in range(args.steps):
                    f()
                times[name].append((time.perf_counter() - t) / args.steps)
            print(
                f"  round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()) + f"  {load()}"
            )
        mm = {"packed": matmul_seconds(packed, B), "packed_bf16": matmul_seconds(packed_bf16, B)}
        bw2, rate2 = read_bandwidth(), matmul_rate()
    floor = flop / rate
    print(f"\nafter the rounds: read bandwidth {bw2 / 1e9:.1f} GB/s, matmul rate {rate2 / 1e9:.0f} GFLOP/s  {load()}")
    print(f"medians over {args.rounds} rounds of {args.steps} steps (spread: min-max of the rounds):")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        bytes_read = weight_bytes / 2 if k == "packed_bf16" else weight_bytes
        split = ""
        if k in mm:
            split = f"; matmuls alone {mm[k] * 1e3:.1f} ms, the rest {(med[k] - mm[k]) * 1e3:.1f} ms"
        print(
            f"  {k:12s} {med[k] * 1e3:6.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f})  = {med[k] / floor:.2f}x the"
            f" compute floor; weights stream at {bytes_read / med[k] / 1e9:5.1f} GB/s; logits vs hf"
            f" {diff[k]:.1e}{split}"
        )
    print(
        f"  hf / loop {med['hf'] / med['loop']:.2f}x   hf / packed {med['hf'] / med['packed']:.2f}x   "
        f"packed / packed_bf16 {med['packed'] / med['packed_bf16']:.2f}x"
    )


if __name__ == "__main__":
    main()
