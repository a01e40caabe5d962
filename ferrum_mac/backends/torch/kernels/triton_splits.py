"""Sums split over several programs of one Triton kernel, finished in the same launch: each
program stores its float32 part, and the last of them to arrive (`arrived_last`) adds the
parts up in split order (`sum_of_splits`: the same rounding whichever program finished last)
and finishes the work. So a kernel with too few programs for the GPU's SMs can split its
reduction without a second launch. The GEMVs (`triton_gemv`), the MoE down projection
(`triton_moe`) and decode attention (`triton_ops`) split so.

SPLIT_K: the most programs a GEMV's column block splits its K over. 0 (or 1) turns splitting
a matmul's sum off: in the GEMVs, and in
`triton_moe.down_sum_plus` (then a token's k pairs are one program's).
"""

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SPLIT_K = 8
SPLIT_COUNTERS = 1 << 16


@functools.cache
def split_counters(device: torch.device) -> torch.Tensor:
    """Arrival counters for the kernels whose programs split a sum and whose last program to
    finish adds up the parts (`arrived_last`). That program sets its counter back to 0, so
    they are zero between launches and a CUDA graph replays those kernels with no memset.
    One set per device: its kernels run one after another on one stream."""
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def split_buffers(
    splits: int, blocks: int, shape: tuple[int, ...], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partials `(splits, *shape)` and the arrival counters (one a block) of a
    launch whose `blocks` blocks each split their sum `splits` ways; with no split, `like`
    for both (a pointer the kernel never reads)."""
    if splits > 1:
        assert blocks <= SPLIT_COUNTERS
        return torch.empty((splits, *shape), dtype=torch.float32, device=like.device), split_counters(like.device)
    return like, like


if triton is not None:

    @triton.jit
    def arrived_last(counter_ptr, arrivals):
        """Whether this program is the last of `arrivals` to reach the counter (which it then
        resets). Every program's stores before the call are visible to the last one's loads
        after it: the barrier orders the program's threads before its atomic, whose acquire
        and release order the programs (inductor's grid barrier does the same)."""
        tl.debug_barrier()
        last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1
        if last:
            tl.store(counter_ptr, 0)
        return last

    @triton.jit
    def sum_of_splits(partials_ptr, offsets, mask, splits, split_stride):
        """The float32 partials of `splits` programs at `offsets`, `split_stride` apart, summed
        in split order (the same rounding whichever program finished last). Read from L2 (.cg):
        other SMs wrote them."""
        total = tl.load(partials_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        for split in range(1, splits):
            total += tl.load(partials_ptr + split * split_stride + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        return total
