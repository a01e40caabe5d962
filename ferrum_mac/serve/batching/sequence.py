"""One admitted request on the scheduler's thread: its prompt still to compute, its cache position, its answer so far."""

from __future__ import annotations

from ferrum_mac.engine import AnswerState
from ferrum_mac.engine.speculation import SpeculationStats
from ferrum_mac.engine.speculation.verify import Speculator
from ferrum_mac.llm import PrefixReuse
from ferrum_mac.serve.batching.request import RequestHandle


class Sequence:
    """One admitted request's state; touched only on the scheduler thread."""

    def __init__(self, handle: RequestHandle, sampler, answer: AnswerState, need: int):
        self.handle = handle
        self.request = handle.request
        self.cache_id = handle.cache_id
        self.sampler = sampler
        self.answer = answer  # the answer's rules: its text, and whether a token ends it
        self.need = need  # KV tokens reserved for it at admission
        self.unprefilled = list(self.request.prompt_ids)
        self.pos = 0  # tokens in its cache
        self.next_token: int | None = None  # sampled, to go into the cache next step
        self.answer_ids: list[int] = []  # the tokens generated so far
        self.cached = 0  # prompt tokens taken from the prefix cache
        self.miss: str | None = None  # why the prefix cache gave no more (`PrefixReuse.miss`)
        self.leader: Sequence | None = None  # an earlier sequence prefilling a prefix this one shares
        self.shared = 0  # prompt tokens in common with `leader`: this one waits until it holds them
        self.speculator: Speculator | None = None  # set when it may guess its next tokens
        self.history: list[int] = []  # while it may: the prompt and the answer, which guesses are looked up in

    @property
    def generated(self) -> int:
        return self.answer.generated

    @property
    def speculation(self) -> SpeculationStats | None:
        return self.speculator.stats if self.speculator is not None else None

    def attach(self, reuse: PrefixReuse) -> None:
        """Start from what `state.reuse` attached: prefill only the rest of the prompt."""
        prompt = self.request.prompt_ids
        self.pos, self.cached, self.miss = reuse.tokens, reuse.tokens, reuse.miss
        self.handle.cached_tokens = reuse.tokens
        self.unprefilled = list(prompt[reuse.tokens :])

    def held_tokens(self, held: int) -> list[int]:
        """The ids of the first `held` positions of its cache: the prompt, then the answer."""
        return (list(self.request.prompt_ids) + self.answer_ids)[:held]

    def emit(self, event) -> None:
        if self.request.emit is None:
            return
        try:
            self.request.emit(event)
        except Exception:  # a client that went away must not stop the others
            pass


def fed_token(seq: Sequence) -> int:
    """The token a decoding sequence feeds this step: the one sampled at the last."""
    assert seq.next_token is not None, "only a decoding sequence feeds a token"
    return seq.next_token


def prefix_line(seq: Sequence) -> str:
    """What `ferrum serve --verbose` logs of a request once its prompt is in the cache."""
    prompt = len(seq.request.prompt_ids)
    line = f"{seq.cache_id}: {seq.cached} of {prompt} prompt tokens reused from the prefix cache"
    return f"{line} (miss: {seq.miss})" if seq.miss else line


def speculation_line(seq: Sequence) -> str:
    """What `ferrum serve --verbose` logs of a request that speculated, when it ends."""
    stats = seq.speculation
    assert stats is not None
    return f"{seq.cache_id}: {stats.accepted} of {stats.proposed} guessed tokens accepted in {stats.steps} verify steps"
