"""The KV a Gemma 3 keeps for one long sequence, against the same model with every layer global.

    python scripts/bench-window-kv.py [--shape 12b] [--tokens 32768] [--backend mlx]

A random Gemma 3 with the shape's layer pattern (its layers, window and every sixth layer
global) but tiny widths is opened by ferrum, once as it is and once with every layer global;
a sequence of `--tokens` tokens is placed in each model's pools as a prefill in 2048-token
chunks and 64 decode steps place it (`PooledLLM._forward`'s placements, without computing the
forward, which only writes into them). Printed per pool: the positions the sequence holds (its
blocks) and those the buffers hold (grown by half at a time, and by a whole prefill chunk
beside the window while it prefills), the buffers' bytes here and at the shape's real widths
(kv heads, head dim, bf16); then the ratios of both (goal: what the sequence holds <= 0.25x).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

SHAPES = {  # layers, window, kv heads, head dim (the Hub's configs)
    "1b": (26, 512, 1, 256),
    "4b": (34, 1024, 4, 256),
    "12b": (48, 1024, 8, 256),
    "27b": (62, 1024, 16, 128),
}
CHUNK, DECODE_STEPS = 2048, 64


def tiny_gemma3(folder: Path, layers: int, window: int, every_global: bool) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    kinds = ["full_attention" if every_global or (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    config = Gemma3TextConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=window,
        layer_types=kinds,
        max_position_embeddings=131072,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def place(model, cache_id: str, tokens: int) -> None:
    """The placements of a prefill of `tokens` in chunks and of decode steps after it."""
    spans = [(start, min(tokens, start + CHUNK)) for start in range(0, tokens, CHUNK)]
    spans += [(tokens + i, tokens + i + 1) for i in range(DECODE_STEPS)]
    windowed = model.state.windowed
    for start, end in spans:
        cache = model.kv.acquire(cache_id)
        model.kv.reserve(cache, start, end)
        cache.length = end
        if windowed is not None:
            windowed.place(cache_id, start, end).length = end


def buffer_bytes(pool) -> int:
    arrays = pool.arrays() if hasattr(pool, "arrays") else [kv for kv in pool.kv if kv.numel()]
    return sum(a.nbytes for a in arrays)


def held(model, tokens: int, shape: tuple) -> dict:
    """Each pool's token positions, layers and bytes after placing a sequence of `tokens`."""
    layers, _, kv_heads, head_dim = shape
    place(model, "long", tokens)
    pools = {"global": model.kv}
    if model.state.windowed is not None:
        pools["windowed"] = model.state.windowed.pool
    out = {}
    per_position = 2 * kv_heads * head_dim * 2  # keys and values, bf16, one layer
    for name, pool in pools.items():
        count = len(pool.layers)
        kept = sum(b != 0 for b in pool.get("long").blocks) * pool.block_tokens
        out[name] = (kept, pool.allocated_tokens, count, buffer_bytes(pool), per_position * count)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="12b")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--backend", default="mlx")
    args = parser.parse_args()
    import ferrum_mac

    shape = SHAPES[args.shape]
    kept, allocated = {}, {}
    for every_global in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            folder = tiny_gemma3(Path(tmp), shape[0], shape[1], every_global)
            model = ferrum_mac.open_model(folder, backend=args.backend, dtype="float32", kv_capacity=args.tokens + 256)
            label = "every layer global" if every_global else f"gemma3 {args.shape} (window {shape[1]})"
            print(f"{label}: {args.tokens} tokens + {DECODE_STEPS} decode steps")
            kept[every_global] = allocated[every_global] = 0
            for name, (held_positions, positions, layers, tiny, per_position) in held(
                model, args.tokens, shape
            ).items():
                print(
                    f"  {name:9s} {layers:3d} layers: the sequence holds {held_positions:6d} positions"
                    f" ({held_positions * per_position / 2**30:5.2f} GiB at the real widths), the buffers"
                    f" {positions:6d} ({positions * per_position / 2**30:5.2f} GiB; {tiny / 2**20:.1f} MiB here)"
                )
                kept[every_global] += held_positions * per_position
                allocated[every_global] += positions * per_position
            del model
    ratio = kept[False] / kept[True]
    print(
        f"KV the sequence holds: {kept[False] / 2**30:.2f} GiB against {kept[True] / 2**30:.2f} GiB all global:"
        f" {ratio:.3f}x ({'meets' if ratio <= 0.25 else 'misses'} the goal of <= 0.25x);"
        f" the buffers: {allocated[False] / allocated[True]:.3f}x"
    )
    sys.exit(0 if ratio <= 0.25 else 1)


if __name__ == "__main__":
    main()
