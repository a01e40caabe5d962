"""Gemma 3 (text) on both backends against transformers' Gemma3ForCausalLM (torch CPU, fp32),
on a tiny random model whose window (16) is far shorter than the prompts (80 tokens): local
and global layers, chunked prefill, decode steps, decode_batch of mixed lengths, a unified
step, verifies, the prefix cache and speculation's cut-backs all see only the window.

fp32 on both sides: the logits differ by summation order only (~1e-6), so 1e-4 catches any
slip (a window off by one moves them by 1e-2 or more: the window test below checks that)."""

from __future__ import annotations

import json

import pytest
import torch

import ferrum_mac
from ferrum_mac.errors import UnsupportedModelError
from ferrum_mac.llm import DecodeItem, ForwardItem
from helpers import (
    VOCAB,
    argmax,
    assert_close,
    assert_same_tokens,
    ferrum_greedy,
    hf_greedy,
    hf_logits,
    installed_backends,
    random_tokens,
    rel_err,
)

FP32_REL = 1e-4
WINDOW = 16
PROMPT = random_tokens(80, seed=11)  # 5 windows
BACKENDS = installed_backends()


def gemma3_config(**changes):
    from transformers import Gemma3TextConfig

    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,  # local, global, local, global
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=24,  # != head_dim
        final_logit_softcapping=30.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},  # the global layers' only
        initializer_range=0.2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Gemma3TextConfig(**{**settings, **changes})


def build_reference(**changes):
    """A random Gemma3ForCausalLM whose norms' weights are random too (they start at 0: 1 + w = 1)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3_config(**changes), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def reference():
    return build_reference()


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def want(reference):
    return hf_logits(reference, PROMPT)


@pytest.fixture(scope="module", params=BACKENDS)
def model(request, folder):
    return ferrum_mac.open_model(folder, backend=request.param, dtype="float32")


def test_the_window_reads_the_config(model):
    kinds = [str(kind) for kind in model.config.layer_kinds]
    assert kinds == [f"a sliding window of {WINDOW} tokens", "full attention"] * 2
    assert model.state.kinds == model.config.layer_kinds
    assert model.kv_capacity() > len(PROMPT)  # not capped at the window


def test_prompt_logits_match_transformers(model, want):
    assert_close(model.forward_verify("v", PROMPT), want, FP32_REL, "every position's logits")
    assert_close(model.prefill("p", PROMPT), want[-1], FP32_REL, "prefill's last logits")
    model.release("v")
    model.release("p")


def test_chunked_prefill_and_a_decode_step(model, want, monkeypatch):
    monkeypatch.setattr(model, "prefill_chunk", 24)  # chunks of 24: 4 chunks, each past the window
    assert_close(model.prefill("c", PROMPT[:-1]), want[-2], FP32_REL, "chunked prefill")
    assert_close(model.decode("c", PROMPT[-1], len(PROMPT) - 1), want[-1], FP32_REL, "a decode step")
    model.release("c")


def test_decode_batch_of_mixed_lengths(model, reference):
    prompts = {"short": PROMPT[:9], "mid": PROMPT[:40], "long": PROMPT}
    for name, prompt in prompts.items():
        model.prefill(f"b-{name}", prompt)
    for step in range(2):
        items = [DecodeItem(f"b-{name}", 3 + step, len(p) + step) for name, p in prompts.items()]
        got = model.decode_batch(items)
        for row, prompt in enumerate(prompts.values()):
            tokens = prompt + [3 + s for s in range(step + 1)]
            assert_close(got[row], hf_logits(reference, tokens)[-1], FP32_REL, f"step {step} row {row}")
    for name in prompts:
        model.release(f"b-{name}")


def test_unified_step_and_verify_batch(model, reference):
    """A decode step beside a prefill chunk, then verifies of two sequences together."""
    a, b = PROMPT[:50], PROMPT[10:75]
    model.prefill("u-a", a)
    model.prefill("u-b", b[:30])
    out = model.unified_forward([ForwardItem("u-a", [5], len(a)), ForwardItem("u-b", b[30:], 30)])
    assert_close(out[0], hf_logits(reference, a + [5])[-1], FP32_REL, "the decode step")
    assert_close(out[1], hf_logits(reference, b)[-1], FP32_REL, "the chunk")
    guesses = [ForwardItem("u-a", [7, 8, 9], len(a) + 1), ForwardItem("u-b", [4, 6], len(b))]
    rows = model.verify_batch(guesses)
    assert_close(rows[0], hf_logits(reference, a + [5, 7, 8, 9])[-3:], FP32_REL, "a's verify")
    assert_close(rows[1], hf_logits(reference, b + [4, 6])[-2:], FP32_REL, "b's verify")
    model.release("u-a")
    model.release("u-b")


def test_greedy_matches_transformers(model, reference):
    want = hf_greedy(reference, PROMPT, 64)
    assert_same_tokens(ferrum_greedy(model, "g", PROMPT, 64), want)
    model.release("g")


def test_the_prefix_cache_is_exact_past_the_window(model):
    """A second prompt sharing 70 tokens (more than 4 windows) reuses them, and continues as
    it does computed whole."""
    first, second = PROMPT[:70] + [9, 9, 9], PROMPT[:70] + [4, 5, 6, 7]
    plain = ferrum_greedy(model, "plain", second, 24)
    model.release("plain")
    model.prefill("first", first)
    model.state.remember("first", first)
    model.release("first")
    reused = model.state.reuse("second", second)
    assert reused.cached >= 64, reused
    assert_same_tokens(ferrum_greedy_from(model, "second", second, reused.tokens, 24), plain)
    model.release("second")
    model.reset()


def test_speculation_is_exact_past_the_window(model):
    """Greedy decoding by verifies of guesses (every third wrong), each cut back to what is
    kept (as the engine's speculation does), gives the plain greedy tokens."""
    plain = ferrum_greedy(model, "plain", PROMPT, 40)
    model.release("plain")
    logits, pos, out = model.prefill("s", PROMPT), len(PROMPT), []
    while len(out) < 40:
        out.append(int(argmax(logits)))
        guesses = [t if i % 3 != 2 else (t + 1) % VOCAB for i, t in enumerate(plain[len(out) : len(out) + 4])]
        rows = model.forward_verify("s", [out[-1]] + guesses)
        kept = 0
        while kept < len(guesses) and int(argmax(rows[kept])) == guesses[kept] and len(out) < 40:
            out.append(guesses[kept])
            kept += 1
        pos += 1 + kept
        model.truncate_kv("s", pos)
        logits = rows[kept]
    assert_same_tokens(out[:40], plain)
    model.release("s")


def windowed_blocks(model, cache_id: str) -> list[int]:
    """The windowed layers' blocks `cache_id` holds (not the scratch block its table names for the rest)."""
    return [b for b in model.state.windowed.pool.get(cache_id).blocks if b != 0]


def test_a_windowed_layer_keeps_its_window_and_a_block(model, reference, monkeypatch):
    monkeypatch.setattr(model, "prefill_chunk", 24)
    model.prefill("m", PROMPT)
    for step in range(60):
        logits = model.decode("m", 3 + step % 5, len(PROMPT) + step)
        blocks = windowed_blocks(model, "m")
        assert len(blocks) <= -(-WINDOW // 32) + 1, (step, blocks)
    assert len(model.state.pool.get("m").blocks) == -(-(len(PROMPT) + 60) // 32)  # the global layers keep all
    context = PROMPT + [3 + s % 5 for s in range(60)]
    assert_close(logits, hf_logits(reference, context)[-1], FP32_REL, "after 60 steps")
    # what the scheduler admits against: half the layers keep 32k tokens, half a window
    assert model.state.tokens_for([32768]) == (32768 // 32 + 1) * 32 // 2 + 3 * 32 // 2
    assert model.state.windowed.allocation_for([32768]) == 3 * 32
    model.release("m")


def test_a_cut_past_the_window_empties_the_sequence(model, reference):
    model.prefill("t", PROMPT)
    for step in range(40):
        model.decode("t", 3, len(PROMPT) + step)
    model.truncate_kv("t", len(PROMPT) + 38)  # a speculation's cut: the window is still there
    assert model.state.length("t") == len(PROMPT) + 38
    model.truncate_kv("t", 50)  # a rewritten history: the window of position 50 is gone
    assert model.state.length("t") == 0
    assert_close(model.prefill("t", PROMPT), hf_logits(reference, PROMPT)[-1], FP32_REL)
    model.release("t")


def test_the_prefix_cache_reuses_only_a_window_it_kept(model, monkeypatch):
    """A prompt prefilled in chunks lets go of its first blocks' window as it goes: a prompt
    sharing only those blocks finds nothing to reuse (its window is gone), one sharing more
    reuses up to a block whose window is kept; both answer as computed whole."""
    from ferrum_mac.sequence_state import MISS_WINDOW

    model.reset()
    monkeypatch.setattr(model, "prefill_chunk", 24)  # chunks at 0, 24, 48, 72: block 0 let go at 72
    model.prefill("w", PROMPT)
    model.state.remember("w", PROMPT)
    model.release("w")
    for shared, cached in ((40, 0), (70, 64)):
        prompt = PROMPT[:shared] + [4, 5, 6, 7]
        plain = ferrum_greedy(model, "plain", prompt, 12)
        model.release("plain")
        found = model.state.reuse("r", prompt)
        assert found.tokens == cached, found
        assert found.miss == MISS_WINDOW or cached
        assert_same_tokens(ferrum_greedy_from(model, "r", prompt, found.tokens, 12), plain)
        model.release("r")
    model.reset()


def test_kept_windows_follow_the_pool_and_go_with_their_nodes(model, monkeypatch):
    """The windowed blocks the cache keeps are renumbered with their pool (which shrinks when
    long sequences go) and let go of when their nodes are evicted: nothing leaks."""
    model.reset()
    windowed = model.state.windowed
    for name, seed in (("long-a", 1), ("long-b", 2), ("long-c", 3)):
        model.prefill(name, random_tokens(300, seed=seed))  # one chunk: its 10 blocks, until its next step
    monkeypatch.setattr(model, "prefill_chunk", 24)
    model.prefill("w", PROMPT)
    model.state.remember("w", PROMPT)
    model.release("w")
    before = windowed.pool.blocks
    for name in ("long-a", "long-b", "long-c"):
        model.release(name)
    prompt = PROMPT[:70] + [4, 5, 6, 7]
    plain = ferrum_greedy(model, "plain", prompt, 12)
    model.release("plain")
    found = model.state.reuse("r", prompt)
    assert found.tokens == 64 and windowed.pool.blocks < before  # kept across a shrink
    assert_same_tokens(ferrum_greedy_from(model, "r", prompt, found.tokens, 12), plain)
    model.release("r")
    model.state.pool.prefix.evict(1 << 20)
    assert not windowed.kept and not any(windowed.pool.refs[1:])
    model.reset()


def ferrum_greedy_from(model, cache_id: str, prompt, held: int, n: int) -> list[int]:
    """`ferrum_greedy` of a sequence that holds `held` tokens of `prompt` already."""
    logits, out, pos = model.prefill(cache_id, prompt[held:]), [], len(prompt)
    for step in range(n):
        out.append(int(argmax(logits)))
        if step + 1 < n:
            logits = model.decode(cache_id, out[-1], pos)
            pos += 1
    return out


def test_the_engines_speculation_is_exact_past_the_window(model):
    """The engine's decode loop with prompt lookup (its guesses from a repeating prompt, always
    worth verifying) gives the tokens of its plain greedy loop."""
    from ferrum_mac.engine.decode_loop import answer_tokens
    from ferrum_mac.engine.sampling import SamplingParams
    from ferrum_mac.engine.speculation import Speculate
    from ferrum_mac.engine.speculation.controller import MAX_K
    from ferrum_mac.engine.speculation.step_times import StepTimes

    prompt = random_tokens(20, seed=5) * 5  # 100 tokens: what follows a repeat is guessed
    greedy = SamplingParams(temperature=0.0)
    times = StepTimes()
    times.use([1.0] * (MAX_K + 1))  # a verify as cheap as a step: always guess
    answers = []
    for speculate in (None, Speculate("ngram")):
        logits = model.prefill("e", prompt)
        tokens, stats = answer_tokens(
            model, model.sampler(greedy, prompt), "e", logits, 48, speculate=speculate, prompt=prompt, times=times
        )
        answers.append(list(tokens))
        model.release("e")
    assert stats is not None and stats.steps > 0 and stats.accepted > 0, stats
    assert_same_tokens(answers[1], answers[0])


def test_the_window_changes_the_answer(reference, want):
    """The same weights with every layer global give other logits past the window: the
    parity above really tests the window."""
    full = build_reference(sliding_window=4096)
    everywhere = hf_logits(full, PROMPT)
    assert rel_err(everywhere[:WINDOW], want[:WINDOW]) < FP32_REL
    assert rel_err(everywhere[WINDOW:], want[WINDOW:]) > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_softcap_matches_transformers_eager(backend, tmp_path, monkeypatch):
    """Gemma 3's configs leave the score cap unset, and transformers' Gemma 3 passes it to no
    attention; its eager attention computes it when passed, which is the reference here."""
    from transformers.models.gemma3 import modeling_gemma3

    reference = build_reference(attn_logit_softcapping=20.0)
    reference.save_pretrained(tmp_path)
    eager = modeling_gemma3.eager_attention_forward
    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", lambda *a, **k: eager(*a, **{**k, "softcap": 20.0}))
    reference.set_attn_implementation("eager")
    want = hf_logits(reference, PROMPT[:40])
    model = ferrum_mac.open_model(tmp_path, backend=backend, dtype="float32")
    assert_close(model.forward_verify("x", PROMPT[:40]), want, FP32_REL, "capped scores")
    model.prefill("d", PROMPT[:30])
    rows = model.decode_batch([DecodeItem("d", PROMPT[30], 30), DecodeItem("x", 3, 40)])
    assert_close(rows[0], want[30], FP32_REL, "a capped decode row")


def test_multimodal_checkpoint_loads_its_text_model(folder, reference, tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint: `gemma3` with a `text_config`, its text
    weights under `language_model.model.` (the vision tower's are not read)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    renamed = {f"language_model.{name}": t for name, t in tensors.items()}
    renamed["vision_tower.vision_model.post_layernorm.weight"] = torch.zeros(3)
    save_file(renamed, tmp_path / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    model = ferrum_mac.open_model(tmp_path, backend=BACKENDS[0], dtype="float32")
    assert_close(model.forward_verify("x", PROMPT[:20]), hf_logits(reference, PROMPT[:20]), FP32_REL)


@pytest.mark.parametrize(
    "field, value", [("use_bidirectional_attention", True), ("hidden_activation", "relu"), ("layer_types", ["chunked"])]
)
def test_an_unknown_variant_names_its_field(folder, tmp_path, field, value):
    import shutil

    shutil.copy(folder / "model.safetensors", tmp_path / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError) as err:
        ferrum_mac.open_model(tmp_path, dtype="float32")
    message = str(err.value)
    assert "\n" not in message and (field in message or str(value[0] if isinstance(value, list) else value) in message)


# -- GGUF, as llama.cpp's converter writes Gemma 3 ----------------------------------------

GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def write_gemma3_gguf(model, path):
    """llama.cpp's names and header keys; its norms stored as (1 + w); q/k rows not permuted
    (Gemma's rope is the NeoX one); every sixth layer global and scores by 1/sqrt(head_dim),
    which llama.cpp assumes (the header does not carry them)."""
    import gguf

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in (
        ("block_count", c.num_hidden_layers),
        ("context_length", c.max_position_embeddings),
        ("embedding_length", c.hidden_size),
        ("feed_forward_length", c.intermediate_size),
        ("attention.head_count", c.num_attention_heads),
        ("attention.head_count_kv", c.num_key_value_heads),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("attention.sliding_window", c.sliding_window),
    ):
        w.add_uint32(f"gemma3.{key}", value)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32("gemma3.rope.freq_base", c.rope_parameters["full_attention"]["rope_theta"])
    w.add_string("gemma3.rope.scaling.type", "linear")
    w.add_float32("gemma3.rope.scaling.factor", c.rope_parameters["full_attention"]["factor"])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([1] * c.vocab_size)

    def add(name, array, norm=False):
        w.add_tensor(name, (array + 1 if norm else array).astype("float32"))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"], norm=True)
    for i in range(c.num_hidden_layers):
        for hf, short in GGUF_NAMES.items():
            add(f"blk.{i}.{short}.weight", sd[f"model.layers.{i}.{hf}.weight"], norm=hf.endswith("norm"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("backend", BACKENDS)
def test_gguf_matches_transformers(backend, tmp_path):
    reference = build_reference(
        num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32, final_logit_softcapping=None
    )
    path = write_gemma3_gguf(reference, tmp_path / "gemma3.gguf")
    model = ferrum_mac.open_model(path, backend=backend, dtype="float32")
    assert [bool(getattr(kind, "window", 0)) for kind in model.config.layer_kinds] == [True] * 5 + [False]
    assert_close(model.forward_verify("x", PROMPT), hf_logits(reference, PROMPT), FP32_REL, "GGUF logits")


# -- MLX's CUDA routes (their kernels computed by MLX ops on this CPU) -----------------------


def decode_kernel_on_the_cpu(q, keys, values, tables, positions, scale, longest=None, block_tokens=32):
    """What `cuda_attention.decode_attention` computes: each row attends the keys its block
    table names, up to its position."""
    import mlx.core as mx

    decode_kernel_on_the_cpu.calls += 1
    out = []
    for b, (table, p) in enumerate(zip(tables.tolist(), positions.tolist())):
        rows = mx.array([table[t // block_tokens] * block_tokens + t % block_tokens for t in range(p + 1)])
        k, v = keys[:, :, rows], values[:, :, rows]
        out.append(mx.fast.scaled_dot_product_attention(q[b : b + 1, :, None, :], k, v, scale=scale)[0, :, 0])
    return mx.stack(out)


@pytest.mark.skipif("mlx" not in BACKENDS, reason="MLX is not installed")
def test_cuda_routes_take_the_global_layers_only(folder, reference, monkeypatch):
    """On MLX's CUDA build the global layers take its routes (padded prefill attention, the
    decode kernel through block tables) and the windowed layers MLX's own ops, over their pool."""
    from ferrum_mac.backends.mlx.cuda import attention as cuda_attention
    from ferrum_mac.backends.mlx.cuda.ops import CudaOps
    from ferrum_mac.backends.options import BackendOptions
    from helpers import open_mlx

    class KernelOnTheCpu(CudaOps):
        def decode_kernel_takes(self, attn) -> bool:
            return True

    monkeypatch.setattr(cuda_attention, "decode_attention", decode_kernel_on_the_cpu)
    decode_kernel_on_the_cpu.calls = 0
    model = open_mlx(folder, KernelOnTheCpu(BackendOptions(cuda_heads=False)))
    assert_close(model.forward_verify("v", PROMPT), hf_logits(reference, PROMPT), FP32_REL, "a forward")
    model.prefill("a", PROMPT[:33])
    rows = model.decode_batch([DecodeItem("v", 3, len(PROMPT)), DecodeItem("a", 4, 33)])
    assert_close(rows[0], hf_logits(reference, PROMPT + [3])[-1], FP32_REL, "a long row")
    assert_close(rows[1], hf_logits(reference, PROMPT[:33] + [4])[-1], FP32_REL, "a short row")
    assert decode_kernel_on_the_cpu.calls == 2  # the global layers', once each
