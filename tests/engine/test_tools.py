"""Python functions registered as tools: schemas from signatures that the server accepts and the
grammar engine compiles, runs with JSON arguments, and one-line errors for what cannot work."""

from __future__ import annotations

import json
from typing import Literal, Optional

import jsonschema
import pytest

from ferrum_mac.engine.tools import Tool, ToolError, Toolbox, schema_of, tool
from ferrum_mac.grammar import tool_call_grammar
from ferrum_mac.serve import checks as api


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: Optional[int] = None) -> str:
    """The current weather in a city.

    More text that is not the description."""
    return f"18 degrees {unit} in {city}"


def plan(stops: list[str], budget: float, notes: dict, urgent: bool = False) -> dict:
    return {"stops": len(stops), "budget": budget, "urgent": urgent}


def test_schema_from_the_signature():
    assert get_weather.description == "The current weather in a city."
    assert get_weather.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["city"],
        "additionalProperties": False,
    }
    schema = schema_of(plan)
    jsonschema.validate({"stops": ["a"], "budget": 2.5, "notes": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"stops": "a", "budget": 2.5, "notes": {}}, schema)


def test_definitions_pass_the_servers_checks_and_compile_as_a_call_grammar():
    box = Toolbox([get_weather, plan, tool(lambda: "pong", name="ping", description="Answers pong")])
    body = {"tools": box.definitions(), "tool_choice": "required"}
    request = api.tool_request(body)
    assert [f["name"] for f in request.forced] == ["get_weather", "plan", "ping"]
    assert tool_call_grammar(request.forced)


def test_run_with_json_or_a_dict():
    box = Toolbox([get_weather, plan])
    assert box.run("get_weather", '{"city": "Paris"}') == "18 degrees celsius in Paris"
    assert json.loads(box.run("plan", {"stops": ["a", "b"], "budget": 3, "notes": {}})) == {
        "stops": 2,
        "budget": 3,
        "urgent": False,
    }


def test_given_schema_and_name_win():
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    t = tool(lambda q: q.upper(), name="shout", description="Upper case", parameters=schema)
    assert isinstance(t, Tool) and t.definition()["function"] == {
        "name": "shout",
        "description": "Upper case",
        "parameters": schema,
    }
    assert t.run('{"q": "hi"}') == "HI"


def _boom(x: int) -> int:
    raise RuntimeError("disk full\nmore")


@pytest.mark.parametrize(
    "name, arguments, fragment",
    [
        ("get_weather", "{}", "missing city"),
        ("get_weather", '{"city": "P", "color": "red"}', "unknown color"),
        ("get_weather", "{oops", "not JSON"),
        ("get_weather", "[1]", "must be a JSON object"),
        ("nope", "{}", "no tool here"),
        ("_boom", '{"x": 1}', "failed: RuntimeError: disk full"),
    ],
)
def test_calls_that_cannot_run_are_one_line_errors(name, arguments, fragment):
    box = Toolbox([get_weather, _boom])
    with pytest.raises(ToolError) as e:
        box.run(name, arguments)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_bad_definitions_are_refused():
    def untyped(x):
        return x

    def odd(x: complex) -> None:
        return None

    with pytest.raises(ToolError, match="needs a type annotation"):
        tool(untyped)
    with pytest.raises(ToolError, match="cannot take"):
        tool(odd)
    with pytest.raises(ToolError, match="1 to 64"):
        tool(get_weather.function, name="bad name")
    with pytest.raises(ToolError, match="registered already"):
        Toolbox([get_weather, get_weather])
