"""The decode loop: sampled token ids, each next step queued on the device before the
current token is read (the overlap mlx-lm gets with async_eval).

One answer in time (`sample` and `decode` only queue work; `read` waits for a token):

    host                                   device
    t1 = sample(prompt logits)             samples t1 after the prefill
    yield read(t1)                         the first token goes out before step 1 is built
    t2 = sample(decode(t1))                step 1: t1 into the cache, samples t2
    t3 = sample(decode(t2))                step 2 queued behind step 1
    yield read(t2)                         step 1 done; step 2 runs while the host yields t2
    t4 = sample(decode(t3))                step 3 queued behind step 2
    yield read(t3)                         step 2 done; step 3 runs
    ...
    yield read(tn)                         the last: nothing queued after it

`answer_tokens` picks the loop for an answer: under a grammar `constrained_tokens`, else the
speculative loop (`ferrum_mac.engine.speculation`), which runs this timeline whenever
guessing does not pay, or `sampled_tokens` with speculation off.
"""

from __future__ import annotations

from typing import Any, Generator, Sequence

import numpy as np

from ferrum_mac.engine.sampling import Sampler
from ferrum_mac.engine.speculation import Speculate, SpeculationStats
from ferrum_mac.engine.speculation.step_times import StepTimes
from ferrum_mac.engine.speculation.verify import Speculator, speculative_tokens
from ferrum_mac.grammar import GrammarMatcher
from ferrum_mac.llm import DecoderOnlyLLM


def answer_tokens(
    model: DecoderOnlyLLM,
    sampler: Sampler,
    cache_id: str,
    logits: Any,
    limit: int | None,
    *,
    matcher: GrammarMatcher | None = None,
    speculate: Speculate | None = None,
    prompt: Sequence[int] = (),
    times: StepTimes | None = None,
) -> tuple[Generator[int, None, None], SpeculationStats | None]:
    """The answer's token ids, and the speculation counts they will have filled in when the
    answer ends (None: it does not speculate); `times`: the model's step times, which the
    answer reads and adds to (None: its own). A grammar turns speculation off: its mask
    for a guessed position depends on the guesses before it, which are not read yet. So does
    a model whose state cannot be cut back (`StateManager.cuts_back`): rejected guesses would
    stay in it."""
    if matcher is not None:
        return constrained_tokens(model, sampler, cache_id, logits, limit, matcher), None
    if speculate is None or not speculate.enabled or not model.state.cuts_back:
        return sampled_tokens(model, sampler, cache_id, logits, limit), None
    speculator = Speculator.for_answer(model, speculate, cache_id, times or StepTimes())
    return speculative_tokens(model, sampler, cache_id, logits, limit, speculator, prompt), speculator.stats


def sampled_tokens(
    model: DecoderOnlyLLM, sampler: Sampler, cache_id: str, logits: Any, limit: int | None
) -> Generator[int, None, None]:
    """Token ids of one answer, starting from the prompt's `logits`, in the module's timeline;
    at most `limit` of them (None: no limit), and no more than the KV capacity leaves room for.

    Each id is in the cache when it is yielded except the first (building step 1, and on MLX's
    CPU build running most of it, would delay the answer's first text) and the last (the
    caller tells `limit` from a full cache by counting). A caller that stops early leaves at
    most one unread token in the cache, after the last one it was given.
    """
    capacity = model.kv_capacity()
    pos = model.state.length(cache_id)
    token = sampler.sample(logits)
    count = 0
    while True:
        count += 1
        more = (limit is None or count < limit) and pos + 1 <= capacity
        if count == 1:
            yield sampler.read(token)
            if not more:
                return
            token = sampler.sample(model.decode(cache_id, token, pos))
            pos += 1
            continue
        if more:
            following = sampler.sample(model.decode(cache_id, token, pos))
            pos += 1
        yield sampler.read(token)
        if not more:
            return
        token = following


def constrained_tokens(
    model: DecoderOnlyLLM, sampler: Sampler, cache_id: str, logits: Any, limit: int | None, matcher: GrammarMatcher
) -> Generator[int, None, None]:
    """`sampled_tokens` under a grammar: each step's logits masked to what `matcher` allows.

    The next mask depends on the token just sampled, so a token cannot be sampled before the
    one before it is read. The forward that feeds it still is: step n+1 is queued with the
    lazy token n, then token n is read and accepted and the next mask filled while the device
    runs step n+1; only the masked sampling waits for the host. The answer ends once the
    grammar is finished (its EOS accepted). Every id yielded is in the cache but the first
    (its step is built after it goes out, as in `sampled_tokens`) and the last when the limit
    or the capacity ended the answer.
    """
    capacity = model.kv_capacity()
    pos = model.state.length(cache_id)
    mask = np.empty((1, matcher.vocab.words), dtype=np.int32)
    matcher.fill_mask(mask)
    token = sampler.sample(logits, mask[0])
    count = 0
    while True:
        count += 1
        more = (limit is None or count < limit) and pos + 1 <= capacity
        if more and count > 1:
            logits = model.decode(cache_id, token, pos)
            pos += 1
        token_id = sampler.read(token)
        matcher.accept(token_id)
        yield token_id
        if not more or matcher.is_finished():
            return
        if count == 1:
            logits = model.decode(cache_id, token, pos)
            pos += 1
        matcher.fill_mask(mask)
        token = sampler.sample(logits, mask[0])
