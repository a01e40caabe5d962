"""`ChatEngine` and `LocalEngine` declare what the interfaces use of an engine: the local
`Engine`, the `RemoteEngine` and the TUI tests' scripted engine each offer all of it, with the
same call signatures."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ferrum_mac.engine import ChatEngine, Engine, LocalEngine
from ferrum_mac.remote import RemoteEngine


def declared(protocol) -> tuple[set[str], dict[str, inspect.Signature]]:
    """The protocol's attributes and its methods' signatures, its bases' included."""
    attributes, methods = set(), {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False):
            continue
        attributes |= set(vars(cls).get("__annotations__", {}))
        attributes |= {n for n, f in vars(cls).items() if isinstance(f, property)}
        methods |= {
            n: inspect.signature(f) for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")
        }
    return attributes, methods


def call_shape(signature: inspect.Signature) -> list[tuple]:
    """Parameter names, kinds and defaults: what a caller relies on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def assert_offers(engine, protocol) -> None:
    attributes, methods = declared(protocol)
    assert isinstance(engine, protocol)
    for name in attributes:
        assert hasattr(engine, name), f"{type(engine).__name__} has no {name}"
    for name, signature in methods.items():
        assert call_shape(inspect.signature(getattr(type(engine), name))) == call_shape(signature), (
            f"{type(engine).__name__}.{name}{inspect.signature(getattr(type(engine), name))} "
            f"differs from {protocol.__name__}.{name}{signature}"
        )


@pytest.fixture
def fake_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "tui"))
    from tui_fakes import FakeEngine

    return FakeEngine()


def test_the_protocols_declare_what_the_interfaces_call():
    attributes, methods = declared(ChatEngine)
    assert attributes == {"name", "path", "default_sampling"}
    assert set(methods) == {"settings", "conversation", "close_conversation", "send", "cancel", "kv_capacity", "close"}
    attributes, methods = declared(LocalEngine)
    assert {"model", "tokenizer", "template", "eos_ids"} <= attributes and "send" in methods


def test_the_local_engine_offers_both(stories):
    assert isinstance(stories, Engine)
    assert_offers(stories, ChatEngine)
    assert_offers(stories, LocalEngine)


def test_the_remote_engine_offers_the_chat_surface():
    engine = RemoteEngine("http://127.0.0.1:1", model="some-model")  # a model named: nothing is asked of the server
    try:
        assert_offers(engine, ChatEngine)
        assert not isinstance(engine, LocalEngine)  # it has no model here for the server to batch on
    finally:
        engine.close()


def test_the_tests_fake_engine_offers_the_chat_surface(fake_engine):
    assert_offers(fake_engine, ChatEngine)


def test_an_engine_missing_a_member_is_not_one(fake_engine):
    attributes, methods = declared(ChatEngine)
    no_cancel = type("NoCancel", (), {name: getattr(type(fake_engine), name) for name in methods if name != "cancel"})()
    for name in attributes:
        setattr(no_cancel, name, getattr(fake_engine, name))
    assert not isinstance(no_cancel, ChatEngine)
    no_cancel.cancel = fake_engine.cancel
    assert isinstance(no_cancel, ChatEngine)
