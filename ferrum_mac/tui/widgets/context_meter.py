"""Context used of capacity as a small bar; warns as it nears capacity. `pending`: what the
prompt's attachments will add when sent, counted in the bar and shown as "+N"."""

from __future__ import annotations

from textual.widgets import Static

WARN_AT = 0.8
BAR = 10


class ContextMeter(Static):
    DEFAULT_CSS = """
    ContextMeter { width: auto; padding: 0 1; }
    ContextMeter.warning { color: $warning; text-style: bold; }
    """

    def show(self, used: int, capacity: int, pending: int = 0) -> None:
        added = f"+{pending}" if pending else ""
        if not capacity:  # a server that does not say its context length
            self.set_class(False, "warning")
            self.update(f"ctx {used}{added} tok")
            return
        share = (used + pending) / capacity
        filled = min(BAR, round(share * BAR))
        warning = share >= WARN_AT
        self.set_class(warning, "warning")
        note = " nearly full" if warning else ""
        self.update(f"ctx {'█' * filled}{'░' * (BAR - filled)} {used}{added}/{capacity}{note}")
