"""OpenAI's Responses API on `ferrum serve`: POST /v1/responses, GET and DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items (the wire API Codex speaks).

This module only translates, as the Messages API does. The input items (messages,
`function_call`, `function_call_output`, reasoning) after those of the response that
`previous_response_id` names become an OpenAI-shaped chat body that passes the same checks as
/v1/chat/completions (`call.call_from_openai`), so function tools are enforced by the same
grammar and `text.format` is `response_format`. The answer's neutral events become a response
object, or its server-sent events (response.created, output items, their deltas,
response.completed). Responses are kept (`ResponseStore`) unless `store` is false.

Not honoured: built-in tools (web search, file search, computer use, ...: a 400), images and
files (a 400 until the models read them), `background` and `conversation` (a 400), and reasoning
items a client sends back (templates drop earlier reasoning).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ferrum_mac.engine import CANCELLED, Done, ReasoningDelta, TextDelta
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.batching.request import Failed
from ferrum_mac.serve.events import LENGTH, Finished, ToolCallDelta
from ferrum_mac.serve.response_store import ResponseStore
from ferrum_mac.text.tool_calls import ToolCall

if TYPE_CHECKING:
    from ferrum_mac.serve.core import Answer, Server

RESPONSES_PATH = "/v1/responses"
PASSED = api.PASSED_AS_IS + ("parallel_tool_calls",)
# Fields asking for what only OpenAI's servers run: refused, so the client knows it did not happen.
SERVER_FEATURES = ("background", "conversation", "prompt")
# OpenAI chat's field names -> this API's, for the shared checks' errors
RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
UNREAD_PARTS = ("input_image", "input_file", "input_audio")
THINKING_OFF = ("none", "minimal")
MAX_ID = 200  # characters of an id echoed in an error


def routes(server: "Server", store: ResponseStore) -> list[Route]:
    responses = ResponsesRoutes(server, store)
    return [
        Route(RESPONSES_PATH, responses.create, methods=["POST"]),
        Route(RESPONSES_PATH + "/{response_id}", responses.get, methods=["GET"]),
        Route(RESPONSES_PATH + "/{response_id}", responses.delete, methods=["DELETE"]),
        Route(RESPONSES_PATH + "/{response_id}/input_items", responses.input_items, methods=["GET"]),
    ]


class ResponsesRoutes:
    def __init__(self, server: "Server", store: ResponseStore):
        self.server = server
        self.store = store

    async def create(self, request: Request) -> Response:
        body = await self.server.read_json(request)
        earlier = await self._earlier(body)
        chat, items = chat_body(body, earlier)
        call = await self.server.call_from_openai(chat, RENAMES)
        answer = await self.server.start(request, call)
        reply = Reply(body, answer.model_name, earlier + items, self.store if body.get("store") is not False else None)
        if call.options.stream:
            return StreamingResponse(stream_events(answer, reply), media_type="text/event-stream")
        whole = await answer.whole()
        response = reply.finished(reply.output_of(whole.reasoning, whole.text, whole.calls, whole.done), whole.done)
        await run_in_threadpool(reply.keep, response)
        return JSONResponse(response)

    async def get(self, request: Request) -> Response:
        return JSONResponse((await self._stored(request)).response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await run_in_threadpool(self.store.delete, response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        stored = await self._stored(request)
        outputs = len(stored.response.get("output", []))
        items = stored.conversation[: len(stored.conversation) - outputs]
        ids = [item.get("id") for item in items if isinstance(item.get("id"), str)]
        return JSONResponse(
            {
                "object": "list",
                "data": items,
                "first_id": ids[0] if ids else None,
                "last_id": ids[-1] if ids else None,
                "has_more": False,
            }
        )

    async def _stored(self, request: Request):
        response_id = request.path_params["response_id"]
        stored = await run_in_threadpool(self.store.get, response_id)
        if stored is None:
            raise not_found(response_id)
        return stored

    async def _earlier(self, body) -> list[dict]:
        """The conversation of the response `previous_response_id` names (none without one)."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise bad("'previous_response_id' must be a string", "previous_response_id")
        stored = await run_in_threadpool(self.store.get, previous)
        if stored is None:
            raise api.ApiError(
                404,
                f"no response '{previous[:MAX_ID]}' is kept here (unknown, expired, deleted or made with store: false)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return stored.conversation


def bad(message: str, param: str | None = None) -> api.ApiError:
    return api.ApiError(400, message, param=param)


def not_found(response_id: str) -> api.ApiError:
    return api.ApiError(404, f"no response '{response_id[:MAX_ID]}' is kept here", code="not_found")


# -- requests: a Responses body -> an OpenAI chat body -----------------------------------------


def chat_body(body, earlier: list[dict]) -> tuple[dict, list[dict]]:
    """The OpenAI-shaped chat body for a Responses body whose earlier conversation is `earlier`,
    and the body's own input items (what a later response's conversation goes on from)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    refused = sorted(k for k in body if k in SERVER_FEATURES and body[k] not in (None, False))
    if refused:
        raise bad(f"'{refused[0]}' is not supported by this server", refused[0])
    items = input_items(body.get("input"))
    messages = messages_of(earlier + items)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    if not messages:
        raise bad("'input' must hold at least one item", "input")
    out: dict[str, Any] = {"messages": messages, **{k: body[k] for k in PASSED if k in body}}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        out["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = chat_tool_choice(body["tool_choice"])
    response_format = chat_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    thinking = enable_thinking(body.get("reasoning"))
    if thinking is not None:
        kwargs = out.get("chat_template_kwargs")
        out["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": thinking}
    return out, items


def input_items(value) -> list[dict]:
    """`input` as a list of items: a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("'input' must be a string or an array of items", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad(f"input[{i}] must be an object", f"input[{i}]")
    return value


def messages_of(items: list[dict]) -> list[dict]:
    """Chat messages for input items: a message each, calls joined to the assistant turn before
    them, each call's output a `tool` message."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
            messages.append({"role": role, "content": content_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", where),
                "type": "function",
                "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # templates render no earlier reasoning
        else:
            raise bad(
                f"{where}.type {str(kind)[:64]!r} is not supported; send message, function_call, "
                "function_call_output or reasoning items",
                f"{where}.type",
            )
    return messages


def content_text(content, where: str) -> str:
    """A message's content (a string, or text parts) as its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of content parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNREAD_PARTS:
            raise bad(f"{where}.content[{j}]: {kind} is not read by this server's models; send text", where)
        if kind not in TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise bad(f"{where}.content[{j}] must be a text part ({', '.join(TEXT_PARTS)})", f"{where}.content[{j}]")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def _text(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad(f"{where}.{name} must be a string", f"{where}.{name}")
    return value


def chat_tools(tools) -> list:
    """Function tools as chat's (their fields one level down); any other kind is refused."""
    if not isinstance(tools, list):
        return tools  # the shared check names the error
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"tools[{i}]: the tool type {str(kind)[:64]!r} is not supported; this server runs function tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools = choice.get("tools")
        named = [{"type": "function", "function": {"name": t.get("name")}} for t in tools if isinstance(t, dict)]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": named}}
    return choice  # auto, none, required, or wrong: the shared check names it


def chat_format(text) -> dict | None:
    """`text.format` as chat's `response_format` (None: free text)."""
    if text is None:
        return None
    form = text.get("format") if isinstance(text, dict) else None
    if form is None:
        return None
    if not isinstance(form, dict):
        raise bad("'text.format' must be an object", "text.format")
    if form.get("type") == "text":
        return None
    if form.get("type") == "json_schema":
        schema = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    return form  # json_object, or wrong: the shared check names it


def enable_thinking(reasoning) -> bool | None:
    """The template's `enable_thinking` for `reasoning.effort` (None: the template's default)."""
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    return None if effort is None else effort not in THINKING_OFF


# -- answers: a response object and its events -------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Reply:
    """What a response says besides its output: the request's settings echoed, its id and times."""

    body: dict
    model: str
    conversation: list[dict]  # the input items it answers, after those of earlier responses
    store: ResponseStore | None
    id: str = field(default_factory=lambda: new_id("resp"))
    created: int = field(default_factory=lambda: int(time.time()))

    def snapshot(self, status: str, output: list[dict]) -> dict:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning"),
            "store": body.get("store", True),
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": "disabled",
            "usage": None,
            "metadata": body.get("metadata") or {},
        }

    def finished(self, output: list[dict], done: Done) -> dict:
        status = status_of(done)
        response = self.snapshot(status, output)
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = usage(done)
        return response

    def failed(self, output: list[dict], message: str) -> dict:
        response = self.snapshot("failed", output)
        response["error"] = {"code": "server_error", "message": message}
        return response

    def keep(self, response: dict) -> None:
        if self.store is not None:
            self.store.put(response, self.conversation + response["output"])

    def output_of(self, reasoning: str, text: str, calls: list[ToolCall], done: Done) -> list[dict]:
        """The whole answer's output items: its reasoning, its text, its calls."""
        status = "incomplete" if status_of(done) == "incomplete" else "completed"
        output = []
        if reasoning:
            output.append(reasoning_item(new_id("rs"), reasoning, status))
        if text.strip() or not (calls or reasoning):
            output.append(message_item(new_id("msg"), text, status))
        output += [call_item(new_id("fc"), call.id, call.name, call.arguments, "completed") for call in calls]
        return output


def status_of(done: Done) -> str:
    if done.stop_reason == CANCELLED:
        return "cancelled"
    if isinstance(done, Finished) and done.finish == LENGTH:
        return "incomplete"
    return "completed"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(done: Done) -> dict:
    return {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": done.cached_tokens},
        "output_tokens": done.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.generated_tokens,
    }


class EventWriter:
    """A response's server-sent events, numbered, with the output item open at the moment."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.number = 0
        self.output: list[dict] = []  # items done
        self.open: dict | None = None  # the item being written
        self.text = ""  # of the open item

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self, item: dict) -> list[str]:
        """Open `item` (closing the open one)."""
        out = self.close()
        self.open, self.text = item, ""
        index = len(self.output)
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            part = output_text("")
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def delta(self, kind: str, text: str) -> list[str]:
        """More of the open item (opening one of `kind` first when another kind is open)."""
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item = reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" else None
            out += self.start(item if item is not None else message_item(new_id("msg"), None, "in_progress"))
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, **self._where(), content_index=0, delta=text, **extra))
        return out

    def call_piece(self, piece: ToolCallDelta) -> list[str]:
        out: list[str] = []
        if piece.name is not None or self.open is None or self.open["type"] != "function_call":
            out += self.start(call_item(new_id("fc"), piece.id or "", piece.name or "", "", "in_progress"))
        if piece.arguments:
            self.text += piece.arguments
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=piece.arguments))
        return out

    def close(self, status: str = "completed") -> list[str]:
        """End the open item: its last events, and it joins the output."""
        item, text = self.open, self.text
        if item is None:
            return []
        self.open, where = None, self._where(len(self.output), item)
        out = []
        if item["type"] == "message":
            item = message_item(item["id"], text, status)
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=output_text(text)))
        elif item["type"] == "reasoning":
            item = reasoning_item(item["id"], text, status)
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            item = call_item(item["id"], item["call_id"], item["name"], text, "completed")
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        return out

    def _where(self, index: int | None = None, item: dict | None = None) -> dict:
        item = item if item is not None else self.open
        assert item is not None
        return {"item_id": item["id"], "output_index": len(self.output) if index is None else index}


async def stream_events(answer: "Answer", reply: Reply) -> AsyncIterator[str]:
    """The response's server-sent events; when the client goes away starlette cancels this
    generator, and the `finally` cancels the request, so its KV is released at the next step."""
    writer = EventWriter(reply)
    try:
        yield writer.event("response.created", response=reply.snapshot("in_progress", []))
        yield writer.event("response.in_progress", response=reply.snapshot("in_progress", []))
        async for event in answer.events():
            if isinstance(event, ReasoningDelta):
                pieces = writer.delta("reasoning", event.text)
            elif isinstance(event, TextDelta):
                pieces = writer.delta("message", event.text)
            elif isinstance(event, ToolCallDelta):
                pieces = writer.call_piece(event)
            elif isinstance(event, Failed):
                pieces = writer.close("incomplete")
                pieces.append(writer.event("response.failed", response=reply.failed(writer.output, event.message)))
            elif isinstance(event, Done):
                status = status_of(event)
                pieces = writer.close("incomplete" if status == "incomplete" else "completed")
                response = reply.finished(writer.output, event)
                kind = "response.incomplete" if status == "incomplete" else "response.completed"
                pieces.append(writer.event(kind, response=response))
                await run_in_threadpool(reply.keep, response)
            else:
                continue
            for piece in pieces:
                yield piece
    finally:
        answer.cancel()
