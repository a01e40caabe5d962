"""`ferrum ps` and `ferrum stop`: what a running server has loaded, and unloading a model from it.

Both speak Ollama's API (`/api/ps`; `/api/generate` with `keep_alive` 0, as `ollama stop`
sends), which `ferrum serve` has on every port. Without `--remote` they look where `ferrum
serve` listens, then where `ferrum serve --ollama` does.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone

from ferrum_mac.errors import FerrumError

CONNECT_TIMEOUT_S = 2.0
TIMEOUT_S = 60.0  # an unload waits for the model's running answers to end


def ps_command(remote: str | None, api_key: str | None) -> None:
    root, http = _server(remote, api_key)
    models = _json(http.get(f"{root}/api/ps"), root).get("models") or []
    if not models:
        print(f"No models loaded on {root}.")
        return
    from ferrum_mac.cli.store_commands import print_table

    rows = [_row(m) for m in models]
    print_table(["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"], rows)


def stop_command(model: str, remote: str | None, api_key: str | None) -> None:
    root, http = _server(remote, api_key)
    loaded = [m.get("name") for m in _json(http.get(f"{root}/api/ps"), root).get("models") or []]
    if model not in loaded:
        running = ", ".join(str(name) for name in loaded) or "none"
        raise FerrumError(f"{model} is not loaded on {root} (loaded: {running}); `ferrum ps` lists them")
    _json(http.post(f"{root}/api/generate", json={"model": model, "keep_alive": 0}), root)
    print(f"stopped {model}")


def _server(remote: str | None, api_key: str | None):
    """The server's root URL (no /v1) and a client for it; a FerrumError when none answers."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.Client(headers=headers, timeout=httpx.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S))
    places = [_root(remote)] if remote else _default_roots()
    for root in places:
        try:
            http.get(f"{root}/health")
            return root, http
        except httpx.TransportError:
            continue
    where = " or ".join(places)
    hint = "check the URL" if remote else "start one with `ferrum serve`, or give --remote URL"
    raise FerrumError(f"no server is running at {where} ({hint})")


def _default_roots() -> list[str]:
    from ferrum_mac.serve.command import DEFAULT_PORT, LOOPBACK, ServeOptionError, ollama_address

    roots = [f"http://{LOOPBACK}:{DEFAULT_PORT}"]
    try:
        host, port = ollama_address(os.environ.get("OLLAMA_HOST"))
        roots.append(f"http://{host}:{port}")
    except ServeOptionError:  # a bad OLLAMA_HOST is `ferrum serve --ollama`'s error to report
        pass
    return roots


def _root(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def _json(response, root: str) -> dict:
    """The body of a good answer, else the server's error as one line."""
    from ferrum_mac.remote import error_message

    if response.status_code >= 400:
        raise FerrumError(f"{root}: {error_message(response)} (HTTP {response.status_code})")
    try:
        return response.json()
    except ValueError:
        raise FerrumError(f"{root} did not answer as ferrum serve or Ollama does (no JSON)") from None


def _row(model: dict) -> list[str]:
    from ferrum_mac.store.units import human_bytes

    size = int(model.get("size") or 0)
    processor = "GPU" if int(model.get("size_vram") or 0) else "CPU"
    return [
        str(model.get("name", "?")),
        human_bytes(size) if size else "?",
        processor,
        str(model.get("context_length") or "?"),
        _until(str(model.get("expires_at") or "")),
    ]


def _until(expires: str) -> str:
    """`expires_at` as people read it: "in 4 minutes", "forever"."""
    try:
        when = datetime.fromisoformat(expires.replace("Z", "+00:00"))
    except ValueError:
        return expires or "?"
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    seconds = (when - datetime.now(timezone.utc)).total_seconds()
    if seconds > 10 * 365 * 86400:
        return "forever"
    if seconds < 60:
        return "in under a minute" if seconds > 0 else "now"
    minutes = round(seconds / 60)
    if minutes < 120:
        return f"in {minutes} minute{'s' if minutes != 1 else ''}"
    return f"in {round(minutes / 60)} hours"
