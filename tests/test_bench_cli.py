"""`ferrum bench MODEL` on a real model whose context is shorter than the default prompt + new tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FERRUM = [sys.executable, "-c", "from ferrum_mac.cli import main; main()"]


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_bench_fits_the_defaults_into_a_short_context(shared_assets, backend):
    if backend == "torch":
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    model = shared_assets / "stories260K"  # a 512-token context, under the default 512 + 128
    args = ["bench", str(model), "--backend", backend, "--device", "cpu", "--runs", "1", "--no-peer", "--json"]
    proc = subprocess.run(FERRUM + args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["prompt_tokens"] + report["new_tokens"] <= 512
    assert report["prompt_tokens"] >= 256 and report["ferrum"]["decode_tps"] > 0
    notices = [line for line in proc.stderr.splitlines() if "context holds 512 tokens" in line]
    assert len(notices) == 1 and "instead of 512 + 128" in notices[0]
