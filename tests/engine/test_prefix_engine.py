"""The prefix cache under the engine: a new conversation with the same system prompt, an edit
taken back, a branch and a released conversation reuse what was computed, and answer exactly
as a cold engine does (greedy, real weights)."""

from __future__ import annotations

import pytest

from engine_helpers import STORY, answer, assert_consistent, done, greedy
from ferrum_mac.engine import Engine
from ferrum_mac.engine.context import common_prefix

SYSTEM = "You tell short stories about a little dog called Max who lives in a big red house by the sea."
MAX_TOKENS = 12


@pytest.fixture
def engine(stories_path):
    """An engine of its own: its prefix cache holds only what the test puts there."""
    engine = Engine.open(stories_path)
    if engine.model.state.prefix_stats() is None:
        pytest.skip("this backend keeps no prefix cache")
    return engine


def cold_answer(stories_path, messages: list[dict], text: str, **settings) -> str:
    """The answer of an engine that has computed nothing before."""
    conv = greedy(Engine.open(stories_path), max_tokens=MAX_TOKENS, **settings)
    conv.messages = [dict(m) for m in messages]
    events = list(conv.send(text))
    assert done(events).cached_tokens == 0
    return answer(events)


def prompt_ids(engine, conv, messages: list[dict]) -> list[int]:
    return engine.render(conv.settings, messages)[1]


def test_a_new_conversation_with_the_same_system_prompt_reuses_it(engine, stories_path):
    first = greedy(engine, max_tokens=MAX_TOKENS, system=SYSTEM)
    list(first.send(STORY))
    first_prompt = prompt_ids(engine, first, [{"role": "user", "content": STORY}])
    first.close()  # its blocks stay cached
    second = greedy(engine, max_tokens=MAX_TOKENS, system=SYSTEM)
    question = "Where does Max sleep?"
    prompt = prompt_ids(engine, second, [{"role": "user", "content": question}])
    events = list(second.send(question))
    shared = common_prefix(first_prompt, prompt)
    assert shared > len(SYSTEM) // 8  # the system prompt, at least
    assert done(events).cached_tokens == shared
    assert done(events).prompt_tokens == len(prompt) - shared
    assert answer(events) == cold_answer(stories_path, [], question, system=SYSTEM)
    assert_consistent(engine, second)
    stats = engine.model.state.prefix_stats()
    assert stats.hits >= 1 and stats.reused_tokens >= shared


def test_an_edit_taken_back_reuses_the_first_version(engine):
    conv = greedy(engine, max_tokens=MAX_TOKENS)
    original = list(conv.send(STORY))
    prompt = prompt_ids(engine, conv, [{"role": "user", "content": STORY}])
    conv.messages = []  # edit the first message: the conversation's cache is cut where it changed
    list(conv.send("Tell me about a cat."))
    conv.messages = []  # and back: the prefix cache still holds the first version
    again = list(conv.send(STORY))
    assert done(again).cached_tokens == len(prompt) - 1  # all but the token whose logits start the answer
    assert answer(again) == answer(original)
    assert_consistent(engine, conv)


def test_regenerate_reuses_the_whole_prompt(engine):
    conv = greedy(engine, max_tokens=MAX_TOKENS)
    first = list(conv.send(STORY))
    conv.messages = []
    again = list(conv.send(STORY))
    assert done(again).cached_tokens == done(first).prompt_tokens - 1
    assert answer(again) == answer(first)


def test_a_branch_reuses_the_history_it_shares(engine, stories_path):
    trunk = greedy(engine, max_tokens=MAX_TOKENS)
    list(trunk.send(STORY))
    list(trunk.send("And then?"))
    history = [dict(m) for m in trunk.messages[:2]]  # the first turn, its answer included
    branch = greedy(engine, max_tokens=MAX_TOKENS)
    branch.messages = [dict(m) for m in history]
    events = list(branch.send("What happened next?"))
    held = prompt_ids(engine, branch, history[:1])  # the first turn's prompt, answered in the cache
    assert done(events).cached_tokens > len(held)  # the prompt and part of its answer
    assert answer(events) == cold_answer(stories_path, history, "What happened next?")
    assert_consistent(engine, branch)
