"""`ferrum bench --backend torch` on the CPU with MLX unimportable, as on the CUDA machine:
random weights from transformers' classes, parity, both sides timed, roofline, batches."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

MICRO = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
MICRO_MOE = {
    **MICRO,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}


@pytest.fixture
def no_mlx(monkeypatch):
    for name in [m for m in sys.modules if m == "mlx" or m.startswith(("mlx.", "mlx_lm"))] + [
        "mlx",
        "mlx.core",
        "mlx_lm",
    ]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("shape", ["micro", "micro-moe"])
def test_bench_runs_without_mlx(monkeypatch, no_mlx, capsys, shape):
    from typer.testing import CliRunner

    from ferrum_mac.bench.shapes import SHAPES
    from ferrum_mac.cli import app

    monkeypatch.setitem(SHAPES, "micro", MICRO)
    monkeypatch.setitem(SHAPES, "micro-moe", MICRO_MOE)
    args = [
        "bench",
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--shape",
        shape,
        "--prompt-tokens",
        "12",
        "--new-tokens",
        "6",
        "--runs",
        "1",
        "--batch",
        "3",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["model"].startswith(shape)
    assert report["ferrum"]["decode_tps"] > 0 and report["transformers"]["decode_tps"] > 0
    assert report["parity"]["prefill_rel_err"] < 0.05 and report["parity"]["decode_rel_err"] < 0.05
    assert report["roofline"]["decode_tps"] > 0 and report["roofline"]["bytes_per_token"] > 0
    assert set(report["batched_decode_tps"]) == {"3"}


def test_bytes_per_token_counts_only_what_a_step_reads():
    """Qwen3-8B: 16.4 GB of bf16 weights, but a step reads one embedding row, not the table;
    Qwen3-30B-A3B: only 8 of 128 experts per layer."""
    from types import SimpleNamespace

    from ferrum_mac.bench.shapes import SHAPES
    from ferrum_mac.bench.torch_side import decode_bytes_per_token
    from ferrum_mac.llm import LlmRuntimeConfig
    from ferrum_mac.weights import config_from_dict
    from ferrum_mac.weights.moe import moe_config

    def fake(shape):
        c = config_from_dict(SHAPES[shape])
        runtime = LlmRuntimeConfig(c.hidden_size, c.num_layers, c.num_kv_heads, c.head_dim, c.vocab_size, 4096)
        moe = moe_config(c) if c.model_type == "qwen3_moe" else None
        return SimpleNamespace(
            model_config=c, config=runtime, dtype=__import__("torch").bfloat16, model=SimpleNamespace(moe=moe)
        )

    assert decode_bytes_per_token(fake("qwen3-8b"), 0) / 1e9 == pytest.approx(15.14, abs=0.01)
    assert decode_bytes_per_token(fake("qwen3-30b-a3b"), 0) / 1e9 == pytest.approx(6.08, abs=0.01)
    # --quant 4bit: 4 bits and a bf16 scale and bias per 64 weights, of every linear layer
    assert decode_bytes_per_token(fake("qwen3-8b"), 0, "4bit") / 1e9 == pytest.approx(15.14 * 0.5625 / 2, abs=0.01)
    # a checkpoint of packed weights (4 bits, groups of 64) reads the same as --quant 4bit
    packed = fake("qwen3-8b")
    packed.model_config = dataclasses.replace(packed.model_config, quantization={"bits": 4, "group_size": 64})
    assert decode_bytes_per_token(packed, 0) == decode_bytes_per_token(fake("qwen3-8b"), 0, "4bit")


def test_a_quantized_bench_says_its_parity_is_against_the_bf16_model():
    """A 4-bit run's logits differ from the bf16 model's by the quantization's own error: the
    report says so rather than only 'DIFFERENT argmax'."""
    from ferrum_mac.bench.torch_side import format_report

    timing = {"prefill_tps": 1.0, "decode_tps": 1.0, "ttft_s": 1.0, "peak_memory_gb": 0.0}
    base = {
        "model": "m",
        "device": "cpu",
        "prompt_tokens": 4,
        "new_tokens": 2,
        "ferrum": timing,
        "transformers": None,
        "prefill_ratio": None,
        "decode_ratio": None,
        "roofline": {"bytes_per_token": 1e9, "copy_bandwidth_gbs": 1.0, "decode_tps": 1.0, "ferrum_share": 1.0},
        "batched_decode_tps": {},
    }
    errors = {"prefill_rel_err": 1.1, "decode_rel_err": 0.9, "same_argmax": False}
    quantized = format_report({**base, "parity": {**errors, "quantized": "4bit"}}, 1)
    assert "parity with the bf16 model it was quantized from (4bit's own error included)" in quantized
    assert "parity with transformers (" in format_report({**base, "parity": {**errors, "quantized": None}}, 1)
