"""The HTTP app of `ferrum serve` (starlette): the core's routes in every protocol, its guards and error handlers.

The core (`serve.core`: `Server`, `Answer`) is protocol-neutral; each protocol module of
`serve.protocols` adds its routes (`routes(server) -> list[Route]`) and only translates.

What a client sends is never trusted: bodies are capped (`max_body`, checked before they are
read) and must be JSON; browsers' requests from origins other than loopback (or those given
in `allow_origins`) are refused, so a web page cannot drive the model; parsing, template
rendering and tokenizing run on worker threads, so one big prompt never stalls the others.
"""

from __future__ import annotations

import contextlib
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ferrum_mac.grammar.guard import GuardLimits
from ferrum_mac.serve import checks as api
from ferrum_mac.serve import protocols
from ferrum_mac.serve.api_errors import error_response, error_shapes
from ferrum_mac.serve.batching.models import Models
from ferrum_mac.serve.batching.scheduler import Scheduler
from ferrum_mac.serve.body import MAX_BODY
from ferrum_mac.serve.core import Answer, ClientGone, Server
from ferrum_mac.serve.guards import ApiKeyCheck, HostCheck, OriginCheck, loopback_host_names
from ferrum_mac.serve.response_store import ResponseStore

RESPONSES_IN_MEMORY_S = 24 * 3600  # an app given no store keeps responses this long, in memory

__all__ = ["Answer", "ClientGone", "Server", "build_app", "error_shapes"]


def build_app(
    models: Models | Scheduler,
    model_name: str | None = None,
    api_key: str | None = None,
    *,
    max_body: int = MAX_BODY,
    allow_origins: tuple[str, ...] = (),
    loopback_only: bool = False,
    responses: ResponseStore | None = None,
    grammar_limits: GuardLimits = GuardLimits(),
) -> Starlette:
    """The ASGI app; `allow_origins`: web origins besides loopback ones that may call it;
    `loopback_only` (a server bound to loopback): refuse requests whose Host names another machine.
    `models`: the registry of the models it serves, or the scheduler of its one model (`model_name`);
    `responses`: where /v1/responses keeps responses (None: in memory, for this app's life);
    `grammar_limits`: what checking one request's schemas may cost."""
    server = Server(models, model_name, max_body, grammar_limits)
    middleware = [Middleware(OriginCheck, allowed=allow_origins)]
    if loopback_only:
        middleware.insert(0, Middleware(HostCheck, allowed=loopback_host_names(allow_origins)))
    if api_key:
        middleware.append(Middleware(ApiKeyCheck, api_key=api_key))
    kept = responses if responses is not None else ResponseStore(None, ttl_s=RESPONSES_IN_MEMORY_S)
    routes = protocols.routes(server, kept) + [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=ERROR_HANDLERS,
        lifespan=_closing(server),
    )


def _closing(server: Server):
    """The app's lifespan: the server's grammar checkers end with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await server.grammar_guard.close()

    return lifespan


# -- errors, in the shape of the route's protocol ---------------------------------------------


async def api_error(request: Request, exc: api.ApiError) -> Response:
    return error_response(request.url.path, exc)


async def http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    error = api.ApiError(exc.status_code, str(exc.detail), code=code)
    return error_response(request.url.path, error, headers=exc.headers)


async def client_gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug: the usual error body rather than a bare text 500 (the traceback goes to the log)."""
    error = api.ApiError(
        500, f"internal error ({type(exc).__name__}); see the server's log", kind="server_error", code="internal_error"
    )
    return error_response(request.url.path, error)


# Any: starlette types each handler as taking any Exception; each of these takes its own kind.
ERROR_HANDLERS: dict[Any, Any] = {
    HTTPException: http_error,
    api.ApiError: api_error,
    ClientGone: client_gone,
    Exception: internal_error,
}
