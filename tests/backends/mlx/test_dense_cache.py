"""The dense copies of quantized checkpoints MLX's CPU build loads (backends/mlx/cpu/dense_cache.py)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.backends.mlx.cpu import dense_cache

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="quantized checkpoints load dense on MLX's CPU build only"
)

TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q4_1",
    "token_embd": "Q8_0",
}
PROMPT = [1, 5, 9, 42, 7]


@pytest.fixture
def gguf_file(zoo, tmp_path):
    from helpers import write_gguf_from_hf

    return write_gguf_from_hf(zoo.hf("llama"), "llama", tmp_path / "tiny.gguf", TYPES)


def entries() -> list:
    folder = dense_cache.cache_dir()
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) if folder.is_dir() else []


def logits(path) -> np.ndarray:
    model = ferrum_mac.open_model(path, dtype="float32")
    return np.array(model.forward_verify("x", PROMPT))


def test_second_open_reads_the_dense_copy_not_the_gguf(gguf_file, monkeypatch):
    before = entries()
    first = logits(gguf_file)
    written = sorted(set(entries()) - set(before))
    assert len(written) == 1

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read or dequantized again")

    monkeypatch.setattr("ferrum_mac.weights.gguf._read_raw", refuse)
    monkeypatch.setattr(dense_cache, "dequantized", refuse)
    np.testing.assert_array_equal(logits(gguf_file), first)


def test_a_changed_file_replaces_its_copy_and_the_switch_turns_it_off(gguf_file, monkeypatch):
    logits(gguf_file)
    old = set(entries())
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    logits(gguf_file)
    now = set(entries())
    assert len(now - old) == 1 and len(old - now) == 1  # the stale copy went
    monkeypatch.setenv("FERRUM_DENSE_CACHE", "0")
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    logits(gguf_file)
    assert set(entries()) == now


def test_a_damaged_copy_is_dropped_and_rebuilt(gguf_file):
    first = logits(gguf_file)
    entry = dense_cache.entry_path(ferrum_mac.weights.load_checkpoint(gguf_file), mx.float32)
    assert entry.is_file()
    entry.write_bytes(entry.read_bytes()[:1000])
    np.testing.assert_array_equal(logits(gguf_file), first)
    assert entry.stat().st_size > 1000


def test_quantized_modes_agree(gguf_file, monkeypatch):
    """Dense from the copy, dense just dequantized and the quantized kernels: the same model."""
    cached = logits(gguf_file)
    monkeypatch.setenv("FERRUM_DENSE_CACHE", "0")
    np.testing.assert_allclose(logits(gguf_file), cached, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("FERRUM_DEQUANTIZE_ON_CPU", "0")
    np.testing.assert_allclose(logits(gguf_file), cached, rtol=1e-3, atol=1e-3)


def test_a_copy_whose_model_is_gone_is_swept(gguf_file):
    from ferrum_mac.store.derived import recorded_source, sweep_orphans

    before = set(entries())
    logits(gguf_file)
    (written,) = set(entries()) - before
    entry = dense_cache.cache_dir() / written
    assert recorded_source(entry) == str(gguf_file.resolve())
    assert sweep_orphans() == 0 and entry.exists()  # its model is still there
    size = entry.stat().st_size
    gguf_file.unlink()  # as `ferrum rm` (or a user) removes it
    assert sweep_orphans() >= size and not entry.exists()
