"""Grammar checks with a bound on their cost: child processes that stop at a CPU or memory limit, or when their client leaves.

A 1 KB schema can cost the grammar engine minutes and gigabytes (an `allOf` of a few dozen
`.*a.*` patterns), and the engine has no way to stop a compile it started, so the server checks
each request's new grammars in a child process (`guard_worker`) first: past `cpu_s` of CPU or
`memory_mb` of memory the child ends and the request is refused as too complex; a request whose
client leaves has its child killed. What passes compiles in the server within about the same
cost. Verdicts are kept by grammar text, so a schema sent again is not checked again, and at
most `workers` children run at once: the rest of the server keeps its cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ferrum_mac.grammar.guard_worker import CPU_EXIT, MEMORY_EXIT
from ferrum_mac.grammar.lru import SizedLru
from ferrum_mac.grammar.schema import GrammarError, grammar_error

WORKER_SOURCE = Path(__file__).with_name("guard_worker.py")
KEPT_VERDICTS = 4096


class SchemaTooComplex(GrammarError):
    """A grammar whose check passed the CPU, memory or time bound."""


@dataclass(frozen=True)
class GuardLimits:
    """What checking one request's grammars may cost: CPU seconds and memory of its child, and
    wall-clock seconds (None: three times the CPU bound, plus a start); children at once."""

    cpu_s: float = 10.0
    memory_mb: int = 512
    workers: int = max(1, min(4, (os.cpu_count() or 2) // 2))
    wall_s: float | None = None

    @property
    def deadline_s(self) -> float:
        return self.wall_s if self.wall_s is not None else 3 * self.cpu_s + 5


@dataclass
class GuardStats:
    """Checks by outcome (ok, invalid, too_complex, abandoned: the client left; cached: no child
    needed) and the seconds children spent on them: for `/metrics`."""

    checks: Counter = field(default_factory=Counter)
    seconds: float = 0.0


@dataclass(frozen=True)
class _TooComplex:
    reason: str


Verdict = str | _TooComplex | None  # the engine's error, a bound passed, or None: it compiles
_COMPILES = ""  # how a verdict of None is kept (the cache's None means "not checked")


class GrammarGuard:
    """Checks grammars in bounded child processes (see the module); one per server, used on its event loop."""

    def __init__(self, limits: GuardLimits = GuardLimits()):
        self.limits = limits
        self.stats = GuardStats()
        self._verdicts = SizedLru(KEPT_VERDICTS, 16 * 2**20)
        self._idle: list[_Worker] = []
        self._slots: asyncio.Semaphore | None = None
        self._ending: set[asyncio.Task] = set()  # waits for killed children, so none is left unreaped

    async def check(self, grammars: Sequence[tuple[str, str]]) -> list[GrammarError | None]:
        """For each `(grammar text, what it is)`, the error compiling it would give (None: it
        compiles); `SchemaTooComplex` for one past the bounds. Checking stops at the first error
        (the rest are None). Cancelled (its client left), its child is killed."""
        texts = [text for text, _ in grammars]
        if any(self._verdicts.get(text) is None for text in texts):
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.limits.workers)
            async with self._slots:
                await self._run([text for text in dict.fromkeys(texts) if self._verdicts.get(text) is None])
        else:
            self.stats.checks["cached"] += len(texts)
        errors: list[GrammarError | None] = [None] * len(grammars)
        for i, (text, what) in enumerate(grammars):
            verdict = self._verdicts.get(text)
            if verdict is not None and verdict != _COMPILES:
                errors[i] = self._error(verdict, what)
                break
        return errors

    async def close(self) -> None:
        """End the idle children and wait for every child ended so far (a running check ends
        its own when cancelled)."""
        for worker in self._idle:
            self._end(worker)
        self._idle.clear()
        await asyncio.gather(*self._ending, return_exceptions=True)

    async def _run(self, texts: list[str]) -> None:
        if not texts:
            return
        start = time.monotonic()
        try:
            verdicts = await self._verdicts_of(texts)
        finally:
            self.stats.seconds += time.monotonic() - start
        for text, verdict in zip(texts, verdicts):
            self._keep(text, verdict)
            outcome = "ok" if verdict is None else "too_complex" if isinstance(verdict, _TooComplex) else "invalid"
            self.stats.checks[outcome] += 1

    async def _verdicts_of(self, texts: list[str]) -> list[Verdict]:
        for attempt in range(2):
            worker = await self._worker()
            verdicts: list[Verdict] = []
            try:
                await asyncio.wait_for(worker.check(texts, verdicts), self.limits.deadline_s)
            except _Recycled:
                continue  # it had ended itself after its last request: a fresh one takes this
            except asyncio.TimeoutError:
                verdicts.append(_TooComplex(f"took more than {self.limits.deadline_s:g} s"))
            except BaseException:  # cancelled: the client left (or the server stops)
                self._end(worker)
                self.stats.checks["abandoned"] += 1
                raise
            if (verdicts and isinstance(verdicts[-1], _TooComplex)) or worker.ended:
                self._end(worker)
            else:
                self._idle.append(worker)
            return verdicts
        raise GrammarError("the grammar checker could not start")

    async def _worker(self) -> "_Worker":
        while self._idle:
            worker = self._idle.pop()
            if not worker.ended:
                return worker
        return await _Worker.start(self.limits)

    def _end(self, worker: "_Worker") -> None:
        """Kill `worker` and reap it in the background (`close` waits for it)."""
        worker.kill()
        task = asyncio.get_running_loop().create_task(worker.process.wait())
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    def _keep(self, text: str, verdict: Verdict) -> None:
        kept = _COMPILES if verdict is None else verdict
        self._verdicts.put(text, kept, 64 + len(kept if isinstance(kept, str) else kept.reason))

    def _error(self, verdict: Verdict, what: str) -> GrammarError:
        if isinstance(verdict, _TooComplex):
            return SchemaTooComplex(
                f"{what} is too complex to compile: checking it {verdict.reason}; simplify it "
                "(fewer patterns under allOf, fewer alternatives, smaller bounds)"
            )
        return grammar_error(str(verdict), what)


class _Recycled(Exception):
    """The child had ended itself (grown big) before taking the request."""


class _Worker:
    """One child process of `guard_worker`."""

    def __init__(self, process: asyncio.subprocess.Process, limits: GuardLimits):
        self.process = process
        self.limits = limits

    @classmethod
    async def start(cls, limits: GuardLimits) -> "_Worker":
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            WORKER_SOURCE.read_text(encoding="utf-8"),
            str(limits.cpu_s),
            str(limits.memory_mb),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return cls(process, limits)

    @property
    def ended(self) -> bool:
        return self.process.returncode is not None

    async def check(self, texts: list[str], verdicts: list[Verdict]) -> None:
        """Append each text's verdict to `verdicts` as it comes; a child that ends midway gives
        the text it was on the verdict of why."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(texts).encode() + b"\n")
            await self.process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # it ended: the read below says why
        for _ in texts:
            line = await self.process.stdout.readline()
            if not line:
                returncode = await self.process.wait()
                if returncode == 0 and not verdicts:
                    raise _Recycled()
                verdicts.append(_TooComplex(self._why(returncode)))
                return
            verdicts.append(json.loads(line))

    def _why(self, returncode: int) -> str:
        if returncode in (CPU_EXIT, -signal.SIGXCPU, -signal.SIGKILL):
            return f"took more than {self.limits.cpu_s:g} s of CPU"
        if returncode == MEMORY_EXIT or returncode == -signal.SIGABRT:
            return f"needed more than {self.limits.memory_mb} MB of memory"
        return f"stopped the grammar engine (exit status {returncode})"

    def kill(self) -> None:
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
