"""Continuous batching: many requests on one model, one forward per step, on one thread.

Each turn of the loop takes in what clients submitted, drops what they cancelled, admits
waiting requests (`Batch`), asks the planner for the next step (`planner.plan_step`: every
decoding sequence's next token plus prefill chunks of newly admitted ones under a token
budget, shaped by what the model can do, its `Capabilities`) and runs it (`StepRunner`). A
decoding sequence gets a token every step, so a long prompt never stalls the others for more
than one chunk. Requests are admitted first come, first served, while the batch has room and
the KV the model would hold with them all at their full length (prompt plus max_tokens; the
pool's whole shape) fits what free memory held at start.

The thread owns the model. Clients talk to it only through `submit` (a queue) and
`RequestHandle.cancel`; events go back through each request's `emit`. The scheduler never
imports MLX or torch: it asks the model for a sampler per request, as the engine does.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from ferrum_mac.engine import LocalEngine, Timing
from ferrum_mac.engine.speculation.setting import OFF
from ferrum_mac.engine.speculation.verify import Speculator
from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import DecodeItem, DecoderOnlyLLM, KvCapacityError, room_advice
from ferrum_mac.serve.batching.batch import Batch, SchedulerStats, one_line
from ferrum_mac.serve.batching.planner import UNIFIED, mode_of, plan_step
from ferrum_mac.serve.batching.request import GenerationRequest, RequestHandle
from ferrum_mac.serve.batching.runner import StepRunner
from ferrum_mac.serve.batching.speculation import Pace, StepCosts, check_mode

__all__ = ["MAX_BATCH", "STEP_TOKENS", "Scheduler", "SchedulerStats"]

log = logging.getLogger("ferrum.serve")

MAX_BATCH = 32  # sequences decoding together
STEP_TOKENS = 512  # tokens one forward may carry (decode tokens plus prefill chunks)
WARMUP_ID = "scheduler-warm-up"


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
        self.verifies = True  # the model runs verify_batch (known once it is loaded)
        self.pace = Pace()
        self.mode = UNIFIED  # how steps run (`planner.mode_of` the model's capabilities, once loaded)
        self.stats = SchedulerStats()
        self._inbox: queue.Queue = queue.Queue()
        self._started = False
        self._stopping = False
        self._unloading = False  # stop() was unload(): drop the model once the loop ends
        self._stopped = threading.Event()
        self._looping = False  # set while the loop runs; False before start, after stop and if it died
        self.death: str | None = None  # why the loop ended, when it ended by an error no guard caught

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
                + room_advice(self.capacity, self.model.config.max_seq_len),
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
            self.death = one_line(e)
            log.exception("the scheduler loop died")
        finally:
            self._looping = False
            try:
                if self.death is None:
                    self.batch.cancel_running()
                message = "the server is stopping" if self.death is None else f"the server failed ({self.death})"
                self._drain_inbox()  # no loop will read it again
                self.batch.fail_everyone(message)
            except BaseException:  # the thread must still park (see _run)
                log.exception("failing the requests left failed")

    def _loop(self) -> None:
        batch = self.batch
        while not self._stopping:
            try:
                self._take_new(block=not batch.running and not batch.waiting)
                batch.drop_cancelled()
                batch.admit(self.max_batch, self.kv_budget, self._speculator)
                batch.wake_followers()
                if batch.running:
                    self.runner.run_or_fail(plan_step(batch.running, self.mode, self.step_tokens), self.pace)
                batch.update_gauges(self._inbox.qsize())
            except Exception as e:  # outside any one request: fail what is in flight, keep serving
                log.exception("scheduler step failed")
                batch.fail_everyone(one_line(e))

    def _take_new(self, block: bool) -> None:
        """What clients submitted, into the batch's waiting list (`block`: wait a while for some)."""
        if block:
            try:
                item = self._inbox.get(timeout=0.5)
            except queue.Empty:
                return
            if item is not None:
                self.batch.waiting.append(item)
        self._drain_inbox()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self.batch.waiting.append(item)

    def _speculator(self, request: GenerationRequest) -> Speculator | None:
        """A request's guesser, unless it may not guess: speculation off, a grammar (each row
        would need its mask), log-probabilities asked for (a guessed token has no row of its own
        in the batch's accepting), a model without a batched verify or whose state cannot be cut back."""
        mode = request.speculate or self.speculate
        if (
            mode == OFF
            or request.matcher is not None
            or request.logprobs is not None
            or not self.verifies
            or not self.model.state.cuts_back
        ):
            return None
        return self.costs.speculator()

    def _load(self) -> None:
        self._engine = engine = self._open_engine()
        self.model: DecoderOnlyLLM = engine.model
        self.tokenizer = engine.tokenizer
        self.capacity = self.model.kv_capacity()
        capabilities = self.model.capabilities
        self.mode, self.verifies = mode_of(capabilities), capabilities.batched_verify
        self.model.prepare(WARMUP_ID, 16)  # compiles kernels and captures graphs before any request
        self.model.release(WARMUP_ID)
        if capabilities.batched_decode:
            self._warm_up_batches()
        self.batch = Batch(self.model, self.tokenizer, frozenset(engine.eos_ids), self.stats)
        self.costs = StepCosts()  # the step times speculation weighs guesses by
        self.runner = StepRunner(self.batch, self.model, self.costs)
        if self.kv_budget is None:
            self.kv_budget = self.model.state.free_tokens()  # None: only the batch size limits admission

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
                self.model.decode_batch([DecodeItem(c, 0, self.model.state.length(c)) for c in ids[:rows]])
                rows *= 2
        finally:
            for cache_id in ids:
                self.model.release(cache_id)

    def _drop_model(self) -> None:
        try:
            self.model.reset()  # on this thread: MLX's arrays belong to it
        except Exception:
            log.exception("resetting the model before unloading it failed")
        self._engine = None
        del self.model, self.tokenizer, self.batch, self.costs, self.runner
