"""OpenAI's API on the core: /v1/chat/completions, /v1/completions and /v1/models, also without /v1.

Each answers without the /v1 too, as llama-server, vLLM and LM Studio do, for clients given a
base URL without it.

Bodies are checked by the core (`Server.call_from_openai`, with `serve.checks`); this module
only renders the answer's neutral events as OpenAI's JSON and server-sent events. A request for
`n` choices is n requests of the scheduler, rendered as one answer; `logprobs` are the model's
own (`TokenLogprob`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import CANCELLED, SEED_LIMIT, Done, ReasoningDelta, TextDelta, TokenLogprob
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.batching.request import Failed
from ferrum_mac.serve.events import LENGTH, TOOL_CALLS, AnswerEvent, Finished, logprob_entries
from ferrum_mac.text.tool_calls import ToolCall, ToolCallDelta

if TYPE_CHECKING:
    from ferrum_mac.serve.call import ChatCall
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
        answers = await self._start_choices(request, call)
        kind = "chat.completion" if chat else "text_completion"
        envelope = envelope_of(kind, new_id("chatcmpl" if chat else "cmpl"), answers[0].model_name)
        if call.options.stream:
            chunks = stream_chunks(answers, envelope, chat, call.options)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            wholes = await asyncio.gather(*(answer.whole() for answer in answers))
        finally:
            cancel_all(answers)
        return JSONResponse(whole_body(wholes, [a.echo for a in answers], envelope, chat, call.options.logprobs))

    async def _start_choices(self, request: Request, call: "ChatCall") -> list["Answer"]:
        """The call's `n` answers, each a request of the scheduler (they batch together, and the
        later ones find the prompt in the prefix cache); choice i draws with seed + i."""
        answers: list[Answer] = []
        try:
            for i in range(call.options.n):
                answers.append(await self.server.start(request, choice_call(call, i)))
        except BaseException:
            cancel_all(answers)
            raise
        return answers


def choice_call(call: "ChatCall", i: int) -> "ChatCall":
    """The call of choice `i`: its seed moved on by i, so seeded choices differ yet repeat."""
    seed = call.options.sampling.seed
    if i == 0 or seed is None:
        return call
    sampling = call.options.sampling.replace(seed=(seed + i) % SEED_LIMIT)
    return dataclasses.replace(call, options=dataclasses.replace(call.options, sampling=sampling))


def cancel_all(answers: list["Answer"]) -> None:
    for answer in answers:
        answer.cancel()


def model_entry(name: str, created: int = 0, **extra) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "ferrum", **extra}


def finish_reason(done: Finished) -> str:
    return done.finish if done.finish in (LENGTH, TOOL_CALLS) else "stop"


def whole_body(wholes: list["Whole"], echoes: list[str], envelope: dict, chat: bool, logprobs: int | None) -> dict:
    choices = []
    for i, (whole, echo) in enumerate(zip(wholes, echoes)):
        done = whole.done
        if chat:
            message = {"role": "assistant", **message_of(whole.text, whole.calls)}
            if whole.reasoning:
                message["reasoning_content"] = whole.reasoning
            choice = {"index": i, "message": message, "finish_reason": finish_reason(done)}
            if logprobs is not None:
                choice["logprobs"] = chat_logprobs(whole.logprobs)
        else:
            shown = completion_logprobs(whole.logprobs, len(echo)) if logprobs is not None else None
            choice = {"index": i, "text": echo + whole.text, "logprobs": shown, "finish_reason": finish_reason(done)}
        choices.append(choice)
    dones = [w.done for w in wholes]
    stats_of = stats(dones[0]) if len(dones) == 1 else [stats(d) for d in dones]
    return {**envelope, "choices": choices, "usage": usage(dones), "stats": stats_of}


async def stream_chunks(
    answers: list["Answer"], envelope: dict, chat: bool, options: api.Options
) -> AsyncIterator[str]:
    """Server-sent events, the choices' chunks interleaved as they come (each with its index);
    when the client goes away starlette cancels this generator, and the `finally` cancels the
    requests, so their KV is released at the next step."""
    kind = envelope["object"] + (".chunk" if chat else "")
    envelope = {**envelope, "object": kind}
    asked = options.logprobs is not None
    pending: list[list[TokenLogprob]] = [[] for _ in answers]  # each choice's tokens not sent yet
    offsets = [len(a.echo) for a in answers]  # each completion's text so far, for `text_offset`

    def chunk(i: int, delta: dict, finish: str | None = None, **extra) -> str:
        tokens, pending[i] = pending[i], []
        if chat:
            choice = {"index": i, "delta": delta}
            if asked:
                choice["logprobs"] = chat_logprobs(tokens)
        else:
            shown = completion_logprobs(tokens, offsets[i]) if asked else None
            offsets[i] += sum(len(t.text) for t in tokens)
            choice = {"index": i, "text": delta.get("content", ""), "logprobs": shown}
        choice["finish_reason"] = finish
        return sse({**envelope, "choices": [choice], **extra})

    dones: list[Done] = []
    try:
        for i, answer in enumerate(answers):
            if chat:
                yield chunk(i, {"role": "assistant", "content": ""})
            elif answer.echo:
                yield chunk(i, {"content": answer.echo})
        async for i, event in interleaved(answers):
            if isinstance(event, TokenLogprob):
                pending[i].append(event)
            elif isinstance(event, TextDelta):
                yield chunk(i, {"content": event.text})
            elif isinstance(event, ToolCallDelta):
                for delta in tool_call_deltas(event):
                    yield chunk(i, delta)
            elif isinstance(event, ReasoningDelta):
                yield chunk(i, {"reasoning_content": event.text} if chat else {})
            elif isinstance(event, Failed):
                yield sse(api.ApiError(500, event.message, kind="server_error", code="generation_failed").body())
            elif isinstance(event, Finished):
                yield chunk(i, {}, finish_reason(event), stats=stats(event))
                dones.append(event)
        if options.include_usage and len(dones) == len(answers):
            yield sse({**envelope, "choices": [], "usage": usage(dones)})
        yield "data: [DONE]\n\n"
    finally:
        cancel_all(answers)


async def interleaved(answers: list["Answer"]) -> AsyncIterator[tuple[int, AnswerEvent]]:
    """The answers' events as they come, each with its answer's index."""
    if len(answers) == 1:
        async for event in answers[0].events():
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, answer: "Answer") -> None:
        try:
            async for event in answer.events():
                queue.put_nowait((i, event))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, a)) for i, a in enumerate(answers)]
    try:
        running = len(tasks)
        while running:
            i, event = await queue.get()
            if event is None:
                running -= 1
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()


def chat_logprobs(tokens: list[TokenLogprob]) -> dict:
    """A chat choice's `logprobs`: each token, its log-probability, its bytes and the likeliest."""
    return {"content": logprob_entries(tokens), "refusal": None}


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> dict:
    """A completion choice's `logprobs`; `offset`: the characters of text before its first token."""
    starts = []
    for t in tokens:
        starts.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{text: logprob for text, _, logprob in t.top} for t in tokens],
        "text_offset": starts,
    }


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


def usage(dones: Sequence[Done]) -> dict:
    """The choices' usage: their answers' tokens summed, the prompt counted once (as OpenAI and
    vLLM count it), with the tokens the first choice found cached."""
    first = dones[0]
    generated = sum(d.generated_tokens for d in dones)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
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
