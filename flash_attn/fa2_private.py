"""FA2's lower-level functions, which downstream libraries (ring attention, sequence-parallel and diffusion
libraries) import from ``flash_attn.flash_attn_interface``: ``_flash_attn_forward`` / ``_flash_attn_varlen_forward``
(no autograd; out, lse, probabilities, rng_state) and ``_flash_attn_backward`` / ``_flash_attn_varlen_backward``
(gradients written into the caller's dq, dk, dv; returns delta = rowsum(dout * out)), and the ``FlashAttn*Func``
autograd classes built on them, with FA2's signatures and return values. They run on the dispatcher's backends,
described like every other call (flash_attn.call), and take the same checks as the public functions.

Where this differs from FA2: the probabilities (``return_softmax``) are fp32 at their true size, negated where
dropout dropped them (as ``flash_attn_func(return_attn_probs=True)`` returns them); ``rng_state`` is the int64 pair
this package's dropout hash is keyed by (zeros without dropout); the returned delta is fp32 (B, H, Sq) (varlen:
(H, total_q)), unpadded. ``leftpad_k`` and ``seqused_k`` are refused (NotImplementedError): the varlen kernels here
take each sequence's keys from cu_seqlens_k.
"""
from __future__ import annotations

import torch

from . import _checks, _ops
from .call import describe, window
from .dropout import new_rng_state


def _describe(q, k, v, varlen, paged, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
              softcap, alibi_slopes, return_softmax=False, deterministic=False, batch=None):
    """(call, alibi_slopes) of a call given by FA2's lower-level arguments, checked as the public API checks them."""
    H, _, D, _ = _checks.qkv(q, k, v, varlen)
    scale = _checks.scalars(dropout_p, softcap, softmax_scale, D)
    left, right = window((window_size_left, window_size_right), causal)
    alibi_slopes = _checks.alibi(alibi_slopes, q.shape[0] if batch is None else batch, H, q.device)
    call = describe(q, v, varlen=varlen, paged=paged, causal=causal, window_left=left, window_right=right,
                    softcap=softcap, alibi=alibi_slopes is not None, dropout_p=dropout_p,
                    return_probs=return_softmax, deterministic=deterministic, scale=scale)
    return call, alibi_slopes


def _rng(dropout_p, rng_state):
    if dropout_p > 0.0:
        if rng_state is None:
            raise ValueError("rng_state: the forward's rng_state is required to replay its dropout in the backward")
        return rng_state.to("cpu", torch.int64)
    return None


def _no_probs(q):
    return torch.empty(0, dtype=torch.float32, device=q.device)


def _refuse_varlen_extras(leftpad_k, seqused_k):
    for name, t in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if t is not None:
            raise NotImplementedError(f"{name}: the varlen kernels here take each sequence's keys from cu_seqlens_k")


def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax):
    """FA2's dense forward without autograd -> (out, softmax_lse (B, H, Sq) fp32, S_dmask, rng_state)."""
    call, alibi_slopes = _describe(q, k, v, False, False, dropout_p, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, alibi_slopes, return_softmax)
    rng_state = new_rng_state() if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64)
    out, lse, probs = _ops._forward(call, q, k, v, None, None, q.shape[1], k.shape[1], None, alibi_slopes,
                                    rng_state if dropout_p > 0.0 else None)
    return out.contiguous(), lse.contiguous(), _no_probs(q) if probs is None else probs, rng_state


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                               alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """FA2's varlen forward without autograd -> (out, softmax_lse (H, total_q) fp32, S_dmask, rng_state).
    ``zero_tensors`` and ``num_splits`` change nothing here (rows outside every sequence are always 0)."""
    _refuse_varlen_extras(leftpad_k, seqused_k)
    _checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    call, alibi_slopes = _describe(q, k, v, True, block_table is not None, dropout_p, softmax_scale, causal,
                                   window_size_left, window_size_right, softcap, alibi_slopes, return_softmax,
                                   batch=cu_seqlens_q.shape[0] - 1)
    rng_state = new_rng_state() if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64)
    out, lse, probs = _ops._forward(call, q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                    block_table, alibi_slopes, rng_state if dropout_p > 0.0 else None)
    return out.contiguous(), lse.contiguous(), _no_probs(q) if probs is None else probs, rng_state


def _write_grads(result, dq, dk, dv, q, k, v):
    out = []
    for given, r, like in zip((dq, dk, dv), result, (q, k, v)):
        if given is None:
            out.append(r)
        else:
            if given.shape != like.shape:
                raise ValueError(f"a gradient buffer has shape {tuple(given.shape)}; expected {tuple(like.shape)}")
            if r is not given:
                given.copy_(r)
            out.append(given)
    return out


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """FA2's dense backward: the gradients go into dq, dk, dv; returns delta = rowsum(dout * out), fp32 (B, H, Sq)."""
    call, alibi_slopes = _describe(q, k, v, False, False, dropout_p, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, alibi_slopes, deterministic=deterministic)
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    grads = (dq, dk, dv) if dq is not None and dk is not None and dv is not None else None
    result = _ops._backward(call, dout, q, k, v, out, softmax_lse, None, None, q.shape[1], k.shape[1], None,
                            alibi_slopes, _rng(dropout_p, rng_state), grads=grads)
    _write_grads(result, dq, dk, dv, q, k, v)
    return (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, deterministic, rng_state=None, zero_tensors=False):
    """FA2's varlen backward: the gradients go into dq, dk, dv; returns delta, fp32 (H, total_q)."""
    _checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    call, alibi_slopes = _describe(q, k, v, True, False, dropout_p, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, alibi_slopes, deterministic=deterministic,
                                   batch=cu_seqlens_q.shape[0] - 1)
    dout = dout.contiguous() if dout.stride(-1) != 1 else dout
    grads = (dq, dk, dv) if dq is not None and dk is not None and dv is not None else None
    result = _ops._backward(call, dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                            int(max_seqlen_k), None, alibi_slopes, _rng(dropout_p, rng_state), grads=grads)
    _write_grads(result, dq, dk, dv, q, k, v)
    return (dout.float() * out.float()).sum(-1).transpose(0, 1).contiguous()


# ---- FA2's autograd classes: FlashAttn[Varlen][QKVPacked|KVPacked]Func.apply(...) with FA2's arguments ----

def _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_softmax):
    out, lse, probs, rng_state = _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size[0],
                                                     window_size[1], softcap, alibi_slopes, return_softmax)
    ctx.save_for_backward(q, k, v, out, lse, rng_state)
    ctx.args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
    return out if not return_softmax else (out, lse, probs)


def _dense_backward(ctx, dout):
    q, k, v, out, lse, rng_state = ctx.saved_tensors
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic = ctx.args
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size[0],
                         window_size[1], softcap, alibi_slopes, deterministic, rng_state)
    return dq, dk, dv


def _varlen_forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, deterministic, return_softmax, block_table=None):
    out, lse, probs, rng_state = _flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap,
        alibi_slopes, return_softmax, block_table)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state)
    ctx.args = (max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic)
    return out if not return_softmax else (out, lse, probs)


def _varlen_backward(ctx, dout):
    q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
    max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic = ctx.args
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p,
                                softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
                                deterministic, rng_state)
    return dq, dk, dv


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        return (*_dense_backward(ctx, dout), *(None,) * 9)


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        q, k, v = qkv.detach().unbind(2)
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        return (torch.stack(_dense_backward(ctx, dout), 2), *(None,) * 9)


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        k, v = kv.detach().unbind(2)
        return _dense_forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              deterministic, return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        dq, dk, dv = _dense_backward(ctx, dout)
        return (dq, torch.stack((dk, dv), 2), *(None,) * 9)


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table=None,
                is_grad_enabled=True):
        return _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax, block_table)

    @staticmethod
    def backward(ctx, dout, *args):
        return (*_varlen_backward(ctx, dout), *(None,) * 14)


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        q, k, v = qkv.detach().unbind(1)
        return _varlen_forward(ctx, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        return (torch.stack(_varlen_backward(ctx, dout), 1), *(None,) * 11)


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        k, v = kv.detach().unbind(1)
        return _varlen_forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                               softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                               return_softmax)

    @staticmethod
    def backward(ctx, dout, *args):
        dq, dk, dv = _varlen_backward(ctx, dout)
        return (dq, torch.stack((dk, dv), 1), *(None,) * 13)
