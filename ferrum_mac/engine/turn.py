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
model writes its family's opener. The server's scheduler keeps the same rules: they are written
once, in `engine.prompt` (how an answer starts) and `engine.answer` (token by token).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Iterator

from ferrum_mac.engine.answer import AnswerState, CallSplitter, Timing, with_calls
from ferrum_mac.engine.answer_text import AnswerText
from ferrum_mac.engine.context import common_prefix, fit
from ferrum_mac.engine.conversation import Conversation
from ferrum_mac.engine.decode_loop import answer_tokens
from ferrum_mac.engine.events import (
    CANCELLED,
    CONTEXT,
    Event,
    Notice,
    ReasoningDelta,
    TextDelta,
    ToolCallRequested,
)
from ferrum_mac.engine.prompt import AnswerGrammar, AnswerStart, another_call_tokens, with_call_opener
from ferrum_mac.engine.structured import ResponseFormat
from ferrum_mac.engine.tools import ToolRequest

if TYPE_CHECKING:
    from ferrum_mac.engine.engine import Engine


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
    call_format = engine.template.tool_format
    grammar = AnswerGrammar(engine.constraints, call_format, response_format or settings.response_format, tools)
    ids, prompt_text, messages = _fit_new_message(engine, conv, text, tools)
    start = AnswerStart.of(prompt_text, tools, call_format)
    sampler = model.sampler(settings.sampling, ids)
    matcher = grammar.matcher(prompt_text, start)
    dropped = _user_turns(conv.messages) + (text is not None) - _user_turns(messages)
    conv.messages = messages  # nothing changed before this line: errors above leave the conversation as it was
    _trim_cache(engine, conv, ids)
    reused = 0
    known = list(ids)  # every token the cache may hold, in order; the ledger is a prefix of it
    answer_text = AnswerText(engine.tokenizer, settings.stop, start.opens_reasoning)
    call_tokens = another_call_tokens(
        tools, call_format, lambda t: engine.tokenizer.encode(t, add_special_tokens=False)
    )
    answer = AnswerState(
        answer_text,
        engine.eos_ids,
        matcher=matcher,
        max_tokens=settings.max_tokens,
        timing=timing,
        call_tokens=call_tokens,
    )
    calls = CallSplitter(call_format if tools is not None else None, tools is None or tools.parallel, start.call_prefix)
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
            times=engine.step_times,
            prompt=ids,
        )
        for token in tokens:
            known.append(token)
            yield from _text_of(calls.split(answer.add(token, accepted=True)))  # the loop fed the grammar
            if answer.reason is not None:
                reason = answer.reason
                break
            if cancel.is_set():
                break
        else:  # the tokens ran out before a rule ended the answer: the cache is full
            reason = CONTEXT
        tokens.close()
        yield from _text_of(calls.split(answer.finish()))
        yield from _text_of(calls.finish(reason))
    finally:
        _commit(engine, conv, known, answer_text, calls)
    if calls.calls:
        yield ToolCallRequested(tuple(calls.calls))
    yield answer.done(with_calls(reason, bool(calls.calls)), len(ids) - reused, reused, speculation)


def _text_of(events: list) -> Iterator[TextDelta | ReasoningDelta]:
    """The text events of `events` (the calls stay in the `CallSplitter`)."""
    return (e for e in events if isinstance(e, (TextDelta, ReasoningDelta)))


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
        rendered["text"], token_ids = engine.render(conv.settings, messages, listed)
        prompt = with_call_opener(engine.constraints, call_format, tools, rendered["text"])
        if prompt != rendered["text"]:
            rendered["text"], token_ids = prompt, engine.tokenizer.encode(prompt, add_special_tokens=False)
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
    calls.split(answer.finish())  # what an interrupted answer held back
    calls.finish(CANCELLED)
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
