"""Tools on `ferrum serve`: bad tool definitions, choices and histories are 400s naming the
problem; answers carry `tool_calls` the way OpenAI's API does, streamed and not, through the
official `openai` client; markup never reaches the text."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import CHAT, LiveServer, chat, error_of, open_stories

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MARKUP = ("<tool_call>", "</tool_call>", "<tool_")


def _function(name: str, parameters) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BAD_TOOLS = [
    ("not a list", {"type": "function"}, "tools"),
    ("wrong type", [{"type": "retrieval"}], "tools[0]"),
    ("bad name", [_function("get weather!", {"type": "object"})], "tools[0].function.name"),
    ("long name", [_function("x" * 65, {"type": "object"})], "tools[0].function.name"),
    ("invalid schema", [_function("f", {"type": "objekt"})], "tools[0].function.parameters"),
    ("schema not an object", [_function("f", [1, 2])], "tools[0].function.parameters"),
    ("same name twice", [WEATHER, WEATHER], "tools"),
]


@pytest.mark.parametrize("case, tools, param", BAD_TOOLS, ids=[c[0] for c in BAD_TOOLS])
def test_bad_tools_are_400s(server, case, tools, param):
    error = error_of(chat(server, tools=tools), 400)
    assert error["param"] == param, error


def test_unsupported_schema_keyword_is_named(server):
    tools = [_function("f", {"type": "object", "properties": {"a": {"type": "string", "format": "uuid-ish", "contentSchema": {}}}, "$dynamicRef": "#x"})]
    response = chat(server, tools=tools)
    if response.status_code == 200:
        pytest.skip("the grammar engine accepts every keyword of this schema")
    error = error_of(response, 400)
    assert error["param"] == "tools[0].function.parameters" and error["code"] == "invalid_schema"


@pytest.mark.parametrize(
    "choice, fragment",
    [
        ({"type": "function", "function": {"name": "nope"}}, "'nope'"),
        ("sometimes", "'tool_choice' must be"),
        ({"type": "function"}, "'tool_choice' must be"),
    ],
)
def test_bad_tool_choice_is_400(server, choice, fragment):
    error = error_of(chat(server, tools=[WEATHER], tool_choice=choice), 400)
    assert error["param"] == "tool_choice" and fragment in error["message"]


def test_tool_choice_without_tools_is_400(server):
    error = error_of(chat(server, tool_choice="required"), 400)
    assert error["param"] == "tool_choice"


@pytest.mark.parametrize(
    "history, param",
    [
        ([{"role": "tool", "content": "18C"}], "messages[1].tool_call_id"),
        ([{"role": "tool", "tool_call_id": "call_1", "content": "18C"}], "messages[1].tool_call_id"),
        ([{"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "18C"}], "messages[2].tool_call_id"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}], "messages[1].tool_calls[0]"),
        ([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}], "messages[1].tool_calls[0]"),
    ],
)
def test_bad_tool_history_is_400(server, history, param):
    messages = [{"role": "user", "content": "Weather in Paris?"}, *history]
    error = error_of(chat(server, messages=messages, tools=[WEATHER]), 400)
    assert error["param"] == param, error


def test_a_history_with_calls_and_results_renders(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    response = chat(server, messages=messages)  # stories' 512 tokens hold no tool descriptions
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_tool_choice_none_answers_in_text(server):
    response = chat(server, tools=[WEATHER], tool_choice="none")
    assert response.status_code == 200 and "tool_calls" not in response.json()["choices"][0]["message"]
