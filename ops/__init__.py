"""Fused ops (flash_attn.ops): Triton kernels with plain-PyTorch fallbacks."""
