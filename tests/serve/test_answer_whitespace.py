"""Whitespace the model writes reaches the client: a completion returns its text exactly as
generated (the space a sentencepiece word starts with, newlines), and a chat answer that is
only whitespace is not turned into nothing. Tokens are forced with a logit bias so the test
does not depend on what stories260K would choose."""

from __future__ import annotations

import pytest

from ferrum_mac.engine import Done, SamplingParams, TextDelta
from ferrum_mac.serve import EventQueue, GenerationRequest

FORCE = 100.0
TIMEOUT = 60


def forced_token(scheduler, text: str) -> int:
    """The id of the one piece `text` encodes to after sentencepiece's leading `▁`."""
    return scheduler.engine.tokenizer.encode(text, add_special_tokens=False)[-1]


def generate(scheduler, token: int, raw: bool) -> str:
    queue = EventQueue()
    ids = scheduler.engine.tokenizer.encode("Once upon a time")
    sampling = SamplingParams(temperature=0.0, logit_bias={token: FORCE})
    scheduler.submit(GenerationRequest(ids, sampling=sampling, max_tokens=3, raw=raw, emit=queue.put))
    events = list(queue.events(timeout=TIMEOUT))
    assert isinstance(events[-1], Done), events[-1]
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_scheduler_raw_text_keeps_the_first_space_and_newlines(scheduler):
    the, newline = forced_token(scheduler, " the"), forced_token(scheduler, "\n")
    assert generate(scheduler, the, raw=True) == " the the the"
    assert generate(scheduler, newline, raw=True) == "\n\n\n"
    assert generate(scheduler, the, raw=False) == "the the the"  # chat: trimmed for display
    assert generate(scheduler, newline, raw=False) == "\n\n\n"  # ...but never to nothing


@pytest.mark.parametrize("stream", [False, True])
def test_completions_return_the_text_as_generated(client, scheduler, stream):
    the = forced_token(scheduler, " the")
    answer = client.completions.create(
        model="m",
        prompt="Once upon a time",
        max_tokens=3,
        temperature=0,
        logit_bias={str(the): FORCE},
        stream=stream,
    )
    text = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
    assert text == " the the the"


def test_a_chat_reply_of_only_a_newline_is_not_empty(client, scheduler):
    newline = forced_token(scheduler, "\n")
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        logit_bias={str(newline): FORCE},
    )
    assert reply.choices[0].message.content == "\n\n"
