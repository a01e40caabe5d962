"""The scheduler's KV memory on stories260K: a burst holds blocks for its tokens, a long
request after it only its own, released sequences' blocks stay in the prefix cache,
admission budgets for the blocks requests need, and `/metrics` says what is held."""

from __future__ import annotations

import time

import httpx
import pytest

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS
from ferrum_mac.engine import Done
from ferrum_mac.serve import EventQueue, GenerationRequest, Scheduler
from serve_support import open_stories

TIMEOUT = 60


def run_all(scheduler, requests: list[dict], note=None) -> list[int]:
    """Submit every request at once and wait for them; returns the KV positions the model
    held at each event (read on the scheduler's thread, where the model lives); `note` is
    called with each event there too."""
    held, queues = [], []
    for options in requests:
        queue = EventQueue()

        def emit(event, put=queue.put):
            held.append(scheduler.model.state.allocated_tokens())
            if note is not None:
                note(event)
            put(event)

        scheduler.submit(GenerationRequest(emit=emit, **options))
        queues.append(queue)
    for queue in queues:
        events = list(queue.events(timeout=TIMEOUT))
        assert isinstance(events[-1], Done), events[-1]
    return held


def wait_idle(scheduler) -> None:
    deadline = time.monotonic() + TIMEOUT
    while (
        scheduler.stats.active or scheduler.stats.waiting or scheduler.stats.kv_tokens_used
    ) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.stats.active == 0 and scheduler.stats.kv_tokens_used == 0


def long_prompt(n: int) -> list[int]:
    return [1] + [(7 * i) % 500 + 10 for i in range(n - 1)]


def blocks_of(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


@pytest.fixture(scope="module")
def fresh_scheduler(stories_path):
    """A scheduler of its own: its KV holds only what these tests put there."""
    scheduler = Scheduler(open_stories(stories_path)).start()
    yield scheduler
    scheduler.stop()


def test_memory_follows_the_tokens_held(fresh_scheduler):
    scheduler, model = fresh_scheduler, fresh_scheduler.model
    burst = [dict(prompt_ids=[1, 20 + i, 30, 40], max_tokens=4, ignore_eos=True) for i in range(32)]
    held = run_all(scheduler, burst)
    # 32 sequences of one block each, and each prompt's block in the prefix cache (a sequence
    # copies it on its first write), and scratch: the buffers grow by at most half again
    assert max(held) <= 2 * (2 * 32 + 1) * BLOCK_TOKENS
    wait_idle(scheduler)
    after_burst = model.state.allocated_tokens()
    assert after_burst <= max(held)
    assert model.state.prefix_stats().cached_tokens >= 32 * 4  # released, their blocks stay cached

    held = run_all(scheduler, [dict(prompt_ids=long_prompt(450), max_tokens=8, ignore_eos=True)])
    assert max(held) <= 2 * (after_burst + blocks_of(458) * BLOCK_TOKENS)  # its own blocks, not 32 slots of them
    wait_idle(scheduler)


def test_metrics_show_allocated_and_used_kv(server, scheduler):
    wait_idle(scheduler)
    run_all(scheduler, [dict(prompt_ids=long_prompt(300), max_tokens=2, ignore_eos=True)])
    wait_idle(scheduler)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the gauges are written once per loop turn
        samples = dict(
            line.rsplit(" ", 1)
            for line in httpx.get(server.url + "/metrics").text.splitlines()
            if not line.startswith("#")
        )
        if samples["ferrum_kv_tokens_used"] == "0":
            break
        time.sleep(0.05)
    assert samples["ferrum_kv_tokens_used"] == "0"
    assert int(samples["ferrum_kv_tokens_allocated"]) >= blocks_of(300) * BLOCK_TOKENS  # its blocks stay cached


def test_admission_budgets_for_the_blocks_requests_need(stories_path):
    """A short request and a long one need more blocks together than a budget allows: the long
    one waits for the short one to end."""
    scheduler = Scheduler(open_stories(stories_path)).start()
    short, long = [1, 20, 30, 40, 50], long_prompt(450)
    scheduler.kv_budget = scheduler.model.state.tokens_for([len(short) + 100, len(long) + 8]) - 1
    running = []

    def note_running(event, scheduler=scheduler):
        running.append(scheduler.stats.active)

    try:
        run_all(
            scheduler,
            [
                dict(prompt_ids=short, max_tokens=100, ignore_eos=True),
                dict(prompt_ids=long, max_tokens=8, ignore_eos=True),
            ],
            note_running,
        )
        assert running and max(running) == 1
    finally:
        scheduler.stop()
