"""A conversation's settings as stored (a small JSON dict) and as the engine takes them.

Keys: system, temperature, top_p, max_tokens, think, context_policy, speculate. A missing or
None value means the model's default (for speculate: auto). `speculate` is stored as the word
`ferrum run --speculate` takes: ngram, off or draft:MODEL.
"""

from __future__ import annotations

from ferrum_mac.engine import TRUNCATE_OLDEST, ChatEngine, ChatSettings
from ferrum_mac.engine.speculation import Speculate, draft_name

KEYS = ("system", "temperature", "top_p", "max_tokens", "think", "context_policy", "speculate")
DEFAULTS = {"context_policy": TRUNCATE_OLDEST}  # a chat app keeps going when the context fills
AUTO = "auto"


def stored_settings(base: dict | None = None, **changes) -> dict:
    """Defaults, then `base`, then `changes`, keeping only known keys that are set."""
    merged = {**DEFAULTS, **(base or {}), **changes}
    if merged.get("speculate") == AUTO:  # the default: nothing to store
        merged["speculate"] = None
    return {k: merged[k] for k in KEYS if merged.get(k) is not None}


def wanted_draft(stored: dict) -> str | None:
    """The draft model the settings name (`speculate` is draft:MODEL), else None."""
    return draft_name(stored.get("speculate") or "")


def engine_settings(engine: ChatEngine, stored: dict, draft: Speculate | None = None) -> ChatSettings:
    """The engine's ChatSettings for a stored settings dict (raises FerrumError on a bad value).
    `draft`: the loaded draft model; settings that name another, or one not loaded yet, speculate
    with auto until it is."""
    sampling = engine.default_sampling.replace(temperature=stored.get("temperature"), top_p=stored.get("top_p"))
    return engine.settings(
        system=stored.get("system") or None,
        sampling=sampling,
        max_tokens=stored.get("max_tokens"),
        think=stored.get("think"),
        context_policy=stored.get("context_policy", DEFAULTS["context_policy"]),
        speculate=speculation(stored, draft),
    )


def speculation(stored: dict, draft: Speculate | None = None) -> Speculate:
    name = wanted_draft(stored)
    if name is None:
        return Speculate.parse(stored.get("speculate") or AUTO)
    return draft if draft is not None and draft.draft_name == name else Speculate()
