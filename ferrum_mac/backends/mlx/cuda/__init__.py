"""MLX's CUDA build: our kernels and the ops that route to them (imported only on CUDA)."""
