"""`ferrum bench`: ferrum_mac beside mlx-lm on the same weights, device and run."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from ferrum_mac.errors import FerrumError


def _ferrum_from_random(shape: str, quant: str):
    from ferrum_mac.backends.mlx.runtime import MlxLLM
    from ferrum_mac.bench.shapes import build_random
    from ferrum_mac.compose import backend_options
    from ferrum_mac.weights import Checkpoint, config_from_dict
    from ferrum_mac.weights.safetensors import canonical_name

    rm = build_random(shape, quant)
    tensors = {canonical_name(k): v for k, v in rm.weights.items()}
    fmt = "mlx-quantized" if quant == "4bit" else "safetensors"
    checkpoint = Checkpoint(config_from_dict(rm.config), tensors, Path(f"random-{shape}-{quant}"), fmt)
    return MlxLLM(checkpoint, options=backend_options()), rm.peer, f"{shape} {quant} (random weights)"


def _ferrum_from_path(model: str, with_peer: bool):
    import ferrum_mac

    llm = ferrum_mac.open_model(model, backend="mlx")  # (auto takes torch on an NVIDIA machine)
    source = llm.source.path
    peer = None
    if with_peer and source.is_dir():
        from mlx_lm import load

        peer, _ = load(str(source))
    return llm, peer, str(model)


def require_peer(module: str, message: str) -> None:
    """A one-line error naming what to install when the library a bench compares against (and
    builds its random weights with) is missing: it is an extra, not in every install."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module blocked as None
        found = False
    if not found:
        raise FerrumError(message)


def fit_to_context(prompt_tokens: int, new_tokens: int, capacity: int) -> tuple[int, int]:
    """The prompt and new tokens, shortened to fit a small model's context (with a notice on stderr):
    a bench of such a model still measures it rather than failing on the default lengths."""
    if prompt_tokens < 1 or new_tokens < 1:
        raise FerrumError("--prompt-tokens and --new-tokens must be at least 1")
    if prompt_tokens + new_tokens <= capacity:
        return prompt_tokens, new_tokens
    if capacity < 2:
        raise FerrumError(f"the model's context holds {capacity} token(s); a bench needs at least 2")
    new = min(new_tokens, max(1, capacity // 4))
    prompt = min(prompt_tokens, capacity - new)
    print(
        f"ferrum bench: the context holds {capacity} tokens; timing a {prompt}-token prompt and {new} new tokens "
        f"instead of {prompt_tokens} + {new_tokens}",
        file=sys.stderr,
    )
    return prompt, new


def run_bench(
    *, model, shape, quant, prompt_tokens, new_tokens, runs, peer, json_out, batch=0, backend="mlx", device=None
) -> dict:
    from ferrum_mac.backends import check_device
    from ferrum_mac.compose import choose_backend as choose

    if choose(backend) == "torch":  # beside transformers, with no MLX import on the way
        from ferrum_mac.bench.torch_side import run_torch_bench

        require_peer(
            "transformers", "ferrum bench --backend torch compares against transformers: pip install transformers"
        )

        return run_torch_bench(
            model=model,
            shape=shape,
            quant=quant,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            runs=runs,
            peer=peer,
            json_out=json_out,
            batch=batch,
            device=device,
        )
    from ferrum_mac.backends.mlx.memory import device_name, use_device
    from ferrum_mac.bench.measure import batched_decode_tps, ferrum_stream, mlx_lm_stream, time_stream
    from ferrum_mac.bench.report import interleaved

    if peer:
        require_peer("mlx_lm", "ferrum bench compares against mlx-lm: pip install 'ferrum-mac[bench]' (or --no-peer)")
    elif shape:
        require_peer(
            "mlx_lm",
            "ferrum bench --shape builds its weights with mlx-lm's model classes: pip install 'ferrum-mac[bench]' "
            "(or bench a MODEL with --no-peer)",
        )
    use_device(check_device(device))
    if (model is None) == (shape is None):
        raise FerrumError("give either a MODEL or --shape (for example: ferrum bench --shape qwen3-0.6b)")
    log = (lambda msg: print(msg, file=sys.stderr)) if json_out else print
    log("ferrum bench: preparing weights ...")
    llm, peer_model, label = _ferrum_from_random(shape, quant) if shape else _ferrum_from_path(model, peer)
    prompt_tokens, new_tokens = fit_to_context(prompt_tokens, new_tokens, llm.kv_capacity())
    rng = random.Random(0)
    prompt = [rng.randrange(llm.config.vocab_size) for _ in range(prompt_tokens)]
    llm.prepare("bench", prompt_tokens + new_tokens)
    llm.release("bench")

    sides = {"ferrum": lambda: time_stream(ferrum_stream(llm, prompt, new_tokens), prompt_tokens, new_tokens)}
    if peer and peer_model is not None:
        sides["mlx_lm"] = lambda: time_stream(mlx_lm_stream(peer_model, prompt, new_tokens), prompt_tokens, new_tokens)
    log(f"ferrum bench: timing {' and '.join(sides)} ({runs} alternating runs after a warm-up) ...")
    timings = interleaved(runs, sides)
    ours, theirs = timings["ferrum"], timings.get("mlx_lm")
    result = {
        "model": label,
        "device": device_name(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "ferrum": ours.as_dict(),
        "mlx_lm": theirs.as_dict() if theirs else None,
        "prefill_ratio": round(ours.prefill_tps / theirs.prefill_tps, 3) if theirs else None,
        "decode_ratio": round(ours.decode_tps / theirs.decode_tps, 3) if theirs else None,
    }
    if batch > 1:
        log(f"ferrum bench: batched decode of {batch} sequences ...")
        batched_decode_tps(llm, prompt, batch, 8)  # warm-up (traces the batch shape)
        aggregate = max(batched_decode_tps(llm, prompt, batch, new_tokens) for _ in range(runs))
        result["batch"] = batch
        result["batched_decode_tps"] = round(aggregate, 2)
        result["batched_over_single"] = round(aggregate / ours.decode_tps, 3)
    if json_out:
        print(json.dumps(result))
    else:
        print(format_table(result, runs))
    return result


def format_table(r: dict, runs: int) -> str:
    from ferrum_mac.bench.report import side_by_side

    lines = side_by_side(r, runs, "mlx_lm", "mlx-lm")
    if r.get("batch"):
        lines.append(
            f"decode, {r['batch']} sequences: {r['batched_decode_tps']:.1f} tok/s in all, "
            f"{r['batched_over_single']:.2f}x the single-stream rate"
        )
    return "\n".join(lines)
