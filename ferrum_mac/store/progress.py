"""How a pull reports itself. `PullProgress` is silent; `TerminalProgress` draws a bar per file
and one for the total (bytes, rate, ETA) on a terminal, and prints one line per finished file
when the output is a log or a pipe."""

from __future__ import annotations

import sys
import time

from ferrum_mac.store.units import human_bytes

SMALL_FILE = 1_000_000  # finished files below this leave the live display


class PullProgress:
    """Receives a pull's events; subclass it to show them (a TUI, a server log)."""

    def start(self, title: str, files: list[tuple[str, int, int]]) -> None:
        """`files`: (path, size, bytes already on disk) of every file still to fetch."""

    def file_started(self, path: str, size: int, resume_from: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def file_done(self, path: str) -> None: ...

    def note(self, line: str) -> None: ...

    def stop(self) -> None: ...


class TerminalProgress(PullProgress):
    def __init__(self, file=None):
        from rich.console import Console

        self.console = Console(file=file or sys.stderr, highlight=False)
        self.live_view = self.files = self.total = None
        self.total_task = self.file_task = None
        self.current: tuple[str, int, int, float] | None = None  # path, size, resumed bytes, start time
        self.hf_verbosity: int | None = None

    def start(self, title: str, files: list[tuple[str, int, int]]) -> None:
        total = sum(size for _, size, _ in files)
        have = sum(done for _, _, done in files)
        resumed = f", {human_bytes(have)} already here" if have else ""
        self.note(f"{title}: {len(files)} file{'s' if len(files) != 1 else ''}, {human_bytes(total)}{resumed}")
        self._quiet_hf_warnings()
        if self.console.is_terminal:
            from rich.console import Group
            from rich.live import Live

            # two bar sets in one live view, so the total stays below the growing list of files
            self.files, self.total = _rich_bars(self.console), _rich_bars(self.console)
            self.total_task = self.total.add_task("total", total=total, completed=have)
            self.live_view = Live(Group(self.files, self.total), console=self.console, refresh_per_second=8)
            self.live_view.start()

    def file_started(self, path: str, size: int, resume_from: int) -> None:
        self.current = (path, size, resume_from, time.monotonic())
        if self.files is not None:
            self.file_task = self.files.add_task(_short(path), total=size, completed=resume_from)

    def advance(self, n: int) -> None:
        if self.files is not None:
            self.files.advance(self.file_task, n)
            self.total.advance(self.total_task, n)

    def file_done(self, path: str) -> None:
        _, size, resumed, began = self.current
        self.current = None
        if self.files is not None:
            if size < SMALL_FILE:
                self.files.update(self.file_task, visible=False)  # a dozen finished config files is clutter
            return
        rate = (size - resumed) / max(time.monotonic() - began, 1e-6)
        note = f" (resumed at {human_bytes(resumed)})" if resumed else ""
        self.note(f"  {path:<40} {human_bytes(size):>10}  {human_bytes(rate)}/s{note}")

    def note(self, line: str) -> None:
        self.console.print(line, markup=False, soft_wrap=True)

    def stop(self) -> None:
        if self.live_view is not None:
            self.live_view.stop()
            self.live_view = self.files = self.total = None
        if self.hf_verbosity is not None:
            from huggingface_hub.utils import logging as hf_logging

            hf_logging.set_verbosity(self.hf_verbosity)
            self.hf_verbosity = None

    def _quiet_hf_warnings(self) -> None:
        """huggingface_hub logs "trying to resume" on a dropped connection; it would tear the bars."""
        from huggingface_hub.utils import logging as hf_logging

        self.hf_verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()


def _rich_bars(console):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(
        TextColumn("  {task.description:<24}"),
        BarColumn(bar_width=None),
        TaskProgressColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        expand=True,
    )


def _short(path: str, width: int = 24) -> str:
    return path if len(path) <= width else "…" + path[-(width - 1) :]
