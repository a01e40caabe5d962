"""The listening side of `ferrum serve`: the bound socket and uvicorn's settings.

uvicorn's h11 protocol waits forever for a request's headers (its keep-alive timeout runs only
between requests), so a client that sends half a header line and stalls holds a connection,
and a file descriptor, for good. `HeaderTimeoutProtocol` closes a connection whose headers are
not complete `header_timeout` seconds after it opened or after its last response, and closes
at once connections past `max_connections` (those within the limit get uvicorn's 503 when the
server is at the limit).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

from ferrum_mac.errors import FerrumError

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 128  # under macOS's default of 256 open files, with room for the model's own
SHUTDOWN_GRACE_S = 5  # what answers still running get to finish once the server is told to stop


class HeaderTimeoutProtocol(H11Protocol):
    def __init__(self, *args, header_timeout: float = HEADER_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            transport.close()  # over the limit: no file descriptor kept for it
            return
        self._await_headers()

    def connection_lost(self, exc) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._await_headers()  # the next request's headers get the same time

    def _await_headers(self) -> None:
        self._stop_waiting()
        self.header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_too_slow(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(
    app,
    *,
    header_timeout: float = HEADER_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
    host: str = "127.0.0.1",
    port: int = 0,
):
    import uvicorn

    protocol = functools.partial(HeaderTimeoutProtocol, header_timeout=header_timeout)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=protocol,  # type: ignore[arg-type]  # uvicorn calls it as it would the class
        limit_concurrency=max_connections,
        # on SIGTERM answers still running get this long, then are cut: a pull or stream never holds the exit
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a one-line FerrumError saying why not (port in use...)."""
    if not 0 < port < 65536:
        raise FerrumError(f"port {port} is not a port; choose one from 1 to 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise FerrumError(f"cannot listen on {host}: {e.strerror}; pass --host an address of this machine") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise FerrumError(_bind_problem(e, host, port)) from None
    sock.set_inheritable(True)
    return sock


def _bind_problem(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} is in use; stop what is using it or pass another --port"
    if e.errno == errno.EACCES:
        return f"port {port} needs administrator rights on this system; pass a --port above 1023"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine; pass --host 127.0.0.1 or one of its addresses"
    return f"cannot listen on {host}:{port} ({e.strerror or e}); pass another --host or --port"
