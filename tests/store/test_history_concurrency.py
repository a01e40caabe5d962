"""The chat history under several ferrum processes at once: a new database opened by many
processes at the same moment, and a writer that waits on another's lock longer than it may."""

from __future__ import annotations

import multiprocessing
import sqlite3
import time

import pytest

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.history import SCHEMA_VERSION, History

PROCESSES = 4
ROUNDS = 12


def _open_and_write(path: str, start_at: float) -> str:
    """Wait for the common start time, open the history, write one message: "ok" or the error."""
    while time.time() < start_at:
        pass
    try:
        history = History.open(path)
        try:
            chat = history.new_conversation("race")
            history.add_message(chat.id, "user", "hello")
        finally:
            history.close()
    except Exception as e:  # reported to the parent, which names it in the failure
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.slow
def test_processes_opening_a_new_database_at_once_all_succeed(tmp_path):
    context = multiprocessing.get_context("spawn")  # a fresh interpreter each, as separate ferrum runs are
    with context.Pool(PROCESSES) as pool:
        pool.map(time.sleep, [0] * PROCESSES)  # workers started before the clock runs
        for round_ in range(ROUNDS):
            path = str(tmp_path / f"history-{round_}.sqlite3")
            start_at = time.time() + 0.3
            results = pool.starmap(_open_and_write, [(path, start_at)] * PROCESSES)
            assert results == ["ok"] * PROCESSES, f"round {round_}: {results}"
            history = History.open(path)
            try:
                assert history.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
                assert len(history.conversations()) == PROCESSES
            finally:
                history.close()


def test_a_writer_blocked_past_the_timeout_gets_a_one_line_error(tmp_path):
    path = tmp_path / "history.sqlite3"
    History.open(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    try:
        history = History.open(path, timeout=0.2)
        try:
            started = time.monotonic()
            with pytest.raises(FerrumError, match=r"locked by another ferrum process") as e:
                history.new_conversation("blocked")
            assert time.monotonic() - started > 0.15  # it waited for the lock
            assert str(path) in str(e.value) and "\n" not in str(e.value)
            # and for its own 0.2 s, not sqlite's default 5 s
            assert "waited 0.2 s" in str(e.value)
            assert history.db.execute("PRAGMA busy_timeout").fetchone()[0] == 200
            with pytest.raises(FerrumError, match=r"locked by another ferrum process"):
                chat_id = 1
                history.add_message(chat_id, "user", "blocked too")
        finally:
            history.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_opening_a_new_database_while_another_process_writes_waits_or_says_why(tmp_path):
    path = tmp_path / "history.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # holds the write lock before any table exists
    try:
        with pytest.raises(FerrumError, match=r"locked by another ferrum process") as e:
            History.open(path, timeout=0.2)
        assert "\n" not in str(e.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    History.open(path, timeout=0.2).close()  # once the lock is gone it opens and migrates
