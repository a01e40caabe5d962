"""The two backends side by side on this machine's CPU: MLX (its Linux CPU wheel) and torch.

Random float32 weights of SmolLM2-135M's shape (saved with transformers), a 128-token
prompt and 32 greedy new tokens through the DecoderOnlyLLM contract, alternating runs,
best of N. This is the measurement behind choosing a backend for Linux machines without a GPU.

    .venv/bin/python scripts/probe-cpu-backends.py [--runs 4]
"""

import argparse
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ferrum_mac

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def one_run(model, prompt: list[int], new_tokens: int, argmax, read) -> tuple[float, float]:
    start = time.perf_counter()
    token = argmax(model.prefill("probe", prompt))
    read(token)
    first = time.perf_counter()
    for i in range(new_tokens):
        token = argmax(model.decode("probe", token, len(prompt) + i))
    read(token)
    end = time.perf_counter()
    model.release("probe")
    return len(prompt) / (first - start), new_tokens / (end - first)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    import mlx.core as mx

    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(folder)
    prompt = [int(t) for t in torch.randint(3, SMOLLM2_135M["vocab_size"], (128,))]
    sides = {
        "mlx": (ferrum_mac.open_model(folder, backend="mlx", dtype="float32"), mx.argmax, lambda t: t.item()),
        "torch": (ferrum_mac.open_model(folder, backend="torch", dtype="float32"), torch.argmax, lambda t: t.item()),
    }
    best = {name: (0.0, 0.0) for name in sides}
    for run in range(args.runs + 1):  # the first run of each side warms up
        for name, (model, argmax, read) in sides.items():
            prefill, decode = one_run(model, prompt, 32, argmax, read)
            if run:
                best[name] = (max(best[name][0], prefill), max(best[name][1], decode))
    for name, (prefill, decode) in best.items():
        print(f"{name:6} prefill {prefill:8.1f} tok/s   decode {decode:6.1f} tok/s")
    print(
        f"torch/mlx: prefill {best['torch'][0] / best['mlx'][0]:.1f}x, decode {best['torch'][1] / best['mlx'][1]:.1f}x"
    )


if __name__ == "__main__":
    main()
