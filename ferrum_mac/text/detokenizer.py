"""Streaming detokenizer: token ids in, one at a time; text deltas out.

Each token's bytes go through an incremental UTF-8 decoder, which holds back a character
until all its bytes have arrived, so a delta never holds half of one. The start of the text
is trimmed by the tokenizer's own rule (sentencepiece drops its first word's space), so the
deltas joined equal `tokenizer.decode(all ids)`.
"""

from __future__ import annotations

import codecs

from ferrum_mac.text.tokenizer import Tokenizer


class StreamingDetokenizer:
    """Feed `add(token_id)` for each generated token, then `finish()` once; join the results."""

    def __init__(self, tokenizer: Tokenizer, keep_start: bool = False):
        self._tokenizer = tokenizer
        self._keep_start = keep_start  # the text continues a prompt: its first space is the model's
        self.reset()

    def reset(self) -> None:
        """Start a new text."""
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=self._tokenizer.utf8_errors)
        self._start = self._tokenizer.text_start()
        self._settled = self._keep_start
        self.token_count = 0

    def add(self, token_id: int) -> str:
        """The text this token completes; '' while a character is still partial."""
        self.token_count += 1
        data = self._tokenizer.token_bytes(token_id)
        if not self._settled:
            data, self._settled = self._start.trim(token_id, data)
        return self._utf8.decode(data) if data else ""

    def finish(self) -> str:
        """What is still held back: U+FFFD for bytes that never became a character."""
        return self._utf8.decode(b"", final=True)
