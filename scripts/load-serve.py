#!/usr/bin/env python3
"""Aggregate decode tok/s of a running `ferrum serve` (or any OpenAI-compatible server) at
several concurrencies: each round starts N streaming /v1/completions requests at once
(greedy, `ignore_eos`, the same max_tokens each) and times them.

    scripts/load-serve.py http://127.0.0.1:8000 --concurrency 1,4,16 --max-tokens 128

decode tok/s = sum over streams of (tokens - 1) / (last stream's end - first stream's first token);
that is the rate the server sustains with N sequences decoding together.

    scripts/load-serve.py URL --schema    # each concurrency free and with a JSON schema, alternating

With `--schema` every round runs twice free and twice with `response_format` a schema of one
long string (so constrained answers run to max_tokens like free ones), alternating; the best of
each side is printed with the constrained/free ratio: the grammar's cost in batched steps.

    scripts/load-serve.py URL --speculate off,auto --concurrency 1,16 [--edit]

With `--speculate` every round runs once per mode (the request's `speculate` field), the modes
alternating, `--repeat` times; the best decode tok/s of each mode is printed side by side with
the ratio to the first mode and the guesses proposed and kept. `--edit` sends prompts that
repeat a passage (an editing task's shape, where prompt lookup has something to copy) instead
of story openings.

For the GPU run, a model folder with random weights of a real shape and the Qwen3 tokenizer:

    scripts/load-serve.py --make-model /tmp/qwen3-8b --shape qwen3-8b   # MLX, or transformers
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

WORDS = [
    "Once upon a time",
    "The old lighthouse keeper",
    "In a city of glass",
    "A robot named Pim",
    "The river remembered",
    "On the last day of summer",
    "Under the mountain",
    "The baker's daughter",
]


MODEL = ["default"]  # the server's first model (`served_model`)

LONG_STRING_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "story",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 20000}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}


EDIT_PASSAGE = (
    "The lighthouse keeper climbed the stairs every evening at six. He lit the lamp, wound the clock, "
    "and wrote the weather in his book: wind from the west, waves of two feet, a ship far to the south. "
    "Then he made tea and watched the light turn over the dark water until the morning came."
)


def prompt_of(i: int, edit: bool) -> str:
    """Stream i's prompt: a story opening, or (`edit`) a passage and the start of its copy."""
    if not edit:
        return f"{WORDS[i % len(WORDS)]} ({i})"
    passage = EDIT_PASSAGE.replace("six", ["six", "seven", "eight", "nine"][i % 4]).replace("two", str(i + 2))
    return f"Text {i}: {passage}\n\nThe same text, copied exactly:\n{passage[:40]}"


def one_stream(
    http, url: str, prompt: str, max_tokens: int, result: dict, fmt: dict | None = None, speculate: str | None = None
) -> None:
    body = {
        "model": MODEL[0],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if fmt is not None:
        body["response_format"] = fmt
    if speculate is not None:
        body["speculate"] = speculate
    result["start"] = time.perf_counter()
    with http.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"load-serve: {url} answered {response.status_code}: {response.text[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                result["error"] = chunk["error"].get("message")
            if chunk.get("choices") and "first" not in result:
                result["first"] = time.perf_counter()
            if chunk.get("usage"):
                result["tokens"] = chunk["usage"]["completion_tokens"]
            if (chunk.get("stats") or {}).get("speculation"):
                result["speculation"] = chunk["stats"]["speculation"]
    result["end"] = time.perf_counter()


def guarded_stream(http, url: str, prompt: str, max_tokens: int, result: dict, *more) -> None:
    """one_stream on a thread: whatever stops it is kept in `result` (a thread's SystemExit vanishes)."""
    try:
        one_stream(http, url, prompt, max_tokens, result, *more)
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        result["error"] = str(e) or type(e).__name__


def wait_for_server(url: str, seconds: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"load-serve: no server answered at {url}/health within {seconds:.0f} s")


def served_model(url: str, api_key: str | None) -> str:
    """The first model /v1/models lists: the one the server was started with."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def one_round(
    url: str,
    api_key: str | None,
    concurrency: int,
    max_tokens: int,
    fmt: dict | None = None,
    speculate: str | None = None,
    edit: bool = False,
) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4)
    results = [{} for _ in range(concurrency)]
    with httpx.Client(headers=headers, timeout=600, limits=limits) as http:
        threads = [
            threading.Thread(
                target=guarded_stream,
                args=(http, url, prompt_of(i, edit), max_tokens, results[i], fmt, speculate),
            )
            for i in range(concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    failed = [
        r.get("error", f"it ended early ({sorted(r)})")
        for r in results
        if "end" not in r or "first" not in r or "error" in r
    ]
    if failed:
        raise SystemExit(f"load-serve: {len(failed)} stream(s) failed: {failed[0]}")
    first = min(r["first"] for r in results)
    end = max(r["end"] for r in results)
    decoded = sum(r["tokens"] - 1 for r in results)
    return {
        "concurrency": concurrency,
        "tokens": sum(r["tokens"] for r in results),
        "decode_tps": round(decoded / (end - first), 1),
        "per_stream_tps": round(decoded / (end - first) / concurrency, 1),
        "mean_ttft_s": round(sum(r["first"] - r["start"] for r in results) / concurrency, 3),
        "ramp_s": round(max(r["first"] for r in results) - first, 3),  # until every stream decodes
        "wall_s": round(end - min(r["start"] for r in results), 2),
        "proposed": sum(r.get("speculation", {}).get("proposed", 0) for r in results),
        "accepted": sum(r.get("speculation", {}).get("accepted", 0) for r in results),
    }


def make_model(folder: Path, shape: str, tokenizer: Path | None = None, quant: str = "bf16") -> None:
    """config.json and safetensors of random weights of `shape`, with the Qwen3 tokenizer:
    written by MLX where it is installed, else by transformers (on the GPU when there is one);
    `quant` 4bit (MLX only): an MLX affine checkpoint, as mlx-lm's convert writes one."""
    repo = Path(__file__).resolve().parents[1]
    places = [repo.parent / "shared/assets/tokenizers/qwen3", repo / "shared/assets/tokenizers/qwen3"]
    tokenizer = tokenizer or next((p for p in places if p.is_dir()), None)
    if tokenizer is None or not (tokenizer / "tokenizer.json").is_file():
        raise SystemExit(
            f"load-serve: no Qwen3 tokenizer at {tokenizer or ' or '.join(map(str, places))}; give --tokenizer DIR"
        )
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        if quant != "bf16":
            raise SystemExit(f"load-serve: --quant {quant} needs MLX to write the checkpoint")
        write_random_with_transformers(folder, shape)
    else:
        write_random_with_mlx(folder, shape, quant)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    print(f"load-serve: wrote {folder} ({shape}, random {quant} weights)", file=sys.stderr)


def write_random_with_mlx(folder: Path, shape: str, quant: str = "bf16") -> None:
    import mlx.core as mx

    from ferrum_mac.bench.shapes import build_random

    random = build_random(shape, quant)
    mx.save_safetensors(str(folder / "model.safetensors"), random.weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps({**random.config, "torch_dtype": "bfloat16"}, indent=1))


def write_random_with_transformers(folder: Path, shape: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ferrum_mac.bench.shapes import SHAPES

    raw = dict(SHAPES[shape])
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", default="1,4,16", help="Comma-separated stream counts, one round each.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--api-key")
    parser.add_argument("--schema", action="store_true", help="Each round free and with a JSON schema, alternating.")
    parser.add_argument(
        "--speculate", help="Comma-separated modes (off,auto,ngram): each round once per mode, alternating."
    )
    parser.add_argument("--edit", action="store_true", help="Prompts that repeat a passage (an editing task's shape).")
    parser.add_argument("--repeat", type=int, default=2, help="Rounds per mode with --speculate (the best counts).")
    parser.add_argument("--make-model", type=Path, help="Write a random-weight model folder and exit.")
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--quant", default="bf16", choices=("bf16", "4bit"), help="With --make-model.")
    parser.add_argument(
        "--tokenizer", type=Path, help="The Qwen3 tokenizer's folder (default: shared/ beside the checkout)."
    )
    args = parser.parse_args()
    if args.make_model:
        return make_model(args.make_model, args.shape, args.tokenizer, args.quant)
    url = args.url.rstrip("/").removesuffix("/v1")
    wait_for_server(url)
    MODEL[0] = served_model(url, args.api_key)
    for c in args.concurrency.split(","):  # warm-up: kernels, caches and each batch size's CUDA graphs
        one_round(url, args.api_key, int(c), 8, edit=args.edit)
    if args.speculate:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        modes = args.speculate.split(",")
        return compare_speculation(url, args.api_key, concurrencies, args.max_tokens, modes, args.repeat, args.edit)
    if args.schema:
        return compare_schema(url, args.api_key, [int(c) for c in args.concurrency.split(",")], args.max_tokens)
    rows = [one_round(url, args.api_key, int(c), args.max_tokens) for c in args.concurrency.split(",")]
    for row in rows:
        print(json.dumps(row))
    base = rows[0]["decode_tps"]
    print(
        " ".join(f"c{r['concurrency']}={r['decode_tps']} tok/s ({r['decode_tps'] / base:.1f}x)" for r in rows),
        file=sys.stderr,
    )


def compare_speculation(
    url: str, api_key: str | None, concurrencies: list[int], max_tokens: int, modes: list[str], repeat: int, edit: bool
) -> None:
    """Each concurrency once per mode, alternating, `repeat` times; the best decode tok/s of each."""
    for mode in modes:  # the first speculating round times the model's steps (once per server)
        one_round(url, api_key, concurrencies[-1], 16, speculate=mode, edit=edit)
    for c in concurrencies:
        best = {mode: {"decode_tps": 0.0} for mode in modes}
        for _ in range(repeat):
            for mode in modes:
                result = one_round(url, api_key, c, max_tokens, speculate=mode, edit=edit)
                if result["decode_tps"] > best[mode]["decode_tps"]:
                    best[mode] = result
        row: dict = {"concurrency": c, "edit": edit}
        for mode in modes:
            row[mode] = best[mode]["decode_tps"]
            row[f"{mode}_over_{modes[0]}"] = round(best[mode]["decode_tps"] / best[modes[0]]["decode_tps"], 3)
            row[f"{mode}_accepted"] = f"{best[mode]['accepted']}/{best[mode]['proposed']}"
        print(json.dumps(row))


def compare_schema(url: str, api_key: str | None, concurrencies: list[int], max_tokens: int) -> None:
    one_round(url, api_key, concurrencies[-1], 8, LONG_STRING_SCHEMA)  # the grammar's first compile
    for c in concurrencies:
        best = {"free": 0.0, "schema": 0.0}
        for _ in range(2):
            for side, fmt in (("free", None), ("schema", LONG_STRING_SCHEMA)):
                best[side] = max(best[side], one_round(url, api_key, c, max_tokens, fmt)["decode_tps"])
        row = {"concurrency": c, **best, "schema_over_free": round(best["schema"] / best["free"], 3)}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
