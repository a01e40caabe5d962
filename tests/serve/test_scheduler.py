"""The scheduler on its own: batched answers equal one-at-a-time answers; cancel, stops,
limits and capacity; every finished request's KV released."""

from __future__ import annotations

import time

import pytest

from ferrum_mac.engine import CANCELLED, MAX_TOKENS, STOP_STRING, Done, SamplingParams, TextDelta
from ferrum_mac.errors import KvCapacityError
from ferrum_mac.serve import EventQueue, Failed, GenerationRequest

PROMPTS = ["Once upon a time Lily", "Once upon a time there was a big red ball that", "Tom and Sam", "The dog"]
TIMEOUT = 60


def submit(scheduler, prompt: str, **options):
    queue = EventQueue()
    ids = scheduler.engine.tokenizer.encode(prompt)
    handle = scheduler.submit(GenerationRequest(ids, emit=queue.put, **options))
    return handle, queue


def answer(queue) -> tuple[str, Done]:
    events = list(queue.events(timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events[-1]


def wait_idle(scheduler) -> None:
    deadline = time.monotonic() + TIMEOUT
    while (scheduler.stats.active or scheduler.stats.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.stats.active == 0 and scheduler.stats.kv_tokens == 0


def test_batched_answers_equal_one_at_a_time(scheduler):
    prompts = PROMPTS * 3
    alone = [answer(submit(scheduler, p, max_tokens=24)[1]) for p in prompts]
    queues = [submit(scheduler, p, max_tokens=24)[1] for p in prompts]
    together = [answer(q) for q in queues]
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert all(done.generated_tokens == 24 and done.stop_reason == MAX_TOKENS for _, done in together)
    wait_idle(scheduler)


def test_split_mode_gives_the_same_answers(scheduler):
    queues = [submit(scheduler, p, max_tokens=16)[1] for p in PROMPTS]
    unified = [answer(q)[0] for q in queues]
    scheduler.mode = "decode_batch"  # the path for backends without unified_forward
    try:
        queues = [submit(scheduler, p, max_tokens=16)[1] for p in PROMPTS]
        assert [answer(q)[0] for q in queues] == unified
    finally:
        scheduler.mode = "unified_forward"


def test_cancel_ends_the_answer_and_frees_its_cache(scheduler):
    # ignore_eos: only the cancel can end it before its (unreachable) limit
    handle, queue = submit(scheduler, "Once upon a time", max_tokens=10_000, ignore_eos=True)
    events = queue.events(timeout=TIMEOUT)
    next(e for e in events if isinstance(e, TextDelta))
    handle.cancel()
    done = [e for e in events][-1]
    assert done.stop_reason == CANCELLED and done.generated_tokens < 10_000
    wait_idle(scheduler)


def test_stop_string_and_seeded_sampling(scheduler):
    text, done = answer(submit(scheduler, PROMPTS[0], max_tokens=40)[1])
    word = text.split()[3]
    stopped, done = answer(submit(scheduler, PROMPTS[0], max_tokens=40, stop=(word,))[1])
    assert done.stop_reason == STOP_STRING and stopped == text[: text.index(word)].rstrip()  # sections end trimmed
    sampling = SamplingParams(temperature=1.0, seed=7)
    first = answer(submit(scheduler, PROMPTS[1], max_tokens=20, sampling=sampling)[1])[0]
    assert answer(submit(scheduler, PROMPTS[1], max_tokens=20, sampling=sampling)[1])[0] == first


def test_prompt_past_capacity_is_refused_before_queueing(scheduler):
    with pytest.raises(KvCapacityError):
        scheduler.submit(GenerationRequest([1] * (scheduler.capacity + 1)))


def test_bad_sampling_fails_only_that_request(scheduler):
    bad = SamplingParams(temperature=0.0, logit_bias={10**9: 1.0})
    _, queue = submit(scheduler, "Tom", max_tokens=4, sampling=bad)
    assert isinstance(list(queue.events(timeout=TIMEOUT))[-1], Failed)
    assert answer(submit(scheduler, "Tom", max_tokens=4)[1])[1].generated_tokens == 4


def test_greedy_and_seeded_rows_in_one_batch_sample_as_alone(scheduler):
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=3)
    requests = [dict(max_tokens=16), dict(max_tokens=16, sampling=seeded), dict(max_tokens=16)]
    alone = [answer(submit(scheduler, p, **r)[1])[0] for p, r in zip(PROMPTS, requests)]
    queues = [submit(scheduler, p, **r)[1] for p, r in zip(PROMPTS, requests)]
    assert [answer(q)[0] for q in queues] == alone


@pytest.fixture(scope="module")
def torch_scheduler(stories_path):
    from ferrum_mac.compose import open_engine
    from ferrum_mac.serve import Scheduler

    s = Scheduler(lambda: open_engine(stories_path, backend="torch")).start()
    yield s
    s.stop()


@pytest.mark.parametrize("backend", ["mlx", "torch"])
@pytest.mark.parametrize(
    "sampling, speculate",
    [(None, "off"), (SamplingParams(temperature=1.0, seed=11), "off"), (None, "ngram")],
    ids=["greedy", "seeded", "guessing"],
)
def test_steps_run_ahead_give_the_answers_of_steps_read_first(request, backend, sampling, speculate):
    """Plain decode steps are queued before the last step's tokens are read (`batching.ahead`):
    the same tokens, stops and ends as reading each step's tokens first; a stop mid-batch, a
    cancel and a late arrival included."""
    scheduler = request.getfixturevalue("scheduler" if backend == "mlx" else "torch_scheduler")
    options = {"speculate": speculate} if sampling is None else {"sampling": sampling, "speculate": speculate}

    def round_of_answers() -> list[tuple[str, str, int]]:
        queues = [submit(scheduler, p, max_tokens=8 + 5 * i, **options)[1] for i, p in enumerate(PROMPTS)]
        queues.append(submit(scheduler, PROMPTS[1], max_tokens=30, stop=("ball",), **options)[1])
        handle, cancelled = submit(scheduler, PROMPTS[2], max_tokens=10_000, ignore_eos=True)
        next(e for e in cancelled.events(timeout=TIMEOUT) if isinstance(e, TextDelta))
        handle.cancel()
        queues.append(submit(scheduler, PROMPTS[3], max_tokens=12, **options)[1])
        answers = [answer(q) for q in queues]
        wait_idle(scheduler)
        return [(text, done.stop_reason, done.generated_tokens) for text, done in answers]

    if speculate == "ngram":  # guessing always pays, whatever this machine's load made of the step times
        from ferrum_mac.serve.batching.speculation import ROW_COUNTS, Pace

        scheduler.costs.use([1.0] * len(ROW_COUNTS))
        scheduler.pace = Pace(judged=False)
    before, guessed = scheduler.runner.steps_ahead, scheduler.stats.proposed_tokens
    ahead = round_of_answers()
    assert scheduler.runner.steps_ahead > before
    assert (scheduler.stats.proposed_tokens > guessed) == (speculate == "ngram")  # guesses still found
    scheduler.runner.runs_ahead = False
    try:
        assert round_of_answers() == ahead
    finally:
        scheduler.runner.runs_ahead = True
