"""Anthropic's Messages API on `ferrum serve`, through the official `anthropic` client: create,
stream (the SDK's text_stream and the raw event order), tools (a forced call whose input validates,
the tool_result round trip), count_tokens, x-api-key, and errors in Anthropic's shape. Requests
translate into the same checked call as OpenAI's, so the same greedy answer comes from both."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import API_KEY, CHAT, LiveServer, open_models, open_stories

from ferrum_mac.engine import Done, ReasoningDelta, TextDelta
from ferrum_mac.serve.protocols import anthropic as anthropic_api
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.events import Finished, ToolCallDelta
from ferrum_mac.text.tool_calls import ToolCall

MESSAGES = "/v1/messages"
STORY = [{"role": "user", "content": "Tell me a story about Lily."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


# -- the translation, without a server -----------------------------------------------------------


def test_a_conversation_translates_to_openais_shapes():
    body = {
        "model": "m",
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, CALL]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        "stop_sequences": ["\n\n"],
        "top_k": 5,
        "metadata": {"user_id": "u"},
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    out = anthropic_api.openai_body(body)
    assert out["messages"] == [
        {"role": "system", "content": "Be brief. Be kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "hm",  # the thinking block reaches the template as the turn's reasoning
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "user", "content": "Thanks."},
    ]
    assert out["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": WEATHER["description"],
            },
        }
    ]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert out["parallel_tool_calls"] is False
    assert (out["max_tokens"], out["stop"], out["top_k"]) == (7, ["\n\n"], 5)
    assert out["chat_template_kwargs"] == {"enable_thinking": True} and "metadata" not in out
    # and the shared checks accept it as they would OpenAI's
    assert api.tool_request(api.check_body(out)) is not None
    assert len(api.chat_messages(out)) == 5


@pytest.mark.parametrize(
    "choice, openai",
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")],
)
def test_tool_choices_translate(choice, openai):
    out = anthropic_api.openai_body(
        {"model": "m", "max_tokens": 1, "messages": STORY, "tools": [WEATHER], "tool_choice": choice}
    )
    assert out["tool_choice"] == openai and "parallel_tool_calls" not in out


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
BAD_BODIES = [
    ("no max_tokens", {"max_tokens": None}, "max_tokens: Field required"),
    ("null max_tokens", {"max_tokens": "null"}, "max_tokens: Field required"),
    ("no model", {"model": None}, "model:"),
    ("no messages", {"messages": []}, "messages:"),
    ("system role", {"messages": [{"role": "system", "content": "x"}]}, "messages.0:"),
    (
        "image",
        {"messages": _user({"type": "text", "text": "What is it?"}, IMAGE)},
        "messages.0.content.1: image blocks",
    ),
    ("document", {"messages": _user({"type": "document", "source": {}})}, "document blocks are not supported"),
    (
        "image in a result",
        {
            "messages": [
                {"role": "assistant", "content": [CALL]},
                *_user({"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}),
            ]
        },
        "image blocks",
    ),
    (
        "result of no call",
        {"messages": _user({"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"})},
        "messages.0.content.0.tool_use_id",
    ),
    ("tool_use from the user", {"messages": _user(CALL)}, "messages.0.content.0:"),
    ("text not a string", {"messages": _user({"type": "text", "text": 3})}, "messages.0.content.0.text"),
    (
        "call without input",
        {"messages": [{"role": "assistant", "content": [{**CALL, "input": "x"}]}]},
        "tool_use block",
    ),
    ("unknown field", {"container": "c"}, "container: this field is not supported"),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0: the tool type"),
    ("tool without schema", {"tools": [{"name": "f"}]}, "tools.0.input_schema: Field required"),
    ("bad tool_choice", {"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice:"),
    ("bad thinking", {"thinking": {"type": "enabled"}}, "thinking:"),
]


@pytest.mark.parametrize("case, change, fragment", BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_bodies_name_the_field(case, change, fragment):
    body = {"model": "m", "max_tokens": 4, "messages": STORY, **change}
    body = {k: None if v == "null" else v for k, v in body.items() if v is not None}
    with pytest.raises(api.ApiError) as error:
        anthropic_api.openai_body(body)
    assert error.value.status == 400 and fragment in error.value.message, error.value.message


def test_hints_the_server_has_no_use_for_are_ignored():
    """Agent harnesses send newer fields (context management, service tiers) before local
    servers know them: they must not fail the request."""
    body = {"model": "m", "max_tokens": 4, "messages": STORY, "context_management": {"edits": []}, "speed": "x"}
    out = anthropic_api.openai_body(body)
    assert "context_management" not in out and "speed" not in out and out["messages"]


def test_count_tokens_bodies_need_no_max_tokens_but_take_no_sampling():
    assert "max_tokens" not in anthropic_api.openai_body({"model": "m", "messages": STORY}, counting=True)
    with pytest.raises(api.ApiError, match="temperature"):
        anthropic_api.openai_body({"model": "m", "messages": STORY, "temperature": 0}, counting=True)


def test_errors_take_anthropics_shape_and_names():
    error = api.ApiError(400, "tools[1].function.parameters must be a JSON schema object", param="tools[1]")
    assert anthropic_api.error_body(error) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "tools.1.input_schema must be a JSON schema object"},
    }
    kinds = {s: anthropic_api.error_body(api.ApiError(s, "x"))["error"]["type"] for s in (401, 404, 413, 500, 503)}
    assert kinds == {
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        500: "api_error",
        503: "overloaded_error",
    }


DONE = Done("eos", 10, 4, 3, 0.1, 100.0, 30.0)


def test_a_whole_message_puts_thinking_first_then_text_then_calls():
    calls = [ToolCall("get_weather", '{"city": "Paris"}', "call_abc")]
    body = anthropic_api.message_body("msg_1", "m", "Let me look.", "They ask about Paris.", calls, DONE)
    assert body["content"] == [
        {"type": "thinking", "thinking": "They ask about Paris.", "signature": ""},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {
        "input_tokens": 6,
        "output_tokens": 3,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    }
    stopped = Done("stop", 10, 0, 3, 0.1, 100.0, 30.0, stop_string="The end")
    body = anthropic_api.message_body("msg_1", "m", "", "", [], stopped)
    assert body["content"] == [{"type": "text", "text": ""}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "The end")


async def _events(*events):
    for event in events:
        yield event


def _parse_sse(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        out.append((name[7:], json.loads(data[6:])))
    return out


def test_stream_events_open_one_block_per_kind_in_order():
    import asyncio

    neutral = _events(
        ReasoningDelta("Paris"),
        ReasoningDelta("?"),
        TextDelta("Let me look."),
        ToolCallDelta(0, "call_a", "get_weather", '{"city": '),
        ToolCallDelta(0, None, None, '"Paris"}'),
        ToolCallDelta(1, "call_b", "get_weather", '{"city": "Rome"}'),
        Finished.of(DONE, called=True),  # the core's last event says whether the answer called
    )

    async def collect():
        return "".join([piece async for piece in anthropic_api.sse_events(neutral, "msg_1", "m", 10)])

    events = _parse_sse(asyncio.run(collect()))
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],  # thinking
        *["content_block_start", "content_block_delta", "content_block_stop"],  # text
        *["content_block_start", "content_block_delta", "content_block_delta", "content_block_stop"],  # call 0
        *["content_block_start", "content_block_delta", "content_block_stop"],  # call 1
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    starts = [data for name, data in events if name == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2, 3]
    assert starts[2]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}
    partial = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == 2]
    assert json.loads("".join(partial)) == {"city": "Paris"}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 3


# -- the official client against a live server on stories260K ---------------------------------

MODEL = "stories260K"  # the name the shared server has
GREEDY = {"extra_body": {"temperature": 0}}  # the current SDK takes sampling settings only this way


@pytest.fixture
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_answers_with_a_message(claude):
    message = claude.messages.create(model=MODEL, max_tokens=8, messages=STORY, **GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [b.type for b in message.content] == ["text"] and _text(message)
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    usage = message.usage
    assert usage.output_tokens == 8 and usage.cache_creation_input_tokens == 0
    prompt = claude.messages.count_tokens(model=MODEL, messages=STORY).input_tokens
    assert prompt > 0 and usage.input_tokens + usage.cache_read_input_tokens == prompt


def test_the_same_greedy_answer_from_all_three_protocols(server, claude):
    system = "You tell short stories."
    message = claude.messages.create(model=MODEL, max_tokens=24, system=system, messages=STORY, **GREEDY)
    messages = [{"role": "system", "content": system}, *STORY]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    openai = httpx.post(server.url + CHAT, json=body, timeout=60).json()
    body = {"model": MODEL, "messages": messages, "stream": False, "options": {"temperature": 0, "num_predict": 24}}
    ollama = httpx.post(server.url + "/api/chat", json=body, timeout=60).json()
    assert _text(message) == openai["choices"][0]["message"]["content"] == ollama["message"]["content"]
    assert _text(message)


def test_a_stop_sequence_ends_the_answer_and_is_named(claude):
    whole = _text(claude.messages.create(model=MODEL, max_tokens=24, messages=STORY, **GREEDY))
    word = whole.split()[len(whole.split()) // 2]
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=STORY, stop_sequences=[word], **GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
    assert _text(message) == whole[: whole.index(word)].rstrip()  # an answer's trailing space is dropped


def test_stream_text_and_final_message_match_create(claude):
    kwargs = dict(model=MODEL, max_tokens=16, messages=STORY, **GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(whole) == _text(final)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16


def test_stream_events_come_in_the_documented_order(server):
    body = {"model": MODEL, "max_tokens": 6, "messages": STORY, "temperature": 0, "stream": True}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", server.url + MESSAGES, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = _parse_sse(response.read().decode())
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * deltas] + [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert {d["delta"]["type"] for n, d in events if n == "content_block_delta"} == {"text_delta"}
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 6


def test_x_api_key_and_bearer_both_authenticate(keyed_server):
    import anthropic

    def client(**auth):
        return anthropic.Anthropic(base_url=keyed_server.url, max_retries=0, timeout=60, **auth)

    assert client(api_key=API_KEY).messages.create(model=MODEL, max_tokens=2, messages=STORY).content
    assert client(auth_token=API_KEY).messages.count_tokens(model=MODEL, messages=STORY).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as error:
        client(api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=STORY)
    assert error.value.status_code == 401 and error.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": error.value.body["error"]["message"]},
    }


BAD_REQUESTS = [
    ("no max_tokens", {"max_tokens": None}, "max_tokens"),
    ("max_tokens 0", {"max_tokens": 0}, "'max_tokens'"),
    ("an image", {"messages": _user({"type": "text", "text": "What is it?"}, IMAGE)}, "image blocks"),
    ("temperature 5", {"temperature": 5}, "'temperature'"),
    ("top_k below 0", {"top_k": -1}, "'top_k'"),
    ("an empty stop sequence", {"stop_sequences": [""]}, "'stop_sequences'"),
    ("five stop sequences", {"stop_sequences": list("abcde")}, "'stop_sequences'"),
    ("a result of no call", {"messages": _user({"type": "tool_result", "tool_use_id": "x"})}, "tool_use_id"),
    ("a schema's type an object", {"tools": [{"name": "f", "input_schema": {"type": {}}}]}, "tool 'f'"),
    (
        "an integer past 64 bits in a schema",
        {"output_config": {"format": {"type": "json_schema", "schema": {"type": "integer", "minimum": 10**30}}}},
        "integer range",
    ),
]


@pytest.mark.parametrize("case, change, fragment", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_are_400s_in_anthropics_shape(claude, case, change, fragment):
    import anthropic

    body = {k: v for k, v in {"model": MODEL, "max_tokens": 4, "messages": STORY, **change}.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.post(MESSAGES, body=body, cast_to=object)
    assert error.value.status_code == 400 and error.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": error.value.body["error"]["message"]},
    }
    assert fragment in error.value.body["error"]["message"]


def test_the_client_is_told_an_image_is_refused(claude):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        claude.messages.create(model=MODEL, max_tokens=4, messages=_user(IMAGE))


def test_a_resent_prompt_is_read_from_the_prefix_cache(claude):
    system = "You are a storyteller for small children. " * 8  # a few KV blocks of the cache
    kwargs = dict(model=MODEL, max_tokens=2, system=system, messages=STORY, **GREEDY)
    first, second = claude.messages.create(**kwargs).usage, claude.messages.create(**kwargs).usage
    assert second.cache_read_input_tokens > 0
    assert second.input_tokens + second.cache_read_input_tokens == first.input_tokens + first.cache_read_input_tokens


def test_a_streamed_answer_counts_its_input_alike_in_message_start_and_message_delta(server):
    """Both events say input_tokens = the uncached input and cache_read_input_tokens = the part
    the prefix cache gave (message_start counted the whole prompt as input, with no cache field)."""
    system = "You are a storyteller for children who like dragons. " * 8
    body = {"model": MODEL, "max_tokens": 2, "system": system, "messages": STORY, "temperature": 0, "stream": True}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    for _ in range(2):  # the second is read from the prefix cache
        response = httpx.post(server.url + MESSAGES, json=body, headers=headers, timeout=60)
        events = dict(_parse_sse(response.text))
        start, delta = events["message_start"]["message"]["usage"], events["message_delta"]["usage"]
        inputs = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        assert {k: start[k] for k in inputs} == {k: delta[k] for k in inputs}, (start, delta)
    assert delta["cache_read_input_tokens"] > 0 and delta["input_tokens"] > 0


@pytest.fixture(scope="module")
def registry_claude(stories_path):
    """A server that serves the models of a registry (as `ferrum serve` does), so a name matters."""
    import anthropic

    from ferrum_mac.serve.app import build_app

    models = open_models(stories_path, MODEL, {})
    live = LiveServer(build_app(models))
    yield anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60)
    live.stop()
    models.close()


def test_an_unknown_model_is_a_not_found_error(registry_claude):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as error:
        registry_claude.messages.create(model="no-such-model", max_tokens=4, messages=STORY)
    assert error.value.body["error"]["type"] == "not_found_error"
    assert "'no-such-model'" in error.value.body["error"]["message"] and MODEL in error.value.body["error"]["message"]
    assert registry_claude.messages.create(model=MODEL, max_tokens=2, messages=STORY).model == MODEL


# -- tools, on the bundled SmolLM2 (its template renders tools) --------------------------------

QUESTION = [{"role": "user", "content": "What's the weather in Paris? Use the tools."}]


@pytest.fixture(scope="module")
def smollm2_claude(smollm2_gguf):
    import anthropic

    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=2048)).start()
    live = LiveServer(build_app(scheduler, "smollm2"))
    yield anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=300)
    live.stop()
    scheduler.stop()


def _validated_calls(message) -> list:
    import jsonschema

    calls = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and calls, message
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER["input_schema"])
    return calls


def test_a_forced_tool_call_validates_and_its_result_round_trips(smollm2_claude):
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    message = smollm2_claude.messages.create(
        model="smollm2", max_tokens=80, messages=QUESTION, tools=[WEATHER], tool_choice=forced
    )
    [call] = _validated_calls(message)
    turns = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"}]},
    ]
    answer = smollm2_claude.messages.create(model="smollm2", max_tokens=24, messages=turns, tools=[WEATHER], **GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    assert not any("<tool_call>" in b.text for b in answer.content if b.type == "text")


def test_a_required_tool_call_streams_as_input_json(smollm2_claude):
    kwargs = dict(model="smollm2", max_tokens=80, messages=QUESTION, tools=[WEATHER], tool_choice={"type": "any"})
    with smollm2_claude.messages.stream(**kwargs) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in kinds and "text_delta" not in kinds
    _validated_calls(final)


def test_output_config_format_constrains_the_answer_to_its_schema(smollm2_claude):
    import jsonschema

    schema = WEATHER["input_schema"]
    message = smollm2_claude.messages.create(
        model="smollm2",
        max_tokens=60,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


# -- thinking, through Qwen3's own template and tokenizer on random weights ----------------------

THINK_OPEN = 151667  # Qwen3's <think>


@pytest.fixture(scope="module")
def qwen3_claude(qwen3_random):
    import anthropic

    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(qwen3_random, kv_capacity=512)).start()
    live = LiveServer(build_app(scheduler, "qwen3-random"))
    yield anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
    live.stop()
    scheduler.stop()


@pytest.mark.slow  # building the random Qwen3 takes seconds; the blocks' order is also tested without a model
def test_thinking_reaches_the_template_and_reasoning_comes_first(qwen3_claude):
    def count(**thinking) -> int:
        return qwen3_claude.messages.count_tokens(model="qwen3-random", messages=STORY, **thinking).input_tokens

    # the template closes an empty <think> section when thinking is off
    assert count(thinking={"type": "disabled"}) > count(thinking={"type": "enabled", "budget_tokens": 1024})
    kwargs = dict(
        model="qwen3-random",
        max_tokens=6,
        messages=STORY,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0, "logit_bias": {str(THINK_OPEN): 100}},  # a random model opens <think> at once
    )
    message = qwen3_claude.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking"] and message.content[0].thinking, message
    with qwen3_claude.messages.stream(**kwargs) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and final.content[0].thinking == message.content[0].thinking


THOUGHT = "They want the weather in Paris; the tool knows it."
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": THOUGHT, "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    },
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]},
]


def test_thinking_blocks_of_the_history_become_the_turns_reasoning():
    messages = anthropic_api.openai_body({"model": "m", "max_tokens": 4, "messages": TOOL_TURNS})["messages"]
    assert messages[1]["reasoning_content"] == THOUGHT and messages[1]["tool_calls"][0]["id"] == "toolu_1"


@pytest.mark.slow  # building the random Qwen3 takes seconds
def test_thinking_blocks_of_the_history_reach_qwen3s_template(qwen3_claude):
    """Qwen3 renders the reasoning of the turns after the last question (a tool loop's): the
    thinking block sent back is in the prompt (it used to be dropped)."""
    weather = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    without = [TOOL_TURNS[0], {**TOOL_TURNS[1], "content": TOOL_TURNS[1]["content"][2:]}, TOOL_TURNS[2]]

    def count(messages) -> int:
        return qwen3_claude.messages.count_tokens(model="qwen3-random", messages=messages, tools=[weather]).input_tokens

    assert count(TOOL_TURNS) > count(without) + 5  # the thought is a dozen tokens and <think> tags
