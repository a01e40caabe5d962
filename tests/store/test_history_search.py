"""Full-text search over the chat history: kept in step by the history's own writes, migrated
into databases written before it existed, and printed by `ferrum chat --search`."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from ferrum_mac.store.history import MATCH_END, MATCH_START, MIGRATIONS, History


def test_search_finds_words_by_prefix_and_follows_deletes(tmp_path):
    history = History.open(tmp_path / "h.sqlite3")
    cats = history.new_conversation("Cats")
    dogs = history.new_conversation("Dogs")
    history.add_message(cats.id, "user", "Why do cats purr when they sleep?")
    answer = history.add_message(cats.id, "assistant", "Purring is a low vibration; café owners love it.")
    history.add_message(cats.id, "notice", "purring notice lines are not searched")
    history.add_message(dogs.id, "user", "Dogs bark at the mailman.")

    hits = history.search("purr")
    assert [(h.conversation_id, h.role) for h in hits] == [(cats.id, "assistant"), (cats.id, "user")]
    assert hits[0].message_id == answer.id and hits[0].title == "Cats"
    assert f"{MATCH_START}Purring{MATCH_END}" in hits[0].snippet
    assert [h.message_id for h in history.search("cafe")] == [answer.id]  # accents folded
    assert [h.title for h in history.search("bark mail")] == ["Dogs"]  # every word, each a prefix
    # FTS5's own syntax is not the person's: quotes, operators and column filters are plain words
    assert history.search('"') == [] and history.search("content:bark OR") == []
    assert [h.title for h in history.search('("bark*')] == ["Dogs"]
    assert [h.title for h in history.search("bark " * 5000)] == ["Dogs"]  # a pasted page: its first words

    history.delete(cats.id)
    assert history.search("purr") == []
    assert [h.title for h in history.search("dogs")] == ["Dogs"]
    history.close()


def test_a_database_from_before_search_is_indexed_when_opened(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0] + MIGRATIONS[1] + "PRAGMA user_version = 2;")
    db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (1, 'Old chat', 1.0, 2.0)")
    db.execute("INSERT INTO messages (conversation_id, role, content, created) VALUES (1, 'user', 'zebra?', 1.0)")
    db.commit()
    db.close()

    history = History.open(path)
    [hit] = history.search("zebra")
    assert (hit.conversation_id, hit.title, hit.role) == (1, "Old chat", "user")
    history.close()


def test_ferrum_chat_search_prints_the_matches(tmp_path):
    path = tmp_path / "h.sqlite3"
    history = History.open(path)
    chat = history.new_conversation("Lighthouses")
    history.add_message(chat.id, "user", "Tell me about the lighthouse keeper and her cat.")
    history.close()

    def chat_search(text: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "ferrum_mac.cli", "chat", "--db", str(path), "--search", text]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    found = chat_search("keeper")
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines() == [
        f"Lighthouses  (conversation {chat.id}, you)",
        "  Tell me about the lighthouse keeper and her cat.",
    ]
    assert f"`ferrum chat --open {chat.id}` opens the first of them" in found.stderr
    missing = chat_search("walrus")
    assert missing.returncode == 0 and missing.stdout == "" and "no message matches 'walrus'" in missing.stderr
    empty = chat_search("  ?! ")
    assert empty.returncode == 1 and empty.stderr.strip().count("\n") == 0 and "nothing to search for" in empty.stderr


def test_ferrum_chat_open_refuses_a_conversation_that_is_not_there(tmp_path):
    path = tmp_path / "h.sqlite3"
    History.open(path).close()
    command = [sys.executable, "-m", "ferrum_mac.cli", "chat", "--db", str(path), "--open", "7"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr == "ferrum: no conversation 7 in the chat history\n"
