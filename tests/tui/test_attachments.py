"""Files and large pastes ride along with a message: a chip above the prompt with its cost, the
text sent after what was typed and kept in the history; binary, huge or too-long files refused."""

from __future__ import annotations

from textual import events

from ferrum_mac.tui.attachments import MAX_BYTES, Attachment, message_text
from ferrum_mac.tui.widgets.message_view import MessageView
from tui_pilot import SIZE, ready, wait_for

NOTES = "".join(f"note {i}: the lighthouse lamp needs oil\n" for i in range(30))


def chips(app, where: str = "#attachments") -> list[str]:
    return [str(label.render()) for label in app.chat.query_one(where).query(".chip")]


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def attach(pilot, path: str) -> None:
    await pilot.press("ctrl+o")
    await pilot.pause()
    pilot.app.screen.query_one("Input").value = path
    await pilot.press("enter")
    await pilot.pause()


async def test_an_attached_file_is_a_chip_is_counted_sent_and_kept(make_app, history, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text(NOTES)
    monkeypatch.chdir(tmp_path)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await attach(pilot, "notes.txt")
        cost = -(-len(Attachment("notes.txt", NOTES).block()) // 4)  # the fake engine has no tokenizer
        assert chips(app) == [f"📎 notes.txt · 30 lines · {cost} tok"]
        assert f"0+{cost}/2048" in str(app.chat.query_one("#context").render())

        app.chat.query_one("#prompt").text = "What does the lamp need?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 1 and not app.chat.busy, what="the answer")
        await pilot.pause()
        sent = message_text("What does the lamp need?", [Attachment("notes.txt", NOTES)])
        assert app.engine.turns[0]["text"] == sent and "note 29: the lighthouse" in sent
        [user, _] = history.messages(app.chat.current_id)
        assert user.content == sent and user.stats == {"attachments": [{"name": "notes.txt", "lines": 30}]}
        assert chips(app) == [] and not app.chat.query_one("#attachments").display
        assert history.conversations()[0].title == "What does the lamp need?"

        view = app.chat.query(MessageView).first()
        assert str(view.query_one(".chip").render()) == "📎 notes.txt · 30 lines"
        assert "note 29" not in " ".join(str(b.render()) for b in view.query("MarkdownParagraph"))
        assert user.id in [h.message_id for h in history.search("lamp oil")]  # the attachment is searchable

        view.focus()  # editing brings the attachment back as a chip
        await pilot.press("e")
        await pilot.pause()
        assert app.chat.query_one("#prompt").text == "What does the lamp need?"
        assert chips(app) == [f"📎 notes.txt · 30 lines · {cost} tok"]


async def test_binary_huge_missing_and_too_long_files_are_refused(make_app, tmp_path, monkeypatch):
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    (tmp_path / "huge.txt").write_text("x" * (MAX_BYTES + 1))
    (tmp_path / "long.txt").write_text("word " * 200)  # ~250 tokens by the estimate, past a 120-token context
    monkeypatch.chdir(tmp_path)
    app = make_app(capacity=120)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await attach(pilot, "image.png")
        await attach(pilot, "huge.txt")
        await attach(pilot, "missing.txt")
        await attach(pilot, str(tmp_path))
        assert chips(app) == []
        said = notices(app)
        assert any("cannot attach image.png: a binary file" in m for m in said), said
        assert any("cannot attach huge.txt: 256 KiB, more than the 256 KiB allowed" in m for m in said), said
        assert any("cannot attach missing.txt: no such file" in m for m in said), said
        assert any("not a file" in m for m in said), said

        app.chat.query_one("#prompt").text = "read @long.txt please"
        await pilot.press("enter")
        await pilot.pause()
        assert app.engine.turns == [] and any("the context holds 120: attach less" in m for m in notices(app))
        assert app.chat.query_one("#prompt").text == "read @long.txt please"  # nothing lost

        app.chat.query_one("#prompt").text = "mail me@example.com or @nobody"  # not files: plain text
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 1 and not app.chat.busy, what="the answer")
        assert app.engine.turns[0]["text"] == "mail me@example.com or @nobody"


async def test_a_large_paste_collapses_to_a_chip_and_at_paths_complete(make_app, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text(NOTES)
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.chat.query_one("#prompt")
        prompt.focus()
        app.post_message(events.Paste("one\ntwo\nthree"))
        await pilot.pause()
        assert prompt.text == "one\ntwo\nthree" and chips(app) == []
        prompt.text = ""
        app.post_message(events.Paste("\n".join(f"log line {i}" for i in range(25))))
        await pilot.pause()
        assert prompt.text == "" and chips(app)[0].startswith("📎 pasted text 1 · 25 lines · ")

        await pilot.press("backspace")  # in an empty prompt: drops the last chip
        await pilot.pause()
        assert chips(app) == []

        app.post_message(events.Paste("\r".join(f"tmux line {i}" for i in range(25))))  # CR line ends
        await pilot.pause()
        assert prompt.text == "" and chips(app)[0].startswith("📎 pasted text 2 · 25 lines · ")
        assert prompt.attachments[0].text.split("\n") == [f"tmux line {i}" for i in range(25)]
        await pilot.press("backspace")
        await pilot.pause()

        await pilot.press(*"see @no", "tab")
        assert prompt.text == "see @notes.txt"
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.engine.turns) == 1 and not app.chat.busy, what="the answer")
        assert app.engine.turns[0]["text"] == message_text("see @notes.txt", [Attachment("notes.txt", NOTES)])
        await pilot.press(*"@d", "tab")
        assert prompt.text == "@docs/"
