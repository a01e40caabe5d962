"""The scheduler's planner without a model: stand-in sequences in, step plans out.

Which sequences feed a token, which prompts are chunked and how far under the step's token
budget, what runs when the model has no unified forward or no batched decode, who is
admitted under the batch and KV budgets, and which guesses a decode step verifies."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum_mac.engine.speculation.proposers import Proposal
from ferrum_mac.llm import Capabilities
from ferrum_mac.serve.batching.planner import (
    DECODE,
    SINGLE,
    SPLIT,
    UNIFIED,
    Chunk,
    choose_guesses,
    may_admit,
    mode_of,
    plan_step,
)
from ferrum_mac.serve.batching.speculation import MAX_ROWS, ROW_COUNTS, Offer, RowCosts


@dataclass(eq=False)
class Seq:
    """What the planner reads of a running sequence."""

    name: str
    next_token: int | None = None
    unprefilled: list[int] = field(default_factory=list)
    leader: object | None = None

    def __repr__(self) -> str:
        return self.name


def decoding(name: str) -> Seq:
    return Seq(name, next_token=7)


def prefilling(name: str, n: int) -> Seq:
    return Seq(name, unprefilled=list(range(n)))


def test_the_mode_follows_what_the_model_runs():
    assert mode_of(Capabilities(True, True, True)) == UNIFIED
    assert mode_of(Capabilities(False, True, False)) == SPLIT
    assert mode_of(Capabilities(False, False, False)) == SINGLE


def test_nothing_to_prefill_is_a_decode_step():
    a, b, waiting = decoding("a"), decoding("b"), Seq("waits")  # neither decoding nor prefilling
    plan = plan_step([a, waiting, b], UNIFIED, 512)
    assert plan.kind == DECODE and plan.decoding == [a, b] and not plan.chunks


def test_decode_tokens_first_then_prefill_chunks_in_admission_order_under_the_budget():
    a, b, c, d = decoding("a"), prefilling("b", 300), prefilling("c", 300), prefilling("d", 10)
    plan = plan_step([b, a, c, d], UNIFIED, 512)
    assert plan.kind == UNIFIED and plan.decoding == [a]
    assert plan.chunks == [Chunk(b, 300, True), Chunk(c, 211, False)]  # d waits for the next step


def test_decode_tokens_come_before_any_prefill():
    decode = [decoding(str(i)) for i in range(4)]
    long = prefilling("long", 100)
    assert plan_step([*decode, long], UNIFIED, 4).chunks == []  # the decode tokens took the whole budget
    assert plan_step([*decode, long], UNIFIED, 5).chunks == [Chunk(long, 1, False)]
    alone = plan_step([long], UNIFIED, 16)
    assert alone.chunks == [Chunk(long, 16, False)] and alone.decoding == []


def test_followers_wait_for_their_leader():
    leader = prefilling("leader", 100)
    follower = Seq("follower", unprefilled=list(range(120)), leader=leader)
    plan = plan_step([leader, follower], UNIFIED, 512)
    assert [c.seq for c in plan.chunks] == [leader]


def test_without_a_unified_forward_prompts_prefill_whole():
    a, b, c = decoding("a"), prefilling("b", 3000), prefilling("c", 5)
    for mode in (SPLIT, SINGLE):
        plan = plan_step([a, b, c], mode, 512)
        assert plan.kind == mode and plan.decoding == [a]
        assert plan.chunks == [Chunk(b, 3000, True), Chunk(c, 5, True)]


def pool(needs: list[int]) -> int:
    """A pool of equal slots: every slot as long as the longest."""
    return len(needs) * max(needs)


def test_admission_within_the_batch_and_the_kv_budget():
    assert may_admit([], 10_000, 4, 100, pool)  # the first request always runs
    assert may_admit([50], 50, 4, 100, pool) and not may_admit([50], 51, 4, 100, pool)
    assert not may_admit([1, 1], 1, 2, None, pool)  # the batch is full
    assert may_admit([10_000] * 3, 10_000, 4, None, pool)  # no KV budget: only the batch limits


FLAT = RowCosts((1.0,) * len(ROW_COUNTS))  # every step as fast as one row: guesses are free


def test_guesses_worth_their_rows_and_none_past_the_row_limit():
    sure, never = decoding("sure"), decoding("never")
    offers = [(sure, Offer(Proposal([1, 2, 3], "ngram"), 0.9)), (never, Offer(Proposal([4], "ngram"), 0.0))]
    assert choose_guesses(offers, 2, FLAT) == {sure: 3}
    assert choose_guesses(offers, MAX_ROWS, FLAT) == {}
    costly = RowCosts((1.0,) + (100.0,) * (len(ROW_COUNTS) - 1))  # a second row costs a hundred steps
    assert choose_guesses(offers, 1, costly) == {}
