"""flash_attn.triton: the Triton attention backend of flash_attn (distribution ``flash-attn-triton``).

:mod:`flash_attn.triton.backend` implements the backend contract (``flash_attn/backends/__init__.py``);
the public API (``flash_attn.flash_attn_func`` and friends) dispatches to it. Importing this package
imports neither torch kernels nor Triton.
"""
