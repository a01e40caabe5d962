"""The engine's sampler contract on MLX: logits in, a lazy token out, nothing read on the host.

`params` is the engine's SamplingParams, read by field name (a backend never imports the
engine). Penalties keep the recent token ids as a device array, so adding the token just
sampled does not wait for it either.
"""

from __future__ import annotations

import math
import secrets
from typing import Sequence

import mlx.core as mx

from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar.device import apply_mask_mlx

NEG_INF = -math.inf


class MlxSampler:
    def __init__(self, params, context: Sequence[int], vocab_size: int):
        self.params = params
        self.vocab_size = vocab_size
        _check_bias_ids(params.logit_bias, vocab_size)
        self.bias = None  # built at the first step, as wide as the logits
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.key = mx.random.key(seed)
        window = list(context)[-params.penalty_window :] if params.penalised else []
        self.window = mx.array(window, dtype=mx.uint32) if params.penalised else None

    def sample(self, logits: mx.array, mask=None) -> mx.array:
        """`mask`: a grammar's allowed ids for this step (one bitmask row), or None: all."""
        p = self.params
        x = logits.reshape(-1).astype(mx.float32)
        if mask is not None:  # first, so no later step can bring back an id the grammar forbids
            x = apply_mask_mlx(x.reshape(1, -1), mask.reshape(1, -1)).reshape(-1)
        if p.logit_bias:
            if self.bias is None:
                self.bias = _bias_vector(p.logit_bias, x.size)
            x = x + self.bias
        if self.window is not None and self.window.size:
            x = self._penalise(x)
        token = mx.argmax(x) if p.greedy else self._draw(x)
        token = token.astype(mx.uint32)
        if self.window is not None:
            self.window = mx.concatenate([self.window, token.reshape(1)])[-p.penalty_window :]
            mx.async_eval(token, self.window)
        else:
            mx.async_eval(token)
        return token

    def read(self, token: mx.array) -> int:
        return int(token.item())

    def logprobs(self, logits: mx.array, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """`token`'s log-probability under the model's own distribution (the raw logits, before
        this sampler's settings), and the `k` likeliest ids with theirs, most likely first."""
        x = logits.reshape(-1)[: self.vocab_size].astype(mx.float32)
        logprobs = x - mx.logsumexp(x)
        top = mx.argpartition(-logprobs, kth=k - 1)[:k] if k else mx.array([], dtype=mx.uint32)
        mx.eval(logprobs, top)
        ids = top.tolist()
        values = logprobs[top].tolist() if k else []
        ranked = sorted(zip(ids, values), key=lambda pair: -pair[1])
        return float(logprobs[token].item()), ranked

    @staticmethod
    def sample_rows(samplers: Sequence["MlxSampler"], rows: Sequence[mx.array]) -> list[int]:
        """Token ids for many sequences at once, row i by samplers[i]: the plain greedy rows
        (no bias, no penalties) in one argmax over their stacked block, the others one by one."""
        plain = [i for i, s in enumerate(samplers) if s.params.greedy and not s.params.logit_bias and s.window is None]
        others = {i: s.sample(r) for i, (s, r) in enumerate(zip(samplers, rows)) if i not in set(plain)}
        picked = mx.argmax(mx.stack([rows[i].reshape(-1) for i in plain]), axis=-1) if plain else mx.array([])
        mx.eval(picked, *others.values())
        ids = dict(zip(plain, picked.tolist()))
        return [ids[i] if i in ids else int(others[i].item()) for i in range(len(samplers))]

    def _penalise(self, x: mx.array) -> mx.array:
        p = self.params
        counts = mx.zeros(x.shape, dtype=mx.float32).at[self.window].add(1.0)
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            penalised = mx.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = mx.where(seen, penalised, x)
        if p.presence_penalty:
            x = x - p.presence_penalty * seen.astype(mx.float32)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        return x

    def _draw(self, x: mx.array) -> mx.array:
        p = self.params
        logprobs = _normalise(x / p.temperature)
        if 0 < p.top_k < logprobs.size:
            logprobs = _normalise(_top_k(logprobs, p.top_k))
        if p.top_p < 1.0:
            logprobs = _normalise(_top_p(logprobs, p.top_p))
        if p.min_p > 0.0:
            logprobs = mx.where(logprobs >= mx.max(logprobs) + math.log(p.min_p), logprobs, NEG_INF)
        self.key, step_key = mx.random.split(self.key)
        return mx.random.categorical(logprobs, key=step_key)


def _normalise(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x)


def _top_k(logprobs: mx.array, k: int) -> mx.array:
    dropped = mx.argpartition(-logprobs, kth=k - 1)[k:]
    return mx.put_along_axis(logprobs, dropped, mx.array(NEG_INF), axis=-1)


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Keep the most likely tokens until their probability reaches top_p (the top one always)."""
    order = mx.argsort(-logprobs)
    probs = mx.exp(logprobs[order])
    before = mx.cumsum(probs) - probs  # probability of the tokens ranked above each one
    kept_sorted = mx.where(before < top_p, logprobs[order], NEG_INF)
    return mx.put_along_axis(mx.full(logprobs.shape, NEG_INF), order, kept_sorted, axis=-1)


def _check_bias_ids(bias, vocab_size: int) -> None:
    bad = [int(t) for t in bias if not 0 <= int(t) < vocab_size]
    if bad:
        raise FerrumError(
            f"logit bias names token id {bad[0]}, outside the vocabulary (0 to {vocab_size - 1}); fix the id"
        )


def _bias_vector(bias, width: int) -> mx.array:
    ids = mx.array([int(t) for t in bias])
    return mx.zeros((width,), dtype=mx.float32).at[ids].add(mx.array([float(v) for v in bias.values()]))
