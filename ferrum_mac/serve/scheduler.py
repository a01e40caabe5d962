"""Continuous batching: many requests on one model, one forward per step, on one thread.

Each step runs every decoding sequence's next token plus prefill chunks of newly admitted
ones under a token budget, as one `unified_forward` where the backend has it (else whole
prefills, then one `decode_batch`, else one `decode` per sequence). A step with nothing to
prefill is one `decode_batch`: the backends' fastest path (a replayed CUDA graph on torch), or,
when some sequences' guesses of their next tokens are worth their rows (`serve.speculation`),
one `verify_batch` of every sequence's token and those guesses; the guesses the sampler would
itself have drawn are kept, the rest cut from the cache (`truncate_kv`). Requests are admitted
first come, first served, while the batch has room and the KV the model would hold with
them all at their full length (prompt plus max_tokens; the pool's whole shape) fits what
free memory held at start; a decoding sequence gets a token every step, so a
long prompt never stalls the others for more than one chunk.

Prefix cache: an admitted request first takes what the model's prefix cache holds of its
prompt (`kv_reuse`) and prefills only the rest. A prompt is remembered (`kv_remember`) once
it is prefilled, and again with its answer before its cache is released. A request that
shares a long prefix with one still being prefilled waits for that prefix to be computed
rather than computing it a second time (16 requests with one system prompt hold it once).

The thread owns the model. Clients talk to it only through `submit` (a queue) and
`RequestHandle.cancel`; events go back through each request's `emit`. The scheduler never
imports MLX or torch: it asks the model for a sampler per request, as the engine does.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ferrum_mac.engine import CANCELLED, CONTEXT, AnswerState, AnswerText, LocalEngine, Timing
from ferrum_mac.engine.speculation import SpeculationStats
from ferrum_mac.engine.speculation.proposers import Proposal
from ferrum_mac.engine.speculation.setting import OFF
from ferrum_mac.engine.speculation.verify import Speculator, accepted_ids
from ferrum_mac.errors import FerrumError, UnsupportedError
from ferrum_mac.grammar import fill_masks
from ferrum_mac.engine.context import common_prefix
from ferrum_mac.llm import (
    KV_CAPACITY_ENV,
    DecodeItem,
    DecoderOnlyLLM,
    ForwardItem,
    KvCapacityError,
    Logits,
    PrefixReuse,
    PrefixStats,
)
from ferrum_mac.serve.request import Failed, GenerationRequest, RequestHandle
from ferrum_mac.serve.speculation import (
    INDEX_STEP_TOKENS,
    MAX_ROWS,
    Offer,
    Pace,
    check_mode,
    indexed,
    measured,
    plan,
    row_costs,
    stream_speculator,
)

log = logging.getLogger("ferrum.serve")

MAX_BATCH = 32  # sequences decoding together
STEP_TOKENS = 512  # tokens one forward may carry (decode tokens plus prefill chunks)
UNIFIED, SPLIT, SINGLE = "unified_forward", "decode_batch", "decode"
WARMUP_ID = "scheduler-warm-up"
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


class Sequence:
    """One admitted request's state; touched only on the scheduler thread."""

    def __init__(self, handle: RequestHandle, sampler, answer: AnswerState, need: int):
        self.handle = handle
        self.request = handle.request
        self.cache_id = handle.cache_id
        self.sampler = sampler
        self.answer = answer  # the answer's rules: its text, and whether a token ends it
        self.need = need  # KV tokens reserved for it at admission
        self.unprefilled = list(self.request.prompt_ids)
        self.pos = 0  # tokens in its cache
        self.next_token: int | None = None  # sampled, to go into the cache next step
        self.answer_ids: list[int] = []  # the tokens generated so far
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.miss: str | None = None  # why the prefix cache gave no more (`PrefixReuse.miss`)
        self.leader: Sequence | None = None  # an earlier sequence prefilling a prefix this one shares
        self.shared = 0  # prompt tokens in common with `leader`: this one waits until it holds them
        self.speculator: Speculator | None = None  # set when it may guess its next tokens
        self.history: list[int] = []  # while it may: the prompt and the answer, which guesses are looked up in

    @property
    def generated(self) -> int:
        return self.answer.generated

    @property
    def speculation(self) -> SpeculationStats | None:
        return self.speculator.stats if self.speculator is not None else None

    def attach(self, reuse: PrefixReuse) -> None:
        """Start from what `kv_reuse` attached: prefill only the rest of the prompt."""
        prompt = self.request.prompt_ids
        self.pos, self.cached, self.miss = reuse.tokens, reuse.tokens, reuse.miss
        self.unprefilled = list(prompt[reuse.tokens :])

    def held_tokens(self, held: int) -> list[int]:
        """The ids of the first `held` positions of its cache: the prompt, then the answer."""
        return (list(self.request.prompt_ids) + self.answer_ids)[:held]

    def emit(self, event) -> None:
        if self.request.emit is None:
            return
        try:
            self.request.emit(event)
        except Exception:  # a client that went away must not stop the others
            pass


def fed_token(seq: Sequence) -> int:
    """The token a decoding sequence feeds this step: the one sampled at the last."""
    assert seq.next_token is not None, "only a decoding sequence feeds a token"
    return seq.next_token


class SchedulerThreads:
    """The threads schedulers run on. A thread that has used MLX must never end (MLX aborts the
    process at exit when one has), so the thread of a scheduler that stopped waits to run the
    next one instead: a server that loads and unloads models keeps as many threads as it ever
    had models loaded at once."""

    def __init__(self):
        self._idle: queue.Queue = queue.Queue()  # each idle thread's own queue of work

    def run(self, work: Callable[[], None]) -> None:
        try:
            jobs = self._idle.get_nowait()
        except queue.Empty:
            jobs = queue.Queue()
            threading.Thread(target=self._serve, args=(jobs,), name="ferrum-scheduler", daemon=True).start()
        jobs.put(work)

    def _serve(self, jobs: queue.Queue) -> None:
        while True:
            work = jobs.get()
            try:
                work()
            except BaseException:
                log.exception("a scheduler's thread failed")
            del work  # before waiting: nothing of the last scheduler stays referenced here
            self._idle.put(jobs)


_THREADS = SchedulerThreads()


class Scheduler:
    def __init__(
        self,
        open_engine: Callable[[], LocalEngine],
        *,
        max_batch: int = MAX_BATCH,
        step_tokens: int = STEP_TOKENS,
        kv_budget: int | None = None,
        speculate: str = OFF,
    ):
        """`open_engine` runs on the scheduler's thread: MLX arrays belong to the thread that
        made them (another thread's lazy arrays fail to evaluate), so the model is opened there.
        `speculate`: auto, ngram or off, for requests that do not choose (`GenerationRequest.speculate`)."""
        self._open_engine = open_engine
        self._engine: LocalEngine | None = None
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.kv_budget = kv_budget
        self.speculate = check_mode(speculate)
        self.verifies = True  # the model runs verify_batch (False once it says it cannot)
        self.pace = Pace()
        self.mode = UNIFIED
        self.stats = SchedulerStats()
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: list[tuple[RequestHandle, Timing]] = []
        self._running: list[Sequence] = []
        self._started = False
        self._stopping = False
        self._unloading = False  # stop() was unload(): drop the model once the loop ends
        self._stopped = threading.Event()
        self._looping = False  # set while the loop runs; False before start, after stop and if it died
        self.death: str | None = None  # why the loop ended, when it ended by an error no guard caught
        self.prefix_cache = False  # whether the model keeps a prefix cache (known once it is loaded)
        self._prefix_read = 0.0  # when the prefix cache's counters were last read

    @property
    def engine(self) -> LocalEngine:
        """The engine `start` opened (on the scheduler's thread)."""
        if self._engine is None:
            raise FerrumError("the scheduler has not started; call start() first")
        return self._engine

    # -- the client side ------------------------------------------------------------------

    def start(self) -> "Scheduler":
        """Open the engine on a new thread and start scheduling there; errors opening it raise here."""
        opened: Future = Future()
        self._started = True
        _THREADS.run(lambda: self._run(opened))
        opened.result()
        return self

    @property
    def alive(self) -> bool:
        """Whether the loop is running and will answer what `submit` queues."""
        return self._looping and not self._stopping

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._started:
            self._stopped.wait(timeout=30)

    def unload(self) -> None:
        """Stop, and let the model's memory go: its caches are reset on its own thread and this
        scheduler drops every reference to it (the caller drops its own, then collects)."""
        self._unloading = True
        self.stop()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue `request`; its events arrive through `request.emit`. A prompt that cannot fit
        raises here, before anything is queued."""
        n = len(request.prompt_ids)
        if n == 0:
            raise FerrumError("the prompt is empty; send some text")
        if n + 1 > self.capacity:
            raise KvCapacityError(
                f"the prompt has {n} tokens but the context holds {self.capacity} (prompt and answer); "
                f"shorten it or raise {KV_CAPACITY_ENV}",
                needed=n + 1,
                capacity=self.capacity,
            )
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in request.prompt_ids):
            raise FerrumError(f"the prompt holds token ids outside the vocabulary (0 to {vocab - 1})")
        self._refuse_unless_alive()
        handle = RequestHandle(request)
        self._inbox.put((handle, Timing()))
        self._refuse_unless_alive()  # the loop may have ended while this was queued: nobody would answer it
        return handle

    def _refuse_unless_alive(self) -> None:
        if self.death is not None:
            raise FerrumError(
                f"the server's scheduler stopped after an internal error ({self.death}); restart the server"
            )
        if not self.alive:
            raise FerrumError("the scheduler is stopping; send the request again after a restart")

    # -- the scheduler thread -------------------------------------------------------------

    def _run(self, opened: Future) -> None:
        try:
            self._load()
        except BaseException as e:
            self._stopping = True
            opened.set_exception(e)
        else:
            self._looping = True
            opened.set_result(None)
            self._loop_until_stopped()
            if self._unloading:
                self._drop_model()
        self._stopped.set()

    def _loop_until_stopped(self) -> None:
        """The loop, and what is left to say to clients once it ends, however it ends."""
        try:
            self._loop()
        except BaseException as e:  # a bug no guard caught: clients must hear of it rather than wait forever
            self.death = _one_line(e)
            log.exception("the scheduler loop died")
        finally:
            self._looping = False
            try:
                if self.death is None:
                    self._cancel_running()
                message = "the server is stopping" if self.death is None else f"the server failed ({self.death})"
                self._fail_everyone(message, queued=True)
            except BaseException:  # the thread must still park (see _run)
                log.exception("failing the requests left failed")

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._take_new(block=not self._running and not self._waiting)
                self._drop_cancelled()
                self._admit()
                self._wake_followers()
                if self._running:
                    self._step_or_fail()
                self._update_gauges()
            except Exception as e:  # outside any one request: fail what is in flight, keep serving
                log.exception("scheduler step failed")
                self._fail_everyone(_one_line(e))

    def _cancel_running(self) -> None:
        for seq in list(self._running):
            try:
                self._finish(seq, CANCELLED)
            except Exception:  # _fail_everyone then fails it
                log.exception("finishing %s failed", seq.cache_id)

    def _fail_everyone(self, message: str, queued: bool = False) -> None:
        """Fail every running and waiting request (their KV released) and, with `queued`,
        those still in the inbox (when no loop will read it again)."""
        for seq in list(self._running):
            seq.emit(Failed(message))
            self._release(seq, "error")
        while queued:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._waiting.append(item)
        for handle, _ in self._waiting:
            self._fail_one(handle, message)
        self._waiting.clear()

    def _drop_model(self) -> None:
        try:
            self.model.reset()  # on this thread: MLX's arrays belong to it
        except Exception:
            log.exception("resetting the model before unloading it failed")
        self._engine = None
        del self.model, self.tokenizer

    def _load(self) -> None:
        self._engine = engine = self._open_engine()
        self.model: DecoderOnlyLLM = engine.model
        self.tokenizer = engine.tokenizer
        self.eos_ids = frozenset(engine.eos_ids)
        self.capacity = self.model.kv_capacity()
        self.model.prepare(WARMUP_ID, 16)  # compiles kernels and captures graphs before any request
        self.model.release(WARMUP_ID)
        self._warm_up_batches()
        self.stats.prefix = _snapshot(self.model.kv_prefix_stats())
        self.prefix_cache = self.stats.prefix is not None
        self._prefix_read = time.monotonic()
        if self.kv_budget is None:
            self.kv_budget = self.model.kv_free_tokens()  # None: only the batch size limits admission

    def _warm_up_batches(self) -> None:
        """One batched decode step at each power-of-two batch up to `max_batch`, so a backend
        compiles its kernels for each batch shape (and captures them, on CUDA) before a burst
        of requests would wait for it."""
        ids = [f"{WARMUP_ID}-{i}" for i in range(self.max_batch)]
        try:
            for cache_id in ids:
                self.model.prefill(cache_id, [0])
            rows = 2
            while rows <= self.max_batch:
                self.model.decode_batch([DecodeItem(c, 0, self.model.kv_len(c)) for c in ids[:rows]])
                rows *= 2
        except UnsupportedError:
            pass  # no batched decode: requests decode one by one
        finally:
            for cache_id in ids:
                self.model.release(cache_id)

    def _take_new(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _drop_cancelled(self) -> None:
        for handle, timing in [w for w in self._waiting if w[0].cancelled]:
            self._waiting.remove((handle, timing))
            self._count(CANCELLED)
        for seq in [s for s in self._running if s.handle.cancelled]:
            self._finish(seq, CANCELLED)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch:
            handle, timing = self._waiting[0]
            need = self._kv_need(handle.request)
            if self._running and self.kv_budget is not None and self._kv_with(need) > self.kv_budget:
                return  # first come, first served: later requests wait behind this one
            self._waiting.pop(0)
            request = handle.request
            try:
                sampler = self.model.sampler(request.sampling, request.prompt_ids)
                seq = Sequence(handle, sampler, self._answer_state(request, timing), need)
                if self._speculates(request):
                    seq.speculator, seq.history = stream_speculator(self.model), list(request.prompt_ids)
                self._attach_prefix(seq)
            except Exception as e:  # this request's settings, its cache lookup or a bug: only this request fails
                if not isinstance(e, FerrumError):
                    log.exception("admitting a request failed")
                self._fail_one(handle, _one_line(e))
                self._release_cache(handle.cache_id)
                continue
            self._running.append(seq)
            self.stats.prompt_tokens += len(request.prompt_ids)

    def _answer_state(self, request: GenerationRequest, timing: Timing) -> AnswerState:
        text = AnswerText(self.tokenizer, request.stop, request.opens_reasoning, raw=request.raw)
        return AnswerState(
            text,
            self.eos_ids,
            matcher=request.matcher,
            max_tokens=request.max_tokens,
            ignore_eos=request.ignore_eos,
            timing=timing,
        )

    def _speculates(self, request: GenerationRequest) -> bool:
        """Whether a request may guess: not under a grammar (each row would need its mask)."""
        mode = request.speculate or self.speculate
        return mode != OFF and request.matcher is None and self.verifies

    def _attach_prefix(self, seq: Sequence) -> None:
        """Give `seq` what the prefix cache holds of its prompt; when a sequence still prefilling
        shares a longer prefix with it, make `seq` wait for that one (its `leader`)."""
        prompt = seq.request.prompt_ids
        seq.attach(self.model.kv_reuse(seq.cache_id, prompt))
        if not self.prefix_cache:
            return
        for other in self._running:
            if other is seq or not other.unprefilled:
                continue
            shared = min(common_prefix(prompt, other.request.prompt_ids), len(prompt) - 1)
            if shared < seq.pos + SHARE_WAIT_TOKENS:
                continue
            if other.pos > seq.pos:  # it computed part of the prefix already: take that now
                self.model.kv_remember(other.cache_id, other.held_tokens(other.pos))
                seq.attach(self.model.kv_reuse(seq.cache_id, prompt))
            if shared >= seq.pos + SHARE_WAIT_TOKENS and shared > seq.shared:
                seq.leader, seq.shared = other, shared

    def _wake_followers(self) -> None:
        """Sequences whose leader now holds the prefix they share (or has gone) take it from the
        prefix cache and prefill the rest (or wait for another leader)."""
        for seq in [s for s in self._running if s.leader is not None]:
            leader = seq.leader
            assert leader is not None
            running = leader in self._running
            if running and leader.unprefilled and leader.pos < seq.shared:
                continue
            try:
                if running:
                    self.model.kv_remember(leader.cache_id, leader.held_tokens(leader.pos))
                seq.leader, seq.shared = None, 0
                self._attach_prefix(seq)
            except Exception as e:  # its lookup failed: only this request fails
                log.exception("taking a shared prefix failed")
                seq.emit(Failed(_one_line(e)))
                self._release(seq, "error")

    def _kv_need(self, request: GenerationRequest) -> int:
        answer = request.max_tokens or self.capacity
        return min(len(request.prompt_ids) + answer, self.capacity)

    def _kv_with(self, need: int) -> int:
        """KV positions the model would hold once a sequence of `need` tokens runs beside the
        running ones, each at its full need: for a pool of equal slots that is every slot as
        long as the longest, not the sum of the needs."""
        return self.model.kv_tokens_for([seq.need for seq in self._running] + [need])

    def _step_or_fail(self) -> None:
        try:
            self._step()
        except Exception as e:  # one bad step fails the sequences in it, not the server
            log.exception("a forward step failed")
            message = _one_line(e)
            for seq in list(self._running):
                seq.emit(Failed(message))
                self._release(seq, "error")

    def _step(self) -> None:
        self.stats.steps += 1
        if self.mode == UNIFIED and self._prefilling():
            try:
                finals = self._unified_step()
            except UnsupportedError:
                self.mode = SPLIT
                finals = self._split_step()
        elif not self._prefilling():
            return self._decode_step()
        else:
            finals = self._split_step()
        self._accept_all(finals)

    # -- speculation ------------------------------------------------------------------------

    def _decode_step(self) -> None:
        """A step with nothing to prefill: every decoding sequence's token, with the guesses
        worth their rows (one `verify_batch`), else one plain batched decode. Timed, so that
        steps with guesses that turn out slower than plain ones stop for a while (`Pace`)."""
        start, generated, timed = time.perf_counter(), self.stats.generated_tokens, measured(self.model)
        decoding = self._decoding()
        guesses = self._guesses(decoding) if self.pace.allows(len(decoding)) else {}
        if not (guesses and self._verify_step(decoding, guesses)):
            for seq in decoding:
                if seq.speculator is not None:
                    seq.speculator.plain_token()
            self._accept_all(self._split_step())
            guesses = {}
        if timed or not measured(self.model):  # the step that timed the model's steps is no measure
            tokens = self.stats.generated_tokens - generated
            self.pace.record(len(decoding), tokens, time.perf_counter() - start, bool(guesses))

    def _verify_step(self, decoding: list[Sequence], guesses: dict[Sequence, Proposal]) -> bool:
        """One `verify_batch` of every decoding sequence's token and `guesses`; False, having
        run nothing, when the model has no batched verify."""
        items = [
            ForwardItem(s.cache_id, [fed_token(s), *guesses[s].tokens] if s in guesses else [fed_token(s)], s.pos)
            for s in decoding
        ]
        try:
            blocks = self.model.verify_batch(items)
        except UnsupportedError:  # raised before any cache changed: decode plainly from now on
            self.verifies = False
            for seq in decoding:
                seq.speculator = None
            return False
        except KvCapacityError:  # no room for the guesses' rows now (nothing changed): a plain step
            return False
        plain: list[tuple[Sequence, Logits]] = []
        for seq, rows in zip(decoding, blocks):
            if seq in guesses:
                continue
            if seq.speculator is not None:
                seq.speculator.plain_token()
            self._advance(seq, 1)
            plain.append((seq, rows[0]))
        self._accept_all(plain)
        for seq, rows in zip(decoding, blocks):
            proposal = guesses.get(seq)
            if proposal is not None:
                self._accept_guessed(seq, rows, proposal)
        return True

    def _guesses(self, decoding: list[Sequence]) -> dict[Sequence, Proposal]:
        """The proposals (cut to what `plan` keeps of them) of the sequences that guess this step."""
        if len(decoding) >= MAX_ROWS:
            return {}
        candidates: list[tuple[Sequence, Speculator, Proposal]] = []
        budget = INDEX_STEP_TOKENS
        for seq in decoding:
            if seq.speculator is None:
                continue
            ready, spent = indexed(seq.speculator, seq.history, budget)
            budget -= spent
            proposal = seq.speculator.candidate(seq.history, self._guess_room(seq)) if ready else None
            if proposal is not None:
                candidates.append((seq, seq.speculator, proposal))
        if not candidates:
            return {}
        try:
            costs = row_costs(self.model)
        except FerrumError as e:  # no room to time steps now (a full KV pool): guess later
            log.debug("speculation waits: %s", _one_line(e))
            return {}
        offers = [
            Offer(proposal, speculator.controller.acceptance(proposal.kind)) for _, speculator, proposal in candidates
        ]
        counts = plan(offers, len(decoding), costs)
        return {
            seq: Proposal(proposal.tokens[:k], proposal.kind) for (seq, _, proposal), k in zip(candidates, counts) if k
        }

    def _guess_room(self, seq: Sequence) -> int:
        """Guesses the sequence may verify after its token: the cache must hold them, and the
        answer's limit leaves room for them and the token drawn after them (the KV it was
        admitted with covers exactly that)."""
        room = self.capacity - seq.pos - 1
        if seq.request.max_tokens is not None:
            room = min(room, seq.request.max_tokens - seq.generated - 1)
        return room

    def _accept_guessed(self, seq: Sequence, rows: Logits, proposal: Proposal) -> None:
        """Keep the guesses the sampler draws too, cut the others from the cache, and hand the
        kept ones and the draw after them to `_accept` one by one, as plain steps would."""
        assert seq.speculator is not None
        try:
            kept, drawn = accepted_ids(seq.sampler, rows, proposal.tokens)
            start = seq.pos
            if kept < len(proposal.tokens):
                self.model.truncate_kv(seq.cache_id, start + 1 + kept)
            seq.speculator.record(proposal, kept)
            self.stats.proposed_tokens += len(proposal.tokens)
            self.stats.accepted_tokens += kept
            for i, token_id in enumerate([*proposal.tokens[:kept], drawn]):
                seq.pos, seq.next_token = start + 1 + i, None  # its cache holds what plain steps would have fed
                self._accept(seq, token_id)
                if seq.next_token is None:  # finished
                    return
        except Exception as e:  # this sequence's draws or detokenizer: fail it, not the others
            log.exception("accepting guessed tokens failed")
            if seq in self._running:
                seq.emit(Failed(_one_line(e)))
                self._release(seq, "error")

    def _unified_step(self) -> list[tuple[Sequence, Logits]]:
        """One unified_forward: every decoding sequence's token, then prefill chunks in
        admission order while the step's token budget lasts."""
        parts: list[tuple[Sequence, list[int], bool]] = []
        budget = self.step_tokens
        for seq in self._decoding():
            parts.append((seq, [fed_token(seq)], True))
            budget -= 1
        for seq in self._prefilling():
            if budget <= 0 and parts:
                break
            chunk = seq.unprefilled[: max(1, budget)]
            parts.append((seq, chunk, len(chunk) == len(seq.unprefilled)))
            budget -= len(chunk)
        items = [ForwardItem(seq.cache_id, tokens, seq.pos, final) for seq, tokens, final in parts]
        logits = self.model.unified_forward(items)
        for seq, tokens, _ in parts:
            self._advance(seq, len(tokens))
        return [(seq, row) for (seq, _, final), row in zip(parts, logits) if final and row is not None]

    def _split_step(self) -> list[tuple[Sequence, Logits]]:
        """Whole prefills of new sequences, then one batched decode of the others."""
        decoding = self._decoding()
        finals: list[tuple[Sequence, Logits]] = []
        for seq in self._prefilling():
            logits = self.model.prefill(seq.cache_id, seq.unprefilled)
            self._advance(seq, len(seq.unprefilled))
            finals.append((seq, logits))
        if not decoding:
            return finals
        if self.mode != SINGLE:
            try:
                block = self.model.decode_batch([DecodeItem(s.cache_id, fed_token(s), s.pos) for s in decoding])
                rows = [block[i] for i in range(len(decoding))]
            except UnsupportedError:
                self.mode = SINGLE
        if self.mode == SINGLE:
            rows = [self.model.decode(s.cache_id, fed_token(s), s.pos) for s in decoding]
        for seq in decoding:
            self._advance(seq, 1)
        return finals + list(zip(decoding, rows))

    def _decoding(self) -> list[Sequence]:
        """The sequences with a sampled token to feed (`fed_token`) this step."""
        return [s for s in self._running if s.next_token is not None]

    def _prefilling(self) -> list[Sequence]:
        """The sequences with prompt tokens to compute, but those waiting for their leader."""
        return [s for s in self._running if s.unprefilled and s.leader is None]

    @staticmethod
    def _advance(seq: Sequence, n: int) -> None:
        seq.pos += n
        if seq.unprefilled:
            seq.unprefilled = seq.unprefilled[n:]
        else:
            seq.next_token = None

    def _accept_all(self, finals: list[tuple[Sequence, Logits]]) -> None:
        for (seq, _), token in zip(finals, self._sample_all(finals)):
            try:
                self._accept(seq, token)
            except Exception as e:  # e.g. its detokenizer: fail this sequence, not the others in the step
                log.exception("accepting a token failed")
                if seq in self._running:
                    seq.emit(Failed(_one_line(e)))
                    self._release(seq, "error")

    @staticmethod
    def _sample_all(finals: list[tuple[Sequence, Logits]]) -> list[int]:
        """One token id per row. Rows under a grammar are sampled with their masks (filled
        together, on the grammar engine's threads); the others exactly as without them."""
        matchers = {i: seq.request.matcher for i, (seq, _) in enumerate(finals) if seq.request.matcher is not None}
        if not matchers:
            return Scheduler._sample_free(finals)
        constrained = list(matchers)
        masks = np.empty((len(constrained), matchers[constrained[0]].vocab.words), dtype=np.int32)
        fill_masks([(matchers[i], row) for row, i in enumerate(constrained)], masks)
        lazy = {i: finals[i][0].sampler.sample(finals[i][1], masks[row]) for row, i in enumerate(constrained)}
        free = [i for i in range(len(finals)) if i not in lazy]
        ids = dict(zip(free, Scheduler._sample_free([finals[i] for i in free])))
        ids.update({i: finals[i][0].sampler.read(token) for i, token in lazy.items()})
        return [ids[i] for i in range(len(finals))]

    @staticmethod
    def _sample_free(finals: list[tuple[Sequence, Logits]]) -> list[int]:
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

    def _accept(self, seq: Sequence, token: int) -> None:
        if seq.generated == 0:  # its prompt is in the cache: requests that start alike share it now
            self.model.kv_remember(seq.cache_id, seq.request.prompt_ids)
            log.info("%s", prefix_line(seq))
        seq.answer_ids.append(token)
        if seq.speculator is not None:
            seq.history.append(token)
        self.stats.generated_tokens += 1
        for event in seq.answer.add(token):
            seq.emit(event)
        reason = seq.answer.reason
        if reason is None and seq.pos + 1 > self.capacity:
            reason = CONTEXT
        if reason is None:
            seq.next_token = token
        else:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        for event in seq.answer.finish():
            seq.emit(event)
        seq.emit(seq.answer.done(reason, len(seq.request.prompt_ids), seq.cached, seq.speculation))
        if seq.speculation is not None and seq.speculation.steps:
            log.info("%s", speculation_line(seq))
        self._remember_answer(seq)
        self._release(seq, reason)

    def _remember_answer(self, seq: Sequence) -> None:
        """Keep the prompt and answer cached after the release (a client's next request
        sends both back); a failure here must not stop the loop."""
        try:
            held = min(self.model.kv_len(seq.cache_id), seq.pos)  # a finished step's later guesses are no answer
            self.model.kv_remember(seq.cache_id, seq.held_tokens(held))
        except Exception:
            log.exception("remembering %s failed", seq.cache_id)

    def _release(self, seq: Sequence, reason: str) -> None:
        self._running.remove(seq)  # first: a release that fails must not leave it running
        self._count(reason)
        self._release_cache(seq.cache_id)

    def _release_cache(self, cache_id: str) -> None:
        try:
            self.model.release(cache_id)
        except Exception:  # release is idempotent; a broken one must not stop the loop
            log.exception("releasing %s failed", cache_id)

    def _fail_one(self, handle: RequestHandle, message: str) -> None:
        if handle.request.emit is not None:
            try:
                handle.request.emit(Failed(message))
            except Exception:
                pass
        self._count("error")

    def _count(self, reason: str) -> None:
        self.stats.requests[reason] = self.stats.requests.get(reason, 0) + 1

    def _update_gauges(self) -> None:
        self.stats.active = len(self._running)
        self.stats.waiting = len(self._waiting) + self._inbox.qsize()
        self.stats.kv_tokens = sum(self.model.kv_len(s.cache_id) for s in self._running)
        self.stats.kv_tokens_allocated = self.model.kv_allocated_tokens() or 0
        self.stats.kv_tokens_used = self.model.kv_used_tokens() or 0
        now = time.monotonic()
        if self.prefix_cache and (now - self._prefix_read >= PREFIX_STATS_S or not self._running):
            self.stats.prefix = _snapshot(self.model.kv_prefix_stats())
            self._prefix_read = now


def prefix_line(seq: Sequence) -> str:
    """What `ferrum serve --verbose` logs of a request once its prompt is in the cache."""
    prompt = len(seq.request.prompt_ids)
    line = f"{seq.cache_id}: {seq.cached} of {prompt} prompt tokens reused from the prefix cache"
    return f"{line} (miss: {seq.miss})" if seq.miss else line


def speculation_line(seq: Sequence) -> str:
    """What `ferrum serve --verbose` logs of a request that speculated, when it ends."""
    stats = seq.speculation
    assert stats is not None
    return f"{seq.cache_id}: {stats.accepted} of {stats.proposed} guessed tokens accepted in {stats.steps} verify steps"


def _snapshot(prefix: PrefixStats | None) -> PrefixStats | None:
    """A copy /metrics may read on another thread while the model counts on."""
    return None if prefix is None else dataclasses.replace(prefix, misses=dict(prefix.misses))


def _one_line(e: BaseException) -> str:
    """An exception as one line for an error event: its message's first line, or its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
