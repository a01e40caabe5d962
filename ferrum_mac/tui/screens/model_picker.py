"""Choose a local model, or pull a new one with progress. Dismissed with the chosen name or None."""

from __future__ import annotations


from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, ProgressBar
from textual.widgets.option_list import Option

from ferrum_mac.store.recommend import DEMO_MODEL
from ferrum_mac.tui.messages import PullFinished, PullProgressed
from ferrum_mac.tui.pull_progress import PostedPullProgress


class ModelPicker(ModalScreen[str | None]):
    CSS_PATH = "model_picker.tcss"
    BINDINGS = [Binding("escape", "dismiss(None)", "Close")]

    def __init__(self, services, current: str):
        super().__init__()
        self.services = services
        self.current = current
        self.pulling = False

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Models on this machine", classes="heading")
            yield OptionList(id="models")
            yield Label("Pull a model (alias such as qwen3:0.6b, or a Hugging Face repo id)", classes="heading")
            with Horizontal(id="pull-row"):
                yield Input(placeholder="qwen3:0.6b", id="pull-name")
                yield Button("Pull", id="pull", variant="primary")
            yield ProgressBar(id="progress", show_eta=False)
            yield Label("", id="pull-note", markup=False)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False
        if self.current == DEMO_MODEL:  # what the demo model's notice says F4 pulls
            self.query_one("#pull-name", Input).value = self.services.recommended_model() or ""
        self.show_models()

    def show_models(self) -> None:
        models = self.services.local_models()
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options(
            Option(
                Text.assemble(("● " if m.name == self.current else "  ") + m.name, (f"  {m.detail}", "dim")), id=m.name
            )
            for m in models
        )
        names = [m.name for m in models]
        options.highlighted = names.index(self.current) if self.current in names else (0 if names else None)
        options.focus()

    @on(OptionList.OptionSelected)
    def _chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    @on(Button.Pressed, "#pull")
    @on(Input.Submitted, "#pull-name")
    def _pull(self) -> None:
        name = self.query_one("#pull-name", Input).value.strip()
        if not name or self.pulling:
            return
        self.pulling = True
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#pull-note", Label).update(f"pulling {name}…")
        self.pull(name)

    @work(thread=True, group="pull")
    def pull(self, name: str) -> None:
        try:
            self.services.pull(name, PostedPullProgress(self.post_message))
            self.post_message(PullFinished(name))
        except Exception as e:
            self.post_message(PullFinished(name, " ".join(str(e).split()) or type(e).__name__))  # all of it, wrapped

    def on_pull_progressed(self, event: PullProgressed) -> None:
        self.query_one(ProgressBar).update(total=event.total or None, progress=event.done)
        if event.note:
            self.query_one("#pull-note", Label).update(event.note)

    def on_pull_finished(self, event: PullFinished) -> None:
        self.pulling = False
        self.query_one(ProgressBar).display = False
        note = self.query_one("#pull-note", Label)
        if event.error:
            note.update(f"pull failed: {event.error}")
            return
        note.update(f"pulled {event.name}; choose it above")
        self.show_models()
