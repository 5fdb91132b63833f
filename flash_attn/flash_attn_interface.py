"""The public attention API, a drop-in for FlashAttention-2's ``flash_attn`` functions.

Shapes: q (B, Sq, H, D), k/v (B, Sk, Hk, D) with H % Hk == 0 (MQA/GQA without repeating K/V); packed
qkv (B, S, 3, H, D), kv (B, S, 2, Hk, D); varlen tensors (total_tokens, H, D) with int32 cu_seqlens
(B + 1,). Causal masks align to the bottom-right corner of the (Sq, Sk) score matrix. Each call runs on
the fastest installed backend that supports it (see :mod:`flash_attn.dispatch`).
"""
from __future__ import annotations

import torch

from . import _checks
from . import _ops
from .call import dense, describe, window
from .dropout import new_rng_state
from .fa2_private import (  # noqa: F401 (FA2's lower-level functions and autograd classes, imported from here)
    FlashAttnFunc,
    FlashAttnKVPackedFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    FlashAttnVarlenKVPackedFunc,
    FlashAttnVarlenQKVPackedFunc,
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)


def _attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, dropout_p,
          softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
          learnable_sink=None, return_lse=False):
    """An attention call of the API: validate, describe the call once (flash_attn.call), run the op. Returns out,
    (out, lse, probs) with return_attn_probs, else (out, lse) with return_lse (FA3's API: lse without probabilities).
    (flash_attn_func's common call, dense without dropout, softcap, ALiBi, probabilities or sink, is described by
    call.dense and runs on the lighter autograd functions of _ops: out only, no lse for the caller.)"""
    varlen = cu_seqlens_q is not None
    batch = None
    if varlen:
        batch = _varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
    H, Hk, D, Dv = _checks.qkv(q, k, v, varlen)
    left, right = window(window_size, causal)
    scale = _checks.scalars(dropout_p, softcap, softmax_scale, D)
    alibi_slopes = _checks.alibi(alibi_slopes, q.shape[0] if batch is None else batch, H, q.device)
    learnable_sink = _checks.sink(learnable_sink, H, q.device)
    rng_state = new_rng_state() if dropout_p > 0.0 else None
    if varlen:
        max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    else:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    call = describe(q, v, varlen=varlen, paged=block_table is not None, causal=causal, window_left=left,
                    window_right=right, softcap=softcap, alibi=alibi_slopes is not None, dropout_p=dropout_p,
                    return_probs=return_attn_probs, deterministic=deterministic, scale=scale,
                    sink=learnable_sink is not None)
    out, lse, probs = _ops.attention(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     block_table, alibi_slopes, rng_state, bool(return_attn_probs or return_lse),
                                     learnable_sink)
    if return_attn_probs:
        return out, lse, probs
    return (out, lse) if return_lse else out


def _varlen_args(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table):
    """The varlen arguments' checks (shapes, dtypes, the paged cache's bounds) -> the batch size."""
    _checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have length {batch + 1} like cu_seqlens_q, "
                         f"got {cu_seqlens_k.shape[0]}")
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError("max_seqlen_q and max_seqlen_k must be >= 0")
    if block_table is not None:
        _checks.tensor("block_table", block_table, 2, dtypes=(torch.int32,), device=q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have {batch} rows (one per sequence), "
                             f"got {block_table.shape[0]}")
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            raise ValueError("with block_table, k and v must be paged caches "
                             f"(num_blocks, block_size, Hk, D); got k shape {tuple(k.shape)}")
        if max_seqlen_k > block_table.shape[1] * k.shape[1]:
            raise ValueError(f"max_seqlen_k ({max_seqlen_k}) exceeds the pages of block_table "
                             f"({block_table.shape[1]} blocks of {k.shape[1]})")
    elif k.dim() != 3:
        raise ValueError(f"k must have 3 dims (total_k, Hk, D), got shape {tuple(k.shape)}")
    return batch


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                    learnable_sink=None):
    """Attention of q (B, Sq, H, D) over k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> out (B, Sq, H, Dv).

    softmax_scale defaults to D**-0.5; window_size (left, right) with -1 unbounded; softcap > 0 applies
    cap * tanh(score / cap); alibi_slopes fp32 (H,) or (B, H) adds -slope * |i + Sk - Sq - j|.
    With return_attn_probs, returns (out, softmax_lse fp32 (B, H, Sq), probs (B, H, Sq, Sk)), probs
    negated where dropout dropped them (for testing only: it materialises Sq x Sk).
    learnable_sink (FA4's; not in FA2): (H,) fp32/bf16/fp16 logits, one per query head, not scaled by
    softmax_scale; each joins its head's softmax rows as an extra term exp(sink) with no value, so softmax_lse
    includes it and a row that sees no key gets out 0 and lse = sink (a -inf sink is no sink). Differentiable.
    """
    if not (dropout_p or softcap or return_attn_probs) and alibi_slopes is None and learnable_sink is None:
        # the common call
        qs, ks, vs = _checks.qkv_shapes(q, k, v, False)
        return _ops.attention_dense(dense(q, qs[3], vs[3], softmax_scale, causal, window_size, deterministic), q, k, v,
                                    qs[1], ks[1])
    return _attn(q, k, v, None, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              learnable_sink=None):
    """flash_attn_func on packed qkv (B, S, 3, H, D)."""
    _checks.tensor("qkv", qkv, 5)
    if qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (B, S, 3, H, D), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(2)
    if not (dropout_p or softcap or return_attn_probs) and alibi_slopes is None and learnable_sink is None:
        # the common call, whose backward writes one packed dqkv (_ops.attention_qkvpacked_dense)
        _, _, D, Dv = _checks.qkv(q, k, v, False)
        return _ops.attention_qkvpacked_dense(dense(q, D, Dv, softmax_scale, causal, window_size, deterministic),
                                              qkv)
    return _attn(q, k, v, None, None, None, None, None, dropout_p, softmax_scale, causal, window_size, softcap,
                 alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                             learnable_sink=None):
    """flash_attn_func with packed kv (B, Sk, 2, Hk, D)."""
    _checks.tensor("kv", kv, 5)
    if kv.shape[2] != 2:
        raise ValueError(f"kv must have shape (B, Sk, 2, Hk, D), got {tuple(kv.shape)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, learnable_sink)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False,
                           block_table=None, learnable_sink=None):
    """Attention over a batch of variable-length sequences packed along the first dim.

    q (total_q, H, D), k/v (total_k, Hk, D); cu_seqlens_q/k int32 (B + 1,) cumulative offsets starting at
    0 (empty sequences allowed); max_seqlen_* bound every sequence's length. With block_table int32
    (B, max_blocks), k/v are paged caches (num_blocks, block_size, Hk, D) and cu_seqlens_k gives each
    sequence's key count. softmax_lse is fp32 (H, total_q). learnable_sink: as flash_attn_func's.
    """
    return _attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                 return_attn_probs, learnable_sink)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False, learnable_sink=None):
    """flash_attn_varlen_func on packed qkv (total, 3, H, D)."""
    _checks.tensor("qkv", qkv, 4)
    if qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape (total, 3, H, D), got {tuple(qkv.shape)}")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, learnable_sink=None):
    """flash_attn_varlen_func with packed kv (total_k, 2, Hk, D)."""
    _checks.tensor("kv", kv, 4)
    if kv.shape[1] != 2:
        raise ValueError(f"kv must have shape (total_k, 2, Hk, D), got {tuple(kv.shape)}")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                  deterministic, return_attn_probs, learnable_sink=learnable_sink)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, learnable_sink=None):
    """Attention of q (B, Sq, H, D) over a KV cache, for inference (no backward).

    k_cache/v_cache (B_cache, Sk_cache, Hk, D), or paged (num_blocks, block_size, Hk, D) with block_table
    int32 (B, max_blocks). If k/v (B, S_new, Hk, D) are given they are written into the caches IN PLACE at
    positions cache_seqlens[b] .., after rotating k by rotary_cos/sin (seqlen_ro, rotary_dim / 2) when
    given (q is rotated too: at cache_seqlens + i if causal or local, else at cache_seqlens); rotary
    tables without new k/v are refused, as in FlashAttention-2.
    cache_seqlens: int or int32 (B,), the cache lengths before the append; cache_batch_idx int32 (B,)
    picks cache rows; cache_leftpad int32 (B,) where each cache row starts. learnable_sink: as
    flash_attn_func's (no gradient here). Returns out (B, Sq, H, D), and softmax_lse fp32 (B, H, Sq) with
    return_softmax_lse.
    """
    _checks.tensor("q", q, 4)
    _checks.tensor("k_cache", k_cache, 4, device=q.device)
    _checks.tensor("v_cache", v_cache, 4, device=q.device)
    B, Sq, H, D = q.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share a dtype; got {q.dtype}, {k_cache.dtype}, "
                        f"{v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _checks.last_dim_contiguous(name, t)
    if k_cache.shape[-1] != D:
        raise ValueError(f"k_cache head dim {k_cache.shape[-1]} must equal q head dim {D}")
    if v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must match k_cache shape "
                         f"{tuple(k_cache.shape)} except the last dim")
    Hk = k_cache.shape[2]
    if H % Hk != 0:
        raise ValueError(f"number of query heads ({H}) must be a multiple of key/value heads ({Hk})")
    if D > _checks.MAX_HEAD_DIM or v_cache.shape[-1] > _checks.MAX_HEAD_DIM:
        raise ValueError(f"head dim must be at most {_checks.MAX_HEAD_DIM}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or both None)")
    if k is not None:
        _checks.tensor("k", k, 4, device=q.device)
        _checks.tensor("v", v, 4, device=q.device)
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"k and v must have q's dtype {q.dtype}")
        if k.shape[0] != B or k.shape[2:] != k_cache.shape[2:] or v.shape[:-1] != k.shape[:-1] \
                or v.shape[-1] != v_cache.shape[-1]:
            raise ValueError(f"k/v must have shape (B={B}, S_new, Hk={Hk}, D) matching the caches; got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        _checks.last_dim_contiguous("k", k)
        _checks.last_dim_contiguous("v", v)
    if block_table is not None:
        _checks.tensor("block_table", block_table, 2, dtypes=(torch.int32,), device=q.device)
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have {B} rows, got {block_table.shape[0]}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (paged KV cache)")
    elif cache_batch_idx is None and k_cache.shape[0] != B:
        raise ValueError(f"k_cache batch ({k_cache.shape[0]}) must equal q batch ({B}) "
                         "unless cache_batch_idx or block_table maps them")
    if cache_seqlens is None:  # the whole cache is valid
        if k is not None:
            raise ValueError("cache_seqlens is required when appending k/v to the cache")
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        cache_seqlens = _checks.trust(torch.full((B,), capacity, dtype=torch.int32, device=q.device))
    elif isinstance(cache_seqlens, int):
        capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
        s_new = 0 if k is None else k.shape[1]
        if not 0 <= cache_seqlens <= capacity - s_new:
            error = ValueError if block_table is None else _checks.PagedCapacityError
            where = "cache" if block_table is None else f"block_table's {block_table.shape[1]} pages"
            raise error(f"cache_seqlens ({cache_seqlens}) must be in [0, {capacity - s_new}] "
                        f"({where}: capacity {capacity}, {s_new} new tokens)")
        # checked here on the host: the op must not sync to read it back
        cache_seqlens = _checks.trust(torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device))
    else:
        _checks.int32_vector("cache_seqlens", cache_seqlens, B, q.device)
    if cache_batch_idx is not None:
        _checks.int32_vector("cache_batch_idx", cache_batch_idx, B, q.device)
    if cache_leftpad is not None:
        _checks.int32_vector("cache_leftpad", cache_leftpad, B, q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos/rotary_sin rotate the new k (and q) being appended: pass k and v too "
                         "(as FlashAttention-2 requires)")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _checks.tensor(name, t, 2, device=q.device)
            if t.shape != rotary_cos.shape:
                raise ValueError("rotary_cos and rotary_sin must have the same shape")
        if 2 * rotary_cos.shape[1] > D:
            raise ValueError(f"rotary_cos has rotary_dim / 2 = {rotary_cos.shape[1]} columns; rotary_dim "
                             f"must be at most the head dim {D}")
    scale = _checks.scalars(0.0, softcap, softmax_scale, D)
    left, right = window(window_size, causal)
    alibi_slopes = _checks.alibi(alibi_slopes, B, H, q.device)
    if learnable_sink is not None:  # (inference only: a sink that is a trained parameter gives no gradient here)
        learnable_sink = _checks.sink(learnable_sink, H, q.device).detach()
    out, lse = _ops.kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                cache_batch_idx, cache_leftpad, block_table, scale, bool(causal), left, right,
                                float(softcap), bool(rotary_interleaved), alibi_slopes, int(num_splits),
                                learnable_sink)
    return (out, lse) if return_softmax_lse else out
