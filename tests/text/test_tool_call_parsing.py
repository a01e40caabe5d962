"""Tool calls parsed per family, whole and streamed (token by token through the real Qwen3
tokenizer and character by character): markup never reaches the text."""

from __future__ import annotations

import json

import pytest

from ferrum_mac.text import StreamingDetokenizer, load_chat_template, load_tokenizer
from ferrum_mac.text.tool_calls import (
    FORMATS,
    HERMES,
    LLAMA3,
    MISTRAL,
    StreamingToolParser,
    ToolCall,
    messages_without_tool_fields,
    parse_tool_calls,
    template_renders_tools,
    tool_format,
    tools_system_message,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "Europe/Paris"}
MARKUP = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "[ARGS]")

CASES = {
    HERMES: (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>',
        "Let me check.\n",
    ),
    LLAMA3: (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}',
        "",
    ),
    MISTRAL: (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
        "",
    ),
}


def _feed_all(parser: StreamingToolParser, pieces) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def _split(events) -> tuple[str, list[ToolCall]]:
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


def _check_calls(calls: list[ToolCall]) -> None:
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family_parses_parallel_calls(family):
    text, content = CASES[family]
    got_content, calls = parse_tool_calls(text, FORMATS[family])
    assert got_content.strip() == content.strip()
    _check_calls(calls)


@pytest.mark.parametrize("family", sorted(CASES))
def test_character_by_character_stream_never_leaks_markup(family):
    text, content = CASES[family]
    parser = StreamingToolParser(FORMATS[family])
    pieces = []
    for ch in text:
        pieces += parser.feed(ch)
    pieces += parser.finish()
    streamed, calls = _split(pieces)
    assert streamed.strip() == content.strip()
    for piece in pieces:
        if isinstance(piece, str):
            assert not any(m in piece for m in MARKUP) and "<tool" not in piece and "[TOOL" not in piece
    _check_calls(calls)


def test_qwen3_tokens_stream_without_markup_in_text(qwen3_dir):
    tokenizer = load_tokenizer(qwen3_dir)
    text, content = CASES[HERMES]
    detok, parser = StreamingDetokenizer(tokenizer), StreamingToolParser(FORMATS[HERMES])
    events = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        events += parser.feed(detok.add(token))
    events += parser.feed(detok.finish()) + parser.finish()
    for piece in events:
        assert not (isinstance(piece, str) and any(m in piece for m in MARKUP))
    streamed, calls = _split(events)
    assert streamed == content
    _check_calls(calls)


def test_text_that_only_looks_like_an_opener_comes_out_whole():
    parser = StreamingToolParser(FORMATS[HERMES])
    events = _feed_all(parser, ["a <tool", " is not a call; 1 < 2", " <tool_c"])
    assert _split(events) == ("a <tool is not a call; 1 < 2 <tool_c", [])


def test_held_back_text_is_released_as_soon_as_it_cannot_be_an_opener():
    parser = StreamingToolParser(FORMATS[HERMES])
    assert parser.feed("Hi <tool") == ["Hi "]
    assert parser.feed("box") == ["<toolbox"]


def test_a_call_that_does_not_parse_comes_out_as_text_without_its_markup():
    content, calls = parse_tool_calls("<tool_call>\n{not json}\n</tool_call>", FORMATS[HERMES])
    assert calls == [] and content.strip() == "{not json}"


def test_an_unclosed_call_at_the_end_still_parses():
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}', FORMATS[HERMES])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


def test_llama_answer_in_plain_text_is_text():
    assert parse_tool_calls("  The weather is {fine}.", FORMATS[LLAMA3]) == ("  The weather is {fine}.", [])
    assert parse_tool_calls("Hello {x}", FORMATS[LLAMA3]) == ("Hello {x}", [])


def test_mistral_v11_calls():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Paris"}'
    content, calls = parse_tool_calls(text, FORMATS[MISTRAL])
    assert content == ""
    _check_calls(calls)


def test_arguments_given_as_json_text_are_accepted():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', FORMATS[HERMES])
    assert json.loads(calls[0].arguments) == {"a": 1}


def test_family_from_template_source(qwen3_dir):
    tokenizer = load_tokenizer(qwen3_dir)
    qwen3 = load_chat_template(qwen3_dir, tokenizer)
    assert tool_format(qwen3.source).family == HERMES and template_renders_tools(qwen3.source)
    assert tool_format("{{ '[TOOL_CALLS]' }}").family == MISTRAL
    assert tool_format("{% if message.role == 'ipython' %}<|python_tag|>{% endif %}").family == LLAMA3
    assert tool_format("{{ messages }}").family == HERMES and not template_renders_tools("{{ messages }}")


def test_messages_for_a_template_without_tools():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    assert '"name": "get_time"' in tools_system_message(tools) and "<tool_call>" in tools_system_message(tools)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    out = messages_without_tool_fields(
        [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ]
    )
    assert out == [
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"},
    ]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
]


@pytest.mark.parametrize("folder", ["tokenizers/qwen3", "stories260K"])
def test_tools_and_calls_render_through_the_template(shared_assets, folder):
    path = shared_assets / folder
    template = load_chat_template(path, load_tokenizer(path))
    prompt = template.render(HISTORY, tools=TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in prompt  # the tool, as the template's tojson writes it
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>' in prompt
    assert "<tool_response>\n12:00\n</tool_response>" in prompt
    assert template.renders_tools == (folder != "stories260K") and template.tool_format.family == HERMES


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_forced_call_parses_after_its_prefix(family):
    fmt = FORMATS[family]
    content, calls = parse_tool_calls(fmt.forced_prefix + '{"name": "get_time", "arguments": {"zone": "UTC"}}', fmt)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Paris"}}]',
        ' {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    ],
)
def test_mistral_calls_whose_special_marker_the_tokenizer_dropped(text):
    parser = StreamingToolParser(FORMATS[MISTRAL])
    events = _feed_all(parser, list(text))
    content, calls = _split(events)
    assert content == "" and calls and calls[0].name == "get_weather"


def test_text_mentioning_markers_later_in_a_mistral_answer_is_text():
    assert parse_tool_calls('Use {"name": x} here', FORMATS[MISTRAL]) == ('Use {"name": x} here', [])
