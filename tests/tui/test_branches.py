"""Regenerate and edit keep the old path as a branch: "‹ 2/2 ›" on the message, the arrows on a
focused message switch, and the next turn sends the path shown."""

from __future__ import annotations

from ferrum_mac.tui.widgets.message_view import MessageView
from tui_pilot import SIZE, ready, send, wait_for


def shown(app) -> list[tuple[str, str]]:
    return [(v.content, str(v.query_one(".role").render())) for v in app.chat.query(MessageView)]


async def test_regenerate_and_edit_make_branches_and_the_arrows_switch(make_app, history):
    replies = [[("text", "A1")], [("text", "A2")], [("text", "A2 again")], [("text", "A3")], [("text", "B1")]]
    app = make_app(replies)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Q1")
        await send(pilot, "Q2")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.chat.busy and app.chat.query(MessageView).last().content == "A2 again")
        await pilot.pause()
        assert shown(app)[-1] == ("A2 again", "Assistant  ‹ 2/2 ›")
        assert shown(app)[-2] == ("Q2", "You")

        app.chat.query(MessageView).last().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.chat.query(MessageView).last().content == "A2")
        assert shown(app)[-1] == ("A2", "Assistant  ‹ 1/2 ›")
        assert app.focused.content == "A2"  # the focus stays on the switched message
        await send(pilot, "Q3")
        # the engine was sent the branch shown, not the newer answer
        assert app.engine.turns[-1]["history"][-1] == {"role": "assistant", "content": "A2"}

        app.chat.query(MessageView).first().focus()
        await pilot.press("e")
        app.chat.query_one("#prompt").text = "Q1 edited"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.busy and app.chat.query(MessageView).last().content == "B1")
        assert shown(app) == [("Q1 edited", "You  ‹ 2/2 ›"), ("B1", "Assistant")]
        assert app.engine.turns[-1]["history"] == []

        app.chat.query(MessageView).first().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: len(app.chat.query(MessageView)) == 6)
        assert [c for c, _ in shown(app)] == ["Q1", "A1", "Q2", "A2", "Q3", "A3"]  # where the person last was
        await pilot.press("left")  # no branch before the first: nothing changes
        await pilot.pause()
        assert len(app.chat.query(MessageView)) == 6
        chat = history.conversations()[0]
        assert len(history.db.execute("SELECT id FROM messages WHERE conversation_id = ?", (chat.id,)).fetchall()) == 9
