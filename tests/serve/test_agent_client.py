"""A real agent framework against a live `ferrum serve`: pydantic-ai's `Agent` on its OpenAI chat
model, pointed at the server's base URL.

pydantic-ai delivers a structured output through a tool call (its `final_result` tool) and asks
for it with tool_choice "required", so unlike llm (tests/serve/test_llm_client.py) it forces calls
that SmolLM2-135M would never make on its own. The grammar must make every call valid: the agent
runs with no retries, so one call pydantic-ai rejects fails the test."""

from __future__ import annotations

import pytest
from serve_support import LiveServer, open_stories

pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic import BaseModel, Field  # noqa: E402
from pydantic_ai import Agent, UsageLimits, capture_run_messages  # noqa: E402
from pydantic_ai.exceptions import UsageLimitExceeded  # noqa: E402
from pydantic_ai.messages import ModelResponse, ToolCallPart  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402

# One call an answer: SmolLM2 otherwise repeats the output call, doubling each answer's tokens.
GREEDY = {"temperature": 0.0, "max_tokens": 120, "parallel_tool_calls": False}


class WeatherReport(BaseModel):
    city: str = Field(min_length=1, max_length=40)
    temperature_celsius: int = Field(ge=-60, le=60)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=4096)).start()
    live = LiveServer(build_app(scheduler, "smollm2"))
    yield live
    live.stop()
    scheduler.stop()


@pytest.fixture
def model(smollm2_server):
    provider = OpenAIProvider(base_url=smollm2_server.url + "/v1", api_key="unused")
    return OpenAIChatModel("smollm2", provider=provider)


def test_structured_output_streams_validated(model):
    """The output tool, streamed: `delta.tool_calls` pieces pydantic-ai assembles and validates."""
    agent = Agent(model, output_type=WeatherReport, model_settings=GREEDY, retries=0)
    output = agent.run_stream_sync("The weather in Oslo is 3 degrees. Report it.").get_output()
    assert isinstance(output, WeatherReport)


def _first_step_calls(tool_name: str):
    """Model settings that force `tool_name` on the run's first request only (a static choice
    would forbid the output tool and so the end of the run)."""

    def settings(ctx):
        return {**GREEDY, "tool_choice": [tool_name]} if ctx.run_step <= 1 else GREEDY

    return settings


def test_function_tool_then_structured_output(model):
    """The whole loop: a forced call of a Python function, its result sent back as a `tool`
    message, then the output tool under tool_choice "required"."""
    agent = Agent(model, output_type=WeatherReport, model_settings=_first_step_calls("get_weather"), retries=0)
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    with capture_run_messages() as messages:
        try:
            output = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=3)).output
        except UsageLimitExceeded:  # the model may keep asking for the weather; the limit ends it cleanly
            output = None
    requested = [
        part.tool_name
        for message in messages
        if isinstance(message, ModelResponse)
        for part in message.parts
        if isinstance(part, ToolCallPart)
    ]
    assert requested[0] == "get_weather" and calls, requested
    assert len(calls) == requested.count("get_weather")  # each call's arguments validated and ran
    assert output is None or isinstance(output, WeatherReport)
