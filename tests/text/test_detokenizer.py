"""Streaming detokenizer: token by token, the deltas joined equal the full decode, no delta
holds half a character, and sentencepiece's leading space comes out as in the full decode."""

from __future__ import annotations

import itertools
import random
import shutil

import pytest

from vocab_gguf_files import sentencepiece_gguf
from text_samples import TRICKY_TEXTS
from ferrum_mac.text import HfTokenizer, SentencePieceTokenizer, StreamingDetokenizer, load_tokenizer

TOKENIZERS = ["qwen3-json", "llama2-spm", "stories-spm", "stories-json", "llama2-gguf", "smollm2-gguf"]


@pytest.fixture(scope="module")
def tokenizers_by_name(request, tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _load(name, request, tmp_path_factory)
        return cache[name]

    return get


def _load(name, request, tmp_path_factory):
    fixture = request.getfixturevalue
    if name == "qwen3-json":
        return load_tokenizer(fixture("qwen3_dir"))
    if name == "stories-json":
        return load_tokenizer(fixture("stories_dir"))
    if name in ("llama2-spm", "stories-spm"):
        model = fixture("llama2_model") if name == "llama2-spm" else fixture("stories_dir") / "tokenizer.model"
        folder = tmp_path_factory.mktemp(name)
        shutil.copy(model, folder / "tokenizer.model")
        return load_tokenizer(folder)  # a folder with only tokenizer.model: sentencepiece
    if name == "llama2-gguf":
        return load_tokenizer(sentencepiece_gguf(fixture("llama2_model"), tmp_path_factory.mktemp("gguf") / "l2.gguf"))
    if name == "smollm2-gguf":
        return load_tokenizer(fixture("smollm2_path"))
    raise KeyError(name)


def stream(tokenizer, ids) -> list[str]:
    detok = StreamingDetokenizer(tokenizer)
    return [detok.add(i) for i in ids] + [detok.finish()]


def test_loader_picks_the_library(tokenizers_by_name):
    assert isinstance(tokenizers_by_name("llama2-spm"), SentencePieceTokenizer)
    assert isinstance(tokenizers_by_name("stories-json"), HfTokenizer)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("specials", [False, True], ids=["plain", "bos"])
def test_stream_equals_full_decode(tokenizers_by_name, name, specials):
    tokenizer = tokenizers_by_name(name)
    for text in TRICKY_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=specials)
        deltas = stream(tokenizer, ids)
        full = tokenizer.decode(ids)
        assert "".join(deltas) == full, text
        assert not any("\ufffd" in d for d in deltas), text  # never half a character
        if isinstance(tokenizer, SentencePieceTokenizer) and not tokenizer.remove_extra_whitespaces:
            assert full == text  # llama2's sentencepiece round-trips even leading spaces


@pytest.mark.parametrize("name", ["qwen3-json", "smollm2-gguf", "llama2-spm"])
def test_multibyte_characters_wait_for_their_last_byte(tokenizers_by_name, name):
    tokenizer = tokenizers_by_name(name)
    ids = tokenizer.encode("🧑🏿‍💻", add_special_tokens=False)
    deltas = stream(tokenizer, ids)
    assert len(ids) > 1 and "" in deltas[:-1]  # some tokens end mid-character and say nothing yet
    assert "".join(deltas) == "🧑🏿‍💻"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_random_token_sequences_stream_like_the_full_decode(tokenizers_by_name, name):
    """Any ids a model might produce. `ByteFallback` decoders replace a whole run of byte
    tokens when any of it is invalid, which a stream cannot take back, so for those only
    sequences that decode cleanly count; sentencepiece matches even on broken bytes."""
    tokenizer = tokenizers_by_name(name)
    exact_on_invalid = isinstance(tokenizer, SentencePieceTokenizer) or tokenizer.utf8_errors == "replace"
    rng = random.Random(f"detok-{name}")
    checked = 0
    for _ in range(400):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
        full = tokenizer.decode(ids)
        if "\ufffd" in full and not exact_on_invalid:
            continue
        assert "".join(stream(tokenizer, ids)) == full, [tokenizer.id_to_piece(i) for i in ids]
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("name", ["llama2-spm", "stories-spm", "stories-json", "llama2-gguf"])
def test_leading_space_rules_at_the_start_of_the_text(tokenizers_by_name, name):
    """Every short sequence of lone spaces, BOS, words with a space, and byte tokens."""
    tokenizer = tokenizers_by_name(name)
    pieces = ["▁", "▁▁", "▁a", "a", "<0x0A>", "<0x20>"]
    candidates = [i for i in (tokenizer.piece_to_id(p) for p in pieces) if i is not None] + [tokenizer.bos_id]
    for n in range(1, 5):
        for ids in itertools.product(candidates, repeat=n):
            assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids), [tokenizer.id_to_piece(i) for i in ids]


def test_first_generated_word_loses_its_sentencepiece_space(tokenizers_by_name):
    tokenizer = tokenizers_by_name("llama2-spm")
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.id_to_piece(ids[0]) == "▁Hello"
    assert stream(tokenizer, ids)[:2] == ["Hello", " world"]


def test_reset_starts_a_new_text(tokenizers_by_name):
    tokenizer = tokenizers_by_name("llama2-spm")
    detok = StreamingDetokenizer(tokenizer)
    first = tokenizer.encode("é", add_special_tokens=False)
    detok.add(first[0])
    detok.reset()
    assert "".join(detok.add(i) for i in tokenizer.encode("Hi", add_special_tokens=False)) + detok.finish() == "Hi"


@pytest.mark.parametrize("scheme", ["always", "first", "never"])
def test_metaspace_decoder(stories_dir, scheme):
    """A `Metaspace` decoder drops the '▁' of the first token only (when it prepends one)."""
    import tokenizers
    from tokenizers import decoders

    backend = tokenizers.Tokenizer.from_file(str(stories_dir / "tokenizer.json"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    tokenizer = HfTokenizer(backend, bos_token="<s>", eos_token="</s>")
    rng = random.Random(f"metaspace-{scheme}")
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 8))]
        assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids), [tokenizer.id_to_piece(i) for i in ids]
