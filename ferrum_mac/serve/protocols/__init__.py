"""The APIs `ferrum serve` speaks, each only translating to and from the core: OpenAI's, Ollama's and Anthropic's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import Route

from ferrum_mac.serve.protocols import anthropic, ollama, openai

if TYPE_CHECKING:
    from ferrum_mac.serve.core import Server


def routes(server: "Server") -> list[Route]:
    """Every protocol's routes on `server`."""
    return openai.routes(server) + ollama.routes(server) + anthropic.routes(server)
