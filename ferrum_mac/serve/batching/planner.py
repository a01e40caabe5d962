"""What the scheduler's next step runs, decided without the model: which sequences, which prefill chunks, which guesses.

The scheduler's thread asks these functions and executes their answer (`StepRunner`), as vLLM
v1 keeps its scheduler apart from its model runner. They read what the model can do (`mode`,
from its `Capabilities`), the budgets, and what each sequence holds; they call no model and
change nothing, so tests drive them with stand-in sequences.

- Admission, first come first served (`may_admit`): while the batch has room and the KV the
  model would hold with every sequence at its full length fits the budget.
- A step (`plan_step`): every decoding sequence's next token, and the prefill chunks of the
  others in admission order while the step's token budget lasts (one `unified_forward`);
  without a unified forward, whole prefills, then one `decode_batch` (or one `decode` per
  sequence). A step with nothing to prefill is a decode step, which may carry guesses.
- Guesses (`choose_guesses`): how many of each candidate's guessed tokens are worth their rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, Protocol, Sequence, TypeVar

from ferrum_mac.llm import Capabilities
from ferrum_mac.serve.batching.speculation import MAX_ROWS, Offer, RowCosts, plan

# How a step runs, by what the model can do.
UNIFIED, SPLIT, SINGLE = "unified_forward", "decode_batch", "decode"
# A step with nothing to prefill: every decoding sequence's token, maybe with guesses.
DECODE = "decode_step"


def mode_of(capabilities: Capabilities) -> str:
    """How the model's steps run: one unified forward, else prefills and a batched decode, else
    prefills and one decode per sequence."""
    if capabilities.unified_forward:
        return UNIFIED
    return SPLIT if capabilities.batched_decode else SINGLE


class Planned(Hashable, Protocol):
    """What the planner reads of a running sequence."""

    @property
    def next_token(self) -> int | None:
        """Sampled last step, to go into the cache this one (None: not decoding)."""
        ...

    @property
    def unprefilled(self) -> list[int]:
        """Prompt tokens still to compute."""
        ...

    @property
    def leader(self) -> object | None:
        """A sequence computing a prefix this one waits for."""
        ...


S = TypeVar("S", bound=Planned)


@dataclass(frozen=True)
class Chunk(Generic[S]):
    """`tokens` prompt tokens of `seq` to prefill; `final`: the last of its prompt (its logits are sampled)."""

    seq: S
    tokens: int
    final: bool


@dataclass(frozen=True)
class StepPlan(Generic[S]):
    """One step: `kind` (UNIFIED, SPLIT, SINGLE or DECODE), the sequences that feed their next
    token (`decoding`, in batch order), the prefill chunks, and for a decode step the guessed
    tokens each guessing sequence verifies (`guesses`: how many of its proposal)."""

    kind: str
    decoding: list[S]
    chunks: list[Chunk[S]] = field(default_factory=list)
    guesses: dict[S, int] = field(default_factory=dict)


def decoding(running: Sequence[S]) -> list[S]:
    """The sequences with a sampled token to feed this step."""
    return [s for s in running if s.next_token is not None]


def prefilling(running: Sequence[S]) -> list[S]:
    """The sequences with prompt tokens to compute, but those waiting for their leader."""
    return [s for s in running if s.unprefilled and s.leader is None]


def plan_step(running: Sequence[S], mode: str, step_tokens: int) -> StepPlan[S]:
    """The next step of `running` (in admission order) on a model that runs `mode`."""
    decode, prefill = decoding(running), prefilling(running)
    if not prefill:
        return StepPlan(DECODE, decode)
    if mode != UNIFIED:
        return StepPlan(mode, decode, [Chunk(s, len(s.unprefilled), True) for s in prefill])
    budget = step_tokens - len(decode)
    chunks: list[Chunk[S]] = []
    for seq in prefill:
        if budget <= 0 and (decode or chunks):
            break
        n = min(len(seq.unprefilled), max(1, budget))
        chunks.append(Chunk(seq, n, n == len(seq.unprefilled)))
        budget -= n
    return StepPlan(UNIFIED, decode, chunks)


def may_admit(
    running_needs: Sequence[int], need: int, max_batch: int, kv_budget: int | None, kv_tokens_for: Callable
) -> bool:
    """Whether a request that needs `need` KV tokens (prompt plus answer) joins the sequences
    running with `running_needs`: the batch has room, and the KV the model would hold with all
    of them at their full length (`kv_tokens_for`, the model's pool geometry) fits `kv_budget`
    (None: no limit). The first request always joins an empty batch."""
    if len(running_needs) >= max_batch:
        return False
    if not running_needs or kv_budget is None:
        return True
    return kv_tokens_for([*running_needs, need]) <= kv_budget


def choose_guesses(candidates: Sequence[tuple[S, Offer]], rows: int, costs: RowCosts) -> dict[S, int]:
    """How many guessed tokens each candidate verifies in a decode step of `rows` sequences
    (those worth their rows by `costs`; none past MAX_ROWS sequences)."""
    if rows >= MAX_ROWS or not candidates:
        return {}
    counts = plan([offer for _, offer in candidates], rows, costs)
    return {seq: k for (seq, _), k in zip(candidates, counts) if k}
