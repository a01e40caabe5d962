"""Tool calls in a model's own words: which call format a chat template speaks, and the calls
parsed out of generated text, whole or as it streams.

Families (picked from the template's source by `tool_format`):

    hermes   Qwen3, Hermes, SmolLM and templates without tools:  <tool_call>{"name": .., "arguments": {..}}</tool_call>
    llama3   Llama 3.x: the whole answer is `{"name": .., "parameters": {..}}` (after an optional <|python_tag|>),
             several calls separated by ';'
    mistral  [TOOL_CALLS] then `[{"name": .., "arguments": {..}}, ..]` (or v11's `name[ARGS]{..}`) to the end

    parser = StreamingToolParser(tool_format(template.source))
    for piece in generated_text: for event in parser.feed(piece): ...   # then parser.finish()

Events are `str` (answer text, never holding call markup) and `ToolCall`s, each whole: a call is
only known to be one once it has been closed and parsed. With `stream_arguments` the calls come
in pieces instead, as OpenAI streams them: a `ToolCallDelta` with the call's id and name as soon
as `{"name": ..., "arguments": ` has been read, then its arguments' JSON text as it is written.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"


@dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is JSON text of an object (as OpenAI's API carries it)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call number `index` of an answer: the first piece has its `id` and `name`,
    later ones (if any) only more `arguments` (JSON text, whole once every piece has come)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


def calls_of(deltas: Sequence[ToolCallDelta]) -> list[ToolCall]:
    """Whole calls from their pieces, in index order; a call whose pieces stopped before its
    arguments were a whole JSON object (cut by `max_tokens`) is none: nobody may run it."""
    heads: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in heads:
            heads[d.index] = d
        arguments.setdefault(d.index, []).append(d.arguments)
    calls = [ToolCall(heads[i].name or "", "".join(arguments[i]), heads[i].id or "") for i in sorted(heads)]
    return [c for c in calls if is_whole(c)]


def is_whole(call: ToolCall) -> bool:
    """Whether a call's arguments are a whole JSON object (a cut one's are a part of one)."""
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


@dataclass(frozen=True)
class ToolFormat:
    """How one family opens and closes its calls. `closer` None: the calls run to the end of the
    answer. `start_openers`: text that opens a call only at the start of the answer and is part of
    the call itself (Llama's bare JSON; Mistral's list when the tokenizer drops its special
    [TOOL_CALLS] token from the text)."""

    family: str
    openers: tuple[str, ...]
    closer: str | None = None
    start_openers: tuple[str, ...] = ()
    forced_prefix: str = ""  # what an answer that must call starts with, before the call's JSON
    separator: str = ""  # between two calls of one answer, when it makes several
    brackets: tuple[str, str] = ("", "")  # around several calls (Mistral's list)

    @property
    def opener(self) -> str:
        """The marker a call is forced to start with."""
        return self.openers[0]

    def calls_markup(self, opened: bool, many: bool) -> tuple[str, str | None, str]:
        """What a call grammar writes around the calls' JSON (`grammar.tool_calls_grammar`'s head,
        between and tail): after an opener the prompt or the model already wrote (`opened`), or
        markers and all (an answer that reasons first); `many`: one call, or one or more. The
        closer is written after the last call, so the model ends the answer where it would."""
        head, tail = self.brackets if many else ("", "")
        if not opened:
            head = self.forced_prefix + head
        return head, self.separator if many else None, tail + ("\n" + self.closer if self.closer else "")

    def parse_calls(self, body: str) -> list[ToolCall] | None:
        """The calls in the text between an opener and its closer (or the end); None when it is no call."""
        if self.family == MISTRAL:
            return _mistral_calls(body)
        if self.family == LLAMA3:
            return _llama_calls(body)
        call = _json_call(body)
        return None if call is None else [call]


FORMATS = {
    HERMES: ToolFormat(
        HERMES,
        ("<tool_call>",),
        "</tool_call>",
        forced_prefix="<tool_call>\n",
        separator="\n</tool_call>\n<tool_call>\n",
    ),
    LLAMA3: ToolFormat(LLAMA3, ("<|python_tag|>",), None, start_openers=("{",), separator="; "),
    MISTRAL: ToolFormat(
        MISTRAL,
        ("[TOOL_CALLS]",),
        None,
        forced_prefix="[TOOL_CALLS]",
        start_openers=('[{"name"', '{"name"'),
        separator=", ",
        brackets=("[", "]"),
    ),
}


def tool_format(template_source: str) -> ToolFormat:
    """The call format the template's own tool section teaches; Hermes where it has none
    (`tools_system_message` then teaches it)."""
    if "[TOOL_CALLS]" in template_source:
        return FORMATS[MISTRAL]
    if "<tool_call>" in template_source:
        return FORMATS[HERMES]
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return FORMATS[LLAMA3]
    return FORMATS[HERMES]


def template_renders_tools(template_source: str) -> bool:
    """Whether a template reads its `tools` variable (else the tools go into a system message)."""
    return re.search(r"\btools\b", template_source) is not None


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """The answer's text without its calls, and the calls."""
    parser = StreamingToolParser(fmt)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]


class StreamingToolParser:
    """Splits streamed answer text into text and calls. Text that may be the start of an opener
    is held back until it is clearly not, so markup never reaches the text; a call that does not
    parse comes out as text at its end (the model wrote something else), unless pieces of it
    were streamed already (`stream_arguments`), which then stand as they are. `parallel` False
    passes on only the answer's first call; `prefix`: what the prompt already opened the answer
    with (a forced call's opener), read before the answer's own text."""

    def __init__(self, fmt: ToolFormat, stream_arguments: bool = False, parallel: bool = True, prefix: str = ""):
        self.fmt = fmt
        self._parallel = parallel
        self._calls_out = 0  # whole calls passed on (with `parallel` False, at most one)
        self._pending = ""  # text held back: a possible opener, or a call's body
        self._opener: str | None = None  # the opener of the call being read
        self._started = False  # whether answer text (not whitespace) has come out yet
        self._after_call = False  # a call just closed: the whitespace separating calls is no text
        self._stream = stream_arguments
        self._index = 0  # calls of the answer so far (the next one's index)
        self._body = _BodyStream()  # how much of the call's body has been streamed
        if prefix:
            self.feed(prefix)

    @property
    def in_call(self) -> bool:
        """Whether the text so far has opened a call that is not closed yet."""
        return self._opener is not None

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        events: list[str | ToolCall] = []
        while self._pending:
            if self._opener is None:
                if not self._scan_text(events):
                    break
            elif not self._scan_call(events):
                break
        return self._kept(events)

    def finish(self, cut: bool = False) -> list[str | ToolCall]:
        """What is left once generation ended: an unclosed call parsed as it is, held text
        released. `cut`: the answer did not end by itself (`max_tokens`, a stop string), so a
        call it left open and unparsable, or text held as a possible opener, was markup cut
        short: neither text nor a call."""
        events: list[str | ToolCall] = []
        if self._opener is not None:
            if not (cut and self._cut_call()):
                self._end_call(self._pending, events)
        elif self._pending and not cut:
            events.append(self._pending)
        self._pending, self._opener = "", None
        return self._kept(events)

    def _cut_call(self) -> bool:
        """Whether the open call's body is a call cut short: unparsable, and opened by a marker
        or starting as a call does (Llama's bare `{` may open plain JSON text instead)."""
        if self.fmt.parse_calls(self._pending) is not None:
            return False
        if self._opener in self.fmt.openers:
            return True
        start = "".join(self._pending.split()).lstrip("[")
        return start.startswith(CALL_START) or CALL_START.startswith(start)

    def _kept(self, events: list) -> list:
        """`events` less the calls after the first when the answer may make only one."""
        if self._parallel:
            return events
        kept = []
        for event in events:
            if isinstance(event, ToolCallDelta):
                if event.index > 0:
                    continue
            elif isinstance(event, ToolCall):
                if self._calls_out:
                    continue
                self._calls_out += 1
            kept.append(event)
        return kept

    # -- states ----------------------------------------------------------------------------

    def _scan_text(self, events: list) -> bool:
        """Emit text up to an opener (then enter the call); False when waiting for more text."""
        if self._after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_call = False
        text = self._pending
        if not self._started and self.fmt.start_openers:
            stripped = text.lstrip()
            for opener in self.fmt.start_openers:
                if stripped.startswith(opener):
                    self._enter(opener, stripped)  # the opener is the call's own text
                    return True
            if not stripped or any(o.startswith(stripped) for o in self.fmt.start_openers):
                return False
        self._started = self._started or bool(text.strip())
        found = _first_opener(text, self.fmt.openers)
        if found is not None:
            at, opener = found
            if at:
                events.append(text[:at])
            self._enter(opener, text[at + len(opener) :])
            return True
        keep = _held_prefix_length(text, self.fmt.openers)
        if len(text) > keep:
            events.append(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return False

    def _scan_call(self, events: list) -> bool:
        closer = self.fmt.closer
        if closer is None or closer not in self._pending:
            if self._stream:
                events.extend(self._body.pieces(self._pending, self._next_index))
            return False
        body, _, rest = self._pending.partition(closer)
        self._end_call(body, events)
        self._pending = rest
        return True

    def _enter(self, opener: str, rest: str) -> None:
        self._opener, self._pending, self._started = opener, rest, True
        self._body = _BodyStream()

    def _next_index(self) -> int:
        self._index += 1
        return self._index - 1

    def _end_call(self, body: str, events: list) -> None:
        calls = self.fmt.parse_calls(body)
        if self._stream:
            events.extend(self._body.pieces(body, self._next_index))
            streamed = self._body.heads
            if calls is None and streamed:
                calls = []  # its pieces are out already; the rest of the body is no text either
            for call in (calls or [])[streamed:]:
                events.append(ToolCallDelta(self._next_index(), call.id, call.name, call.arguments))
        elif calls is not None:
            events.extend(calls)
        if calls is None:
            events.append(body)  # without its opener: markup never reaches the text
        else:
            self._after_call = True
        self._opener = None


CALL_START = '{"name"'  # how every family's call JSON starts (whitespace aside)

# A call's head as the grammar (and most models) write it; the arguments must be an object to be
# streamed (some models write them as a JSON string, which is only parsed whole).
_CALL_HEAD = re.compile(
    r'[\s\[\]{},;]*?\{\s*"name"\s*:\s*"([a-zA-Z0-9_.-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


class _BodyStream:
    """The pieces of a call's body read so far: each call's head once it is whole, then its
    arguments object as far as it goes (a JSON scanner finds where the object ends)."""

    def __init__(self):
        self.at = 0  # how far into the body has been streamed
        self.heads = 0  # calls whose head was streamed
        self.depth = 0  # inside the arguments: bracket depth (0: not inside)
        self.in_string = self.escaped = False

    def pieces(self, body: str, next_index) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while True:
            if self.depth == 0:
                head = _CALL_HEAD.match(body, self.at)
                if head is None:
                    return out
                self.at, self.depth, self.heads = head.end(), 0, self.heads + 1
                self.index = next_index()
                out.append(ToolCallDelta(self.index, new_call_id(), head.group(1), ""))
                self.depth = -1  # at the arguments' first character
            start, end = self.at, self._scan(body)
            if end > start:
                out.append(ToolCallDelta(self.index, None, None, body[start:end]))
            if self.depth != 0:
                return out

    def _scan(self, body: str) -> int:
        """Advance through the arguments' JSON; where it stopped (the body's end, or just past
        the object's closing brace, then depth is 0)."""
        if self.depth == -1:
            self.depth = 0
        i = self.at
        while i < len(body):
            ch = body[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    break
        self.at = i
        return i


def _first_opener(text: str, openers: Sequence[str]) -> tuple[int, str] | None:
    hits = [(text.find(o), o) for o in openers if o in text]
    return min(hits) if hits else None


def _held_prefix_length(text: str, openers: Sequence[str]) -> int:
    """The length of the longest tail of `text` that an opener starts with."""
    best = 0
    for opener in openers:
        for n in range(min(len(opener) - 1, len(text)), best, -1):
            if opener.startswith(text[-n:]):
                best = n
                break
    return best


# -- call bodies -------------------------------------------------------------------------------


def _json_call(text: str, arguments_key: str = "arguments") -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_of(value, arguments_key)


def _call_of(value: Any, *arguments_keys: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    for key in arguments_keys or ("arguments",):
        if key in value:
            arguments = value[key]
            break
    else:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _llama_calls(text: str) -> list[ToolCall] | None:
    calls = []
    for part in _split_top_level(text.strip(), ";"):
        try:
            value = json.loads(part)
        except ValueError:
            return None
        call = _call_of(value, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
    return calls or None


_MISTRAL_V11 = re.compile(r"\s*([a-zA-Z0-9_-]{1,64})\[ARGS\]")


def _mistral_calls(text: str) -> list[ToolCall] | None:
    text = text.strip()
    if text.startswith("{"):  # one call, as a forced call's grammar writes it
        call = _json_call(text)
        return None if call is None else [call]
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        listed = [_call_of(item, "arguments") for item in items]
        found = [c for c in listed if c is not None]
        return found if listed and len(found) == len(listed) else None
    calls = []
    for part in filter(None, (p.strip() for p in text.split("[TOOL_CALLS]"))):
        head = _MISTRAL_V11.match(part)
        if head is None:
            return None
        call = _call_of({"name": head.group(1), "arguments": part[head.end() :].strip()})
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator`s outside JSON strings and brackets."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


# -- prompts -----------------------------------------------------------------------------------


def tools_system_message(tools: Sequence[Mapping[str, Any]]) -> str:
    """How a model whose template has no tool section learns the tools: Hermes' wording."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def messages_without_tool_fields(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Messages for a template that knows nothing of tools: assistant calls written out in
    Hermes markup, tool results as user turns in <tool_response> tags (as Qwen3 renders them)."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = [_hermes_markup(c) for c in message.pop("tool_calls")]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *calls]))
        elif message.get("role") == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        out.append(message)
    return out


def _hermes_markup(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
