"""Ollama's API on a live `ferrum serve`, through the official `ollama` client: chat and generate
(streamed NDJSON and whole, the same tokens as the OpenAI routes give), the model routes (tags,
show, ps, pull from a fake Hub with its progress, delete), `format` with a schema, tools whose
calls carry their arguments as an object, and bad input answered 400 with `{"error": "..."}`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import ollama
import pytest
from serve_support import API_KEY, REPO, LiveServer, open_stories

from ferrum_mac.engine import ReasoningDelta
from ferrum_mac.serve.protocols import ollama as oa
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.batching.models import FOREVER, keep_alive_seconds


MODEL = "stories260K"
ASK = [{"role": "user", "content": "Tell me a story about Lily."}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def client(server):
    return ollama.Client(host=server.url, timeout=120)


def openai_text(server, path: str, **body) -> str:
    response = httpx.post(server.url + path, json={"temperature": 0, "max_tokens": 12, **body}, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def ndjson_lines(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"] == oa.NDJSON
        return [json.loads(line) for line in response.iter_lines() if line]


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


# -- the pure translation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, seconds",
    [(None, None), (300, 300.0), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25), (0, 0.0)]
    + [("0", 0.0), (-1, FOREVER), ("-1", FOREVER), ("-1m", FOREVER), (2.5, 2.5)],
)
def test_keep_alive_takes_seconds_and_go_durations(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m", "5x", "", True, [5], {"m": 5}, "1e999"])
def test_keep_alive_refuses_what_is_no_duration(value):
    with pytest.raises(api.ApiError, match="keep_alive .* is not a duration"):
        keep_alive_seconds(value)


def test_options_map_to_openai_fields_and_unknown_keys_are_ignored():
    options = oa.check_options(
        {"temperature": 0.5, "num_predict": 7, "repeat_penalty": 1.2, "stop": ["\n"], "seed": 3, "mirostat": 0}
        | {"some_future_option": "x", "top_k": 5.0}
    )
    assert oa.sampling_fields(options) == {
        "temperature": 0.5,
        "max_completion_tokens": 7,
        "repetition_penalty": 1.2,
        "stop": ["\n"],
        "seed": 3,
        "top_k": 5,
    }
    assert oa.sampling_fields(oa.check_options({"num_predict": -1, "seed": -1})) == {}


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"temperature": "hot"}, "options.temperature must be a number"),
        ({"num_predict": 1.5}, "options.num_predict must be an integer"),
        ({"top_k": True}, "options.top_k must be an integer"),
        ({"stop": [1]}, "options.stop must be a string or an array"),
        ({"use_mmap": "yes"}, "options.use_mmap must be true or false"),
        ([1], "options must be an object"),
    ],
)
def test_options_of_the_wrong_type_are_refused(options, fragment):
    with pytest.raises(api.ApiError, match=fragment):
        oa.check_options(options)


def test_tool_history_becomes_openai_shaped():
    messages = oa.chat_messages(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                ],
            },
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
            {"role": "tool", "content": "rain", "tool_name": "get_weather"},
        ]
    )
    calls = messages[1]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [m["tool_call_id"] for m in messages[2:]] == [c["id"] for c in calls]  # each answers its own call
    with pytest.raises(api.ApiError, match=r"messages\[0\] \(role tool\) answers no earlier assistant tool call"):
        oa.chat_messages([{"role": "tool", "content": "sunny", "tool_name": "get_weather"}])


def test_tool_calls_reach_the_client_with_arguments_as_an_object():
    from ferrum_mac.serve.events import ToolCallDelta

    out = oa.OllamaAnswer("m", chat=True)
    pieces = [ToolCallDelta(0, "call_1", "get_weather", '{"city": '), ToolCallDelta(0, None, None, '"Paris"}')]
    assert all(out.piece(p) is None for p in pieces)  # sent whole, once complete
    message = ollama.ChatResponse.model_validate(out.calls_object()).message
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}


# -- chat and generate through the official client ------------------------------------------------


def test_chat_whole_gives_the_openai_routes_tokens(server, client):
    answer = client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=False)
    assert answer.message.content == openai_text(server, "/v1/chat/completions", messages=ASK)
    assert answer.done and answer.done_reason == "length" and answer.eval_count == 12
    assert answer.prompt_eval_count > 0 and answer.total_duration >= answer.eval_duration > 0
    assert answer.prompt_eval_duration > 0 and answer.created_at.endswith("Z")


def test_chat_streams_ndjson_ending_with_done(server, client):
    parts = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    *pieces, last = parts
    assert pieces and not any(p.done for p in pieces) and last.done
    assert (
        "".join(p.message.content for p in parts)
        == client.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    )
    assert last.eval_count == 12 and last.done_reason == "length" and last.message.content == ""
    lines = ndjson_lines(server, "/api/chat", {"model": MODEL, "messages": ASK, "options": GREEDY})
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_generate_raw_and_templated(server, client):
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY)
    assert raw.response == openai_text(server, "/v1/completions", prompt="Once upon a time")
    system = "You tell short stories."
    templated = client.generate(model=f"{MODEL}:latest", prompt="Tell me a story.", system=system, options=GREEDY)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Tell me a story."}]
    assert templated.response == openai_text(server, "/v1/chat/completions", messages=messages)
    assert templated.model == f"{MODEL}:latest"
    streamed = list(client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done


def test_an_empty_prompt_loads_the_model(client):
    loaded = client.generate(model=MODEL)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"


def test_stop_and_seed_options(server, client):
    full = client.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    word = full.split()[2]
    stopped = client.chat(model=MODEL, messages=ASK, options={**GREEDY, "stop": [word]})
    assert stopped.message.content == full[: full.index(word)].rstrip() and stopped.done_reason == "stop"
    seeded = {"temperature": 1.0, "seed": 7, "num_predict": 12}
    first = client.chat(model=MODEL, messages=ASK, options=seeded).message.content
    assert client.chat(model=MODEL, messages=ASK, options=seeded).message.content == first


# -- the model routes ------------------------------------------------------------------------------


def test_version_and_root_answer_as_ollama_does(server, client):
    assert httpx.get(server.url + "/").text == "Ollama is running"
    assert httpx.head(server.url + "/").status_code == 200
    version = httpx.get(server.url + "/api/version").json()["version"]
    assert tuple(int(n) for n in version.split(".")) >= (0, 5, 0)


def test_tags_show_and_ps_describe_the_model(client, stories_path):
    [entry] = [m for m in client.list().models if m.model == MODEL]
    assert entry.details.family == "llama" and entry.details.parameter_size == "260K"
    assert entry.details.format == "safetensors" and len(entry.digest) == 64 and entry.size > 0
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.context_length"] > 0
    assert "completion" in shown.capabilities and shown.details.parameter_size == "260K"
    assert f"FROM {MODEL}" in shown.modelfile and "temperature" in shown.parameters
    [loaded] = client.ps().models
    assert loaded.model == MODEL and loaded.context_length == shown.modelinfo["llama.context_length"]


def test_show_lists_tools_for_a_model_whose_template_has_no_tool_section(client, server):
    shown = client.show(MODEL)
    assert "tools" in shown.capabilities and "thinking" not in shown.capabilities
    assert "tools" not in shown.template  # the server describes the tools itself, and its grammar writes the call
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}  # a call stories can finish
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": no_arguments}}
    body = {"messages": ASK, "tools": [tool], "tool_choice": "required", "max_tokens": 40, "temperature": 0}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_unknown_model_is_a_404(server, client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("no-such-model")
    assert caught.value.status_code == 404 and "not found" in caught.value.error
    assert "not found" in error_of(httpx.post(server.url + "/api/show", json={"model": "nope:7b"}), 404)


# -- bad input --------------------------------------------------------------------------------------

BAD = [
    ("/api/chat", {"messages": ASK}, "model is required"),
    ("/api/chat", {"model": MODEL, "messages": "hi"}, "messages must be an array"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "stream": "yes"}, "stream must be true or false"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}, "options.temperature"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": 5}}, "'options.temperature' is 5"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"num_predict": 0}}, "options.num_predict"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"num_ctx": 10**6}}, "options.num_ctx is 1000000"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "keep_alive": "soon"}, "keep_alive 'soon' is not a duration"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "format": "xml"}, 'format must be "json"'),
    ("/api/chat", {"model": MODEL, "messages": ASK, "think": "maybe"}, "think must be"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix is not supported"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "images": ["aGk="]}, "images are not supported"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "context": [1, 2]}, "context is not supported"),
    ("/api/generate", {"model": MODEL, "prompt": 3}, "prompt must be a string"),
    ("/api/generate", {"model": MODEL, "prompt": "x", "raw": True, "system": "s"}, "system has no place"),
]


@pytest.mark.parametrize("path, body, fragment", BAD, ids=[f"{p}-{f[:24]}" for p, _, f in BAD])
def test_bad_input_is_a_400_in_ollamas_shape(server, path, body, fragment):
    assert fragment in error_of(httpx.post(server.url + path, json=body, timeout=60), 400)


def test_bad_json_and_unknown_routes_take_ollamas_shape(server):
    post = httpx.post(server.url + "/api/chat", content=b'{"model": ', timeout=60)
    assert "not valid JSON" in error_of(post, 400)
    assert error_of(httpx.get(server.url + "/api/nothing-here"), 404)
    assert error_of(httpx.get(server.url + "/api/chat"), 405)


def test_the_body_limit_holds_on_ollamas_routes(server):
    big = json.dumps({"model": MODEL, "prompt": "x" * (5 * 2**20)})
    assert "is over 4194304 bytes" in error_of(httpx.post(server.url + "/api/generate", content=big, timeout=60), 413)


def test_ollamas_routes_without_a_counterpart_say_so(server):
    response = httpx.post(server.url + "/api/embed", json={"model": MODEL, "input": "x"})
    assert error_of(response, 404) == "ferrum serve does not offer Ollama's /api/embed"


def test_the_api_key_guards_ollamas_routes(keyed_server):
    assert error_of(httpx.post(keyed_server.url + "/api/chat", json={"model": MODEL, "messages": ASK}), 401)
    client = ollama.Client(host=keyed_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert client.chat(model=MODEL, messages=ASK, options=GREEDY).done


def test_curl_style_bodies_without_a_json_content_type_are_read(server):
    body = json.dumps({"model": MODEL, "prompt": "Lily", "stream": False, "options": GREEDY})
    response = httpx.post(
        server.url + "/api/generate", content=body, headers={"content-type": "application/x-www-form-urlencoded"}
    )
    assert response.status_code == 200 and response.json()["done"] is True


# -- the store: pull, serve, unload and delete, through a fake Hub -------------------------------------


@pytest.fixture(scope="module")
def store_server(stories_path):
    """A server of several models, as `ferrum serve` builds it: stories260K by default, and the
    store's models (`ferrum list`) opened when a request names them."""
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app
    from ferrum_mac.serve.batching.models import LoadedModel, Models, size_of
    from ferrum_mac.store import list_models

    def open_scheduler(path):
        return Scheduler(open_stories(Path(path)), max_batch=4).start()

    default = LoadedModel(MODEL, open_scheduler(stories_path), size_of(stories_path), 300.0, stories_path)
    models = Models(default, open_scheduler, list_models)
    live = LiveServer(build_app(models))
    yield live
    live.stop()
    models.close()


def test_pull_serve_unload_and_delete_a_model(hub, store_server):
    client = ollama.Client(host=store_server.url, timeout=120)
    progress = list(client.pull(REPO, stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    files = {p.digest: p for p in progress if p.digest}  # the last object of each file
    weights = files["model.safetensors"]
    assert weights.total == len(hub.repos[REPO].files["model.safetensors"]) == weights.completed
    assert all(p.completed <= p.total for p in progress if p.digest)
    assert REPO in [m.model for m in client.list().models]
    assert client.pull(REPO, stream=False).status == "success"  # already here: nothing to fetch

    # the pulled copy of stories260K answers as the default model does, loaded beside it
    pulled = client.chat(model=f"{REPO}:latest", messages=ASK, options=GREEDY, keep_alive="1h")
    assert pulled.message.content == client.chat(model=MODEL, messages=ASK, options=GREEDY).message.content
    assert pulled.load_duration > 0  # it waited for the load; the next request finds it loaded
    assert client.chat(model=REPO, messages=ASK, options=GREEDY, keep_alive="1h").load_duration == 0
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {MODEL, REPO} and running[REPO].context_length > 0
    hour = running[REPO].expires_at.timestamp() - time.time()
    assert 3500 < hour <= 3600
    unloaded = client.generate(model=REPO, keep_alive=0)
    assert unloaded.done_reason == "unload" and [m.model for m in client.ps().models] == [MODEL]
    assert client.generate(model=REPO, keep_alive="1m").done_reason == "load"  # Ollama's preload idiom
    assert {m.model for m in client.ps().models} == {MODEL, REPO}

    assert client.delete(REPO).status == "success"
    assert REPO not in [m.model for m in client.list().models + client.ps().models]
    with pytest.raises(ollama.ResponseError) as caught:
        client.delete(REPO)
    assert caught.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(model=REPO, messages=ASK)
    assert caught.value.status_code == 404 and MODEL in caught.value.error  # it names what exists


def test_pull_of_a_missing_model_fails_clearly(hub, store_server):
    client = ollama.Client(host=store_server.url, timeout=120)
    with pytest.raises(ollama.ResponseError, match="no model tiny-org/nope"):
        list(client.pull("tiny-org/nope", stream=True))
    body = {"model": "tiny-org/nope", "stream": False}
    response = httpx.post(store_server.url + "/api/pull", json=body, timeout=60)
    assert "no model tiny-org/nope" in error_of(response, 404)
    assert "unknown model" in error_of(httpx.post(store_server.url + "/api/pull", json={"model": "nope:1b"}), 404)


def test_the_served_model_cannot_be_deleted(server):
    response = httpx.request("DELETE", server.url + "/api/delete", json={"model": MODEL})
    assert "the model this server was started with" in error_of(response, 400)


# -- a real chat model: a schema as `format`, and tool calls ------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=2048)).start()
    live = LiveServer(build_app(scheduler, "smollm2"))
    yield ollama.Client(host=live.url, timeout=300)
    live.stop()
    scheduler.stop()


def test_format_schema_answers_validate(smollm2):
    import jsonschema

    shown = smollm2.show("smollm2")  # the GGUF's own template and facts
    assert "<|im_start|>" in shown.template and f'TEMPLATE """{shown.template}"""' in shown.modelfile
    assert shown.details.quantization_level == "Q4_1" and shown.details.parameter_size == "135M"
    assert "temperature 0.2" in shown.parameters  # its authors' recommendation, as the server samples

    answer = smollm2.chat(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        format=PERSON,
        options={"num_predict": 80, "seed": 1},
    )
    assert answer.done_reason == "stop"
    jsonschema.validate(json.loads(answer.message.content), PERSON)


def test_tool_calls_stream_with_arguments_as_objects(smollm2):
    """A history of calls (Ollama's shape: arguments as objects, no ids) primes the small model
    to call again; the call arrives whole, its arguments an object that validates."""
    import jsonschema

    messages = []
    for city in ("Rome", "Berlin", "Madrid"):
        call = {"function": {"name": "get_weather", "arguments": {"city": city}}}
        messages += [
            {"role": "user", "content": f"What's the weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
        ]
    messages.append({"role": "user", "content": "What's the weather in Paris?"})
    parts = list(
        smollm2.chat(
            model="smollm2",
            messages=messages,
            tools=[WEATHER],
            options={"temperature": 0, "num_predict": 40},
            stream=True,
        )
    )
    [call] = [c for p in parts for c in p.message.tool_calls or ()]
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), WEATHER["function"]["parameters"])
    assert not "".join(p.message.content for p in parts).strip()  # no call markup as text
    assert parts[-1].done and parts[-1].done_reason == "stop"


# -- think, through Qwen3's own template and tokenizer on random weights ------------------------------


@pytest.fixture(scope="module")
def qwen3(qwen3_random):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(qwen3_random, kv_capacity=512)).start()
    live = LiveServer(build_app(scheduler, "qwen3-random"))
    yield ollama.Client(host=live.url, timeout=120)
    live.stop()
    scheduler.stop()


@pytest.mark.slow  # building and loading the random Qwen3 (its 152k-token vocabulary) takes a while
def test_think_reaches_the_template_and_reasoning_comes_as_thinking(qwen3):
    def prompt_tokens(think: bool) -> int:
        return qwen3.chat(
            model="qwen3-random", messages=ASK, think=think, options=GREEDY | {"num_predict": 1}
        ).prompt_eval_count

    assert prompt_tokens(False) > prompt_tokens(True)  # the template closes an empty <think> when it is off
    assert "thinking" in qwen3.show("qwen3-random").capabilities
    out = oa.OllamaAnswer("m", chat=True)
    assert out.piece(ReasoningDelta("Paris is in France."))["message"] == {
        "role": "assistant",
        "content": "",
        "thinking": "Paris is in France.",
    }
    assert oa.OllamaAnswer("m", chat=True, show_thinking=False).piece(ReasoningDelta("x")) is None  # think: false
    assert oa.OllamaAnswer("m", chat=False).piece(ReasoningDelta("y"))["thinking"] == "y"  # /api/generate


# -- options.num_ctx below the prompt -------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You tell short stories."}
TURNS = [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: Lily saw a big red ball in the park."}
    for i in range(7)
]


def prompt_tokens(server, messages: list[dict]) -> int:
    """The prompt tokens of `messages` as the server renders them (its count_tokens route)."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    body = {"model": MODEL, "messages": rest, **({"system": system[0]} if system else {})}
    return httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=60).json()["input_tokens"]


def test_num_ctx_below_the_prompt_keeps_the_system_and_the_newest_messages_that_fit(server):
    """As Ollama does: the system message stays, then the longest tail of the conversation whose
    prompt fits in num_ctx (it was ignored: the whole prompt was read)."""
    whole = prompt_tokens(server, [SYSTEM, *TURNS])
    expected = prompt_tokens(server, [SYSTEM, *TURNS[-3:]])
    assert expected < prompt_tokens(server, [SYSTEM, *TURNS[-4:]]) < whole
    body = {"model": MODEL, "messages": [SYSTEM, *TURNS], "stream": False, "options": {"num_predict": 2}}
    cut = httpx.post(server.url + "/api/chat", json={**body, "options": {"num_predict": 2, "num_ctx": expected + 1}})
    assert cut.status_code == 200, cut.text
    assert cut.json()["prompt_eval_count"] == expected
    full = httpx.post(server.url + "/api/chat", json={**body, "options": {"num_predict": 2, "num_ctx": whole}})
    assert full.json()["prompt_eval_count"] == whole


def test_num_ctx_below_the_newest_message_is_a_400(server):
    body = {"model": MODEL, "messages": [SYSTEM, *TURNS], "options": {"num_ctx": 8}}
    assert "more than options.num_ctx (8)" in error_of(httpx.post(server.url + "/api/chat", json=body), 400)
    body = {"model": MODEL, "prompt": TURNS[0]["content"], "options": {"num_ctx": 8}}
    assert "more than options.num_ctx (8)" in error_of(httpx.post(server.url + "/api/generate", json=body), 400)
    body = {"model": MODEL, "prompt": TURNS[0]["content"], "raw": True, "options": {"num_ctx": 8}}
    assert "more than options.num_ctx (8)" in error_of(httpx.post(server.url + "/api/generate", json=body), 400)
