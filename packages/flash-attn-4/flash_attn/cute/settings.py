"""The environment variables of ``flash_attn.cute``, read here and nowhere else, once (``reload()`` reads them again).
(The package installs alone, so it has its own reader; the root package and the Triton backend have theirs.)

User settings:

``FLASH_ATTN_CUTE_CACHE``
    Folder of the compiled-kernel disk cache (default ``$XDG_CACHE_HOME/flash_attn_cute``, i.e.
    ``~/.cache/flash_attn_cute``); ``0`` / ``off`` / ``false`` / ``no`` / ``none``: no disk cache.
``FLASH_ATTN_CUTE_CACHE_VERBOSE``
    ``1``: print each disk-cache problem (unwritable folder, corrupt entry) to stderr as it is met.
``FLASH_ATTN_CUTE_DISABLE``
    Comma-separated kernel features to switch off, to tell a suspected kernel fault from a caller's:
    ``bwd`` (gradients from the PyTorch backward, or from the next backend under the root dispatcher),
    ``paged`` and ``hdim_v`` (such calls are refused), ``pack_gqa`` (calls run unpacked), ``split`` (calls
    run unsplit), ``d96`` / ``d192`` / ``d256`` (the root dispatcher sends that head dim's forward, and d96's
    backward, to the next backend; flash_attn.cute's own autograd then skips the d96 backward kernel too),
    ``mask_sparsity`` (a mask_mod call without block_sparse_tensors visits every tile instead of the lists built
    from its mask_mod). Each changes how the work is done, never the result.

Tuning experiments:

``FLASH_ATTN_CUTE_OVERRIDES``
    Fields of the typed configurations (``config.FwdConfig``, ``config.BwdConfig``, ``config.PlanRules``, and the
    norm backward's ``config.NormBwdTuning``) that replace what the selection rules chose, e.g.
    ``fwd.stages=2,fwd.block_n=96,bwd.block_m=64,ln.threads=512,ln.opts=p1+p2``. A name
    without a section sets that field in every section that has it. Unknown sections or fields, and values
    of the wrong type, raise ValueError naming them. The disk cache keys on the resulting configuration.
"""
import os

CACHE = "FLASH_ATTN_CUTE_CACHE"
CACHE_VERBOSE = "FLASH_ATTN_CUTE_CACHE_VERBOSE"
DISABLE = "FLASH_ATTN_CUTE_DISABLE"
OVERRIDES = "FLASH_ATTN_CUTE_OVERRIDES"
FEATURES = ("bwd", "paged", "hdim_v", "pack_gqa", "split", "d96", "d192", "d256", "mask_sparsity")
_OFF = ("0", "off", "false", "no", "none")


class Settings:
    """One reading of the environment. ``cache``: the raw cache folder value ("" when unset; ``cache_off``
    when it names no folder); ``overrides``: {section or "": {field: raw value}} (checked against the
    configurations by ``config.overrides``)."""

    __slots__ = ("cache", "cache_off", "cache_verbose", "xdg_cache_home", "disabled", "overrides", "triton_interpret",
                 "cc", "cute_dsl_libs")

    def __init__(self, environ):
        self.cache = environ.get(CACHE, "").strip()
        self.cache_off = self.cache.lower() in _OFF
        self.cache_verbose = environ.get(CACHE_VERBOSE, "").strip() not in ("", "0")
        self.xdg_cache_home = environ.get("XDG_CACHE_HOME", "")
        self.disabled = _features(environ.get(DISABLE, ""))
        self.overrides = _overrides(environ.get(OVERRIDES, ""))
        self.triton_interpret = environ.get("TRITON_INTERPRET") == "1"
        self.cc = environ.get("CC")  # the C compiler that links a disk-cache entry's shared library
        self.cute_dsl_libs = environ.get("CUTE_DSL_LIBS", "")  # where CuTeDSL's runtime library is


def _features(text):
    named = frozenset(x.strip().lower() for x in text.split(",") if x.strip())
    unknown = sorted(named - set(FEATURES))
    if unknown:
        raise ValueError(f"{DISABLE}={text!r}: unknown feature(s) {unknown}; expected some of {list(FEATURES)}")
    return named


def _overrides(text):
    table = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        if not eq or not name.strip() or not value.strip():
            raise ValueError(f"{OVERRIDES}={text!r}: {item!r} is not [section.]field=value")
        section, _, field = name.strip().rpartition(".")
        table.setdefault(section, {})[field] = value.strip()
    return table


current = Settings(os.environ)


def reload():
    """Read the environment again (tests and tools that change it call this); returns the new Settings."""
    global current
    current = Settings(os.environ)
    return current


def disabled(feature):
    """Whether FLASH_ATTN_CUTE_DISABLE names ``feature`` (one of FEATURES)."""
    return feature in current.disabled
