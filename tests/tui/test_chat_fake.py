"""The chat app on a scripted engine: streaming, stop, errors, edits, conversations, modals."""

from __future__ import annotations

from tui_pilot import SIZE, ready, send, wait_for
from ferrum_mac.tui.widgets.message_view import MessageView
from ferrum_mac.tui.widgets.notice_line import NoticeLine


def texts(app) -> list[tuple[str, str]]:
    return [(v.role, v.content) for v in app.chat.query(MessageView)]


def stored(history, chat_id=None) -> list[tuple[str, str]]:
    chat_id = chat_id or history.conversations()[0].id
    return [(m.role, m.content) for m in history.messages(chat_id)]


async def test_answer_streams_and_is_saved(make_app, history):
    app = make_app([[("text", "Paris is the **capital** of France.")]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.chat.query("#welcome")
        await send(pilot, "What is the capital of France?")
        assert texts(app) == [
            ("user", "What is the capital of France?"),
            ("assistant", "Paris is the **capital** of France."),
        ]
        assert not app.chat.query("#welcome")
        chat = history.conversations()[0]
        assert chat.title == "What is the capital of France?"
        answer = history.messages(chat.id)[-1]
        assert answer.stats["decode_tps"] == 42.0 and answer.stats["context_used"] == 26
        status = app.chat.query_one("#status")
        assert "42.0 tok/s" in str(status.query_one("#speed").render())
        assert "26/2048" in str(status.query_one("#context").render())
        assert "fake · cpu" in str(status.query_one("#device").render())


async def test_stop_keeps_the_partial_answer_and_keys_stay_live(make_app, history):
    app = make_app([[("text", "Counting: one two"), ("hang",)]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = app.chat
        screen.query_one("#prompt").text = "count"
        await pilot.press("enter")
        engine = app.engine
        await wait_for(pilot, engine.hanging.is_set, what="the hang")
        await wait_for(pilot, lambda: "two" in screen.answer.content, what="the partial text")
        await pilot.press("h", "i")  # typing while the model "generates"
        assert screen.query_one("#prompt").text == "hi"
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.busy, what="the stop")
        assert stored(history) == [("user", "count"), ("assistant", "Counting: one two")]
        assert history.messages(history.conversations()[0].id)[-1].stats["stop_reason"] == "cancelled"
        assert "stopped" in str(screen.query(MessageView).last().query_one(".footer").render())


async def test_a_failing_turn_shows_the_error_and_loses_nothing(make_app, history):
    app = make_app([[("text", "Half an"), ("fail", "the model fell over")], [("text", "Recovered.")]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        errors = [n for n in app.chat.query(NoticeLine) if n.has_class("error")]
        assert len(errors) == 1 and "the model fell over" in str(errors[0].render())
        assert stored(history) == [("user", "first"), ("assistant", "Half an"), ("error", "error: the model fell over")]
        await send(pilot, "again")
        assert stored(history)[-2:] == [("user", "again"), ("assistant", "Recovered.")]
        # the engine saw the saved turns (not the error line) before the new message
        assert app.engine.turns[-1]["history"] == [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "Half an"},
        ]


async def test_enter_sends_and_shift_enter_or_ctrl_j_insert_a_newline(make_app, history):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.chat.query_one("#prompt")
        prompt.focus()
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        assert prompt.text == "a\nb\nc"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.busy and len(history.conversations()) == 1)
        assert stored(history)[0] == ("user", "a\nb\nc")
        assert prompt.text == ""


async def test_regenerate_and_edit_resend_replace_later_messages(make_app, history):
    app = make_app([[("text", "A1")], [("text", "A2")], [("text", "A2 again")], [("text", "B1")]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "Q1")
        await send(pilot, "Q2")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not app.chat.busy and stored(history)[-1] == ("assistant", "A2 again"))
        assert stored(history) == [("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2 again")]
        assert app.engine.turns[-1]["history"] == app.engine.turns[1]["history"]  # the same prompt again
        first = app.chat.query(MessageView).first()
        first.focus()
        await pilot.press("e")
        prompt = app.chat.query_one("#prompt")
        assert prompt.text == "Q1" and app.chat.query_one("#editing").display
        prompt.text = "Q1 edited"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.busy and stored(history)[-1] == ("assistant", "B1"))
        assert stored(history) == [("user", "Q1 edited"), ("assistant", "B1")]
        assert texts(app) == [("user", "Q1 edited"), ("assistant", "B1")]
        assert app.engine.turns[-1]["history"] == []  # the engine truncates its cache to the common prefix


async def test_reasoning_is_collapsible_and_notices_show(make_app, history):
    from textual.widgets import Collapsible

    reply = [
        ("notice", "dropped the 1 oldest turn to fit the 2048-token context"),
        ("reasoning", "The user greets me."),
        ("text", "Hello!"),
    ]
    app = make_app([reply])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        view = app.chat.query(MessageView).last()
        box = view.query_one(Collapsible)
        assert box.display and box.collapsed and view.reasoning == "The user greets me."
        await pilot.press("ctrl+t")
        assert not box.collapsed
        notices = list(app.chat.query(NoticeLine))
        assert "dropped the 1 oldest turn" in str(notices[0].render())
        assert [r for r, _ in stored(history)] == ["user", "notice", "assistant"]
        assert history.messages(history.conversations()[0].id)[-1].reasoning == "The user greets me."


async def test_conversations_new_switch_search_rename_delete(make_app, history):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "about cats")
        await pilot.press("ctrl+n")
        await send(pilot, "about dogs")
        cats, dogs = sorted(history.conversations(), key=lambda c: c.id)
        assert app.chat.current_id == dogs.id and app.resident.is_resident(cats.id)
        sidebar = app.chat.query_one("#conversations")
        assert len(sidebar.children) == 2
        app.chat.query_one("#search").focus()  # the sidebar's filter
        await pilot.press(*"cats")
        await wait_for(pilot, lambda: len(sidebar.children) == 1)
        sidebar.focus()
        sidebar.index = 0
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.current_id == cats.id)
        assert texts(app)[0] == ("user", "about cats")
        await send(pilot, "more cats")
        assert app.engine.turns[-1]["cached"] > 0  # the resident conversation kept its cache
        await pilot.press("f2")
        await pilot.pause()
        app.screen.query_one("Input").value = "Cats"
        await pilot.press("enter")
        await wait_for(pilot, lambda: history.conversation(cats.id).title == "Cats")
        sidebar.focus()
        await pilot.press("delete")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, lambda: len(history.conversations("")) == 1)
        assert history.conversations()[0].id == dogs.id


async def test_settings_modal_changes_the_next_turn(make_app, history):
    from textual.widgets import Input, Select

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.press("ctrl+s")
        await pilot.pause()
        modal = app.screen
        modal.query_one("#system").text = "Be terse."
        modal.query_one("#temperature", Input).value = "0.5"
        modal.query_one("#max_tokens", Input).value = "7"
        modal.query_one("#context_policy", Select).value = "error"
        await pilot.press("ctrl+s")
        await pilot.pause()
        chat = history.conversations()[0]
        assert chat.settings == {"system": "Be terse.", "temperature": 0.5, "max_tokens": 7, "context_policy": "error"}
        await send(pilot, "again")
        settings = app.engine.turns[-1]["settings"]
        assert (settings.system, settings.max_tokens, settings.sampling.temperature) == ("Be terse.", 7, 0.5)


async def test_settings_modal_shows_the_defaults_in_force(make_app, history):
    from textual.widgets import Input

    from tui_fakes import FakeEngine

    engine = FakeEngine()
    engine.default_sampling = engine.default_sampling.replace(temperature=0.2, top_p=0.9)
    app = make_app(engine=engine)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+s")
        await pilot.pause()
        fields = {name: app.screen.query_one(f"#{name}", Input) for name in ("temperature", "top_p", "max_tokens")}
        assert {name: field.placeholder for name, field in fields.items()} == {
            "temperature": "default: 0.2",
            "top_p": "default: 0.9",
            "max_tokens": "default: no limit",  # the fake engine sets none
        }
        assert all(field.value == "" for field in fields.values())  # nothing stored: the defaults apply


async def test_export_writes_markdown(make_app, history, tmp_path):
    app = make_app([[("text", "```python\nprint('hi')\n```")]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "code please")
        await pilot.press("f3")
        await pilot.pause()
        text = (tmp_path / "code-please.md").read_text()
        assert "# code please" in text and "## You" in text and "print('hi')" in text
        assert app.chat.query("CodeFence")


async def test_model_picker_pulls_with_progress_and_switches(make_app, history):
    from textual.widgets import Input, OptionList

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await pilot.pause()
        picker = app.screen
        assert picker.query_one(OptionList).option_count == 2
        picker.query_one("#pull-name", Input).value = "smollm2:360m"
        await pilot.click("#pull")
        await wait_for(pilot, lambda: app.services.pulled == ["smollm2:360m"] and not picker.pulling)
        options = picker.query_one(OptionList)
        assert options.option_count == 3
        options.focus()
        options.highlighted = 2
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.services.opened_names[-1] == "smollm2:360m" and app.engine is not None)
        assert app.model_name == "smollm2:360m"


async def test_line_breaks_in_an_answer_stay(make_app, history):
    poem = "Roses are red,\nviolets are blue,\nsugar is sweet."
    app = make_app([[("text", poem)]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a poem please")
        await pilot.pause()
        paragraph = app.chat.query(MessageView).last().query_one("MarkdownParagraph")
        assert paragraph.size.height == 3  # a line each, not one reflowed line
        assert str(paragraph.render()).splitlines() == poem.splitlines()


async def test_open_shows_the_conversation_asked_for(history, tmp_path):
    from ferrum_mac.tui.app import ChatApp
    from tui_fakes import FakeEngine, FakeServices

    older = history.new_conversation("lighthouses")
    history.add_message(older.id, "user", "the lighthouse keeper")
    newer = history.new_conversation("newer")
    history.add_message(newer.id, "user", "something else")
    engine = FakeEngine()
    app = ChatApp(FakeServices(engine), history, engine.name, export_dir=tmp_path, open_id=older.id)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.chat.current_id == older.id
        assert texts(app) == [("user", "the lighthouse keeper")]
