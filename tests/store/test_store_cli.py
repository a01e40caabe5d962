"""`ferrum pull / list / rm / show` as a person types them, against the fake Hub."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tiny_repo import REPO_ID, write_gguf_header
from ferrum_mac.cli import app

runner = CliRunner()


def ferrum(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def test_pull_list_show_rm(hub):
    result = ferrum("list")
    assert result.exit_code == 0 and "no models yet" in result.stdout

    result = ferrum("pull", REPO_ID)
    assert result.exit_code == 0, result.output
    assert re.search(r"pulling tiny-org/tiny-llama: 8 files, \d+\.\d kB", result.stderr)
    assert re.search(r"model\.safetensors\s+\d+\.\d kB\s+\S+ [kMG]?B/s", result.stderr)  # a line per file, with rate
    assert f"{REPO_ID} is ready: " in result.stdout

    lines = ferrum("list").stdout.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "QUANT", "FORMAT", "MODIFIED"]
    assert re.match(rf"{REPO_ID}\s+\d+\.\d kB\s+fp32\s+safetensors\s+just now$", lines[1])

    shown = ferrum("show", REPO_ID).stdout
    for expected in (
        r"architecture\s+LlamaForCausalLM \(llama\)",
        r"parameters\s+\d+\.\d\dK \([\d,]+\)",
        r"context length\s+512",
        r"quantization\s+fp32",
        r"chat template\s+yes",
        r"license\s+mit",
    ):
        assert re.search(expected, shown), (expected, shown)

    result = ferrum("rm", REPO_ID, input="n\n")
    assert result.exit_code == 1 and "Remove tiny-org/tiny-llama (all its cached files)" in result.stdout
    assert "nothing removed" in result.stdout
    result = ferrum("rm", REPO_ID, "--yes")
    assert result.exit_code == 0 and re.search(r"removed tiny-org/tiny-llama \(\d+\.\d kB freed\)", result.stdout)
    assert "no models yet" in ferrum("list").stdout


def test_unfinished_pull_is_not_listed_as_a_model(hub):
    hub.cut[(REPO_ID, "model.safetensors")] = 256 * 1024
    result = ferrum("pull", REPO_ID)
    assert result.exit_code == 1 and "resumes the download" in str(result.exception)
    result = ferrum("list")
    assert "no models yet" in result.stdout
    assert re.search(
        r"unfinished: tiny-org/tiny-llama \(.*\); `ferrum pull tiny-org/tiny-llama` finishes it", result.stderr
    )
    assert ferrum("show", REPO_ID).exit_code == 1  # not downloaded: a FerrumError, not a half model


def test_list_available_prints_the_alias_table():
    out = ferrum("list", "--available").stdout
    assert re.search(r"qwen3:0\.6b\s+mlx-community/Qwen3-0\.6B-4bit", out)
    assert re.search(r"smollm2:135m\s+bundled GGUF", out)
    assert re.search(
        r"qwen3:0\.6b\s+Qwen/Qwen3-0\.6B$", ferrum("list", "--available", "--backend", "torch").stdout, re.M
    )


def test_bundled_model_is_listed_and_shown(hf_home, tmp_path):
    from ferrum_mac.store import bundled

    gguf = bundled.models_dir() / bundled.SMOLLM2.name / bundled.SMOLLM2.filename
    write_gguf_header(
        gguf,
        {
            "general.architecture": "llama",
            "llama.context_length": 8192,
            "tokenizer.chat_template": "{{ x }}",
            "general.license": "apache-2.0",
        },
        [("blk.0.ffn_up.weight", (576, 1536), 3)],
    )
    assert re.search(r"smollm2:135m\s+\S+ B\s+Q4_1\s+gguf", ferrum("list").stdout)
    shown = ferrum("show", "smollm2:135m").stdout
    assert re.search(r"context length\s+8,192", shown) and re.search(r"license\s+apache-2.0", shown)


def test_errors_are_one_line_on_stderr(hub):
    """Through the real entry point (`main`), as the installed `ferrum` script runs it."""
    env = {**os.environ, "HF_ENDPOINT": hub.url}
    proc = subprocess.run(
        [sys.executable, "-c", "from ferrum_mac.cli import main; main()", "pull", "tiny-org/nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "ferrum: no model tiny-org/nope on the Hub; check the name (`ferrum list --available` shows aliases)"
    ]


def test_a_hub_answering_with_a_web_page_is_one_line(hub):
    hub.portal.add(REPO_ID)
    env = {**os.environ, "HF_ENDPOINT": hub.url}
    proc = subprocess.run(
        [sys.executable, "-c", "from ferrum_mac.cli import main; main()", "pull", REPO_ID],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"ferrum: {hub.url} answered with something other than a Hugging Face Hub's model")


@pytest.mark.parametrize("args", [["rm", "tiny-org/never-pulled", "--yes"], ["show", "qwen3:0.6b"]])
def test_not_downloaded(hf_home, args):
    result = ferrum(*args)
    assert result.exit_code == 1 and "not downloaded" in str(result.exception)


def test_rm_counts_and_removes_the_dense_copy(hub):
    """The dense copy MLX's CPU build keeps of a model is shown in `list`, asked about and freed by `rm`."""
    mx = pytest.importorskip("mlx.core")
    from ferrum_mac.backends.mlx.cpu import dense_cache

    from ferrum_mac.store.resolve import resolve_model

    assert ferrum("pull", REPO_ID).exit_code == 0
    assert "dense copy" not in ferrum("list").stdout
    source = (resolve_model(REPO_ID, pull=False) / "config.json").resolve()
    copy = dense_cache.cache_dir() / "0123456789ab-test.safetensors"
    assert dense_cache.store(copy, {"w": mx.zeros((500, 1000))}, source=source)  # 2.0 MB, as a load writes it
    assert re.match(rf"{REPO_ID}\s+\d+\.\d kB \+ 2\.0 MB dense copy\s+fp32", ferrum("list").stdout.splitlines()[1])

    result = ferrum("rm", REPO_ID, input="n\n")
    assert re.search(
        r"Remove tiny-org/tiny-llama \(all its cached files\), \d+\.\d kB and its dense copy, 2\.0 MB\?", result.stdout
    )
    assert copy.is_file()
    result = ferrum("rm", REPO_ID, "--yes")
    assert result.exit_code == 0 and re.search(r"removed tiny-org/tiny-llama \(2\.\d MB freed\)", result.stdout)
    assert not copy.exists()


def test_rm_suggests_the_closest_downloaded_model(hub):
    assert ferrum("pull", REPO_ID).exit_code == 0
    for typo in ("tiny-org/tiny-lama", "tiny-org/Tiny-Llama2"):
        result = ferrum("rm", typo, "--yes")
        assert result.exit_code == 1
        assert f"did you mean {REPO_ID}?" in str(result.exception)
    result = ferrum("rm", "someone/else", "--yes")
    assert result.exit_code == 1 and "did you mean" not in str(result.exception)
