"""Chat templates: a model's Jinja template rendered exactly as transformers renders it.

Same environment (sandboxed, trim_blocks, lstrip_blocks, loop controls), same helpers
(`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and HTML characters),
same inputs (messages without None-valued keys, reasoning under every name templates
read, the tokenizer's special-token strings, then the caller's keyword arguments).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ferrum_mac.errors import FerrumError
from ferrum_mac.text.tool_calls import (
    ToolFormat,
    messages_without_tool_fields,
    template_renders_tools,
    tool_format,
    tools_system_message,
)

# Used when a model ships no template; ChatML is what most small chat models speak.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# For a model without ChatML tokens (a base model): plain "Role: text" turns.
PLAIN = (
    "{{ bos_token if bos_token is defined else '' }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# The names a message's reasoning comes under; templates read `reasoning_content`
# (Qwen3, DeepSeek) or `thinking` (gpt-oss).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(FerrumError):
    """A chat template that does not compile or refuses the conversation."""


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, name: str = "default"):
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _compile(source)
        except (jinja2.TemplateError, RecursionError, TypeError, ValueError) as e:
            raise ChatTemplateError(
                f"the model's chat template does not compile ({_one_line(e)}); fix or replace it"
            ) from None

    @property
    def renders_tools(self) -> bool:
        """Whether the template has its own tool section (else `render` writes the tools into a system message)."""
        return template_renders_tools(self.source)

    @property
    def tool_format(self) -> ToolFormat:
        """The call format the model was taught, to parse its calls with."""
        return tool_format(self.source)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; keyword arguments (e.g. `enable_thinking=False`)
        reach the template as variables. `tools`: OpenAI tool objects; a template without a tool
        section gets them (and the calls and results in `messages`) as Hermes-style text."""
        if not self.renders_tools and (tools or _mentions_tools(messages)):
            messages, tools = _tools_as_text(messages, tools or ()), None
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=[_template_message(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused this conversation: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001  the template is the model's code: whatever it raises fails this render
            raise ChatTemplateError(
                f"the chat template failed on this conversation ({type(e).__name__}: {_one_line(e)})"
            ) from None


def _mentions_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _tools_as_text(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    out = messages_without_tool_fields(messages)
    if not tools:
        return out
    described = tools_system_message(tools)
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{described}".lstrip()}, *out[1:]]
    return [{"role": "system", "content": described}, *out]


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


def _template_message(message: Mapping[str, Any]) -> dict:
    """A copy without None values, with reasoning under each name templates look for."""
    plain = {k: v for k, v in message.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' (and so the templates') does not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering it is just its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def fallback_template(has_chatml_tokens: bool) -> str:
    """The template to use when a model has none."""
    return CHATML if has_chatml_tokens else PLAIN
