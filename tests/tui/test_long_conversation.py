"""A long conversation mounts only what fills the screen; the rest comes a window at a time (the
"▲ N earlier messages" line: scrolling to the top, the arrows, a click), and a search hit far back opens
a window around it."""

from __future__ import annotations

from ferrum_mac.tui.widgets.message_list import WINDOW, MessageList
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.more_messages import MoreMessages
from tui_pilot import SIZE, ready, send, wait_for

MESSAGES = 100


def fill(history) -> int:
    chat = history.new_conversation("long")
    for i in range(MESSAGES):
        history.add_message(chat.id, "user" if i % 2 == 0 else "assistant", f"message {i}")
    return chat.id


def contents(app) -> list[str]:
    return [v.content for v in app.chat.query(MessageView)]


async def test_only_the_last_screenful_is_mounted_and_more_come_on_demand(make_app, history):
    fill(history)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        shown = contents(app)
        assert 2 <= len(shown) < 20 and shown[-1] == f"message {MESSAGES - 1}"
        first = int(shown[0].split()[1])
        more = app.chat.query_one(MoreMessages)
        assert str(more.render()).startswith(f"▲ {first} earlier messages")

        app.chat.query_one(MessageList).scroll_home(animate=False)  # scrolled to the top: the next window
        await wait_for(pilot, lambda: contents(app)[0] == f"message {first - WINDOW}", what="the next window")
        assert len(contents(app)) == len(shown) + WINDOW
        # the view stays where it was (on the message that was first), so no second window comes
        await wait_for(pilot, lambda: app.chat.query_one(MessageList).scroll_y > 0, what="the view kept")
        await pilot.pause(0.2)
        assert contents(app)[0] == f"message {first - WINDOW}"

        app.chat.query(MessageView).first().focus()
        await pilot.press("up")  # the arrows walk past the first shown: one more window
        await wait_for(pilot, lambda: app.focused.content == f"message {first - WINDOW - 1}", what="the walk up")


async def test_two_loads_at_once_mount_one_window_under_one_marker(make_app, history):
    import asyncio

    fill(history)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        shown = app.chat.query_one(MessageList)
        first = shown.first
        await asyncio.gather(shown.load_more(earlier=True), shown.load_more(earlier=True))  # a click while scrolling up
        await pilot.pause()
        markers = [i for i, w in enumerate(shown.children) if isinstance(w, MoreMessages)]
        assert markers == [0]
        assert contents(app) == [f"message {i}" for i in range(first - WINDOW, MESSAGES)]


async def test_a_search_hit_far_back_opens_around_it_and_a_new_turn_goes_at_the_end(make_app, history):
    chat_id = fill(history)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+f")
        await pilot.pause()
        app.screen.query_one("#query").value = "message 10"
        await wait_for(pilot, lambda: app.screen.hits, what="the hits")
        hits = app.screen.hits
        index = [h.message_id for h in hits].index(history.messages(chat_id)[10].id)
        app.screen.query_one("OptionList").highlighted = index
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.focused is not None and app.focused.content == "message 10", what="the hit")
        assert contents(app)[0] == "message 7" and len(contents(app)) == WINDOW
        later = [m for m in app.chat.query(MoreMessages) if not m.earlier]
        assert str(later[0].render()).startswith(f"▼ {MESSAGES - 7 - WINDOW} later messages")

        await send(pilot, "a new question")
        assert contents(app)[-2:] == ["a new question", "You said: a new question"]
        assert f"message {MESSAGES - 1}" in contents(app) and "message 10" not in contents(app)
