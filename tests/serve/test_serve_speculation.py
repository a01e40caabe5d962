"""Speculation in `ferrum serve`: with `speculate` auto or ngram, several concurrent requests get
exactly the answers they get with it off (streamed and whole, greedy and seeded), end for the
same reasons, and the guesses kept show in the answer's stats and in /metrics.

The step times are set per model (`scheduler.costs.use`: every step as fast as one row), and the
whole steps' pace is not judged, so that guessing runs whatever this machine measures:
correctness must not depend on the plan.
"""

from __future__ import annotations

import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_support import CHAT, COMPLETIONS, LiveServer, error_of, open_stories

from ferrum_mac.engine.speculation.controller import MAX_K, Controller
from ferrum_mac.engine.speculation.proposers import PromptLookup, Proposal
from ferrum_mac.engine.speculation.step_times import StepTimes
from ferrum_mac.engine.speculation.verify import Speculator
from ferrum_mac.serve.command import ServeOptionError, speculate_option
from ferrum_mac.serve.batching.speculation import (
    FIRST_PAUSE,
    FIRST_PROBE_GUESSES,
    PACE_SAMPLES,
    PLAIN_EVERY,
    PROBE_GUESSES,
    PROBES,
    REPROBE_EVERY,
    ROW_COUNTS,
    Offer,
    Pace,
    RowCosts,
    StepCosts,
    indexed,
    learned,
    plan,
)

FLAT = [1.0] * len(ROW_COUNTS)  # a step of many rows as fast as one: guessing always pays
PROMPTS = (
    "Tom and Lily went to the park. Tom and Lily",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "Once upon a time",
    "Lily had a red ball. Lily had a red ball. Lily",
)
EDIT = (
    "Copy this text exactly, changing 'red' to 'blue':\n"
    "The red house stands at the end of the long road, next to the old oak tree and the small river."
)


@pytest.fixture(scope="module")
def server(stories_path):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(stories_path), max_batch=4).start()
    scheduler.costs.use(FLAT)
    scheduler.pace = Pace(judged=False)
    live = LiveServer(build_app(scheduler, "stories260K"))
    yield live
    live.stop()
    scheduler.stop()


def completion(server, prompt: str, speculate: str, stream: bool = False, **fields) -> tuple[str, dict]:
    """The text and ferrum's stats of one /v1/completions answer."""
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "speculate": speculate, "stream": stream, **fields}
    if not stream:
        response = httpx.post(server.url + COMPLETIONS, json=body, timeout=60)
        assert response.status_code == 200, response.text
        data = response.json()
        return data["choices"][0]["text"], data["stats"]
    text, stats = [], {}
    with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                text += [c["text"] for c in chunk["choices"]]
                stats = chunk.get("stats", stats)
    return "".join(text), stats


def concurrently(server, speculate: str, stream: bool, **fields) -> list[tuple[str, dict]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: completion(server, p, speculate, stream, **fields), PROMPTS))


def test_greedy_answers_are_those_without_speculation(server):
    plain = [text for text, _ in concurrently(server, "off", stream=False)]
    kept = 0
    for mode, stream in (("auto", False), ("ngram", True)):
        answers = concurrently(server, mode, stream)
        assert [text for text, _ in answers] == plain, (mode, stream)
        for _, stats in answers:
            assert stats["generated_tokens"] == 60 and stats["stop_reason"] == "max_tokens"
            assert 0 <= stats["speculation"]["accepted"] <= stats["speculation"]["proposed"]
            kept += stats["speculation"]["accepted"]
    assert kept > 0


def test_limits_and_stop_strings_end_answers_as_without_speculation(server):
    prompt = PROMPTS[0]
    for limit in (1, 2, 3, 9):
        fast, fast_stats = completion(server, prompt, "auto", max_tokens=limit)
        plain, plain_stats = completion(server, prompt, "off", max_tokens=limit)
        assert fast == plain and fast_stats["generated_tokens"] == plain_stats["generated_tokens"] == limit
    text, _ = completion(server, prompt, "off", max_tokens=60)
    stop = text[20:26]  # a stop string inside a guessed stretch as often as not
    fast, stats = completion(server, prompt, "auto", max_tokens=60, stop=[stop])
    assert (fast, stats["stop_string"]) == (text[: text.index(stop)], stop)
    assert (
        stats["generated_tokens"]
        == completion(server, prompt, "off", max_tokens=60, stop=[stop])[1]["generated_tokens"]
    )


def test_the_prefix_cache_keeps_answers_as_computed(server):
    """An answer with guesses cut from its cache is remembered as it was computed: a request
    that sends it back takes its blocks from the prefix cache and goes on as one longer answer."""
    for prompt in ("Ben saw a big dog. Ben saw a big dog. Ben", "Mom made a cake. Mom made a cake. Mom"):
        head, stats = completion(server, prompt, "auto", max_tokens=30)  # prompts no other test sends
        assert stats["speculation"]["proposed"] > stats["speculation"]["accepted"]  # some were cut
        response = httpx.post(
            server.url + COMPLETIONS,
            json={"prompt": prompt + head, "max_tokens": 30, "temperature": 0, "speculate": "off"},
            timeout=60,
        ).json()
        assert response["usage"]["prompt_tokens_details"]["cached_tokens"] > stats["prompt_tokens"] + 16
        whole, _ = completion(server, prompt, "off", max_tokens=60)
        assert head + response["choices"][0]["text"] == whole


def test_seeded_sampling_draws_the_same_answer(server):
    """The sampler is called once per token, in order, whether the token was guessed or not:
    a seeded answer is the same with speculation, and it still honours max_tokens and stop."""
    sampled = {"temperature": 0.8, "seed": 7, "max_tokens": 40}
    plain = concurrently(server, "off", stream=False, **sampled)
    fast = concurrently(server, "auto", stream=True, **sampled)
    assert [t for t, _ in fast] == [t for t, _ in plain]
    assert all(s["generated_tokens"] <= 40 for _, s in fast)


def test_bad_speculate_values_are_refused_on_every_protocol(server):
    for value, words in (("fast", "auto, ngram or off"), ("draft:tiny", "draft model"), (3, "string")):
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "speculate": value}
        error = error_of(httpx.post(server.url + CHAT, json=body, timeout=30), 400)
        assert words in error["message"] and error["param"] == "speculate"
        body = {"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        response = httpx.post(server.url + "/v1/messages", json={**body, "speculate": value}, timeout=30)
        assert response.status_code == 400 and response.json()["type"] == "error", response.text
        assert words in response.json()["error"]["message"]
        ollama = {
            "model": "stories260K",
            "messages": body["messages"],
            "stream": False,
            "options": {"speculate": value},
        }
        response = httpx.post(server.url + "/api/chat", json=ollama, timeout=30)
        assert response.status_code == 400 and "options.speculate" in response.json()["error"], response.text
    with pytest.raises(ServeOptionError, match="auto, ngram or off"):
        speculate_option("draft:tiny")


def test_other_protocols_speculate_too(server):
    """Anthropic's and Ollama's bodies carry the field to the same request model."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    answers = []
    for mode in ("off", "ngram"):
        body = {"model": "stories260K", "messages": messages, "max_tokens": 30, "temperature": 0, "speculate": mode}
        response = httpx.post(server.url + "/v1/messages", json=body, timeout=60)
        options = {"speculate": mode, "temperature": 0, "num_predict": 30}
        ollama = {"model": "stories260K", "messages": messages, "stream": False, "options": options}
        chat = httpx.post(server.url + "/api/chat", json=ollama, timeout=60)
        answers.append((response.json()["content"][0]["text"], chat.json()["message"]["content"]))
    assert answers[0] == answers[1]


def test_metrics_count_guesses(server):
    def counters() -> tuple[int, int]:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        found = [
            re.search(rf"^ferrum_speculation_{name}_tokens_total (\d+)$", text, re.M)
            for name in ("proposed", "accepted")
        ]
        assert all(found), text
        return int(found[0].group(1)), int(found[1].group(1))

    before = counters()
    _, stats = completion(server, PROMPTS[1], "auto")
    after = counters()
    assert after[0] - before[0] == stats["speculation"]["proposed"] > 0
    assert after[1] - before[1] == stats["speculation"]["accepted"]


def test_smollm2_edit_answers_are_plain_and_keep_guesses(smollm2_gguf):
    """The bundled chat model on an editing task (its answer copies the prompt): two
    concurrent answers, the same as without speculation, with guesses kept."""
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=512), max_batch=2).start()
    scheduler.costs.use(FLAT)
    scheduler.pace = Pace(judged=False)
    live = LiveServer(build_app(scheduler, "smollm2"))
    try:

        def answer(mode: str, question: str) -> dict:
            body = {"messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
            return httpx.post(live.url + CHAT, json={**body, "speculate": mode}, timeout=120).json()

        questions = (EDIT, EDIT.replace("'blue'", "'green'"))
        with ThreadPoolExecutor(2) as pool:
            plain = list(pool.map(lambda q: answer("off", q), questions))
            fast = list(pool.map(lambda q: answer("auto", q), questions))
        texts = [[a["choices"][0]["message"]["content"] for a in side] for side in (plain, fast)]
        assert texts[0] == texts[1]
        kept = sum(a["stats"]["speculation"]["accepted"] for a in fast)
        assert kept > 10, [a["stats"]["speculation"] for a in fast]
    finally:
        live.stop()
        scheduler.stop()


@pytest.mark.slow
def test_torch_verify_rows_give_the_answers_without_speculation(stories_path):
    """On torch a verify runs as decode rows (a captured step on a GPU): the same answers."""
    from ferrum_mac.compose import open_engine
    from ferrum_mac.engine import SamplingParams, TextDelta
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.batching.request import EventQueue, GenerationRequest

    scheduler = Scheduler(lambda: open_engine(stories_path, backend="torch"), max_batch=4).start()
    scheduler.costs.use(FLAT)
    scheduler.pace = Pace(judged=False)
    try:

        def answers(mode: str) -> list[tuple[str, dict | None]]:
            queues = [EventQueue() for _ in PROMPTS]
            for prompt, queue in zip(PROMPTS, queues):
                ids = scheduler.tokenizer.encode(prompt, add_special_tokens=True)
                greedy = SamplingParams(temperature=0.0)
                scheduler.submit(GenerationRequest(ids, greedy, 40, emit=queue.put, speculate=mode))
            events = [list(queue.events(timeout=60)) for queue in queues]
            return [
                ("".join(e.text for e in answer if isinstance(e, TextDelta)), answer[-1].speculation)
                for answer in events
            ]

        plain, fast = answers("off"), answers("auto")
        assert [text for text, _ in fast] == [text for text, _ in plain]
        assert sum(stats["accepted"] for _, stats in fast if stats) > 0
    finally:
        scheduler.stop()


def test_plan_for_one_stream_is_the_engines_rule():
    """One stream alone: the plan verifies what the engine's controller would, with the same
    costs (a step of k+1 rows against one of one row)."""
    for seconds in (FLAT, [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 9.0], [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]):
        costs = RowCosts(tuple(seconds))
        for accepted in (0.1, 0.5, 0.8, 0.95):
            controller = Controller(costs.curve(), counts={"copy": [accepted, 1.0]})
            offer = Offer(Proposal(list(range(MAX_K)), "copy"), accepted)
            assert plan([offer], 1, costs) == [controller.guesses("copy")], (seconds, accepted)


def test_plan_spends_rows_on_the_likeliest_guesses():
    costs = RowCosts((1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0))  # 16 rows as fast as 1, 32 twice as slow
    offers = [Offer(Proposal([1] * 8, "copy"), 0.9), Offer(Proposal([2] * 8, "ngram1"), 0.2)]
    assert plan(offers, 8, costs) == [8, 0]  # 8 rows free: the likely stream's; the other's would not pay
    assert plan(offers, 16, costs) == [0, 0]  # every further row doubles the step


def test_pace_stops_guessing_where_it_loses():
    """Steps with guesses that give fewer tokens a second than plain steps of the same batch
    size stop for a stretch that doubles while they keep losing; other sizes go on guessing."""
    pace = Pace()
    pace.record(16, 16, 0.010, guessed=False)  # plain: 1600 tokens/s
    for _ in range(PACE_SAMPLES):
        assert pace.allows(16)
        pace.record(16, 18, 0.012, guessed=True)  # 1500 tokens/s
    assert [pace.allows(16) for _ in range(FIRST_PAUSE)] == [False] * FIRST_PAUSE
    assert pace.allows(16) and pace.allows(4)
    for _ in range(PACE_SAMPLES):
        pace.record(16, 18, 0.012, guessed=True)
    assert sum(not pace.allows(16) for _ in range(4 * FIRST_PAUSE)) == 2 * FIRST_PAUSE
    for _ in range(PLAIN_EVERY):  # winning steps: every one guesses, but a plain one now and then
        pace.record(16, 30, 0.012, guessed=True)
    assert not pace.allows(16)
    pace.record(16, 16, 0.010, guessed=False)
    assert pace.allows(16)


def test_a_long_prompt_is_indexed_a_slice_a_step():
    """A stream's lookups take a long prompt in over several steps, then guess as a lookup
    that took it in at once does."""
    history = [t % 97 for t in range(3000)] + [5, 6, 7]
    speculator = Speculator(PromptLookup(), StepTimes())
    steps = 1
    while not indexed(speculator, history, 1000)[0]:
        steps += 1
    assert steps == 4
    assert (
        speculator.candidate(history, MAX_K, known=True)
        == PromptLookup().propose(history, MAX_K)
        == Proposal([8, 9, 10, 11, 12, 13, 14, 15], "ngram3")
    )


def test_a_fresh_server_learns_the_step_costs_from_its_requests(stories_path, monkeypatch):
    """Nothing is timed apart from requests: every forward of the first request is on its own
    cache, and before the step costs are known a step verifies at most PROBE_GUESSES guesses,
    PROBES such steps; then they are known, and the answer is the plain one."""
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(stories_path), max_batch=4).start()
    scheduler.pace = Pace(judged=False)
    model, costs = scheduler.model, scheduler.costs
    verifies: list[tuple[set, int, bool]] = []  # (cache ids, guesses, costs known)
    prefills: set = set()
    verify_batch, prefill, unified_forward = model.verify_batch, model.prefill, model.unified_forward

    def watched_verify(items):
        verifies.append(({i.cache_id for i in items}, sum(len(i.tokens) - 1 for i in items), costs.measured(1)))
        return verify_batch(items)

    def watched_prefill(cache_id, tokens):
        prefills.add(cache_id)
        return prefill(cache_id, tokens)

    monkeypatch.setattr(model, "verify_batch", watched_verify)

    def watched_forward(items):
        prefills.update(i.cache_id for i in items)
        return unified_forward(items)

    monkeypatch.setattr(model, "prefill", watched_prefill)
    monkeypatch.setattr(model, "unified_forward", watched_forward)
    live = LiveServer(build_app(scheduler, "stories260K"))
    try:
        fast, stats = completion(live, PROMPTS[1], "auto")
        assert len(prefills) == 1 and all(ids == prefills for ids, _, _ in verifies)
        probes = [guesses for _, guesses, known in verifies if not known]
        assert len(probes) == PROBES and max(probes) <= PROBE_GUESSES
        assert costs.measured(1) and not costs.measured(2) and stats["speculation"]["accepted"] > 0
        assert fast == completion(live, PROMPTS[1], "off")[0]
    finally:
        live.stop()
        scheduler.stop()


def test_learned_step_costs_grow_past_the_largest_timed_size():
    plain, verify = deque([1.0, 0.9]), {4: deque([2.0, 1.2])}  # the fastest counts
    costs = learned(plain, verify, 1)
    assert costs.plain_time(1) == pytest.approx(0.9)
    assert costs.time(1) == costs.time(4) == pytest.approx(1.2)  # no fewer rows timed: as dear
    assert costs.time(8) == pytest.approx(1.2 + 4 * 0.1)  # per row as from the plain step's one row to four
    verify[16] = deque([1.5])
    assert learned(plain, verify, 1).time(64) == pytest.approx(1.5 + 48 * 0.3 / 12)
    assert learned((), verify, 1).time(2) == float("inf")  # no plain step timed: no guess pays
    batch = learned(deque([2.0]), {8: deque([2.4])}, 4)  # four sequences: their plain step is the base
    assert batch.plain_time(4) == pytest.approx(2.0) and batch.time(16) == pytest.approx(2.4 + 8 * 0.1)


def test_step_costs_are_kept_by_batch_size_and_probed_again_when_they_refuse():
    costs = StepCosts()
    for probe in (FIRST_PROBE_GUESSES, PROBE_GUESSES):
        assert costs.probe(1) == probe
        costs.record(1, 1 + probe, 1.0, guessed=True)
    costs.record(1, 1, 0.5, guessed=False)
    assert costs.probe(1) == 0 and costs.measured(1) and not costs.measured(4) and costs.probe(4) == FIRST_PROBE_GUESSES
    refusals = [costs.reprobe(1) for _ in range(2 * REPROBE_EVERY)]  # the plan found no guess worth it
    assert refusals.count(PROBE_GUESSES) == 2 and refusals[REPROBE_EVERY - 1] == PROBE_GUESSES
