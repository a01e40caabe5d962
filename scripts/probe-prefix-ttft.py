"""Where a cached prompt's first token goes, on the torch backend (a GPU run).

    python scripts/probe-prefix-ttft.py [--shape qwen3-8b] [--prefix 16000] [--new 200]

Random weights of the shape; a prompt of `prefix` tokens is prefilled and remembered, then a
prompt sharing it plus `new` tokens is timed: the lookup (`state.reuse`), the prefill of the new
tokens and the first token read. Then the attention of such a chunk alone, under the boolean
mask against PyTorch's lower-right causal bias (which its fused kernels take).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F


def timed(fn, device) -> float:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--prefix", type=int, default=16000)
    parser.add_argument("--new", type=int, default=200)
    args = parser.parse_args()
    from ferrum_mac.bench.torch_side import random_pair

    device = torch.device("cuda")
    llm, reference, _ = random_pair(args.shape, device)
    del reference
    rng = random.Random(0)
    vocab = llm.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(args.prefix)]
    with torch.inference_mode():
        cold = timed(lambda: llm.prefill("cold", shared + [1]).argmax().item(), device)
        llm.state.remember("cold", shared)
        llm.release("cold")
        print(f"cold prefill of {args.prefix + 1}: {cold * 1000:.1f} ms")
        for run in range(4):
            prompt = shared + [rng.randrange(vocab) for _ in range(args.new)]
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            found = llm.state.reuse(f"warm{run}", prompt)
            t1 = time.perf_counter()
            logits = llm.prefill(f"warm{run}", prompt[found.tokens :])
            t2 = time.perf_counter()
            logits.argmax().item()
            t3 = time.perf_counter()
            print(
                f"cached run {run}: reused {found.tokens}, lookup {(t1 - t0) * 1000:.1f} ms, prefill queued "
                f"{(t2 - t1) * 1000:.1f} ms, first token at {(t3 - t0) * 1000:.1f} ms, "
                f"contiguous={llm.kv.get(f'warm{run}').first_row_if_contiguous(len(prompt)) is not None}"
            )
            llm.release(f"warm{run}")
        c = llm.model_config
        end = args.prefix + args.new
        q = torch.randn(1, c.num_heads, args.new, c.head_dim, device=device, dtype=llm.dtype)
        k = torch.randn(1, c.num_kv_heads, end, c.head_dim, device=device, dtype=llm.dtype)
        v = torch.randn_like(k)
        rows = torch.arange(args.prefix, end, device=device)[:, None]
        boolean = torch.arange(end, device=device)[None, :] <= rows
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(args.new, end)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, enable_gqa=True)
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        print(f"lower-right bias vs boolean mask: max difference {(got - want).abs().max().item():.3g}")
        for name, mask in (("boolean", boolean), ("lower-right", bias)):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            t = timed(
                lambda: [
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    for _ in range(c.num_layers)
                ],
                device,
            )
            print(f"attention of {args.new} over {end}, {c.num_layers} layers, {name}: {t * 1000:.1f} ms")


if __name__ == "__main__":
    main()
