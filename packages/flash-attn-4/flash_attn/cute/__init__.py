"""flash_attn.cute: CuTeDSL attention kernels for Hopper (distribution ``flash-attn-4``).

``flash_attn_func(q, k, v, softmax_scale=None, causal=False, ...) -> (out, lse)`` follows
FlashAttention-4's API. Importing this package imports neither torch kernels nor CuTeDSL; the kernels
are compiled on first use. Not yet validated on a GPU (see the distribution's README).
"""

__all__ = ["flash_attn_func"]


def __getattr__(name):
    if name == "flash_attn_func":
        from flash_attn.cute.interface import flash_attn_func

        return flash_attn_func
    raise AttributeError(f"module 'flash_attn.cute' has no attribute {name!r}")
