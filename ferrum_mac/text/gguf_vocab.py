"""Tokenizers rebuilt from a GGUF file's metadata, as `tokenizers` objects.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: `tokenizer.ggml.model`
says which kind ("gpt2": byte-level BPE with merges; "llama": sentencepiece with scores),
`tokenizer.ggml.pre` names the pre-tokenizer regex the merges were learned with, and each
token has a type (normal, control, user-defined, byte...). We build the same pipeline
llama.cpp runs, out of `tokenizers` parts.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ferrum_mac.errors import CorruptModelError, UnsupportedModelError
from ferrum_mac.text.hf_tokenizer import HfTokenizer

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the regex that splits text before byte-level BPE. The ones not
# listed ("gpt2", "default", ...) use GPT-2's own regex.
SPLIT_REGEX = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
}
# GPT-2's regex after splitting every digit apart (SmolLM's and StarCoder's tokenizer.json).
SINGLE_DIGIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}

_SPECIAL_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


def read_gguf_metadata(path: str | Path) -> dict:
    """The tokenizer part of a GGUF's metadata (`tokenizer.*`), as plain Python values."""
    from ferrum_mac.weights.gguf_header import cached_gguf_info, shard_paths

    try:
        info = cached_gguf_info(shard_paths(Path(path))[0])  # its errors name the file and what to do
    except OSError as e:
        raise CorruptModelError(f"cannot read GGUF metadata from {path} ({e})") from None
    return {k: v for k, v in info.metadata.items() if k.startswith("tokenizer.")}


def tokenizer_from_gguf(meta: dict, source: str = "the GGUF file") -> HfTokenizer:
    """An `HfTokenizer` for the vocabulary described by GGUF metadata `meta`."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CorruptModelError(
            f"{source} has no tokenizer.ggml.tokens; it cannot be used for chat, get a complete GGUF"
        )
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens, source)
        add_bos_default = False
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True
    else:
        raise UnsupportedModelError(
            f"{source} has a {kind!r} tokenizer; ferrum reads 'gpt2' (byte-level BPE) and 'llama' (sentencepiece) vocabularies"
        )
    _add_special_tokens(backend, tokens, types)

    special = {name: _token(meta, tokens, f"tokenizer.ggml.{key}_token_id") for name, key in _SPECIAL_KEYS.items()}
    add_bos = meta.get("tokenizer.ggml.add_bos_token", add_bos_default)
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    backend.post_processor = _bos_eos_processor(special["bos_token"], special["eos_token"], add_bos, add_eos, backend)
    # llama.cpp also stops on an end-of-turn token when the vocabulary names one.
    extra_eos = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
    return HfTokenizer(backend, **special, extra_eos_ids=extra_eos)


def _token(meta: dict, tokens: list[str], key: str) -> str | None:
    token_id = meta.get(key)
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(meta: dict, tokens: list[str], source: str) -> tokenizers.Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise CorruptModelError(
            f"{source} has a byte-level vocabulary without tokenizer.ggml.merges; get a complete GGUF"
        )
    vocab = _vocab(tokens)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre == pre`."""
    if pre in SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(SPLIT_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in SINGLE_DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2


def _sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """Sentencepiece's BPE as llama.cpp runs it: merge the adjacent pair whose union has the best score."""
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = _vocab(tokens)
    unk = _token(meta, tokens, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        vocab=vocab,
        merges=merges_from_scores(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    # As llama.cpp (and sentencepiece) do: every run of text, at the start or after a
    # special token, gets one '▁' prepended, even when it already starts with a space.
    # (transformers' `Metaspace` skips it then, and after special tokens.)
    spaces = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if add_prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a normal token into two normal
    tokens, best-scored union first (ties: longer left part first, as transformers orders them)."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    ranked = []
    for token, token_id in normal.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in normal and right in normal]
        splits.sort(key=lambda pair: (normal[pair[0]], normal[pair[1]]))
        ranked += [(scores[token_id], len(left), len(right), left, right) for left, right in splits]
    ranked.sort(key=lambda r: r[:3], reverse=True)
    return [(left, right) for *_, left, right in ranked]


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> its first id (a vocabulary may repeat a token)."""
    return dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens (matched whole, left out of
    decode); user-defined ones (like '<think>') are matched whole but decoded as text."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _bos_eos_processor(bos, eos, add_bos: bool, add_eos: bool, backend: tokenizers.Tokenizer):
    single, specials = ["$A:0"], []
    if add_bos and bos is not None:
        single.insert(0, f"{bos}:0")
        specials.append((bos, backend.token_to_id(bos)))
    if add_eos and eos is not None:
        single.append(f"{eos}:0")
        specials.append((eos, backend.token_to_id(eos)))
    if not specials:
        return None
    return processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
