"""MLX's CPU build: OpenBLAS matmuls, numpy attention and dense copies of quantized checkpoints."""
