"""GPT-2's byte-level alphabet: each of the 256 bytes spelled as one printable character."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """Printable bytes stand for themselves; the rest are shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def piece_bytes(piece: str) -> bytes:
    """The bytes a byte-level piece spells; a piece outside the alphabet (an added token such
    as '<think>' written plainly) stands for its own UTF-8, as the `ByteLevel` decoder does."""
    table = char_to_byte()
    try:
        return bytes(table[c] for c in piece)
    except KeyError:
        return piece.encode("utf-8")
