"""README's layout block: generated from the tree by scripts/readme-layout, and kept current."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    path = ROOT / "scripts" / "readme-layout"
    loader = importlib.machinery.SourceFileLoader("readme_layout", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


layout = load_script()


def test_readme_block_is_the_generated_one():
    _, current, _ = layout.readme_parts((ROOT / "README.md").read_text(encoding="utf-8"))
    assert current == layout.block(), "README's layout block is stale: run scripts/readme-layout --write"


def test_every_package_module_and_script_says_what_it_is_for():
    assert layout.undescribed() == [], "give these a docstring (a script: a comment line after the shebang)"


def test_a_summary_is_the_first_line_cut_back_to_a_whole_phrase():
    assert layout.summary("Stop strings in a stream of text deltas.") == "Stop strings in a stream of text deltas"
    assert layout.summary("The KV manager: MLX buffers for blocks. Per layer one key buffer and one\nvalue.") == (
        "The KV manager: MLX buffers for blocks"
    )
    runs_on = "Speculation in `ferrum serve`: which sequences add guesses, and how many guesses\nthey add."
    assert layout.summary(runs_on) == "Speculation in `ferrum serve`"  # a colon's clause before a comma's
    assert layout.summary("Time from process start to the first byte, the model\nalready on disk.") == (
        "Time from process start to the first byte"
    )
    bracketed = "`RemoteEngine`: any OpenAI-compatible server (ferrum serve, vLLM, Ollama) in the\nengine's place."
    assert layout.summary(bracketed) == "`RemoteEngine`: any OpenAI-compatible server (ferrum serve, vLLM, Ollama)"
    unclosed = "The store's models as Ollama describes them (/api/tags, /api/show entries: details,\ndigests)."
    assert layout.summary(unclosed) == "The store's models as Ollama describes them"
