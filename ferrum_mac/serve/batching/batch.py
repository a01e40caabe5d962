"""The sequences one model's scheduler runs and the requests that wait: admitted, fed their tokens, finished, failed.

Admission is first come, first served, while the planner says the batch and the KV budget hold
one more (`planner.may_admit`). An admitted request first takes what the model's prefix cache
holds of its prompt (`state.reuse`) and prefills only the rest. A prompt is remembered
(`state.remember`) once it is prefilled, and again with its answer before its cache is released.
A request that shares a long prefix with one still being prefilled waits for that prefix to be
computed rather than computing it a second time (16 requests with one system prompt hold it once).

Everything here runs on the scheduler's thread; events go back through each request's `emit`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ferrum_mac.engine import CANCELLED, CONTEXT, AnswerState, AnswerText, Timing, TokenLogprob
from ferrum_mac.engine.context import common_prefix
from ferrum_mac.engine.speculation.verify import Speculator
from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import DecoderOnlyLLM, PrefixStats
from ferrum_mac.serve.api_errors import hide_paths
from ferrum_mac.serve.batching.planner import may_admit
from ferrum_mac.serve.batching.request import Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.batching.sequence import Sequence, prefix_line, speculation_line
from ferrum_mac.text import Tokenizer

log = logging.getLogger("ferrum.serve")

# A request waits for an earlier one's prefill when they share at least this many prompt
# tokens beyond what the cache gave it: below that, computing them again costs less than waiting.
SHARE_WAIT_TOKENS = 64
PREFIX_STATS_S = 0.25  # the prefix cache's counters are read this often (a read walks its index)


@dataclass
class SchedulerStats:
    """Counters and gauges for /metrics; written by the scheduler thread only."""

    requests: dict = field(default_factory=dict)  # finish reason -> count
    prompt_tokens: int = 0
    generated_tokens: int = 0
    active: int = 0
    waiting: int = 0
    kv_tokens: int = 0  # held by active sequences
    kv_tokens_allocated: int = 0  # positions the model's KV buffers hold, used or not
    kv_tokens_used: int = 0  # tokens every cache of the model holds (active sequences and any other)
    steps: int = 0
    proposed_tokens: int = 0  # guesses verified (speculation)
    accepted_tokens: int = 0  # of them, kept
    prefix: PrefixStats | None = None  # the model's prefix cache counters (None: it keeps none)


class Batch:
    """One model's running sequences (in admission order) and waiting requests."""

    def __init__(self, model: DecoderOnlyLLM, tokenizer: Tokenizer, eos_ids: frozenset[int], stats: SchedulerStats):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.capacity = model.kv_capacity()
        self.stats = stats
        self.running: list[Sequence] = []
        self.waiting: list[tuple[RequestHandle, Timing]] = []
        self.stats.prefix = snapshot(model.state.prefix_stats())
        self.prefix_cache = self.stats.prefix is not None  # whether the model keeps a prefix cache
        self._prefix_read = time.monotonic()  # when the prefix cache's counters were last read

    # -- admission ---------------------------------------------------------------------------

    def drop_cancelled(self) -> None:
        for handle, timing in [w for w in self.waiting if w[0].cancelled]:
            self.waiting.remove((handle, timing))
            self.count(CANCELLED)
        for seq in [s for s in self.running if s.handle.cancelled]:
            self.finish(seq, CANCELLED)

    def admit(
        self, max_batch: int, kv_budget: int | None, speculator: Callable[[GenerationRequest], Speculator | None]
    ) -> None:
        """Admit waiting requests in order while `planner.may_admit` lets the first one in;
        `speculator`: the request's `Speculator`, or None when it does not guess."""
        while self.waiting:
            handle, timing = self.waiting[0]
            need = self.kv_need(handle.request)
            if not may_admit([s.need for s in self.running], need, max_batch, kv_budget, self.model.state.tokens_for):
                return  # first come, first served: later requests wait behind this one
            self.waiting.pop(0)
            request = handle.request
            try:
                sampler = self.model.sampler(request.sampling, request.prompt_ids)
                seq = Sequence(handle, sampler, self.answer_state(request, timing), need)
                seq.speculator = speculator(request)
                if seq.speculator is not None:
                    seq.history = list(request.prompt_ids)
                self.attach_prefix(seq)
            except Exception as e:  # this request's settings, its cache lookup or a bug: only this request fails
                if not isinstance(e, FerrumError):
                    log.exception("admitting a request failed")
                self.fail_one(handle, one_line(e))
                self.release_cache(handle.cache_id)
                continue
            self.running.append(seq)
            self.stats.prompt_tokens += len(request.prompt_ids)

    def answer_state(self, request: GenerationRequest, timing: Timing) -> AnswerState:
        text = AnswerText(self.tokenizer, request.stop, request.opens_reasoning, raw=request.raw)
        return AnswerState(
            text,
            self.eos_ids,
            matcher=request.matcher,
            max_tokens=request.max_tokens,
            ignore_eos=request.ignore_eos,
            timing=timing,
            call_tokens=request.call_tokens,
        )

    def kv_need(self, request: GenerationRequest) -> int:
        answer = request.max_tokens or self.capacity
        return min(len(request.prompt_ids) + answer, self.capacity)

    def attach_prefix(self, seq: Sequence) -> None:
        """Give `seq` what the prefix cache holds of its prompt; when a sequence still prefilling
        shares a longer prefix with it, make `seq` wait for that one (its `leader`)."""
        prompt = seq.request.prompt_ids
        seq.attach(self.model.state.reuse(seq.cache_id, prompt))
        if not self.prefix_cache:
            return
        for other in self.running:
            if other is seq or not other.unprefilled:
                continue
            shared = min(common_prefix(prompt, other.request.prompt_ids), len(prompt) - 1)
            if shared < seq.pos + SHARE_WAIT_TOKENS:
                continue
            if other.pos > seq.pos:  # it computed part of the prefix already: take that now
                self.model.state.remember(other.cache_id, other.held_tokens(other.pos))
                seq.attach(self.model.state.reuse(seq.cache_id, prompt))
            if shared >= seq.pos + SHARE_WAIT_TOKENS and shared > seq.shared:
                seq.leader, seq.shared = other, shared

    def wake_followers(self) -> None:
        """Sequences whose leader now holds the prefix they share (or has gone) take it from the
        prefix cache and prefill the rest (or wait for another leader)."""
        for seq in [s for s in self.running if s.leader is not None]:
            leader = seq.leader
            assert leader is not None
            running = leader in self.running
            if running and leader.unprefilled and leader.pos < seq.shared:
                continue
            try:
                if running:
                    self.model.state.remember(leader.cache_id, leader.held_tokens(leader.pos))
                seq.leader, seq.shared = None, 0
                self.attach_prefix(seq)
            except Exception as e:  # its lookup failed: only this request fails
                log.exception("taking a shared prefix failed")
                self.fail(seq, one_line(e))

    # -- tokens and ends ---------------------------------------------------------------------

    def accept(self, seq: Sequence, token: int, logits=None) -> None:
        """Hand `seq` its next token: its text goes out, and the answer's rules (or a full
        context) may end it; else the token goes into its cache next step. `logits`: the row it
        was drawn from, for a request that asks for log-probabilities (`TokenLogprob`)."""
        if seq.generated == 0:  # its prompt is in the cache: requests that start alike share it now
            self.model.state.remember(seq.cache_id, seq.request.prompt_ids)
            log.info("%s", prefix_line(seq))
        seq.answer_ids.append(token)
        if seq.speculator is not None:
            seq.history.append(token)
        self.stats.generated_tokens += 1
        k = seq.request.logprobs
        if k is not None and logits is not None and (token not in self.eos_ids or seq.request.ignore_eos):
            seq.emit(self.token_logprob(seq, logits, token, k))
        for event in seq.answer.add(token):
            seq.emit(event)
        reason = seq.answer.reason
        if reason is None and seq.pos + 1 > self.capacity:
            reason = CONTEXT
        if reason is None:
            seq.next_token = token
        else:
            self.finish(seq, reason)

    def token_logprob(self, seq: Sequence, logits, token: int, k: int) -> TokenLogprob:
        logprob, top = seq.sampler.logprobs(logits, token, k)
        return TokenLogprob(*self.token_text(token), logprob, tuple((*self.token_text(i), lp) for i, lp in top))

    def token_text(self, token: int) -> tuple[str, bytes]:
        """A token's text and bytes as a client sees them: a special token by its spelling."""
        data = self.tokenizer.token_bytes(token)
        if not data:
            data = (self.tokenizer.id_to_piece(token) or "").encode()
        return data.decode("utf-8", errors="backslashreplace"), data

    def accept_or_fail(self, seq: Sequence, token: int, logits=None) -> None:
        """`accept`; an error (e.g. its detokenizer) fails this sequence, not the others in the step."""
        try:
            self.accept(seq, token, logits)
        except Exception as e:
            log.exception("accepting a token failed")
            if seq in self.running:
                self.fail(seq, one_line(e))

    def finish(self, seq: Sequence, reason: str) -> None:
        for event in seq.answer.finish():
            seq.emit(event)
        seq.emit(seq.answer.done(reason, len(seq.request.prompt_ids), seq.cached, seq.speculation))
        if seq.speculation is not None and seq.speculation.steps:
            log.info("%s", speculation_line(seq))
        self._remember_answer(seq)
        self.release(seq, reason)

    def _remember_answer(self, seq: Sequence) -> None:
        """Keep the prompt and answer cached after the release (a client's next request
        sends both back); a failure here must not stop the loop."""
        try:
            held = min(self.model.state.length(seq.cache_id), seq.pos)  # a finished step's later guesses are no answer
            self.model.state.remember(seq.cache_id, seq.held_tokens(held))
        except Exception:
            log.exception("remembering %s failed", seq.cache_id)

    def fail(self, seq: Sequence, message: str) -> None:
        seq.emit(Failed(message))
        self.release(seq, "error")

    def release(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)  # first: a release that fails must not leave it running
        self.count(reason)
        self.release_cache(seq.cache_id)

    def release_cache(self, cache_id: str) -> None:
        try:
            self.model.release(cache_id)
        except Exception:  # release is idempotent; a broken one must not stop the loop
            log.exception("releasing %s failed", cache_id)

    def fail_one(self, handle: RequestHandle, message: str) -> None:
        if handle.request.emit is not None:
            try:
                handle.request.emit(Failed(message))
            except Exception:
                pass
        self.count("error")

    def cancel_running(self) -> None:
        for seq in list(self.running):
            try:
                self.finish(seq, CANCELLED)
            except Exception:  # fail_everyone then fails it
                log.exception("finishing %s failed", seq.cache_id)

    def fail_everyone(self, message: str) -> None:
        """Fail every running and waiting request (their KV released)."""
        for seq in list(self.running):
            self.fail(seq, message)
        for handle, _ in self.waiting:
            self.fail_one(handle, message)
        self.waiting.clear()

    def count(self, reason: str) -> None:
        self.stats.requests[reason] = self.stats.requests.get(reason, 0) + 1

    def update_gauges(self, queued: int) -> None:
        """`queued`: requests submitted and not yet taken in."""
        self.stats.active = len(self.running)
        self.stats.waiting = len(self.waiting) + queued
        self.stats.kv_tokens = sum(self.model.state.length(s.cache_id) for s in self.running)
        self.stats.kv_tokens_allocated = self.model.state.allocated_tokens() or 0
        self.stats.kv_tokens_used = self.model.state.used_tokens() or 0
        now = time.monotonic()
        if self.prefix_cache and (now - self._prefix_read >= PREFIX_STATS_S or not self.running):
            self.stats.prefix = snapshot(self.model.state.prefix_stats())
            self._prefix_read = now


def snapshot(prefix: PrefixStats | None) -> PrefixStats | None:
    """A copy /metrics may read on another thread while the model counts on."""
    return None if prefix is None else dataclasses.replace(prefix, misses=dict(prefix.misses))


def one_line(e: BaseException) -> str:
    """An exception as one line for an error event: its message's first line, or its type; the
    server's paths in it cut to their last part (the log gets them whole)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    shown = hide_paths(line)
    if shown != line:
        log.warning("%s", line)
    return shown
