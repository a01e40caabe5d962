"""A real agent client against a live `ferrum serve`: Simon Willison's `llm` CLI, with the
server registered as an OpenAI-compatible model (`extra-openai-models.yaml` in a temporary
LLM_USER_PATH, set for the subprocess only).

llm offers its tools with tool_choice "auto" and has no way to ask for more: its OpenAI chat
options forbid extra fields (no `tool_choice`) and the YAML has no extra body. SmolLM2-135M, the
chat model these tests can run, answers such prompts in text, so the tool test asserts the round
trip (valid arguments, llm runs the tool, the answer with its result) whenever a call is made,
and otherwise that the answer is clean text. `--schema` is enforced, so it is checked exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serve_support import LiveServer, open_stories

LLM = Path(sys.executable).with_name("llm")
FUNCTIONS = '''
def get_weather(city: str) -> str:
    """The current weather in a city."""
    import json, os
    with open(os.environ["FERRUM_TEST_CALLS"], "a") as f:
        f.write(json.dumps({"city": city}) + "\\n")
    return f"It is sunny and 21 degrees in {city}."
'''


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    from ferrum_mac.serve import Scheduler
    from ferrum_mac.serve.app import build_app

    scheduler = Scheduler(open_stories(smollm2_gguf, kv_capacity=2048)).start()
    live = LiveServer(build_app(scheduler, "smollm2"))
    yield live
    live.stop()
    scheduler.stop()


def llm_env(tmp_path: Path, server_url: str) -> dict:
    """An environment for the llm subprocess whose user folder knows the server as `ferrum`."""
    home = tmp_path / "llm-home"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: ferrum\n  model_name: smollm2\n  api_base: {server_url}/v1\n"
        "  supports_tools: true\n  supports_schema: true\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LLM_"))}
    return {**env, "LLM_USER_PATH": str(home), "FERRUM_TEST_CALLS": str(tmp_path / "calls.jsonl")}


@pytest.mark.slow  # SmolLM2 answers in text under "auto", so this mostly checks a clean answer
@pytest.mark.skipif(not LLM.exists() and shutil.which("llm") is None, reason="the llm CLI is not installed")
def test_llm_calls_a_tool_and_answers_with_its_result(smollm2_server, tmp_path):
    env = llm_env(tmp_path, smollm2_server.url)
    command = [str(LLM if LLM.exists() else shutil.which("llm")), "-m", "ferrum", "--functions", FUNCTIONS, "--td"]
    command += ["-o", "temperature", "0", "-o", "max_tokens", "120", "--no-log"]
    command += ["Use the get_weather tool to find the weather in Paris."]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() and "<tool_call>" not in done.stdout and "</tool_call>" not in done.stdout
    log = tmp_path / "calls.jsonl"
    if log.exists():  # the model called the tool: llm ran it with valid arguments and sent the result back
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        assert all(isinstance(c["city"], str) and c["city"] for c in calls), calls
        assert done.stdout.split("It is sunny and 21 degrees")[-1].strip(), done.stdout  # the answer after it


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.skipif(not LLM.exists() and shutil.which("llm") is None, reason="the llm CLI is not installed")
def test_llm_schema_answer_validates(smollm2_server, tmp_path):
    import jsonschema

    env = llm_env(tmp_path, smollm2_server.url)
    command = [str(LLM if LLM.exists() else shutil.which("llm")), "-m", "ferrum", "--schema", json.dumps(PERSON)]
    command += ["-o", "max_tokens", "60", "--no-log", "Invent a person."]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    jsonschema.validate(json.loads(done.stdout), PERSON)
