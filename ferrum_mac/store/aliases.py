"""Model names -> what to fetch.

A name is one of:
  - an alias in Ollama's manner, `family:size[-quant]` (`qwen3:8b`, `qwen3:8b-8bit`), mapped
    per backend: MLX prefers the mlx-community 4-bit conversion (the original repository where
    there is none in MLX's affine quantization), torch the original repository;
    a family of one size also by its family name (`phi4`, `phi4-mini-8bit`);
  - a Hugging Face repository id, `org/name[@revision][:QUANT]`, where `:QUANT` picks one GGUF
    file of a repository that holds several (`:Q8_0`), as `ollama pull hf.co/org/name:Q8_0` does;
  - a local folder or .gguf file (handled by the resolver, not here).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ferrum_mac.errors import ModelNotFoundError, UnsupportedModelError
from ferrum_mac.store.paths import check_revision, is_repo_id, shown

QUANTS = ("4bit", "8bit", "bf16")
DEFAULT_QUANT = {"mlx": "4bit", "torch": "bf16"}
BACKENDS = tuple(DEFAULT_QUANT)


@dataclass(frozen=True)
class Alias:
    name: str  # "qwen3:8b"
    original: str  # the publisher's bf16 repository
    mlx_stem: str | None  # mlx-community repository without its "-4bit"/"-8bit" suffix; None: none
    bundled: bool = False  # the MLX default is the GGUF shipped through the package index


ALIASES = (
    Alias("qwen3:0.6b", "Qwen/Qwen3-0.6B", "mlx-community/Qwen3-0.6B"),
    Alias("qwen3:1.7b", "Qwen/Qwen3-1.7B", "mlx-community/Qwen3-1.7B"),
    Alias("qwen3:4b", "Qwen/Qwen3-4B", "mlx-community/Qwen3-4B"),
    Alias("qwen3:8b", "Qwen/Qwen3-8B", "mlx-community/Qwen3-8B"),
    Alias("qwen3:30b-a3b", "Qwen/Qwen3-30B-A3B", "mlx-community/Qwen3-30B-A3B"),
    Alias("qwen2.5:0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "mlx-community/Qwen2.5-0.5B-Instruct"),
    Alias("qwen2.5:1.5b", "Qwen/Qwen2.5-1.5B-Instruct", "mlx-community/Qwen2.5-1.5B-Instruct"),
    Alias("qwen2.5:3b", "Qwen/Qwen2.5-3B-Instruct", "mlx-community/Qwen2.5-3B-Instruct"),
    Alias("qwen2.5:7b", "Qwen/Qwen2.5-7B-Instruct", "mlx-community/Qwen2.5-7B-Instruct"),
    Alias("llama3.2:1b", "meta-llama/Llama-3.2-1B-Instruct", "mlx-community/Llama-3.2-1B-Instruct"),
    Alias("llama3.2:3b", "meta-llama/Llama-3.2-3B-Instruct", "mlx-community/Llama-3.2-3B-Instruct"),
    Alias("llama3.1:8b", "meta-llama/Llama-3.1-8B-Instruct", "mlx-community/Meta-Llama-3.1-8B-Instruct"),
    Alias("mistral:7b", "mistralai/Mistral-7B-Instruct-v0.3", "mlx-community/Mistral-7B-Instruct-v0.3"),
    Alias("smollm2:135m", "HuggingFaceTB/SmolLM2-135M-Instruct", None, bundled=True),
    Alias("phi4:14b", "microsoft/phi-4", "mlx-community/phi-4"),
    Alias("phi4-mini:3.8b", "microsoft/Phi-4-mini-instruct", "mlx-community/Phi-4-mini-instruct"),
    Alias("smollm3:3b", "HuggingFaceTB/SmolLM3-3B", "mlx-community/SmolLM3-3B"),
    # mlx-community's gpt-oss conversions keep OpenAI's MXFP4 experts (-MXFP4-Q4/-Q8), not MLX's affine bits
    Alias("gpt-oss:20b", "openai/gpt-oss-20b", None),
    Alias("gpt-oss:120b", "openai/gpt-oss-120b", None),
)
_BY_NAME = {a.name: a for a in ALIASES}


def _only_sizes() -> dict[str, Alias]:
    """A family with one size, by the family alone (`phi4`), as Ollama's default tag names it."""
    sizes: dict[str, list[Alias]] = {}
    for alias in ALIASES:
        sizes.setdefault(alias.name.partition(":")[0], []).append(alias)
    return {family: found[0] for family, found in sizes.items() if len(found) == 1}


_BY_FAMILY = _only_sizes()


@dataclass(frozen=True)
class RepoRef:
    """A Hugging Face model repository at a revision, optionally one GGUF quantization of it."""

    repo_id: str
    revision: str = "main"
    gguf_quant: str | None = None

    def __str__(self) -> str:
        text = self.repo_id if self.revision == "main" else f"{self.repo_id}@{self.revision}"
        return f"{text}:{self.gguf_quant}" if self.gguf_quant else text


@dataclass(frozen=True)
class BundledRef:
    """The model shipped through the package index (see `store.bundled`)."""

    alias: str

    def __str__(self) -> str:
        return self.alias


def is_alias_like(name: str) -> bool:
    return "/" not in name and (":" in name or _split_quant(name.lower())[0] in _BY_FAMILY)


def parse_name(name: str, backend: str = "mlx") -> RepoRef | BundledRef:
    """An alias or a repository id -> what to fetch for `backend` ("mlx" or "torch")."""
    name = name.strip()
    backend = "mlx" if backend == "auto" else backend  # MLX first; open_model passes the backend it chose
    if backend not in BACKENDS:
        raise UnsupportedModelError(
            f"unknown backend {backend!r} for a model name; choose one of: {', '.join(BACKENDS)}"
        )
    if is_alias_like(name):
        return _alias_ref(name, backend)
    return parse_repo_id(name)


def parse_repo_id(name: str) -> RepoRef:
    rest, _, quant = name.partition(":")
    repo_id, at, revision = rest.partition("@")
    if not is_repo_id(repo_id) or name.count("@") > 1:
        raise ModelNotFoundError(
            f"{shown(name)} is not a model name: give an alias (`ferrum list --available`), a Hugging Face repo id "
            "(org/name[@revision]), a model folder or a .gguf file"
        )
    if at:
        check_revision(revision, name)  # it becomes a file name under the cache's refs/
    return RepoRef(repo_id, revision or "main", quant or None)


def _alias_ref(name: str, backend: str) -> RepoRef | BundledRef:
    base, quant = _split_quant(name.lower())
    alias = _BY_NAME.get(base) or _BY_FAMILY.get(base)
    if alias is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}{_did_you_mean(base)}; `ferrum list --available` shows the names"
        )
    if quant is None and alias.mlx_stem is None and not alias.bundled:
        return RepoRef(alias.original)  # no conversion to prefer: the original on either backend
    quant = quant or DEFAULT_QUANT[backend]
    if quant == "bf16":
        return RepoRef(alias.original)
    if backend == "torch":
        raise UnsupportedModelError(
            f"the torch backend runs the original bf16 weights; use {alias.name} or {alias.name}-bf16"
        )
    if alias.bundled and quant == "4bit":
        return BundledRef(alias.name)
    if alias.mlx_stem is None:
        raise ModelNotFoundError(f"{name!r} has no {quant} conversion; use {alias.name}-bf16, the original weights")
    return RepoRef(f"{alias.mlx_stem}-{quant}")


def _split_quant(name: str) -> tuple[str, str | None]:
    for quant in QUANTS:
        if name.endswith("-" + quant):
            return name[: -len(quant) - 1], quant
    return name, None


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, _BY_NAME, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def alias_table(backend: str = "mlx") -> list[tuple[str, str]]:
    """(alias, what it fetches on `backend`) for every alias, for `ferrum list --available`."""
    rows = []
    for alias in ALIASES:
        ref = _alias_ref(alias.name, backend)
        rows.append((alias.name, "bundled GGUF (Q4_1)" if isinstance(ref, BundledRef) else str(ref)))
    return rows


def alias_for_repo(repo_id: str) -> str | None:
    """The alias (with quant suffix when not the default) that fetches `repo_id`, if any."""
    for alias in ALIASES:
        if repo_id == alias.original:
            return f"{alias.name}-bf16"
        for quant in ("4bit", "8bit"):
            if alias.mlx_stem and repo_id == f"{alias.mlx_stem}-{quant}":
                return alias.name if quant == DEFAULT_QUANT["mlx"] else f"{alias.name}-{quant}"
    return None
