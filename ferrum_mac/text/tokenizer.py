"""The one tokenizer interface the engine sees, whatever file the vocabulary came from.

Besides encode/decode it tells the streaming detokenizer, token by token, which bytes each
token adds to the text (`token_bytes`) and how the very start of a text is trimmed
(`text_start`): sentencepiece vocabularies drop the space their first word carries.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from typing import Protocol, Sequence

# Sentencepiece and `ByteFallback` turn each invalid byte into its own U+FFFD; Python's
# "replace" (like Rust's from_utf8_lossy) turns each invalid sequence into one.
REPLACE_EACH_BYTE = "ferrum_replace_each_byte"
codecs.register_error(REPLACE_EACH_BYTE, lambda err: ("\ufffd" * (err.end - err.start), err.end))


class TextStart(Protocol):
    """The rule that trims the beginning of a decoded text; a fresh one per decode."""

    def trim(self, token_id: int, data: bytes) -> tuple[bytes, bool]:
        """The bytes of `token_id` to keep, and whether the start of the text is now settled."""
        ...


class KeepStart:
    """Byte-level vocabularies: the text starts exactly as its first token does."""

    def trim(self, token_id: int, data: bytes) -> tuple[bytes, bool]:
        return data, True


class StripLeadingSpaces:
    """Drop up to `count` spaces from the start of the whole text (a `Strip` decoder)."""

    def __init__(self, count: int = 1):
        self.left = count

    def trim(self, token_id: int, data: bytes) -> tuple[bytes, bool]:
        while self.left and data.startswith(b" "):
            data, self.left = data[1:], self.left - 1
        if data:
            self.left = 0
        return data, self.left == 0


class DropFirstTokenSpaces:
    """A `Metaspace` decoder: the first token that decodes at all loses every space it has."""

    def trim(self, token_id: int, data: bytes) -> tuple[bytes, bool]:
        if not data:
            return data, False
        return data.replace(b" ", b""), True


class Tokenizer(ABC):
    """Text to token ids and back, the special tokens chat templates need, and per-token bytes.

    `decode` leaves out special (control) tokens; the streaming detokenizer does the same.
    """

    vocab_size: int
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    # Every id that ends a generation: the tokenizer's eos plus the model's generation config.
    eos_ids: frozenset[int] = frozenset()
    special_ids: frozenset[int] = frozenset()
    # The codec error handler that turns invalid UTF-8 into U+FFFD the way `decode` does.
    utf8_errors: str = "replace"

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the BOS/EOS the vocabulary asks for."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`."""

    @abstractmethod
    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary's spelling of a token (e.g. 'Ġthe', '▁the', '<0x0A>')."""

    @abstractmethod
    def piece_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary entry, or None."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds in the middle of a text; b'' for special tokens (memoised)."""
        cache = self.__dict__.setdefault("_token_bytes_cache", {})
        data = cache.get(token_id)
        if data is None:
            data = cache[token_id] = self._token_bytes(token_id)
        return data

    @abstractmethod
    def _token_bytes(self, token_id: int) -> bytes:
        """`token_bytes` before memoisation."""

    @abstractmethod
    def text_start(self) -> TextStart:
        """A fresh rule for trimming the start of a decoded text."""

    def template_tokens(self) -> dict[str, str]:
        """The special-token strings a chat template may use (bos_token, eos_token, ...)."""
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}
