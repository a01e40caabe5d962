"""A GGUF file's metadata and tensor table, read from its header without touching tensor data.

Scalar and string values, and each tensor's shape, ggml type and file offset: what `ferrum
list`/`show` print, what the loader checks before MLX reads the file (MLX silently casts
tensor types it cannot keep quantized to float16; reading the table first lets us refuse
those by name) and what the model config comes from. Arrays (the vocabulary, its merges and
scores) are skipped, only counted, unless asked for (the tokenizer reads them from here).

The header is parsed in memory (the file mapped, `struct.unpack_from` at offsets): a 49k-token
vocabulary is ~100k strings, too many for one read call each.
"""

from __future__ import annotations

import collections
import functools
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ferrum_mac.errors import CorruptModelError, ModelNotFoundError, UnsupportedModelError

# ggml tensor type ids -> names (the ones seen in published files)
TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
    41: "Q1_0",
}
# type name -> (values per block, bytes per block), for the types whose size we check
BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q8_1": (32, 36),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q8_K": (256, 292),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# a shard of a model split in several files, as llama.cpp's gguf-split names them
SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
DEFAULT_ALIGNMENT = 32
VERSIONS = (2, 3)  # 1 had 32-bit counts and lengths: another layout
MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes a metadata entry, a tensor entry and a string or array item take.
_MIN_KV_BYTES, _MIN_TENSOR_BYTES, _MIN_ITEM_BYTES = 8 + 4, 8 + 4 + 4 + 8, 8


@dataclass(frozen=True)
class GgufInfo:
    metadata: dict  # key -> scalar or string (arrays only when read with arrays=True)
    tensors: list  # (name, shape, type name)
    offsets: dict = field(default_factory=dict)  # tensor name -> absolute file offset of its data
    array_lengths: dict = field(default_factory=dict)  # metadata key of an array -> its length
    data_end: int = 0  # where the last tensor of a known type ends (the file must be this long)

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.tensors)

    @property
    def quantization(self) -> str:
        """The type holding most of the weights, e.g. "Q4_1"."""
        weight = collections.Counter()
        for _, shape, kind in self.tensors:
            weight[kind] += math.prod(shape)
        return weight.most_common(1)[0][0] if weight else "?"

    @property
    def type_mix(self) -> str:
        """Each type's share of the weights, most first, e.g. "Q4_K 71%, Q6_K 28%, F32 <1%"."""
        weight = collections.Counter()
        for _, shape, kind in self.tensors:
            weight[kind] += math.prod(shape)
        total = sum(weight.values()) or 1
        shares = ((kind, 100 * count / total) for kind, count in weight.most_common())
        return ", ".join(f"{kind} {share:.0f}%" if share >= 0.5 else f"{kind} <1%" for kind, share in shares)


def read_gguf_info(path: str | Path, arrays: bool = False) -> GgufInfo:
    """The header of the GGUF file at `path`; `arrays`: decode metadata arrays too (as lists)."""
    try:
        f = open(path, "rb")
    except OSError as e:  # a dangling or looping link, no permission
        raise CorruptModelError(
            f"{path} cannot be read ({e.strerror or e}); fix the link or download it again"
        ) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 4 or f.read(4) != b"GGUF":
            raise CorruptModelError(f"{path} is not a GGUF file; download it again")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _Parser(buf, size, path, arrays).info()
            except struct.error:
                raise _truncated(path) from None


def shard_paths(path: Path) -> list[Path]:
    """The files of the model at `path`: itself, or every shard of a `-0000k-of-0000n` set."""
    m = SHARD.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    paths = [path.with_name(f"{m.group('stem')}-{no:05d}-of-{count:05d}.gguf") for no in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelNotFoundError(
            f"{path} is shard {int(m.group('no'))} of {count}, but {', '.join(missing[:3])} "
            f"{'is' if len(missing) == 1 else 'are'} missing; download every shard"
        )
    return paths


def cached_gguf_info(path: str | Path) -> GgufInfo:
    """`read_gguf_info(path, arrays=True)`, read once per process while the file is unchanged:
    the model loader and the tokenizer both want the header. Callers must not modify it."""
    path = Path(path).resolve()
    stat = path.stat()
    return _cached_info(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_info(path: str, size: int, mtime_ns: int) -> GgufInfo:
    return read_gguf_info(path, arrays=True)


def _truncated(path) -> CorruptModelError:
    return CorruptModelError(f"{path} ends inside its GGUF header; the file is truncated, download it again")


class _Parser:
    def __init__(self, buf, size: int, path, arrays: bool):
        self.buf, self.size, self.path, self.arrays = buf, size, path, arrays
        self.pos = 4

    def info(self) -> GgufInfo:
        self.check_version(self.u32())
        tensor_count, kv_count = self.u64(), self.u64()
        # A damaged count would send the loops below through the whole file, one field at a time.
        self.check_fits(kv_count, _MIN_KV_BYTES)
        self.check_fits(tensor_count, _MIN_TENSOR_BYTES)
        metadata, lengths = {}, {}
        for _ in range(kv_count):
            key = self.string()
            kind = self.u32()
            if kind == _ARRAY:
                value, lengths[key] = self.array()
                if value is not None:
                    metadata[key] = value
            else:
                metadata[key] = self.value(kind)
        tensors, relative = [], {}
        for _ in range(tensor_count):
            name = self.string()
            dims = self.u32()
            if dims > MAX_DIMS:
                raise CorruptModelError(
                    f"{self.path}: tensor {name[:80]!r} claims {dims} dimensions; the file is damaged"
                )
            shape = tuple(self.u64() for _ in range(dims))[::-1]
            type_id = self.u32()
            kind = TYPES.get(type_id, f"type {type_id}")
            relative[name] = self.u64()
            tensors.append((name, shape, kind))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        alignment = alignment if isinstance(alignment, int) and alignment > 0 else DEFAULT_ALIGNMENT
        data_start = -(-self.pos // alignment) * alignment
        offsets = {name: data_start + offset for name, offset in relative.items()}
        data_end = data_start
        for name, shape, kind in tensors:
            if kind in BLOCKS:
                per_block, block_bytes = BLOCKS[kind]
                data_end = max(data_end, offsets[name] + -(-math.prod(shape) // per_block) * block_bytes)
        return GgufInfo(metadata, tensors, offsets, lengths, data_end)

    def check_version(self, version: int) -> None:
        if version in VERSIONS:
            return
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:
            raise UnsupportedModelError(f"{self.path} is a big-endian GGUF; ferrum reads little-endian GGUF files")
        if not 0 < version < 256:  # no GGUF was ever written so; the header is damaged
            raise CorruptModelError(
                f"{self.path} has GGUF version {version}, which no GGUF file has; download it again"
            )
        raise UnsupportedModelError(
            f"{self.path} is GGUF version {version}; ferrum reads versions {' and '.join(map(str, VERSIONS))} "
            "(convert the model again with a current llama.cpp)"
        )

    def check_fits(self, count: int, item_bytes: int) -> None:
        """`count` items of at least `item_bytes` each must fit in what is left of the file."""
        if count * item_bytes > self.size - self.pos:
            raise _truncated(self.path)

    def u32(self) -> int:
        value = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return value

    def u64(self) -> int:
        value = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return value

    def string(self) -> str:
        n = self.u64()
        end = self.pos + n
        if end > self.size:  # a damaged length field can claim more bytes than the file has
            raise _truncated(self.path)
        text = self.buf[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            value = struct.unpack_from(fmt, self.buf, self.pos)[0]
            self.pos += struct.calcsize(fmt)
            return value
        raise CorruptModelError(f"{self.path} has an unknown GGUF metadata type {kind}; the file is damaged")

    def array(self) -> tuple[list | None, int]:
        """(the array as a list, or None when skipped; its length)."""
        item_kind, count = self.u32(), self.u64()
        if item_kind in _SCALARS:
            width = struct.calcsize("<" + _SCALARS[item_kind])
            self.check_fits(count, width)
            value = (
                list(struct.unpack_from(f"<{count}{_SCALARS[item_kind]}", self.buf, self.pos)) if self.arrays else None
            )
            self.pos += width * count
            return value, count
        self.check_fits(count, _MIN_ITEM_BYTES)
        if item_kind == _STRING:
            return self.strings(count), count
        items = [self.array()[0] if item_kind == _ARRAY else self.value(item_kind) for _ in range(count)]
        return (items if self.arrays else None), count

    def strings(self, count: int) -> list[str] | None:
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        if not self.arrays:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
                if pos > self.size:  # a damaged length: stop before it points past what an offset can hold
                    raise _truncated(self.path)
            value = None
        else:
            raw = []
            append = raw.append
            for _ in range(count):
                start = pos + 8
                pos = start + unpack(buf, pos)[0]
                if pos > self.size:
                    raise _truncated(self.path)
                append(buf[start:pos])
            # One decode for all of them: joined by newlines when none contains one.
            joined = b"\n".join(raw)
            if count and joined.count(b"\n") == count - 1:
                value = joined.decode("utf-8", errors="replace").split("\n")
            else:
                value = [item.decode("utf-8", errors="replace") for item in raw]
        if pos > self.size:
            raise _truncated(self.path)
        self.pos = pos
        return value
