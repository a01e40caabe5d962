"""A conversation's settings as stored (a small JSON dict) and as the engine takes them.

Keys: system, temperature, top_p, max_tokens, think, context_policy. A missing or None value
means the model's default.
"""

from __future__ import annotations

from ferrum_mac.engine import TRUNCATE_OLDEST, ChatEngine, ChatSettings

KEYS = ("system", "temperature", "top_p", "max_tokens", "think", "context_policy")
DEFAULTS = {"context_policy": TRUNCATE_OLDEST}  # a chat app keeps going when the context fills


def stored_settings(base: dict | None = None, **changes) -> dict:
    """Defaults, then `base`, then `changes`, keeping only known keys that are set."""
    merged = {**DEFAULTS, **(base or {}), **changes}
    return {k: merged[k] for k in KEYS if merged.get(k) is not None}


def engine_settings(engine: ChatEngine, stored: dict) -> ChatSettings:
    """The engine's ChatSettings for a stored settings dict (raises FerrumError on a bad value)."""
    sampling = engine.default_sampling.replace(temperature=stored.get("temperature"), top_p=stored.get("top_p"))
    return engine.settings(
        system=stored.get("system") or None,
        sampling=sampling,
        max_tokens=stored.get("max_tokens"),
        think=stored.get("think"),
        context_policy=stored.get("context_policy", DEFAULTS["context_policy"]),
    )
