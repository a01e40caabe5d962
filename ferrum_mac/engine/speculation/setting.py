"""What a conversation asks of speculation (`Speculate`) and what one answer did (`SpeculationStats`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrum_mac.errors import FerrumError

AUTO = "auto"  # prompt lookup, where the controller finds that it pays
NGRAM = "ngram"  # prompt lookup, still judged by the controller (it never costs speed either)
DRAFT = "draft"  # a draft model: `draft:MODEL`
OFF = "off"
MODES = (AUTO, NGRAM, DRAFT, OFF)


class Speculate:
    """`mode` is one of MODES; with `draft`, `draft_model` is the loaded draft (a
    `DecoderOnlyLLM` with the target's vocabulary) and `draft_name` what the user called it.

    Immutable, and copied as itself: settings are copied (`dataclasses.asdict`, `replace`)
    and a draft model must never be."""

    __slots__ = ("mode", "draft_model", "draft_name")
    mode: str
    draft_model: Any
    draft_name: str

    def __init__(self, mode: str = AUTO, draft_model: Any = None, draft_name: str = ""):
        if mode not in MODES or (mode == DRAFT) != (draft_model is not None):
            raise FerrumError(f"speculation {mode!r} needs {'a' if mode == DRAFT else 'no'} draft model")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "draft_model", draft_model)
        object.__setattr__(self, "draft_name", draft_name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Speculate is immutable")

    def __deepcopy__(self, memo: dict) -> "Speculate":
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Speculate) and (self.mode, self.draft_model) == (other.mode, other.draft_model)

    def __hash__(self) -> int:
        return hash((self.mode, id(self.draft_model)))

    def __repr__(self) -> str:
        return f"Speculate({str(self)!r})"

    @classmethod
    def parse(cls, text: str) -> "Speculate":
        """`auto`, `ngram` or `off`; `draft:MODEL` names a model to load first (`is_draft`)."""
        word = str(text).strip().lower()
        if word in (AUTO, NGRAM, OFF):
            return cls(word)
        if draft_name(text):
            raise FerrumError(f"load the draft model first: {text!r:.60} is not a setting on its own")
        raise FerrumError(f"unknown speculation {text!r:.60}; choose auto, ngram, draft:MODEL or off")

    @property
    def enabled(self) -> bool:
        return self.mode != OFF

    def __str__(self) -> str:
        return f"{DRAFT}:{self.draft_name}" if self.mode == DRAFT else self.mode


def draft_name(text: str) -> str | None:
    """MODEL in `draft:MODEL`, or None when `text` names no draft model."""
    head, _, name = str(text).strip().partition(":")
    return name.strip() or None if head.lower() == DRAFT else None


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers (`ferrum_mac.text.Tokenizer`) spell every id alike: a draft
    model's guesses are ids, so they mean the same text to the target only then."""
    if a.vocab_size != b.vocab_size:
        return False
    return all(a.id_to_piece(i) == b.id_to_piece(i) for i in range(a.vocab_size))


def check_speculate(text: str) -> None:
    """Refuse a word that is no speculation setting (before a model is loaded)."""
    if draft_name(text) is None:
        Speculate.parse(text)


@dataclass
class SpeculationStats:
    """One answer's speculation: tokens proposed, of them accepted, verify steps run."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "steps": self.steps}
