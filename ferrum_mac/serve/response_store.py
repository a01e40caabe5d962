"""The responses `/v1/responses` keeps for `previous_response_id` and GET/DELETE by id: one sqlite file.

A kept response holds the answer as the client got it and the conversation that led to it
(the input items of every response in its chain, then its own output), so a follow-up that
names it sends only its new items. Each expires after `ttl_s`; at most `max_rows` are kept, the
oldest going first, so clients cannot fill the disk. `store: false` keeps nothing.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

MAX_ROWS = 10_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created REAL NOT NULL,
    expires REAL NOT NULL,
    response TEXT NOT NULL,
    conversation TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object as the client got it
    conversation: list[dict]  # every input item of its chain and its own output items, in order


class ResponseStore:
    """Responses by id, in the sqlite file at `path` (None: in memory, for one process)."""

    def __init__(self, path: Path | None, ttl_s: float, max_rows: int = MAX_ROWS):
        self.ttl_s, self.max_rows = ttl_s, max_rows
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock, self._db:
            self._db.executescript(SCHEMA)

    def put(self, response: dict, conversation: list[dict]) -> None:
        now = time.time()
        with self._lock, self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                (response["id"], now, now + self.ttl_s, json.dumps(response), json.dumps(conversation)),
            )
            self._db.execute("DELETE FROM responses WHERE expires < ?", (now,))
            self._db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC LIMIT -1 OFFSET ?)",
                (self.max_rows,),
            )

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, conversation FROM responses WHERE id = ? AND expires >= ?", (response_id, time.time())
            ).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock, self._db:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()
