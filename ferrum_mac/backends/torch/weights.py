"""A checkpoint's tensors as torch tensors on the model's device, in its compute dtype.

Dense safetensors checkpoints are read by safetensors' torch loader straight onto the
device (`load_onto`), so this path needs no MLX; so do random-weight benchmarks, which hand
out `torch.Tensor`s. MLX affine-quantized and GGUF weights come from `ferrum_mac.weights` as
`mx.array`s. A linear layer's quantized weight stays packed where the source keeps packed
weights (`packed`, on CUDA by default: `quant.Packed`); everything else (embeddings, MoE
experts, packed weights off CUDA unless asked for) is dequantized at load with
`mx.dequantize`. `on_the_fly` ("4bit", "8bit") quantizes a dense checkpoint's linear layers as
they load.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from ferrum_mac.backends.options import DEFAULTS, BackendOptions
from ferrum_mac.backends.torch import quant
from ferrum_mac.errors import CorruptModelError, UnsupportedModelError
from ferrum_mac.weights import Checkpoint, ModelConfig, find_gguf, load_checkpoint
from ferrum_mac.weights.config import config_from_hf
from ferrum_mac.weights.gguf import load_gguf
from ferrum_mac.weights.safetensors import load_safetensors

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_onto(path: str | Path, device: torch.device) -> Checkpoint:
    """The checkpoint at `path` for the torch backend: a safetensors folder (dense, or
    MLX-quantized in bits `quant.Packed` reads) read onto `device`, and a GGUF file read onto
    the CPU, both without MLX; other MLX-quantized checkpoints through `load_checkpoint`
    (MLX reads them)."""
    folder = Path(path).expanduser()
    gguf = folder if folder.suffix == ".gguf" and folder.is_file() else None
    if folder.is_dir() and not (folder / "config.json").is_file():
        gguf = find_gguf(folder)
    if gguf is not None:
        config, tensors, quantized = load_gguf(gguf, read=quant.read_gguf)
        return Checkpoint(config, tensors, gguf, "gguf", quantized)
    if not (folder.is_dir() and (folder / "config.json").is_file()):
        return load_checkpoint(folder)
    config = config_from_hf(folder)
    if config.quantization and not quant.reads_without_mlx(config.quantization):
        return load_checkpoint(folder)
    from safetensors.torch import load_file

    tensors = load_safetensors(folder, read=functools.partial(load_file, device=str(device)))
    return Checkpoint(config, tensors, folder, "mlx-quantized" if config.quantization else "safetensors")


def to_torch(array) -> torch.Tensor:
    """An `mx.array` (or a torch tensor, returned as is) as a CPU torch tensor of the same dtype."""
    if isinstance(array, torch.Tensor):
        return array
    import mlx.core as mx

    if array.dtype == mx.bfloat16:  # numpy has no bfloat16: move the bits as uint16
        return torch.from_numpy(np.array(array.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


def dtype_name(array) -> str:
    """ "bfloat16", "float16", ... of an mx.array or torch tensor."""
    return str(array.dtype).rsplit(".", 1)[-1]


class TensorSource:
    """Hands out a checkpoint's tensors by canonical name, checking presence and shape."""

    def __init__(
        self,
        tensors: dict,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        where: str,
        packed: bool | None = None,
        on_the_fly: str | None = None,
        options: BackendOptions = DEFAULTS,
    ):
        self.tensors, self.config, self.dtype, self.device, self.where = tensors, config, dtype, device, where
        self.options = options  # the backends' switches a layer reads as it is built
        self.keep_packed = device.type == "cuda" if packed is None else packed
        self.on_the_fly = quant.checked_quant(on_the_fly)  # "4bit", "8bit": dense linears quantized at load

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The dense tensor `name` (dequantized if the checkpoint quantized its module)."""
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and self.config.quant_for(module) and self.has(f"{module}.scales"):
            tensor = self._dequantized(module)
        else:
            tensor = to_torch(self._raw(name))
        if tuple(tensor.shape) != tuple(shape):
            raise CorruptModelError(
                f"{self.where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)} from the model's config"
            )
        return tensor.to(device=self.device, dtype=self.dtype)

    def packed(self, module: str, shape: tuple[int, ...]) -> quant.Packed | None:
        """Linear `module`'s weight kept quantized, or None for a dense one: the file's own
        packing where it quantized the module (in bits and groups the kernels take: others are
        dequantized), else quantized now where `on_the_fly` asks. Stacked experts' `(experts,
        out, in)` come as one `(experts * out, in)`."""
        if module.endswith(".mlp.gate"):  # a MoE router: tiny, and the MoE kernels read it dense
            return None
        spec = self.config.quant_for(module)
        if spec and self.has(f"{module}.scales"):
            bits, group = spec["bits"], spec["group_size"]
            if not (self.keep_packed and quant.kernels_take(8 if bits < 8 else bits, group)):
                return None
            parts = (self._raw(f"{module}.{part}") for part in ("weight", "scales", "biases"))
            flat = (t.reshape(-1, t.shape[-1]) for t in parts)
            weight = quant.from_mlx(*flat, bits, group)
            if bits not in quant.BITS:  # (GGUF's 5-bit and 8-bit-exact types: no kernels of their own)
                weight = weight.widened()
            if weight.scales.dtype == torch.float32 and self.dtype != torch.float32:
                weight = weight.with_scales(torch.float16)  # (GGUF's K-quants: products of two float16s)
        elif self.on_the_fly and shape[-1] % quant.ON_THE_FLY_GROUP == 0:  # (as mlx-lm: other widths stay dense)
            dense = self.take(f"{module}.weight", shape)
            weight = quant.quantize(dense.reshape(-1, shape[-1]), quant.ON_THE_FLY[self.on_the_fly])
        else:
            return None
        if weight.shape != (math.prod(shape[:-1]), shape[-1]):
            raise CorruptModelError(
                f"{self.where}: tensor {module}.weight has shape {weight.shape}, expected {tuple(shape)} from the model's config"
            )
        return weight.to(self.device)

    def norm(self, module: str, dim: int) -> torch.Tensor:
        return self.take(f"{module}.weight", (dim,))

    def _raw(self, name: str):
        if name not in self.tensors:
            raise CorruptModelError(
                f"{self.where} lacks tensor {name!r}; the checkpoint is incomplete or not a {self.config.model_type} model"
            )
        return self.tensors[name]

    def _dequantized(self, module: str) -> torch.Tensor:
        spec = self.config.quant_for(module)
        if isinstance(self._raw(f"{module}.weight"), torch.Tensor):  # read by `load_onto`, without MLX
            words, scales, biases = (self._raw(f"{module}.{part}") for part in ("weight", "scales", "biases"))
            rows = words.shape[:-1]  # (stacked MoE experts: (experts, out))
            flat = (t.reshape(-1, t.shape[-1]) for t in (words, scales, biases))
            return quant.from_mlx(*flat, spec["bits"], spec["group_size"]).dequantize().view(*rows, -1)
        try:
            import mlx.core as mx
        except ImportError:
            raise UnsupportedModelError(
                f"{self.where}: MLX-quantized weights need MLX to dequantize (pip install mlx); use a bf16 or fp16 checkpoint"
            ) from None
        weight = self._raw(f"{module}.weight")
        # in float32, where scale * q + bias is exact; rounded once, to the compute dtype
        scales, biases = (self._raw(f"{module}.{part}").astype(mx.float32) for part in ("scales", "biases"))
        dense = mx.dequantize(weight, scales, biases, group_size=spec["group_size"], bits=spec["bits"])
        return to_torch(dense)
