"""Chat history: conversations and their messages in sqlite, kept as they happen.

    history = History.open()                       # the platform data folder, or History.open(path)
    chat = history.new_conversation("New chat", {"temperature": 0.7})
    history.add_message(chat.id, "user", "Hi")
    history.add_message(chat.id, "assistant", "Hello!", stats={"decode_tps": 5.1})

Every message is committed when it is added (WAL mode), so a killed process loses nothing
already written. The schema carries its version (`PRAGMA user_version`); `MIGRATIONS[n]`
takes a database from version n to n + 1, and opening a database runs whatever is missing.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from ferrum_mac.errors import FerrumError

DB_NAME = "history.sqlite3"

MIGRATIONS: list[str] = [
    # 0 -> 1: conversations and messages
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        created REAL NOT NULL
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    # 1 -> 2: per-conversation settings; reasoning and figures beside each message
    """
    ALTER TABLE conversations ADD COLUMN settings TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT '';
    ALTER TABLE messages ADD COLUMN stats TEXT NOT NULL DEFAULT '{}';
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def default_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("ferrum_mac")) / DB_NAME


@dataclass
class StoredConversation:
    id: int
    title: str
    settings: dict = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0


@dataclass
class StoredMessage:
    id: int
    conversation_id: int
    role: str  # user, assistant, or notice (shown, never sent to the model)
    content: str
    reasoning: str = ""
    stats: dict = field(default_factory=dict)


class History:
    def __init__(self, db: sqlite3.Connection, path: Path):
        self.db = db
        self.path = path

    @classmethod
    def open(cls, path: str | Path | None = None) -> "History":
        path = Path(path).expanduser() if path else default_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA foreign_keys=ON")
            migrate(db)
        except sqlite3.Error as e:
            raise FerrumError(f"cannot open the chat history {path}: {e}") from e
        return cls(db, path)

    def close(self) -> None:
        self.db.close()

    # -- conversations ------------------------------------------------------------------

    def new_conversation(self, title: str, settings: dict | None = None) -> StoredConversation:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, settings, created, updated) VALUES (?, ?, ?, ?)",
            (title, json.dumps(settings or {}), now, now),
        )
        return StoredConversation(cur.lastrowid, title, settings or {}, now, now)

    def conversations(self, search: str = "") -> list[StoredConversation]:
        """Newest first; `search` matches titles and message text (case-insensitive)."""
        query = "SELECT id, title, settings, created, updated FROM conversations"
        args: tuple = ()
        if search:
            like = f"%{search}%"
            query += (
                " WHERE title LIKE ? OR id IN (SELECT conversation_id FROM messages WHERE content LIKE ?)"
            )
            args = (like, like)
        rows = self.db.execute(query + " ORDER BY updated DESC, id DESC", args).fetchall()
        return [StoredConversation(i, t, json.loads(s), c, u) for i, t, s, c, u in rows]

    def conversation(self, conversation_id: int) -> StoredConversation:
        row = self.db.execute(
            "SELECT id, title, settings, created, updated FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise FerrumError(f"no conversation {conversation_id} in the chat history")
        i, t, s, c, u = row
        return StoredConversation(i, t, json.loads(s), c, u)

    def rename(self, conversation_id: int, title: str) -> None:
        self._update(conversation_id, "title = ?", title)

    def save_settings(self, conversation_id: int, settings: dict) -> None:
        self._update(conversation_id, "settings = ?", json.dumps(settings))

    def delete(self, conversation_id: int) -> None:
        self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _update(self, conversation_id: int, assignment: str, value) -> None:
        self.db.execute(
            f"UPDATE conversations SET {assignment}, updated = ? WHERE id = ?", (value, time.time(), conversation_id)
        )

    # -- messages -------------------------------------------------------------------------

    def add_message(
        self, conversation_id: int, role: str, content: str, reasoning: str = "", stats: dict | None = None
    ) -> StoredMessage:
        now = time.time()
        with self.db:  # one transaction: the message and the conversation's new time
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, reasoning, stats, created)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, reasoning, json.dumps(stats or {}), now),
            )
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return StoredMessage(cur.lastrowid, conversation_id, role, content, reasoning, stats or {})

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT id, conversation_id, role, content, reasoning, stats FROM messages"
            " WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        ).fetchall()
        return [StoredMessage(i, c, r, t, reason, json.loads(s)) for i, c, r, t, reason, s in rows]

    def delete_from(self, conversation_id: int, message_id: int) -> None:
        """Forget message `message_id` and every later one (edit and resend, regenerate)."""
        self.db.execute("DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id))


def migrate(db: sqlite3.Connection) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise FerrumError(
            f"the chat history has schema version {version}, newer than this ferrum's {SCHEMA_VERSION}; upgrade ferrum"
        )
    for step in range(version, SCHEMA_VERSION):
        db.executescript(f"BEGIN; {MIGRATIONS[step]} PRAGMA user_version = {step + 1}; COMMIT;")
