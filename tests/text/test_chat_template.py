"""Chat template rendering: templates that use each feature transformers' renderer offers,
rendered by both; where templates come from in a folder; the fallback."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from ferrum_mac.errors import ModelFileError
from ferrum_mac.text import CHATML, ChatTemplate, ChatTemplateError, chat_templates, load_chat_template, load_tokenizer

MESSAGES = [
    {"role": "system", "content": "Be <brief> & «kind»"},
    {"role": "user", "content": "Hi 🙂", "name": None},
    {"role": "assistant", "content": "Hello", "reasoning": "greet them"},
    {"role": "user", "content": "Bye"},
]

FEATURE_TEMPLATES = {
    "tojson": "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}\n{% endfor %}",
    "trim-and-lstrip-blocks": "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}",
    "loop-controls": "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }};{% endfor %}",
    "namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "reasoning-aliases": "{% for m in messages %}{{ m.reasoning_content | default('-') }}/{{ m.thinking | default('-') }}/{{ 'name' in m }};{% endfor %}",
    "special-tokens-and-kwargs": "{{ bos_token | default('none') }}{{ eos_token }}{{ pad_token }}{{ custom }}{{ add_generation_prompt }}{{ tools is none }}",
    "generation-block": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "dict-and-items": "{% for k, v in dict(a=1, b=messages | length).items() %}{{ k }}={{ v }} {% endfor %}",
}


@pytest.fixture(scope="module")
def qwen3_tokenizer(qwen3_dir):
    return load_tokenizer(qwen3_dir)


@pytest.mark.parametrize("name", list(FEATURE_TEMPLATES))
def test_features_render_like_transformers(hf_qwen3, qwen3_tokenizer, name):
    source = FEATURE_TEMPLATES[name]
    ours = ChatTemplate(source, qwen3_tokenizer.template_tokens()).render(MESSAGES, custom="x")
    reference = hf_qwen3.apply_chat_template(
        MESSAGES, chat_template=source, tokenize=False, add_generation_prompt=True, custom="x"
    )
    assert ours == reference


def test_tojson_keeps_unicode_and_html():
    out = ChatTemplate("{{ messages[0] | tojson }}").render(MESSAGES[:1])
    assert out == json.dumps({"role": "system", "content": "Be <brief> & «kind»"}, ensure_ascii=False)


def test_raise_exception_becomes_a_one_line_error():
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="must start with a user turn") as info:
        template.render(MESSAGES)
    assert "\n" not in str(info.value)


def test_strftime_now_is_todays_date():
    assert ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([]) == datetime.now().strftime("%Y-%m-%d")


def test_sandbox_refuses_attribute_escapes():
    with pytest.raises(Exception):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(Exception):
        ChatTemplate("{{ messages.append(1) }}").render([])  # immutable sandbox


@pytest.mark.parametrize(
    "source, error",
    [
        ("{% for i in range(10 ** 9) %}{% endfor %}", "OverflowError: Range too big"),  # the sandbox's range limit
        ("{{ messages.append(1) }}", "is unsafe"),  # the sandbox's SecurityError
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ messages[0].content + 5 }}", "TypeError"),
    ],
)
def test_whatever_a_template_raises_is_a_one_line_error(source, error):
    with pytest.raises(ChatTemplateError, match="the chat template") as info:
        ChatTemplate(source).render(MESSAGES)
    assert error in str(info.value) and "\n" not in str(info.value)


def test_a_template_that_does_not_compile_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_template_sources_in_a_folder(tmp_path, qwen3_tokenizer):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "A"}, {"name": "rag", "template": "R"}]})
    )
    assert chat_templates(tmp_path) == {"default": "A", "rag": "R"}
    assert load_chat_template(tmp_path, qwen3_tokenizer, name="rag").render([]) == "R"
    (tmp_path / "chat_template.jinja").write_text("J")  # the newer, separate file wins
    assert load_chat_template(tmp_path, qwen3_tokenizer).render([]) == "J"
    with pytest.raises(ModelFileError, match="no chat template named 'nope'"):
        load_chat_template(tmp_path, qwen3_tokenizer, name="nope")


def test_chat_template_json_is_read_too(tmp_path, qwen3_tokenizer):
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "C"}))
    assert load_chat_template(tmp_path, qwen3_tokenizer).render([]) == "C"


def test_fallback_is_chatml_when_the_vocabulary_speaks_it(tmp_path, qwen3_dir, stories_dir):
    (tmp_path / "tokenizer.json").write_bytes((qwen3_dir / "tokenizer.json").read_bytes())
    template = load_chat_template(tmp_path, load_tokenizer(tmp_path))
    assert template.name == "fallback" and template.source == CHATML
    assert (
        template.render([{"role": "user", "content": "Hi"}])
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_fallback_is_plain_text_for_a_base_model(stories_dir):
    tokenizer = load_tokenizer(stories_dir)
    template = load_chat_template(stories_dir, tokenizer)
    assert template.name == "fallback"
    prompt = template.render([{"role": "user", "content": "Tell me a story."}])
    assert prompt == "<s>User: Tell me a story.\n\nAssistant:"
    assert tokenizer.encode(prompt, add_special_tokens=False)[0] == tokenizer.bos_id
