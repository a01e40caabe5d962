"""The tiers stay honest: the fast tier fits its minutes, a heavy file keeps its tier when it
moves, and no test asserts that something finished within so many seconds (a loaded machine
fails those; assert an order or a count, or guard a hang with a generous timeout)."""

from __future__ import annotations

import re

import tiers

# Seconds per worker the fast tier may cost as measured: the table's figures came from a
# loaded machine (load average 8 on 2 cores, some 3x a quiet one's), so scripts/test --fast
# takes well under 5 minutes on a quiet one.
FAST_BUDGET_S = 240
WORKERS = 2

CLOCK = r"(?:monotonic|perf_counter|time)\(\)"
WITHIN_SECONDS = [
    re.compile(rf"assert\b.*{CLOCK}\s*-\s*[\w.]+\s*<"),  # assert time.monotonic() - start < 2
    re.compile(r"assert\b.*\belapsed\b.*<"),  # assert response.elapsed.total_seconds() < 1
]


def test_the_fast_tier_fits_its_minutes():
    fast = sum(cost.fast for cost in tiers.file_costs().values() if cost.fast <= tiers.SLOW_FILE_S)
    assert fast / WORKERS < FAST_BUDGET_S, f"lower SLOW_FILE_S in {tiers.__file__}"


def test_every_slow_file_in_the_table_is_there():
    """A heavy file moved or renamed would join the fast tier unseen: rename it in the table
    too (or rerun scripts/test-costs.py)."""
    slow = [name for name, cost in tiers.file_costs().items() if cost.fast > tiers.SLOW_FILE_S]
    missing = [name for name in slow if not (tiers.TESTS / name).is_file()]
    assert slow and not missing, f"moved? give their new names in {tiers.FILE_COSTS.name}: {missing}"


def test_a_file_the_table_does_not_name_is_fast():
    costs = {"serve/test_x.py": tiers.Cost(every=99.0, fast=99.0)}
    assert tiers.is_slow(tiers.TESTS / "serve" / "test_x.py", costs)
    assert not tiers.is_slow(tiers.TESTS / "serve" / "test_not_measured_yet.py", costs)


def test_no_test_asserts_it_finished_within_seconds():
    found = [
        f"{path.relative_to(tiers.TESTS)}:{number}: {line.strip()}"
        for path in sorted(tiers.TESTS.rglob("*.py"))
        if path.name != "test_tiers.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(pattern.search(line) for pattern in WITHIN_SECONDS)
    ]
    assert not found, "\n".join(found)
