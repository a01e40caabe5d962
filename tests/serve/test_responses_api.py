"""OpenAI's Responses API (/v1/responses) through the official `openai` client: whole and streamed
answers, function tools enforced by the grammar, structured output, `previous_response_id` from
the kept responses, GET and DELETE by id, and the 4xx a bad body gets."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_support import LiveServer, error_of, open_stories

from ferrum_mac.serve.response_store import ResponseStore

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def smollm2_client(smollm2_gguf, tmp_path_factory):
    """SmolLM2 (a chat template with tool calls), its responses kept in a real sqlite file."""
    import openai

    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=4096)).start()
    store = ResponseStore(tmp_path_factory.mktemp("responses") / "responses.sqlite3", ttl_s=3600)
    live = LiveServer(build_app(scheduler, "smollm2", responses=store))
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    live.stop()
    scheduler.stop()


def test_whole_answer_is_a_response_with_usage(client):
    response = client.responses.create(model="stories260K", input="Once upon a time", max_output_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output_text
    assert response.usage.output_tokens == 12 and response.usage.input_tokens > 0


def test_stream_events_come_in_the_documented_order(client):
    stream = client.responses.create(model="stories260K", input="Once upon a time", max_output_tokens=10, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and text


def test_the_stream_helper_accumulates_a_completed_response(smollm2_client):
    """The SDK's helper needs `response.completed`: an answer that ends by itself."""
    greedy = {"temperature": 0.0}
    with smollm2_client.responses.stream(
        model="smollm2", input="Say hello.", max_output_tokens=200, **greedy
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas and deltas


def test_required_function_call_streams_and_validates(smollm2_client):
    stream = smollm2_client.responses.create(
        model="smollm2",
        input="What's the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=80,
        stream=True,
    )
    events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(done) >= 1 and done[0].name == "get_weather"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(done[0].arguments)["city"] and done[0].arguments.startswith(arguments[:10])
    assert events[-1].type == "response.completed"


def test_a_call_and_its_output_round_trip_through_previous_response_id(smollm2_client):
    first = smollm2_client.responses.create(
        model="smollm2",
        input="What's the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert json.loads(call.arguments)["city"]
    second = smollm2_client.responses.create(
        model="smollm2",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}],
        tools=[WEATHER],
        max_output_tokens=40,
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt came from the cache
    kept = smollm2_client.responses.retrieve(second.id)
    assert kept.id == second.id and kept.output_text == second.output_text
    items = smollm2_client.responses.input_items.list(second.id)
    assert [item.type for item in items.data][-2:] == ["function_call", "function_call_output"]


def test_structured_output_follows_the_schema(smollm2_client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = smollm2_client.responses.create(
        model="smollm2",
        input="Describe a person as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=64,
    )
    value = json.loads(response.output_text)
    assert set(value) == {"name", "age"}


def test_delete_forgets_and_store_false_keeps_nothing(client):
    import openai

    kept = client.responses.create(model="stories260K", input="The dog", max_output_tokens=4)
    assert client.responses.delete(kept.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    unkept = client.responses.create(model="stories260K", input="The dog", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|kept"):
        client.responses.create(model="stories260K", previous_response_id=unkept.id, input="And then")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, None),
        ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/responses", json={"model": "stories260K", **body}, timeout=30)
    error = error_of(response, 400)
    if param is not None:
        assert error.get("param") == param, error


def test_kept_responses_expire_and_are_bounded(tmp_path):
    store = ResponseStore(tmp_path / "r.sqlite3", ttl_s=3600, max_rows=3)
    for i in range(5):
        store.put({"id": f"resp_{i}", "output": []}, [{"type": "message", "role": "user", "content": str(i)}])
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    expired = ResponseStore(tmp_path / "e.sqlite3", ttl_s=-1)
    expired.put({"id": "resp_x", "output": []}, [])
    assert expired.get("resp_x") is None
    again = ResponseStore(tmp_path / "r.sqlite3", ttl_s=3600)  # a restart reads the same file
    assert again.get("resp_4").conversation[0]["content"] == "4"
