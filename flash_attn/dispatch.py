"""Backend registry and selection.

Each call arrives described by the core's :class:`flash_attn.call.AttnCall` (built once at the API); the first
backend in priority order (CuTeDSL, Triton, PyTorch reference) that is installed and supports the call serves
it. The choice is cached per (description, forced backend), so the per-call cost is one dict lookup.
``FLASH_ATTN_BACKEND`` or :func:`use_backend` force a backend; a forced backend that cannot serve a forward call
raises an error that says why. A backward pass uses its forward's forced backend when it can, else the best one that
can (a CuTeDSL forward with no CuTeDSL backward falls back this way). On CPU tensors the automatic choice is
never a GPU backend: those run on a CPU only in an interpreter (TRITON_INTERPRET=1), a
testing tool, so they serve CPU calls only when forced.
"""
from __future__ import annotations

import contextvars
import importlib

from flash_attn import settings
from flash_attn.call import AttnCall

# name -> module implementing the contract in flash_attn/backends/__init__.py, in priority order.
BACKENDS = {
    "cute": "flash_attn.cute.backend",
    "triton": "flash_attn.triton.backend",
    "torch": "flash_attn.reference",
}
_INSTALL_HINT = {
    "cute": "pip install flash-attn-4 (or ./packages/flash-attn-4)",
    "triton": "pip install flash-attn-triton (or ./packages/flash-attn-triton)",
}
ENV_VAR = settings.BACKEND
# GPU backends that can run CPU tensors in an interpreter (tests); never picked for CPU automatically.
_INTERPRETED_ON_CPU = {"triton", "cute"}


# The dispatcher keys on the core's call description (flash_attn/call.py); backends read it in unsupported_reason.
Call = AttnCall
# A bound on the cached choices: the description holds the call's scale, window and softcap values, so a caller that
# sweeps them would grow the cache without limit.
_MAX_CHOICES = 4096


class BackendUnavailableError(NotImplementedError):
    """A forced backend cannot serve the call."""


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("flash_attn_backend", default=None)
_modules: dict[str, object] = {}
_unavailable: dict[str, str | None] = {}
_choice: dict[tuple, object] = {}
_CURRENT = object()  # select()'s default: the forced backend of this context


def _check_name(name):
    if name not in BACKENDS:
        raise ValueError(f"unknown flash_attn backend {name!r}; expected one of {sorted(BACKENDS)}")


def load(name):
    """The backend module, or None; the reason it is unavailable is in :func:`unavailable_reason`."""
    if name in _unavailable:
        return _modules.get(name)
    try:
        mod = importlib.import_module(BACKENDS[name])
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing == BACKENDS[name]:  # the package is there, its dispatcher glue is not
            reason = f"{missing.rsplit('.', 1)[0]} has no dispatcher module ({missing}) yet"
        elif BACKENDS[name].startswith(missing) and missing.count(".") >= 1:
            reason = f"not installed ({_INSTALL_HINT.get(name, name)})"
        else:
            reason = f"import failed: {e}"
        _unavailable[name] = reason
        return None
    except Exception as e:  # a backend that breaks on import must not break the others
        _unavailable[name] = f"import failed: {type(e).__name__}: {e}"
        return None
    reason = mod.unavailable_reason()
    _unavailable[name] = reason
    if reason is None:
        _modules[name] = mod
    return _modules.get(name)


def unavailable_reason(name):
    _check_name(name)
    load(name)
    return _unavailable[name]


def forced_backend():
    """The backend forced in this context (use_backend, else FLASH_ATTN_BACKEND), or None. A forward that records
    gradients keeps it for its backward, which autograd may run on another thread (outside the context)."""
    name = _forced.get() or settings.current.backend
    if name is not None:
        _check_name(name)
    return name


class use_backend:
    """Force every attention call in this context (and thread) onto one backend: "cute", "triton" or
    "torch". A call it cannot serve raises an error that names the reason. (A class rather than a
    contextlib generator: flash_attn.cute's calls that record gradients enter one per call.)"""

    __slots__ = ("name", "token")

    def __init__(self, name):
        if name is not None:
            _check_name(name)
        self.name = name

    def __enter__(self):
        self.token = _forced.set(self.name)

    def __exit__(self, *exc):
        _forced.reset(self.token)


def _reason(name, call):
    mod = load(name)
    if mod is None:
        return _unavailable[name]
    return mod.unsupported_reason(call)


def select(call: AttnCall, forced=_CURRENT):
    """The backend module that serves ``call``: the one plan cache of the attention calls (a dict lookup on the
    description and the forced backend once the call's kind has been seen). ``forced``: the forced backend (or
    None) to select under instead of the current one (a backward's: its forward's, see forced_backend)."""
    if forced is _CURRENT:
        forced = _forced.get() or settings.current.backend
    key = (call, forced)
    mod = _choice.get(key)
    if mod is None:
        mod = _choose(call, forced)
        if len(_choice) >= _MAX_CHOICES:
            _choice.clear()
        _choice[key] = mod
    return mod


def _choose(call, forced):
    if forced is not None:
        _check_name(forced)
        why = _reason(forced, call)
        if why is None:
            return _modules[forced]
        if not call.backward:
            raise BackendUnavailableError(f"flash_attn backend {forced!r} cannot serve this call: {why}")
    reasons = []
    for name in BACKENDS:
        why = _reason(name, call)
        if why is None and call.device_type == "cpu" and name in _INTERPRETED_ON_CPU:
            why = "cpu tensors run on GPU backends (interpreted) only when forced"
        if why is None:
            return _modules[name]
        reasons.append(f"{name}: {why}")
    raise NotImplementedError("no flash_attn backend serves this call: " + "; ".join(reasons))


def explain(call: AttnCall):
    """{backend name: None if it would serve ``call`` else the reason}, in priority order."""
    return {name: _reason(name, call) for name in BACKENDS}
