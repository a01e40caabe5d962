"""The speculative decode loop: plain pipelined steps while guessing does not pay, and a
verify step (one `forward_verify` of the last token and k guesses) when it does.

Acceptance. The sampler draws the target's token at each verified position in turn, exactly
as plain decoding would draw it there, and a guess is kept while it equals that draw; at the
first difference the draw itself is the next token, and when every guess is kept the last
row gives one more. For a deterministic proposer (q one-hot on its guess x) this is the
standard rejection rule: x is kept with probability p(x) = min(1, p(x)/q(x)), and a rejected
position yields a draw from p without x, which is norm(max(0, p - q)). Greedy answers are
the plain greedy tokens. The sampler is called once per answer token, in order, so the
penalties' window and the seeded generator advance as they do without speculation.

Cache. After a verify, the cache is cut back (`truncate_kv`) to the last token and the kept
guesses; the next token (the draw) is not in it yet, as in the plain loop. The prefix cache's
blocks follow the cut: a cut block that was shared is copied before it is written again.
Limits. A verify never holds more guesses than the answer limit and the KV capacity leave
room for, so the answer ends at the same token, for the same reason, as without speculation.
"""

from __future__ import annotations

import time
from typing import Any, Generator, Sequence

from ferrum_mac.engine.sampling import Sampler
from ferrum_mac.engine.speculation.controller import MAX_K, Controller, worth_measuring
from ferrum_mac.engine.speculation.proposers import DraftModel, PromptLookup, Proposal, Proposer
from ferrum_mac.engine.speculation.setting import DRAFT, Speculate, SpeculationStats
from ferrum_mac.engine.speculation.step_times import StepTimes
from ferrum_mac.llm import DecoderOnlyLLM


class Speculator:
    """One answer's proposer, controller and counts. The controller weighs the model's step
    costs (`times`) once they are known; until then a strong guess is verified a few tokens at
    a time so that a verify step is timed, and a weak one not at all."""

    def __init__(self, proposer: Proposer, times: StepTimes, draft: str | None = None):
        self.proposer = proposer
        self.times = times
        self.draft = draft  # the draft model's name: its guesses' time counts (None: prompt lookup)
        self.controller = Controller(times.curve(draft))
        self.stats = SpeculationStats()

    @classmethod
    def for_answer(cls, model: DecoderOnlyLLM, setting: Speculate, cache_id: str, times: StepTimes) -> "Speculator":
        if setting.mode == DRAFT:
            proposer = DraftModel(setting.draft_model, f"{cache_id}:draft", model.config.vocab_size)
            return cls(proposer, times, setting.draft_name or "draft")
        return cls(PromptLookup(), times)

    def guesses(self, history: Sequence[int], room: int) -> int:
        """How many guesses to verify after `history` (0: a plain step)."""
        kind = self.proposer.peek(history)
        if kind is None or room < 1:
            return 0
        if not self.times.known(self.draft):
            return self.times.probe(room) if worth_measuring(kind) and self.controller.wait == 0 else 0
        self.controller.curve = self.times.curve(self.draft)  # kept until a step's time is recorded
        k = self.controller.guesses(kind, min(room, MAX_K))
        if k == 0 and worth_measuring(kind) and self.controller.wait == 0:
            return self.times.reprobe(room)
        return k

    def propose(self, history: Sequence[int], room: int) -> Proposal | None:
        k = self.guesses(history, room)
        if not k:
            return None
        start = time.perf_counter()
        proposal = self.proposer.propose(history, k)
        if proposal is not None and self.draft is not None:
            self.times.record_guess(self.draft, (time.perf_counter() - start) / len(proposal.tokens))
        return proposal

    def candidate(self, history: Sequence[int], room: int, known: bool) -> Proposal | None:
        """The longest proposal (at most `room` and MAX_K guesses) a caller that weighs several
        streams together may verify a prefix of; None while the stream stands aside, without a
        guess, or with only a weak one before the step costs are `known`."""
        if room < 1 or self.controller.wait > 0:
            return None
        proposal = self.proposer.propose(history, min(room, MAX_K))
        if proposal is None or (not known and not worth_measuring(proposal.kind)):
            return None
        return proposal

    def plain_token(self, seconds: float | None = None) -> None:
        """A plain token went out; `seconds`: its decode step's time (None: not a timed one)."""
        self.controller.plain_token()
        if seconds is not None:
            self.times.record_decode(seconds)

    def record(self, proposal: Proposal, accepted: int, seconds: float | None = None) -> None:
        """A verify of `proposal` kept `accepted` guesses; `seconds`: the step's time."""
        if seconds is not None:
            self.times.record_verify(len(proposal.tokens), seconds)
        self.controller.record(proposal.kind, len(proposal.tokens), accepted)
        self.stats.proposed += len(proposal.tokens)
        self.stats.accepted += accepted
        self.stats.steps += 1

    def close(self) -> None:
        self.proposer.close()


def speculative_tokens(
    model: DecoderOnlyLLM,
    sampler: Sampler,
    cache_id: str,
    logits: Any,
    limit: int | None,
    speculator: Speculator,
    prompt: Sequence[int],
) -> Generator[int, None, None]:
    """`decode_loop.sampled_tokens` with speculation: the same token ids, for the same
    reasons, at most `limit` of them; `prompt` holds the ids in the cache before the answer.

    As there, each id is in the cache when it is yielded except the first and the last (the
    caller tells `limit` from a full cache by counting). A caller that stops early may leave
    guesses after the last id it read in the cache: truncate to what it read.
    """
    capacity = model.kv_capacity()
    pos = model.state.length(cache_id)
    history = list(prompt)
    token = sampler.sample(logits)  # the next answer token: drawn, maybe not read, not in the cache
    first = True  # read before step 1 is built, as in the plain loop
    queued = False  # whether `token` comes from a decode step queued behind the one before it
    try:
        while True:
            start = time.perf_counter()  # a step's time leaves out the caller's, between yields
            produced = len(history) - len(prompt)
            if limit is not None and produced + 1 >= limit or pos + 1 > capacity:
                yield _read(sampler, token, history)  # the last one
                return
            room = capacity - pos - 1  # guesses the cache holds after the token
            if limit is not None:
                room = min(room, limit - produced - 2)  # guesses, the token and the draw after them
            if not first and not speculator.guesses(history, room):  # plain, the next step queued first
                following = sampler.sample(model.decode(cache_id, token, pos))
                pos += 1
                token_id = _read(sampler, token, history)
                # a step that had none queued before it is no measure of the pipelined loop
                speculator.plain_token(time.perf_counter() - start if queued else None)
                queued = True
                yield token_id
                token = following
                continue
            token_id = _read(sampler, token, history)
            owed = not first  # the first goes out before any step is built
            if first:
                first = False
                yield token_id
            proposal = speculator.propose(history, room)
            # the step that feeds the token is queued before it goes out, as in the plain loop
            if proposal is None:
                token = sampler.sample(model.decode(cache_id, token_id, pos))
                pos += 1
                queued = True
                if owed:
                    yield token_id
                continue
            start = time.perf_counter()
            rows = model.forward_verify(cache_id, [token_id, *proposal.tokens])
            if owed:
                paused = time.perf_counter()
                yield token_id
                start += time.perf_counter() - paused
            kept, token = accepted_guesses(sampler, rows, proposal.tokens)
            pos += 1 + kept
            model.truncate_kv(cache_id, pos)
            speculator.record(proposal, kept, time.perf_counter() - start)
            queued = False
            for guess in proposal.tokens[:kept]:
                history.append(guess)
                yield guess
    finally:
        speculator.close()


def _read(sampler: Sampler, token: Any, history: list[int]) -> int:
    token_id = sampler.read(token)
    history.append(token_id)
    return token_id


def accepted_guesses(sampler: Sampler, rows: Any, guesses: Sequence[int]) -> tuple[int, Any]:
    """How many guesses the target's draws keep, and the draw after them (the next token):
    the acceptance rule of every speculating loop (this one, and `ferrum serve`'s batched steps).

    A plain greedy sampler (no bias, no penalties: nothing that depends on the position) picks
    every row's argmax, so all rows are compared at one read instead of one read per row."""
    if _plain_greedy(sampler):
        kept = _kept(rows.argmax(-1).tolist(), guesses)
        return kept, sampler.sample(rows[kept])
    for i, guess in enumerate(guesses):
        token = sampler.sample(rows[i])
        if sampler.read(token) != guess:
            return i, token
    return len(guesses), sampler.sample(rows[len(guesses)])


def accepted_ids(sampler: Sampler, rows: Any, guesses: Sequence[int]) -> tuple[int, int]:
    """`accepted_guesses` with the draw read: for a plain greedy sampler, from the one read of
    every row's argmax (the draw is the argmax of its row), so a caller that reads at once
    waits on the device once per verify."""
    if _plain_greedy(sampler):
        best = rows.argmax(-1).tolist()
        kept = _kept(best, guesses)
        return kept, best[kept]
    kept, token = accepted_guesses(sampler, rows, guesses)
    return kept, sampler.read(token)


def _kept(best: list[int], guesses: Sequence[int]) -> int:
    """How many guesses equal the rows' argmax, from the first."""
    return next((i for i, guess in enumerate(guesses) if best[i] != guess), len(guesses))


def _plain_greedy(sampler: Sampler) -> bool:
    """Whether `sampler` draws a plain argmax; backends' samplers carry their `params`."""
    params = getattr(sampler, "params", None)
    return bool(params is not None and params.greedy and not params.logit_bias and not params.penalised)
