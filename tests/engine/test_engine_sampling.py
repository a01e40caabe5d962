"""Sampling on the device, through the engine and through the backend's sampler directly."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from engine_helpers import STORY, answer, done, greedy
from ferrum_mac.engine import MAX_TOKENS, SamplingError, SamplingParams, TextDelta, sampling_defaults
from ferrum_mac.engine.defaults import DEFAULT_MAX_TOKENS, FALLBACK_SAMPLING, max_tokens_default
from ferrum_mac.store.bundled import bundled_sampling
from ferrum_mac.errors import FerrumError
from helpers import ferrum_greedy

# -- the engine's greedy answer is the plain argmax loop ----------------------------------


def _engine_vs_manual(engine, text: str, max_tokens: int, **settings):
    conv = greedy(engine, max_tokens=max_tokens, **settings)
    _, prompt = engine.render(conv.settings, [{"role": "user", "content": text}])
    events = list(conv.send(text))
    manual = ferrum_greedy(engine.model, "manual", prompt, done(events).generated_tokens)
    engine.model.release("manual")
    return conv, prompt, events, manual


def test_stories_greedy_equals_manual_argmax_loop(stories):
    conv, prompt, events, manual = _engine_vs_manual(stories, STORY, max_tokens=24)
    assert done(events).stop_reason == MAX_TOKENS and done(events).generated_tokens == 24
    # the last token is sampled but never fed back, so the cache holds all but it
    assert conv.ledger == prompt + manual[:-1]
    assert answer(events) == stories.tokenizer.decode(manual).strip()


def test_smollm2_greedy_equals_manual_argmax_loop(smollm2):
    conv, prompt, events, manual = _engine_vs_manual(smollm2, "What is the capital of France?", 12, system="Be brief.")
    stats = done(events)
    if stats.stop_reason == "eos":
        assert manual[-1] in smollm2.eos_ids
        assert conv.ledger == prompt + manual  # the end-of-turn token is cached too
    else:
        assert conv.ledger == prompt + manual[:-1]
    assert answer(events) == smollm2.tokenizer.decode(manual).strip()
    assert "Paris" in answer(events)


# -- sampling through the engine -------------------------------------------------------


def _sampled(engine, **sampling) -> str:
    conv = engine.conversation(sampling=engine.default_sampling.replace(**sampling), max_tokens=24, prepare=False)
    try:
        return answer(conv.send(STORY))
    finally:
        conv.close()


def test_seeded_sampling_is_reproducible(stories):
    first = _sampled(stories, temperature=1.0, top_k=0, top_p=1.0, seed=7)
    assert _sampled(stories, temperature=1.0, top_k=0, top_p=1.0, seed=7) == first
    others = {_sampled(stories, temperature=1.0, top_k=0, top_p=1.0, seed=s) for s in (8, 9, 10)}
    assert others - {first}, "different seeds should give some other answer"


def test_top_k_one_equals_greedy(stories):
    want = _sampled(stories, temperature=0.0)
    assert _sampled(stories, temperature=1.5, top_k=1, top_p=1.0, seed=3) == want


def test_tiny_top_p_and_high_min_p_equal_greedy(stories):
    want = _sampled(stories, temperature=0.0)
    assert _sampled(stories, temperature=1.0, top_k=0, top_p=1e-6, seed=4) == want
    assert _sampled(stories, temperature=1.0, top_k=0, top_p=1.0, min_p=0.999, seed=5) == want


# -- the backend's sampler on made-up logits -------------------------------------------

TOP, SECOND, VOCAB = 5, 9, 512


def _logits(top: float = 4.0, second: float = 3.0) -> mx.array:
    values = [-10.0] * VOCAB
    values[TOP], values[SECOND] = top, second
    return mx.array(values)


def _pick(stories, logits=None, context=(), **params) -> int:
    sampler = stories.model.sampler(SamplingParams(temperature=0.0).replace(**params), list(context))
    token = sampler.sample(_logits() if logits is None else logits)
    assert isinstance(token, mx.array)  # a device scalar, not read yet
    return sampler.read(token)


def test_logit_bias(stories):
    assert _pick(stories) == TOP
    assert _pick(stories, logit_bias={7: 100.0}) == 7
    assert _pick(stories, logit_bias={TOP: -float("inf")}) == SECOND


def test_repetition_penalty_divides_positive_logits_of_recent_tokens(stories):
    assert _pick(stories, context=[TOP], repetition_penalty=1.0) == TOP
    assert _pick(stories, context=[TOP], repetition_penalty=2.0) == SECOND  # 4 / 2 < 3
    assert _pick(stories, context=[TOP], repetition_penalty=1.2) == TOP  # 4 / 1.2 > 3
    negative = _logits(top=-1.0, second=-1.5)
    assert _pick(stories, negative, context=[TOP], repetition_penalty=2.0) == SECOND  # -1 * 2 < -1.5


def test_presence_and_frequency_penalties(stories):
    assert _pick(stories, context=[TOP], presence_penalty=2.0) == SECOND
    assert _pick(stories, context=[TOP, TOP, TOP], presence_penalty=0.5) == TOP  # once, whatever the count
    assert _pick(stories, context=[TOP], frequency_penalty=0.6) == TOP  # 4 - 0.6
    assert _pick(stories, context=[TOP, TOP], frequency_penalty=0.6) == SECOND  # 4 - 1.2


def test_penalties_look_back_only_over_their_window(stories):
    context = [TOP] + [100] * 70
    assert _pick(stories, context=context, presence_penalty=2.0, penalty_window=64) == TOP
    assert _pick(stories, context=context, presence_penalty=2.0, penalty_window=128) == SECOND


def test_penalties_see_the_tokens_the_sampler_picked(stories):
    sampler = stories.model.sampler(SamplingParams(temperature=0.0, presence_penalty=2.0), [])
    first = sampler.sample(_logits())
    second = sampler.sample(_logits())  # queued before the first was read
    assert (sampler.read(first), sampler.read(second)) == (TOP, SECOND)


def test_temperature_draws_from_both_of_two_equal_tokens(stories):
    logits = _logits(top=3.0, second=3.0)
    drawn = {_pick(stories, logits, temperature=1.0, seed=s) for s in range(12)}
    assert drawn == {TOP, SECOND}
    assert len({_pick(stories, logits, temperature=1.0, top_k=1, seed=s) for s in range(6)}) == 1


def test_min_p_keeps_only_tokens_near_the_top(stories):
    logits = _logits(top=3.0, second=2.5)  # the rest sit at -10
    drawn = {_pick(stories, logits, temperature=1.0, min_p=0.5, seed=s) for s in range(12)}
    assert drawn == {TOP, SECOND}  # exp(-0.5) = 0.61 of the top: kept


# -- settings and defaults --------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=1.0),
        dict(top_k=-1),
        dict(repetition_penalty=0.0),
        dict(penalty_window=-1),
    ],
)
def test_out_of_range_settings_are_refused(bad):
    with pytest.raises(SamplingError):
        SamplingParams().replace(**bad)


def test_logit_bias_outside_the_vocabulary_is_refused(stories):
    with pytest.raises(FerrumError, match="outside the vocabulary"):
        stories.model.sampler(SamplingParams(logit_bias={VOCAB + 3: 1.0}), [])


def test_defaults_come_from_generation_config(stories, tmp_path, smollm2_gguf):
    assert stories.default_sampling.greedy  # stories260K's generation_config says do_sample: false
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1})
    )
    defaults = sampling_defaults(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.6, 0.95, 20, 1.1)
    bundled = sampling_defaults(smollm2_gguf, bundled_sampling(smollm2_gguf))  # a GGUF carries none: its card says
    assert (bundled.temperature, bundled.top_p) == (0.2, 0.9)
    assert bundled.replace(temperature=0.7, top_p=0.9) == FALLBACK_SAMPLING
    assert sampling_defaults(tmp_path / "elsewhere") == FALLBACK_SAMPLING


def test_fallback_defaults_hold_back_repetition_and_runaway_answers(stories, tmp_path):
    """Where generation_config says nothing: Ollama's mild repeat penalty over the last 64
    tokens, and an answer limit of a few thousand tokens, bounded by the context."""
    assert (FALLBACK_SAMPLING.repetition_penalty, FALLBACK_SAMPLING.penalty_window) == (1.1, 64)
    assert max_tokens_default(tmp_path) == DEFAULT_MAX_TOKENS == 4096
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 300}))
    assert max_tokens_default(tmp_path) == 300
    assert stories.default_max_tokens == min(DEFAULT_MAX_TOKENS, stories.kv_capacity())
    assert stories.settings().max_tokens == stories.default_max_tokens
    assert stories.settings(max_tokens=None).max_tokens == stories.default_max_tokens  # unset: the default
    assert stories.settings(max_tokens=7).max_tokens == 7


def test_the_bundled_model_names_paris_at_its_default_sampling(smollm2):
    """The README's first question, at the bundled model's default sampling, over 16 seeds.
    At the old default (temperature 0.7) 6 of these 16 answers missed Paris; at its card's
    temperature 0.2 about one in eight still starts "L'Étoile ..." (the Q4_1 file puts nearly
    as much weight on "L" as on "The"), so a few misses are allowed."""
    answers = []
    for seed in range(16):
        conv = smollm2.conversation(sampling=smollm2.default_sampling.replace(seed=seed), max_tokens=24, prepare=False)
        answers.append("".join(e.text for e in conv.send("What is the capital of France?") if isinstance(e, TextDelta)))
        conv.close()
    assert sum("Paris" in a for a in answers) >= 12, answers
