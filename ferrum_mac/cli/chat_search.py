"""`ferrum chat --search TEXT`: the chat history's matching messages, printed, best first."""

from __future__ import annotations

import sys

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.history import MATCH_END, MATCH_START, History, fts_query

ROLE_NAMES = {"user": "you", "assistant": "assistant"}
BOLD, PLAIN = "\x1b[1m", "\x1b[0m"


def print_search(db: str | None, text: str) -> None:
    if not fts_query(text):
        raise FerrumError(f"nothing to search for in {text!r}: give a word or more")
    history = History.open(db)
    try:
        hits = history.search(text)
    finally:
        history.close()
    if not hits:
        print(f"no message matches {text!r}", file=sys.stderr)
        return
    start, end = (BOLD, PLAIN) if sys.stdout.isatty() else ("", "")
    for hit in hits:
        snippet = " ".join(hit.snippet.split()).replace(MATCH_START, start).replace(MATCH_END, end)
        print(f"{hit.title}  (conversation {hit.conversation_id}, {ROLE_NAMES.get(hit.role, hit.role)})")
        print(f"  {snippet}")
    print(f"`ferrum chat --open {hits[0].conversation_id}` opens the first of them", file=sys.stderr)
