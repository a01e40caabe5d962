"""The `ferrum` command line. Each command imports its implementation lazily so start-up
stays fast and `ferrum bench` works with only the engine's dependencies present."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ferrum_mac.cli.bench import bench_app
from ferrum_mac.cli.options import (
    CONTEXT_DEFAULT,
    NAME_HELP,
    AliasBackend,
    ApiKey,
    Backend,
    Device,
    KvCapacity,
    Remote,
    ServerApiKey,
    ServerUrl,
)
from ferrum_mac.errors import FerrumError

app = typer.Typer(
    name="ferrum",
    help="Local LLM chat, Apple-Silicon-first.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: Rich markup would eat "[@revision]" in the texts and print "<bool>" after every flag.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"ferrum {version('ferrum-mac')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("ferrum (version unknown: not installed)")
        raise typer.Exit()


@app.callback()
def _group(
    _version: bool = typer.Option(
        False, "--version", "-V", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    """Local LLM chat, Apple-Silicon-first."""


app.add_typer(bench_app, name="bench")


@app.command()
def pull(
    name: str = typer.Argument(..., metavar="NAME", help=NAME_HELP),
    backend: AliasBackend = "mlx",
) -> None:
    """Download a model (only the files it needs; an interrupted pull resumes)."""
    from ferrum_mac.cli.store_commands import pull_command

    pull_command(name, backend)


@app.command("list")
def list_(
    available: bool = typer.Option(False, "--available", help="Print the aliases and what each fetches."),
    backend: AliasBackend = "mlx",
) -> None:
    """Models on this machine (the Hugging Face cache and the bundled model)."""
    from ferrum_mac.cli.store_commands import list_command

    list_command(available, backend)


@app.command()
def rm(
    name: str = typer.Argument(..., metavar="NAME", help=NAME_HELP),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask first."),
    backend: AliasBackend = "mlx",
) -> None:
    """Delete a downloaded model."""
    from ferrum_mac.cli.store_commands import rm_command

    rm_command(name, yes, backend)


@app.command()
def show(
    name: str = typer.Argument(..., metavar="NAME", help=NAME_HELP),
    backend: AliasBackend = "mlx",
) -> None:
    """Architecture, parameters, context length, quantization, chat template and license of a model."""
    from ferrum_mac.cli.store_commands import show_command

    show_command(name, backend)


@app.command()
def ps(remote: ServerUrl = None, api_key: ApiKey = None) -> None:
    """Models a running server has loaded, and when each unloads."""
    from ferrum_mac.cli.server_commands import ps_command

    ps_command(remote, api_key)


@app.command()
def stop(
    model: str = typer.Argument(..., metavar="MODEL", help="A model `ferrum ps` lists."),
    remote: ServerUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Unload a model from a running server (its memory returns; the next request loads it again)."""
    from ferrum_mac.cli.server_commands import stop_command

    stop_command(model, remote, api_key)


@app.command(context_settings={"allow_interspersed_args": True})
def run(
    words: Optional[list[str]] = typer.Argument(
        None,
        metavar="[MODEL] PROMPT",
        help="Model (alias, repo id, folder or .gguf; default $FERRUM_MODEL or smollm2:135m) and prompt. "
        "No prompt: stdin when piped, else the REPL.",
    ),
    system: Optional[str] = typer.Option(None, help="System prompt."),
    temperature: Optional[float] = typer.Option(None, help="0 is greedy; default from the model's generation config."),
    top_p: Optional[float] = typer.Option(
        None, "--top-p", help="Nucleus sampling: keep tokens up to this probability."
    ),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0: off)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Drop tokens below min_p x the top probability."),
    repeat_penalty: Optional[float] = typer.Option(None, "--repeat-penalty", help="Above 1 discourages repeats."),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Most tokens in the answer."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop at this text (repeatable)."),
    think: Optional[bool] = typer.Option(
        None, "--think/--no-think", help="The model's thinking mode, where it has one."
    ),
    hide_thinking: bool = typer.Option(False, "--hide-thinking", help="Do not print the reasoning (stderr, dimmed)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print a stats line (tok/s) after each answer."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: text, reasoning, stats."),
    answer_format: str = typer.Option(
        "text", "--format", help="text, or json: every answer a JSON object (enforced token by token)."
    ),
    schema: Optional[Path] = typer.Option(
        None, "--schema", metavar="FILE", help="Every answer JSON valid against the JSON schema in FILE."
    ),
    speculate: str = typer.Option(
        "auto",
        "--speculate",
        help="Speculative decoding: auto (prompt lookup where it pays), ngram, draft:MODEL or off.",
    ),
    backend: Backend = "auto",
    device: Device = None,
    kv_capacity: KvCapacity = None,
    context: str = typer.Option(
        CONTEXT_DEFAULT,
        help="When the context is full: truncate-oldest (drop the oldest turns, as the chat app does) or error.",
    ),
    pull: bool = typer.Option(True, "--pull/--no-pull", help="Download the model when it is not on disk."),
    interactive: bool = typer.Option(False, "--interactive", "-i", help="The REPL, even with stdin piped."),
    remote: Remote = None,
    api_key: ApiKey = None,
) -> None:
    """Chat with a model: one answer to a prompt, or a REPL (/? for its commands)."""
    from ferrum_mac.cli.run import RunOptions
    from ferrum_mac.cli.run import run as run_chat

    run_chat(
        words or [],
        RunOptions(
            system=system,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            max_tokens=max_tokens,
            stop=stop or [],
            think=think,
            hide_thinking=hide_thinking,
            verbose=verbose,
            json=json_out,
            backend=backend,
            device=device,
            kv_capacity=kv_capacity,
            context=context,
            pull=pull,
            interactive=interactive,
            remote=remote,
            api_key=api_key,
            format=answer_format,
            schema=schema,
            speculate=speculate,
        ),
    )


@app.command()
def serve(
    model: Optional[str] = typer.Argument(
        None, help="Model to serve (default $FERRUM_MODEL or smollm2:135m). " + NAME_HELP
    ),
    host: Optional[str] = typer.Option(
        None, help="Address to listen on (default 127.0.0.1, loopback; with --ollama $OLLAMA_HOST's)."
    ),
    port: Optional[int] = typer.Option(
        None, min=1, max=65535, help="Port to listen on (default 8000; with --ollama 11434 or $OLLAMA_HOST's)."
    ),
    api_key: ServerApiKey = None,
    backend: Backend = "auto",
    device: Device = None,
    kv_capacity: KvCapacity = None,
    max_body: int = typer.Option(
        4 * 1024 * 1024, "--max-body", min=1024, help="Largest request body in bytes (413 beyond)."
    ),
    allow_origin: Optional[list[str]] = typer.Option(
        None,
        "--allow-origin",
        help="A web origin (https://app.example) whose pages may call the server; repeatable. "
        "Loopback origins always may; others get 403.",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Log per request: prompt tokens reused from the prefix cache, guesses kept."
    ),
    keep_alive: str = typer.Option(
        "5m",
        "--keep-alive",
        help="Unload a model after this long without requests: seconds or a duration (300, 5m, 1h); "
        "0 after each request, -1 never. Requests may set their own (Ollama's keep_alive).",
    ),
    ollama: bool = typer.Option(
        False, "--ollama", help="Listen where Ollama's clients look: $OLLAMA_HOST, else 127.0.0.1:11434."
    ),
    speculate: str = typer.Option(
        "auto",
        "--speculate",
        help="Speculative decoding for requests that do not choose (their `speculate` field): "
        "auto (prompt lookup where it pays), ngram or off.",
    ),
    any_model: bool = typer.Option(
        False,
        "--any-model",
        help="Answer a request naming a model this server does not have with the default model, not a 404 "
        "(default $FERRUM_SERVE_ANY_MODEL).",
    ),
) -> None:
    """An OpenAI-, Anthropic- and Ollama-compatible server of the default model and any model in the
    store (/v1/chat/completions, /v1/messages, /api/chat, /v1/models, /health, /metrics, ...)."""
    from ferrum_mac.serve.command import keep_alive_option, serve_command

    serve_command(
        model,
        host,
        port,
        api_key,
        backend,
        device,
        kv_capacity=kv_capacity,
        max_body=max_body,
        allow_origins=tuple(allow_origin or ()),
        verbose=verbose,
        keep_alive_s=keep_alive_option(keep_alive),
        ollama=ollama,
        speculate=speculate,
        any_model=any_model,
    )


@app.command()
def chat(
    model: Optional[str] = typer.Argument(
        None, metavar="MODEL", help="Model to open (default $FERRUM_MODEL or smollm2:135m). " + NAME_HELP
    ),
    backend: Backend = "auto",
    device: Device = None,
    db: Optional[str] = typer.Option(None, "--db", help="Chat history file (default: in the platform's data folder)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Most tokens per answer in new conversations."),
    remote: Remote = None,
    api_key: ApiKey = None,
    search: Optional[str] = typer.Option(
        None, "--search", metavar="TEXT", help="Print the history's messages that match TEXT, then exit."
    ),
    open_id: Optional[int] = typer.Option(
        None, "--open", metavar="N", help="Open conversation N (the number --search prints beside each match)."
    ),
) -> None:
    """The chat application: conversations kept as they happen, streaming Markdown, a model picker."""
    if search is not None:
        from ferrum_mac.cli.chat_search import print_search

        print_search(db, search)
        return
    from ferrum_mac.tui.app import main as chat_app

    chat_app(model, backend, db, max_tokens, remote=remote, api_key=api_key, device=device, open_id=open_id)


def main(prog_name: str | None = None) -> None:
    try:
        code = app(standalone_mode=False, prog_name=prog_name)
    except FerrumError as e:
        print(f"ferrum: {e}", file=sys.stderr)
        sys.exit(1)
    except typer.Abort:
        print("\nferrum: aborted", file=sys.stderr)
        sys.exit(1)
    except typer.TyperException as e:  # a bad flag or value: one line instead of click's box
        message = e.format_message().rstrip(".") if hasattr(e, "format_message") else str(e)
        if message:  # (no arguments at all: the help was printed already)
            command = getattr(getattr(e, "ctx", None), "command_path", None) or "ferrum"
            print(f"ferrum: {message}; see `{command} --help`", file=sys.stderr)
        sys.exit(getattr(e, "exit_code", 2))
    except KeyboardInterrupt:
        print("\nferrum: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


def chat_main() -> None:
    """`ferrum-chat [MODEL] [--backend ...] [--db PATH]`: the same as `ferrum chat`."""
    if sys.argv[1:] not in (["--version"], ["-V"]):  # the version is the group's option, not chat's
        sys.argv = [sys.argv[0], "chat", *sys.argv[1:]]
    main(prog_name="ferrum")  # its help then reads "ferrum chat", a command that exists
