"""Write small GGUF files that hold a real vocabulary (and one dummy tensor), with the `gguf`
package, so the GGUF tokenizer path can be checked against the tokenizer it came from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def write_gguf(path: Path, *, model: str, tokens, types, scores=None, merges=None, pre=None, **ids) -> Path:
    """`ids`: bos/eos/unk/pad token ids (`bos=1`), `add_bos=True`, `chat_template="..."`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(list(tokens))
    writer.add_token_types(list(types))
    if scores is not None:
        writer.add_token_scores(list(scores))
    if merges is not None:
        writer.add_token_merges(list(merges))
    for name, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("unk", writer.add_unk_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        if ids.get(name) is not None:
            add(ids[name])
    if "add_bos" in ids:
        writer.add_add_bos_token(ids["add_bos"])
    if "chat_template" in ids:
        writer.add_chat_template(ids["chat_template"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sentencepiece_gguf(model_file: Path, path: Path) -> Path:
    """A llama-style ('llama' tokenizer model) GGUF vocabulary from a sentencepiece model."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        for test, value in (
            (sp.is_unknown, UNKNOWN),
            (sp.is_control, CONTROL),
            (sp.is_byte, BYTE),
            (sp.is_unused, UNUSED),
        ):
            if test(i):
                return value
        return NORMAL

    return write_gguf(
        path,
        model="llama",
        tokens=[sp.id_to_piece(i) for i in range(n)],
        types=[kind(i) for i in range(n)],
        scores=[sp.get_score(i) for i in range(n)],
        bos=sp.bos_id(),
        eos=sp.eos_id(),
        unk=sp.unk_id(),
    )


def byte_level_gguf(tokenizer_json: Path, path: Path, pre: str) -> Path:
    """A 'gpt2' (byte-level BPE) GGUF vocabulary from a tokenizer.json, as llama.cpp converts it."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    added = {t["id"]: t for t in data["added_tokens"]}
    size = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens, types = [f"[PAD{i}]" for i in range(size)], [UNUSED] * size
    for token, i in vocab.items():
        tokens[i], types[i] = token, NORMAL
    for i, token in added.items():
        tokens[i], types[i] = token["content"], CONTROL if token["special"] else USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return write_gguf(
        path, model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges, eos=tokens.index("<|im_end|>")
    )
