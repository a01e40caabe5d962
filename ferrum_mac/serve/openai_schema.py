"""OpenAI request bodies -> checked options, and engine events -> OpenAI response bodies.

Checks follow the OpenAI API: a wrong field answers 400 with `{"error": {message, type,
param, code}}`. Fields ferrum cannot honour (n > 1, tools, logprobs, ...) are refused rather
than ignored; vLLM's extras `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos` and `chat_template_kwargs` are accepted.
"""

from __future__ import annotations

import numbers
import time
import uuid
from dataclasses import dataclass, field

from ferrum_mac.engine import CANCELLED, CONTEXT, MAX_TOKENS, Done, SamplingParams

MAX_STOPS = 4
# field -> the value ferrum can honour (None: absent only)
UNSUPPORTED = {
    "tools": None, "functions": None, "function_call": None, "tool_choice": "none", "logprobs": False,
    "top_logprobs": None, "audio": None, "prediction": None, "best_of": 1, "echo": False, "suffix": None,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Options:
    sampling: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    template_kwargs: dict = field(default_factory=dict)


def check_body(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in (None, allowed):
            raise ApiError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ApiError(400, "only response_format {'type': 'text'} is supported", param="response_format",
                       code="unsupported_parameter")
    return body


def options(body: dict, defaults: SamplingParams) -> Options:
    sampling = defaults.replace(
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1, low_open=True),
        top_k=_integer(body, "top_k", 0),
        min_p=_number(body, "min_p", 0, 1),
        repetition_penalty=_number(body, "repetition_penalty", 0, None, low_open=True),
        presence_penalty=_number(body, "presence_penalty", -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", -2, 2),
        seed=_integer(body, "seed", None),
        logit_bias=_logit_bias(body),
    )
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stream_options = _typed(body, "stream_options", dict) or {}
    kwargs = _typed(body, "chat_template_kwargs", dict) or {}
    return Options(
        sampling=sampling, max_tokens=max_tokens, stop=_stops(body), stream=bool(_typed(body, "stream", bool)),
        include_usage=bool(stream_options.get("include_usage")), template_kwargs=kwargs,
        ignore_eos=bool(_typed(body, "ignore_eos", bool)),
    )


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a 'role' string", param=f"messages[{i}]")
        out.append({**m, "content": _content_text(m.get("content"), i)})
    return out


def completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt per request)", param="prompt")


# -- responses -------------------------------------------------------------------------------


def finish_reason(done: Done) -> str:
    return "length" if done.stop_reason in (MAX_TOKENS, CONTEXT) else "stop"


def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.generated_tokens,
            "total_tokens": done.prompt_tokens + done.generated_tokens}


def stats(done: Done) -> dict:
    """ferrum's own figures (time to first token, tok/s); OpenAI clients ignore the field."""
    return {**done.as_dict(), "cancelled": done.stop_reason == CANCELLED}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def envelope(kind: str, request_id: str, model: str) -> dict:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model}


# -- field checks ----------------------------------------------------------------------------


def _typed(body: dict, name: str, kind: type):
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ApiError(400, f"'{name}' must be a {kind.__name__}", param=name, code="invalid_type")
    return value


def _number(body: dict, name: str, low, high, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ApiError(400, f"'{name}' must be a number", param=name, code="invalid_type")
    if (value <= low if low_open else value < low) or (high is not None and value > high):
        bound = f"above {low}" if low_open else f"at least {low}"
        raise ApiError(400, f"'{name}' is {value}; it must be {bound}" + (f" and at most {high}" if high is not None else ""),
                       param=name, code="invalid_value")
    return float(value)


def _integer(body: dict, name: str, low: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name, code="invalid_type")
    if low is not None and value < low:
        raise ApiError(400, f"'{name}' is {value}; it must be at least {low}", param=name, code="invalid_value")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a string or an array of at most {MAX_STOPS} strings", param="stop",
                       code="invalid_type")
    return tuple(stops)


def _logit_bias(body: dict) -> dict[int, float] | None:
    bias = _typed(body, "logit_bias", dict)
    if not bias:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise ApiError(400, "'logit_bias' must map token ids to numbers", param="logit_bias", code="invalid_type") from None


def _content_text(content, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or an array of text parts", param=f"messages[{i}].content",
                   code="invalid_type")
