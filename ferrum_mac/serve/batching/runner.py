"""Runs the planner's steps on the model: the forwards, the draws, the tokens handed to the batch.

A `StepPlan` (`planner.plan_step`) runs as one `unified_forward` of every decoding sequence's
token and the prefill chunks, or as whole prefills then one `decode_batch` (one `decode` per
sequence where the model has no batched decode). A decode step, nothing to prefill, is the
backends' fastest path (a replayed CUDA graph on torch) or, when some sequences' guesses of
their next tokens are worth their rows (`batching.speculation`), one `verify_batch` of every
sequence's token and those guesses; the guesses the sampler would itself have drawn are kept,
the rest cut from the cache (`truncate_kv`). Decode steps are timed, so that guessing stops for
a while where it turns out slower than plain steps (`Pace`).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ferrum_mac.engine.speculation.proposers import Proposal
from ferrum_mac.engine.speculation.verify import Speculator, accepted_ids
from ferrum_mac.grammar import fill_masks
from ferrum_mac.llm import DecodeItem, DecoderOnlyLLM, ForwardItem, KvCapacityError, Logits
from ferrum_mac.serve.batching.ahead import InFlight, may_run_ahead
from ferrum_mac.serve.batching.batch import Batch, one_line
from ferrum_mac.serve.batching.planner import DECODE, SINGLE, UNIFIED, StepPlan, choose_guesses
from ferrum_mac.serve.batching.sequence import Sequence, fed_token
from ferrum_mac.serve.batching.speculation import INDEX_STEP_TOKENS, MAX_ROWS, Offer, Pace, StepCosts, indexed

log = logging.getLogger("ferrum.serve")


class StepRunner:
    """Executes step plans for one batch on its model (on the scheduler's thread)."""

    def __init__(self, batch: Batch, model: DecoderOnlyLLM, costs: StepCosts):
        self.batch = batch
        self.model = model
        self.costs = costs
        self.batched_decode = model.capabilities.batched_decode
        self.in_flight: InFlight | None = None  # a decode step queued, its tokens not read (`ahead`)
        self.runs_ahead = True  # False: every step's tokens are read before the next is queued
        self.steps_ahead = 0  # decode steps queued ahead of their reads

    def run_or_fail(self, plan: StepPlan[Sequence], pace: Pace) -> None:
        """Run `plan`; one bad step fails the sequences in it, not the server."""
        try:
            self.run(plan, pace)
        except Exception as e:
            log.exception("a forward step failed")
            self.in_flight = None
            message = one_line(e)
            for seq in list(self.batch.running):
                self.batch.fail(seq, message)

    def run(self, plan: StepPlan[Sequence], pace: Pace) -> None:
        allowed = plan.kind == DECODE and pace.allows(len(plan.decoding))  # guesses may be verified this step
        if self.in_flight is not None:
            if plan.kind == DECODE and self._continues_ahead(plan.decoding, allowed):
                self._decode_ahead(plan.decoding, pace)
            else:  # its tokens may end sequences this plan holds, or feed their guesses: plan again after them
                self.drain()
            return
        if plan.kind == DECODE:
            self._decode_step(plan.decoding, pace, allowed)
            return
        self.batch.stats.steps += 1
        if plan.kind == UNIFIED:
            self._accept_all(self._unified(plan))
        else:
            self._accept_all(self._prefills(plan) + self._decode(plan.decoding, plan.kind != SINGLE))

    # -- prefill and plain decode ----------------------------------------------------------------

    def _unified(self, plan: StepPlan[Sequence]) -> list[tuple[Sequence, Logits]]:
        """One unified_forward: every decoding sequence's token, then the plan's prefill chunks."""
        parts = [(seq, [fed_token(seq)], True) for seq in plan.decoding]
        parts += [(c.seq, c.seq.unprefilled[: c.tokens], c.final) for c in plan.chunks]
        items = [ForwardItem(seq.cache_id, tokens, seq.pos, final) for seq, tokens, final in parts]
        logits = self.model.unified_forward(items)
        for seq, tokens, _ in parts:
            advance(seq, len(tokens))
        return [(seq, row) for (seq, _, final), row in zip(parts, logits) if final and row is not None]

    def _prefills(self, plan: StepPlan[Sequence]) -> list[tuple[Sequence, Logits]]:
        """Whole prefills of the plan's new sequences."""
        finals: list[tuple[Sequence, Logits]] = []
        for chunk in plan.chunks:
            seq = chunk.seq
            logits = self.model.prefill(seq.cache_id, seq.unprefilled)
            advance(seq, len(seq.unprefilled))
            finals.append((seq, logits))
        return finals

    def _decode(self, decoding: list[Sequence], batched: bool) -> list[tuple[Sequence, Logits]]:
        """One batched decode of `decoding` (one decode each where the model has none)."""
        if not decoding:
            return []
        if batched and self.batched_decode:
            block = self.model.decode_batch([DecodeItem(s.cache_id, fed_token(s), s.pos) for s in decoding])
            rows = [block[i] for i in range(len(decoding))]
        else:
            rows = [self.model.decode(s.cache_id, fed_token(s), s.pos) for s in decoding]
        for seq in decoding:
            advance(seq, 1)
        return list(zip(decoding, rows))

    def _accept_all(self, finals: list[tuple[Sequence, Logits]]) -> None:
        for (seq, logits), token in zip(finals, sample_all(finals)):
            self.batch.accept_or_fail(seq, token, logits)

    # -- plain decode steps, queued ahead of their reads ----------------------------------------

    def _continues_ahead(self, decoding: list[Sequence], allowed: bool) -> bool:
        """Whether the next step of `decoding` may be queued fed the step in flight's tokens: the
        same sequences, none that needs its tokens read first, and no stream with a guess in
        sight (looked up without the tokens in flight: a guess waits a step for the drain)."""
        assert self.in_flight is not None
        if not (self.runs_ahead and may_run_ahead(decoding, self.batch.capacity)):
            return False
        if not self.in_flight.continued_by(decoding, self.batch.running):
            return False
        known = self.costs.measured(len(decoding))
        return not (allowed and len(decoding) < MAX_ROWS and any(self._may_guess(seq, known) for seq in decoding))

    def _may_guess(self, seq: Sequence, known: bool) -> bool:
        speculator = seq.speculator
        if speculator is None:
            return False
        ready, _ = indexed(speculator, seq.history, 0)  # a prompt still being indexed: `_guesses` goes on with it
        return not ready or speculator.candidate(seq.history, self._guess_room(seq), known) is not None

    def _decode_ahead(self, decoding: list[Sequence], pace: Pace) -> None:
        """Queue a decode step of `decoding`, fed the tokens of the step in flight unread (or the
        ones read, when none is), then read and hand out the in-flight step's tokens (`ahead`).
        Timed for `pace`, from the second step on: the first reads nothing."""
        self.batch.stats.steps += 1
        self.steps_ahead += 1
        start, generated = time.perf_counter(), self.batch.stats.generated_tokens
        previous = self.in_flight
        fed = previous.tokens_of(decoding) if previous is not None else [fed_token(s) for s in decoding]
        if self.batched_decode:
            block = self.model.decode_batch([DecodeItem(s.cache_id, t, s.pos) for s, t in zip(decoding, fed)])
            rows = [block[i] for i in range(len(decoding))]
        else:
            rows = [self.model.decode(s.cache_id, t, s.pos) for s, t in zip(decoding, fed)]
        for seq in decoding:
            advance(seq, 1)
        self.in_flight = InFlight(decoding, [seq.sampler.sample(row) for seq, row in zip(decoding, rows)])
        if previous is not None:
            self._read(previous)
            seconds = time.perf_counter() - start  # from one step queued to the next: a plain step's time
            self.costs.record(len(decoding), len(decoding), seconds, False)
            pace.record(len(decoding), self.batch.stats.generated_tokens - generated, seconds, False)

    def drain(self) -> None:
        """Read and hand out the tokens of the step in flight, if any: the time from its queuing
        to its tokens read is a plain step's (what guesses are weighed against)."""
        if self.in_flight is not None:
            previous, self.in_flight = self.in_flight, None
            self._read(previous)
            rows = len(previous.seqs)
            self.costs.record(rows, rows, time.perf_counter() - previous.queued_at, False)

    def _read(self, step: InFlight) -> None:
        """Hand the sequences of `step` that still run their tokens, as a plain step would."""
        for seq, token in zip(step.seqs, step.tokens):
            if seq not in self.batch.running:  # finished or cancelled since: its row is no answer
                continue
            if seq.speculator is not None:
                seq.speculator.plain_token()
            try:
                token_id = seq.sampler.read(token)
            except Exception as e:  # this sequence's draw: fail it, not the others
                log.exception("reading a sampled token failed")
                self.batch.fail(seq, one_line(e))
                continue
            self.batch.accept_or_fail(seq, token_id)

    # -- decode steps, with guesses --------------------------------------------------------------

    def _decode_step(self, decoding: list[Sequence], pace: Pace, guessing: bool) -> None:
        """Every decoding sequence's token, with the guesses worth their rows (one `verify_batch`)
        when `guessing`, else one plain batched decode. Timed for `pace`."""
        stats = self.batch.stats
        start, generated, known = time.perf_counter(), stats.generated_tokens, self.costs.measured(len(decoding))
        guesses = self._guesses(decoding) if guessing else {}
        if not guesses and self.runs_ahead and may_run_ahead(decoding, self.batch.capacity):
            self._decode_ahead(decoding, pace)
            return
        stats.steps += 1
        if not (guesses and self._verify(decoding, guesses)):
            for seq in decoding:
                if seq.speculator is not None:
                    seq.speculator.plain_token()
            self._accept_all(self._decode(decoding, True))
            guesses = {}
        seconds = time.perf_counter() - start
        rows = len(decoding) + sum(len(p.tokens) for p in guesses.values())
        self.costs.record(len(decoding), rows, seconds, bool(guesses))
        if known or not guesses:  # a step that guessed before guessing was judged is no measure of it
            pace.record(len(decoding), stats.generated_tokens - generated, seconds, bool(guesses))

    def _guesses(self, decoding: list[Sequence]) -> dict[Sequence, Proposal]:
        """The proposals (cut to what the planner keeps of them) of the sequences that guess this
        step; before the step costs are known, and now and then while they say no guess pays, a
        few guesses of the likeliest stream, to time them."""
        if len(decoding) >= MAX_ROWS:
            return {}
        candidates: list[tuple[Sequence, Speculator, Proposal]] = []
        budget = INDEX_STEP_TOKENS
        known = self.costs.measured(len(decoding))
        for seq in decoding:
            if seq.speculator is None:
                continue
            ready, spent = indexed(seq.speculator, seq.history, budget)
            budget -= spent
            proposal = seq.speculator.candidate(seq.history, self._guess_room(seq), known) if ready else None
            if proposal is not None:
                candidates.append((seq, seq.speculator, proposal))
        if not candidates:
            return {}
        offers = [(seq, Offer(p, speculator.controller.acceptance(p.kind))) for seq, speculator, p in candidates]
        if known:
            counts = choose_guesses(offers, len(decoding), self.costs.get(len(decoding)))
            if counts:
                return {seq: Proposal(p.tokens[: counts[seq]], p.kind) for seq, _, p in candidates if seq in counts}
        probe = self.costs.reprobe(len(decoding)) if known else self.costs.probe(len(decoding))
        seq, offer = max(offers, key=lambda item: item[1].acceptance)
        return {seq: Proposal(offer.proposal.tokens[:probe], offer.proposal.kind)} if probe else {}

    def _guess_room(self, seq: Sequence) -> int:
        """Guesses the sequence may verify after its token: the cache must hold them, and the
        answer's limit leaves room for them and the token drawn after them (the KV it was
        admitted with covers exactly that)."""
        room = self.batch.capacity - seq.pos - 1
        if seq.request.max_tokens is not None:
            room = min(room, seq.request.max_tokens - seq.generated - 1)
        return room

    def _verify(self, decoding: list[Sequence], guesses: dict[Sequence, Proposal]) -> bool:
        """One `verify_batch` of every decoding sequence's token and `guesses`; False, having run
        nothing, when the cache has no room for the guesses' rows now."""
        items = [
            ForwardItem(s.cache_id, [fed_token(s), *guesses[s].tokens] if s in guesses else [fed_token(s)], s.pos)
            for s in decoding
        ]
        try:
            blocks = self.model.verify_batch(items)
        except KvCapacityError:  # raised before any cache changed: a plain step
            return False
        plain: list[tuple[Sequence, Logits]] = []
        for seq, rows in zip(decoding, blocks):
            if seq in guesses:
                continue
            if seq.speculator is not None:
                seq.speculator.plain_token()
            advance(seq, 1)
            plain.append((seq, rows[0]))
        self._accept_all(plain)
        for seq, rows in zip(decoding, blocks):
            proposal = guesses.get(seq)
            if proposal is not None:
                self._accept_guessed(seq, rows, proposal)
        return True

    def _accept_guessed(self, seq: Sequence, rows: Logits, proposal: Proposal) -> None:
        """Keep the guesses the sampler draws too, cut the others from the cache, and hand the
        kept ones and the draw after them to the batch one by one, as plain steps would."""
        assert seq.speculator is not None
        stats = self.batch.stats
        try:
            kept, drawn = accepted_ids(seq.sampler, rows, proposal.tokens)
            start = seq.pos
            if kept < len(proposal.tokens):
                self.model.truncate_kv(seq.cache_id, start + 1 + kept)
            seq.speculator.record(proposal, kept)
            stats.proposed_tokens += len(proposal.tokens)
            stats.accepted_tokens += kept
            for i, token_id in enumerate([*proposal.tokens[:kept], drawn]):
                seq.pos, seq.next_token = start + 1 + i, None  # its cache holds what plain steps would have fed
                self.batch.accept(seq, token_id)
                if seq.next_token is None:  # finished
                    return
        except Exception as e:  # this sequence's draws or detokenizer: fail it, not the others
            log.exception("accepting guessed tokens failed")
            if seq in self.batch.running:
                self.batch.fail(seq, one_line(e))


def advance(seq: Sequence, n: int) -> None:
    """`n` more of the sequence's tokens are in its cache: prompt tokens, else its fed token."""
    seq.pos += n
    if seq.unprefilled:
        seq.unprefilled = seq.unprefilled[n:]
    else:
        seq.next_token = None


def sample_all(finals: list[tuple[Sequence, Logits]]) -> list[int]:
    """One token id per row. Rows under a grammar are sampled with their masks (filled
    together, on the grammar engine's threads); the others exactly as without them."""
    matchers = {i: seq.request.matcher for i, (seq, _) in enumerate(finals) if seq.request.matcher is not None}
    if not matchers:
        return sample_free(finals)
    constrained = list(matchers)
    masks = np.empty((len(constrained), matchers[constrained[0]].vocab.words), dtype=np.int32)
    fill_masks([(matchers[i], row) for row, i in enumerate(constrained)], masks)
    lazy = {i: finals[i][0].sampler.sample(finals[i][1], masks[row]) for row, i in enumerate(constrained)}
    free = [i for i in range(len(finals)) if i not in lazy]
    ids = dict(zip(free, sample_free([finals[i] for i in free])))
    ids.update({i: finals[i][0].sampler.read(token) for i, token in lazy.items()})
    return [ids[i] for i in range(len(finals))]


def sample_free(finals: list[tuple[Sequence, Logits]]) -> list[int]:
    """One token id per row without a grammar: in one call where the backend's sampler offers
    `sample_rows`, else every row sampled before any is read, so the device works on them together."""
    samplers = [seq.sampler for seq, _ in finals]
    if not samplers:
        return []
    batched = getattr(type(samplers[0]), "sample_rows", None)
    if batched is not None and len(samplers) > 1 and all(type(s) is type(samplers[0]) for s in samplers):
        return batched(samplers, [logits for _, logits in finals])
    lazy = [s.sample(logits) for s, (_, logits) in zip(samplers, finals)]
    return [s.read(token) for s, token in zip(samplers, lazy)]
