"""ferrum_mac/settings.py: one table of settings, read through it alone, and README's copy of it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferrum_mac import settings
from ferrum_mac.settings import SettingError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ferrum_mac"
TABLE = re.compile(
    r"<!-- settings table: python -m ferrum_mac.settings --markdown -->\n(.*?)<!-- end of settings table -->", re.S
)


def test_readme_table_is_the_generated_one():
    found = TABLE.search((ROOT / "README.md").read_text(encoding="utf-8"))
    assert found, "README.md lost its settings table markers"
    generated = subprocess.run(
        [sys.executable, "-m", "ferrum_mac.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert found.group(1) == generated, "README's table is stale: paste `python -m ferrum_mac.settings --markdown`"


def python_files():
    return [p for p in PACKAGE.rglob("*.py") if p.name != "settings.py"]


def test_no_module_reads_a_ferrum_variable_but_the_settings_module():
    """`os.environ[...]`, `.get(...)`, `getenv(...)` of a FERRUM_ name anywhere else is a setting
    hidden from the table."""
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Subscript, ast.Call)):
                text = ast.unparse(node)
                if ("environ" in text or "getenv" in text) and "FERRUM_" in text:
                    pytest.fail(f"{path.relative_to(ROOT)} reads {text!r}; read it through ferrum_mac.settings")


def test_every_ferrum_variable_named_in_the_code_and_scripts_is_declared():
    named = set()
    for path in [*python_files(), *(ROOT / "scripts").iterdir(), PACKAGE / "backends/mlx/cpu/_cpu_blas.c"]:
        if path.is_file():
            named |= set(
                re.findall(r"\bFERRUM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8", errors="replace"))
            )
    assert named - set(settings.BY_NAME) == set()


def test_values_are_parsed_and_bad_ones_are_one_line_errors_naming_the_variable(monkeypatch):
    for name in ("FERRUM_KV_CAPACITY", "FERRUM_TORCH_PDL", "FERRUM_TORCH_GEMV", "FERRUM_TORCH_MOE_ROUTE"):
        monkeypatch.delenv(name, raising=False)
    assert settings.value("FERRUM_KV_CAPACITY") is None and settings.value("FERRUM_TORCH_PDL") is True
    assert settings.value("FERRUM_TORCH_GEMV") == {"norm_swiglu", "matmul_residual", "norm_qkv_rope"}
    monkeypatch.setenv("FERRUM_KV_CAPACITY", " 512 ")
    monkeypatch.setenv("FERRUM_TORCH_PDL", "off")
    monkeypatch.setenv("FERRUM_TORCH_GEMV", "")  # set but empty: no GEMV kernels, not the default
    monkeypatch.setenv("FERRUM_TORCH_MOE_ROUTE", "Gathered")
    assert settings.value("FERRUM_KV_CAPACITY") == 512 and settings.value("FERRUM_TORCH_PDL") is False
    assert settings.value("FERRUM_TORCH_GEMV") == frozenset() and settings.value("FERRUM_TORCH_MOE_ROUTE") == "gathered"
    for name, bad in (
        ("FERRUM_KV_CAPACITY", "lots"),
        ("FERRUM_KV_CAPACITY", "0"),
        ("FERRUM_TORCH_PDL", "maybe"),
        ("FERRUM_TORCH_MOE_ROUTE", "sideways"),
    ):
        monkeypatch.setenv(name, bad)
        with pytest.raises(SettingError) as err:
            settings.value(name)
        assert name in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(KeyError, match="not declared"):
        settings.value("FERRUM_NO_SUCH_THING")


def test_user_folders_follow_the_cache_setting(monkeypatch, tmp_path):
    from ferrum_mac.store.derived import dense_dir
    from ferrum_mac.store.history import default_path

    monkeypatch.setenv("FERRUM_CACHE_DIR", str(tmp_path))
    assert dense_dir() == settings.dense_weights_dir() == tmp_path / "dense-weights"
    assert default_path() == settings.history_db_path() and default_path().parent == settings.data_dir()


READERS = {"value", "raw", "setting", "BY_NAME", "SETTINGS"}


def test_only_the_settings_module_and_the_composition_root_read_settings():
    """Everything else gets its settings as parameters (the backends: `BackendOptions`). The
    folder functions (`settings.history_db_path()` and kin) may be imported where the files live."""
    for path in python_files():
        name = path.relative_to(PACKAGE).as_posix()
        if name == "compose.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(a.name == "ferrum_mac.settings" for a in node.names):
                pytest.fail(f"ferrum_mac/{name} imports ferrum_mac.settings; take the value as a parameter")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "ferrum_mac"
                and any(a.name == "settings" for a in node.names)
            ):
                pytest.fail(f"ferrum_mac/{name} imports ferrum_mac.settings; take the value as a parameter")
            if isinstance(node, ast.ImportFrom) and node.module == "ferrum_mac.settings":
                read = READERS & {a.name for a in node.names}
                assert not read, f"ferrum_mac/{name} reads settings ({', '.join(sorted(read))})"


def test_backend_options_default_to_the_table_and_follow_the_environment(monkeypatch):
    from ferrum_mac.backends.options import SETTING_OF, BackendOptions
    from ferrum_mac.compose import backend_options

    for option, name in SETTING_OF.items():
        monkeypatch.delenv(name, raising=False)
        assert getattr(BackendOptions(), option) == settings.setting(name).default, name
    assert set(SETTING_OF) == set(BackendOptions.__dataclass_fields__) - {"prefix_dir"}  # a folder, not a setting
    assert backend_options() == BackendOptions(prefix_dir=settings.prefix_cache_dir())
    monkeypatch.setenv("FERRUM_MLX_CUDA_HEADS", "0")
    monkeypatch.setenv("FERRUM_TORCH_GEMV", "norm_matmul")
    options = backend_options()
    assert not options.cuda_heads and options.torch_gemv == {"norm_matmul"} and options.cuda_qmm
