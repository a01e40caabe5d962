"""Every setting ferrum reads from the environment, and the folders it keeps files in.

One table, `SETTINGS`: each setting's name, type, default, what reads it and what it does.
Code reads a setting through `value(name)` (parsed, checked, the default when unset), never
through `os.environ`; a setting that is not declared here cannot be read. README's
"Environment" table is generated from this one: `python -m ferrum_mac.settings --markdown`.

A/B switches that a benchmark still uses are named `FERRUM_<BACKEND>_<THING>` (`FERRUM_MLX_*`,
`FERRUM_TORCH_*`); they exist to time a fast path against the plain one, not for users.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ferrum_mac.errors import FerrumError

APP_NAME = "ferrum_mac"  # the folder name under the platform's user folders
OFF_WORDS, ON_WORDS = ("0", "off", "no", "false"), ("1", "on", "yes", "true")


class SettingError(FerrumError):
    """An environment variable of ferrum's set to a value it cannot take."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # "text", "int", "bool", "choice", "list" or "path"
    default: object  # the parsed value when unset (None: decided elsewhere, see `shown_default`)
    read_by: str  # the module or command that reads it
    doc: str  # one line
    choices: tuple[str, ...] = ()  # for "choice"
    minimum: int | None = None  # for "int"
    shown_default: str = ""  # the default as the table says it, where `default` alone would not

    def parse(self, raw: str):
        """`raw` (an environment value, stripped, not empty) as this setting's type."""
        parser: Callable[[Setting, str], object] = _PARSERS[self.kind]
        return parser(self, raw)


def _parse_int(setting: Setting, raw: str) -> int:
    try:
        number = int(raw)
    except ValueError:
        raise SettingError(f"{setting.name}={raw!r} is not a whole number; {_hint(setting)}") from None
    if setting.minimum is not None and number < setting.minimum:
        raise SettingError(f"{setting.name}={number} must be at least {setting.minimum}; {_hint(setting)}")
    return number


def _parse_bool(setting: Setting, raw: str) -> bool:
    word = raw.lower()
    if word in OFF_WORDS or word in ON_WORDS:
        return word in ON_WORDS
    raise SettingError(f"{setting.name}={raw!r} is not a switch; set it to 1 or 0 (or leave it unset)")


def _parse_choice(setting: Setting, raw: str) -> str:
    if raw.lower() not in setting.choices:
        raise SettingError(f"{setting.name}={raw!r} is not one of: {', '.join(setting.choices)}")
    return raw.lower()


def _parse_list(setting: Setting, raw: str) -> frozenset[str]:
    return frozenset(item.strip() for item in raw.split(",") if item.strip())


_PARSERS = {
    "text": lambda setting, raw: raw,
    "path": lambda setting, raw: Path(raw).expanduser(),
    "int": _parse_int,
    "bool": _parse_bool,
    "choice": _parse_choice,
    "list": _parse_list,
}


def _hint(setting: Setting) -> str:
    return f"set it to a number like {setting.default or 8192}, or unset it"


HF = "huggingface_hub (the model store)"
SETTINGS: tuple[Setting, ...] = (
    # what users set
    Setting(
        "FERRUM_MODEL",
        "text",
        "smollm2:135m",
        "compose.py: every command's default model",
        "The model opened when none is named (an alias, repo id, folder or .gguf file).",
    ),
    Setting(
        "FERRUM_KV_CAPACITY",
        "int",
        None,
        "compose.py; `--kv-capacity` of run, serve and chat",
        "The most tokens one sequence's KV cache may hold (clamped to the model's maximum and to free memory).",
        minimum=1,
        shown_default="the model's maximum",
    ),
    Setting(
        "FERRUM_API_KEY",
        "text",
        None,
        "cli: `--api-key` of run, serve and chat",
        "serve: the key clients must send; run/chat --remote: the key to send.",
        shown_default="none",
    ),
    Setting(
        "FERRUM_SERVE_ANY_MODEL",
        "bool",
        False,
        "compose.py: `--any-model` of serve",
        "serve: answer a request naming a model the server does not have with its default model, "
        "instead of a 404 (for clients that send a fixed name).",
    ),
    Setting(
        "FERRUM_DEVICE",
        "text",
        None,
        "compose.py: the torch backend's device",
        "The torch backend's device when `--device` is not given: cuda, cuda:1 or cpu.",
        shown_default="cuda when present, else cpu",
    ),
    Setting(
        "FERRUM_CACHE_DIR",
        "path",
        None,
        "settings.cache_dir(): the dense weight copies",
        "The folder for files ferrum derives from models, instead of the user cache folder.",
        shown_default="the user cache folder",
    ),
    Setting(
        "FERRUM_PREFIX_CACHE_MB",
        "int",
        4096,
        "backends/state/pooled_llm.py: the prefix cache in memory",
        "Memory (MiB) the prefix cache may keep for prompts no request is using (at most a quarter "
        "of what is free after loading); 0 turns the prefix cache off.",
        minimum=0,
    ),
    Setting(
        "FERRUM_RESPONSES_DAYS",
        "int",
        30,
        "serve/command.py: /v1/responses",
        "Days `ferrum serve` keeps a /v1/responses answer (for previous_response_id and GET by id), "
        "in the data folder's responses.sqlite3; 0 keeps them in memory only, until the server stops.",
        minimum=0,
    ),
    Setting(
        "FERRUM_PREFIX_DISK_MB",
        "int",
        4096,
        "backends/state/prefix_disk.py: the prefix cache on disk",
        "Disk space (MiB) for prompt prefixes kept across restarts, under the cache folder's "
        "prefix-cache/ (CPUs and Macs: a CUDA GPU computes them again faster); 0 keeps nothing on disk.",
        minimum=0,
    ),
    # MLX's CPU build (Linux)
    Setting(
        "FERRUM_DENSE_CACHE",
        "bool",
        True,
        "backends/mlx/cpu/ops.py",
        "0: do not keep dense copies of quantized checkpoints on disk (MLX's CPU build).",
    ),
    Setting(
        "FERRUM_DEQUANTIZE_ON_CPU",
        "bool",
        True,
        "backends/mlx/cpu/ops.py",
        "0: keep quantized weights quantized on MLX's CPU build (slower, less memory).",
    ),
    Setting(
        "FERRUM_CPU_BLAS",
        "choice",
        "openblas",
        "backends/mlx/cpu/blas.py",
        "reference: leave MLX's CPU build on the BLAS its wheel bundles instead of numpy's OpenBLAS.",
        choices=("openblas", "reference", "off", "0"),
    ),
    # A/B switches: a benchmark times each fast path against the plain one
    Setting(
        "FERRUM_MLX_COMPILE_MAX_TOKENS",
        "int",
        16,
        "backends/mlx/models/llama.py",
        "MLX steps of at most this many tokens run as compiled graphs; 0 turns that off.",
        minimum=0,
    ),
    Setting(
        "FERRUM_MLX_CUDA_ATTENTION",
        "bool",
        True,
        "backends/mlx/cuda/ops.py",
        "0: MLX's masked fused attention instead of the decode kernel by length (MLX CUDA).",
    ),
    Setting(
        "FERRUM_MLX_NUMPY_ATTENTION",
        "bool",
        True,
        "backends/mlx/cpu/ops.py",
        "0: MLX's attention for long prompts on the CPU too, instead of numpy's (faster exp).",
    ),
    Setting(
        "FERRUM_MLX_CUDA_MOE",
        "bool",
        True,
        "backends/mlx/cuda/ops.py",
        "0: MLX's ops instead of the MoE decode kernels (MLX CUDA).",
    ),
    Setting(
        "FERRUM_MLX_CUDA_HEADS",
        "bool",
        True,
        "backends/mlx/cuda/ops.py",
        "0: MLX's ops instead of the one kernel for a token's q/k norms and RoPE (MLX CUDA).",
    ),
    Setting(
        "FERRUM_MLX_CUDA_QMM",
        "bool",
        True,
        "backends/mlx/cuda/ops.py",
        "0: MLX's quantized_matmul instead of the few-row kernel (MLX CUDA).",
    ),
    Setting(
        "FERRUM_TORCH_CUDA_GRAPHS",
        "bool",
        True,
        "backends/torch/steps.py",
        "0: torch decode steps run eagerly instead of as CUDA graphs.",
    ),
    Setting(
        "FERRUM_TORCH_TRITON",
        "bool",
        True,
        "backends/torch/ops.py",
        "0: torch's ops instead of the Triton kernels in the CUDA decode step.",
    ),
    Setting(
        "FERRUM_TORCH_GEMV",
        "list",
        frozenset({"norm_swiglu", "matmul_residual", "norm_qkv_rope"}),
        "backends/torch/ops.py",
        "The fused Triton GEMVs in use, by name (also norm_matmul); empty for none.",
        shown_default="norm_swiglu,matmul_residual,norm_qkv_rope",
    ),
    Setting(
        "FERRUM_TORCH_DP4A",
        "bool",
        True,
        "backends/torch/kernels/triton_quant.py",
        "0: a packed weight's one-row GEMV multiplies x in floats (FMA), not as integers (dp4a).",
    ),
    Setting(
        "FERRUM_TORCH_PDL",
        "bool",
        True,
        "backends/torch/kernels/triton_pdl.py",
        "0: no programmatic dependent launch of the Triton kernels (Hopper and later).",
    ),
    Setting(
        "FERRUM_TORCH_MOE_ROUTE",
        "choice",
        "",
        "backends/torch/models/qwen3_moe.py",
        "Force the Qwen3-MoE expert route on torch: grouped, gathered or dense.",
        choices=("grouped", "gathered", "dense"),
        shown_default="chosen per step",
    ),
    # not ferrum's own, listed for the user
    Setting("HF_TOKEN", "text", None, HF, "A Hugging Face token, for gated or private models.", shown_default="none"),
    Setting(
        "HF_HOME", "path", None, HF, "The Hugging Face cache, where models live.", shown_default="~/.cache/huggingface"
    ),
    Setting("HF_ENDPOINT", "text", None, HF, "Another Hub (a mirror).", shown_default="the Hugging Face Hub"),
    Setting("HF_HUB_OFFLINE", "bool", False, HF, "1: use only models already downloaded."),
    Setting(
        "OLLAMA_HOST",
        "text",
        None,
        "compose.py: `ferrum serve --ollama`",
        "Where `ferrum serve --ollama` listens, as Ollama reads it: host, host:port or a URL.",
        shown_default="127.0.0.1:11434",
    ),
    # the scripts and tests
    Setting(
        "FERRUM_VENV",
        "path",
        None,
        "scripts/_env.sh",
        "The virtual environment scripts/run and scripts/test use.",
        shown_default=".venv",
    ),
    Setting(
        "FERRUM_EXTRAS",
        "text",
        None,
        "scripts/_env.sh",
        "The extras scripts/_env.sh installs (scripts/test: test).",
        shown_default="none",
    ),
    Setting(
        "FERRUM_TEST_REFRESH_REFERENCE",
        "bool",
        False,
        "tests/backends/test_real_weights.py",
        "1: recompute the real-weights test's cached reference logits.",
    ),
)
BY_NAME = {setting.name: setting for setting in SETTINGS}


def setting(name: str) -> Setting:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in ferrum_mac/settings.py") from None


def raw(name: str) -> str:
    """The variable's text as set, stripped ('' when unset)."""
    return os.environ.get(setting(name).name, "").strip()


def value(name: str):
    """The setting's value: parsed from the environment, or its default when unset or empty
    (a list set empty is the empty list). A value it cannot take is a one-line `SettingError`
    that names the variable."""
    declared, text = setting(name), raw(name)
    if text or (declared.kind == "list" and name in os.environ):
        return declared.parse(text)
    return declared.default


# -- the folders ferrum keeps files in -------------------------------------------------------


def data_dir() -> Path:
    """The user data folder: the bundled model, chat history, the REPL's history and saves."""
    import platformdirs

    return Path(platformdirs.user_data_dir(APP_NAME))


def cache_dir() -> Path:
    """The user cache folder (or FERRUM_CACHE_DIR): files derived from models, rebuilt when gone."""
    folder = value("FERRUM_CACHE_DIR")
    if folder is None:
        import platformdirs

        folder = Path(platformdirs.user_cache_dir(APP_NAME))
    return folder


def dense_weights_dir() -> Path:
    """The dense copies of quantized checkpoints that MLX's CPU build loads."""
    return cache_dir() / "dense-weights"


def prefix_cache_dir() -> Path:
    """Prompt prefixes' KV blocks kept across restarts (`backends/state/prefix_disk.py`)."""
    return cache_dir() / "prefix-cache"


def bundled_models_dir() -> Path:
    return data_dir() / "models"


def history_db_path() -> Path:
    """The chat app's sqlite history."""
    return data_dir() / "history.sqlite3"


def responses_db_path() -> Path:
    """The responses `ferrum serve` keeps for /v1/responses."""
    return data_dir() / "responses.sqlite3"


def repl_history_path() -> Path:
    return data_dir() / "repl_history"


def saved_conversations_dir() -> Path:
    """The REPL's /save and /load files."""
    return data_dir() / "conversations"


def export_dir() -> Path:
    """Where the chat app exports conversations as Markdown: a folder of the user's documents."""
    import platformdirs

    return Path(platformdirs.user_documents_dir()) / "ferrum-chat"


# -- the README's table ------------------------------------------------------------------------


def markdown_table() -> str:
    """The README's environment table."""
    rows = ["| Variable | Type | Default | Read by | What it does |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        kind = " / ".join(c for c in s.choices if c not in ("off", "0")) if s.kind == "choice" else s.kind
        rows.append(f"| `{s.name}` | {kind} | {_shown_default(s)} | {s.read_by} | {s.doc} |")
    return "\n".join(rows) + "\n"


def _shown_default(s: Setting) -> str:
    if s.shown_default:
        return s.shown_default
    if isinstance(s.default, bool):
        return "1" if s.default else "0"
    return f"`{s.default}`"


def main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m ferrum_mac.settings --markdown", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
