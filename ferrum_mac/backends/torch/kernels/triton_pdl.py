"""Programmatic dependent launch (Hopper and later) for a decode step's Triton kernels: each
kernel may start while the one before it finishes, so the GPU is not idle between them.

A step is a chain of small kernels, each a few microseconds, and each pays a ramp at its start
(launch, the first loads' trip to memory) and a tail at its end (the last programs, the split
sums). Launched with `launch_pdl`, a kernel's programs start as soon as every program of the
kernel before has passed `wait_for_previous`. Until its own `wait_for_previous` a program may
only read what no kernel before it writes: the GEMVs (and `triton_qkv`) prefetch their first
weight lines into L2 there (`prefetch_rows`). Everything else, every store and every read of
an activation, comes after the wait, which returns once the kernel before has finished and
its writes are visible; so a kernel never sees, nor overwrites, what the one before is still
using (its buffers may be the same memory, reused by torch's allocator in stream order).

Kernels with no weight, and those streaming at most PDL_MAX_BYTES of one, launch early: it
speeds up a step of small GEMVs (Qwen3-0.6B's) and slows one of large GEMVs (Qwen3-8B's),
whose prefetched lines are evicted before use by the kernel still streaming, and whose
programs, placed while another kernel fills the SMs, may sit unevenly.

FERRUM_TORCH_PDL=0 turns it off (for A/B timing). PREFETCH_BYTES is the weight each GEMV
program prefetches before its wait (0: none); PDL_MAX_BYTES the largest weight a kernel
launching early streams.
"""

import functools
import os

import torch

from ferrum_mac.backends.torch.kernels import switches

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    triton = None

# 64 KB a program: the least that runs at full speed.
PREFETCH_BYTES = 64 << 10
PDL_MAX_BYTES = 16 << 20
LINE_BYTES = 128  # an L2 line: what one prefetch brings


def pdl_for(device: torch.device, weight: torch.Tensor | None = None) -> bool:
    """Whether a kernel on `device` launches early, given the weight it streams (if any)."""
    return switches.pdl and pdl_runs(device) and (weight is None or weight.numel() * weight.element_size() <= PDL_MAX_BYTES)


@functools.cache
def pdl_runs(device: torch.device) -> bool:
    """Whether kernels on `device` can launch dependently: CUDA compute capability 9 or
    later (griddepcontrol is Hopper's), compiled (not Triton's interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(pdl: bool) -> dict:
    """The launch's keyword arguments, with the kernel's constexpr of the same choice:
    `kernel[grid](..., PDL=pdl, **launch_options(pdl))`."""
    return {"launch_pdl": True} if pdl else {}


def prefetch_lines(rows: int, k: int, element_size: int) -> int:
    """L2 lines of each weight row a GEMV program prefetches: PREFETCH_BYTES over its `rows`
    rows, no more than its share `k` of a row holds, a power of two (at least one, if
    prefetching at all)."""
    if PREFETCH_BYTES <= 0:
        return 0
    whole_row = triton.cdiv(k * element_size, LINE_BYTES)
    lines = max(1, min(whole_row, PREFETCH_BYTES // (rows * LINE_BYTES)))
    return 1 << (lines.bit_length() - 1)


if triton is not None:

    @triton.jit
    def wait_for_previous(PDL: tl.constexpr):
        """Waits for the kernel before to finish (its writes then visible), then lets the next
        kernel start its programs. A no-op unless PDL."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def prefetch_rows(row_ptrs, inside, k_begin, k_end, LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
        """Prefetches into L2 the first LINES lines of each weight row at `row_ptrs` (a column of
        pointers to row starts, where `inside`) from k_begin on, up to k_end."""
        ks = k_begin + tl.arange(0, LINES)[None, :] * LINE_ELEMENTS
        wanted = inside[:, None] & (ks < k_end)
        ptrs = tl.where(wanted, row_ptrs + ks, row_ptrs)  # a line not wanted: the row's start again
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
