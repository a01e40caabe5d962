"""Tokenizers from the `tokenizers` library: `tokenizer.json` files, and vocabularies rebuilt
from GGUF metadata.

`decode` is the library's own. For streaming, each token's bytes are worked out from the
decoder pipeline the file declares (byte-level, or sentencepiece-style `Replace` +
`ByteFallback` + `Strip`, or `Metaspace`), so a stream of tokens decodes exactly as the
whole sequence does.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Sequence

import tokenizers

from ferrum_mac.text.byte_level import piece_bytes
from ferrum_mac.text.tokenizer import (
    REPLACE_EACH_BYTE,
    DropFirstTokenSpaces,
    KeepStart,
    StripLeadingSpaces,
    TextStart,
    Tokenizer,
)

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class PieceDecoder:
    """What a `tokenizers` decoder pipeline does to one token, read from its JSON form."""

    def __init__(self, spec: dict | None):
        self.byte_level = False
        self.byte_fallback = False
        self.replacements: list[tuple[str, str]] = []
        self.strip_start = 0
        self.drop_first_token_spaces = False
        self.understood = spec is not None
        for step in _flatten(spec):
            self._add(step)

    def _add(self, step: dict) -> None:
        kind = step.get("type")
        if kind == "ByteLevel":
            self.byte_level = True
        elif kind == "ByteFallback":
            self.byte_fallback = True
        elif kind == "Fuse":
            pass
        elif kind == "Replace" and "String" in step.get("pattern", {}):
            self.replacements.append((step["pattern"]["String"], step["content"]))
        elif kind == "Strip" and step.get("content") == " " and not step.get("stop"):
            self.strip_start += step.get("start", 0)
        elif kind == "Metaspace":
            self.replacements.append((step.get("replacement", "▁"), " "))
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            self.drop_first_token_spaces = scheme != "never"
        else:
            self.understood = False

    def piece_bytes(self, piece: str) -> bytes:
        if self.byte_fallback and len(piece) == 6 and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if self.byte_level:
            return piece_bytes(piece)
        for old, new in self.replacements:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")


def _flatten(spec: dict | None) -> Iterable[dict]:
    if not spec:
        return
    if spec.get("type") == "Sequence":
        for step in spec.get("decoders", []):
            yield from _flatten(step)
    else:
        yield spec


class HfTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` behind ferrum's interface."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ):
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_id = self.piece_to_id(bos_token) if bos_token else None
        self.eos_id = self.piece_to_id(eos_token) if eos_token else None
        self.eos_ids = frozenset(i for i in (self.eos_id, *extra_eos_ids) if i is not None)
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        decoder_spec = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
        self._pieces = PieceDecoder(decoder_spec)
        self.utf8_errors = "replace" if self._pieces.byte_level else REPLACE_EACH_BYTE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the interpreter while it works and encode does not: with it a
        # long text tokenized on a worker thread does not stall the others (the server's event loop).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def piece_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.backend.id_to_token(token_id)
        if piece is None or token_id in self.special_ids:
            return b""
        if not self._pieces.understood:
            # A decoder pipeline we do not model: the token on its own is the best we know.
            return self.backend.decode([token_id], skip_special_tokens=True).encode("utf-8")
        return self._pieces.piece_bytes(piece)

    def text_start(self) -> TextStart:
        if self._pieces.drop_first_token_spaces:
            return DropFirstTokenSpaces()
        if self._pieces.strip_start:
            return StripLeadingSpaces(self._pieces.strip_start)
        return KeepStart()
