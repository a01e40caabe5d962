"""Conversations: KV reuse across turns, truncation, context policies, cancel, stop strings, threads."""

from __future__ import annotations

import threading

import pytest

from engine_helpers import STORY, answer, assert_consistent, done, greedy, notices, reasoning
from ferrum_mac.engine import (
    CANCELLED,
    CONTEXT,
    EOS,
    MAX_TOKENS,
    STOP_STRING,
    TRUNCATE_OLDEST,
    ContextLimitError,
    TextDelta,
)
from ferrum_mac.errors import FerrumError
from ferrum_mac.text import ChatTemplate

# -- reuse ------------------------------------------------------------------------------


def test_second_turn_prefills_only_the_new_tokens(stories):
    conv = greedy(stories, max_tokens=12)
    first = done(list(conv.send(STORY)))
    held = len(conv.ledger)
    # (the session's engine may have answered this prompt before: its prefix cache holds it)
    assert held == first.cached_tokens + first.prompt_tokens + first.generated_tokens - 1
    _, prompt2 = stories.render(conv.settings, conv.messages + [{"role": "user", "content": "And then?"}])
    second = done(list(conv.send("And then?")))
    assert second.cached_tokens >= held  # the whole cache was reused (and the prefix cache's, if it holds more)...
    assert second.prompt_tokens == len(prompt2) - second.cached_tokens  # ...and only the rest prefilled
    assert conv.ledger[: len(prompt2)] == prompt2
    assert_consistent(stories, conv)


def test_smollm2_chat_turns_reuse_the_cache(smollm2):
    conv = greedy(smollm2, max_tokens=6, system="Be brief.")
    list(conv.send("Hi!"))
    held = len(conv.ledger)
    second = done(list(conv.send("Name a colour.")))
    _, prompt2 = smollm2.render(conv.settings, conv.messages[:-1])
    # ChatML: the cache holds the answer; the new render adds <|im_end|> (unless cached) and the new turn
    assert second.cached_tokens >= held - 1
    assert second.cached_tokens + second.prompt_tokens == len(prompt2)
    assert_consistent(smollm2, conv)


def test_changing_the_system_prompt_truncates_to_the_first_difference(stories):
    conv = greedy(stories, max_tokens=6, system="You tell stories.")
    list(conv.send(STORY))
    conv.settings = conv.settings.replace(system="You tell long stories.")
    _, old = stories.render(conv.settings.replace(system="You tell stories."), [])
    _, new = stories.render(conv.settings, [])
    shared = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
    assert done(list(conv.send("More."))).cached_tokens == shared
    assert_consistent(stories, conv)


# A ChatML-like template that opens <think> for the answer and, like Qwen3's, leaves the
# reasoning of earlier answers out of the prompt.
DROPS_REASONING = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think>\n{% endif %}"
)


def test_template_that_drops_old_reasoning_truncates_the_cache(stories):
    from ferrum_mac.engine import Engine

    engine = Engine(stories.model, stories.tokenizer, ChatTemplate(DROPS_REASONING, name="drops"))
    conv = greedy(engine, max_tokens=10)
    events = list(conv.send("Once upon a time"))
    assert reasoning(events) and not answer(events)  # everything after <think> is reasoning
    assert conv.messages[-1]["reasoning_content"] == reasoning(events)
    ledger_before = list(conv.ledger)
    _, prompt2 = engine.render(conv.settings, conv.messages + [{"role": "user", "content": "More."}])
    first_difference = next(i for i, (a, b) in enumerate(zip(ledger_before, prompt2)) if a != b)
    assert first_difference < len(ledger_before)  # the render dropped what the cache holds
    second = done(list(conv.send("More.")))
    assert second.cached_tokens == first_difference
    assert second.prompt_tokens == len(prompt2) - first_difference
    assert_consistent(engine, conv)


# -- the context ------------------------------------------------------------------------

LONG = "The little dog ran to the park and played with a big red ball all day long. " * 3


def test_context_error_policy_refuses_and_changes_nothing(small_context):
    engine = small_context(64)
    conv = greedy(engine, max_tokens=4)
    list(conv.send("Hi."))
    messages, ledger = [dict(m) for m in conv.messages], list(conv.ledger)
    with pytest.raises(ContextLimitError, match=r"needs \d+ prompt tokens .* context holds 64") as caught:
        list(conv.send(LONG))
    assert caught.value.capacity == 64 and caught.value.needed > 64
    assert "\n" not in str(caught.value)
    assert conv.messages == messages and conv.ledger == ledger
    assert done(list(conv.send("Bye."))).cached_tokens > 0  # still usable
    assert_consistent(engine, conv)


def test_truncate_oldest_drops_old_turns_and_reports_it(small_context):
    engine = small_context(96)
    conv = greedy(engine, max_tokens=8, context_policy=TRUNCATE_OLDEST)
    said = []
    for turn in range(8):
        events = list(conv.send(f"Turn {turn}: the cat sat on the mat."))
        said += notices(events)
        assert done(events).stop_reason in (MAX_TOKENS, EOS)
        assert_consistent(engine, conv)
        assert len(conv.ledger) <= 96
    assert said and all(n.startswith("dropped the 1 oldest turn to fit the 96-token context") for n in said)
    assert conv.messages[0]["role"] == "user" and conv.messages[0]["content"] != "Turn 0: the cat sat on the mat."
    assert conv.messages[-2]["content"] == "Turn 7: the cat sat on the mat."


def test_a_turn_refused_before_it_starts_leaves_the_conversation_as_it_was(stories):
    conv = greedy(stories, max_tokens=4)
    list(conv.send(STORY))
    messages, ledger = [dict(m) for m in conv.messages], list(conv.ledger)
    conv.settings = conv.settings.replace(sampling=conv.settings.sampling.replace(logit_bias={10**6: 1.0}))
    with pytest.raises(FerrumError, match="outside the vocabulary"):
        list(conv.send("More."))
    assert conv.messages == messages and conv.ledger == ledger
    assert_consistent(stories, conv)


def test_truncate_oldest_still_refuses_a_message_that_cannot_fit(small_context):
    engine = small_context(48)
    conv = greedy(engine, max_tokens=4, context_policy=TRUNCATE_OLDEST)
    with pytest.raises(ContextLimitError, match="newest message alone"):
        list(conv.send(LONG))


def test_answer_stops_when_the_cache_is_full(small_context):
    engine = small_context(40)
    conv = greedy(engine)  # no max_tokens: until the context ends
    stats = done(list(conv.send(STORY)))
    assert stats.stop_reason == CONTEXT
    assert engine.model.state.length(conv.cache_id) == 40 == len(conv.ledger)


# -- ending an answer early -------------------------------------------------------------


def _cancel_after(conv, deltas: int, text: str = STORY):
    cancel, events = threading.Event(), []
    for event in conv.send(text, cancel):
        events.append(event)
        if sum(isinstance(e, TextDelta) for e in events) == deltas:
            cancel.set()
    return events


def _next_turn_matches_a_fresh_conversation(engine, conv):
    fresh = engine.conversation(conv.settings, prepare=False)
    fresh.messages = [dict(m) for m in conv.messages]
    want = answer(fresh.send("More."))
    assert answer(conv.send("More.")) == want
    assert_consistent(engine, conv)


def test_cancel_keeps_the_partial_answer_and_a_matching_cache(stories):
    conv = greedy(stories, max_tokens=40)
    events = _cancel_after(conv, 5)
    stats = done(events)
    assert stats.stop_reason == CANCELLED and 5 <= stats.generated_tokens < 10  # a token may add no text
    assert conv.messages[-1] == {"role": "assistant", "content": answer(events)}
    assert_consistent(stories, conv)  # the step queued ahead was taken back out of the cache
    _next_turn_matches_a_fresh_conversation(stories, conv)


def test_ctrl_c_mid_answer_keeps_the_conversation_consistent(stories):
    conv = greedy(stories, max_tokens=40)
    stream = conv.send(STORY)
    shown = [next(stream) for _ in range(6)]
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt)
    assert conv.messages[-1]["role"] == "assistant"
    assert conv.messages[-1]["content"].startswith(answer(shown).strip())
    assert_consistent(stories, conv)
    _next_turn_matches_a_fresh_conversation(stories, conv)


def test_dropping_the_stream_keeps_the_conversation_consistent(stories):
    conv = greedy(stories, max_tokens=40)
    stream = conv.send(STORY)
    for _ in range(4):
        next(stream)
    stream.close()
    assert conv.messages[-1]["role"] == "assistant"
    assert_consistent(stories, conv)
    _next_turn_matches_a_fresh_conversation(stories, conv)


def test_stop_string_ends_the_answer_before_it(stories):
    full = answer(greedy(stories, max_tokens=24).send(STORY))
    assert "scared" in full  # stories260K's greedy answer: 'Anna, I'm scared. ...'
    conv = greedy(stories, max_tokens=24, stop=("scared",))
    events = list(conv.send(STORY))
    assert answer(events) == full[: full.index("scared")].strip()
    assert (done(events).stop_reason, done(events).stop_string) == (STOP_STRING, "scared")
    assert conv.messages[-1]["content"] == answer(events)
    list(conv.send("More."))  # the cache held text past the stop: the next turn trims it
    assert_consistent(stories, conv)


# -- threads and lifetime ----------------------------------------------------------------


def test_turns_from_worker_threads_run_one_at_a_time(stories):
    want = answer(greedy(stories, max_tokens=16).send(STORY))
    results, errors = [], []

    def worker():
        try:
            results.append(answer(greedy(stories, max_tokens=16).send(STORY)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [want] * 3


def test_engine_cancel_from_another_thread(stories):
    conv = greedy(stories, max_tokens=200)
    first_delta = threading.Event()
    events = []

    def worker():
        for event in conv.send(STORY):
            events.append(event)
            first_delta.set()

    thread = threading.Thread(target=worker)
    thread.start()
    assert first_delta.wait(30)
    stories.cancel()
    thread.join(30)
    assert done(events).stop_reason in (CANCELLED, EOS, MAX_TOKENS)
    assert_consistent(stories, conv)


def test_close_releases_the_cache(stories):
    conv = greedy(stories, max_tokens=4)
    list(conv.send(STORY))
    assert stories.model.state.length(conv.cache_id) > 0
    conv.close()
    conv.close()  # idempotent
    assert stories.model.state.length(conv.cache_id) == 0 and conv.ledger == []
    with pytest.raises(FerrumError, match="closed"):
        list(conv.send("Hi."))


def test_think_setting_reaches_the_template(stories):
    from ferrum_mac.engine import Engine

    template = ChatTemplate("{{ 'thinking' if enable_thinking is defined and enable_thinking else 'plain' }}")
    engine = Engine(stories.model, stories.tokenizer, template)
    assert engine.render(engine.settings(think=True), [])[0] == "thinking"
    assert engine.render(engine.settings(think=False), [])[0] == "plain"
    assert engine.render(engine.settings(), [])[0] == "plain"
