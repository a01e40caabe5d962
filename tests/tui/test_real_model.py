"""The chat app on the bundled SmolLM2-135M (a real engine), through Pilot and in a real terminal."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tui_pilot import SIZE, send, wait_for
from ferrum_mac.store.history import History
from ferrum_mac.tui.app import ChatApp
from ferrum_mac.tui.services import Services
from ferrum_mac.tui.widgets.message_view import MessageView

MAX_TOKENS = 6  # the model decodes ~5 tok/s on a loaded 2-core CPU


async def test_real_engine_answers_reuses_and_truncates_its_cache(smollm2_gguf, history):
    app = ChatApp(Services("auto"), history, str(smollm2_gguf), {"max_tokens": MAX_TOKENS, "temperature": 0.0})
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.engine is not None, timeout=120, what="the model")
        assert "mlx" in app.device_text
        await send(pilot, "What is the capital of France?", timeout=90)
        chat = history.conversations()[0]
        first = history.messages(chat.id)[-1]
        assert first.role == "assistant" and first.content.strip()
        assert 1 <= first.stats["generated_tokens"] <= MAX_TOKENS and first.stats["cached_tokens"] == 0
        views = list(app.chat.query(MessageView))
        assert views[-1].content == first.content

        await send(pilot, "And of Spain?", timeout=60)
        second = history.messages(chat.id)[-1]
        assert second.stats["cached_tokens"] > 0  # the resident conversation prefilled only the new turn

        views = list(app.chat.query(MessageView))
        views[0].focus()
        await pilot.press("e")
        app.chat.query_one("#prompt").text = "What is the capital of Italy?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.chat.busy and len(history.messages(chat.id)) == 2, timeout=60)
        edited = history.messages(chat.id)[-1]
        # the cache was cut back to the system prompt and template shared with the edited turn
        assert 0 < edited.stats["cached_tokens"] < second.stats["cached_tokens"]
        assert [m.content for m in history.messages(chat.id)][0] == "What is the capital of Italy?"

        # back to the first branch: the prefix cache still holds it, so only the new turn is computed
        app.chat.query(MessageView).first().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: len(history.messages(chat.id)) == 4, what="the first branch")
        await send(pilot, "And of Germany?", timeout=60)
        third = history.messages(chat.id)[-1]
        assert [m.content for m in history.messages(chat.id)][2] == "And of Spain?"
        assert third.stats["cached_tokens"] > second.stats["cached_tokens"]


def chat_command() -> list[str]:
    script = Path(sys.executable).parent / "ferrum-chat"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from ferrum_mac.cli import chat_main; chat_main()"]


def capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def wait_for_screen(session: str, condition, timeout: float, what: str) -> str:
    end = time.monotonic() + timeout
    while True:
        screen = capture(session)
        if condition(screen):
            return screen
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}; the screen shows:\n{screen}")
        time.sleep(0.3)


def test_ferrum_chat_in_tmux(smollm2_gguf, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    db, exit_file = tmp_path / "history.sqlite3", tmp_path / "exit-code"
    command = chat_command() + [str(smollm2_gguf), "--db", str(db), "--max-tokens", str(MAX_TOKENS)]
    shell = f"{shlex.join(command)}; echo $? > {exit_file}; sleep 30"  # (Textual draws on stderr)
    session = f"ferrum-chat-test-{tmp_path.name}"
    (tmp_path / "notes.txt").write_text("The lighthouse lamp needs oil.\nThe keeper's cat is grey.\n")
    tmux = ["tmux", "new-session", "-d", "-s", session, "-x", "110", "-y", "32", "-c", str(tmp_path), shell]
    subprocess.run(tmux, check=True)
    try:
        wait_for_screen(session, lambda s: "mlx ·" in s, 120, "the model to load")
        subprocess.run(["tmux", "send-keys", "-t", session, "What is the capital of France?", "Enter"], check=True)
        screen = wait_for_screen(session, lambda s: "tokens ·" in s or " tokens\n" in s, 90, "the answer")
        lines = screen.splitlines()
        assistant = next(i for i, line in enumerate(lines) if line.rstrip().endswith("Assistant"))
        answer = lines[assistant + 1].split("▕")[-1].strip()
        assert answer and "tok/s" not in answer, screen
        assert "What is the capital of France?" in screen

        def keys(*sent: str) -> None:
            subprocess.run(["tmux", "send-keys", "-t", session, *sent], check=True)

        keys("Summarise @no", "Tab")  # the path completes; the file goes as a chip
        wait_for_screen(session, lambda s: "@notes.txt" in s, 10, "the completed path")
        keys("Enter")
        wait_for_screen(session, lambda s: "📎 notes.txt · 2 lines" in s and s.count("tok/s ·") >= 2, 90, "answer 2")
        keys("C-r")  # regenerate: the old answer stays as a branch
        wait_for_screen(session, lambda s: "‹ 2/2 ›" in s, 90, "the regenerated answer")
        keys("C-f")
        wait_for_screen(session, lambda s: "Search every conversation" in s, 10, "the search screen")
        keys("capital")
        wait_for_screen(session, lambda s: " found" in s and "nothing found" not in s, 10, "the search result")
        keys("Escape")
        subprocess.run(["tmux", "send-keys", "-t", session, "C-q"], check=True)
        end = time.monotonic() + 20
        while not exit_file.exists() or not exit_file.read_text().strip():
            assert time.monotonic() < end, f"ferrum-chat did not quit; the screen shows:\n{capture(session)}"
            time.sleep(0.2)
        assert exit_file.read_text().strip() == "0", capture(session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    history = History.open(db)
    try:
        chat = history.conversations()[0]
        path = history.messages(chat.id)
        assert [m.role for m in path] == ["user", "assistant", "user", "assistant"]
        assert "The keeper's cat is grey." in path[2].content and path[3].branch == (2, 2)
    finally:
        history.close()
