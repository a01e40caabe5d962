"""The HTTP API of `ferrum serve` (starlette): OpenAI's /v1/chat/completions, /v1/completions
and /v1/models, plus /health and /metrics. Every request becomes one scheduler request;
its events come back to the event loop through an asyncio queue.

What a client sends is never trusted: bodies are capped (`max_body`, checked before they are
read) and must be JSON; browsers' requests from origins other than loopback (or those given
in `allow_origins`) are refused, so a web page cannot drive the model; parsing, template
rendering and tokenizing run on worker threads, so one big prompt never stalls the others.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import Done, ReasoningDelta, ResponseFormat, TextDelta
from ferrum_mac.errors import FerrumError, KvCapacityError
from ferrum_mac.grammar import (
    GrammarError,
    GrammarMatcher,
    UnsupportedSchemaError,
    compile_grammar,
    tool_call_grammar,
)
from ferrum_mac.grammar.schema import marked_tool_call_grammar
from ferrum_mac.serve import openai_schema as api
from ferrum_mac.serve.guards import ApiKeyCheck, HostCheck, OriginCheck, loopback_host_names
from ferrum_mac.serve.metrics import prometheus_text
from ferrum_mac.serve.request import Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.scheduler import Scheduler
from ferrum_mac.text import prompt_opens_reasoning

MAX_BODY = 4 * 1024 * 1024  # bytes; a long prompt of a large context is well under it
BODY_TIMEOUT_S = 30  # a client that takes longer to send its body is refused (408)
# A text longer than this many characters per token of context is first tested on its head:
# when the head alone overflows the context, the rest need not be tokenized.
CHARS_PER_TOKEN_CHECKED = 8


def build_app(
    scheduler: Scheduler,
    model_name: str,
    api_key: str | None = None,
    *,
    max_body: int = MAX_BODY,
    allow_origins: tuple[str, ...] = (),
    loopback_only: bool = False,
) -> Starlette:
    """The ASGI app; `allow_origins`: web origins besides loopback ones that may call it;
    `loopback_only` (a server bound to loopback): refuse requests whose Host names another machine."""
    server = Server(scheduler, model_name, max_body)
    middleware = [Middleware(OriginCheck, allowed=allow_origins)]
    if loopback_only:
        middleware.insert(0, Middleware(HostCheck, allowed=loopback_host_names(allow_origins)))
    if api_key:
        middleware.append(Middleware(ApiKeyCheck, api_key=api_key))
    return Starlette(
        routes=[
            Route("/v1/chat/completions", server.chat, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers=ERROR_HANDLERS,
    )


class Server:
    def __init__(self, scheduler: Scheduler, model_name: str, max_body: int = MAX_BODY):
        self.scheduler = scheduler
        self.engine = scheduler.engine  # started: it raises otherwise
        self.model_name = model_name
        self.max_body = max_body
        template = self.engine.template
        self.template_names = frozenset(getattr(template, "special_tokens", {}))

    # -- routes ----------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await self._json_body(request)
        messages = api.chat_messages(body)
        opts = self._options(body)
        tools = await run_in_threadpool(api.tool_request, body)  # compiles each parameters schema
        text, ids = await run_in_threadpool(self._chat_prompt, messages, opts.template_kwargs, tools)
        fmt = self.engine.template.tool_format
        prefilled = tools is not None and bool(tools.forced) and text.endswith(fmt.forced_prefix)
        if tools is not None and (tools.forced or opts.response_format is None):
            matcher = await run_in_threadpool(self._tool_matcher, tools, text, prefilled)
        else:
            matcher = await run_in_threadpool(self._matcher, opts.response_format, text)
        call_prefix = fmt.forced_prefix if prefilled else ""
        return await self._answer(
            request,
            ids,
            opts,
            prompt_opens_reasoning(text),
            chat=True,
            tools=tools,
            matcher=matcher,
            call_prefix=call_prefix,
        )

    async def completions(self, request: Request) -> Response:
        body = await self._json_body(request)
        prompt = api.completion_prompt(body)
        opts = self._options(body)
        ids = prompt if isinstance(prompt, list) else await run_in_threadpool(self._encode, prompt, True, "prompt")
        matcher = await run_in_threadpool(self._matcher, opts.response_format, None)
        return await self._answer(request, ids, opts, False, chat=False, matcher=matcher)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise api.ApiError(
                404,
                f"the model '{model_id[:200]}' does not exist; this server has '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_entry())

    async def health(self, request: Request) -> Response:
        if not self.scheduler.alive:
            return JSONResponse(
                {
                    "status": "error",
                    "model": self.model_name,
                    "error": self.scheduler.death or "the scheduler is not running",
                },
                status_code=503,
            )
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def metrics(self, request: Request) -> Response:
        text = prometheus_text(self.scheduler.stats, up=self.scheduler.alive)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # -- one answer ------------------------------------------------------------------------

    def _model_entry(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ferrum",
            "max_model_len": self.scheduler.capacity,
        }

    async def _json_body(self, request: Request) -> dict:
        raw = await read_json_body(request, self.max_body)
        return api.check_body(await run_in_threadpool(api.parse_json, raw))

    def _options(self, body: dict) -> api.Options:
        return api.options(body, self.engine.default_sampling, self.engine.model.config.vocab_size, self.template_names)

    def _chat_prompt(
        self, messages: list[dict], template_kwargs: dict, tools: api.ToolRequest | None = None
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its ids (on a worker thread: both take long on long prompts);
        an answer that must call a tool starts with its family's call opener, unless the model
        reasons first (then the opener is part of the call's grammar, see `_tool_matcher`)."""
        template = self.engine.template
        try:
            text = template.render(
                messages,
                add_generation_prompt=True,
                tools=tools.template_tools() if tools else None,
                **template_kwargs,
            )
            if tools is not None and tools.forced and not self._reasons_before_calling(text):
                text += template.tool_format.forced_prefix
        except FerrumError as e:
            raise api.ApiError(400, str(e), param="messages") from None
        except Exception as e:  # templates index and compare what clients send: a dict where a string goes...
            raise api.ApiError(
                400,
                f"the chat template cannot render these messages ({type(e).__name__}: {str(e)[:200]})",
                param="messages",
            ) from None
        return text, self._encode(text, False, "messages")

    def _matcher(self, fmt: ResponseFormat | None, prompt_text: str | None) -> GrammarMatcher | None:
        """The answer's grammar state for `fmt` (on a worker thread: compiling a schema, and the
        first time the model's grammar vocabulary, take a while); a schema it cannot compile is a 400.
        `prompt_text`: the chat prompt, so a thinking model's grammar starts after its reasoning."""
        if fmt is None:
            return None
        constraints = self.engine.constraints
        try:
            return constraints.matcher(constraints.compile(fmt), prompt_text)
        except UnsupportedSchemaError as e:
            raise api.ApiError(400, str(e), param="response_format", code="unsupported_schema") from None
        except GrammarError as e:
            raise api.ApiError(400, str(e), param="response_format", code="invalid_schema") from None

    def _reasons_before_calling(self, prompt_text: str) -> bool:
        """Whether a required call should wait for the model's reasoning: a thinking prompt, and
        call markers the grammar can write as text (Hermes' tags; not special tokens)."""
        closer = self.engine.template.tool_format.closer
        return closer is not None and bool(self.engine.constraints.start_after(prompt_text))

    def _tool_matcher(self, tools: api.ToolRequest, prompt_text: str, prefilled: bool) -> GrammarMatcher | None:
        """The call's grammar, so its arguments always validate against the function's parameters.
        A required call's JSON comes right after the opener the prompt ends with (`prefilled`), or
        with its markers after the model's reasoning; with "auto" the answer is free until the
        model writes its family's opener, then the one call is constrained (None for Llama's bare
        JSON, whose opener is the call itself)."""
        fmt = self.engine.template.tool_format
        if not tools.forced and not fmt.forced_prefix:
            return None
        constraints = self.engine.constraints
        try:
            if tools.forced and not prefilled and fmt.closer is not None:
                text = marked_tool_call_grammar(tools.forced, fmt.forced_prefix, "\n" + fmt.closer)
                return constraints.matcher(compile_grammar(text, constraints.vocab), prompt_text)
            grammar = compile_grammar(tool_call_grammar(tools.forced or tools.functions), constraints.vocab)
        except GrammarError as e:
            raise api.ApiError(400, str(e), param="tools", code="invalid_schema") from None
        if tools.forced:
            return constraints.matcher(grammar, None)
        return GrammarMatcher(grammar, self.engine.tokenizer.encode(fmt.opener, add_special_tokens=False))

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of `text`, or a 400 as soon as it is clear they cannot fit the context."""
        capacity = self.scheduler.capacity
        head = text[: capacity * CHARS_PER_TOKEN_CHECKED]
        if len(head) < len(text):
            n = len(self.engine.tokenizer.encode(head, add_special_tokens=add_special_tokens))
            if n > capacity:
                raise api.ApiError(
                    400,
                    f"the prompt has over {n} tokens but the context holds {capacity} (prompt and answer); shorten it",
                    param=param,
                    code="context_length_exceeded",
                )
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def _answer(
        self,
        http: Request,
        ids: list[int],
        opts: api.Options,
        opens_reasoning: bool,
        chat: bool,
        tools: api.ToolRequest | None = None,
        matcher: GrammarMatcher | None = None,
        call_prefix: str = "",
    ) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = GenerationRequest(
            ids,
            sampling=opts.sampling,
            max_tokens=opts.max_tokens,
            stop=opts.stop,
            opens_reasoning=opens_reasoning,
            raw=not chat,
            ignore_eos=opts.ignore_eos,
            matcher=matcher,
            emit=lambda event: _put_threadsafe(loop, events, event),
        )
        try:
            handle = self.scheduler.submit(request)
        except KvCapacityError as e:
            raise api.ApiError(
                400, str(e), param="messages" if chat else "prompt", code="context_length_exceeded"
            ) from None
        except FerrumError as e:  # the request's (token ids, settings), or a scheduler that stopped
            if not self.scheduler.alive:
                raise api.ApiError(503, str(e), kind="server_error", code="unavailable") from None
            raise api.ApiError(400, str(e)) from None
        kind = "chat.completion" if chat else "text_completion"
        envelope = api.envelope(kind, api.new_id("chatcmpl" if chat else "cmpl"), self.model_name)
        calls = api.ToolAnswer(tools, self.engine.template.tool_format, call_prefix)
        if opts.stream:
            chunks = stream_chunks(handle, events, envelope, chat, opts.include_usage, calls)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            answer = await unless_disconnected(http, whole_answer(events, envelope, chat, calls))
            return JSONResponse(answer) if answer is not None else Response(status_code=499)
        finally:
            handle.cancel()  # no-op once done; frees the sequence when the client went away


def _put_threadsafe(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, event) -> None:
    """Hand `event` from the scheduler's thread to the request's queue on the event loop."""
    loop.call_soon_threadsafe(events.put_nowait, event)


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


async def whole_answer(events: asyncio.Queue, envelope: dict, chat: bool, calls: api.ToolAnswer | None = None) -> dict:
    calls = calls or api.ToolAnswer(None, None)
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
        message = {"role": "assistant", **calls.message("".join(text))}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        choice = {"index": 0, "message": message, "finish_reason": calls.finish_reason(event)}
    else:
        choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": api.finish_reason(event)}
    return {**envelope, "choices": [choice], "usage": api.usage(event), "stats": api.stats(event)}


async def stream_chunks(
    handle: RequestHandle,
    events: asyncio.Queue,
    envelope: dict,
    chat: bool,
    include_usage: bool,
    calls: api.ToolAnswer | None = None,
) -> AsyncIterator[str]:
    """Server-sent events; when the client goes away starlette cancels this generator, and the
    `finally` cancels the request, so its KV is released at the next step."""
    calls = calls or api.ToolAnswer(None, None)
    kind = envelope["object"] + (".chunk" if chat else "")
    envelope = {**envelope, "object": kind}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choice = (
            {"index": 0, "delta": delta} if chat else {"index": 0, "text": delta.get("content", ""), "logprobs": None}
        )
        choice["finish_reason"] = finish
        return sse({**envelope, "choices": [choice], **extra})

    try:
        if chat:
            yield chunk({"role": "assistant", "content": ""})
        while True:
            event = await events.get()
            if isinstance(event, TextDelta):
                for delta in calls.deltas(event.text):
                    yield chunk(delta)
            elif isinstance(event, ReasoningDelta):
                yield chunk({"reasoning_content": event.text} if chat else {})
            elif isinstance(event, Failed):
                yield sse(api.ApiError(500, event.message, kind="server_error", code="generation_failed").body())
                break
            elif isinstance(event, Done):
                for delta in calls.finish_deltas():
                    yield chunk(delta)
                yield chunk({}, calls.finish_reason(event), stats=api.stats(event))
                if include_usage:
                    yield sse({**envelope, "choices": [], "usage": api.usage(event)})
                break
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


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


# -- errors --------------------------------------------------------------------


async def api_error(request: Request, exc: api.ApiError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(
        api.ApiError(exc.status_code, str(exc.detail), code=code).body(),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug: the usual error body rather than a bare text 500 (the traceback goes to the log)."""
    error = api.ApiError(
        500, f"internal error ({type(exc).__name__}); see the server's log", kind="server_error", code="internal_error"
    )
    return JSONResponse(error.body(), status_code=500)


# Any: starlette types each handler as taking any Exception; each of these takes its own kind.
ERROR_HANDLERS: dict[Any, Any] = {HTTPException: http_error, api.ApiError: api_error, Exception: internal_error}
