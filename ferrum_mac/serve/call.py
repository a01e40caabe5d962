"""One request, whatever protocol it came in: the three API modules translate into a `ChatCall`.

There is one validation layer. A protocol module builds an OpenAI-shaped body from its own
(`messages`, `max_completion_tokens`, `stop`, `response_format`, `tools`, ...) and passes it to
`call_from_openai`, which runs the same checks as the OpenAI routes: a limit or a fix applies to
every protocol. `renames` maps OpenAI's field names to the protocol's own, so its client is told
about the field it sent (`max_tokens`, not `max_completion_tokens`).

The answer comes back as neutral events (`ferrum_mac.serve.events`), which each module renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ferrum_mac.engine import SamplingParams
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.events import Finished, ToolCallDelta
from ferrum_mac.serve.batching.speculation import speculate_field

__all__ = ["ChatCall", "Finished", "Limits", "ToolCallDelta", "call_from_openai", "renamed"]


@dataclass
class ChatCall:
    """One request, whatever protocol it came in; the three API modules translate into it."""

    messages: list[dict] | None  # chat: OpenAI-shaped messages, checked (api.chat_messages)
    options: api.Options  # sampling, max_tokens, stop, response_format, template_kwargs, ignore_eos
    tools: api.ToolRequest | None = None
    prompt: str | list[int] | None = None  # a completion (messages None): text or token ids
    model: str | None = None  # the body's model field; None/"" = the server's default
    keep_alive_s: float | None = None  # Ollama's keep_alive for this model; None = the server's
    speculate: str | None = None  # auto, ngram or off (`speculate`, ferrum's own field); None = the server's


@dataclass(frozen=True)
class Limits:
    """What a request is checked against that depends on the model answering it."""

    sampling: SamplingParams  # the model's defaults, which the request's settings override
    vocab_size: int
    template_names: frozenset = frozenset()  # variables the chat template gets (its special tokens)


def call_from_openai(
    body: dict, limits: Limits, renames: Mapping[str, str] | None = None, *, chat: bool = True
) -> ChatCall:
    """The checked call of an OpenAI-shaped body: a chat (`messages`), or with `chat` False a
    completion (`prompt`). Compiles each tool's parameters schema: run it on a worker thread."""
    try:
        body = api.check_body(body)
        messages = api.chat_messages(body) if chat else None
        prompt = None if chat else api.completion_prompt(body)
        options = api.options(body, limits.sampling, limits.vocab_size, limits.template_names, chat=chat)
        tools = api.tool_request(body) if chat else None
        speculate = speculate_field(body)
    except api.ApiError as e:
        raise renamed(e, renames or {}) from None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise renamed(api.ApiError(400, "'model' must be a string", param="model", code="invalid_type"), renames or {})
    return ChatCall(messages, options, tools, prompt, model or None, speculate=speculate)


def renamed(error: api.ApiError, renames: Mapping[str, str]) -> api.ApiError:
    """`error` speaking of the protocol's own field names: its `param` (and a path under it, as
    `messages[2].content`) and the quoted name in its message."""
    if not error.param or not renames:
        return error
    head = error.param.split("[")[0].split(".")[0]
    new = renames.get(head)
    if new is None:
        return error
    error.param = new + error.param[len(head) :]
    error.message = error.message.replace(f"'{head}", f"'{new}").replace(f"{head}[", f"{new}[")
    error.args = (error.message,)
    return error
