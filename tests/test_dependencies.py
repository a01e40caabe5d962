"""What the optional dependencies leave out: the torch backend runs where MLX is not installed,
and `ferrum bench` names the extra it needs (mlx-lm) instead of failing on an import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_close, hf_logits, random_tokens

ROOT = Path(__file__).resolve().parent.parent
PROMPT = random_tokens(24, seed=5)

BLOCK = """
import sys
class Absent:  # as if these packages were not installed
    names = {names!r}
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in cls.names:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent)
"""


def run_without(names: tuple[str, ...], code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK.format(names=names) + code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_torch_backend_opens_safetensors_without_mlx(zoo, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "logits.json"
    code = f"""
import ferrum_mac
model = ferrum_mac.open_model({str(zoo.path("llama"))!r}, backend="torch", dtype="float32")
logits = model.forward_verify("a", {PROMPT!r})
assert not any(m == "mlx" or m.startswith("mlx.") for m in sys.modules), "MLX was imported"
import json; open({str(out)!r}, "w").write(json.dumps(logits.tolist()))
"""
    done = run_without(("mlx", "mlx_lm"), code)
    assert done.returncode == 0, done.stderr[-2000:]
    import torch

    got = torch.tensor(json.loads(out.read_text()))
    assert_close(got, hf_logits(zoo.hf("llama"), PROMPT), 1e-4)


def test_bench_without_mlx_lm_names_the_extra():
    done = run_without(
        ("mlx_lm",), "from ferrum_mac.cli import main\nsys.argv = ['ferrum', 'bench', '--shape', 'qwen3-0.6b']\nmain()"
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'ferrum-mac[bench]'" in lines[0] and "mlx-lm" in lines[0], done.stderr


def test_torch_backend_reads_safetensors_without_going_through_mlx(zoo):
    """Even where MLX is installed, a dense checkpoint goes file -> torch on the device."""
    pytest.importorskip("torch")
    code = f"""
import sys, ferrum_mac
model = ferrum_mac.open_model({str(zoo.path("llama"))!r}, backend="torch", dtype="float32")
print(sorted(m for m in sys.modules if m == "mlx" or m.startswith("mlx.")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
