"""Real trained weights against transformers: stories260K (safetensors) and SmolLM2-135M-Instruct
(Q4_1 GGUF, the app's default model)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

import ferrum_mac
from helpers import assert_close, assert_same_tokens, ferrum_greedy, hf_greedy, rel_err, to_np

# -- stories260K: a 260K-parameter Llama trained on TinyStories (llama2.c) ----------------


@pytest.fixture(scope="module")
def stories(shared_assets) -> Path:
    folder = shared_assets / "stories260K"
    if not (folder / "model.safetensors").is_file():
        pytest.skip("stories260K is not in the shared assets")
    return folder


def test_stories_greedy_from_bos_matches_transformers(stories):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(stories, dtype=torch.float32).eval()
    want = hf_greedy(reference, [1], 64)
    model = ferrum_mac.open_model(stories)
    assert model.config.dtype == "float32" and model.config.bos_token_id == 1
    got = ferrum_greedy(model, "story", [1], 64)
    assert_same_tokens(got, want)
    text = AutoTokenizer.from_pretrained(stories).decode(got)
    assert text.startswith("Once upon a time"), text  # a trained model, not noise


# -- SmolLM2-135M-Instruct Q4_1 GGUF ----------------------------------------------------
#
# transformers reads the GGUF by dequantizing every tensor to fp32 (and un-permuting the
# llama q/k rows llama.cpp permuted); ferrum keeps Q4_1 as MLX affine 4-bit (and Q8_0 as
# 8-bit) and, with dtype="float32", runs quantized matmuls with fp32 activations over
# exactly those dequantized values (d * q + m with fp16 d, m is exact in fp32). Left to
# differ is the fp32 summation order through 30 layers: measured ~3e-6 of the logits'
# range; 1e-4 leaves a 30x margin and is still 100x below a Q4 rounding slip or a wrong
# rope layout, which each move the logits by whole percent.
GGUF_FP32_REL = 1e-4
# In ferrum's default dtype for GGUF (float16 activations, as on a Mac) 30 layers of
# fp16 rounding (unit roundoff 2.4e-4) add up to about 1e-2 of the logits' range; allow 5e-2.
GGUF_FP16_REL = 5e-2
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
ANSWER_TOKENS = 24


def _reference_key(gguf: Path) -> str:
    import transformers

    from ferrum_mac.store.bundled import SMOLLM2

    facts = {
        "gguf": SMOLLM2.sha256 if gguf.name == SMOLLM2.filename else str(gguf),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "messages": QUESTION,
        "answer_tokens": ANSWER_TOKENS,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf: Path) -> dict:
    """transformers' view of the GGUF: prompt ids from its GGUF tokenizer, last-position fp32
    logits and the greedy answer.

    Loading a GGUF into transformers takes about a minute on two cores (the `gguf` reader
    parses the 49k-entry vocabulary in Python several times), so the result is kept next to
    the cached GGUF, keyed by the GGUF hash, the transformers and torch versions and the
    prompt. Delete the .npz, or set FERRUM_TEST_REFRESH_REFERENCE=1, to recompute it.
    """
    cached = smollm2_gguf.parent / f"transformers-reference-{_reference_key(smollm2_gguf)}.npz"
    if cached.is_file() and not os.environ.get("FERRUM_TEST_REFRESH_REFERENCE"):
        data = np.load(cached)
        return {k: data[k] for k in data.files}

    pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF (pip install -e .[test])")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    encoded = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1].float().numpy()
    answer = hf_greedy(model, ids, ANSWER_TOKENS)
    reference = {
        "prompt": np.array(ids, dtype=np.int64),
        "last_logits": last,
        "answer": np.array(answer, dtype=np.int64),
        "answer_text": np.array(tokenizer.decode(answer)),
    }
    tmp = cached.with_suffix(".tmp.npz")
    np.savez(tmp, **reference)
    os.replace(tmp, cached)
    return reference


@pytest.fixture(scope="module")
def smollm2_run(smollm2_gguf, smollm2_reference) -> dict:
    """ferrum in fp32 on the reference prompt: the prefill's logits and the greedy answer
    (one prefill serves both tests; a 135M model is slow on a shared two-core CPU)."""
    model = ferrum_mac.open_model(smollm2_gguf, dtype="float32")
    prompt = smollm2_reference["prompt"].tolist()
    first = model.prefill("answer", prompt)
    mx.eval(first)
    tokens, logits, pos = [], first, len(prompt)
    for step in range(ANSWER_TOKENS):
        tokens.append(int(mx.argmax(logits)))
        if step + 1 < ANSWER_TOKENS:
            logits = model.decode("answer", tokens[-1], pos)
            pos += 1
    model.release("answer")
    return {"first_logits": first, "answer": tokens}


def test_smollm2_reads_as_llama_with_quantized_tensors(smollm2_gguf):
    from ferrum_mac.weights import load_checkpoint

    ckpt = load_checkpoint(smollm2_gguf)
    c = ckpt.config
    assert ckpt.format == "gguf" and c.model_type == "llama" and c.rope_traditional
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in ckpt.tensors
    assert c.quant_for("layers.0.self_attn.q_proj") == {"group_size": 32, "bits": 4}  # Q4_1
    assert c.quant_for("layers.0.input_layernorm") is None  # F32 norms stay dense
    assert ckpt.tensors["layers.0.self_attn.q_proj.weight"].dtype == mx.uint32


def test_smollm2_prompt_logits_match_transformers(smollm2_run, smollm2_reference):
    assert smollm2_reference["prompt"][0] == 1 and len(smollm2_reference["prompt"]) > 20  # ChatML + system prompt
    got = smollm2_run["first_logits"]
    assert got.dtype == mx.float32
    assert_close(got, smollm2_reference["last_logits"], GGUF_FP32_REL)


def test_smollm2_greedy_answer_matches_transformers(smollm2_run, smollm2_reference):
    assert_same_tokens(smollm2_run["answer"], smollm2_reference["answer"].tolist())
    assert "Paris" in str(smollm2_reference["answer_text"])


@pytest.mark.skipif(
    mx.default_device() == mx.cpu, reason="float16 matmuls on MLX's CPU build take minutes for this model"
)
def test_smollm2_default_dtype_is_close(smollm2_gguf, smollm2_reference):
    """The app opens GGUF files in float16 (MLX's fast path on a Mac or a CUDA GPU)."""
    model = ferrum_mac.open_model(smollm2_gguf)
    assert model.config.dtype == "float16"
    got = model.prefill("q", smollm2_reference["prompt"].tolist())
    assert got.dtype == mx.float16
    want = smollm2_reference["last_logits"]
    assert rel_err(got, want) <= GGUF_FP16_REL
    assert int(np.argmax(to_np(got))) == int(np.argmax(want))


def test_smollm2_default_dtype(smollm2_gguf):
    """float16 (its scales' dtype) on a GPU; float32 on MLX's CPU build, where half precision is slow."""
    from ferrum_mac.backends.mlx.runtime import compute_dtype
    from ferrum_mac.weights import load_checkpoint

    want = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    assert compute_dtype(load_checkpoint(smollm2_gguf), None) == want
