"""Structured output: an answer that must be a JSON object, or JSON valid against a schema.

A `ResponseFormat` names what the answer must be; `Constraints` turns it into a
`GrammarMatcher` per answer for one model (its vocabulary built once, on first use). The
matcher is applied by the decode loop (`decode_loop.constrained_tokens`) and by the server's
scheduler: each step the matcher fills the row's allowed-token bitmask, the sampler masks the
logits with it on the device, and the sampled id is `accept`ed before the next mask is asked for.

Thinking models: when the prompt leaves room for a `<think>` section (the vocabulary has a
`</think>` token and the prompt does not already close one), the grammar starts after the
model's `</think>`, so the reasoning is free and only the answer is constrained.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ferrum_mac.grammar import (
    Grammar,
    GrammarError,
    GrammarMatcher,
    GrammarVocab,
    compile_grammar,
    json_object_grammar,
)
from ferrum_mac.grammar.schema import check_grammar, schema_grammar, tool_calls_grammar
from ferrum_mac.text import Tokenizer
from ferrum_mac.text.tool_calls import ToolFormat

if TYPE_CHECKING:
    from ferrum_mac.engine.tools import ToolRequest

THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ResponseFormat:
    """The answer must be JSON: any object when `schema` is None, else valid against `schema`
    (`strict`: its objects take only the members they name, as in OpenAI's strict mode)."""

    schema: Any = None  # a JSON schema (a dict, or its JSON text)
    strict: bool = False

    @classmethod
    def parse(cls, value: "ResponseFormat | str | dict | None") -> "ResponseFormat | None":
        """None or "text": free text; "json": any JSON object; a dict: that JSON schema."""
        if value is None or isinstance(value, ResponseFormat):
            return value
        if value == "text":
            return None
        if value in ("json", "json_object"):
            return cls()
        if isinstance(value, dict):
            return cls(value)
        raise GrammarError(f"unknown response format {str(value)[:80]!r}; use 'text', 'json' or a JSON schema")

    def grammar_text(self) -> str:
        """The grammar, not yet checked (compiling it says what is wrong); a schema that is not
        JSON, or whose `$ref` points nowhere, raises `GrammarError` at once."""
        return json_object_grammar() if self.schema is None else schema_grammar(self.schema, strict=self.strict)

    def as_openai(self) -> dict:
        """The OpenAI API's `response_format` for this (what a remote engine sends)."""
        if self.schema is None:
            return {"type": "json_object"}
        schema = json.loads(self.schema) if isinstance(self.schema, (str, bytes)) else self.schema
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": self.strict}}

    @classmethod
    def from_file(cls, path: str | Path) -> "ResponseFormat":
        """The JSON schema in the file at `path`; a missing or broken file is a one-line `GrammarError`."""
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GrammarError(f"cannot read the schema file {path}: {getattr(e, 'strerror', None) or e}") from None
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise GrammarError(f"the schema file {path} is not valid JSON ({e}); fix it or give another") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"the schema file {path} must hold a JSON object (a JSON schema)")
        fmt = cls(schema)
        check_grammar(
            fmt.grammar_text(), "the JSON schema"
        )  # an unsupported keyword is an error now, not at the first answer
        return fmt

    def describe(self) -> str:
        """One line for people (`/show`): "json" or "json schema {...}"."""
        if self.schema is None:
            return "json"
        text = self.schema if isinstance(self.schema, str) else json.dumps(self.schema)
        return f"json schema {text[:60]}{'...' if len(text) > 60 else ''}"


class Constraints:
    """One model's grammar vocabulary and the matchers made from it."""

    def __init__(self, tokenizer: Tokenizer, width: int, eos_ids: Iterable[int]):
        self.tokenizer, self.width, self.eos_ids = tokenizer, width, sorted(eos_ids)
        self._vocab: GrammarVocab | None = None
        self._lock = threading.Lock()  # the server compiles on worker threads

    @property
    def vocab(self) -> GrammarVocab:
        with self._lock:
            if self._vocab is None:
                self._vocab = GrammarVocab(self.tokenizer, self.width, self.eos_ids)
            return self._vocab

    def compile(self, fmt: ResponseFormat) -> Grammar:
        """`fmt` checked against this model's vocabulary (`GrammarError` when it cannot be)."""
        return compile_grammar(fmt.grammar_text(), self.vocab, "the JSON schema")

    def matcher(self, grammar: Grammar, prompt_text: str | None) -> GrammarMatcher:
        """A matcher for one answer to the prompt `prompt_text` (None: the grammar starts at once)."""
        return GrammarMatcher(grammar, self.start_after(prompt_text))

    def reasons_before_calling(self, fmt: ToolFormat, prompt_text: str) -> bool:
        """Whether a required call should wait for the model's reasoning: a thinking prompt, and
        call markers the grammar can write as text (Hermes' tags; not special tokens)."""
        return fmt.closer is not None and bool(self.start_after(prompt_text))

    def tool_matcher(
        self, tools: "ToolRequest", fmt: ToolFormat, prompt_text: str, prefilled: bool
    ) -> GrammarMatcher | None:
        """The calls' grammar, so every call's arguments validate against its function's parameters.

        A required call's JSON comes right after the opener the prompt ends with (`prefilled`), or
        with its markers after the model's reasoning; with "auto" the answer is free until the
        model writes its family's opener, then the calls are constrained (None for Llama's bare
        JSON, whose opener is the call itself). With `tools.parallel` one or more calls ("auto"
        and "required"; a named function is called once), else one. A parameters schema the
        engine cannot compile is a `GrammarError`."""
        if not tools.forced and not fmt.forced_prefix:
            return None
        opened = prefilled or not tools.forced or fmt.closer is None
        many = tools.parallel and tools.choice in ("auto", "required")
        head, between, tail = fmt.calls_markup(opened, many)
        calls = tool_calls_grammar(tools.forced or tools.functions, head, between, tail)
        grammar = compile_grammar(calls, self.vocab, "the tool call")
        if not tools.forced:
            return GrammarMatcher(grammar, self.tokenizer.encode(fmt.opener, add_special_tokens=False))
        return self.matcher(grammar, None if opened else prompt_text)

    def start_after(self, prompt_text: str | None) -> tuple[int, ...]:
        """The ids of `</think>` when the answer may reason first, else none."""
        if prompt_text is None:
            return ()
        think_id = self.tokenizer.piece_to_id(THINK_CLOSE)
        if think_id is None or think_id < 0 or prompt_text.rstrip().endswith(THINK_CLOSE):
            return ()
        return (think_id,)
