"""oterm, the Textual Ollama client, against a real `ferrum serve` on the bundled model, driven in
tmux: it lists the model (/api/tags), reads its parameters (/api/show), and streams an answer
whose text appears on screen. oterm lives in a venv of its own (scripts/oterm-env)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from test_real_model import wait_for_screen

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What is the capital of France?"
MAX_TOKENS = 16
pytestmark = pytest.mark.slow


def oterm_command() -> str:
    """scripts/oterm-env's oterm (installed on first use), or a skip saying why not."""
    try:
        done = subprocess.run([str(ROOT / "scripts" / "oterm-env")], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("installing oterm took over 10 minutes")
    if done.returncode != 0:
        pytest.skip(f"oterm could not be installed: {done.stderr.strip()[-300:]}")
    return done.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def home(tmp_path, smollm2_gguf) -> dict:
    """A home folder of the test's own, whose ferrum data folder holds the bundled model (so
    `ferrum serve smollm2:135m` runs it without fetching) and whose Hugging Face cache is empty."""
    env = {**os.environ, "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    env.pop("HF_HOME", None)
    env.pop("HF_HUB_CACHE", None)
    where = [sys.executable, "-c", "from ferrum_mac.store import bundled; print(bundled.models_dir())"]
    models = Path(subprocess.run(where, env=env, capture_output=True, text=True, check=True).stdout.strip())
    folder = models / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    return env


@pytest.fixture
def serve(home, tmp_path):
    """`ferrum serve --ollama` on the bundled model, where OLLAMA_HOST says (as oterm reads it)."""
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "ferrum_mac.cli", "serve", "smollm2:135m", "--ollama"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=out, env={**home, "OLLAMA_HOST": f"127.0.0.1:{port}"})
    try:
        deadline = time.monotonic() + 120
        while "serving" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "serving" in log.read_text(), log.read_text()
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "Traceback" not in log.read_text(), log.read_text()


def keys(session: str, *names: str, literal: bool = False) -> None:
    for name in names:
        subprocess.run(["tmux", "send-keys", "-t", session] + (["-l"] if literal else []) + [name], check=True)
        time.sleep(0.3)


def test_oterm_lists_the_model_and_streams_an_answer(serve, home, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    oterm = oterm_command()
    expected = httpx.post(
        f"http://{serve}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": MAX_TOKENS},
        timeout=300,  # (the suite's other worker shares the two cores: it timed out once at 120 s)
    ).json()["choices"][0]["message"]["content"]
    data = tmp_path / "oterm"
    data.mkdir()
    (data / "config.json").write_text(json.dumps({"splash-screen": False, "theme": "textual-dark"}))
    env = {"OTERM_DATA_DIR": str(data), "OLLAMA_HOST": serve, "HOME": home["HOME"]}
    # (COLUMNS and LINES, which pytest's environment may hold, would override the tmux window's size)
    shell = "env -u COLUMNS -u LINES " + " ".join(f"{k}={v}" for k, v in env.items()) + f" {oterm}; sleep 30"
    session = f"oterm-test-{tmp_path.name}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "36", shell], check=True)
    try:
        wait_for_screen(session, lambda s: "Ctrl+N to start a new chat" in s, 90, "oterm to start")
        keys(session, "C-n")
        wait_for_screen(session, lambda s: "smollm2:135m" in s, 30, "the model list (/api/tags)")
        # the model: typed into the filter, then picked from the list
        keys(session, "Tab")
        keys(session, "smollm2", literal=True)
        keys(session, "Down", "Down", "Enter")
        wait_for_screen(session, lambda s: "Model: smollm2:135m" in s and "0.2" in s, 30, "the model's parameters")
        # temperature 0 and a short answer, then Save. The model offers tools, so oterm lists its
        # own tools (how many depends on its version) before the parameters: they are reached
        # backwards from the model list (past the buttons, Thinking, Seed, Max Tokens and Top P).
        keys(session, *["BTab"] * 7, "C-a", "C-k")
        keys(session, "0", literal=True)
        keys(session, "Tab", "Tab")
        keys(session, str(MAX_TOKENS), literal=True)
        keys(session, "Tab", "Tab", "Enter")  # past Seed to Save
        wait_for_screen(session, lambda s: "chat #1 - smollm2:135m" in s, 30, "the chat")
        keys(session, QUESTION, literal=True)
        keys(session, "Enter")
        first_line = expected.strip().splitlines()[0][:60]
        screen = wait_for_screen(session, lambda s: first_line in s, 120, f"the answer {first_line!r}")
        assert QUESTION in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
