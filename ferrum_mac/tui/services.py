"""What the UI asks of the world outside it: open an engine, list and pull models, machine facts.

Tests hand the app a `Services` of their own (a scripted engine, a fixed model list, fixed facts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum_mac.engine import ChatEngine


@dataclass(frozen=True)
class ModelEntry:
    name: str
    detail: str  # size, format and quantization, for the picker


class Services:
    def __init__(self, backend: str = "auto", device: str | None = None):
        self.backend, self.device = backend, device
        self.opened_on = ""  # the last engine's description of its device

    def default_model(self) -> str:
        from ferrum_mac.engine import default_model_name

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

    def pull(self, name: str, progress) -> None:
        from ferrum_mac.backends import choose
        from ferrum_mac.store import pull_model

        pull_model(name, backend=choose(self.backend), progress=progress)

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

    def pull(self, name: str, progress) -> None:
        from ferrum_mac.errors import FerrumError

        raise FerrumError(f"models are pulled on the server ({self.url}), not here")

    def backend_and_device(self) -> str:
        return f"remote · {self.url}"
