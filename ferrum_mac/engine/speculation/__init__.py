"""Speculative decoding: guess a few tokens cheaply, check them all in one forward.

A proposer (`proposers.py`: prompt lookup over the prompt and the answer so far, or a small
draft model with the same tokenizer) guesses the next k tokens; one `forward_verify` of the
last token and the k guesses gives the target's logits at every position, and the sampler
keeps the guesses it would itself have drawn (`verify.py`). A controller per answer
(`controller.py`) weighs the measured cost of a verify against a decode step and the
acceptance seen so far, picks k (0 included) and stands aside when guessing does not pay.

This module holds only the setting (`Speculate`), so the conversation's settings can name it
without importing the loop.
"""

from ferrum_mac.engine.speculation.setting import (
    DRAFT,
    MODES,
    Speculate,
    SpeculationStats,
    check_speculate,
    draft_name,
    same_vocabulary,
)

__all__ = ["DRAFT", "MODES", "Speculate", "SpeculationStats", "check_speculate", "draft_name", "same_vocabulary"]
