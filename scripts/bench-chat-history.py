"""The chat history's figures: full-text search over 10,000 messages, and the time the chat app
takes to show the first screen of a 1,000-message conversation.

    python scripts/bench-chat-history.py [--messages 10000] [--runs 20] [--long 1000]

The history is a real sqlite file in a temporary folder, filled with generated sentences
(a seeded vocabulary of 2,000 words, Zipf-like, so some words match thousands of messages and
others a handful). Each query's median over --runs is printed with its hit count; the target is
under 50 ms for every query.

Then a conversation of --long messages (Markdown answers with a code block) is opened in the chat
app, headless at 100x30 (Textual's test harness, no model: the engine is never opened): the time
from asking for the conversation to the first screen painted, median of 5 (target: under 300 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from ferrum_mac.store.history import History

VOCABULARY = 2_000
MESSAGES_PER_CONVERSATION = 100
QUERIES = ("w1", "w7 w3", "w150", "w1999", "w4", "w2 w5 w9", "nothing-like-this")


def fill(history: History, messages: int, seed: int = 0) -> None:
    """`messages` generated user and assistant messages, MESSAGES_PER_CONVERSATION per conversation."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(VOCABULARY)]
    weights = [1 / (i + 1) for i in range(VOCABULARY)]
    written = 0
    while written < messages:
        chat = history.new_conversation(f"Conversation {written // MESSAGES_PER_CONVERSATION + 1}")
        for i in range(min(MESSAGES_PER_CONVERSATION, messages - written)):
            text = " ".join(rng.choices(words, weights, k=rng.randint(8, 120)))
            history.add_message(chat.id, "user" if i % 2 == 0 else "assistant", text)
            written += 1


def time_search(history: History, query: str, runs: int) -> tuple[float, int]:
    """The median milliseconds of `history.search(query)` and its hit count."""
    times, hits = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        hits = len(history.search(query))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), hits


ANSWER = """Here is **one** way, step {i}:

```python
def step_{i}(x):
    return x * {i}
```

It returns `x` times {i}."""


def fill_long(history: History, messages: int) -> int:
    chat = history.new_conversation("A long conversation")
    for i in range(messages):
        if i % 2 == 0:
            history.add_message(chat.id, "user", f"Question {i}: how would you write step {i}?")
        else:
            history.add_message(chat.id, "assistant", ANSWER.format(i=i), stats={"generated_tokens": 40})
    return chat.id


class NoModel:
    """Services for the app with no engine: opening one fails, which the app shows and carries on."""

    def default_model(self) -> str:
        return "none"

    def open_engine(self, name):
        raise RuntimeError("no model in this benchmark")

    def backend_and_device(self) -> str:
        return "none"

    def memory_bytes(self) -> int:
        return 0


async def time_open(history: History, chat_id: int, runs: int = 5) -> list[float]:
    """Milliseconds from opening a conversation (`Conversations.open`) to the first screen painted,
    `runs` times (each opening the empty chat in between, so every run builds the long one anew)."""
    from ferrum_mac.tui.app import ChatApp

    times = []
    app = ChatApp(NoModel(), history, "none", export_dir=Path(tempfile.gettempdir()))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        for _ in range(runs):
            await app.chat.conversations.open(None)
            await pilot.pause()
            start = time.perf_counter()
            await app.chat.conversations.open(chat_id)
            await pilot.pause()  # the messages were processed and the screen laid out and painted
            times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--long", type=int, default=1000, help="messages in the conversation opened")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        history = History.open(Path(folder) / "history.sqlite3")
        start = time.perf_counter()
        fill(history, args.messages)
        print(f"wrote {args.messages} messages in {time.perf_counter() - start:.1f} s")
        print(f"{'query':<20} {'hits':>5} {'median ms':>10}")
        worst = 0.0
        for query in QUERIES:
            ms, hits = time_search(history, query, args.runs)
            worst = max(worst, ms)
            print(f"{query:<20} {hits:>5} {ms:>10.2f}")
        print(f"search: slowest median {worst:.2f} ms over {args.messages} messages (target < 50 ms)")
        chat_id = fill_long(history, args.long)
        times = asyncio.run(time_open(history, chat_id))
        print(f"open: {', '.join(f'{t:.0f}' for t in times)} ms")
        print(f"open: median {statistics.median(times):.0f} ms for {args.long} messages (target < 300 ms)")
        history.close()


if __name__ == "__main__":
    main()
