"""A storm against a real `ferrum serve` on stories260K: a few hundred malformed, hostile and
valid requests at once. It ends with no 5xx (nor an error inside a 200 stream), no traceback
in the server's output, the server answering as fast as before, and /metrics showing no live
sequence and no KV held by any sequence (blocks past the idle pool are the prefix cache's)."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_BODY = 256 * 1024
REQUESTS = 360
WORKERS = 16
MESSAGES = [{"role": "user", "content": "Tell me a story about Lily."}]
SHORT_ANSWER = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def ferrum_serve(stories_path, tmp_path_factory):
    """`ferrum serve` in its own process; its stderr goes to a file the test reads at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("storm") / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ferrum_mac.cli",
                "serve",
                str(stories_path),
                "--port",
                str(port),
                "--max-body",
                str(MAX_BODY),
                "--allow-origin",
                "https://app.example",
                "--verbose",
            ],
            stderr=out,
            stdout=out,
        )
    deadline = time.monotonic() + 60
    while "serving" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "serving" in log.read_text(), log.read_text()
    yield f"http://127.0.0.1:{port}", port, log, process.pid
    process.terminate()
    process.wait(timeout=30)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in samples}


# -- the requests: each returns the status it got (0: the connection closed without one) ------


def valid_chat(rng, http, url):
    body = {
        "messages": [{"role": "user", "content": rng.choice(["Lily", "Tom had a ball.", "Once upon a time"])}],
        "max_tokens": rng.randint(1, 12),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": rng.randint(0, 2**64 - 1),
        "top_p": rng.choice([0.5, 1.0]),
        "top_k": rng.choice([0, 5, 10_000]),
        "min_p": rng.choice([0, 0.1]),
        "repetition_penalty": rng.choice([1.0, 1.3]),
        "logit_bias": {"2": rng.choice([-100, 0, 100])},
        "stop": rng.choice([None, ["the"], ["\n", ".", "!", "?"]]),
    }
    return http.post(url + CHAT, json=body).status_code


def valid_stream(rng, http, url):
    body = {
        "messages": MESSAGES,
        "max_tokens": rng.randint(1, 16),
        "stream": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", url + CHAT, json=body) as r:
        text = "".join(r.iter_text())
    assert "generation_failed" not in text and "server_error" not in text, text
    return r.status_code


def valid_completion(rng, http, url):
    prompt = rng.choice(["Once upon a time", [1, 403, 407, 261], "The cat", ["Tom and"]])
    body = {"prompt": prompt, "max_tokens": rng.randint(1, 12), "temperature": 0.5, "ignore_eos": rng.random() < 0.3}
    return http.post(url + COMPLETIONS, json=body).status_code


def gets(rng, http, url):
    path = rng.choice(
        [
            "/health",
            "/metrics",
            "/v1/models",
            "/v1/models/stories260K",
            "/v1/models/x/y",
            "/v1/nothing",
            CHAT,
            "/../../etc/passwd",
            "/v1/models/%00",
        ]
    )
    return http.get(url + path).status_code


def disconnect_mid_stream(rng, http, url):
    body = {"messages": MESSAGES, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with http.stream("POST", url + CHAT, json=body) as r:
        for _ in zip(range(rng.randint(1, 5)), r.iter_lines()):
            pass
        return r.status_code


def give_up_on_a_whole_answer(rng, http, url):
    body = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
    try:
        return http.post(url + CHAT, json=body, timeout=httpx.Timeout(30, read=rng.uniform(0.05, 0.3))).status_code
    except httpx.ReadTimeout:
        return 0


MALFORMED_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'"x"',
    b"{not json",
    b'{"messages": []}',
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
    b'{"prompt": "\\udfff"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": Infinity}',
    b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}',
    b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1e30}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": NaN}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": []}',
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": false}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 1}}',
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999999999999999999999}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "hi"}], "n": 9}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 1e3}',
    b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}',
    b'{"messages": [{"role": "user", "content": {"a": 1}}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"messages": [{"role": 5, "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi", "name": {"x": [1, 2]}}]}',
    b'{"prompt": []}',
    b'{"prompt": [1, 2, 99999999]}',
    b'{"prompt": [-1]}',
    b'{"prompt": [true]}',
    b'{"prompt": ["a", "b"]}',
    b'{"prompt": ""}',
    b'{"prompt": 5}',
    b"[" * 50_000 + b"]" * 50_000,
    b'{"a":' * 5000 + b"1" + b"}" * 5000,
    b'{"prompt": "' + b"9" * 5000 + b'"}',
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b"\xff\xfe\x00garbage",
    b'{"prompt": "Once upon a time ' + b"little girl " * 3000 + b'"}',
]


def malformed(rng, http, url):
    path = rng.choice([CHAT, COMPLETIONS])
    body = rng.choice(MALFORMED_BODIES)
    return http.post(url + path, content=body, headers={"content-type": "application/json"}).status_code


def wrong_headers(rng, http, url):
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    headers = rng.choice(
        [
            {"content-type": "text/plain"},
            {"content-type": "application/x-www-form-urlencoded"},
            {},
            {"content-type": "application/json", "origin": "https://evil.example"},
            {"content-type": "application/json", "origin": "null"},
            {"content-type": "application/json", "origin": "http://localhost:3000"},
            {"content-type": "application/json", "origin": "https://app.example"},
            {"content-type": "application/json; charset=utf-8", "authorization": "bearer whatever"},
        ]
    )
    return http.post(url + CHAT, content=body, headers=headers).status_code


def preflight(rng, http, url):
    origin = rng.choice(["https://evil.example", "http://127.0.0.1:9", "https://app.example"])
    return http.options(url + CHAT, headers={"origin": origin, "access-control-request-method": "POST"}).status_code


def too_big(rng, http, url):
    size = MAX_BODY + rng.randint(1, 100_000)
    if rng.random() < 0.5:
        body = b'{"prompt": "' + b"a" * size + b'"}'
        return http.post(url + COMPLETIONS, content=body, headers={"content-type": "application/json"}).status_code

    def chunks():
        yield b'{"prompt": "'
        for _ in range(size // 16384 + 1):
            yield b"a" * 16384

    return http.post(url + COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}).status_code


MESSAGES_PATH, RESPONSES, OLLAMA_CHAT, OLLAMA_GENERATE = "/v1/messages", "/v1/responses", "/api/chat", "/api/generate"


def other_protocols(rng, http, url):
    """A valid answer, whole or streamed, on Anthropic's, the Responses or Ollama's routes; a
    stream may be left after a few lines."""
    stream = rng.random() < 0.5
    path, body = rng.choice(
        [
            (MESSAGES_PATH, {"messages": MESSAGES, "max_tokens": rng.randint(1, 12), "stream": stream}),
            (RESPONSES, {"input": "Once upon a time", "max_output_tokens": rng.randint(1, 12), "stream": stream}),
            (OLLAMA_CHAT, {"messages": MESSAGES, "stream": stream, "options": {"num_predict": rng.randint(1, 12)}}),
            (OLLAMA_GENERATE, {"prompt": "Tom and", "stream": stream, "options": {"num_predict": 8}}),
        ]
    )
    body["model"] = "stories260K"
    if not stream:
        return http.post(url + path, json=body).status_code
    with http.stream("POST", url + path, json=body) as r:
        lines = [line for _, line in zip(range(rng.choice([3, 1000])), r.iter_lines())]
    text = "\n".join(lines)
    assert "generation_failed" not in text and "server_error" not in text and "api_error" not in text, text
    return r.status_code


OTHER_MALFORMED = [
    (MESSAGES_PATH, {"messages": [], "max_tokens": 5}),
    (MESSAGES_PATH, {"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 5}),
    (MESSAGES_PATH, {"messages": MESSAGES, "max_tokens": 10**400}),
    (MESSAGES_PATH, {"messages": MESSAGES, "max_tokens": 5, "temperature": "hot"}),
    (MESSAGES_PATH, {"messages": MESSAGES, "max_tokens": 5, "tools": [{"name": "x", "input_schema": 5}]}),
    (RESPONSES, {"input": 5}),
    (RESPONSES, {"input": [{"type": "function_call_output"}]}),
    (RESPONSES, {"input": "hi", "previous_response_id": "resp_nothing"}),
    (RESPONSES, {"input": "hi", "tools": [{"type": "web_search"}]}),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
    (OLLAMA_CHAT, {"messages": "hi"}),
    (OLLAMA_CHAT, {"messages": MESSAGES, "options": {"temperature": [1]}}),
    (OLLAMA_CHAT, {"messages": MESSAGES, "format": {"type": "object", "properties": 5}}),
    (OLLAMA_GENERATE, {"prompt": 5}),
    (OLLAMA_GENERATE, {"prompt": "x", "options": {"num_predict": "many"}}),
    ("/api/show", {"model": "../../etc/passwd"}),
    ("/api/delete", {"model": "nothing-here"}),
]


def other_malformed(rng, http, url):
    path, body = rng.choice(OTHER_MALFORMED)
    return http.post(url + path, json={"model": "stories260K", **body}).status_code


PERSON = {
    "type": "object",
    "$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}},
    "properties": {"pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 2}},
    "required": ["pets"],
}


def schema_bomb(patterns: int) -> dict:
    """An `allOf` of `.*a.*`, `.*b.*`, ...: a few hundred bytes the grammar engine could spend
    seconds and hundreds of MB on (the server checks it within bounds)."""
    letters = [chr(ord("a") + i) for i in range(patterns)]
    return {
        "type": "object",
        "properties": {"s": {"allOf": [{"type": "string", "pattern": f".*{c}.*"} for c in letters]}},
    }


def grammar_heavy(rng, http, url):
    """Schemas as tools and structured output, on every protocol: `$defs` models, any object, a
    small grammar bomb; a stream may be left early."""
    schema = rng.choice([PERSON, schema_bomb(rng.randint(6, 12)), {"type": "object"}])
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    path, body = rng.choice(
        [
            (CHAT, {"messages": MESSAGES, "tools": [tool], "tool_choice": "required"}),
            (
                CHAT,
                {
                    "messages": MESSAGES,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                },
            ),
            (
                MESSAGES_PATH,
                {
                    "messages": MESSAGES,
                    "tools": [{"name": "f", "input_schema": schema}],
                    "tool_choice": {"type": "any"},
                },
            ),
            (OLLAMA_CHAT, {"messages": MESSAGES, "format": schema, "stream": False}),
            (RESPONSES, {"input": "Lily", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}),
        ]
    )
    body = {**body, "model": "stories260K", "max_tokens": rng.randint(4, 24)}
    if path == RESPONSES:
        body["max_output_tokens"] = body.pop("max_tokens")
    if path == OLLAMA_CHAT:
        body["options"] = {"num_predict": body.pop("max_tokens")}
    try:
        return http.post(url + path, json=body, timeout=httpx.Timeout(60, read=rng.choice([0.5, 60]))).status_code
    except httpx.ReadTimeout:  # a client that gave up: its check and answer must stop
        return 0


JSON_POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def raw_socket(rng, http, url, port):
    """Bytes no HTTP client would send; the answer's status, or 0 when the server just closes."""
    data = rng.choice(
        [
            b"GARBAGE\r\n\r\n",
            b"GET / HTTP/9.9\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
            JSON_POST + b"Content-Length: 999999999\r\n\r\n{",
            JSON_POST + b'Content-Length: 40\r\n\r\n{"pro',
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
            b"GET /health HTTP/1.0\r\n\r\n",
            b"GET /health HTTP/1.1\r\nHost: x\r\nConn",
        ]
    )
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        try:
            s.sendall(data)
            if rng.random() < 0.5:
                s.shutdown(socket.SHUT_WR)
            answer = s.recv(64)
        except (ConnectionResetError, BrokenPipeError, socket.timeout):
            return 0
    return int(answer.split()[1]) if answer.startswith(b"HTTP/") else 0


KINDS = [
    (valid_chat, 5),
    (valid_stream, 3),
    (valid_completion, 4),
    (gets, 3),
    (disconnect_mid_stream, 1),
    (give_up_on_a_whole_answer, 1),
    (malformed, 8),
    (wrong_headers, 3),
    (preflight, 1),
    (too_big, 1),
    (raw_socket, 2),
    (other_protocols, 4),
    (other_malformed, 4),
    (grammar_heavy, 4),
]


@pytest.mark.slow
def test_storm(ferrum_serve):
    url, port, log, pid = ferrum_serve
    with httpx.Client(timeout=60) as http:
        assert valid_chat(random.Random(0), http, url) == 200  # warm
        health_before = timed(lambda: http.get(url + "/health"))
        answer_before = timed(lambda: http.post(url + CHAT, json=SHORT_ANSWER))
    idle = metrics(url)

    def storm(seed: int, requests: int) -> tuple[list[tuple[str, int]], float]:
        rng = random.Random(seed)
        kinds = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS], k=requests)
        seeds = [rng.random() for _ in kinds]
        start = time.monotonic()
        with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=WORKERS)) as http:

            def one(job):
                kind, seed = job
                rng = random.Random(seed)
                status = kind(rng, http, url, port) if kind is raw_socket else kind(rng, http, url)
                return kind.__name__, status

            with ThreadPoolExecutor(WORKERS) as pool:
                return list(pool.map(one, zip(kinds, seeds))), time.monotonic() - start

    storm(16, REQUESTS)  # what the server keeps by design (its caches' fill, its pools) is taken first
    rss_before = rss_mb(pid)
    results, storm_s = storm(15, REQUESTS)

    server_errors = [(name, status) for name, status in results if status >= 500]
    assert not server_errors, server_errors
    assert sum(1 for _, s in results if s == 200) > REQUESTS // 4  # valid requests got answers
    assert sum(1 for _, s in results if 400 <= s < 500) > REQUESTS // 4  # hostile ones were refused
    assert storm_s < 60

    def settled(m: dict) -> bool:  # the gauges are written once per turn of the scheduler's loop
        return not (
            m["ferrum_active_sequences"]
            or m["ferrum_waiting_requests"]
            or m["ferrum_kv_tokens_in_use"]
            or m["ferrum_kv_tokens_used"]
        )

    deadline = time.monotonic() + 20
    after = metrics(url)
    while not settled(after) and time.monotonic() < deadline:
        time.sleep(0.1)
        after = metrics(url)
    assert after["ferrum_scheduler_up"] == 1
    assert after["ferrum_active_sequences"] == 0 and after["ferrum_waiting_requests"] == 0
    assert after["ferrum_kv_tokens_in_use"] == 0
    assert after["ferrum_kv_tokens_used"] == 0, after  # no cache left behind (what stays is the prefix cache's)
    errors = 'ferrum_requests_total{reason="error"}'
    assert after.get(errors, 0) == idle.get(errors, 0)  # no request failed inside the scheduler

    with httpx.Client(timeout=60) as http:
        health_after = timed(lambda: http.get(url + "/health"))
        answer_after = timed(lambda: http.post(url + CHAT, json=SHORT_ANSWER))
    assert health_after < max(0.5, 5 * health_before)
    assert answer_after < max(1.0, 5 * answer_before)
    assert "Traceback" not in log.read_text()
    rss_after = rss_mb(pid)
    print(f"server RSS {rss_before:.0f} MB before the storm, {rss_after:.0f} MB after")
    assert rss_after < 1.1 * rss_before  # nothing a storm does grows the server for good


def rss_mb(pid: int) -> float:
    """The process's resident memory (Linux's /proc), in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def timed(call) -> float:
    start = time.monotonic()
    response = call()
    assert response.status_code == 200, response.text
    return time.monotonic() - start
