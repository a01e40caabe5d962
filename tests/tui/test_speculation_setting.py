"""Speculation in the chat app: the settings screen's choice reaches the engine conversation,
is kept in the history, names draft models with the chat model's vocabulary, and a draft that
cannot be used is said in the app and falls back to auto."""

from __future__ import annotations

import shutil

import pytest
from textual.widgets import Select

from ferrum_mac.engine.speculation import Speculate
from ferrum_mac.engine.speculation.controller import MAX_K
from ferrum_mac.tui.app import ChatApp
from ferrum_mac.tui.services import ModelEntry, Services
from ferrum_mac.tui.widgets.message_view import MessageView
from tui_fakes import FakeEngine, FakeServices
from tui_pilot import SIZE, ready, send, wait_for

CHEAP = [1.0] * (MAX_K + 1)  # a verify costs a decode step: guessing always pays, whatever this machine measures
PROMPT = "Tom and Lily went to the park. Tom and Lily"


class FakeDraftServices(FakeServices):
    """Draft models by name; loading one fails as a missing model does."""

    def draft_models(self, engine):
        return ["qwen3:0.6b"]


class StoriesServices(Services):
    """The real services, with a store of three models: the chat's own, a copy of it (a
    draft with the same vocabulary) and a Qwen3 tokenizer (another vocabulary)."""

    def __init__(self, models: list[str]):
        super().__init__("auto")
        self.models = models

    def local_models(self):
        return [ModelEntry(name, "") for name in self.models]


def notices(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


def footer(app) -> str:
    return str(app.chat.query(MessageView).last().query_one(".footer").render())


async def open_settings(pilot):
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: pilot.app.screen.query("#speculate"), what="the settings screen")
    return pilot.app.screen


async def choose_speculation(pilot, value: str) -> None:
    modal = await open_settings(pilot)
    await wait_for(pilot, lambda: modal.draft_names is not None, what="the draft models")
    modal.query_one("#speculate", Select).value = value
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: pilot.app.screen is not modal, what="the saved settings")


async def test_the_setting_reaches_the_conversation_and_survives_reopening(history):
    engine = FakeEngine()
    app = ChatApp(FakeDraftServices(engine), history, engine.name)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        modal = await open_settings(pilot)
        await wait_for(pilot, lambda: modal.draft_names == ["qwen3:0.6b"], what="the draft models")
        offered = [value for _, value in modal.query_one("#speculate", Select)._options]
        assert offered == ["auto", "ngram", "off", "draft:qwen3:0.6b"]
        await pilot.press("escape")
        await choose_speculation(pilot, "ngram")
        chat = history.conversations()[0]
        assert history.conversation(chat.id).settings["speculate"] == "ngram"
        await send(pilot, "again")
        assert engine.turns[-1]["settings"].speculate == Speculate("ngram")

    engine = FakeEngine()  # the app opened again on the same history
    app = ChatApp(FakeDraftServices(engine), history, engine.name)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        modal = await open_settings(pilot)
        assert modal.query_one("#speculate", Select).value == "ngram"
        await pilot.press("escape")
        await send(pilot, "once more")
        assert engine.turns[-1]["settings"].speculate == Speculate("ngram")
        await choose_speculation(pilot, "off")
        await send(pilot, "off now")
        assert engine.turns[-1]["settings"].speculate == Speculate("off")
        await choose_speculation(pilot, "auto")
        assert "speculate" not in history.conversation(chat.id).settings  # auto: the default, not stored
        await send(pilot, "and auto")
        assert engine.turns[-1]["settings"].speculate == Speculate()


async def test_a_draft_that_cannot_load_is_said_and_falls_back_to_auto(history):
    engine = FakeEngine()
    app = ChatApp(FakeDraftServices(engine), history, engine.name, {"speculate": "draft:no-such-model"})
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await wait_for(pilot, lambda: any("no-such-model" in n for n in notices(app)), what="the notice")
        [notice] = [n for n in notices(app) if "no-such-model" in n]
        assert "is not a model name" in notice and notice.endswith("Speculation is back to auto.")
        assert engine.turns[-1]["settings"].speculate == Speculate()  # the answer came, with auto
        assert history.messages(history.conversations()[0].id)[-1].role == "assistant"
        await wait_for(pilot, lambda: "speculate" not in history.conversations()[0].settings, what="the fallback")

        await choose_speculation(pilot, "draft:qwen3:0.6b")  # listed, but not in this store
        await wait_for(pilot, lambda: any("qwen3:0.6b" in n and "back to auto" in n for n in notices(app)))
        await wait_for(pilot, lambda: "speculate" not in history.conversations()[0].settings, what="the fallback")
        modal = await open_settings(pilot)
        assert modal.query_one("#speculate", Select).value == "auto"


@pytest.fixture
def stories_store(shared_assets, tmp_path):
    stories = shared_assets / "stories260K"
    if not (stories / "model.safetensors").is_file():
        pytest.skip("stories260K is not in the shared assets")
    draft = tmp_path / "stories-draft"
    shutil.copytree(stories, draft)
    return stories, draft, shared_assets / "tokenizers" / "qwen3"


async def test_on_stories_ngram_and_a_draft_answer_as_off(stories_store, history):
    """Greedy answers are the same with speculation off, prompt lookup and a draft model; a
    model of another vocabulary is not offered as a draft, and refused when named."""
    stories, draft, qwen3 = stories_store
    services = StoriesServices([str(stories), str(draft), str(qwen3)])
    app = ChatApp(services, history, str(stories), {"max_tokens": 40, "temperature": 0.0, "speculate": "off"})
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=60, what="the model")
        app.engine.step_times.use(CHEAP)
        await send(pilot, PROMPT, timeout=60)
        plain = history.messages(history.conversations()[0].id)[-1]
        assert plain.stats["speculation"] is None and "guessed" not in footer(app)

        await pilot.press("ctrl+n")
        await choose_speculation(pilot, "ngram")  # a new chat: the settings it will start with
        await send(pilot, PROMPT, timeout=60)
        ngram = history.messages(app.chat.current_id)[-1]
        assert ngram.content == plain.content
        guessed = ngram.stats["speculation"]
        assert guessed["proposed"] > 0 and 0 < guessed["accepted"] <= guessed["proposed"]
        assert f"guessed {guessed['proposed']}, kept {guessed['accepted']}" in footer(app)

        modal = await open_settings(pilot)
        await wait_for(pilot, lambda: modal.draft_names is not None, what="the draft models")
        assert modal.draft_names == [str(draft)]  # not the chat's own model, not another vocabulary
        await pilot.press("escape")
        await pilot.press("ctrl+n")
        await choose_speculation(pilot, f"draft:{draft}")
        await wait_for(
            pilot, lambda: f"Draft model {draft} loaded" in "".join(notices(app)), timeout=30, what="the draft"
        )
        app.engine.step_times.use(CHEAP, draft_step=0.01)
        await send(pilot, PROMPT, timeout=60)
        drafted = history.messages(app.chat.current_id)[-1]
        assert drafted.content == plain.content
        assert drafted.stats["speculation"]["accepted"] > 0  # the same weights: its guesses are kept
        conv = app.resident._conversations[app.chat.current_id]
        assert (conv.settings.speculate.mode, conv.settings.speculate.draft_name) == ("draft", str(draft))

        chat_id = app.chat.current_id
        history.save_settings(chat_id, {**history.conversation(chat_id).settings, "speculate": f"draft:{qwen3}"})
        await send(pilot, "Once upon a time", timeout=60)
        await wait_for(pilot, lambda: any("another vocabulary" in n for n in notices(app)), what="the refusal")
        assert "speculate" not in history.conversation(chat_id).settings
        assert history.messages(chat_id)[-1].role == "assistant"
