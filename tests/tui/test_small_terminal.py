"""The chat app at 80x24 as a new user meets it: the footer's keys, the model picker's errors,
the status bar while an answer streams, and where an export goes."""

from __future__ import annotations

import re
import time

from textual.widgets import Label, Static

from ferrum_mac.errors import FerrumError
from ferrum_mac.store.history import History
from ferrum_mac.tui.app import ChatApp
from tui_fakes import FakeEngine, FakeServices
from tui_pilot import ready, send, wait_for

SMALL = (80, 24)
PULL_ERROR = (
    "no model someone/missing-model on the Hub; check the name (`ferrum list --available` shows aliases)\n"
    "a gated repository needs a login first: `hf auth login`"
)


def visible(widget, width: int = SMALL[0]) -> bool:
    region = widget.region
    return widget.display and region.width > 0 and region.height > 0 and region.right <= width


async def test_footer_shows_help_and_quit_beside_the_palette(make_app):
    from textual.widgets._footer import FooterKey

    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot)
        keys = {key.key: key for key in app.screen.query(FooterKey)}
        assert {"f1", "ctrl+q", "escape", "f4"} <= set(keys), sorted(keys)
        # a loaded machine may lay the footer out a few frames after the engine opened
        await wait_for(pilot, lambda: all(key.region.width for key in keys.values()), what="the footer's layout")
        palette = keys.pop("ctrl+p")
        for key in keys.values():
            assert visible(key) and key.region.right <= palette.region.x, (key.key, key.region, palette.region)
        await pilot.press("f1")
        await pilot.pause()
        assert type(app.screen).__name__ == "HelpScreen"


class FailingPull(FakeServices):
    def pull(self, name, progress):
        raise FerrumError(PULL_ERROR)


async def test_model_picker_shows_the_whole_pull_error(history, tmp_path):
    engine = FakeEngine()
    app = ChatApp(FailingPull(engine), history, engine.name, export_dir=tmp_path)
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot)
        await pilot.press("f4")
        await pilot.pause()
        picker = app.screen
        picker.query_one("#pull-name").value = "someone/missing-model"
        await pilot.click("#pull")
        await wait_for(pilot, lambda: not picker.pulling, what="the failed pull")
        await pilot.pause()
        note = picker.query_one("#pull-note", Label)
        assert " ".join(str(note.render()).split()) == "pull failed: " + " ".join(PULL_ERROR.split())
        assert visible(note) and note.region.height >= 3  # wrapped inside the dialog, not cut off
        assert visible(picker.query_one("#dialog"))


async def test_status_bar_counts_tokens_while_the_answer_streams(make_app):
    words = " ".join(f"w{i}" for i in range(60))
    app = make_app(engine=FakeEngine([[("text", words), ("hang",)]], delay=0.02))
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot)
        screen = app.chat
        speed = screen.query_one("#speed", Static)
        screen.query_one("#prompt").text = "count"
        await pilot.press("enter")
        seen, start = [], time.monotonic()
        while not app.engine.hanging.is_set():
            text = str(speed.render())
            if not seen or seen[-1] != text:
                seen.append(text)
            await pilot.pause(0.05)
        streaming = [t for t in seen if re.fullmatch(r"\d+ tok · \d+\.\d tok/s", t)]
        assert len(streaming) >= 2, seen  # it moved while the answer streamed
        counts = [int(t.split()[0]) for t in streaming]
        assert counts == sorted(counts) and counts[-1] <= 60
        assert len(seen) <= (time.monotonic() - start) / 0.5 + 2, seen  # every half second or so, not every token
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.busy, what="the stop")
        await pilot.pause()
        assert str(speed.render()) == "42.0 tok/s"  # the finished answer's figure


async def test_export_goes_to_the_documents_folder_and_says_where(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_DOCUMENTS_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.chdir(work)
    history = History.open(tmp_path / "history.sqlite3")
    engine = FakeEngine([[("text", "Hi there.")]])
    app = ChatApp(FakeServices(engine), history, engine.name)
    try:
        async with app.run_test(size=SMALL) as pilot:
            await ready(pilot)
            await send(pilot, "hello")
            await pilot.press("f3")
            await pilot.pause()
            exported = list(home.rglob("*.md"))
            assert len(exported) == 1 and "Hi there." in exported[0].read_text()
            assert exported[0].parent.parent == home / "Documents"
            messages = [str(n.message) for n in app._notifications]
            assert any(str(exported[0]) in m for m in messages), messages
    finally:
        history.close()
    assert list(work.iterdir()) == []


async def test_at_80x24_the_prompt_status_and_an_answer_footer_fit(make_app, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a line\n" * 30)
    app = make_app([[("text", "Short answer."), ("end", "max_tokens")]])
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        app.chat.composer.attach_path(str(notes))
        await pilot.pause()
        screen = app.chat
        for part in ("#prompt", "#attachments", "#model", "#speed", "#context", "#memory"):
            assert visible(screen.query_one(part)), part
        footer = screen.query(".footer").last()
        assert visible(footer) and "cut at max tokens" in str(footer.render())
        assert visible(screen.query(".chip").last())


def label_text(screen) -> str:
    """The dialog's question as far as it is inside the dialog (what the screen shows)."""
    label, dialog = screen.query_one("#dialog > Label", Label), screen.query_one("#dialog")
    assert dialog.content_region.contains_region(label.region), (label.region, dialog.content_region)
    return "\n".join(line.text for line in label.render_lines(label.region.reset_offset)).strip()


async def test_dialog_questions_wrap_at_80_columns(make_app, history):
    history.new_conversation("A conversation about lighthouses, their keepers and the lamp oil they burned")
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()
        shown = " ".join(label_text(app.screen).split())
        assert shown == "Attach a text file: its path (Tab completes it; or type @path in the prompt)"
        await pilot.press("escape")
        await pilot.pause()
        app.chat.action_delete_chat()
        await pilot.pause()
        shown = " ".join(label_text(app.screen).split())
        assert shown.endswith("and the lamp oil they burned” and its messages?"), shown


async def test_the_attach_dialog_completes_paths_with_tab(make_app, tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("lamp oil\n")
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    app = make_app()
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press("n", "tab")
        assert app.screen.query_one("#answer").value == "notes.txt"
        await pilot.press("enter")
        await pilot.pause()
        assert app.chat.query_one("#prompt").attachments[0].name == "notes.txt"
