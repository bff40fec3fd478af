"""Parallelism applied to a model that knows nothing of it: FSDP2, activation checkpointing,
torch.compile and FP8 matmuls, and the torch workarounds they need (compat)."""
