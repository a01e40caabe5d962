"""Several models behind one server, each on its own scheduler: loaded on first use, unloaded
after its keep-alive idle time, so an idle server holds only what keep-alive says.

The request's `model` picks among the default model (what `ferrum serve MODEL` names) and the
models in the local store (`ferrum list`'s names, and the aliases and repo ids `ferrum run`
takes); a client never names a path. A model not loaded yet is opened on a worker thread
(concurrent requests for it wait for that one load); when its weights (the store's size, plus
a quarter for its KV and activations) do not fit the free memory, idle models are unloaded
first, least recently used first, else the request is refused naming who holds the memory.

Each model unloads once it has had no request for its keep-alive: `keep_alive_s` seconds (the
server's `--keep-alive`, or the last request's own), 0 right after each answer, FOREVER never.
A keep-alive is read as Ollama writes it, seconds or a Go duration (`keep_alive_seconds`).
Unloading stops its scheduler, which drops the model on its own thread, then collects and
empties the allocators' caches, so the memory really goes back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool

from ferrum_mac.errors import FerrumError
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.api_errors import hide_paths
from ferrum_mac.serve.batching.scheduler import Scheduler, SchedulerStats
from ferrum_mac.store import in_use
from ferrum_mac.store.catalog import LocalModel

log = logging.getLogger("ferrum.serve")

FOREVER = math.inf
DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: five minutes
LONGEST_KEEP_ALIVE_S = 100 * 365 * 86400.0  # longer is forever (and past a date's range when written)
REAP_INTERVAL_S = 0.2  # how often idle models are looked at
LOAD_GRACE_S = 1.0  # a model just loaded is kept this long, so the requests that waited for it get it
KV_SHARE_OF_WEIGHTS = 0.25  # memory a model needs beyond its weights, for its KV pool and activations
NAMES_SHOWN = 20  # models named in a 404 at most
# keep-alive as Ollama writes it: Go's durations ("5m", "1h30m")
GO_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

Opener = Callable[[Path | str], Scheduler]  # a model's path or name -> its started scheduler


def keep_alive_seconds(value) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or a Go duration ("5m", "1h30m", "300ms") or a
    number as text; 0 unloads after the answer, a negative value (or over a century) never. None when absent."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _bad_keep_alive(value)
    if isinstance(value, numbers.Real):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration_seconds(value.strip())
    else:
        raise _bad_keep_alive(value)
    if not math.isfinite(seconds):
        raise _bad_keep_alive(value)
    return FOREVER if seconds < 0 or seconds > LONGEST_KEEP_ALIVE_S else seconds


def _duration_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    parts = GO_DURATION.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise _bad_keep_alive(text)
    return sign * sum(float(number) * DURATION_UNITS[unit] for number, unit in parts)


def _bad_keep_alive(value) -> api.ApiError:
    return api.ApiError(
        400,
        f'keep_alive {str(value)[:40]!r} is not a duration: give seconds (300), a duration ("5m", "1h30m"), '
        "0 to unload after the answer or -1 to keep the model loaded",
    )


@dataclass(eq=False)
class LoadedModel:
    """A model being served: its scheduler, and what the registry knows of its use."""

    name: str
    scheduler: Scheduler
    size: int  # bytes of its weights on disk
    keep_alive_s: float
    source: Path | str | None = None  # what the opener opens again; None: it cannot be reopened
    active: int = 0  # requests submitted and not finished
    idle_since: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.monotonic)
    prompting: Any = None  # the server's prompt maker for it, made on first use
    hold: in_use.Hold | None = None  # marks it loaded, so no process deletes its files meanwhile

    @property
    def path(self) -> Path | None:
        """Where its files are (None: unknown)."""
        if self.source is not None:
            return Path(self.source)
        path = getattr(self.engine, "path", None)
        return Path(path) if path is not None else None

    def files_gone(self) -> bool:
        """Whether its files were deleted while it ran (it cannot be loaded again)."""
        return self.path is not None and not self.path.exists()

    @property
    def engine(self):
        return self.scheduler.engine

    @property
    def context(self) -> int:
        return self.scheduler.capacity

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    def expires_at(self) -> float | None:
        """When (Unix time) it unloads if no request comes; None: never."""
        if self.keep_alive_s == FOREVER or self.source is None:
            return None
        left = self.keep_alive_s if self.active else self.idle_since + self.keep_alive_s - time.monotonic()
        return time.time() + max(0.0, left)

    def expired(self, now: float) -> bool:
        return (
            self.active == 0
            and self.source is not None
            and now >= self.idle_since + self.keep_alive_s
            and now >= self.loaded_at + LOAD_GRACE_S
        )


class Models:
    """The registry. `default`: the model opened at start. `opener` opens any other (and the
    default again after it was unloaded); without one, this server has only its default and
    answers every name with it (a server built around one scheduler). `catalog`: the store's
    models (`ferrum list`). `free_memory` and `release_memory` are the backend's."""

    def __init__(
        self,
        default: LoadedModel,
        opener: Opener | None = None,
        catalog: Callable[[], list[LocalModel]] | None = None,
        *,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        free_memory: Callable[[], int] | None = None,
        release_memory: Callable[[], None] | None = None,
        resolve: Callable[[str], Path | None] | None = None,
        any_name: bool = False,
    ):
        self.default_name = default.name
        self.any_name = any_name  # a name it does not have means the default model (else a 404)
        self.default_source = default.source
        self.opener = opener
        self.catalog = catalog
        self.keep_alive_s = keep_alive_s
        self.free_memory = free_memory
        self.release_memory = release_memory or (lambda: None)
        self.resolve = resolve
        self.last_stats: dict[str, SchedulerStats] = {default.name: default.stats}
        if default.hold is None and default.path is not None:
            default.hold = in_use.hold(default.path)
        self._loaded: dict[str, LoadedModel] = {default.name: default}
        self._loads: dict[str, asyncio.Future] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._reaper: threading.Thread | None = None
        if opener is not None:
            self._reaper = threading.Thread(target=self._reap, name="ferrum-models-reaper", daemon=True)
            self._reaper.start()

    # -- what the server asks -----------------------------------------------------------------

    @property
    def strict(self) -> bool:
        """Whether a name must be one this server has (else any name means the default model)."""
        return self.opener is not None

    def loaded(self) -> list[LoadedModel]:
        with self._lock:
            return list(self._loaded.values())

    def get_loaded(self, name: str | None) -> LoadedModel | None:
        """The loaded model `name` means (None, "": the default), if it is loaded."""
        with self._lock:
            return self._loaded.get(self._known_key(name) or "")

    def available(self) -> list[LocalModel]:
        """The store's complete models (slow: it scans the cache; call it on a worker thread)."""
        if self.catalog is None:
            return []
        try:
            return [m for m in self.catalog() if m.complete]
        except OSError:  # files deleted while the scan read them
            log.warning("listing the store failed", exc_info=True)
            return []

    def gone(self) -> list[str]:
        """The models, loaded or default, whose files were deleted while this server ran."""
        with self._lock:
            loaded = list(self._loaded.values())
        names = [m.name for m in loaded if m.files_gone()]
        default = self.default_source
        if self.default_name not in names and default is not None and not Path(default).exists():
            names.insert(0, self.default_name)
        return names

    def unload_for_removal(self, name: str, deletes: Callable[[Path], bool]) -> None:
        """Unload this server's idle models whose files a removal (of `name`) `deletes`; a 400
        when it deletes the default model, a 409 when a request is running on one."""
        if self.default_source is not None and deletes(Path(self.default_source)):
            raise _not_while_served(name)
        with self._lock:
            hit = [m for m in self._loaded.values() if m.path is not None and deletes(m.path)]
        for model in hit:
            if model.name == self.default_name:
                raise _not_while_served(name)
            if not self.unload(model.name):
                raise api.ApiError(
                    409, f"a request is running on {name[:200]}; delete it once that is done", code="model_busy"
                )

    async def acquire(self, name: str | None, keep_alive_s: float | None = None) -> LoadedModel:
        """The model `name` means, loaded, with one more request counted on it: the caller must
        `release` it once that request is done. 404 for a name this server does not have."""
        key = self._known_key(name)
        while True:
            with self._lock:
                model = self._loaded.get(key) if key is not None else None
                if model is not None:
                    model.active += 1
                    model.keep_alive_s = self.keep_alive_s if keep_alive_s is None else keep_alive_s
                    return model
            if key == self.default_name:
                source, size = self.default_source, size_of(self.default_source)
                await self._load_once(key, source, size)
            else:
                found, source, size = await run_in_threadpool(self._find, name or "")
                await self._load_once(found, source, size)
                key = found

    async def _load_once(self, key: str, source: Path | str | None, size: int) -> None:
        """Load `key` unless a load of it is under way already; either way, wait for it."""
        load = self._loads.get(key)
        if load is None:
            load = asyncio.ensure_future(run_in_threadpool(self._load, key, source, size))
            self._loads[key] = load
            load.add_done_callback(lambda _: self._loads.pop(key, None))
        await asyncio.shield(load)

    def release(self, model: LoadedModel) -> None:
        """One request on `model` is done (any thread)."""
        with self._lock:
            model.active = max(0, model.active - 1)
            if model.active == 0:
                model.idle_since = time.monotonic()

    def unload(self, name: str | None) -> bool:
        """Unload the model `name` means now, unless requests are running on it or it cannot be
        opened again; whether it was unloaded (blocks: call it on a worker thread)."""
        key = self._known_key(name)
        with self._lock:
            model = self._loaded.get(key or "")
            if model is None or model.active or model.source is None:
                return False
            del self._loaded[model.name]
        self._unload(model)
        return True

    def close(self) -> None:
        """Stop the reaper and every scheduler this registry opened."""
        self._closing.set()
        with self._lock:
            models = list(self._loaded.values())
            self._loaded.clear()
        for model in models:
            if model.source is not None:
                model.scheduler.stop()
            _let_go(model)

    # -- names --------------------------------------------------------------------------------

    def _known_key(self, name: str | None) -> str | None:
        """The key of a loaded model or of the default model `name` means, without looking at the store."""
        name = (name or "").strip()
        if not name or not self.strict or name == self.default_name:
            return self.default_name
        if name in self._loaded:
            return name
        base = name.removesuffix(":latest")
        return base if base in self._loaded else None

    def _find(self, name: str) -> tuple[str, Path | str | None, int]:
        """(key, what to open, size) of a model of the store; 404 when it has none by `name`."""
        base = name.strip().removesuffix(":latest")
        models = self.available()
        match = next((m for m in models if m.name == base), None)
        if match is None and self.resolve is not None:
            path = self.resolve(base)  # an alias or repo id of a model the store holds
            match = next((m for m in models if path is not None and m.path == path), None)
        if match is not None and self.default_source is not None and match.path == Path(self.default_source):
            return self.default_name, self.default_source, match.size
        if match is None and self.any_name:
            log.info("answering a request for '%s' with %s (--any-model)", name[:200], self.default_name)
            return self.default_name, self.default_source, size_of(self.default_source)
        if match is None:
            raise self._not_found(name, models)
        return match.name, match.path, match.size

    def _not_found(self, name: str, models: list[LocalModel]) -> api.ApiError:
        names = [self.default_name] + [m.name for m in models if m.name != self.default_name]
        shown = ", ".join(names[:NAMES_SHOWN]) + (", ..." if len(names) > NAMES_SHOWN else "")
        return api.ApiError(
            404,
            f"model '{name[:200]}' not found; this server has: {shown} (`ferrum pull NAME` adds one; "
            f"a server started with --any-model answers any other name with {self.default_name})",
            param="model",
            code="model_not_found",
        )

    # -- loading and unloading (worker threads) -----------------------------------------------

    def _load(self, key: str, source: Path | str | None, size: int) -> None:
        if source is None or self.opener is None:
            raise api.ApiError(503, f"the model '{key}' was unloaded and cannot be opened again", code="unavailable")
        with self._lock:
            if key in self._loaded:
                return
        if isinstance(source, Path) and not source.exists():
            raise files_gone(key)
        self._make_room(key, size)
        try:
            hold = in_use.hold(source)
        except in_use.ModelInUseError:
            raise files_gone(key) from None
        try:
            scheduler = self._open(key, source)
        except BaseException:
            hold.release()
            raise
        model = LoadedModel(key, scheduler, size, self.keep_alive_s, source, hold=hold)
        with self._lock:
            self._loaded[key] = model
            self.last_stats[key] = model.stats
        log.info("loaded %s (context %d tokens)", key, model.context)

    def _open(self, key: str, source: Path | str) -> Scheduler:
        """The opener's scheduler for `key`; its failure a 500 whose message keeps the server's
        paths to its log, or a 410 when its files went while it loaded."""
        assert self.opener is not None
        try:
            return self.opener(source)
        except (FerrumError, OSError) as e:
            log.warning("the model '%s' failed to load from %s: %s", key, source, e)
            if isinstance(source, Path) and not source.exists():
                raise files_gone(key) from None
            raise api.ApiError(
                500,
                f"the model '{key}' failed to load: {hide_paths(str(e))} (the server's log has more)",
                kind="server_error",
                code="load_failed",
            ) from None

    def _make_room(self, key: str, size: int) -> None:
        """Unload idle models, least recently used first, until `key`'s estimate fits; a 507
        when it cannot fit at all, a 503 naming the busy models when they hold the memory."""
        if self.free_memory is None or not size:
            return
        need = int(size * (1 + KV_SHARE_OF_WEIGHTS))
        while (free := self.free_memory()) < need:
            with self._lock:
                idle = sorted(
                    (m for m in self._loaded.values() if not m.active and m.source), key=lambda m: m.idle_since
                )
                victim = idle[0] if idle else None
                if victim is not None:
                    del self._loaded[victim.name]
                busy = [m for m in self._loaded.values() if m.active]
            if victim is not None:
                log.info("unloading %s to make room for %s", victim.name, key)
                self._unload(victim)
                continue
            wanted = f"the model '{key}' needs about {_gib(need)} of memory and {_gib(free)} is free"
            if not busy:
                raise api.ApiError(507, wanted, param="model", code="insufficient_memory")
            holders = ", ".join(f"'{m.name}' ({_gib(m.size)}, {m.active} running)" for m in busy)
            raise api.ApiError(
                503, f"{wanted}; {holders} hold the rest: try again when they are done", code="model_busy"
            )

    def _unload(self, model: LoadedModel) -> None:
        model.scheduler.unload()
        model.prompting = None  # it holds the engine
        _let_go(model)
        self.release_memory()
        log.info("unloaded %s; its memory released", model.name)

    def _reap(self) -> None:
        while not self._closing.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                expired = [m for m in self._loaded.values() if m.expired(now)]
                for model in expired:
                    del self._loaded[model.name]
            for model in expired:
                log.info("unloading %s after %.0f s idle", model.name, model.keep_alive_s)
                try:
                    self._unload(model)
                except Exception:
                    log.exception("unloading %s failed", model.name)


def served_name(typed: str) -> str:
    """The name clients use for the model `typed` opened: a folder or file given as a path goes
    by its own name (`stories260K`, `model-Q4_K_M` for a .gguf), since a request never names a
    path; an alias or repo id as typed."""
    path = Path(typed).expanduser()
    if not path.exists():
        return typed
    return path.stem if path.is_file() else path.resolve().name


def size_of(source: Path | str | None) -> int:
    """Bytes a model's files take (a .gguf file or a folder's weights)."""
    if source is None:
        return 0
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin"))
    return 0


def _let_go(model: LoadedModel) -> None:
    """Drop the model's mark: its files may be deleted now."""
    if model.hold is not None:
        model.hold.release()


def _not_while_served(name: str) -> api.ApiError:
    return api.ApiError(400, f"{name[:200]} is the model this server was started with; stop the server to delete it")


def files_gone(key: str) -> api.ApiError:
    """A 410 for a model whose files were deleted while the server ran."""
    return api.ApiError(
        410,
        f"the files of the model '{key}' were deleted while this server ran; `ferrum pull` it again "
        "or restart the server",
        param="model",
        code="model_files_gone",
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
