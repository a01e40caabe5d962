"""Sampling settings and the sampler contract each backend provides.

The engine never touches logits. For each answer it asks the model for a sampler,
`model.sampler(params, context)`, and drives it with two calls:

    token = sampler.sample(logits)   # picks the next token on the device; does not wait for it
    token_id = sampler.read(token)   # waits for it and brings its id to the host

A constrained answer passes `sampler.sample(logits, mask)` with its grammar's bitmask for the
step (see `engine.structured`). Only token ids cross to the host. Because `sample` does not wait, the engine can queue the
next decode step with the lazy token before it reads the current one.

Order of work in a sampler (as transformers applies its processors and warpers): logit bias,
repetition/presence/frequency penalties over the last `penalty_window` tokens of the
sequence (prompt included), then greedy argmax when temperature is 0, else temperature,
top-k, top-p, min-p and a draw from a generator seeded with `seed`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from ferrum_mac.errors import FerrumError

Token = Any  # a device scalar holding a token id


class SamplingError(FerrumError):
    """A sampling setting out of its range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8  # 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0: off
    top_p: float = 1.0  # keep the smallest set whose probability reaches p; 1: off
    min_p: float = 0.0  # drop tokens less likely than min_p x the top token's probability; 0: off
    repetition_penalty: float = 1.0  # >1 discourages tokens in the window (divides positive logits); 1: off
    presence_penalty: float = 0.0  # subtracted once from each token in the window
    frequency_penalty: float = 0.0  # subtracted per occurrence in the window
    penalty_window: int = 64  # recent tokens the penalties look at
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None  # same seed, same prompt, same settings: same answer

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        ) and self.penalty_window > 0

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with the given fields changed; None values are left out (unset options)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None}).checked()

    def __post_init__(self) -> None:
        self.checked()

    def checked(self) -> "SamplingParams":
        """Self, or a SamplingError naming the first setting out of range (NaN and infinities
        included: a NaN temperature or penalty turns every logit into NaN)."""
        for name in _REAL_FIELDS:
            _require_finite(name, getattr(self, name))
        for name in ("top_k", "penalty_window"):
            _require_integer(name, getattr(self, name))
        problems = [
            (self.temperature < 0, f"temperature {self.temperature} must be 0 (greedy) or more"),
            (self.top_k < 0, f"top_k {self.top_k} must be 0 (off) or more"),
            (not 0 < self.top_p <= 1, f"top_p {self.top_p} must be above 0 and at most 1"),
            (not 0 <= self.min_p < 1, f"min_p {self.min_p} must be at least 0 and below 1"),
            (self.repetition_penalty <= 0, f"repetition_penalty {self.repetition_penalty} must be above 0 (1 is off)"),
            (self.penalty_window < 0, f"penalty_window {self.penalty_window} must be 0 or more"),
        ]
        for bad, message in problems:
            if bad:
                raise SamplingError(message)
        _check_seed(self.seed)
        _check_logit_bias(self.logit_bias)
        return self

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "logit_bias": {str(k): v for k, v in self.logit_bias.items()}}


_REAL_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit integers on every backend


def _require_finite(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SamplingError(f"{name} {value!r} must be a finite number")


def _require_integer(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingError(f"{name} {value!r} must be a whole number")


def _check_seed(seed) -> None:
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < SEED_LIMIT:
        raise SamplingError(f"seed {seed!r} must be a whole number from 0 to 2**64 - 1")


def _check_logit_bias(bias: Mapping[int, float]) -> None:
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise SamplingError(f"logit_bias names token {token!r}; token ids are whole numbers from 0")
        if value == -math.inf:  # bans the token; NaN and +inf would poison every logit
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise SamplingError(f"logit_bias[{token}] {value!r} must be a finite number (or -inf to ban the token)")


class Sampler(Protocol):
    """One answer's sampler, made by the backend (`DecoderOnlyLLM.sampler`)."""

    def sample(self, logits: Any, mask: Any = None) -> Token:
        """The next token as a device scalar, computing in the background (not waited for).
        `mask`: the ids a grammar allows this step, one int32 bitmask row (`ferrum_mac.grammar`),
        applied to the logits before anything else; None: every id."""
        ...

    def read(self, token: Token) -> int:
        """Wait for `token` and return its id."""
        ...

    def logprobs(self, logits: Any, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """`token`'s log-probability in `logits` (the model's own, before this sampler's settings)
        and the `k` likeliest ids with theirs, most likely first; read on the host, so called
        only for a request that asks for them."""
        ...
