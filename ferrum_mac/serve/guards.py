"""Who may call `ferrum serve`, checked before a request reaches a route: the API key, the
web origin (with CORS answers for allowed ones) and, on a loopback server, the Host. Each
refuses with the API's usual error body."""

from __future__ import annotations

import hmac
import ipaddress
import socket

from starlette.responses import Response

from ferrum_mac.serve import checks as api
from ferrum_mac.serve.api_errors import error_response

OPEN_PATHS = ("/health",)  # answered without the API key
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
CORS_METHODS = "GET, POST, DELETE, OPTIONS"  # DELETE: /api/delete
CORS_MAX_AGE = "600"


async def refuse(error: api.ApiError, scope, receive, send) -> None:
    """`error` in the error shape of the API the path belongs to."""
    await error_response(scope["path"], error)(scope, receive, send)


class ApiKeyCheck:
    """401 for any path but /health without `Authorization: Bearer <key>` (the scheme in any case)
    or `x-api-key: <key>` (Anthropic's clients send that)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self.accepts(dict(scope["headers"])):
            error = api.ApiError(
                401,
                "incorrect or missing API key; send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="invalid_api_key",
            )
            return await refuse(error, scope, receive, send)
        await self.app(scope, receive, send)

    def accepts(self, headers: dict) -> bool:
        scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)
        return bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.expected)


class OriginCheck:
    """Browsers name the page's origin on cross-site requests: refuse (403) every origin but
    loopback ones and those allowed, so a web page the user visits cannot use the model, and
    answer CORS preflights for the accepted ones. Clients that send no Origin are not browsers."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = frozenset(o.rstrip("/").lower() for o in allowed)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin", b"").decode("latin-1")
        if not origin:
            return await self.app(scope, receive, send)
        if not self.accepts(origin):
            error = api.ApiError(
                403,
                f"requests from the web page at {origin[:200]} are refused; start the server "
                f"with --allow-origin {origin[:200]} to allow them",
                code="origin_not_allowed",
            )
            return await refuse(error, scope, receive, send)
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers", b"").decode("latin-1")
            preflight = {
                **cors,
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": asked or "Authorization, Content-Type",
                "Access-Control-Max-Age": CORS_MAX_AGE,
            }
            return await Response(status_code=204, headers=preflight)(scope, receive, send)

        extra = [(name.lower().encode(), value.encode("latin-1")) for name, value in cors.items()]

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def accepts(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        return origin in self.allowed or is_loopback_origin(origin)


class HostCheck:
    """A web page can point a name of its own at 127.0.0.1 (DNS rebinding) and then read this
    server as "same origin", sending no Origin at all. Its requests still name its own host,
    so a server bound to loopback refuses (403) every Host but loopback names, this machine's
    name and the hosts of allowed origins."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            host = host_name(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
            if host and not (host in self.allowed or host.endswith(".localhost") or is_loopback_host(host)):
                error = api.ApiError(
                    403,
                    f"requests for the host {host[:200]!r} are refused: this server answers on loopback "
                    "names only (or start it with --allow-origin for a page's origin)",
                    code="host_not_allowed",
                )
                return await refuse(error, scope, receive, send)
        await self.app(scope, receive, send)


def loopback_host_names(allow_origins: tuple[str, ...]) -> frozenset[str]:
    """Host names a loopback server answers to: loopback ones, this machine's, allowed origins' hosts."""
    names = {*LOOPBACK_HOSTS, socket.gethostname().lower()}
    names |= {host_name(origin.partition("://")[2]) for origin in allow_origins}
    return frozenset(names)


def is_loopback_host(host: str) -> bool:
    """`localhost` or a loopback address (an IPv6 one with or without its brackets)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """`host[:port]` or `[v6][:port]` without the port, lower case."""
    host = host.strip().lower().rstrip("/")
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_origin(origin: str) -> bool:
    """http(s)://localhost, 127.0.0.1 or [::1], on any port."""
    scheme, sep, rest = origin.partition("://")
    if scheme not in ("http", "https") or not sep:
        return False
    host = rest.rsplit(":", 1)[0] if not rest.endswith("]") else rest
    port = rest[len(host) + 1 :]
    return host in LOOPBACK_HOSTS and (port == "" or port.isdigit())
