"""What a hostile or careless client sends never stops a live server on stories260K: bad
seeds, NaN, lone surrogates, deep JSON and big bodies are 4xx with the usual error body; a
failure inside the scheduler fails only the requests it touched; a dead loop says so;
cross-site pages and slow clients are refused; `ferrum serve` fails in one line."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from serve_support import API_KEY, LiveServer, open_stories

from ferrum_mac.engine import SamplingParams
from ferrum_mac.engine.sampling import SamplingError
from ferrum_mac.serve import Scheduler
from ferrum_mac.serve.app import build_app

MESSAGES = [{"role": "user", "content": "Tell me a story about Lily."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def post_raw(server, path: str, raw: bytes, **headers) -> httpx.Response:
    """A body sent as given (httpx's json= cannot send NaN or lone surrogates)."""
    return httpx.post(
        server.url + path, content=raw, headers={"content-type": "application/json", **headers}, timeout=60
    )


def chat(server, timeout: float = 60, **fields) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(server.url + CHAT, json=body, timeout=timeout)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in samples}


# -- 1. seeds, and a scheduler loop that never dies -------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7"])
def test_a_seed_outside_0_to_2_64_is_a_400_and_the_server_keeps_serving(server, seed):
    error = error_of(chat(server, seed=seed), 400)
    assert error["param"] == "seed"
    assert chat(server, seed=2**64 - 1, temperature=1.0).status_code == 200


@pytest.mark.parametrize(
    "bad",
    [
        dict(seed=-1),
        dict(seed=2**64),
        dict(seed=1.5),
        dict(temperature=math.nan),
        dict(top_p=math.nan),
        dict(repetition_penalty=math.inf),
        dict(presence_penalty=-math.inf),
        dict(frequency_penalty=math.nan),
        dict(min_p=math.nan),
        dict(logit_bias={3: math.nan}),
        dict(logit_bias={-1: 1.0}),
        dict(top_k=2.5),
    ],
)
def test_sampling_params_refuse_bad_seeds_and_non_finite_numbers(bad):
    with pytest.raises(SamplingError):
        SamplingParams(**bad)


@pytest.mark.parametrize(
    "flag, value", [("--seed", "-1"), ("--seed", str(2**64)), ("--temperature", "nan"), ("--repeat-penalty", "inf")]
)
def test_ferrum_run_refuses_bad_sampling_values_in_one_line(stories_path, flag, value):
    result = subprocess.run(
        [sys.executable, "-m", "ferrum_mac.cli", "run", str(stories_path), flag, value, "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("ferrum: ") and result.stderr.count("\n") == 1, result.stderr


@pytest.fixture(scope="module")
def own_server(stories_path):
    """A scheduler and server of their own, for tests that break the model's methods (the
    session's scheduler must not keep a cache a broken release left behind)."""
    scheduler = Scheduler(open_stories(stories_path)).start()
    live = LiveServer(build_app(scheduler, "stories260K"))
    yield scheduler, live
    live.stop()
    scheduler.stop()


def breaks_once(real, message: str):
    calls = []

    def method(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(message)
        return real(*args, **kwargs)

    return method


def test_a_sampler_that_raises_fails_only_its_request(own_server, monkeypatch):
    scheduler, server = own_server
    monkeypatch.setattr(scheduler.model, "sampler", breaks_once(scheduler.model.sampler, "sampler creation broke"))
    error = error_of(chat(server, timeout=30), 500)
    assert error["code"] == "generation_failed" and "sampler creation broke" in error["message"]
    assert chat(server, timeout=30).json()["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("method", ["unified_forward", "release"])
def test_a_forward_or_a_release_that_raises_fails_its_step_and_the_loop_goes_on(own_server, monkeypatch, method):
    scheduler, server = own_server
    monkeypatch.setattr(scheduler.model, method, breaks_once(getattr(scheduler.model, method), f"{method} broke"))
    first = chat(server, timeout=30)
    if method == "unified_forward":
        assert "unified_forward broke" in error_of(first, 500)["message"]
    else:
        assert first.status_code == 200  # the answer was whole; only freeing its cache failed
    assert chat(server, timeout=30).json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 10
    while metrics(server)["ferrum_active_sequences"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metrics(server)["ferrum_active_sequences"] == 0 and metrics(server)["ferrum_scheduler_up"] == 1


class Fatal(BaseException):
    """Escapes every `except Exception`: the loop's last guard must catch it."""


def test_a_dead_loop_answers_503_on_health_and_requests_and_says_so_in_metrics(stories_path):
    scheduler = Scheduler(open_stories(stories_path)).start()
    live = LiveServer(build_app(scheduler, "stories260K"))
    try:
        assert chat(live).status_code == 200 and metrics(live)["ferrum_scheduler_up"] == 1
        take_new = scheduler._take_new

        def explode_while_generating(block):
            if scheduler._running:
                raise Fatal("the loop broke")
            return take_new(block)

        scheduler._take_new = explode_while_generating
        answer = chat(live, timeout=30, max_tokens=100_000, ignore_eos=True)
        assert "the loop broke" in error_of(answer, 500)["message"]  # failed, not left hanging
        deadline = time.monotonic() + 10
        while scheduler.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and "the loop broke" in health.json()["error"]
        assert metrics(live)["ferrum_scheduler_up"] == 0
        error = error_of(chat(live, timeout=10), 503)
        assert "restart" in error["message"]
    finally:
        live.stop()
        scheduler.stop()


# -- 2. client errors are 400s, not 500s --------------------------------------------------------


@pytest.mark.parametrize(
    "path, raw",
    [
        (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi", "name": "\\ud83d"}]}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}'),
        (COMPLETIONS, b'{"prompt": "Once \\udc00 upon"}'),
        (COMPLETIONS, b'{"prompt": ["\\ud800"]}'),
    ],
)
def test_lone_surrogates_are_a_400(server, path, raw):
    assert error_of(post_raw(server, path, raw), 400)["code"] == "invalid_text"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"add_generation_prompt": False},
        {"messages": []},
        {"tools": "x"},
        {"bos_token": "<evil>"},
        {"raise_exception": 1},
        "enable_thinking",
        [1, 2],
    ],
)
def test_chat_template_kwargs_that_collide_or_are_not_an_object_are_a_400(server, kwargs):
    assert error_of(chat(server, chat_template_kwargs=kwargs), 400)["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(
    "bias, code",
    [
        ({"999999": 5}, "invalid_value"),
        ({"512": 1}, "invalid_value"),
        ({"abc": 1}, "invalid_type"),
        ({"-3": 1}, "invalid_type"),
        ({"5": 101}, "invalid_value"),
        ({"5": "x"}, "invalid_type"),
        ({"5": None}, "invalid_type"),
    ],
)
def test_logit_bias_outside_the_vocabulary_or_range_is_a_400(server, bias, code):
    error = error_of(chat(server, logit_bias=bias), 400)
    assert error["param"] == "logit_bias" and error["code"] == code


def nested(depth: int):
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_deeply_nested_json_is_a_400(server):
    deep_kwargs = {"messages": MESSAGES, "chat_template_kwargs": {"a": nested(40)}}
    for raw in (
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({"messages": nested(40)}).encode(),
        json.dumps(deep_kwargs).encode(),
    ):
        assert error_of(post_raw(server, CHAT, raw), 400)["code"] == "invalid_json"
    assert chat(server).status_code == 200


# -- 3. every number finite and in range --------------------------------------------------------


@pytest.mark.parametrize(
    "field, literal",
    [
        ("temperature", "NaN"),
        ("repetition_penalty", "Infinity"),
        ("presence_penalty", "-Infinity"),
        ("frequency_penalty", "NaN"),
        ("top_p", "NaN"),
        ("min_p", "NaN"),
        ("temperature", "1e400"),
        ("logit_bias", '{"5": NaN}'),
        ("max_tokens", "1e400"),
    ],
)
def test_nan_and_infinity_are_a_400(server, field, literal):
    raw = f'{{"messages": {json.dumps(MESSAGES)}, "max_tokens": 4, "{field}": {literal}}}'.encode()
    assert error_of(post_raw(server, CHAT, raw), 400)["code"] == "invalid_json"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_completion_tokens": -4}, "max_completion_tokens"),
        ({"n": 2.0}, "n"),
        ({"n": "1"}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": "yes"}}, "include_usage"),
        ({"stop": ["x" * 1001]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_numbers_out_of_range_or_of_the_wrong_type_are_a_400(server, fields, param):
    assert error_of(chat(server, **fields), 400)["param"] == param


# -- 4. big bodies --------------------------------------------------------------------------


def raw_exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send `data` on a fresh connection and read what comes back until the server closes
    or `timeout` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        received = b""
        try:
            while b"\r\n\r\n" not in received or not received.endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                received += chunk
        except socket.timeout:
            pass
        return received


def test_a_body_declared_over_the_limit_is_a_413_before_it_is_sent(server):
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {20 * 1024 * 1024}\r\n\r\n"
    ).encode()
    start = time.monotonic()
    answer = raw_exchange(server.port, head + b'{"messages": ', timeout=10)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer and time.monotonic() - start < 5


def test_a_chunked_body_over_the_limit_is_a_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5 * 16):  # 5 MiB
            yield b"a" * 65536

    response = httpx.post(
        server.url + COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}, timeout=60
    )
    assert error_of(response, 413)["code"] == "request_too_large"


def test_health_answers_while_a_long_prompt_is_tokenized(small_server, monkeypatch):
    from ferrum_mac.serve import app

    monkeypatch.setattr(app, "CHARS_PER_TOKEN_CHECKED", 10**9)  # tokenize all of it, not just its head
    prompt = "Once upon a time there was a little girl named Lily. " * 50_000  # 2.7 MB, under the limit
    answers = {}

    def big():
        answers["big"] = httpx.post(small_server.url + COMPLETIONS, json={"prompt": prompt}, timeout=120)

    thread = threading.Thread(target=big)
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        start = time.monotonic()
        assert httpx.get(small_server.url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.02)
    thread.join()
    assert error_of(answers["big"], 400)["code"] == "context_length_exceeded"
    assert answers["big"].elapsed.total_seconds() > 1.0 and slowest < 0.5


def test_a_prompt_far_past_the_context_is_refused_without_tokenizing_all_of_it(small_server):
    start = time.monotonic()
    prompt = "Once upon a time there was a little girl named Lily. " * 70_000
    response = httpx.post(small_server.url + COMPLETIONS, json={"prompt": prompt}, timeout=120)
    assert error_of(response, 400)["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 2.0


# -- 5. cross-site requests ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def origin_server(scheduler):
    live = LiveServer(build_app(scheduler, "stories260K", allow_origins=("https://app.example",)))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def loopback_server(scheduler):
    live = LiveServer(build_app(scheduler, "stories260K", allow_origins=("https://app.example",), loopback_only=True))
    yield live
    live.stop()


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "192.168.1.20:80"])
def test_a_loopback_server_refuses_other_hosts_names_dns_rebinding(loopback_server, host):
    for response in (
        httpx.get(loopback_server.url + "/v1/models", headers={"host": host}),
        httpx.post(loopback_server.url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}, headers={"host": host}),
    ):
        assert error_of(response, 403)["code"] == "host_not_allowed"


@pytest.mark.parametrize(
    "host", ["localhost", "127.0.0.1:1234", "127.0.0.2", "[::1]:8000", "app.localhost", "app.example"]
)
def test_a_loopback_server_answers_loopback_names_and_allowed_origins_hosts(loopback_server, host):
    assert httpx.get(loopback_server.url + "/v1/models", headers={"host": host}).status_code == 200


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_json_endpoints_require_a_json_content_type(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    response = httpx.post(server.url + CHAT, content=body, headers=headers)
    assert error_of(response, 415)["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "origin", ["http://evil.example", "https://localhost.evil.example", "null", "http://127.0.0.1.evil.example:8000"]
)
def test_a_web_page_from_another_origin_is_refused(origin_server, origin):
    body = {"messages": MESSAGES, "max_tokens": 2}
    response = httpx.post(origin_server.url + CHAT, json=body, headers={"origin": origin})
    assert error_of(response, 403)["code"] == "origin_not_allowed"
    preflight = httpx.options(
        origin_server.url + CHAT, headers={"origin": origin, "access-control-request-method": "POST"}
    )
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize(
    "origin", ["http://localhost:5173", "http://127.0.0.1:8080", "http://[::1]:3000", "https://app.example"]
)
def test_loopback_and_allowed_origins_get_cors_answers(origin_server, origin):
    preflight = httpx.options(
        origin_server.url + CHAT,
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "content-type" in preflight.headers["access-control-allow-headers"].lower()
    response = httpx.post(
        origin_server.url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}, headers={"origin": origin}, timeout=30
    )
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == origin


def test_clients_without_an_origin_are_served(origin_server):
    response = httpx.post(origin_server.url + CHAT, json={"messages": MESSAGES, "max_tokens": 2}, timeout=30)
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


# -- 6. slow clients ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def strict_server(scheduler):
    """Headers must arrive within 1 s; at most 8 connections."""
    live = LiveServer(build_app(scheduler, "stories260K"), header_timeout=1.0, max_connections=8)
    yield live
    live.stop()


def stalled_connection(port: int) -> socket.socket:
    """A connection that sends half a header line, then nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
    return s


def closed_by_server(s: socket.socket, within: float) -> bool:
    s.settimeout(within)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_stalled_headers_are_closed_after_the_timeout_and_others_are_served(strict_server):
    stalled = [stalled_connection(strict_server.port) for _ in range(5)]
    try:
        assert httpx.get(strict_server.url + "/health", timeout=5).status_code == 200
        start = time.monotonic()
        assert all(closed_by_server(s, within=5) for s in stalled)
        assert 0.5 < time.monotonic() - start < 4
        assert httpx.get(strict_server.url + "/health", timeout=5).status_code == 200
    finally:
        for s in stalled:
            s.close()


def test_a_header_trickled_a_byte_at_a_time_is_still_cut_off(strict_server):
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=5) as s:
        start = time.monotonic()
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                s.sendall(bytes([byte]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert time.monotonic() - start < 4


def test_connections_past_the_limit_are_closed_at_once(strict_server):
    stalled = [stalled_connection(strict_server.port) for _ in range(8)]
    extra = [socket.create_connection(("127.0.0.1", strict_server.port), timeout=5) for _ in range(4)]
    try:
        assert all(closed_by_server(s, within=0.5) for s in extra)
    finally:
        for s in stalled + extra:
            s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the server notices the closed ones
        if httpx.get(strict_server.url + "/health", timeout=5).status_code == 200:
            break
        time.sleep(0.1)
    assert httpx.get(strict_server.url + "/health", timeout=5).status_code == 200


# -- 7. smaller points --------------------------------------------------------------------------


def test_models_retrieve(client):
    assert client.models.retrieve("stories260K").id == "stories260K"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(keyed_server, scheme):
    response = httpx.get(keyed_server.url + "/v1/models", headers={"authorization": f"{scheme} {API_KEY}"})
    assert response.status_code == 200


@pytest.mark.parametrize("value", [f"Basic {API_KEY}", API_KEY, f"Bearer {API_KEY}x", "Bearer"])
def test_other_schemes_and_keys_are_refused(keyed_server, value):
    assert error_of(httpx.get(keyed_server.url + "/v1/models", headers={"authorization": value}), 401)


def ferrum_serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferrum_mac.cli", "serve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_a_taken_port_is_one_line(stories_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = ferrum_serve(str(stories_path), "--port", str(port))
    assert result.returncode != 0
    assert result.stderr == f"ferrum: port {port} is in use; stop what is using it or pass another --port\n"


@pytest.mark.parametrize("port", ["99999", "0", "-5"])
def test_a_port_out_of_range_is_one_line(stories_path, port):
    result = ferrum_serve(str(stories_path), "--port", port)
    assert result.returncode != 0
    assert result.stderr.startswith("ferrum: ") and result.stderr.count("\n") == 1 and "--port" in result.stderr


def test_serving_is_printed_once_the_port_answers(stories_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ferrum_mac.cli", "serve", str(stories_path), "--port", str(port)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        assert line.startswith("ferrum: serving ") and f":{port}/v1" in line, line
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # at once: no retry, no wait
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "ok"
    finally:
        process.terminate()
        process.wait(timeout=30)
