"""OpenAI's API on the core: /v1/chat/completions, /v1/completions and /v1/models, also without /v1.

Each answers without the /v1 too, as llama-server, vLLM and LM Studio do, for clients given a
base URL without it.

Bodies are checked by the core (`Server.call_from_openai`, with `serve.checks`); this module
only renders the answer's neutral events as OpenAI's JSON and server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import CANCELLED, Done, ReasoningDelta, TextDelta
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.batching.request import Failed
from ferrum_mac.serve.events import LENGTH, TOOL_CALLS, Finished
from ferrum_mac.text.tool_calls import ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from ferrum_mac.serve.core import Answer, Server, Whole


def routes(server: "Server") -> list[Route]:
    api_routes = OpenAiRoutes(server)
    return [
        Route(prefix + path, handler, methods=methods)
        for prefix in ("/v1", "")  # clients given a base URL without /v1 call these bare paths
        for path, handler, methods in (
            ("/chat/completions", api_routes.chat, ["POST"]),
            ("/completions", api_routes.completions, ["POST"]),
            ("/models", api_routes.models, ["GET"]),
            ("/models/{model_id:path}", api_routes.model, ["GET"]),
        )
    ]


class OpenAiRoutes:
    def __init__(self, server: "Server"):
        self.server = server

    async def chat(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def models(self, request: Request) -> Response:
        """The loaded models (with their context), then the store's others."""
        return JSONResponse({"object": "list", "data": await run_in_threadpool(self._entries)})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        entries = await run_in_threadpool(self._entries)
        entry = next((e for e in entries if e["id"] == model_id), None)
        if entry is None:
            raise api.ApiError(
                404,
                f"the model '{model_id[:200]}' does not exist; this server has "
                + ", ".join(f"'{e['id']}'" for e in entries[:20]),
                param="model",
                code="model_not_found",
            )
        return JSONResponse(entry)

    def _entries(self) -> list[dict]:
        models = self.server.models
        loaded = [model_entry(m.name, max_model_len=m.context) for m in models.loaded()]
        if not any(e["id"] == models.default_name for e in loaded):
            loaded.insert(0, model_entry(models.default_name))  # unloaded by keep-alive: loaded again on use
        names = {e["id"] for e in loaded}
        return loaded + [model_entry(m.name, int(m.modified)) for m in models.available() if m.name not in names]

    async def _answer(self, request: Request, chat: bool) -> Response:
        body = await self.server.read_json(request)
        call = await self.server.call_from_openai(body, chat=chat)
        answer = await self.server.start(request, call)
        kind = "chat.completion" if chat else "text_completion"
        envelope = envelope_of(kind, new_id("chatcmpl" if chat else "cmpl"), answer.model_name)
        if call.options.stream:
            chunks = stream_chunks(answer, envelope, chat, call.options.include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return JSONResponse(whole_body(await answer.whole(), envelope, chat))


def model_entry(name: str, created: int = 0, **extra) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "ferrum", **extra}


def finish_reason(done: Finished) -> str:
    return done.finish if done.finish in (LENGTH, TOOL_CALLS) else "stop"


def whole_body(whole: "Whole", envelope: dict, chat: bool) -> dict:
    done = whole.done
    if chat:
        message = {"role": "assistant", **message_of(whole.text, whole.calls)}
        if whole.reasoning:
            message["reasoning_content"] = whole.reasoning
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(done)}
    else:
        choice = {"index": 0, "text": whole.text, "logprobs": None, "finish_reason": finish_reason(done)}
    return {**envelope, "choices": [choice], "usage": usage(done), "stats": stats(done)}


async def stream_chunks(answer: "Answer", envelope: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events; when the client goes away starlette cancels this generator, and the
    `finally` cancels the request, so its KV is released at the next step."""
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
        async for event in answer.events():
            if isinstance(event, TextDelta):
                yield chunk({"content": event.text})
            elif isinstance(event, ToolCallDelta):
                for delta in tool_call_deltas(event):
                    yield chunk(delta)
            elif isinstance(event, ReasoningDelta):
                yield chunk({"reasoning_content": event.text} if chat else {})
            elif isinstance(event, Failed):
                yield sse(api.ApiError(500, event.message, kind="server_error", code="generation_failed").body())
            elif isinstance(event, Finished):
                yield chunk({}, finish_reason(event), stats=stats(event))
                if include_usage:
                    yield sse({**envelope, "choices": [], "usage": usage(event)})
        yield "data: [DONE]\n\n"
    finally:
        answer.cancel()


def message_of(content: str, calls: list[ToolCall]) -> dict:
    """A whole answer's `message` (no role, no reasoning): its text, and its calls if it made any."""
    if not calls:
        return {"content": content}
    return {"content": content if content.strip() else None, "tool_calls": [c.as_openai() for c in calls]}


def tool_call_deltas(piece: ToolCallDelta) -> list[dict]:
    """A call's piece as stream `delta`s: its head (id, name) first when it has one, then its arguments."""
    out: list[dict] = []
    if piece.id is not None or piece.name is not None:
        head = {
            "index": piece.index,
            "id": piece.id,
            "type": "function",
            "function": {"name": piece.name, "arguments": ""},
        }
        out.append({"tool_calls": [head]})
    out.append({"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]})
    return out


def usage(done: Done) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.generated_tokens,
        "total_tokens": done.prompt_tokens + done.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def stats(done: Done) -> dict:
    """ferrum's own figures (time to first token, tok/s); OpenAI clients ignore the field."""
    return {**done.as_dict(), "cancelled": done.stop_reason == CANCELLED}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope_of(kind: str, request_id: str, model: str) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model}


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
