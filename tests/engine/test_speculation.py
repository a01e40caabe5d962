"""Speculative decoding: the same answers as plain decoding, for the same reasons, with the
sampler's own distribution, and a cache (and prefix cache) left as plain decoding leaves it.

The cost curve is set per engine (`engine.step_times.use`) so that speculation runs, or never runs,
whatever this machine measures: correctness must not depend on the controller's choice.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from engine_helpers import answer, assert_consistent, done
from helpers import to_np
from ferrum_mac.engine import ChatSettings, Engine
from ferrum_mac.engine.events import CONTEXT, EOS, MAX_TOKENS, STOP_STRING
from ferrum_mac.engine.speculation import DRAFT, Speculate
from ferrum_mac.engine.speculation.controller import MAX_K, Controller, fixed_curve
from ferrum_mac.engine.speculation.step_times import FIRST_PROBE_K, PROBE_K, PROBES, REPROBE_EVERY, StepTimes
from ferrum_mac.engine.speculation.proposers import PromptLookup, Proposal
from ferrum_mac.engine.speculation.verify import Speculator, speculative_tokens
from ferrum_mac.errors import FerrumError

CHEAP = [1.0] * (MAX_K + 1)  # a verify as cheap as a decode step: always worth guessing
PROMPTS = ("Once upon a time", "Tom and Lily went to the park. Tom and Lily", "The cat sat on the mat. The cat")
NGRAM, OFF = Speculate("ngram"), Speculate("off")


@pytest.fixture(scope="module")
def stories(stories_path) -> Engine:
    engine = Engine.open(stories_path, backend="mlx")
    engine.step_times.use(CHEAP)
    return engine


def greedy_answer(
    engine, prompt: str, speculate: Speculate, ledgers: list | None = None, **changes
) -> tuple[str, list]:
    sampling = engine.default_sampling.replace(temperature=0.0, repetition_penalty=1.0)
    sampling = sampling.replace(**changes.pop("sampling", {}))
    conv = engine.conversation(sampling=sampling, prepare=False, speculate=speculate, **changes)
    events = list(conv.send(prompt))
    assert_consistent(engine, conv)
    if ledgers is not None:
        ledgers.append(list(conv.ledger))
    conv.close()
    return answer(events), events


def test_greedy_answers_are_plain_greedy_answers(stories):
    for prompt in PROMPTS:
        plain, _ = greedy_answer(stories, prompt, OFF, max_tokens=80)
        fast, events = greedy_answer(stories, prompt, NGRAM, max_tokens=80)
        assert fast == plain, prompt
        stats = done(events).speculation
        assert stats["steps"] > 0 and 0 < stats["accepted"] <= stats["proposed"], stats
    assert done(greedy_answer(stories, PROMPTS[0], OFF, max_tokens=8)[1]).speculation is None


def test_greedy_answers_are_plain_greedy_answers_on_torch(stories_path):
    engine = Engine.open(stories_path, backend="torch")
    engine.step_times.use(CHEAP)
    plain, _ = greedy_answer(engine, PROMPTS[1], OFF, max_tokens=20)
    fast, events = greedy_answer(engine, PROMPTS[1], NGRAM, max_tokens=20)
    assert fast == plain
    assert done(events).speculation["steps"] > 0


def test_smollm2_greedy_answers_are_plain_greedy_answers(smollm2):
    """The bundled chat model: a copying task (long guesses kept) and a free question."""
    text = "Repeat exactly: The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."
    smollm2.step_times.use(CHEAP)
    try:
        for prompt in (text, "What is the capital of France?"):
            plain, _ = greedy_answer(smollm2, prompt, OFF, max_tokens=32)
            fast, events = greedy_answer(smollm2, prompt, NGRAM, max_tokens=32)
            assert fast == plain, prompt
        assert done(events).speculation["steps"] > 0
    finally:
        smollm2.step_times.forget()  # the session's other tests measure as a user's run does


def test_penalties_apply_at_every_verified_position(stories):
    """A repetition penalty depends on the tokens before each position: the sampler is called
    once per answer token in order, so a guessed position sees the same window as plain."""
    penalty = {"repetition_penalty": 1.3, "presence_penalty": 0.2}
    for prompt in PROMPTS[1:]:
        plain, _ = greedy_answer(stories, prompt, OFF, max_tokens=80, sampling=penalty)
        fast, _ = greedy_answer(stories, prompt, NGRAM, max_tokens=80, sampling=penalty)
        assert fast == plain


def test_limits_stop_strings_and_eos_end_answers_as_without_speculation(stories):
    for limit in (1, 2, 3, 7, 30):
        plain, plain_events = greedy_answer(stories, PROMPTS[1], OFF, max_tokens=limit)
        fast, fast_events = greedy_answer(stories, PROMPTS[1], NGRAM, max_tokens=limit)
        assert (fast, done(fast_events).generated_tokens) == (plain, done(plain_events).generated_tokens)
        assert done(fast_events).stop_reason == MAX_TOKENS
    # stories260K's greedy stories do not end, so a common id plays the end-of-sequence token
    eos_ids = stories.eos_ids
    stories.eos_ids = frozenset(
        {stories.tokenizer.encode("Tom and Lily went to the park.", add_special_tokens=False)[-1]}
    )
    ledgers: list = []  # the cache after the answer: the end token is in it, as without speculation
    try:
        plain, plain_events = greedy_answer(stories, PROMPTS[1], OFF, ledgers, max_tokens=400)
        fast, fast_events = greedy_answer(stories, PROMPTS[1], NGRAM, ledgers, max_tokens=400)
    finally:
        stories.eos_ids = eos_ids
    assert ledgers[0] == ledgers[1]
    assert done(plain_events).stop_reason == EOS
    assert (fast, done(fast_events).stop_reason, done(fast_events).generated_tokens) == (
        plain,
        EOS,
        done(plain_events).generated_tokens,
    )
    stop = plain[len(plain) // 2 : len(plain) // 2 + 6]
    cut, cut_events = greedy_answer(stories, PROMPTS[1], NGRAM, max_tokens=400, stop=(stop,))
    assert done(cut_events).stop_reason == STOP_STRING
    assert cut == plain[: plain.index(stop)]


def test_a_full_context_ends_the_answer_where_plain_decoding_does(small_context):
    engine = small_context(64)
    engine.step_times.use(CHEAP)
    plain, plain_events = greedy_answer(engine, PROMPTS[2], OFF, max_tokens=None)
    fast, fast_events = greedy_answer(engine, PROMPTS[2], NGRAM, max_tokens=None)
    assert done(plain_events).stop_reason == done(fast_events).stop_reason == CONTEXT
    assert fast == plain
    assert done(fast_events).speculation["steps"] > 0


def test_the_next_turn_and_the_prefix_cache_see_the_kept_tokens_only(stories):
    """Rejected guesses are cut from the cache and its blocks: a second turn (the conversation's
    own cache), and a new conversation that reuses the first one's blocks, answer as plain."""
    turns = ("Tom and Lily went to the park.", "Then Tom and Lily went home.")

    def two_turns(speculate):
        conv = stories.conversation(
            sampling=stories.default_sampling.replace(temperature=0.0, repetition_penalty=1.0),
            prepare=False,
            speculate=speculate,
            max_tokens=60,
        )
        answers = [answer(conv.send(text)) for text in turns]
        assert_consistent(stories, conv)
        return conv, answers

    first, fast = two_turns(NGRAM)
    second, plain = two_turns(OFF)  # its prompts reuse blocks `first` remembered
    assert fast == plain
    held = list(first.ledger)
    first.close()
    reuse = stories.model.state.reuse("replay", held)
    assert reuse.cached > len(held) // 2
    logits = stories.model.prefill("replay", held[reuse.tokens :])
    fresh = stories.model.prefill("fresh", held)
    assert int(np.argmax(to_np(logits))) == int(np.argmax(to_np(fresh)))
    np.testing.assert_allclose(to_np(logits), to_np(fresh), rtol=1e-3, atol=1e-3)
    for cache_id in ("replay", "fresh"):
        stories.model.release(cache_id)
    second.close()


def test_a_draft_model_keeps_its_cache_in_step(stories_path, stories):
    """The draft (here the same weights, so every greedy guess is right) is cut back and fed
    the accepted tokens before each guess; its cache is released with the answer."""
    draft = Engine.open(stories_path, backend="mlx").model
    stories.step_times.use(CHEAP, draft_step=1e-6)
    setting = Speculate(DRAFT, draft, "stories")
    for prompt in PROMPTS:
        plain, _ = greedy_answer(stories, prompt, OFF, max_tokens=50)
        fast, events = greedy_answer(stories, prompt, setting, max_tokens=50)
        assert fast == plain
        stats = done(events).speculation
        assert stats["accepted"] == stats["proposed"] > 20, stats
    assert draft.state.used_tokens() == 0


def test_sampled_tokens_follow_the_targets_distribution(stories_path):
    """Temperature 1 on stories260K (512 ids): a fixed guess after the first token is kept or
    replaced by the sampler's draw. The second token's frequencies match the model's own
    softmax at that position (within 5 standard errors per frequent id), and so does the
    first's, where no guess was made."""
    engine = Engine.open(stories_path, backend="mlx")
    model = engine.model
    prompt = engine.tokenizer.encode("Once upon a time, there was a", add_special_tokens=True)
    start = model.prefill("stats", prompt)
    first_p = softmax(to_np(start))
    first_id = int(np.argmax(first_p))
    second_p = softmax(to_np(model.forward_verify("stats", [first_id])[0]))
    model.truncate_kv("stats", len(prompt))
    guess = int(np.argsort(second_p)[-2])  # the second most likely: kept often, rejected often
    cheap = StepTimes()
    cheap.use(CHEAP)
    runs, firsts, seconds = 700, collections.Counter(), collections.Counter()
    for seed in range(runs):
        sampler = model.sampler(engine.default_sampling.replace(temperature=1.0, top_p=1.0, top_k=0, seed=seed))
        speculator = Speculator(FixedGuess(guess), cheap)
        tokens = speculative_tokens(model, sampler, "stats", start, 3, speculator, prompt)
        t1, t2 = next(tokens), next(tokens)
        tokens.close()
        model.truncate_kv("stats", len(prompt))
        firsts[t1] += 1
        if t1 == first_id:
            seconds[t2] += 1
    model.release("stats")
    assert_follows(firsts, first_p)
    assert sum(seconds.values()) > 150
    assert_follows(seconds, second_p)


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match():
    lookup = PromptLookup()
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert lookup.propose(history, 3) == Proposal([7, 8, 2], "ngram3")  # the latest "2 3 4"
    assert lookup.propose([*history, 6], 2) is None  # 6 never occurred
    assert lookup.propose([*history, 6, 4], 2) == Proposal([6, 4], "ngram1")  # the latest "4"
    assert PromptLookup().propose([5, 5], 4) == Proposal([5], "ngram1")
    passage = list(range(10, 40))  # a passage being copied: the longest match wins, as "copy"
    copied = [*passage, 99, 12, 13, 14, 7, *passage[:12]]
    assert PromptLookup().propose(copied, 4) == Proposal([22, 23, 24, 25], "copy")


def test_the_controller_guesses_only_where_it_pays_and_stands_aside_after_misses():
    cheap, costly = Controller(fixed_curve(CHEAP)), Controller(fixed_curve([1.0, 3.0, 3.5, 4.0]))
    assert cheap.guesses("ngram3") == MAX_K and cheap.guesses(None) == 0
    assert costly.guesses("ngram1") == 0
    assert cheap.guesses("ngram3", available=2) == 2
    for _ in range(6):
        cheap.record("ngram1", 8, 0)
    assert cheap.wait > 0 and cheap.guesses("ngram3") == 0
    for _ in range(cheap.wait):
        cheap.plain_token()
    assert cheap.guesses("ngram3") == MAX_K
    assert cheap.acceptance("ngram1") < 0.1


def test_a_grammar_turns_speculation_off(stories):
    sampling = stories.default_sampling.replace(temperature=0.0)
    conv = stories.conversation(sampling=sampling, prepare=False, speculate=NGRAM, max_tokens=30)
    events = list(conv.send("Give me a JSON object", response_format="json"))
    assert done(events).speculation is None
    conv.close()


def test_settings_refuse_unknown_speculation_and_never_copy_a_draft():
    with pytest.raises(FerrumError, match="choose auto, ngram, draft:MODEL or off"):
        Speculate.parse("fast")
    with pytest.raises(FerrumError, match="load the draft model first"):
        Speculate.parse("draft:qwen3:0.6b")
    model = object()
    settings = ChatSettings(speculate=Speculate(DRAFT, model, "x"))
    assert dataclasses.asdict(settings)["speculate"].draft_model is model
    assert str(settings.replace(max_tokens=3).speculate) == "draft:x"


class FixedGuess:
    """A proposer that always guesses one given token."""

    def __init__(self, token: int):
        self.token = token

    def peek(self, history):
        return "fixed"

    def propose(self, history, k):
        return Proposal([self.token], "fixed")

    def close(self):
        pass


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits.astype(np.float64) - logits.max())
    return z / z.sum()


def assert_follows(counts: collections.Counter, p: np.ndarray) -> None:
    n = sum(counts.values())
    for token in np.argsort(p)[-8:]:
        expected = p[token]
        if expected * n < 10:
            continue
        got = counts[int(token)] / n
        sigma = math.sqrt(expected * (1 - expected) / n)
        assert abs(got - expected) < 5 * sigma + 1e-3, (int(token), got, expected, n)


def test_ferrum_run_takes_speculate_and_reports_its_figures(stories_path, tmp_path):
    """`--speculate` and `/set speculate` as a user types them; a bad value is one line."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "TERM": "dumb", "NO_COLOR": "1"}
    env.pop("FERRUM_MODEL", None)

    def ferrum(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", "from ferrum_mac.cli import main; main()", "run", *args]
        return subprocess.run(command, env=env, input=stdin, capture_output=True, text=True, timeout=120)

    run = ferrum(str(stories_path), "Once upon a time", "--speculate", "ngram", "--max-tokens", "30", "--json")
    assert run.returncode == 0, run.stderr
    assert set(json.loads(run.stdout)["stats"]["speculation"]) == {"proposed", "accepted", "steps"}
    bad = ferrum(str(stories_path), "hi", "--speculate", "fast")
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "draft:MODEL" in bad.stderr
    script = [
        "/set speculate off",
        "/set speculate fast",
        f"/set speculate draft:{stories_path}",
        "/show parameters",
        "Once upon a time",
        "/bye",
    ]
    repl = ferrum(str(stories_path), "-i", "--max-tokens", "12", stdin="\n".join(script) + "\n")
    assert repl.returncode == 0, repl.stderr
    assert "Set speculation to off." in repl.stdout and "choose auto, ngram, draft:MODEL or off" in repl.stdout
    assert f"speculate         draft:{stories_path}" in repl.stdout


def test_a_first_answer_learns_the_step_costs_from_its_own_steps(stories_path, monkeypatch):
    """A fresh engine times nothing apart from answers: every forward is on the answer's own
    cache. Until the costs are known a verify holds at most PROBE_K guesses, PROBES of them;
    the answer's plain and verify steps make them known, and the answer is the plain one."""
    engine = Engine.open(stories_path, backend="mlx")
    model, times = engine.model, engine.step_times
    forwards: list[tuple[str, str, int, bool]] = []  # (method, cache id, tokens, costs known)

    def watched(name):
        method = getattr(model, name)

        def call(cache_id, tokens, *args):
            size = len(tokens) if isinstance(tokens, list) else 1
            forwards.append((name, cache_id, size, times.known()))
            return method(cache_id, tokens, *args)

        return call

    for name in ("prefill", "decode", "forward_verify"):
        monkeypatch.setattr(model, name, watched(name))
    fast, events = greedy_answer(engine, PROMPTS[1], NGRAM, max_tokens=80)
    monkeypatch.undo()
    assert {cache_id for _, cache_id, _, _ in forwards} == {forwards[0][1]}
    probes = [size - 1 for name, _, size, known in forwards if name == "forward_verify" and not known]
    assert len(probes) == PROBES and max(probes) <= PROBE_K
    assert times.known() and done(events).speculation["accepted"] > 0
    assert fast == greedy_answer(engine, PROMPTS[1], OFF, max_tokens=80)[0]


def test_step_times_are_the_fastest_recent_ones_and_grow_past_the_largest_timed():
    times = StepTimes()
    assert not times.known() and times.probe(room=8) == FIRST_PROBE_K
    times.record_verify(1, 1.2)
    assert times.probe(room=8) == PROBE_K and times.probe(room=2) == 2
    times.record_verify(3, 5.0)  # a first use: slow
    assert times.probe(room=8) == 0 and not times.known()  # timed enough verifies; no plain step yet
    times.record_verify(3, 1.5)
    times.record_decode(1.2)
    times.record_decode(1.0)
    assert times.known() and not times.known(draft="small")  # that draft's guesses are not timed
    curve = times.curve().verify
    assert curve[0] == 1.0 and curve[3] == pytest.approx(1.5)
    assert curve[2] == pytest.approx(1.35) and curve[MAX_K] == pytest.approx(1.5 + 5 * 0.15)
    times.record_guess("small", 0.1)
    assert times.curve("small").draft_step == pytest.approx(0.1)
    refusals = [times.reprobe(room=8) for _ in range(2 * REPROBE_EVERY)]  # the costs said no each time
    assert refusals.count(PROBE_K) == 2 and refusals[REPROBE_EVERY - 1] == PROBE_K
    times.forget()
    assert not times.known()
