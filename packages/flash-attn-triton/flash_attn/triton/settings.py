"""The environment variables of ``flash_attn.triton``, read here and nowhere else, once at import (the package
installs alone, so it has its own reader).

``TRITON_INTERPRET``
    ``1``: Triton's interpreter runs the kernels on CPU tensors (Triton reads it when a kernel is defined).
``FLASH_ATTN_TRITON_OVERRIDES``
    Tuning experiments, comma-separated: ``fwd_variant=`` ``off`` (the table's kernels only), ``ws`` / ``ws64`` /
    ``ws128`` (the warp-specialized forward, with the table's or that BLOCK_N), ``wsp*`` (its persistent form),
    ``wsb*`` (persistent, causal tiles in the balanced order), replacing _configs.FWD_WS_DEFAULT for every head dim;
    ``bwd_variant=`` ``off`` (the FA2-style backward only) or ``ws`` (the warp-specialized backward wherever it
    serves). Unknown names or values raise ValueError.
"""
import os

OVERRIDES = "FLASH_ATTN_TRITON_OVERRIDES"
_FIELDS = ("fwd_variant", "bwd_variant")

interpret = os.environ.get("TRITON_INTERPRET") == "1"


def _overrides(text):
    table = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in _FIELDS:
            raise ValueError(f"{OVERRIDES}={text!r}: {item!r} is not one of {', '.join(f + '=...' for f in _FIELDS)}")
        table[name] = value.strip().lower()
    return table


overrides = _overrides(os.environ.get(OVERRIDES, ""))
