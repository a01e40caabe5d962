"""A name anyone may type -> a local model path, pulling it when allowed."""

from __future__ import annotations

from pathlib import Path

from ferrum_mac.errors import FerrumError, ModelNotFoundError
from ferrum_mac.store.aliases import BundledRef, parse_name
from ferrum_mac.store.local import bundled_model, cached_model
from ferrum_mac.store.paths import exists, is_broken_link, shown
from ferrum_mac.store.progress import PullProgress


def resolve_model(
    name: str | Path, backend: str = "mlx", pull: bool = True, progress: PullProgress | None = None
) -> Path:
    """A folder, .gguf file, alias (`qwen3:0.6b`) or repo id (`org/name[@rev][:QUANT]`) -> local path.

    Uses a complete cached copy when there is one (no network); otherwise downloads it when
    `pull` is true (with `progress`, a terminal display by default) and raises
    ModelNotFoundError naming `ferrum pull` when it is not.
    """
    text = str(name)
    path = Path(text).expanduser()
    if exists(path) or is_broken_link(path):  # the loader says what is wrong with a broken one
        return path
    if looks_like_path(text):
        raise ModelNotFoundError(f"{shown(text)} does not exist; give a model folder, a .gguf file or a model name")
    if _bundled_on_torch(text, backend):
        backend = "mlx"  # the same file on both backends
    ref = parse_name(text, backend)
    local = bundled_model() if isinstance(ref, BundledRef) else cached_model(ref)
    if local is not None:
        return local
    if not pull:
        flag = " --backend torch" if backend == "torch" else ""
        raise ModelNotFoundError(f"{text} is not downloaded; run `ferrum pull {text}{flag}`")
    from ferrum_mac.store.progress import TerminalProgress
    from ferrum_mac.store.pull import pull as pull_model

    return pull_model(text, backend, progress or TerminalProgress())


def _bundled_on_torch(text: str, backend: str) -> bool:
    """Whether `text` is the bundled model's alias and torch can read its GGUF (dequantized at
    load, through MLX's GGUF reader): then torch runs the bundled file, offline too, instead
    of fetching the original weights from the Hub."""
    from ferrum_mac.backends import available

    if backend != "torch" or not available("mlx"):
        return False
    try:
        return isinstance(parse_name(text, "mlx"), BundledRef)
    except FerrumError:
        return False


def looks_like_path(text: str) -> bool:
    """Whether `text` is written as a path (not an alias or a repo id)."""
    before_revision = text.split("@", 1)[0]
    return text.startswith((".", "/", "~")) or before_revision.endswith(".gguf") or before_revision.count("/") > 1
