"""A looping answer is stopped (LOOP) and legitimate repetition is not: a real model's loop
(stories260K's greedy answer repeats one sentence), text that repeats for a reason (code, a
table, a list, a JSON array, a poem's refrain) in the bundled SmolLM2's tokens, and a loop
pasted with a word changed in each round."""

from __future__ import annotations

import json
import random

import pytest
from engine_helpers import answer, done

from ferrum_mac.engine import LOOP, MAX_TOKENS, AnswerState, AnswerText, Engine
from ferrum_mac.engine.loop_guard import WINDOW, LoopGuard
from ferrum_mac.text.tokenizer import KeepStart

PARAGRAPH = (
    "The Roman Empire was one of the largest empires in history. It was founded in 27 BC when "
    "Augustus became the first emperor. The empire grew to cover much of Europe, North Africa and "
    "the Middle East. "
)
CODE = "\n".join(
    f"    def __{name}__(self, other):\n        return Point(self.x {op} other.x, self.y {op} other.y)\n"
    for name, op in [("add", "+"), ("sub", "-"), ("mul", "*"), ("truediv", "/"), ("floordiv", "//"), ("mod", "%")]
    + [("pow", "**"), ("and", "&"), ("or", "|"), ("xor", "^"), ("lshift", "<<"), ("rshift", ">>")]
)
SETTINGS = "\n".join(
    f'    "{a}_{b}": os.environ.get("APP_{a.upper()}_{b.upper()}", None),'
    for a in ("smtp", "redis", "s3", "db")
    for b in ("host", "port", "user", "password", "timeout", "retries", "tls", "pool", "prefix", "ttl")
)
TABLE = "| Body | Moons | Rings |\n|---|---|---|\n" + "\n".join(
    f"| Moon {c}{d} | {d} | {'Yes' if d % 2 else 'No'} |" for c in "ABCDE" for d in range(8)
)
RECIPE = "\n".join(
    f"{i}. Add the {w} to the {bowl} and stir well."
    for i, (w, bowl) in enumerate(
        [
            (w, bowl)
            for bowl in ("bowl", "pan", "jug")
            for w in "flour sugar eggs milk butter salt vanilla cocoa nuts cinnamon honey yeast".split()
        ],
        1,
    )
)
USERS = json.dumps([{"id": i, "name": f"user{i}", "active": True, "role": "member"} for i in range(30)], indent=2)
CHORUS = (
    "Row, row, row your boat,\nGently down the stream.\nMerrily, merrily, merrily, merrily,\nLife is but a dream.\n"
)
SONG = "\n".join(
    f"Verse {i}: the {season} comes over the hills so {colour} and wide,\nwe walk along the river with {who} by our side.\n"
    + CHORUS
    for i, (season, colour, who) in enumerate(
        [("spring", "green", "friends"), ("summer", "gold", "family"), ("autumn", "red", "neighbours")]
        + [("winter", "white", "strangers"), ("morning", "bright", "children"), ("evening", "grey", "dogs")],
        1,
    )
)


def first_loop(token_ids: list[int]) -> int | None:
    """How many tokens an answer of `token_ids` runs before it is stopped as a loop."""
    guard = LoopGuard()
    return next((i + 1 for i, token in enumerate(token_ids) if guard.add(token)), None)


@pytest.mark.parametrize(
    "text", [CODE, SETTINGS, TABLE, RECIPE, USERS, SONG], ids=["code", "settings", "table", "list", "json", "song"]
)
def test_text_that_repeats_for_a_reason_is_no_loop(smollm2, text):
    token_ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    assert len(token_ids) > WINDOW  # long enough to be judged
    assert first_loop(token_ids) is None


def test_a_paragraph_repeated_is_a_loop_with_a_word_changed_or_not(smollm2):
    rounds = 15
    exact = smollm2.tokenizer.encode("Rome began as a small town. " + PARAGRAPH * rounds, add_special_tokens=False)
    assert first_loop(exact) < WINDOW + 60  # soon after a window of it
    words, rng = PARAGRAPH.split(), random.Random(1)
    changed = []
    for _ in range(rounds):  # a sampled loop: one word differs in each round
        edited = list(words)
        edited[rng.randrange(len(words))] = rng.choice(["large", "vast", "great", "wide"])
        changed.append(" ".join(edited))
    assert first_loop(smollm2.tokenizer.encode(" ".join(changed), add_special_tokens=False)) is not None


def test_a_real_models_loop_ends_the_answer(stories_path):
    """stories260K's greedy answer repeats "It is a small, red cat." from about its 40th token:
    the answer ends as a loop well before its limit; with the guard's threshold out of reach it
    runs to the limit."""
    engine = Engine.open(stories_path, backend="mlx")
    sampling = engine.default_sampling.replace(temperature=0.0, repetition_penalty=1.0)
    conv = engine.conversation(sampling=sampling, prepare=False, max_tokens=480)
    events = list(conv.send("The cat sat on the mat. The cat"))
    assert done(events).stop_reason == LOOP and done(events).generated_tokens < WINDOW + 40
    assert "It is a small, red cat. It is a small, red cat." in answer(events)
    conv.close()


def test_an_answer_that_must_run_its_length_is_never_stopped_as_a_loop():
    """`ignore_eos` (benchmarks: every token asked for) turns the guard off."""
    tokens = [1, 2, 3] * (2 * WINDOW)
    for ignore_eos, reason in ((False, LOOP), (True, MAX_TOKENS)):
        state = AnswerState(AnswerText(Letters(), (), False), {0}, max_tokens=len(tokens), ignore_eos=ignore_eos)
        for token in tokens:
            state.add(token)
            if state.reason is not None:
                break
        assert state.reason == reason


class Letters:
    """Token n is the letter a + n (enough of a tokenizer for the detokenizer)."""

    utf8_errors = "replace"

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([ord("a") + token_id])

    def text_start(self) -> KeepStart:
        return KeepStart()
