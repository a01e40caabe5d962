"""`ferrum run --format json`, `--schema FILE` and the REPL's `/set format`, as a user runs them
(the console script in a subprocess) on the bundled SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

FERRUM = Path(sys.executable).with_name("ferrum")
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture
def env(tmp_path) -> dict:
    data = tmp_path / "data"
    data.mkdir()
    variables = {**os.environ, "XDG_DATA_HOME": str(data), "TERM": "dumb", "NO_COLOR": "1"}
    variables.pop("FERRUM_MODEL", None)
    return variables


def ferrum(*args: str, env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FERRUM), *args], input=stdin or "", capture_output=True, text=True, env=env, timeout=300)


def test_schema_file_answer_validates(smollm2_gguf, env, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    run = ferrum(
        "run", str(smollm2_gguf), "Where is the Eiffel tower?", "--schema", str(schema), "--max-tokens", "48", env=env
    )
    assert run.returncode == 0, run.stderr
    jsonschema.validate(json.loads(run.stdout), CITY)


def test_format_json_answer_is_an_object(smollm2_gguf, env):
    run = ferrum("run", str(smollm2_gguf), "List two colours.", "--format", "json", "--max-tokens", "48", env=env)
    assert run.returncode == 0, run.stderr
    assert isinstance(json.loads(run.stdout), dict)


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "cannot read the schema file"),
        ("{broken", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"type": "array", "uniqueItems": true}', "'uniqueItems'"),
    ],
)
def test_bad_schema_file_is_one_line(env, tmp_path, content, says):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    run = ferrum("run", "--no-pull", "hello", "--schema", str(path), env=env)
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1 and lines[0].startswith("ferrum: "), run.stderr
    assert says in lines[0]


def test_unknown_format_is_one_line(env):
    run = ferrum("run", "--no-pull", "hello", "--format", "yaml", env=env)
    assert run.returncode != 0 and run.stderr.strip() == "ferrum: unknown --format 'yaml'; choose one of: text, json"


def test_repl_set_format_json_then_text(smollm2_gguf, env):
    script = "\n".join(
        [
            "/set num_predict 40",
            "/set temperature 0",  # (a sampled answer may run past 40 tokens before its last brace)
            "/set format json",
            "/show parameters",
            "Name a fruit.",
            "/set format text",
            "/show parameters",
            "/set format xml",
            "/bye",
        ]
    )
    run = ferrum("run", str(smollm2_gguf), "-i", env=env, stdin=script + "\n")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "Set answer format to json." in out and "format            json" in out
    assert "Set answer format to text." in out and "format            text" in out
    assert "/set format takes json or text" in out
    answer = out.split("format            json", 1)[1].split("Set answer format to text.", 1)[0]
    start, end = answer.index("{"), answer.rindex("}")
    assert isinstance(json.loads(answer[start : end + 1]), dict)
