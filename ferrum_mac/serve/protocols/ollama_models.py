"""The store's models as Ollama describes them (/api/tags, /api/show, /api/ps entries: details,
digests, Modelfile parameters, capabilities) and a pull's progress as Ollama's /api/pull objects.
`protocols.ollama` answers those routes with these."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from ferrum_mac.engine import SamplingParams
from ferrum_mac.errors import FerrumError, ModelNotFoundError
from ferrum_mac.serve import checks as api
from ferrum_mac.serve.api_errors import hide_paths
from ferrum_mac.store import LocalModel, ModelFacts, PullProgress, describe_model, pull_model
from ferrum_mac.store.describe import read_config
from ferrum_mac.text import chat_templates

log = logging.getLogger("ferrum.serve")

# -- the store's models, as Ollama describes them ------------------------------------------------


def iso_time(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def digest_of(name: str, size: int, modified: float) -> str:
    """A stable id for one version of a model (Ollama's is its manifest's sha256; ferrum has none,
    so this hashes what identifies the files)."""
    return hashlib.sha256(f"{name}\0{size}\0{modified}".encode()).hexdigest()


def parameter_size(count: int | None) -> str:
    """135000000 -> "135M", as Ollama shows it."""
    if not count:
        return ""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(count)


def family_of(path: Path, facts: ModelFacts | None) -> str:
    """The architecture's short name ("llama", "qwen3"): a GGUF's own, else config.json's model_type."""
    if path.suffix == ".gguf":
        return (facts.architecture if facts else None) or ""
    model_type = read_config(path).get("model_type")
    return model_type if isinstance(model_type, str) else ""


def facts_of(path: Path) -> ModelFacts | None:
    try:
        return describe_model(path)
    except (FerrumError, OSError, ValueError):  # a damaged header: listed with what is known
        return None


def details(path: Path, fmt: str, quant: str, facts: ModelFacts | None) -> dict:
    family = family_of(path, facts)
    return {
        "parent_model": "",
        "format": fmt,
        "family": family,
        "families": [family] if family else None,
        "parameter_size": parameter_size(facts.parameters if facts else None),
        "quantization_level": quant,
    }


def tag_entry(model: LocalModel) -> dict:
    """One model of /api/tags (reads the model's headers: call on a worker thread)."""
    return {
        "name": model.name,
        "model": model.name,
        "modified_at": iso_time(model.modified),
        "size": model.size,
        "digest": digest_of(model.name, model.size, model.modified),
        "details": details(model.path, model.format, model.quant, facts_of(model.path)),
    }


def local_entry(name: str, path: Path) -> LocalModel:
    """A model that is not in the store (the server's default, given as a folder or file); one
    whose files were deleted while it ran is listed with size 0 (it still answers from memory)."""
    try:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        size, modified = sum(p.stat().st_size for p in files), path.stat().st_mtime
    except OSError:
        size, modified = 0, 0.0
    facts = facts_of(path)
    fmt = facts.format if facts else ("gguf" if path.suffix == ".gguf" else "safetensors")
    quant = facts.quantization if facts else "?"
    return LocalModel(name, path, size, quant, fmt, modified)


def model_parameters(sampling: SamplingParams, stops: tuple[str, ...] = ()) -> str:
    """The model's defaults as a Modelfile's PARAMETER lines (without the word)."""
    lines = [f"temperature {sampling.temperature:g}", f"top_p {sampling.top_p:g}"]
    if sampling.top_k:
        lines.append(f"top_k {sampling.top_k}")
    if sampling.min_p:
        lines.append(f"min_p {sampling.min_p:g}")
    if sampling.repetition_penalty != 1.0:
        lines += [f"repeat_penalty {sampling.repetition_penalty:g}", f"repeat_last_n {sampling.penalty_window}"]
    lines += [f"stop {json.dumps(s)}" for s in stops]
    return "\n".join(lines)


def capabilities(template: str) -> list[str]:
    """What Ollama's clients look for, as this server can do it: "completion"; "tools" for every
    model (a template without a tool section gets the tools described in a system message, and
    the grammar writes the calls); "thinking" where the template has a reasoning switch or block."""
    found = ["completion", "tools"]
    if "enable_thinking" in template or "<think>" in template or "reasoning_content" in template:
        found.append("thinking")
    return found


def show_body(model: LocalModel, sampling: SamplingParams, context: int | None) -> dict:
    """/api/show's answer (reads the model's headers and template: call on a worker thread)."""
    facts = facts_of(model.path)
    template = chat_templates(model.path).get("default", "")
    info = details(model.path, model.format, model.quant, facts)
    family = info["family"] or "general"
    parameters = model_parameters(sampling)
    context = context or (facts.context_length if facts else None)
    modelfile = "\n".join(
        [f"# Modelfile of {model.name} (ferrum)", f"FROM {model.name}", f'TEMPLATE """{template}"""']
        + [f"PARAMETER {line}" for line in parameters.splitlines()]
    )
    model_info: dict[str, Any] = {"general.architecture": family}
    if facts and facts.parameters:
        model_info["general.parameter_count"] = facts.parameters
    if context:
        model_info[f"{family}.context_length"] = context
    return {
        "license": (facts.license if facts else None) or "",
        "modelfile": modelfile,
        "parameters": parameters,
        "template": template,
        "details": info,
        "model_info": model_info,
        "capabilities": capabilities(template),
        "modified_at": iso_time(model.modified),
    }


# -- pulls ---------------------------------------------------------------------------------------


class QueueProgress(PullProgress):
    """A pull's progress as Ollama's objects, `{"status", "digest", "total", "completed"}`, handed
    to `put` (from the pull's thread). ferrum knows a file by its path in the repository, so the
    path stands where Ollama puts a blob's digest. Sent at file starts and ends and at most every
    PROGRESS_EVERY_S seconds between."""

    def __init__(self, put: Callable[[dict], None]):
        self.put = put
        self.current: list | None = None  # [path, size, bytes done]
        self.sent_at = 0.0
        self.stopped = threading.Event()

    def stop_pull(self) -> None:
        """End the pull at its next chunk (from any thread): what it fetched stays, to resume."""
        self.stopped.set()

    def file_started(self, path: str, size: int, resume_from: int) -> None:
        self._unless_stopped()
        self.current = [path, size, resume_from]
        self._send()

    def advance(self, n: int) -> None:
        self._unless_stopped()
        if self.current is not None:
            self.current[2] += n
            if time.monotonic() - self.sent_at >= PROGRESS_EVERY_S:
                self._send()

    def file_done(self, path: str) -> None:
        if self.current is not None:
            self.current[2] = self.current[1]
            self._send()
        self.current = None

    def _unless_stopped(self) -> None:
        if self.stopped.is_set():
            raise PullStopped("the pull was stopped (its client left, or the server is stopping)")

    def _send(self) -> None:
        path, size, done = self.current  # type: ignore[misc]
        self.sent_at = time.monotonic()
        self.put({"status": f"pulling {path}", "digest": path, "total": size, "completed": min(done, size)})


PROGRESS_EVERY_S = 0.1
PULL_DONE = object()


class PullStopped(FerrumError):
    """A pull ended because nobody waits for it any more."""


def start_pull(name: str, backend: str, queue: asyncio.Queue) -> QueueProgress:
    """Pull `name` on a worker thread, its objects into `queue`, ending with PULL_DONE or an
    `ApiError` whatever happens; `stop_pull()` on what this returns ends it early."""
    loop = asyncio.get_running_loop()

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (the server stopped): nobody reads it
            pass

    progress = QueueProgress(put)

    def work() -> None:
        try:
            pull_model(name, backend, progress)
        except FerrumError as e:
            put(pull_error(e))
        except BaseException as e:  # never a pull that ends with no last line
            log.exception("pulling %s failed", name)
            put(api.ApiError(500, f"pulling {name} failed ({type(e).__name__}); see the server's log"))
        else:
            put(PULL_DONE)

    # its own thread, not the loop's pool: a server that stops does not wait for a download
    threading.Thread(target=work, name=f"ferrum-pull {name[:40]}", daemon=True).start()
    return progress


def pull_error(error: FerrumError) -> api.ApiError:
    status = 404 if isinstance(error, ModelNotFoundError) else 502  # else the Hub or the disk failed
    return api.ApiError(status, hide_paths(str(error)))


async def pull_updates(queue: asyncio.Queue) -> AsyncIterator[dict | api.ApiError]:
    """A pull's objects, from "pulling manifest" to "success"; a failure is the last item."""
    yield {"status": "pulling manifest"}
    while (item := await queue.get()) is not PULL_DONE:
        yield item
        if isinstance(item, api.ApiError):
            return
    yield {"status": "success"}
