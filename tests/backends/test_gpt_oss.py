"""gpt-oss on both backends against transformers' GptOssForCausalLM (torch CPU, fp32), on a tiny
random model whose window (16) is far shorter than the prompts (80 tokens): a windowed layer
and a full one, both with sinks; the biased MoE with its clamped SwiGLU; YaRN. Prefill,
chunked prefill, decode steps, decode_batch of mixed lengths, the prefix cache and
speculation all agree with transformers or with the plain greedy loop.

Biases, norms and sinks are drawn at random (transformers starts biases at 0 and norms at 1,
which would hide a missing one), and the clamp is low enough to bite: the tests below check
that the sinks and the clamp really move transformers' answer."""

from __future__ import annotations

import pytest
import torch

import ferrum_mac
from ferrum_mac.errors import UnsupportedModelError
from ferrum_mac.llm import DecodeItem, ForwardItem
from helpers import (
    FAMILY_FACTORIES,
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


def build_reference(**changes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILY_FACTORIES["gpt_oss"](**changes), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.normal_(1, 0.3)
    return model


@pytest.fixture(scope="module")
def reference():
    return build_reference()


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    reference.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def want(reference):
    return hf_logits(reference, PROMPT)


@pytest.fixture(scope="module", params=BACKENDS)
def model(request, folder):
    return ferrum_mac.open_model(folder, backend=request.param, dtype="float32")


def test_the_config_reads_windows_sinks_and_yarn(model):
    kinds = [str(kind) for kind in model.config.layer_kinds]
    assert kinds == [f"a sliding window of {WINDOW} tokens", "full attention"]
    c = model.model.config  # (the checkpoint's, beside the engine's `model.config`)
    assert c.attention_sinks and c.qkv_bias and c.o_bias
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["original_max_position_embeddings"] == 256


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
    logits, out, pos = model.prefill("second", second[reused.tokens :]), [], len(second)
    for step in range(24):
        out.append(int(argmax(logits)))
        if step < 23:
            logits = model.decode("second", out[-1], pos)
            pos += 1
    assert_same_tokens(out, plain)
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


def test_the_engines_speculation_is_exact(model):
    """The engine's decode loop with prompt lookup gives the tokens of its plain greedy loop."""
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


@pytest.mark.skipif("torch" not in BACKENDS, reason="torch is not installed")
@pytest.mark.parametrize("route", ["grouped", "gathered", "dense"])
def test_every_torch_expert_route_agrees(folder, want, route):
    model = ferrum_mac.open_model(folder, backend="torch", dtype="float32")
    for layer in model.model.layers:  # (as FERRUM_TORCH_MOE_ROUTE forces it at load)
        layer.mlp.experts.forced_route = route
    assert_close(model.forward_verify("r", PROMPT[:40]), want[:40], FP32_REL, f"{route} prompt")
    assert_close(model.decode("r", PROMPT[40], 40), want[40], FP32_REL, f"{route} decode")


def test_sinks_and_the_clamp_change_the_answer(reference, want):
    """Without sinks, or with gpt-oss's own clamp (7, which these weights rarely reach), the same
    weights answer otherwise: the parity above really tests both."""
    unclamped = build_reference(swiglu_limit=7.0)
    assert rel_err(hf_logits(unclamped, PROMPT), want) > 0.02
    with torch.no_grad():
        for layer in unclamped.model.layers:
            layer.mlp.experts.limit = 2.0
            layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
    assert rel_err(hf_logits(unclamped, PROMPT), want) > 0.02


def mlx_lm_layout(folder, out):
    """The checkpoint as mlx-lm's conversions store it (mlx-community): experts split by
    projection, outputs first, with `.bias`; the fused transformers tensors gone."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        p = name.rsplit(".", 1)[0]
        gate_up, bias = tensors.pop(name).transpose(1, 2), tensors.pop(f"{p}.gate_up_proj_bias")
        tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"] = gate_up[:, ::2], gate_up[:, 1::2]
        tensors[f"{p}.gate_proj.bias"], tensors[f"{p}.up_proj.bias"] = bias[:, ::2], bias[:, 1::2]
        tensors[f"{p}.down_proj.weight"] = tensors.pop(f"{p}.down_proj").transpose(1, 2)
        tensors[f"{p}.down_proj.bias"] = tensors.pop(f"{p}.down_proj_bias")
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    shutil.copy(folder / "config.json", out / "config.json")
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_mlx_lm_conversion_loads(folder, want, tmp_path, backend):
    mlx_lm_layout(folder, tmp_path)
    model = ferrum_mac.open_model(tmp_path, backend=backend, dtype="float32")
    assert_close(model.forward_verify("x", PROMPT[:40]), want[:40], FP32_REL, "mlx-lm's layout")


@pytest.mark.skipif("mlx" not in BACKENDS, reason="MLX is not installed")
def test_an_mlx_lm_quantized_conversion_matches_mlx_lm(folder, tmp_path):
    """mlx-lm's converter quantizes the experts (4-bit, groups of 32) and the router (its
    predicate: 8-bit, groups of 64); ferrum on both backends against mlx-lm's gpt_oss on the
    very same packed weights. (mlx-lm fixes the clamp at gpt-oss's 7: so does this model.)"""
    import mlx.core as mx
    from mlx_lm import convert, load

    import helpers

    build_reference(swiglu_limit=7.0, intermediate_size=64).save_pretrained(tmp_path / "hf")
    raw = mlx_lm_layout(tmp_path / "hf", tmp_path)
    # mlx-lm reads rope_theta and rope_scaling, as transformers 4 wrote them, and YaRN's ramp
    # always truncated (the default, which transformers and ferrum then agree on)
    rope = raw.pop("rope_parameters")
    del rope["truncate"]
    raw["rope_theta"], raw["rope_scaling"] = rope.pop("rope_theta"), rope
    helpers.write_config(tmp_path, raw)
    helpers.write_tiny_tokenizer(tmp_path)
    out = tmp_path / "q4"
    convert(str(tmp_path), str(out), quantize=True, q_group_size=32, q_bits=4, dtype="float32")
    assert helpers.read_config(out)["quantization"]["model.layers.0.mlp.router"]["bits"] == 8
    reference, _ = load(str(out))
    want = reference(mx.array([PROMPT[:40]]))[0]
    for backend in BACKENDS:
        model = ferrum_mac.open_model(out, backend=backend, dtype="float32")
        assert_close(model.forward_verify("x", PROMPT[:40]), want, 1e-5, f"{backend} on mlx-lm's 4-bit experts")


def write_mxfp4_checkpoint(reference, folder, seed: int = 0):
    """`reference` saved as OpenAI's gpt-oss checkpoints are: its experts replaced by random
    MXFP4 blocks and scales (outputs first), `quant_method: mxfp4` in its config. Returns the
    reference with those experts, as transformers' own loader dequantizes them."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    reference.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    rng = torch.Generator().manual_seed(seed)
    E, H, inter = reference.config.num_local_experts, reference.config.hidden_size, reference.config.intermediate_size
    for i, layer in enumerate(reference.model.layers):
        p = f"model.layers.{i}.mlp.experts"
        for name, (out, inp) in (("gate_up_proj", (2 * inter, H)), ("down_proj", (H, inter))):
            del tensors[f"{p}.{name}"]
            blocks = torch.randint(0, 256, (E, out, inp // 32, 16), generator=rng, dtype=torch.uint8)
            scales = torch.randint(122, 126, (E, out, inp // 32), generator=rng, dtype=torch.uint8)
            tensors[f"{p}.{name}_blocks"], tensors[f"{p}.{name}_scales"] = blocks, scales
            dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
            getattr(layer.mlp.experts, name).data.copy_(dense)
    save_file(tensors, folder / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(raw))
    return reference


def test_openai_mxfp4_experts_load(tmp_path):
    """OpenAI's own layout: MXFP4 experts kept packed on MLX (its mxfp4 quantization is the same
    format), dequantized at load on torch; both as transformers dequantizes them."""
    reference = write_mxfp4_checkpoint(build_reference(intermediate_size=64), tmp_path)
    want = hf_logits(reference, PROMPT[:40])
    for backend in BACKENDS:
        model = ferrum_mac.open_model(tmp_path, backend=backend, dtype="float32")
        assert_close(model.forward_verify("x", PROMPT[:40]), want, FP32_REL, f"{backend} on MXFP4 experts")
        model.prefill("d", PROMPT[:39])  # (a prompt's pairs run sorted by expert, a decode's unsorted)
        assert_close(model.decode("d", PROMPT[39], 39), want[39], FP32_REL, f"{backend} decoding on MXFP4 experts")
        if backend == "mlx":
            assert model.model.layers[0].mlp.experts.gate_up.mode == "mxfp4"


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("layer_types", ["sliding_attention", "chunked_attention"], "chunked_attention"),
        ("quantization_config", {"quant_method": "fp8"}, "fp8"),
        ("quantization", {"group_size": 32, "bits": 4, "mode": "mxfp4"}, "mxfp4"),  # mlx-community's MXFP4-Q4/Q8
    ],
)
def test_a_variant_ferrum_does_not_run_names_its_field(folder, tmp_path, field, value, named):
    import json
    import shutil

    shutil.copy(folder / "model.safetensors", tmp_path / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    raw[field] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=named) as err:
        ferrum_mac.open_model(tmp_path, backend=BACKENDS[0], dtype="float32")
    assert "\n" not in str(err.value)


def test_gpt_oss_20b_config_reads():
    """A config.json of gpt-oss-20b's shape and keys, as OpenAI's repository writes them:
    alternating 128-token windows from the first layer, YaRN from 4,096 tokens by 32, sinks,
    biases, and MXFP4 experts, which are not an MLX quantization of the whole model."""
    from ferrum_mac.weights.config import config_from_dict
    from ferrum_mac.weights.gpt_oss import gpt_oss_moe

    raw = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 201088,
    }
    c = config_from_dict(raw)
    assert c.layer_windows == (128, 0) * 12 and c.attention_sinks and c.qkv_bias and c.o_bias
    assert c.quantization is None and c.dtype == "bfloat16" and c.eos_token_ids == (200002,)
    assert (c.rope_scaling["factor"], c.rope_scaling["original_max_position_embeddings"]) == (32.0, 4096)
    moe = gpt_oss_moe(c)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.swiglu_limit) == (32, 4, 2880, 7.0)
