"""The environment variables of the root ``flash_attn`` package (with its modules, ops, models and training), read
here and nowhere else, once (``reload()`` reads them again). ``flash_attn.cute`` and ``flash_attn.triton`` install
alone, so each has its own reader (their settings.py).

User settings:

``FLASH_ATTN_BACKEND``
    ``torch``, ``triton`` or ``cute``: every attention call on that backend (a ``use_backend`` context wins over it);
    ``torch`` / ``triton`` also put the fused ops (``flash_attn.ops``) on their PyTorch / Triton paths; unset: the
    fastest installed backend that serves each call, and the ops' path by device.
``FLASH_ATTN_FP32_WGRAD``
    ``1`` / ``0``: ``ops.linear``'s layers accumulate the weight gradient in fp32 (with a bias gradient of its own) on
    every device / on none; unset: on CUDA.
``FLASH_ATTN_WEIGHT_CAST_CACHE``
    ``1``: ``ops.linear`` keeps the low-precision copy of an fp32 weight between forwards (until the weight changes).
``FLASH_ATTN_DISABLE``
    Comma-separated kernels to switch off, to tell a suspected kernel fault from a caller's: ``ln_cute_bwd`` (the
    CuTeDSL LayerNorm / RMSNorm backward; the Triton one serves).

Tuning experiments:

``FLASH_ATTN_OVERRIDES``
    ``section.NAME=value`` items, comma-separated, replacing a module's tuning constants: ``ce.FWD_BLOCK=16384``
    (ops/triton/cross_entropy.py), ``act.BWD_TILE=8192`` (ops/triton/activations.py), ``linear.wgrad_bias=torch``
    (ops/linear.py). Unknown names raise ValueError, so a typo never silently measures the default. (The CuTeDSL norm
    backward's knobs are flash_attn.cute's: ``FLASH_ATTN_CUTE_OVERRIDES=ln.threads=512,ln.opts=p1+p2``.)
"""
import os

BACKEND = "FLASH_ATTN_BACKEND"
FP32_WGRAD = "FLASH_ATTN_FP32_WGRAD"
WEIGHT_CAST_CACHE = "FLASH_ATTN_WEIGHT_CAST_CACHE"
DISABLE = "FLASH_ATTN_DISABLE"
OVERRIDES = "FLASH_ATTN_OVERRIDES"
FEATURES = ("ln_cute_bwd",)
SECTIONS = ("ce", "act", "linear")


class Settings:
    """One reading of the environment."""

    __slots__ = ("backend", "fp32_wgrad", "weight_cast_cache", "disabled", "overrides", "triton_interpret")

    def __init__(self, environ):
        self.backend = environ.get(BACKEND, "").strip() or None
        wgrad = environ.get(FP32_WGRAD, "").strip()
        if wgrad not in ("", "0", "1"):
            raise ValueError(f"{FP32_WGRAD}={wgrad!r}: expected 1 or 0 (or unset)")
        self.fp32_wgrad = None if not wgrad else wgrad == "1"
        self.weight_cast_cache = environ.get(WEIGHT_CAST_CACHE, "0").strip() == "1"
        named = frozenset(x.strip().lower() for x in environ.get(DISABLE, "").split(",") if x.strip())
        if named - set(FEATURES):
            raise ValueError(f"{DISABLE}: unknown {sorted(named - set(FEATURES))}; expected some of {list(FEATURES)}")
        self.disabled = named
        self.overrides = _overrides(environ.get(OVERRIDES, ""))
        self.triton_interpret = environ.get("TRITON_INTERPRET", "0") == "1"


def _overrides(text):
    table = {s: {} for s in SECTIONS}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, eq, value = item.partition("=")
        section, dot, field = name.strip().partition(".")
        if not eq or not dot or not field:
            raise ValueError(f"{OVERRIDES}={text!r}: {item!r} is not section.NAME=value")
        if section not in table:
            raise ValueError(f"{OVERRIDES}: unknown section {section!r}; expected one of {list(SECTIONS)}")
        table[section][field] = value.strip()
    return table


current = Settings(os.environ)


def reload():
    """Read the environment again (tests and tools that change it call this); returns the new Settings."""
    global current
    current = Settings(os.environ)
    return current


def disabled(feature):
    return feature in current.disabled


def override(section, name, default=None):
    """FLASH_ATTN_OVERRIDES' raw value for section.name, else ``default``."""
    return current.overrides[section].get(name, default)


def apply_knobs(section, namespace):
    """Set a kernel module's upper-case tuning constants from FLASH_ATTN_OVERRIDES' ``section`` (ints, booleans or
    strings, as the defaults are); an unknown name raises ValueError."""
    for name, value in current.overrides[section].items():
        if name not in namespace or not name.isupper():
            raise ValueError(f"{OVERRIDES}: {section}.{name} is not a tuning constant of that module")
        default = namespace[name]
        if isinstance(default, bool):
            namespace[name] = value.lower() in ("1", "true", "yes")
        elif isinstance(default, int):
            namespace[name] = int(value)
        else:
            namespace[name] = value
