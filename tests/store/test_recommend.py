"""A model sized to this machine's memory, recommended beside the bundled demo model, and what
an empty store suggests."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ferrum_mac.cli import app
from ferrum_mac.store.recommend import demo_model_line, first_model_lines, recommended_model

GB = 10**9


@pytest.mark.parametrize(
    "memory, backend, name",
    [
        (64 * GB, "mlx", "qwen3:30b-a3b"),
        (16 * GB, "mlx", "qwen3:8b"),
        (8 * GB, "mlx", "qwen3:4b"),
        (2 * GB, "mlx", "qwen3:0.6b"),
        (16 * GB, "torch", "qwen3:1.7b"),  # bf16 weights: four times the bytes
    ],
)
def test_the_largest_model_whose_weights_fit_in_part_of_memory(memory, backend, name):
    best = recommended_model(memory, backend)
    assert best is not None and best.name == name and best.weight_bytes <= 0.4 * memory


def test_no_recommendation_where_nothing_fits():
    assert recommended_model(GB // 2) is None
    assert "`ferrum list --available`" in demo_model_line("smollm2:135m", [], GB // 2)


def test_demo_model_line_names_the_model_that_it_is_small_and_the_pull():
    line = demo_model_line("smollm2:135m", [], 16 * GB)
    assert "\n" not in line
    assert line.startswith("smollm2:135m is a small demo model (135M parameters)")
    assert "16.0 GB" in line and "`ferrum pull qwen3:8b`" in line


def test_no_demo_line_for_another_model_or_once_another_is_here():
    assert demo_model_line("qwen3:8b", [], 16 * GB) == ""
    assert demo_model_line("smollm2:135m", ["qwen3:4b"], 16 * GB) == ""


def test_an_empty_store_suggests_the_demo_model_first(hf_home):
    out = CliRunner().invoke(app, ["list"]).stdout
    first, second = out.splitlines()
    assert first.startswith("no models yet; `ferrum run` fetches the bundled demo model smollm2:135m")
    assert "`ferrum pull qwen3:" in second


def test_an_empty_store_offline_suggests_only_what_works(hf_home, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as HF_HUB_OFFLINE=1 at start-up sets it
    out = CliRunner().invoke(app, ["list"]).stdout
    assert "`ferrum run`" in out and "ferrum pull" not in out


def test_first_model_lines_offline():
    assert len(first_model_lines(16 * GB, hub_offline=True)) == 2
    assert "ferrum pull" not in "".join(first_model_lines(16 * GB, hub_offline=True))
