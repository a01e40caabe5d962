"""Anthropic's Messages API on `ferrum serve`: POST /v1/messages and /v1/messages/count_tokens.

This module only translates. A Messages body becomes an OpenAI-shaped body that passes the same
checks as /v1/chat/completions (`call.call_from_openai`), so a limit or a fix applies to every
protocol; the checks here are only those OpenAI's shapes cannot express (content blocks, which
tool result answers which call). The core's neutral answer events become Anthropic's message, or
its server-sent events (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors on these routes take Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ...}}`.

Not honoured: images and documents (a 400 until the models read them), an assistant turn at the
end as the start of the answer ("prefill": the model answers after it instead), server tools, and
`thinking.budget_tokens` as a separate cap (reasoning counts towards `max_tokens`).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import CONTEXT, EOS, LOOP, MAX_TOKENS, STOP_STRING, Done, ReasoningDelta, TextDelta, with_calls
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.api_errors import error_shapes
from ferrum_mac.serve.events import TOOL_CALLS, ToolCallDelta, finish_of
from ferrum_mac.serve.batching.request import Failed
from ferrum_mac.text.tool_calls import ToolCall

if TYPE_CHECKING:
    from ferrum_mac.serve.core import Answer, Server

MESSAGES_PATH = "/v1/messages"
PASSED = api.PASSED_AS_IS
# Fields asking for what only Anthropic's own servers run: refused, so the client knows it did
# not happen. Any other field this module does not read is a hint (metadata, service_tier,
# context_management, ...) and ignored, as other local servers do.
SERVER_FEATURES = ("container", "mcp_servers")
TRANSLATED = (
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
)
COUNTED = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "cache_control")
ROLES = ("user", "assistant")
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
UNREAD_BLOCKS = ("image", "document", "search_result")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# OpenAI's field names -> this API's, for the shared checks' errors (call.call_from_openai)
RENAMES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config.format"}
# OpenAI's paths in those errors' text -> this API's (tools[2].function.parameters -> tools.2.input_schema)
RENAMED_PATHS = (
    (re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools.\1.input_schema"),
    (re.compile(r"tools\[(\d+)\](?:\.function)?"), r"tools.\1"),
)
# a loop stopped is an answer at its end (its `stats` say why), never one to continue
STOP_REASONS = {
    EOS: "end_turn",
    STOP_STRING: "stop_sequence",
    MAX_TOKENS: "max_tokens",
    CONTEXT: "max_tokens",
    LOOP: "end_turn",
}


def routes(server: "Server") -> list[Route]:
    error_shapes[MESSAGES_PATH] = error_body
    messages = MessagesRoutes(server)
    return [
        Route(MESSAGES_PATH, messages.create, methods=["POST"]),
        Route(MESSAGES_PATH + "/count_tokens", messages.count_tokens, methods=["POST"]),
    ]


class MessagesRoutes:
    def __init__(self, server: "Server"):
        self.server = server

    async def create(self, request: Request) -> Response:
        body = openai_body(await self.server.read_json(request))
        call = await self.server.call_from_openai(body, RENAMES)
        answer = await self.server.start(request, call)
        message_id = new_message_id()
        if call.options.stream:
            events = stream_events(answer, message_id, answer.model_name, answer.prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream")
        whole = await answer.whole()
        return JSONResponse(
            message_body(message_id, answer.model_name, whole.text, whole.reasoning, whole.calls, whole.done)
        )

    async def count_tokens(self, request: Request) -> Response:
        body = openai_body(await self.server.read_json(request), counting=True)
        call = await self.server.call_from_openai(body, RENAMES)
        return JSONResponse({"input_tokens": await self.server.count_tokens(call)})


def bad(message: str) -> api.ApiError:
    return api.ApiError(400, message)


# -- requests: Anthropic's body -> an OpenAI-shaped one ---------------------------------------


def openai_body(body, counting: bool = False) -> dict:
    """The OpenAI-shaped body for a Messages body (`counting`: a count_tokens body, which has no
    `max_tokens` and samples nothing)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    if counting:
        unknown = sorted(k for k in body if k not in COUNTED)
    else:  # agent harnesses send the newest hints first: a field that is not a server feature is ignored
        unknown = sorted(k for k in body if k in SERVER_FEATURES)
    if unknown:
        raise bad(f"{unknown[0][:64]}: this field is not supported by this server")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model: a model name (string) is required")
    out: dict[str, Any] = {key: body[key] for key in PASSED if key in body}
    out["model"] = model
    out["messages"] = [*system_messages(body.get("system")), *chat_messages(body.get("messages"))]
    if not counting:
        if body.get("max_tokens") is None:
            raise bad("max_tokens: Field required")
        out["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        out["stop"] = body["stop_sequences"]
    out.update(tools_fields(body.get("tools"), body.get("tool_choice")))
    fmt = response_format(body.get("output_config"))
    if fmt is not None:
        out["response_format"] = fmt
    thinking = enable_thinking(body.get("thinking"))
    if thinking is not None:
        kwargs = out.get("chat_template_kwargs")
        out["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": thinking}
    return out


def system_messages(system) -> list[dict]:
    """`system`: a string or an array of text blocks; none when empty."""
    if system is None:
        return []
    text = system if isinstance(system, str) else block_text(system, "system")
    return [{"role": "system", "content": text}] if text else []


def chat_messages(messages) -> list[dict]:
    """OpenAI's messages for Anthropic's: an assistant turn's tool_use blocks become its
    tool_calls, a user turn's tool_result blocks become role "tool" messages (before its text)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages: must be a non-empty array of {role, content}")
    out: list[dict] = []
    call_ids: set[str] = set()  # the tool_use ids of the assistant turns so far
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad(f"{where}: must be an object whose role is 'user' or 'assistant'")
        role = message["role"]
        blocks = content_blocks(message.get("content"), role, where)
        if role == "assistant":
            out.append(assistant_message(blocks, where))
            call_ids.update(c["id"] for c in out[-1].get("tool_calls", ()))
        else:
            out.extend(user_messages(blocks, where, call_ids))
    return out


def content_blocks(content, role: str, where: str) -> list[dict]:
    """The blocks of a message's `content` (a string is one text block), each of a kind `role` may send."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content: must be a string or an array of content blocks")
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in UNREAD_BLOCKS:
            raise bad(f"{where}.content.{j}: {kind} blocks are not supported: this server's models read text only")
        if kind not in BLOCKS[role]:
            allowed = ", ".join(BLOCKS[role])
            raise bad(f"{where}.content.{j}: a {role} message's blocks must be one of: {allowed} (not {kind!r:.64})")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad(f"{where}.content.{j}.text: must be a string")
    return content


def assistant_message(blocks: list[dict], where: str) -> dict:
    """Text, calls, and the reasoning of its thinking blocks as `reasoning_content`, which the
    chat template renders where the model's own rules keep it (Qwen3: the turns after the last
    question, as while it calls tools); redacted_thinking carries no text to render."""
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [tool_call(b, f"{where}.content.{j}") for j, b in enumerate(blocks) if b["type"] == "tool_use"]
    reasoning = "".join(
        thinking_text(b, f"{where}.content.{j}") for j, b in enumerate(blocks) if b["type"] == "thinking"
    )
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def thinking_text(block: dict, where: str) -> str:
    thinking = block.get("thinking")
    if not isinstance(thinking, str):
        raise bad(f"{where}.thinking: must be a string")
    return thinking


def tool_call(block: dict, where: str) -> dict:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad(f"{where}: a tool_use block needs 'id' and 'name' strings and an 'input' object")
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def user_messages(blocks: list[dict], where: str, call_ids: set[str]) -> list[dict]:
    """One "tool" message per tool_result, then the text (if any) as a user message."""
    out = []
    for j, block in enumerate(blocks):
        if block["type"] != "tool_result":
            continue
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or call_id not in call_ids:
            raise bad(
                f"{where}.content.{j}.tool_use_id: {str(call_id)[:64]!r} names no tool_use block of an earlier "
                "assistant message"
            )
        content = block.get("content")
        text = content if isinstance(content, str) or content is None else block_text(content, f"{where}.content.{j}")
        out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def block_text(blocks, where: str) -> str:
    """The text of an array of text blocks (a system prompt, a tool result's content)."""
    if not isinstance(blocks, list):
        raise bad(f"{where}: must be a string or an array of text blocks")
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in UNREAD_BLOCKS:
            raise bad(f"{where}.{j}: {kind} blocks are not supported: this server's models read text only")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where}.{j}: must be a text block {{'type': 'text', 'text': ...}}")
    return "".join(b["text"] for b in blocks)


def tools_fields(tools, choice) -> dict:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` for Anthropic's tools and tool_choice."""
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools: must be an array of {name, description, input_schema}")
        out["tools"] = [function_tool(t, f"tools.{i}") for i, t in enumerate(tools)]
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad(
            "tool_choice: must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or {'type': 'tool', 'name': ...}"
        )
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def function_tool(tool, where: str) -> dict:
    if not isinstance(tool, dict):
        raise bad(f"{where}: must be an object {{name, description, input_schema}}")
    if tool.get("type") not in (None, "custom"):
        raise bad(
            f"{where}: the tool type {str(tool['type'])[:64]!r} is not supported; this server runs client tools only"
        )
    if "input_schema" not in tool:
        raise bad(f"{where}.input_schema: Field required")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def response_format(output_config) -> dict | None:
    """OpenAI's response_format for `output_config.format` (structured outputs); `effort` is a hint."""
    if output_config is None:
        return None
    if not isinstance(output_config, dict):
        raise bad("output_config: must be an object")
    fmt = output_config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format: must be {'type': 'json_schema', 'schema': {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def enable_thinking(thinking) -> bool | None:
    """The template's `enable_thinking` for `thinking`; None (the template's default) when absent."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if kind == "enabled" and isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1:
        return True
    raise bad("thinking: must be {'type': 'enabled', 'budget_tokens': N} (N at least 1) or {'type': 'disabled'}")


# -- answers: neutral events -> Anthropic's message -------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str | None) -> str:
    """Anthropic's ids start with toolu_; the core's with call_ (a client hands them back as is)."""
    return "toolu_" + (call_id or uuid.uuid4().hex[:24]).removeprefix("call_")


def stop_reason(done: Done, called: bool = False) -> str:
    """`tool_use` when the answer ended by itself holding whole calls (`called`, or as the core's
    `Finished` says); one cut short is `max_tokens`, whatever calls it holds."""
    if finish_of(done) == TOOL_CALLS or with_calls(done.stop_reason, called) == TOOL_CALLS:
        return "tool_use"
    return STOP_REASONS.get(done.stop_reason, "end_turn")


def usage(done: Done) -> dict:
    return usage_of(done.prompt_tokens, done.cached_tokens, done.generated_tokens)


def usage_of(prompt: int, cached: int, generated: int) -> dict:
    """Anthropic's meaning: input_tokens counts what was prefilled (the uncached input), the
    prefix cache's reused tokens are cache reads."""
    return {
        "input_tokens": prompt - cached,
        "output_tokens": generated,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(call_id: str | None, name: str | None, arguments: str) -> dict:
    try:
        parsed = json.loads(arguments) if arguments else {}
    except ValueError:  # the grammar makes this JSON; a model without one may not
        parsed = {}
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name or "", "input": parsed}


def message_body(message_id: str, model: str, text: str, reasoning: str, calls: Sequence[ToolCall], done: Done) -> dict:
    """The whole answer: thinking first when the model reasoned, then text, then tool calls."""
    content: list[dict] = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not (calls or reasoning):  # an empty text block only when the answer has no other
        content.append({"type": "text", "text": text})
    content.extend(tool_use_block(c.id, c.name, c.arguments) for c in calls)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(done, bool(calls)),
        "stop_sequence": done.stop_string if done.stop_reason == STOP_STRING else None,
        "usage": usage(done),
    }


def message_start(message_id: str, model: str, usage: dict) -> str:
    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return sse("message_start", {"type": "message_start", "message": message})


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class StreamBlocks:
    """Anthropic's content blocks as events arrive: one block is open at a time; a new kind
    (thinking, text, a tool call) closes it and opens the next at the next index."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text" or "tool_use:<call index>"

    def text(self, kind: str, piece: str) -> list[str]:
        """Events for more text of `kind` ("thinking" or "text")."""
        start = {"type": kind, kind: ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
        out = self._switch(kind, start)
        delta = (
            {"type": "text_delta", "text": piece} if kind == "text" else {"type": "thinking_delta", "thinking": piece}
        )
        out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return out

    def call(self, delta: ToolCallDelta) -> list[str]:
        out = self._switch(f"tool_use:{delta.index}", {**tool_use_block(delta.id, delta.name, ""), "input": {}})
        if delta.arguments:
            piece = {"type": "input_json_delta", "partial_json": delta.arguments}
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": piece}))
        return out

    def close(self) -> list[str]:
        """Events closing the open block (an empty text block when the answer had none)."""
        out = [] if self.index >= 0 else self._switch("text", {"type": "text", "text": ""})
        if self.open is not None:
            out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None
        return out

    def _switch(self, kind: str, start: dict) -> list[str]:
        if self.open == kind:
            return []
        out = self.close() if self.open is not None else []
        self.index += 1
        self.open = kind
        out.append(
            sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": start})
        )
        return out


async def stream_events(answer: "Answer", message_id: str, model: str, prompt_tokens: int) -> AsyncIterator[str]:
    """Server-sent events; when the client goes away starlette cancels this generator, and the
    `finally` cancels the request, so its KV is released at the next step."""
    try:
        async for piece in sse_events(answer.events(), message_id, model, prompt_tokens, lambda: answer.cached_tokens):
            yield piece
    finally:
        answer.cancel()


async def sse_events(
    events: AsyncIterator, message_id: str, model: str, prompt_tokens: int, cached: Callable[[], int] = lambda: 0
) -> AsyncIterator[str]:
    """Anthropic's server-sent events for the core's neutral events. `message_start` goes once
    the first event has come: the prompt is prefilled then, and `cached()` says how much of it
    the prefix cache gave, so its usage says what `message_delta`'s does."""
    blocks = StreamBlocks()
    started = False
    async for event in events:
        if not started:
            started = True
            reused = event.cached_tokens if isinstance(event, Done) else cached()
            yield message_start(message_id, model, usage_of(prompt_tokens, reused, 0))
        if isinstance(event, TextDelta):
            pieces = blocks.text("text", event.text) if event.text else []
        elif isinstance(event, ReasoningDelta):
            pieces = blocks.text("thinking", event.text) if event.text else []
        elif isinstance(event, ToolCallDelta):
            pieces = blocks.call(event)
        elif isinstance(event, Failed):
            yield sse("error", error_body(api.ApiError(500, event.message, kind="server_error")))
            return
        elif isinstance(event, Done):
            for piece in blocks.close():
                yield piece
            delta = {
                "stop_reason": stop_reason(event),
                "stop_sequence": event.stop_string if event.stop_reason == STOP_STRING else None,
            }
            yield sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(event)})
            yield sse("message_stop", {"type": "message_stop"})
            return
        else:
            pieces = []
        for piece in pieces:
            yield piece


# -- errors -----------------------------------------------------------------------------------


def error_body(error: api.ApiError) -> dict:
    """Anthropic's error shape; the type follows the status as Anthropic's API sets it."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": renamed(error.message)}}


def renamed(message: str) -> str:
    """The shared checks name OpenAI's paths; say this API's instead."""
    for pattern, replacement in RENAMED_PATHS:
        message = pattern.sub(replacement, message)
    return message
