"""Options several commands share, declared once: the same flag, help text and environment
variable wherever they appear. Use as a parameter's type, with its default after `=`:

    def run(backend: Backend = "auto", device: Device = None): ...
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

API_KEY_ENV = "FERRUM_API_KEY"
# What `ferrum run` does when the context is full: what the chat app does (tui/chat_settings.py),
# and Ollama's REPL: a long conversation drops its oldest turns instead of stopping.
CONTEXT_DEFAULT = "truncate-oldest"
NAME_HELP = "Alias (qwen3:0.6b), Hugging Face repo id (org/name[@revision][:QUANT]), folder or .gguf file."

Backend = Annotated[str, typer.Option("--backend", help="auto, mlx or torch.")]
Device = Annotated[
    Optional[str],
    typer.Option("--device", help="cpu or gpu (cuda, cuda:N, metal); default: the backend's GPU where it has one."),
]
Remote = Annotated[
    Optional[str], typer.Option("--remote", help="Chat with an OpenAI-compatible server at this URL instead.")
]
ServerUrl = Annotated[
    Optional[str],
    typer.Option(
        "--remote", help="The server's URL (default: where `ferrum serve` listens, then `ferrum serve --ollama`)."
    ),
]
ApiKey = Annotated[
    Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, help="With --remote: the server's API key.")
]
# `serve` takes the same key from the same variable, and requires it of every request
ServerApiKey = Annotated[
    Optional[str], typer.Option("--api-key", envvar=API_KEY_ENV, help="Require 'Authorization: Bearer KEY'.")
]
KvCapacity = Annotated[
    Optional[int],
    typer.Option(
        "--kv-capacity",
        min=2,
        help="Most tokens in one context (default $FERRUM_KV_CAPACITY, else the model's maximum).",
    ),
]
# pull, list, rm and show: which backend's repository an alias names (not where a model runs)
AliasBackend = Annotated[
    str,
    typer.Option(
        "--backend",
        help="Which backend's repository an alias maps to: mlx (4-bit conversions) or torch (bf16 originals).",
    ),
]
