"""`ferrum-chat --remote`: the chat app driving a live `ferrum serve` through the OpenAI API."""

from __future__ import annotations

import asyncio
import time

from ferrum_mac.store.history import History
from ferrum_mac.tui.app import ChatApp
from ferrum_mac.tui.services import RemoteServices

QUESTION = "Tell me about Lily"


async def wait_for(pilot, condition, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def test_chat_app_answers_through_a_remote_server(server, client, tmp_path):
    expected = (
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0
        )
        .choices[0]
        .message.content
    )
    history = History.open(tmp_path / "history.sqlite3")
    app = ChatApp(RemoteServices(server.url), history, None, {"temperature": 0, "max_tokens": 12})

    async def chat() -> None:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: app.engine is not None, "the remote engine")
            assert app.device_text.startswith("remote")
            screen = app.chat
            screen.query_one("#prompt").focus()
            screen.query_one("#prompt").text = QUESTION
            await pilot.press("enter")
            answered = lambda: screen.current_id is not None and len(history.messages(screen.current_id)) == 2  # noqa: E731
            await wait_for(pilot, lambda: answered() and not screen.busy, "the saved answer")
            await pilot.pause()
            # the context meter counts what the server said it holds (no local ledger in remote mode)
            stats = history.messages(screen.current_id)[-1].stats
            used = stats["prompt_tokens"] + stats["cached_tokens"] + stats["generated_tokens"]
            assert stats["context_used"] == used > 0
            assert f" {used}" in str(screen.query_one("#context").render())
            await app.action_quit()

    try:
        asyncio.run(chat())
        conversation = history.conversations()[0]
        roles = [(m.role, m.content) for m in history.messages(conversation.id)]
    finally:
        history.close()
    assert roles[0] == ("user", QUESTION)
    assert roles[1][0] == "assistant" and roles[1][1].strip() == expected.strip()
