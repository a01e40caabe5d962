"""The remote client: `ferrum run --remote` and RemoteEngine against a live `ferrum serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from serve_support import API_KEY

from ferrum_mac.engine import CANCELLED, MAX_TOKENS, Done, ReasoningDelta, TextDelta
from ferrum_mac.errors import FerrumError
from ferrum_mac.remote import RemoteEngine, RemoteTurn, base_url

FERRUM = [sys.executable, "-c", "from ferrum_mac.cli import main; main()"]
ROOT = Path(__file__).resolve().parents[2]


def ferrum(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*FERRUM, *args], input=stdin, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def test_ferrum_run_remote_one_shot_and_json(server, client):
    expected = (
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Tell me about Lily"}], max_tokens=12, temperature=0
        )
        .choices[0]
        .message.content
    )
    shot = ferrum("run", "--remote", server.url, "--temperature", "0", "--max-tokens", "12", "Tell me about Lily")
    assert shot.returncode == 0, shot.stderr
    assert shot.stdout.strip() == expected.strip()
    out = ferrum(
        "run",
        "--remote",
        server.url + "/v1",
        "--json",
        "--temperature",
        "0",
        "--max-tokens",
        "12",
        "Tell me about Lily",
    )
    data = json.loads(out.stdout)
    assert data["text"] == expected and data["model"] == "stories260K"
    assert data["stats"]["generated_tokens"] == 12 and data["stats"]["stop_reason"] == MAX_TOKENS


def test_ferrum_run_remote_repl_and_a_bad_key(server, keyed_server):
    repl = ferrum("run", "--remote", server.url, "-i", "--max-tokens", "6", stdin="Hello\n/show info\n/bye\n")
    assert repl.returncode == 0, repl.stderr
    assert "stories260K" in repl.stdout and server.url in repl.stdout
    refused = ferrum("run", "--remote", keyed_server.url, "--api-key", "wrong", "Hi")
    assert refused.returncode == 1 and "401" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_remote_conversation_keeps_its_turns_and_cancels(server):
    engine = RemoteEngine(server.url)
    conv = engine.conversation(max_tokens=8, sampling=engine.default_sampling.replace(temperature=0))
    events = list(conv.send("Tell me about Tom"))
    assert isinstance(events[-1], Done) and events[-1].generated_tokens == 8 and events[-1].decode_tps > 0
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[1]["content"] == "".join(e.text for e in events if isinstance(e, TextDelta))
    assert engine.kv_capacity() == server_capacity(server)
    cancel = threading.Event()
    conv.settings = conv.settings.replace(max_tokens=2000)
    stream = conv.send("And then?", cancel)
    next(e for e in stream if isinstance(e, TextDelta))
    cancel.set()
    assert [e for e in stream][-1].stop_reason == CANCELLED
    assert conv.messages[-1]["role"] == "assistant"
    engine.close()


def server_capacity(server) -> int:
    import httpx

    return httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]


def test_remote_key_and_unreachable_server(keyed_server):
    engine = RemoteEngine(keyed_server.url, api_key=API_KEY)
    assert engine.name == "stories260K"
    with pytest.raises(FerrumError, match="401"):
        RemoteEngine(keyed_server.url, api_key="wrong").name
    with pytest.raises(FerrumError, match="cannot reach"):
        RemoteEngine("http://127.0.0.1:9").name


def test_reasoning_fields_of_other_servers_become_reasoning_events():
    chunks = iter(
        [
            {"choices": [{"delta": {"reasoning_content": "think "}}]},
            {"choices": [{"delta": {"reasoning": "more"}}]},
            {"choices": [{"delta": {"content": "Answer"}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
        ]
    )
    turn = RemoteTurn()
    events = list(turn.read(chunks, threading.Event()))
    assert events == [ReasoningDelta("think "), ReasoningDelta("more"), TextDelta("Answer")]
    assert turn.message() == {"role": "assistant", "content": "Answer", "reasoning_content": "think more"}
    done = turn.done()
    assert (done.stop_reason, done.prompt_tokens, done.generated_tokens) == (MAX_TOKENS, 3, 3)
    assert base_url("localhost:8000/") == "http://localhost:8000/v1"


def test_sampling_the_user_left_alone_is_the_servers_to_choose():
    """Left out of the request, the server samples with the model's own defaults, as a local
    run of the model does; what the user set is sent."""
    engine = RemoteEngine("http://127.0.0.1:9", model="m")
    plain = engine._request_body(engine.conversation(prepare=False), "hi")
    assert not {"temperature", "top_p", "top_k", "repetition_penalty"} & set(plain)
    cold = engine.conversation(prepare=False, sampling=engine.default_sampling.replace(temperature=0, top_k=5))
    body = engine._request_body(cold, "hi")
    assert (body["temperature"], body["top_k"]) == (0, 5) and "top_p" not in body
    from ferrum_mac.tui.chat.turn_settings import defaults_in_force

    assert defaults_in_force(engine) == {}  # the chat app says "model default", not our figures
