"""The protocol-neutral core of `ferrum serve`: a checked call in, an `Answer` of neutral events out.

Each API module (`serve.protocols`) only translates. A route reads its body (`Server.read_json`),
checks it into a `ChatCall` (`Server.call_from_openai`, the one validation layer), and
`Server.start` renders the prompt and builds the grammar matcher (`Prompting`, on a worker
thread, so one big prompt never stalls the others), submits it to the model's scheduler and
answers with an `Answer` of neutral events (`serve.events`), which the route renders. Errors are
`ApiError`s, rendered in the shape of the route's protocol (`serve.api_errors`).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Mapping, NamedTuple

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ferrum_mac.engine import CallSplitter, Done, LocalEngine, ReasoningDelta, TextDelta, TokenLogprob
from ferrum_mac.engine.prompt import AnswerStart
from ferrum_mac.errors import FerrumError, KvCapacityError
from ferrum_mac.grammar import GrammarMatcher
from ferrum_mac.grammar.guard import GrammarGuard, GuardLimits
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.batching.models import FOREVER, LoadedModel, Models, served_name
from ferrum_mac.serve.batching.request import Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.batching.scheduler import Scheduler
from ferrum_mac.serve.body import MAX_BODY, read_json_body
from ferrum_mac.serve.call import ChatCall, Limits, call_from_openai
from ferrum_mac.serve.events import AnswerEvent, Finished, ToolCallDelta, calls_of
from ferrum_mac.serve.metrics import grammar_lines, prometheus_text
from ferrum_mac.serve.prompting import Prompting, format_error
from ferrum_mac.text.tool_calls import ToolCall

DISCONNECT_POLL_S = 0.1


class ClientGone(Exception):
    """The client went away while its whole answer was computed (answered 499, which nobody reads)."""


class Whole(NamedTuple):
    """A whole answer: its text (calls' markup taken out), reasoning, tool calls and last event,
    and its tokens' log-probabilities when the request asked for them."""

    text: str
    reasoning: str
    calls: list[ToolCall]
    done: Finished
    logprobs: list[TokenLogprob] = []


class Answer:
    """One request's answer as neutral events: TextDelta, ReasoningDelta and ToolCallDelta (each
    token's `TokenLogprob` before its text, when asked for), then one `Finished` (a `Done` with
    its finish reason) or one `Failed`. Iterate `events()` once to
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
        self.echo = ""  # a completion that asked for `echo`: its prompt's text

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache: final once the first event has come."""
        return self.handle.cached_tokens

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
                elif isinstance(event, (ReasoningDelta, TokenLogprob)):
                    yield event
                elif isinstance(event, Failed):
                    yield event
                    return
                elif isinstance(event, Done):
                    for piece in streamed(self.calls.finish(event.stop_reason)):
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
        logprobs: list[TokenLogprob] = []
        async for event in self.events():
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, TokenLogprob):
                logprobs.append(event)
            elif isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ToolCallDelta):
                calls.append(event)
            elif isinstance(event, Failed):
                raise api.ApiError(500, event.message, kind="server_error", code="generation_failed")
            elif isinstance(event, Finished):
                return Whole("".join(text), "".join(reasoning), calls_of(calls), event, logprobs)
        raise api.ApiError(500, "the answer ended without a last event", kind="server_error", code="internal_error")


def streamed(pieces: list[TextDelta | ToolCall | ToolCallDelta]) -> list[TextDelta | ToolCallDelta]:
    """The pieces of a splitter that streams its calls' arguments (it makes no whole `ToolCall`)."""
    return [p for p in pieces if not isinstance(p, ToolCall)]


class Server:
    """The core every API module drives: a call in, an `Answer` out, on the model it names
    (`models`; a bare scheduler is a server of that one model, whatever name a request gives)."""

    def __init__(
        self,
        models: Models | Scheduler,
        model_name: str | None = None,
        max_body: int = MAX_BODY,
        grammar_limits: GuardLimits = GuardLimits(),
    ):
        if isinstance(models, Scheduler):
            models = Models(LoadedModel(model_name or served_name(models.engine.name), models, 0, FOREVER))
        self.models = models
        self.model_name = models.default_name
        self.max_body = max_body
        self.grammar_guard = GrammarGuard(grammar_limits)

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
    def prompting(self) -> Prompting:
        return self.prompting_of(self.default)

    def prompting_of(self, model: LoadedModel) -> Prompting:
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
        await self.check_grammars(http, call)
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
            call_tokens=prepared.call_tokens,
            emit=emit,
            logprobs=options.logprobs,
            speculate=call.speculate,
        )
        handle = _submit(model.scheduler, request, "messages" if call.messages is not None else "prompt")
        tools = call.tools
        fmt = prompting.engine.template.tool_format if tools is not None else None
        calls = CallSplitter(fmt, tools is None or tools.parallel, prepared.start.call_prefix, stream_arguments=True)
        answer = Answer(http, handle, queue, model.name, len(prepared.ids), calls, done)
        if options.echo:
            prompt = call.prompt
            answer.echo = prompt if isinstance(prompt, str) else prompting.engine.tokenizer.decode(prepared.ids)
        return answer

    async def check_grammars(self, http: Request | None, call: ChatCall) -> None:
        """Check the grammars `call` needs within the guard's bounds, before the server compiles
        them (a 400 for one it cannot take or that is too complex); `ClientGone`, its check
        stopped, as soon as the client has gone."""
        checks = await run_in_threadpool(Prompting.grammar_checks, call)  # a big schema takes a while to read
        if not checks:
            return
        work = self.grammar_guard.check([(c.text, c.what) for c in checks])
        errors = await (work if http is None else unless_disconnected(http, work))
        for check, error in zip(checks, errors):
            if error is not None:
                raise format_error(error, check.param)

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
        """503 when a loaded model's scheduler has stopped (an unloaded model is no fault) or the
        default model is unloaded and its files are gone; "degraded" with a warning when a
        loaded model's files were deleted (it answers, but cannot be loaded again). Open
        without the API key, so it names models by name only, never by path."""
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
        gone = await run_in_threadpool(self.models.gone)
        if not gone:
            return JSONResponse({"status": "ok", "model": self.model_name})
        warnings = [f"the files of the model '{name}' were deleted while this server ran" for name in gone]
        if self.model_name in gone and self.models.get_loaded(None) is None:
            return JSONResponse({"status": "error", "model": self.model_name, "error": warnings[0]}, status_code=503)
        return JSONResponse({"status": "degraded", "model": self.model_name, "warnings": warnings})

    async def metrics(self, request: Request) -> Response:
        """The default model's figures (the last it had, while keep-alive has it unloaded)."""
        model = self.models.get_loaded(None)
        stats = model.stats if model is not None else self.models.last_stats[self.model_name]
        up = model is None or model.scheduler.alive
        text = prometheus_text(stats, up=up) + grammar_lines(self.grammar_guard.stats)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


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
