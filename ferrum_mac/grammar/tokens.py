"""Our tokenizers' vocabularies as the grammar engine's token table, padded to the logits width."""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import llguidance
import numpy as np

from ferrum_mac.text.tokenizer import Tokenizer

# The engine's convention for a token that never stands for text: its bytes start with 0xFF,
# which no UTF-8 text contains, so no grammar over text can ever allow it.
SPECIAL_PREFIX = b"\xff"


def mask_words(width: int) -> int:
    """Int32 words in one row of a bitmask over `width` token ids (bit i of word j: id 32*j+i)."""
    return (width + 31) // 32


def full_mask(rows: int, width: int) -> np.ndarray:
    """A bitmask that allows every id: the row of a sequence decoding without a grammar."""
    return np.full((rows, mask_words(width)), -1, dtype=np.int32)


def token_table(tokenizer: Tokenizer, width: int | None = None) -> list[bytes]:
    """Each id's bytes as the engine must see them; special, unused and padding ids are marked special."""
    width = max(width or 0, tokenizer.vocab_size)
    table = []
    for token_id in range(width):
        data = _text_bytes(tokenizer, token_id)
        table.append(data if data else SPECIAL_PREFIX + _special_name(tokenizer, token_id).encode("utf-8"))
    return table


def _text_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    if token_id >= tokenizer.vocab_size or token_id in tokenizer.special_ids:
        return b""
    if tokenizer.unk_token is not None and token_id == tokenizer.piece_to_id(tokenizer.unk_token):
        # `<unk>` decodes to a placeholder, not to bytes the model means: never let a grammar pick it.
        return b""
    data = tokenizer.token_bytes(token_id)
    # 0xFF never occurs in UTF-8 text and the engine reserves it to mark special tokens: a
    # byte-level vocabulary's lone 0xFF byte can never be part of a grammar's text anyway.
    return b"" if SPECIAL_PREFIX in data else data


def _special_name(tokenizer: Tokenizer, token_id: int) -> str:
    piece = tokenizer.id_to_piece(token_id) if token_id < tokenizer.vocab_size else None
    return piece if piece else f"<[{token_id}]>"


class _TableTokenizer:
    """The shape `llguidance.TokenizerWrapper` reads: the table, eos/bos, and an encoder of bytes.

    The engine tokenizes text the grammar forces and needs ids that spell exactly those bytes.
    A sentencepiece tokenizer puts a space before the first word of what it encodes; when our
    encoding does not spell the bytes exactly, the engine's own greedy longest-match does.
    """

    def __init__(self, tokenizer: Tokenizer, table: list[bytes], eos_ids: Sequence[int]):
        self.tokens = table
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, data in enumerate(table) if data.startswith(SPECIAL_PREFIX)]
        self._tokenizer = tokenizer
        self.greedy: llguidance.LLTokenizer | None = None  # set once the engine's tokenizer exists

    def __call__(self, data: bytes) -> list[int]:
        text = data.decode("utf-8", errors="replace")
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        if b"".join(self.tokens[i] for i in ids) == data or self.greedy is None:
            return ids
        return self.greedy.greedy_tokenize(text)


class GrammarVocab:
    """One model's token table in the engine; build once per model (it takes a fraction of a second)."""

    def __init__(self, tokenizer: Tokenizer, width: int | None = None, eos_ids: Iterable[int] | None = None):
        """`width`: the model's logits width when its embeddings are padded past the tokenizer."""
        eos = sorted(set(eos_ids if eos_ids is not None else tokenizer.eos_ids))
        if not eos:
            raise ValueError("a grammar needs the model's end-of-sequence ids; the tokenizer names none")
        self.table = token_table(tokenizer, width)
        self.tokenizer_size = tokenizer.vocab_size
        self.width = len(self.table)
        self.words = mask_words(self.width)
        self.eos_ids = tuple(eos)
        table_tokenizer = _TableTokenizer(tokenizer, self.table, eos)
        wrapper = llguidance.TokenizerWrapper(table_tokenizer)
        self.engine_tokenizer = llguidance.LLTokenizer(
            wrapper, eos_token=list(eos), slices=llguidance.LLTokenizer.json_slices()
        )
        table_tokenizer.greedy = self.engine_tokenizer

    @functools.cached_property
    def free_mask(self) -> np.ndarray:
        """One row allowing every id of the tokenizer and none of the padding past it."""
        allowed = np.zeros(32 * self.words, dtype=bool)
        allowed[: self.tokenizer_size] = True
        return np.packbits(allowed, bitorder="little").view(np.int32)

    def engine_bytes(self, token_id: int) -> bytes:
        """The bytes the engine holds for `token_id` (special ids keep their 0xFF marker)."""
        return self.engine_tokenizer.decode_bytes([token_id])
