"""Speculative decoding on and off, side by side, in one process on the same prompts.

    python scripts/bench-speculation.py [MODEL] [--runs 2] [--backend auto] [--part edit,chat]

(a) edit: rewrite a ~300-token code block with one small change, temperature 0: prompt lookup
    (`ngram`) against `off`, decode tok/s and whether the outputs are identical (goal: >= 1.8x);
(b) chat: ten varied questions with no repetition to copy: `auto` against `off` (goal: >= 0.98x).

Runs alternate the order (off first, then on first) so neither side always runs warm. The rate
is the answer's decode tok/s (tokens after the first over the time after the first), summed
over the runs as total tokens over total time. The cost curve the controller measured
(verify of k guesses / one decode step) is printed too.
"""

from __future__ import annotations

import argparse

from ferrum_mac.compose import open_engine
from ferrum_mac.engine import Done
from ferrum_mac.engine.speculation import Speculate
from ferrum_mac.engine.speculation.controller import cost_curve

CODE = '''def parse_config(path):
    """Read a key = value file into a dict, skipping comments and blank lines."""
    settings = {}
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key = value")
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def merge_configs(base, override):
    """Values of override win; keys only in base are kept."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def write_config(path, settings):
    with open(path, "w") as handle:
        for key in sorted(settings):
            handle.write(f"{key} = {settings[key]}\\n")


def main():
    base = parse_config("base.conf")
    local = parse_config("local.conf")
    write_config("merged.conf", merge_configs(base, local))
'''
EDIT = f"Rewrite this Python code with the function merge_configs renamed to combine_configs. Output only the full code.\n\n```python\n{CODE}```"
QUESTIONS = (
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "How do vaccines train the immune system?",
    "What should I pack for a weekend hiking trip?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a friendly robot and say why.",
)


def answer(engine, prompt: str, speculate: str, max_tokens: int) -> tuple[str, Done]:
    sampling = engine.default_sampling.replace(temperature=0.0)
    conv = engine.conversation(sampling=sampling, max_tokens=max_tokens, speculate=Speculate.parse(speculate))
    try:
        events = list(conv.send(prompt))
        return conv.messages[-1]["content"], events[-1]
    finally:
        conv.close()


def compare(engine, prompts, on: str, runs: int, max_tokens: int) -> dict:
    """Tokens and decode seconds per side, over every prompt and run; outputs that differ."""
    totals = {side: [0, 0.0] for side in ("off", on)}
    differ, accepted, proposed = 0, 0, 0
    for run in range(runs):
        order = ("off", on) if run % 2 == 0 else (on, "off")
        for prompt in prompts:
            texts = {}
            for side in order:
                text, done = answer(engine, prompt, side, max_tokens)
                texts[side] = text
                if done.decode_tps:
                    totals[side][0] += done.generated_tokens - 1
                    totals[side][1] += (done.generated_tokens - 1) / done.decode_tps
                if side == on and done.speculation:
                    accepted += done.speculation["accepted"]
                    proposed += done.speculation["proposed"]
            differ += texts["off"] != texts[on]
    rate = {side: tokens / seconds if seconds else 0.0 for side, (tokens, seconds) in totals.items()}
    return {
        "off": rate["off"],
        on: rate[on],
        "ratio": rate[on] / rate["off"] if rate["off"] else 0.0,
        "differ": differ,
        "acceptance": accepted / proposed if proposed else 0.0,
        "proposed": proposed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--part", default="edit,chat")
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    engine = open_engine(args.model, backend=args.backend)
    print(f"model {engine.name or args.model} on {engine.device}")
    answer(engine, "Hi", "off", 8)  # warm up
    curve = cost_curve(engine.model).verify
    print("verify(k)/decode:", " ".join(f"k={k}:{c:.2f}" for k, c in enumerate(curve) if k))
    parts = args.part.split(",")
    if "edit" in parts:
        r = compare(engine, [EDIT], "ngram", args.runs, args.max_tokens)
        print(
            f"edit  off {r['off']:.1f} tok/s  ngram {r['ngram']:.1f} tok/s  {r['ratio']:.2f}x  "
            f"acceptance {r['acceptance']:.2f} of {r['proposed']}  outputs differ: {r['differ']}"
        )
    if "chat" in parts:
        r = compare(engine, QUESTIONS, "auto", args.runs, min(args.max_tokens, 200))
        print(
            f"chat  off {r['off']:.1f} tok/s  auto {r['auto']:.1f} tok/s  {r['ratio']:.2f}x  "
            f"acceptance {r['acceptance']:.2f} of {r['proposed']}  outputs differ: {r['differ']}"
        )


if __name__ == "__main__":
    main()
