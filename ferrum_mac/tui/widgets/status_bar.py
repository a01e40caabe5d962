"""The bottom line: model, backend and device, tok/s of the last answer, context, memory."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from ferrum_mac.tui.widgets.context_meter import ContextMeter


class StatusBar(Horizontal):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $text-muted; }
    StatusBar > Static { width: auto; padding: 0 1; }
    StatusBar > #model { color: $text; text-style: bold; }
    StatusBar > #spacer { width: 1fr; }
    """

    def compose(self) -> ComposeResult:
        yield Static(id="model", markup=False)
        yield Static(id="device", markup=False)
        yield Static(id="speed")
        yield Static(id="spacer")
        yield ContextMeter(id="context")
        yield Static(id="memory")

    def show_model(self, model: str, device: str) -> None:
        self.query_one("#model", Static).update(short_name(model))
        self.query_one("#device", Static).update(device)

    def show_speed(self, tokens_per_second: float | None) -> None:
        text = f"{tokens_per_second:.1f} tok/s" if tokens_per_second else "– tok/s"
        self.query_one("#speed", Static).update(text)

    def show_streaming(self, tokens: int, tokens_per_second: float) -> None:
        rate = f"{tokens_per_second:.1f} tok/s" if tokens_per_second else "– tok/s"
        self.query_one("#speed", Static).update(f"{tokens} tok · {rate}")

    def show_context(self, used: int, capacity: int, pending: int = 0) -> None:
        self.query_one(ContextMeter).show(used, capacity, pending)

    def show_memory(self, text: str) -> None:
        self.query_one("#memory", Static).update(f"mem {text}")


def short_name(model: str) -> str:
    """A model named by its path shows as the file or folder name."""
    return model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] if model.startswith(("/", "~", ".")) else model
