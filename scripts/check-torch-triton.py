#!/usr/bin/env python3
"""Checks and times the torch backend's Triton decode kernels (`ferrum_mac/backends/torch/kernels/triton_ops.py`
and `triton_gemv.py`) on a CUDA GPU, against the torch code they replace, at Qwen3-0.6B's and Qwen3-8B's shapes in
bf16 (and one Llama-like layout: no q/k norm, interleaved RoPE, head_dim 64, checked only):

- norm + rope + write: `pointwise.norm_and_rope` and DecodePlan's KV index_put vs `norm_rope_write`
- attention: DecodePlan's SDPA under the additive bias vs `decode_attention` (a kv head's query
  group per program; split-K + merge where the batch is too small to fill the GPU)
- attention block: the qkv projection and both of the above, as `DecodePlan.attend` vs
  `TritonOps.attention` in a decode step (for a few rows, with `triton_qkv`; for one row, a
  `triton_gemv` GEMV and `norm_rope_write`)
- norm+qkv+rope+write, for a few rows: F.rms_norm + F.linear + the torch norm + rope + write vs
  `triton_qkv.norm_qkv_rope_write`; then the three kernels a step ran before it (Triton's RMSNorm,
  cuBLAS, `norm_rope_write`) vs it; then it at other K chunks and splits
- swiglu: `pointwise.torch_swiglu` vs `triton_ops.swiglu`
- the GEMVs for a decode step's few rows (ctx "-"): norm+qkv (F.rms_norm + F.linear vs
  `norm_matmul`), norm+gate_up+swiglu (F.rms_norm + F.linear + `pointwise.torch_swiglu`,
  vs `norm_swiglu`), o_proj/down+residual (`torch.addmm` vs `matmul_residual`). Their
  calls cycle through copies of the weight that together outgrow the L2 cache, as a step's
  layers do. Then the three GEMVs a layer runs by default with K unsplit against the split
  `triton_gemv.dot_splits` chooses (marked *), with each one's weight bytes per second
  (`--sweep`: other split counts too). `--tiles`: for one row, each GEMV at other tiles
  (`triton_gemv.GemvTile`: column block, K chunk, warps, stages, splits) and the copy rate,
  the rest skipped. (One row of a weight of at most `triton_gemv.ROW_GEMV_MAX_BYTES` takes
  the row GEMV by default, so there the default is that kernel, the tiles the tl.dot one's.)
- RMSNorm of a step's row at Qwen3-0.6B's, Qwen3-30B-A3B's and Qwen3-8B's hidden sizes:
  F.rms_norm vs `triton_ops.rms_norm`, with the bytes per second each moves (row, weight, output).

Times are device microseconds per call, from CUDA graphs of many back-to-back calls (a decode
step runs as a graph, so Python's launch cost is not counted). Exits 1 on a mismatch. Needs
only torch (with its triton) and numpy; from the repository root:

    python3 scripts/check-torch-triton.py [--sweep | --tiles]
"""

import itertools
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _gpu_check import can_check, compare, cycling, graph_us, verdict  # noqa: E402  (this folder)

from ferrum_mac.backends.torch import pointwise  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_gemv, triton_ops, triton_qkv  # noqa: E402
from ferrum_mac.backends.torch.attention import DecodePlan  # noqa: E402
from ferrum_mac.backends.torch.kv import KvManager  # noqa: E402
from ferrum_mac.backends.torch.layers import Linear, RmsNorm, Rope  # noqa: E402
from ferrum_mac.backends.torch.ops import GEMV_MAX_ROWS, TORCH_OPS, TritonOps  # noqa: E402
from ferrum_mac.bench.torch_side import copy_bandwidth  # noqa: E402

# name -> hidden size, heads, kv_heads, head_dim, MLP width, q/k norm, interleaved RoPE
LAYOUTS = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True, False),
    "qwen3-8b": (4096, 32, 8, 128, 12288, True, False),
    "llama-like": (4096, 32, 8, 64, 8192, False, True),
}
TIMED = ("qwen3-0.6b", "qwen3-8b")
CASES = [(1, 256), (1, 4096), (8, 1024), (16, 1024), (32, 1024)]  # (rows, context: the longest row's position + 1)
GEMV_ROWS = (1, 4)
SPLIT_OPS = ("norm+gate_up+swiglu", "o_proj+residual", "down+residual")  # the GEMVs a decode step runs by default
SWEEP_SPLITS = (2, 3, 4, 6, 8)
QKV_BLOCK_K, QKV_SPLITS = (32, 64, 128), (1, 2, 4, 8, 16)  # norm+qkv+rope+write's variants timed
QKV_VARIANTS: list[str] = []
NORM_WIDTHS = (1024, 2048, 4096)  # hidden sizes: Qwen3-0.6B, Qwen3-30B-A3B, Qwen3-8B
EPS = 1e-6
DTYPE = torch.bfloat16
B = KvManager.block_tokens
BEYOND_L2 = 128 << 20  # bytes of weight copies a timed GEMV cycles through


def main() -> int:
    if not can_check(triton_ops):
        return 2
    print()
    if "--tiles" in sys.argv:
        return sweep_tiles()
    rows_out, splits_out = [], []
    for name, layout in LAYOUTS.items():
        for rows, context in CASES if name in TIMED else CASES[:1]:
            rows_out += check_case(name, layout, rows, context, timed=name in TIMED)
        for rows in GEMV_ROWS if name in TIMED else GEMV_ROWS[:1]:
            timed, split = check_gemvs(name, layout, rows, timed=name in TIMED)
            rows_out, splits_out = rows_out + timed, splits_out + split
    norms_out = check_rms_norms()
    print(f"{'layout':<11} {'rows':>4} {'ctx':>5}  {'op':<19} {'torch us':>9} {'triton us':>9} {'speedup':>7}")
    for name, rows, context, op, torch_us, triton_us in rows_out:
        speedup = torch_us / triton_us
        print(f"{name:<11} {rows:>4} {context:>5}  {op:<19} {torch_us:>9.2f} {triton_us:>9.2f} {speedup:>6.2f}x")
    print(
        f"\nGEMV split-K\n{'layout':<11} {'rows':>4}  {'op':<19} {'N x K':>11} {'blocks':>6} {'splits':>6} {'us':>7} {'GB/s':>5} {'vs 1':>6}"
    )
    for name, rows, op, (n, k), blocks, splits, chosen, us, unsplit_us, weight_bytes in splits_out:
        mark = "*" if chosen else " "
        print(f"{name:<11} {rows:>4}  {op:<19} {f'{n}x{k}':>11} {blocks:>6} {splits:>5}{mark} {us:>7.2f} "
              f"{weight_bytes / us / 1e3:>5.0f} {unsplit_us / us:>5.2f}x")  # fmt: skip
    print(
        f"\nnorm+qkv+rope+write by K chunk and splits (default: {triton_qkv.TILE_BYTES} weight bytes a chunk, gemv_splits)"
    )
    print(f"{'layout':<11} {'rows':>4}  {'block_k':>7} {'splits':>6} {'us':>7} {'GB/s':>5}\n" + "\n".join(QKV_VARIANTS))
    print(
        f"\nRMSNorm, 1 row\n{'width':>5} {'F.rms_norm us':>13} {'triton us':>9} {'speedup':>7} {'GB/s torch':>10} {'GB/s triton':>11}"
    )
    for width, torch_us, triton_us, moved in norms_out:
        print(
            f"{width:>5} {torch_us:>13.2f} {triton_us:>9.2f} {torch_us / triton_us:>6.2f}x {moved / torch_us / 1e3:>10.1f} {moved / triton_us / 1e3:>11.1f}"
        )
    return verdict()


def check_case(name: str, layout, rows: int, context: int, timed: bool) -> list:
    hidden, heads, kv_heads, dim, width, qk_norm, interleaved = layout
    where = f"{name} rows={rows} ctx={context}"
    torch.manual_seed(rows * 10_000 + context)
    width = -(-(context + 1) // B)  # each row's blocks
    tokens = width * B
    positions = torch.randint(0, context, (rows,), device="cuda")
    positions[-1] = context - 1
    table = (torch.randperm(rows * width, device="cuda") + 1).view(rows, width)  # scattered blocks; 0 is scratch
    torch_pool, triton_pool = (pool(kv_heads, dim, rows * width + 1) for _ in range(2))
    triton_pool.kv[0].copy_(torch_pool.kv[0])
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
    norm = RmsNorm((1 + 0.1 * torch.randn(hidden, device="cuda")).to(DTYPE), EPS)
    qkv_weights = weight_copies(((heads + 2 * kv_heads) * dim, hidden), timed)
    qkv = F.linear(norm(x), qkv_weights[0])
    weight = (1 + 0.1 * torch.randn(heads + kv_heads, dim, device="cuda")).to(DTYPE) if qk_norm else None
    rope = Rope(SimpleNamespace(head_dim=dim, rope_theta=1e6, rope_scaling=None, rope_traditional=interleaved), "cuda")
    rope.build(tokens)
    cos, sin = rope.tables(positions, DTYPE)
    attn = SimpleNamespace(
        layer=0,
        heads=heads,
        head_dim=dim,
        qkv=Linear(qkv_weights[0]),
        qk_norm=weight,
        eps=EPS,
        rope=rope,
        scale=dim**-0.5,
    )
    torch_plan = decode_plan(torch_pool, table, positions, fused=False)
    triton_plan = decode_plan(triton_pool, table, positions, fused=True)

    def torch_project(qkv=qkv):
        qk = qkv[:, : (heads + kv_heads) * dim].unflatten(-1, (heads + kv_heads, dim))
        v = qkv[:, (heads + kv_heads) * dim :].unflatten(-1, (kv_heads, dim))
        qk = pointwise.norm_and_rope(qk, weight, cos, sin, attn.eps, interleaved)
        return qk[:, :heads], qk[:, heads:], v

    def torch_block():
        return torch_plan.attend(
            0, *torch_project(F.linear(F.rms_norm(x, (hidden,), norm.weight, EPS), attn.qkv.weight)), attn.scale
        )

    def triton_block():  # as a decode step runs it (`TritonOps.row_qkv` or `triton_qkv`)
        return triton_plan.ops.attention(attn, x, norm, triton_plan, cos, sin)

    def fused_qkv(w=qkv_weights[0], **variant):
        return triton_qkv.norm_qkv_rope_write(
            x,
            norm.weight,
            EPS,
            w,
            None,
            heads,
            weight,
            EPS,
            cos,
            sin,
            interleaved,
            triton_pool.kv[0],
            triton_plan.places,
            **variant,
        )

    # norm + rope + write, then attention, then both (the pools end up written the same)
    q, k, v = torch_project()
    triton_q = triton_ops.norm_rope_write(
        qkv, heads, weight, cos, sin, attn.eps, interleaved, triton_pool.kv[0], triton_plan.places
    )
    compare(f"{where} q", triton_q, q)
    torch_out = torch_block()
    compare(f"{where} pool", triton_pool.kv[0], torch_pool.kv[0])
    compare(
        f"{where} attention",
        triton_ops.decode_attention(triton_q, triton_pool.kv[0], table, positions, attn.scale, B),
        torch_out,
    )
    compare(
        f"{where} attention, one split",
        triton_ops.decode_attention(triton_q, triton_pool.kv[0], table, positions, attn.scale, B, splits=1),
        torch_out,
    )
    compare(f"{where} attention block", triton_block(), torch_out)
    if triton_qkv.fits(dim, rows):
        compare(f"{where} norm+qkv+rope+write q", fused_qkv(), q)
        compare(f"{where} norm+qkv+rope+write pool", triton_pool.kv[0], torch_pool.kv[0])
        compare(f"{where} norm+qkv+rope+write q, K unsplit", fused_qkv(splits=1), q)
    gate_up = 2 * torch.randn(rows, 2 * width, device="cuda", dtype=DTYPE)
    compare(f"{where} swiglu", triton_ops.swiglu(gate_up), pointwise.torch_swiglu(gate_up))
    routing = torch.rand(rows, 1, device="cuda", dtype=DTYPE)
    compare(f"{where} weighted swiglu", triton_ops.swiglu(gate_up, routing), pointwise.torch_swiglu(gate_up, routing))
    if not timed:
        return []

    kv, grouped_q = torch_pool.kv[0], q.reshape(rows, kv_heads, -1, dim)
    keys, values = kv[:, :, torch_plan.key_rows].transpose(1, 2)  # gathered through the table, untimed

    def torch_norm_rope_write(qkv=qkv):
        q, k, v = torch_project(qkv)
        kv.view(2, -1, dim)[:, torch_plan.places] = torch.stack((k, v)).view(2, -1, dim)
        return q

    def torch_attention():
        return torch.nn.functional.scaled_dot_product_attention(
            grouped_q, keys, values, attn_mask=torch_plan.bias, scale=attn.scale
        )

    pairs = {
        "norm+rope+write": (torch_norm_rope_write, lambda: triton_ops.norm_rope_write(
            qkv, heads, weight, cos, sin, attn.eps, interleaved, triton_pool.kv[0], triton_plan.places)),
        "attention": (torch_attention, lambda: triton_ops.decode_attention(triton_q, triton_pool.kv[0], table, positions, attn.scale, B)),
        "attention block": (torch_block, triton_block),
        "swiglu": (lambda: pointwise.torch_swiglu(gate_up), lambda: triton_ops.swiglu(gate_up)),
    }  # fmt: skip
    if triton_qkv.fits(dim, rows) and rows <= GEMV_MAX_ROWS:  # weights past L2, as a step's layers
        fused = cycling(fused_qkv, qkv_weights)
        pairs["norm+qkv+rope+write"] = (
            cycling(lambda w: torch_norm_rope_write(F.linear(norm(x), w)), qkv_weights),
            fused,
        )
        pairs["  3 kernels vs 1"] = (cycling(lambda w: triton_ops.norm_rope_write(
            F.linear(triton_ops.rms_norm(x, norm.weight, EPS), w), heads, weight, cos, sin, EPS, interleaved,
            triton_pool.kv[0], triton_plan.places), qkv_weights), fused)  # fmt: skip
        if context == CASES[0][1]:
            time_qkv_variants(f"{name:<11} {rows:>4}", fused_qkv, qkv_weights)
    return [(name, rows, context, op, graph_us(a), graph_us(b)) for op, (a, b) in pairs.items()]


def time_qkv_variants(where: str, fused_qkv, copies: list) -> None:
    """norm+qkv+rope+write timed at other splits of K and K chunks (QKV_VARIANTS)."""
    weight_bytes = copies[0].numel() * copies[0].element_size()
    for block_k in QKV_BLOCK_K:
        for splits in QKV_SPLITS:
            us = graph_us(cycling(lambda w: fused_qkv(w, splits=splits, block_k=block_k), copies))
            QKV_VARIANTS.append(f"{where}  {block_k:>7} {splits:>6} {us:>7.2f} {weight_bytes / us / 1e3:>5.0f}")


def gemv_ops(layout, rows: int, timed: bool) -> dict:
    """The GEMVs a decode step runs for `rows` rows of `layout`: op -> (torch's, Triton's (of a
    weight, and optionally a split count and a tile), the weights it cycles through)."""
    hidden, heads, kv_heads, dim, width, _, _ = layout
    torch.manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
    norm = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(DTYPE)
    attn_out = torch.randn(rows, heads * dim, device="cuda", dtype=DTYPE)
    inter = torch.randn(rows, width, device="cuda", dtype=DTYPE)
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * dim, hidden),
        "gate_up": (2 * width, hidden),
        "o_proj": (hidden, heads * dim),
        "down": (hidden, width),
    }
    weights = {part: weight_copies(shape, timed) for part, shape in shapes.items()}
    return {
        "norm+qkv": (lambda w: F.linear(F.rms_norm(x, (hidden,), norm, EPS), w),
                     lambda w, splits=None, tile=None: triton_gemv.norm_matmul(x, norm, EPS, w, splits=splits, tile=tile),
                     weights["qkv"]),
        "norm+gate_up+swiglu": (lambda w: pointwise.torch_swiglu(F.linear(F.rms_norm(x, (hidden,), norm, EPS), w)),
                                lambda w, splits=None, tile=None: triton_gemv.norm_swiglu(x, norm, EPS, w, splits=splits, tile=tile),
                                weights["gate_up"]),
        "o_proj+residual": (lambda w: torch.addmm(x, attn_out, w.t()),
                            lambda w, splits=None, tile=None: triton_gemv.matmul_residual(attn_out, w, x, splits=splits, tile=tile),
                            weights["o_proj"]),
        "down+residual": (lambda w: torch.addmm(x, inter, w.t()),
                          lambda w, splits=None, tile=None: triton_gemv.matmul_residual(inter, w, x, splits=splits, tile=tile),
                          weights["down"]),
    }  # fmt: skip


def columns_and_k(op: str, weight: torch.Tensor) -> tuple[int, int]:
    """A GEMV's output columns (each of gate and up for SwiGLU) and K."""
    return weight.shape[0] // 2 if op == "norm+gate_up+swiglu" else weight.shape[0], weight.shape[1]


def check_gemvs(name: str, layout, rows: int, timed: bool) -> tuple[list, list]:
    """The GEMVs checked (split as `dot_splits` chooses, and unsplit) and, if `timed`, timed
    against torch: rows for the main table, and rows for the split-K table."""
    where = f"{name} rows={rows}"
    ops = gemv_ops(layout, rows, timed)
    for op, (torch_op, triton_op, copies) in ops.items():
        want = torch_op(copies[0])
        compare(f"{where} {op}", triton_op(copies[0]), want)
        compare(f"{where} {op}, K unsplit", triton_op(copies[0], splits=1), want)
    if not timed:
        return [], []
    timings = [(name, rows, "-", op, graph_us(cycling(a, w)), graph_us(cycling(b, w))) for op, (a, b, w) in ops.items()]
    triton_us = {op: us for _, _, _, op, _, us in timings}
    split_rows = []
    for op in SPLIT_OPS:
        torch_op, triton_op, copies = ops[op]
        weights = 2 if op == "norm+gate_up+swiglu" else 1  # (gate's and up's)
        n_k = columns_and_k(op, copies[0])
        for row in time_splits(f"{where} {op}", triton_op, torch_op, copies, n_k, triton_us[op], weights):
            split_rows.append((name, rows, op, *row))
    return timings, split_rows


def time_splits(where: str, triton_op, torch_op, copies: list, n_k: tuple[int, int], chosen_us: float,
                weights: int) -> list:  # fmt: skip
    """(N x K, column blocks, splits, chosen?, us, unsplit us, weight bytes) for K unsplit, the
    split `triton_gemv.dot_splits` chooses (timed already: `chosen_us`) and, with --sweep,
    other counts (`weights`: 2 for gate_up's, as `gemv_tile` takes them)."""
    weight = copies[0]
    n, k = n_k
    tile = triton_gemv.gemv_tile(n, k, weight.device, weight.element_size(), weights=weights)
    blocks = -(-n // tile.block_n)
    chosen = triton_gemv.dot_splits(blocks, k, tile, weight.device)[0]
    wanted = {1, chosen} | (set(SWEEP_SPLITS) if "--sweep" in sys.argv else set())
    splits = sorted({triton_gemv.dot_splits(blocks, k, tile, weight.device, count)[0] for count in wanted})
    times = {chosen: chosen_us}
    for count in splits:
        if count not in times:
            compare(f"{where}, {count} splits", triton_op(weight, splits=count), torch_op(weight))
            times[count] = graph_us(cycling(lambda w: triton_op(w, splits=count), copies))
    weight_bytes = weight.numel() * weight.element_size()
    return [((n, k), blocks, count, count == chosen, times[count], times[1], weight_bytes) for count in splits]


TILE_WIDEST, TILE_BYTES, TILE_WARPS, TILE_STAGES = (32, 64, 128), (16384, 32768), (4, 8), (3, 4)
TILE_SPLITS = (None, 1, 2, 3)  # None: dot_splits' choice (timed once where it is one of the others)


def sweep_tiles() -> int:
    """Each one-row GEMV of the timed layouts at the tiles TILE_* make, beside the default:
    device us and weight bytes a second, then the copy rate `ferrum bench`'s roofline takes."""
    print(f"{'layout':<11} {'op':<19} {'N x K':>11} {'block_n':>7} {'block_k':>7} {'warps':>5} {'stages':>6} "
          f"{'splits':>6} {'us':>7} {'GB/s':>5} {'vs default':>10}")  # fmt: skip
    for name in TIMED:
        for op, (_, gemv, copies) in gemv_ops(LAYOUTS[name], 1, timed=True).items():
            n, k = columns_and_k(op, copies[0])
            weight_bytes = copies[0].numel() * DTYPE.itemsize
            default_us = graph_us(cycling(gemv, copies))
            where = f"{name:<11} {op:<19} {f'{n}x{k}':>11}"
            print(f"{where} {'default':>39} {default_us:>7.2f} {weight_bytes / default_us / 1e3:>5.0f}")
            for us, tile, splits in sorted(time_tiles(f"{name} {op}", gemv, copies, n, k), key=lambda r: r[0])[:6]:
                print(f"{where} {tile.block_n:>7} {tile.block_k:>7} {tile.warps:>5} {tile.stages:>6} {splits:>6} "
                      f"{us:>7.2f} {weight_bytes / us / 1e3:>5.0f} {default_us / us:>9.2f}x")  # fmt: skip
    read = copy_bandwidth(torch.device("cuda")) / 2
    print(f"\ncopy rate: {read / 1e9:.0f} GB/s read (and as many written)")
    return verdict()


def time_tiles(where: str, gemv, copies: list, n: int, k: int) -> list:
    """(us, tile, splits) of `gemv` at each distinct tile and split count TILE_* make, checked
    against its default's output; a tile that fails to compile or launch is said and skipped."""
    want, results, seen = gemv(copies[0]), [], set()
    device = copies[0].device
    for widest, tile_bytes, warps, stages, wanted in itertools.product(
        TILE_WIDEST, TILE_BYTES, TILE_WARPS, TILE_STAGES, TILE_SPLITS
    ):
        tile = triton_gemv.gemv_tile(n, k, device, DTYPE.itemsize, tile_bytes, widest, warps=warps, stages=stages)
        splits = triton_gemv.dot_splits(-(-n // tile.block_n), k, tile, device, wanted)[0]
        if (tile, splits) in seen:
            continue
        seen.add((tile, splits))
        try:
            compare(f"{where} {tile} splits={splits}", gemv(copies[0], splits, tile), want)
            results.append((graph_us(cycling(lambda w: gemv(w, splits, tile), copies)), tile, splits))  # noqa: B023  (called at once)
        except Exception as error:  # (a tile past the shared memory, say)
            print(f"{where} {tile} splits={splits}: {type(error).__name__}")
    return results


def check_rms_norms() -> list:
    """RMSNorm checked on 1 and 4 rows, timed on 1: (width, torch us, triton us, bytes moved)."""
    timings = []
    for width in NORM_WIDTHS:
        weight = (1 + 0.1 * torch.randn(width, device="cuda")).to(DTYPE)
        for rows in (1, 4):
            x = torch.randn(rows, width, device="cuda", dtype=DTYPE)
            compare(
                f"rms_norm width={width} rows={rows}",
                triton_ops.rms_norm(x, weight, EPS),
                F.rms_norm(x, (width,), weight, EPS),
            )
        x = x[:1]
        moved = 3 * width * DTYPE.itemsize  # the row and the weight read, the output written
        timings.append(
            (
                width,
                graph_us(lambda: F.rms_norm(x, (width,), weight, EPS)),
                graph_us(lambda: triton_ops.rms_norm(x, weight, EPS)),
                moved,
            )
        )
    return timings


def weight_copies(shape: tuple[int, int], timed: bool) -> list[torch.Tensor]:
    """Random weights scaled to keep outputs near 1: one, or for timing as many as outgrow L2."""
    copies = -(-BEYOND_L2 // (shape[0] * shape[1] * DTYPE.itemsize)) if timed else 1
    return [(torch.randn(shape, device="cuda") / shape[1] ** 0.5).to(DTYPE) for _ in range(copies)]


def pool(kv_heads: int, dim: int, blocks: int) -> KvManager:
    kv = KvManager(1, kv_heads, dim, DTYPE, torch.device("cuda"), capacity=blocks * B)
    kv._grow(blocks)
    kv.kv[0].normal_()
    return kv


def decode_plan(kv: KvManager, table, positions, fused: bool) -> DecodePlan:
    return DecodePlan(kv, table, positions, DTYPE, ops=TritonOps() if fused else TORCH_OPS)


if __name__ == "__main__":
    sys.exit(main())
