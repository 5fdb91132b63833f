"""Backend registry and selection.

Each call is described by a small hashable :class:`Call`; the first backend in priority order
(CuTeDSL, Triton, PyTorch reference) that is installed and supports the call serves it. The choice is
cached per (Call, forced backend), so the per-call cost is one dict lookup. ``FLASH_ATTN_BACKEND`` or
:func:`use_backend` force a backend; a forced backend that cannot serve a forward call raises an error
that says why. A backward pass uses the forced backend when it can, else the best one that can (a
CuTeDSL forward with no CuTeDSL backward falls back this way). On CPU tensors the automatic choice is
never a GPU backend: those run on a CPU only in an interpreter (TRITON_INTERPRET=1), a
testing tool, so they serve CPU calls only when forced.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import NamedTuple

import torch

from flash_attn import settings

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


class Call(NamedTuple):
    """What a call needs from a backend; everything that changes which kernel can serve it.
    (A NamedTuple: built and hashed on every call, it must be cheap.)"""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    arch: tuple | None = None  # CUDA compute capability, None off CUDA
    varlen: bool = False
    paged: bool = False
    causal: bool = False
    local: bool = False
    softcap: bool = False
    alibi: bool = False
    dropout: bool = False
    return_probs: bool = False
    kvcache: bool = False
    backward: bool = False
    deterministic: bool = False


class BackendUnavailableError(NotImplementedError):
    """A forced backend cannot serve the call."""


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("flash_attn_backend", default=None)
_modules: dict[str, object] = {}
_unavailable: dict[str, str | None] = {}
_choice: dict[tuple, object] = {}
_arch_cache: dict[int, tuple] = {}


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
    name = _forced.get() or settings.current.backend
    if name is not None:
        _check_name(name)
    return name


@contextlib.contextmanager
def use_backend(name):
    """Force every attention call in this context (and thread) onto one backend: "cute", "triton" or
    "torch". A call it cannot serve raises an error that names the reason."""
    if name is not None:
        _check_name(name)
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def device_arch(device):
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    arch = _arch_cache.get(idx)
    if arch is None:
        arch = _arch_cache[idx] = tuple(torch.cuda.get_device_capability(idx))
    return arch


def _reason(name, call):
    mod = load(name)
    if mod is None:
        return _unavailable[name]
    return mod.unsupported_reason(call)


def select(call: Call):
    """The backend module that serves ``call``."""
    forced = forced_backend()
    key = (call, forced)
    mod = _choice.get(key)
    if mod is not None:
        return mod
    if forced is not None:
        why = _reason(forced, call)
        if why is None:
            mod = _modules[forced]
        elif not call.backward:
            raise BackendUnavailableError(f"flash_attn backend {forced!r} cannot serve this call: {why}")
    if mod is None:
        reasons = []
        for name in BACKENDS:
            why = _reason(name, call)
            if why is None and call.device_type == "cpu" and name in _INTERPRETED_ON_CPU:
                why = "cpu tensors run on GPU backends (interpreted) only when forced"
            if why is None:
                mod = _modules[name]
                break
            reasons.append(f"{name}: {why}")
        else:
            raise NotImplementedError("no flash_attn backend serves this call: " + "; ".join(reasons))
    _choice[key] = mod
    return mod


def select_for(q, v, varlen, paged, causal, window_left, window_right, softcap, alibi, dropout_p,
               return_probs=False, kvcache=False, backward=False, deterministic=False):
    """select(Call(...)) for a call on q/v with these arguments, cached on a plain tuple (building and
    hashing the Call costs more than the rest of the lookup)."""
    forced = forced_backend()
    device = q.device
    local = window_left >= 0 or (window_right >= 0 and not causal)
    key = (device, q.dtype, q.shape[-1], v.shape[-1], varlen, paged, causal, local, softcap > 0.0,
           alibi is not None, dropout_p > 0.0, return_probs, kvcache, backward, deterministic, forced)
    mod = _choice.get(key)
    if mod is None:
        mod = select(Call(
            device_type=device.type, dtype=q.dtype, head_dim=q.shape[-1], head_dim_v=v.shape[-1],
            arch=device_arch(device), varlen=varlen, paged=paged, causal=causal, local=local,
            softcap=softcap > 0.0, alibi=alibi is not None, dropout=dropout_p > 0.0,
            return_probs=return_probs, kvcache=kvcache, backward=backward, deterministic=deterministic))
        _choice[key] = mod
    return mod


def select_dense(q, v, causal, window_left, window_right, deterministic):
    """select_for() of a dense forward without dropout, softcap, ALiBi or probabilities (flash_attn_func's
    common call), on a shorter key."""
    forced = forced_backend()
    local = window_left >= 0 or (window_right >= 0 and not causal)
    key = (q.device, q.dtype, q.shape[-1], v.shape[-1], causal, local, deterministic, forced)
    mod = _choice.get(key)
    if mod is None:
        mod = _choice[key] = select_for(q, v, False, False, causal, window_left, window_right, 0.0, None, 0.0,
                                        deterministic=deterministic)
    return mod


def explain(call: Call):
    """{backend name: None if it would serve ``call`` else the reason}, in priority order."""
    return {name: _reason(name, call) for name in BACKENDS}
