"""Tools in the engine's conversations, on the bundled SmolLM2 GGUF (its template teaches the tools
in Hermes' words): the calls come as a `ToolCallRequested` and the message's `tool_calls`, never
as markup in the text; a required call validates; the results go back as `tool` messages and the
model answers with them."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine_helpers import answer, done, greedy
from ferrum_mac.engine import TOOL_CALLS, ToolCallRequested
from ferrum_mac.engine.tools import ToolError, Toolbox, ToolRequest, tool
from ferrum_mac.errors import FerrumError

MARKUP = ("<tool_call>", "</tool_call>")
asked: list[str] = []


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    asked.append(city)
    return f"It is sunny and 21 degrees in {city}."


@tool
def get_time(zone: str) -> str:
    """The current time in a time zone."""
    return "12:00"


BOX = Toolbox([get_weather, get_time])


def assert_consistent_with_tools(engine, conv) -> None:
    """The ledger is what the cache holds and starts with the history rendered with the tools."""
    assert engine.model.state.length(conv.cache_id) == len(conv.ledger)
    _, fresh = engine.render(conv.settings, conv.messages[:-1], BOX.definitions())
    assert conv.ledger[: len(fresh)] == fresh


def requested(events) -> tuple:
    found = [e for e in events if isinstance(e, ToolCallRequested)]
    assert len(found) == 1, events
    return found[0].calls


def test_required_call_validates_and_the_answer_uses_its_result(smollm2):
    asked.clear()
    with greedy(smollm2, max_tokens=120) as conv:
        events = list(
            conv.send("What is the weather in Paris?", tools=BOX, tool_choice="get_weather", parallel_tool_calls=False)
        )
        calls = requested(events)
        assert done(events).stop_reason == TOOL_CALLS and [c.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].arguments), get_weather.parameters)
        assert not any(m in answer(events) for m in MARKUP)
        message = conv.messages[-1]
        assert message["role"] == "assistant" and message["tool_calls"] == [calls[0].as_openai()]
        assert_consistent_with_tools(smollm2, conv)

        conv.add_tool_results(BOX.results(calls))
        assert asked and conv.messages[-1] == {
            "role": "tool",
            "tool_call_id": calls[0].id,
            "content": f"It is sunny and 21 degrees in {asked[0]}.",
        }
        prompt, _ = smollm2.render(conv.settings, conv.messages, BOX.definitions())
        assert "<tool_response>\nIt is sunny" in prompt  # the model reads the result
        events = list(conv.continue_answer(tools=BOX))
        assert done(events).stop_reason in ("eos", TOOL_CALLS)
        text = answer(events)
        assert text.strip() or any(isinstance(e, ToolCallRequested) for e in events)
        assert not any(m in text for m in MARKUP)
        assert conv.messages[-1]["role"] == "assistant"
        if not any(isinstance(e, ToolCallRequested) for e in events):
            assert "21" in text or "sunny" in text.lower(), text  # it answered with the result


def test_parallel_required_calls_each_validate(smollm2):
    """The grammar of a required answer takes one or more calls; a prompt that asks for two gets two."""
    with greedy(smollm2, max_tokens=160) as conv:
        events = list(
            conv.send(
                "Call get_weather for Paris and then get_weather for Rome. Make two calls.",
                tools=BOX,
                tool_choice="required",
            )
        )
        calls = requested(events)
        assert conv.messages[-1]["content"].strip() == ""  # the calls alone, no markup
    assert len(calls) >= 2, calls
    for call in calls:
        schema = get_weather.parameters if call.name == "get_weather" else get_time.parameters
        jsonschema.validate(json.loads(call.arguments), schema)
    assert len({c.id for c in calls}) == len(calls)


def test_auto_may_answer_in_text_and_none_offers_no_tools(smollm2):
    assert ToolRequest.of(BOX, "none") is None and ToolRequest.of([], "auto") is None
    with greedy(smollm2, max_tokens=32) as conv:
        events = list(conv.send("Say hello.", tools=BOX))
        assert not any(m in answer(events) for m in MARKUP)
        assert_consistent_with_tools(smollm2, conv)


def test_bad_tool_arguments_are_clear_errors(smollm2):
    with greedy(smollm2, max_tokens=8) as conv:
        with pytest.raises(ToolError, match="none of the tools"):
            conv.send("Hi", tools=BOX, tool_choice="get_news")
        with pytest.raises(ToolError, match="must be a Tool"):
            conv.send("Hi", tools=[{"name": "f"}])
        with pytest.raises(FerrumError, match="nothing to continue"):
            conv.continue_answer()
        with pytest.raises(FerrumError, match="no call of the last answer"):
            conv.add_tool_results({"call_x": "18C"})
        assert conv.messages == []


@pytest.mark.parametrize("max_tokens", [8, 14])
def test_a_required_call_cut_by_max_tokens_is_a_cut_answer_not_a_call(smollm2, max_tokens):
    """Cut inside its only call: no call to run, no markup as text, and the answer says it was cut."""
    with greedy(smollm2, max_tokens=max_tokens) as conv:
        events = list(conv.send("Weather in Paris?", tools=[get_weather], tool_choice="required"))
        assert not any(isinstance(e, ToolCallRequested) for e in events)
        assert done(events).stop_reason == "max_tokens"
        assert answer(events) == "" and conv.messages[-1]["content"] == ""
        assert "tool_calls" not in conv.messages[-1]


def test_a_required_answer_ends_after_its_whole_calls_when_another_cannot_fit(smollm2):
    """34 tokens hold one call of get_weather but not a second: the answer ends after the first
    (EOS, so TOOL_CALLS) instead of starting one the limit cuts."""
    with greedy(smollm2, max_tokens=34) as conv:
        events = list(conv.send("Weather in Paris?", tools=[get_weather], tool_choice="required"))
        calls = requested(events)
        assert done(events).stop_reason == TOOL_CALLS and done(events).generated_tokens < 34
        assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}]
        assert answer(events) == "" and not conv.messages[-1]["content"]
