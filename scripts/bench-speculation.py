"""Speculative decoding on and off, side by side, in one process on the same prompts.

    python scripts/bench-speculation.py [MODEL] [--runs 2] [--chat-runs 1] [--backend auto] [--part edit,chat]

(a) edit: rewrite a ~300-token text block, then a ~270-token code block, with one small change,
    temperature 0: prompt lookup (`ngram`) against `off`, decode tok/s and whether the outputs
    are identical (goal: >= 1.8x). How much the model copies sets the gain: SmolLM2-135M copies
    the text nearly word for word and rewrites parts of the code;
(b) chat: ten varied questions with no repetition to copy: `auto` against `off` (goal: >= 0.98x).

The order alternates from prompt to prompt and run to run (off first, then on first) so
neither side always runs warm. The rate
is the answer's decode tok/s (tokens after the first over the time after the first), summed
over the runs as total tokens over total time. The cost curve the controller learned from the
answers' steps (verify of k guesses / one decode step) is printed too.
"""

from __future__ import annotations

import argparse

from ferrum_mac.compose import open_engine
from ferrum_mac.engine import Done
from ferrum_mac.engine.speculation import Speculate

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
TEXT = """The river town of Alder Creek wakes up slowly. At six the baker opens the shutters and sets out \
the first loaves of rye, still warm, on the long wooden counter. At half past six the ferryman checks the \
ropes of his flat boat and waves to the fishermen who are already out on the river. The school bell rings \
at eight, and children run along the river path with their bags bouncing on their backs. By nine the market \
square is full: farmers sell apples, cheese and honey, and the old clockmaker repairs watches at a folding \
table under a green umbrella. At noon the church bells ring twelve times and the whole town seems to pause \
for lunch. In the afternoon the river is quiet, the ferry crosses only twice, and the library fills with \
readers escaping the heat. Two old friends play chess on the bench by the bridge, and a dog sleeps in the \
shade of the post office. At five the workshops close, the baker sweeps the floor, and the smell of supper \
drifts from the open kitchen windows. When the sun sets behind the hills, the lamps along the river are lit \
one by one, and the town goes to sleep as slowly as it woke up."""
EDITS = {
    "text": f'Repeat the following text exactly, but replace the word "river" with "stream" everywhere.\n\n{TEXT}',
    "code": "Rewrite this Python code with the function merge_configs renamed to combine_configs. "
    f"Output only the full code.\n\n```python\n{CODE}```",
}
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
        for i, prompt in enumerate(prompts):
            order = ("off", on) if (run + i) % 2 == 0 else (on, "off")
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
    parser.add_argument("--chat-runs", type=int, default=1)
    parser.add_argument("--chat-tokens", type=int, default=120)
    args = parser.parse_args()
    engine = open_engine(args.model, backend=args.backend)
    print(f"model {engine.name or args.model} on {engine.device}")
    answer(engine, "Hi", "off", 8)  # warm up
    parts = args.part.split(",")
    for name, prompt in EDITS.items():
        if "edit" in parts:
            r = compare(engine, [prompt], "ngram", args.runs, args.max_tokens)
            print(
                f"edit ({name})  off {r['off']:.1f} tok/s  ngram {r['ngram']:.1f} tok/s  {r['ratio']:.2f}x  "
                f"acceptance {r['acceptance']:.2f} of {r['proposed']}  outputs differ: {r['differ']}",
                flush=True,
            )
    curve = engine.step_times.curve().verify  # learned from the answers above
    print("verify(k)/decode:", " ".join(f"k={k}:{c:.2f}" for k, c in enumerate(curve) if k))
    if "chat" in parts:
        r = compare(engine, QUESTIONS, "auto", args.chat_runs, args.chat_tokens)
        print(
            f"chat  off {r['off']:.1f} tok/s  auto {r['auto']:.1f} tok/s  {r['ratio']:.2f}x  "
            f"acceptance {r['acceptance']:.2f} of {r['proposed']}  outputs differ: {r['differ']}"
        )


if __name__ == "__main__":
    main()
