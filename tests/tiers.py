"""Test tiers by measured cost: which files are slow as a whole, and which the workers take first.

tests/file_costs.toml holds, per test file, what a run of every tier spent on all its tests
and on those no mark makes heavy (scripts/test-costs.py writes it). A file whose latter cost
is over SLOW_FILE_S is slow: a module's server or model is paid once per file, so its cheap
tests go with it. A file the table does not name (new or moved) is cheap until it is rewritten.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import NamedTuple

TESTS = Path(__file__).parent
FILE_COSTS = TESTS / "file_costs.toml"
# Sized so the fast tier stays a few minutes on 2 cores (test_tiers.py checks the sum).
SLOW_FILE_S = 20.0


class Cost(NamedTuple):
    """Seconds a test file took: all its tests, and those no mark makes heavy."""

    every: float = 0.0
    fast: float = 0.0


def file_costs() -> dict[str, Cost]:
    """The measured costs, by each file's path under tests/."""
    with FILE_COSTS.open("rb") as f:
        return {name: Cost(**row) for name, row in tomllib.load(f)["seconds"].items()}


def cost_of(path: Path, costs: dict[str, Cost]) -> Cost:
    """What the test file at `path` cost when measured; nothing for one not measured."""
    try:
        return costs.get(path.relative_to(TESTS).as_posix(), Cost())
    except ValueError:  # outside tests/
        return Cost()


def is_slow(path: Path, costs: dict[str, Cost]) -> bool:
    return cost_of(path, costs).fast > SLOW_FILE_S
