"""One conversation through OpenAI's, Anthropic's and Ollama's APIs, each with its official client,
at temperature 0: the three protocols map into one request, so the answer is the same text,
streamed or whole."""

from __future__ import annotations

import pytest

MODEL = "stories260K"
SYSTEM = "You tell short stories."
TURNS = [
    {"role": "user", "content": "Tell me a story about Lily."},
    {"role": "assistant", "content": "Lily went to the park with her dog."},
    {"role": "user", "content": "What happened next?"},
]
MAX_TOKENS = 16


def openai_answers(url: str) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *TURNS],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True)
    return [whole, "".join(c.choices[0].delta.content or "" for c in stream if c.choices)]


def anthropic_answers(url: str) -> list[str]:
    anthropic = pytest.importorskip("anthropic")
    pytest.importorskip("ferrum_mac.serve.protocols.anthropic", reason="the Anthropic API is not built yet")
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    # the current SDK has no temperature argument: it goes through extra_body
    kwargs = dict(model=MODEL, system=SYSTEM, messages=TURNS, max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    whole = "".join(b.text for b in client.messages.create(**kwargs).content if b.type == "text")
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
    return [whole, streamed]


def ollama_answers(url: str) -> list[str]:
    import ollama

    client = ollama.Client(host=url, timeout=60)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *TURNS],
        options={"temperature": 0, "num_predict": MAX_TOKENS},
    )
    whole = client.chat(**kwargs).message.content
    return [whole, "".join(part.message.content for part in client.chat(**kwargs, stream=True))]


def test_the_same_answer_through_every_protocol(server):
    answers = {
        "openai": openai_answers(server.url),
        "ollama": ollama_answers(server.url),
        "anthropic": anthropic_answers(server.url),
    }
    reference = answers["openai"][0]
    assert reference.strip()
    assert answers == {name: [reference, reference] for name in answers}


LOOPING = [{"role": "user", "content": "The cat sat on the mat. The cat"}]  # stories260K repeats one sentence


def test_a_looping_answer_stops_on_every_protocol_as_an_ended_one(server):
    """stories260K's greedy answer here repeats "It is a small, red cat." until the limit: each
    protocol ends it early, as an answer that ended ("stop", "end_turn"; never "length", which
    asks a client to continue it), and ferrum's stats and the remote client say it looped."""
    import httpx

    from ferrum_mac.engine import LOOP, Done
    from ferrum_mac.remote import RemoteEngine

    limit = 480
    openai = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": LOOPING, "temperature": 0, "max_tokens": limit},
        timeout=120,
    ).json()
    assert (openai["choices"][0]["finish_reason"], openai["stats"]["stop_reason"]) == ("stop", LOOP)
    looped = openai["usage"]["completion_tokens"]
    assert looped < 350
    anthropic = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL, "messages": LOOPING, "temperature": 0, "max_tokens": limit},
        timeout=120,
    ).json()
    assert (anthropic["stop_reason"], anthropic["usage"]["output_tokens"]) == ("end_turn", looped)
    ollama = httpx.post(
        server.url + "/api/chat",
        json={
            "model": MODEL,
            "messages": LOOPING,
            "options": {"temperature": 0, "num_predict": limit},
            "stream": False,
        },
        timeout=120,
    ).json()
    assert (ollama["done_reason"], ollama["eval_count"]) == ("stop", looped)
    remote = RemoteEngine(server.url, model=MODEL)
    conv = remote.conversation(max_tokens=limit, sampling=remote.default_sampling.replace(temperature=0.0))
    done = [e for e in conv.send(LOOPING[0]["content"]) if isinstance(e, Done)][0]
    assert (done.stop_reason, done.generated_tokens) == (LOOP, looped)
    remote.close()
