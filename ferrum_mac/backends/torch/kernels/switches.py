"""The A/B switches the Triton kernels read as they launch, set at load from `BackendOptions`.

They are the process's (a kernel launch has no model at hand): the last model loaded sets them.
"""

from __future__ import annotations

pdl = True  # programmatic dependent launch on Hopper and later (FERRUM_TORCH_PDL, `triton_pdl`)
dp4a = True  # one row of a packed weight by the dp4a GEMV, not the FMA one (FERRUM_TORCH_DP4A, `triton_quant`)


def use(options) -> None:
    """Take the switches of `options` (a `BackendOptions`)."""
    global pdl, dp4a
    pdl, dp4a = options.torch_pdl, options.torch_dp4a
