"""Apply a token bitmask to a batch of logits on the device: MLX arrays and torch tensors.

`bitmask` is `(rows, words)` int32 from `GrammarMatcher.fill_mask` (bit i of word j allows id
32*j+i); a row without a grammar is all ones (`tokens.full_mask`). Logits wider than the mask's
ids are masked past it. MLX and torch are imported by the function that needs them, so the
engine layer can import this package without either framework.

The bits are unpacked a byte at a time (the words viewed as little-endian bytes, which is how
the engine writes them): a quarter of the work of shifting each int32 word 32 ways.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_BYTE_BITS = [1, 2, 4, 8, 16, 32, 64, 128]


def apply_mask_mlx(logits: Any, bitmask: np.ndarray | Any) -> Any:
    """`logits` `(rows, vocab)` with every id the mask does not allow set to -inf (a new array)."""
    import mlx.core as mx

    mask = mx.array(bitmask) if isinstance(bitmask, np.ndarray) else bitmask
    rows, vocab = logits.shape
    bits = mx.expand_dims(mx.view(mask, mx.uint8), -1) & mx.array(_BYTE_BITS, dtype=mx.uint8)
    allowed = bits.reshape(rows, -1) != 0
    covered = allowed.shape[1]
    if covered >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = mx.concatenate([allowed, mx.zeros((rows, vocab - covered), dtype=mx.bool_)], axis=1)
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def apply_mask_torch(logits: Any, bitmask: np.ndarray | Any, compiled: bool = False) -> Any:
    """Set, in place, every id of `logits` `(rows, vocab)` the mask does not allow to -inf; returns `logits`.

    `compiled`: use the engine's own `torch.compile`d kernel, far faster per call but it
    compiles (seconds) on first use and on each new dtype: for a long-running server, not a
    one-off CLI answer. If it cannot compile here, the plain version runs instead.
    """
    import torch

    mask = torch.from_numpy(bitmask) if isinstance(bitmask, np.ndarray) else bitmask
    mask = mask.to(logits.device, non_blocking=True)
    if compiled and _apply_compiled(logits, mask):
        return logits
    rows, vocab = logits.shape
    bits = (mask.view(torch.uint8).unsqueeze(-1) & _torch_byte_bits(logits.device)).reshape(rows, -1)
    covered = min(bits.shape[1], vocab)
    logits[:, :covered].masked_fill_(bits[:, :covered] == 0, float("-inf"))
    if covered < vocab:
        logits[:, covered:] = float("-inf")
    return logits


@functools.cache
def _torch_byte_bits(device: Any) -> Any:
    # Made once per device: a fresh host tensor each step would be a copy the step waits on.
    import torch

    return torch.tensor(_BYTE_BITS, dtype=torch.uint8, device=device)


_compiled_failed = False


def _apply_compiled(logits: Any, mask: Any) -> bool:
    global _compiled_failed
    if _compiled_failed:
        return False
    try:
        from llguidance.torch import apply_token_bitmask_inplace

        apply_token_bitmask_inplace(logits, mask)
        return True
    except Exception:  # no compiler toolchain for torch.compile here: the plain kernel is always there
        _compiled_failed = True
        return False
