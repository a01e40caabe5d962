"""`ferrum serve`: bind the port, open the model on the scheduler's thread, then serve the API
with uvicorn on the bound socket (so "serving ... on" is printed only once the port is ours)."""

from __future__ import annotations

import logging
import sys

from ferrum_mac.serve.app import MAX_BODY
from ferrum_mac.serve.guards import is_loopback_host
from ferrum_mac.serve.listener import MAX_CONNECTIONS, bind_socket, uvicorn_config

LOOPBACK = "127.0.0.1"


def serve_command(
    model: str | None,
    host: str,
    port: int,
    api_key: str | None,
    backend: str = "auto",
    device: str | None = None,
    *,
    kv_capacity: int | None = None,
    max_body: int = MAX_BODY,
    allow_origins: tuple[str, ...] = (),
    max_connections: int = MAX_CONNECTIONS,
    verbose: bool = False,
) -> None:
    import uvicorn

    from ferrum_mac.compose import open_engine
    from ferrum_mac.serve.app import build_app
    from ferrum_mac.serve.scheduler import Scheduler

    if not is_loopback_host(host) and not api_key:
        print(
            f"ferrum: serving on {host} without --api-key: anyone who can reach this port can use the model",
            file=sys.stderr,
        )
    if verbose:
        log_requests()
    sock = bind_socket(host, port)  # first: a taken port fails before the model loads
    try:
        scheduler = Scheduler(
            lambda: open_engine(model, backend=backend, device=device, kv_capacity=kv_capacity)
        ).start()
        try:
            name = scheduler.engine.name
            app = build_app(
                scheduler,
                name,
                api_key,
                max_body=max_body,
                allow_origins=allow_origins,
                loopback_only=is_loopback_host(host),
            )
            server = uvicorn.Server(uvicorn_config(app, host=host, port=port, max_connections=max_connections))
            sock.listen(max_connections)
            print(
                f"ferrum: serving {name} on http://{url_host(host)}:{port}/v1 (context {scheduler.capacity} tokens)",
                file=sys.stderr,
            )
            server.run(sockets=[sock])
        finally:
            scheduler.stop()
    finally:
        sock.close()


def log_requests() -> None:
    """`--verbose`: the scheduler's per-request lines (prefix cache reuse) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ferrum: %(message)s"))
    log = logging.getLogger("ferrum.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def url_host(host: str) -> str:
    """`host` as it goes in a URL (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host else host
