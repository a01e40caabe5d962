"""Decode steps: one token for each cache of a fixed list, run from static input buffers.

A step's shapes depend only on its caches (how many, and each one's allocation), never on
positions or tokens, which it reads from device buffers. On CUDA each step is therefore
captured once as a CUDA graph and replayed for every later token: one launch instead of
hundreds of kernel launches from Python, which is most of a decode step's time otherwise.
Elsewhere (the CPU) the same step runs eagerly from the same buffers.

Steps are kept per list of caches (a batch-size bucket that also fixes its buffers); a
cache's key changes when it is reallocated, so a stale graph is never replayed. Released
caches return to the KV pool with their graphs, so a new sequence that takes one reuses them.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict

import torch

from ferrum_mac.backends.torch.attention import DecodePlan
from ferrum_mac.backends.torch.kv import SequenceCache

# FERRUM_CUDA_GRAPHS=0 runs CUDA decode steps eagerly (for debugging and A/B timing).
USE_GRAPHS = os.environ.get("FERRUM_CUDA_GRAPHS", "1") != "0"
MAX_STEPS = 16  # captured graphs kept (least recently used dropped first)


class DecodeStep:
    def __init__(self, model, caches: list[SequenceCache], dtype: torch.dtype, device: torch.device, pool):
        self.model, self.caches, self.dtype, self.device, self.pool = model, caches, dtype, device, pool
        n = len(caches)
        self.inputs = torch.zeros(2 * n, dtype=torch.int64, device=device)  # tokens, then positions
        self.tokens, self.positions = self.inputs[:n], self.inputs[n:]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured = device.type == "cuda" and USE_GRAPHS
        self.out: torch.Tensor | None = None

    def load(self, tokens: list, positions: list[int]) -> None:
        """Copy this step's inputs to its buffers without waiting on the device: host ids go
        up in one pinned copy; device tokens (a sampled token not read yet) are copied on the device."""
        on_device = [isinstance(t, torch.Tensor) for t in tokens]
        host = torch.tensor([0 if d else int(t) for t, d in zip(tokens, on_device)] + list(positions), dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()  # a pageable copy would wait for the queued steps
        self.inputs.copy_(host, non_blocking=True)
        if all(on_device):
            self.tokens.copy_(torch.stack([t.reshape(()) for t in tokens]))
        else:
            for i, t in enumerate(tokens):
                if on_device[i]:
                    self.tokens[i].copy_(t.reshape(()))

    def run(self) -> torch.Tensor:
        """`(len(caches), vocab)` logits of a new tensor (a graph's output buffer is reused)."""
        if not self.captured:
            return self.forward()
        if self.graph is None:
            self.capture()
        if self.graph is None:  # capture failed: stay eager
            return self.forward()
        self.graph.replay()
        return self.out.clone()

    def forward(self) -> torch.Tensor:
        plan = DecodePlan(self.caches, self.positions, self.dtype)
        return self.model.logits(self.model.hidden(self.tokens, plan))

    def capture(self) -> None:
        try:
            # Warm up on a side stream first: lazy initialisation (cuBLAS workspaces) may not
            # happen during capture. Its cache writes are the very ones the step makes.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.out = self.forward()
            self.graph = graph
        except RuntimeError as e:
            self.captured = False
            print(f"ferrum: decoding without CUDA graphs ({str(e).splitlines()[0]})", file=sys.stderr)


class DecodeSteps:
    """Decode steps by the caches they serve, least recently used dropped first."""

    def __init__(self, model, dtype: torch.dtype, device: torch.device):
        self.model, self.dtype, self.device = model, dtype, device
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None  # shared by all graphs
        self.steps: OrderedDict[tuple, DecodeStep] = OrderedDict()

    def get(self, caches: list[SequenceCache]) -> DecodeStep:
        key = tuple(c.key for c in caches)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = DecodeStep(self.model, caches, self.dtype, self.device, self.pool)
            while len(self.steps) > MAX_STEPS:
                self.steps.popitem(last=False)
        self.steps.move_to_end(key)
        return step

    def clear(self) -> None:
        self.steps.clear()
