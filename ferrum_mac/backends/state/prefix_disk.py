"""The prefix cache's disk tier: full KV blocks kept across restarts (`PrefixDisk`).

A block is stored once, in a folder of its model: `settings.prefix_cache_dir()/<model
key>/<name>.safetensors`. The model key hashes the weights' identity (`weights_identity`), the
backend and its device, the compute dtype, the block's shape and FORMAT, so another model,
dtype, backend or a changed file never matches (two backends may lay a head's rows out alike
yet round differently; greedy output must not change with the cache). A block's name hashes
that key with its hash chain (`prefix_index.Node.digest`: every token id from position 0 to the
block's end): the weights and the tokens that computed it (`block_name`).

Why safetensors: a block is one array, `(layers, 2, kv_heads, block_tokens, head_dim)`, and
safetensors is that and nothing else: a length, a JSON header naming the dtype (BF16 for
bfloat16, which numpy holds as uint16 bits) and shape, then the raw bytes, read back with one
`readinto` and no unpickling; `weights/safetensors.py` already checks such headers. The
header's metadata adds FORMAT, the block's name (a file renamed or copied by hand is refused)
and the sha256 of the data, checked on every read: a file the disk damaged or someone changed
is refused (sha256 reads about 1.8 GB/s on one core of a recent CPU).

What is written (`offer`), so the SSD is not worn: the blocks of a prefix that was reused, or
of one at least LONG_PREFIX_TOKENS long (its prefill costs seconds on a CPU, so one sighting is
worth keeping; shorter prompts wait until they are seen twice), each once: a block on disk is
never rewritten, and a hit only refreshes the file's mtime (the LRU's clock). The caller's
thread copies the blocks to the host (device access stays on it); a background thread writes
them, each atomically (a temporary file, fsynced, renamed into place), while the disk keeps
MIN_FREE_BYTES free; a folder removed while running is made again. Work past QUEUE_BYTES
waiting is dropped rather than slowing the server (a dropped block is offered again on its next
use). The folder's total stays under the budget (FERRUM_PREFIX_DISK_MB), least recently used
files first, across every model's folder (a model that is gone stops being used and its blocks
go first) and every process writing there: after each batch of writes the folder is listed
again, and the budget holds for what is on disk.

A file is checked against the model (dtype, shape, size) before anything is allocated for it:
a damaged, truncated or foreign file is deleted and read as a miss, anything else odd (a folder
of a block's name, an unreadable file) is a miss, never an error; a crashed writer's temporary
files are swept.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import math
import os
import queue
import shutil
import stat
import struct
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Generator, Iterable

import numpy as np

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.derived import checkpoint_files
from ferrum_mac.store.paths import inside
from ferrum_mac.weights import Checkpoint
from ferrum_mac.weights.safetensors import check_header

FORMAT = "2"  # bump when what a block file holds changes
LONG_PREFIX_TOKENS = 1024  # a remembered prefix this long is written without waiting for a reuse
MIN_FREE_BYTES = 2 << 30  # never fill the disk past this
QUEUE_BYTES = 64 << 20  # blocks waiting to be written at most; more is dropped (and a release reads no more)
READ_AT_ONCE = 16  # blocks copied to the host in one read (bounds one copy's memory)
LOAD_THREADS = min(8, os.cpu_count() or 1)  # blocks read back and checked at once
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
    checkpoint: Checkpoint, dtype: str, backend: str, block_shape: tuple[int, ...], root: Path | None, budget_mb: int
) -> "PrefixDisk | None":
    """The disk tier for a model loaded from `checkpoint` in `dtype` (float32, float16, bfloat16)
    by `backend` (its name and device, e.g. "torch-cpu"), whose blocks are arrays of
    `block_shape` (`block_shape_of`), in the folder `root` (shared by every model) holding at
    most `budget_mb` MiB; None when it keeps nothing on disk (no folder, a budget of 0, a CUDA
    device, a checkpoint without files, an unusable cache folder)."""
    budget = budget_mb << 20
    if backend.endswith("-cuda"):
        # A CUDA GPU computes a prompt again faster than it reads the prompt's KV back (an
        # H100 prefills 16k tokens of an 8B model in under a second, 2.3 GB of KV), and the
        # host copies for writing would hold up the server: the tier pays only on CPUs and Macs.
        return None
    key = model_key(checkpoint_files(checkpoint), dtype, backend, block_shape)
    if root is None or not budget or key is None or dtype not in DTYPES:
        return None
    try:
        return PrefixDisk(root, key, dtype, block_shape, budget)
    except (OSError, FerrumError):
        return None


def block_shape_of(num_layers: int, kv_heads: int, block_tokens: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one block's array, as the pools' `_read_blocks` hand it over."""
    return (num_layers, 2, kv_heads, block_tokens, head_dim)


def model_key(files: list[Path], dtype: str, backend: str, block_shape: tuple[int, ...]) -> str | None:
    """The name of a model's folder: its weights' identity (`weights_identity`), backend, dtype,
    block shape and FORMAT hashed; None when there are no files to key it by."""
    identity = weights_identity(files)
    if identity is None:
        return None
    text = json.dumps([FORMAT, backend, dtype, list(block_shape), identity])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def weights_identity(files: list[Path]) -> list | None:
    """What tells one version of a model's files from another without reading gigabytes: each
    file's path (a pulled file's is its content's sha256), size, modification and change times
    and inode. The change time is the kernel's (no `touch` or copy sets it back), so a file
    replaced by another of the same size and modification time is another model. None when
    there are no files or one is unreadable."""
    if not files:
        return None
    try:
        stats = [(f, f.stat()) for f in files]
    except OSError:
        return None
    return [(str(f), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for f, s in stats]


def block_name(key: str, digest: str) -> str:
    """The file name (without SUFFIX) of the block whose token chain is `digest`
    (`prefix_index.Node.digest`) in the folder of the model `key`: both hashed, so a block is
    keyed by the weights that computed it as well as by its tokens."""
    return hashlib.sha256(f"{key}|{digest}".encode()).hexdigest()[:32]


class PrefixDisk:
    def __init__(
        self,
        root: Path,
        key: str,
        dtype: str,
        block_shape: tuple[int, ...],
        budget_bytes: int,
        min_free_bytes: int = MIN_FREE_BYTES,
        queue_bytes: int = QUEUE_BYTES,
    ):
        """Blocks of the model `key` (`model_key`) in `dtype`, each an array of `block_shape`
        (`block_shape_of`), under `root` (shared by every model) holding at most `budget_bytes`."""
        self.root, self.key, self.folder = Path(root), key, Path(root) / key
        self.st_dtype, self.np_dtype = DTYPES[dtype]
        # The model's, never a file's: one odd file must not change what is accepted.
        self.block_shape = tuple(block_shape)
        self.block_bytes = math.prod(self.block_shape) * self.np_dtype.itemsize
        self.budget, self.min_free, self.queue_bytes = budget_bytes, min_free_bytes, queue_bytes
        self._make_folder()
        self.lock = threading.Lock()  # guards what the writer thread changes: files, present, counters
        self.files: OrderedDict[Path, int] = OrderedDict()  # every block file under root -> size, LRU first
        self.present: set[str] = set()  # block names (`block_name`) in this model's folder
        self.queued: set[str] = set()  # block names waiting to be written
        self.waiting_bytes = 0
        self.bytes_written = self.bytes_read = self.dropped_blocks = 0
        self.jobs: queue.Queue = queue.Queue()
        self.writer: threading.Thread | None = None
        self._take_inventory()
        self._prune()
        atexit.register(_finish_writes, weakref.ref(self))

    def path_of(self, digest: str) -> Path:
        """The file of the block whose token chain is `digest`."""
        return self.folder / f"{block_name(self.key, digest)}{SUFFIX}"

    # -- the pool's calls -------------------------------------------------------------

    def load(self, digest: str) -> np.ndarray | None:
        """The block whose token chain is `digest`, `(layers, 2, kv_heads, block_tokens,
        head_dim)`, or None when it is not on disk or its file is not this model's block
        (damaged, truncated, foreign: then deleted). Never raises: whatever is in the folder,
        a request only misses."""
        path = self.path_of(digest)
        name = path.name.removesuffix(SUFFIX)
        with self.lock:
            listed = name in self.present
        if not listed and not path.is_file():  # (another process may have written it since)
            return None
        try:
            array, size = self._read(path, name)
        except ValueError:
            array, size = None, 0
            _remove(path)
        except OSError:  # gone, unreadable, a folder of that name: a miss, left alone
            array, size = None, 0
        with self.lock:
            if array is None:
                self.present.discard(name)
                self.files.pop(path, None)
                return None
            self.present.add(name)
            self.files[path] = size
            self.files.move_to_end(path)
            self.bytes_read += size
        try:
            os.utime(path)  # most recently used, for the LRU of a later start and of other processes
        except OSError:
            pass
        return array

    def load_run(self, digests: Iterable[str]) -> Generator[np.ndarray, None, None]:
        """The blocks of the token chains `digests`, in order, up to the first not on disk
        (`load`). Past the first, they are read and checked a few at a time on LOAD_THREADS
        threads (reading and hashing let go of the GIL), so a long prefix comes back at the
        speed of several cores; a prompt with nothing on disk costs one look, as before."""
        digests = iter(digests)
        first = next(digests, None)
        array = None if first is None else self.load(first)
        if array is None:
            return
        yield array
        workers = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="prefix-disk-read")
        try:
            ahead = deque(workers.submit(self.load, d) for d in itertools.islice(digests, 2 * LOAD_THREADS))
            while ahead:
                array = ahead.popleft().result()
                if array is None:
                    return
                ahead.extend(workers.submit(self.load, d) for d in itertools.islice(digests, 1))
                yield array
        finally:  # (also when the caller stops early: what was read ahead is dropped)
            workers.shutdown(wait=True, cancel_futures=True)

    def offer(self, pool, nodes: list, reused: bool) -> None:
        """Queue for writing the full blocks of `nodes` (a prefix's, in order) not on disk yet,
        if the prefix was `reused` or is long; their host copies are read here."""
        if not reused and len(nodes) * pool.block_tokens < LONG_PREFIX_TOKENS:
            return
        named = [(node, block_name(self.key, node.digest)) for node in nodes if node.digest]
        with self.lock:
            wanted = [(node, name) for node, name in named if name not in self.present and name not in self.queued]
        while wanted:
            with self.lock:
                room = self.queue_bytes - self.waiting_bytes
            n = min(len(wanted), READ_AT_ONCE, room // self.block_bytes)
            if n <= 0:
                self.dropped_blocks += len(wanted)
                return
            part, wanted = wanted[:n], wanted[n:]
            self._queue([name for _, name in part], pool._read_blocks([node.block for node, _ in part]))

    def count(self, stats) -> None:
        """Fill `stats` (`llm.PrefixStats`) with the bytes written and read."""
        with self.lock:
            stats.disk_bytes_written = self.bytes_written
            stats.disk_bytes_read = self.bytes_read

    def other_model_has(self, digest: str) -> bool:
        """Whether another model's folder holds the block whose token chain is `digest` (a miss's reason)."""
        try:
            folders = [f for f in self.root.iterdir() if f.is_dir() and f != self.folder]
        except OSError:
            return False
        return any((folder / f"{block_name(folder.name, digest)}{SUFFIX}").is_file() for folder in folders)

    def wait_for_writes(self, timeout: float) -> bool:
        """Wait until the queued blocks are written (or dropped); False when `timeout` passed first."""
        end = time.monotonic() + timeout
        while self.jobs.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    # -- writing ----------------------------------------------------------------------

    def _queue(self, names: list[str], array: np.ndarray) -> None:
        layers, two, heads, block_tokens, head_dim = self.block_shape
        if array.dtype != self.np_dtype or array.shape != (layers, two, heads, len(names) * block_tokens, head_dim):
            raise TypeError(
                f"_read_blocks gave a {array.dtype} array of shape {array.shape}; the disk tier wants "
                f"{self.np_dtype} {(layers, two, heads, len(names) * block_tokens, head_dim)}"
            )
        with self.lock:
            for i, name in enumerate(names):
                self.queued.add(name)
                self.waiting_bytes += self.block_bytes
                self.jobs.put((name, array[:, :, :, i * block_tokens : (i + 1) * block_tokens]))
            if self.writer is None:
                self.writer = threading.Thread(target=self._write_queued, name="prefix-disk", daemon=True)
                self.writer.start()

    def _write_queued(self) -> None:
        while True:
            try:
                name, block = self.jobs.get(timeout=WRITER_IDLE_SECONDS)
            except queue.Empty:
                with self.lock:  # (`_queue` puts and starts a writer under this lock: no job is left behind)
                    if self.jobs.empty():
                        self.writer = None
                        return
                continue
            try:
                written = self._write(name, np.ascontiguousarray(block))
            except (OSError, ValueError, FerrumError):
                written = 0
            with self.lock:
                self.queued.discard(name)
                self.waiting_bytes -= block.nbytes
                if written:
                    self.present.add(name)
                    self.bytes_written += written
                    self.files[self.folder / f"{name}{SUFFIX}"] = written
                else:
                    self.dropped_blocks += 1
            drained = self.jobs.empty()
            if drained:
                # Other processes (a second server, the chat UI) write to the same folder: the
                # budget holds for what is on disk, not for what this one wrote.
                self._take_inventory()
            if written or drained:
                self._prune()
            self.jobs.task_done()

    def _write(self, name: str, block: np.ndarray) -> int:
        """Write one block's file atomically; its size, or 0 when the disk has no room."""
        data = block.data
        header = _header(name, self.st_dtype, block.shape, block.nbytes, hashlib.sha256(data).hexdigest())
        size = 8 + len(header) + block.nbytes
        self._make_folder()  # (it may have been removed while running)
        if shutil.disk_usage(self.folder).free - size < self.min_free:
            return 0
        path = self.folder / f"{name}{SUFFIX}"
        temp = self.folder / f".{name}.{os.getpid()}{TEMP_SUFFIX}"
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
            _remove(path)

    # -- reading ----------------------------------------------------------------------

    def _read(self, path: Path, name: str) -> tuple[np.ndarray, int]:
        """The block in `path` and the file's size; ValueError unless the file is whole and is
        the block `name` of this model (its dtype and shape, checked before anything is
        allocated: a header may declare any shape), its data what was written (sha256)."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
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
            if meta.get("format") != FORMAT or meta.get("digest") != name or not isinstance(entry, dict):
                raise ValueError("not this block")
            if (
                entry["dtype"] != self.st_dtype
                or tuple(entry["shape"]) != self.block_shape
                or entry["data_offsets"] != [0, self.block_bytes]
            ):
                raise ValueError("another model's dtype or shape")
            if size != 8 + header_len + self.block_bytes:
                raise ValueError("truncated or too long")
            array = np.empty(self.block_shape, self.np_dtype)
            if f.readinto(array.data.cast("B")) != array.nbytes:
                raise ValueError("truncated")
        if hashlib.sha256(array.data).hexdigest() != meta.get("sha256"):
            raise ValueError("damaged or changed")
        return array, size

    # -- the folder -------------------------------------------------------------------

    def _make_folder(self) -> None:
        """This model's folder, made (again) if missing; FerrumError if a link leads it elsewhere."""
        self.folder.mkdir(parents=True, exist_ok=True)
        inside(self.root, self.folder)

    def _take_inventory(self) -> None:
        """List every model's block files as they are on disk (least recently used first), and
        sweep dead writers' temporary files."""
        found = sorted(self._scan(), key=lambda entry: entry[0])
        with self.lock:
            self.files = OrderedDict((path, size) for _, path, size in found)
            self.present = {path.name.removesuffix(SUFFIX) for path in self.files if path.parent == self.folder}

    def _scan(self) -> list[tuple[int, Path, int]]:
        """(mtime, path, size) of every model's block files: plain files only."""
        found: list[tuple[int, Path, int]] = []
        try:
            folders = [f for f in self.root.iterdir() if f.is_dir() and not f.is_symlink()]
        except OSError:
            return found
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                    if entry.name.startswith(".") and entry.name.endswith(TEMP_SUFFIX):
                        if _dead_writer(entry.name, info.st_mtime):
                            os.unlink(entry.path)
                    elif entry.name.endswith(SUFFIX) and stat.S_ISREG(info.st_mode):
                        found.append((info.st_mtime_ns, Path(entry.path), info.st_size))
                except OSError:
                    continue
        return found


def _header(name: str, st_dtype: str, shape: tuple, nbytes: int, sha256: str) -> bytes:
    """A safetensors header for one tensor, padded with spaces to 8 bytes as the format suggests."""
    header = {
        "__metadata__": {"format": FORMAT, "digest": name, "sha256": sha256},
        TENSOR: {"dtype": st_dtype, "shape": list(shape), "data_offsets": [0, nbytes]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _remove(path: Path) -> None:
    """Delete a block file; what cannot be deleted (a folder of that name, a read-only folder) stays."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


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
