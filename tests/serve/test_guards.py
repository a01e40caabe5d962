"""Who may call a live server on stories260K: web pages from other origins and, on a
loopback server, requests naming another host are refused (403) while loopback pages get
CORS answers; connections whose headers stall are closed and the connection count is capped,
while others are still served (`ferrum_mac/serve/guards.py`, `listener.py`)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serve_support import CHAT, MESSAGES, LiveServer, error_of

from ferrum_mac.serve.app import build_app


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


def test_a_loopback_page_may_preflight_a_delete(origin_server):
    preflight = httpx.options(
        origin_server.url + "/api/delete",
        headers={"origin": "http://localhost:5173", "access-control-request-method": "DELETE"},
    )
    assert preflight.status_code == 204 and "DELETE" in preflight.headers["access-control-allow-methods"]


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
    start = time.monotonic()
    stalled = [stalled_connection(strict_server.port) for _ in range(5)]
    try:
        assert httpx.get(strict_server.url + "/health", timeout=60).status_code == 200
        assert all(closed_by_server(s, within=60) for s in stalled)  # 60 s: a hang, not a slow machine
        assert time.monotonic() - start > 0.5  # not at once: the 1 s timer runs from each connection
        assert httpx.get(strict_server.url + "/health", timeout=60).status_code == 200
    finally:
        for s in stalled:
            s.close()


def test_a_header_trickled_a_byte_at_a_time_is_still_cut_off(strict_server):
    header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100  # 14 s at 10 bytes a second
    sent = 0
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=5) as s:
        try:
            for byte in header:
                s.sendall(bytes([byte]))
                sent += 1
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert sent < len(header)  # cut off on the way, though every byte came on time


@pytest.fixture(scope="module")
def limited_server(scheduler):
    """At most 8 connections, and a minute for headers: only the limit closes one sooner."""
    live = LiveServer(build_app(scheduler, "stories260K"), header_timeout=60.0, max_connections=8)
    yield live
    live.stop()


def test_connections_past_the_limit_are_closed_at_once(limited_server):
    stalled = [stalled_connection(limited_server.port) for _ in range(8)]
    extra = [socket.create_connection(("127.0.0.1", limited_server.port), timeout=5) for _ in range(4)]
    try:
        assert all(closed_by_server(s, within=30) for s in extra)  # long before the header timeout
    finally:
        for s in stalled + extra:
            s.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the server notices the closed ones
        if httpx.get(limited_server.url + "/health", timeout=5).status_code == 200:
            break
        time.sleep(0.1)
    assert httpx.get(limited_server.url + "/health", timeout=5).status_code == 200
