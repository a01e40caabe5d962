"""Decode steps: one token for each of `rows` sequences whose blocks fit a block table
`width` blocks wide, run from static input buffers.

A step's shapes depend only on the pool (its version) and `(rows, width)`, never on
positions, tokens or which blocks a sequence holds, which it reads from device buffers. On
CUDA each step is therefore captured once as a CUDA graph and replayed for every later
token: one launch instead of hundreds of kernel launches from Python, which is most of a
decode step's time otherwise. Elsewhere (the CPU) the same step runs eagerly from the same
buffers.

Rows past the batch decode token 0 at position 0 into the scratch block and are dropped.
A row's table goes up only when its blocks change (a sequence gains a block every
`block_tokens` tokens), so a step's host work is the batch's tokens and positions. Steps are
kept per `(rows, width)`; when the pool is reallocated every step is dropped, so a stale
graph is never replayed.

A prefill step (`PrefillStep`) is the same idea for a fresh prompt: its tokens padded to a
few fixed lengths, its forward captured once per length (`FreshPlan`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch

from ferrum_mac.backends.torch.attention import DecodePlan, FreshPlan
from ferrum_mac.backends.torch import quant
from ferrum_mac.backends.torch.kv import KvManager, host_ids
from ferrum_mac.backends.torch.ops import TORCH_OPS, decode_ops
from ferrum_mac.backends.options import DEFAULTS, BackendOptions

MAX_STEPS = 24  # captured graphs kept (least recently used dropped first)


class CapturedStep:
    """A forward over static input buffers: captured once as a CUDA graph and replayed (`run`)
    where `graphs` is a CUDA graph pool, else run eagerly. Subclasses own the buffers and the forward."""

    def __init__(self, device: torch.device, graphs):
        self.device, self.graphs = device, graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured = graphs is not None
        self.out: torch.Tensor | None = None

    def forward(self) -> torch.Tensor:
        raise NotImplementedError

    def run(self) -> torch.Tensor:
        """The forward's output, in a new tensor (a graph's output buffer is reused)."""
        if not self.captured:
            return self.forward()
        if self.graph is None:
            self.capture()
        if self.graph is None:  # capture failed: stay eager
            return self.forward()
        self.graph.replay()
        return self.out.clone()

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
            with torch.cuda.graph(graph, pool=self.graphs):
                self.out = self.forward()
            self.graph = graph
        except RuntimeError as e:
            self.captured = False
            print(f"ferrum: running without CUDA graphs ({str(e).splitlines()[0]})", file=sys.stderr)


class DecodeStep(CapturedStep):
    def __init__(
        self,
        model,
        pool: KvManager,
        rows: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        graphs,
        sequences: int | None = None,
        options: BackendOptions = DEFAULTS,
        windowed=None,
    ):
        """`windowed`: the windowed layers' `WindowedKv`, whose pool a row's second table names."""
        super().__init__(device, graphs)
        self.model, self.pool, self.rows, self.width, self.dtype = model, pool, rows, width, dtype
        self.sequences = sequences or rows  # (`DecodePlan`'s: a verify's rows are one sequence's)
        self.inputs = torch.zeros(2 * rows, dtype=torch.int64, device=device)  # tokens, positions
        self.tokens, self.positions = self.inputs[:rows], self.inputs[rows:]
        self.table = torch.zeros((rows, width), dtype=torch.int64, device=device)  # all scratch
        self.uploaded: list[list[int]] = [[] for _ in range(rows)]  # each row's blocks in `table`
        self.windowed = windowed
        self.window_table = torch.zeros((rows, width), dtype=torch.int64, device=device) if windowed else None
        self.window_uploaded: list[list[int]] = [[] for _ in range(rows)]
        # Triton's kernels on CUDA: captured once, so their launches cost nothing
        self.ops = decode_ops(device, options, verify=self.sequences < rows)

    def load(self, batch: list[tuple]) -> None:
        """Copy this step's inputs to its buffers without waiting on the device. `batch`: row i's
        (token, position, blocks); later rows go to the scratch block. Host ids go up in one
        pinned copy; device tokens (a sampled token not read yet) are copied on the device."""
        tokens, positions = [0] * self.rows, [0] * self.rows
        on_device = {}
        for row, (token, pos, blocks, *window) in enumerate(batch):
            if isinstance(token, torch.Tensor):
                on_device[row] = token
            else:
                tokens[row] = int(token)
            positions[row] = pos
            self._load_table_row(row, blocks)
            if self.window_table is not None:
                self._load_table_row(row, window[0], self.window_table, self.window_uploaded)
        for row in range(len(batch), self.rows):
            self._load_table_row(row, [])
            if self.window_table is not None:
                self._load_table_row(row, [], self.window_table, self.window_uploaded)
        self.inputs.copy_(host_ids(tokens + positions, self.device), non_blocking=True)
        if len(on_device) == self.rows:
            self.tokens.copy_(torch.stack([on_device[r].reshape(()) for r in range(self.rows)]))
        else:
            for row, token in on_device.items():
                self.tokens[row].copy_(token.reshape(()))

    def _load_table_row(self, row: int, blocks: list[int], table=None, uploaded=None) -> None:
        """Send row `row`'s blocks (scratch past them) unless its table holds them already."""
        table = self.table if table is None else table
        uploaded = self.uploaded if uploaded is None else uploaded
        if uploaded[row] != blocks:
            table[row].copy_(host_ids(blocks + [0] * (self.width - len(blocks)), self.device), non_blocking=True)
            uploaded[row] = list(blocks)

    def forward(self) -> torch.Tensor:
        plan = DecodePlan(self.pool, self.table, self.positions, self.dtype, self.ops, self.sequences)
        if self.window_table is not None:  # attended by torch's own ops (`Attention.ops_for`)
            plan.windowed = DecodePlan(
                self.windowed.pool, self.window_table, self.positions, self.dtype, TORCH_OPS, self.sequences
            )
        # device tokens are never read on the host: clip them so an id past the vocabulary
        # cannot index past the embedding (a device assert that ends the CUDA context)
        tokens = self.tokens.clamp(0, self.model.config.vocab_size - 1)
        return self.model.logits(self.model.hidden(tokens, plan), plan.ops)


class PrefillStep(CapturedStep):
    """A fresh prompt of up to `rows` tokens whose blocks fit a table `width` blocks wide
    (`FreshPlan`): its tokens padded to `rows`; the logits of its last token."""

    def __init__(self, model, pool: KvManager, rows: int, width: int, device: torch.device, graphs):
        super().__init__(device, graphs)
        self.model, self.pool, self.rows, self.width = model, pool, rows, width
        self.inputs = torch.zeros(rows + 1, dtype=torch.int64, device=device)  # tokens, then their count
        self.tokens, self.count = self.inputs[:rows], self.inputs[rows:]
        self.table = torch.zeros(width, dtype=torch.int64, device=device)

    def run(self) -> torch.Tensor:
        with quant.scratch_lock:  # its packed matmuls dequantize into the buffer models share
            return super().run()

    def load(self, tokens: list[int], blocks: list[int]) -> None:
        """Copy a prompt's (checked) tokens and its blocks to the buffers without waiting."""
        padded = tokens + [0] * (self.rows - len(tokens)) + [len(tokens)]
        self.inputs.copy_(host_ids(padded, self.device), non_blocking=True)
        self.table.copy_(host_ids(blocks + [0] * (self.width - len(blocks)), self.device), non_blocking=True)

    def forward(self) -> torch.Tensor:
        plan = FreshPlan(self.pool, self.table, self.count, self.rows)
        h = self.model.hidden(self.tokens, plan)
        return self.model.logits(h.index_select(0, self.count - 1))[0]


class DecodeSteps:
    """Captured steps by their shapes, least recently used dropped first: decode steps by
    `(rows, width, sequences)`, prefill steps by `(rows, width)`."""

    def __init__(
        self,
        model,
        pool: KvManager,
        dtype: torch.dtype,
        device: torch.device,
        options: BackendOptions = DEFAULTS,
        windowed=None,
    ):
        """On CUDA the steps are captured as CUDA graphs unless `options` say not
        (FERRUM_TORCH_CUDA_GRAPHS=0: eagerly, for debugging and A/B timing); `windowed`: the
        windowed layers' `WindowedKv`, when the model has one."""
        self.model, self.pool, self.dtype, self.device, self.options = model, pool, dtype, device, options
        self.windowed = windowed
        self.captured = device.type == "cuda" and options.torch_cuda_graphs
        self.graphs = torch.cuda.graph_pool_handle() if self.captured else None  # shared by all graphs
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.version = (pool.version, windowed.pool.version if windowed else 0)

    def get(self, rows: int, width: int, sequences: int | None = None) -> DecodeStep:
        key = (rows, width, sequences or rows)
        return self._kept(
            key,
            lambda: DecodeStep(
                self.model,
                self.pool,
                rows,
                width,
                self.dtype,
                self.device,
                self.graphs,
                sequences,
                self.options,
                self.windowed,
            ),
        )

    def prefill(self, rows: int, width: int) -> PrefillStep:
        key = ("prefill", rows, width)
        return self._kept(key, lambda: PrefillStep(self.model, self.pool, rows, width, self.device, self.graphs))

    def _kept(self, key: tuple, make):
        version = (self.pool.version, self.windowed.pool.version if self.windowed else 0)
        if version != self.version:  # a pool was reallocated: every graph is stale
            self.clear()
            self.version = version
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = make()
            while len(self.steps) > MAX_STEPS:
                self.steps.popitem(last=False)
        self.steps.move_to_end(key)
        return step

    def clear(self) -> None:
        self.steps.clear()
        # The memory pool dies with its last graph; capturing into its handle again fails an
        # internal assert in PyTorch's allocator, so later graphs get a new pool.
        self.graphs = torch.cuda.graph_pool_handle() if self.captured else None
