"""The official openai client against a live server: chat and completions, streaming and not,
16 concurrent streams equal to the same requests one at a time, a client that disconnects
mid-stream or while a whole answer is computed, and OpenAI-style errors after which the server keeps serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_support import API_KEY

MESSAGES = [{"role": "user", "content": "Tell me a story about Lily."}]


def stream_text(client, messages, max_tokens=16, **extra) -> str:
    stream = client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=max_tokens, temperature=0, stream=True, **extra
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_chat_whole_and_streamed_agree(client):
    whole = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=16, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 16 and whole.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="stories260K",
            messages=MESSAGES,
            max_completion_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_and_seed(client):
    text = (
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0)
        .choices[0]
        .message.content
    )
    word = text.split()[2]
    stopped = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=24, temperature=0, stop=[word])
    assert stopped.choices[0].finish_reason == "stop" and word not in stopped.choices[0].message.content
    seeded = [
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.9, seed=5)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_completions_models_and_health(client, server):
    whole = client.completions.create(model="m", prompt="Once upon a time", max_tokens=12, temperature=0)
    assert whole.choices[0].text and whole.usage.completion_tokens == 12
    streamed = client.completions.create(
        model="m", prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert [m.id for m in client.models.list()] == ["stories260K"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_the_routes_answer_without_the_v1_prefix_too(server, client):
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    asked = {"model": "m", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    assert (
        bare.chat.completions.create(**asked).choices[0].message.content
        == client.chat.completions.create(**asked).choices[0].message.content
    )
    assert bare.completions.create(model="m", prompt="Tom", max_tokens=3).usage.completion_tokens == 3
    assert [m.id for m in bare.models.list()] == ["stories260K"] and bare.models.retrieve("stories260K").id
    assert error_of(httpx.post(server.url + "/completions", json=[1]), 400)["type"] == "invalid_request_error"


def test_sixteen_concurrent_streams_equal_one_at_a_time(client):
    conversations = [
        [{"role": "user", "content": f"Tell me a story about {name}."}]
        for name in ["Lily", "Tom", "a cat", "the sun"] * 4
    ]
    alone = [stream_text(client, m, max_tokens=20) for m in conversations]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda m: stream_text(client, m, max_tokens=20), conversations))
    assert together == alone and all(alone)


def metrics(server) -> dict[str, float]:
    """Prometheus samples by name (labels included)."""
    text = httpx.get(server.url + "/metrics").text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in samples}


def assert_cancelled_and_released(server, cancelled_before: float) -> None:
    """Within 20 s no sequence is active and no KV held, and one more request counts as cancelled."""
    deadline = time.monotonic() + 20
    while metrics(server)["ferrum_active_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = metrics(server)
    assert after["ferrum_active_sequences"] == 0 and after["ferrum_kv_tokens_in_use"] == 0
    assert after['ferrum_requests_total{reason="cancelled"}'] == cancelled_before + 1


def test_disconnect_mid_stream_releases_the_kv(server):
    cancelled = metrics(server).get('ferrum_requests_total{reason="cancelled"}', 0)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metrics(server)["ferrum_active_sequences"] == 1
        assert metrics(server)["ferrum_kv_tokens_in_use"] > 0
    assert_cancelled_and_released(server, cancelled)


def test_disconnect_while_a_whole_answer_is_computed_releases_the_kv(server):
    cancelled = metrics(server).get('ferrum_requests_total{reason="cancelled"}', 0)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    assert_cancelled_and_released(server, cancelled)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0]"),
        ({"messages": MESSAGES, "n": 9}, "n"),
        (
            {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f g"}}]},
            "tools[0].function.name",
        ),
        ({"messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
        ({"messages": MESSAGES, "stop": [1, 2]}, "stop"),
    ],
)
def test_bad_fields_get_a_400_naming_them(server, body, param):
    error = error_of(httpx.post(server.url + "/v1/chat/completions", json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_malformed_json_unknown_route_and_the_server_keeps_serving(server, client):
    error = error_of(
        httpx.post(
            server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert error["code"] == "invalid_json"
    error_of(httpx.post(server.url + "/v1/completions", json=[1, 2]), 400)
    error_of(httpx.get(server.url + "/v1/nothing"), 404)
    assert (
        "vocabulary"
        in error_of(httpx.post(server.url + "/v1/completions", json={"prompt": [1, 10**6]}), 400)["message"]
    )
    assert client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4).usage.completion_tokens == 4


def test_prompt_past_capacity_is_a_400(small_server):
    long = [{"role": "user", "content": "Once upon a time there was a little girl " * 10}]
    error = error_of(httpx.post(small_server.url + "/v1/chat/completions", json={"messages": long}), 400)
    assert error["code"] == "context_length_exceeded" and "48" in error["message"]
    assert "FERRUM_KV_CAPACITY" in error["message"]  # below the model's maximum: raising it helps
    short = httpx.post(
        small_server.url + "/v1/completions", json={"prompt": "Tom", "max_tokens": 100, "temperature": 0}
    )
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("long", [[1] * 600, "Once upon a time there was a little girl " * 200])
def test_a_prompt_past_the_models_own_maximum_is_not_told_to_raise_the_capacity(server, scheduler, long):
    most = scheduler.engine.model.config.max_seq_len
    assert scheduler.capacity == most < 600
    error = error_of(httpx.post(server.url + "/v1/completions", json={"prompt": long}), 400)
    assert error["code"] == "context_length_exceeded"
    assert f"{most} tokens is this model's own maximum" in error["message"]
    assert "FERRUM_KV_CAPACITY" not in error["message"] and "kv-capacity" not in error["message"]


def test_api_key(keyed_server):
    good = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=API_KEY, max_retries=0)
    bad = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    error = error_of(httpx.get(keyed_server.url + "/metrics"), 401)
    assert error["code"] == "invalid_api_key"
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert good.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4).usage.completion_tokens == 4


def test_another_protocol_hears_its_own_field_names():
    from ferrum_mac.engine import SamplingParams
    from ferrum_mac.serve import checks as api
    from ferrum_mac.serve.call import Limits, call_from_openai

    limits = Limits(SamplingParams(), vocab_size=512)
    renames = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages"}
    body = {"messages": MESSAGES, "max_completion_tokens": 0}
    with pytest.raises(api.ApiError) as error:
        call_from_openai(body, limits, renames)
    assert error.value.param == "max_tokens" and "'max_tokens'" in error.value.message
    with pytest.raises(api.ApiError) as error:
        call_from_openai({"messages": MESSAGES, "stop": ["x"] * 5}, limits, renames)
    assert error.value.param == "stop_sequences" and "'stop_sequences'" in error.value.message
    call = call_from_openai({**body, "max_completion_tokens": 8, "model": "m"}, limits, renames)
    assert call.options.max_tokens == 8 and call.model == "m" and call.messages[0]["content"] == MESSAGES[0]["content"]


def test_errors_take_the_shape_of_the_longest_registered_prefix(monkeypatch):
    from ferrum_mac.serve import api_errors as shapes
    from ferrum_mac.serve import checks as api

    monkeypatch.setattr(shapes, "error_shapes", {"/x/": lambda e: {"x": e.message}, "/x/y": lambda e: {"y": e.status}})
    error = api.ApiError(400, "bad")
    assert shapes.error_body("/x/z", error) == {"x": "bad"}
    assert shapes.error_body("/x/y/z", error) == {"y": 400}
    assert shapes.error_body("/v1/chat/completions", error)["error"]["message"] == "bad"
