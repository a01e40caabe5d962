"""`ferrum bench --backend torch`: the torch backend beside transformers' `generate` (eager,
batch 1, its default attention) on the same weights, device and run; the memory-bandwidth
roofline; and the aggregate decode rate of larger batches.

Nothing here imports MLX: it runs on a CUDA machine without it. Random weights of a real
shape (the table in bench/shapes.py) are built by transformers' own model classes, on the
device, in bf16; the torch backend takes those very tensors (it copies only what it fuses:
q/k/v and gate/up), so both sides read identical weights.

Roofline: a batch-1 decode step must read each weight it uses once (not the embedding
table, of which it reads one row; of the experts, only the top k) and the KV cache at the
mean context. Over the device-to-device copy rate measured in the same run (bytes read
plus bytes written per second), that is the fastest decode the memory allows.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

from ferrum_mac.bench import fit_to_context
from ferrum_mac.bench.report import Timing, interleaved, side_by_side, timed
from ferrum_mac.errors import FerrumError
from ferrum_mac.llm import DecodeItem

DEFAULT_BATCHES = (8, 16, 32)
COPY_MIB = {"cuda": 512, "cpu": 64}  # far past any cache


def run_torch_bench(
    *, model, shape, quant, prompt_tokens, new_tokens, runs, peer, json_out, batch=0, device=None
) -> dict:
    from ferrum_mac.backends import check_device
    from ferrum_mac.backends.torch.memory import device_name, resolve_device

    if (model is None) == (shape is None):
        raise FerrumError("give either a MODEL or --shape (for example: ferrum bench --backend torch --shape qwen3-8b)")
    from ferrum_mac.backends.torch.quant import ON_THE_FLY

    if quant != "bf16" and quant not in ON_THE_FLY:
        raise FerrumError(f"unknown --quant {quant!r}; the torch bench takes bf16, {', '.join(ON_THE_FLY)}")
    on_the_fly = None if quant == "bf16" else quant  # the bf16 weights quantized as they load
    from ferrum_mac.compose import device_or_setting

    device = resolve_device(check_device(device_or_setting("torch", device)))
    log = (lambda msg: print(msg, file=sys.stderr)) if json_out else print
    log("ferrum bench: measuring the copy bandwidth ...")
    bandwidth = copy_bandwidth(device)
    log("ferrum bench: preparing weights ...")
    llm, reference, label = (
        random_pair(shape, device, on_the_fly) if shape else pair_from_path(model, device, on_the_fly)
    )
    prompt_tokens, new_tokens = fit_to_context(prompt_tokens, new_tokens, llm.kv_capacity())
    rng = random.Random(0)
    prompt = [rng.randrange(llm.config.vocab_size) for _ in range(prompt_tokens)]

    result = {"model": label, "device": device_name(device), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
    if reference is None and device.type == "cuda":  # (a reference would count in it too)
        result["memory_gb"] = loaded_memory_gb(device)
    if reference is not None:
        log("ferrum bench: parity with transformers on the prompt ...")
        result["parity"] = {**parity(llm, reference, prompt, device), "quantized": on_the_fly}
    llm.prepare("bench", prompt_tokens + new_tokens)  # sizes the cache and captures its decode graph
    llm.release("bench")
    sides = {"ferrum": lambda: time_tokens(ferrum_tokens(llm, prompt, new_tokens), prompt_tokens, new_tokens, device)}
    if peer and reference is not None:
        sides["transformers"] = lambda: time_transformers(reference, prompt, new_tokens, device)
    log(f"ferrum bench: timing {' and '.join(sides)} ({runs} alternating runs after a warm-up) ...")
    timings = interleaved(runs, sides)
    ours, theirs = timings["ferrum"], timings.get("transformers")
    result.update(
        ferrum=ours.as_dict(),
        transformers=theirs.as_dict() if theirs else None,
        prefill_ratio=round(ours.prefill_tps / theirs.prefill_tps, 3) if theirs else None,
        decode_ratio=round(ours.decode_tps / theirs.decode_tps, 3) if theirs else None,
    )
    per_token = decode_bytes_per_token(llm, prompt_tokens + new_tokens // 2, on_the_fly)
    result["roofline"] = {
        "copy_bandwidth_gbs": round(bandwidth / 1e9, 1),
        "bytes_per_token": per_token,
        "decode_tps": round(bandwidth / per_token, 1),
        "ferrum_share": round(ours.decode_tps * per_token / bandwidth, 3),
    }
    batches = (batch,) if batch > 1 else DEFAULT_BATCHES
    result["batched_decode_tps"] = {}
    for size in batches:
        log(f"ferrum bench: decode_batch of {size} sequences ...")
        batched_decode_tps(llm, prompt, size, new_tokens)  # warm-up: grows the caches, captures the batch's graph
        rate = max(batched_decode_tps(llm, prompt, size, new_tokens) for _ in range(runs))
        result["batched_decode_tps"][str(size)] = round(rate, 1)
    print(json.dumps(result) if json_out else format_report(result, runs))
    return result


# -- the two sides on the same weights ---------------------------------------------------------


def random_pair(shape: str, device: torch.device, quant: str | None = None):
    """A transformers model of `shape` with random bf16 weights on `device`, and the torch
    backend built from the same tensors (its linear layers quantized to `quant` if given)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.bench.shapes import SHAPES
    from ferrum_mac.weights import Checkpoint, config_from_dict
    from ferrum_mac.weights.safetensors import canonical_name

    if shape not in SHAPES:
        raise FerrumError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    raw = {**SHAPES[shape], "dtype": "bfloat16"}
    settings = {k: v for k, v in raw.items() if k != "model_type"}
    torch.manual_seed(0)
    with torch.device(device):
        reference = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(raw["model_type"], **settings), dtype=torch.bfloat16
        )
    reference.to(device).eval()
    tensors = {canonical_name(k): v for k, v in reference.state_dict().items()}
    checkpoint = Checkpoint(config_from_dict(raw), tensors, Path(f"random-{shape}-bf16"), "safetensors")
    from ferrum_mac.compose import backend_options

    return (
        TorchLLM(checkpoint, device=device, quant=quant, options=backend_options()),
        reference,
        f"{shape} {quant or 'bf16'} (random weights)",
    )


def pair_from_path(model: str, device: torch.device, quant: str | None = None):
    """A model by path or name, and transformers' reading of it when it is a plain checkpoint folder."""
    import ferrum_mac
    from ferrum_mac.backends.torch.runtime import TorchLLM
    from ferrum_mac.weights import load_checkpoint

    path = Path(model).expanduser()
    if not path.exists():
        llm = ferrum_mac.open_model(model, backend="torch", quant=quant)
    else:
        from ferrum_mac.compose import backend_options

        llm = TorchLLM(load_checkpoint(path), device=device, quant=quant, options=backend_options())
    reference = None
    source = llm.source.path
    if source.is_dir() and llm.source.format == "safetensors":
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, llm.config.dtype)
        reference = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(llm.device).eval()
    return llm, reference, f"{model} {quant}" if quant else str(model)


def parity(llm, reference, prompt: list[int], device: torch.device) -> dict:
    """The prompt's last logits and one decode step (the captured graph on CUDA) beside
    transformers', as max |difference| over the largest |logit|."""
    with torch.no_grad():
        out = reference(torch.tensor([prompt], device=device), use_cache=True, logits_to_keep=1)
        want = out.logits[0, -1].float()
        token = int(want.argmax())
        after = reference(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, logits_to_keep=1)
        want_next = after.logits[0, -1].float()
    got = llm.prefill("parity", prompt).float()
    got_next = llm.decode("parity", token, len(prompt)).float()
    llm.release("parity")
    return {
        "prefill_rel_err": round(rel_err(got, want), 5),
        "decode_rel_err": round(rel_err(got_next, want_next), 5),
        "same_argmax": bool(int(got.argmax()) == token and int(got_next.argmax()) == int(want_next.argmax())),
    }


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


# -- timing ---------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loaded_memory_gb(device: torch.device) -> dict:
    """GPU memory the loaded model holds, and the most its loading held at once."""
    return {
        "loaded": round(torch.cuda.memory_allocated(device) / 1e9, 2),
        "load_peak": round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
    }


def peak_memory_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0


def time_tokens(tokens: Iterator[int], prompt_len: int, new_tokens: int, device: torch.device) -> Timing:
    def settle() -> None:
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    return timed(tokens, prompt_len, new_tokens, settle, lambda: peak_memory_gb(device))


def ferrum_tokens(llm, prompt: list[int], new_tokens: int, cache_id: str = "bench") -> Iterator[int]:
    """Greedy tokens through the contract, each next step queued before the current token is read."""
    from ferrum_mac.backends.torch.sampling import queue_read

    try:
        token = llm.prefill(cache_id, prompt).argmax()
        read, pos = queue_read(token), len(prompt)
        for _ in range(new_tokens):
            following = llm.decode(cache_id, token, pos).argmax()
            read_following = queue_read(following)
            yield read()
            token, read, pos = following, read_following, pos + 1
    finally:
        llm.release(cache_id)


def time_transformers(reference, prompt: list[int], new_tokens: int, device: torch.device) -> Timing:
    """transformers' greedy `generate`, timed at each token its streamer receives."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []

        def put(self, value):  # first the prompt, then each new token (already on the host)
            self.times.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.tensor([prompt], device=device)
    clock = Clock()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with torch.no_grad():
        reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=0,
            eos_token_id=None,
        )
    first, last = clock.times[1], clock.times[-1]
    decoded = len(clock.times) - 2  # tokens after the first
    return Timing(first - start, len(prompt) / (first - start), decoded / (last - first), peak_memory_gb(device))


def batched_decode_tps(llm, prompt: list[int], batch: int, new_tokens: int) -> float:
    """Aggregate greedy decode tok/s of `batch` sequences stepped together with `decode_batch`
    (sequence i's prompt is `prompt[i:]`, so their lengths differ). The first step is not
    timed: it captures the batch's CUDA graph, as the KV pool shrinks when a batch ends."""
    ids = [f"batch-{i}" for i in range(batch)]
    try:
        tokens = torch.stack([llm.prefill(cid, prompt[i:]).argmax() for i, cid in enumerate(ids)])
        positions = [len(prompt) - i for i in range(batch)]
        start = time.perf_counter()
        for step in range(new_tokens):
            if step == 1:
                synchronize(llm.device)
                start = time.perf_counter()
            items = [DecodeItem(cid, tokens[i], positions[i] + step) for i, cid in enumerate(ids)]
            tokens = llm.decode_batch(items).argmax(dim=-1)
        synchronize(llm.device)
        return batch * max(1, new_tokens - 1) / (time.perf_counter() - start)
    finally:
        for cid in ids:
            llm.release(cid)


# -- the roofline ---------------------------------------------------------------------------


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy rate in bytes moved (read + written) per second: best of 3 rounds of 10 copies."""
    size = COPY_MIB.get(device.type, 64) << 20
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * size / best


def decode_bytes_per_token(llm, context: int, quant: str | None = None) -> int:
    """Bytes one batch-1 decode step reads: the weights it uses and the KV cache of `context`
    tokens (with `quant`, the linear layers and MoE experts packed; the router dense)."""
    from ferrum_mac.backends.torch.quant import ON_THE_FLY, ON_THE_FLY_GROUP, bytes_per_weight

    c = llm.model_config
    size = torch.tensor([], dtype=llm.dtype).element_size()
    packed = c.quantization  # a checkpoint of packed weights, read as such
    if quant:
        linear = bytes_per_weight(ON_THE_FLY[quant], ON_THE_FLY_GROUP, size)
    elif packed:
        linear = bytes_per_weight(packed["bits"], packed["group_size"], size)
    else:
        linear = size
    attention = (
        c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    )
    dense_mlp = 3 * c.hidden_size * c.intermediate_size
    moe = getattr(llm.model, "moe", None)
    per_layer = []
    for layer in range(c.num_layers):
        if moe is not None and moe.is_sparse(layer):
            router, experts = moe.num_experts * c.hidden_size, moe.top_k * 3 * c.hidden_size * moe.intermediate_size
            per_layer.append((attention + experts) * linear + router * size)
        else:
            per_layer.append((attention + dense_mlp) * linear)
    weights = sum(per_layer) + c.vocab_size * c.hidden_size * linear + c.hidden_size * size  # head, one embedding row
    return int(weights + llm.config.kv_bytes_per_token(size) * context)


# -- the report -------------------------------------------------------------------------------


def format_report(r: dict, runs: int) -> str:
    lines = side_by_side(r, runs, "transformers", "transformers")
    roof = r["roofline"]
    lines.append(
        f"roofline: {roof['bytes_per_token'] / 1e9:.3g} GB read per token at {roof['copy_bandwidth_gbs']:.0f} GB/s copy rate "
        f"= {roof['decode_tps']:.1f} tok/s; ferrum decodes at {100 * roof['ferrum_share']:.0f}% of it"
    )
    for size, rate in r["batched_decode_tps"].items():
        lines.append(f"decode, {size} sequences: {rate:.1f} tok/s in all")
    if r.get("memory_gb"):
        m = r["memory_gb"]
        lines.append(
            f"GPU memory: {m['loaded']:.2f} GB held once loaded, {m['load_peak']:.2f} GB at most while loading"
        )
    if r.get("parity"):
        p = r["parity"]
        against = (
            f"the bf16 model it was quantized from ({p['quantized']}'s own error included)"
            if p.get("quantized")
            else "transformers"
        )
        lines.append(
            f"parity with {against} ({'same' if p['same_argmax'] else 'DIFFERENT'} argmax): "
            f"prefill logits {p['prefill_rel_err']:.2g}, decode step {p['decode_rel_err']:.2g} of the logits' range"
        )
    return "\n".join(lines)
