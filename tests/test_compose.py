"""The composition root (ferrum_mac/compose.py): settings become parameters there, and the
engine depends on no backend and no store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def stories_path(shared_assets) -> Path:
    folder = shared_assets / "stories260K"
    if not (folder / "model.safetensors").is_file():
        pytest.skip("stories260K is not in the shared assets")
    return folder


def test_kv_capacity_is_a_parameter_that_wins_over_the_setting(stories_path, monkeypatch):
    from ferrum_mac.compose import open_engine, open_model

    monkeypatch.setenv("FERRUM_KV_CAPACITY", "48")
    assert open_model(stories_path, dtype="float32").kv_capacity() == 48  # the setting as the default
    engine = open_engine(stories_path, kv_capacity=40)
    assert engine.kv_capacity() == 40
    assert engine.device.split(" · ")[0] in ("mlx", "torch") and " · " in engine.device


def test_the_engine_imports_no_backend_no_store_and_no_array_library():
    code = (
        "import sys, ferrum_mac, ferrum_mac.engine\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'torch')"
        " or m.startswith(('ferrum_mac.backends', 'ferrum_mac.store', 'ferrum_mac.compose'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
