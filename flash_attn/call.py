"""The normalised description of an attention call: the core's one encoding of a call's facts, built once at the
API boundary (flash_attn_interface), keyed on by the dispatcher and handed to every backend, which reads it and
never re-derives the mask from FA2's arguments.

The mask has one spelling. ``window_left`` / ``window_right`` are ints, ``UNBOUNDED`` (-1) for a side without a
limit; causal is the bottom-right aligned window (left, 0), so a causal call arrives with ``window_right == 0``.
Query i of a sequence sees key j iff j - (i + Sk - Sq) is in [-window_left, window_right] (a bounded side only).
``local`` says a call needs a window beyond causal; ``bounded`` that some side is limited (causal or local).
``sink``: the call has a learnable sink, FA4's per-head logit that joins every softmax row as a term exp(sink)
with no value (its lse includes it; a row that sees no key gets out 0 and lse = sink); the tensor travels beside
the description, as ALiBi's slopes do.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

UNBOUNDED = -1  # a window side without a limit


def window(window_size, causal):
    """(window_left, window_right) of FA2's ``window_size`` and ``causal``: ints >= -1, -1 unbounded, and
    window_right 0 when causal. Raises ValueError naming window_size for anything else."""
    if type(window_size) is tuple and window_size == (-1, -1):  # the default, accepted without the checks
        return -1, (0 if causal else -1)
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {window_size!r}")
    return left, (0 if causal else right)


class AttnCall(NamedTuple):
    """Everything about a call that decides which backend and kernel serve it, normalised (see the module's
    docstring for the mask). A NamedTuple: built and hashed on every call, it must be cheap. Per-call values that
    vary batch to batch (sequence lengths, tensors) travel beside it, never in it."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    arch: Optional[tuple] = None  # CUDA compute capability, None off CUDA
    varlen: bool = False
    paged: bool = False
    causal: bool = False
    window_left: int = UNBOUNDED
    window_right: int = UNBOUNDED
    softcap: float = 0.0  # > 0: score = softcap * tanh(score / softcap)
    alibi: bool = False
    dropout_p: float = 0.0
    return_probs: bool = False
    kvcache: bool = False
    backward: bool = False
    deterministic: bool = False
    scale: Optional[float] = None  # the softmax scale; None: head_dim ** -0.5
    sink: bool = False  # a learnable sink (H,) travels with the call

    @property
    def local(self):
        """A window beyond causal: a bounded left side, or a bounded right side without causal."""
        return self.window_left >= 0 or (self.window_right >= 0 and not self.causal)

    @property
    def bounded(self):
        """Some side of the window is limited (causal, or local)."""
        return self.window_left >= 0 or self.window_right >= 0

    @property
    def dropout(self):
        return self.dropout_p > 0.0

    @property
    def softmax_scale(self):
        return self.head_dim ** -0.5 if self.scale is None else self.scale


_new = tuple.__new__
_arch: dict = {}


def device_facts(device):
    """(device type, CUDA compute capability or None) of a torch.device, cached per device."""
    facts = _arch.get(device)
    if facts is None:
        arch = None
        if device.type == "cuda":
            arch = tuple(torch.cuda.get_device_capability(device.index if device.index is not None
                                                          else torch.cuda.current_device()))
        facts = (device.type, arch)
        if not torch.compiler.is_compiling():  # written while torch.compile traces, the dict would be a side effect
            _arch[device] = facts
    return facts


def describe(q, v, *, varlen=False, paged=False, causal=False, window_left=UNBOUNDED, window_right=UNBOUNDED,
             softcap=0.0, alibi=False, dropout_p=0.0, return_probs=False, kvcache=False, backward=False,
             deterministic=False, scale=None, sink=False):
    """The AttnCall of a call on q (.., H, D) and v (.., Hk, Dv). Keyword arguments: validated values, the window
    in window()'s encoding (a causal call's right side is set to 0 here too); scale None is head_dim ** -0.5;
    sink: whether a learnable sink comes with the call."""
    device_type, arch = device_facts(q.device)
    D = q.shape[-1]
    return _new(AttnCall, (device_type, q.dtype, D, v.shape[-1], arch, bool(varlen), bool(paged), bool(causal),
                           int(window_left), 0 if causal else int(window_right), float(softcap), bool(alibi),
                           float(dropout_p), bool(return_probs), bool(kvcache), bool(backward), bool(deterministic),
                           D ** -0.5 if scale is None else float(scale), bool(sink)))


def dense(q, D, Dv, softmax_scale, causal, window_size, deterministic):
    """describe() of flash_attn_func's common call (dense; no softcap, ALiBi, dropout, probabilities or sink) from the
    API's own arguments, q's head dims already checked: the API's common call builds its description with this, at
    less cost than describe()'s keywords."""
    left, right = window(window_size, causal)
    facts = _arch.get(q.device) or device_facts(q.device)
    return _new(AttnCall, (facts[0], q.dtype, D, Dv, facts[1], False, False, bool(causal), left, right, 0.0, False,
                           0.0, False, False, False, bool(deterministic),
                           D ** -0.5 if softmax_scale is None else float(softmax_scale), False))


def for_backward(call):
    """The description of the backward of a forward ``call``."""
    return call._replace(backward=True, return_probs=False)
