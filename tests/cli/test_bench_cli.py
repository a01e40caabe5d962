"""`ferrum bench MODEL` on a real model whose context is shorter than the default prompt + new tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FERRUM = [sys.executable, "-c", "from ferrum_mac.cli import main; main()"]


@pytest.mark.slow
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


WITHOUT_MLX_LM = [
    sys.executable,
    "-c",
    "import sys; sys.modules['mlx_lm'] = None; from ferrum_mac.cli import main; main()",
]


def test_bench_no_peer_needs_no_mlx_lm(smollm2_gguf):
    args = ["bench", str(smollm2_gguf), "--backend", "mlx", "--device", "cpu", "--runs", "1", "--json"]
    args += ["--prompt-tokens", "16", "--new-tokens", "4"]
    proc = subprocess.run(WITHOUT_MLX_LM + args + ["--no-peer"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["mlx_lm"] is None and report["ferrum"]["decode_tps"] > 0
    proc = subprocess.run(WITHOUT_MLX_LM + args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("ferrum: ferrum bench compares against mlx-lm")
    proc = subprocess.run(
        WITHOUT_MLX_LM + ["bench", "--shape", "qwen3-0.6b", "--no-peer"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "--shape builds its weights with mlx-lm" in proc.stderr


def test_bench_turns_reuses_the_cache(shared_assets):
    model = shared_assets / "stories260K"
    args = ["bench", "turns", str(model), "--turns", "2", "--answer-tokens", "4", "--runs", "1", "--json"]
    proc = subprocess.run(FERRUM + args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["turn"] == 2 and report["model"] == str(model)
    assert report["reuse"]["cached"] > 0 and report["re_prefill"]["cached"] == 0
    assert report["reuse"]["prefilled"] < report["re_prefill"]["prefilled"] == report["history_tokens"]


def test_bench_prefix_prints_each_figure_beside_its_cold_one(shared_assets, tmp_path):
    model = shared_assets / "stories260K"
    sizes = ["--conversation-tokens", "200", "--last-message-tokens", "20", "--steps", "4", "--step-tokens", "40"]
    sizes += ["--answer-tokens", "8", "--shared-tokens", "150", "--requests", "4", "--own-tokens", "16"]
    env = {**os.environ, "FERRUM_CACHE_DIR": str(tmp_path), "FERRUM_PREFIX_DISK_MB": "64"}  # (b) reads the disk
    proc = subprocess.run(
        FERRUM + ["bench", "prefix", "--model", str(model), *sizes, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    again, restart, replay, concurrent = (report[k] for k in ("again", "restart", "replay", "concurrent"))
    assert again["cached_tokens"] == 180 and again["prompt_tokens"] == 200  # all but the new last message
    assert again["ttft_cached_s"] < again["ttft_cold_s"]
    assert restart["cached_tokens"] >= 160 and restart["disk_tokens_loaded"] >= 160  # full blocks, from disk
    assert replay["new_tokens"] <= replay["computed_tokens"] <= replay["new_tokens"] + 4 * 32  # (a block a step)
    assert concurrent["cached_tokens"] >= 3 * 128  # three of the four took the shared prompt's full blocks
    assert set(report["goals"]) >= {"ttft_cached_over_cold", "computed_over_new", "peak_over_alone_plus_own"}

    proc = subprocess.run(
        FERRUM + ["bench", "prefix", "--model", str(model), "--steps", "0"], capture_output=True, text=True
    )
    assert proc.returncode == 1 and proc.stderr.strip() == "ferrum: --steps must be at least 1"


def test_bench_first_token_passes_its_arguments_to_run(shared_assets):
    model = shared_assets / "stories260K"
    args = ["bench", "first-token", "--runs", "1", str(model), "--max-tokens", "4", "hi"]
    proc = subprocess.run(FERRUM + args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"ferrum run {model} --max-tokens 4 hi: first answer byte ")
    assert "median of 1" in proc.stdout


def test_bench_subcommands_parse_apart_from_the_speed_bench(monkeypatch):
    from typer.testing import CliRunner

    import ferrum_mac.bench
    import ferrum_mac.bench.first_token
    from ferrum_mac.cli import app

    calls = []
    monkeypatch.setattr(ferrum_mac.bench, "run_bench", lambda **kwargs: calls.append(("speed", kwargs)))
    monkeypatch.setattr(ferrum_mac.bench.first_token, "run_first_token", lambda *args: calls.append(("first", args)))
    runner = CliRunner()
    assert runner.invoke(app, ["bench", "some-model", "--runs", "2", "--json"]).exit_code == 0
    assert (
        runner.invoke(app, ["bench", "first-token", "--runs", "3", "--backend", "torch", "m.gguf", "hi"]).exit_code == 0
    )
    assert runner.invoke(app, ["bench", "first-token"]).exit_code == 0
    (_, speed), first, first_default = calls
    assert (speed["model"], speed["runs"], speed["json_out"], speed["backend"]) == ("some-model", 2, True, "auto")
    assert first == ("first", (["--backend", "torch", "m.gguf", "hi"], 3))  # unknown options go to `ferrum run`
    assert first_default == ("first", (["hi"], 5))


def test_bench_model_before_a_subcommand_is_one_line_error(shared_assets):
    proc = subprocess.run(
        FERRUM + ["bench", str(shared_assets / "stories260K"), "turns"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "turns comes first" in proc.stderr
