"""SVG snapshots of the main states, on the scripted engine at a fixed size (no clock, fixed figures).

Update them after an intended change of the look: pytest tests/tui/test_snapshots.py --snapshot-update
"""

from __future__ import annotations

import time

from ferrum_mac.tui.widgets.status_bar import StatusBar
from tui_pilot import SIZE, ready, send, wait_for

ANSWER = """Here is a tiny **Python** function:

```python
def greet(name: str) -> str:
    return f"Hello, {name}!"
```

Call it with `greet("Ada")`."""


def still(pilot) -> None:
    """No blinking cursor in a snapshot: nothing has the focus."""
    for area in pilot.app.screen.query("TextArea, Input"):
        area.cursor_blink = False
    pilot.app.screen.set_focus(None)


async def settle(pilot, timeout: float = 10.0) -> None:
    """Until the screen stops changing: a fixed pause is too short on a loaded machine (a
    chip or a markdown block still being laid out when the snapshot is taken)."""
    still(pilot)
    await pilot.pause(0.3)
    await pilot.wait_for_scheduled_animations()
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        shot = pilot.app.export_screenshot()
        if shot == last:
            return
        last = shot
        await pilot.pause(0.2)


def test_empty(snap_compare, make_app):
    async def before(pilot):
        await ready(pilot)
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def test_streaming(snap_compare, make_app):
    app = make_app([[("text", ANSWER), ("hang",)]])

    async def before(pilot):
        await ready(pilot)
        pilot.app.chat.query_one("#prompt").text = "Write a greeting function"
        await pilot.press("enter")
        await wait_for(pilot, app.engine.hanging.is_set)
        await wait_for(pilot, lambda: "Ada" in app.chat.answer.content)
        await settle(pilot)
        # The live figures come from the clock; fixed ones keep the snapshot stable.
        app.chat.query_one(StatusBar).show_streaming(21, 42.0)
        app.chat.query_one(StatusBar).show_context(28, 2048)
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=before)


def test_reasoning_expanded(snap_compare, make_app):
    reply = [("reasoning", "The user says hello, so I greet them back briefly."), ("text", "Hello! How can I help?")]

    async def before(pilot):
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.press("ctrl+t")
        await settle(pilot)

    assert snap_compare(make_app([reply]), terminal_size=SIZE, run_before=before)


def test_settings_modal(snap_compare, make_app):
    async def before(pilot):
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.press("ctrl+s")
        await settle(pilot)

    assert snap_compare(make_app(settings={"max_tokens": 256}), terminal_size=SIZE, run_before=before)


def test_context_warning(snap_compare, make_app):
    async def before(pilot):
        await ready(pilot)
        await send(pilot, "fill the context")
        await settle(pilot)

    assert snap_compare(make_app(capacity=30), terminal_size=SIZE, run_before=before)


def test_model_picker(snap_compare, make_app):
    async def before(pilot):
        await ready(pilot)
        await pilot.press("f4")
        await settle(pilot)

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def test_search_results(snap_compare, make_app):
    replies = [[("text", "A **lighthouse** keeps ships off the rocks at night.")], [("text", "Cats nap all day.")]]

    async def before(pilot):
        await ready(pilot)
        await send(pilot, "What does a lighthouse do?")
        await pilot.press("ctrl+n")
        await send(pilot, "What do cats do?")
        await pilot.press("ctrl+f")
        await pilot.pause()
        await pilot.press(*"lighthouse")
        await settle(pilot)

    assert snap_compare(make_app(replies), terminal_size=SIZE, run_before=before)


def test_message_with_siblings(snap_compare, make_app):
    replies = [[("text", "Hello! How can I help?")], [("text", "Hi there. What shall we talk about?")]]

    async def before(pilot):
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not pilot.app.chat.busy and len(pilot.app.engine.turns) == 2)
        await settle(pilot)

    assert snap_compare(make_app(replies), terminal_size=SIZE, run_before=before)


def test_answer_footer(snap_compare, make_app):
    reply = [("text", "Once upon a time there was a lighthouse keeper who"), ("end", "max_tokens")]

    async def before(pilot):
        await ready(pilot)
        await send(pilot, "Tell me a story")
        await settle(pilot)

    assert snap_compare(make_app([reply]), terminal_size=SIZE, run_before=before)


def test_file_chips(snap_compare, make_app, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("".join(f"line {i}\n" for i in range(12)))

    async def before(pilot):
        await ready(pilot)
        prompt = pilot.app.chat.query_one("#prompt")
        pilot.app.chat.composer.attach_path(str(notes))
        await send(pilot, "Summarise my notes")
        pilot.app.chat.composer.attach_path(str(notes))
        prompt.text = "And again"
        await settle(pilot)

    # a short answer: the conversation fits, so no scroll position (which the chips' row can
    # move) decides what the snapshot holds
    assert snap_compare(make_app([[("text", "Read them.")]]), terminal_size=SIZE, run_before=before)
