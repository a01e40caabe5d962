"""RoPE schedules that stretch a model's context (LongRoPE, YaRN), computed once for every backend.

Each gives the rotation frequencies of a head's rotated dims and an attention factor: the
cosines and sines are multiplied by it, so the rotated dims of q and k come out scaled (as
transformers and llama.cpp apply it).

- LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by a rescale factor, one list for
  contexts within the pretraining length (`short_factor`) and one past it (`long_factor`).
  transformers picks the list by a sequence's current length and recomputes the whole cache
  when a sequence crosses; here, as in llama.cpp, the context the model is opened for (its
  KV capacity) picks one list for every sequence, so cached keys and shared prefixes never
  change meaning. Within the pretraining length, or for a sequence past it, the two agree.
- YaRN (gpt-oss, Qwen's long-context configs): frequencies blended between the original
  and the interpolated ones over a ramp of dims set by `beta_fast`/`beta_slow`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ferrum_mac.weights.config import ModelConfig


@dataclass(frozen=True)
class ScaledRope:
    inv_freq: np.ndarray  # float32 `(rope_dims / 2,)`: radians per position of each pair of dims
    attention_factor: float


def scaled_rope(config: ModelConfig, context: int) -> ScaledRope | None:
    """The config's LongRoPE or YaRN schedule for a model holding up to `context` tokens; None for others."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "longrope":
        return longrope(config.rope_dims, config.rope_theta, scaling, context)
    if kind == "yarn":
        return yarn(config.rope_dims, config.rope_theta, scaling)
    return None


def uses_long_factors(scaling: dict, context: int) -> bool:
    return context > scaling["original_max_position_embeddings"]


def context_variant(config: ModelConfig, context: int) -> str:
    """What of the schedule the context picks ("": nothing), for the keys of computed keys and
    values kept across runs (the prefix cache's disk tier): LongRoPE's factor list."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return ""
    return "longrope-long" if uses_long_factors(scaling, context) else "longrope-short"


def plain_inv_freq(dims: int, base: float) -> np.ndarray:
    """1 / base^(2i / dims), in float32 as transformers computes it."""
    return (1.0 / base ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))).astype(np.float32)


def longrope(dims: int, base: float, scaling: dict, context: int) -> ScaledRope:
    original = scaling["original_max_position_embeddings"]
    factors = scaling["long_factor"] if uses_long_factors(scaling, context) else scaling["short_factor"]
    factors = np.asarray(factors, dtype=np.float32)
    if factors.shape != (dims // 2,):
        raise ValueError(
            f"LongRoPE needs {dims // 2} rescale factors (one per pair of rotated dims), got {factors.size}"
        )
    powers = (base ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))).astype(np.float32)
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling["factor"]
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return ScaledRope((1.0 / (factors * powers)).astype(np.float32), float(attention))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(dims: int, base: float, scaling: dict) -> ScaledRope:
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over `original`
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolated = plain_inv_freq(dims, base)
    interpolated = (extrapolated / np.float32(factor)).astype(np.float32)
    keep = 1 - ramp  # 1: the original frequency (fast dims), 0: the interpolated one (slow dims)
    return ScaledRope((interpolated * (1 - keep) + extrapolated * keep).astype(np.float32), float(attention))
