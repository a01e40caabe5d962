"""Every request body checked at the edge, whatever its protocol: OpenAI-shaped bodies -> checked options.

The Anthropic and Ollama modules translate their bodies into OpenAI's shape first, so this is
the one validation layer (`call.call_from_openai` builds a call from its answers). Checks follow
the OpenAI API: a wrong field answers 400 with `{"error": {message, type,
param, code}}`. Everything a client sends is checked here, at the edge: JSON nested at most
`MAX_DEPTH` deep, no NaN or infinities, strings that are valid Unicode (no lone surrogates),
every number finite and in its range. Fields ferrum cannot honour (functions, audio, `echo` with
`logprobs`, ...) are refused rather than ignored; vLLM's extras `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos` and `chat_template_kwargs` are accepted.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from ferrum_mac.engine import SEED_LIMIT, SamplingParams
from ferrum_mac.engine.structured import ResponseFormat
from ferrum_mac.engine.tools import ToolRequest
from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar import GrammarError
from ferrum_mac.grammar.schema import call_grammar
from ferrum_mac.serve.api_errors import ApiError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
MAX_CHOICES = 8  # `n`: answers to one request (each a sequence of the batch)
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs`, OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # completions' `logprobs`, OpenAI's limit

MAX_STOPS = 4
MAX_STOP_CHARS = 1000  # the answer is searched for each at every token
MAX_DEPTH = 32  # JSON nesting a request may have; real requests nest under ten deep
LOGIT_BIAS_RANGE = 100  # OpenAI's: biases from -100 (ban) to 100 (force)
# Fields another protocol's body carries with chat's name and meaning, passed on as they are
# (top_k and the others top-level from older clients, or through the SDKs' extra_body).
PASSED_AS_IS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "logit_bias",
    "stream",
    "chat_template_kwargs",
    "speculate",  # ferrum's own: auto, ngram or off
)
# The variables ChatTemplate.render passes itself; chat_template_kwargs may not replace them.
TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "raise_exception", "strftime_now"}
)
# field -> the value ferrum can honour (None: absent only)
UNSUPPORTED = {
    "functions": None,
    "function_call": None,
    "audio": None,
    "prediction": None,
    "best_of": 1,
    "suffix": None,
}


@dataclass
class Options:
    sampling: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    template_kwargs: dict = field(default_factory=dict)
    response_format: ResponseFormat | None = None  # None: free text
    n: int = 1  # answers to the request, each its own sequence
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k likeliest
    echo: bool = False  # a completion: its text starts with the prompt


def parse_json(raw: bytes):
    """The request body as JSON, or a 400 for anything that is not strict JSON of sane depth, or
    holds a number no field can take (NaN, infinities, past a float's range), named by its place."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    _check_values(body)
    return body


def check_body(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in (None, allowed):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    return body


def options(
    body: dict, defaults: SamplingParams, vocab_size: int, template_names=frozenset(), chat: bool = True
) -> Options:
    """The request's settings over the model's defaults. `template_names`: the variables the
    chat template gets besides TEMPLATE_ARGUMENTS (its special tokens); `chat`: the body is a
    chat's (else a completion's, whose `logprobs` is a count and which may `echo`)."""
    sampling = _sampling(body, defaults, vocab_size)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stream_options = _typed(body, "stream_options", dict) or {}
    return Options(
        sampling=sampling,
        max_tokens=max_tokens,
        stop=_stops(body),
        stream=bool(_typed(body, "stream", bool)),
        include_usage=bool(_typed(stream_options, "include_usage", bool)),
        template_kwargs=_template_kwargs(body, TEMPLATE_ARGUMENTS | frozenset(template_names)),
        ignore_eos=bool(_typed(body, "ignore_eos", bool)),
        response_format=response_format(body),
        n=_integer(body, "n", 1, MAX_CHOICES) or 1,
        logprobs=logprobs_asked(body, chat),
        echo=_echo(body, chat),
    )


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many likeliest tokens each answer token's log-probability comes with; None: no
    log-probabilities. A chat says `logprobs: true` and `top_logprobs` (0 to 20), a completion
    `logprobs` (0 to 5)."""
    if not chat:
        return None if body.get("logprobs") is False else _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    asked = _typed(body, "logprobs", bool)
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not asked:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    return (top or 0) if asked else None


def _echo(body: dict, chat: bool) -> bool:
    echo = bool(_typed(body, "echo", bool))
    if echo and chat:
        raise ApiError(400, "'echo' is a completions field", param="echo", code="unsupported_parameter")
    if echo and body.get("logprobs") not in (None, False):
        raise ApiError(
            400,
            "'echo' with 'logprobs' (the prompt's log-probabilities) is not supported; ask for either alone",
            param="echo",
            code="unsupported_parameter",
        )
    return echo


def response_format(body: dict) -> ResponseFormat | None:
    """`response_format` as the engine's: `text` (None), `json_object` (with a `schema`, as
    several servers take it, that schema), or `json_schema` `{"name", "schema", "strict"}`;
    anything else a 400. Whether the schema compiles is checked against the model's vocabulary
    later (`GrammarError`, also a 400)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat(_schema(fmt, "response_format.schema"))
    if kind != "json_schema":
        raise ApiError(
            400,
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
            "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
            param="response_format",
            code="invalid_value",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(
            400, "response_format.json_schema must be an object with 'name' and 'schema'", param="response_format"
        )
    _typed(spec, "name", str)
    strict = _typed(spec, "strict", bool)
    return ResponseFormat(_schema(spec, "response_format.json_schema.schema"), strict is True)


def _schema(holder: dict, name: str) -> dict | None:
    schema = holder.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ApiError(400, f"{name} must be a JSON schema object", param="response_format")
    return schema


def _sampling(body: dict, defaults: SamplingParams, vocab_size: int) -> SamplingParams:
    changes = dict(
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1, low_open=True),
        top_k=_integer(body, "top_k", 0),
        min_p=_number(body, "min_p", 0, 1),
        repetition_penalty=_number(body, "repetition_penalty", 0, None, low_open=True),
        presence_penalty=_number(body, "presence_penalty", -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2),
        seed=_integer(body, "seed", 0, SEED_LIMIT - 1),
        logit_bias=_logit_bias(body, vocab_size),
    )
    try:
        return defaults.replace(**changes)
    except FerrumError as e:  # a combination the engine refuses (its own checks)
        raise ApiError(400, str(e), code="invalid_value") from None


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    out = []
    call_ids: set[str] = set()  # ids of the calls assistant messages made so far
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' string", param=f"messages[{i}]")
        message = {**m, "content": _content_text(m.get("content"), i)}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = _assistant_calls(m["tool_calls"], i)
            call_ids.update(c["id"] for c in message["tool_calls"])
        elif m["role"] == "tool":
            _check_tool_result(m, i, call_ids)
        out.append(message)
    return out


# -- tools -----------------------------------------------------------------------------------


def tool_request(body: dict) -> ToolRequest | None:
    """The checked `tools` and `tool_choice`; None when the model gets no tools (none sent, or
    `tool_choice` "none")."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = _typed(body, "parallel_tool_calls", bool)
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools' to choose from", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(
            400, f"'tools' must be an array of at most {MAX_TOOLS} tools", param="tools", code="invalid_type"
        )
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})[0]
        raise ApiError(
            400, f"two tools are named '{twice}'; tool names must differ", param="tools", code="invalid_value"
        )
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        choice, allowed = _allowed_tools(choice.get("allowed_tools"), names)
        functions = tuple(f for f in functions if f["name"] in allowed)
    choice = _tool_choice(choice, names)
    if choice == "none":
        return None
    return ToolRequest(functions, choice, parallel is not False)


def _allowed_tools(allowed, names: list[str]) -> tuple[str, set[str]]:
    """`tool_choice` {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}: the mode
    ("auto" or "required") and the names the answer may call (the model is shown only those)."""
    wrong = ApiError(
        400,
        "'tool_choice.allowed_tools' must be {'mode': 'auto' or 'required', 'tools': "
        "[{'type': 'function', 'function': {'name': ...}}, ...]}",
        param="tool_choice",
        code="invalid_value",
    )
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required"):
        raise wrong
    tools = allowed.get("tools")
    if not isinstance(tools, list) or not tools:
        raise wrong
    chosen = set()
    for tool in tools:
        name = (tool.get("function") or {}).get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str) or name not in names:
            raise ApiError(
                400,
                f"'tool_choice.allowed_tools' names the function {str(name)[:64]!r}, which is not among 'tools'",
                param="tool_choice",
                code="invalid_value",
            )
        chosen.add(name)
    return allowed["mode"], chosen


def _function(tool, i: int) -> dict:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ApiError(
            400, f"{param} must be {{'type': 'function', 'function': {{...}}}}", param=param, code="invalid_type"
        )
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ApiError(
            400,
            f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'",
            param=f"{param}.function.name",
            code="invalid_value",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ApiError(400, f"{param}.function.description must be a string", param=param, code="invalid_type")
    function = {
        k: v for k, v in function.items() if k in ("name", "description", "parameters", "strict") and v is not None
    }
    if function.get("parameters") is not None:
        _check_parameters(function["parameters"], function, f"{param}.function.parameters")
    return function


def _check_parameters(parameters, function: dict, param: str) -> None:
    """A parameters schema constrained decoding can take: a JSON schema of an object whose
    references resolve. Whether the engine compiles it is checked before the answer starts
    (`serve.core`, bounded in time and memory)."""
    if not isinstance(parameters, dict):
        raise ApiError(400, f"{param} must be a JSON schema object", param=param, code="invalid_type")
    try:
        call_grammar([function])
    except GrammarError as e:
        raise ApiError(400, str(e), param=param, code="invalid_schema") from None


def _tool_choice(choice, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if isinstance(name, str) and name in names:
            return name
        raise ApiError(
            400,
            f"'tool_choice' names the function {str(name)[:64]!r}, which is not among 'tools' ({', '.join(names)})",
            param="tool_choice",
            code="invalid_value",
        )
    raise ApiError(
        400,
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
        code="invalid_value",
    )


def _assistant_calls(calls, i: int) -> list[dict]:
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(400, f"{param} must be an array", param=param, code="invalid_type")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise ApiError(
                400,
                f"{param}[{j}] must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}",
                param=f"{param}[{j}]",
                code="invalid_type",
            )
        try:
            json.loads(function["arguments"])
        except ValueError:
            raise ApiError(
                400, f"{param}[{j}].function.arguments is not JSON text", param=f"{param}[{j}]", code="invalid_value"
            ) from None
        out.append(
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": function["name"], "arguments": function["arguments"]},
            }
        )
    return out


def _check_tool_result(message: dict, i: int, call_ids: set[str]) -> None:
    call_id = message.get("tool_call_id")
    if not isinstance(call_id, str) or call_id not in call_ids:
        raise ApiError(
            400,
            f"messages[{i}] (role 'tool') needs a 'tool_call_id' naming a call in an earlier assistant message's "
            f"'tool_calls'; {str(call_id)[:64]!r} is none of them",
            param=f"messages[{i}].tool_call_id",
            code="invalid_value",
        )


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)", param="prompt")


# -- field checks ----------------------------------------------------------------------------


def _typed(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ApiError(400, f"'{name}' must be a {kind.__name__}", param=name, code="invalid_type")
    return value


def _number(body: dict, name: str, low, high, low_open: bool = False, param: str | None = None) -> float | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a finite number", param=param, code="invalid_type")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        bound = f"above {low}" if low_open else f"at least {low}"
        raise ApiError(
            400,
            f"'{name}' is {value}; it must be {bound}" + (f" and at most {high}" if high is not None else ""),
            param=param,
            code="invalid_value",
        )
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1.0 is an integer to JSON
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name, code="invalid_type")
    if value < low or (high is not None and value > high):
        bound = f"at least {low}" + (f" and at most {high}" if high is not None else "")
        raise ApiError(400, f"'{name}' is {value}; it must be {bound}", param=name, code="invalid_value")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(
            400,
            f"'stop' must be a string or an array of at most {MAX_STOPS} strings",
            param="stop",
            code="invalid_type",
        )
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400, f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters", param="stop", code="invalid_value"
        )
    return tuple(stops)


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    bias = _typed(body, "logit_bias", dict)
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise ApiError(
                400,
                f"'logit_bias' keys must be token ids; {key[:40]!r} is not",
                param="logit_bias",
                code="invalid_type",
            )
        if int(key) >= vocab_size:
            raise ApiError(
                400,
                f"'logit_bias' names token {key}, outside the vocabulary (0 to {vocab_size - 1})",
                param="logit_bias",
                code="invalid_value",
            )
        value = _number(bias, key, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE, param="logit_bias")
        if value is None:
            raise ApiError(400, f"'logit_bias' gives token {key} no number", param="logit_bias", code="invalid_type")
        out[int(key)] = value
    return out


def _template_kwargs(body: dict, reserved: frozenset) -> dict:
    kwargs = _typed(body, "chat_template_kwargs", dict) or {}
    taken = sorted(reserved.intersection(kwargs))
    if taken:
        raise ApiError(
            400,
            f"'chat_template_kwargs' may not set {', '.join(taken)}: the server sets them",
            param="chat_template_kwargs",
            code="invalid_value",
        )
    return kwargs


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")


def _check_values(body) -> None:
    """No nesting past MAX_DEPTH, no string that is not valid Unicode (JSON's \\ud800 escapes
    make lone surrogates, which tokenizers and templates cannot take), and every number finite
    and within a float's range, so no field's check meets one it cannot compare or convert. A
    value's place is kept as a chain of (parent, key), made a path only for an error."""
    pending: list[tuple[Any, int, Any]] = [(body, 1, None)]
    while pending:
        value, depth, place = pending.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not _float_sized(value):
                raise _number_too_large(value, _path(place))
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            if isinstance(value, dict):
                pending.extend((k, depth, place) for k in value)
                pending.extend((v, depth + 1, (place, k)) for k, v in value.items())
            else:
                pending.extend((v, depth + 1, (place, i)) for i, v in enumerate(value))


def _float_sized(number: int | float) -> bool:
    return math.isfinite(number) if isinstance(number, float) else abs(number) <= sys.float_info.max


def _path(place) -> str:
    """`messages[0].content` for the chain (((None, "messages"), 0), "content")."""
    keys = []
    while place is not None:
        place, key = place
        keys.append(key)
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys)).lstrip(".")


def _number_too_large(number: int | float, path: str) -> ApiError:
    shown = f"a number of {len(str(abs(number)))} digits" if isinstance(number, int) else str(number)
    return ApiError(
        400,
        f"'{path[:200]}' is {shown}, which no field takes (JSON allows no NaN or infinity, and numbers must "
        "fit a float); send a finite number in the field's range",
        param=path[:200] or None,
        code="invalid_json",
    )


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"the request holds a string that is not valid Unicode ({e.reason} at index {e.start}); send UTF-8 text",
            code="invalid_text",
        ) from None


def _content_text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(
        400,
        f"messages[{i}].content must be a string or an array of text parts",
        param=f"messages[{i}].content",
        code="invalid_type",
    )
