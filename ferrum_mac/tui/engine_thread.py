"""The one thread that runs the engine: opening the model, every turn, closing it.

MLX aborts the process at exit ("terminate called without an active exception") when two
different non-main threads have used it, so all engine work goes through one thread, in order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class EngineThread:
    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrum-engine")

    def run(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        """Take no more work; what is queued (closing the engine) still runs before the process exits."""
        self._pool.shutdown(wait=False)
