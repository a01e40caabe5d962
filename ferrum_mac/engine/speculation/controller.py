"""When to speculate and how far: measured costs against the acceptance seen so far.

The cost curve (`CostCurve`) is measured on the machine, once per model: a few timed decode
steps and verify forwards of k+1 tokens on a throw-away cache, as ratios to one decode step.
With a per-token acceptance rate a, a verify of k guesses yields (1 - a^(k+1)) / (1 - a)
tokens on average, so the rate against plain decoding is that over the verify's cost (plus
the draft's steps). The controller picks the k with the best rate and speculates only when
it beats plain decoding by a margin; acceptance is tracked per kind of proposal (a long
prompt-lookup match is a better bet than a short one) with decaying counts, and verify steps
that keep nothing, twice in a row, make the stream stand aside for a stretch that doubles
while it keeps failing.
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

from ferrum_mac.llm import DecoderOnlyLLM

MAX_K = 8  # most guesses per verify
MEASURED_K = (2, 8)  # verify sizes timed at calibration; the others are interpolated
CALIBRATION_PROMPT = 64  # tokens in the throw-away cache the timings run on
CALIBRATION_RUNS = 2  # the median ratio counts: one run disturbed by other work does not
MARGIN = 1.1  # speculate only when the expected rate beats plain decoding by this much
DECAY = 0.9  # weight left to older verify steps in the acceptance counts
MISSES_BEFORE_WAIT = 2  # verify steps in a row that keep nothing before the stream stands aside
FIRST_STRETCH = 4  # plain tokens it then decodes before guessing again; doubles up to LONGEST
LONGEST_STRETCH = 64
# prior (accepted, tried) per kind: a long match is a passage being copied, a 1-token match rarely is
PRIORS = {"copy": (2.7, 3.0), "ngram3": (2.1, 3.0), "ngram2": (1.5, 3.0), "ngram1": (0.6, 3.0), "draft": (2.0, 3.0)}
DEFAULT_PRIOR = (1.0, 3.0)
MEASURE_FROM = 0.6  # a kind this likely to be kept (by its prior) starts the measuring; weaker ones wait for it


def worth_measuring(kind: str) -> bool:
    """Whether a first guess of `kind` justifies measuring the cost curve (a few forwards on
    the first answer that has one): a weak guess alone does not, so short answers measure
    nothing."""
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


_curves: "weakref.WeakKeyDictionary[DecoderOnlyLLM, tuple[float, ...]]" = weakref.WeakKeyDictionary()
_step_times: "weakref.WeakKeyDictionary[DecoderOnlyLLM, float]" = weakref.WeakKeyDictionary()


def cost_curve(model: DecoderOnlyLLM, draft: DecoderOnlyLLM | None = None) -> CostCurve:
    """The model's measured verify costs (measured at the first call, then kept), with the
    draft's step cost when there is one."""
    if model not in _curves:
        _curves[model] = _measure(model)
    draft_step = _decode_time(draft) / _decode_time(model) if draft is not None else 0.0
    return CostCurve(_curves[model], draft_step)


def measured(*models: DecoderOnlyLLM | None) -> bool:
    """Whether the cost curves of `models` (None: no model) are measured already."""
    return all(model is None or model in _curves for model in models)


def _decode_time(model: DecoderOnlyLLM) -> float:
    if model not in _curves:
        _curves[model] = _measure(model)
    return _step_times[model]


def _measure(model: DecoderOnlyLLM) -> tuple[float, ...]:
    cache_id = "speculation-calibration"
    vocab = model.config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(min(CALIBRATION_PROMPT, model.kv_capacity() - MAX_K - 2))]
    if len(prompt) <= MAX_K:  # a context too small to guess in: never speculate
        _step_times[model] = 1.0
        return (1.0,) + (float("inf"),) * MAX_K
    try:
        wait_for(model.prefill(cache_id, prompt))
        held = model.state.length(cache_id)

        def decode() -> None:
            wait_for(model.decode(cache_id, prompt[-1], held))

        def verify(k: int):
            return lambda: wait_for(model.forward_verify(cache_id, prompt[-k - 1 :]))

        def seconds(step) -> float:
            start = time.perf_counter()
            step()
            model.truncate_kv(cache_id, held)
            return time.perf_counter() - start

        seconds(decode)  # warm-up: first-use costs are not the curve
        for k in MEASURED_K:
            seconds(verify(k))
        ratios: dict[int, list[float]] = {k: [] for k in MEASURED_K}
        decode_times = []
        for _ in range(CALIBRATION_RUNS):  # each verify against the decode step next to it
            for k in MEASURED_K:
                decode_times.append(seconds(decode))
                ratios[k].append(seconds(verify(k)) / decode_times[-1])
        measured = {0: 1.0, **{k: statistics.median(r) for k, r in ratios.items()}}
        decode_time = statistics.median(decode_times)
    finally:
        model.release(cache_id)
    _step_times[model] = decode_time
    return _interpolated(measured)


def wait_for(logits) -> None:
    """Run the queued forward: read one value of the logits (nothing else reaches the host)."""
    logits.reshape(-1)[0].item()


def _interpolated(measured: dict[int, float]) -> tuple[float, ...]:
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


def use_costs(model: DecoderOnlyLLM, costs: Sequence[float], decode_time: float = 1.0) -> None:
    """Take `costs` (verify[k] / decode for k = 0, 1, ...) as `model`'s curve instead of
    measuring it: tests that need speculation to run, or to never run, on any machine."""
    _curves[model] = _interpolated(dict(enumerate(costs)))
    _step_times[model] = decode_time


def forget_costs(model: DecoderOnlyLLM) -> None:
    """Drop `model`'s curve: the next answer that guesses measures it again."""
    _curves.pop(model, None)
    _step_times.pop(model, None)


def fixed_curve(costs: Sequence[float], draft_step: float = 0.0) -> CostCurve:
    """A cost curve from given ratios (tests, and machines where measuring is not wanted)."""
    return CostCurve(_interpolated(dict(enumerate(costs))), draft_step)
