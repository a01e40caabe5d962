"""Triton kernels for a decode-sized mixture-of-experts block (Qwen3-MoE): the gate projection
and router, the experts and the residual add in three launches, instead of about fifteen small
torch kernels, and with no host sync (a CUDA graph replays them).

The one idea: at decode a token-expert pair is a matrix-vector product, so the experts are
GEMVs that read the chosen experts' weights straight from the stacked tensors, the expert id
read on the device.

- `route`: softmax of the gate logits in float32, the top k (k argmax steps, the lower index
  on ties), optionally renormalised: one program per token. `gate_route` computes the logits
  too (rounded to x's dtype, as the gate's F.linear stores them): a program per (token, block
  of experts), the last of a token's programs to finish routes it.
- `gate_up_swiglu`: silu(x Wg^T) * (x Wu^T) * the router's weight, for every pair. A program
  owns a block of the intermediate columns of one expert: the first pair (in token order)
  that chose the expert runs it for every token that chose it (a `tl.dot` over the tokens,
  padded to 16 rows), later pairs of that expert exit. So each chosen expert's weights are
  read once per step, however many tokens share it.
- `down_sum_plus`: residual + sum over a token's k pairs of a Wd^T. One program per (pair,
  block of hidden columns) stores the pair's products in float32; the last of a token's k
  programs for a block to finish adds them up in slot order with the residual and rounds
  once (torch rounds each pair's output first, then the sum, then the residual add). So a
  lone token still has k times as many programs as column blocks to fill the GPU with.
  `triton_splits.SPLIT_K` = 0 keeps the unsplit kernel:
  one program per (token, block), the k experts' rows as one long dot product.

Products round where the torch path rounds them (each projection's output, silu, the product
with up, the router's weight), so the pairs' activations match it to a bf16 ulp or so.

Entry functions launch on whatever tensors they are given (CUDA, or CPU tensors under
`TRITON_INTERPRET=1` for tests); choosing them is `qwen3_moe`'s business. The module loads
without triton; `triton` is then None.
"""

import torch

from ferrum_mac.backends.torch.kernels import triton_splits
from ferrum_mac.backends.torch.kernels.triton_ops import MIN_DOT_ROWS  # the tokens are padded to it

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# Tile sizes (columns of a program, then the step of its loop). Small column blocks give a
# single token's GEMVs enough programs to fill the GPU.
GATE_BLOCK_E, GATE_BLOCK_H = 4, 2048
GATE_UP_BLOCK_I, GATE_UP_BLOCK_H = 16, 128
# down_sum_plus, split: a program per pair takes the pair's rows for its columns in one step
# (its loads all in flight at once; Triton pipelines only a loop's loads for tl.dot).
DOWN_BLOCK_H, DOWN_BLOCK_I = 16, 1024
UNSPLIT_DOWN_BLOCK_H, UNSPLIT_DOWN_BLOCK_I = 16, 256  # a program per token


# -- launches -----------------------------------------------------------------------------------


def route(logits: torch.Tensor, top_k: int, renormalise: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits `(T, E)` -> expert ids `(T, top_k)` int32 (best first) and their weights
    `(T, top_k)` in `dtype`, as `qwen3_moe.Router` computes them."""
    tokens, experts = logits.shape
    assert logits.stride(1) == 1 and top_k <= experts
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
    _route_kernel[(tokens,)](
        logits, logits.stride(0), ids, weights, EXPERTS=experts, K=top_k,
        EXPERTS_PAD=triton.next_power_of_2(experts), K_PAD=triton.next_power_of_2(top_k),
        RENORMALISE=renormalise, num_warps=1,
    )
    return ids, weights


def gate_route(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalise: bool,
               block_e: int | None = None, block_h: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`route(F.linear(x, gate), ...)` in one launch: x `(T, H)`, gate `(E, H)` -> expert ids
    `(T, top_k)` int32 and their weights `(T, top_k)` in x's dtype."""
    block_e, block_h = block_e or GATE_BLOCK_E, block_h or GATE_BLOCK_H
    (tokens, hidden), experts = x.shape, gate.shape[0]
    assert x.stride(1) == 1 and gate.is_contiguous() and gate.shape[1] == hidden and top_k <= experts
    assert tokens <= triton_splits.SPLIT_COUNTERS
    logits = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=x.dtype, device=x.device)
    _gate_route_kernel[(tokens, triton.cdiv(experts, block_e))](
        x, x.stride(0), gate, logits, triton_splits.split_counters(x.device), ids, weights,
        HIDDEN=hidden, EXPERTS=experts, K=top_k, EXPERTS_PAD=triton.next_power_of_2(experts),
        K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block_e, BLOCK_H=min(block_h, triton.next_power_of_2(hidden)),
        RENORMALISE=renormalise, num_warps=4,
    )
    return ids, weights


def gate_up_swiglu(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   block_i: int | None = None, block_h: int | None = None) -> torch.Tensor:
    """x `(T, H)`, ids/weights `(T, k)`, gate_up `(E, 2I, H)` (gate rows first) -> the pairs'
    activations `(T * k, I)` in (token, slot) order: silu(x Wg^T) * (x Wu^T) * weight."""
    block_i, block_h = block_i or GATE_UP_BLOCK_I, block_h or GATE_UP_BLOCK_H
    (tokens, hidden), (_, top_k), (_, double, _) = x.shape, ids.shape, gate_up.shape
    inter = double // 2
    assert x.stride(1) == 1 and ids.is_contiguous() and weights.is_contiguous() and gate_up.is_contiguous()
    assert gate_up.shape[2] == hidden and gate_up.dtype == x.dtype
    pairs = tokens * top_k
    out = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _gate_up_swiglu_kernel[(pairs, triton.cdiv(inter, block_i))](
        x, x.stride(0), ids, weights, gate_up, out, tokens,
        K=top_k, HIDDEN=hidden, INTER=inter, TOKENS_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(tokens)),
        PAIRS_PAD=triton.next_power_of_2(pairs), K_PAD=triton.next_power_of_2(top_k),
        BLOCK_I=block_i, BLOCK_H=min(block_h, triton.next_power_of_2(hidden)),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
    )
    return out


def down_sum_plus(activations: torch.Tensor, ids: torch.Tensor, down: torch.Tensor, residual: torch.Tensor,
                  block_h: int | None = None, block_i: int | None = None, split: bool | None = None) -> torch.Tensor:
    """The pairs' activations `(T * k, I)`, ids `(T, k)`, down `(E, H, I)`, residual `(T, H)` ->
    residual + the sum over each token's k pairs of activation Wd^T, `(T, H)`. `split`: a
    program per pair (by default, unless `triton_splits.SPLIT_K` turns splitting off) or per token."""
    split = triton_splits.SPLIT_K > 1 if split is None else split
    (tokens, top_k), (_, hidden, inter) = ids.shape, down.shape
    assert activations.is_contiguous() and ids.is_contiguous() and down.is_contiguous() and residual.stride(1) == 1
    assert activations.shape == (tokens * top_k, inter) and down.dtype == residual.dtype
    block_h = block_h or (DOWN_BLOCK_H if split else UNSPLIT_DOWN_BLOCK_H)
    block_i = min(block_i or (DOWN_BLOCK_I if split else UNSPLIT_DOWN_BLOCK_I), triton.next_power_of_2(inter))
    blocks = triton.cdiv(hidden, block_h)
    out = torch.empty((tokens, hidden), dtype=residual.dtype, device=residual.device)
    if not split:
        _down_sum_plus_kernel[(tokens, blocks)](
            activations, ids, down, residual, residual.stride(0), out,
            K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_H=block_h, BLOCK_I=block_i, num_warps=4, num_stages=3,
        )
        return out
    assert tokens * blocks <= triton_splits.SPLIT_COUNTERS
    products = torch.empty((tokens * top_k, hidden), dtype=torch.float32, device=residual.device)
    _down_split_sum_plus_kernel[(tokens * top_k, blocks)](
        activations, ids, down, residual, residual.stride(0), products, triton_splits.split_counters(residual.device), out,
        K=top_k, HIDDEN=hidden, INTER=inter, BLOCK_H=block_h, BLOCK_I=block_i, num_warps=4, num_stages=3,
    )
    return out


def experts_plus(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + the router-weighted sum of each token's chosen experts' SwiGLU MLPs."""
    return down_sum_plus(gate_up_swiglu(x, ids, weights, gate_up), ids, down, residual)


# -- kernels ------------------------------------------------------------------------------------

if triton is not None:
    from ferrum_mac.backends.torch.kernels.triton_splits import arrived_last, sum_of_splits

    @triton.jit
    def _swiglu_as_torch(gate, up, weight, dtype: tl.constexpr):
        """silu(gate) * up * weight from float32 projections, rounded to `dtype` where the torch
        path stores: each projection's output, silu, the product with up, the weighted result."""
        gate, up = gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return ((silu * up).to(dtype).to(tl.float32) * weight).to(dtype)

    @triton.jit
    def _route_kernel(
        logits_ptr, row_stride, ids_ptr, weights_ptr,
        EXPERTS: tl.constexpr, K: tl.constexpr, EXPERTS_PAD: tl.constexpr, K_PAD: tl.constexpr,
        RENORMALISE: tl.constexpr,
    ):
        token = tl.program_id(0)
        experts = tl.arange(0, EXPERTS_PAD)
        logits = tl.load(logits_ptr + token * row_stride + experts, mask=experts < EXPERTS, other=-float("inf"))
        _route_token(logits.to(tl.float32), token, ids_ptr, weights_ptr, EXPERTS, K, EXPERTS_PAD, K_PAD, RENORMALISE)

    @triton.jit
    def _gate_route_kernel(
        x_ptr, x_row_stride, gate_ptr, logits_ptr, counters_ptr, ids_ptr, weights_ptr,
        HIDDEN: tl.constexpr, EXPERTS: tl.constexpr, K: tl.constexpr, EXPERTS_PAD: tl.constexpr,
        K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, RENORMALISE: tl.constexpr,
    ):
        # One program per (token, block of BLOCK_E experts): their logits, rounded to x's dtype,
        # to `logits` (T, E) in float32. The last of a token's programs to finish routes it.
        token, block = tl.program_id(0), tl.program_id(1)
        experts = block * BLOCK_E + tl.arange(0, BLOCK_E)
        real = experts < EXPERTS
        acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
        for start in range(0, HIDDEN, BLOCK_H):
            hidden = start + tl.arange(0, BLOCK_H)
            inside = hidden < HIDDEN
            x = tl.load(x_ptr + token * x_row_stride + hidden, mask=inside, other=0.0).to(tl.float32)
            w = tl.load(
                gate_ptr + experts[:, None] * HIDDEN + hidden[None, :], mask=real[:, None] & inside[None, :], other=0.0
            )
            acc += w.to(tl.float32) * x[None, :]
        logits = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + token * EXPERTS + experts, logits, mask=real)
        if arrived_last(counters_ptr + token, tl.num_programs(1)):
            every = tl.arange(0, EXPERTS_PAD)
            row = tl.load(
                logits_ptr + token * EXPERTS + every, mask=every < EXPERTS, other=-float("inf"), cache_modifier=".cg"
            )
            _route_token(row, token, ids_ptr, weights_ptr, EXPERTS, K, EXPERTS_PAD, K_PAD, RENORMALISE)

    @triton.jit
    def _route_token(
        logits, token, ids_ptr, weights_ptr,
        EXPERTS: tl.constexpr, K: tl.constexpr, EXPERTS_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORMALISE: tl.constexpr,
    ):
        """A token's float32 logits `(EXPERTS_PAD,)` (-inf past EXPERTS) -> its k expert ids and weights."""
        experts = tl.arange(0, EXPERTS_PAD)
        real = experts < EXPERTS
        exps = tl.exp(logits - tl.max(logits, axis=0))
        probs = tl.where(real, exps / tl.sum(exps, axis=0), -1.0)  # -1: below any probability, never chosen

        slots = tl.arange(0, K_PAD)
        ids = tl.zeros([K_PAD], dtype=tl.int32)
        chosen = tl.zeros([K_PAD], dtype=tl.float32)
        for slot in tl.static_range(K):
            best = tl.argmax(probs, axis=0, tie_break_left=True)
            ids = tl.where(slots == slot, best, ids)
            chosen = tl.where(slots == slot, tl.max(probs, axis=0), chosen)
            probs = tl.where(experts == best, -1.0, probs)
        if RENORMALISE:
            chosen = chosen / tl.sum(chosen, axis=0)  # slots past K hold 0
        in_k = slots < K
        tl.store(ids_ptr + token * K + slots, ids, mask=in_k)
        tl.store(weights_ptr + token * K + slots, chosen.to(weights_ptr.dtype.element_ty), mask=in_k)

    @triton.jit
    def _gate_up_swiglu_kernel(
        x_ptr, x_row_stride, ids_ptr, weights_ptr, gate_up_ptr, out_ptr, tokens,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, TOKENS_PAD: tl.constexpr,
        PAIRS_PAD: tl.constexpr, K_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        # One program per (pair, block of BLOCK_I intermediate columns); only the expert's
        # first pair works, for all the tokens that chose the expert.
        pair, block = tl.program_id(0), tl.program_id(1)
        expert = tl.load(ids_ptr + pair)
        before = tl.arange(0, PAIRS_PAD)
        earlier_ids = tl.load(ids_ptr + before, mask=before < pair, other=-1)
        if tl.max((earlier_ids == expert).to(tl.int32), axis=0) == 0:
            _gate_up_swiglu_of_expert(
                x_ptr, x_row_stride, ids_ptr, weights_ptr, gate_up_ptr, out_ptr, tokens, expert, block,
                K, HIDDEN, INTER, TOKENS_PAD, K_PAD, BLOCK_I, BLOCK_H, PRECISION,
            )

    @triton.jit
    def _gate_up_swiglu_of_expert(
        x_ptr, x_row_stride, ids_ptr, weights_ptr, gate_up_ptr, out_ptr, tokens, expert, block,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, TOKENS_PAD: tl.constexpr,
        K_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # Which tokens chose `expert`, and in which of their slots (a token chooses it at most once).
        rows = tl.arange(0, TOKENS_PAD)
        slots = tl.arange(0, K_PAD)
        pairs = rows[:, None] * K + slots[None, :]
        ids = tl.load(ids_ptr + pairs, mask=(rows[:, None] < tokens) & (slots[None, :] < K), other=-1)
        hits = ids == expert
        uses = tl.max(hits.to(tl.int32), axis=1) > 0
        pair_of = tl.sum(tl.where(hits, pairs, 0), axis=1)

        columns = block * BLOCK_I + tl.arange(0, BLOCK_I)
        in_columns = columns < INTER
        gate_rows = gate_up_ptr + expert.to(tl.int64) * (2 * INTER * HIDDEN) + columns[None, :] * HIDDEN
        up_rows = gate_rows + INTER * HIDDEN
        gate = tl.zeros([TOKENS_PAD, BLOCK_I], dtype=tl.float32)
        up = tl.zeros([TOKENS_PAD, BLOCK_I], dtype=tl.float32)
        for start in range(0, HIDDEN, BLOCK_H):
            hidden = start + tl.arange(0, BLOCK_H)
            in_hidden = hidden < HIDDEN
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + hidden[None, :],
                mask=uses[:, None] & in_hidden[None, :],
                other=0.0,
            )
            both = in_hidden[:, None] & in_columns[None, :]
            gate = tl.dot(
                x, tl.load(gate_rows + hidden[:, None], mask=both, other=0.0), gate, input_precision=PRECISION
            )
            up = tl.dot(x, tl.load(up_rows + hidden[:, None], mask=both, other=0.0), up, input_precision=PRECISION)

        weight = tl.load(weights_ptr + pair_of, mask=uses, other=0.0).to(tl.float32)
        out = _swiglu_as_torch(gate, up, weight[:, None], out_ptr.dtype.element_ty)
        tl.store(out_ptr + pair_of[:, None] * INTER + columns[None, :], out, mask=uses[:, None] & in_columns[None, :])

    @triton.jit
    def _down_sum_plus_kernel(
        activations_ptr, ids_ptr, down_ptr, residual_ptr, residual_row_stride, out_ptr,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    ):
        # One program per (token, block of BLOCK_H hidden columns): its k experts' rows for
        # those columns, concatenated, dotted with its k pairs' activations (one loop, so the
        # loads pipeline across experts). Partial products are summed once, after the loop.
        token, block = tl.program_id(0), tl.program_id(1)
        columns = block * BLOCK_H + tl.arange(0, BLOCK_H)
        in_columns = columns < HIDDEN
        steps_per_pair: tl.constexpr = (INTER + BLOCK_I - 1) // BLOCK_I
        acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
        for step in range(0, K * steps_per_pair):
            pair = token * K + step // steps_per_pair
            inner = (step % steps_per_pair) * BLOCK_I + tl.arange(0, BLOCK_I)
            in_inner = inner < INTER
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            a = tl.load(activations_ptr + pair * INTER + inner, mask=in_inner, other=0.0).to(tl.float32)
            rows = down_ptr + expert * (HIDDEN * INTER) + columns[:, None] * INTER + inner[None, :]
            w = tl.load(rows, mask=in_columns[:, None] & in_inner[None, :], other=0.0).to(tl.float32)
            acc += w * a[None, :]
        residual = tl.load(residual_ptr + token * residual_row_stride + columns, mask=in_columns, other=0.0)
        out = residual.to(tl.float32) + tl.sum(acc, axis=1)
        tl.store(out_ptr + token * HIDDEN + columns, out.to(residual.dtype), mask=in_columns)

    @triton.jit
    def _down_split_sum_plus_kernel(
        activations_ptr, ids_ptr, down_ptr, residual_ptr, residual_row_stride, products_ptr, counters_ptr, out_ptr,
        K: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
    ):
        # One program per (pair, block of BLOCK_H hidden columns): its expert's rows for those
        # columns dotted with its activation, to `products` (T * k, H) in float32. The last of
        # a token's K programs for the block to finish sums their products, adds the residual.
        pair, block = tl.program_id(0), tl.program_id(1)
        token = pair // K
        columns = block * BLOCK_H + tl.arange(0, BLOCK_H)
        in_columns = columns < HIDDEN
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        rows = down_ptr + expert * (HIDDEN * INTER) + columns[:, None] * INTER
        acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
        for start in range(0, INTER, BLOCK_I):
            inner = start + tl.arange(0, BLOCK_I)
            in_inner = inner < INTER
            a = tl.load(activations_ptr + pair * INTER + inner, mask=in_inner, other=0.0).to(tl.float32)
            w = tl.load(rows + inner[None, :], mask=in_columns[:, None] & in_inner[None, :], other=0.0).to(tl.float32)
            acc += w * a[None, :]
        tl.store(products_ptr + pair * HIDDEN + columns, tl.sum(acc, axis=1), mask=in_columns)
        if arrived_last(counters_ptr + token * tl.num_programs(1) + block, K):
            products = sum_of_splits(products_ptr, token * K * HIDDEN + columns, in_columns, K, HIDDEN)
            residual = tl.load(residual_ptr + token * residual_row_stride + columns, mask=in_columns, other=0.0)
            out = residual.to(tl.float32) + products
            tl.store(out_ptr + token * HIDDEN + columns, out.to(residual.dtype), mask=in_columns)
