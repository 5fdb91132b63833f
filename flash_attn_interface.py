"""FlashAttention-3's top-level API module, as FA3 installs it: ``from flash_attn_interface import flash_attn_func``.
The functions live in flash_attn.fa3_interface (see there for how FA3's arguments are served)."""
from flash_attn.fa3_interface import (  # noqa: F401
    _flash_attn_backward,
    _flash_attn_forward,
    flash_attn_combine,
    flash_attn_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
)
from flash_attn.fa3_ops import register as _register_ops

_register_ops()  # torch.ops.flash_attn_3.* with FA3's schemas (fa3_ops.py)
