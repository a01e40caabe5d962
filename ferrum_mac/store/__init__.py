"""The model store: where models live on disk and how they get there.

Models live in the standard Hugging Face cache (shared with mlx-lm, transformers and the hub
CLI); the bundled SmolLM2 GGUF lives in the user data folder (`store.bundled`).

    resolve_model(name, backend, pull)   any name -> local path (folder or .gguf), pulling if allowed
    pull_model(name, backend, progress)  download (resumable, verified) -> local path
    list_models()                        what is on disk, complete or not
    plan_removal(name).execute()         delete a downloaded model
    describe_model(path)                 format, quantization, parameters, context, template, license
    ALIASES, alias_table(backend)        the `family:size[-quant]` names
"""

from ferrum_mac.store.aliases import ALIASES, alias_table, parse_name
from ferrum_mac.store.catalog import LocalModel, list_models
from ferrum_mac.store.describe import ModelFacts
from ferrum_mac.store.describe import describe as describe_model
from ferrum_mac.store.progress import PullProgress, TerminalProgress
from ferrum_mac.store.pull import pull as pull_model
from ferrum_mac.store.remove import Removal, plan_removal
from ferrum_mac.store.resolve import resolve_model

__all__ = [
    "ALIASES",
    "LocalModel",
    "ModelFacts",
    "PullProgress",
    "Removal",
    "TerminalProgress",
    "alias_table",
    "describe_model",
    "list_models",
    "parse_name",
    "plan_removal",
    "pull_model",
    "resolve_model",
]
