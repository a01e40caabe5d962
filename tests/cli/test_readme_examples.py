"""The README's command examples, run as written (the console script, in a subprocess) where
they can run offline on the bundled model: each prints what its comment claims."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

FERRUM = Path(sys.executable).with_name("ferrum")
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_examples() -> set[tuple[str, ...]]:
    """The words of each `ferrum ...` line of the README's Commands block, without its comment."""
    block = README.read_text(encoding="utf-8").split("## Commands", 1)[1]
    block = re.search(r"```sh\n(.*?)```", block, re.S).group(1)
    lines = (shlex.split(line, comments=True) for line in block.splitlines())
    return {tuple(words) for words in lines if words and words[0] in ("ferrum", "ferrum-chat")}


def says_an_answer(out: str) -> None:
    assert len(out.split()) >= 5, out


def says_a_json_object_with_content(out: str) -> None:
    answer = json.loads(out)
    assert isinstance(answer, dict) and answer, out


def lists_the_bundled_model(out: str) -> None:
    header, *rows = out.splitlines()
    assert header.split() == ["NAME", "SIZE", "QUANT", "FORMAT", "MODIFIED"]
    assert any(row.split()[0] == "smollm2:135m" for row in rows), out


def lists_the_aliases(out: str) -> None:
    assert out.splitlines()[0].split()[0] == "NAME" and "qwen3:8b" in out, out


def shows_the_model(out: str) -> None:
    for fact in ("architecture", "parameters", "context length", "quantization", "chat template", "license"):
        assert re.search(rf"^\s+{fact}\s+\S", out, re.M), (fact, out)


def says_the_version(out: str) -> None:
    assert re.fullmatch(r"ferrum \S+\n", out), out


def says_nothing_matches(out: str) -> None:
    assert out == "", out  # an empty history: no match (a line on stderr says so)


# example -> what its output must show
OFFLINE = {
    'ferrum run "Why is the sky blue?"': says_an_answer,
    'ferrum run --format json "List three colours"': says_a_json_object_with_content,
    "ferrum list": lists_the_bundled_model,
    "ferrum list --available": lists_the_aliases,
    "ferrum show smollm2:135m": shows_the_model,
    'ferrum chat --search "lighthouse keeper"': says_nothing_matches,
    "ferrum --version": says_the_version,
}
# Examples that need a download, a server, a terminal, a peer or a store model other than the
# bundled one; the other tests cover them.
ELSEWHERE = {
    "ferrum-chat",
    "ferrum run",
    'ferrum run qwen3:0.6b "Hi" -v',
    "ferrum pull qwen3:8b",
    "ferrum rm qwen3:8b",
    "ferrum serve qwen3:0.6b --port 8000",
    "ferrum serve --keep-alive 10m",
    "ferrum serve --ollama",
    "ferrum ps",
    "ferrum stop smollm2:135m",
    'ferrum run --remote http://127.0.0.1:8000 "Hi"',
    "ferrum-chat --remote http://127.0.0.1:8000",
    "ferrum bench --shape qwen3-0.6b --quant 4bit",
    "ferrum bench --backend torch --shape qwen3-8b --quant 4bit",
    "ferrum bench path/to/model --json --batch 8",
    "ferrum bench turns smollm2:135m",
    "ferrum bench first-token hi",
    "ferrum bench prefix",
}


def test_every_example_is_run_here_or_named_as_run_elsewhere():
    examples = readme_examples()
    here, elsewhere = ({tuple(shlex.split(example)) for example in named} for named in (OFFLINE, ELSEWHERE))
    assert here <= examples, here - examples  # the README still shows them
    assert examples <= here | elsewhere, examples - here - elsewhere


@pytest.mark.parametrize("example", sorted(OFFLINE))
def test_example_prints_what_it_claims(example, newcomer_env):
    words = shlex.split(example)
    run = subprocess.run(
        [str(FERRUM), *words[1:]], input="", capture_output=True, text=True, env=newcomer_env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    OFFLINE[example](run.stdout)
