"""Utilities (flash_attn.utils), FlashAttention-2's modules of that name, each imported on use: ``generation``
(KV-cache decoding, sampling, CUDA-graph decode steps), ``pretrained`` (Hugging Face checkpoints as state dicts),
``benchmark`` (timing and profiling helpers), ``distributed`` (collectives for tensor and sequence parallelism)."""
