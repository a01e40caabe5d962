"""Each device's MLX routes live in its own folder behind one dispatch object (backends/mlx/ops.py):
the CPU path never imports the CUDA one, and the ops are chosen once, at load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, sys
import ferrum_mac
model = ferrum_mac.open_model(sys.argv[1], backend="mlx", device="cpu", dtype="float32")
model.prepare("a", 16)
model.decode("a", model.prefill("a", [1, 2, 3]).argmax(), 3)
print(json.dumps({"ops": type(model.ops).__name__, "modules": sorted(n for n in sys.modules if ".mlx.cuda" in n)}))
"""


def test_the_cpu_path_imports_no_cuda_module(zoo):
    """A fresh process that opens, prepares and runs a model on MLX's CPU loads nothing from
    `backends/mlx/cuda/`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(zoo.path("qwen3"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"ops": "CpuOps", "modules": []}


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="this machine's MLX computes on the CPU")
def test_the_runtime_picks_the_devices_ops_once(zoo):
    import ferrum_mac
    from ferrum_mac.backends.mlx.cpu.ops import CpuOps

    model = ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")
    assert isinstance(model.ops, CpuOps) and model.segment_type is CpuOps.segment_type
    block = model.model.layers[0]
    assert block.ops is model.ops and block.attn.ops is model.ops


def test_the_settings_reach_the_ops_through_the_composition_root(zoo, monkeypatch):
    """A switch set in the environment is read once, by `compose.backend_options`, and the
    model's ops and layers carry it."""
    import ferrum_mac

    monkeypatch.setenv("FERRUM_MLX_COMPILE_MAX_TOKENS", "0")
    monkeypatch.setenv("FERRUM_MLX_NUMPY_ATTENTION", "0")
    model = ferrum_mac.open_model(zoo.path("llama"), backend="mlx", dtype="float32")
    assert model.ops.options.compile_max_tokens == 0 and not model.ops.options.numpy_attention
    assert model.model.layers[0].compile_max_tokens == 0
    monkeypatch.delenv("FERRUM_MLX_COMPILE_MAX_TOKENS")
    assert ferrum_mac.open_model(zoo.path("llama"), backend="mlx").model.layers[0].compile_max_tokens == 16
