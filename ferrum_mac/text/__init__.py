"""The text layer: tokenizers, chat templates, streaming detokenizing, reasoning and stop strings.

    tokenizer = load_tokenizer(path)                 # folder (tokenizer.json / .model) or .gguf
    template = load_chat_template(path, tokenizer)
    prompt = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)

    detok, thinking = StreamingDetokenizer(tokenizer), ReasoningSplitter(prompt_opens_reasoning(prompt))
    stops = StopMatcher(["\\nUser:"])
    for token in generated:  # then detok.finish(), thinking.finish(), stops.finish()
        for delta in thinking.feed(detok.add(token)): ...

No engine, backend, MLX or transformers import here (GGUF metadata comes from `weights.gguf_header`).
"""

from ferrum_mac.text.chat_template import CHATML, ChatTemplate, ChatTemplateError
from ferrum_mac.text.detokenizer import StreamingDetokenizer
from ferrum_mac.text.gguf_vocab import read_gguf_metadata, tokenizer_from_gguf
from ferrum_mac.text.hf_tokenizer import HfTokenizer
from ferrum_mac.text.loader import chat_templates, load_chat_template, load_tokenizer
from ferrum_mac.text.reasoning import ANSWER, REASONING, Delta, ReasoningSplitter, prompt_opens_reasoning
from ferrum_mac.text.spm_tokenizer import SentencePieceTokenizer
from ferrum_mac.text.stops import StopMatcher
from ferrum_mac.text.tokenizer import Tokenizer

__all__ = [
    "ANSWER",
    "CHATML",
    "REASONING",
    "ChatTemplate",
    "ChatTemplateError",
    "Delta",
    "HfTokenizer",
    "ReasoningSplitter",
    "SentencePieceTokenizer",
    "StopMatcher",
    "StreamingDetokenizer",
    "Tokenizer",
    "chat_templates",
    "load_chat_template",
    "load_tokenizer",
    "prompt_opens_reasoning",
    "read_gguf_metadata",
    "tokenizer_from_gguf",
]
