"""The prefix cache through `ferrum serve` on stories260K, with the official openai client: a
second request sharing a long prefix reports `usage.prompt_tokens_details.cached_tokens` on
every endpoint and answers exactly as a server that computed nothing before; requests in
flight together share their common prefix; /metrics counts hits, reuse and misses by reason;
`--verbose` logs one line per request."""

from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest

from ferrum_mac.engine import Done, TextDelta
from ferrum_mac.llm import MISS_NO_PREFIX
from ferrum_mac.serve import EventQueue, GenerationRequest, Scheduler
from serve_support import LiveServer, open_stories

SYSTEM = (
    "You are a storyteller. Your stories are about Lily, a little girl who lives in a small house "
    "near a big forest with her mother, her father and her dog Spot. Every story is short and happy, "
    "and Lily always learns something new by the end of it. Lily likes to play in the park, to read "
    "books with her mother and to help her father in the garden."
)
MAX_TOKENS = 12
TIMEOUT = 60


@pytest.fixture
def live(stories_path):
    """A server of its own, so its prefix cache holds only what the test sends; call it again
    for another (a cold one)."""
    from ferrum_mac.serve.app import build_app

    opened = []

    def start():
        scheduler = Scheduler(open_stories(stories_path)).start()
        if scheduler.model.state.prefix_stats() is None:
            pytest.skip("this backend keeps no prefix cache")
        server = LiveServer(build_app(scheduler, "stories260K"))
        opened.append((server, scheduler))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        return server, scheduler, client

    yield start
    for server, scheduler in opened:
        server.stop()
        scheduler.stop()


def ask(client, question: str, **extra):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return client.chat.completions.create(
        model="stories260K", messages=messages, max_tokens=MAX_TOKENS, temperature=0, **extra
    )


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
    }


def settled_metrics(server, name: str, at_least: float) -> dict[str, float]:
    """/metrics once `name` reaches `at_least` (the gauges are read once per turn of the loop)."""
    deadline = time.monotonic() + 10
    while True:
        sample = metrics(server)
        if sample.get(name, 0) >= at_least or time.monotonic() > deadline:
            return sample
        time.sleep(0.05)


def test_a_shared_system_prompt_is_cached_and_answers_as_cold(live):
    server, _, client = live()
    first = ask(client, "Tell me a story about Spot.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = ask(client, "What does Lily like?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > len(SYSTEM) // 8  # the system prompt, at least
    assert cached < second.usage.prompt_tokens  # the new question was computed
    assert second.stats["cached_tokens"] == cached  # (ferrum's own figures agree)

    _, _, cold_client = live()
    cold = ask(cold_client, "What does Lily like?")
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message.content == cold.choices[0].message.content


def test_every_endpoint_reports_cached_tokens(live):
    _, _, client = live()
    ask(client, "Tell me a story about Spot.")
    chunks = list(ask(client, "Tell me a story about Spot.", stream=True, stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens == streamed.prompt_tokens - 1  # all but the last token

    prompt = SYSTEM + " Once upon a time"
    first = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens <= 1  # (no chat template: only BOS is shared)
    again = client.completions.create(model="stories260K", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].text == first.choices[0].text
    chunks = list(
        client.completions.create(
            model="stories260K",
            prompt=prompt + " there",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def submit(scheduler, ids: list[int]) -> EventQueue:
    queue = EventQueue()
    scheduler.submit(GenerationRequest(list(ids), max_tokens=MAX_TOKENS, ignore_eos=True, emit=queue.put))
    return queue


def result(queue: EventQueue) -> tuple[str, Done]:
    events = list(queue.events(timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]


def test_requests_in_flight_together_share_their_prefix(live):
    _, scheduler, _ = live()
    tokenizer = scheduler.engine.tokenizer
    shared = tokenizer.encode(SYSTEM)
    prompts = [shared + tokenizer.encode(f"Story number {i}.", add_special_tokens=False) for i in range(4)]
    answers = [result(q) for q in [submit(scheduler, p) for p in prompts]]  # all four at once
    assert answers[0][1].cached_tokens == 0
    # the others waited for the first to compute the prefix, then took it from the cache
    assert all(done.cached_tokens >= len(shared) - 1 for _, done in answers[1:])

    cold = [result(submit(live()[1], p)) for p in prompts[:2]]  # each on a server that computed nothing
    assert all(done.cached_tokens == 0 for _, done in cold)
    assert [text for text, _ in answers[:2]] == [text for text, _ in cold]


def test_metrics_count_hits_reuse_and_misses(live):
    server, _, client = live()
    before = metrics(server)
    assert before["ferrum_prefix_lookups_total"] == 0
    ask(client, "Tell me a story about Spot.")
    ask(client, "What does Lily like?")
    after = settled_metrics(server, "ferrum_prefix_lookups_total", 2)
    assert after["ferrum_prefix_lookups_total"] == 2
    assert after["ferrum_prefix_hits_total"] == 1
    assert after["ferrum_prefix_reused_tokens_total"] > len(SYSTEM) // 8
    assert after["ferrum_prefix_missed_tokens_total"] > 0
    assert after[f'ferrum_prefix_misses_total{{reason="{MISS_NO_PREFIX}"}}'] >= 1  # the first found nothing
    assert after["ferrum_prefix_cached_tokens"] > before["ferrum_prefix_cached_tokens"]
    for name in ("evicted_blocks", "disk_written_bytes", "disk_read_bytes"):
        assert f"ferrum_prefix_{name}_total" in after


def test_verbose_logs_reuse_per_request(live, caplog):
    _, _, client = live()
    with caplog.at_level(logging.INFO, logger="ferrum.serve"):
        ask(client, "Tell me a story about Spot.")
        second = ask(client, "What does Lily like?")
    lines = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(lines) == 2
    assert f"miss: {MISS_NO_PREFIX}" in lines[0]
    cached, prompt = second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens
    assert f"{cached} of {prompt} prompt tokens reused" in lines[1]


def test_a_failing_lookup_fails_only_its_request(live, monkeypatch):
    from ferrum_mac.serve import Failed

    _, scheduler, _ = live()
    model, poisoned = scheduler.model, 77
    real_reuse = model.state.reuse

    def reuse(cache_id, tokens):
        if poisoned in tokens:
            raise RuntimeError("the prefix index broke")
        return real_reuse(cache_id, tokens)

    monkeypatch.setattr(model.state, "reuse", reuse)
    tokenizer = scheduler.engine.tokenizer
    good = tokenizer.encode(SYSTEM)
    queues = [submit(scheduler, good), submit(scheduler, good[:5] + [poisoned] + good[5:]), submit(scheduler, good)]
    bad = list(queues[1].events(timeout=TIMEOUT))
    assert bad == [Failed("the prefix index broke")]
    first, third = result(queues[0]), result(queues[2])
    assert first[0] == third[0] and third[1].cached_tokens >= len(good) - 1
    assert scheduler.alive
    deadline = time.monotonic() + 10
    while scheduler.stats.kv_tokens_used and time.monotonic() < deadline:  # (a gauge: written once per loop)
        time.sleep(0.05)
    assert scheduler.stats.kv_tokens_used == 0  # the failed request's cache was released too
