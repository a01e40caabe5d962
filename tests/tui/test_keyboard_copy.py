"""By keyboard alone in few keys (Ctrl+L to the list and back, Ctrl+Up and the arrows through the
messages) and copying from any terminal: OSC 52, the system clipboard command, or a file."""

from __future__ import annotations

import stat

from tui_pilot import SIZE, ready, send, wait_for

CODE_ANSWER = "Try this:\n\n```python\nprint('first')\n```\n\nor:\n\n```sh\necho second\n```"


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def test_ctrl_l_reaches_the_list_and_the_arrows_walk_the_messages(make_app, history):
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        await send(pilot, "first chat")
        await pilot.press("ctrl+n")
        await send(pilot, "second chat")
        first = min(c.id for c in history.conversations())
        await pilot.press("ctrl+l")
        assert app.focused.id == "conversations"
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.chat.current_id == first, what="the other chat")
        await pilot.press("ctrl+l")
        assert app.focused.id == "prompt"

        await pilot.press("ctrl+up")
        assert (app.focused.role, app.focused.content) == ("assistant", "You said: first chat")
        await pilot.press("up")
        assert (app.focused.role, app.focused.content) == ("user", "first chat")
        await pilot.press("down", "down")  # past the last message: the prompt
        assert app.focused.id == "prompt"


async def test_copy_uses_the_system_clipboard_command_where_there_is_one(make_app, tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    pbcopy = tools / "pbcopy"
    pbcopy.write_text(f'#!/bin/sh\ncat > "{tmp_path}/copied.txt"\n')
    pbcopy.chmod(pbcopy.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tools}:/usr/bin:/bin")
    app = make_app([[("text", CODE_ANSWER)]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "code please")
        await pilot.press("ctrl+up", "b")
        await pilot.pause()
        assert (tmp_path / "copied.txt").read_text() == "echo second"
        assert app.clipboard == "echo second"  # and through the terminal (OSC 52)
        assert notices(app)[-1] == "Copied the code block."
        await pilot.press("c")
        await pilot.pause()
        assert (tmp_path / "copied.txt").read_text() == CODE_ANSWER


async def test_without_a_clipboard_command_the_notice_says_where_the_text_is(make_app, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    app = make_app([[("text", CODE_ANSWER)]])
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "code please")
        await pilot.press("ctrl+up", "b")
        await pilot.pause()
        fallback = tmp_path / "clipboard.txt"  # the export folder (make_app: tmp_path)
        assert fallback.read_text() == "echo second" and app.clipboard == "echo second"
        assert "OSC 52" in notices(app)[-1] and str(fallback) in notices(app)[-1]
