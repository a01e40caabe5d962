"""The APIs `ferrum serve` speaks, each only translating to and from the core: OpenAI's (chat and Responses), Ollama's and Anthropic's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import Route

from ferrum_mac.serve.protocols import anthropic, ollama, openai, responses

if TYPE_CHECKING:
    from ferrum_mac.serve.core import Server
    from ferrum_mac.serve.response_store import ResponseStore


def routes(server: "Server", kept: "ResponseStore") -> list[Route]:
    """Every protocol's routes on `server`; `kept`: the responses /v1/responses keeps."""
    return openai.routes(server) + responses.routes(server, kept) + ollama.routes(server) + anthropic.routes(server)
