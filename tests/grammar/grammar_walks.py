"""A random walk through a matcher: each step samples among the ids its mask allows, as a
sampler with the mask applied would."""

from __future__ import annotations

import numpy as np

from ferrum_mac.grammar import GrammarMatcher


def allowed_ids(matcher: GrammarMatcher) -> np.ndarray:
    mask = np.zeros((1, matcher.vocab.words), dtype=np.int32)
    matcher.fill_mask(mask)
    bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def random_walk(
    matcher: GrammarMatcher, rng: np.random.Generator, max_tokens: int = 400, eos_weight: float = 0.3
) -> list[int]:
    """Tokens sampled uniformly among the allowed ones (EOS, when allowed, taken with `eos_weight`)
    until the grammar finishes; fails if it has not within `max_tokens`. Half the steps sample
    only among tokens that can close a string, number, object or array: uniform sampling alone
    wanders inside an unbounded string for a long time."""
    vocab = matcher.vocab
    is_eos = np.isin(np.arange(vocab.width), vocab.eos_ids)
    closes = _closing_tokens(vocab)
    out: list[int] = []
    for _ in range(max_tokens):
        allowed = allowed_ids(matcher)
        assert len(allowed), "the mask allows nothing"
        ends, text = allowed[is_eos[allowed]], allowed[~is_eos[allowed]]
        if len(ends) and (not len(text) or rng.random() < eos_weight):
            token = int(ends[0])
        else:
            closing = text[closes[text]]
            token = int(rng.choice(closing if len(closing) and rng.random() < 0.5 else text))
        matcher.accept(token)
        if is_eos[token]:
            assert matcher.is_finished()
            return out
        out.append(token)
    raise AssertionError(f"no EOS within {max_tokens} tokens: {out[-20:]}")


_CLOSERS = tuple(b'"}],')
_closing_cache: dict[int, np.ndarray] = {}


def _closing_tokens(vocab) -> np.ndarray:
    if id(vocab) not in _closing_cache:
        _closing_cache[id(vocab)] = np.array([any(c in data for c in _CLOSERS) for data in vocab.table])
    return _closing_cache[id(vocab)]
