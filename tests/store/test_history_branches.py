"""The chat history as a tree: edits and regenerations add branches instead of deleting, the
shown path follows the leaf, and a database from before branches becomes single paths."""

from __future__ import annotations

import sqlite3

import pytest

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.history import MIGRATIONS, History


def path(history, chat_id) -> list[tuple[str, tuple[int, int]]]:
    return [(m.content, m.branch) for m in history.messages(chat_id)]


def test_edit_and_regenerate_keep_the_old_path_as_a_branch(tmp_path):
    history = History.open(tmp_path / "h.sqlite3")
    chat = history.new_conversation("tree")
    q1 = history.add_message(chat.id, "user", "Q1")
    history.add_message(chat.id, "assistant", "A1")
    q2 = history.add_message(chat.id, "user", "Q2")
    a2 = history.add_message(chat.id, "assistant", "A2")
    history.add_message(chat.id, "user", "Q3")

    history.set_leaf(chat.id, q2.id)  # regenerate Q2's answer
    a2b = history.add_message(chat.id, "assistant", "A2b")
    assert a2b.branch == (2, 2) and a2b.parent_id == q2.id
    assert path(history, chat.id) == [("Q1", (1, 1)), ("A1", (1, 1)), ("Q2", (1, 1)), ("A2b", (2, 2))]

    history.set_leaf(chat.id, None)  # edit the first message
    history.add_message(chat.id, "user", "Q1 edited")
    history.add_message(chat.id, "assistant", "B1")
    assert path(history, chat.id) == [("Q1 edited", (2, 2)), ("B1", (1, 1))]

    # back to the first branch: down to the newest message written below Q1 (A2b, not Q3)
    assert history.switch_branch(chat.id, history.messages(chat.id)[0].id, -1) == q1.id
    assert [c for c, _ in path(history, chat.id)] == ["Q1", "A1", "Q2", "A2b"]
    assert history.switch_branch(chat.id, q1.id, -1) is None  # no sibling before the first
    assert history.switch_branch(chat.id, a2b.id, -1) == a2.id
    assert path(history, chat.id)[-2:] == [("A2", (1, 2)), ("Q3", (1, 1))]

    history.show_message(chat.id, a2b.id)  # a search hit on another branch
    assert path(history, chat.id)[-1] == ("A2b", (2, 2))
    assert len(history.db.execute("SELECT id FROM messages").fetchall()) == 8  # nothing was deleted
    with pytest.raises(FerrumError, match="no message 999 in conversation"):
        history.set_leaf(chat.id, 999)
    history.close()


def test_a_linear_conversation_from_before_branches_becomes_one_path(tmp_path):
    file = tmp_path / "old.sqlite3"
    db = sqlite3.connect(file)
    db.executescript(MIGRATIONS[0] + MIGRATIONS[1] + MIGRATIONS[2] + "PRAGMA user_version = 3;")
    for chat in (1, 2):
        db.execute("INSERT INTO conversations (id, title, created, updated) VALUES (?, 'old', 1.0, 2.0)", (chat,))
    for chat, role, text in [(1, "user", "hi"), (2, "user", "other"), (1, "assistant", "hello"), (1, "user", "bye")]:
        db.execute(
            "INSERT INTO messages (conversation_id, role, content, created) VALUES (?, ?, ?, 1.0)", (chat, role, text)
        )
    db.commit()
    db.close()

    history = History.open(file)
    assert path(history, 1) == [("hi", (1, 1)), ("hello", (1, 1)), ("bye", (1, 1))]
    assert path(history, 2) == [("other", (1, 1))]
    history.set_leaf(1, history.messages(1)[1].id)
    history.add_message(1, "user", "see you")
    assert path(history, 1)[-1] == ("see you", (2, 2))
    history.close()


def test_a_parent_edited_into_a_loop_ends_the_path(tmp_path):
    file = tmp_path / "h.sqlite3"
    history = History.open(file)
    chat = history.new_conversation("loop")
    first = history.add_message(chat.id, "user", "one")
    second = history.add_message(chat.id, "assistant", "two")
    history.db.execute("UPDATE messages SET parent_id = ? WHERE id = ?", (second.id, first.id))
    assert [m.content for m in history.messages(chat.id)] == ["one", "two"]
    history.close()
