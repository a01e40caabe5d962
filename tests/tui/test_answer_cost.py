"""Each answer's footer tells its cost and why it ended; the context meter moves while it streams."""

from __future__ import annotations

import re

from textual.widgets import Static

from ferrum_mac.tui.chat.answers import answer_footer
from ferrum_mac.tui.widgets.message_view import MessageView
from tui_fakes import FakeEngine
from tui_pilot import SIZE, ready, send, wait_for


def footer(app) -> str:
    return str(app.chat.query(MessageView).last().query_one(".footer").render())


async def test_the_footer_shows_tokens_speed_first_token_cache_and_the_stop_reason(make_app, history):
    replies = [
        [("text", "one two three"), ("end", "max_tokens")],
        [("text", "four five"), ("end", "stop", "THE END")],
        [("text", "six"), ("end", "context")],
        [("text", "plain answer")],
    ]
    app = make_app(replies)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a")
        assert footer(app) == "3 tokens · 42.0 tok/s · first token 0.25 s · cut at max tokens"
        await send(pilot, "b")
        assert footer(app).endswith("· stop string 'THE END'")
        await send(pilot, "c")
        assert footer(app).endswith("· context full (Ctrl+N starts afresh; FERRUM_KV_CAPACITY sets its size)")
        await send(pilot, "d")
        assert footer(app) == "2 tokens · 42.0 tok/s · first token 0.25 s"
        # the figures are kept: reopening the conversation shows the same footers
        await app.chat.conversations.open(app.chat.current_id)
        [first] = [v for v in app.chat.query(MessageView) if v.content == "one two three"]
        assert str(first.query_one(".footer").render()).endswith("cut at max tokens")


def test_speculation_and_a_stop_by_the_person_in_the_footer():
    stats = {"generated_tokens": 40, "decode_tps": 80.0, "ttft_s": 0.5, "cached_tokens": 12}
    speculation = {"proposed": 40, "accepted": 30, "steps": 12}
    assert answer_footer({**stats, "speculation": speculation, "stop_reason": "cancelled"}) == (
        "40 tokens · 80.0 tok/s · first token 0.50 s · 12 cached · guessed 40, kept 30 · stopped by you"
    )
    assert answer_footer({**stats, "speculation": None, "stop_reason": "eos"}).endswith("12 cached")
    assert answer_footer({**stats, "stop_reason": "loop"}).endswith("· stopped: it kept repeating itself")


async def test_the_context_meter_moves_while_the_answer_streams(make_app):
    words = " ".join(f"w{i}" for i in range(60))
    app = make_app(engine=FakeEngine([[("text", "first answer")], [("text", words), ("hang",)]], delay=0.02))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        meter = app.chat.query_one("#context", Static)
        before = int(re.search(r" (\d+)/2048", str(meter.render()))[1])
        app.chat.query_one("#prompt").text = "count for me"
        await pilot.press("enter")
        seen = set()
        while not app.engine.hanging.is_set():
            seen.add(int(re.search(r" (\d+)/2048", str(meter.render()))[1]))
            await pilot.pause(0.05)
        moved = seen - {before}
        assert moved and all(used > before for used in moved), seen  # it moved while the answer streamed
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.chat.busy, what="the stop")
