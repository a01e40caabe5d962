"""`response_format` on a live `ferrum serve` with a real chat model (the bundled SmolLM2 GGUF):
JSON objects and schemas on chat and completions, streaming and not, the official client's
`parse` with a pydantic model, schemas it cannot compile as 400s, and requests without a
format left exactly as they were when batched beside constrained ones."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
from pathlib import Path
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest
from serve_support import CHAT, COMPLETIONS, LiveServer, error_of, open_stories

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grammar"))
from schemas import SCHEMAS  # noqa: E402  (the grammar tests' suite of schemas)

ASK = [{"role": "user", "content": "Give me an example as JSON."}]
# Long enough for every schema of the suite with its strings bounded (`bounded`).
SUITE_MAX_TOKENS = 200
STRING_LIMIT = 48  # characters: a small model may ramble in a free string until any token limit


def bounded(schema):
    """`schema` with a `maxLength` on every free string, so an answer always finishes in time (what
    it admits is a subset of what `schema` admits: answers are validated against `schema` itself)."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v) for k, v in schema.items()}
    free = not {"maxLength", "enum", "const", "pattern", "format"} & set(schema)
    if schema.get("type") == "string" and free:
        out["maxLength"] = STRING_LIMIT
    return out


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf), max_batch=8).start()
    live = LiveServer(build_app(scheduler, "smollm2"))
    yield live
    live.stop()
    scheduler.stop()


def post(server, path: str, **body) -> httpx.Response:
    # (the suite's other worker shares the two cores: a batch of these timed out once at 120 s)
    return httpx.post(server.url + path, json=body, timeout=300)


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def content_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def streamed_content(server, **body) -> tuple[str, str]:
    """The streamed answer's text and its finish reason."""
    text, finish = [], None
    with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
    return "".join(text), finish


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    hobbies: list[Annotated[str, pydantic.StringConstraints(max_length=24)]] = pydantic.Field(max_length=3)


def test_official_client_parse_with_a_pydantic_model(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        max_tokens=SUITE_MAX_TOKENS,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


def test_json_object_streamed_parses(smollm2_server):
    text, finish = streamed_content(
        smollm2_server, messages=ASK, max_tokens=SUITE_MAX_TOKENS, seed=1, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(text), dict) and finish == "stop"


def test_completions_follow_a_schema(smollm2_server):
    schema = SCHEMAS["string_enum"]
    response = post(
        smollm2_server, COMPLETIONS, prompt="The review was", max_tokens=32, response_format=schema_format(schema)
    )
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), schema)


def test_text_format_is_free_text(smollm2_server):
    plain = content_of(post(smollm2_server, CHAT, messages=ASK, max_tokens=12, temperature=0))
    text = content_of(
        post(smollm2_server, CHAT, messages=ASK, max_tokens=12, temperature=0, response_format={"type": "text"})
    )
    assert text == plain


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(smollm2_server):
    """Greedy answers alone, then the same requests sent together with constrained ones."""
    prompts = [f"Tell me about the number {n}." for n in range(3)]

    def plain(prompt: str) -> str:
        return content_of(
            post(smollm2_server, CHAT, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
        )

    alone = [plain(p) for p in prompts]
    results: dict = {}

    def run(key, **body):
        results[key] = post(smollm2_server, CHAT, **body)

    threads = [
        threading.Thread(
            target=run,
            args=(("plain", i),),
            kwargs=dict(messages=[{"role": "user", "content": p}], max_tokens=24, temperature=0),
        )
        for i, p in enumerate(prompts)
    ] + [
        threading.Thread(
            target=run,
            args=(("json", i),),
            kwargs=dict(
                messages=ASK, max_tokens=SUITE_MAX_TOKENS, response_format=schema_format(bounded(SCHEMAS[name]))
            ),
        )
        for i, name in enumerate(["flat_required", "array_min_max", "nested_objects"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [content_of(results[("plain", i)]) for i in range(3)] == alone
    for i, name in enumerate(["flat_required", "array_min_max", "nested_objects"]):
        jsonschema.validate(json.loads(content_of(results[("json", i)])), SCHEMAS[name])


def test_unsupported_keyword_is_a_400_naming_it(smollm2_server):
    response = post(
        smollm2_server,
        CHAT,
        messages=ASK,
        max_tokens=8,
        response_format=schema_format({"type": "array", "uniqueItems": True}),
    )
    error = error_of(response, 400)
    assert "uniqueItems" in error["message"] and error["param"] == "response_format"
    assert error["code"] == "unsupported_schema"


@pytest.mark.parametrize(
    "fmt",
    [
        "json",
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": "{}"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    ],
)
def test_malformed_response_format_is_a_400(smollm2_server, fmt):
    error_of(post(smollm2_server, CHAT, messages=ASK, max_tokens=8, response_format=fmt), 400)


@pytest.mark.slow
def test_every_schema_of_the_suite_validates_at_default_sampling(smollm2_server):
    """The validity goal: each schema (twice), at the model's default sampling, parses and
    validates; the requests go together, so the server decodes them in batches."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = {
            (name, run): pool.submit(
                post,
                smollm2_server,
                CHAT,
                messages=ASK,
                max_tokens=SUITE_MAX_TOKENS,
                response_format=schema_format(bounded(schema), name),
                seed=run,  # default sampling, drawn the same way on every run of the suite
            )
            for name, schema in SCHEMAS.items()
            for run in range(2)
        }
    failures = []
    for (name, _), future in sorted(answers.items()):
        text = content_of(future.result())
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{name}: {text!r} ({str(e).splitlines()[0]})")
    assert len(SCHEMAS) >= 20 and not failures, "\n".join(failures)


def test_remote_engine_sends_the_conversations_format(smollm2_server):
    from ferrum_mac.engine import ResponseFormat, TextDelta
    from ferrum_mac.remote import RemoteEngine

    from ferrum_mac.engine import SamplingParams

    engine = RemoteEngine(smollm2_server.url)
    try:
        conv = engine.conversation(  # greedy: the free json_object answer below ends the same way every run
            max_tokens=SUITE_MAX_TOKENS,
            sampling=SamplingParams(temperature=0.0),
            response_format=ResponseFormat(bounded(SCHEMAS["flat_required"])),
        )
        text = "".join(e.text for e in conv.send("Describe a person.") if isinstance(e, TextDelta))
        jsonschema.validate(json.loads(text), SCHEMAS["flat_required"])
        conv.settings = conv.settings.replace(response_format=None)
        turn = conv.send("Now any JSON.", response_format="json")  # this answer only
        assert isinstance(json.loads("".join(e.text for e in turn if isinstance(e, TextDelta))), dict)
    finally:
        engine.close()
