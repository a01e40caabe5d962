"""Fixtures for the chat UI: a history in a temporary folder and an app on a scripted engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from ferrum_mac.store.history import History
from ferrum_mac.tui.app import ChatApp
from tui_fakes import FakeEngine, FakeServices

SIZE = (100, 30)


@pytest.fixture
def history(tmp_path):
    h = History.open(tmp_path / "history.sqlite3")
    yield h
    h.close()


@pytest.fixture
def make_app(history, tmp_path):
    def make(replies=(), capacity: int = 2048, settings: dict | None = None, engine: FakeEngine | None = None):
        engine = engine or FakeEngine(replies, capacity=capacity)
        return ChatApp(FakeServices(engine), history, engine.name, settings, export_dir=tmp_path)

    return make


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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests here on asyncio (no pytest-asyncio needed)."""
    if asyncio.iscoroutinefunction(pyfuncitem.obj):
        names = pyfuncitem._fixtureinfo.argnames
        asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
        return True
    return None
