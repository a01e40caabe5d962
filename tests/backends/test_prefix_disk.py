"""The prefix cache's disk tier (`prefix_disk`) under a host-array pool whose keys and values
are a function of each row's token and position, so a block read back from disk is checked
bit for bit against what the model would have computed."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
import zlib

import numpy as np
import pytest

import ferrum_mac
from ferrum_mac.backends.state import prefix_disk
from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS as B
from ferrum_mac.backends.state.block_pool import BlockPool
from ferrum_mac.backends.state.prefix_disk import SUFFIX, PrefixDisk, block_shape_of, for_checkpoint, model_key
from ferrum_mac.backends.state.prefix_index import ROOT_DIGEST, chain_digest
from ferrum_mac.llm import MISS_NO_PREFIX, MISS_OTHER_MODEL
from ferrum_mac.weights import load_checkpoint

from helpers import BACKENDS, SHARED, random_tokens
from prefix_support import greedy
from test_block_pool import check_counts, ids

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 4
SHAPE = block_shape_of(LAYERS, KV_HEADS, B, HEAD_DIM)
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


def open_disk(root, key="model", dtype="float32", budget=1 << 30, shape=SHAPE, **kwargs):
    return PrefixDisk(root, key, dtype, shape, budget, min_free_bytes=kwargs.pop("min_free_bytes", 0), **kwargs)


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


def chain_digests(prompt):
    """The token chains of `prompt`'s full blocks, in order."""
    digests = [ROOT_DIGEST]
    for start in range(0, len(prompt) - B + 1, B):
        digests.append(chain_digest(digests[-1], prompt[start : start + B]))
    return digests[1:]


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
    pool, _ = serve(tmp_path, prompt)
    digests = chain_digests(prompt)[20:22]
    torn, damaged = (pool.prefix.disk.path_of(d) for d in digests)
    torn.write_bytes(torn.read_bytes()[:-100])
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    disk = open_disk(tmp_path)
    assert all(disk.load(d) is None for d in digests)
    assert not torn.exists() and not damaged.exists()
    pool = KvPool(8192, cache_blocks=1000, disk=disk)
    found = pool.start("b", prompt)  # whatever came before the torn blocks is reused, bit-exact
    assert found.tokens < 40 * B
    check_counts(pool)


def test_a_run_of_blocks_comes_back_in_order_up_to_the_first_missing_one(tmp_path):
    prompt = ids(40 * B + 5, 19)
    pool, _ = serve(tmp_path, prompt)
    chains = chain_digests(prompt)
    pool.prefix.disk.path_of(chains[25]).unlink()
    disk = open_disk(tmp_path)
    arrays = list(disk.load_run(chains))  # (read ahead on several threads)
    assert len(arrays) == 25
    assert all(np.array_equal(a, pool.computed(prompt[i * B : (i + 1) * B], i * B)) for i, a in enumerate(arrays))
    run = disk.load_run(chains)
    next(run), next(run)
    run.close()  # a caller that stops early (memory is full) leaves no reading thread behind
    assert not [t for t in threading.enumerate() if t.name.startswith("prefix-disk-read")]
    assert list(disk.load_run([])) == []


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
    assert open_disk(tmp_path, dtype="float16").load(chain_digests(prompt)[0]) is None


def test_the_model_key_changes_with_files_dtype_backend_and_block_shape(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"1234")
    key = model_key([weights], "bfloat16", "torch-cuda", SHAPE)
    assert model_key([weights], "float16", "torch-cuda", SHAPE) != key
    assert model_key([weights], "bfloat16", "mlx-gpu", SHAPE) != key
    assert model_key([weights], "bfloat16", "torch-cuda", block_shape_of(LAYERS, KV_HEADS, 2 * B, HEAD_DIM)) != key
    assert model_key([weights], "bfloat16", "torch-cuda", block_shape_of(LAYERS + 1, KV_HEADS, B, HEAD_DIM)) != key
    os.utime(weights, ns=(1, 1))
    assert model_key([weights], "bfloat16", "torch-cuda", SHAPE) != key
    assert model_key([], "bfloat16", "torch-cuda", SHAPE) is None


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
    assert for_checkpoint(checkpoint, "float32", "torch-cpu", SHAPE, root, 0) is None
    disk = for_checkpoint(checkpoint, "float32", "torch-cpu", SHAPE, root, 64)
    assert disk is not None and disk.budget == 64 << 20
    assert disk.folder.parent == root
    assert for_checkpoint(checkpoint, "float32", "torch-cuda", SHAPE, root, 64) is None  # a GPU recomputes faster
    assert for_checkpoint(checkpoint, "float32", "mlx-cuda", SHAPE, root, 64) is None


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


# -- odd files: a miss, never an error, and nothing else changes ------------------------


def plant_other_shape(disk, digest):
    """A whole, valid block of another model's shape under the name of `digest`'s block."""
    layers, two, heads, block_tokens, head_dim = disk.block_shape
    shape = (layers + 1, two, heads, block_tokens, head_dim)
    other = PrefixDisk(disk.root, disk.key, "float32", shape, 1 << 30, 0)
    assert other._write(disk.path_of(digest).name.removesuffix(SUFFIX), np.ones(shape, np.float32))


def rewrite(path, change_header=None, change_data=None):
    """Rewrite a block file: its header (as a dict) and data (as a bytearray) changed in place."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), bytearray(raw[8 + length :])
    if change_header:
        change_header(header)
    if change_data:
        change_data(data)
        header["__metadata__"]["crc32"] = str(zlib.crc32(data))  # a CRC alone would not see the change
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def declare_huge_shape(header):
    """A header whose tensor would take 32 TiB (its offsets agree with it: the header is well formed)."""
    shape = [1 << 16, 2, 1 << 13, 32, 1 << 8]
    header["kv"]["shape"], header["kv"]["data_offsets"] = shape, [0, int(np.prod(shape, dtype=object)) * 4]


def negate_first_value(data):
    data[3] ^= 0x80  # the sign bit of the first float32 (little-endian)


def test_a_block_of_another_shape_read_first_is_a_miss_and_changes_nothing(tmp_path):
    first, second = ids(40 * B + 5, 11), ids(40 * B + 5, 12)
    pool, _ = serve(tmp_path, first)
    pool.start("b", second)
    pool.release("b")
    assert pool.prefix.disk.wait_for_writes(10)
    plant_other_shape(pool.prefix.disk, chain_digests(first)[0])

    restarted = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path))
    assert restarted.start("a", first).tokens == 0  # the odd block is the first one read
    assert not pool.prefix.disk.path_of(chain_digests(first)[0]).exists()
    assert restarted.start("b", second).tokens == 40 * B  # every valid block is still accepted
    assert len(block_files(tmp_path / "model")) == 79
    check_counts(restarted)


def test_a_header_declaring_a_huge_shape_is_a_miss_and_the_file_goes(tmp_path):
    prompt = ids(40 * B, 13)
    pool, _ = serve(tmp_path, prompt)
    odd = pool.prefix.disk.path_of(chain_digests(prompt)[0])
    rewrite(odd, change_header=declare_huge_shape)
    for _ in range(2):  # (a restart does not make it an error either)
        restarted = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path))
        assert restarted.start("a", prompt).tokens == 0  # the first block read after a start
        assert not odd.exists()


def test_a_folder_with_a_blocks_name_is_a_miss(tmp_path):
    prompt = ids(40 * B, 14)
    pool, _ = serve(tmp_path, prompt)
    disk = pool.prefix.disk
    odd = disk.path_of(chain_digests(prompt)[2])
    odd.unlink()
    odd.mkdir()  # listed as a block by the running tier, and there at the next start
    assert disk.load(chain_digests(prompt)[2]) is None
    restarted = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path))
    assert restarted.start("a", prompt).tokens == 2 * B
    assert odd not in restarted.prefix.disk.files  # (not counted against the budget either)


# -- the budget and the folder --------------------------------------------------------


def test_two_writers_sharing_a_folder_stay_within_one_budget(tmp_path):
    """Two servers (or a server and the chat UI) with one cache folder: each tier writes
    blocks the other does not know of, and the folder still holds at most the budget."""
    budget = 1 << 20
    writers = [open_disk(tmp_path, budget=budget) for _ in range(2)]  # both started before either writes
    for seed, disk in enumerate(writers):
        pool = KvPool(8192, cache_blocks=1000, disk=disk)
        pool.start("a", ids(200 * B, 20 + seed))  # about 0.9 MiB of blocks each
        pool.release("a")
        assert disk.wait_for_writes(10) and disk.bytes_written > budget * 3 // 4
    assert sum(p.stat().st_size for p in block_files(tmp_path / "model")) <= budget


@pytest.mark.parametrize("removed", ["model folder", "cache folder"])
def test_a_folder_removed_while_running_is_made_again(tmp_path, removed):
    root = tmp_path / "prefix-cache"
    pool, _ = serve(root, ids(40 * B, 15))
    shutil.rmtree(root / "model" if removed == "model folder" else root)
    pool.start("b", ids(40 * B, 16))
    pool.release("b")
    assert pool.prefix.disk.wait_for_writes(10)
    assert len(block_files(root / "model")) == 40


# -- integrity: a block is its model's and holds what was written ---------------------


def test_a_block_changed_with_its_crc_recomputed_is_a_miss(tmp_path):
    prompt = ids(40 * B, 17)
    pool, _ = serve(tmp_path, prompt)
    changed = pool.prefix.disk.path_of(chain_digests(prompt)[5])
    rewrite(changed, change_data=negate_first_value)
    restarted = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path))
    assert restarted.start("a", prompt).tokens == 5 * B  # (start checks every reused row)
    assert not changed.exists()


def test_a_block_is_keyed_by_its_models_weights(tmp_path):
    """Another model's blocks copied into this model's folder, each under the name this model
    would give it, are refused: a block's name and header tie it to the weights that computed it."""
    prompt = ids(40 * B, 18)
    pool, _ = serve(tmp_path, prompt)
    other = open_disk(tmp_path, key="other")
    for digest in chain_digests(prompt):
        shutil.copyfile(pool.prefix.disk.path_of(digest), other.path_of(digest))
    found = KvPool(8192, cache_blocks=1000, disk=open_disk(tmp_path, key="other")).start("a", prompt)
    assert (found.tokens, found.miss) == (0, MISS_OTHER_MODEL)


def test_weights_replaced_by_a_file_of_the_same_size_and_time_are_another_model(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"1234")
    key = model_key([weights], "float32", "torch-cpu", SHAPE)
    replacement = tmp_path / "new.safetensors"
    replacement.write_bytes(b"5678")  # another fine-tune of the same size, copied with its times kept
    stat = weights.stat()
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, weights)
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert model_key([weights], "float32", "torch-cpu", SHAPE) != key


# -- the same on both backends, with a real model ----------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_files_are_misses_on_both_backends(tmp_path, monkeypatch, backend):
    """stories260K with its disk tier: after a restart, a block of another shape read first, a
    header declaring a huge shape, a folder with a block's name and a block changed with its
    CRC recomputed are each a miss where they lie; the blocks before them are used, and every
    answer is the one computed without the cache."""
    if not STORIES.exists():
        pytest.skip("stories260K is not in the shared assets")
    monkeypatch.setenv("FERRUM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FERRUM_PREFIX_DISK_MB", "64")
    model = ferrum_mac.open_model(STORIES, backend=backend)
    prompts = [random_tokens(4 * B + 5, seed=30 + i, vocab=500) for i in range(4)]
    answers = []
    for i, prompt in enumerate(prompts):
        answers.append(greedy(model, f"p{i}", prompt, 6, reuse=True)[0])
        greedy(model, f"p{i}-again", prompt, 6, reuse=True)  # reused: written
    disk = model.kv.prefix.disk
    assert disk.wait_for_writes(30) and len(block_files(disk.folder)) == 16
    chains = [chain_digests(p) for p in prompts]
    plant_other_shape(disk, chains[0][0])
    rewrite(disk.path_of(chains[1][2]), change_header=declare_huge_shape)
    disk.path_of(chains[2][1]).unlink()
    disk.path_of(chains[2][1]).mkdir()
    rewrite(disk.path_of(chains[3][3]), change_data=negate_first_value)

    restarted = ferrum_mac.open_model(STORIES, backend=backend)
    for i, (prompt, reused) in enumerate(zip(prompts, [0, 2 * B, 1 * B, 3 * B])):
        answer, found = greedy(restarted, f"r{i}", prompt, 6, reuse=True)
        assert (found, answer) == (reused, answers[i])
    assert restarted.state.prefix_stats().disk_tokens_loaded == 6 * B
