"""The attention ops registered with torch.library, so torch.compile(fullgraph=True) traces models that
call them without graph breaks: flash_attn::fwd, flash_attn::bwd (wired up as fwd's autograd formula)
and flash_attn::fwd_kvcache (mutates the caches). Each real implementation validates tensor values,
picks a backend through :mod:`flash_attn.dispatch` and runs it; the fake implementations give shapes. Eager calls
arrive with the call's description (flash_attn.call.AttnCall, built at the API) and skip the ops; the ops' flat
schema is the description's fields, from which their implementations rebuild it.

A learnable sink (FA4's, (H,) logits) travels beside the description like ALiBi's slopes: the forward backends take it
(``sink=``, fp32) and return an lse that includes it. The backward needs nothing more from a backend: with that lse,
P = exp(s - lse) and delta = rowsum(dO * O) are the sink-aware ones, so dq, dk, dv come out right, and the sink's own
gradient is computed here in torch ops (sink_grad).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _checks, dispatch
from .call import describe, for_backward


def _check_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table):
    if cu_seqlens_q is None:
        return
    _checks.cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    if block_table is None:
        _checks.cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    else:  # paged: cu_seqlens_k counts each sequence's keys, bounded by max_seqlen_k <= its pages
        _checks.cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, None, max_seqlen_k)
        _checks.range_values("block_table", block_table, 0, k.shape[0])


def _forward(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes,
             rng_state, sink=None, lse_dropped=False):
    """The forward of a described call on the backend that serves it -> (out, lse, probs or None). sink: the
    learnable sink of a call with ``call.sink``, handed to the backend in fp32. lse_dropped: no gradient follows and
    the caller drops lse (a backend with LSE_SCRATCH is told so: lse_scratch)."""
    if cu_seqlens_q is not None:
        _check_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    backend = dispatch.select(call)
    extra = {} if sink is None else {"sink": _fp32_sink(sink)}
    if lse_dropped and getattr(backend, "LSE_SCRATCH", False):
        extra["lse_scratch"] = True
    return backend.fwd(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                       alibi_slopes, rng_state, **extra)


def _fp32_sink(sink):
    return sink.detach().to(torch.float32).contiguous()


def sink_grad(dout, out, lse, sink, dlse=None):
    """The learnable sink's gradient, fp32 (H,). The sink enters only through each row's lse, with d lse_i / d sink
    = exp(sink - lse_i) =: p_i (the sink's probability in row i), and d L / d lse_i = dlse_i - delta_i, delta_i =
    rowsum(dO_i * O_i) (the output's share, as O_i = sum_j P_ij V_j with P_ij = exp(s_ij - lse_i)); summed over every
    row of the head. Dense: out / dout (B, Sq, H, Dv), lse (B, H, Sq); varlen: (T, H, Dv), (H, T). A row with lse
    +inf (padding, or no key and a -inf sink) has p = 0, as has every row under a -inf sink (the forwards never
    give such a sink's rows lse -inf)."""
    delta = (dout.float() * out.float()).sum(-1)  # (B, Sq, H) or (T, H)
    s = sink.detach().float()
    if lse.dim() == 3:
        delta = delta.transpose(1, 2)  # (B, H, Sq)
        s = s.view(1, -1, 1)
    else:
        delta = delta.t()  # (H, T)
        s = s.view(-1, 1)
    if dlse is not None:
        delta = delta - dlse
    p = torch.exp(s - lse)
    dims = (0, 2) if lse.dim() == 3 else (1,)
    return -(p * delta).sum(dims)


def _backward(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
              alibi_slopes, rng_state, dlse=None, grads=None, forced=dispatch._CURRENT):
    """(dq, dk, dv) of the forward ``call`` on the backend that serves its backward (under ``forced``, the backend
    its forward was forced onto; default: this context's). dlse, the gradient flowing into the returned lse, travels
    only when there is one (a backend may take a faster path without it); ``grads``, the tensors to write the
    gradients into, only to a backend that takes them (BWD_OUT)."""
    call = for_backward(call)
    backend = dispatch.select(call, forced)
    extra = {} if dlse is None else {"dlse": dlse}
    if grads is not None and getattr(backend, "BWD_OUT", False):
        extra["grads"] = grads
    return backend.bwd(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       block_table, alibi_slopes, rng_state, **extra)


# ---- the custom ops (torch.compile traces these): their flat arguments are the description's fields ----

def _flat_call(q, v, cu_seqlens_q, block_table, softmax_scale, causal, window_left, window_right, softcap,
               alibi_slopes, dropout_p, return_probs, deterministic, sink=False):
    return describe(q, v, varlen=cu_seqlens_q is not None, paged=block_table is not None, causal=causal,
                    window_left=window_left, window_right=window_right, softcap=softcap,
                    alibi=alibi_slopes is not None, dropout_p=dropout_p, return_probs=return_probs,
                    deterministic=deterministic, scale=softmax_scale, sink=sink)


def _fwd_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, block_table: Optional[Tensor], softmax_scale: float,
        causal: bool, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        dropout_p: float, rng_state: Optional[Tensor], return_probs: bool,
        deterministic: bool, lse_grad: bool = False,
        learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    call = _flat_call(q, v, cu_seqlens_q, block_table, softmax_scale, causal, window_left, window_right, softcap,
                      alibi_slopes, dropout_p, return_probs, deterministic, learnable_sink is not None)
    out, lse, probs = _forward(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                               alibi_slopes, rng_state, learnable_sink)
    if probs is None:
        probs = q.new_empty(0, dtype=torch.float32)
    # the fake kernels promise contiguous outputs; torch.compile checks real strides against them
    return out.contiguous(), lse.contiguous(), probs


fwd = torch.library.custom_op("flash_attn::fwd", _fwd_impl, mutates_args=())


@fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
              causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, return_probs,
              deterministic, lse_grad=False, learnable_sink=None):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is None:
        B, Sq, H = q.shape[:3]
        lse = q.new_empty((B, H, Sq), dtype=torch.float32)
        probs_shape = (B, H, Sq, k.shape[1])
    else:
        total, H = q.shape[:2]
        lse = q.new_empty((H, total), dtype=torch.float32)
        probs_shape = (cu_seqlens_q.shape[0] - 1, H, max_seqlen_q, max_seqlen_k)
    probs = q.new_empty(probs_shape if return_probs else (0,), dtype=torch.float32)
    return out, lse, probs


def _bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int,
        block_table: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
        rng_state: Optional[Tensor], deterministic: bool,
        dlse: Optional[Tensor] = None, sink: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    # (sink: the forward had one, so its lse includes it; the backends need only that fact, for their choice)
    call = _flat_call(q, v, cu_seqlens_q, block_table, softmax_scale, causal, window_left, window_right, softcap,
                      alibi_slopes, dropout_p, False, deterministic, sink)
    dq, dk, dv = _backward(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           block_table, alibi_slopes, rng_state, dlse)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


bwd = torch.library.custom_op("flash_attn::bwd", _bwd_impl, mutates_args=())


@bwd.register_fake
def _bwd_fake(dout, q, k, v, *args):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_args(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state):
    """flash_attn::fwd's arguments after q, k, v (without lse_grad) of a described call."""
    return (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, call.softmax_scale, call.causal,
            call.window_left, call.window_right, call.softcap, alibi_slopes, call.dropout_p, rng_state,
            call.return_probs, call.deterministic)


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale, causal,
     window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, return_probs, deterministic,
     *rest) = inputs
    lse_grad = bool(rest and rest[0])
    sink = rest[1] if len(rest) > 1 else None
    _save(ctx, _flat_call(q, v, cu_seqlens_q, block_table, softmax_scale, causal, window_left, window_right, softcap,
                          alibi_slopes, dropout_p, return_probs, deterministic, sink is not None),
          q, k, v, output[0], output[1], (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                          alibi_slopes, rng_state), lse_grad, sink)


def _save(ctx, call, q, k, v, out, lse, extras, lse_grad, sink=None):
    """What the backward of a forward needs: the tensors, the description, the sequence lengths. lse_grad: the caller
    hands lse to its user, so a gradient may flow into it; without it the backward drops dlse, which torch.compile's
    backward always passes (zeros for an unused output). sink: the learnable sink, for its gradient."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state = extras
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, rng_state, sink)
    ctx.call = call
    ctx.seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.lse_grad = lse_grad
    ctx.forced = dispatch.forced_backend()  # autograd may run the backward on another thread, outside the context


def _backward_with(traced, sink_input):
    """The backward of the saved forward -> (dq, dk, dv, d sink or None); sink_input: the sink's position among the
    Function's inputs (its gradient is computed only when that input needs one)."""
    def backward(ctx, dout, dlse, dprobs):
        (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, rng_state,
         sink) = ctx.saved_tensors
        max_seqlen_q, max_seqlen_k = ctx.seqlens
        call = ctx.call
        if not ctx.lse_grad:
            dlse = None
        if dout is None:  # only lse is used (grads are not materialised: see _EagerAttention)
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq = dk = dv = dsink = None
        # (when only the sink needs a gradient, no attention backward runs)
        if sink is None or any(ctx.needs_input_grad[:3]):
            if traced:  # the bwd custom op, so that AOTAutograd sees an op, not Python
                args = _op_args(call, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                alibi_slopes, rng_state)
                dq, dk, dv = bwd(dout, q, k, v, out, lse, *args[:12], rng_state, call.deterministic, dlse, call.sink)
            else:
                dq, dk, dv = _backward(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, block_table, alibi_slopes, rng_state, dlse, forced=ctx.forced)
        if sink is not None and ctx.needs_input_grad[sink_input]:
            dsink = sink_grad(dout, out, lse, sink, dlse).to(sink.dtype)
        return dq, dk, dv, dsink
    return backward


_traced_backward = _backward_with(True, 19)


def _op_backward(ctx, dout, dlse, dprobs):
    dq, dk, dv, dsink = _traced_backward(ctx, dout, dlse, dprobs)
    return (dq, dk, dv) + (None,) * 16 + (dsink,)


torch.library.register_autograd("flash_attn::fwd", _op_backward, setup_context=_fwd_setup_context)


_eager_backward = _backward_with(False, 3)


class _EagerAttention(torch.autograd.Function):
    """The same forward/backward as the custom op, without the dispatcher's per-call cost (which is
    tens of microseconds with autograd on): used whenever torch.compile is not tracing."""

    # Old-style forward (ctx first): a separate setup_context costs ~40 us per call. The trailing arguments travel
    # as one tuple: apply() walks every argument, so fewer is cheaper. The sink is an argument of its own (None
    # without one): autograd gives gradients to arguments only.
    @staticmethod
    def forward(ctx, q, k, v, sink, rest):
        call, extras, lse_grad = rest
        out, lse, probs = _forward(call, q, k, v, *extras, sink)
        if probs is None:
            probs = q.new_empty(0, dtype=torch.float32)
        _save(ctx, call, q, k, v, out, lse, extras, lse_grad, sink)
        # An unused lse then arrives as None, not as zeros: the backward skips the lse term.
        ctx.set_materialize_grads(False)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout, dlse, dprobs):
        return _eager_backward(ctx, dout, dlse, dprobs) + (None,)


# torch.autograd.Function.apply's Python wrapper binds default arguments for setup_context-style Functions,
# checks for functorch transforms and unwraps dead functorch wrappers (~2 us per call); attention() does
# the last two itself and calls the C apply underneath. On a torch without these internals it uses apply.
try:
    _c_apply = super(torch.autograd.Function, _EagerAttention).apply
    _transforms_active = torch._C._are_functorch_transforms_active
    _unwrap = torch._C._functorch.unwrap_if_dead
except AttributeError:
    _c_apply = _EagerAttention.apply
    _transforms_active = bool

    def _unwrap(t):
        return t


def attention(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes,
              rng_state, lse_grad, sink=None):
    """(out, lse, probs) of a described call, differentiable in q, k, v (and the learnable sink ``sink`` of a call
    with ``call.sink``). lse_grad: lse reaches the caller's user (a gradient may flow into it)."""
    extras = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state)
    if torch.compiler.is_compiling():
        if sink is None:
            return fwd(q, k, v, *_op_args(call, *extras), lse_grad)
        return fwd(q, k, v, *_op_args(call, *extras), lse_grad, sink)
    if _transforms_active():
        return _EagerAttention.apply(q, k, v, sink, (call, extras, lse_grad))
    q, k, v = _unwrap(q), _unwrap(k), _unwrap(v)
    if sink is not None:
        sink = _unwrap(sink)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sink is not None and sink.requires_grad)):
        return _c_apply(q, k, v, sink, (call, extras, lse_grad))
    # Nothing to differentiate: the autograd.Function would only add its cost.
    out, lse, probs = _forward(call, q, k, v, *extras, sink, lse_dropped=not lse_grad)
    if probs is None:
        probs = q.new_empty(0, dtype=torch.float32)
    return out.contiguous(), lse, probs


def _fwd_dense(call, q, k, v):
    """The forward of a dense described call without dropout, softcap, ALiBi or probabilities -> (out, lse)."""
    out, lse, _ = dispatch.select(call).fwd(call, q, k, v, None, None, q.shape[1], k.shape[1], None, None, None)
    return out.contiguous(), lse


def _fwd_dense_out(call, q, k, v, seqlen_q, seqlen_k):
    """_fwd_dense's out alone (no gradient, lse dropped), the lengths Sq, Sk given: a backend that can (LSE_SCRATCH)
    writes lse to a shared buffer instead of a new one."""
    backend = dispatch.select(call)
    if getattr(backend, "LSE_SCRATCH", False):
        out = backend.fwd(call, q, k, v, None, None, seqlen_q, seqlen_k, None, None, None, lse_scratch=True)[0]
    else:
        out = backend.fwd(call, q, k, v, None, None, seqlen_q, seqlen_k, None, None, None)[0]
    return out.contiguous()


class _EagerDenseAttention(torch.autograd.Function):
    """_EagerAttention for attention_dense: out is its only output (each output costs autograd ~0.5 us)."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = _fwd_dense(call, q, k, v)
        _save(ctx, call, q, k, v, out, lse.contiguous(), (None, None, q.shape[1], k.shape[1], None, None, None),
              False)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _eager_backward(ctx, dout, None, None)[:3] + (None,)


try:
    _c_apply_dense = super(torch.autograd.Function, _EagerDenseAttention).apply
except AttributeError:
    _c_apply_dense = _EagerDenseAttention.apply


def attention_dense(call, q, k, v, seqlen_q=None, seqlen_k=None):
    """attention() of flash_attn_func's common call (dense; no dropout, softcap, ALiBi or probabilities: see
    flash_attn.call.dense) -> out. The same op, with less per-call work than the general entry. seqlen_q / seqlen_k:
    Sq and Sk where the caller has read them (else read here)."""
    if torch.compiler.is_compiling() or _transforms_active():
        return attention(call, q, k, v, None, None, q.shape[1], k.shape[1], None, None, None, False)[0]
    q, k, v = _unwrap(q), _unwrap(k), _unwrap(v)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _c_apply_dense(q, k, v, call)
    if seqlen_q is None:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    return _fwd_dense_out(call, q, k, v, seqlen_q, seqlen_k)


class _EagerPackedDenseAttention(torch.autograd.Function):
    """attention_dense on packed qkv (B, S, 3, H, D) -> out. Its backward allocates one packed gradient and
    has the backend write dq, dk, dv into its three slices (when the backend takes ``grads``, as
    Triton's does), where autograd through qkv.unbind(2) would stack three separate gradients: a copy
    of the whole gradient per call (1.2% of a GPT-2 medium training step on an H200)."""

    @staticmethod
    def forward(ctx, qkv, call):
        q, k, v = qkv.unbind(2)
        out, lse = _fwd_dense(call, q, k, v)
        ctx.save_for_backward(qkv, out, lse.contiguous())
        ctx.call = call
        ctx.forced = dispatch.forced_backend()
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        q, k, v = qkv.unbind(2)
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        grads = dqkv.unbind(2)
        result = _backward(ctx.call, dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], None, None, None,
                           grads=grads, forced=ctx.forced)
        for g, r in zip(grads, result):
            if r is not g:
                g.copy_(r)
        return dqkv, None


def attention_qkvpacked_dense(call, qkv):
    """attention_dense of qkv.unbind(2) for packed qkv (B, S, 3, H, D) -> out, with the packed backward above
    (under torch.compile or functorch transforms: the unbind path)."""
    if torch.compiler.is_compiling() or _transforms_active():
        q, k, v = qkv.unbind(2)
        return attention_dense(call, q, k, v)
    qkv = _unwrap(qkv)
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _c_apply_packed(qkv, call)
    q, k, v = qkv.unbind(2)
    S = qkv.shape[1]
    return _fwd_dense_out(call, q, k, v, S, S)


try:
    _c_apply_packed = super(torch.autograd.Function, _EagerPackedDenseAttention).apply
except AttributeError:
    _c_apply_packed = _EagerPackedDenseAttention.apply


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
            num_splits, learnable_sink=None):
    """flash_attn_with_kvcache's (out, lse): the op fwd_kvcache under torch.compile, functorch transforms or inputs
    that want gradients (the op then refuses a backward), else its implementation called directly (a custom op's
    eager dispatch costs several times the rest of a decoding call's host work), bumping the version counters of
    the caches it appends to as the op's mutation does."""
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
            num_splits, learnable_sink)
    if (torch.compiler.is_compiling() or _transforms_active()
            or (torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad
                                             or (k is not None and (k.requires_grad or v.requires_grad))))):
        return fwd_kvcache(*args)
    out, lse = _fwd_kvcache(*args)
    if k is not None and k.shape[1] and q.shape[0]:
        torch.autograd.graph.increment_version((k_cache, v_cache))
    return out, lse


@torch.library.custom_op("flash_attn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Tensor,
                cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                block_table: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
                window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                num_splits: int, learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                        rotary_interleaved, alibi_slopes, num_splits, learnable_sink)


def _fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                 block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
                 alibi_slopes, num_splits, learnable_sink):
    s_new = 0 if k is None else k.shape[1]
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if block_table is not None:
        _checks.range_values("block_table", block_table, 0, k_cache.shape[0])
        _checks.range_values("cache_seqlens", cache_seqlens, 0, capacity - s_new + 1, _checks.PagedCapacityError,
                             f" (block_table holds {block_table.shape[1]} pages of {k_cache.shape[1]} rows"
                             + (f", {s_new} new keys" if s_new else "") + ")")
    else:
        _checks.range_values("cache_seqlens", cache_seqlens, 0, capacity - s_new + 1)
    if cache_batch_idx is not None:
        _checks.range_values("cache_batch_idx", cache_batch_idx, 0, k_cache.shape[0])
    if cache_leftpad is not None:
        _checks.range_values("cache_leftpad", cache_leftpad, 0, capacity + 1)
    call = describe(q, v_cache, paged=block_table is not None, causal=causal, window_left=window_left,
                    window_right=window_right, softcap=softcap, alibi=alibi_slopes is not None, kvcache=True,
                    scale=softmax_scale, sink=learnable_sink is not None)
    if rotary_cos is not None and k is not None:
        # positions cache_seqlens + i must exist in the cos/sin tables (q uses them too when the mask is bounded)
        need = max(s_new, q.shape[1] if call.bounded else 1)
        _checks.range_values("cache_seqlens", cache_seqlens, 0, rotary_cos.shape[0] - need + 1)
    extra = {} if learnable_sink is None else {"sink": _fp32_sink(learnable_sink)}
    out, lse = dispatch.select(call).fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                                                 rotary_interleaved, num_splits, **extra)
    return out.contiguous(), lse.contiguous()


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, *args):
    B, Sq, H = q.shape[:3]
    return q.new_empty((B, Sq, H, v_cache.shape[-1])), q.new_empty((B, H, Sq), dtype=torch.float32)
