"""Qwen3.5's text weights inside a multimodal checkpoint, by the names of a text-only one."""

from __future__ import annotations

# A Qwen3_5ForConditionalGeneration checkpoint names its text model `model.language_model.*`
# (canonical `language_model.*`), mlx-lm's conversion of it `language_model.model.*`; its
# vision tower (`visual.*`) and multi-token-prediction head (`mtp.*`) are not read here.
TEXT_PREFIXES = ("language_model.model.", "language_model.")
SKIPPED_PREFIXES = ("visual.", "mtp.")


def text_tensors(tensors):
    """`tensors` by canonical text-model names (`layers.0.linear_attn.in_proj_qkv.weight`)."""
    if not any(name.startswith(TEXT_PREFIXES) for name in tensors):
        return {n: t for n, t in tensors.items() if not n.startswith(SKIPPED_PREFIXES)}
    out = {}
    for name, tensor in tensors.items():
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            out[name[len(prefix) :]] = tensor
    return out


def norm_offset(tensors) -> float:
    """What the zero-centred norms' weights are offset by: 1 (weighed by 1 + w), or 0 in an
    mlx-lm conversion, which adds the 1 into them (and is told by its convolution weights,
    stored `(channels, kernel, 1)` where transformers stores `(channels, 1, kernel)`)."""
    converted = any(name.endswith("conv1d.weight") and t.shape[-1] == 1 for name, t in tensors.items())
    return 0.0 if converted else 1.0


def conv_layout(tensors, name: str, channels: int, kernel: int) -> tuple[int, int, int]:
    """The shape of a depthwise convolution's weight `name` as stored: transformers'
    `(channels, 1, kernel)`, or mlx-lm's `(channels, kernel, 1)`."""
    weight = tensors.get(name)
    mlx_lm = weight is not None and kernel > 1 and tuple(weight.shape) == (channels, kernel, 1)
    return (channels, kernel, 1) if mlx_lm else (channels, 1, kernel)


def recurrent_state_bytes(config, bytes_per_element: int) -> int:
    """The bytes one sequence's recurrent states take: per linear layer, its convolution's last
    `kernel - 1` inputs (the activations' dtype) and its float32 state of value heads x key
    dim x value dim."""
    e = config.extra
    k_dim, v_dim = e["linear_key_head_dim"], e["linear_value_head_dim"]
    channels = 2 * e["linear_num_key_heads"] * k_dim + e["linear_num_value_heads"] * v_dim
    conv = (e["linear_conv_kernel_dim"] - 1) * channels * bytes_per_element
    state = e["linear_num_value_heads"] * k_dim * v_dim * 4
    return len(config.recurrent_layers) * (conv + state)


def unfuse_linear_projections(tensors: dict, config, concat) -> None:
    """Qwen3-Next's fused projections of its linear layers, as Qwen3.5's, in place.

    Its `in_proj_qkvz` holds per key head [q, k, v, z] (v and z: that head's value heads) and
    `in_proj_ba` per key head [b, a]; Qwen3.5's `in_proj_qkv` holds every q, then every k,
    then every v, beside `in_proj_z`, `in_proj_b` and `in_proj_a`. Rows move, so quantized
    weights (their scales and biases by the same rows) move alike. `concat` joins arrays
    along their first axis (the backend's)."""
    e = config.extra
    k_heads, v_heads = e["linear_num_key_heads"], e["linear_num_value_heads"]
    k_dim, v_dim, per = e["linear_key_head_dim"], e["linear_value_head_dim"], v_heads // k_heads
    for layer in config.recurrent_layers:
        p = f"layers.{layer}.linear_attn"
        for suffix in ("weight", "scales", "biases"):
            if f"{p}.in_proj_qkvz.{suffix}" in tensors:
                w = tensors.pop(f"{p}.in_proj_qkvz.{suffix}")
                rest = tuple(w.shape[1:])
                g = w.reshape(k_heads, 2 * k_dim + 2 * per * v_dim, *rest)
                q, k = g[:, :k_dim], g[:, k_dim : 2 * k_dim]
                v, z = g[:, 2 * k_dim : 2 * k_dim + per * v_dim], g[:, 2 * k_dim + per * v_dim :]
                qkv = [q.reshape(k_heads * k_dim, *rest), k.reshape(k_heads * k_dim, *rest)]
                tensors[f"{p}.in_proj_qkv.{suffix}"] = concat(qkv + [v.reshape(v_heads * v_dim, *rest)])
                tensors[f"{p}.in_proj_z.{suffix}"] = z.reshape(v_heads * v_dim, *rest)
            if f"{p}.in_proj_ba.{suffix}" in tensors:
                w = tensors.pop(f"{p}.in_proj_ba.{suffix}")
                rest = tuple(w.shape[1:])
                g = w.reshape(k_heads, 2 * per, *rest)
                tensors[f"{p}.in_proj_b.{suffix}"] = g[:, :per].reshape(v_heads, *rest)
                tensors[f"{p}.in_proj_a.{suffix}"] = g[:, per:].reshape(v_heads, *rest)
