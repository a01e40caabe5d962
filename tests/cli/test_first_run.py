"""A newcomer's first `ferrum run` on the bundled model: one line says which model it is, that
it is a small demo, and which model to pull for this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FERRUM = Path(sys.executable).with_name("ferrum")


def ferrum(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(FERRUM), *args], input="", capture_output=True, text=True, env=env, timeout=300)


def test_first_run_says_the_model_is_a_demo_and_what_to_pull(newcomer_env):
    run = ferrum("run", "--max-tokens", "2", "Hi", env=newcomer_env)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if "demo model" in line]
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("ferrum: smollm2:135m is a small demo model (135M parameters)")
    assert "`ferrum pull qwen3:" in lines[0] or "`ferrum list --available`" in lines[0]
    assert "demo model" not in run.stdout


def test_a_named_model_file_gets_no_demo_line(smollm2_gguf, newcomer_env):
    run = ferrum("run", str(smollm2_gguf), "--max-tokens", "2", "Hi", env=newcomer_env)
    assert run.returncode == 0 and "demo model" not in run.stderr, run.stderr


def test_an_empty_prompt_is_refused_before_the_model_loads(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    for words in ([""], ["  "], ["smollm2:135m", ""]):
        run = ferrum("run", "--no-pull", *words, env=env)
        assert run.returncode == 1 and run.stdout == ""
        assert run.stderr.splitlines() == [
            'ferrum: the prompt is empty; give some text (`ferrum run "Hi"`), or none for the REPL'
        ], run.stderr
