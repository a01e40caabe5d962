"""What a hostile or careless client sends never stops a live server on stories260K: bad
seeds, NaN, lone surrogates, deep JSON and big bodies are 4xx with the usual error body; a
failure inside the scheduler fails only the requests it touched; a dead loop says so;
`ferrum serve` fails in one line. (Cross-site pages and slow clients: test_guards.py.)"""

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
from serve_support import API_KEY, CHAT, COMPLETIONS, MESSAGES, LiveServer, chat, error_of, open_stories, post_raw

from ferrum_mac.engine import SamplingParams
from ferrum_mac.engine.sampling import SamplingError
from ferrum_mac.serve import Scheduler
from ferrum_mac.serve.app import build_app


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
            if scheduler.batch.running:
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


HUGE = "1" * 400  # an integer no float holds: float() of it raises OverflowError
ASK = [{"role": "user", "content": "Hi"}]
HUGE_NUMBERS = [
    (CHAT, {"messages": MESSAGES, "temperature": HUGE}, "temperature"),
    (CHAT, {"messages": MESSAGES, "top_p": HUGE}, "top_p"),
    (CHAT, {"messages": MESSAGES, "presence_penalty": f"-{HUGE}"}, "presence_penalty"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"5": HUGE}}, "logit_bias.5"),
    (CHAT, {"messages": MESSAGES, "max_tokens": HUGE}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "seed": HUGE}, "seed"),
    (COMPLETIONS, {"prompt": [1, 2, HUGE]}, "prompt[2]"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 4, "temperature": HUGE}, "temperature"),
    ("/v1/messages", {"messages": ASK, "max_tokens": HUGE}, "max_tokens"),
    ("/v1/messages", {"messages": ASK, "max_tokens": 4, "top_k": HUGE}, "top_k"),
    ("/api/chat", {"messages": ASK, "options": {"temperature": HUGE}}, "options.temperature"),
    ("/api/chat", {"messages": ASK, "options": {"top_p": HUGE}}, "options.top_p"),
    ("/api/chat", {"messages": ASK, "options": {"num_ctx": HUGE}}, "options.num_ctx"),
    ("/api/chat", {"messages": ASK, "keep_alive": HUGE}, "keep_alive"),
    ("/api/generate", {"prompt": "Hi", "options": {"num_predict": HUGE}}, "options.num_predict"),
    ("/api/generate", {"prompt": "Hi", "options": {"repeat_penalty": "1e400"}}, "options.repeat_penalty"),
]


@pytest.mark.parametrize("path, fields, param", HUGE_NUMBERS, ids=[f"{p}-{f}" for p, _, f in HUGE_NUMBERS])
def test_a_number_past_a_floats_range_is_a_400_naming_its_field(server, path, fields, param):
    """Anywhere a client sends a number, 400 digits (or 1e400) is a 400 naming the field, never a
    500 from a check that converts it (OverflowError)."""
    raw = json.dumps({"model": "stories260K", **fields}).replace(f'"{HUGE}"', HUGE).replace('"1e400"', "1e400")
    response = post_raw(server, path, raw.encode())
    assert response.status_code == 400, response.text
    body = response.json()
    message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    assert f"'{param}'" in message, message
    if path.startswith("/v1/chat") or path == COMPLETIONS:
        assert body["error"]["param"] == param
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_keep_alive_past_a_century_is_forever():
    """Longer would put the expiry past what a date holds (/api/ps answered 500)."""
    from ferrum_mac.serve.batching.models import FOREVER, keep_alive_seconds

    assert keep_alive_seconds(1e300) == FOREVER and keep_alive_seconds("1e12") == FOREVER
    assert keep_alive_seconds(86400 * 365) == 86400 * 365


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
        ({"n": 9.0}, "n"),
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
    answer = raw_exchange(server.port, head + b'{"messages": ', timeout=10)  # the body is never sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer


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
    from ferrum_mac.serve import prompting

    monkeypatch.setattr(prompting, "CHARS_PER_TOKEN_CHECKED", 10**9)  # tokenize all of it, not just its head
    prompt = "Once upon a time there was a little girl named Lily. " * 50_000  # 2.7 MB, under the limit
    answers = {}

    def big():
        answers["big"] = httpx.post(small_server.url + COMPLETIONS, json={"prompt": prompt}, timeout=120)

    thread = threading.Thread(target=big)
    thread.start()
    healthy = 0
    while thread.is_alive():
        assert httpx.get(small_server.url + "/health", timeout=60).status_code == 200
        healthy += 1
        time.sleep(0.02)
    thread.join()
    assert error_of(answers["big"], 400)["code"] == "context_length_exceeded"
    # Health answered all along, not once or twice around a tokenizing that held the event loop.
    assert healthy >= 10, healthy


def test_a_prompt_far_past_the_context_is_refused_without_tokenizing_all_of_it(small_server, monkeypatch):
    from ferrum_mac.text.hf_tokenizer import HfTokenizer

    encode, encoded = HfTokenizer.encode, []

    def measured_encode(self, text, *args, **kwargs):
        encoded.append(len(text))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(HfTokenizer, "encode", measured_encode)  # stories260K's tokenizer
    prompt = "Once upon a time there was a little girl named Lily. " * 70_000
    response = httpx.post(small_server.url + COMPLETIONS, json={"prompt": prompt}, timeout=120)
    assert error_of(response, 400)["code"] == "context_length_exceeded"
    assert encoded and max(encoded) < len(prompt) // 100, encoded  # its head only


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
