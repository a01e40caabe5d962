"""A conversation's settings: system prompt, temperature, top-p, max tokens, thinking, context policy.

Dismissed with the new stored-settings dict (see chat_settings.py), or None when cancelled.
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, TextArea

from ferrum_mac.engine import CONTEXT_POLICIES
from ferrum_mac.tui.chat_settings import stored_settings

THINKING = [("model default", "default"), ("on", "on"), ("off", "off")]
THINK_VALUES = {"default": None, "on": True, "off": False}


class SettingsScreen(ModalScreen[dict | None]):
    CSS_PATH = "settings_screen.tcss"
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, title: str, settings: dict):
        super().__init__()
        self.chat_title = title
        self.settings = settings

    def compose(self) -> ComposeResult:
        s = self.settings
        think = {None: "default", True: "on", False: "off"}[s.get("think")]
        with Vertical(id="dialog"):
            yield Label(f"Settings · {self.chat_title}", id="heading", markup=False)
            yield Label("System prompt")
            yield TextArea(s.get("system") or "", id="system")
            with Grid(id="fields"):
                yield Label("Temperature")
                yield Input(_text(s.get("temperature")), placeholder="model default", id="temperature", type="number")
                yield Label("Top-p")
                yield Input(_text(s.get("top_p")), placeholder="model default", id="top_p", type="number")
                yield Label("Max tokens")
                yield Input(_text(s.get("max_tokens")), placeholder="model default", id="max_tokens", type="integer")
                yield Label("Thinking")
                yield Select(THINKING, value=think, allow_blank=False, id="think")
                yield Label("When the context is full")
                yield Select(
                    [(p, p) for p in CONTEXT_POLICIES],
                    value=s["context_policy"],
                    allow_blank=False,
                    id="context_policy",
                )
            with Horizontal(id="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            self.dismiss(self.read_form())
        except ValueError as e:
            self.notify(str(e), severity="error")

    def read_form(self) -> dict:
        temperature = _number(self, "temperature", float)
        top_p = _number(self, "top_p", float)
        if temperature is not None and temperature < 0:
            raise ValueError("temperature must be 0 or more")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError("top-p must be above 0 and at most 1")
        max_tokens = _number(self, "max_tokens", int)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max tokens must be at least 1")
        return stored_settings(
            system=self.query_one("#system", TextArea).text.strip() or None,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            think=THINK_VALUES[self.query_one("#think", Select).value],
            context_policy=self.query_one("#context_policy", Select).value,
        )


def _text(value) -> str:
    return "" if value is None else str(value)


def _number(screen: SettingsScreen, field: str, kind):
    text = screen.query_one(f"#{field}", Input).value.strip()
    if not text:
        return None
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{field.replace('_', ' ')} {text!r} is not a number") from None
