"""Context used of capacity as a small bar; warns as it nears capacity."""

from __future__ import annotations

from textual.widgets import Static

WARN_AT = 0.8
BAR = 10


class ContextMeter(Static):
    DEFAULT_CSS = """
    ContextMeter { width: auto; padding: 0 1; }
    ContextMeter.warning { color: $warning; text-style: bold; }
    """

    def show(self, used: int, capacity: int) -> None:
        if not capacity:  # a server that does not say its context length
            self.set_class(False, "warning")
            self.update(f"ctx {used} tok")
            return
        share = used / capacity if capacity else 0.0
        filled = min(BAR, round(share * BAR))
        warning = share >= WARN_AT
        self.set_class(warning, "warning")
        note = " nearly full" if warning else ""
        self.update(f"ctx {'█' * filled}{'░' * (BAR - filled)} {used}/{capacity}{note}")
