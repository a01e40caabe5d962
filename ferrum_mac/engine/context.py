"""Fitting a conversation into the KV cache: what can be reused, and what to drop when it is full."""

from __future__ import annotations

from typing import Callable, Sequence

from ferrum_mac.engine.conversation import TRUNCATE_OLDEST
from ferrum_mac.errors import FerrumError


class ContextLimitError(FerrumError):
    """A turn does not fit in the context and the conversation's policy is `error`."""

    def __init__(self, message: str, *, needed: int, capacity: int):
        super().__init__(message)
        self.needed = needed
        self.capacity = capacity


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def answer_room(capacity: int, max_tokens: int | None) -> int:
    """Tokens truncate-oldest keeps free for the answer: max_tokens, at most a quarter of the context."""
    quarter = max(1, capacity // 4)
    return min(max_tokens, quarter) if max_tokens else quarter


def fit(
    messages: list[dict],
    prompt_ids: Callable[[list[dict]], list[int]],
    policy: str,
    capacity: int,
    max_tokens: int | None,
) -> tuple[list[int], list[dict]]:
    """The prompt ids for `messages` and the messages they render (fewer when old turns were dropped).

    Policy `error`: the prompt must leave room for at least one answer token. Policy
    `truncate-oldest`: drop whole turns, oldest first, until the prompt leaves `answer_room`
    free; the system prompt (not in `messages`) and the newest user message always stay.
    """
    ids = prompt_ids(messages)
    if policy == TRUNCATE_OLDEST:
        room = answer_room(capacity, max_tokens)
        messages = list(messages)
        while len(ids) + room > capacity and drop_oldest_turn(messages):
            ids = prompt_ids(messages)
    if len(ids) + 1 > capacity:
        what = "the newest message alone" if policy == TRUNCATE_OLDEST else "this turn"
        advice = (
            "shorten the message or the system prompt"
            if policy == TRUNCATE_OLDEST
            else "clear the conversation, shorten the message or use the truncate-oldest context policy"
        )
        raise ContextLimitError(
            f"{what} needs {len(ids)} prompt tokens plus room to answer, but the context holds {capacity}; {advice}",
            needed=len(ids) + 1,
            capacity=capacity,
        )
    return ids, messages


def drop_oldest_turn(messages: list[dict]) -> bool:
    """Remove the first turn (its user message and everything up to the next user message),
    unless it is the last one. Returns whether anything was removed."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if len(users) < 2:
        return False
    del messages[: users[1]]
    return True
