"""`TorchLLM`: the `DecoderOnlyLLM` contract on PyTorch (CUDA or the CPU).

Prefill and mixed batches are one eager forward over a `Plan` of segments (`PooledLLM`
keeps the bookkeeping and checks). Decode steps (`decode`, `decode_batch`) and short
verifies (`verify_batch`, a row per token) run as a `DecodeStep` of fixed shapes, captured as
a CUDA graph on a GPU. Device tokens (not
checked: that would wait for them) are clipped into the vocabulary inside the decode step
(`steps.py`), as an embedding lookup past its end is a device assert that ends the CUDA
context.
"""

from __future__ import annotations

import numbers

from typing import Sequence

import torch

from ferrum_mac.backends.state.padding import power_of_two_above, quarter_octave_above
from ferrum_mac.backends.state.manager import PooledState
from ferrum_mac.backends.state.pooled_llm import PooledLLM, model_family, named_dtype, pool_limits
from ferrum_mac.backends.state.recurrent import RecurrentStates, recurrent_tokens
from ferrum_mac.backends.state.windowed import WindowedKv
from ferrum_mac.backends.torch.attention import Plan, Segment
from ferrum_mac.backends.torch.kv import BLOCK_TOKENS, KvManager
from ferrum_mac.backends.torch.memory import free_memory_bytes, resolve_device
from ferrum_mac.backends.torch.models import FAMILIES
from ferrum_mac.backends.options import DEFAULTS, BackendOptions
from ferrum_mac.backends.torch.kernels import switches
from ferrum_mac.backends.torch.steps import DecodeSteps
from ferrum_mac.backends.torch.weights import DTYPES, TensorSource, dtype_name
from ferrum_mac.llm import DecodeItem, LlmRuntimeConfig, kv_capacity_within
from ferrum_mac.weights import Checkpoint

WARMUP_TOKENS = 8
# The narrowest decode table, in blocks: short sequences share one captured step (a CUDA
# graph) instead of one per width they pass; attention reads only each row's own length.
MIN_WIDTH = 8
# On CUDA a verify of at most this many tokens in all runs as decode rows (a CUDA graph); on the
# CPU a forward costs less than that many decode steps' rows.
VERIFY_ROWS = 64


def compute_dtype(checkpoint: Checkpoint, override: str | None) -> torch.dtype:
    if override:
        return named_dtype(override, DTYPES)
    if checkpoint.config.quantization:  # dequantized at load, to the dtype of its scales
        scales = next((t for n, t in checkpoint.tensors.items() if n.endswith(".scales")), None)
        return DTYPES.get(dtype_name(scales), torch.float16) if scales is not None else torch.float16
    return DTYPES.get(checkpoint.config.dtype, torch.float16)


def prefill_rows(n: int) -> int:
    """The padded length of a captured prefill of `n` tokens (64, 80, 96, 112, 128, 160, ...),
    so few graphs serve every prompt."""
    return quarter_octave_above(n, 64)


class TorchLLM(PooledLLM):
    device_array_types = (torch.Tensor,)
    segment_type = window_segment_type = Segment
    prefill_graph_tokens = 1024  # a fresh prompt of at most this many tokens runs as a captured `PrefillStep`

    def __init__(
        self,
        checkpoint: Checkpoint,
        dtype: str | None = None,
        device: str | torch.device | None = None,
        kv_capacity: int | None = None,
        quant: str | None = None,
        packed: bool | None = None,
        options: BackendOptions = DEFAULTS,
    ):
        """`quant` ("4bit", "8bit"): a dense checkpoint's linear layers quantized as they load;
        `packed`: whether quantized weights stay packed (default: on CUDA; dequantized on the CPU);
        `options`: the backends' switches (the torch_* ones)."""
        c = checkpoint.config
        family = model_family(FAMILIES, c.model_type, "torch")
        self.device = resolve_device(device)
        switches.use(options)
        self.dtype = compute_dtype(checkpoint, dtype)
        with torch.inference_mode():
            source = TensorSource(
                checkpoint.tensors, c, self.dtype, self.device, str(checkpoint.path), packed, quant, options
            )
            self.model = family(source, c)
        checkpoint.tensors.clear()  # the model holds what it needs (fused copies included)
        self.model_config = c
        self.source = checkpoint
        self._config = LlmRuntimeConfig.of_model(c, str(self.dtype).removeprefix("torch."))
        element = torch.tensor([], dtype=self.dtype).element_size()
        self._capacity = kv_capacity_within(self._config, free_memory_bytes(self.device), element, kv_capacity)
        with torch.inference_mode():
            self.model.rope.build(self._capacity)
        max_blocks, cache_blocks = pool_limits(
            self._config, free_memory_bytes(self.device), element, BLOCK_TOKENS, options.prefix_cache_mb
        )
        windowed = [i for i, w in enumerate(c.layer_windows) if w]
        self.recurrent = bool(c.recurrent_layers)  # (its steps run eagerly: a captured step keeps no recurrent state)
        if self.recurrent:  # (the prefix cache keeps no recurrent state: nothing to reuse)
            cache_blocks = 0
        disk = cache_blocks and not windowed  # (the disk tier keeps every layer's blocks: none with windows)
        self.kv = KvManager(
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            self._capacity,
            max_blocks,
            cache_blocks,
            self._prefix_disk(checkpoint, f"torch-{self.device.type}", options) if disk else None,
            layers=[i for i in range(c.num_layers) if i not in windowed and i not in c.recurrent_layers],
        )
        self.windowed = None
        if windowed:
            pool = KvManager(
                c.num_layers,
                c.num_kv_heads,
                c.head_dim,
                self.dtype,
                self.device,
                self._capacity,
                max_blocks,
                layers=windowed,
            )
            self.windowed = WindowedKv(pool, max(c.layer_windows), self.kv.prefix)
        self._state = PooledState(
            self.kv,
            self._config,
            self.device_array_types,
            self._computing,
            windowed=self.windowed,
            recurrent=RecurrentStates(recurrent_tokens(c, self._config, element)) if self.recurrent else None,
        )
        self.steps = DecodeSteps(self.model, self.kv, self.dtype, self.device, options, self.windowed)
        # (a captured prefill writes the full pool only: a windowed model prefills eagerly)
        self.captured_prefill = (
            self.steps.captured and self.windowed is None and not self.recurrent
        )  # off once a capture fails
        self.verify_rows = VERIFY_ROWS if self.device.type == "cuda" and not self.recurrent else 0

    # -- contract -------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, cache_id: str, max_tokens: int) -> None:
        """Make room for `max_tokens` more of `cache_id`, then warm up on it: a short prefill and
        one decode step past what it holds, cut off again; on CUDA the one-row decode steps of
        every table width up to `max_tokens` are captured too, so no decode of it pauses to
        capture one."""
        tokens = min(max(1, max_tokens), self._capacity)
        cache = self.kv.prepare(cache_id, tokens)
        held = cache.length
        # (past a held sequence, a windowed model's warm-up would move its window on: none)
        # (nor a recurrent one's: its states cannot be cut back after)
        warm = min(WARMUP_TOKENS, self._capacity - held - 1) if not (held and (self.windowed or self.recurrent)) else 0
        if warm >= 1:
            self._forward([(cache_id, [0] * warm, held)])
            self.decode(cache_id, 0, held + warm)
        self.state.truncate(cache_id, held)
        self._capture_decode_steps(held + tokens)

    def _capture_decode_steps(self, tokens: int) -> None:
        """Capture the one-row steps of widths MIN_WIDTH, twice that ... up to `tokens`' blocks; their row is
        outside any batch, so it writes only the scratch block."""
        widest = max(MIN_WIDTH, power_of_two_above(self.kv.blocks_for(min(tokens, self._capacity))))
        width = MIN_WIDTH
        while width <= widest and not self.recurrent:
            step = self.steps.get(1, width)
            if not step.captured:
                return  # eager steps (the CPU): nothing to capture
            if step.graph is None:
                step.load([])
                step.run()
            width *= 2

    def reset(self) -> None:
        self.state.reset()
        self.steps.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sampler(self, params, context: Sequence[int] = ()):
        from ferrum_mac.backends.torch.sampling import TorchSampler

        return TorchSampler(params, context, self._config.vocab_size, self.device)

    # -- the forwards (PooledLLM keeps the bookkeeping around them) ----------------------

    def _computing(self):
        return torch.inference_mode()

    def _hidden(
        self,
        token_parts: list[list[int]],
        segments: list[Segment],
        windowed: list | None = None,
        recurrent: list | None = None,
    ) -> torch.Tensor:
        ids = token_tensor(token_parts, self._config.vocab_size, self.device)
        plan = Plan(segments, self.device)
        if windowed is not None:  # the windowed layers' pool
            plan.windowed = Plan(windowed, self.device)
        plan.recurrent = recurrent
        return self.model.hidden(ids, plan)

    def _logits_at(self, h: torch.Tensor, rows) -> torch.Tensor:
        return self.model.logits(h if rows == slice(None) else h[rows])

    def _fresh_prompt(self, cache_id: str, tokens: list[int]) -> torch.Tensor | None:
        """A prompt of up to `prefill_graph_tokens` as a captured `PrefillStep` (CUDA only)."""
        if not (self.captured_prefill and len(tokens) <= self.prefill_graph_tokens):
            return None
        cache = self.kv.acquire(cache_id)
        self.kv.reserve(cache, 0, len(tokens))
        width = max(MIN_WIDTH, power_of_two_above(len(cache.blocks)))
        step = self.steps.prefill(prefill_rows(len(tokens)), width)
        step.load(tokens, cache.blocks)
        logits = step.run()
        self.captured_prefill = step.captured  # (a model whose forward cannot be captured runs as before)
        cache.length = len(tokens)
        return logits

    def _verify(self, segments) -> torch.Tensor:
        """Verifies of a few tokens in all run as one `DecodeStep` (a CUDA graph), a row per
        token: row `i` of a segment sits at its position and reads the keys up to it, which
        its earlier rows wrote in the same step, so attention is causal as in a forward."""
        rows = sum(len(tokens) for _, tokens, _ in segments)
        if rows > self.verify_rows:
            return super()._verify(segments)
        caches = [self.kv.acquire(cache_id) for cache_id, _, _ in segments]
        for cache, (_, tokens, offset) in zip(caches, segments):
            self.kv.reserve(cache, offset, offset + len(tokens))
        windows = self._place_windows([(c, o, o + len(t)) for c, t, o in segments])
        batch = [
            (token, offset + i, cache.blocks, *window)
            for cache, window, (_, tokens, offset) in zip(caches, windows, segments)
            for i, token in enumerate(tokens)
        ]
        logits = self._step_over(batch, max(len(cache.blocks) for cache in caches), len(segments))
        for cache, (cache_id, tokens, offset) in zip(caches, segments):
            cache.length = offset + len(tokens)
            self._windows_hold(cache_id, cache.length)
        return logits

    def _windows_hold(self, cache_id: str, length: int) -> None:
        if self.windowed is not None:
            self.windowed.pool.get(cache_id).length = length

    def _place_windows(self, spans: list[tuple[str, int, int]]) -> list[tuple]:
        """Each (cache_id, start, end)'s windowed blocks (`WindowedKv.place`): a one-item tuple
        of its block table, or none without a windowed pool."""
        if self.windowed is None:
            return [()] * len(spans)
        return [(self.windowed.place(cache_id, start, end).blocks,) for cache_id, start, end in spans]

    def _step_over(self, batch: list[tuple], blocks: int, sequences: int | None = None) -> torch.Tensor:
        """`(len(batch), vocab)` logits of one `DecodeStep` over `batch`'s (token, position,
        blocks) rows of `sequences` sequences (default: one a row): rows, table width and
        sequences rounded up to powers of two, so a server's changing batches share few steps."""
        width = max(MIN_WIDTH, power_of_two_above(blocks))
        rows = power_of_two_above(len(batch))
        step = self.steps.get(rows, width, power_of_two_above(sequences) if sequences else rows)
        step.load(batch)
        logits = step.run()
        return logits if len(batch) == step.rows else logits[: len(batch)]

    def _decode_batch(self, items: Sequence[DecodeItem]) -> torch.Tensor:
        """One `DecodeStep` over the batch's sequences (a recurrent model: one eager forward)."""
        if self.recurrent:
            return self._logits_at(self._forward([(it.cache_id, it.token, it.pos) for it in items]), slice(None))
        caches = [self.kv.acquire(it.cache_id) for it in items]
        for cache, it in zip(caches, items):
            self.kv.reserve(cache, it.pos, it.pos + 1)
        windows = self._place_windows([(it.cache_id, it.pos, it.pos + 1) for it in items])
        batch = [(it.token, it.pos, cache.blocks, *window) for cache, window, it in zip(caches, windows, items)]
        logits = self._step_over(batch, max(len(cache.blocks) for cache in caches))
        for cache, it in zip(caches, items):
            cache.length = it.pos + 1
            self._windows_hold(it.cache_id, cache.length)
        return logits


def token_tensor(token_parts: list, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The segments' ids as one tensor: checked host ids (a list or one id), or device tokens
    (a decode step's sampled ids, not checked: that would wait for them) clamped into the vocabulary."""
    if all(isinstance(part, list) for part in token_parts):
        return torch.tensor([t for part in token_parts for t in part], device=device)
    parts = [
        part.reshape(-1).to(device=device, dtype=torch.int64).clamp(0, vocab_size - 1)
        if torch.is_tensor(part)
        else torch.tensor([int(part)] if isinstance(part, numbers.Integral) else list(part), device=device)
        for part in token_parts
    ]
    return torch.cat(parts)
