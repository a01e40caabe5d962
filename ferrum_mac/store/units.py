"""Numbers for people: byte sizes and ages."""

from __future__ import annotations

import time


def human_bytes(n: float) -> str:
    """1234567 -> "1.2 MB" (decimal units, as disk and network tools show them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_age(timestamp: float, now: float | None = None) -> str:
    """A Unix time -> "5 minutes ago", "3 days ago"."""
    seconds = max(0, (now if now is not None else time.time()) - timestamp)
    for unit, size in (
        ("year", 365 * 86400),
        ("month", 30 * 86400),
        ("week", 7 * 86400),
        ("day", 86400),
        ("hour", 3600),
        ("minute", 60),
    ):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"
