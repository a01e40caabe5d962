"""A server that wants a key: `ferrum run --remote` says how to give one."""

from __future__ import annotations

import os
import subprocess
import sys

from serve_support import API_KEY

FERRUM = [sys.executable, "-c", "from ferrum_mac.cli import main; main()"]


def ferrum(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*FERRUM, *args], input="", capture_output=True, text=True, timeout=120, env=env)


def test_a_refused_key_says_how_to_give_one(keyed_server):
    env = {k: v for k, v in os.environ.items() if k != "FERRUM_API_KEY"}
    refused = ferrum("run", "--remote", keyed_server.url, "Hi", env=env)
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "401" in lines[0] and "--api-key" in lines[0] and "FERRUM_API_KEY" in lines[0]


def test_the_key_from_the_environment_is_used(keyed_server):
    env = {**os.environ, "FERRUM_API_KEY": API_KEY}
    answered = ferrum("run", "--remote", keyed_server.url, "--max-tokens", "4", "Hi", env=env)
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.strip()
