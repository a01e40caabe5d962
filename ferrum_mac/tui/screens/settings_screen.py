"""A conversation's settings: system prompt, temperature, top-p, max tokens, thinking, context
policy, speculation.

Dismissed with the new stored-settings dict (see chat_settings.py), or None when cancelled.
"""

from __future__ import annotations

from typing import Callable

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, TextArea

from ferrum_mac.engine import CONTEXT_POLICIES
from ferrum_mac.tui.chat_settings import AUTO, stored_settings

THINKING = [("model default", "default"), ("on", "on"), ("off", "off")]
THINK_VALUES = {"default": None, "on": True, "off": False}
SPECULATION = [(AUTO, AUTO), ("ngram", "ngram"), ("off", "off")]  # and draft:MODEL for each draft model found


class SettingsScreen(ModalScreen[dict | None]):
    CSS_PATH = "settings_screen.tcss"
    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(
        self,
        title: str,
        settings: dict,
        find_drafts: Callable[[], list[str]] | None = None,
        in_force: dict | None = None,
    ):
        """`find_drafts`: the names of the models that can draft for the chat's model (slow:
        it runs in a thread once the screen shows; None: no draft models). `in_force`: the
        model's defaults (temperature, top_p, max_tokens), shown in the fields left empty."""
        super().__init__()
        self.chat_title = title
        self.settings = settings
        self.in_force = in_force or {}
        self.find_drafts = find_drafts
        self.draft_names: list[str] | None = None  # None until find_drafts answered

    def compose(self) -> ComposeResult:
        s = self.settings
        think = {None: "default", True: "on", False: "off"}[s.get("think")]
        speculate = s.get("speculate") or AUTO
        with Vertical(id="dialog"):
            yield Label(f"Settings · {self.chat_title}", id="heading", markup=False)
            yield Label("System prompt")
            yield TextArea(s.get("system") or "", id="system")
            with Grid(id="fields"):
                yield Label("Temperature")
                yield Input(
                    _text(s.get("temperature")),
                    placeholder=self.placeholder("temperature"),
                    id="temperature",
                    type="number",
                )
                yield Label("Top-p", classes="right")
                yield Input(_text(s.get("top_p")), placeholder=self.placeholder("top_p"), id="top_p", type="number")
                yield Label("Max tokens")
                yield Input(
                    _text(s.get("max_tokens")),
                    placeholder=self.placeholder("max_tokens"),
                    id="max_tokens",
                    type="integer",
                )
                yield Label("Thinking", classes="right")
                yield Select(THINKING, value=think, allow_blank=False, id="think")
                yield Label("When the context is full", classes="wide")
                yield Select(
                    [(p, p) for p in CONTEXT_POLICIES],
                    value=s["context_policy"],
                    allow_blank=False,
                    id="context_policy",
                    classes="wide",
                )
                yield Label("Speculation")
                yield Select(speculation_options(speculate, []), value=speculate, allow_blank=False, id="speculate")
            with Horizontal(id="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def placeholder(self, field: str) -> str:
        """What an empty field means: the model's default, by its value where it is known."""
        if field not in self.in_force:
            return "model default"
        value = self.in_force[field]
        if value is None:  # max tokens: no limit but the context's
            return "default: no limit"
        return f"default: {value:g}"

    def on_mount(self) -> None:
        if self.find_drafts is not None:
            self.run_worker(self._list_drafts, thread=True, exit_on_error=False)

    def _list_drafts(self) -> None:
        try:
            names = self.find_drafts() if self.find_drafts is not None else []
        except Exception:  # a store that cannot be read offers no draft models; the rest still works
            names = []
        self.app.call_from_thread(self.show_drafts, names)

    def show_drafts(self, names: list[str]) -> None:
        """Offer draft:NAME for each model in `names`, keeping the choice shown."""
        try:
            select = self.query_one("#speculate", Select)
        except NoMatches:  # dismissed meanwhile
            return
        chosen = select.value
        select.set_options(speculation_options(str(chosen), names))
        select.value = chosen
        self.draft_names = names

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
            speculate=self.query_one("#speculate", Select).value,
        )


def speculation_options(chosen: str, drafts: list[str]) -> list[tuple[str, str]]:
    """auto, ngram, off, then draft:NAME for each draft model, and the chosen setting if none of those."""
    options = SPECULATION + [(f"draft:{name}", f"draft:{name}") for name in drafts]
    if chosen not in [value for _, value in options]:
        options.append((chosen, chosen))
    return options


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
