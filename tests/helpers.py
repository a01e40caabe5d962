"""Shared test helpers: tiny random checkpoints per family, reference loops, comparisons.

`FAMILY_FACTORIES` is the one list of model families the parity and contract tests run
over. To cover a new family, add an entry that returns a transformers config for a tiny
model of it (hidden 64, 2 layers, a few hundred tokens of vocabulary); every parametrised
test picks it up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ASSETS = SHARED / "assets"

VOCAB = 320
# Random init with std 0.2 (transformers' default is 0.02): at 0.02 attention is
# almost uniform and the logits nearly ignore positions, so a wrong RoPE or mask would
# still pass. At 0.2 changing the rope schedule moves the logits by ~100% of their range.
INIT_STD = 0.2
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=INIT_STD,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small so that the tiny head_dim's frequencies fall in all three bands
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}


def _llama(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(**TINY, **extra)


def _llama3_rope():
    return _llama(rope_scaling=dict(LLAMA3_ROPE))


def _llama_tied():
    return _llama(tie_word_embeddings=True)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**TINY, sliding_window=None)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**TINY, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config

    # head_dim 32 != hidden / heads (16): q/o projections are not square
    return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # top 4 of 8 experts: prompts from 16 tokens on take the sorted-by-expert route, decodes the unsorted one
    return Qwen3MoeConfig(
        **TINY, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4, norm_topk_prob=True
    )


def _phi3(**extra):
    from transformers import Phi3Config

    # Phi-4-mini's shape: RoPE on the first 0.75 of each head (12 of 16 dims), tied embeddings
    settings = {**TINY, "partial_rotary_factor": 0.75, "tie_word_embeddings": True, "pad_token_id": 0, **extra}
    return Phi3Config(**settings, sliding_window=None)


def _smollm3():
    from transformers import SmolLM3Config

    # layer 1 of 2 without RoPE (SmolLM3-3B: every fourth)
    return SmolLM3Config(**TINY, no_rope_layer_interval=2, pad_token_id=0)


def _gpt_oss(**extra):
    from transformers import GptOssConfig

    # a 16-token window, then full attention; top 2 of 4 experts, their SwiGLU clamped at 2
    # (gpt-oss's 7 is rarely reached by tiny random weights); YaRN as gpt-oss's, on 256 tokens
    settings = {
        **TINY,
        "intermediate_size": 48,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "swiglu_limit": 2.0,
        "pad_token_id": 0,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 256,
            "rope_theta": 150000.0,
        },
        **extra,
    }
    return GptOssConfig(**settings)


# name -> () -> transformers config of a tiny model of that family
FAMILY_FACTORIES: dict[str, Callable[[], object]] = {
    "llama": _llama,
    "llama3_rope": _llama3_rope,
    "llama_tied": _llama_tied,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "phi3": _phi3,
    "smollm3": _smollm3,
    "gpt_oss": _gpt_oss,
}
FAMILIES = list(FAMILY_FACTORIES)


def build_hf_model(family: str, seed: int = 0):
    """A random tiny transformers model of `family` (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILY_FACTORIES[family](), dtype=torch.float32)
    return model.eval()


def save_hf_model(model, folder: Path, dtype=None, **save_kwargs) -> Path:
    """`save_pretrained` into `folder` (safetensors), optionally cast to `dtype` first."""
    if dtype is not None:
        import copy

        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(folder, **save_kwargs)
    return folder


def write_tiny_tokenizer(folder: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer over `vocab_size` made-up tokens (mlx-lm refuses folders without one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


# -- numbers ------------------------------------------------------------------------


def to_np(x) -> np.ndarray:
    """A device array (mx or torch) or numpy array as fp32 numpy."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float32)
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    import mlx.core as mx

    return np.array(x.astype(mx.float32))


def rel_err(a, b) -> float:
    """max|a - b| / max|b|: error relative to the reference's range."""
    a, b = to_np(a), to_np(b)
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_close(a, b, rel: float, what: str = "logits") -> None:
    err = rel_err(a, b)
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:.1g}"


def assert_same_tokens(got: Sequence[int], want: Sequence[int]) -> None:
    got, want = list(got), list(want)
    if got != want:
        i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        raise AssertionError(f"greedy tokens differ from step {i}:\n got  {got}\n want {want}")


# -- backends ---------------------------------------------------------------------------


def installed_backends() -> list[str]:
    from ferrum_mac.backends import BACKENDS, available

    return [b for b in BACKENDS if available(b)]


BACKENDS = installed_backends()  # the contract tests run on each


def is_torch(x) -> bool:
    return hasattr(x, "detach")


def argmax(logits):
    """Index of the largest logit (over the last axis) as a device array, not read yet."""
    if is_torch(logits):
        return logits.argmax(dim=-1)
    import mlx.core as mx

    return mx.argmax(logits, axis=-1)


def device_array(like, value):
    """`value` (an int or list of ints) as a device array of `like`'s backend and device."""
    if is_torch(like):
        import torch

        return torch.tensor(value, device=like.device)
    import mlx.core as mx

    return mx.array(value)


def evaluate(x) -> None:
    """Wait for a device array (MLX computes lazily; torch has computed already)."""
    if not is_torch(x):
        import mlx.core as mx

        mx.eval(x)


def is_backend_array(x, backend: str) -> bool:
    if backend == "torch":
        import torch

        return isinstance(x, torch.Tensor)
    import mlx.core as mx

    return isinstance(x, mx.array)


# -- llama config variants

LLAMA_VARIANTS = {
    "linear_rope": {"rope_scaling": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
    "biases": {"attention_bias": True, "mlp_bias": True},  # o_proj and MLP biases too
    "wide_heads": {"head_dim": 32},  # head_dim != hidden / heads (Mistral-Nemo style)
    "mha_theta": {"num_key_value_heads": 4, "rope_theta": 500000.0, "rms_norm_eps": 1e-6},
    # YaRN over a pretraining length of 16 (the prompt runs past it): Qwen's long-context
    # configs, and gpt-oss's (factor 32, an untruncated ramp)
    "yarn_rope": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    "yarn_untruncated": {
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "rope_theta": 150000.0,
        }
    },
}


def llama_variant(variant: str, folder):
    """The transformers llama of a `LLAMA_VARIANTS` entry, saved into `folder`."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    settings = {**TINY, **copy.deepcopy(LLAMA_VARIANTS[variant])}
    if "rope_theta" in settings and "rope_scaling" not in settings:
        settings["rope_parameters"] = {"rope_type": "default", "rope_theta": settings.pop("rope_theta")}
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32).eval()
    reference.save_pretrained(folder)
    return reference


# -- greedy loops -----------------------------------------------------------------------


def ferrum_greedy(model, cache_id: str, prompt: Sequence[int], n: int) -> list[int]:
    """Prefill `prompt`, then decode greedily for `n` tokens with the contract's calls."""
    logits = model.prefill(cache_id, list(prompt))
    out, pos = [], len(prompt)
    for step in range(n):
        token = int(argmax(logits))
        out.append(token)
        if step + 1 < n:
            logits = model.decode(cache_id, token, pos)
            pos += 1
    return out


def hf_greedy(model, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' greedy continuation via its own KV cache (no eos stop)."""
    import torch

    ids, past, out = torch.tensor([list(prompt)]), None, []
    with torch.no_grad():
        for _ in range(n):
            o = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = o.past_key_values
            token = int(o.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def hf_logits(model, tokens: Sequence[int]):
    """transformers' `[len(tokens), vocab]` fp32 logits for one prompt."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].float()


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def write_config(folder: Path, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# -- GGUF files written from tiny transformers models ----------------------------------------

GGUF_ARCH = {
    "llama": "llama",
    "llama_tied": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "smollm3": "smollm3",
}
_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script reorders llama q/k rows for its interleaved (GPT-J) rope."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_rope_factors(dim: int, rope: dict) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's convert script computes it for Llama-3 rope scaling:
    at inference each rotation frequency is divided by its factor."""
    import math

    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def add_gguf_shape(w, c) -> int:
    """The architecture keys llama.cpp writes for a transformers config `c`; returns the head dim."""
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_vocab_size(c.vocab_size)
    return head_dim


def add_phi3_rope(w, c, head_dim: int) -> None:
    """What llama.cpp's convert script writes of Phi-3's rope: the rotated dims, and for
    LongRoPE the pretraining length, the attention factor and both factor lists as tensors."""
    import math

    rope = c.rope_parameters
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") != "longrope":
        return
    original = c.original_max_position_embeddings
    scale = c.max_position_embeddings / original
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def write_gguf_from_hf(model, family: str, path: Path, types: dict[str, str], split_max_tensors: int = 0) -> Path:
    """Write `model` as llama.cpp would: GGUF names, permuted llama q/k, and each 2-D weight
    stored as `types[gguf short name]` (any ggml type ferrum reads; default F32): quantized by
    `gguf.quants` where it can, else random valid blocks of the weight's spread
    (`ggml_random_blocks`). `split_max_tensors`: write shards of that many tensors (returns the
    first)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    arch, c = GGUF_ARCH[family], model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    head_dim = add_gguf_shape(w, c)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([1] * c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, array: np.ndarray) -> None:
        short = name.split(".")[-2]
        kind = types.get(short, "F32") if array.ndim == 2 else "F32"
        if kind == "F32":
            w.add_tensor(name, array.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, array.astype(np.float16))
        elif kind == "BF16":
            w.add_tensor(name, gguf.quants.quantize(array.astype(np.float32), Q.BF16), raw_dtype=Q.BF16)
        else:
            qt = getattr(Q, kind)
            try:
                blocks = gguf.quants.quantize(array.astype(np.float32), qt)
            except NotImplementedError:
                blocks = ggml_random_blocks(kind, array.shape, float(array.std()), np.random.default_rng(len(name)))
            w.add_tensor(name, blocks, raw_dtype=qt)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":  # Llama 3.1+: llama.cpp stores per-frequency divisors
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(head_dim, rope))
    if arch == "phi3":
        add_phi3_rope(w, c, head_dim)
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, short in _GGUF_BLOCK.items():
            for suffix in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_name}.{suffix}"
                if key not in sd:
                    continue
                array = sd[key]
                if arch in ("llama", "smollm3") and short in ("attn_q", "attn_k"):
                    array = llama_cpp_permute(
                        array, c.num_attention_heads if short == "attn_q" else c.num_key_value_heads
                    )
                add(f"blk.{i}.{short}.{suffix}", array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return next(path.parent.glob(f"{path.stem}-00001-of-*.gguf")) if split_max_tensors else path


# Where each type `gguf.quants` cannot quantize keeps its float16 scales: (byte offset, the
# scale giving values of spread ~1); every other byte of a random block is valid.
_BLOCK_SCALES = {
    "Q2_K": ((80, 1 / 20), (82, 1 / 15)),
    "Q3_K": ((108, 1 / 64),),
    "Q4_K": ((0, 1 / 400), (2, 1 / 60)),
    "Q5_K": ((0, 1 / 800), (2, 1 / 60)),
    "Q6_K": ((208, 1 / 1000),),
    "IQ4_NL": ((0, 1 / 100),),
    "IQ4_XS": ((0, 1 / 2000),),
}


def ggml_random_blocks(kind: str, shape: tuple[int, ...], spread: float, rng) -> np.ndarray:
    """Random valid ggml blocks of type `kind` for a tensor of `shape` (uint8, GGUF's byte
    shape), its values of about `spread`: random bytes, with finite float16 scales."""
    from ferrum_mac.weights.gguf_header import BLOCKS

    per_block, block_bytes = BLOCKS[kind]
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // per_block, block_bytes), dtype=np.uint8)
    for at, unit in _BLOCK_SCALES[kind]:
        scale = rng.uniform(0.5, 1.5, (len(blocks), 1)) * spread * unit
        blocks[:, at : at + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def decode_batch_steps(model, prompts: dict[str, list[int]], tag: str, steps: int = 2) -> list:
    """Prefill each prompt (cache ids `tag-NAME`), then `steps` decode_batch steps over all of
    them (token 3 + step at each one's next position), then release; each step's logits."""
    from ferrum_mac.llm import DecodeItem

    for name, prompt in prompts.items():
        model.prefill(f"{tag}-{name}", prompt)
    logits = []
    for step in range(steps):
        items = [DecodeItem(f"{tag}-{n}", 3 + step, len(p) + step) for n, p in prompts.items()]
        logits.append(model.decode_batch(items).clone())
    for name in prompts:
        model.release(f"{tag}-{name}")
    return logits


def open_mlx(path, ops, dtype: str = "float32"):
    """A model opened on MLX with the given dispatch object (`backends/mlx/ops.py`), as a test
    routes it: e.g. CUDA's routes on this CPU, with MLX ops standing in for the kernels."""
    from ferrum_mac.backends.mlx.runtime import MlxLLM
    from ferrum_mac.weights import load_checkpoint

    return MlxLLM(load_checkpoint(path), dtype=dtype, ops=ops)
