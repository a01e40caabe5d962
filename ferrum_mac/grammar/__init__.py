"""Constrained decoding: JSON schemas, `json_object` and tool-call shapes compiled into per-step token masks.

The host side (`schema`, `tokens`, `engine`) needs numpy and the grammar engine only; `device`
applies a mask to MLX or torch logits and imports them lazily, so the engine layer can use this
package without pulling in either framework.
"""

from ferrum_mac.grammar.engine import Grammar, GrammarMatcher, compile_grammar, fill_masks
from ferrum_mac.grammar.schema import (
    GrammarError,
    UnsupportedSchemaError,
    json_object_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from ferrum_mac.grammar.tokens import GrammarVocab, full_mask, mask_words

__all__ = [
    "Grammar",
    "GrammarError",
    "GrammarMatcher",
    "GrammarVocab",
    "UnsupportedSchemaError",
    "compile_grammar",
    "fill_masks",
    "full_mask",
    "json_object_grammar",
    "json_schema_grammar",
    "mask_words",
    "tool_call_grammar",
]
