#!/usr/bin/env python3
"""Times and checks the torch backend's bf16 decode GEMVs (`ferrum_mac/backends/torch/triton_gemv.py`)
on a CUDA GPU at Qwen3-0.6B's and Qwen3-8B's matmul shapes, each with what the model fuses into
it (RMSNorm, residual, SwiGLU over the fused gate_up), at 1 and 2 rows (`--rows=1,2,4`: others):

- the tl.dot GEMV (`fma=False`: x padded to 16 rows), the FMA GEMV that multiplies in registers
  (`triton_gemv.fma_gemv`) with its default tile (`triton_gemv.FMA_TILE`) and with one thing of
  the tile changed, and cuBLAS (`F.linear`, the matmul alone);
- at the qkv shape also `triton_qkv.norm_qkv_rope_write` (norm + qkv + q/k norm + RoPE + KV
  write in one kernel: what a decode step runs), its projection by tl.dot (as before) and
  multiplied in registers (`fma=True`, now the default for a row or two), and the FMA GEMV's
  norm + qkv followed by `triton_ops.norm_rope_write` (two kernels);
- at the head's shape, Triton's RMSNorm then cuBLAS (what a step runs) beside the GEMVs' norm + head.

Per variant: device microseconds per call (CUDA graphs of back-to-back calls cycling through
copies of the weight that together outgrow the L2 cache, as a step's layers do), the weight's
GB/s and share of the H100's 3.35 TB/s, and the largest error against a float32 reference,
relative to the largest output (BAD past 2e-2). Then per shape the fastest variant, and per
model and rows the step's matmuls summed (x layers; the head once): as the step ran them before
the FMA GEMV, as it runs them now (the defaults), and with each shape's fastest. A variant that
fails is printed and skipped (the script exits 0). Needs only torch (with its triton); from the
repository root:

    python3 scripts/check-torch-gemv.py [--rows=1,2]
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_check import can_check, cycling, graph_us  # noqa: E402  (this folder)

from ferrum_mac.backends.torch import pointwise, triton_gemv, triton_ops, triton_qkv  # noqa: E402

DTYPE = torch.bfloat16
DEVICE = "cuda"
PEAK_GBS = 3350  # H100 SXM HBM3
L2_PAST = 160 << 20  # the weights a timed call cycles through, at least
MAX_ERROR = 2e-2
ROWS = tuple(int(r) for arg in sys.argv if arg.startswith("--rows=") for r in arg[7:].split(",")) or (1, 2)
VOCAB = 151936
# model -> hidden, heads, kv_heads, head_dim, MLP width, layers
MODELS = {"0.6B": (1024, 16, 8, 128, 3072, 28), "8B": (4096, 32, 8, 128, 12288, 36)}
# the FMA GEMV's variants: its default tile with one thing changed
FMA_CHANGES = [
    {},
    {"reduce": "step"},
    {"columns": 32},
    {"columns": 128},
    {"row_bytes": 1024},
    {"warps": 8},
    {"per_sm": 8},
]
HEAD_CHANGES = [{}, {"columns": 128}, {"row_bytes": 1024}]  # (fewer: the head's 151,936 columns fill the GPU anyway)
DOT, HEAD_TODAY = "dot (tl.dot)", "rms_norm + cuBLAS"
TODAY_QKV, QKV_FMA, FMA_QKV = "qkv+rope kernel, tl.dot", "qkv+rope kernel, fma", "fma gemv + norm_rope_write"
DEFAULT = "fma defaults"


def shapes(model: str) -> list[tuple[str, int, int, str, int]]:
    """(name, out N, in K, what is fused, calls per step) of a model's decode step."""
    hidden, heads, kv_heads, dim, inter, layers = MODELS[model]
    return [
        ("qkv", (heads + 2 * kv_heads) * dim, hidden, "norm", layers),
        ("o_proj", hidden, heads * dim, "residual", layers),
        ("gate_up+swiglu", 2 * inter, hidden, "swiglu", layers),
        ("down", hidden, inter, "residual", layers),
        ("lm_head", VOCAB, hidden, "norm", 1),
    ]


def main() -> int:
    if not can_check(triton_gemv):
        return 2
    torch.manual_seed(0)
    start = time.time()
    results = {}  # (model, shape, rows, variant) -> us
    for model in MODELS:
        for name, n, k, fused, _ in shapes(model):
            copies = weights(n, k)
            nbytes = n * k * 2
            print(f"\n{model} {name}: {n} x {k}, + {fused}, {nbytes / 1e6:.1f} MB ({time.time() - start:.0f} s)\n"
                  f"{'variant':<30}" + "".join(f" | {rows} row{'s' if rows > 1 else ' '}: {'us':>7} {'GB/s':>5} "
                                               f"{'peak':>4} {'err':>7}" for rows in ROWS), flush=True)  # fmt: skip
            for label in variants(name):
                cells = []
                for rows in ROWS:
                    try:
                        us, err = time_variant(model, copies, fused, rows, label)
                    except Exception as e:  # (a variant that fails to compile or launch: said, and the sweep goes on)
                        cells.append(f" | {'failed: ' + first_line(e):<36.36}")
                        continue
                    results[(model, name, rows, label)] = us
                    gbs = nbytes / us / 1e3
                    flag = " BAD" if err > MAX_ERROR else ""
                    cells.append(f" | {'':7} {us:>7.1f} {gbs:>5.0f} {gbs / PEAK_GBS:>4.0%} {err:>7.1e}{flag}")
                print(f"{label:<30}" + "".join(cells), flush=True)
            print("fma defaults take: " + "; ".join(plan_of(n, k, fused, rows) for rows in ROWS), flush=True)
            del copies
            torch.cuda.empty_cache()
    print_best(results)
    print(f"\nsweep took {time.time() - start:.0f} s")
    return 0


def variants(name: str) -> list[str]:
    changes = FMA_CHANGES if name != "lm_head" else HEAD_CHANGES
    labels = [DOT] + [fma_label(change) for change in changes] + ["cuBLAS (matmul alone)"]
    if name == "qkv":
        labels += [TODAY_QKV, QKV_FMA, FMA_QKV]
    if name == "lm_head":
        labels += [HEAD_TODAY]
    return labels


def fma_label(change: dict) -> str:
    return "fma " + (", ".join(f"{key} {value}" for key, value in change.items()) or "defaults")


FMA_TILES = {
    fma_label(change): dataclasses.replace(triton_gemv.FMA_TILE, **change) for change in FMA_CHANGES + HEAD_CHANGES
}


def weights(n: int, k: int) -> list[torch.Tensor]:
    """Enough copies of a random `(n, k)` weight to outgrow L2."""
    first = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * k**-0.5
    return [first] + [first.roll(i, 0) for i in range(1, max(2, -(-L2_PAST // (n * k * 2))))]


def time_variant(model: str, copies: list[torch.Tensor], fused: str, rows: int, label: str) -> tuple[float, float]:
    """(us per call cycling through the copies, the first copy's largest error against float32,
    relative to the largest output) of the variant `label`."""
    n, k = copies[0].shape
    x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
    norm = torch.rand(k, device=DEVICE, dtype=DTYPE) + 0.5
    residual = torch.randn(rows, n, device=DEVICE, dtype=DTYPE)
    normed = F.rms_norm(x, (k,), norm, 1e-6)
    if label in (TODAY_QKV, QKV_FMA, FMA_QKV):
        return time_qkv(model, copies, x, norm, label)
    if label.startswith("cuBLAS"):
        return graph_us(cycling(lambda w: F.linear(x, w), copies)), 0.0
    if label == HEAD_TODAY:
        got = F.linear(triton_ops.rms_norm(x, norm, 1e-6), copies[0])
        us = graph_us(cycling(lambda w: F.linear(triton_ops.rms_norm(x, norm, 1e-6), w), copies))
        return us, error(got, F.linear(normed.float(), copies[0].float()))
    options = {"fma": False} if label == DOT else {"fma": True, "tile": FMA_TILES[label]}
    if fused == "norm":
        call = lambda w: triton_gemv.norm_matmul(x, norm, 1e-6, w, **options)  # noqa: E731
        want = F.linear(normed.float(), copies[0].float())
    elif fused == "residual":
        call = lambda w: triton_gemv.matmul_residual(x, w, residual, **options)  # noqa: E731
        want = F.linear(x.float(), copies[0].float()) + residual.float()
    else:
        call = lambda w: triton_gemv.norm_swiglu(x, norm, 1e-6, w, **options)  # noqa: E731
        want = pointwise.torch_swiglu(F.linear(normed.float(), copies[0].float()))
    return graph_us(cycling(call, copies)), error(call(copies[0]), want)


def time_qkv(model: str, copies: list[torch.Tensor], x: torch.Tensor, norm: torch.Tensor, label: str):
    """norm + qkv + q/k norm + RoPE + KV write: in one kernel (`triton_qkv`) with tl.dot
    (TODAY_QKV) or multiplied in registers (QKV_FMA), or the FMA GEMV's norm + qkv then
    `norm_rope_write` (FMA_QKV); q's error against the tl.dot kernel's on the first copy (the
    reference: each rounds the projection once)."""
    _, heads, kv_heads, dim, _, _ = MODELS[model]
    rows = x.shape[0]
    kv = torch.zeros(2, kv_heads, 64, dim, device=DEVICE, dtype=DTYPE)
    places = torch.arange(rows * kv_heads, device=DEVICE) * 3  # (token rows apart)
    qk_weight = torch.rand(heads + kv_heads, dim, device=DEVICE, dtype=DTYPE) + 0.5
    angles = torch.rand(rows, 1, dim, device=DEVICE) * 6.3
    cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)

    def one_kernel(w, fma=False):
        return triton_qkv.norm_qkv_rope_write(
            x, norm, 1e-6, w, None, heads, qk_weight, 1e-6, cos, sin, False, kv, places, fma=fma
        )

    def two_kernels(w):
        qkv = triton_gemv.norm_matmul(x, norm, 1e-6, w, fma=True)
        return triton_ops.norm_rope_write(qkv, heads, qk_weight, cos, sin, 1e-6, False, kv, places)

    call = {TODAY_QKV: one_kernel, QKV_FMA: lambda w: one_kernel(w, fma=True), FMA_QKV: two_kernels}[label]
    err = error(call(copies[0]), one_kernel(copies[0]).float())
    return graph_us(cycling(call, copies)), err


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def plan_of(n: int, k: int, fused: str, rows: int) -> str:
    swiglu = fused == "swiglu"
    plan = triton_gemv.fma_plan(n // 2 if swiglu else n, k, rows, swiglu, 2, torch.device(DEVICE))
    return f"{rows} row(s) {plan[0]} columns x {plan[1]} K a step, {plan[2]} blocks x {plan[3]} splits"


def first_line(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def print_best(results: dict) -> None:
    """The fastest variant per shape and rows; per model and rows the step's matmuls summed:
    as before the FMA GEMV (qkv by triton_qkv, the others tl.dot, the head RMSNorm + cuBLAS),
    now (the FMA defaults for o_proj, gate_up and down) and with each shape's fastest."""
    print(f"\nbest per shape\n{'shape':<22} {'rows':>4} {'dot us':>8} {'fma default':>11} {'best us':>8}  best variant")
    for model in MODELS:
        for name, *_ in shapes(model):
            for rows in ROWS:
                mine = {label: us for (m, s, r, label), us in results.items() if (m, s, r) == (model, name, rows)}
                if mine:
                    label, us = min(mine.items(), key=lambda item: item[1])
                    dot, default = mine.get(DOT, float("nan")), mine.get(DEFAULT, float("nan"))
                    print(f"{model + ' ' + name:<22} {rows:>4} {dot:>8.1f} {default:>11.1f} {us:>8.1f}  {label}")
    for model in MODELS:
        for rows in ROWS:
            sums = {"before": 0.0, "now": 0.0, "best": 0.0}
            for name, *_, calls in shapes(model):
                mine = {label: us for (m, s, r, label), us in results.items() if (m, s, r) == (model, name, rows)}
                nan = float("nan")
                before = {"qkv": TODAY_QKV, "lm_head": HEAD_TODAY}.get(name, DOT)
                now = {"qkv": QKV_FMA, "lm_head": HEAD_TODAY}.get(name, DEFAULT)
                sums["before"] += calls * mine.get(before, nan)
                sums["now"] += calls * mine.get(now, nan)
                # (at qkv, only the variants that also rope and write the KV)
                fused = [us for label, us in mine.items() if not label.startswith("cuBLAS")]
                if name == "qkv":
                    fused = [us for label, us in mine.items() if label in (TODAY_QKV, QKV_FMA, FMA_QKV)]
                sums["best"] += calls * min(fused, default=nan)
            print(f"Qwen3-{model} step's matmuls, {rows} row(s): " + ", ".join(
                f"{key} {us / 1e3:.3f} ms ({1e6 / us:.0f} steps/s)" for key, us in sums.items()))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
