"""Chat turns: time to first token at turn N with the conversation's KV cache reused, against a
fresh conversation that re-prefills the same history.

    ferrum bench turns [MODEL] [--turns 20] [--answer-tokens 24] [--runs 3] [--json]

Turns 1..N-1 are real greedy answers (at most --answer-tokens each). Each timed run asks
turn N with a different question, so the reused side prefills just that question; the
re-prefill side opens a new conversation holding the same history on a second copy of the
model whose caches are dropped first (else its prefix cache would hold the history). Best of
--runs each.
"""

from __future__ import annotations

import json
import sys

from ferrum_mac.engine import Done, Engine

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is two plus two?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "What colour is the sky on a clear day?",
    "What is frozen water called?",
    "Which animal says moo?",
    "What is the largest ocean?",
    "How many days are in a week?",
]
SYSTEM = "You are a helpful assistant. Answer briefly."


def measure(engine: Engine, turns: int, answer_tokens: int, runs: int, say=print, cold: Engine | None = None) -> dict:
    """`cold`: the engine the re-prefill side runs on (default `engine`, whose prefix cache may
    then hold the history)."""
    cold = cold or engine
    sampling = engine.default_sampling.replace(temperature=0.0)
    conv = engine.conversation(sampling=sampling, max_tokens=answer_tokens, system=SYSTEM)
    for turn in range(1, turns):
        list(conv.send(QUESTIONS[(turn - 1) % len(QUESTIONS)]))
        say(f"turn {turn}: {len(conv.ledger)} tokens in the cache")
    history = [dict(m) for m in conv.messages]
    conv.settings = conv.settings.replace(max_tokens=1)  # timed turns stop at their first token
    reused, fresh = [], []
    for run in range(runs):
        # a new question each run (its first token differs), so the reused side prefills all of it
        question = f"{run + 1}. {QUESTIONS[(turns - 1 + run) % len(QUESTIONS)]}"
        conv.messages = [dict(m) for m in history]
        reused.append(_first_token(conv.send(question)))
        if cold is not engine:
            cold.model.reset()  # nothing cached: the history is computed again
        other = cold.conversation(conv.settings, prepare=False)
        other.messages = [dict(m) for m in history]
        fresh.append(_first_token(other.send(question)))
        other.close()
        say(f"run {run + 1}: reuse {reused[-1].ttft_s:.3f} s, re-prefill {fresh[-1].ttft_s:.3f} s")
    conv.close()
    best_reused, best_fresh = min(reused, key=_ttft), min(fresh, key=_ttft)
    return {
        "model": engine.name,
        "turn": turns,
        "history_tokens": best_fresh.prompt_tokens,
        "reuse": {
            "ttft_s": best_reused.ttft_s,
            "prefilled": best_reused.prompt_tokens,
            "cached": best_reused.cached_tokens,
        },
        "re_prefill": {
            "ttft_s": best_fresh.ttft_s,
            "prefilled": best_fresh.prompt_tokens,
            "cached": best_fresh.cached_tokens,
        },
        "speedup": best_fresh.ttft_s / best_reused.ttft_s,
    }


def _first_token(events) -> Done:
    """The figures of a one-token turn."""
    done = list(events)[-1]
    assert isinstance(done, Done)
    return done


def _ttft(done: Done) -> float:
    return done.ttft_s


def run_turns(model: str | None, turns: int, answer_tokens: int, runs: int, json_out: bool) -> None:
    """`ferrum bench turns`: measure, progress on stderr, then one line (or one JSON object) on stdout."""
    engine, cold = Engine.open(model), Engine.open(model)
    result = measure(engine, turns, answer_tokens, runs, say=lambda s: print(s, file=sys.stderr), cold=cold)
    if json_out:
        print(json.dumps(result, indent=1))
        return
    print(
        f"{result['model']}, turn {result['turn']} ({result['history_tokens']} prompt tokens): "
        f"time to first token {result['reuse']['ttft_s']:.3f} s reusing the cache "
        f"(prefilled {result['reuse']['prefilled']}), {result['re_prefill']['ttft_s']:.3f} s re-prefilling "
        f"the history ({result['re_prefill']['prefilled']}); {result['speedup']:.1f}x"
    )
