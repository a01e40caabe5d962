"""Triton's interpreter, for the Triton kernel tests on a machine without a GPU, and what
those tests share (a tolerance, the GEMVs' inputs).

Importing this module before triton sets TRITON_INTERPRET when there is no CUDA device
(Triton reads it when a kernel is defined and again at launches, so it stays set for the
session). `like_a_gpu()` then fixes three ways the interpreter (as of Triton 3.6) computes
unlike a GPU:
- its scalars are 1-element arrays, which numpy >= 2.3 no longer turns into an int, so a loop
  bound read from memory (`range(start, end, ...)`) fails;
- it truncates float32 to bfloat16 where a GPU (and torch) rounds to nearest even, so bf16
  results would be off by an ulp wherever the kernels round as torch does;
- its `tl.dot` multiplies bfloat16 operands as the raw uint16 they are stored in.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"


@contextlib.contextmanager
def like_a_gpu():
    """The interpreter patched to compute as a GPU does, while the block runs (a no-op on a GPU)."""
    if not INTERPRET:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    patch = pytest.MonkeyPatch()
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_with_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder = type(interpreter.interpreter_builder)
    cast, dot = builder.cast_impl, builder.create_dot

    def cast_rounding_to_nearest(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            floats = torch.from_numpy(np.ascontiguousarray(src.data))
            return interpreter.TensorHandle(
                floats.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), tl.bfloat16
            )
        return cast(self, src, dst_type)

    def dot_of_bfloat16_as_float32(self, a, b, acc, *args):
        if a.dtype.scalar == tl.bfloat16:  # bf16 bits are a float32's top half
            a, b = (
                interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32) for x in (a, b)
            )
        return dot(self, a, b, acc, *args)

    patch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor_with_index)
    patch.setattr(builder, "cast_impl", cast_rounding_to_nearest)
    patch.setattr(builder, "create_dot", dot_of_bfloat16_as_float32)
    try:
        yield
    finally:
        patch.undo()


def ulps(dtype: torch.dtype) -> float:
    """A tolerance of a couple of units in the last place for `dtype`'s activations."""
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def gemv_inputs(rows: int, k: int, n: int, dtype: torch.dtype, bias: bool):
    """x, its RMSNorm, a weight `(n, k)` scaled to keep outputs near 1, and maybe a bias."""
    from ferrum_mac.backends.torch.layers import RmsNorm  # (after TRITON_INTERPRET is set)

    torch.manual_seed(rows * k + n)
    x = (3 * torch.randn(rows, k, device=DEVICE)).to(dtype)
    norm = RmsNorm((1 + 0.3 * torch.randn(k, device=DEVICE)).to(dtype), 1e-6)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    return x, norm, weight, torch.randn(n, device=DEVICE).to(dtype) if bias else None
