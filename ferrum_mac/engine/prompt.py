"""How an answer starts from its rendered prompt: a required call's opener, the grammar it keeps, open reasoning.

The chat engine (`turn.run_turn`) and the server (`serve.prompting.Prompting`) render prompts their
own ways (a conversation's settings, a request's template arguments); what they do with the
rendered text is decided here once:

- a required tool call starts with its family's opener at the end of the prompt, unless the
  model reasons first (then the opener is part of the call's grammar) (`with_call_opener`);
- a required call's grammar wins over a response format; with "auto" the format holds unless
  there is none, and then the calls are constrained once opened (`AnswerGrammar`);
- what the answer starts inside: an open `<think>`, a call opener the prompt ended with
  (`AnswerStart`);
- how many tokens one more call of a required answer takes at the least
  (`another_call_tokens`), so `AnswerState` ends the answer after its whole calls rather than
  let `max_tokens` cut the next one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ferrum_mac.engine.tools import shortest_arguments
from ferrum_mac.grammar import Grammar, GrammarMatcher
from ferrum_mac.text import prompt_opens_reasoning
from ferrum_mac.text.tool_calls import ToolFormat

if TYPE_CHECKING:
    from ferrum_mac.engine.structured import Constraints, ResponseFormat
    from ferrum_mac.engine.tools import ToolRequest


def with_call_opener(constraints: "Constraints", fmt: ToolFormat, tools: "ToolRequest | None", prompt: str) -> str:
    """`prompt`, ended with the call opener when a call is required and the model does not
    reason first (a thinking prompt whose call markers the grammar writes as text)."""
    if tools is None or not tools.forced or not fmt.forced_prefix:
        return prompt
    if constraints.reasons_before_calling(fmt, prompt):
        return prompt
    return prompt + fmt.forced_prefix


@dataclass(frozen=True)
class AnswerStart:
    """What an answer to a rendered prompt starts inside: an open `<think>` (`opens_reasoning`),
    and the call opener the prompt already ends with (`prefilled`; `call_prefix` is its text)."""

    opens_reasoning: bool = False
    prefilled: bool = False
    call_prefix: str = ""

    @classmethod
    def of(cls, prompt: str, tools: "ToolRequest | None", fmt: ToolFormat) -> "AnswerStart":
        prefilled = tools is not None and bool(tools.forced) and prompt.endswith(fmt.forced_prefix)
        return cls(prompt_opens_reasoning(prompt), prefilled, fmt.forced_prefix if prefilled else "")


class AnswerGrammar:
    """The grammar an answer keeps: a required call's wins over `response_format`; with "auto"
    the format holds unless there is none (then the calls are constrained once opened).
    Made before the prompt is rendered (a format's schema is compiled here, and a schema the
    model cannot take raises `GrammarError` at once); `matcher` then gives one answer's state."""

    def __init__(
        self,
        constraints: "Constraints",
        call_format: ToolFormat,
        response_format: "ResponseFormat | None",
        tools: "ToolRequest | None",
    ):
        self.constraints = constraints
        self.call_format = call_format
        self.tools = tools
        self.for_calls = tools is not None and (bool(tools.forced) or response_format is None)
        self.grammar: Grammar | None = None
        if response_format is not None and self.keeps_format(response_format, tools):
            self.grammar = constraints.compile(response_format)

    @staticmethod
    def keeps_format(response_format: "ResponseFormat", tools: "ToolRequest | None") -> bool:
        """Whether `response_format` holds beside `tools` (a required call's grammar wins)."""
        return tools is None or not tools.forced

    def matcher(self, prompt: str | None, start: AnswerStart) -> GrammarMatcher | None:
        """One answer's grammar state; `prompt`: the rendered chat prompt (None: a completion,
        whose grammar starts at once), so a thinking model's grammar starts after its reasoning."""
        if self.for_calls:
            assert self.tools is not None
            return self.constraints.tool_matcher(self.tools, self.call_format, prompt or "", start.prefilled)
        if self.grammar is None:
            return None
        return self.constraints.matcher(self.grammar, prompt)


def another_call_tokens(tools: "ToolRequest | None", fmt: ToolFormat, encode: Callable[[str], list[int]]) -> int | None:
    """The fewest tokens one more call of an answer that must call and may call several takes,
    from where its calls could end (their tail written) to the end of the next one: the
    shortest call any of its functions allows (required arguments only, the shortest values).
    None for any other answer (one that may answer in text, or makes one call)."""
    if tools is None or tools.choice != "required" or not tools.parallel:
        return None
    _, between, tail = fmt.calls_markup(True, True)
    between = between or ""
    more = between[len(tail) :] if between.startswith(tail) else between
    return min(
        len(encode(more + json.dumps({"name": f["name"], "arguments": shortest_arguments(f)}) + tail))
        for f in tools.forced
    )
