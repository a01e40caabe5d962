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
    tools = [
        _function(
            "f",
            {
                "type": "object",
                "properties": {"a": {"type": "string", "format": "uuid-ish", "contentSchema": {}}},
                "$dynamicRef": "#x",
            },
        )
    ]
    response = chat(server, tools=tools)
    if response.status_code == 200:
        pytest.skip("the grammar engine accepts every keyword of this schema")
    error = error_of(response, 400)
    assert error["param"] == "tools[0].function.parameters" and error["code"] == "unsupported_schema"
    assert "'$dynamicRef'" in error["message"] or "'contentSchema'" in error["message"], error


@pytest.mark.parametrize(
    "choice, fragment",
    [
        ({"type": "function", "function": {"name": "nope"}}, "'nope'"),
        ("sometimes", "'tool_choice' must be"),
        ({"type": "function"}, "'tool_choice' must be"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "always", "tools": []}}, "allowed_tools"),
        (
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"function": {"name": "nope"}}]}},
            "'nope'",
        ),
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
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_2", "content": "18C"},
            ],
            "messages[2].tool_call_id",
        ),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}], "messages[1].tool_calls[0]"),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{oops"}}]}],
            "messages[1].tool_calls[0]",
        ),
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


# -- a real model calling tools, through the official client ---------------------------------


def _tool(name: str, description: str, properties: dict, required=()) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WORD = {"type": "string", "maxLength": 24}
TWENTY_TOOLS = [
    _tool(
        "get_weather",
        "Current weather in a city",
        {"city": WORD, "unit": {"enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    _tool("get_time", "Current time in a time zone", {"zone": WORD}, ["zone"]),
    _tool("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
    _tool(
        "roll_dice",
        "Roll dice",
        {
            "sides": {"type": "integer", "minimum": 2, "maximum": 100},
            "count": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        ["sides"],
    ),
    _tool(
        "search",
        "Search the web",
        {"query": WORD, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        ["query"],
    ),
    _tool(
        "send_email", "Send an email", {"to": WORD, "subject": WORD, "urgent": {"type": "boolean"}}, ["to", "subject"]
    ),
    _tool(
        "set_alarm",
        "Set an alarm",
        {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "minute": {"type": "integer", "minimum": 0, "maximum": 59},
        },
        ["hour", "minute"],
    ),
    _tool(
        "translate", "Translate text", {"text": WORD, "target": {"enum": ["fr", "de", "es", "it"]}}, ["text", "target"]
    ),
    _tool(
        "create_event",
        "Create a calendar event",
        {"title": WORD, "attendees": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}},
        ["title", "attendees"],
    ),
    _tool(
        "convert_units",
        "Convert a quantity",
        {"value": {"type": "number", "minimum": 0}, "from_unit": WORD, "to_unit": WORD},
        ["value", "from_unit", "to_unit"],
    ),
    _tool("stock_price", "A stock's price", {"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}, ["ticker"]),
    _tool(
        "play_music",
        "Play a song",
        {"song": WORD, "volume": {"type": "integer", "minimum": 0, "maximum": 10}},
        ["song"],
    ),
    _tool(
        "book_table",
        "Book a restaurant table",
        {
            "restaurant": WORD,
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "when": {
                "type": "object",
                "properties": {"day": WORD, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["day", "hour"],
                "additionalProperties": False,
            },
        },
        ["restaurant", "people", "when"],
    ),
    _tool("list_files", "List a folder", {"path": WORD, "hidden": {"type": "boolean"}}, ["path"]),
    _tool(
        "rate_movie",
        "Rate a movie",
        {"title": WORD, "stars": {"type": "integer", "minimum": 1, "maximum": 5}},
        ["title", "stars"],
    ),
    _tool(
        "order_pizza",
        "Order pizza",
        {
            "size": {"enum": ["small", "medium", "large"]},
            "toppings": {"type": "array", "items": {"enum": ["cheese", "ham", "olives", "basil"]}, "maxItems": 4},
        },
        ["size"],
    ),
    _tool(
        "navigate",
        "Directions to a place",
        {"destination": WORD, "mode": {"anyOf": [{"enum": ["car", "bike", "walk"]}, {"type": "null"}]}},
        ["destination"],
    ),
    _tool("get_news", "Headlines", {"topic": WORD, "count": {"type": "integer", "minimum": 1, "maximum": 5}}, []),
    _tool("lights", "Switch the lights", {"room": WORD, "on": {"type": "boolean"}}, ["room", "on"]),
    _tool("no_arguments", "A tool without arguments", {}, []),
]
QUESTION = [{"role": "user", "content": "What's the weather in Paris? Use the tools."}]


@pytest.fixture(scope="module")
def smollm2_scheduler(smollm2_gguf):
    from ferrum_mac.serve import Scheduler

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=4096)).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_scheduler):
    from ferrum_mac.serve.app import build_app

    live = LiveServer(build_app(smollm2_scheduler, "smollm2"))
    yield live
    live.stop()


@pytest.fixture
def smollm2_client(smollm2_server):
    import openai

    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _validate(call, tools=TWENTY_TOOLS) -> None:
    import jsonschema

    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.parametrize("tool", TWENTY_TOOLS, ids=[t["function"]["name"] for t in TWENTY_TOOLS])
def test_named_call_validates_for_each_of_twenty_tools(smollm2_client, tool):
    name = tool["function"]["name"]
    answer = smollm2_client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        tools=TWENTY_TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=160,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == [name]
    _validate(choice.message.tool_calls[0])
    assert not choice.message.content


def test_required_call_streams_as_delta_tool_calls(smollm2_client):
    stream = smollm2_client.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=TWENTY_TOOLS, tool_choice="required", max_tokens=160, stream=True
    )
    content, calls, finish, pieces = [], {}, None, 0
    for chunk in stream:
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for piece in choice.delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            if piece.id:
                assert call["id"] is None and not call["arguments"]  # id and name come first
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
            pieces += bool(piece.function.arguments)
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) >= 1
    assert not any(m in "".join(content) for m in MARKUP)
    assert pieces > len(calls)  # the arguments came as the model wrote them, not in one chunk a call
    import jsonschema

    for call in calls.values():
        schema = next(t["function"]["parameters"] for t in TWENTY_TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), schema)


def test_auto_answer_never_leaks_markup(smollm2_server):
    body = {"messages": QUESTION, "tools": TWENTY_TOOLS[:3], "max_tokens": 80, "temperature": 0, "stream": True}
    with httpx.stream("POST", smollm2_server.url + CHAT, json=body, timeout=300) as response:
        assert response.status_code == 200
        lines = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in lines if c["choices"])
    assert not any(m in content for m in MARKUP), content
    whole = httpx.post(smollm2_server.url + CHAT, json={**body, "stream": False}, timeout=300).json()
    message = whole["choices"][0]["message"]
    assert not any(m in (message["content"] or "") for m in MARKUP)
    for call in message.get("tool_calls") or ():
        assert (
            call["function"]["name"] in {"get_weather", "get_time", "add"}
            and json.loads(call["function"]["arguments"]) is not None
        )


def _allowed(matcher, token: int) -> bool:
    import numpy as np

    mask = np.zeros((1, matcher.vocab.words), np.int32)
    matcher.fill_mask(mask)
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def test_auto_answer_is_free_until_the_model_opens_a_call_then_constrained(smollm2_scheduler):
    from ferrum_mac.serve import checks as api
    from ferrum_mac.serve.core import Server

    server = Server(smollm2_scheduler, "smollm2")
    matcher = server._tool_matcher(api.tool_request({"tools": TWENTY_TOOLS[:3]}), "", False)
    encode = lambda text: server.engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for token in encode("Let me check. ") + encode("<tool_call>"):
        assert _allowed(matcher, token) and not matcher.started
        matcher.accept(token)
    assert matcher.started
    assert not _allowed(matcher, encode("Sure")[0])  # past the opener only the call's JSON may follow
    for token in encode('{"name": "get_time", "arguments": {"zone": "UTC"}}'):
        assert _allowed(matcher, token)
        matcher.accept(token)
    assert not matcher.is_complete()  # the call is closed as the family closes it
    for token in encode("\n</tool_call>"):
        matcher.accept(token)
    assert matcher.is_complete()
    wrong = server._tool_matcher(api.tool_request({"tools": TWENTY_TOOLS[:3]}), "", False)
    for token in encode("<tool_call>") + encode('{"name": "'):
        wrong.accept(token)
    assert not _allowed(wrong, encode("wipe")[0])  # only the tools' names may follow


TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)


@pytest.mark.parametrize("parallel", [True, False])
def test_answers_keep_one_call_when_parallel_calls_are_off(parallel):
    from ferrum_mac.engine import CallSplitter, Done, TextDelta
    from ferrum_mac.serve import checks as api
    from ferrum_mac.serve.events import Finished
    from ferrum_mac.serve.protocols.openai import finish_reason, message_of, tool_call_deltas
    from ferrum_mac.text.tool_calls import FORMATS, HERMES

    tools = api.tool_request({"tools": TWENTY_TOOLS[:2], "parallel_tool_calls": parallel})
    whole = CallSplitter(FORMATS[HERMES], tools.parallel, stream_arguments=True)
    whole.feed(TWO_CALLS)
    whole.finish()
    message = message_of(whole.text, whole.calls)
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"][: 2 if parallel else 1]
    stream = CallSplitter(FORMATS[HERMES], tools.parallel, stream_arguments=True)
    events = [e for ch in TWO_CALLS for e in stream.feed(ch)] + stream.finish()
    assert not any(isinstance(e, TextDelta) for e in events)
    deltas = [d for e in events for d in tool_call_deltas(e)]
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [h["index"] for h in heads] == list(range(2 if parallel else 1))
    assert all(h["function"]["arguments"] == "" and h["type"] == "function" for h in heads)
    done = Finished.of(Done("eos", 1, 0, 1, 0.1, 10.0, 10.0), bool(stream.calls))
    assert finish_reason(done) == "tool_calls"


STREAMED = [
    ("hermes", "Let me see. " + TWO_CALLS, ["get_weather", "get_time"]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
        ["get_weather", "get_time"],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
        ["get_weather", "get_time"],
    ),
]


@pytest.mark.parametrize("family, text, names", STREAMED, ids=[s[0] for s in STREAMED])
def test_arguments_stream_as_they_are_written(family, text, names):
    """Fed a character at a time, each call's id and name come once its head is read, then its
    arguments in pieces; together they are the call, and no markup is text."""
    from ferrum_mac.engine import CallSplitter
    from ferrum_mac.text.tool_calls import FORMATS, ToolCallDelta, calls_of

    split = CallSplitter(FORMATS[family], stream_arguments=True)
    events = [e for ch in text for e in split.feed(ch)] + split.finish()
    pieces = [e for e in events if isinstance(e, ToolCallDelta)]
    text_out = "".join(e.text for e in events if not isinstance(e, ToolCallDelta))
    assert text_out.strip() in ("", "Let me see.") and not any(m in text_out for m in MARKUP + ("[TOOL_CALLS]",))
    heads = [p for p in pieces if p.id is not None]
    assert [h.name for h in heads] == names and [h.index for h in heads] == [0, 1]
    assert all(p.name is None for p in pieces if p.id is None)
    assert len(pieces) > 2 * len(names) + 2  # many pieces, not one per call
    calls = calls_of(pieces)
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"zone": "UTC"}]


def test_a_call_that_never_parses_is_text_and_a_cut_one_is_no_call():
    from ferrum_mac.engine import EOS, MAX_TOKENS, CallSplitter
    from ferrum_mac.text.tool_calls import FORMATS, HERMES, ToolCallDelta

    split = CallSplitter(FORMATS[HERMES], stream_arguments=True)
    events = split.feed("<tool_call>\nnot a call\n</tool_call> ok") + split.finish(EOS)
    assert "".join(e.text for e in events) == "\nnot a call\n ok" and not split.calls
    cut = CallSplitter(FORMATS[HERMES], stream_arguments=True)
    events = cut.feed('<tool_call>\n{"name": "get_time", "arguments": {"zone": "U') + cut.finish(MAX_TOKENS)
    assert all(isinstance(e, ToolCallDelta) for e in events)  # streamed as it came, but no call to run
    assert cut.calls == []


CUT = [
    ("second call's head", "hermes", TWO_CALLS.split('"get_time"')[0], ["get_weather"], ""),
    ("second opener", "hermes", TWO_CALLS[: TWO_CALLS.rindex("<tool_call>")] + "<tool_call>\n{", ["get_weather"], ""),
    (
        "half an opener",
        "hermes",
        'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_',
        ["get_time"],
        "Sure. ",
    ),
    ("no head yet", "hermes", "<tool_call>\n", [], ""),
    ("llama call", "llama3", '{"name": "get_weather", "parameters": {"city": "Par', [], ""),
    ("llama JSON text", "llama3", '{"answer": 4', [], '{"answer": 4'),
    (
        "mistral list",
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get',
        ["get_time"],
        "",
    ),
]


@pytest.mark.parametrize("case, family, text, names, content", CUT, ids=[c[0] for c in CUT])
@pytest.mark.parametrize("stream", [True, False])
def test_a_call_cut_by_max_tokens_is_neither_a_call_nor_text(case, family, text, names, content, stream):
    """Whatever the limit cuts inside call markup comes back as no text and no call; whole calls
    before it stay, and text that is no call (Llama's bare JSON) stays text."""
    from ferrum_mac.engine import MAX_TOKENS, CallSplitter, TextDelta
    from ferrum_mac.text.tool_calls import FORMATS

    split = CallSplitter(FORMATS[family], stream_arguments=stream)
    events = [e for ch in text for e in split.feed(ch)] + split.finish(MAX_TOKENS)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == content == split.text
    if family == "mistral" and not stream:
        names = []  # one body holds the whole list: unparsable once cut, its whole first call with it
    assert [c.name for c in split.calls] == names


# -- Qwen3's own template and tokenizer (<tool_call> is one token there), on random weights -----


@pytest.fixture(scope="module")
def qwen3_server(qwen3_random):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(qwen3_random, kv_capacity=2048)).start()
    live = LiveServer(build_app(scheduler, "qwen3-random"))
    yield live
    live.stop()
    scheduler.stop()


THINK_CLOSE = 151668  # Qwen3's </think>


@pytest.mark.parametrize("thinking", [False, True], ids=["no-think", "think"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_qwen3_required_call_validates_through_its_template(qwen3_server, stream, thinking):
    """Without thinking the prompt ends with <tool_call>; with it the call's grammar, markers
    and all, starts after the model's </think> (which a bias makes come at once)."""
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    tools = [t for t in TWENTY_TOOLS if t["function"]["name"] in ("lights", "order_pizza", "rate_movie")]
    extra = (
        {"logit_bias": {str(THINK_CLOSE): 100}} if thinking else {"chat_template_kwargs": {"enable_thinking": False}}
    )
    kwargs = dict(
        model="qwen3-random", messages=QUESTION, tools=tools, tool_choice="required", max_tokens=200, extra_body=extra
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        # a random model writes </think> without <think> first, so the splitter leaves it in the text
        assert choice.finish_reason == "tool_calls" and (choice.message.content or "") in (
            "",
            "</think>"[: 8 * thinking],
        )
        assert not any(m in (choice.message.content or "") for m in MARKUP), choice
        _validate(choice.message.tool_calls[0], tools)
        return
    pieces = list(client.chat.completions.create(**kwargs, stream=True))
    content = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    calls = [c for p in pieces if p.choices for c in p.choices[0].delta.tool_calls or ()]
    assert content.strip() in ("", "</think>"[: 8 * thinking]) and pieces[-1].choices[0].finish_reason == "tool_calls"
    # a random model may make parallel calls: each index's argument pieces make one object
    names = {c.index: c.function.name for c in calls if c.function.name}
    for index, name in names.items():
        arguments = "".join(c.function.arguments or "" for c in calls if c.index == index)
        schema = next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)
    assert names, pieces


def test_remote_engine_calls_tools_and_answers_with_the_result(smollm2_server):
    """`Conversation.send(tools=...)` on a remote engine: the server's calls come back as a
    `ToolCallRequested`, the results go back as `tool` messages, and the answer follows."""
    import jsonschema

    from ferrum_mac.engine import TOOL_CALLS, Done, TextDelta, ToolCallRequested
    from ferrum_mac.engine.tools import Toolbox, tool
    from ferrum_mac.remote import RemoteEngine

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"It is sunny in {city}."

    box = Toolbox([get_weather])
    engine = RemoteEngine(smollm2_server.url)
    try:
        conv = engine.conversation(max_tokens=60)
        events = list(conv.send("Weather in Paris?", tools=box, tool_choice="get_weather"))
        [requested] = [e for e in events if isinstance(e, ToolCallRequested)]
        assert events[-1].stop_reason == TOOL_CALLS and [c.name for c in requested.calls] == ["get_weather"]
        jsonschema.validate(json.loads(requested.calls[0].arguments), get_weather.parameters)
        assert conv.messages[-1]["tool_calls"] == [c.as_openai() for c in requested.calls]
        conv.add_tool_results(box.results(requested.calls))
        events = list(conv.continue_answer())
        assert isinstance(events[-1], Done) and "".join(e.text for e in events if isinstance(e, TextDelta)).strip()
        assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    finally:
        engine.close()


def test_allowed_tools_narrow_what_an_answer_may_call():
    """OpenAI's `allowed_tools` choice (pydantic-ai sends it): its mode, and only its tools."""
    from ferrum_mac.serve import checks as api

    allowed = {
        "mode": "required",
        "tools": [{"type": "function", "function": {"name": TWENTY_TOOLS[1]["function"]["name"]}}],
    }
    tools = api.tool_request(
        {"tools": TWENTY_TOOLS[:3], "tool_choice": {"type": "allowed_tools", "allowed_tools": allowed}}
    )
    assert tools.choice == "required"
    assert [f["name"] for f in tools.functions] == [TWENTY_TOOLS[1]["function"]["name"]]


# -- a forced call and max_tokens, through OpenAI's and Anthropic's routes --------------------

PARIS = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _sse_data(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("max_tokens", [8, 14, 34])
def test_a_forced_call_is_whole_or_a_cut_answer_never_a_cut_call_or_markup(smollm2_server, max_tokens):
    """8 and 14 tokens cut the only call: a cut answer (length / max_tokens) with no call and no
    text. 34 hold one call but not a second: the answer ends after the first (tool_calls /
    tool_use), where it used to start a second whose head came back as text."""
    cut = max_tokens < 34
    base = {"model": "smollm2", "messages": PARIS, "max_tokens": max_tokens, "temperature": 0}
    openai_body = {**base, "tools": [_function("get_weather", CITY)], "tool_choice": "required"}
    choice = httpx.post(smollm2_server.url + CHAT, json=openai_body, timeout=300).json()["choices"][0]
    assert choice["finish_reason"] == ("length" if cut else "tool_calls"), choice
    assert not choice["message"]["content"]
    calls = choice["message"].get("tool_calls") or []
    assert [json.loads(c["function"]["arguments"]) for c in calls] == ([] if cut else [{"city": "Paris"}])
    chunks = _sse_data(httpx.post(smollm2_server.url + CHAT, json={**openai_body, "stream": True}, timeout=300))
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == choice["finish_reason"]

    anthropic_body = {**base, "tools": [{"name": "get_weather", "input_schema": CITY}], "tool_choice": {"type": "any"}}
    message = httpx.post(smollm2_server.url + "/v1/messages", json=anthropic_body, timeout=300).json()
    assert message["stop_reason"] == ("max_tokens" if cut else "tool_use"), message
    assert [b["type"] for b in message["content"]] == (["text"] if cut else ["tool_use"])
    assert all(b["text"] == "" for b in message["content"] if b["type"] == "text")
    events = _sse_data(
        httpx.post(smollm2_server.url + "/v1/messages", json={**anthropic_body, "stream": True}, timeout=300)
    )
    assert not any(e.get("delta", {}).get("type") == "text_delta" for e in events)
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == [message["stop_reason"]]


def test_ollama_sends_no_call_cut_by_num_predict():
    """Ollama's answer gathers the calls' pieces and sends them whole: a cut one is left out
    (it used to go out with `arguments: {}`), and the answer is "length"."""
    from ferrum_mac.engine import Done
    from ferrum_mac.serve.events import Finished
    from ferrum_mac.serve.protocols.ollama import OllamaAnswer
    from ferrum_mac.text.tool_calls import ToolCallDelta

    pieces = [
        ToolCallDelta(0, "call_a", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city": "Paris"}'),
        ToolCallDelta(1, "call_b", "get_time", ""),
        ToolCallDelta(1, None, None, '{"zone": '),
    ]
    out = OllamaAnswer("smollm2", chat=True)
    assert all(out.piece(p) is None for p in pieces)
    done = Finished.of(Done("max_tokens", 10, 0, 30, 0.1, 10.0, 10.0), called=True)
    last = out.last(done, 1.0)
    assert out.calls_object()["message"]["tool_calls"] == [
        {"id": "call_a", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert last["done_reason"] == "length" and done.finish == "length"
