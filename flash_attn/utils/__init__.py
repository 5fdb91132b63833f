"""Utilities (flash_attn.utils): ``generation`` (KV-cache decoding, sampling, CUDA-graph decode steps)."""
