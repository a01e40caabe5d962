"""Decode speed with a JSON schema active beside the same model unconstrained, side by side.

    python scripts/bench-structured.py [--model smollm2:135m] [--backend auto] [--tokens 128] [--runs 3]

One answer per run through the engine (`Conversation.send`), alternating the two sides; each
side's best decode tok/s is reported. The schema is one long string (at least 4000 characters),
so the constrained answer runs to `--tokens` like the free one (unless that ends earlier): the
figure is the grammar's cost per token (mask, masking on the device, the token read before the
next step is built), not a difference in what is generated.
"""

from __future__ import annotations

import argparse
import json

from ferrum_mac.engine import Done, Engine, ResponseFormat
from ferrum_mac.engine.speculation.setting import OFF, Speculate

PROMPT = "Write a long story about a lighthouse keeper and her cat, as JSON with the story in 'text'."
SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
    "additionalProperties": False,
}


def decode_tps(engine: Engine, tokens: int, fmt: ResponseFormat | None) -> tuple[float, int]:
    """One answer's decode tok/s and its token count (a fresh conversation: the same prompt each run)."""
    # speculation off on both sides: a grammar turns it off, and the figure is the grammar's cost
    with engine.conversation(max_tokens=tokens, response_format=fmt, speculate=Speculate(OFF)) as conv:
        done = [e for e in conv.send(PROMPT) if isinstance(e, Done)][0]
    return done.decode_tps, done.generated_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: $FERRUM_MODEL or smollm2:135m")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()

    engine = Engine.open(args.model, backend=args.backend)
    fmt = ResponseFormat(SCHEMA)
    engine.constraints.compile(fmt)  # the grammar vocabulary is built once per model, not per answer
    decode_tps(engine, 8, None)  # warm-up: first-use kernel compiles
    decode_tps(engine, 8, fmt)
    free, constrained = [], []
    for _ in range(args.runs):
        free.append(decode_tps(engine, args.tokens, None))
        constrained.append(decode_tps(engine, args.tokens, fmt))
    best_free, best_constrained = max(free), max(constrained)
    ratio = best_constrained[0] / best_free[0] if best_free[0] else 0.0
    if args.json:
        report = {"model": engine.name, "device": engine.device, "free_tps": best_free[0]}
        report.update(constrained_tps=best_constrained[0], ratio=ratio, tokens=[best_free[1], best_constrained[1]])
        print(json.dumps(report))
        return
    print(f"{engine.name} ({engine.device}), decode tok/s, best of {args.runs}:")
    print(f"  {'unconstrained':<16}{best_free[0]:8.1f}   ({best_free[1]} tokens)")
    print(f"  {'json schema':<16}{best_constrained[0]:8.1f}   ({best_constrained[1]} tokens)")
    print(f"  {'ratio':<16}{100 * ratio:7.1f}%")


if __name__ == "__main__":
    main()
