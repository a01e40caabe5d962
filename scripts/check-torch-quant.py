#!/usr/bin/env python3
"""Checks and times the torch backend's Triton kernels over packed 4-bit and 8-bit weights
(`triton_quant.py`, `triton_fma_gemv.py`, `triton_dequant.py` in ferrum_mac/backends/torch/)
on a CUDA GPU, at Qwen3-8B's matmul shapes with random weights quantized affinely (group 64
as MLX's 4-bit checkpoints, 32 as GGUF's):

- correctness: `triton_quant.gemv` at 1, 4 and 8 rows (plain, + residual, RMSNorm + SwiGLU on
  the fused gate_up) and `triton_quant.matmul` at 512 rows, each way of unpacking, against
  torch's matmul of the dequantized weight (`Packed.dequantize`, in bf16)
- decode: device microseconds per one-row GEMV, from CUDA graphs of back-to-back calls that
  cycle through enough copies of the weight to outgrow the L2 cache (as a step's layers do),
  the tl.dot kernel with each way of unpacking a tile (`triton_quant.UNPACK`: gather, words)
  and the FMA kernel (`triton_fma_gemv.fma_gemv`); the bytes a call
  reads (packed weight, scales and biases), the GB/s the faster way makes and its share of the
  H100's 3.35 TB/s; beside it cuBLAS on the same shape in bf16
- prefill: microseconds and TFLOP/s of 512 rows (the faster unpacking), beside cuBLAS in bf16
- the decode step's matmuls summed over Qwen3-8B's 36 layers and its head: the tok/s those
  alone allow (attention, norms and launches come on top)
- Qwen3-30B-A3B's MoE layer (128 experts, top 8, hidden 2048, intermediate 768) with packed
  experts: `triton_quant.experts_plus` by each of its routes (the FMA GEMV a token-expert pair
  at a time, `triton_fma_gemv.fma_expert_gemv`, and the tl.dot kernels) against torch's
  gathered route over the chosen experts dequantized (its max error), and their microseconds
  at 1 to 32 tokens (calls cycling through random routings), the FMA route's two kernels alone
  with the bytes they read (each pair's expert) and their GB/s, beside the bf16 kernels
  (`triton_moe.experts_plus`) on the same routings; x 48 layers: the experts' share of a step

Exits 1 on a mismatch. `--sweep` instead times and checks the decode GEMV alone (4-bit group
64), at Qwen3-8B's and Qwen3-0.6B's shapes with what the model fuses into each (RMSNorm,
residual, SwiGLU), at 1, 2 and 4 rows (`--rows=1,2`: those only): the tl.dot kernel, the
FMA kernel's variants (its default tile, `triton_fma_gemv.FMA_TILE`, with one thing changed)
and cuBLAS over the dense bf16 weight; then the fastest per shape and the step's GEMVs
summed; it goes on past a variant that fails (and exits 0). It compiles some 160 kernels,
most of its few minutes. `--moe` instead checks and times the MoE layer's experts only, and
the FMA route's two kernels with each of the sweep's tiles.
`--sweep --rows=1 --dp4a` times the one-row dp4a GEMV's variants (`triton_dp4a_gemv`, the FMA
tile with one thing changed) beside the FMA kernel's defaults.
`--prefill` instead times a prompt's matmuls (`main_prefill`: the
packed weight dequantized + cuBLAS, the tl.dot matmul, cuBLAS in bf16), checked first. Needs
only torch (with its triton); from the repository root:

    python3 scripts/check-torch-quant.py [--sweep [--rows=1,2,4] [--dp4a] | --moe | --prefill]
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_check import can_check, compare, cycling, failures, graph_us, verdict  # noqa: E402  (this folder)

from ferrum_mac.backends.torch import pointwise, quant  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_moe  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_dequant, triton_fma_gemv, triton_quant  # noqa: E402  (packed weights)
from ferrum_mac.backends.torch.layers import RmsNorm  # noqa: E402

DTYPE = torch.bfloat16
PEAK_GBS = 3350  # H100 SXM HBM3
L2_PAST = 160 << 20  # the weights a timed call cycles through, at least
HIDDEN, INTER, QKV, VOCAB, LAYERS = 4096, 12288, 6144, 151936, 36
# (name, out N, in K, swiglu, per layer): the decode step's matmuls of Qwen3-8B
SHAPES = [
    ("qkv", QKV, HIDDEN, False, True),
    ("o_proj", HIDDEN, HIDDEN, False, True),
    ("gate_up+swiglu", 2 * INTER, HIDDEN, True, True),
    ("down", HIDDEN, INTER, False, True),
    ("lm_head", VOCAB, HIDDEN, False, False),
]
QUANTS = [(4, 64), (4, 32), (8, 64)]  # (bits, group)
UNPACKS = ("gather", "words")
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER, MOE_LAYERS = 128, 8, 2048, 768, 48
MOE_TOKENS = (1, 4, 8, 32)
ROWS = (1, 4, 8)
PREFILL_ROWS = 512


def main() -> int:
    if not can_check(triton_quant):
        return 2
    torch.manual_seed(0)
    decode, prefill = [], []
    for bits, group in QUANTS:
        print(f"{bits}-bit, group {group} ...", flush=True)
        for name, n, k, swiglu, per_layer in SHAPES:
            copies = weights(n, k, bits, group)
            check(name, copies[0], swiglu, bits, group)
            decode.append((bits, group, name, per_layer, *time_gemv(copies, swiglu)))
            prefill.append((bits, group, name, *time_matmul(copies[0])))
            del copies
            torch.cuda.empty_cache()

    print(f"\ndecode, 1 row, weights past L2\n{'bits':>4} {'group':>5}  {'matmul':<15} {'MB read':>8} "
          f"{'gather us':>9} {'words us':>8} {'fma us':>8} {'GB/s':>6} {'of peak':>7}  {'bf16 cuBLAS us':>14} {'speedup':>7}")  # fmt: skip
    for bits, group, name, _, us, read, dense_us, by_way in decode:
        print(f"{bits:>4} {group:>5}  {name:<15} {read / 1e6:>8.2f} {by_way['gather']:>9.2f} {by_way['words']:>8.2f} {by_way['fma']:>8.2f} "
              f"{read / us / 1e3:>6.0f} {read / us / 1e3 / PEAK_GBS:>6.0%}  {dense_us:>14.2f} {dense_us / us:>6.2f}x")  # fmt: skip
    print(f"\nprefill, {PREFILL_ROWS} rows\n{'bits':>4} {'group':>5}  {'matmul':<15} {'us':>8} {'TFLOP/s':>7}  "
          f"{'bf16 cuBLAS us':>14} {'ratio':>6}")  # fmt: skip
    for bits, group, name, us, flops, dense_us in prefill:
        print(
            f"{bits:>4} {group:>5}  {name:<15} {us:>8.1f} {flops / us / 1e6:>7.0f}  {dense_us:>14.1f} {dense_us / us:>5.2f}x"
        )
    print_moe()
    print(f"\nQwen3-8B decode step, its matmuls alone ({LAYERS} layers + head)")
    for bits, group in QUANTS:
        rows = [r for r in decode if r[:2] == (bits, group)]
        us = sum(r[4] * (LAYERS if r[3] else 1) for r in rows)
        dense = sum(r[6] * (LAYERS if r[3] else 1) for r in rows)
        read = sum(r[5] * (LAYERS if r[3] else 1) for r in rows)
        ways = {way: sum(r[7][way] * (LAYERS if r[3] else 1) for r in rows) for way in (*UNPACKS, "fma")}
        by_way = ", ".join(f"{way} only {1e6 / t:.0f}" for way, t in ways.items())
        print(f"  {bits}-bit g{group}: {us / 1e3:.3f} ms, {1e6 / us:.0f} tok/s at most ({by_way}; {read / 1e9:.2f} GB, "
              f"{read / us / 1e3:.0f} GB/s); bf16 cuBLAS {dense / 1e3:.3f} ms, {1e6 / dense:.0f} tok/s")  # fmt: skip
    return verdict()


def main_moe() -> int:
    """`--moe`: the MoE layer's experts only (checked, then timed)."""
    if not can_check(triton_quant):
        return 2
    torch.manual_seed(0)
    print_moe()
    print_moe_tiles()
    return verdict()


def print_moe_tiles() -> None:
    """The FMA route's two kernels at one token, 4-bit group 64, with each of SWEEP_FMA's tiles:
    us, GB/s of the pairs' experts, max error against the default tile's result."""
    E, H, inter, fma = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, triton_fma_gemv.fma_expert_gemv
    gate_up, down = (
        quant.quantize(torch.randn(rows, k, device="cuda", dtype=DTYPE) * k**-0.5, SWEEP_BITS, SWEEP_GROUP)
        for rows, k in ((E * 2 * inter, H), (E * H, inter))
    )
    x, residual = (torch.randn(1, H, device="cuda", dtype=DTYPE) for _ in range(2))
    routings = [torch.randperm(E, device="cuda")[:MOE_TOP_K][None].int() for _ in range(16)]
    weights = torch.softmax(torch.randn(1, MOE_TOP_K, device="cuda"), dim=-1).to(DTYPE)
    activations = fma(x, routings[0], gate_up, E, pair_weights=weights)
    calls = {
        "gate_up+swiglu": (gate_up, lambda r, tile: fma(x, r, gate_up, E, pair_weights=weights, tile=tile)),
        "down+sum+res": (down, lambda r, tile: fma(activations, r, down, E, residual=residual, tile=tile)),
    }
    print(f"\nthe FMA route's kernels, 1 token, {SWEEP_BITS}-bit g{SWEEP_GROUP}, by tile\n{'kernel':<15} "
          f"{'variant':<24} {'us':>7} {'GB/s':>6} {'err':>8}")  # fmt: skip
    for name, (weight, call) in calls.items():
        read = MOE_TOP_K * weight.nbytes / E
        want = call(routings[0], triton_fma_gemv.FMA_TILE)
        for change in SWEEP_FMA:
            tile = dataclasses.replace(triton_fma_gemv.FMA_TILE, **change)
            try:
                err = (call(routings[0], tile).float() - want.float()).abs().max().item()
                us = graph_us(cycling(lambda r: call(r, tile), routings))  # noqa: B023  (called at once)
            except Exception as e:  # (a variant that fails to compile or launch: said, and the table goes on)
                print(f"{name:<15} {variant_name('fma', change):<24} failed: {first_line(e)}")
                continue
            print(
                f"{name:<15} {variant_name('fma', change):<24} {us:>7.2f} {read / us / 1e3:>6.0f} {err:>8.2g}",
                flush=True,
            )


def print_moe() -> None:
    """Qwen3-30B-A3B's experts at each token count and quantization: both routes, checked and timed."""
    moe = [time_experts(tokens, bits, group) for tokens in MOE_TOKENS for bits, group in QUANTS]
    print(f"\nQwen3-30B-A3B MoE layer, experts only (routings cycling; default: triton_quant.experts_plus's "
          f"route, FMA up to {triton_quant.EXPERT_FMA_MAX_PAIRS} pairs)\n{'tokens':>6} {'bits':>4} {'group':>5} "
          f"{'MB read':>8} {'fma us':>8} {'GB/s':>6} {'dot us':>8} {'bf16 us':>8} {'speedup':>7} {'x48 ms':>7} "
          f"{'max err':>8}")  # fmt: skip
    for tokens, bits, group, read, us, dot_us, dense_us, error, _ in moe:
        best = min(us, dot_us)
        print(f"{tokens:>6} {bits:>4} {group:>5} {read / 1e6:>8.2f} {us:>8.2f} {read / us / 1e3:>6.0f} {dot_us:>8.2f} "
              f"{dense_us:>8.2f} {dense_us / best:>6.2f}x {best * MOE_LAYERS / 1e3:>7.3f} {error:>8.3g}")  # fmt: skip
    print(f"\nthe FMA route's kernels alone\n{'tokens':>6} {'bits':>4} {'group':>5}  {'kernel':<14} {'MB read':>8} "
          f"{'us':>8} {'GB/s':>6} {'of peak':>7}")  # fmt: skip
    for tokens, bits, group, *_, kernels in moe:
        for name, read, us in kernels:
            print(f"{tokens:>6} {bits:>4} {group:>5}  {name:<14} {read / 1e6:>8.2f} {us:>8.2f} {read / us / 1e3:>6.0f} "
                  f"{read / us / 1e3 / PEAK_GBS:>6.0%}")  # fmt: skip


def time_experts(tokens: int, bits: int, group: int) -> tuple:
    """(tokens, bits, group, the pairs' experts' packed bytes per call, us per call on the FMA
    route, on the tl.dot one, of the bf16 kernels, the max error against torch, and the FMA
    route's kernels: (name, bytes, us) each), after checking both routes against torch."""
    E, H, inter = MOE_EXPERTS, MOE_HIDDEN, MOE_INTER
    gate_up = quant.ExpertStack(
        quant.quantize(torch.randn(E * 2 * inter, H, device="cuda", dtype=DTYPE) * H**-0.5, bits, group), E, DTYPE
    )
    down = quant.ExpertStack(
        quant.quantize(torch.randn(E * H, inter, device="cuda", dtype=DTYPE) * inter**-0.5, bits, group), E, DTYPE
    )
    x, residual = (torch.randn(tokens, H, device="cuda", dtype=DTYPE) for _ in range(2))
    routings = [
        torch.stack([torch.randperm(E, device="cuda")[:MOE_TOP_K] for _ in range(tokens)]).int() for _ in range(16)
    ]
    weights = torch.softmax(torch.randn(tokens, MOE_TOP_K, device="cuda"), dim=-1).to(DTYPE)
    ids = routings[0]
    chosen = ids.reshape(-1).long()
    rows = x.repeat_interleave(MOE_TOP_K, dim=0)[:, :, None]
    a = pointwise.torch_swiglu(torch.bmm(gate_up.chosen(chosen), rows)[..., 0], weights.reshape(-1, 1))
    want = residual + torch.bmm(down.chosen(chosen), a[:, :, None])[..., 0].view(tokens, MOE_TOP_K, H).sum(dim=1)
    error = 0.0
    for fma in (True, False):
        got = triton_quant.experts_plus(x, ids, weights, gate_up, down, residual, fma=fma)
        compare(f"moe {bits}-bit g{group} tokens={tokens} {'fma' if fma else 'dot'}", got, want)
        error = max(error, (got.float() - want.float()).abs().max().item())
    us, dot_us = (
        graph_us(cycling(lambda r: triton_quant.experts_plus(x, r, weights, gate_up, down, residual, fma=f), routings))
        for f in (True, False)
    )
    dense_gate_up, dense_down = gate_up.dense(), down.dense()
    dense_us = graph_us(
        cycling(lambda r: triton_moe.experts_plus(x, r, weights, dense_gate_up, dense_down, residual), routings)
    )
    pairs = tokens * MOE_TOP_K  # (the FMA route reads each pair's expert)
    fma = triton_fma_gemv.fma_expert_gemv
    activations = fma(x, ids, gate_up.packed, E, pair_weights=weights)
    kernels = [
        ("gate_up+swiglu", pairs * gate_up.packed.nbytes / E,
         graph_us(cycling(lambda r: fma(x, r, gate_up.packed, E, pair_weights=weights), routings))),
        ("down+sum+res", pairs * down.packed.nbytes / E,
         graph_us(cycling(lambda r: fma(activations, r, down.packed, E, residual=residual), routings))),
    ]  # fmt: skip
    per_expert = (gate_up.packed.nbytes + down.packed.nbytes) / E
    return tokens, bits, group, pairs * per_expert, us, dot_us, dense_us, error, kernels


def weights(n: int, k: int, bits: int, group: int) -> list[quant.Packed]:
    """Enough packed copies of a random `(n, k)` weight to outgrow L2 (each quantized on the GPU)."""
    first = quant.quantize(torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5, bits, group)
    count = max(2, -(-L2_PAST // first.nbytes))
    return [first] + [
        quant.Packed(first.words.roll(i, 0), first.scales.roll(i, 0), first.biases.roll(i, 0), bits, group)
        for i in range(1, count)
    ]


def check(name: str, w: quant.Packed, swiglu: bool, bits: int, group: int) -> None:
    dense = w.dequantize(DTYPE)
    where = f"{bits}-bit g{group} {name}"
    n, k = w.shape
    norm = RmsNorm(torch.rand(k, device="cuda", dtype=DTYPE) + 0.5, 1e-6)
    for rows, way in ((rows, way) for rows in ROWS for way in UNPACKS):
        x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
        if swiglu:
            y = F.linear(norm(x), dense)
            want = F.silu(y[:, : n // 2]) * y[:, n // 2 :]
            got = triton_quant.gemv(x, w, norm_weight=norm.weight, eps=norm.eps, swiglu=True, unpack=way)
            compare(f"{where} rows={rows} {way} norm+gemv+swiglu", got, want)
        else:
            compare(f"{where} rows={rows} {way} gemv", triton_quant.gemv(x, w, unpack=way), F.linear(x, dense))
            residual = torch.randn(rows, n, device="cuda", dtype=DTYPE)
            compare(
                f"{where} rows={rows} {way} gemv+residual",
                triton_quant.gemv(x, w, residual=residual, unpack=way),
                torch.addmm(residual, x, dense.t()),
            )
    x = torch.randn(PREFILL_ROWS, k, device="cuda", dtype=DTYPE)
    for way in UNPACKS:
        compare(f"{where} matmul {way} {PREFILL_ROWS} rows", triton_quant.matmul(x, w, unpack=way), F.linear(x, dense))


def time_gemv(copies: list[quant.Packed], swiglu: bool) -> tuple[float, int, float, dict]:
    """(us per one-row call the faster way, bytes it reads, us of cuBLAS's bf16 matmul on the
    same shape, us by way of unpacking)."""
    n, k = copies[0].shape
    x = torch.randn(1, k, device="cuda", dtype=DTYPE)
    by_way = {
        way: graph_us(cycling(lambda w: triton_quant.gemv(x, w, swiglu=swiglu, unpack=way, fma=False), copies))
        for way in UNPACKS
    }
    by_way["fma"] = graph_us(cycling(lambda w: triton_quant.gemv(x, w, swiglu=swiglu, fma=True), copies))
    read = copies[0].nbytes + x.numel() * 2 + (n // 2 if swiglu else n) * 2
    dense = [torch.randn(n, k, device="cuda", dtype=DTYPE) for _ in range(max(2, -(-L2_PAST // (n * k * 2))))]
    dense_us = graph_us(cycling(lambda w: F.linear(x, w), dense))
    return min(by_way.values()), read, dense_us, by_way


def time_matmul(
    w: quant.Packed, blocks=None, warps: int | None = None, stages: int | None = None
) -> tuple[float, int, float]:
    n, k = w.shape
    x = torch.randn(PREFILL_ROWS, k, device="cuda", dtype=DTYPE)
    us = min(
        graph_us(lambda: triton_quant.matmul(x, w, blocks=blocks, warps=warps, stages=stages, unpack=way))
        for way in UNPACKS
    )
    dense = torch.randn(n, k, device="cuda", dtype=DTYPE)
    return us, 2 * PREFILL_ROWS * n * k, graph_us(lambda: F.linear(x, dense))


# -- --sweep: the decode GEMV's variants, timed and checked at each model's shapes -------------

# (name, out N, in K, what the model fuses into it, calls per step): Qwen3-8B's, then Qwen3-0.6B's
SWEEP_SHAPES = [
    ("8B qkv", QKV, HIDDEN, "norm", LAYERS),
    ("8B o_proj", HIDDEN, HIDDEN, "residual", LAYERS),
    ("8B gate_up+swiglu", 2 * INTER, HIDDEN, "swiglu", LAYERS),
    ("8B down", HIDDEN, INTER, "residual", LAYERS),
    ("8B lm_head", VOCAB, HIDDEN, "norm", 1),
    ("0.6B qkv", 4096, 1024, "norm", 28),
    ("0.6B o_proj", 1024, 2048, "residual", 28),
    ("0.6B gate_up+swiglu", 6144, 1024, "swiglu", 28),
    ("0.6B down", 1024, 3072, "residual", 28),
    ("0.6B lm_head", VOCAB, 1024, "norm", 1),
]
SWEEP_ROWS = tuple(int(r) for arg in sys.argv if arg.startswith("--rows=") for r in arg[7:].split(",")) or (1, 2, 4)
SWEEP_BITS, SWEEP_GROUP = 4, 64
# the FMA GEMV's variants: its default tile (`triton_fma_gemv.FMA_TILE`) with one thing changed
SWEEP_FMA = [
    {},
    {"longer_rows": False},
    {"columns": 32},
    {"columns": 128},
    {"row_bytes": 1024},
    {"prefetch": True},
    {"per_sm": 2},
    {"per_sm": 8},
    {"pdl": False},
]
# the dp4a GEMV's variants (one row, x as 16-bit integers: `triton_dp4a_gemv`), on the same tiles
SWEEP_DP4A = [
    {},
    {"longer_rows": False},
    {"columns": 32},
    {"columns": 128},
    {"row_bytes": 256},
    {"row_bytes": 1024},
    {"per_sm": 2},
    {"per_sm": 8},
    {"warps": 8},
    {"columns": 32, "warps": 8},
    {"columns": 32, "per_sm": 2},
    {"columns": 16},
    {"columns": 32, "row_bytes": 1024},
    {"columns": 16, "row_bytes": 1024},
]
# `--sweep --dp4a`: the FMA defaults beside the dp4a variants, one row, nothing else
DP4A_ONLY = "--dp4a" in sys.argv
MAX_ERROR = 2e-2  # of the largest output, against the dequantized weight's matmul in float32


def main_sweep() -> int:
    """Each shape x rows x variant (the tl.dot kernel, the FMA kernel's variants, cuBLAS over
    the dequantized weight in bf16): us per call, GB/s of the packed weight, share of
    PEAK_GBS, max error; then the best variant per shape and the step's GEMVs summed."""
    if not can_check(triton_quant):
        return 2
    torch.manual_seed(0)
    start = time.time()
    results = {}  # (shape, rows, variant) -> us
    for name, n, k, fused, _ in SWEEP_SHAPES:
        copies = weights(n, k, SWEEP_BITS, SWEEP_GROUP)
        nbytes = copies[0].nbytes
        print(f"\n{name}: {n} x {k}, + {fused}, {SWEEP_BITS}-bit g{SWEEP_GROUP}, {nbytes / 1e6:.1f} MB packed "
              f"({time.time() - start:.0f} s)\n{'variant':<32}" + "".join(
                  f" | {rows} row{'s' if rows > 1 else ' '}: {'us':>7} {'GB/s':>5} {'peak':>4} {'err':>7}" for rows in SWEEP_ROWS),
              flush=True)  # fmt: skip
        variants = [] if DP4A_ONLY else [("dot (tl.dot, old)", {"fma": False})]
        variants += [(variant_name("fma", v), fma_options(v)) for v in ([{}] if DP4A_ONLY else SWEEP_FMA)]
        if SWEEP_ROWS == (1,):
            variants += [(variant_name("dp4a", v), dp4a_options(v)) for v in SWEEP_DP4A]
        for label, options in variants:
            cells = []
            for rows in SWEEP_ROWS:
                try:
                    us, err = time_variant(copies, fused, rows, options)
                except Exception as e:  # (a variant that fails to compile or launch: said, and the sweep goes on)
                    cells.append(f" | {'failed: ' + first_line(e):<30.30}")
                    continue
                results[(name, rows, label)] = us
                flag = " BAD" if err > MAX_ERROR else ""
                gbs = nbytes / us / 1e3
                cells.append(f" | {'':6} {us:>7.1f} {gbs:>5.0f} {gbs / PEAK_GBS:>4.0%} {err:>7.1e}{flag}")
            print(f"{label:<32}" + "".join(cells), flush=True)
        dense = [torch.randn(n, k, device="cuda", dtype=DTYPE) for _ in range(max(2, -(-L2_PAST // (n * k * 2))))]
        cells = []
        for rows in SWEEP_ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            us = graph_us(cycling(lambda w: F.linear(x, w), dense))
            cells.append(f" | {'':6} {us:>7.1f} {n * k * 2 / us / 1e3:>5.0f} {'(bf16)':>12}")
        print(f"{'cuBLAS bf16, dense':<32}" + "".join(cells), flush=True)
        plans = [(rows, triton_fma_gemv.fma_plan(n // 2 if fused == "swiglu" else n, k, rows, fused == "swiglu",
                                              SWEEP_BITS, SWEEP_GROUP, copies[0].words.device)) for rows in SWEEP_ROWS]  # fmt: skip
        print("fma defaults take: " + "; ".join(
            f"{rows} row(s) {plan[0]} columns x {plan[1]} words a step, {plan[2]} blocks x {plan[3]} splits"
            for rows, plan in plans))  # fmt: skip
        del copies, dense
        torch.cuda.empty_cache()
    print_best(results)
    print(f"\nsweep took {time.time() - start:.0f} s")
    return 0


def variant_name(kernel: str, change: dict) -> str:
    return f"{kernel} " + (", ".join(f"{key} {value}" for key, value in change.items()) or "defaults")


def fma_options(change: dict) -> dict:
    return {"fma": True, "dp4a": False, "tile": dataclasses.replace(triton_fma_gemv.FMA_TILE, **change)}


def dp4a_options(change: dict) -> dict:
    """The dp4a GEMV with the FMA tile changed so (its defaults: its own tile by shape, `dp4a_tile`)."""
    return {"dp4a": True, "tile": dataclasses.replace(triton_fma_gemv.FMA_TILE, **change) if change else None}


def first_line(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def time_variant(copies: list[quant.Packed], fused: str, rows: int, options: dict) -> tuple[float, float]:
    """(us per call cycling through the copies, max error of the first against the dequantized
    weight's matmul in float32, relative to its largest output) of `gemv` with `options`."""
    n, k = copies[0].shape
    x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
    dense = copies[0].dequantize(DTYPE).float()

    def call(w, **kw):
        return triton_quant.gemv(x, w, **kw, **options)

    if fused == "norm":
        norm = RmsNorm(torch.rand(k, device="cuda", dtype=DTYPE) + 0.5, 1e-6)
        kw = {"norm_weight": norm.weight, "eps": norm.eps}
        want = F.linear(norm(x).float(), dense)
    elif fused == "residual":
        residual = torch.randn(rows, n, device="cuda", dtype=DTYPE)
        kw = {"residual": residual}
        want = F.linear(x.float(), dense) + residual.float()
    else:
        norm = RmsNorm(torch.rand(k, device="cuda", dtype=DTYPE) + 0.5, 1e-6)
        kw = {"norm_weight": norm.weight, "eps": norm.eps, "swiglu": True}
        y = F.linear(norm(x).float(), dense)
        want = F.silu(y[:, : n // 2]) * y[:, n // 2 :]
    got = call(copies[0], **kw).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    return graph_us(cycling(lambda w: call(w, **kw), copies)), err


def print_best(results: dict) -> None:
    """The fastest variant per shape and rows, beside the defaults; and per model the step's
    GEMVs summed (x layers) with the defaults and with each shape's best."""
    print(
        f"\nbest per shape\n{'shape':<22} {'rows':>4} {'dot us':>8} {'fma default us':>14} {'dp4a us':>10} {'best us':>8}"
        "  best variant"
    )
    for name, n, k, fused, _ in SWEEP_SHAPES:
        for rows in SWEEP_ROWS:
            mine = {label: us for (s, r, label), us in results.items() if s == name and r == rows}
            if not mine:
                continue
            label, us = min(mine.items(), key=lambda item: item[1])
            dot, default = mine.get("dot (tl.dot, old)", float("nan")), mine.get("fma defaults", float("nan"))
            dp4a = mine.get("dp4a defaults", float("nan"))
            print(f"{name:<22} {rows:>4} {dot:>8.1f} {default:>14.1f} {dp4a:>10.1f} {us:>8.1f}  {label}")
    for model in ("8B", "0.6B"):
        for rows in SWEEP_ROWS:
            sums = {"dot (tl.dot, old)": 0.0, "fma defaults": 0.0, "dp4a defaults": 0.0, "best": 0.0}
            for name, _, _, _, calls in (s for s in SWEEP_SHAPES if s[0].startswith(model + " ")):
                mine = {label: us for (s, r, label), us in results.items() if s == name and r == rows}
                for key in ("dot (tl.dot, old)", "fma defaults", "dp4a defaults"):
                    sums[key] += calls * mine.get(key, float("nan"))
                sums["best"] += calls * min(mine.values(), default=float("nan"))
            print(f"Qwen3-{model} step GEMVs, {rows} row(s): " + ", ".join(
                f"{key} {us / 1e3:.3f} ms ({1e6 / us:.0f} steps/s)" for key, us in sums.items()))  # fmt: skip


# -- --prefill: a prompt's matmuls over packed weights, each way, beside bf16 cuBLAS ----------

# (name, out N, in K, calls per prompt): the prefill matmuls of Qwen3-8B, then Qwen3-0.6B's
PREFILL_SHAPES = [
    ("8B qkv", QKV, HIDDEN, LAYERS),
    ("8B o_proj", HIDDEN, HIDDEN, LAYERS),
    ("8B gate_up", 2 * INTER, HIDDEN, LAYERS),
    ("8B down", HIDDEN, INTER, LAYERS),
    ("0.6B qkv", 4096, 1024, 28),
    ("0.6B o_proj", 1024, 2048, 28),
    ("0.6B gate_up", 6144, 1024, 28),
    ("0.6B down", 1024, 3072, 28),
]
PREFILL_SWEEP_ROWS = (16, 64, PREFILL_ROWS)
PREFILL_WAYS = ("dequantize", "dequant+cuBLAS", "overlapped", "tl.dot matmul", "bf16 cuBLAS")
OVERLAP_SLICES = 4


def main_prefill() -> int:
    """Per shape (4-bit g64, weights cycling past L2) and rows: us of the dequantizing kernel
    alone, of it + cuBLAS (`quant.dense_matmul`, what QuantLinear runs from
    quant.DENSE_MIN_ROWS rows), of the tl.dot matmul (`triton_quant.matmul`), and of cuBLAS on a
    dense bf16 weight; checked first (the dequantized weight bit for bit against
    `Packed.dequantize`, the products against torch's). Then per model the prompt's matmuls
    summed (x layers) and the tokens/s they alone allow."""
    if not can_check(triton_quant):
        return 2
    torch.manual_seed(0)
    quant.reserve_scratch(max(n * k for _, n, k, _ in PREFILL_SHAPES))  # (as a model's linears do when made)
    start = time.time()
    results = {}  # (shape, rows, way) -> us
    print(f"\nprefill matmuls, {SWEEP_BITS}-bit g{SWEEP_GROUP}, us per call (TFLOP/s)\n{'shape':<14} {'rows':>4}"
          + "".join(f" {way:>21}" for way in PREFILL_WAYS), flush=True)  # fmt: skip
    for name, n, k, _ in PREFILL_SHAPES:
        copies = weights(n, k, SWEEP_BITS, SWEEP_GROUP)
        dense_copies = [c.dequantize(DTYPE) for c in copies[: max(2, -(-L2_PAST // (n * k * 2)))]]
        scratch = quant.scratch_for(copies[0].words.device, DTYPE)
        side = torch.cuda.Stream()
        check_prefill(name, copies[0], dense_copies[0], scratch, side)
        out = torch.empty(n, k, dtype=DTYPE, device="cuda")
        for rows in PREFILL_SWEEP_ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=DTYPE)
            calls = {
                "dequantize": cycling(lambda w: triton_dequant.dequantize(w, out), copies),
                "dequant+cuBLAS": cycling(lambda w: quant.dense_matmul(x, w, scratch), copies),
                "overlapped": cycling(lambda w: overlapped_matmul(x, w, scratch, side), copies),
                "tl.dot matmul": cycling(lambda w: triton_quant.matmul(x, w), copies),
                "bf16 cuBLAS": cycling(lambda w: F.linear(x, w), dense_copies),
            }
            cells = []
            for way, call in calls.items():
                try:
                    us = results[(name, rows, way)] = graph_us(call)
                except Exception as e:  # (said, and the rest go on)
                    cells.append(f" {'failed: ' + first_line(e):>21.21}")
                    continue
                flops = 2 * rows * n * k / us / 1e6
                cells.append(f" {us:>12.1f} ({flops:>6.0f})" if way != "dequantize" else f" {us:>12.1f} {'':>8}")
            print(f"{name:<14} {rows:>4}" + "".join(cells), flush=True)
        del copies, dense_copies, calls
        torch.cuda.empty_cache()
    time_dequantize_blocks()
    torch.cuda.empty_cache()
    for model in ("8B", "0.6B"):
        for rows in PREFILL_SWEEP_ROWS:
            sums = {way: 0.0 for way in PREFILL_WAYS}
            for name, _, _, per_prompt in (s for s in PREFILL_SHAPES if s[0].startswith(model + " ")):
                for way in PREFILL_WAYS:
                    sums[way] += per_prompt * results.get((name, rows, way), float("nan"))
            print(f"Qwen3-{model} prompt of {rows}, matmuls alone: " + ", ".join(
                f"{way} {us / 1e3:.2f} ms ({rows * 1e6 / us:.0f} tok/s)" for way, us in sums.items()))  # fmt: skip
    print(f"(QuantLinear: dequant+cuBLAS from {quant.DENSE_MIN_ROWS} rows; prefill took {time.time() - start:.0f} s)")
    return verdict()


def overlapped_matmul(x: torch.Tensor, w: quant.Packed, scratch: torch.Tensor, side) -> torch.Tensor:
    """An experiment (not what QuantLinear runs): `quant.dense_matmul` in OVERLAP_SLICES slices
    of W's rows, each dequantized on the stream `side` (into the two halves of `scratch` in
    turn) while cuBLAS multiplies the one before: how much of the dequantizing overlapping
    would hide."""
    n, k = w.shape
    step = -(-n // OVERLAP_SLICES)
    halves = [scratch[i * step * k : (i + 1) * step * k] for i in (0, 1)]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    done: list = []
    for i, start in enumerate(range(0, n, step)):
        end = min(n, start + step)
        part = quant.Packed(w.words[start:end], w.scales[start:end], w.biases[start:end], w.bits, w.group_size)
        ready = torch.cuda.Event()
        with torch.cuda.stream(side):
            if i >= 2:  # (the multiply that read this half before is done)
                side.wait_event(done[i - 2])
            dense = triton_dequant.dequantize(part, halves[i % 2][: (end - start) * k].view(end - start, k))
            ready.record(side)
        main.wait_event(ready)
        out[:, start:end] = F.linear(x, dense)
        done.append(torch.cuda.Event())
        done[-1].record(main)
    main.wait_stream(side)
    return out


# the dequantizing kernel's (rows, values of K) a program and warps, tried at 8B's gate_up
# (and q made a float in a mantissa rather than converted)
DEQUANT_VARIANTS = [
    ((32, 256), 4, False),
    ((32, 256), 4, True),
    ((16, 256), 4, False),
    ((64, 256), 8, False),
    ((16, 512), 4, False),
    ((16, 512), 4, True),
    ((8, 1024), 4, False),
    ((64, 128), 4, False),
]


def time_dequantize_blocks() -> None:
    """us and GB/s (packed read + dense written) of `triton_dequant.dequantize`'s variants."""
    _, n, k, _ = PREFILL_SHAPES[2]
    copies = weights(n, k, SWEEP_BITS, SWEEP_GROUP)
    out = torch.empty(n, k, dtype=DTYPE, device="cuda")
    moved = copies[0].nbytes + out.numel() * out.element_size()
    print(f"\ndequantize, {PREFILL_SHAPES[2][0]} ({moved / 1e6:.0f} MB moved): block (rows, K), warps, mantissa "
          "-> us, GB/s")  # fmt: skip
    for block, warps, mantissa in DEQUANT_VARIANTS:
        label = f"  {str(block):<12} {warps} {str(mantissa):<5}"
        try:
            want = triton_dequant.dequantize(copies[0], out, block, warps, mantissa).clone()
            ok = "" if torch.equal(want, copies[0].dequantize(DTYPE)) else "  DIFFERS"
            us = graph_us(cycling(lambda w: triton_dequant.dequantize(w, out, block, warps, mantissa), copies))
            print(f"{label}  {us:>8.1f} {moved / us / 1e3:>6.0f}{ok}", flush=True)
        except Exception as e:  # (a variant that fails to compile: said, and the rest go on)
            print(f"{label}  failed: {first_line(e)}")


def check_prefill(name: str, w: quant.Packed, dense: torch.Tensor, scratch: torch.Tensor, side) -> None:
    n, k = w.shape
    got = triton_dequant.dequantize(w, torch.empty(n, k, dtype=DTYPE, device="cuda"))
    if not torch.equal(got, dense):
        failures.append(f"{name} dequantize: {int((got != dense).sum())} of {got.numel()} values differ")
    x = torch.randn(PREFILL_ROWS, k, device="cuda", dtype=DTYPE)
    residual = torch.randn(PREFILL_ROWS, n, device="cuda", dtype=DTYPE)
    compare(f"{name} dequant+cuBLAS", quant.dense_matmul(x, w, scratch), F.linear(x, dense))
    compare(f"{name} dequant+cuBLAS+residual", quant.dense_matmul(x, w, scratch, residual=residual),
            torch.addmm(residual, x, dense.t()))  # fmt: skip
    small = scratch[: (n // 3 + 1) * k]  # (in slices of rows)
    compare(f"{name} dequant+cuBLAS in slices", quant.dense_matmul(x, w, small), F.linear(x, dense))
    compare(f"{name} tl.dot matmul", triton_quant.matmul(x, w), F.linear(x, dense))
    compare(f"{name} overlapped", overlapped_matmul(x, w, scratch, side), F.linear(x, dense))


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sys.exit(main_sweep())
    if "--moe" in sys.argv:
        sys.exit(main_moe())
    sys.exit(main_prefill() if "--prefill" in sys.argv else main())
