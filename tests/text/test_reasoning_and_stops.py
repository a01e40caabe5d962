"""Reasoning splitter and stop matcher: fed in any pieces, they give what they give for the
whole text; cut at every position (and char by char) to prove it."""

from __future__ import annotations

import random

import pytest

from ferrum_mac.text import ANSWER, REASONING, ReasoningSplitter, StopMatcher, prompt_opens_reasoning


def split_all(text: str, cuts: list[int], in_reasoning: bool = False) -> tuple[str, str, list[str]]:
    """(reasoning, answer, kinds in order) after feeding `text` cut at `cuts`."""
    splitter = ReasoningSplitter(in_reasoning=in_reasoning)
    bounds = [0, *cuts, len(text)]
    deltas = []
    for a, b in zip(bounds, bounds[1:]):
        deltas += splitter.feed(text[a:b])
    deltas += splitter.finish()
    kinds = []
    for d in deltas:
        assert d.text  # never an empty delta
        if not kinds or kinds[-1] != d.kind:
            kinds.append(d.kind)
    reasoning = "".join(d.text for d in deltas if d.kind == REASONING)
    answer = "".join(d.text for d in deltas if d.kind == ANSWER)
    return reasoning, answer, kinds


REASONING_CASES = [
    # (text, starts inside reasoning, expected reasoning, expected answer)
    ("<think>\nLet me think.\n</think>\n\nParis.", False, "Let me think.", "Paris."),
    ("Let me think.\n</think>\n\nParis.", True, "Let me think.", "Paris."),  # template opened <think>
    ("\n\n</think>\n\nParis.", True, "", "Paris."),  # thinking switched off: an empty block
    (
        "Just an answer with a < and <b>bold</b> and </thin",
        False,
        "",
        "Just an answer with a < and <b>bold</b> and </thin",
    ),
    ("<think>never closed  \n", False, "never closed", ""),
    ("<thi", False, "", "<thi"),  # a tag that never completed is text
    ("<think>a < b </thinking> c</think>ok", False, "a < b </thinking> c", "ok"),
    ("<think></think>", False, "", ""),
    ("  <think> x </think> y <think> z </think> w ", False, "xz", "yw"),
    ("<think>\n\n  spaced  \n\n out \n</think>\n\n  answer \n\n more\n", False, "spaced  \n\n out", "answer \n\n more"),
    # a reply that is only whitespace is still the reply, not nothing
    ("\n", False, "", "\n"),
    (" \n\t ", False, "", " \n\t "),
    # ...but the whitespace around a tag is layout, whichever side of it
    ("\n\n</think>\n\n", True, "", ""),
    ("<think>\n</think>\n", False, "", ""),
    ("<think>x</think>\n\n", False, "x", ""),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "answer"), REASONING_CASES)
def test_reasoning_split_is_the_same_at_every_cut(text, inside, reasoning, answer):
    whole = split_all(text, [], inside)
    assert whole[:2] == (reasoning, answer)
    for cut in range(1, len(text)):
        assert split_all(text, [cut], inside) == whole, cut
    assert split_all(text, list(range(1, len(text))), inside) == whole  # one character at a time


def test_reasoning_split_random_cuts():
    rng = random.Random(7)
    alphabet = ["<think>", "</think>", "<", "/", "t", "h", "i", "n", "k", ">", " ", "\n", "a", "é", "🙂"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        inside = rng.random() < 0.3
        whole = split_all(text, [], inside)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 6)))) if len(text) > 1 else []
        assert split_all(text, cuts, inside) == whole, (text, cuts)


def test_reasoning_comes_out_before_the_answer_while_streaming():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == []  # could still be the tag
    out = splitter.feed("nk>Hmm")
    assert [(d.kind, d.text) for d in out] == [(REASONING, "Hmm")]
    assert splitter.feed("</th") == []
    out = splitter.feed("ink>\n\nHi")
    assert [(d.kind, d.text) for d in out] == [(ANSWER, "Hi")]
    assert not splitter.in_reasoning


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    # an old turn's closed block does not count, a new open one does
    assert prompt_opens_reasoning("<think>a</think>b<|im_start|>assistant\n<think>\n")


def test_qwen3_thinking_prompts(qwen3_dir):
    from ferrum_mac.text import load_chat_template, load_tokenizer

    template = load_chat_template(qwen3_dir, load_tokenizer(qwen3_dir))
    messages = [{"role": "user", "content": "Hi"}]
    assert not prompt_opens_reasoning(template.render(messages, enable_thinking=False))
    # Qwen3 with thinking on leaves the <think> to the model
    assert not prompt_opens_reasoning(template.render(messages, enable_thinking=True))


def stop_all(text: str, stops: list[str], cuts: list[int]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    bounds = [0, *cuts, len(text)]
    out = ""
    for a, b in zip(bounds, bounds[1:]):
        out += matcher.feed(text[a:b])
        if matcher.stopped:
            break
    out += matcher.finish()
    return out, matcher.stopped


def expected_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest occurrence of any stop string."""
    positions = [i for s in stops if s and (i := text.find(s)) >= 0]
    return (text[: min(positions)], True) if positions else (text, False)


STOP_CASES = [
    ("Hello\nUser: next", ["\nUser:"]),
    ("abcabd", ["abd"]),
    ("aaab", ["aab"]),
    ("xabcd", ["abcd", "bc"]),  # the longer stop starts earlier and wins
    ("xabce", ["abcd", "bc"]),  # ...until it fails, then the shorter one stops it
    ("no stop here", ["STOP", "END"]),
    ("ends with a partial ST", ["STOP"]),
    ("🙂 emoji 🙂 stop", ["🙂 stop"]),
    ("", ["x"]),
    ("anything", []),
]


@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
def test_stop_matcher_is_the_same_at_every_cut(text, stops):
    expected = expected_stop(text, stops)
    assert stop_all(text, stops, []) == expected
    for cut in range(1, len(text)):
        assert stop_all(text, stops, [cut]) == expected, cut
    assert stop_all(text, stops, list(range(1, len(text)))) == expected


def test_stop_matcher_random_cuts():
    rng = random.Random(11)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 16)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 5)))) if len(text) > 1 else []
        assert stop_all(text, stops, cuts) == expected_stop(text, stops), (text, stops, cuts)


def test_stop_matcher_holds_back_only_a_possible_start():
    matcher = StopMatcher(["</answer>"])
    assert matcher.feed("The answer is 4 <") == "The answer is 4 "
    assert matcher.feed("b>") == "<b>"  # not the stop after all
    assert matcher.feed("done</ans") == "done"
    assert matcher.feed("wer> ignored") == ""
    assert matcher.stopped and matcher.matched == "</answer>"
    assert matcher.feed("more") == "" and matcher.finish() == ""


# (what the model writes, what a raw completion returns, what a chat answer shows)
ANSWER_TEXTS = [
    ("\n    a +=", "\n    a +=", "a +="),
    (" Paris.", " Paris.", "Paris."),
    ("\n", "\n", "\n"),
    (" <think> x </think>\n y ", " <think> x </think>\n y ", "y"),
]


@pytest.mark.parametrize(("written", "raw", "chat"), ANSWER_TEXTS)
def test_raw_answer_text_keeps_every_character(qwen3_dir, written, raw, chat):
    """A completion continues its prompt: the newline and indent after `def add(a, b):`, the
    space before ` Paris` and `<think>` tags are the model's text. A chat answer is trimmed for
    display, but never to nothing."""
    from ferrum_mac.engine import TextDelta
    from ferrum_mac.engine.answer_text import AnswerText
    from ferrum_mac.text import load_tokenizer

    tokenizer = load_tokenizer(qwen3_dir)
    ids = tokenizer.encode(written, add_special_tokens=False)
    for is_raw, expected in ((True, raw), (False, chat)):
        text = AnswerText(tokenizer, (), opens_reasoning=False, raw=is_raw)
        events = [e for i in ids for e in text.add(i)] + text.finish()
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text.answer == expected
