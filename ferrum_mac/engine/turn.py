"""One turn of a conversation: fit the prompt, reuse the cache, prefill the rest, stream the answer.

The cache is reused twice over: the conversation's own cache is cut back to what it shares
with the new prompt, then the model's prefix cache (`state.reuse`) attaches whatever more of the
prompt any sequence computed before (another conversation with the same system prompt, the
turn before an edit). What the turn computes is remembered (`state.remember`) for later ones.

Whatever ends the turn (the answer's end, cancel, Ctrl-C, an error, the caller dropping
the stream), the conversation is left consistent: the answer so far is its last assistant
message and its ledger equals what the cache holds.

With tools, the answer's text is split as it streams: call markup never reaches a `TextDelta`;
the calls go into the assistant message's `tool_calls` and a `ToolCallRequested` event. A
required call is constrained from the start (its opener ends the prompt), an "auto" one once the
model writes its family's opener, exactly as the server does it (`Constraints.tool_matcher`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from ferrum_mac.engine.answer_text import AnswerText
from ferrum_mac.engine.context import common_prefix, fit
from ferrum_mac.engine.conversation import Conversation
from ferrum_mac.engine.decode_loop import answer_tokens
from ferrum_mac.engine.structured import ResponseFormat
from ferrum_mac.engine.events import (
    CANCELLED,
    CONTEXT,
    EOS,
    MAX_TOKENS,
    STOP_STRING,
    TOOL_CALLS,
    Done,
    Event,
    Notice,
    ReasoningDelta,
    TextDelta,
    ToolCallRequested,
)
from ferrum_mac.engine.tools import ToolRequest
from ferrum_mac.grammar import GrammarMatcher
from ferrum_mac.text import prompt_opens_reasoning
from ferrum_mac.text.tool_calls import StreamingToolParser, ToolCall, ToolFormat

if TYPE_CHECKING:
    from ferrum_mac.engine.engine import Engine


@dataclass
class Timing:
    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None

    def token(self) -> None:
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last


def run_turn(
    engine: "Engine",
    conv: Conversation,
    text: str | None,
    cancel: threading.Event,
    response_format: ResponseFormat | None = None,
    tools: ToolRequest | None = None,
) -> Iterator[Event]:
    """`response_format`: what this answer must be (None: the conversation's setting); `tools`:
    what it may call; `text` None: no new user message (the answer after tool results)."""
    timing = Timing()
    model, settings = engine.model, conv.settings
    fmt = response_format or settings.response_format
    call_format = engine.template.tool_format
    grammar = engine.constraints.compile(fmt) if fmt is not None and (tools is None or not tools.forced) else None
    ids, prompt_text, messages = _fit_new_message(engine, conv, text, tools)
    prefilled = tools is not None and bool(tools.forced) and prompt_text.endswith(call_format.forced_prefix)
    sampler = model.sampler(settings.sampling, ids)
    matcher = _matcher(engine, grammar, tools, call_format, prompt_text, prefilled)
    dropped = _user_turns(conv.messages) + (text is not None) - _user_turns(messages)
    conv.messages = messages  # nothing changed before this line: errors above leave the conversation as it was
    _trim_cache(engine, conv, ids)
    reused = 0
    known = list(ids)  # every token the cache may hold, in order; the ledger is a prefix of it
    answer = AnswerText(engine.tokenizer, settings.stop, prompt_opens_reasoning(prompt_text))
    calls = CallSplitter(tools, call_format, call_format.forced_prefix if prefilled else "")
    generated = 0
    reason = CANCELLED  # unless the loop says otherwise
    speculation = None
    try:
        if dropped:
            yield Notice(
                f"dropped the {dropped} oldest turn{'s' if dropped > 1 else ''} to fit the "
                f"{model.kv_capacity()}-token context"
            )
        reused = model.state.reuse(conv.cache_id, ids).tokens
        logits = model.prefill(conv.cache_id, ids[reused:])
        model.state.remember(conv.cache_id, ids)  # a conversation started alike shares it from now on
        tokens, speculation = answer_tokens(
            model,
            sampler,
            conv.cache_id,
            logits,
            settings.max_tokens,
            matcher=matcher,
            speculate=settings.speculate,
            prompt=ids,
        )
        for token in tokens:
            timing.token()
            known.append(token)
            generated += 1
            if token in engine.eos_ids:
                reason = EOS
                break
            yield from calls.split(answer.add(token))
            if answer.stopped:
                reason = STOP_STRING
                break
            if cancel.is_set():
                break
        else:
            if matcher is not None and matcher.is_finished():  # the grammar allows nothing more
                reason = EOS
            else:
                reason = MAX_TOKENS if generated == settings.max_tokens else CONTEXT
        tokens.close()
        yield from calls.split(answer.finish())
        yield from calls.finish()
    finally:
        _commit(engine, conv, known, answer, calls)
    if calls.calls:
        yield ToolCallRequested(tuple(calls.calls))
        reason = TOOL_CALLS if reason == EOS else reason
    yield done_event(reason, len(ids) - reused, reused, generated, timing, answer.stop_string, speculation)


class CallSplitter:
    """An answer's text events split into text and tool calls as they stream (with no tools,
    passed through). `prefix`: the call opener the prompt already ended with."""

    def __init__(self, tools: ToolRequest | None, fmt: ToolFormat, prefix: str = ""):
        self.parser = StreamingToolParser(fmt, parallel=tools.parallel, prefix=prefix) if tools is not None else None
        self.text = ""  # the answer's text without call markup
        self.calls: list[ToolCall] = []

    def split(self, events: list[TextDelta | ReasoningDelta]) -> Iterator[TextDelta | ReasoningDelta]:
        for event in events:
            if isinstance(event, TextDelta) and self.parser is not None:
                yield from self._text_and_calls(self.parser.feed(event.text))
            else:
                self.text += event.text if isinstance(event, TextDelta) else ""
                yield event

    def finish(self) -> Iterator[TextDelta]:
        """What the parser held back; once (generation has ended)."""
        if self.parser is not None:
            parser, self.parser = self.parser, None
            yield from self._text_and_calls(parser.finish())

    def _text_and_calls(self, parsed: list[str | ToolCall]) -> Iterator[TextDelta]:
        for item in parsed:
            if isinstance(item, str):
                if item:
                    self.text += item
                    yield TextDelta(item)
            else:
                self.calls.append(item)


def _matcher(
    engine: "Engine",
    grammar,
    tools: ToolRequest | None,
    call_format: ToolFormat,
    prompt_text: str,
    prefilled: bool,
) -> GrammarMatcher | None:
    """A required call's grammar wins over a response format; with "auto" the format holds
    unless there is none (then the calls are constrained once opened)."""
    if tools is not None and (tools.forced or grammar is None):
        return engine.constraints.tool_matcher(tools, call_format, prompt_text, prefilled)
    return engine.constraints.matcher(grammar, prompt_text) if grammar is not None else None


def _fit_new_message(
    engine: "Engine", conv: Conversation, text: str | None, tools: ToolRequest | None = None
) -> tuple[list[int], str, list[dict]]:
    """Prompt ids and text with the new user message (none when `text` is None), and the
    messages they render (the oldest turns dropped when the policy says so); `conv` is left as
    it is. A required call's opener ends the prompt, unless the model reasons first."""
    rendered = {}
    listed = tools.template_tools() if tools is not None else None
    call_format = engine.template.tool_format

    def prompt_ids(messages: list[dict]) -> list[int]:
        prompt, token_ids = engine.render(conv.settings, messages, listed)
        if (
            tools is not None
            and tools.forced
            and call_format.forced_prefix
            and not engine.constraints.reasons_before_calling(call_format, prompt)
        ):
            prompt += call_format.forced_prefix
            token_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        rendered["text"] = prompt
        return token_ids

    wanted = conv.messages + ([{"role": "user", "content": text}] if text is not None else [])
    ids, kept = fit(
        wanted, prompt_ids, conv.settings.context_policy, engine.model.kv_capacity(), conv.settings.max_tokens
    )
    return ids, rendered["text"], kept


def _user_turns(messages: list[dict]) -> int:
    return sum(m.get("role") == "user" for m in messages)


def _trim_cache(engine: "Engine", conv: Conversation, ids: list[int]) -> None:
    """Cut the cache back to its longest prefix shared with `ids`; at least one id is left to prefill."""
    held = engine.model.state.length(conv.cache_id)
    reused = min(common_prefix(conv.ledger[:held], ids), len(ids) - 1)
    if held > reused:
        engine.model.truncate_kv(conv.cache_id, reused)
    conv.ledger = ids[:reused]


def _commit(engine: "Engine", conv: Conversation, known: list[int], answer: AnswerText, calls: CallSplitter) -> None:
    for _ in calls.split(answer.finish()):  # what an interrupted answer held back
        pass
    for _ in calls.finish():
        pass
    message: dict = {"role": "assistant", "content": calls.text}
    if calls.calls:
        message["tool_calls"] = [c.as_openai() for c in calls.calls]
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    conv.messages.append(message)
    held = engine.model.state.length(conv.cache_id)
    if held > len(known):  # a step queued ahead and never read
        engine.model.truncate_kv(conv.cache_id, len(known))
        held = len(known)
    conv.ledger = known[:held]
    engine.model.state.remember(conv.cache_id, conv.ledger)  # the answer too: the next turn starts with it


def done_event(
    reason: str, prompt: int, cached: int, generated: int, timing: Timing, stop: str | None, speculation=None
) -> Done:
    """`speculation`: the answer's `SpeculationStats` (None: it did not speculate)."""
    first = timing.first if timing.first is not None else time.perf_counter()
    ttft = first - timing.start
    decode_time = (timing.last or first) - first
    return Done(
        stop_reason=reason,
        prompt_tokens=prompt,
        cached_tokens=cached,
        generated_tokens=generated,
        ttft_s=ttft,
        prefill_tps=prompt / ttft if ttft > 0 else 0.0,
        decode_tps=(generated - 1) / decode_time if generated > 1 and decode_time > 0 else 0.0,
        stop_string=stop,
        speculation=speculation.as_dict() if speculation is not None else None,
    )
