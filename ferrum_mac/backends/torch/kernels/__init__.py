"""The torch backend's Triton kernels for CUDA decode steps (`torch/ops.py`'s `TritonOps` calls them)."""
