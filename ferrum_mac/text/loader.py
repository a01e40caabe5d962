"""Find a model's tokenizer and chat template: a Hugging Face folder or a .gguf file.

Folder: `tokenizer.json` (preferred, as transformers does) or `tokenizer.model`, with
`tokenizer_config.json` for special tokens and `generation_config.json` for extra
end-of-sequence ids. Templates come from `chat_template.jinja`, `tokenizer_config.json`
(`chat_template`, a string or a list of named ones) or `chat_template.json`. A GGUF keeps
all of it in its metadata.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from ferrum_mac.errors import CorruptModelError, FerrumError, ModelFileError, ModelNotFoundError
from ferrum_mac.text.chat_template import ChatTemplate, fallback_template
from ferrum_mac.text.gguf_vocab import read_gguf_metadata, tokenizer_from_gguf
from ferrum_mac.text.hf_tokenizer import HfTokenizer
from ferrum_mac.text.spm_tokenizer import SentencePieceTokenizer
from ferrum_mac.text.tokenizer import Tokenizer
from ferrum_mac.weights.config import read_json_object

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_TEMPLATE = "tokenizer.chat_template"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model at `path` (a folder or a .gguf file)."""
    path = _existing(path)
    if path.is_file():
        return _gguf_tokenizer(path)
    config = _read_json(path / "tokenizer_config.json")
    extra_eos = _generation_eos_ids(path)
    if (path / "tokenizer.json").is_file():
        return _hf_tokenizer(path, config, extra_eos)
    if (path / "tokenizer.model").is_file():
        return SentencePieceTokenizer(
            path / "tokenizer.model",
            add_bos=config.get("add_bos_token", True),
            add_eos=config.get("add_eos_token", False),
            legacy=bool(config.get("legacy", False)),
            extra_eos_ids=extra_eos,
        )
    raise ModelFileError(f"{path} has no tokenizer.json or tokenizer.model; download the model's tokenizer files too")


def chat_templates(path: str | Path) -> dict[str, str]:
    """Every chat template the model ships, by name ('default' for the main one)."""
    path = _existing(path)
    if path.is_file():
        meta = _gguf_metadata(path)
        templates = {
            k[len(_GGUF_TEMPLATE) + 1 :]: v
            for k, v in meta.items()
            if k.startswith(_GGUF_TEMPLATE + ".") and isinstance(v, str)
        }
        if isinstance(meta.get(_GGUF_TEMPLATE), str):
            templates["default"] = meta[_GGUF_TEMPLATE]
        return templates
    templates = _named_templates(_read_json(path / "tokenizer_config.json").get("chat_template"))
    if not templates:
        templates = _named_templates(_read_json(path / "chat_template.json").get("chat_template"))
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        templates.update({f.stem: _read_template(f) for f in sorted(extra.glob("*.jinja"))})
    if (path / "chat_template.jinja").is_file():
        templates["default"] = _read_template(path / "chat_template.jinja")
    return templates


def load_chat_template(path: str | Path, tokenizer: Tokenizer, name: str | None = None) -> ChatTemplate:
    """The model's chat template (or the one called `name`); a fallback when it has none."""
    templates = chat_templates(path)
    if name is not None:
        if name not in templates:
            known = ", ".join(sorted(templates)) or "none"
            raise ModelFileError(f"the model has no chat template named {name!r} (it has: {known}); pick one of those")
        return ChatTemplate(templates[name], tokenizer.template_tokens(), name)
    if "default" in templates:
        return ChatTemplate(templates["default"], tokenizer.template_tokens(), "default")
    if len(templates) == 1:
        ((only_name, source),) = templates.items()
        return ChatTemplate(source, tokenizer.template_tokens(), only_name)
    has_chatml = tokenizer.piece_to_id("<|im_start|>") is not None and tokenizer.piece_to_id("<|im_end|>") is not None
    return ChatTemplate(fallback_template(has_chatml), tokenizer.template_tokens(), "fallback")


def _gguf_tokenizer(path: Path) -> Tokenizer:
    meta = _gguf_metadata(path)
    try:
        return tokenizer_from_gguf(meta, source=str(path))
    except FerrumError:
        raise
    except Exception as e:  # the tokenizers library raises a plain Exception for a vocabulary it cannot build
        raise CorruptModelError(
            f"{path} holds a vocabulary no tokenizer can be built from ({str(e).splitlines()[0][:200]}); download it again"
        ) from None


def _hf_tokenizer(folder: Path, config: dict, extra_eos: list[int]) -> HfTokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception as e:
        raise CorruptModelError(f"{folder / 'tokenizer.json'} cannot be read ({e}); download it again") from None
    special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
    if not any(special.values()):
        # No tokenizer_config.json: take the ids the model config names.
        model_config = _read_json(folder / "config.json")
        for name in _SPECIAL_NAMES:
            token_id = model_config.get(name + "_id")
            if isinstance(token_id, int):
                special[name] = backend.id_to_token(token_id)
    return HfTokenizer(backend, **special, extra_eos_ids=extra_eos)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _generation_eos_ids(folder: Path) -> list[int]:
    ids = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        ids += [v for v in (value if isinstance(value, list) else [value]) if type(v) is int]
    return ids


def _named_templates(value) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        }
    return {}


def _read_json(path: Path) -> dict:
    return read_json_object(path) if path.is_file() else {}


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CorruptModelError(f"{path} is not UTF-8 text; download it again") from None
    except OSError as e:
        raise CorruptModelError(f"{path} cannot be read ({e.strerror or e}); download it again") from None


def _existing(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"{path} does not exist; give a model folder or a .gguf file")
    return path


def _gguf_metadata(path: Path) -> dict:
    # The tokenizer and the chat template both come from here; the header is read once (cached_gguf_info).
    return read_gguf_metadata(path)
