"""The store's `ferrum` commands (pull, list, rm, show): arguments in, text out. cli.py calls these."""

from __future__ import annotations

import sys

from ferrum_mac.store.units import human_age, human_bytes


def pull_command(name: str, backend: str) -> None:
    from ferrum_mac.store.progress import TerminalProgress
    from ferrum_mac.store.pull import pull

    path = pull(name, backend, TerminalProgress())
    print(f"{name} is ready: {path}")


def list_command(available: bool, backend: str) -> None:
    if available:
        from ferrum_mac.store.aliases import alias_table

        print_table(["NAME", f"FETCHES ({backend})"], alias_table(backend))
        print("\nAdd -8bit or -bf16 for other precisions (qwen3:8b-8bit); any Hugging Face repo id works too.")
        return
    from ferrum_mac.store.catalog import list_models

    models = list_models()
    complete = [m for m in models if m.complete]
    if not complete:
        from ferrum_mac.store.pull import hub_offline
        from ferrum_mac.store.recommend import first_model_lines, machine_memory_bytes

        print("\n".join(first_model_lines(machine_memory_bytes(), backend, hub_offline())))
    else:
        print_table(
            ["NAME", "SIZE", "QUANT", "FORMAT", "MODIFIED"],
            [(m.name, _size_with_copies(m), m.quant, m.format, human_age(m.modified)) for m in complete],
        )
    for m in models:
        if not m.complete:
            print(
                f"unfinished: {m.name} ({human_bytes(m.size)}); `ferrum pull {m.name}` finishes it, "
                f"`ferrum rm {m.name}` deletes it",
                file=sys.stderr,
            )


def _size_with_copies(model) -> str:
    """The model's size, and beside it that of the dense copy MLX's CPU build keeps of it, if any."""
    from ferrum_mac.store.derived import copies_of

    copies = sum(p.stat().st_size for p in copies_of(model.path))
    return human_bytes(model.size) + (f" + {human_bytes(copies)} dense copy" if copies else "")


def rm_command(name: str, yes: bool, backend: str) -> None:
    import typer

    from ferrum_mac.store.remove import plan_removal

    removal = plan_removal(name, backend)
    if not yes and not typer.confirm(removal.question(), default=False):
        print("nothing removed")
        raise typer.Exit(1)
    print(f"removed {name} ({human_bytes(removal.execute())} freed)")


def show_command(name: str, backend: str) -> None:
    from ferrum_mac.store.describe import describe
    from ferrum_mac.store.resolve import resolve_model

    path = resolve_model(name, backend, pull=False)
    facts = describe(path)
    rows = [
        ("name", name),
        ("path", str(path)),
        ("architecture", facts.architecture or "?"),
        ("parameters", _count(facts.parameters)),
        ("context length", f"{facts.context_length:,}" if facts.context_length else "?"),
        ("quantization", facts.quantization),
        *([("tensor types", facts.types)] if facts.types else []),
        ("format", facts.format),
        ("chat template", "yes" if facts.chat_template else "no"),
        ("license", facts.license or "not stated"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _count(n: int | None) -> str:
    if not n:
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def print_table(header: list[str], rows: list) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("   ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())
