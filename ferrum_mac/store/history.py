"""Chat history: conversations and their messages in sqlite, kept as they happen.

    history = History.open()                       # the platform data folder, or History.open(path)
    chat = history.new_conversation("New chat", {"temperature": 0.7})
    history.add_message(chat.id, "user", "Hi")
    history.add_message(chat.id, "assistant", "Hello!", stats={"decode_tps": 5.1})

A conversation is a tree: each message has a parent, and the conversation's leaf is the tip of
the path that is shown and sent. Editing an earlier message or regenerating an answer moves the
leaf back (`set_leaf`) and adds the new message beside the old one, which stays as a branch;
`switch_branch` moves to a sibling and down to the newest message below it.

Every message is committed when it is added (WAL mode), so a killed process loses nothing
already written. The schema carries its version (`PRAGMA user_version`); `MIGRATIONS[n]`
takes a database from version n to n + 1, and opening a database runs whatever is missing.

Several ferrum processes may share the file (a chat app, a REPL, a server): migrations run in
one write transaction, and a writer waits up to `timeout` seconds for another's lock, then
says so in one line rather than failing with sqlite's bare "database is locked".
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ferrum_mac.errors import FerrumError

LOCK_TIMEOUT = 10.0  # seconds a writer waits for another process's write to finish

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
    # 2 -> 3: full-text search over the messages, kept in step by triggers on every write; the
    # prefix indexes serve the short prefixes a person types (every word is searched as a prefix)
    """
    CREATE VIRTUAL TABLE messages_fts USING fts5(
        content, content='messages', content_rowid='id', tokenize='unicode61 remove_diacritics 2', prefix='2 3'
    );
    CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
    END;
    CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN
        INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
        INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content);
    END;
    INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
    """,
    # 3 -> 4: a conversation is a tree (edits and regenerations are branches); `leaf_id` is the
    # tip of the path shown. An existing linear conversation becomes a single path.
    """
    ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE;
    UPDATE messages SET parent_id = (
        SELECT MAX(p.id) FROM messages AS p WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id
    );
    CREATE INDEX messages_by_parent ON messages(conversation_id, parent_id, id);
    ALTER TABLE conversations ADD COLUMN leaf_id INTEGER;
    UPDATE conversations SET leaf_id = (SELECT MAX(id) FROM messages WHERE conversation_id = conversations.id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def default_path() -> Path:
    from ferrum_mac.settings import history_db_path

    return history_db_path()


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
    parent_id: int | None = None
    branch: tuple[int, int] = (1, 1)  # this message's place among its siblings, and how many there are


@dataclass
class SearchHit:
    conversation_id: int
    title: str
    message_id: int
    role: str
    snippet: str  # the match in its context, each matched word between MATCH_START and MATCH_END


MATCH_START, MATCH_END = "\x02", "\x03"  # control characters no message text is shown with
SNIPPET_WORDS = 12
SEARCH_LIMIT = 50
SEARCH_WORDS = 32  # a query's words past this are ignored (a pasted page is not a search)


class History:
    def __init__(self, db: sqlite3.Connection, path: Path, timeout: float = LOCK_TIMEOUT):
        self.db = db
        self.path = path
        self.timeout = timeout

    @classmethod
    def open(cls, path: str | Path | None = None, timeout: float = LOCK_TIMEOUT) -> "History":
        """The history at `path` (default: the platform data folder), created or migrated as needed;
        `timeout`: seconds to wait for another process's write before giving up with a FerrumError."""
        path = Path(path).expanduser() if path else default_path()
        db = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, timeout=timeout, check_same_thread=False, isolation_level=None)
            with _locked_is_clear(path, timeout):
                _use_wal(db, timeout)
                db.execute("PRAGMA foreign_keys=ON")
                migrate(db)
        except sqlite3.Error as e:
            if db is not None:
                db.close()
            raise FerrumError(f"cannot open the chat history {path}: {e}") from None
        except FerrumError:
            if db is not None:
                db.close()
            raise
        return cls(db, path, timeout)

    def close(self) -> None:
        self.db.close()

    # -- conversations ------------------------------------------------------------------

    def new_conversation(self, title: str, settings: dict | None = None) -> StoredConversation:
        now = time.time()
        cur = self._execute(
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
            query += " WHERE title LIKE ? OR id IN (SELECT conversation_id FROM messages WHERE content LIKE ?)"
            args = (like, like)
        rows = self._execute(query + " ORDER BY updated DESC, id DESC", args).fetchall()
        return [StoredConversation(i, t, stored_object(s), c, u) for i, t, s, c, u in rows]

    def conversation(self, conversation_id: int) -> StoredConversation:
        row = self._execute(
            "SELECT id, title, settings, created, updated FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        if row is None:
            raise FerrumError(f"no conversation {conversation_id} in the chat history")
        i, t, s, c, u = row
        return StoredConversation(i, t, stored_object(s), c, u)

    def rename(self, conversation_id: int, title: str) -> None:
        self._update(conversation_id, "title = ?", title)

    def save_settings(self, conversation_id: int, settings: dict) -> None:
        self._update(conversation_id, "settings = ?", json.dumps(settings))

    def delete(self, conversation_id: int) -> None:
        self._execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def search(self, text: str, limit: int = SEARCH_LIMIT) -> list[SearchHit]:
        """Messages (user and assistant) whose words start with each word of `text`, newest first."""
        query = fts_query(text)
        if not query:
            return []
        rows = self._execute(
            "SELECT m.conversation_id, c.title, m.id, m.role,"
            f" snippet(messages_fts, 0, ?, ?, '…', {SNIPPET_WORDS})"
            " FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid"
            " JOIN conversations c ON c.id = m.conversation_id"
            " WHERE messages_fts MATCH ? AND m.role IN ('user', 'assistant')"
            " ORDER BY messages_fts.rowid DESC LIMIT ?",
            (MATCH_START, MATCH_END, query, limit),
        ).fetchall()
        return [SearchHit(*row) for row in rows]

    def _update(self, conversation_id: int, assignment: str, value) -> None:
        self._execute(
            f"UPDATE conversations SET {assignment}, updated = ? WHERE id = ?", (value, time.time(), conversation_id)
        )

    # -- messages -------------------------------------------------------------------------

    def add_message(
        self, conversation_id: int, role: str, content: str, reasoning: str = "", stats: dict | None = None
    ) -> StoredMessage:
        """Add a message after the conversation's leaf; it becomes the leaf."""
        now = time.time()
        # One transaction: the message, the new leaf and time. IMMEDIATE takes the write lock up
        # front, where sqlite waits for it; a deferred transaction's upgrade fails at once.
        with _locked_is_clear(self.path, self.timeout), self.db:
            self.db.execute("BEGIN IMMEDIATE")
            parent = self._leaf(conversation_id)
            cur = self.db.execute(
                "INSERT INTO messages (conversation_id, role, content, reasoning, stats, created, parent_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, reasoning, json.dumps(stats or {}), now, parent),
            )
            self.db.execute(
                "UPDATE conversations SET updated = ?, leaf_id = ? WHERE id = ?", (now, cur.lastrowid, conversation_id)
            )
        siblings = self._siblings(conversation_id, parent)
        return StoredMessage(
            cur.lastrowid,
            conversation_id,
            role,
            content,
            reasoning,
            stats or {},
            parent,
            (len(siblings), len(siblings)),
        )

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """The path from the first message to the leaf, each with its place among its siblings.
        (A parent id must be smaller than its child's: a row edited into a loop ends the path.)"""
        rows = self._execute(
            "WITH RECURSIVE path(id) AS ("
            " SELECT leaf_id FROM conversations WHERE id = ? AND leaf_id IS NOT NULL"
            " UNION ALL SELECT m.parent_id FROM messages m JOIN path ON m.id = path.id"
            " WHERE m.parent_id IS NOT NULL AND m.parent_id < m.id)"
            " SELECT m.id, m.conversation_id, m.role, m.content, m.reasoning, m.stats, m.parent_id,"
            " (SELECT COUNT(*) FROM messages s WHERE s.conversation_id = m.conversation_id"
            "  AND s.parent_id IS m.parent_id AND s.id <= m.id),"
            " (SELECT COUNT(*) FROM messages s WHERE s.conversation_id = m.conversation_id"
            "  AND s.parent_id IS m.parent_id)"
            " FROM messages m JOIN path ON m.id = path.id ORDER BY m.id",
            (conversation_id,),
        ).fetchall()
        return [
            StoredMessage(i, c, r, t, reason, stored_object(s), parent, (place, count))
            for i, c, r, t, reason, s, parent, place, count in rows
        ]

    def set_leaf(self, conversation_id: int, message_id: int | None) -> None:
        """End the shown path at `message_id` (None: before the first message); the next message
        added goes after it, beside whatever came after it before (edit and resend, regenerate)."""
        if message_id is not None:
            self._parent_of(conversation_id, message_id)
        self._execute("UPDATE conversations SET leaf_id = ? WHERE id = ?", (message_id, conversation_id))

    def show_message(self, conversation_id: int, message_id: int) -> None:
        """Make the path go through `message_id`, down to the newest message written below it
        (where the person last was on that branch)."""
        self._parent_of(conversation_id, message_id)
        newest = self._execute(
            "WITH RECURSIVE below(id) AS (SELECT ? UNION ALL SELECT m.id FROM messages m JOIN below"
            " ON m.conversation_id = ? AND m.parent_id = below.id AND m.id > below.id)"
            " SELECT MAX(id) FROM below",
            (message_id, conversation_id),
        ).fetchone()[0]
        self.set_leaf(conversation_id, newest)

    def switch_branch(self, conversation_id: int, message_id: int, step: int) -> int | None:
        """Show the sibling `step` places from `message_id` (-1: the one before); its id, or None
        where there is none that way."""
        parent = self._parent_of(conversation_id, message_id)
        siblings = self._siblings(conversation_id, parent)
        place = siblings.index(message_id) + step
        if not 0 <= place < len(siblings):
            return None
        self.show_message(conversation_id, siblings[place])
        return siblings[place]

    def _leaf(self, conversation_id: int) -> int | None:
        row = self.db.execute("SELECT leaf_id FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            raise FerrumError(f"no conversation {conversation_id} in the chat history")
        return row[0]

    def _siblings(self, conversation_id: int, parent_id: int | None) -> list[int]:
        rows = self._execute(
            "SELECT id FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY id",
            (conversation_id, parent_id),
        ).fetchall()
        return [row[0] for row in rows]

    def _parent_of(self, conversation_id: int, message_id: int) -> int | None:
        """The parent of message `message_id`, which must be in the conversation."""
        row = self._execute(
            "SELECT parent_id FROM messages WHERE id = ? AND conversation_id = ?", (message_id, conversation_id)
        ).fetchone()
        if row is None:
            raise FerrumError(f"no message {message_id} in conversation {conversation_id}")
        return row[0]

    def _execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        with _locked_is_clear(self.path, self.timeout):
            return self.db.execute(sql, args)


def fts_query(text: str) -> str:
    """The person's words as an FTS5 query: every word, each as a prefix. Only word characters reach
    FTS5, so its query syntax (quotes, AND, NEAR, column filters) cannot be typed by accident."""
    return " ".join(f'"{word}"*' for word in re.findall(r"\w+", text)[:SEARCH_WORDS])


def stored_object(text: str | None) -> dict:
    """A settings or figures column: a JSON object, or {} where the row was damaged (by hand or
    another program), so one bad row costs its settings, not the conversation."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def migrate(db: sqlite3.Connection) -> None:
    """Bring the schema to SCHEMA_VERSION in one write transaction. The version is read again
    once the lock is held: another process may have migrated the file while this one waited."""
    if _schema_version(db) == SCHEMA_VERSION:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        version = _schema_version(db)
        for step in range(version, SCHEMA_VERSION):
            for statement in _statements(MIGRATIONS[step]):
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _use_wal(db: sqlite3.Connection, timeout: float) -> None:
    """Switch the file to WAL mode (it stays so). sqlite answers "locked" at once, without its busy
    wait, when two connections switch a new file together; the loser retries until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _schema_version(db: sqlite3.Connection) -> int:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise FerrumError(
            f"the chat history has schema version {version}, newer than this ferrum's {SCHEMA_VERSION}; upgrade ferrum"
        )
    return version


def _statements(script: str) -> list[str]:
    """A migration script's statements, one by one (executescript would commit the open transaction)."""
    statements, pending = [], ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            statements.append(pending.strip())
            pending = ""
    if pending.strip():
        statements.append(pending.strip())
    return statements


@contextmanager
def _locked_is_clear(path: Path, timeout: float):
    """sqlite's "database is locked" (busy past `timeout`) -> a FerrumError that says who holds it."""
    try:
        yield
    except sqlite3.OperationalError as e:
        if "locked" not in str(e) and "busy" not in str(e):
            raise
        raise FerrumError(
            f"the chat history {path} is locked by another ferrum process (waited {timeout:g} s for its write); "
            "close the other ferrum or try again"
        ) from None
