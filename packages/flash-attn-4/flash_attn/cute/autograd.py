"""Gradients of flash_attn.cute's calls.

Two routes, one result:
- With the root ``flash-attn`` distribution installed, a call whose mask that package's backends can express (window
  sizes >= 0) runs inside its differentiable op (``_with_fallback_backward``): the forward is this package's kernel
  (the dispatcher's cute backend), the backward the dispatcher's choice (this package's backward kernel where it
  serves the call, else Triton's: windows, softcap, determinism).
- Otherwise (flash-attn-4 installed alone, a learnable sink, a negative window size, seqused_q / seqused_k), the
  ``Attention`` Function here runs this package's forward and backs it with the dispatcher's backward when it can
  take the call, else with this package's own: the CuTeDSL backward kernel for dense calls it serves
  (``_kernel_takes``), the PyTorch backward of bwd_torch.py for the rest.

The learnable sink adds exp(sink) to each softmax row's sum with no value. Given the sink-inclusive lse the standard
backward stays right (P = exp(s - lse), delta = rowsum(dO * O)); the sink's own gradient follows from
d lse_i / d sink = exp(sink - lse_i) =: p_i: dL/dsink = -sum_i p_i (delta_i - dlse_i) over every row of the head.
A loss that uses the returned lse contributes dlse_i * P_ij to dS_ij, which every backward takes as delta - dlse.
"""
from __future__ import annotations

import sys

import torch

from flash_attn.cute import launch as _k
from flash_attn.cute import settings
from flash_attn.cute.plan import _UNBOUNDED

_F32 = torch.float32


def needs_grad(q, k, v, learnable_sink=None):
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        learnable_sink is not None and learnable_sink.requires_grad))


_DISPATCHER = []


def dispatcher():
    """The root package's core services to a backend (flash_attn.backends.core_attention / core_backward), or None
    without that package (flash-attn-4 alone); looked up once (per call it cost an import's microsecond)."""
    if not _DISPATCHER:
        try:
            from flash_attn.backends import core_attention, core_backward
        except ImportError:
            _DISPATCHER.append(None)
        else:
            _DISPATCHER.append((core_attention, core_backward))
    return _DISPATCHER[0]


def _backend():
    """flash_attn.cute.backend (imported on first use: it imports this module's neighbours)."""
    mod = sys.modules.get("flash_attn.cute.backend")
    if mod is None:
        from flash_attn.cute import backend as mod
    return mod


def dispatcher_window(causal, window_left, window_right):
    """The window in the root dispatcher's encoding (sizes >= 0, -1 for no limit; right 0 when causal), or None
    for a negative size, which that encoding cannot say."""
    if window_left < 0 or (window_right < 0 and not causal):
        return None
    U = _UNBOUNDED
    return -1 if window_left >= U else window_left, 0 if causal else -1 if window_right >= U else window_right


def with_fallback_backward(q, k, v, softmax_scale, causal, window_left, window_right, softcap, varlen=None,
                           deterministic=False):
    """(out, lse) of a call that needs gradients, through the root package's differentiable op under
    use_backend("cute") when that package is installed and the call is one its contract says (None otherwise, for
    the caller to take Attention)."""
    ops = dispatcher()
    window = dispatcher_window(causal, window_left, window_right)
    if ops is None or window is None:
        return None
    if q.shape[-1] not in _backend().forward_head_dims():  # the dispatcher would refuse the forced forward
        return None
    core_attention, _ = ops
    cu_q, cu_k, max_q, max_k = varlen[:4] if varlen is not None else (None, None, q.shape[1], k.shape[1])
    return core_attention("cute", q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window[0], window[1],
                          softcap, deterministic)


def _pair(d, dv):
    """A q / v head-dim pair the backward kernel serves (config.HEAD_DIM_PAIRS, hdim_v not switched off)."""
    from flash_attn.cute.config import HEAD_DIM_PAIRS

    return (d, dv) in HEAD_DIM_PAIRS and not settings.disabled("hdim_v")


def _kernel_takes(q, v, causal, window_left, window_right, softcap, deterministic, varlen):
    """Whether this package's CuTeDSL backward kernel serves the call in own_backward (as backend.py's rule for the
    dispatcher: its head dims (backend.backward_head_dims, d96 unless FLASH_ATTN_CUTE_DISABLE names it), not switched
    off; a window with sizes >= 0 under the plan rule bwd_window; varlen (cu_seqlens, seqused) under bwd_varlen;
    softcap under bwd_softcap), and deterministic calls without a window whatever bwd_deterministic says: that rule
    weighs the kernel against Triton's deterministic backward, while the alternative here is bwd_torch, which is slower
    than either."""
    from flash_attn.cute import backend

    U = _UNBOUNDED
    unwindowed = window_left >= U and (causal or window_right >= U)
    window_ok = unwindowed or (backend._window_bwd() and window_left >= 0 and (causal or window_right >= 0))
    varlen_ok = varlen is None or (backend._varlen_bwd() and varlen[0] is not None and varlen[1] is not None)
    det_ok = not deterministic or unwindowed
    return (varlen_ok and (not softcap or backend._softcap_bwd()) and det_ok and window_ok
            and (q.shape[-1] == v.shape[-1] or _pair(q.shape[-1], v.shape[-1]))
            and q.shape[-1] in backend.backward_head_dims() and (q.shape[-1] != 256 or backend.d256_bwd_takes(causal))
            and not settings.disabled("bwd"))


def _kernel_window(causal, window_left, window_right):
    """The backward kernel's window argument: None without a window, else (left, right) clamped to _UNBOUNDED."""
    if window_left >= _UNBOUNDED and (causal or window_right >= _UNBOUNDED):
        return None
    return min(window_left, _UNBOUNDED), 0 if causal else min(window_right, _UNBOUNDED)


def own_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                 arch, varlen, dlse=None):
    """(dq, dk, dv) without the root package: the CuTeDSL backward kernel where it serves the call, else bwd_torch."""
    if _kernel_takes(q, v, causal, window_left, window_right, softcap, deterministic, varlen):
        window = _kernel_window(causal, window_left, window_right)
        if varlen is not None:
            cu_q, cu_k, max_q, max_k, used_q, used_k = varlen
            return _k.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, softmax_scale,
                                      causal, arch, dlse=dlse, window=window, deterministic=deterministic,
                                      softcap=softcap)
        return _k.backward(dout, q, k, v, out, lse, softmax_scale, causal, arch, dlse=dlse, window=window,
                           deterministic=deterministic, softcap=softcap)
    from flash_attn.cute import bwd_torch

    cu_q = cu_k = used_q = used_k = None
    if varlen is not None:
        cu_q, cu_k, _, _, used_q, used_k = varlen
    return bwd_torch.backward(dout, q, k, v, out, lse, softmax_scale, causal=causal, window_left=window_left,
                              window_right=window_right, softcap=softcap, dlse=dlse, cu_seqlens_q=cu_q,
                              cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k)


def dispatcher_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                        deterministic, arch, varlen, dlse=None):
    """(dq, dk, dv) from the root package's dispatcher (the backward with_fallback_backward's calls get) when it is
    installed and takes the call, else own_backward."""
    ops = dispatcher()
    window = dispatcher_window(causal, window_left, window_right)
    used = varlen is not None and (varlen[4] is not None or varlen[5] is not None)
    if ops is None or window is None or used:
        return own_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
                            deterministic, arch, varlen, dlse)
    _, core_backward = ops
    cu_q, cu_k, max_q, max_k = varlen[:4] if varlen is not None else (None, None, q.shape[1], k.shape[1])
    return core_backward("cute", dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window[0],
                         window[1], softcap, deterministic, dlse)


class Attention(torch.autograd.Function):
    """This package's forward (forward() or forward_varlen(), a learnable sink included), backed by
    dispatcher_backward. args: (softmax_scale, causal, window_left, window_right, softcap, deterministic, arch,
    varlen); varlen None or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k) with
    rows of q outside every sequence's used rows given out 0 and lse +inf."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, args):
        softmax_scale, causal, window_left, window_right, softcap, _, arch, varlen = args
        sink = None if learnable_sink is None else learnable_sink.detach().to(_F32).contiguous()
        if varlen is None:
            out, lse = _k.forward(q, k, v, softmax_scale, causal, arch, window_left, window_right, softcap, sink)
        else:
            out, lse = _k._varlen_forward(q, k, v, varlen, softmax_scale, causal, arch, window_left, window_right,
                                          softcap, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = args
        ctx.sink_dtype = None if learnable_sink is None else learnable_sink.dtype
        ctx.set_materialize_grads(False)  # an unused out or lse arrives as None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        softmax_scale, causal, window_left, window_right, softcap, deterministic, arch, varlen = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq = dk = dv = None
        if any(ctx.needs_input_grad[:3]):
            dq, dk, dv = dispatcher_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                                                 window_right, softcap, deterministic, arch, varlen, dlse)
        dsink = sink_grad(dout, out, lse, sink, dlse).to(ctx.sink_dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None


def sink_grad(dout, out, lse, sink, dlse=None):
    """d(sink) (H,) fp32: -sum_i p_i (delta_i - dlse_i) over every row of each head, p_i = exp(sink - lse_i); dense
    out / dout (B, Sq, H, Dv) with lse (B, H, Sq), or varlen (T, H, Dv) with lse (H, T) (rows of no sequence have
    lse +inf: p = 0)."""
    delta = (dout.float() * out.float()).sum(-1)  # (B, Sq, H) or (T, H)
    sink = sink.float()
    if lse.dim() == 3:
        if dlse is not None:
            delta = delta - dlse.transpose(1, 2)
        p = torch.exp(sink.view(1, -1, 1) - lse)  # (B, H, Sq)
        return -(p * delta.transpose(1, 2)).sum((0, 2))
    if dlse is not None:
        delta = delta - dlse.t()
    p = torch.exp(sink.view(-1, 1) - lse)  # (H, T)
    return -(p * delta.t()).sum(1)
