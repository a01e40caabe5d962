"""Real-world tool schemas on a live server with a real chat model (the bundled SmolLM2 GGUF):
`$defs`/`$ref` (local, nested, `definitions`, recursive, `anyOf` of refs) work as tool parameters
through OpenAI's, Anthropic's and Ollama's APIs with every `tool_choice`, as they do as a
response format; `strict` tools take no undeclared keys; a function without `parameters` is
called with `{}`; `json_object` with a `schema` honours it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
from serve_support import CHAT, LiveServer, open_stories

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grammar"))
from test_schema_shapes import REF_SCHEMAS  # noqa: E402  (the grammar tests' schemas with refs)

ASK = [{"role": "user", "content": "Place an order for two apples. Use the tool."}]
OPENAI_CHOICES = {"auto": "auto", "required": "required", "named": {"type": "function", "function": {"name": "f"}}}
ANTHROPIC_CHOICES = {"auto": {"type": "auto"}, "required": {"type": "any"}, "named": {"type": "tool", "name": "f"}}


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=4096), max_batch=4).start()
    live = LiveServer(build_app(scheduler, "smollm2"))
    yield live
    live.stop()
    scheduler.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "smollm2", "temperature": 0, **body}, timeout=300)


def openai_calls(server, schema: dict, choice: str, max_tokens: int) -> list[dict]:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": ASK, "tools": [tool], "tool_choice": OPENAI_CHOICES[choice], "max_tokens": max_tokens}
    response = post(server, CHAT, body)
    assert response.status_code == 200, response.text
    choice_ = response.json()["choices"][0]
    if choice_["finish_reason"] != "tool_calls":
        return []
    return [json.loads(c["function"]["arguments"]) for c in choice_["message"]["tool_calls"]]


def anthropic_calls(server, schema: dict, choice: str, max_tokens: int) -> list[dict]:
    body = {
        "messages": ASK,
        "tools": [{"name": "f", "input_schema": schema}],
        "tool_choice": ANTHROPIC_CHOICES[choice],
        "max_tokens": max_tokens,
    }
    response = post(server, "/v1/messages", body)
    assert response.status_code == 200, response.text
    message = response.json()
    if message["stop_reason"] != "tool_use":
        return []
    return [block["input"] for block in message["content"] if block["type"] == "tool_use"]


def ollama_calls(server, schema: dict, choice: str, max_tokens: int) -> list[dict]:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": ASK, "tools": [tool], "stream": False, "options": {"num_predict": max_tokens}}
    response = post(server, "/api/chat", body)
    assert response.status_code == 200, response.text
    return [c["function"]["arguments"] for c in response.json()["message"].get("tool_calls", [])]


PROTOCOLS = {"openai": openai_calls, "anthropic": anthropic_calls, "ollama": ollama_calls}


@pytest.mark.parametrize("name", sorted(REF_SCHEMAS))
@pytest.mark.parametrize(
    "protocol, choice",
    [(p, c) for p in ("openai", "anthropic") for c in ("auto", "required", "named")] + [("ollama", "auto")],
)
def test_refs_in_tool_parameters_are_taken_with_every_choice(smollm2_server, name, protocol, choice):
    # one token: the schema compiles and the answer starts (it was a 400 before any token)
    PROTOCOLS[protocol](smollm2_server, REF_SCHEMAS[name], choice, 1)


@pytest.mark.parametrize("name", ["pydantic_defs", "recursive_list", "any_of_refs"])
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_a_required_call_with_refs_validates(smollm2_server, name, protocol):
    schema = REF_SCHEMAS[name]
    calls = PROTOCOLS[protocol](smollm2_server, schema, "required", 300)
    assert calls, "the call did not end within 300 tokens"
    for arguments in calls:
        jsonschema.validate(arguments, schema)


def test_a_refs_schema_as_a_response_format_validates(smollm2_server):
    schema = REF_SCHEMAS["pydantic_defs"]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}
    response = post(smollm2_server, CHAT, {"messages": ASK, "response_format": fmt, "max_tokens": 300})
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), schema)


def test_a_tool_without_parameters_is_called_with_nothing(smollm2_server):
    tool = {"type": "function", "function": {"name": "f", "description": "The time now."}}
    body = {"messages": [{"role": "user", "content": "What time is it?"}], "tools": [tool], "tool_choice": "required"}
    response = post(smollm2_server, CHAT, {**body, "max_tokens": 40})
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{}] * len(calls) and calls


def test_a_strict_tool_takes_no_undeclared_keys(smollm2_server):
    parameters = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
    for seed in range(3):
        body = {"messages": ASK, "tools": [tool], "tool_choice": "required", "max_tokens": 60, "seed": seed}
        response = post(smollm2_server, CHAT, {**body, "temperature": 1.0})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        for call in choice["message"].get("tool_calls") or []:
            assert set(json.loads(call["function"]["arguments"])) <= {"fruit"}


def test_json_object_with_a_schema_honours_it(smollm2_server):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_object", "schema": schema}
    response = post(smollm2_server, CHAT, {"messages": ASK, "response_format": fmt, "max_tokens": 40})
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["message"]["content"]), schema)


def test_a_format_string_and_an_untyped_value_end_valid(smollm2_server):
    # an email's local part, or an untyped value's digits, once grew until max_tokens
    schema = {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email"}, "extra": {}},
        "required": ["email", "extra"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "contact", "schema": schema}}
    ask = [{"role": "user", "content": "Give me a contact as JSON."}]
    for seed in range(2):
        body = {"messages": ask, "response_format": fmt, "max_tokens": 400, "seed": seed, "temperature": 1.0}
        choice = post(smollm2_server, CHAT, body).json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
