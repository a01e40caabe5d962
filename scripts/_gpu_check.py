"""What the GPU kernel check scripts share: a tolerance check that records mismatches, and
device time per call measured from a CUDA graph (no launch overhead in the figure), of calls
that may cycle through inputs (weights that together outgrow the L2 cache, as a step's layers do)."""

import itertools
import sys

import torch

TOLERANCE = 2e-2  # a couple of bf16 ulps near 1
GRAPH_CALLS, REPLAYS = 100, 5

failures: list[str] = []


def verdict() -> int:
    """Prints the mismatches (or that there were none); the script's exit status."""
    if failures:
        print(f"\n{len(failures)} mismatch(es):\n  " + "\n  ".join(failures))
        return 1
    print("\nall kernels match the torch path")
    return 0


def can_check(kernels_module) -> bool:
    """Whether the Triton kernels of `kernels_module` run here; if not, says why on stderr."""
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the Triton kernels on a GPU", file=sys.stderr)
        return False
    if kernels_module.triton is None:
        print("triton does not import", file=sys.stderr)
        return False
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {kernels_module.triton.__version__}")
    return True


def compare(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    bound = TOLERANCE * (1 + want.float().abs())
    if got.shape != want.shape or not bool((diff <= bound).all()):
        failures.append(
            f"{what}: max |diff| {diff.max().item():.3g}, {int((diff > bound).sum())} of {diff.numel()} out of tolerance"
        )


def graph_us(fn) -> float:
    """Device time per call of `fn`, from a CUDA graph of GRAPH_CALLS calls."""
    for _ in range(3):  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (GRAPH_CALLS * REPLAYS)


def cycling(op, inputs: list):
    """A call of `op` on the next of `inputs` each time."""
    turn = itertools.cycle(inputs)
    return lambda: op(next(turn))
