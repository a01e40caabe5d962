"""The prefix cache's disk tier: full KV blocks kept across restarts (`PrefixDisk`).

A block is stored once, under the name of its hash chain (`prefix_index.Node.digest`: every
token id from position 0 to the block's end), in a folder of its model:
`settings.prefix_cache_dir()/<model key>/<digest>.safetensors`. The model key hashes the
checkpoint's files (path, size, mtime), the backend and its device, the compute dtype, the
block size and FORMAT, so another model, dtype, backend or a changed file never matches (two
backends may lay a head's rows out alike yet round differently; greedy output must not
change with the cache).

Why safetensors: a block is one array, `(layers, 2, kv_heads, block_tokens, head_dim)`, and
safetensors is that and nothing else: a length, a JSON header naming the dtype (BF16 for
bfloat16, which numpy holds as uint16 bits) and shape, then the raw bytes, read back with one
`readinto` and no unpickling; `weights/safetensors.py` already checks such headers. The
header's metadata adds FORMAT, the digest (a file renamed by hand is refused) and a CRC32 of
the data (a file the disk damaged is refused; it costs about a millisecond per 5 MB).

What is written (`offer`), so the SSD is not worn: the blocks of a prefix that was reused, or
of one at least LONG_PREFIX_TOKENS long (its prefill costs seconds on a CPU, so one sighting is
worth keeping; shorter prompts wait until they are seen twice), each once: a block on disk is
never rewritten, and a hit only refreshes the file's mtime (the LRU's clock). The caller's
thread copies the blocks to the host (device access stays on it); a background thread writes
them, each atomically (a temporary file, fsynced, renamed into place), while the disk keeps
MIN_FREE_BYTES free. Work past QUEUE_BYTES waiting is dropped rather than slowing the server
(a dropped block is offered again on its next use). The folder's total stays under the
budget (FERRUM_PREFIX_DISK_MB), least recently used files first, across every model's
folder: a model that is gone stops being used and its blocks go first.

A damaged, truncated or foreign file is deleted and read as a miss, never an error; a crashed
writer's temporary files are swept at open.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import shutil
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.derived import checkpoint_files
from ferrum_mac.store.paths import inside
from ferrum_mac.weights import Checkpoint
from ferrum_mac.weights.safetensors import check_header

FORMAT = "1"  # bump when what a block file holds changes
LONG_PREFIX_TOKENS = 1024  # a remembered prefix this long is written without waiting for a reuse
MIN_FREE_BYTES = 2 << 30  # never fill the disk past this
QUEUE_BYTES = 64 << 20  # blocks waiting to be written at most; more is dropped (and a release reads no more)
READ_AT_ONCE = 16  # blocks copied to the host in one read (bounds one copy's memory)
STALE_TEMP_SECONDS = 600  # a temporary file this old is a dead writer's even if its pid was reused
WRITER_IDLE_SECONDS = 30.0  # the writer thread ends after this long without work (a model reloaded leaves none)
EXIT_WAIT_SECONDS = 5.0  # at exit, how long the writes still queued may take
SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
TENSOR = "kv"

# the compute dtype -> (safetensors dtype, the numpy dtype the backends hand over)
DTYPES: dict[str, tuple[str, np.dtype]] = {
    "float32": ("F32", np.dtype(np.float32)),
    "float16": ("F16", np.dtype(np.float16)),
    "bfloat16": ("BF16", np.dtype(np.uint16)),
}


def for_checkpoint(
    checkpoint: Checkpoint, dtype: str, backend: str, block_tokens: int, root: Path | None, budget_mb: int
) -> "PrefixDisk | None":
    """The disk tier for a model loaded from `checkpoint` in `dtype` (float32, float16, bfloat16)
    by `backend` (its name and device, e.g. "torch-cpu"), in the folder `root` (shared by every
    model) holding at most `budget_mb` MiB; None when it keeps nothing on disk (no folder, a budget of 0,
    a CUDA device, a checkpoint without files, an unusable cache folder)."""
    budget = budget_mb << 20
    if backend.endswith("-cuda"):
        # A CUDA GPU computes a prompt again faster than it reads the prompt's KV back (an
        # H100 prefills 16k tokens of an 8B model in under a second, 2.3 GB of KV), and the
        # host copies for writing would hold up the server: the tier pays only on CPUs and Macs.
        return None
    key = model_key(checkpoint_files(checkpoint), dtype, backend, block_tokens)
    if root is None or not budget or key is None or dtype not in DTYPES:
        return None
    try:
        return PrefixDisk(root, key, dtype, budget)
    except (OSError, FerrumError):
        return None


def model_key(files: list[Path], dtype: str, backend: str, block_tokens: int) -> str | None:
    """The name of a model's folder: its files (path, size, mtime), backend, dtype, block size
    and FORMAT hashed; None when there are no files to key it by."""
    if not files:
        return None
    try:
        stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    except OSError:
        return None
    text = json.dumps([FORMAT, backend, dtype, block_tokens, stats])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class PrefixDisk:
    def __init__(
        self,
        root: Path,
        key: str,
        dtype: str,
        budget_bytes: int,
        min_free_bytes: int = MIN_FREE_BYTES,
        queue_bytes: int = QUEUE_BYTES,
    ):
        """Blocks of the model `key` (`model_key`) in `dtype`, under `root` (shared by every
        model) holding at most `budget_bytes`."""
        self.root, self.folder = Path(root), Path(root) / key
        self.st_dtype, self.np_dtype = DTYPES[dtype]
        self.budget, self.min_free, self.queue_bytes = budget_bytes, min_free_bytes, queue_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        inside(self.root, self.folder)  # a link planted under the key must not lead elsewhere
        self.lock = threading.Lock()  # guards what the writer thread changes: files, present, counters
        self.files: OrderedDict[Path, int] = OrderedDict()  # every block file under root -> size, LRU first
        self.present: set[str] = set()  # digests in this model's folder
        self.queued: set[str] = set()  # digests waiting to be written
        self.waiting_bytes = 0
        self.block_shape: tuple[int, ...] | None = None  # learned from the first block read or loaded
        self.bytes_written = self.bytes_read = self.dropped_blocks = 0
        self.jobs: queue.Queue = queue.Queue()
        self.writer: threading.Thread | None = None
        self._open_folder()
        atexit.register(_finish_writes, weakref.ref(self))

    # -- the pool's calls -------------------------------------------------------------

    def load(self, digest: str) -> np.ndarray | None:
        """The block named `digest`, `(layers, 2, kv_heads, block_tokens, head_dim)`, or None
        when it is not on disk or its file is damaged (then deleted)."""
        path = self.folder / f"{digest}{SUFFIX}"
        with self.lock:
            listed = digest in self.present
        if not listed and not path.is_file():  # (another process may have written it since)
            return None
        try:
            array, size = self._read(path, digest)
        except FileNotFoundError:
            array, size = None, 0
        except (OSError, ValueError):
            array, size = None, 0
            path.unlink(missing_ok=True)
        with self.lock:
            if array is None:
                self.present.discard(digest)
                self.files.pop(path, None)
                return None
            self.block_shape = array.shape
            self.present.add(digest)
            self.files[path] = size
            self.files.move_to_end(path)
            self.bytes_read += size
        try:
            os.utime(path)  # most recently used, for the LRU of a later start
        except OSError:
            pass
        return array

    def offer(self, pool, nodes: list, reused: bool) -> None:
        """Queue for writing the full blocks of `nodes` (a prefix's, in order) not on disk yet,
        if the prefix was `reused` or is long; their host copies are read here."""
        if not reused and len(nodes) * pool.block_tokens < LONG_PREFIX_TOKENS:
            return
        with self.lock:
            wanted = [n for n in nodes if n.digest and n.digest not in self.present and n.digest not in self.queued]
        while wanted:
            with self.lock:
                room = self.queue_bytes - self.waiting_bytes
            block_bytes = self._block_bytes()
            n = min(len(wanted), READ_AT_ONCE, room // block_bytes if block_bytes else 1)
            if n <= 0:
                self.dropped_blocks += len(wanted)
                return
            part, wanted = wanted[:n], wanted[n:]
            self._queue(part, pool._read_blocks([node.block for node in part]), pool.block_tokens)

    def count(self, stats) -> None:
        """Fill `stats` (`llm.PrefixStats`) with the bytes written and read."""
        with self.lock:
            stats.disk_bytes_written = self.bytes_written
            stats.disk_bytes_read = self.bytes_read

    def other_model_has(self, digest: str) -> bool:
        """Whether another model's folder holds the block `digest` (a miss's reason)."""
        name = f"{digest}{SUFFIX}"
        try:
            folders = [f for f in self.root.iterdir() if f.is_dir() and f != self.folder]
        except OSError:
            return False
        return any((folder / name).is_file() for folder in folders)

    def wait_for_writes(self, timeout: float) -> bool:
        """Wait until the queued blocks are written (or dropped); False when `timeout` passed first."""
        end = time.monotonic() + timeout
        while self.jobs.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    # -- writing ----------------------------------------------------------------------

    def _block_bytes(self) -> int | None:
        return None if self.block_shape is None else int(np.prod(self.block_shape)) * self.np_dtype.itemsize

    def _queue(self, nodes: list, array: np.ndarray, block_tokens: int) -> None:
        if array.dtype != self.np_dtype or array.ndim != 5 or array.shape[3] != len(nodes) * block_tokens:
            raise TypeError(
                f"_read_blocks gave a {array.dtype} array of shape {array.shape}; the disk tier wants "
                f"{self.np_dtype} (layers, 2, kv_heads, {len(nodes) * block_tokens}, head_dim)"
            )
        shape = (*array.shape[:3], block_tokens, array.shape[4])
        with self.lock:
            self.block_shape = shape
            for i, node in enumerate(nodes):
                self.queued.add(node.digest)
                self.waiting_bytes += self._block_bytes() or 0
                self.jobs.put((node.digest, array[:, :, :, i * block_tokens : (i + 1) * block_tokens]))
            if self.writer is None:
                self.writer = threading.Thread(target=self._write_queued, name="prefix-disk", daemon=True)
                self.writer.start()

    def _write_queued(self) -> None:
        while True:
            try:
                digest, block = self.jobs.get(timeout=WRITER_IDLE_SECONDS)
            except queue.Empty:
                with self.lock:  # (`_queue` puts and starts a writer under this lock: no job is left behind)
                    if self.jobs.empty():
                        self.writer = None
                        return
                continue
            try:
                written = self._write(digest, np.ascontiguousarray(block))
            except (OSError, ValueError):
                written = 0
            with self.lock:
                self.queued.discard(digest)
                self.waiting_bytes -= block.nbytes
                if written:
                    self.present.add(digest)
                    self.bytes_written += written
                    self.files[self.folder / f"{digest}{SUFFIX}"] = written
                else:
                    self.dropped_blocks += 1
            if written:
                self._prune()
            self.jobs.task_done()

    def _write(self, digest: str, block: np.ndarray) -> int:
        """Write one block's file atomically; its size, or 0 when the disk has no room."""
        data = block.data
        header = _header(digest, self.st_dtype, block.shape, block.nbytes, zlib.crc32(data))
        size = 8 + len(header) + block.nbytes
        if shutil.disk_usage(self.folder).free - size < self.min_free:
            return 0
        path = self.folder / f"{digest}{SUFFIX}"
        self.folder.mkdir(parents=True, exist_ok=True)  # (removed by hand while running)
        temp = self.folder / f".{digest}.{os.getpid()}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(struct.pack("<Q", len(header)) + header)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # the rename must not reach the disk before the data
            os.replace(temp, path)
        except OSError:
            temp.unlink(missing_ok=True)
            raise
        return size

    def _prune(self) -> None:
        """Delete the least recently used files (every model's) until the folder fits the budget."""
        with self.lock:
            total = sum(self.files.values())
            gone = []
            while total > self.budget and self.files:
                path, size = self.files.popitem(last=False)
                total -= size
                gone.append(path)
                if path.parent == self.folder:
                    self.present.discard(path.name.removesuffix(SUFFIX))
        for path in gone:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                continue

    # -- reading ----------------------------------------------------------------------

    def _read(self, path: Path, digest: str) -> tuple[np.ndarray, int]:
        """The block in `path` and the file's size; ValueError unless the file is whole and is the block `digest`
        in this model's dtype and shape."""
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("truncated")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > 1 << 16:
                raise ValueError("header too long")
            try:
                header = json.loads(f.read(header_len))
            except (ValueError, RecursionError):
                raise ValueError("malformed header") from None
            check_header(header)
            meta, entry = header.get("__metadata__") or {}, header.get(TENSOR)
            if meta.get("format") != FORMAT or meta.get("digest") != digest or not isinstance(entry, dict):
                raise ValueError("not this block")
            shape = tuple(entry["shape"])
            if entry["dtype"] != self.st_dtype or len(shape) != 5 or entry["data_offsets"][0] != 0:
                raise ValueError("another dtype or layout")
            if self.block_shape is not None and shape != self.block_shape:
                raise ValueError("another shape")
            array = np.empty(shape, self.np_dtype)
            if f.readinto(array.data.cast("B")) != array.nbytes or f.read(1):
                raise ValueError("truncated or too long")
        if str(zlib.crc32(array.data)) != meta.get("crc32"):
            raise ValueError("damaged")
        return array, 8 + header_len + array.nbytes

    # -- the folder -------------------------------------------------------------------

    def _open_folder(self) -> None:
        """List every model's block files (least recently used first), sweep dead writers'
        temporary files, and fit the budget."""
        found = []
        for folder in self.root.iterdir():
            if not folder.is_dir() or folder.is_symlink():
                continue
            for path in folder.iterdir():
                try:
                    stat = path.lstat()
                    if path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX):
                        if _dead_writer(path.name, stat.st_mtime):
                            path.unlink()
                    elif path.name.endswith(SUFFIX) and not path.is_symlink():
                        found.append((stat.st_mtime, path, stat.st_size))
                except OSError:
                    continue
        for _, path, size in sorted(found, key=lambda entry: entry[0]):
            self.files[path] = size
            if path.parent == self.folder:
                self.present.add(path.name.removesuffix(SUFFIX))
        self._prune()


def _header(digest: str, st_dtype: str, shape: tuple, nbytes: int, crc: int) -> bytes:
    """A safetensors header for one tensor, padded with spaces to 8 bytes as the format suggests."""
    header = {
        "__metadata__": {"format": FORMAT, "digest": digest, "crc32": str(crc)},
        TENSOR: {"dtype": st_dtype, "shape": list(shape), "data_offsets": [0, nbytes]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _dead_writer(name: str, mtime: float) -> bool:
    """Whether a temporary file `.<digest>.<pid>.tmp` belongs to no live writer."""
    if time.time() - mtime > STALE_TEMP_SECONDS:
        return True
    try:
        pid = int(name.removesuffix(TEMP_SUFFIX).rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, someone else's
    return False


def _finish_writes(ref: "weakref.ref[PrefixDisk]") -> None:
    disk = ref()
    if disk is not None:
        disk.wait_for_writes(EXIT_WAIT_SECONDS)
