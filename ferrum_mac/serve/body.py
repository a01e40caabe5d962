"""A request's JSON body, read under limits: its media type, its size (413) and how long it takes to arrive (408)."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from ferrum_mac.serve import checks as api

MAX_BODY = 4 * 1024 * 1024  # bytes; a long prompt of a large context is well under it
BODY_TIMEOUT_S = 30  # a client that takes longer to send its body is refused (408)


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body of a JSON request: 415 unless it says it is JSON, 413 past `limit` bytes (from
    Content-Length before reading anything, else counted as it arrives), 408 when it is slow."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise api.ApiError(
            415, "send the body as JSON with 'Content-Type: application/json'", code="unsupported_media_type"
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    try:
        return await asyncio.wait_for(read_at_most(request, limit), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise api.ApiError(
            408, f"the request body took over {BODY_TIMEOUT_S} s to arrive", code="request_timeout"
        ) from None


async def read_at_most(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise api.ApiError(400, "the client went away before sending the whole body", code="incomplete_body") from None
    return b"".join(chunks)


def body_too_large(limit: int) -> api.ApiError:
    return api.ApiError(
        413,
        f"the request body is over {limit} bytes; send a shorter one or start the server with a larger --max-body",
        code="request_too_large",
    )
