"""docs/ARCHITECTURE.md names files that exist: a module moved without the walk-through following fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"`(ferrum_mac/[^`\s]+)`")


def test_every_path_the_walk_through_names_exists():
    named = PATH.findall((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert len(named) > 20, "the walk-through should name its files as `ferrum_mac/...` paths"
    missing = sorted({path for path in named if not (ROOT / path).exists()})
    assert missing == [], f"docs/ARCHITECTURE.md names files that are gone: {missing}"
