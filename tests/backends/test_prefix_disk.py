"""The prefix cache's disk tier (`prefix_disk`) under a host-array pool whose keys and values
are a function of each row's token and position, so a block read back from disk is checked
bit for bit against what the model would have computed."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ferrum_mac.backends.state import prefix_disk
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.backends.state.block_pool import BlockPool
from ferrum_mac.backends.state.prefix_disk import SUFFIX, PrefixDisk, for_checkpoint, model_key
from ferrum_mac.llm import MISS_NO_PREFIX, MISS_OTHER_MODEL
from ferrum_mac.weights import load_checkpoint

from helpers import SHARED
from test_block_pool import check_counts, ids

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
STORIES = SHARED / "assets" / "stories260K"


class KvPool(BlockPool):
    """Keys and values on the host: `(layers, 2, kv_heads, rows, head_dim)` in `dtype`
    (bfloat16 held as uint16 bits, as the backends hand it to the disk tier)."""

    def __init__(self, *args, dtype="float32", **kwargs):
        super().__init__(*args, **kwargs)
        self.np_dtype = prefix_disk.DTYPES[dtype][1]
        self.kv = self._zeros(0)

    def _zeros(self, blocks):
        return np.zeros((LAYERS, 2, KV_HEADS, blocks * B, HEAD_DIM), self.np_dtype)

    def _resize(self, blocks, keep):
        new = self._zeros(blocks)
        for i, old in enumerate(keep):
            new[:, :, :, i * B : (i + 1) * B] = self.kv[:, :, :, old * B : (old + 1) * B]
        self.kv = new

    def _copy_block(self, src, dst, tokens):
        self.kv[:, :, :, dst * B : dst * B + tokens] = self.kv[:, :, :, src * B : src * B + tokens]

    def _drop(self):
        self.kv = self._zeros(0)

    def _read_blocks(self, blocks):
        return np.concatenate([self.kv[:, :, :, b * B : (b + 1) * B] for b in blocks], axis=3)

    def _write_blocks(self, blocks, array):
        for i, b in enumerate(blocks):
            self.kv[:, :, :, b * B : (b + 1) * B] = array[:, :, :, i * B : (i + 1) * B]

    def computed(self, tokens, start):
        """What a model would write for `tokens` at positions `start...`."""
        t = np.asarray(tokens, np.float32)[:, None] * 0.731 + np.arange(start, start + len(tokens))[:, None] * 1.37
        values = np.sin(t + np.arange(LAYERS * 2 * KV_HEADS * HEAD_DIM).reshape(LAYERS, 2, KV_HEADS, 1, HEAD_DIM))
        values = values.astype(np.float32)
        if self.np_dtype == np.uint16:  # bfloat16: the high half of a float32
            return (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.astype(self.np_dtype)

    def start(self, cid, prompt):
        """A request: reuse what is cached, compute the rest, remember it."""
        found = self.prefix.reuse(cid, prompt)
        seq = self.acquire(cid)
        assert np.array_equal(self.held(cid), self.computed(prompt[: found.tokens], 0))
        self.reserve(seq, found.tokens, len(prompt))
        self.kv[:, :, :, seq.places(found.tokens, len(prompt))] = self.computed(prompt[found.tokens :], found.tokens)
        seq.length = len(prompt)
        self.prefix.remember(cid, prompt)
        return found

    def held(self, cid):
        seq = self.caches[cid]
        return self.kv[:, :, :, seq.places(0, seq.length)]


def open_disk(root, key="model", dtype="float32", budget=1 << 30, **kwargs):
    return PrefixDisk(root, key, dtype, budget, min_free_bytes=kwargs.pop("min_free_bytes", 0), **kwargs)


def serve(root, prompt, dtype="float32", **kwargs):
    """One process's life: a pool with a disk tier answers `prompt`, waits for its writes."""
    disk = open_disk(root, dtype=dtype, **kwargs)
    pool = KvPool(8192, cache_blocks=1000, disk=disk, dtype=dtype)
    found = pool.start("a", prompt)
    pool.release("a")  # what the disk tier writes is handed to it at a release
    assert disk.wait_for_writes(10)
    return pool, found


def block_files(folder):
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_long_prompt_comes_back_from_disk_bit_exact_after_a_restart(tmp_path, dtype):
    prompt = ids(40 * B + 5, 1)  # past LONG_PREFIX_TOKENS: written on first sight
    first, found = serve(tmp_path, prompt, dtype)
    assert found.tokens == 0
    assert len(block_files(tmp_path / "model")) == 40
    written = sum(p.stat().st_size for p in block_files(tmp_path / "model"))
    assert first.prefix.read_stats().disk_bytes_written == written

    second = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path, dtype=dtype), dtype=dtype)
    found = second.start("b", prompt)  # (start checks every reused row against the computed one)
    assert (found.tokens, found.cached, found.miss) == (40 * B, 40 * B, None)
    stats = second.prefix.read_stats()
    assert stats.disk_tokens_loaded == 40 * B and stats.disk_bytes_read > 0 and stats.disk_bytes_written == 0
    assert np.array_equal(second.held("b"), first.computed(prompt, 0))
    check_counts(second)


def test_a_short_prompt_is_written_once_reused_and_never_rewritten(tmp_path):
    disk = open_disk(tmp_path)
    pool = KvPool(8192, cache_blocks=1000, disk=disk)
    prompt = ids(4 * B + 3, 2)
    pool.start("a", prompt)
    pool.release("a")
    assert disk.wait_for_writes(10) and disk.bytes_written == 0  # seen once, short: not worth the SSD
    pool.start("b", prompt)
    pool.release("b")
    assert disk.wait_for_writes(10)
    files = block_files(tmp_path / "model")
    assert len(files) == 4
    written, stamps = disk.bytes_written, [p.stat().st_mtime_ns for p in files]
    pool.start("c", prompt + [7])
    pool.release("c")
    assert disk.wait_for_writes(10)
    assert disk.bytes_written == written and [p.stat().st_mtime_ns for p in files] == stamps


def test_the_budget_keeps_the_most_recently_used_blocks(tmp_path):
    prompt = ids(40 * B, 3)
    _, _ = serve(tmp_path, prompt)
    size = block_files(tmp_path / "model")[0].stat().st_size
    old = tmp_path / "model" / f"{'0' * 32}{SUFFIX}"  # an old file, another prompt's
    old.write_bytes(b"x" * size)
    os.utime(old, (1, 1))
    pool, _ = serve(tmp_path, ids(40 * B, 4), budget=50 * size)  # 40 more blocks: 30 must go
    kept = block_files(tmp_path / "model")
    assert len(kept) == 50 and old not in kept
    assert sum(p.stat().st_size for p in kept) <= 50 * size
    assert pool.prefix.disk.wait_for_writes(1) and len(pool.prefix.disk.files) == 50


def test_a_torn_file_is_a_miss_and_is_removed(tmp_path):
    prompt = ids(40 * B, 5)
    serve(tmp_path, prompt)
    files = block_files(tmp_path / "model")
    torn = files[0]  # (sorted by name: some block of the prompt)
    torn.write_bytes(torn.read_bytes()[:-100])
    damaged = files[1]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    disk = open_disk(tmp_path)
    digests = {p.name.removesuffix(SUFFIX) for p in (torn, damaged)}
    assert all(disk.load(d) is None for d in digests)
    assert not torn.exists() and not damaged.exists()
    pool = KvPool(8192, cache_blocks=1000, disk=disk)
    found = pool.start("b", prompt)  # whatever came before the torn blocks is reused, bit-exact
    assert found.tokens < 40 * B
    check_counts(pool)


def test_a_dead_writers_temporary_files_are_swept_at_open(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    crashed = folder / f".{'a' * 32}.{dead}.tmp"
    crashed.write_bytes(b"half a block")
    live = folder / f".{'b' * 32}.{os.getppid()}.tmp"  # another process, still writing
    live.write_bytes(b"being written")
    old = folder / f".{'c' * 32}.{os.getppid()}.tmp"
    old.write_bytes(b"long dead")
    os.utime(old, (time.time() - 3600,) * 2)
    open_disk(tmp_path)
    assert not crashed.exists() and not old.exists() and live.exists()


def test_another_model_or_dtype_never_matches_and_the_miss_says_so(tmp_path):
    prompt = ids(40 * B, 6)
    serve(tmp_path, prompt)
    other = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path, key="other"))
    found = other.start("a", prompt)
    assert (found.tokens, found.miss) == (0, MISS_OTHER_MODEL)
    assert other.prefix.read_stats().misses == {MISS_OTHER_MODEL: 1}
    fresh = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path, key="third"))
    assert fresh.start("a", ids(40 * B, 7)).miss == MISS_NO_PREFIX

    # a file of another dtype under this model's name is refused, not misread
    digest = block_files(tmp_path / "model")[0].name.removesuffix(SUFFIX)
    assert open_disk(tmp_path, dtype="float16").load(digest) is None


def test_the_model_key_changes_with_files_dtype_backend_and_block_size(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"1234")
    key = model_key([weights], "bfloat16", "torch-cuda", B)
    assert model_key([weights], "float16", "torch-cuda", B) != key
    assert model_key([weights], "bfloat16", "mlx-gpu", B) != key
    assert model_key([weights], "bfloat16", "torch-cuda", 2 * B) != key
    os.utime(weights, ns=(1, 1))
    assert model_key([weights], "bfloat16", "torch-cuda", B) != key
    assert model_key([], "bfloat16", "torch-cuda", B) is None


def test_a_full_disk_or_a_full_queue_drops_writes_without_error(tmp_path):
    prompt = ids(40 * B, 8)
    pool, _ = serve(tmp_path, prompt, min_free_bytes=1 << 60)
    assert pool.prefix.disk.bytes_written == 0 and not block_files(tmp_path / "model")
    block_bytes = LAYERS * 2 * KV_HEADS * B * HEAD_DIM * 4
    pool, _ = serve(tmp_path / "q", prompt, queue_bytes=3 * block_bytes)
    assert 0 < len(block_files(tmp_path / "q" / "model")) < 40  # the rest dropped, offered again later
    pool.start("a2", prompt)  # a reuse offers the dropped blocks again
    pool.release("a2")
    assert pool.prefix.disk.wait_for_writes(10)
    assert len(block_files(tmp_path / "q" / "model")) > 3


def test_for_checkpoint_follows_its_budget(tmp_path):
    if not STORIES.exists():
        pytest.skip("stories260K is not in the shared assets")
    checkpoint = load_checkpoint(STORIES)
    root = tmp_path / "prefix-cache"
    assert for_checkpoint(checkpoint, "float32", "torch-cpu", B, root, 0) is None
    disk = for_checkpoint(checkpoint, "float32", "torch-cpu", B, root, 64)
    assert disk is not None and disk.budget == 64 << 20
    assert disk.folder.parent == root
    assert for_checkpoint(checkpoint, "float32", "torch-cuda", B, root, 64) is None  # a GPU recomputes faster
    assert for_checkpoint(checkpoint, "float32", "mlx-cuda", B, root, 64) is None


def test_the_writer_thread_ends_when_idle_and_comes_back_for_new_work(tmp_path, monkeypatch):
    monkeypatch.setattr(prefix_disk, "WRITER_IDLE_SECONDS", 0.05)
    pool, _ = serve(tmp_path, ids(40 * B, 9))
    deadline = time.monotonic() + 10
    while pool.prefix.disk.writer is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.prefix.disk.writer is None  # a model reloaded many times leaves no thread per load behind
    pool.start("b", ids(40 * B, 10))
    pool.release("b")
    assert pool.prefix.disk.wait_for_writes(10)
    assert len(block_files(tmp_path / "model")) == 80
