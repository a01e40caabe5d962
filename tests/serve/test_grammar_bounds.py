"""Grammar bombs on a live server: a 1 KB schema that would cost the grammar engine minutes and
gigabytes (an `allOf` of `.*a.*`, `.*b.*`, ... patterns) is a 400 "too complex" within the
server's bounds on every protocol, costs nothing when sent again, stops when its client leaves,
and forty of them at once leave `/health` and a small chat answering."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serve_support import CHAT, LiveServer, chat, error_of

from ferrum_mac.grammar.guard import GuardLimits

# Small bounds keep the test cheap; a 16-pattern bomb needs about 150 MB and a second of CPU.
LIMITS = GuardLimits(cpu_s=1.0, memory_mb=64, workers=1)
PATTERNS = 16
WORKER_MARK = "The child process of `grammar.guard`"  # in a checker child's command line


def bomb(first: int = 0) -> dict:
    letters = [chr(ord("a") + (first + i) % 26) for i in range(PATTERNS)]
    return {
        "type": "object",
        "properties": {"s": {"allOf": [{"type": "string", "pattern": f".*{c}.*"} for c in letters]}},
        "required": ["s"],
    }


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.fixture(scope="module")
def bounded_server(scheduler):
    from ferrum_mac.serve.app import build_app

    live = LiveServer(build_app(scheduler, "stories260K", grammar_limits=LIMITS))
    yield live
    live.stop()


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def checkers() -> list[int]:
    """The live checker children of this process (the server runs on a thread of it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and WORKER_MARK in cmdline:
            found.append(int(entry.name))
    return found


def test_a_bomb_is_a_400_within_the_bounds_and_costs_nothing_again(bounded_server):
    error = error_of(chat(bounded_server, tools=[tool(bomb())], tool_choice="required"), 400)
    assert "too complex" in error["message"] and error["code"] == "schema_too_complex", error
    assert "64 MB of memory" in error["message"] or "1 s of CPU" in error["message"], error
    assert error["param"] == "tools[0].function.parameters"
    seconds = metric(bounded_server, "ferrum_grammar_check_seconds_total")
    cached = metric(bounded_server, 'ferrum_grammar_checks_total{outcome="cached"}')
    again = error_of(chat(bounded_server, tools=[tool(bomb())]), 400)
    assert again["message"] == error["message"]
    assert metric(bounded_server, "ferrum_grammar_check_seconds_total") == seconds  # no child ran
    assert metric(bounded_server, 'ferrum_grammar_checks_total{outcome="cached"}') == cached + 1
    assert metric(bounded_server, 'ferrum_grammar_checks_total{outcome="too_complex"}') >= 1


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/messages", {"tools": [{"name": "f", "input_schema": bomb(1)}], "max_tokens": 4}),
        ("/api/chat", {"format": bomb(2), "stream": False}),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": bomb(3)}}}),
    ],
)
def test_every_protocol_refuses_a_bomb(bounded_server, path, body):
    messages = [{"role": "user", "content": "Hi"}]
    response = httpx.post(
        bounded_server.url + path, json={"model": "stories260K", "messages": messages, **body}, timeout=60
    )
    assert response.status_code == 400 and "too complex" in response.text, response.text


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_bomb_whose_client_leaves_is_stopped(bounded_server):
    abandoned = metric(bounded_server, 'ferrum_grammar_checks_total{outcome="abandoned"}')
    before = set(checkers())  # other servers' idle checkers too
    with pytest.raises(httpx.ReadTimeout):
        chat(bounded_server, timeout=0.4, tools=[tool(bomb(4))], tool_choice="required")
    deadline = time.monotonic() + 5
    while metric(bounded_server, 'ferrum_grammar_checks_total{outcome="abandoned"}') == abandoned:
        assert time.monotonic() < deadline, "the server went on checking for a client that left"
        time.sleep(0.05)
    time.sleep(0.1)
    assert set(checkers()) <= before  # the bomb's checker (new, or one that was idle) is gone


# Sends forty bombs at once from another process (the client's threads would otherwise share
# the server's GIL) and prints their status codes.
BOMBER = """
import json, sys, httpx
from concurrent.futures import ThreadPoolExecutor
url, bodies = sys.argv[1], json.loads(sys.stdin.read())
with ThreadPoolExecutor(len(bodies)) as pool:
    codes = list(pool.map(lambda body: httpx.post(url, json=body, timeout=300).status_code, bodies))
print(json.dumps(codes))
"""


def test_forty_bombs_at_once_leave_health_and_a_small_chat_answering(bounded_server):
    # four distinct bombs ten times over: each is checked once, within its bounds
    messages = [{"role": "user", "content": "Hi"}]
    bodies = [
        {"messages": messages, "max_tokens": 4, "tools": [tool(bomb(10 + i % 4))], "tool_choice": "required"}
        for i in range(40)
    ]
    bomber = subprocess.Popen(
        [sys.executable, "-c", BOMBER, bounded_server.url + CHAT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert bomber.stdin is not None and bomber.stdout is not None
    bomber.stdin.write(json.dumps(bodies))
    bomber.stdin.close()
    time.sleep(0.5)  # the bombs are in
    rounds, slowest = 0, 0.0
    while bomber.poll() is None:
        start = time.monotonic()
        assert httpx.get(bounded_server.url + "/health", timeout=30).status_code == 200
        assert chat(bounded_server, max_tokens=2, timeout=30).status_code == 200
        slowest = max(slowest, time.monotonic() - start)
        rounds += 1
    assert json.loads(bomber.stdout.read()) == [400] * 40
    print(f"{rounds} rounds of /health and a chat while forty bombs were checked; the slowest took {slowest:.2f} s")
    assert rounds >= 3
