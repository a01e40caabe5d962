"""The HTTP API of `ferrum serve` (starlette): OpenAI's /v1/chat/completions, /v1/completions
and /v1/models, plus /health and /metrics. Every request becomes one scheduler request;
its events come back to the event loop through an asyncio queue."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import Done, ReasoningDelta, TextDelta
from ferrum_mac.errors import FerrumError, KvCapacityError
from ferrum_mac.serve import openai_schema as api
from ferrum_mac.serve.metrics import prometheus_text
from ferrum_mac.serve.request import Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.scheduler import Scheduler
from ferrum_mac.text import prompt_opens_reasoning

OPEN_PATHS = ("/health",)


def build_app(scheduler: Scheduler, model_name: str, api_key: str | None = None) -> Starlette:
    server = Server(scheduler, model_name)
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, api.ApiError: api_error},
    )
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    return app


class Server:
    def __init__(self, scheduler: Scheduler, model_name: str):
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.model_name = model_name

    # -- routes ----------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = api.check_body(await json_body(request))
        messages = api.chat_messages(body)
        opts = self._options(body)
        try:
            text = self.engine.template.render(messages, add_generation_prompt=True, **opts.template_kwargs)
        except FerrumError as e:
            raise api.ApiError(400, str(e), param="messages") from None
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return await self._answer(request, ids, opts, prompt_opens_reasoning(text), chat=True)

    async def completions(self, request: Request) -> Response:
        body = api.check_body(await json_body(request))
        prompt = api.completion_prompt(body)
        opts = self._options(body)
        ids = prompt if isinstance(prompt, list) else self.engine.tokenizer.encode(prompt)
        return await self._answer(request, ids, opts, False, chat=False)

    async def models(self, request: Request) -> Response:
        entry = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "ferrum",
                 "max_model_len": self.scheduler.capacity}
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.scheduler.stats), media_type="text/plain; version=0.0.4")

    # -- one answer ------------------------------------------------------------------------

    def _options(self, body: dict) -> api.Options:
        try:
            return api.options(body, self.engine.default_sampling)
        except FerrumError as e:  # a sampling value out of range
            raise api.ApiError(400, str(e), code="invalid_value") from None

    async def _answer(self, http: Request, ids: list[int], opts: api.Options, opens_reasoning: bool, chat: bool) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = GenerationRequest(
            ids, sampling=opts.sampling, max_tokens=opts.max_tokens, stop=opts.stop, opens_reasoning=opens_reasoning,
            raw=not chat, ignore_eos=opts.ignore_eos,
            emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
        )
        try:
            handle = self.scheduler.submit(request)
        except KvCapacityError as e:
            raise api.ApiError(400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded") from None
        except FerrumError as e:
            raise api.ApiError(400, str(e)) from None
        kind = "chat.completion" if chat else "text_completion"
        envelope = api.envelope(kind, api.new_id("chatcmpl" if chat else "cmpl"), self.model_name)
        if opts.stream:
            chunks = stream_chunks(handle, events, envelope, chat, opts.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            answer = await unless_disconnected(http, whole_answer(events, envelope, chat))
            return JSONResponse(answer) if answer is not None else Response(status_code=499)
        finally:
            handle.cancel()  # no-op once done; frees the sequence when the client went away


DISCONNECT_POLL_S = 0.1


async def unless_disconnected(http: Request, work):
    """`work`'s result, or None as soon as the client has gone (then `work` is cancelled).
    Starlette cancels a streaming response's generator on a disconnect, but not a handler
    that is still computing a whole answer: this watches for it."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                return None
    finally:
        task.cancel()


async def whole_answer(events: asyncio.Queue, envelope: dict, chat: bool) -> dict:
    text, reasoning = [], []
    while True:
        event = await events.get()
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, Failed):
            raise api.ApiError(500, event.message, kind="server_error", code="generation_failed")
        elif isinstance(event, Done):
            break
    if chat:
        message = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        choice = {"index": 0, "message": message, "finish_reason": api.finish_reason(event)}
    else:
        choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": api.finish_reason(event)}
    return {**envelope, "choices": [choice], "usage": api.usage(event), "stats": api.stats(event)}


async def stream_chunks(
    handle: RequestHandle, events: asyncio.Queue, envelope: dict, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events; when the client goes away starlette cancels this generator, and the
    `finally` cancels the request, so its KV is released at the next step."""
    kind = envelope["object"] + (".chunk" if chat else "")
    envelope = {**envelope, "object": kind}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta.get("content", ""), "logprobs": None}
        choice["finish_reason"] = finish
        return sse({**envelope, "choices": [choice], **extra})

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            event = await events.get()
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ReasoningDelta):
                yield chunk({"reasoning_content": event.text} if chat else {})
            elif isinstance(event, Failed):
                yield sse(api.ApiError(500, event.message, kind="server_error", code="generation_failed").body())
                break
            elif isinstance(event, Done):
                yield chunk({}, api.finish_reason(event), stats=api.stats(event))
                if include_usage:
                    yield sse({**envelope, "choices": [], "usage": api.usage(event)})
                break
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise api.ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None


# -- errors and the API key --------------------------------------------------------------------


async def api_error(request: Request, exc: api.ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(api.ApiError(exc.status_code, str(exc.detail), code=code).body(), status_code=exc.status_code)


class ApiKeyCheck:
    """401 for any path but /health without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = api.ApiError(401, "incorrect or missing API key; send 'Authorization: Bearer <key>'",
                                     code="invalid_api_key")
                return await JSONResponse(error.body(), status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)
