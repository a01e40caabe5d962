"""The rules of one answer, without a model: a scripted token source through `AnswerState` and
`CallSplitter`, and the prompt rules of `engine.prompt` on stand-in constraints. The chat
engine's turns and the server's scheduler both run on these."""

from __future__ import annotations

import pytest

from ferrum_mac.engine import (
    CONTEXT,
    EOS,
    MAX_TOKENS,
    STOP_STRING,
    TOOL_CALLS,
    AnswerState,
    AnswerText,
    CallSplitter,
    ReasoningDelta,
    TextDelta,
    Timing,
    done_event,
    with_calls,
)
from ferrum_mac.engine.prompt import AnswerGrammar, AnswerStart, with_call_opener
from ferrum_mac.engine.tools import ToolRequest
from ferrum_mac.text.tokenizer import KeepStart
from ferrum_mac.text.tool_calls import FORMATS, HERMES, ToolCall, ToolCallDelta

WORDS = ["<eos>", "Hello", " world", ".", " STOP", "<think>", "thought", "</think>", "<tool_call>", "\n", "}"]
EOS_ID = 0
TOOLS = ToolRequest(({"name": "get_time", "parameters": {"type": "object"}},))
FORCED = ToolRequest(TOOLS.functions, choice="required")


class WordTokenizer:
    """Each id is one word of WORDS (enough of a tokenizer for the detokenizer)."""

    utf8_errors = "replace"

    def token_bytes(self, token_id: int) -> bytes:
        return b"" if token_id == EOS_ID else WORDS[token_id].encode()

    def text_start(self) -> KeepStart:
        return KeepStart()


class FinishesAfter:
    """A grammar that allows nothing more after `n` tokens."""

    def __init__(self, n: int):
        self.left = n

    def accept(self, token: int) -> None:
        self.left -= 1

    def is_finished(self) -> bool:
        return self.left <= 0


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def run(tokens: list[int], stops=(), opens_reasoning=False, **rules) -> tuple[list, AnswerState]:
    """The events of `tokens` up to the one that ends the answer, as a decode loop hands them on."""
    answer = AnswerState(AnswerText(WordTokenizer(), stops, opens_reasoning), {EOS_ID}, **rules)
    events: list = []
    for token in tokens:
        events += answer.add(token)
        if answer.reason is not None:
            break
    return events + answer.finish(), answer


def text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_an_end_of_sequence_token_ends_the_answer_and_writes_nothing():
    events, answer = run(ids("Hello", " world", "<eos>", "."))
    assert text(events) == "Hello world" and answer.reason == EOS and answer.generated == 3


def test_ignore_eos_writes_on_unless_the_grammar_is_finished():
    _, answer = run(ids("Hello", "<eos>", "."), ignore_eos=True, max_tokens=3)
    assert answer.reason == MAX_TOKENS and answer.generated == 3
    _, answer = run(ids("Hello", "<eos>", "."), ignore_eos=True, matcher=FinishesAfter(2))
    assert answer.reason == EOS and answer.generated == 2


def test_stop_string_then_limit_in_that_order():
    events, answer = run(ids("Hello", " STOP", "."), stops=(" STOP",), max_tokens=2)
    assert answer.reason == STOP_STRING and text(events) == "Hello" and answer.text.stop_string == " STOP"
    _, answer = run(ids("Hello", " world", "."), max_tokens=2)
    assert answer.reason == MAX_TOKENS


def test_a_finished_grammar_ends_the_answer_before_a_stop_string():
    events, answer = run(ids("Hello", " STOP", "."), stops=(" STOP",), matcher=FinishesAfter(2))
    assert answer.reason == EOS


def test_a_grammar_fed_by_the_loop_is_not_fed_again():
    matcher = FinishesAfter(2)
    answer = AnswerState(AnswerText(WordTokenizer(), (), False), {EOS_ID}, matcher=matcher)
    answer.add(ids("Hello")[0], accepted=True)
    assert matcher.left == 2 and answer.reason is None


def test_no_rule_ends_an_answer_the_caller_must_end():
    _, answer = run(ids("Hello", " world"))
    assert answer.reason is None  # the caller ends it: a full context, a cancel
    done = answer.done(CONTEXT, prompt=5, cached=2)
    assert (done.stop_reason, done.prompt_tokens, done.cached_tokens, done.generated_tokens) == (CONTEXT, 5, 2, 2)


def test_reasoning_is_split_off_when_the_prompt_opens_it():
    events, _ = run(ids("thought", "</think>", "Hello"), opens_reasoning=True)
    assert [type(e) for e in events if e.text.strip()] == [ReasoningDelta, TextDelta]


def test_done_figures_from_the_timing():
    timing = Timing(start=0.0, first=0.5, last=2.5)
    done = done_event(EOS, 100, 0, 5, timing, None)
    assert done.ttft_s == 0.5 and done.prefill_tps == 200.0 and done.decode_tps == 2.0
    assert done_event(EOS, 10, 0, 1, Timing(start=0.0, first=0.5, last=0.5), None).decode_tps == 0.0


def test_an_answer_that_called_and_ended_by_itself_waits_for_results():
    assert with_calls(EOS, True) == TOOL_CALLS
    assert with_calls(MAX_TOKENS, True) == MAX_TOKENS and with_calls(EOS, False) == EOS


CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_calls_are_split_from_the_text_whole_or_in_pieces(stream):
    split = CallSplitter(FORMATS[HERMES], stream_arguments=stream)
    events = [e for ch in "Let me see. " + CALL for e in split.feed(ch)] + split.finish()
    assert text(events).strip() == "Let me see." and split.text.strip() == "Let me see."
    kind = ToolCallDelta if stream else ToolCall
    assert all(isinstance(e, (TextDelta, kind)) for e in events)
    assert [(c.name, c.arguments) for c in split.calls] == [("get_time", '{"zone": "UTC"}')]


def test_a_forced_opener_is_read_before_the_answer_and_no_tools_pass_text_through():
    split = CallSplitter(FORMATS[HERMES], prefix="<tool_call>\n")
    split.feed(CALL.removeprefix("<tool_call>\n"))
    split.finish()
    assert [c.name for c in split.calls] == ["get_time"] and split.text == ""
    plain = CallSplitter(None)
    events = plain.split([ReasoningDelta("hm"), TextDelta(CALL)])
    assert events == [ReasoningDelta("hm"), TextDelta(CALL)] and plain.text == CALL and not plain.calls


# -- how an answer starts from its prompt -------------------------------------------------------


class Constraints:
    """Stands in for `engine.structured.Constraints`: says which grammar was asked for."""

    def __init__(self, thinks: bool = False):
        self.thinks = thinks

    def reasons_before_calling(self, fmt, prompt: str) -> bool:
        return self.thinks and fmt.closer is not None

    def compile(self, fmt):
        return ("format", fmt)

    def matcher(self, grammar, prompt):
        return ("matcher", grammar, prompt)

    def tool_matcher(self, tools, fmt, prompt, prefilled):
        return ("calls", tools.choice, prefilled)


def test_a_required_call_ends_the_prompt_with_its_opener_unless_the_model_reasons_first():
    hermes = FORMATS[HERMES]
    assert with_call_opener(Constraints(), hermes, FORCED, "P") == "P<tool_call>\n"
    assert with_call_opener(Constraints(thinks=True), hermes, FORCED, "P") == "P"
    assert with_call_opener(Constraints(), hermes, TOOLS, "P") == "P"
    assert with_call_opener(Constraints(), hermes, None, "P") == "P"
    start = AnswerStart.of("P<think>\n<tool_call>\n", FORCED, hermes)
    assert start == AnswerStart(opens_reasoning=True, prefilled=True, call_prefix="<tool_call>\n")
    assert AnswerStart.of("P<tool_call>\n", TOOLS, hermes) == AnswerStart()


@pytest.mark.parametrize(
    "tools, fmt, want",
    [
        (None, None, None),
        (None, "json", "matcher"),
        (TOOLS, None, "calls"),  # "auto" with no format: the calls are constrained once opened
        (TOOLS, "json", "matcher"),  # "auto": the format holds
        (FORCED, "json", "calls"),  # a required call's grammar wins
    ],
)
def test_which_grammar_an_answer_keeps(tools, fmt, want):
    matcher = AnswerGrammar(Constraints(), FORMATS[HERMES], fmt, tools).matcher("P", AnswerStart())
    assert (matcher[0] if matcher else None) == want
