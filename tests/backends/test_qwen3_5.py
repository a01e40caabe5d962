"""Qwen3.5 (dense, text) on both backends against transformers' Qwen3_5ForCausalLM (torch CPU,
fp32), on a tiny random model of three Gated DeltaNet layers and one gated attention layer:
prefill over several chunks, decode steps, decode_batch of mixed lengths, a unified step,
greedy decoding; and the recurrent states the state manager keeps beside the attention
layers' keys and values: released, cut back (emptied: a state cannot go back), never reused
from the prefix cache, and speculation off for the model.

fp32 on both sides: transformers runs the delta rule's chunked form, ferrum its recurrent step,
so the logits differ by summation order (~1e-6); 1e-4 catches any slip."""

from __future__ import annotations

import pytest
import torch

import ferrum_mac
from ferrum_mac.errors import CacheStateError
from ferrum_mac.llm import DecodeItem, ForwardItem
from ferrum_mac.sequence_state import MISS_RECURRENT, Recurrent
from helpers import (
    VOCAB,
    assert_close,
    assert_same_tokens,
    ferrum_greedy,
    hf_greedy,
    hf_logits,
    installed_backends,
    random_tokens,
)

FP32_REL = 1e-4
PROMPT = random_tokens(80, seed=13)
BACKENDS = installed_backends()


def qwen3_5_config(**changes):
    from transformers import Qwen3_5TextConfig

    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,  # linear, linear, linear, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads; a quarter of it turned by RoPE
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,  # != key dim
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # each key head serves two value heads
        initializer_range=0.2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Qwen3_5TextConfig(**{**settings, **changes})


def build_reference(**changes):
    """A random Qwen3_5ForCausalLM whose norms' weights are random too (zero-centred: they start at 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen3_5_config(**changes), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
            if name.endswith("dt_bias"):
                p.normal_(0, 1.0)
    return model


@pytest.fixture(scope="module")
def reference():
    return build_reference()


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5")
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def want(reference):
    return hf_logits(reference, PROMPT)


@pytest.fixture(scope="module", params=BACKENDS)
def model(request, folder):
    return ferrum_mac.open_model(folder, backend=request.param, dtype="float32")


def test_the_layer_kinds_read_the_config(model):
    kinds = model.config.layer_kinds
    assert [isinstance(kind, Recurrent) for kind in kinds] == [True, True, True, False]
    assert model.state.kinds == kinds
    assert not model.state.cuts_back


def test_prompt_logits_match_transformers(model, want):
    assert_close(model.prefill("p", PROMPT), want[-1], FP32_REL, "prefill's last logits")
    assert_close(model.forward_verify("v", PROMPT), want, FP32_REL, "every position's logits")
    model.release("v")
    model.release("p")


def test_a_prompt_of_several_delta_rule_chunks(model, reference):
    """200 tokens: the delta rule's chunks of 64 (the last one padded), each from the state the last left."""
    prompt = random_tokens(200, seed=17)
    assert_close(model.prefill("long", prompt), hf_logits(reference, prompt)[-1], FP32_REL, "200 tokens")
    model.release("long")


def test_chunked_prefill_and_a_decode_step(model, want, monkeypatch):
    monkeypatch.setattr(model, "prefill_chunk", 24)  # 4 chunks, each from the states the last left
    assert_close(model.prefill("c", PROMPT[:-1]), want[-2], FP32_REL, "chunked prefill")
    assert model.state.length("c") == len(PROMPT) - 1
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


def test_unified_step(model, reference):
    """A decode step beside a prefill chunk, each from its own sequence's states."""
    a, b = PROMPT[:50], PROMPT[10:75]
    model.prefill("u-a", a)
    model.prefill("u-b", b[:30])
    out = model.unified_forward([ForwardItem("u-a", [5], len(a)), ForwardItem("u-b", b[30:], 30)])
    assert_close(out[0], hf_logits(reference, a + [5])[-1], FP32_REL, "the decode step")
    assert_close(out[1], hf_logits(reference, b)[-1], FP32_REL, "the chunk")
    model.release("u-a")
    model.release("u-b")


def test_greedy_matches_transformers(model, reference):
    want = hf_greedy(reference, PROMPT, 64)
    assert_same_tokens(ferrum_greedy(model, "g", PROMPT, 64), want)
    model.release("g")


def test_a_cut_empties_the_sequence_and_a_prefill_restores_it(model, want):
    model.prefill("t", PROMPT[:40])
    model.truncate_kv("t", 40)  # no shorter: nothing changes
    assert model.state.length("t") == 40
    model.truncate_kv("t", 30)  # a recurrent state cannot go back to position 30
    assert model.state.length("t") == 0
    assert_close(model.prefill("t", PROMPT), want[-1], FP32_REL, "prefilled again")
    model.release("t")
    assert model.state.length("t") == 0


def test_memory_counts_the_attention_layers_kv_and_each_sequences_states(model):
    """KV per token: the one attention layer's (2 kv heads of 32, float32); each sequence's
    states (3 layers: the convolution's last 3 inputs of 160 channels, and 4 x 16 x 24 floats)
    are 24192 bytes, 48 such tokens, counted once per sequence."""
    assert model.config.kv_bytes_per_token(4) == 2 * 2 * 32 * 4
    assert model.state.recurrent.tokens_per_sequence == 48
    pool = model.state.pool
    assert model.state.tokens_for([100, 7]) == pool.allocation_for([100, 7]) + 2 * 48
    model.prefill("mem", PROMPT[:5])
    assert model.state.allocated_tokens() == pool.allocated_tokens + 48
    assert model.state.recurrent.nbytes() == 3 * (3 * 160 * 4 + 4 * 16 * 24 * 4)
    model.release("mem")


def test_a_forward_must_continue_the_state(model):
    model.prefill("s", PROMPT[:10])
    with pytest.raises(CacheStateError):
        model.decode("s", 3, 12)
    model.release("s")


def test_the_prefix_cache_reuses_nothing_and_says_why(model):
    first, second = PROMPT[:70] + [9, 9], PROMPT[:70] + [4, 5, 6]
    model.prefill("first", first)
    model.state.remember("first", first)
    model.release("first")
    found = model.state.reuse("second", second)
    assert (found.tokens, found.cached, found.miss) == (0, 0, MISS_RECURRENT)
    model.reset()


# -- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(model, folder):
    from ferrum_mac.engine import Engine
    from ferrum_mac.text import load_chat_template, load_tokenizer

    write_word_tokenizer(folder)
    tokenizer = load_tokenizer(folder)
    model.reset()
    return Engine(model, tokenizer, load_chat_template(folder, tokenizer))


def write_word_tokenizer(folder) -> None:
    """Words `w3` ... of the vocabulary, each piece with its space before it: an answer's text
    encodes to its own ids again, so the next turn's prompt starts with what the cache holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"\u2581w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()  # (each word's piece starts with its space)
    tok.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def greedy_conversation(engine, **changes):
    sampling = engine.default_sampling.replace(temperature=0.0, repetition_penalty=1.0)
    return engine.conversation(sampling=sampling, max_tokens=10, prepare=False, **changes)


def answer_of(events) -> str:
    from ferrum_mac.engine import TextDelta

    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_a_conversation_answers_as_a_fresh_prefill(engine):
    """Turn after turn (speculation asked for: it stays off for this model), the conversation
    answers as one that prefills its whole history anew."""
    from ferrum_mac.engine.speculation import Speculate

    from ferrum_mac.engine import Done

    conv = greedy_conversation(engine, speculate=Speculate("ngram"))
    continued = []
    for text in ("w5 w6 w7 w8", "w9 w10", "w11 w12 w13", "w14"):
        fresh = greedy_conversation(engine)
        fresh.messages = [dict(m) for m in conv.messages]
        want = answer_of(fresh.send(text))
        engine.close_conversation(fresh)
        events = list(conv.send(text))
        assert answer_of(events) == want, text
        assert engine.model.state.length(conv.cache_id) == len(conv.ledger)
        done = events[-1]
        assert isinstance(done, Done) and done.speculation is None
        continued.append(done.cached_tokens)
    assert len(conv.messages) == 8
    # a turn whose history renders as the cache holds it goes on from the states the last left
    # (after an answer cut at its end token, the render differs: that turn prefills anew)
    assert any(continued[1:]), continued
    engine.close_conversation(conv)


# -- the MoE variants: Qwen3-Next (fused linear projections) and Qwen3.5-MoE --------------------

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def variant_reference(name: str):
    """A random Qwen3NextForCausalLM (its second layer a dense MLP) or Qwen3_5MoeForCausalLM."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig

    settings = {k: v for k, v in qwen3_5_config().to_dict().items() if k in QWEN3_5_KEYS}
    if name == "qwen3_next":
        config = Qwen3NextConfig(**settings, **MOE, mlp_only_layers=[1], norm_topk_prob=False)
    else:
        config = Qwen3_5MoeTextConfig(**settings, **MOE)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.normal_(0, 0.3)
            if param_name.endswith(("dt_bias", "mlp.gate.weight")):
                p.normal_(0, 1.0)
    return model


QWEN3_5_KEYS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
    "head_dim linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads "
    "linear_num_value_heads initializer_range max_position_embeddings rms_norm_eps bos_token_id "
    "eos_token_id pad_token_id"
).split()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def variant(request, tmp_path_factory):
    reference = variant_reference(request.param)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)
    return reference, path


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_moe_variants_match_transformers(variant, backend, monkeypatch):
    reference, path = variant
    model = ferrum_mac.open_model(path, backend=backend, dtype="float32")
    assert sum(isinstance(kind, Recurrent) for kind in model.config.layer_kinds) == 3
    want = hf_logits(reference, PROMPT)
    assert_close(model.prefill("p", PROMPT), want[-1], FP32_REL, "prefill")
    monkeypatch.setattr(model, "prefill_chunk", 24)
    assert_close(model.prefill("c", PROMPT[:-1]), want[-2], FP32_REL, "chunked prefill")
    assert_close(model.decode("c", PROMPT[-1], len(PROMPT) - 1), want[-1], FP32_REL, "a decode step")
    model.prefill("short", PROMPT[:9])
    got = model.decode_batch([DecodeItem("short", 3, 9), DecodeItem("p", 4, len(PROMPT))])
    assert_close(got[0], hf_logits(reference, PROMPT[:9] + [3])[-1], FP32_REL, "batch row 0")
    assert_close(got[1], hf_logits(reference, PROMPT + [4])[-1], FP32_REL, "batch row 1")
    assert_same_tokens(ferrum_greedy(model, "g", PROMPT, 64), hf_greedy(reference, PROMPT, 64))


# -- mlx-lm's conversions -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_mlx_lm_conversions_match_mlx_lm(name, tmp_path):
    """mlx-lm stores the convolutions `(channels, kernel, 1)` and adds the 1 into the
    zero-centred norms' weights (Qwen3.5 inside its multimodal wrapper: `language_model.model.*`):
    both backends read them so, and answer as mlx-lm does."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx_lm import convert, load

    import helpers

    reference = build_reference() if name == "qwen3_5" else variant_reference(name)
    folder = tmp_path / "hf"
    reference.save_pretrained(folder)
    helpers.write_tiny_tokenizer(folder)
    raw = helpers.read_config(folder)
    rope = raw.get("rope_parameters") or {}
    raw = {**raw, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    if name == "qwen3_5":  # mlx-lm reads the multimodal checkpoint's config only
        raw = {"model_type": "qwen3_5", "text_config": raw, "tie_word_embeddings": False}
    helpers.write_config(folder, raw)
    out = tmp_path / "mlx"
    convert(str(folder), str(out), dtype="float32")
    mlx_lm_model, _ = load(str(out))
    want = helpers.to_np(mlx_lm_model(mx.array([PROMPT]))[0])
    for backend in BACKENDS:
        model = ferrum_mac.open_model(out, backend=backend, dtype="float32")
        assert_close(model.forward_verify("m", PROMPT), want, FP32_REL, f"{backend} against mlx-lm")


# -- the server ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_scheduler_batches_hybrid_sequences_without_guessing(folder, backend):
    """`ferrum serve`'s scheduler, speculation asked for: several requests batched together
    answer as each does alone, and none guesses (its guesses could not be cut back)."""
    from ferrum_mac.compose import open_engine
    from ferrum_mac.engine import Done, TextDelta
    from ferrum_mac.serve import EventQueue, GenerationRequest, Scheduler

    write_word_tokenizer(folder)
    scheduler = Scheduler(lambda: open_engine(folder, backend=backend, dtype="float32"), speculate="ngram").start()
    try:
        prompts = [PROMPT[:n] for n in (9, 30, 55, 80)]

        def send(ids):
            queue = EventQueue()
            scheduler.submit(GenerationRequest(list(ids), emit=queue.put, max_tokens=16))
            return queue

        def answer(queue):
            events = list(queue.events(timeout=120))
            assert isinstance(events[-1], Done), events[-1]
            return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]

        alone = [answer(send(p)) for p in prompts]
        together = [answer(q) for q in [send(p) for p in prompts]]
        assert [text for text, _ in together] == [text for text, _ in alone]
        assert all(done.speculation is None for _, done in alone + together)
    finally:
        scheduler.stop()


# -- MLX's CUDA routes (their kernels computed by MLX ops on this CPU) -----------------------


@pytest.mark.skipif("mlx" not in BACKENDS, reason="MLX is not installed")
def test_cuda_routes_take_the_gated_attention_layers(folder, reference, monkeypatch):
    """On MLX's CUDA build the gated attention layer takes its routes (padded prefill
    attention, the decode kernel through block tables); the linear layers MLX's own ops."""
    from backends.test_gemma3 import decode_kernel_on_the_cpu
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
    assert decode_kernel_on_the_cpu.calls == 1  # the one attention layer's
