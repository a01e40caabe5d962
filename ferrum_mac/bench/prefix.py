"""`ferrum bench prefix`: the prefix cache's figures, each beside its cold counterpart and the
goal issue 17 sets, in one process and through the server's scheduler.

    ferrum bench prefix [--model M | --shape S] [--backend B] [--device D] [--json]

(d) 16 requests arriving together with one long system prompt: KV positions allocated at
    the peak, against one such request alone plus every request's own tokens;
(a) a conversation sent again with another last message: time to first token against the
    first (cold) send, and the share of the prompt taken from the cache;
(b) after a restart (the model opened again in this process: the memory cache is gone, the
    disk tier holds the blocks): that request again, against a cold prompt as long;
(c) an agent replay: each request the whole previous one, its answer and new tokens: prompt
    tokens computed over the new ones, and the last step's time to first token over the first's.

Prompts are random token ids (so random weights of a real shape work as well as a model);
answers are greedy, their length fixed (end of sequence ignored). The answer's ids come back
through a tokenizer that spells each id as digits, so the replay sends them back exactly.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, cast

from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import DecoderOnlyLLM
from ferrum_mac.text.tokenizer import KeepStart, Tokenizer

if TYPE_CHECKING:
    from ferrum_mac.engine import Done, LocalEngine

REQUEST_TIMEOUT_S = 600
WARM_UP_TOKENS = 256
# The disk tier names a model by its files: random weights have none (and FERRUM_PREFIX_DISK_MB=0 turns it off).
NO_DISK = " (none: the disk tier is off, or the model has no files; give --model a folder of weights)"
GOALS = {  # issue 17's goals, as the ratios below are computed
    "ttft_cached_over_cold": 0.15,
    "cached_share": 0.90,
    "ttft_restart_over_cold": 0.30,
    "computed_over_new": 1.15,
    "ttft_last_over_first": 1.5,
    "peak_over_alone_plus_own": 1.3,
}


@dataclass
class PrefixBenchSizes:
    # The defaults are quick on a CPU; the sizes: --step-tokens 300 --shared-tokens 4000.
    conversation_tokens: int = 1500  # (a), (b): the conversation sent again
    last_message_tokens: int = 40  # (a), (b): its last user message, which changes
    steps: int = 20  # (c): requests in the agent replay
    step_tokens: int = 100  # (c): new tokens each step adds
    answer_tokens: int = 16  # (c), (d): each answer's length
    shared_tokens: int = 1000  # (d): the system prompt the concurrent requests share
    requests: int = 16  # (d)
    own_tokens: int = 64  # (d): each request's own message

    def checked(self, capacity: int | None = None) -> "PrefixBenchSizes":
        """Sizes that make sense, and that fit a context of `capacity` tokens (None: unknown yet)."""
        for name, value in asdict(self).items():
            if value < 1:
                raise FerrumError(f"--{name.replace('_', '-')} must be at least 1")
        if self.last_message_tokens >= self.conversation_tokens:
            raise FerrumError("--last-message-tokens must be fewer than --conversation-tokens")
        if capacity is None:
            return self
        longest = {
            "--conversation-tokens": self.conversation_tokens + 1,
            "--steps x (--step-tokens + --answer-tokens)": self.steps * (self.step_tokens + self.answer_tokens) + 1,
            "--shared-tokens + --own-tokens + --answer-tokens": self.shared_tokens
            + self.own_tokens
            + self.answer_tokens,
        }
        for what, tokens in longest.items():
            if tokens > capacity:
                raise FerrumError(f"{what} is {tokens} tokens but the model's context holds {capacity}; lower it")
        return self


class IdTokenizer(Tokenizer):
    """Spells token id `i` as `i,`: an answer's text gives back its ids exactly."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(piece) for piece in text.split(",") if piece.strip()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"{int(i)}," for i in ids)

    def id_to_piece(self, token_id: int) -> str | None:
        return f"{token_id},"

    def piece_to_id(self, piece: str) -> int | None:
        return int(piece.rstrip(",")) if piece.rstrip(",").isdigit() else None

    def _token_bytes(self, token_id: int) -> bytes:
        return f"{token_id},".encode()

    def text_start(self) -> KeepStart:
        return KeepStart()


class BenchEngine:
    """What the scheduler needs of an engine: the model, a tokenizer, no end-of-sequence ids."""

    def __init__(self, model: DecoderOnlyLLM, name: str):
        self.model, self.name = model, name
        self.tokenizer = IdTokenizer(model.config.vocab_size)
        self.eos_ids: frozenset[int] = frozenset()


class Server:
    """A scheduler on a freshly opened model, and requests sent to it one at a time or together."""

    def __init__(self, open_model: Callable[[], DecoderOnlyLLM], name: str):
        from ferrum_mac.serve import Scheduler

        # (the scheduler reads only an engine's model, tokenizer and eos_ids)
        self.scheduler = Scheduler(lambda: cast("LocalEngine", BenchEngine(open_model(), name))).start()
        self.model = self.scheduler.model
        self.peak_allocated = 0

    def send(self, prompts: list[list[int]], answer_tokens: int) -> list[tuple[Done, list[int]]]:
        """Submit every prompt at once; each one's Done and answer ids, in order."""
        from ferrum_mac.engine import Done, TextDelta
        from ferrum_mac.serve import EventQueue, Failed, GenerationRequest

        queues = []
        for prompt in prompts:
            queue = EventQueue()
            request = GenerationRequest(
                list(prompt), max_tokens=answer_tokens, raw=True, ignore_eos=True, emit=self._watching(queue.put)
            )
            self.scheduler.submit(request)
            queues.append(queue)
        results: list[tuple[Done, list[int]]] = []
        for queue in queues:
            events = list(queue.events(timeout=REQUEST_TIMEOUT_S))
            last = events[-1]
            if isinstance(last, Failed):
                raise FerrumError(f"a benchmark request failed: {last.message}")
            assert isinstance(last, Done)
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
            results.append((last, self.scheduler.tokenizer.encode(text)))
        return results

    def one(self, prompt: list[int], answer_tokens: int = 1) -> tuple[Done, list[int]]:
        return self.send([prompt], answer_tokens)[0]

    def _watching(self, emit):
        """`emit`, noting the KV allocated at each event (on the scheduler's thread, between steps)."""

        def watched(event) -> None:
            self.peak_allocated = max(self.peak_allocated, self.model.state.allocated_tokens() or 0)
            emit(event)

        return watched

    # (read between requests, while the scheduler's thread has nothing to do)
    def prefix_stats(self) -> dict:
        stats = self.model.state.prefix_stats()
        return asdict(stats) if stats is not None else {}

    def stop(self) -> None:
        self.scheduler.stop()


def measure(open_model: Callable[[], DecoderOnlyLLM], name: str, sizes: PrefixBenchSizes, say=print) -> dict:
    """(d) and (a) on one model, then (d)'s lone request, (b) and (c) on the model opened again;
    each (d) side starts from a fresh model after the same warm-up, so their peaks compare."""
    rng = random.Random(17)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    result: dict = {"model": name, "sizes": asdict(sizes), "goals": GOALS}
    server = Server(open_model, name)
    try:
        vocab = server.model.config.vocab_size
        sizes.checked(server.model.kv_capacity())
        say("warming up ...")
        server.one(ids(WARM_UP_TOKENS))
        say(f"(d) {sizes.requests} requests sharing a {sizes.shared_tokens}-token system prompt ...")
        system = ids(sizes.shared_tokens)
        together = _peak(server, [system + ids(sizes.own_tokens) for _ in range(sizes.requests)], sizes)
        say(f"(a) a {sizes.conversation_tokens}-token conversation sent again ...")
        history = ids(sizes.conversation_tokens - sizes.last_message_tokens)
        result["again"] = _again(server, history, sizes, ids)
    finally:
        server.stop()

    say("(b) the model opened again: (d)'s request alone, then (a)'s conversation once more ...")
    server = Server(open_model, name)
    try:
        server.one(ids(WARM_UP_TOKENS))  # nothing of it is cached
        alone = _peak(server, [ids(sizes.shared_tokens) + ids(sizes.own_tokens)], sizes)
        result["concurrent"] = _sharing(together, alone, sizes)
        result["restart"] = _restart(server, history, sizes, ids)
        say(f"(c) an agent replay of {sizes.steps} requests ...")
        result["replay"] = _replay(server, sizes, ids, say)
        result["prefix_stats"] = server.prefix_stats()
    finally:
        server.stop()
    return result


def _again(server: Server, history: list[int], sizes: PrefixBenchSizes, ids) -> dict:
    """The conversation sent cold, then again with another last message."""
    cold, _ = server.one(history + ids(sizes.last_message_tokens))
    cached, _ = server.one(history + ids(sizes.last_message_tokens))
    return {
        "ttft_cold_s": cold.ttft_s,
        "ttft_cached_s": cached.ttft_s,
        "ttft_cached_over_cold": cached.ttft_s / cold.ttft_s,
        "cached_tokens": cached.cached_tokens,
        "prompt_tokens": cached.prompt_tokens,
        "cached_share": cached.cached_tokens / cached.prompt_tokens,
    }


def _restart(server: Server, history: list[int], sizes: PrefixBenchSizes, ids) -> dict:
    """On a model opened again: a cold prompt as long as the conversation, then the conversation
    with another last message (its blocks on disk, when the disk tier is on)."""
    cold, _ = server.one(ids(sizes.conversation_tokens))
    restarted, _ = server.one(history + ids(sizes.last_message_tokens))
    disk = server.prefix_stats()
    return {
        "ttft_cold_s": cold.ttft_s,
        "ttft_restart_s": restarted.ttft_s,
        "ttft_restart_over_cold": restarted.ttft_s / cold.ttft_s,
        "cached_tokens": restarted.cached_tokens,
        "disk_tokens_loaded": disk.get("disk_tokens_loaded", 0),
        "disk_bytes_read": disk.get("disk_bytes_read", 0),
    }


def _peak(server: Server, prompts: list[list[int]], sizes: PrefixBenchSizes) -> tuple[int, int]:
    """(KV positions allocated at the peak, prompt tokens cached) of `prompts` sent together
    (on a model that ran the same warm-up before, so two peaks compare)."""
    server.peak_allocated = 0
    results = server.send(prompts, sizes.answer_tokens)
    return server.peak_allocated, sum(done.cached_tokens for done, _ in results)


def _sharing(together: tuple[int, int], alone: tuple[int, int], sizes: PrefixBenchSizes) -> dict:
    own = sizes.requests * (sizes.own_tokens + sizes.answer_tokens)
    return {
        "alone_peak_tokens": alone[0],
        "own_tokens": own,
        "peak_tokens": together[0],
        "peak_over_alone_plus_own": together[0] / (alone[0] + own),
        "unshared_tokens": sizes.requests * alone[0],
        "cached_tokens": together[1],
    }


def _replay(server: Server, sizes: PrefixBenchSizes, ids, say) -> dict:
    """Each request: the previous prompt, its answer, then `step_tokens` new ones."""
    prompt = ids(sizes.step_tokens)
    held = 0  # tokens of the prompt the previous request sent or got back
    computed = new = 0
    ttfts = []
    for step in range(1, sizes.steps + 1):
        done, answer = server.one(prompt, sizes.answer_tokens)
        computed += len(prompt) - done.cached_tokens
        new += len(prompt) - held
        ttfts.append(done.ttft_s)
        say(f"  step {step}: {len(prompt)} prompt tokens, {done.cached_tokens} cached, first token {done.ttft_s:.3f} s")
        held = len(prompt) + len(answer)
        prompt = prompt + answer + ids(sizes.step_tokens)
    return {
        "computed_tokens": computed,
        "new_tokens": new,
        "computed_over_new": computed / new,
        "ttft_first_s": ttfts[0],
        "ttft_last_s": ttfts[-1],
        "ttft_last_over_first": ttfts[-1] / ttfts[0],
    }


def report_lines(r: dict) -> list[str]:
    g, c, a, b, p = r["goals"], r["concurrent"], r["again"], r["restart"], r["replay"]
    s = r["sizes"]
    return [
        f"ferrum bench prefix: {r['model']}",
        f"(a) {s['conversation_tokens']}-token conversation again, new last message: first token "
        f"{a['ttft_cached_s']:.3f} s cached vs {a['ttft_cold_s']:.3f} s cold = {a['ttft_cached_over_cold']:.2f}x "
        f"(goal <= {g['ttft_cached_over_cold']}); cached {a['cached_tokens']} of {a['prompt_tokens']} "
        f"= {a['cached_share']:.0%} (goal >= {g['cached_share']:.0%})",
        f"(b) after a restart: first token {b['ttft_restart_s']:.3f} s vs {b['ttft_cold_s']:.3f} s cold = "
        f"{b['ttft_restart_over_cold']:.2f}x (goal <= {g['ttft_restart_over_cold']}); cached {b['cached_tokens']}, "
        f"{b['disk_tokens_loaded']} tokens ({b['disk_bytes_read']} bytes) read from disk"
        + ("" if b["disk_tokens_loaded"] else NO_DISK),
        f"(c) agent replay, {s['steps']} steps of {s['step_tokens']} new tokens: computed {p['computed_tokens']} "
        f"prompt tokens for {p['new_tokens']} new = {p['computed_over_new']:.2f}x (goal <= "
        f"{g['computed_over_new']}); first token at the last step {p['ttft_last_s']:.3f} s vs "
        f"{p['ttft_first_s']:.3f} s at the first = {p['ttft_last_over_first']:.2f}x (goal <= {g['ttft_last_over_first']})",
        f"(d) {s['requests']} requests sharing {s['shared_tokens']} tokens: KV allocated at the peak "
        f"{c['peak_tokens']} tokens vs one alone {c['alone_peak_tokens']} + their own {c['own_tokens']} = "
        f"{c['peak_over_alone_plus_own']:.2f}x (goal <= {g['peak_over_alone_plus_own']}); "
        f"{c['unshared_tokens']} if none were shared; {c['cached_tokens']} prompt tokens shared",
    ]


def model_opener(model: str | None, shape: str | None, quant: str, backend: str, device: str | None):
    """(a function opening the model on the calling thread, its label): the scheduler opens it on its own."""
    from ferrum_mac.backends import check_device
    from ferrum_mac.compose import choose_backend as choose

    if model is not None and shape is not None:
        raise FerrumError("give a MODEL or --shape, not both")
    chosen = choose(backend)
    device = check_device(device)
    if shape is None:
        from ferrum_mac.compose import open_model
        from ferrum_mac.compose import default_model_name

        name = model or default_model_name()
        return (lambda: open_model(name, backend=chosen, device=device)), str(name)
    if chosen == "torch":
        if quant != "bf16":
            raise FerrumError(f"the torch bench runs bf16 weights, not --quant {quant}; drop --quant")

        def open_torch():
            from ferrum_mac.backends.torch.memory import resolve_device
            from ferrum_mac.bench.torch_side import random_pair

            from ferrum_mac.compose import device_or_setting

            return random_pair(shape, resolve_device(device_or_setting("torch", device)))[0]

        return open_torch, f"{shape} bf16 (random weights, torch)"

    def open_mlx():
        from ferrum_mac.backends.mlx.memory import use_device
        from ferrum_mac.bench import _ferrum_from_random

        use_device(device)
        return _ferrum_from_random(shape, quant)[0]

    return open_mlx, f"{shape} {quant} (random weights, mlx)"


def run_prefix(
    model: str | None,
    shape: str | None,
    quant: str,
    backend: str,
    device: str | None,
    sizes: PrefixBenchSizes,
    json_out: bool,
) -> dict:
    """`ferrum bench prefix`: progress on stderr, then the figures (or one JSON object) on stdout."""
    sizes.checked()  # before the model loads
    open_model, name = model_opener(model, shape, quant, backend, device)
    result = measure(open_model, name, sizes, say=lambda s: print(f"ferrum bench prefix: {s}", file=sys.stderr))
    print(json.dumps(result, indent=1) if json_out else "\n".join(report_lines(result)))
    return result
