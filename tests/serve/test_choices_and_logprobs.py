"""`n` choices and `logprobs` through the official openai client, on an MLX and a torch scheduler:
seeded choices differ yet repeat, greedy ones agree, streams interleave them by index; each
token's log-probability is the model's own, its top alternatives sorted and holding it."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest
from serve_support import LiveServer

MESSAGES = [{"role": "user", "content": "Tell me a story about Lily."}]
PROMPT = "Once upon a time, there was a little girl named Lily."


@pytest.fixture(scope="module", params=["mlx", "torch"])
def live(request, stories_path):
    from ferrum_mac.compose import open_engine
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(lambda: open_engine(stories_path, backend=request.param)).start()
    server = LiveServer(build_app(scheduler, "stories260K"))
    yield server
    server.stop()
    scheduler.stop()


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# -- n choices --------------------------------------------------------------------------------


def test_seeded_choices_differ_and_repeat(client):
    def texts():
        reply = client.chat.completions.create(
            model="m", messages=MESSAGES, n=4, temperature=1.0, seed=7, max_tokens=24
        )
        assert [c.index for c in reply.choices] == [0, 1, 2, 3]
        return [c.message.content for c in reply.choices]

    first = texts()
    assert len(set(first)) > 1, first
    assert texts() == first
    one = client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, seed=7, max_tokens=24)
    assert one.choices[0].message.content == first[0]  # choice 0 draws with the seed itself


def test_greedy_choices_agree_and_usage_sums(client):
    one = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=20)
    reply = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=20, n=3)
    assert [c.text for c in reply.choices] == [one.choices[0].text] * 3
    assert reply.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert reply.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_later_choices_take_the_prompt_from_the_prefix_cache(live):
    prompt = " ".join([PROMPT] * 12)
    body = {"prompt": prompt, "n": 4, "max_tokens": 8, "temperature": 0.7, "seed": 3}
    reply = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    stats = reply["stats"]  # ferrum's own figures, one per choice
    assert [s["prompt_tokens"] for s in stats] == [reply["usage"]["prompt_tokens"]] * 4
    assert all(s["cached_tokens"] >= s["prompt_tokens"] - 1 for s in stats[1:]), stats


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_choices_come_by_index_and_equal_the_whole_ones(client, chat):
    settings = dict(model="m", n=3, temperature=0.8, seed=11, max_tokens=20)
    if chat:
        whole = [c.message.content for c in client.chat.completions.create(messages=MESSAGES, **settings).choices]
        stream = client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **settings
        )
    else:
        whole = [c.text for c in client.completions.create(prompt=PROMPT, **settings).choices]
        stream = client.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **settings
        )
    texts, finishes, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if chat else choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == whole and all(finishes)
    assert usage is not None and usage.completion_tokens >= 3  # every choice's tokens


def test_n_past_the_cap_is_a_400_naming_it(live):
    for route, body in (
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 9}),
        ("/v1/completions", {"prompt": PROMPT, "n": 9}),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}),
    ):
        response = httpx.post(live.url + route, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "n", response.text


def test_cancelling_a_stream_of_choices_cancels_them_all(live):
    body = {"messages": MESSAGES, "n": 3, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", live.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(12):
            next(lines)
        assert active(live) == 3
    deadline = time.monotonic() + 20
    while active(live) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active(live) == 0


def active(live) -> float:
    for line in httpx.get(live.url + "/metrics").text.splitlines():
        if line.startswith("ferrum_active_sequences "):
            return float(line.split()[1])
    raise AssertionError("no ferrum_active_sequences on /metrics")


# -- logprobs ---------------------------------------------------------------------------------


def test_greedy_chat_logprobs_are_the_top_ones(client):
    plain = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=24)
    reply = client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True, top_logprobs=5
    )
    choice = reply.choices[0]
    assert choice.message.content == plain.choices[0].message.content  # asking changes no token
    tokens = choice.logprobs.content
    assert len(tokens) == reply.usage.completion_tokens - (choice.finish_reason == "stop")  # no EOS entry
    for token in tokens:
        assert_consistent(token.token, token.logprob, [(t.token, t.logprob) for t in token.top_logprobs], 5)
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy: the likeliest
        assert bytes(token.bytes).decode() == token.token
    assert plain.choices[0].logprobs is None


def test_sampled_logprobs_leave_the_tokens_as_they_were(client):
    settings = dict(model="m", messages=MESSAGES, temperature=1.0, seed=5, max_tokens=24)
    plain = client.chat.completions.create(**settings)
    reply = client.chat.completions.create(**settings, logprobs=True, top_logprobs=20)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    for token in reply.choices[0].logprobs.content:
        assert_consistent(token.token, token.logprob, [(t.token, t.logprob) for t in token.top_logprobs], 20)


def test_streamed_chat_logprobs_equal_the_whole_ones(client):
    settings = dict(model="m", messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**settings).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in whole]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_and_offsets(client, stream):
    settings = dict(model="m", prompt=PROMPT, temperature=0, max_tokens=16, logprobs=3)
    if stream:
        text, tokens, logprobs, tops, offsets = "", [], [], [], []
        for chunk in client.completions.create(**settings, stream=True):
            choice = chunk.choices[0]
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                logprobs += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    else:
        choice = client.completions.create(**settings).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, logprobs, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    assert tokens and len(tokens) == len(logprobs) == len(tops) == len(offsets)
    assert "".join(tokens) == text
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for token, logprob, top in zip(tokens, logprobs, tops):
        assert_consistent(token, logprob, list(top.items()), 3)
        assert logprob == pytest.approx(max(top.values()))


def test_echo_gives_the_prompt_first(client):
    plain = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=12)
    echoed = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=12, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="m", prompt=PROMPT, temperature=0, max_tokens=12, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 2}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "echo": True}, "echo"),  # the prompt's: not computed
        ("/v1/chat/completions", {"messages": MESSAGES, "echo": True}, "echo"),
    ],
)
def test_logprobs_out_of_range_are_400s_naming_the_field(live, route, body, param):
    response = httpx.post(live.url + route, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def assert_consistent(token: str, logprob: float, top: list[tuple[str, float]], k: int) -> None:
    """A token's log-probability is one, its alternatives are `k`, sorted, and hold it where it is among them."""
    assert logprob <= 0 and math.isfinite(logprob)
    assert len(top) == k
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
    for text, value in top:
        if text == token:
            assert value == pytest.approx(logprob)
            return
    assert logprob <= values[-1] + 1e-5  # not among the k likeliest: no likelier than the last


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_logprobs_through_its_client(live, stream):
    import ollama

    client = ollama.Client(host=live.url, timeout=60)
    settings = dict(model="m", options={"temperature": 0, "num_predict": 16}, logprobs=True, top_logprobs=3)
    chat = dict(messages=MESSAGES, **settings)
    plain = client.chat(model="m", messages=MESSAGES, options=settings["options"])
    if stream:
        text, entries = "", []
        for part in client.chat(**chat, stream=True):
            text += part.message.content
            entries += part.logprobs or []
    else:
        reply = client.chat(**chat)
        text, entries = reply.message.content, list(reply.logprobs)
    assert text == plain.message.content and plain.logprobs is None
    assert entries
    for entry in entries:
        assert_consistent(entry.token, entry.logprob, [(t.token, t.logprob) for t in entry.top_logprobs], 3)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    generated = client.generate(
        model="m", prompt=PROMPT, raw=True, logprobs=True, top_logprobs=2, **{"options": settings["options"]}
    )
    assert "".join(e.token for e in generated.logprobs) == generated.response
