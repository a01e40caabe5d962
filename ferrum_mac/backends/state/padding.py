"""Padded lengths: few distinct shapes for the kernels that are built once per shape.

A torch CUDA graph is captured per prefill length, and MLX's CUDA attention builds a cuDNN
graph per (queries, keys) shape, each costing far more than the work it then does once.
Padding lengths up to one of four values an octave keeps the shapes a server meets few,
for at most a quarter more rows.
"""

from __future__ import annotations


def power_of_two_above(n: int) -> int:
    """The least power of two >= n (>= 1): decode steps' sizes, so changing batches and growing
    sequences share few steps (each one a CUDA graph to capture)."""
    return 1 << max(0, n - 1).bit_length()


def quarter_octave_above(n: int, least: int = 64) -> int:
    """`n` rounded up to one of four lengths an octave from `least` (a power of two) on:
    with 64, that is 64, 80, 96, 112, 128, 160, ... (steps of at least 16 rows)."""
    octave = power_of_two_above(max(n, least))
    step = max(octave // 8, min(16, least)) if octave > least else least
    return -(-n // step) * step
