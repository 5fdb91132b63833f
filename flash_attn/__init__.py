"""Fast, exact, IO-aware attention (FlashAttention, Dao et al. 2022/2023) for PyTorch.

The namespace root stays tiny: importing ``flash_attn`` imports neither torch kernels nor any backend;
the public functions are loaded on first use. Backend distributions (``flash-attn-4`` ->
``flash_attn.cute``, ``flash-attn-triton`` -> ``flash_attn.triton``) install into this namespace.
"""
import os as _os
from pkgutil import extend_path as _extend_path

# The FA2 API level this package is a drop-in for (libraries such as transformers gate flash_attention_2 on it);
# pyproject.toml holds the same number.
__version__ = "2.8.0"

# pkgutil-style namespace: backend distributions installed elsewhere on sys.path (another site-packages,
# ``pip install --target``, an editable install) contribute their flash_attn/<backend> folders.
__path__ = _extend_path(__path__, __name__)


def _source_checkout_paths():
    # In a source checkout the root folders modules/, ops/, models/, training/ are flash_attn.modules, ...
    # (the wheel moves them under flash_attn/), and packages/*/flash_attn hold the backends.
    root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if not (_os.path.isfile(_os.path.join(root, "pyproject.toml"))
            and _os.path.isdir(_os.path.join(root, "packages"))
            and _os.path.isdir(_os.path.join(root, "modules"))):
        return []
    paths = [root]
    pkgs = _os.path.join(root, "packages")
    for dist in sorted(_os.listdir(pkgs)):
        ns = _os.path.join(pkgs, dist, "flash_attn")
        if _os.path.isdir(ns):
            paths.append(ns)
    return paths


for _p in _source_checkout_paths():
    if _p not in __path__:
        __path__.append(_p)

_LAZY = {
    "flash_attn_func": "flash_attn.flash_attn_interface",
    "flash_attn_qkvpacked_func": "flash_attn.flash_attn_interface",
    "flash_attn_kvpacked_func": "flash_attn.flash_attn_interface",
    "flash_attn_varlen_func": "flash_attn.flash_attn_interface",
    "flash_attn_varlen_qkvpacked_func": "flash_attn.flash_attn_interface",
    "flash_attn_varlen_kvpacked_func": "flash_attn.flash_attn_interface",
    "flash_attn_with_kvcache": "flash_attn.flash_attn_interface",
    "use_backend": "flash_attn.dispatch",
}

__all__ = list(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'flash_attn' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
