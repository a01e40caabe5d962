"""`ferrum serve`: bind the port, open the default model on its scheduler's thread, then serve
the APIs with uvicorn on the bound socket (so "serving ... on" is printed only once the port is
ours). Other models of the store are opened when a request names them, and every model unloads
after `--keep-alive` idle (`ferrum_mac.serve.batching.models`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from urllib.parse import urlsplit

from ferrum_mac.errors import FerrumError
from ferrum_mac.serve.body import MAX_BODY
from ferrum_mac.serve.guards import is_loopback_host
from ferrum_mac.serve.listener import MAX_CONNECTIONS, bind_socket, uvicorn_config
from ferrum_mac.serve.batching.models import DEFAULT_KEEP_ALIVE_S, served_name

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8000
OLLAMA_PORT = 11434  # where Ollama's clients look


class ServeOptionError(FerrumError):
    """A `ferrum serve` option or OLLAMA_HOST that cannot be used."""


def serve_command(
    model: str | None,
    host: str | None,
    port: int | None,
    api_key: str | None,
    backend: str = "auto",
    device: str | None = None,
    *,
    kv_capacity: int | None = None,
    max_body: int = MAX_BODY,
    allow_origins: tuple[str, ...] = (),
    max_connections: int = MAX_CONNECTIONS,
    verbose: bool = False,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    ollama: bool = False,
    speculate: str = "auto",
    any_model: bool = False,
) -> None:
    """`any_model` (or FERRUM_SERVE_ANY_MODEL): a name this server does not have means its default model."""
    import uvicorn

    from ferrum_mac.compose import ollama_host, response_store, serve_any_model
    from ferrum_mac.serve.app import build_app

    host, port = listen_address(host, port, ollama, ollama_host())
    speculate = speculate_option(speculate)
    if not is_loopback_host(host) and not api_key:
        print(
            f"ferrum: serving on {host} without --api-key: anyone who can reach this port can use the model",
            file=sys.stderr,
        )
    if verbose:
        log_requests()
    sock = bind_socket(host, port)  # first: a taken port fails before the model loads
    try:
        any_model = any_model or serve_any_model()
        models = open_models(model, backend, device, kv_capacity, keep_alive_s, speculate, any_model)
        try:
            default = models.loaded()[0]
            app = build_app(
                models,
                api_key=api_key,
                max_body=max_body,
                allow_origins=allow_origins,
                loopback_only=is_loopback_host(host),
                responses=response_store(),
            )
            server = uvicorn.Server(uvicorn_config(app, host=host, port=port, max_connections=max_connections))
            sock.listen(max_connections)
            line = serving_line(default.name, host, port, default.context, ollama, typed=default.engine.name)
            print(line, file=sys.stderr)
            server.run(sockets=[sock])
        finally:
            models.close()
    finally:
        sock.close()


def open_models(
    model: str | None,
    backend: str,
    device: str | None,
    kv_capacity: int | None,
    keep_alive_s: float,
    speculate: str = "auto",
    any_model: bool = False,
):
    """The registry with the default model open (pulled first if need be, as `ferrum run` does);
    the store's others are opened from their files, never pulled, when a request names them.
    `speculate`: what requests that do not choose get (auto, ngram or off); `any_model`: answer
    names this server does not have with the default model."""
    from ferrum_mac.compose import free_memory_bytes, open_engine, release_cached_memory
    from ferrum_mac.serve.batching.models import LoadedModel, Models, size_of
    from ferrum_mac.serve.batching.scheduler import Scheduler
    from ferrum_mac.store import list_models

    def open_scheduler(source: Path | str) -> Scheduler:
        return Scheduler(
            lambda: open_engine(source, backend=backend, device=device, kv_capacity=kv_capacity, pull=False),
            speculate=speculate,
        ).start()

    scheduler = Scheduler(
        lambda: open_engine(model, backend=backend, device=device, kv_capacity=kv_capacity), speculate=speculate
    ).start()
    engine = scheduler.engine
    default = LoadedModel(served_name(engine.name), scheduler, size_of(engine.path), keep_alive_s, source=engine.path)
    return Models(
        default,
        open_scheduler,
        list_models,
        keep_alive_s=keep_alive_s,
        free_memory=lambda: free_memory_bytes(backend, device),
        release_memory=release_cached_memory,
        resolve=lambda name: stored_path(name, backend),
        any_name=any_model,
    )


def stored_path(name: str, backend: str) -> Path | None:
    """Where the store holds the model an alias or repo id names, if it does (never a path a
    client typed: those are not model names here)."""
    from ferrum_mac.compose import choose_backend
    from ferrum_mac.store.aliases import BundledRef, parse_name
    from ferrum_mac.store.local import bundled_model, cached_model

    try:
        ref = parse_name(name, choose_backend(backend))
    except FerrumError:
        return None
    return bundled_model() if isinstance(ref, BundledRef) else cached_model(ref)


def keep_alive_option(value: str) -> float:
    """`--keep-alive` in seconds (FOREVER for a negative one), read as Ollama reads keep_alive."""
    from ferrum_mac.serve import checks as api
    from ferrum_mac.serve.batching.models import keep_alive_seconds

    try:
        seconds = keep_alive_seconds(value)
    except api.ApiError:
        seconds = None
    if seconds is None:
        raise ServeOptionError(
            f"--keep-alive {value!r} is not a duration: give seconds (300) or a duration (5m, 1h30m); "
            "0 unloads after each request, -1 never"
        )
    return seconds


def speculate_option(value: str) -> str:
    """`--speculate`: auto, ngram or off (a draft model is `ferrum run`'s only)."""
    from ferrum_mac.serve.batching.speculation import check_mode

    try:
        return check_mode(value)
    except ValueError as e:
        raise ServeOptionError(str(e)) from None


def listen_address(host: str | None, port: int | None, ollama: bool, ollama_host: str | None) -> tuple[str, int]:
    """Where to listen: --host and --port, else with --ollama where Ollama's clients look
    (OLLAMA_HOST, else 127.0.0.1:11434), else 127.0.0.1:8000."""
    if ollama:
        default_host, default_port = ollama_address(ollama_host)
    else:
        default_host, default_port = LOOPBACK, DEFAULT_PORT
    return host or default_host, port or default_port


def ollama_address(value: str | None) -> tuple[str, int]:
    """OLLAMA_HOST as Ollama reads it: `host`, `host:port`, `:port` or a URL (http or https),
    each part defaulting to 127.0.0.1 and 11434."""
    text = (value or "").strip()
    if not text:
        return LOOPBACK, OLLAMA_PORT
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        port, parts = -1, None
    if parts is None or port == -1 or parts.scheme not in ("http", "https") or parts.path.strip("/"):
        raise ServeOptionError(
            f"OLLAMA_HOST={value!r} is not an address; give host, host:port or http://host:port (port 1 to 65535)"
        )
    return parts.hostname or LOOPBACK, port or OLLAMA_PORT


def log_requests() -> None:
    """`--verbose`: the scheduler's per-request lines (prefix cache reuse, speculation) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ferrum: %(message)s"))
    log = logging.getLogger("ferrum.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def serving_line(name: str, host: str, port: int, context: int, ollama: bool, typed: str | None = None) -> str:
    """What the server says once it listens: the model's name (and the path `typed` for it, when
    that differs) and the base URL its clients take (Ollama's clients the bare address, OpenAI's
    the /v1 under it)."""
    base = f"http://{url_host(host)}:{port}"
    where = f"{base} for Ollama's clients, {base}/v1 for OpenAI's" if ollama else f"{base}/v1"
    source = f" (from {typed})" if typed is not None and typed != name else ""
    return f"ferrum: serving {name}{source} on {where} (context {context} tokens)"


def url_host(host: str) -> str:
    """`host` as it goes in a URL (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host else host
