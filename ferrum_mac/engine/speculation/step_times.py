"""What a model's decode and verify steps cost, learned from the steps real answers take.

Nothing is timed apart from answers: a plain decode step is timed as it happens (only one
that had the step before it queued behind it, as the pipelined loop runs), a verify step of
k guesses too, and a draft model's guesses where it makes them. Until a few of each are in,
speculation is not judged: an answer with a strong guess verifies one of it, then a few
(`probe`: real guesses whose kept tokens count; the first verify of a short answer, which
may be its only one, costs little) and decodes plainly otherwise; once
they are, a strong guess the costs refuse is verified so now and then (`reprobe`). The
fastest recent time of each kind counts, so a step slowed by other work, or by a first use
(kernels compiled, a graph captured), does not make guessing look dear for long.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from ferrum_mac.engine.speculation.controller import MAX_K, CostCurve, interpolated

FIRST_PROBE_K = 1  # guesses in the first verify: on a slow CPU a verify of a few costs several decode steps
PROBE_K = 4  # most guesses in a later verify taken before the costs are known (and in a reprobe)
PROBES = 2  # verify steps timed before the costs count (the first may pay a first use)
DECODE_SAMPLES = 2  # plain steps timed before the costs count
KEPT = 8  # recent times kept of each kind
REPROBE_EVERY = 64  # strong guesses the costs refused before a few are verified anyway: times go stale


class StepTimes:
    """One model's recent step times (seconds): plain decode steps, verify steps by guesses,
    and each draft model's guesses by the draft's name. `use` sets a curve instead (tests that
    need speculation to run, or never to run, on any machine)."""

    def __init__(self) -> None:
        self.decode: deque[float] = deque(maxlen=KEPT)
        self.verify: dict[int, deque[float]] = {}
        self.guess: dict[str, deque[float]] = {}  # draft name -> seconds per guessed token
        self._fixed: CostCurve | None = None
        self._curves: dict[str | None, CostCurve] = {}  # by draft, until a time is recorded
        self._refused = 0  # strong guesses refused since the last probe

    def use(self, costs: Sequence[float], draft_step: float = 0.0) -> None:
        """Take `costs` (verify[k] / decode for k = 0, 1, ...) and `draft_step` (a draft's
        guess in decode steps) as the model's, whatever its steps take."""
        self._fixed = CostCurve(interpolated(dict(enumerate(costs))), draft_step)
        self._curves.clear()

    def forget(self) -> None:
        """Back to knowing nothing: the next answers learn the costs as a first one does."""
        self.decode.clear()
        self.verify.clear()
        self.guess.clear()
        self._fixed = None
        self._curves.clear()

    def record_decode(self, seconds: float) -> None:
        self._add(self.decode, seconds)

    def record_verify(self, guesses: int, seconds: float) -> None:
        self._add(self.verify.setdefault(guesses, deque(maxlen=KEPT)), seconds)

    def record_guess(self, draft: str, seconds_each: float) -> None:
        self._add(self.guess.setdefault(draft, deque(maxlen=KEPT)), seconds_each)

    def _add(self, times: deque[float], seconds: float) -> None:
        """A time in; the curves are made again only when the fastest recent one changes."""
        before = (len(times), min(times, default=None))
        times.append(seconds)
        if before != (len(times), min(times)):
            self._curves.clear()

    def known(self, draft: str | None = None) -> bool:
        """Whether enough steps are timed to judge guessing (with `draft`'s guesses too)."""
        if self._fixed is not None:
            return True
        verified = sum(len(times) for times in self.verify.values())
        return (
            verified >= PROBES and len(self.decode) >= DECODE_SAMPLES and (draft is None or bool(self.guess.get(draft)))
        )

    def probe(self, room: int) -> int:
        """Guesses a strong proposal may verify while the costs are not known (0: decode
        plainly, the verify steps being timed already)."""
        if self._fixed is not None:
            return 0
        verified = sum(len(times) for times in self.verify.values())
        if verified >= PROBES:
            return 0
        return min(FIRST_PROBE_K if verified == 0 else PROBE_K, room)

    def reprobe(self, room: int) -> int:
        """Guesses a strong proposal the known costs refused may verify all the same: every
        REPROBE_EVERY refusals a few, so a time taken while the machine was busy (or a step's
        first use) does not keep guessing off for good."""
        if self._fixed is not None:
            return 0
        self._refused += 1
        if self._refused < REPROBE_EVERY:
            return 0
        self._refused = 0
        return min(PROBE_K, room)

    def curve(self, draft: str | None = None) -> CostCurve:
        """Verify costs in decode steps from the fastest recent times: interpolated between the
        guesses timed, and past the largest one growing as it grew up to it."""
        if draft not in self._curves:
            self._curves[draft] = self._curve(draft)
        return self._curves[draft]

    def _curve(self, draft: str | None) -> CostCurve:
        if self._fixed is not None:
            return self._fixed
        if not self.known(draft):
            return CostCurve((1.0,) + (float("inf"),) * MAX_K)
        decode = min(self.decode)
        ratios = {k: min(times) / decode for k, times in self.verify.items() if times}
        draft_step = min(self.guess[draft]) / decode if draft is not None else 0.0
        return CostCurve(extrapolated(ratios), draft_step)


def extrapolated(ratios: dict[int, float]) -> tuple[float, ...]:
    """`interpolated` costs, continued past the largest timed k along the last segment's slope
    (a CPU's verify grows with its rows; a GPU's hardly does)."""
    points = {0: 1.0, **ratios}
    ks = sorted(points)
    last, before = ks[-1], ks[-2] if len(ks) > 1 else ks[-1]
    slope = (points[last] - points[before]) / (last - before) if last > before else 0.0
    for k in range(last + 1, MAX_K + 1):
        points[k] = points[last] + slope * (k - last)
    return interpolated(points)
