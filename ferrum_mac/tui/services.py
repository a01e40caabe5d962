"""What the UI asks of the world outside it: open an engine, list and pull models, machine facts.

Tests hand the app a `Services` of their own (a scripted engine, a fixed model list, fixed facts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum_mac.engine import ChatEngine
    from ferrum_mac.engine.speculation import Speculate


PICKER_PULL = "F4 pulls it"  # the model picker's pull field holds the recommended model


@dataclass(frozen=True)
class ModelEntry:
    name: str
    detail: str  # size, format and quantization, for the picker


class Services:
    def __init__(self, backend: str = "auto", device: str | None = None):
        self.backend, self.device = backend, device
        self.opened_on = ""  # the last engine's description of its device

    def default_model(self) -> str:
        from ferrum_mac.compose import default_model_name

        return default_model_name()

    def open_engine(self, name: str | None) -> ChatEngine:
        from ferrum_mac.compose import open_engine

        engine = open_engine(name, backend=self.backend, device=self.device)
        self.opened_on = engine.device
        return engine

    def local_models(self) -> list[ModelEntry]:
        from ferrum_mac.store import list_models
        from ferrum_mac.store.units import human_bytes

        return [ModelEntry(m.name, f"{human_bytes(m.size)}  {m.format} {m.quant}") for m in list_models() if m.complete]

    def machine_memory_bytes(self) -> int:
        from ferrum_mac.store.recommend import machine_memory_bytes

        return machine_memory_bytes()

    def recommended_model(self) -> str | None:
        """The catalog model sized to this machine's memory (see store/recommend.py)."""
        from ferrum_mac.compose import choose_backend
        from ferrum_mac.store.recommend import recommended_model

        best = recommended_model(self.machine_memory_bytes(), choose_backend(self.backend))
        return best.name if best else None

    def demo_notice(self, name: str) -> str:
        """One line when `name` is the bundled demo model and no other model is here: it is
        small, and the model picker pulls one sized to this machine ('' otherwise)."""
        from ferrum_mac.compose import choose_backend
        from ferrum_mac.store.recommend import DEMO_MODEL, demo_model_line

        if name != DEMO_MODEL:
            return ""
        others = [m.name for m in self.local_models() if m.name != DEMO_MODEL]
        return demo_model_line(name, others, self.machine_memory_bytes(), choose_backend(self.backend), PICKER_PULL)

    def draft_models(self, engine: ChatEngine) -> list[str]:
        """The local models that can draft for `engine`'s model: the same vocabulary, another
        file. Reads every model's tokenizer: call it off the UI thread."""
        from ferrum_mac.compose import choose_backend
        from ferrum_mac.engine.speculation import same_vocabulary
        from ferrum_mac.errors import FerrumError
        from ferrum_mac.store import resolve_model
        from ferrum_mac.text import load_tokenizer

        tokenizer = getattr(engine, "tokenizer", None)  # a remote or scripted engine has none
        if tokenizer is None:
            return []
        own, backend = getattr(engine, "path", None), choose_backend(self.backend)
        names = []
        for entry in self.local_models():
            try:
                path = resolve_model(entry.name, backend=backend, pull=False)
                if own is None or path.resolve() != Path(own).resolve():
                    if same_vocabulary(load_tokenizer(path), tokenizer):
                        names.append(entry.name)
            except (FerrumError, OSError, ValueError):  # unreadable: no candidate
                continue
        return names

    def open_draft(self, engine: ChatEngine, name: str) -> Speculate:
        """The local model `name` loaded as `engine`'s draft (FerrumError: missing, or another vocabulary)."""
        from ferrum_mac.cli.run import open_draft

        return open_draft(engine, name, backend=self.backend, device=self.device, pull=False)

    def pull(self, name: str, progress) -> None:
        from ferrum_mac.compose import choose_backend
        from ferrum_mac.store import pull_model

        pull_model(name, backend=choose_backend(self.backend), progress=progress)

    def backend_and_device(self) -> str:
        return self.opened_on

    def memory_bytes(self) -> int:
        """This process's resident memory (on Apple Silicon it includes the GPU's share)."""
        try:
            import psutil

            return psutil.Process().memory_info().rss
        except ImportError:
            import resource
            import sys

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024


class RemoteServices(Services):
    """An OpenAI-compatible server (another ferrum, vLLM, Ollama, LM Studio) instead of a local model."""

    def __init__(self, url: str, api_key: str | None = None):
        super().__init__("remote")
        self.url, self.api_key = url, api_key

    def open_engine(self, name: str | None) -> ChatEngine:
        from ferrum_mac.remote import RemoteEngine

        engine = RemoteEngine(self.url, self.api_key, model=name or None)
        engine.name  # asks the server now, on the engine's thread: a wrong URL or key fails here
        return engine

    def default_model(self) -> str:
        return ""  # the server's first model, named once the engine opens

    def local_models(self) -> list[ModelEntry]:
        return []

    def draft_models(self, engine: ChatEngine) -> list[str]:
        return []

    def demo_notice(self, name: str) -> str:
        return ""  # the server's model: pulled there, not here

    def open_draft(self, engine: ChatEngine, name: str) -> Speculate:
        from ferrum_mac.errors import FerrumError

        raise FerrumError("a draft model needs a local model; the server decodes on its own")

    def pull(self, name: str, progress) -> None:
        from ferrum_mac.errors import FerrumError

        raise FerrumError(f"models are pulled on the server ({self.url}), not here")

    def backend_and_device(self) -> str:
        return f"remote · {self.url}"
