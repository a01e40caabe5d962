"""Speculation in `ferrum serve`: which decoding sequences add guesses to a step, and how many.

A step with nothing to prefill is one `verify_batch`: each decoding sequence feeds its next
token, and a speculating one also its guesses (prompt lookup, `PromptLookup`), a row each.
The time of a step grows with its rows, so a guess is worth a row only when the step's
expected tokens per second rise with it. The times are learned from the decode steps the
scheduler runs (`StepCosts`: by batch size, the fastest recent plain step and step with
guesses of each number of rows, in powers of two; rows not yet timed are estimated from the
timed ones, never as cheaper than fewer), so nothing is timed apart from requests; until two
steps with guesses of a batch size are timed, its steps verify at most a few guesses of one
stream (real guesses: what they keep counts), and so again now and then while the times
refuse every guess (`reprobe`). Each guess adds the chance that it and the guesses before it are kept, from its
stream's own controller (`Controller.acceptance`, by kind of proposal); `plan` adds guesses
in order of that chance and keeps the prefix with the best rate, when it beats the step
without guesses by the controller's MARGIN. With one stream this is the engine's rule
(`Controller.guesses`). A stream whose verifies keep nothing stands aside for a stretch, as
in the engine. Guesses are accepted by the engine's rule (`accepted_guesses`), so answers
are those of plain decoding.

The plan weighs one step at a time; the scheduler also keeps the tokens per second whole
steps give (`Pace`): where steps with guesses give fewer than plain steps of the same batch
size, guessing stops there for a while. A long
prompt is indexed for lookups a slice a step (`indexed`), never all in one step.

Draft models are not offered here: a request for one is refused (`speculate_field`).
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from ferrum_mac.engine.speculation.controller import MARGIN, MAX_K, CostCurve
from ferrum_mac.engine.speculation.proposers import PromptLookup, Proposal
from ferrum_mac.engine.speculation.setting import AUTO, DRAFT, NGRAM, OFF
from ferrum_mac.engine.speculation.step_times import StepTimes
from ferrum_mac.engine.speculation.verify import Speculator
from ferrum_mac.serve import checks as api

SERVE_MODES = (AUTO, NGRAM, OFF)
MAX_ROWS = 64  # rows of one speculating step (torch runs up to this many as a captured decode step)
ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # step sizes the costs are kept for
PROBES = 2  # steps with guesses timed before the costs count (the first may pay a first use)
FIRST_PROBE_GUESSES = 1  # guesses in a batch size's first such step: on a slow CPU a few cost a step or more
PROBE_GUESSES = 3  # most guesses such a later step holds, of one stream (and a reprobe)
KEPT = 8  # recent times kept of each size
REPROBE_EVERY = 64  # steps whose guesses the costs refused before a few are verified anyway: times go stale
INDEX_STEP_TOKENS = 2048  # prompt positions indexed for lookups in one step, over all streams
INDEX_SLACK = 64  # a stream this few positions behind is indexed by its lookup itself
PACE_WEIGHT = 0.25  # of a step's rate in the moving average of its kind and size
PACE_SAMPLES = 4  # steps with guesses averaged before they are judged against plain ones
FIRST_PAUSE = 16  # plain steps after guessing steps lost; doubles up to LONGEST_PAUSE
LONGEST_PAUSE = 512
PLAIN_EVERY = 64  # a plain step after this many with guesses in a row keeps the plain rate current


def speculate_field(body: dict) -> str | None:
    """The body's `speculate` ("auto", "ngram" or "off"; None: the server's default), or a 400."""
    value = body.get("speculate")
    if value is None:
        return None
    if not isinstance(value, str):
        raise api.ApiError(400, "'speculate' must be a string", param="speculate", code="invalid_type")
    word = value.strip().lower()
    if word.partition(":")[0] == DRAFT:
        raise api.ApiError(
            400,
            "'speculate': a draft model is not available in ferrum serve; use auto, ngram or off",
            param="speculate",
            code="unsupported_parameter",
        )
    if word not in SERVE_MODES:
        raise api.ApiError(
            400, f"'speculate' must be auto, ngram or off, not {value[:40]!r}", param="speculate", code="invalid_value"
        )
    return word


def check_mode(mode: str) -> str:
    """`ferrum serve --speculate`: one of SERVE_MODES, else ValueError with the choices."""
    word = str(mode).strip().lower()
    if word not in SERVE_MODES:
        raise ValueError(f"--speculate {mode!r}: choose auto, ngram or off (no draft model in ferrum serve)")
    return word


@dataclass(frozen=True)
class RowCosts:
    """Seconds of a verify step of ROW_COUNTS[i] rows; `plain`: a plain decode step (the
    scheduler's `decode_batch`) as a share of a verify step of as many rows (timed at one row;
    at most 1: a backend whose decode step is its own, faster path makes guesses pay less)."""

    seconds: tuple[float, ...]
    plain: float = 1.0

    def time(self, rows: int) -> float:
        """A step of `rows` rows: as long as the smallest measured step that holds them."""
        return self._by_rows[rows] if rows <= MAX_ROWS else float("inf")

    @functools.cached_property
    def _by_rows(self) -> list[float]:
        """`time` of 0 to MAX_ROWS rows (the plan reads it for every row it adds)."""
        return [next(s for count, s in zip(ROW_COUNTS, self.seconds) if count >= rows) for rows in range(MAX_ROWS + 1)]

    def plain_time(self, rows: int) -> float:
        """A plain decode step of `rows` sequences."""
        return self.time(rows) * self.plain

    def curve(self) -> CostCurve:
        """One stream's verify costs in decode steps, as the engine's controller reads them."""
        return CostCurve(tuple(self.time(k + 1) / self.plain_time(1) for k in range(MAX_K + 1)))


class StepCosts:
    """One model's step times, learned from the decode steps the scheduler runs (`record`), or
    set (`use`); the model's scheduler keeps them, so they go when it unloads. They are kept by
    batch size (the decoding sequences, a power of two: a backend may attend each sequence of a
    verify apart, so rows of one sequence and of several cost differently); until a few steps
    of a size with guesses are timed (`measured`), its steps may verify a few guesses of one
    stream (`probe`)."""

    def __init__(self) -> None:
        self.plain: dict[int, deque[float]] = {}  # batch size -> its plain decode steps (seconds)
        self.verify: dict[int, dict[int, deque[float]]] = {}  # batch size -> rows (a power of two) -> seconds
        self._costs: dict[int, RowCosts] = {}
        self._fixed: RowCosts | None = None
        self._refused: dict[int, int] = {}  # batch size -> steps with guesses refused since a probe

    def measured(self, sequences: int) -> bool:
        """Whether the step times of a batch of `sequences` are known (set, or enough timed)."""
        size = _size(sequences)
        return self._fixed is not None or (self._verified(size) >= PROBES and size in self.plain)

    def probe(self, sequences: int) -> int:
        """Guesses one stream may verify while the times of this batch size are not known (0:
        none, the steps with guesses being timed already)."""
        verified = self._verified(_size(sequences))
        if self._fixed is not None or verified >= PROBES:
            return 0
        return FIRST_PROBE_GUESSES if verified == 0 else PROBE_GUESSES

    def reprobe(self, sequences: int) -> int:
        """Guesses one stream may verify although the known times refused them: every
        REPROBE_EVERY refusals a few, so a time taken while the machine was busy (or a step's
        first use) does not keep guessing off for good."""
        if self._fixed is not None:
            return 0
        size = _size(sequences)
        self._refused[size] = self._refused.get(size, 0) + 1
        if self._refused[size] < REPROBE_EVERY:
            return 0
        self._refused[size] = 0
        return PROBE_GUESSES

    def record(self, sequences: int, rows: int, seconds: float, guessed: bool) -> None:
        """A decode step of `sequences` and `rows` rows (theirs and their guesses) took `seconds`."""
        if self._fixed is not None or not 0 < rows <= MAX_ROWS:
            return
        size = _size(sequences)
        if guessed:
            times = self.verify.setdefault(size, {}).setdefault(_size(rows), deque(maxlen=KEPT))
        else:
            times = self.plain.setdefault(size, deque(maxlen=KEPT))
        times.append(seconds)
        self._costs.pop(size, None)

    def get(self, sequences: int) -> RowCosts:
        """The step costs of a batch of `sequences`, as `plan` reads them."""
        if self._fixed is not None:
            return self._fixed
        size = _size(sequences)
        if size not in self._costs:
            self._costs[size] = learned(self.plain.get(size, ()), self.verify.get(size, {}), size)
        return self._costs[size]

    def use(self, seconds: Sequence[float], plain: float = 1.0) -> None:
        """Take `seconds` (a step of each of ROW_COUNTS rows) as the model's instead of learning
        them: tests that need speculation to run, or never to run, on any machine."""
        self._fixed = RowCosts(tuple(seconds), plain)

    def speculator(self) -> Speculator:
        """One sequence's proposer, controller (its acceptance figures, its stretches aside) and counts."""
        return Speculator(PromptLookup(), StepTimes())

    def _verified(self, size: int) -> int:
        return sum(map(len, self.verify.get(size, {}).values()))


def learned(plain: Iterable[float], verify: dict[int, deque[float]], size: int) -> RowCosts:
    """Step costs of a batch of `size` sequences from its timed steps (the fastest of each
    kind): rows not timed with guesses cost what the nearest fewer timed ones do plus, per row,
    what the rows between the two most timed cost (or between the plain step and the timed)."""
    plain_times = list(plain)
    if not verify or not plain_times:
        return RowCosts((1.0,) + (float("inf"),) * (len(ROW_COUNTS) - 1))
    points = sorted((rows, min(times)) for rows, times in verify.items())
    plain_seconds = min(plain_times)
    if len(points) > 1:
        (r0, t0), (r1, t1) = points[-2], points[-1]
    else:
        (r0, t0), (r1, t1) = (size, plain_seconds), points[-1]
    slope = max(0.0, (t1 - t0) / (r1 - r0)) if r1 > r0 else t1 / r1
    seconds = []
    for count in ROW_COUNTS:
        below = [t for rows, t in points if rows <= count]
        seconds.append(below[-1] + slope * (count - points[len(below) - 1][0]) if below else points[0][1])
    seconds = [max(seconds[: i + 1]) for i in range(len(seconds))]  # never cheaper with more rows
    return RowCosts(tuple(seconds), min(1.0, plain_seconds / seconds[ROW_COUNTS.index(size)]))


def indexed(speculator: Speculator, history: Sequence[int], budget: int) -> tuple[bool, int]:
    """Whether the stream's prompt lookup has taken in `history` once it indexes at most
    `budget` more positions, and how many it indexed: a long prompt is indexed a slice a step,
    so one request's first guess never holds up every other sequence's step."""
    lookup = speculator.proposer
    assert isinstance(lookup, PromptLookup), "serve's streams guess by prompt lookup"
    behind = lookup.behind(history)
    if behind <= INDEX_SLACK:
        return True, 0
    spent = min(behind, budget)
    lookup.index_some(history, spent)
    return spent == behind, spent


class Pace:
    """The tokens per second steps with guesses and plain steps really give, by batch size (a
    power of two): what the measured forwards leave out (sampling, the host's bookkeeping) is
    in it. Where steps with guesses have been slower than plain ones, guessing stops for a
    stretch of steps that doubles while it keeps losing; a plain step now and then keeps the
    plain figure current while every step has guesses. `judged` False: never stop (tests
    whose figures must not depend on this machine's speed)."""

    def __init__(self, judged: bool = True) -> None:
        self.judged = judged
        self.rates: dict[tuple[int, bool], float] = {}  # (size, guessed) -> tokens/s, a moving average
        self.counts: dict[tuple[int, bool], int] = {}  # steps averaged
        self.since_plain: dict[int, int] = {}  # steps with guesses since the last plain one
        self.paused: dict[int, int] = {}  # plain steps left before guessing again
        self.stretch: dict[int, int] = {}

    def allows(self, rows: int) -> bool:
        """Whether a step of `rows` decoding sequences may have guesses."""
        size = _size(rows)
        if self.paused.get(size, 0) > 0:
            self.paused[size] -= 1
            return False
        return self.since_plain.get(size, 0) < PLAIN_EVERY

    def record(self, rows: int, tokens: int, seconds: float, guessed: bool) -> None:
        if rows < 1 or seconds <= 0:
            return
        size = _size(rows)
        key = (size, guessed)
        rate = tokens / seconds
        n = self.counts.get(key, 0)
        self.rates[key] = rate if n == 0 else self.rates[key] + PACE_WEIGHT * (rate - self.rates[key])
        self.counts[key] = n + 1
        self.since_plain[size] = self.since_plain.get(size, 0) + 1 if guessed else 0
        plain = self.rates.get((size, False))
        if not self.judged or not guessed or plain is None or self.counts[key] < PACE_SAMPLES:
            return
        if self.rates[key] < plain:
            self.paused[size] = self.stretch.get(size, FIRST_PAUSE)
            self.stretch[size] = min(2 * self.paused[size], LONGEST_PAUSE)
            del self.rates[key], self.counts[key]  # measured afresh after the pause
        else:
            self.stretch[size] = FIRST_PAUSE


def _size(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class Offer:
    """What one stream may add to a step: `proposal` (its longest), kept each with `acceptance`."""

    proposal: Proposal
    acceptance: float


def plan(offers: Sequence[Offer], rows: int, costs: RowCosts) -> list[int]:
    """Guesses to verify from each offer on a step of `rows` plain rows (one per decoding
    sequence): guesses added in order of the chance that they are kept (a guess counts only
    when those before it in its stream are kept too), the prefix with the best expected tokens
    per second, or none when that does not beat the plain step by MARGIN."""
    taken = [0] * len(offers)
    plain_rate = rows / costs.plain_time(rows)
    best_rate, best = plain_rate, list(taken)
    expected = float(rows)
    chances = [(-offer.acceptance, i) for i, offer in enumerate(offers) if offer.proposal.tokens]
    heapq.heapify(chances)
    while chances and rows < MAX_ROWS:
        chance, i = heapq.heappop(chances)
        taken[i] += 1
        rows += 1
        expected -= chance
        rate = expected / costs.time(rows)
        if rate > best_rate:
            best_rate, best = rate, list(taken)
        if taken[i] < len(offers[i].proposal.tokens):
            heapq.heappush(chances, (chance * offers[i].acceptance, i))
    return best if best_rate >= MARGIN * plain_rate else [0] * len(offers)
