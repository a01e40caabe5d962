"""The chat app on the bundled demo model: a notice says it is small and that F4 pulls a model
sized to this machine, and the picker's pull field holds that model."""

from __future__ import annotations

from textual.widgets import Input

from ferrum_mac.tui.app import ChatApp
from tui_fakes import FakeEngine, FakeServices
from tui_pilot import SIZE, ready, wait_for

GB = 10**9


class DemoServices(FakeServices):
    def __init__(self, engine, models, memory: int = 16 * GB):
        super().__init__(engine, models)
        self.memory = memory

    def machine_memory_bytes(self) -> int:
        return self.memory


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def test_demo_model_notice_and_the_picker_pulls_the_recommendation(history, tmp_path):
    engine = FakeEngine(name="smollm2:135m")
    app = ChatApp(DemoServices(engine, ("smollm2:135m",)), history, "smollm2:135m", export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await wait_for(pilot, lambda: notices(app), what="the demo notice")
        (line,) = notices(app)
        assert line.startswith("smollm2:135m is a small demo model (135M parameters)")
        assert "qwen3:8b" in line and "16.0 GB" in line and "F4 pulls it" in line
        await pilot.press("f4")
        await pilot.pause()
        field = app.screen.query_one("#pull-name", Input)
        assert field.value == "qwen3:8b"
        field.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.services.pulled == ["qwen3:8b"], what="the pull")


async def test_no_demo_notice_once_another_model_is_here(history, tmp_path):
    engine = FakeEngine(name="smollm2:135m")
    app = ChatApp(DemoServices(engine, ("smollm2:135m", "qwen3:4b")), history, "smollm2:135m", export_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.pause(0.2)
        assert notices(app) == []
        await pilot.press("f4")
        await pilot.pause()
        assert app.screen.query_one("#pull-name", Input).value == "qwen3:8b"  # still the machine's fit
