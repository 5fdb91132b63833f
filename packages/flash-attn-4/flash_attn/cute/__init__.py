"""flash_attn.cute: CuTeDSL attention kernels for Hopper (distribution ``flash-attn-4``).

``flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...) -> (out, lse)`` and
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, ...) -> (out, lse)`` follow
FlashAttention-4's API. Importing this package imports neither torch kernels nor CuTeDSL; the kernels
are compiled (or loaded from the disk cache) on first use.
"""

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine", "get_scheduler_metadata"]


def __getattr__(name):
    if name in __all__:
        from flash_attn.cute import interface

        return getattr(interface, name)
    raise AttributeError(f"module 'flash_attn.cute' has no attribute {name!r}")
