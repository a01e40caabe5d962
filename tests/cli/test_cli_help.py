"""`ferrum --help`, `-h` and `--version` as a person reads them."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from ferrum_mac.cli import app

COMMANDS = ["bench", "pull", "list", "rm", "show", "run", "serve", "chat", "ps", "stop"]


def ferrum(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "100"})


@pytest.mark.parametrize("command", ["pull", "rm", "show", "serve", "chat"])
def test_help_keeps_the_revision_syntax(command):
    result = ferrum(command, "--help")
    assert result.exit_code == 0
    assert "org/name[@revision][:QUANT]" in result.stdout.replace("\n", "").replace(" ", "")


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_show_no_type_and_h_is_help(command):
    long, short = ferrum(command, "--help"), ferrum(command, "-h")
    assert long.exit_code == short.exit_code == 0
    assert short.stdout == long.stdout
    assert "<bool>" not in long.stdout
    assert "-h, --help" in long.stdout


def test_top_level_help_and_version():
    assert ferrum("-h").stdout == ferrum("--help").stdout
    for flag in ("--version", "-V"):
        result = ferrum(flag)
        assert result.exit_code == 0 and result.stdout == f"ferrum {version('ferrum-mac')}\n"


def test_version_through_the_entry_point():
    proc = subprocess.run(
        [sys.executable, "-c", "from ferrum_mac.cli import main; main()", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"ferrum {version('ferrum-mac')}" and proc.stderr == ""


def test_chat_command_prints_the_version():
    proc = subprocess.run(
        [sys.executable, "-c", "from ferrum_mac.cli import chat_main; chat_main()", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"ferrum {version('ferrum-mac')}"


def test_bench_help_lists_the_shapes():
    from ferrum_mac.bench.shapes import SHAPES

    text = ferrum("bench", "--help").stdout.replace("\n", " ")
    for name in SHAPES:
        assert name in text
    for subcommand in ("turns", "first-token"):
        assert subcommand in text
        assert ferrum("bench", subcommand, "-h").stdout.startswith(f"Usage: ferrum bench {subcommand} [OPTIONS]")


@pytest.mark.parametrize("command", ["run", "chat", "ps"])
def test_api_key_comes_from_the_environment(command, monkeypatch):
    monkeypatch.setenv("FERRUM_API_KEY", "from-env")
    ctx = get_command(app).commands[command].make_context(command, ["--remote", "http://127.0.0.1:1"])
    assert ctx.params["api_key"] == "from-env"
    monkeypatch.delenv("FERRUM_API_KEY")
    ctx = get_command(app).commands[command].make_context(command, ["--remote", "http://127.0.0.1:1"])
    assert ctx.params["api_key"] is None
    assert "FERRUM_API_KEY" in ferrum(command, "--help").stdout
    assert os.environ.get("FERRUM_API_KEY") is None
