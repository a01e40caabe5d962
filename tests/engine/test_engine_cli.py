"""`ferrum run` as a user runs it: the console script in a subprocess, through pipes and a terminal."""

from __future__ import annotations

import json
import re
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ferrum_mac.store.bundled import SMOLLM2

FERRUM = Path(sys.executable).with_name("ferrum")
STORY = "Tell me a story."


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict:
    """A private data folder (saved chats, history, the bundled model) and no model preference."""
    data = tmp_path / "data"
    data.mkdir()
    variables = {**os.environ, "XDG_DATA_HOME": str(data), "TERM": "dumb", "NO_COLOR": "1"}
    variables.pop("FERRUM_MODEL", None)
    variables.pop("FERRUM_KV_CAPACITY", None)
    return variables


@pytest.fixture
def bundled_env(env, smollm2_gguf) -> dict:
    """`env` with the bundled SmolLM2 already 'downloaded' (a link to the test copy)."""
    folder = Path(env["XDG_DATA_HOME"]) / "ferrum_mac" / "models" / SMOLLM2.name
    folder.mkdir(parents=True)
    (folder / SMOLLM2.filename).symlink_to(smollm2_gguf)
    return env


def ferrum(*args: str, env: dict, stdin: str | None = "", timeout: float = 120) -> subprocess.CompletedProcess:
    command = [str(FERRUM)] if FERRUM.exists() else [sys.executable, "-m", "ferrum_mac.cli"]
    return subprocess.run(command + list(args), input=stdin, capture_output=True, text=True, env=env, timeout=timeout)


# -- one answer ---------------------------------------------------------------------------


def test_one_shot_with_the_bundled_default_model_names_paris(bundled_env):
    run = ferrum("run", "What is the capital of France?", "--temperature", "0", "--max-tokens", "12", env=bundled_env)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    # nothing on stderr but the line saying the bundled model is a demo (tests/cli/test_first_run.py)
    assert [line for line in run.stderr.splitlines() if "is a small demo model" not in line] == []


def test_one_shot_verbose_prints_a_stats_line(stories_path, env):
    run = ferrum("run", str(stories_path), STORY, "--max-tokens", "8", "--verbose", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Anna")
    assert "tok/s" in run.stderr and "stop: max_tokens" in run.stderr


def test_device_flag(stories_path, env):
    on_cpu = ferrum("run", str(stories_path), STORY, "--max-tokens", "8", "--device", "cpu", env=env)
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert on_cpu.stdout.startswith("Anna")
    wrong = ferrum("run", str(stories_path), STORY, "--device", "tpu", env=env)
    assert wrong.returncode == 1 and wrong.stdout == ""
    assert wrong.stderr.strip().count("\n") == 0 and "unknown device 'tpu'" in wrong.stderr


def test_piped_stdin_is_the_prompt(stories_path, env):
    by_argument = ferrum("run", str(stories_path), STORY, "--max-tokens", "12", env=env)
    by_pipe = ferrum("run", str(stories_path), "--max-tokens", "12", env=env, stdin=STORY + "\n")
    assert by_pipe.returncode == 0, by_pipe.stderr
    assert by_pipe.stdout == by_argument.stdout and by_pipe.stdout.strip()


def test_json_output(stories_path, env):
    run = ferrum("run", str(stories_path), STORY, "--max-tokens", "20", "--stop", "scared", "--json", env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert set(result) == {"model", "text", "reasoning", "notices", "stats"}
    assert result["text"] == "Anna, I'm" and result["reasoning"] == ""
    stats = result["stats"]
    assert stats["stop_reason"] == "stop" and stats["stop_string"] == "scared"
    assert stats["prompt_tokens"] > 0 and stats["cached_tokens"] == 0 and stats["generated_tokens"] > 0
    assert {"ttft_s", "prefill_tps", "decode_tps"} <= set(stats)


# -- an answer cut short says so: one line on stderr -----------------------------------------


def test_an_answer_cut_by_max_tokens_says_so(stories_path, env):
    run = ferrum("run", str(stories_path), STORY, "--max-tokens", "8", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and run.stderr == "ferrum: the answer was cut at 8 tokens (--max-tokens)\n"


def test_the_models_own_limit_stops_a_runaway_answer(stories_path, tmp_path, env):
    """No --max-tokens: the model's generation_config `max_new_tokens` (else a few thousand
    tokens) ends the answer, and the user is told how to change it."""
    model = tmp_path / "stories"
    model.mkdir()
    for file in stories_path.iterdir():
        if file.name != "generation_config.json":
            (model / file.name).symlink_to(file)
    (model / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 6}))
    run = ferrum("run", str(model), STORY, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "ferrum: the answer was cut at 6 tokens (--max-tokens)\n"


def test_an_answer_cut_by_a_full_context_says_so(stories_path, env):
    run = ferrum("run", str(stories_path), STORY, "--kv-capacity", "40", "--context", "error", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ferrum: the answer was cut at "), run.stderr
    assert lines[0].endswith(
        " tokens: the context is full (--kv-capacity sets its size, up to the model's context length)"
    )


def test_an_answer_stopped_as_a_loop_says_so(stories_path, env):
    """stories260K's greedy answer to this repeats one sentence: it ends long before the limit,
    with a line saying why."""
    prompt = "The cat sat on the mat. The cat"
    run = ferrum("run", str(stories_path), prompt, "--temperature", "0", "--max-tokens", "480", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("It is a small, red cat.") > 10
    assert re.fullmatch(r"ferrum: the answer was stopped at \d+ tokens: it kept repeating itself\n", run.stderr)


@pytest.mark.slow
def test_torch_runs_the_bundled_model_offline(bundled_env):
    """torch reads the bundled GGUF: no trip to the Hub for the default model."""
    pytest.importorskip("torch")
    env = {**bundled_env, "HF_HUB_OFFLINE": "1"}
    run = ferrum("run", "--backend", "torch", "--no-pull", "Hi", "--max-tokens", "8", env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() and "Traceback" not in run.stderr


# -- bad input: one line on stderr, non-zero exit, no traceback -------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (["nosuch:model", "hi"], "unknown model"),
        (["./no/such/folder", "hi"], "does not exist"),
        (["{bad}", "hi"], "broken.gguf"),
        (["{stories}", "--kv-capacity", "16", "The dog ran to the big park to play."], "context holds 16"),
        (["{stories}", "hi", "--temperature", "-1"], "temperature"),
        (["{stories}", "hi", "--top-p", "2"], "top_p"),
        (["{stories}", "hi", "--temperature", "warm"], "--temperature"),
        (["{stories}", "hi", "--context", "sideways"], "context policy"),
        (["{stories}", "hi", "--max-tokens", "0"], "max_tokens"),
        (["{stories}", "hi", "--no-such-flag"], "no-such-flag"),
    ],
)
def test_bad_input_exits_with_one_clear_line(args, says, stories_path, tmp_path, env):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    args = [a.format(stories=stories_path, bad=bad) for a in args]
    run = ferrum("run", *args, env=env)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ferrum: "), run.stderr
    assert says.lower() in lines[0].lower() and "Traceback" not in run.stderr


# -- the REPL -------------------------------------------------------------------------------


def test_repl_through_a_pipe(stories_path, env):
    script = (
        "\n".join(
            [
                "/set temperature 0",
                "/set parameter num_predict 8",
                "/set system You tell stories.",
                "/show system",
                STORY,
                '"""',
                "Once upon",
                'a time"""',
                "/show parameters",
                "/save chat1",
                "/clear",
                "/load chat1",
                "/unknown",
                "/bye",
                "this line is never read",
            ]
        )
        + "\n"
    )
    run = ferrum("run", str(stories_path), "--interactive", env=env, stdin=script)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "Set parameter 'temperature' to '0'." in out and "You tell stories." in out
    assert "num_predict       8" in out and "temperature       0.0" in out
    assert "Cleared session context." in out and "Loaded 'chat1' (4 messages)." in out
    assert "Unknown command '/unknown'" in out
    saved = json.loads((Path(env["XDG_DATA_HOME"]) / "ferrum_mac" / "conversations" / "chat1.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant", "user", "assistant"]
    assert saved["messages"][2]["content"] == "Once upon\na time"
    assert saved["settings"]["system"] == "You tell stories." and saved["settings"]["max_tokens"] == 8


def test_repl_says_when_the_limit_cut_an_answer(stories_path, env):
    run = ferrum("run", str(stories_path), "-i", env=env, stdin=f"/set num_predict 5\n{STORY}\n")
    assert run.returncode == 0, run.stderr
    assert run.stderr == "ferrum: the answer was cut at 5 tokens (/set num_predict)\n"


def test_repl_ends_at_end_of_input(stories_path, env):
    run = ferrum("run", str(stories_path), "-i", "--max-tokens", "4", env=env, stdin=STORY + "\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


class Terminal:
    """A child process on a pseudo-terminal that is its controlling terminal (so ^C is SIGINT)."""

    def __init__(self, command: list[str], env: dict):
        import fcntl
        import termios

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            command,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 60) -> str:
        """Read until `text` appears after what earlier calls consumed; return what came before it."""
        assert self.sees(text, timeout), f"waited {timeout}s for {text!r}; got {self.seen[-500:]!r}"
        before, _, self.seen = self.seen.partition(text)
        return before

    def sees(self, text: str, timeout: float) -> bool:
        """Whether `text` appears within `timeout` seconds (read, not consumed)."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                assert chunk, f"the process ended while waiting for {text!r}; got {self.seen[-500:]!r}"
                self.seen += chunk.decode("utf-8", "replace")
        return True

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(30)
        finally:
            os.close(self.master)


def test_repl_on_a_terminal_ctrl_c_stops_the_answer_not_the_program(bundled_env):
    command = [str(FERRUM), "run"] if FERRUM.exists() else [sys.executable, "-m", "ferrum_mac.cli", "run"]
    term = Terminal(command + ["--temperature", "0"], bundled_env)
    try:
        term.expect(">>> ", timeout=90)
        term.send("/set num_predict 400\n")
        term.expect("Set parameter")
        term.expect(">>> ")
        term.send("Write a long story about a dragon.\n")
        term.expect("dragon.")  # the terminal's echo of the line
        term.expect(" ", timeout=90)  # the answer has begun to stream
        term.send("\x03")
        stopped = term.expect(">>> ", timeout=60)
        assert len(stopped.split()) < 100, stopped  # 400 tokens would be some 300 words
        term.send("/set num_predict 8\n")
        term.expect(">>> ")
        term.send('"""\nWhat is the capital\nof France?\n"""\n')
        term.expect("France?")
        term.expect(">>> ", timeout=60)  # answered after the interrupted turn
        # CPython's readline loop notices a signal only when it interrupts its select(); one
        # that lands while the prompt is being drawn waits for the next key. So Ctrl-C until
        # the hint shows (a late first one would then end the program, as a second does).
        for _ in range(3):
            time.sleep(0.5)
            term.send("\x03")
            if term.sees("Ctrl-D or /bye", timeout=10):
                break
        term.expect("Ctrl-D or /bye", timeout=1)
        time.sleep(0.5)
        term.send("\x03")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait()


# -- which word is the model ---------------------------------------------------------------


@pytest.mark.parametrize("words", [["Translate:", "a", "story"], ["docs", "please", "tell", "a", "story"]])
def test_a_prompt_word_that_is_not_a_model_stays_in_the_prompt(words, stories_path, env, tmp_path):
    """An unquoted prompt whose first word ends in ':' or is a folder without a model in it is all prompt."""
    (tmp_path / "docs").mkdir()
    env = {**env, "FERRUM_MODEL": str(stories_path)}
    command = [str(FERRUM)] if FERRUM.exists() else [sys.executable, "-m", "ferrum_mac.cli"]
    run = subprocess.run(
        command + ["run", *words, "--max-tokens", "4", "--json"],
        input="",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["model"] == str(stories_path) and answer["stats"]["prompt_tokens"] > len(words)


def test_repl_after_clear_and_load_reuses_what_was_computed(stories_path, env):
    lines = ["/set temperature 0", "/set num_predict 6", STORY, "And then?", "/save c", "/clear", "Hi", "/load c"]
    run = ferrum("run", str(stories_path), "-i", "-v", env=env, stdin="\n".join([*lines, "More."]) + "\n")
    assert run.returncode == 0, run.stderr
    stats = [line for line in run.stderr.splitlines() if line.startswith("prompt ")]
    second, after_clear, after_load = (re.match(r"prompt (\d+) tokens \((\d+) cached\)", s).groups() for s in stats[1:])
    assert int(after_clear[1]) > 0  # the template's start, kept across /clear
    # the loaded history was computed before /clear: the prefix cache holds it
    assert int(after_load[1]) > int(second[0]) + int(second[1])
