"""`RecurrentStates`: each sequence's recurrent layers' state (linear attention's), beside the KV pool.

A recurrent layer keeps, per sequence, a state of fixed size that every token updates: for
Gated DeltaNet a short convolution's last inputs and a `(heads, key dim, value dim)` matrix.
The store holds them per sequence, layer by layer, as the backend's arrays (opaque here), with
the number of tokens they have taken in. A forward over positions `offset ..` of a sequence
starts from the state after `offset` tokens: `place` checks that it holds exactly that
(zeros when `offset` is 0), and the forward's layers read and replace `layers[i]`.

A state cannot be cut back to a shorter prefix, nor rebuilt from cached keys and values:
cutting a sequence back drops its state (the caller prefills it again), and the prefix cache
reuses nothing for such a model (snapshots at block boundaries would let it).
"""

from __future__ import annotations

from typing import Any

from ferrum_mac.errors import CacheStateError
from ferrum_mac.weights.qwen3_5 import recurrent_state_bytes


class SequenceRecurrent:
    """One sequence's recurrent layers' states (`layers[layer]`, the backend's) after `length` tokens."""

    def __init__(self, cache_id: str):
        self.cache_id = cache_id
        self.length = 0
        self.layers: dict[int, Any] = {}


class RecurrentStates:
    """Every sequence's `SequenceRecurrent`, by cache_id. `tokens_per_sequence`: what one
    sequence's states cost, in the KV token positions of the same memory (what a scheduler
    admits against: `PooledState.tokens_for`)."""

    def __init__(self, tokens_per_sequence: int = 0) -> None:
        self.sequences: dict[str, SequenceRecurrent] = {}
        self.tokens_per_sequence = tokens_per_sequence

    def length(self, cache_id: str) -> int:
        seq = self.sequences.get(cache_id)
        return seq.length if seq else 0

    def place(self, cache_id: str, offset: int) -> SequenceRecurrent:
        """`cache_id`'s states for a forward from position `offset`: they must have taken in
        exactly `offset` tokens (a state holds no earlier position to go back to)."""
        seq = self.sequences.get(cache_id)
        if seq is None:
            seq = self.sequences[cache_id] = SequenceRecurrent(cache_id)
        if seq.length != offset:
            raise CacheStateError(
                f"{cache_id!r}'s recurrent state holds {seq.length} tokens, not the {offset} this "
                "forward continues from; a recurrent state cannot skip or go back"
            )
        return seq

    def release(self, cache_id: str) -> None:
        self.sequences.pop(cache_id, None)

    def reset(self) -> None:
        self.sequences.clear()

    def arrays(self) -> list:
        """Every state array of every sequence (MLX evaluates them between prefill chunks)."""
        return [a for seq in self.sequences.values() for state in seq.layers.values() for a in state]

    def nbytes(self) -> int:
        """Bytes the states of every sequence take (arrays with an `nbytes`)."""
        return sum(getattr(a, "nbytes", 0) for a in self.arrays())


def recurrent_tokens(model_config, config, bytes_per_element: int) -> int:
    """`RecurrentStates.tokens_per_sequence` of a checkpoint's `ModelConfig` and its runtime
    config, with activations of `bytes_per_element` bytes."""
    per_token = config.kv_bytes_per_token(bytes_per_element)
    return -(-recurrent_state_bytes(model_config, bytes_per_element) // per_token)
