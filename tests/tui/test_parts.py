"""The pieces under the screens: batching of streamed text, the resident-conversation LRU, palette and help."""

from __future__ import annotations

import threading
import time

from tui_pilot import SIZE, ready
from ferrum_mac.tui.chat_turn import run_turn
from ferrum_mac.tui.messages import AnswerChunk, AnswerDone
from ferrum_mac.tui.resident import ResidentConversations
from tui_fakes import FakeEngine


def test_streamed_text_is_posted_in_batches_of_at_most_20_a_second():
    words = " ".join(f"w{i}" for i in range(300))
    engine = FakeEngine([[("text", words)]], delay=0.002)  # ~500 pieces a second
    posted = []
    start = time.monotonic()
    run_turn(engine.conversation(), [], "go", threading.Event(), posted.append)
    seconds = time.monotonic() - start
    chunks = [m for m in posted if isinstance(m, AnswerChunk)]
    assert "".join(c.text for c in chunks) == words
    assert isinstance(posted[-1], AnswerDone)
    assert len(chunks) <= seconds * 20 + 2, (len(chunks), seconds)
    assert len(chunks) < 300 / 5  # far fewer updates than tokens


def test_resident_conversations_release_the_least_recent_past_the_limits():
    engine = FakeEngine()
    resident = ResidentConversations(engine, max_resident=2, token_budget=100)
    settings = engine.settings()
    a, b = resident.get(1, settings), resident.get(2, settings)
    assert resident.get(1, settings) is a  # resident: the same conversation, cache and all
    resident.get(3, settings)
    assert not resident.is_resident(2) and b.closed and resident.is_resident(1)
    resident.get(1, settings).ledger = list(range(90))
    resident.get(3, settings).ledger = list(range(20))  # 110 tokens in all: over the budget
    resident.get(3, settings)
    assert not resident.is_resident(1) and a.closed and resident.is_resident(3)


async def test_palette_entries_and_help(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {
            "New conversation",
            "Conversation settings",
            "Choose model",
            "Export to Markdown",
            "Regenerate answer",
            "Stop answer",
            "Toggle reasoning",
            "Key bindings",
            "Theme",
        } <= titles
        await pilot.press("f1")
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        await pilot.pause()
        assert type(app.screen).__name__ == "ChatScreen"


def test_an_answers_stats_line_shows_its_cached_prompt_tokens():
    from ferrum_mac.tui.chat.answers import answer_footer

    stats = {"decode_tps": 31.25, "generated_tokens": 40, "cached_tokens": 512, "stop_reason": "eos"}
    assert answer_footer(stats) == "40 tokens · 31.2 tok/s · 512 cached"
    assert "cached" not in answer_footer({**stats, "cached_tokens": 0})


def test_a_released_chat_finds_its_history_in_the_prefix_cache(shared_assets):
    from ferrum_mac.engine import Engine

    engine = Engine.open(shared_assets / "stories260K")
    resident = ResidentConversations(engine, max_resident=1)
    settings = engine.settings(max_tokens=8, sampling=engine.default_sampling.replace(temperature=0.0))

    def answer(chat: int, history: list[dict], text: str) -> AnswerDone:
        posted = []
        run_turn(resident.get(chat, settings), history, text, threading.Event(), posted.append)
        assert isinstance(posted[-1], AnswerDone), posted[-1]
        return posted[-1]

    first = answer(1, [], "Tell me a story.")
    history = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": first.content}]
    answer(2, [], "Once upon a time")  # switching to another chat releases the first (one resident)
    assert not resident.is_resident(1)
    back = answer(1, history, "And then?")
    # its history was computed before: only what follows the cached part is prefilled
    assert back.stats["cached_tokens"] >= first.context_used - 1
