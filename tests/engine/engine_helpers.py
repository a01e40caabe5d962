"""Small helpers the engine tests share."""

from __future__ import annotations

from ferrum_mac.engine import Done, Notice, ReasoningDelta, TextDelta

STORY = "Tell me a story."


def answer(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def reasoning(events) -> str:
    return "".join(e.text for e in events if isinstance(e, ReasoningDelta))


def notices(events) -> list[str]:
    return [e.text for e in events if isinstance(e, Notice)]


def done(events) -> Done:
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]


def greedy(engine, **changes):
    """A conversation that decodes greedily, a plain argmax (no warm-up: tests open many)."""
    sampling = engine.default_sampling.replace(temperature=0.0, repetition_penalty=1.0)
    return engine.conversation(sampling=sampling, prepare=False, **changes)


def assert_consistent(engine, conv) -> None:
    """The ledger is exactly what the cache holds, and it starts with a fresh render of the history."""
    assert engine.model.state.length(conv.cache_id) == len(conv.ledger)
    history = conv.messages[:-1]  # up to the last user message; its answer follows the render
    if history:
        _, fresh = engine.render(conv.settings, history)
        assert conv.ledger[: len(fresh)] == fresh
