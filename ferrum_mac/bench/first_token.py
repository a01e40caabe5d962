"""Time from process start to the first byte of the answer of `ferrum run [ARGS]`, the model
already on disk: what a user waits for after pressing Enter.

    ferrum bench first-token [--runs 5] [--] [ferrum run arguments, default: hi]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path


def ferrum_command() -> list[str]:
    script = Path(sys.executable).with_name("ferrum")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ferrum_mac.cli"]


def first_byte_seconds(run_args: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(ferrum_command() + ["run", *run_args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        if not proc.stdout.read(1):
            raise SystemExit(f"ferrum run {' '.join(run_args)} printed nothing (exit {proc.wait()})")
        return time.perf_counter() - start
    finally:
        proc.kill()
        proc.wait()


def run_first_token(run_args: list[str], runs: int) -> None:
    """`ferrum bench first-token`: the best and median of `runs` starts, after one that warms the file cache."""
    first_byte_seconds(run_args)  # warm the file cache; not counted
    times = [first_byte_seconds(run_args) for _ in range(runs)]
    print(
        f"ferrum run {' '.join(run_args)}: first answer byte {min(times):.2f} s best, "
        f"{statistics.median(times):.2f} s median of {len(times)} (from process start)"
    )
