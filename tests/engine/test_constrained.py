"""Structured output in the engine: answers constrained to JSON (a schema, any object), on a
real chat model (the bundled SmolLM2 GGUF), and unconstrained answers left exactly as they were."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

import helpers
from ferrum_mac.engine.structured import ResponseFormat
from ferrum_mac.grammar import GrammarError, UnsupportedSchemaError
from engine_helpers import answer, assert_consistent, done

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_schema_answer_parses_validates_and_stops(smollm2):
    with smollm2.conversation(max_tokens=64) as conv:
        events = list(conv.send("Describe a person as JSON.", response_format=PERSON))
    value = json.loads(answer(events))
    jsonschema.validate(value, PERSON)
    assert done(events).stop_reason == "eos"


@pytest.mark.parametrize("max_tokens", [64, 5])
def test_cache_matches_the_ledger_after_a_constrained_answer(smollm2, max_tokens):
    """Ended by the grammar (its EOS) or cut by the limit, the next turn starts from a consistent cache."""
    with smollm2.conversation(max_tokens=max_tokens) as conv:
        events = list(conv.send("Describe a person as JSON.", response_format=PERSON))
        assert done(events).stop_reason == ("eos" if max_tokens == 64 else "max_tokens")
        assert_consistent(smollm2, conv)
        list(conv.send("And another one.", response_format=PERSON))
        assert_consistent(smollm2, conv)


def test_setting_json_object_and_back_to_text(smollm2):
    """JSON mode asks for a member (never `{}`), which this small model may write at length: room for it,
    and greedy, for sampled it may ramble inside a string past any limit."""
    greedy = smollm2.default_sampling.replace(temperature=0.0)
    with smollm2.conversation(max_tokens=320, sampling=greedy, response_format=ResponseFormat()) as conv:
        events = list(conv.send("Give me some data."))
        assert isinstance(json.loads(answer(events)), dict)
        conv.settings = conv.settings.replace(response_format=None)
        list(conv.send("Thanks."))  # free text again: no error whatever it says


def test_unconstrained_answer_is_unchanged_by_a_constrained_one(smollm2):
    """Same greedy prompt before and after a constrained turn elsewhere: same tokens."""
    greedy = smollm2.default_sampling.replace(temperature=0.0)
    with smollm2.conversation(max_tokens=24, sampling=greedy) as conv:
        before = answer(list(conv.send("Name three fruits.")))
    with smollm2.conversation(max_tokens=24, sampling=greedy) as conv:
        list(conv.send("Name three fruits.", response_format="json"))
    with smollm2.conversation(max_tokens=24, sampling=greedy) as conv:
        after = answer(list(conv.send("Name three fruits.")))
    assert before == after


def test_unsupported_schema_names_the_keyword_and_leaves_the_conversation(smollm2):
    with smollm2.conversation(max_tokens=8) as conv:
        with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
            list(conv.send("hi", response_format={"type": "array", "uniqueItems": True}))
        assert conv.messages == []


def test_unknown_format_is_a_clear_error():
    with pytest.raises(GrammarError, match="unknown response format"):
        ResponseFormat.parse("yaml")


def test_grammar_waits_for_think_close_when_the_prompt_may_reason(smollm2):
    """SmolLM2 has no `</think>` token: its grammar always starts at once."""
    assert smollm2.constraints.start_after("<|im_start|>assistant\n") == ()


def test_think_close_id_for_a_thinking_vocabulary():
    from ferrum_mac.engine.structured import Constraints
    from ferrum_mac.text.loader import load_tokenizer

    folder = helpers.ASSETS / "tokenizers" / "qwen3"
    if not folder.exists():
        pytest.skip("the Qwen3 tokenizer is not in the shared assets")
    qwen3_tokenizer = load_tokenizer(folder)
    constraints = Constraints(qwen3_tokenizer, qwen3_tokenizer.vocab_size, qwen3_tokenizer.eos_ids)
    think = qwen3_tokenizer.piece_to_id("</think>")
    assert constraints.start_after("<|im_start|>assistant\n") == (think,)
    assert constraints.start_after("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ()
    assert constraints.start_after(None) == ()


def test_masked_sampler_never_picks_a_forbidden_id(smollm2):
    """The mask is applied before the draw: with one id allowed, every draw is that id."""
    model = smollm2.model
    words = (model.config.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    mask[1] = 1 << 3  # id 35
    sampler = model.sampler(smollm2.default_sampling.replace(temperature=1.5, seed=3), [1, 2])
    logits = model.prefill("masked-sampler", [1, 2, 3])
    try:
        assert {sampler.read(sampler.sample(logits, mask)) for _ in range(5)} == {35}
    finally:
        model.release("masked-sampler")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_sampler_masks_a_copy_of_the_logits(dtype):
    """The torch sampler draws only allowed ids and leaves the model's logits as they were."""
    torch = pytest.importorskip("torch")
    from ferrum_mac.backends.torch.sampling import TorchSampler
    from ferrum_mac.engine import SamplingParams

    sampler = TorchSampler(SamplingParams(temperature=1.5, seed=3), [], 100, torch.device("cpu"))
    logits = torch.randn(1, 100).to(getattr(torch, dtype))
    original = logits.clone()
    mask = np.zeros(4, dtype=np.int32)
    mask[2] = 1 << 5  # id 69
    assert {sampler.read(sampler.sample(logits, mask)) for _ in range(5)} == {69}
    assert torch.equal(logits, original)


def test_free_text_until_the_marker_then_the_grammar(smollm2):
    """As a thinking model's reasoning before `</think>`: the text up to the `start_after` ids is
    free, the rest follows the schema (here the marker is a newline, which SmolLM2 has as a token)."""
    from ferrum_mac.engine.decode_loop import constrained_tokens
    from ferrum_mac.grammar import GrammarMatcher

    tokenizer, model = smollm2.tokenizer, smollm2.model
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    grammar = smollm2.constraints.compile(ResponseFormat(PERSON))
    matcher = GrammarMatcher(grammar, start_after=newline)
    _, prompt = smollm2.render(smollm2.settings(), [{"role": "user", "content": "Think, then answer in JSON."}])
    sampling = smollm2.default_sampling.replace(temperature=0.0, logit_bias={newline[0]: 4.0})
    sampler = model.sampler(sampling, prompt)
    try:
        logits = model.prefill("marker", prompt)
        ids = list(constrained_tokens(model, sampler, "marker", logits, 80, matcher))
    finally:
        model.release("marker")
    assert newline[0] in ids and matcher.is_finished()
    after = [t for t in ids[ids.index(newline[0]) + 1 :] if t not in smollm2.eos_ids]
    jsonschema.validate(json.loads(tokenizer.decode(after)), PERSON)
    assert ids.index(newline[0]) > 0  # free text came first
