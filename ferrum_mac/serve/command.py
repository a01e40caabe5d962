"""`ferrum serve`: open the model on the scheduler's thread, then serve the API with uvicorn."""

from __future__ import annotations

import ipaddress
import sys

LOOPBACK = "127.0.0.1"


def serve_command(
    model: str | None, host: str, port: int, api_key: str | None, backend: str = "auto", device: str | None = None
) -> None:
    import uvicorn

    from ferrum_mac.engine import Engine
    from ferrum_mac.serve.app import build_app
    from ferrum_mac.serve.scheduler import Scheduler

    if not is_loopback(host) and not api_key:
        print(f"ferrum: serving on {host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr)
    scheduler = Scheduler(lambda: Engine.open(model, backend=backend, device=device)).start()
    name = scheduler.engine.name
    print(f"ferrum: serving {name} on http://{host}:{port}/v1 (context {scheduler.capacity} tokens)", file=sys.stderr)
    try:
        uvicorn.run(build_app(scheduler, name, api_key), host=host, port=port, log_level="warning")
    finally:
        scheduler.stop()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
