"""Measure the grammar engines on our real vocabularies: time to compile a JSON schema, and the
time per token to compute the allowed-token mask (mean and p99) while walking a valid JSON answer.
Compile is the median over walks (each walk compiles afresh; outlines-core's index is built once).

    python scripts/probe-grammar.py --tokenizer PATH [--tokenizer PATH ...] [--engines llguidance,xgrammar,outlines]
    python scripts/probe-grammar.py --apply-mask [--vocab 151936] [--rows 1,16]

--apply-mask times applying a batch bitmask to logits instead: ferrum_mac.grammar.device's
torch function (plain, and the engine's compiled kernel) on CUDA when there is one, else the
CPU, and its MLX function where MLX is installed.

PATH is a model folder or a .gguf file (loaded with ferrum's own tokenizer loader). Engines that
are not installed are skipped. The answer walked is fixed JSON text tokenized by the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ferrum_mac.text.loader import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "role": "editor",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10115"},
    "tags": ["math", "engines", "poetry of science"],
    "score": 0.875,
    "active": True,
}


def answer_text() -> str:
    return json.dumps(ANSWER, separators=(", ", ": "))


def probe_llguidance(tokenizer, ids, walks):
    from ferrum_mac.grammar import GrammarMatcher, GrammarVocab, compile_grammar, json_schema_grammar

    t0 = time.perf_counter()
    vocab = GrammarVocab(tokenizer)
    setup = time.perf_counter() - t0
    compiles, times = [], []
    for _ in range(walks):
        t0 = time.perf_counter()
        grammar = compile_grammar(json_schema_grammar(SCHEMA), vocab)
        matcher = GrammarMatcher(grammar)
        compiles.append(time.perf_counter() - t0)
        mask = np.zeros((1, vocab.words), dtype=np.int32)
        for token_id in ids:
            t0 = time.perf_counter()
            matcher.fill_mask(mask)
            times.append(time.perf_counter() - t0)
            matcher.accept(token_id)
    return setup, compiles, times


def probe_xgrammar(tokenizer, ids, walks):
    import torch
    import xgrammar as xgr

    from ferrum_mac.grammar.tokens import token_table

    t0 = time.perf_counter()
    table = [b"" if data.startswith(b"\xff") else data for data in token_table(tokenizer)]
    info = xgr.TokenizerInfo(table, xgr.VocabType.RAW, vocab_size=len(table), stop_token_ids=sorted(tokenizer.eos_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    compiles, times = [], []
    for _ in range(walks):
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        matcher = xgr.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - t0)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        assert isinstance(mask, torch.Tensor)
        for token_id in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            times.append(time.perf_counter() - t0)
            assert matcher.accept_token(token_id), token_id
    return setup, compiles, times


def probe_outlines(tokenizer, ids, walks):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    from ferrum_mac.grammar.tokens import token_table

    t0 = time.perf_counter()
    eos = min(tokenizer.eos_ids)
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, data in enumerate(token_table(tokenizer)):
        if not data.startswith(b"\xff") and token_id not in tokenizer.eos_ids:
            by_bytes.setdefault(data, []).append(token_id)
    vocabulary = oc.Vocabulary(eos, by_bytes)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")
    index = oc.Index(regex, vocabulary)
    compiles = [time.perf_counter() - t0]  # compiled once: building the index is what costs
    times = []
    for _ in range(walks):
        guide = oc.Guide(index)
        mask = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        for token_id in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            times.append(time.perf_counter() - t0)
            guide.advance(token_id)
    return setup, compiles, times


ENGINES = {"llguidance": probe_llguidance, "xgrammar": probe_xgrammar, "outlines": probe_outlines}


def time_call(fn, sync, calls: int = 50) -> float:
    """Mean seconds per call after warm-up calls (which also trigger any compilation)."""
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls


def probe_apply_mask(vocab: int, rows_list: list[int]) -> None:
    from ferrum_mac.grammar.device import apply_mask_mlx, apply_mask_torch

    rng = np.random.default_rng(0)
    print(f"\napply a bitmask to logits, vocabulary {vocab}")
    for rows in rows_list:
        mask = rng.integers(-(2**31), 2**31, size=(rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        try:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
            logits = torch.randn(
                rows, vocab, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32
            )
            on_device = torch.from_numpy(mask).to(device)
            for compiled in (False, True):
                for label, source in (("mask on device", on_device), ("mask from host", mask)):
                    seconds = time_call(lambda: apply_mask_torch(logits, source, compiled=compiled), sync)
                    kind = "compiled" if compiled else "plain"
                    print(f"  torch {device:<4} {kind:<8} rows {rows:>3} {label:<15} {seconds * 1e6:>8.0f}us")
        except ImportError:
            print("  torch not installed")
        try:
            import mlx.core as mx

            logits_mx, mask_mx = mx.random.normal((rows, vocab)), mx.array(mask)
            seconds = time_call(lambda: mx.eval(apply_mask_mlx(logits_mx, mask_mx)), lambda: None)
            print(f"  mlx  {mx.default_device()!s:<14} rows {rows:>3} {'mask on device':<15} {seconds * 1e6:>8.0f}us")
        except ImportError:
            print("  mlx not installed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", action="append", default=[], help="a model folder or .gguf file (repeatable)")
    parser.add_argument("--apply-mask", action="store_true", help="time applying masks to logits instead")
    parser.add_argument("--vocab", type=int, default=151936, help="logits width for --apply-mask")
    parser.add_argument("--rows", default="1,16", help="comma-separated batch rows for --apply-mask")
    parser.add_argument(
        "--walks", type=int, default=20, help="walks through the answer, each with a freshly compiled grammar"
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: " + ", ".join(ENGINES))
    args = parser.parse_args()
    if args.apply_mask:
        probe_apply_mask(args.vocab, [int(r) for r in args.rows.split(",")])
        return
    if not args.tokenizer:
        parser.error("name at least one --tokenizer (or --apply-mask)")
    for path in args.tokenizer:
        tokenizer = load_tokenizer(path)
        ids = tokenizer.encode(answer_text(), add_special_tokens=False)
        print(f"\n{path}: vocabulary {tokenizer.vocab_size}, answer {len(ids)} tokens, {args.walks} walks")
        print(
            f"  {'engine':<11} {'vocab setup':>12} {'compile':>10} {'mask mean':>10} {'mask p99':>10} {'mask max':>10}"
        )
        for name in args.engines.split(","):
            try:
                setup, compiles, times = ENGINES[name](tokenizer, ids, args.walks)
            except ImportError as e:
                print(f"  {name:<11} not installed ({e})")
                continue
            except Exception as e:  # a probe reports an engine that fails, it does not stop the others
                print(f"  {name:<11} failed: {type(e).__name__}: {e}")
                continue
            us = sorted(t * 1e6 for t in times)
            p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
            print(
                f"  {name:<11} {setup * 1e3:>10.0f}ms {statistics.median(compiles) * 1e3:>8.1f}ms {statistics.mean(us):>8.0f}us {p99:>8.0f}us {us[-1]:>8.0f}us"
            )


if __name__ == "__main__":
    main()
