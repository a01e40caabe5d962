"""A newcomer's machine for the CLI tests: a store holding only the bundled model, no network."""

from __future__ import annotations

import os

import pytest

from ferrum_mac.store.bundled import SMOLLM2


@pytest.fixture(scope="module")
def newcomer_env(smollm2_gguf, tmp_path_factory) -> dict:
    """The environment of a subprocess that finds the bundled model in the store (as after the
    first `ferrum run`), no other model, and the Hub switched off."""
    home = tmp_path_factory.mktemp("newcomer")
    folder = home / "data" / "ferrum_mac" / "models" / SMOLLM2.name
    folder.mkdir(parents=True)
    (folder / SMOLLM2.filename).symlink_to(smollm2_gguf)
    variables = {
        **os.environ,
        "XDG_DATA_HOME": str(home / "data"),
        "HF_HOME": str(home / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }
    variables.pop("FERRUM_MODEL", None)
    return variables
