"""Ollama's API on `ferrum serve`: /api/chat, /api/generate, /api/tags, /api/show, /api/ps,
/api/pull, /api/delete, /api/version, and `GET /` ("Ollama is running", which clients probe).

This module only translates. A chat or generate body becomes an OpenAI-shaped body that passes
the same checks as /v1/chat/completions (`call.call_from_openai`), so a limit or a fix applies to
every protocol; the checks here are Ollama's own (its field types, `options`, `keep_alive`).
Unknown `options` keys are ignored, as Ollama ignores them, but a known one of the wrong type is
a 400. An `options.num_ctx` below the prompt keeps the newest messages that fit, as Ollama
does (`fit_num_ctx`). The core's neutral events become NDJSON objects (one JSON object a line, the last with
`done: true` and Ollama's counts and nanosecond durations), or one object with `stream: false`.
Errors on these routes take Ollama's shape, `{"error": "message"}`.

Model names are the store's (`smollm2:135m`, `org/name`) or the server's default; a `:latest`
suffix is accepted and dropped. Not honoured: images (a 400 until the models read them),
`suffix` (fill-in-the-middle), `template` and `context` on /api/generate.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import numbers
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import ReasoningDelta, TextDelta, TokenLogprob
from ferrum_mac.engine.defaults import sampling_defaults
from ferrum_mac.errors import FerrumError, ModelNotFoundError
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.body import BODY_TIMEOUT_S, body_too_large, read_at_most
from ferrum_mac.serve.api_errors import error_shapes, hide_paths
from ferrum_mac.serve.batching.models import files_gone
from ferrum_mac.serve.events import Finished, ToolCallDelta, calls_of, finish_of, logprob_entries
from ferrum_mac.serve.batching.models import keep_alive_seconds
from ferrum_mac.serve.protocols.ollama_models import (
    PULL_DONE,
    QueueProgress,
    iso_time,
    local_entry,
    pull_updates,
    start_pull,
)
from ferrum_mac.serve.protocols.ollama_models import show_body, tag_entry
from ferrum_mac.serve.batching.request import Failed
from ferrum_mac.store import LocalModel, Removal, parse_name
from ferrum_mac.store.remove import plan_stored_removal
from ferrum_mac.store.in_use import ModelInUseError
from ferrum_mac.store.resolve import looks_like_path
from ferrum_mac.store.bundled import bundled_sampling

# The Ollama release whose API these answers follow; clients compare it to gate features.
OLLAMA_VERSION = "0.13.0"
NDJSON = "application/x-ndjson"

# Ollama's option -> (the OpenAI body's field, the JSON type Ollama requires).
OPTIONS: dict[str, tuple[str | None, type | tuple[type, ...]]] = {
    "temperature": ("temperature", numbers.Real),
    "top_p": ("top_p", numbers.Real),
    "top_k": ("top_k", int),
    "min_p": ("min_p", numbers.Real),
    "seed": ("seed", int),
    "num_predict": ("max_completion_tokens", int),
    "stop": ("stop", (list, str)),
    "repeat_penalty": ("repetition_penalty", numbers.Real),
    "presence_penalty": ("presence_penalty", numbers.Real),
    "frequency_penalty": ("frequency_penalty", numbers.Real),
    "speculate": ("speculate", str),  # ferrum's own: auto, ngram or off
    # checked here, applied after the OpenAI checks (they have no OpenAI field)
    "repeat_last_n": (None, int),
    "num_ctx": (None, int),
    # known to Ollama, no use to ferrum: their types are checked, their values ignored
    "num_keep": (None, int),
    "typical_p": (None, numbers.Real),
    "tfs_z": (None, numbers.Real),
    "mirostat": (None, int),
    "mirostat_tau": (None, numbers.Real),
    "mirostat_eta": (None, numbers.Real),
    "penalize_newline": (None, bool),
    "numa": (None, bool),
    "num_batch": (None, int),
    "num_gpu": (None, int),
    "main_gpu": (None, int),
    "low_vram": (None, bool),
    "use_mmap": (None, bool),
    "use_mlock": (None, bool),
    "num_thread": (None, int),
}
# The OpenAI body's field -> the Ollama field a client sent it as (for error messages).
RENAMES = {
    **{field: f"options.{name}" for name, (field, _) in OPTIONS.items() if field},
    "response_format": "format",
    "chat_template_kwargs": "think",
}
TYPE_NAMES = {numbers.Real: "a number", int: "an integer", bool: "true or false", str: "a string"}


def bad(message: str, status: int = 400) -> api.ApiError:
    return api.ApiError(status, message)


def error_body(error: api.ApiError) -> dict:
    return {"error": error.message}


# -- request fields ------------------------------------------------------------------------------


def model_name(body: dict) -> str:
    """The model the body names (`model`, or `name` as older clients send it), without `:latest`."""
    name = body.get("model", body.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise bad("model is required")
    return name.strip().removesuffix(":latest")


def name_sent(body: dict) -> str:
    """The model's name as the client wrote it (answers echo it, as Ollama's do)."""
    name = body.get("model", body.get("name"))
    return name if isinstance(name, str) else ""


def stream_wanted(body: dict) -> bool:
    """Ollama streams unless told `stream: false`."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false")
    return stream is not False


def check_options(options) -> dict:
    """`options` by name, each of the type Ollama requires; unknown keys are dropped."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise bad("options must be an object")
    checked = {}
    for name, value in options.items():
        if name not in OPTIONS or value is None:
            continue
        kind = OPTIONS[name][1]
        if name == "stop":
            if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))):
                raise bad("options.stop must be a string or an array of strings")
        elif not _is(value, kind):
            raise bad(f"options.{name} must be {TYPE_NAMES[kind]}")  # type: ignore[index]
        checked[name] = int(value) if kind is int else value
    return checked


def _is(value, kind) -> bool:
    if isinstance(value, bool):
        return kind is bool
    if kind is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, kind)


def sampling_fields(options: dict) -> dict:
    """The OpenAI body's fields for Ollama's checked `options`."""
    fields = {OPTIONS[name][0]: value for name, value in options.items() if OPTIONS[name][0]}
    predict = options.get("num_predict")
    if predict is not None:
        if predict in (-1, -2):  # no limit / fill the context: the server's own bounds apply
            del fields["max_completion_tokens"]
        elif predict < 1:
            raise bad("options.num_predict must be a positive count, -1 (no limit) or -2 (fill the context)")
    if options.get("seed") == -1:  # llama.cpp's "random seed"
        del fields["seed"]
    return fields


def logprobs_field(body: dict, chat: bool) -> dict:
    """Ollama's `logprobs` (true or false) and `top_logprobs` as the OpenAI body's: a chat's, or
    for a raw prompt a completion's `logprobs` count (the shared checks bound them)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise bad("logprobs must be true or false")
    if not asked:
        return {}
    if not chat:
        return {"logprobs": 0 if top is None else top}
    return {"logprobs": True} if top is None else {"logprobs": True, "top_logprobs": top}


def format_field(fmt) -> dict:
    """`format`: "json" (any JSON object) or a JSON schema, as OpenAI's `response_format`."""
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise bad('format must be "json" or a JSON schema object')


def think_field(think) -> dict:
    """`think`: true/false (or gpt-oss's "low"/"medium"/"high"), as the template's own switches."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if think in ("low", "medium", "high"):
        return {"chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": think}}
    raise bad('think must be true, false, "low", "medium" or "high"')


def context_limit(options: dict, capacity: int) -> None:
    """`num_ctx` is accepted up to the model's context; beyond it is a clear 400, not a silent cut."""
    num_ctx = options.get("num_ctx")
    if num_ctx is not None and not 0 < num_ctx <= capacity:
        raise bad(f"options.num_ctx is {num_ctx}; this model's context holds at most {capacity} tokens")


async def fit_num_ctx(server, call, num_ctx: int | None) -> None:
    """Ollama's `num_ctx` below the prompt: as Ollama does, the chat keeps its system messages and
    the newest messages that fit in `num_ctx` tokens (the last always); a prompt that cannot fit
    even so (the newest message alone, a generate prompt) is a 400 rather than Ollama's cut of
    the prompt's tokens. The longest fitting tail is found by halving, a render each."""
    if num_ctx is None:
        return
    needed = await server.count_tokens(call)
    messages = call.messages
    if needed <= num_ctx:
        return
    if messages is None:
        raise bad(
            f"the prompt needs {needed} tokens, more than options.num_ctx ({num_ctx}); raise num_ctx or shorten it"
        )

    def kept(start: int) -> list[dict]:
        return [m for m in messages[:start] if m.get("role") == "system"] + messages[start:]

    fits, cut = len(messages) - 1, 0  # the tail from `fits` may fit; from `cut` it does not
    while fits - cut > 1:
        start = (fits + cut) // 2
        if await server.count_tokens(dataclasses.replace(call, messages=kept(start))) <= num_ctx:
            fits = start
        else:
            cut = start
    call.messages = kept(fits)
    needed = await server.count_tokens(call)
    if needed > num_ctx:
        raise bad(
            f"the newest message needs {needed} prompt tokens, more than options.num_ctx ({num_ctx}); "
            "raise num_ctx or shorten the message"
        )


def penalty_window(options: dict, capacity: int) -> int | None:
    """`repeat_last_n`: tokens the repetition penalty looks back over (-1: the whole context)."""
    last_n = options.get("repeat_last_n")
    if last_n is None:
        return None
    if last_n < -1:
        raise bad("options.repeat_last_n must be 0 (off), a count of tokens or -1 (the whole context)")
    return options.get("num_ctx", capacity) if last_n == -1 else min(last_n, capacity)


# -- messages ------------------------------------------------------------------------------------


def chat_messages(messages) -> list[dict]:
    """Ollama's messages as OpenAI's: tool calls carry their arguments as JSON text and an id,
    and a tool message answers the earliest call of its `tool_name` not yet answered."""
    if not isinstance(messages, list):
        raise bad("messages must be an array")
    out: list[dict] = []
    pending: list[tuple[str, str]] = []  # (call id, function name) of calls not yet answered
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role")
        if m.get("images"):
            raise bad(f"messages[{i}] has images; the models this server runs read text only")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string")
        message: dict[str, Any] = {"role": m["role"], "content": content or ""}
        if m["role"] == "assistant":
            if isinstance(m.get("thinking"), str) and m["thinking"]:
                message["reasoning_content"] = m["thinking"]
            if m.get("tool_calls"):
                message["tool_calls"] = _assistant_calls(m["tool_calls"], i)
                pending += [(c["id"], c["function"]["name"]) for c in message["tool_calls"]]
        elif m["role"] == "tool":
            message["tool_call_id"] = _answered_call(m, i, pending)
        out.append(message)
    return out


def _assistant_calls(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be an array")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"messages[{i}].tool_calls[{j}] must be {{'function': {{'name': str, 'arguments': {{...}}}}}}")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, dict):
            raise bad(f"messages[{i}].tool_calls[{j}].function.arguments must be an object")
        call_id = call.get("id") if isinstance(call.get("id"), str) and call["id"] else f"call_{i}_{j}"
        out.append(
            {
                "id": call_id,
                "type": "function",
                "function": {"name": function["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    return out


def _answered_call(message: dict, i: int, pending: list[tuple[str, str]]) -> str:
    given = message.get("tool_call_id")
    name = message.get("tool_name")
    for k, (call_id, function) in enumerate(pending):
        if call_id == given or (given is None and (name is None or name == function)):
            del pending[k]
            return call_id
    if isinstance(given, str):
        return given  # the core names the call it cannot find
    raise bad(
        f"messages[{i}] (role tool) answers no earlier assistant tool call"
        + (f" of {str(name)[:64]!r}" if name is not None else "")
    )


def tools_field(tools) -> dict:
    """`tools` are OpenAI's function tools already; the model chooses whether to call one."""
    if tools is None or tools == []:
        return {}
    return {"tools": tools}


def chat_body(body: dict) -> dict:
    """An /api/chat body as the OpenAI-shaped body the core checks."""
    options = check_options(body.get("options"))
    return {
        "model": model_name(body),
        "messages": chat_messages(body.get("messages")),
        **sampling_fields(options),
        **format_field(body.get("format")),
        **think_field(body.get("think")),
        **tools_field(body.get("tools")),
        **logprobs_field(body, chat=True),
    }


def generate_body(body: dict) -> dict:
    """An /api/generate body as an OpenAI chat body (the prompt a user message after `system`),
    or with `raw` a completion body (the prompt as it is, no template)."""
    for name, why in (("suffix", "fill-in-the-middle"), ("template", "a template per request")):
        if body.get(name):
            raise bad(f"{name} is not supported by this server ({why}); send the prompt alone")
    if body.get("context"):
        raise bad("context is not supported by this server; send the conversation to /api/chat instead")
    if body.get("images"):
        raise bad("images are not supported: the models this server runs read text only")
    prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw")
    if not isinstance(prompt, str):
        raise bad("prompt must be a string")
    if system is not None and not isinstance(system, str):
        raise bad("system must be a string")
    if raw is not None and not isinstance(raw, bool):
        raise bad("raw must be true or false")
    options = check_options(body.get("options"))
    fields = {"model": model_name(body), **sampling_fields(options), **format_field(body.get("format"))}
    if raw:
        if system:
            raise bad("system has no place in a raw prompt; write it into the prompt")
        return {**fields, "prompt": prompt, **logprobs_field(body, chat=False)}
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return {**fields, "messages": messages, **think_field(body.get("think")), **logprobs_field(body, chat=True)}


# -- answers -------------------------------------------------------------------------------------


def now_text() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def final_fields(done, total_s: float, load_s: float = 0.0) -> dict:
    """The last object's `done_reason`, counts and durations (nanoseconds, as Ollama reports)."""
    decode_s = (done.generated_tokens - 1) / done.decode_tps if done.decode_tps and done.generated_tokens > 1 else 0.0
    return {
        "done": True,
        "done_reason": done_reason(done),
        "total_duration": nanoseconds(total_s),
        "load_duration": nanoseconds(load_s),
        "prompt_eval_count": done.prompt_tokens,
        "prompt_eval_duration": nanoseconds(done.ttft_s),
        "eval_count": done.generated_tokens,
        "eval_duration": nanoseconds(decode_s),
    }


def done_reason(done) -> str:
    """Ollama says "length" for a cut answer and "stop" for the rest, tool calls included."""
    return "length" if finish_of(done) == "length" else "stop"


def ollama_call(call, index: int) -> dict:
    """A whole call (`calls_of` makes no other) as Ollama sends it: `arguments` an object, not JSON text."""
    return {"id": call.id, "function": {"index": index, "name": call.name, "arguments": json.loads(call.arguments)}}


class OllamaAnswer:
    """Neutral answer events -> Ollama objects, for /api/chat (`chat`) or /api/generate.
    Tool calls are gathered from their pieces and sent whole, in one object before the last;
    tokens' log-probabilities (`logprobs`: asked for) go with the next object sent."""

    def __init__(self, model: str, chat: bool, show_thinking: bool = True, load_s: float = 0.0, logprobs: bool = False):
        self.model, self.chat, self.show_thinking = model, chat, show_thinking
        self.load_s = load_s  # the time this request waited for its model to load
        self.calls: dict[int, list[ToolCallDelta]] = {}
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None  # those not sent yet

    def piece(self, event) -> dict | None:
        """The object for one event (None: nothing to send yet); a Failed event raises."""
        if isinstance(event, TokenLogprob) and self.logprobs is not None:
            self.logprobs.append(event)
            return None
        if isinstance(event, TextDelta):
            return self._with_logprobs(self._object(content=event.text)) if event.text else None
        if isinstance(event, ReasoningDelta):
            if not self.show_thinking or not event.text:
                return None
            return self._object(thinking=event.text)
        if isinstance(event, ToolCallDelta):
            self.calls.setdefault(event.index, []).append(event)
            return None
        if isinstance(event, Failed):
            raise api.ApiError(500, event.message, kind="server_error", code="generation_failed")
        return None

    def tool_calls(self) -> list[dict]:
        pieces = [d for i in sorted(self.calls) for d in self.calls[i]]
        return [ollama_call(c, i) for i, c in enumerate(calls_of(pieces))]

    def calls_object(self) -> dict | None:
        """The object carrying the answer's tool calls, sent once they are whole."""
        calls = self.tool_calls()
        return self._object(tool_calls=calls) if calls and self.chat else None

    def last(self, done, total_s: float) -> dict:
        return {**self._with_logprobs(self._object()), **final_fields(done, total_s, self.load_s)}

    def whole_answer(self, whole, total_s: float) -> dict:
        """The one object of a `stream: false` answer, from the core's whole answer."""
        thinking = whole.reasoning if self.show_thinking and whole.reasoning else None
        calls = [ollama_call(c, i) for i, c in enumerate(whole.calls)] if self.chat else []
        if self.logprobs is not None:
            self.logprobs = list(whole.logprobs)
        return {
            **self._with_logprobs(self._object(content=whole.text, thinking=thinking, tool_calls=calls or None)),
            **final_fields(whole.done, total_s, self.load_s),
        }

    def _with_logprobs(self, out: dict) -> dict:
        """`out` with the log-probabilities not sent yet, when the request asked for them."""
        if self.logprobs is not None:
            out["logprobs"], self.logprobs = logprob_entries(self.logprobs), []
        return out

    def empty(self) -> dict:
        return self._object()

    def _object(self, content: str = "", thinking: str | None = None, tool_calls: list | None = None) -> dict:
        out: dict[str, Any] = {"model": self.model, "created_at": now_text()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking is not None:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking is not None:
                out["thinking"] = thinking
        out["done"] = False
        return out


def ndjson(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False) + "\n"


def elapsed_since(start: float) -> float:
    return time.monotonic() - start


# -- routes --------------------------------------------------------------------------------------

API_PREFIX = "/api/"


def routes(server) -> list[Route]:
    """Ollama's routes on `server` (and its error shape on /api/*)."""
    error_shapes[API_PREFIX] = error_body
    ollama = OllamaRoutes(server)
    return [
        Route("/", ollama.root, methods=["GET", "HEAD"]),
        Route("/api/version", ollama.version, methods=["GET"]),
        Route("/api/chat", ollama.chat, methods=["POST"]),
        Route("/api/generate", ollama.generate, methods=["POST"]),
        Route("/api/tags", ollama.tags, methods=["GET"]),
        Route("/api/show", ollama.show, methods=["POST"]),
        Route("/api/ps", ollama.ps, methods=["GET"]),
        Route("/api/pull", ollama.pull, methods=["POST"]),
        Route("/api/delete", ollama.delete, methods=["DELETE"]),
    ] + [Route(path, not_offered, methods=["GET", "POST", "HEAD", "DELETE"]) for path in NOT_OFFERED]


# Ollama's routes this server has no counterpart for: answered with a 404 that says so.
NOT_OFFERED = ("/api/embed", "/api/embeddings", "/api/create", "/api/copy", "/api/push", "/api/blobs/{digest}")


async def not_offered(http: Request) -> Response:
    raise api.ApiError(404, f"ferrum serve does not offer Ollama's {http.url.path[:64]}")


class OllamaRoutes:
    def __init__(self, server):
        self.server = server

    async def root(self, http: Request) -> Response:
        return PlainTextResponse("Ollama is running")

    async def version(self, http: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    # -- answers -------------------------------------------------------------------------------

    async def chat(self, http: Request) -> Response:
        started = time.monotonic()
        body = await self.body(http)
        if not body.get("messages"):
            return await self.load_only(body, chat=True)
        return await self.answer(http, body, chat_body(body), chat=True, started=started)

    async def generate(self, http: Request) -> Response:
        started = time.monotonic()
        body = await self.body(http)
        if not body.get("prompt") and not body.get("suffix"):
            return await self.load_only(body, chat=False)
        return await self.answer(http, body, generate_body(body), chat=False, started=started)

    async def answer(self, http: Request, body: dict, openai: dict, chat: bool, started: float) -> Response:
        """`openai` (a chat body, or a completion body for a raw prompt) answered in the shape of
        /api/chat (`chat`) or /api/generate."""
        stream = stream_wanted(body)
        keep_alive = keep_alive_seconds(body.get("keep_alive"))
        options = check_options(body.get("options"))
        models = self.server.models
        loading = models.get_loaded(openai["model"]) is None
        checking = time.monotonic()
        call = await self.server.call_from_openai(openai, RENAMES, chat="messages" in openai)  # loads the model
        load_s = elapsed_since(checking) if loading else 0.0
        call.keep_alive_s = keep_alive
        model = await models.acquire(call.model, keep_alive)  # held, so its context is known and stays
        try:
            context_limit(options, model.context)
            await fit_num_ctx(self.server, call, options.get("num_ctx"))
            window = penalty_window(options, model.context)
            if window is not None:
                call.options.sampling = call.options.sampling.replace(penalty_window=window)
            answer = await self.server.start(http, call)
        finally:
            models.release(model)
        out = OllamaAnswer(
            name_sent(body),
            chat,
            show_thinking=body.get("think") is not False,
            load_s=load_s,
            logprobs=call.options.logprobs is not None,
        )
        if stream:
            return StreamingResponse(self.lines(answer, out, started), media_type=NDJSON)
        whole = await answer.whole()
        return JSONResponse(out.whole_answer(whole, elapsed_since(started)))

    async def lines(self, answer, out: OllamaAnswer, started: float) -> AsyncIterator[str]:
        """The NDJSON stream; a failed generation ends it with an `{"error": ...}` line, as Ollama's does."""
        try:
            async for event in answer.events():
                if isinstance(event, Finished):
                    calls = out.calls_object()
                    if calls is not None:
                        yield ndjson(calls)
                    yield ndjson(out.last(event, elapsed_since(started)))
                    return
                try:
                    piece = out.piece(event)
                except api.ApiError as e:
                    yield ndjson(error_body(e))
                    return
                if piece is not None:
                    yield ndjson(piece)
        finally:
            answer.cancel()

    async def load_only(self, body: dict, chat: bool) -> Response:
        """Ollama's idiom for loading a model (no messages, or no prompt), or with `keep_alive` 0
        unloading it: answered at once with `done_reason` "load" or "unload"."""
        keep_alive = keep_alive_seconds(body.get("keep_alive"))
        name = model_name(body)
        models = self.server.models
        if keep_alive == 0:
            if models.get_loaded(name) is None:
                await run_in_threadpool(self.find, name)  # a 404 for a model this server does not have
            await run_in_threadpool(models.unload, name)
        else:
            models.release(await models.acquire(name, keep_alive))
        out = OllamaAnswer(name_sent(body), chat=chat)
        return JSONResponse({**out.empty(), "done": True, "done_reason": "unload" if keep_alive == 0 else "load"})

    # -- models --------------------------------------------------------------------------------

    async def tags(self, http: Request) -> Response:
        models = await run_in_threadpool(self.store_models)
        return JSONResponse({"models": await run_in_threadpool(lambda: [tag_entry(m) for m in models])})

    async def show(self, http: Request) -> Response:
        body = await self.body(http)
        name = model_name(body)
        model = await run_in_threadpool(self.find, name)
        loaded = self.server.models.get_loaded(name)
        try:
            if loaded is not None:
                sampling, context = loaded.engine.default_sampling, loaded.context
            else:
                sampling, context = (
                    await run_in_threadpool(sampling_defaults, model.path, bundled_sampling(model.path)),
                    None,
                )
            return JSONResponse(await run_in_threadpool(show_body, model, sampling, context))
        except (FerrumError, OSError):
            if model.path.exists():
                raise
            raise files_gone(model.name) from None

    async def ps(self, http: Request) -> Response:
        """The loaded models, with their size, context and when keep-alive unloads them."""
        entries = [await run_in_threadpool(self.running_entry, m) for m in self.server.models.loaded()]
        return JSONResponse({"models": entries})

    def running_entry(self, model) -> dict:
        found = next((m for m in self.store_models() if m.name == model.name), None)
        entry = tag_entry(found or local_entry(model.name, model.engine.path))
        expires = model.expires_at()
        on_gpu = " cpu" not in (model.engine.device or " cpu")
        size = model.size or entry["size"]
        return {
            **entry,
            "size": size,
            "size_vram": size if on_gpu else 0,
            "expires_at": iso_time(expires) if expires is not None else FOREVER_TEXT,
            "context_length": model.context,
        }

    async def pull(self, http: Request) -> Response:
        body = await self.body(http)
        name = model_name(body)
        stream = stream_wanted(body)
        try:
            parse_name(name, self.backend)
        except FerrumError as e:
            raise api.ApiError(404, str(e)) from None
        queue: asyncio.Queue = asyncio.Queue()
        progress = start_pull(name, self.backend, queue)
        if stream:
            return StreamingResponse(pull_lines(queue, progress), media_type=NDJSON)
        try:
            while (item := await queue.get()) is not PULL_DONE:
                if isinstance(item, api.ApiError):
                    raise item
        finally:
            progress.stop_pull()  # the client left, or the server stops: no pull outlives its request
        return JSONResponse({"status": "success"})

    async def delete(self, http: Request) -> Response:
        """Delete a stored model's files. Refused while this server runs it or any ferrum
        process has it loaded, whatever spelling names it (the check is on the files the
        name resolves to); this server's idle copy is unloaded first."""
        body = await self.body(http)
        name = model_name(body)
        if name.lower() == self.server.model_name.lower():
            raise bad(f"{name} is the model this server was started with; stop the server to delete it")
        removal = await run_in_threadpool(self.removal_of, name)
        await run_in_threadpool(self.server.models.unload_for_removal, name, removal.covers)
        try:
            await run_in_threadpool(removal.execute)
        except ModelInUseError as e:
            raise api.ApiError(409, str(e)) from None
        except FerrumError as e:
            raise bad(hide_paths(str(e))) from None
        return Response(status_code=200)

    def removal_of(self, name: str) -> Removal:
        """What deleting `name` removes; a 404 for a path (the same for every one: a client may
        not learn what exists on this machine) and for a name the store does not hold."""
        not_found = api.ApiError(404, f"model '{name[:200]}' not found")
        if looks_like_path(name):
            raise not_found
        try:
            return plan_stored_removal(name, self.backend)
        except ModelNotFoundError:
            raise not_found from None
        except FerrumError as e:
            raise bad(hide_paths(str(e))) from None

    # -- helpers -------------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """The backend the server runs ("mlx" or "torch"), which picks what an alias fetches."""
        loaded = self.server.models.get_loaded(None)
        device = (loaded.engine.device if loaded is not None else None) or "mlx"
        return device.split(" ")[0]

    async def body(self, http: Request) -> dict:
        """The request's JSON object. Ollama's clients (curl -d included) do not always say the
        body is JSON, so the content type is not checked; the size and time limits are."""
        raw = await read_body(http, self.server.max_body)
        body = await run_in_threadpool(api.parse_json, raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    def store_models(self) -> list[LocalModel]:
        """The server's own model first, then the store's complete models it serves (none on a
        server of one model, which answers every name with it)."""
        models = self.server.models.available()
        default = self.server.models.default_name
        if not any(m.name == default for m in models):
            models.insert(0, local_entry(default, self.default_path()))
        return models

    def default_path(self) -> Path:
        source = self.server.models.default_source
        if source is not None and Path(source).exists():
            return Path(source)
        return self.server.engine.path

    def find(self, name: str) -> LocalModel:
        """The model `name` means: a name as /api/tags lists it, or an alias or repo id of a
        stored one (a 404 otherwise; never a path a client typed)."""
        models = self.store_models()
        found = next((m for m in models if m.name == name), None)
        if found is not None and not found.path.exists():
            raise files_gone(found.name)
        resolve = self.server.models.resolve
        if found is None and resolve is not None:
            path = resolve(name)
            found = next((m for m in models if path is not None and m.path == path), None)
        if found is None and self.server.models.any_name:
            found = next((m for m in models if m.name == self.server.models.default_name), None)
        if found is None:
            raise api.ApiError(404, f"model '{name[:200]}' not found")
        return found


FOREVER_TEXT = "2318-08-24T00:00:00Z"  # how Ollama writes the expiry of a model kept loaded for good


async def pull_lines(queue: asyncio.Queue, progress: QueueProgress) -> AsyncIterator[str]:
    try:
        async for item in pull_updates(queue):
            yield ndjson(error_body(item) if isinstance(item, api.ApiError) else item)
    finally:
        progress.stop_pull()  # the client left, or the server stops: no pull outlives its request


async def read_body(http: Request, limit: int) -> bytes:
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    try:
        return await asyncio.wait_for(read_at_most(http, limit), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise bad(f"the request body took over {BODY_TIMEOUT_S} s to arrive", 408) from None
