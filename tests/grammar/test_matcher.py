"""The per-sequence matcher: EOS only once the grammar is complete, a grammar that starts after
Qwen3's `</think>`, rollback, and refusals of a token or a mask it cannot take."""

from __future__ import annotations

import numpy as np
import pytest

from ferrum_mac.grammar import GrammarError, GrammarMatcher, compile_grammar, json_schema_grammar
from grammar_walks import allowed_ids

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


@pytest.fixture(scope="module")
def point(smollm2_vocab):
    return compile_grammar(json_schema_grammar(POINT), smollm2_vocab)


def feed(matcher, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert token in allowed_ids(matcher), (text, token)
        matcher.accept(token)


def test_only_eos_once_the_grammar_is_complete(point, smollm2_tokenizer):
    matcher = GrammarMatcher(point)
    feed(matcher, smollm2_tokenizer, '{"x": 12')
    assert not matcher.is_complete()
    assert not set(allowed_ids(matcher).tolist()) & set(smollm2_tokenizer.eos_ids)
    feed(matcher, smollm2_tokenizer, "}")
    assert matcher.is_complete()
    assert allowed_ids(matcher).tolist() == sorted(smollm2_tokenizer.eos_ids)
    matcher.accept(smollm2_tokenizer.eos_id)
    assert matcher.is_finished()


def test_eos_before_the_end_is_refused(point, smollm2_tokenizer):
    matcher = GrammarMatcher(point)
    feed(matcher, smollm2_tokenizer, '{"x": 12')
    with pytest.raises(GrammarError, match="does not fit") as raised:
        matcher.accept(smollm2_tokenizer.eos_id)
    assert "\n" not in str(raised.value)


def test_a_token_outside_the_mask_is_refused(point, smollm2_tokenizer):
    matcher = GrammarMatcher(point)
    (letter,) = smollm2_tokenizer.encode("z", add_special_tokens=False)
    assert letter not in allowed_ids(matcher)
    with pytest.raises(GrammarError):
        matcher.accept(letter)


def test_rollback_returns_to_an_earlier_mask(point, smollm2_tokenizer):
    matcher = GrammarMatcher(point)
    feed(matcher, smollm2_tokenizer, '{"x": ')
    before = allowed_ids(matcher)
    feed(matcher, smollm2_tokenizer, "42}")
    matcher.rollback(len(smollm2_tokenizer.encode("42}", add_special_tokens=False)))
    assert np.array_equal(allowed_ids(matcher), before)
    feed(matcher, smollm2_tokenizer, "7}")
    assert matcher.is_complete()


def test_grammar_starts_after_the_thinking_section(qwen3_tokenizer, qwen3_vocab):
    end_think = qwen3_tokenizer.encode("</think>", add_special_tokens=False)
    grammar = compile_grammar(json_schema_grammar(POINT), qwen3_vocab)
    matcher = GrammarMatcher(grammar, start_after=end_think)
    thinking = qwen3_tokenizer.encode("<think>\nThe user wants x; pick 3. Not {json} yet.\n", add_special_tokens=False)
    for token in thinking + end_think[:-1]:
        assert not matcher.started
        assert len(allowed_ids(matcher)) == qwen3_tokenizer.vocab_size  # unconstrained
        matcher.accept(token)
    matcher.accept(end_think[-1])
    assert matcher.started
    first = {qwen3_vocab.table[i][:1] for i in allowed_ids(matcher)}
    assert first == {b"{"}
    feed(matcher, qwen3_tokenizer, '{"x": 3}')
    assert allowed_ids(matcher).tolist() == sorted(qwen3_tokenizer.eos_ids)


def test_a_mask_of_the_wrong_width_is_refused(point):
    matcher = GrammarMatcher(point)
    with pytest.raises(ValueError, match="int32 words"):
        matcher.fill_mask(np.zeros((1, point.vocab.words - 1), dtype=np.int32))
    with pytest.raises(ValueError, match="int32 words"):
        matcher.fill_mask(np.zeros((1, point.vocab.words), dtype=np.int64))


def test_rows_of_one_batch_mask_are_independent(point, smollm2_tokenizer, smollm2_vocab):
    from ferrum_mac.grammar import full_mask

    batch = full_mask(3, smollm2_vocab.width)
    ahead = GrammarMatcher(point)
    feed(ahead, smollm2_tokenizer, '{"x": 1}')
    GrammarMatcher(point).fill_mask(batch, 0)
    ahead.fill_mask(batch, 2)
    assert (batch[1] == -1).all()  # a row without a grammar: everything allowed
    assert not np.array_equal(batch[0], batch[2])


def test_batch_fill_matches_one_row_at_a_time(qwen3_tokenizer, qwen3_vocab):
    from ferrum_mac.grammar import fill_masks, full_mask

    grammar = compile_grammar(json_schema_grammar(POINT), qwen3_vocab)
    end_think = qwen3_tokenizer.encode("</think>", add_special_tokens=False)
    matchers = [GrammarMatcher(grammar), GrammarMatcher(grammar), GrammarMatcher(grammar, start_after=end_think)]
    feed(matchers[1], qwen3_tokenizer, '{"x": 5')
    rows = [(matchers[0], 3), (matchers[1], 0), (matchers[2], 1)]  # row 2: no grammar
    batch = full_mask(4, qwen3_vocab.width)
    fill_masks(rows, batch)
    for matcher, row in rows:
        one = np.zeros((1, qwen3_vocab.words), dtype=np.int32)
        matcher.fill_mask(one)
        assert np.array_equal(batch[row], one[0]), row
    assert (batch[2] == -1).all()
    with pytest.raises(ValueError, match="outside"):
        fill_masks([(matchers[0], 4)], batch)
