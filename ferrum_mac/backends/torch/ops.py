"""Which kernel runs each op of a torch forward: the one place that decides it.

A plan carries its ops (`Plan.ops`, `DecodePlan.ops`) and the model files call them, never
asking which kernel runs:

- `Ops`: torch's own ops. Eager steps (prefill, verify, mixed batches) always use them, and
  so do decode steps off CUDA.
- `TritonOps`: a CUDA decode step's, where triton imports (`decode_ops`). Triton kernels run
  only there: a decode step is captured once in a CUDA graph, while launched eagerly each
  Triton call costs tens of microseconds of Python, more than the torch op it replaces.
  The elementwise work is one `triton_ops` kernel each (RMSNorm, SwiGLU; q/k norm and RoPE
  fused with the KV write, and attention); for a few rows the matmul beside each joins it
  in one Triton GEMV (`triton_gemv`, `triton_qkv`), each GEMV on or off by name; a MoE
  block at decode sizes is three `triton_moe` kernels.

FERRUM_TORCH_TRITON=0 keeps torch's ops in decode steps too, for A/B timing.
"""

from __future__ import annotations

import functools

import torch

from ferrum_mac.backends.options import DEFAULTS, TORCH_GEMVS, BackendOptions
from ferrum_mac.backends.torch import quant
from ferrum_mac.backends.torch.layers import Linear, RmsNorm
from ferrum_mac.backends.torch.pointwise import one_per_row, torch_swiglu

# The fused GEMV kernels in use, by name (`BackendOptions.torch_gemv`, FERRUM_TORCH_GEMV): "norm_swiglu" (RMSNorm + gate_up + SwiGLU),
# "matmul_residual" (o_proj and down plus the residual), "norm_qkv_rope" (RMSNorm + qkv + q/k
# norm + RoPE + KV write: `triton_qkv`, or for one row or a verify's, a `triton_gemv` GEMV and
# then `triton_ops.norm_rope_write`: `TritonOps.row_qkv`), "norm_matmul" (RMSNorm + qkv projection,
# where norm_qkv_rope is off; off unless named: it lost to F.rms_norm + cuBLAS).
GEMV_MAX_ROWS = 4  # the GEMVs take up to 16 rows; past a few, cuBLAS reads a weight once as well
GEMV_MOST_ROWS = 16  # (triton_ops.MIN_DOT_ROWS: x padded to a tl.dot operand)
# At most this many token-expert pairs take the Triton MoE kernels (a pair is a GEMV there; a
# prefill's many pairs are better served by grouped GEMMs).
MOE_MAX_PAIRS = 256


class Ops:
    """Torch's own ops (the reference the Triton kernels are tested against)."""

    triton = False  # whether a decode plan leaves attention to `attention` whole (no mask to build)

    def rms_norm(self, x: torch.Tensor, norm: RmsNorm) -> torch.Tensor:
        return norm(x)

    def norm_matmul(self, x: torch.Tensor, norm: RmsNorm, linear: Linear) -> torch.Tensor:
        """linear(norm(x))."""
        return linear(self.rms_norm(x, norm))

    def head(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """The output head on the normed rows x."""
        return linear(x)

    def matmul_plus(self, x: torch.Tensor, linear: Linear, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(x)."""
        return linear.plus(x, residual)

    def swiglu(self, gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of the fused projection's output (gate first), times `weights` (one
        per row) if given."""
        return torch_swiglu(gate_up, weights)

    def norm_swiglu(self, x: torch.Tensor, norm: RmsNorm, gate_up: Linear) -> torch.Tensor:
        """swiglu(gate_up(norm(x)))."""
        return self.swiglu(gate_up(self.rms_norm(x, norm)))

    def attention(
        self, attn, h: torch.Tensor, norm: RmsNorm, plan, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`attn` (an `attention.Attention`) on the block's input `h` `(T, hidden)` -> `(T, heads * dim)`."""
        q, k, v = attn.project(self.norm_matmul(h, norm, attn.qkv), cos, sin)
        return plan.attend(attn.layer, q, k, v, attn.scale, attn.window, attn.softcap, attn.sinks)

    def sparse_moe(self, moe, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + `moe` (a `qwen3_moe.SparseMoe`) on the normed `x` `(T, hidden)`."""
        experts, weights = moe.router(x)
        return residual + moe.experts(x, experts, weights, self)


class TritonOps(Ops):
    """A CUDA decode step's Triton kernels; torch's ops where a kernel does not take the case."""

    triton = True

    def __init__(self, gemv: frozenset[str] = TORCH_GEMVS, gemv_max_rows: int = GEMV_MAX_ROWS, rowwise: bool = False):
        """`rowwise`: a verify's rows, each a sequence's decode step: a packed linear takes them
        one at a time, as the GEMV that multiplies in registers sums a row differently among
        more rows; a bf16 GEMV is told to sum each row as alone (`triton_gemv`'s `rows_alike`)."""
        self.gemvs, self.gemv_max_rows, self.rowwise = gemv, gemv_max_rows, rowwise

    def _by_row(self, x: torch.Tensor, linear) -> bool:
        return self.rowwise and linear.quantized and x.dim() == 2 and x.shape[0] > 1

    def head(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._by_row(x, linear):
            return torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
        return linear(x)

    def gemv(self, kernel: str, x: torch.Tensor) -> bool:
        """Whether the Triton GEMV `kernel` (named as in `TORCH_GEMVS`) takes x `(rows, K)`: a few rows."""
        return kernel in self.gemvs and x.dim() == 2 and x.shape[0] <= self.gemv_max_rows

    def rms_norm(self, x: torch.Tensor, norm: RmsNorm) -> torch.Tensor:
        # one kernel of torch's rounding: F.rms_norm takes several microseconds on a row
        if norm.weight is None:
            return super().rms_norm(x, norm)
        from ferrum_mac.backends.torch.kernels import triton_ops

        return triton_ops.rms_norm(x, norm.weight, norm.eps)

    def quant_gemv(self, x: torch.Tensor, linear, norm: RmsNorm | None = None) -> bool:
        """Whether `triton_quant.gemv` takes a packed `linear` on x (and its norm, if any)."""
        rows = x.shape[0] if x.dim() == 2 else quant.GEMV_MAX_ROWS + 1
        return linear.quantized and rows <= quant.GEMV_MAX_ROWS and (norm is None or norm.weight is not None)

    def norm_matmul(self, x: torch.Tensor, norm: RmsNorm, linear: Linear) -> torch.Tensor:
        if self._by_row(x, linear):
            return torch.cat([self.norm_matmul(x[i : i + 1], norm, linear) for i in range(x.shape[0])])
        if self.quant_gemv(x, linear, norm):
            from ferrum_mac.backends.torch.kernels import triton_quant

            return triton_quant.gemv(x, linear.weight, linear.bias, norm_weight=norm.weight, eps=norm.eps)
        if linear.quantized or not (self.gemv("norm_matmul", x) or self.row_qkv(x, linear)):
            return super().norm_matmul(x, norm, linear)
        from ferrum_mac.backends.torch.kernels import triton_gemv

        return triton_gemv.norm_matmul(x, norm.weight, norm.eps, linear.weight, linear.bias, rows_alike=self.rowwise)

    def matmul_plus(self, x: torch.Tensor, linear: Linear, residual: torch.Tensor) -> torch.Tensor:
        # (a packed linear's own `plus` adds the residual in its GEMV)
        if self._by_row(x, linear):
            return torch.cat([linear.plus(x[i : i + 1], residual[i : i + 1]) for i in range(x.shape[0])])
        if linear.quantized or linear.bias is not None or not self.gemv("matmul_residual", x):
            return super().matmul_plus(x, linear, residual)
        from ferrum_mac.backends.torch.kernels import triton_gemv

        return triton_gemv.matmul_residual(x, linear.weight, residual, rows_alike=self.rowwise)

    def swiglu(self, gate_up: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if not one_per_row(weights, gate_up):
            return super().swiglu(gate_up, weights)
        from ferrum_mac.backends.torch.kernels import triton_ops

        return triton_ops.swiglu(gate_up, weights)

    def norm_swiglu(self, x: torch.Tensor, norm: RmsNorm, gate_up: Linear) -> torch.Tensor:
        if self._by_row(x, gate_up):
            return torch.cat([self.norm_swiglu(x[i : i + 1], norm, gate_up) for i in range(x.shape[0])])
        if self.quant_gemv(x, gate_up, norm):
            from ferrum_mac.backends.torch.kernels import triton_quant

            return triton_quant.gemv(
                x, gate_up.weight, gate_up.bias, norm_weight=norm.weight, eps=norm.eps, swiglu=True
            )
        if gate_up.quantized or not self.gemv("norm_swiglu", x):
            return super().norm_swiglu(x, norm, gate_up)
        from ferrum_mac.backends.torch.kernels import triton_gemv

        return triton_gemv.norm_swiglu(x, norm.weight, norm.eps, gate_up.weight, gate_up.bias, rows_alike=self.rowwise)

    def row_qkv(self, x: torch.Tensor, qkv: Linear) -> bool:
        """Whether the qkv projection of one row (or a verify's rows) takes a `triton_gemv`
        GEMV, then q/k norm, RoPE and KV write in a kernel of their own: two kernels that beat
        `triton_qkv`'s one there (docs/BENCHMARKS.md, the torch table: qwen3-8b bf16, H200, one row's qkv)."""
        return not qkv.quantized and self.gemv("norm_qkv_rope", x) and (x.shape[0] == 1 or self.rowwise)

    def fused_qkv(self, h: torch.Tensor, attn) -> bool:
        """Whether `triton_qkv`'s one kernel takes the norm, qkv projection, q/k norm, RoPE and
        KV write of h."""
        return not attn.qkv.quantized and self.gemv("norm_qkv_rope", h) and not self.row_qkv(h, attn.qkv)

    def attention(
        self, attn, h: torch.Tensor, norm: RmsNorm, plan, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """For a few rows norm, projection, q/k norm, RoPE and KV write in one kernel
        (`triton_qkv`), else (and for one row or a verify's: `row_qkv`) the projection, then
        those in one (`triton_ops.norm_rope_write`);
        then attention reading each row's keys up to its position (`plan`: a `DecodePlan`)."""
        from ferrum_mac.backends.torch.kernels import triton_ops, triton_qkv
        from ferrum_mac.backends.torch.kernels.triton_pdl import pdl_for

        kv = plan.pool.kv[attn.layer]  # (2, kv_heads, token rows, dim)
        interleaved, places = attn.rope.interleaved, plan.places
        if self.fused_qkv(h, attn) and triton_qkv.fits(attn.head_dim, h.shape[0]):
            q = triton_qkv.norm_qkv_rope_write(
                h,
                norm.weight,
                norm.eps,
                attn.qkv.weight,
                attn.qkv.bias,
                attn.heads,
                attn.qk_norm,
                attn.eps,
                cos,
                sin,
                interleaved,
                kv,
                places,
            )
            early = pdl_for(h.device, attn.qkv.weight)  # (a large weight's kernel lets none start early)
        else:
            qkv = self.norm_matmul(h, norm, attn.qkv)
            q = triton_ops.norm_rope_write(qkv, attn.heads, attn.qk_norm, cos, sin, attn.eps, interleaved, kv, places)
            early = True
        B = plan.pool.block_tokens
        splits = triton_ops.default_splits(plan.sequences * kv.shape[1], plan.table.shape[1] * B, h.device)
        return triton_ops.decode_attention(q, kv, plan.table, plan.positions, attn.scale, B, splits, early)

    def sparse_moe(self, moe, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Gate projection with the router, gate_up with SwiGLU, down with the sum over k and
        the residual add: three `triton_moe` kernels, at decode sizes and unless a torch
        route is forced (`qwen3_moe.Experts.forced_route`)."""
        if moe.experts.forced_route or x.shape[0] * moe.router.top_k > MOE_MAX_PAIRS:
            return super().sparse_moe(moe, x, residual)
        from ferrum_mac.backends.torch.kernels import triton_moe

        router, experts = moe.router, moe.experts  # (the gate has no bias)
        ids, weights = triton_moe.gate_route(x, router.gate.weight, router.top_k, router.renormalise)
        if experts.packed:  # the same two kernels over packed experts
            from ferrum_mac.backends.torch.kernels import triton_quant

            return triton_quant.experts_plus(x, ids, weights, experts.gate_up, experts.down, residual)
        return triton_moe.experts_plus(x, ids, weights, experts.gate_up, experts.down, residual)


TORCH_OPS = Ops()


def decode_ops(device: torch.device, options: BackendOptions = DEFAULTS, verify: bool = False) -> Ops:
    """A decode step's ops on `device`: Triton's on CUDA where triton imports (unless `options`
    turn them off), with the GEMVs they name. `verify`: the step's rows are verified tokens,
    computed as each one's decode step would be: the GEMVs take every row they can, not handing
    many rows to cuBLAS (whose sums differ)."""
    if not (options.torch_triton and device.type == "cuda" and triton_imports()):
        return TORCH_OPS
    if verify:
        return TritonOps(options.torch_gemv, gemv_max_rows=GEMV_MOST_ROWS, rowwise=True)
    return TritonOps(options.torch_gemv)


@functools.cache
def triton_imports() -> bool:
    try:  # imported only here, and only for CUDA: the CPU path never pays for it
        from ferrum_mac.backends.torch.kernels import triton_ops
    except ImportError:
        return False
    return triton_ops.triton is not None
