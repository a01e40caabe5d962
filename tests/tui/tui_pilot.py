"""Pilot helpers shared by the chat UI tests (a module of its own: `from conftest import`
breaks when several test folders each have a conftest)."""

from __future__ import annotations

import time

SIZE = (100, 30)


async def wait_for(pilot, condition, timeout: float = 10.0, what: str = "the condition") -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


async def ready(pilot) -> None:
    """The engine is open (it opens in a worker thread)."""
    await wait_for(pilot, lambda: pilot.app.engine is not None, what="the engine")
    await pilot.pause()


async def send(pilot, text: str, timeout: float = 10.0) -> None:
    """Type `text` into the prompt and press Enter; return once the answer ended."""
    screen = pilot.app.chat
    screen.query_one("#prompt").focus()
    screen.query_one("#prompt").text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: not screen.busy, timeout, what="the answer")
    await pilot.pause()
