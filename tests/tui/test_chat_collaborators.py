"""The chat screen's seams: every key and palette command reaches a method of the screen, and the
collaborators' pure helpers (the engine's messages from stored rows, a new chat's title)."""

from __future__ import annotations

import ast
import inspect
from types import SimpleNamespace

from ferrum_mac.tui import app as app_module
from ferrum_mac.tui.chat.answers import engine_messages, title_from
from ferrum_mac.tui.screens.chat_screen import ChatScreen
from ferrum_mac.tui.widgets.conversation_list import ConversationList


def row(role, content, reasoning="", **stats):
    return SimpleNamespace(role=role, content=content, reasoning=reasoning, stats=stats)


def test_every_binding_and_palette_command_is_a_method_of_the_screen():
    actions = {binding.action for binding in ChatScreen.BINDINGS}
    actions |= {b.action.removeprefix("screen.") for b in ConversationList.BINDINGS if b.action.startswith("screen.")}
    missing = [name for name in actions if not callable(getattr(ChatScreen, f"action_{name}", None))]
    assert missing == []
    palette = inspect.getsource(app_module.ChatApp.get_system_commands)
    called = {node.attr for node in ast.walk(ast.parse(palette.strip())) if isinstance(node, ast.Attribute)}
    commands = [name for name in called if name.startswith("action_")]
    assert len(commands) > 10 and all(hasattr(ChatScreen, name) for name in commands)


def test_the_engine_is_sent_messages_and_tool_rows_not_notices():
    stored = [
        row("user", "weather?"),
        row("assistant", "", "think first"),
        row("tool_call", '{"city": "Oslo"}', tool_call_id="c1", name="get_weather"),
        row("tool", "sunny", tool_call_id="c1", name="get_weather"),
        row("notice", "earlier turns were dropped"),
        row("error", "error: boom"),
    ]
    messages = engine_messages(stored)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["reasoning_content"] == "think first"
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}


def test_a_new_chats_title_is_its_first_line_cut_to_forty_characters():
    assert title_from("  what is\n a  llama? ") == "what is a llama?"
    long = title_from("x" * 50)
    assert len(long) == 40 and long.endswith("…")
