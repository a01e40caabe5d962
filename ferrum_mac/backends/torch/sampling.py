"""The engine's sampler contract on torch: logits in, a device token out, nothing read on the host.

`params` is the engine's SamplingParams, read by field name (a backend never imports the
engine). Draws use the Gumbel-max trick with a seeded generator on the model's device
(argmax of log-probabilities plus Gumbel noise), so no step waits on the host; penalties
keep the recent token ids as a device tensor, so adding the token just sampled does not
wait for it either.
"""

from __future__ import annotations

import math
import secrets
from typing import Callable, Sequence

import torch

from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar.device import apply_mask_torch

NEG_INF = -math.inf
MAX_PENDING_READS = 4  # queued host copies kept for tokens not read yet (a decode loop has two)


class TorchSampler:
    def __init__(self, params, context: Sequence[int], vocab_size: int, device: torch.device):
        self.params, self.vocab_size, self.device = params, vocab_size, device
        bad = [int(t) for t in params.logit_bias if not 0 <= int(t) < vocab_size]
        if bad:
            raise FerrumError(
                f"logit bias names token id {bad[0]}, outside the vocabulary (0 to {vocab_size - 1}); fix the id"
            )
        self.bias = None  # built at the first step, as wide as the logits
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        window = list(context)[-params.penalty_window :] if params.penalised else []
        self.window = torch.tensor(window, dtype=torch.int64, device=device) if params.penalised else None
        self.reads: dict[int, Callable[[], int]] = {}  # by id(token): its queued copy to the host

    def sample(self, logits: torch.Tensor, mask=None) -> torch.Tensor:
        """`mask`: a grammar's allowed ids for this step (one bitmask row), or None: all."""
        p = self.params
        x = logits.reshape(-1).float()
        if mask is not None:  # first, so no later step can bring back an id the grammar forbids
            x = apply_mask_torch(x.reshape(1, -1).clone(), mask.reshape(1, -1)).reshape(-1)
        if p.logit_bias:
            if self.bias is None:
                self.bias = bias_vector(p.logit_bias, x.numel(), x.device)
            x = x + self.bias
        if self.window is not None and self.window.numel():
            x = self._penalise(x)
        token = x.argmax() if p.greedy else self._draw(x)
        if self.window is not None:
            self.window = torch.cat([self.window, token.reshape(1)])[-p.penalty_window :]
        self.reads[id(token)] = queue_read(token)
        while len(self.reads) > MAX_PENDING_READS:  # tokens a caller never read
            self.reads.pop(next(iter(self.reads)))
        return token

    def read(self, token: torch.Tensor) -> int:
        pending = self.reads.pop(id(token), None)
        return pending() if pending else int(token.item())

    def logprobs(self, logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """`token`'s log-probability under the model's own distribution (the raw logits, before
        this sampler's settings), and the `k` likeliest ids with theirs, most likely first."""
        logprobs = torch.log_softmax(logits.reshape(-1)[: self.vocab_size].float(), dim=-1)
        values, ids = torch.topk(logprobs, k)
        return float(logprobs[token].item()), list(zip(ids.tolist(), values.tolist()))

    def _penalise(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        counts = torch.zeros_like(x).index_add_(0, self.window, torch.ones_like(self.window, dtype=x.dtype))
        seen = counts > 0
        if p.repetition_penalty != 1.0:
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, penalised, x)
        if p.presence_penalty:
            x = x - p.presence_penalty * seen.float()
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        return x

    def _draw(self, x: torch.Tensor) -> torch.Tensor:
        p = self.params
        logprobs = torch.log_softmax(x / p.temperature, dim=-1)
        if 0 < p.top_k < logprobs.numel():
            logprobs = torch.log_softmax(top_k(logprobs, p.top_k), dim=-1)
        if p.top_p < 1.0:
            logprobs = torch.log_softmax(top_p(logprobs, p.top_p), dim=-1)
        if p.min_p > 0.0:
            logprobs = logprobs.masked_fill(logprobs < logprobs.max() + math.log(p.min_p), NEG_INF)
        noise = torch.empty_like(logprobs).exponential_(generator=self.generator).clamp_min_(1e-30)
        return (logprobs - noise.log()).argmax()  # Gumbel-max: a draw from softmax(logprobs)


def top_k(logprobs: torch.Tensor, k: int) -> torch.Tensor:
    kept = torch.topk(logprobs, k)
    return torch.full_like(logprobs, NEG_INF).scatter(0, kept.indices, kept.values)


def top_p(logprobs: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the most likely tokens until their probability reaches p (the top one always)."""
    sorted_lp, order = torch.sort(logprobs, descending=True)
    probs = sorted_lp.exp()
    before = probs.cumsum(0) - probs  # probability of the tokens ranked above each one
    kept = sorted_lp.masked_fill(before >= p, NEG_INF)
    return torch.full_like(logprobs, NEG_INF).scatter(0, order, kept)


def bias_vector(bias, width: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor([int(t) for t in bias], device=device)
    values = torch.tensor([float(v) for v in bias.values()], device=device)
    return torch.zeros(width, device=device).index_add_(0, ids, values)


def queue_read(token: torch.Tensor) -> Callable[[], int]:
    """Queues a device scalar's copy to the host now, and returns the function that gives it as
    an int. That waits for the work queued before this call only: `token.item()` later would
    also wait for the decode step queued since, leaving the GPU idle while the host builds the
    step after it."""
    if token.device.type != "cuda":
        return lambda: int(token.item())
    host = torch.empty((), dtype=token.dtype, pin_memory=True)
    host.copy_(token, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> int:
        copied.synchronize()
        return int(host.item())

    return read
