#!/usr/bin/env python3
"""Measure what each test file costs and write tests/file_costs.toml, which tiers the suite.

    scripts/test-costs.py              run every tier (scripts/test -q), then write the table
    scripts/test-costs.py RUN.xml      write it from a junit xml of a run of every tier
                                       (`scripts/test -q --junitxml=RUN.xml`)

A file's cost is its tests' setup, call and teardown summed, so a module's server or model
counts once: for all its tests ("every"), and for those no mark makes heavy ("fast", which
tests/conftest.py names in the xml). tests/tiers.py says what the table decides.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "tests" / "file_costs.toml"
HEADER = """\
# Seconds each test file took in one run of every tier on 2 cores (its tests' setup, call and
# teardown summed): all its tests, and those no mark makes heavy. tests/tiers.py reads it.
# Rewrite it with scripts/test-costs.py after adding or moving heavy tests.
"""


def file_of(classname: str) -> str:
    """tests.serve.test_app.TestX -> serve/test_app.py: the dotted path up to the test module."""
    parts = classname.split(".")
    modules = [i for i, part in enumerate(parts) if part.startswith("test_") or part.endswith("_test")]
    end = modules[-1] + 1 if modules else len(parts)
    path = parts[:end]
    if path and path[0] == "tests":
        path = path[1:]
    return "/".join(path) + ".py"


def file_costs(junit_xml: Path) -> dict[str, dict[str, float]]:
    costs: dict[str, dict[str, float]] = defaultdict(lambda: {"every": 0.0, "fast": 0.0})
    for case in ET.parse(junit_xml).iter("testcase"):
        cost, seconds = costs[file_of(case.get("classname", ""))], float(case.get("time") or 0)
        cost["every"] += seconds
        if any(p.get("name") == "tier" and p.get("value") == "fast" for p in case.iter("property")):
            cost["fast"] += seconds
    return dict(costs)


def table(costs: dict[str, dict[str, float]]) -> str:
    rows = sorted(costs.items(), key=lambda row: -row[1]["every"])
    return (
        HEADER
        + "\n[seconds]\n"
        + "".join(f'"{name}" = {{ every = {cost["every"]:.1f}, fast = {cost["fast"]:.1f} }}\n' for name, cost in rows)
    )


def run_every_tier(junit_xml: Path) -> int:
    return subprocess.call([str(ROOT / "scripts" / "test"), "-q", f"--junitxml={junit_xml}"], cwd=ROOT)


def main(args: list[str]) -> int:
    status = 0
    with tempfile.TemporaryDirectory() as folder:
        if args:
            junit_xml = Path(args[0])
        else:
            junit_xml = Path(folder) / "run.xml"
            status = run_every_tier(junit_xml)
            if status:
                print("test-costs: some tests failed; their files are measured all the same", file=sys.stderr)
        costs = file_costs(junit_xml)
    TABLE.write_text(table(costs))
    every, fast = (sum(cost[key] for cost in costs.values()) for key in ("every", "fast"))
    print(f"test-costs: {len(costs)} files, {every:.0f} s ({fast:.0f} s unmarked) -> {TABLE.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
