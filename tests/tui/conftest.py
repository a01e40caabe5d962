"""Fixtures for the chat UI: a history in a temporary folder and an app on a scripted engine."""

from __future__ import annotations

import asyncio
import pytest

from ferrum_mac.store.history import History
from ferrum_mac.tui.app import ChatApp
from tui_fakes import FakeEngine, FakeServices
from tui_pilot import SIZE, ready, send, wait_for  # noqa: F401  (fixtures and tests share them)


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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests here on asyncio (no pytest-asyncio needed)."""
    if asyncio.iscoroutinefunction(pyfuncitem.obj):
        names = pyfuncitem._fixtureinfo.argnames
        asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
        return True
    return None
