"""The `ferrum` command line. Each command imports its implementation lazily so start-up
stays fast and `ferrum bench` works with only the engine's dependencies present."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ferrum_mac.errors import FerrumError

app = typer.Typer(
    name="ferrum",
    help="Local LLM chat, Apple-Silicon-first.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _group() -> None:
    """Local LLM chat, Apple-Silicon-first."""


@app.command()
def bench(
    model: Optional[str] = typer.Argument(None, help="Model folder, .gguf file or name (omit with --shape)."),
    shape: Optional[str] = typer.Option(None, help="Random weights of a real shape, e.g. qwen3-0.6b."),
    quant: str = typer.Option("bf16", help="With --shape: bf16 or 4bit."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Prompt length for prefill."),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Tokens to decode."),
    runs: int = typer.Option(5, help="Timed runs per side, alternating; the best is reported."),
    peer: bool = typer.Option(True, help="Also run mlx-lm on the same weights."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    batch: int = typer.Option(0, help="Also time decode_batch over this many sequences (aggregate tok/s)."),
) -> None:
    """Prefill and decode speed, time to first token and peak memory, beside mlx-lm."""
    from ferrum_mac.bench import run_bench

    run_bench(
        model=model, shape=shape, quant=quant, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
        runs=runs, peer=peer, json_out=json_out, batch=batch,
    )


NAME_HELP = "Alias (qwen3:0.6b), Hugging Face repo id (org/name[@revision][:QUANT]), folder or .gguf file."
BACKEND_HELP = "Which backend's repository an alias maps to: mlx (4-bit conversions) or torch (bf16 originals)."


@app.command()
def pull(
    name: str = typer.Argument(..., help=NAME_HELP),
    backend: str = typer.Option("mlx", help=BACKEND_HELP),
) -> None:
    """Download a model (only the files it needs; an interrupted pull resumes)."""
    from ferrum_mac.store.commands import pull_command

    pull_command(name, backend)


@app.command("list")
def list_(
    available: bool = typer.Option(False, "--available", help="Print the aliases and what each fetches."),
    backend: str = typer.Option("mlx", help=BACKEND_HELP),
) -> None:
    """Models on this machine (the Hugging Face cache and the bundled model)."""
    from ferrum_mac.store.commands import list_command

    list_command(available, backend)


@app.command()
def rm(
    name: str = typer.Argument(..., help=NAME_HELP),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask first."),
    backend: str = typer.Option("mlx", help=BACKEND_HELP),
) -> None:
    """Delete a downloaded model."""
    from ferrum_mac.store.commands import rm_command

    rm_command(name, yes, backend)


@app.command()
def show(
    name: str = typer.Argument(..., help=NAME_HELP),
    backend: str = typer.Option("mlx", help=BACKEND_HELP),
) -> None:
    """Architecture, parameters, context length, quantization, chat template and license of a model."""
    from ferrum_mac.store.commands import show_command

    show_command(name, backend)


def main() -> None:
    try:
        app()
    except FerrumError as e:
        print(f"ferrum: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\nferrum: interrupted", file=sys.stderr)
        sys.exit(130)


def chat_main() -> None:
    """`ferrum-chat`: the Textual chat application."""
    print("ferrum-chat: the chat application is not built yet; use `ferrum bench` for now", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
