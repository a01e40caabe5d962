"""The HTTP server of `ferrum serve` (starlette): the protocol-neutral core under its APIs.

Each API module only translates: OpenAI's (`openai_api`), and the Anthropic and Ollama ones
(`anthropic_api`, `ollama_api`, each with a `routes(server) -> list[Route]` that `build_app`
adds; a module adds its import line to `build_app` once it exists). A route reads its body
(`Server.read_json`), checks it into a `ChatCall` (`Server.call_from_openai`, the one validation
layer), and `Server.start` renders the prompt, builds the grammar matcher, submits it to the
model's scheduler and answers with an `Answer` of neutral events (`ferrum_mac.serve.events`),
which the route renders. Errors are `ApiError`s, rendered in the shape of the route's protocol
(`error_shapes`).

What a client sends is never trusted: bodies are capped (`max_body`, checked before they are
read) and must be JSON; browsers' requests from origins other than loopback (or those given
in `allow_origins`) are refused, so a web page cannot drive the model; parsing, template
rendering and tokenizing run on worker threads, so one big prompt never stalls the others.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Mapping, NamedTuple

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ferrum_mac.engine import CallSplitter, Done, LocalEngine, ReasoningDelta, ResponseFormat, TextDelta
from ferrum_mac.engine.prompt import AnswerGrammar, AnswerStart, with_call_opener
from ferrum_mac.errors import FerrumError, KvCapacityError
from ferrum_mac.grammar import GrammarError, GrammarMatcher, UnsupportedSchemaError
from ferrum_mac.serve import openai_schema as api
from ferrum_mac.serve.call import ChatCall, Limits, call_from_openai
from ferrum_mac.serve.error_shapes import error_response, error_shapes
from ferrum_mac.serve.events import AnswerEvent, Finished, ToolCallDelta, calls_of
from ferrum_mac.serve.guards import ApiKeyCheck, HostCheck, OriginCheck, loopback_host_names
from ferrum_mac.serve.metrics import prometheus_text
from ferrum_mac.serve.models import FOREVER, LoadedModel, Models
from ferrum_mac.serve.request import Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.scheduler import Scheduler
from ferrum_mac.text.tool_calls import ToolCall

__all__ = ["Answer", "ClientGone", "Server", "build_app", "error_shapes"]

MAX_BODY = 4 * 1024 * 1024  # bytes; a long prompt of a large context is well under it
BODY_TIMEOUT_S = 30  # a client that takes longer to send its body is refused (408)
# A text longer than this many characters per token of context is first tested on its head:
# when the head alone overflows the context, the rest need not be tokenized.
CHARS_PER_TOKEN_CHECKED = 8
DISCONNECT_POLL_S = 0.1


def build_app(
    models: Models | Scheduler,
    model_name: str | None = None,
    api_key: str | None = None,
    *,
    max_body: int = MAX_BODY,
    allow_origins: tuple[str, ...] = (),
    loopback_only: bool = False,
) -> Starlette:
    """The ASGI app; `allow_origins`: web origins besides loopback ones that may call it;
    `loopback_only` (a server bound to loopback): refuse requests whose Host names another machine.
    `models`: the registry of the models it serves, or the scheduler of its one model (`model_name`)."""
    from ferrum_mac.serve import openai_api

    server = Server(models, model_name, max_body)
    middleware = [Middleware(OriginCheck, allowed=allow_origins)]
    if loopback_only:
        middleware.insert(0, Middleware(HostCheck, allowed=loopback_host_names(allow_origins)))
    if api_key:
        middleware.append(Middleware(ApiKeyCheck, api_key=api_key))
    routes = openai_api.routes(server) + [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
    ]
    from ferrum_mac.serve import ollama_api

    routes += ollama_api.routes(server)
    from ferrum_mac.serve import anthropic_api

    routes += anthropic_api.routes(server)
    return Starlette(routes=routes, middleware=middleware, exception_handlers=ERROR_HANDLERS)


class ClientGone(Exception):
    """The client went away while its whole answer was computed (answered 499, which nobody reads)."""


class Whole(NamedTuple):
    """A whole answer: its text (calls' markup taken out), reasoning, tool calls and last event."""

    text: str
    reasoning: str
    calls: list[ToolCall]
    done: Finished


class Answer:
    """One request's answer as neutral events: TextDelta, ReasoningDelta and ToolCallDelta, then
    one `Finished` (a `Done` with its finish reason) or one `Failed`. Iterate `events()` once to
    stream, or await `whole()`; either way the request is cancelled (its KV freed) if the client
    goes, and `cancel()` does it at once."""

    def __init__(
        self,
        http: Request | None,
        handle: RequestHandle,
        queue: asyncio.Queue,
        model_name: str,
        prompt_tokens: int,
        calls: CallSplitter,
        on_end=None,
    ):
        self.http = http
        self.on_end = on_end or (lambda: None)  # the request no longer holds its model
        self.handle = handle
        self.queue = queue
        self.model_name = model_name
        self.prompt_tokens = prompt_tokens
        self.calls = calls

    def cancel(self) -> None:
        """Stop generating after the current step and free the sequence (a no-op once done)."""
        self.handle.cancel()
        self.on_end()

    async def events(self) -> AsyncIterator[AnswerEvent]:
        """The answer's events. A stream route should also `cancel()` in its own `finally`:
        starlette cancels the route's generator when the client goes, not this one."""
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, TextDelta):
                    for piece in streamed(self.calls.feed(event.text)):
                        yield piece
                elif isinstance(event, ReasoningDelta):
                    yield event
                elif isinstance(event, Failed):
                    yield event
                    return
                elif isinstance(event, Done):
                    for piece in streamed(self.calls.finish()):
                        yield piece
                    yield Finished.of(event, bool(self.calls.calls))
                    return
        finally:
            self.cancel()

    async def whole(self) -> Whole:
        """The whole answer; `ClientGone` as soon as the client has gone (the request is then
        cancelled); a failed generation is a 500."""
        try:
            if self.http is None:
                return await self._collect()
            return await unless_disconnected(self.http, self._collect())
        finally:
            self.cancel()

    async def _collect(self) -> Whole:
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCallDelta] = []
        async for event in self.events():
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ToolCallDelta):
                calls.append(event)
            elif isinstance(event, Failed):
                raise api.ApiError(500, event.message, kind="server_error", code="generation_failed")
            elif isinstance(event, Finished):
                return Whole("".join(text), "".join(reasoning), calls_of(calls), event)
        raise api.ApiError(500, "the answer ended without a last event", kind="server_error", code="internal_error")


def streamed(pieces: list[TextDelta | ToolCall | ToolCallDelta]) -> list[TextDelta | ToolCallDelta]:
    """The pieces of a splitter that streams its calls' arguments (it makes no whole `ToolCall`)."""
    return [p for p in pieces if not isinstance(p, ToolCall)]


class Server:
    """The core every API module drives: a call in, an `Answer` out, on the model it names
    (`models`; a bare scheduler is a server of that one model, whatever name a request gives)."""

    def __init__(self, models: Models | Scheduler, model_name: str | None = None, max_body: int = MAX_BODY):
        if isinstance(models, Scheduler):
            models = Models(LoadedModel(model_name or models.engine.name, models, 0, FOREVER))
        self.models = models
        self.model_name = models.default_name
        self.max_body = max_body

    # -- the default model (the one `ferrum serve MODEL` names) -------------------------------

    @property
    def default(self) -> LoadedModel:
        """The default model, when loaded (503 while keep-alive has it unloaded)."""
        model = self.models.get_loaded(None)
        if model is None:
            raise api.ApiError(
                503, f"the model '{self.model_name}' is not loaded; a request for it loads it", code="unavailable"
            )
        return model

    @property
    def scheduler(self) -> Scheduler:
        return self.default.scheduler

    @property
    def engine(self) -> LocalEngine:
        return self.default.engine

    @property
    def prompting(self) -> "Prompting":
        return self.prompting_of(self.default)

    def prompting_of(self, model: LoadedModel) -> "Prompting":
        if model.prompting is None:
            model.prompting = Prompting(model.engine, lambda: model.scheduler.capacity)
        return model.prompting

    # -- for the API modules -----------------------------------------------------------------

    async def read_json(self, request: Request) -> Any:
        """The request's body as JSON: 415 unless it says it is JSON, 413 past `max_body`, 408
        when slow, 400 for anything but strict JSON of sane depth and valid Unicode."""
        raw = await read_json_body(request, self.max_body)
        return await run_in_threadpool(api.parse_json, raw)

    async def call_from_openai(
        self, body: dict, renames: Mapping[str, str] | None = None, *, chat: bool = True
    ) -> ChatCall:
        """`body` (OpenAI-shaped) checked into a call against the model it names."""
        model = body.get("model") if isinstance(body, dict) else None
        limits = await self.limits(model if isinstance(model, str) else None)
        return await run_in_threadpool(call_from_openai, body, limits, renames, chat=chat)

    async def limits(self, model: str | None = None) -> Limits:
        """What a request for `model` is checked against (it loads the model; 404 for a name
        this server does not have)."""
        loaded = await self.models.acquire(model)
        try:
            return self.prompting_of(loaded).limits()
        finally:
            self.models.release(loaded)

    async def context(self, model: str | None = None) -> int:
        """The context (tokens per sequence) of the model `model` names (it loads the model)."""
        loaded = await self.models.acquire(model)
        try:
            return loaded.context
        finally:
            self.models.release(loaded)

    async def start(self, http: Request | None, call: ChatCall) -> Answer:
        """Render the call's prompt, build its matcher, submit it to its model's scheduler (loaded
        first if need be); `http` (when given) is watched so a whole answer stops when its client goes."""
        model = await self.models.acquire(call.model, call.keep_alive_s)
        done = Once(lambda: self.models.release(model))
        try:
            return await self._start(http, call, model, done)
        except BaseException:
            done()
            raise

    async def _start(self, http: Request | None, call: ChatCall, model: LoadedModel, done: "Once") -> Answer:
        prompting = self.prompting_of(model)
        prepared = await run_in_threadpool(prompting.prepare, call)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        options = call.options

        def emit(event) -> None:  # on the scheduler's thread
            _put_threadsafe(loop, queue, event)
            if isinstance(event, (Done, Failed)):
                done()

        request = GenerationRequest(
            prepared.ids,
            sampling=options.sampling,
            max_tokens=options.max_tokens,
            stop=options.stop,
            opens_reasoning=prepared.start.opens_reasoning,
            raw=call.messages is None,
            ignore_eos=options.ignore_eos,
            matcher=prepared.matcher,
            emit=emit,
            speculate=call.speculate,
        )
        handle = _submit(model.scheduler, request, "messages" if call.messages is not None else "prompt")
        tools = call.tools
        fmt = prompting.engine.template.tool_format if tools is not None else None
        calls = CallSplitter(fmt, tools is None or tools.parallel, prepared.start.call_prefix, stream_arguments=True)
        return Answer(http, handle, queue, model.name, len(prepared.ids), calls, done)

    async def count_tokens(self, call: ChatCall) -> int:
        """How many tokens the call's prompt is, as `start` would render it."""
        model = await self.models.acquire(call.model, call.keep_alive_s)
        try:
            return await run_in_threadpool(self.prompting_of(model).count_tokens, call)
        finally:
            self.models.release(model)

    # -- kept for callers of the single-model server ----------------------------------------

    def _tool_matcher(self, tools: api.ToolRequest, prompt_text: str, prefilled: bool) -> GrammarMatcher | None:
        return self.prompting.answer_matcher(None, tools, prompt_text, AnswerStart(prefilled=prefilled))

    # -- routes every protocol shares --------------------------------------------------------

    async def health(self, request: Request) -> Response:
        """503 when a loaded model's scheduler has stopped (an unloaded model is no fault)."""
        for model in self.models.loaded():
            if not model.scheduler.alive:
                return JSONResponse(
                    {
                        "status": "error",
                        "model": model.name,
                        "error": model.scheduler.death or "the scheduler is not running",
                    },
                    status_code=503,
                )
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def metrics(self, request: Request) -> Response:
        """The default model's figures (the last it had, while keep-alive has it unloaded)."""
        model = self.models.get_loaded(None)
        stats = model.stats if model is not None else self.models.last_stats[self.model_name]
        up = model is None or model.scheduler.alive
        return PlainTextResponse(prometheus_text(stats, up=up), media_type="text/plain; version=0.0.4")


class Once:
    """A callable that runs `action` the first time it is called, from any thread."""

    def __init__(self, action):
        self._action = action
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            action, self._action = self._action, None
        if action is not None:
            action()


def _submit(scheduler: Scheduler, request: GenerationRequest, param: str) -> RequestHandle:
    try:
        return scheduler.submit(request)
    except KvCapacityError as e:
        raise api.ApiError(400, str(e), param=param, code="context_length_exceeded") from None
    except FerrumError as e:  # the request's (token ids, settings), or a scheduler that stopped
        if not scheduler.alive:
            raise api.ApiError(503, str(e), kind="server_error", code="unavailable") from None
        raise api.ApiError(400, str(e)) from None


class Prompting:
    """How calls become prompts for one model: the rendered prompt's ids and the grammar state
    that enforces `response_format` or the tools' call shapes. All of it may take long
    (templates, tokenizing long prompts, compiling schemas): call it on a worker thread."""

    def __init__(self, engine: LocalEngine, capacity):
        self.engine = engine
        self._capacity = capacity  # a callable: the scheduler knows it once its model is loaded
        self.template_names = frozenset(getattr(engine.template, "special_tokens", {}))

    @property
    def capacity(self) -> int:
        return self._capacity()

    def limits(self) -> Limits:
        return Limits(self.engine.default_sampling, self.engine.model.config.vocab_size, self.template_names)

    def prepare(self, call: ChatCall) -> "Prepared":
        if call.messages is None:
            ids = self._completion_ids(call)
            return Prepared(ids, self.answer_matcher(call.options.response_format, None, None, AnswerStart()))
        tools = call.tools
        text, ids = self.chat_prompt(call.messages, call.options.template_kwargs, tools)
        start = AnswerStart.of(text, tools, self.engine.template.tool_format)
        return Prepared(ids, self.answer_matcher(call.options.response_format, tools, text, start), start)

    def count_tokens(self, call: ChatCall) -> int:
        if call.messages is None:
            return len(self._completion_ids(call))
        return len(self.chat_prompt(call.messages, call.options.template_kwargs, call.tools)[1])

    def _completion_ids(self, call: ChatCall) -> list[int]:
        prompt = call.prompt if call.prompt is not None else ""
        return list(prompt) if isinstance(prompt, list) else self.encode(prompt, True, "prompt")

    def chat_prompt(
        self, messages: list[dict], template_kwargs: dict, tools: api.ToolRequest | None = None
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its ids; an answer that must call a tool starts with its
        family's call opener, unless the model reasons first (then the opener is part of the
        call's grammar, see `tool_matcher`)."""
        template = self.engine.template
        try:
            text = template.render(
                messages,
                add_generation_prompt=True,
                tools=tools.template_tools() if tools else None,
                **template_kwargs,
            )
            text = with_call_opener(self.engine.constraints, template.tool_format, tools, text)
        except FerrumError as e:
            raise api.ApiError(400, str(e), param="messages") from None
        except Exception as e:  # templates index and compare what clients send: a dict where a string goes...
            raise api.ApiError(
                400,
                f"the chat template cannot render these messages ({type(e).__name__}: {str(e)[:200]})",
                param="messages",
            ) from None
        return text, self.encode(text, False, "messages")

    def answer_matcher(
        self, fmt: ResponseFormat | None, tools: api.ToolRequest | None, prompt_text: str | None, start: AnswerStart
    ) -> GrammarMatcher | None:
        """The answer's grammar state (`engine.prompt.AnswerGrammar`: compiling a schema, and the
        first time the model's grammar vocabulary, take a while); a schema it cannot compile is a
        400 naming `response_format` or `tools`. `prompt_text`: the chat prompt (None: a
        completion), so a thinking model's grammar starts after its reasoning."""
        try:
            grammar = AnswerGrammar(self.engine.constraints, self.engine.template.tool_format, fmt, tools)
        except GrammarError as e:
            raise format_error(e) from None
        try:
            return grammar.matcher(prompt_text, start)
        except GrammarError as e:
            if grammar.for_calls:
                raise api.ApiError(400, str(e), param="tools", code="invalid_schema") from None
            raise format_error(e) from None

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of `text`, or a 400 as soon as it is clear they cannot fit the context."""
        capacity = self.capacity
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


class Prepared(NamedTuple):
    """A call made ready for the scheduler."""

    ids: list[int]
    matcher: GrammarMatcher | None
    start: AnswerStart = AnswerStart()  # what the answer starts inside (a <think>, a call's opener)


def format_error(e: GrammarError) -> api.ApiError:
    """A `response_format` the model's grammar cannot take, as a 400."""
    code = "unsupported_schema" if isinstance(e, UnsupportedSchemaError) else "invalid_schema"
    return api.ApiError(400, str(e), param="response_format", code=code)


def _put_threadsafe(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, event) -> None:
    """Hand `event` from the scheduler's thread to the request's queue on the event loop."""
    loop.call_soon_threadsafe(queue.put_nowait, event)


async def unless_disconnected(http: Request, work):
    """`work`'s result; `ClientGone` as soon as the client has gone (then `work` is cancelled).
    Starlette cancels a streaming response's generator on a disconnect, but not a handler
    that is still computing a whole answer: this watches for it."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise ClientGone()
    finally:
        task.cancel()


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
