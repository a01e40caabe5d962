#!/usr/bin/env python3
"""How far rounding x to integers (the one-row dp4a GEMV over packed weights,
`triton_dp4a_gemv`: 16 bits a value; int8, as llama.cpp's q8_1, for comparison) moves a
model's output, beside the 4-bit quantization's own error. On the CPU, the torch backend's
one-row matmuls over packed 4-bit weights are computed as the kernel computes them
(`triton_dp4a_gemv.reference`, whose equality with the kernel the tests hold), everything
else as usual:

- random weights of a shape (`--shape`, default qwen3-tiny), greedy decode from a random
  prompt: the logits of the dense model, of the model quantized to 4 bits at load, and of
  that with x rounded; per step the largest difference, in units of the dense logits'
  standard deviation: 4 bits' own error (4-bit vs dense) beside x's (rounded x vs 4-bit);
- SmolLM2-135M-Instruct Q4_1, the real bundled model (`--real`): the greedy tokens of a chat
  answer, `--steps` of them, with x rounded each way against x in floats, and the largest
  logit difference before they part. Exits 1 if 16-bit x changes a token.

    python3 scripts/check-dp4a-rounding.py [--shape qwen3-tiny] [--steps 64] [--real]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum_mac.backends.torch import quant  # noqa: E402
from ferrum_mac.backends.torch.kernels import triton_dp4a_gemv  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-tiny")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--real", action="store_true", help="also SmolLM2-135M Q4_1's greedy tokens")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    random_weights(args.shape, args.steps)
    if args.real:
        return real_model(args.steps)
    return 0


class RoundedX:
    """While `levels` is set: a packed 4-bit linear's one-row calls round x to integers of at
    most `levels` per block of 32, as the dp4a GEMV does."""

    def __init__(self):
        self.levels: float | None = None
        call, plus = quant.QuantLinear.__call__, quant.QuantLinear.plus
        rounded = self

        def patched_call(linear, x):
            if not rounded.applies(linear, x):
                return call(linear, x)
            y = triton_dp4a_gemv.reference(x.reshape(1, -1), linear.weight, rounded.levels).to(x.dtype)
            y = y if linear.bias is None else y + linear.bias
            return y.view(*x.shape[:-1], -1)

        def patched_plus(linear, x, residual):
            if not rounded.applies(linear, x):
                return plus(linear, x, residual)
            return residual + patched_call(linear, x)

        quant.QuantLinear.__call__, quant.QuantLinear.plus = patched_call, patched_plus

    def applies(self, linear, x) -> bool:
        return self.levels is not None and x.numel() == x.shape[-1] and linear.weight.bits == 4


ROUNDED = RoundedX()
WAYS = {"16-bit x (the kernel's)": triton_dp4a_gemv.X_LEVELS, "int8 x": 127.0}


def greedy_logits(llm, prompt: list[int], steps: int, tokens: list[int] | None = None) -> tuple[list[int], list]:
    """Greedy decode (or the given `tokens`, forced): each step's token and logits (float64)."""
    cache = f"c{id(prompt)}-{len(tokens or [])}-{ROUNDED.levels}"
    logits = llm.prefill(cache, prompt)
    out, rows, pos = [], [], len(prompt)
    for step in range(steps):
        rows.append(logits.double().reshape(-1).cpu())
        token = tokens[step] if tokens else int(logits.reshape(-1).argmax())
        out.append(token)
        logits = llm.decode(cache, token, pos)
        pos += 1
    llm.release(cache)
    return out, rows


def random_weights(shape: str, steps: int) -> None:
    from ferrum_mac.bench.torch_side import random_pair

    dense, _, _ = random_pair(shape, torch.device("cpu"))
    packed, _, _ = random_pair(shape, torch.device("cpu"), quant="4bit")  # (the same weights: one seed)
    torch.manual_seed(1)
    prompt = torch.randint(0, dense.config.vocab_size, (32,)).tolist()
    tokens, want = greedy_logits(dense, prompt, steps)  # (the dense model's path, forced on the others)
    _, four = greedy_logits(packed, prompt, steps, tokens)
    own = [(a - b).abs().max().item() / b.std().item() for a, b in zip(four, want)]
    print(f"{shape}, random weights, {steps} steps: largest logit difference per step / the dense logits' std")
    print(f"  4 bits' own error (4-bit vs dense):  max {max(own):.4f}, mean {sum(own) / len(own):.4f}")
    for name, levels in WAYS.items():
        ROUNDED.levels = levels
        _, rounded = greedy_logits(packed, prompt, steps, tokens)
        ROUNDED.levels = None
        xs = [(a - b).abs().max().item() / c.std().item() for a, b, c in zip(rounded, four, want)]
        print(f"  {name + ' vs 4-bit:':<35} max {max(xs):.4f}, mean {sum(xs) / len(xs):.4f} "
              f"({sum(xs) / sum(own):.4f} of 4 bits' own)")  # fmt: skip


def real_model(steps: int) -> int:
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.store.bundled import ensure_smollm2
    from ferrum_mac.text.loader import load_tokenizer
    from ferrum_mac.weights import load_checkpoint

    path = ensure_smollm2(progress=True)
    llm = TorchLLM(load_checkpoint(path), device="cpu", packed=True)
    tokenizer = load_tokenizer(path)
    text = "<|im_start|>user\nWhy is the sky blue? Answer in three sentences.<|im_end|>\n<|im_start|>assistant\n"
    prompt = tokenizer.encode(text)
    tokens, plain = greedy_logits(llm, prompt, steps)
    print(f"SmolLM2-135M-Instruct Q4_1, {steps} greedy steps, x in floats: {tokenizer.decode(tokens)!r}")
    status = 0
    for name, levels in WAYS.items():
        ROUNDED.levels = levels
        rounded_tokens, rounded = greedy_logits(llm, prompt, steps)
        ROUNDED.levels = None
        parted = next((i for i, (a, b) in enumerate(zip(tokens, rounded_tokens)) if a != b), None)
        largest = max((a - b).abs().max().item() / b.std().item() for a, b in zip(rounded[: parted or steps], plain))
        print(f"  {name}: " + ("the same tokens" if parted is None else f"tokens part at step {parted}")
              + f"; largest logit difference before / the logits' std {largest:.4f}")  # fmt: skip
        if parted is not None:
            print(f"    {tokenizer.decode(rounded_tokens)!r}")
            status = status or int(levels == triton_dp4a_gemv.X_LEVELS)
    return status


if __name__ == "__main__":
    sys.exit(main())
