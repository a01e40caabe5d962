"""The scheduler's KV memory on stories260K: after a burst the pool goes back to its idle size,
a long request after the burst holds one slot of its own room, admission budgets for the
pool's whole shape (every slot as long as the longest), and `/metrics` says what is held."""

from __future__ import annotations

import time

import httpx

from ferrum_mac.engine import Done
from ferrum_mac.serve import EventQueue, GenerationRequest, Scheduler
from serve_support import open_stories

TIMEOUT = 60
IDLE = 256  # the scheduler's warm-up prepares 16 tokens: one slot of the grow step


def run_all(scheduler, requests: list[dict]) -> list[int]:
    """Submit every request at once and wait for them; returns the KV positions the model
    held at each event (read on the scheduler's thread, where the model lives)."""
    held, queues = [], []
    for options in requests:
        queue = EventQueue()

        def emit(event, put=queue.put):
            held.append(scheduler.model.kv_allocated_tokens())
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


def test_a_burst_then_one_long_request_holds_one_slot(scheduler):
    wait_idle(scheduler)
    burst = [dict(prompt_ids=[1, 20 + i, 30, 40], max_tokens=4, ignore_eos=True) for i in range(32)]
    held = run_all(scheduler, burst)
    assert max(held) == 32 * 256  # 32 slots of the grow step
    wait_idle(scheduler)
    assert scheduler.model.kv_allocated_tokens() == IDLE

    held = run_all(scheduler, [dict(prompt_ids=long_prompt(450), max_tokens=8, ignore_eos=True)])
    assert max(held) == 512  # one slot of the long one's room (it was 32 such slots)
    wait_idle(scheduler)
    assert scheduler.model.kv_allocated_tokens() == IDLE


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
        if samples["ferrum_kv_tokens_allocated"] == str(IDLE):
            break
        time.sleep(0.05)
    assert samples["ferrum_kv_tokens_allocated"] == str(IDLE)
    assert samples["ferrum_kv_tokens_used"] == "0"


def test_admission_budgets_for_the_pools_shape(stories_path):
    """A short request (room 256) and a long one (room 512) need 563 tokens between them, but
    together the pool holds two slots of 512: with a budget of 900 the long one waits."""
    scheduler = Scheduler(open_stories(stories_path), kv_budget=900).start()
    try:
        held = run_all(
            scheduler,
            [
                dict(prompt_ids=[1, 20, 30, 40, 50], max_tokens=100, ignore_eos=True),
                dict(prompt_ids=long_prompt(450), max_tokens=8, ignore_eos=True),
            ],
        )
        assert max(held) <= 900
        assert max(held) == 512  # the long one ran, alone
    finally:
        scheduler.stop()
