"""What the step-profiling scripts share: the CUDA kernels a few steps ran (through
torch.profiler, whose CUPTI tracing sees every kernel of the process, MLX's and those
replayed from CUDA graphs included), tabled by name, with how much of the steps' wall time
the GPU was busy."""

import time


def profile_steps(step, steps: int, sync, top: int = 30) -> None:
    """Runs `step()` `steps` times under the profiler (then `sync()`), and prints the wall time
    per step, the GPU's busy time per step (the union of kernel intervals) and the kernels by
    device time per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - start) / steps * 1e3
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps / 1e3
    print(f"  wall {wall:.3f} ms/step (profiled), GPU busy {busy:.3f} ms/step, {len(kernels) / steps:.0f} kernels/step")
    totals: dict[str, list[float]] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.end - e.time_range.start
        entry[1] += 1
    print(f"  {'us/step':>9} {'count/step':>10} {'us each':>8}  name")
    for name, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / steps:9.1f} {count / steps:10.1f} {us / count:8.2f}  {name[:100]}")


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total
