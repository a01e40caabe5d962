"""The real Qwen3 tokenizer and chat template against transformers: same text, same ids."""

from __future__ import annotations

import pytest

from text_samples import TRICKY_TEXTS
from ferrum_mac.text import HfTokenizer, load_chat_template, load_tokenizer

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
HISTORY = [
    {"role": "user", "content": "What is 2 + 2?"},
    {
        "role": "assistant",
        "content": "4",
        "reasoning_content": "The user asks for 2 + 2.\nThat is 4.",
    },
    {"role": "user", "content": "And times 3? 日本語で 🙂"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted» <b>html</b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATIONS = {
    "single-turn": [{"role": "user", "content": "Hi there!"}],
    "system": [SYSTEM, {"role": "user", "content": "Name a colour."}],
    "multi-turn-with-reasoning": [SYSTEM, *HISTORY],
    "history-without-system": HISTORY,
    "reasoning-inline-in-content": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hello\n</think>\n\nHello!"},
        {"role": "user", "content": "Again"},
    ],
    "assistant-content-none": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": None},
        {"role": "user", "content": "Bye"},
    ],
}


@pytest.fixture(scope="module")
def qwen3(qwen3_dir):
    tokenizer = load_tokenizer(qwen3_dir)
    return tokenizer, load_chat_template(qwen3_dir, tokenizer)


def test_loads_as_tokenizer_json_with_the_model_eos_ids(qwen3):
    tokenizer, template = qwen3
    assert isinstance(tokenizer, HfTokenizer)
    assert tokenizer.eos_token == "<|im_end|>"
    # generation_config.json adds <|endoftext|> to <|im_end|>
    assert tokenizer.eos_ids == {tokenizer.piece_to_id("<|im_end|>"), tokenizer.piece_to_id("<|endoftext|>")}
    assert template.name == "default" and "enable_thinking" in template.source


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [True, False], ids=["think", "no-think"])
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen", "no-gen"])
def test_render_and_ids_match_transformers(qwen3, hf_qwen3, name, thinking, generation_prompt):
    tokenizer, template = qwen3
    messages = CONVERSATIONS[name]
    ours = template.render(messages, add_generation_prompt=generation_prompt, enable_thinking=thinking)
    reference = hf_qwen3.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
    )
    assert ours == reference
    reference_ids = hf_qwen3.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt, enable_thinking=thinking
    )
    assert tokenizer.encode(ours, add_special_tokens=False) == list(reference_ids)


def test_thinking_switch_shows_in_the_prompt(qwen3):
    _, template = qwen3
    messages = CONVERSATIONS["single-turn"]
    assert template.render(messages, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert template.render(messages, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_old_reasoning_is_dropped_from_history_but_kept_in_the_last_turn(qwen3):
    _, template = qwen3
    history = template.render(CONVERSATIONS["multi-turn-with-reasoning"])
    assert "That is 4." not in history  # before the last user turn: dropped by the template
    last = [*HISTORY[:1], HISTORY[1]]
    assert "<think>\nThe user asks for 2 + 2.\nThat is 4.\n</think>" in template.render(
        last, add_generation_prompt=False
    )


def test_tools_render_like_transformers(qwen3, hf_qwen3):
    _, template = qwen3
    messages = [SYSTEM, {"role": "user", "content": "Weather in Paris?"}]
    ours = template.render(messages, tools=TOOLS)
    assert ours == hf_qwen3.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "«quoted» <b>html</b>" in ours  # tojson keeps non-ASCII and HTML as they are


@pytest.mark.parametrize("text", TRICKY_TEXTS + ["<|im_start|>user\nhi<|im_end|>", "<think>x</think>", ""])
@pytest.mark.parametrize("specials", [True, False], ids=["specials", "plain"])
def test_encode_and_decode_match_transformers(qwen3, hf_qwen3, text, specials):
    tokenizer, _ = qwen3
    ids = tokenizer.encode(text, add_special_tokens=specials)
    assert ids == hf_qwen3.encode(text, add_special_tokens=specials)
    assert tokenizer.decode(ids) == hf_qwen3.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_qwen3.decode(ids)
