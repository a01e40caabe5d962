"""The MLX backend: the `DecoderOnlyLLM` contract on MLX (Metal on a Mac; its CUDA and CPU builds on Linux)."""
