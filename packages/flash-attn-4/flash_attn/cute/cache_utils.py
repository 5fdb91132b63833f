"""In-memory caches of compiled kernels, at FA4's module path (``flash_attn.cute.cache_utils``: ``JITCache``,
``get_jit_cache``).

The kernels compiled per user function (score_mod / mask_mod, mods.py) live in named JITCaches:
``get_jit_cache("mods_fwd")`` and ``get_jit_cache("mods_bwd")``, also reachable as
``interface._flash_attn_fwd.compile_cache`` / ``_flash_attn_bwd.compile_cache``, where FA4's users look for them;
``clear()`` drops their kernels (the next call compiles again). The plain kernels' memory and disk caches are
cache.py's.
"""
from __future__ import annotations

import threading


class JITCache:
    """A compile key -> compiled function map (``cache``: the dict itself, as FA4's)."""

    def __init__(self):
        self.cache: dict = {}

    def __setitem__(self, key, fn):
        self.cache[key] = fn

    def __getitem__(self, key):
        return self.cache[key]

    def __contains__(self, key):
        return key in self.cache

    def __len__(self):
        return len(self.cache)

    def get(self, key, default=None):
        return self.cache.get(key, default)

    def clear(self):
        self.cache.clear()


_named: dict[str, JITCache] = {}
_named_lock = threading.Lock()


def get_jit_cache(name: str | None = None) -> JITCache:
    """The JITCache registered under ``name`` (created on first use); None: a new unnamed one."""
    if name is None:
        return JITCache()
    with _named_lock:
        cache = _named.get(name)
        if cache is None:
            cache = _named[name] = JITCache()
        return cache
