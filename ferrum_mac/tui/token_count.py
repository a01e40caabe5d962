"""How many tokens a text will cost, before it is sent: the model's own tokenizer where the engine
is local, else an estimate (a remote server tokenizes on its side)."""

from __future__ import annotations

CHARS_PER_TOKEN = 4  # a common English average; only for engines without a tokenizer here


def count_tokens(engine, text: str) -> int:
    if not text:
        return 0
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return -(-len(text) // CHARS_PER_TOKEN)
