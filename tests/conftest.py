"""Session-wide fixtures: tiny random checkpoints built once, real assets located or fetched once."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

_STARTED = time.time()  # before ferrum and torch load: the time --fast prints is the whole run's

from ferrum_mac.backends import route_cpu_blas  # noqa: E402

route_cpu_blas()  # before any test module imports MLX, as the composition root does


def _interpret_triton_without_a_gpu() -> None:
    """Triton reads TRITON_INTERPRET when a kernel is defined: set it before any test module
    imports triton (through the torch backend or a kernel test), whatever order the tests
    run in (pytest-xdist gives each worker its own), so kernels run in the interpreter here."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_a_gpu()

import helpers  # noqa: E402
import tiers  # noqa: E402

# The tokenizers library forks worker threads and warns when the process forks later on.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# Test tiers (`--fast` leaves out the heavy ones; CI runs every tier).
TIERS = {
    "interpreter": "Triton kernels run under Triton's CPU interpreter (on a GPU: compiled)",
    "real_model": "runs the bundled SmolLM2-135M GGUF (fetched once into the user cache)",
    "slow": "takes several seconds on this project's 2-core machines, or its file does",
    "gpu": "needs a CUDA GPU; skips without one",
}
HEAVY_TIERS = ("interpreter", "real_model", "slow")
INTERPRETER_FILES = ("test_triton_ops.py", "test_triton_gemv.py", "test_triton_moe.py")
REAL_MODEL_FIXTURES = ("smollm2_gguf",)


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"the edit-test loop: leave out the {', '.join(HEAVY_TIERS)} tiers, and print the run's time",
    )


def pytest_configure(config):
    for name, doc in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config, items):
    """Tiers by where a test lives, what it uses and what its file costs, so a new test lands
    in the right tier without remembering a decorator."""
    costs = tiers.file_costs()
    for item in items:
        if item.path.name in INTERPRETER_FILES:
            item.add_marker(pytest.mark.interpreter)
        if any(name in REAL_MODEL_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if not in_heavy_tier(item):  # before its file's cost has a say; scripts/test-costs.py reads it
            item.user_properties.append(("tier", "fast"))
        if tiers.is_slow(item.path, costs):
            item.add_marker(pytest.mark.slow)
    if config.getoption("fast"):
        leave_out_heavy_tiers(config, items)
    costliest_first(items, costs)


def in_heavy_tier(item) -> bool:
    return any(item.get_closest_marker(tier) for tier in HEAVY_TIERS)


def leave_out_heavy_tiers(config, items) -> None:
    config.hook.pytest_deselected(items=[item for item in items if in_heavy_tier(item)])
    items[:] = [item for item in items if not in_heavy_tier(item)]


def costliest_first(items, costs: dict[str, tiers.Cost]) -> None:
    """The costliest files first (each in its own order): pytest-xdist hands out whole files in
    this order (scripts/test asks it to), so the long ones start early instead of ending last."""
    items.sort(key=lambda item: -tiers.cost_of(item.path, costs).every)


def pytest_terminal_summary(terminalreporter, config):
    """How many tests the fast tier ran, and in how long (its goal: a few minutes)."""
    if not config.getoption("fast"):
        return
    outcomes = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
    ran = {report.nodeid for outcome in outcomes for report in terminalreporter.stats.get(outcome, ())}
    minutes, seconds = divmod(round(time.time() - _STARTED), 60)
    terminalreporter.write_line(f"fast tier: {len(ran):,} tests in {minutes}m{seconds:02d}s")


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """ferrum's cache (the MLX CPU build's dense weight copies) in a folder of this session,
    not the user's; subprocesses inherit it."""
    folder = tmp_path_factory.mktemp("ferrum-cache")
    os.environ["FERRUM_CACHE_DIR"] = str(folder)
    # The prefix cache's disk tier off unless a test turns it on: a prompt one test's model
    # wrote to disk must not be a hit for another test's.
    os.environ["FERRUM_PREFIX_DISK_MB"] = "0"
    os.environ["FERRUM_RESPONSES_DAYS"] = "0"  # servers keep /v1/responses in memory, not in the user's data folder
    yield folder
    shutil.rmtree(folder, ignore_errors=True)  # copies of real models are hundreds of MB


class TinyZoo:
    """Tiny random checkpoints by family, built on first use and shared by the whole session."""

    def __init__(self, root: Path):
        self.root = root
        self._hf: dict = {}
        self._paths: dict = {}
        self._ferrum: dict = {}

    def hf(self, family: str):
        """The transformers model (fp32) every checkpoint of `family` was saved from."""
        if family not in self._hf:
            self._hf[family] = helpers.build_hf_model(family)
        return self._hf[family]

    def path(self, family: str, dtype: str = "float32", shards: bool = False) -> Path:
        """A safetensors folder of `family` saved in `dtype` (sharded with an index when asked)."""
        key = (family, dtype, shards)
        if key not in self._paths:
            import torch

            folder = self.root / f"{family}-{dtype}{'-sharded' if shards else ''}"
            kwargs = {"max_shard_size": "40KB"} if shards else {}
            helpers.save_hf_model(self.hf(family), folder, dtype=getattr(torch, dtype), **kwargs)
            self._paths[key] = folder
        return self._paths[key]

    def ferrum(self, family: str, backend: str = "mlx"):
        """One fp32 ferrum model per family and backend, shared by tests that use distinct cache ids."""
        if (family, backend) not in self._ferrum:
            import ferrum_mac

            self._ferrum[family, backend] = ferrum_mac.open_model(self.path(family), backend=backend, dtype="float32")
        return self._ferrum[family, backend]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> TinyZoo:
    return TinyZoo(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def shared_assets() -> Path:
    if not helpers.ASSETS.is_dir():
        pytest.skip("shared assets not found (looked for a 'shared/assets' folder next to the repository)")
    return helpers.ASSETS


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF, fetched once into the user cache (skips when offline)."""
    import platformdirs

    from ferrum_mac.errors import FerrumError
    from ferrum_mac.store.bundled import ensure_smollm2

    cache = Path(platformdirs.user_cache_dir("ferrum_mac")) / "test-assets" / "smollm2-135m-instruct"
    try:
        return ensure_smollm2(cache, progress=True)
    except FerrumError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
