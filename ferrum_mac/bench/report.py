"""What both benchmark sides share, whatever the framework: a run's timing, alternating
runs, and the side-by-side table."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator


@dataclass
class Timing:
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    peak_memory_gb: float

    def as_dict(self) -> dict:
        return {k: round(v, 4) for k, v in asdict(self).items()}


def timed(
    tokens: Iterator[int], prompt_len: int, new_tokens: int, settle: Callable[[], None], peak_gb: Callable[[], float]
) -> Timing:
    """Time a stream of generated tokens. Time to first token covers the prompt (prefill) and
    the first sampled token; decode tok/s counts the tokens after the first over the time
    after the first, as mlx-lm reports it. `settle` waits for queued device work and resets
    the peak-memory counter that `peak_gb` then reads."""
    settle()
    start = time.perf_counter()
    first, count = None, 0
    for _ in tokens:
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == new_tokens:
            break
    end = time.perf_counter()
    if hasattr(tokens, "close"):
        tokens.close()  # lets the generator release its cache now
    ttft = first - start
    return Timing(
        ttft_s=ttft,
        prefill_tps=prompt_len / ttft,
        decode_tps=(count - 1) / (end - first) if count > 1 else 0.0,
        peak_memory_gb=peak_gb(),
    )


def interleaved(runs: int, sides: dict[str, Callable[[], Timing]]) -> dict[str, Timing]:
    """Warm every side up, then alternate their timed runs so drift (clocks, other load)
    falls on all of them alike; each side reports its best rates."""
    for once in sides.values():
        once()
    results: dict[str, list[Timing]] = {name: [] for name in sides}
    for _ in range(runs):
        for name, once in sides.items():
            results[name].append(once())
    return {name: best(timings) for name, timings in results.items()}


def best(results: list[Timing]) -> Timing:
    return Timing(
        ttft_s=min(r.ttft_s for r in results),
        prefill_tps=max(r.prefill_tps for r in results),
        decode_tps=max(r.decode_tps for r in results),
        peak_memory_gb=max(r.peak_memory_gb for r in results),
    )


def side_by_side(r: dict, runs: int, peer_key: str, peer_title: str) -> list[str]:
    """The header and the four rows (prefill, decode, time to first token, peak memory)."""
    ours, theirs = r["ferrum"], r[peer_key]
    rows = [
        ("prefill tok/s", "prefill_tps", "{:.1f}", r["prefill_ratio"]),
        ("decode tok/s", "decode_tps", "{:.1f}", r["decode_ratio"]),
        ("time to first token ms", "ttft_s", "{:.1f}", None),
        ("peak memory GB", "peak_memory_gb", "{:.2f}", None),
    ]
    width = max(10, len(peer_title) + 2)
    lines = [
        f"{r['model']} on {r['device']}: {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, best of {runs}",
        f"{'':24}{'ferrum':>10}{peer_title:>{width}}{'ratio':>8}",
    ]
    for title, key, fmt, ratio in rows:
        scale = 1000 if key == "ttft_s" else 1
        mine = fmt.format(ours[key] * scale)
        peer = fmt.format(theirs[key] * scale) if theirs else "-"
        lines.append(f"{title:24}{mine:>10}{peer:>{width}}{(f'{ratio:.2f}x' if ratio else ''):>8}")
    return lines
