"""A decode step queued before the last step's tokens are read: the host's work on those tokens
(their text, the answers' rules, the next plan) overlaps the device's work on the next step.

The engine's decode loop keeps one answer on this timeline (`engine.decode_loop`); the server
keeps a batch on it while its steps are plain decodes:

    host                                             device
    decode(t_k, sampled, not read); sample t_k+1     step k+1 queued behind step k
    read t_k; its text out; the answer's rules       step k+1 runs
    plan the next step; decode(t_k+1); sample t_k+2  step k+2 queued behind step k+1
    read t_k+1 ...

A step runs ahead only where nothing needs the tokens before the step is queued: no grammar
(its mask needs the last token), no log-probabilities asked for (read with their row), no guesses this step (they are looked up in the tokens read),
and room in every cache for a position the answer may never use (its last token, fed before it
is read). A finished answer's queued row is wasted, never wrong: what a sequence remembers is
what it read (`Batch._remember_answer`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ferrum_mac.serve.batching.sequence import Sequence


@dataclass
class InFlight:
    """A queued decode step: each sequence's token sampled from it, not read yet."""

    seqs: list[Sequence]
    tokens: list[Any]  # device scalars, one per sequence
    queued_at: float = field(default_factory=time.perf_counter)

    def continued_by(self, decoding: list[Sequence], running: list[Sequence]) -> bool:
        """Whether `decoding` is this step's sequences that still run, in order: the next step
        can feed them these tokens unread."""
        return decoding == [s for s in self.seqs if s in running]

    def tokens_of(self, decoding: list[Sequence]) -> list[Any]:
        by_seq = {id(s): t for s, t in zip(self.seqs, self.tokens)}
        return [by_seq[id(s)] for s in decoding]


def may_run_ahead(decoding: list[Sequence], capacity: int) -> bool:
    """Whether a plain decode step of `decoding` may be queued before its tokens are read (see
    the module's docstring; whether the step guesses is the runner's to say)."""
    if not decoding:
        return False
    for seq in decoding:
        if seq.request.matcher is not None or seq.request.logprobs is not None:
            return False
        if seq.pos + 2 > capacity:  # the queued row sits at pos; a read token must still fit after it
            return False
    return True
