"""A thread-safe least-recently-used cache bounded in entries and in the size of what it holds, keyed by digest.

Grammar texts and schemas can be megabytes (a request body may be 4 MB): the caches of the
grammar package keep a digest of each key, not the key, and drop the oldest entries once their
values' sizes pass `max_bytes`.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any


class SizedLru:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> Any:
        """The value kept for `key`, or None."""
        digest = _digest(key)
        with self._lock:
            found = self._entries.get(digest)
            if found is None:
                return None
            self._entries.move_to_end(digest)
            return found[0]

    def put(self, key: str, value: Any, size: int) -> None:
        """Keep `value` (`size` bytes, about) for `key`; one past `max_bytes` alone is not kept."""
        if size > self.max_bytes:
            return
        digest = _digest(key)
        with self._lock:
            old = self._entries.pop(digest, None)
            self._bytes += size - (old[1] if old else 0)
            self._entries[digest] = (value, size)
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
