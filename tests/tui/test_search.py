"""Ctrl+F searches every conversation; Enter on a result opens its conversation at that message."""

from __future__ import annotations

from textual.widgets import OptionList

from tui_pilot import SIZE, ready, send, wait_for


async def test_search_screen_finds_and_opens_the_conversation_at_the_message(make_app, history):
    app = make_app([[("text", "Penguins live in the south.")], [("text", "Owls hunt at night.")]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Where do penguins live?")
        await pilot.press("ctrl+n")
        await send(pilot, "When do owls hunt?")
        penguins = min(c.id for c in history.conversations())
        assert app.chat.current_id != penguins

        await pilot.press("ctrl+f")
        await pilot.pause()
        screen = app.screen
        assert type(screen).__name__ == "SearchScreen"
        await pilot.press(*"penguin")
        results = screen.query_one(OptionList)
        await wait_for(pilot, lambda: results.option_count == 2, what="two hits")
        assert [h.role for h in screen.hits] == ["assistant", "user"]
        assert "2 found" in str(screen.query_one("#count").render())
        await pilot.press("down", "enter")  # the second hit: the question
        await wait_for(pilot, lambda: app.chat.current_id == penguins, what="the conversation")
        await pilot.pause()
        focused = app.focused
        assert focused.role == "user" and focused.content == "Where do penguins live?"

        await pilot.press("ctrl+f")
        await pilot.pause()
        await pilot.press(*"walrus")
        await wait_for(pilot, lambda: "nothing found" in str(app.screen.query_one("#count").render()))
        await pilot.press("escape")
        assert app.chat.current_id == penguins
