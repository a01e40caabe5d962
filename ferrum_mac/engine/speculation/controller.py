"""When to speculate and how far: measured costs against the acceptance seen so far.

The cost curve (`CostCurve`): a verify of k guesses (k+1 tokens) in decode steps, from the
steps answers take on this machine (`step_times.StepTimes`). With a per-token acceptance rate a, a verify of k guesses yields (1 - a^(k+1)) / (1 - a)
tokens on average, so the rate against plain decoding is that over the verify's cost (plus
the draft's steps). The controller picks the k with the best rate and speculates only when
it beats plain decoding by a margin; acceptance is tracked per kind of proposal (a long
prompt-lookup match is a better bet than a short one) with decaying counts, and verify steps
that keep nothing, twice in a row, make the stream stand aside for a stretch that doubles
while it keeps failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

MAX_K = 8  # most guesses per verify
MARGIN = 1.1  # speculate only when the expected rate beats plain decoding by this much
DECAY = 0.9  # weight left to older verify steps in the acceptance counts
MISSES_BEFORE_WAIT = 2  # verify steps in a row that keep nothing before the stream stands aside
FIRST_STRETCH = 4  # plain tokens it then decodes before guessing again; doubles up to LONGEST
LONGEST_STRETCH = 64
# prior (accepted, tried) per kind: a long match is a passage being copied, a 1-token match rarely is
PRIORS = {"copy": (2.7, 3.0), "ngram3": (2.1, 3.0), "ngram2": (1.5, 3.0), "ngram1": (0.6, 3.0), "draft": (2.0, 3.0)}
DEFAULT_PRIOR = (1.0, 3.0)
MEASURE_FROM = 0.6  # a kind this likely to be kept (by its prior) is verified to time a verify; weaker ones wait


def worth_measuring(kind: str) -> bool:
    """Whether a first guess of `kind` is worth verifying before the costs are known (its
    verify step is timed): a weak guess alone is not, so plain answers verify nothing."""
    accepted, tried = PRIORS.get(kind, DEFAULT_PRIOR)
    return accepted / tried >= MEASURE_FROM


@dataclass(frozen=True)
class CostCurve:
    """`verify[k]`: a verify of k guesses (k+1 tokens) in decode steps (`verify[0]` is 1);
    `draft_step`: one draft-model decode step in target decode steps (0 without a draft)."""

    verify: tuple[float, ...]
    draft_step: float = 0.0

    def step_cost(self, k: int) -> float:
        return self.verify[k] + k * self.draft_step


def interpolated(measured: dict[int, float]) -> tuple[float, ...]:
    """Costs for every k up to MAX_K from the measured ones, never falling as k grows."""
    points = sorted(measured.items())
    costs: list[float] = []
    for k in range(MAX_K + 1):
        below = max((p for p in points if p[0] <= k), key=lambda p: p[0])
        above = min((p for p in points if p[0] >= k), key=lambda p: p[0], default=below)
        span = above[0] - below[0]
        cost = below[1] if span == 0 else below[1] + (above[1] - below[1]) * (k - below[0]) / span
        costs.append(max(cost, costs[-1] if costs else 1.0))
    return tuple(costs)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k guesses yields when each guess is kept with `acceptance`."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass
class Controller:
    """One stream's choices: how many guesses of each kind to verify, and when to stand aside."""

    curve: CostCurve
    counts: dict[str, list[float]] = field(default_factory=dict)  # kind -> [accepted, tried]
    wait: int = 0  # plain tokens left before speculating again
    misses: int = 0  # verify steps in a row that kept nothing
    stretch: int = FIRST_STRETCH

    def acceptance(self, kind: str) -> float:
        accepted, tried = self.counts.setdefault(kind, list(PRIORS.get(kind, DEFAULT_PRIOR)))
        return accepted / tried

    def guesses(self, kind: str | None, available: int = MAX_K) -> int:
        """How many guesses of `kind` to verify now (0: decode plainly)."""
        if kind is None or self.wait > 0:
            return 0
        a = self.acceptance(kind)
        rates = [expected_tokens(a, k) / self.curve.step_cost(k) for k in range(min(available, MAX_K) + 1)]
        best = max(range(len(rates)), key=rates.__getitem__)
        return best if rates[best] >= MARGIN else 0

    def plain_token(self) -> None:
        self.wait = max(0, self.wait - 1)

    def record(self, kind: str, proposed: int, accepted: int) -> None:
        """A verify of `proposed` guesses kept `accepted`."""
        counts = self.counts.setdefault(kind, list(PRIORS.get(kind, DEFAULT_PRIOR)))
        tried = accepted + (1 if accepted < proposed else 0)  # guesses judged: the kept ones and the first miss
        counts[0] = counts[0] * DECAY + accepted
        counts[1] = counts[1] * DECAY + tried
        if accepted:
            self.misses, self.stretch = 0, FIRST_STRETCH
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_WAIT:
            self.wait = self.stretch
            self.stretch = min(2 * self.stretch, LONGEST_STRETCH)


def fixed_curve(costs: Sequence[float], draft_step: float = 0.0) -> CostCurve:
    """A cost curve from given ratios (tests, and machines where measuring is not wanted)."""
    return CostCurve(interpolated(dict(enumerate(costs))), draft_step)
