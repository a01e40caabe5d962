"""How a call becomes a prompt for one model: the rendered prompt's ids and the answer's grammar state.

The rules of how an answer starts (a required call's opener, which grammar holds, open
reasoning) are the engine's (`engine.prompt`); this adds the server's side: a request's
template arguments, a prompt refused as soon as it cannot fit, and errors as 400s.
"""

from __future__ import annotations

from typing import NamedTuple

from ferrum_mac.engine import LocalEngine, ResponseFormat
from ferrum_mac.engine.prompt import AnswerGrammar, AnswerStart, another_call_tokens, with_call_opener
from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar import GrammarError, GrammarMatcher, UnsupportedSchemaError
from ferrum_mac.grammar.guard import SchemaTooComplex
from ferrum_mac.grammar.schema import call_grammar
from ferrum_mac.llm import room_advice
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.call import ChatCall, Limits

# A text longer than this many characters per token of context is first tested on its head:
# when the head alone overflows the context, the rest need not be tokenized.
CHARS_PER_TOKEN_CHECKED = 8


class Prompting:
    """How calls become prompts for one model: the rendered prompt's ids and the grammar state
    that enforces `response_format` or the tools' call shapes. All of it may take long
    (templates, tokenizing long prompts, compiling schemas): call it on a worker thread."""

    def __init__(self, engine: LocalEngine, capacity):
        self.engine = engine
        self._capacity = capacity  # a callable: the scheduler knows it once its model is loaded
        self.template_names = frozenset(getattr(engine.template, "special_tokens", {}))

    @property
    def capacity(self) -> int:
        return self._capacity()

    def limits(self) -> Limits:
        return Limits(self.engine.default_sampling, self.engine.model.config.vocab_size, self.template_names)

    def prepare(self, call: ChatCall) -> "Prepared":
        if call.messages is None:
            ids = self._completion_ids(call)
            return Prepared(ids, self.answer_matcher(call.options.response_format, None, None, AnswerStart()))
        tools = call.tools
        text, ids = self.chat_prompt(call.messages, call.options.template_kwargs, tools)
        fmt = self.engine.template.tool_format
        start = AnswerStart.of(text, tools, fmt)
        matcher = self.answer_matcher(call.options.response_format, tools, text, start)
        return Prepared(ids, matcher, start, another_call_tokens(tools, fmt, self._encode_text))

    def _encode_text(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def grammar_checks(call: ChatCall) -> list["GrammarCheck"]:
        """The grammars `prepare` will compile for `call` (each tool's call shape, the response
        format when it holds), to be checked first within bounds (`grammar.guard`)."""
        checks = []
        tools = call.tools
        for i, function in enumerate(tools.functions if tools is not None else ()):
            param = f"tools[{i}].function.parameters"
            try:
                text = call_grammar([function])
            except GrammarError as e:
                raise api.ApiError(400, str(e), param=param, code="invalid_schema") from None
            checks.append(GrammarCheck(text, f"the parameters of tool '{function['name']}'", param))
        fmt = call.options.response_format
        if fmt is not None and AnswerGrammar.keeps_format(fmt, tools):
            try:
                checks.append(GrammarCheck(fmt.grammar_text(), "the JSON schema", "response_format"))
            except GrammarError as e:
                raise format_error(e) from None
        return checks

    def count_tokens(self, call: ChatCall) -> int:
        if call.messages is None:
            return len(self._completion_ids(call))
        return len(self.chat_prompt(call.messages, call.options.template_kwargs, call.tools)[1])

    def _completion_ids(self, call: ChatCall) -> list[int]:
        prompt = call.prompt if call.prompt is not None else ""
        return list(prompt) if isinstance(prompt, list) else self.encode(prompt, True, "prompt")

    def chat_prompt(
        self, messages: list[dict], template_kwargs: dict, tools: api.ToolRequest | None = None
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its ids; an answer that must call a tool starts with its
        family's call opener, unless the model reasons first (then the opener is part of the
        call's grammar, see `tool_matcher`)."""
        template = self.engine.template
        try:
            text = template.render(
                messages,
                add_generation_prompt=True,
                tools=tools.template_tools() if tools else None,
                **template_kwargs,
            )
            text = with_call_opener(self.engine.constraints, template.tool_format, tools, text)
        except FerrumError as e:
            raise api.ApiError(400, str(e), param="messages") from None
        except Exception as e:  # templates index and compare what clients send: a dict where a string goes...
            raise api.ApiError(
                400,
                f"the chat template cannot render these messages ({type(e).__name__}: {str(e)[:200]})",
                param="messages",
            ) from None
        return text, self.encode(text, False, "messages")

    def answer_matcher(
        self, fmt: ResponseFormat | None, tools: api.ToolRequest | None, prompt_text: str | None, start: AnswerStart
    ) -> GrammarMatcher | None:
        """The answer's grammar state (`engine.prompt.AnswerGrammar`: compiling a schema, and the
        first time the model's grammar vocabulary, take a while); a schema it cannot compile is a
        400 naming `response_format` or `tools`. `prompt_text`: the chat prompt (None: a
        completion), so a thinking model's grammar starts after its reasoning."""
        try:
            grammar = AnswerGrammar(self.engine.constraints, self.engine.template.tool_format, fmt, tools)
        except GrammarError as e:
            raise format_error(e) from None
        try:
            return grammar.matcher(prompt_text, start)
        except GrammarError as e:
            if grammar.for_calls:
                raise api.ApiError(400, str(e), param="tools", code="invalid_schema") from None
            raise format_error(e) from None

    def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Token ids of `text`, or a 400 as soon as it is clear they cannot fit the context."""
        capacity = self.capacity
        head = text[: capacity * CHARS_PER_TOKEN_CHECKED]
        if len(head) < len(text):
            n = len(self.engine.tokenizer.encode(head, add_special_tokens=add_special_tokens))
            if n > capacity:
                raise api.ApiError(
                    400,
                    f"the prompt has over {n} tokens but the context holds {capacity} (prompt and answer); "
                    + room_advice(capacity, self.engine.model.config.max_seq_len),
                    param=param,
                    code="context_length_exceeded",
                )
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)


class GrammarCheck(NamedTuple):
    """A grammar a call needs: its text, what it is (for the error) and the field it came from."""

    text: str
    what: str
    param: str


class Prepared(NamedTuple):
    """A call made ready for the scheduler."""

    ids: list[int]
    matcher: GrammarMatcher | None
    start: AnswerStart = AnswerStart()  # what the answer starts inside (a <think>, a call's opener)
    call_tokens: int | None = None  # the fewest tokens one more required call takes (`another_call_tokens`)


def format_error(e: GrammarError, param: str = "response_format") -> api.ApiError:
    """A schema the model's grammar cannot take, as a 400 naming the field it came from."""
    if isinstance(e, SchemaTooComplex):
        code = "schema_too_complex"
    else:
        code = "unsupported_schema" if isinstance(e, UnsupportedSchemaError) else "invalid_schema"
    return api.ApiError(400, str(e), param=param, code=code)
