"""Applying a batch bitmask to MLX and torch logits: exactly the ids the mask allows keep their
logits, a row without a grammar (all ones) is untouched, ids past the mask are masked; and the
host side of the package imports neither framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrum_mac.grammar import full_mask
from ferrum_mac.grammar.device import apply_mask_mlx, apply_mask_torch

ROOT = Path(__file__).resolve().parents[2]


def batch(rows: int, vocab: int, width: int, seed: int = 0):
    """Random logits `(rows, vocab)`, a random grammar mask over `width` ids (as the engine
    writes it: no bit past `width`) with row 1 all ones (no grammar), and the expected result."""
    rng = np.random.default_rng(seed)
    bits = rng.random((rows, 32 * ((width + 31) // 32))) < 0.5
    bits[:, width:] = False
    mask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    mask[1] = full_mask(1, width)[0]
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    allowed = np.zeros((rows, vocab), dtype=bool)
    allowed[:, : min(vocab, bits.shape[1])] = bits[:, :vocab]
    return logits, mask, np.where(allowed, logits, -np.inf)


# Logits wider than the tokenizer (padded embeddings): inside the mask's last word, and past it.
SHAPES = [(4, 49152, 49152), (3, 1000, 1000), (3, 1003, 1000), (2, 1100, 1000)]


@pytest.mark.parametrize("rows, vocab, width", SHAPES)
def test_mlx_mask(rows, vocab, width):
    mx = pytest.importorskip("mlx.core")
    logits, mask, expected = batch(rows, vocab, width)
    out = apply_mask_mlx(mx.array(logits), mask)
    assert np.array_equal(np.array(out), expected)
    assert np.array_equal(np.array(out)[1, :width], logits[1, :width])


def test_mlx_mask_keeps_dtype():
    mx = pytest.importorskip("mlx.core")
    logits, mask, expected = batch(2, 640, 640)
    out = apply_mask_mlx(mx.array(logits).astype(mx.bfloat16), mx.array(mask))
    assert out.dtype == mx.bfloat16
    assert np.array_equal(np.isinf(np.array(out.astype(mx.float32))), np.isinf(expected))


@pytest.mark.parametrize("rows, vocab, width", SHAPES)
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])  # torch.compile: seconds
def test_torch_mask(rows, vocab, width, compiled):
    torch = pytest.importorskip("torch")
    logits, mask, expected = batch(rows, vocab, width)
    tensor = torch.from_numpy(logits.copy())
    out = apply_mask_torch(tensor, torch.from_numpy(mask), compiled=compiled)
    assert out is tensor
    assert np.array_equal(tensor.numpy(), expected)


def test_host_side_imports_neither_framework():
    code = (
        "import sys, ferrum_mac.grammar, ferrum_mac.grammar.device\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'torch')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
