"""The PyTorch backend: the `DecoderOnlyLLM` contract on CUDA (decode steps as CUDA graphs) and the CPU."""
