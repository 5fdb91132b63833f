"""Attention over a KV cache (FA2's ``flash_attn_with_kvcache``) for decoding, CUDA-graph capturable.

Up to three launches, none of which reads a device value on the host:

1. ``_kvcache_prep_kernel`` (when there are new k/v, or rotary): rotates the new k (rotary_cos/sin at
   absolute positions cache_seqlens[b] + i) and writes k/v into the cache rows (dense, through
   cache_batch_idx, or paged through block_table); rotates q into a fresh buffer (at cache_seqlens[b] + i
   under a causal/local mask, else every row at cache_seqlens[b]).
2. ``_kvcache_attn_kernel``: one program per (batch, kv head, split, row block). The query heads of a KV
   group are packed into the rows of one tile (row r = query i * group + head g), so every K/V block is
   read once per group. The keys a row block can see (after leftpad, cache length and window) are cut
   into ``num_splits`` contiguous runs of whole blocks; the cut is computed in the kernel from the
   runtime lengths, so the grid depends only on shapes.
3. ``_kvcache_combine_kernel`` (num_splits > 1): merges the splits' normalised partial outputs by their
   log-sum-exps.

A learnable sink (HAS_SINK: one logit per query head, an extra softmax term with no value) joins each row's sum
where the row is finished: in the attention kernel's epilogue with one split, in the combine kernel with several
(the partials stay sink-free).

Cache lengths, leftpad, batch indices and block tables are only ever read inside kernels, and the kernels
take lengths as unspecialised runtime arguments, so one compiled kernel serves every cache length and a
captured graph can be replayed after cache_seqlens changes in place.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _configs
from ._common import LN2, LOG2E, NO_WINDOW, _kv_block_range, _scores
from ._launch import Launcher

_LOG2E = 1.4426950408889634
MAX_SPLITS = 128


@triton.jit
def _rotary(X, rows, pos, row_ok, Cos, Sin, stride_xm, stride_cm, stride_sm, seqlen_ro,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY_DIM: tl.constexpr,
            INTERLEAVED: tl.constexpr):
    """Rows `rows` of X (row stride stride_xm, contiguous head dim) rotated at positions pos, in fp32.

    Interleaved (GPT-J) pairs dims (2t, 2t + 1), else (GPT-NeoX) (t, t + ROTARY_DIM / 2); both use angle t.
    Dims past ROTARY_DIM are passed through.
    """
    d = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(X + rows[:, None] * stride_xm + d[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROTARY_DIM > 0:
        if INTERLEAVED:
            t = d // 2
            partner = d ^ 1
            first = (d % 2) == 0
        else:
            first = d < ROTARY_DIM // 2
            t = tl.where(first, d, d - ROTARY_DIM // 2)
            partner = tl.where(first, d + ROTARY_DIM // 2, d - ROTARY_DIM // 2)
        in_rot = d < ROTARY_DIM
        t = tl.where(in_rot, t, 0)
        partner = tl.where(in_rot, partner, d)
        rok = ok & in_rot[None, :] & (pos[:, None] < seqlen_ro)
        xp = tl.load(X + rows[:, None] * stride_xm + partner[None, :], mask=rok, other=0.0).to(tl.float32)
        c = tl.load(Cos + pos[:, None] * stride_cm + t[None, :], mask=rok, other=1.0).to(tl.float32)
        s = tl.load(Sin + pos[:, None] * stride_sm + t[None, :], mask=rok, other=0.0).to(tl.float32)
        # first of a pair: x1 c - x2 s; second: x2 c + x1 s (x1, x2 the pair's first and second dims)
        xs = tl.where(first[None, :], -xp, xp) * s
        x = tl.where(in_rot[None, :], x * c + xs, x)
    return x


@triton.jit
def _cache_row_offsets(pos, ok, BtRow, stride_cb, stride_cn, cache_row,
                       PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """int64 element offsets of cache positions pos (a vector) of one sequence."""
    if PAGED:
        blk = tl.load(BtRow + pos // PAGE_SIZE, mask=ok, other=0)
        return blk.to(tl.int64) * stride_cb + ((pos % PAGE_SIZE) * stride_cn).to(tl.int64)
    else:
        return cache_row.to(tl.int64) * stride_cb + pos.to(tl.int64) * stride_cn


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_new", "num_kv_heads", "capacity", "seqlen_ro", "stride_btb"])
def _kvcache_prep_kernel(
    Q, QRot, KNew, VNew, KCache, VCache, Cos, Sin, CacheSeqlens, CacheBatchIdx, BlockTable,
    stride_qb, stride_qm, stride_qh,
    stride_rb, stride_rm, stride_rh,
    stride_knb, stride_knm, stride_knh,
    stride_vnb, stride_vnm, stride_vnh,
    stride_kcb, stride_kcn, stride_kch,
    stride_vcb, stride_vcn, stride_vch,
    stride_cm, stride_sm, stride_btb,
    seqlen_q, seqlen_new, num_heads, num_kv_heads, capacity, seqlen_ro,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, APPEND: tl.constexpr,
    ROTATE_Q: tl.constexpr, Q_LOCAL: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr,
):
    bh = tl.program_id(0)
    pid_r = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cache_len = tl.load(CacheSeqlens + b).to(tl.int32)
    if ROTATE_Q:
        q_ok = rows < seqlen_q
        if Q_LOCAL:
            q_pos = cache_len + rows
        else:
            q_pos = cache_len + rows * 0
        Qb = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        x = _rotary(Qb, rows, q_pos, q_ok, Cos, Sin, stride_qm, stride_cm, stride_sm, seqlen_ro,
                    HEAD_DIM, BLOCK_D, ROTARY_DIM, INTERLEAVED)
        d = tl.arange(0, BLOCK_D)
        QRb = QRot + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
        tl.store(QRb + rows[:, None] * stride_rm + d[None, :], x.to(QRot.dtype.element_ty),
                 mask=q_ok[:, None] & (d[None, :] < HEAD_DIM))
    if APPEND:
        if h < num_kv_heads:
            pos = cache_len + rows
            # Rows past the cache's capacity are dropped (the op's checks reject them outside a graph
            # capture; inside one, nothing may write out of bounds).
            ok = (rows < seqlen_new) & (pos < capacity)
            if HAS_BATCH_IDX:
                cache_row = tl.load(CacheBatchIdx + b)
            else:
                cache_row = b
            BtRow = BlockTable + b.to(tl.int64) * stride_btb
            off_k = _cache_row_offsets(pos, ok, BtRow, stride_kcb, stride_kcn, cache_row, PAGED, PAGE_SIZE)
            off_v = _cache_row_offsets(pos, ok, BtRow, stride_vcb, stride_vcn, cache_row, PAGED, PAGE_SIZE)
            KNb = KNew + b.to(tl.int64) * stride_knb + h.to(tl.int64) * stride_knh
            k = _rotary(KNb, rows, pos, ok, Cos, Sin, stride_knm, stride_cm, stride_sm, seqlen_ro,
                        HEAD_DIM, BLOCK_D, ROTARY_DIM, INTERLEAVED)
            d = tl.arange(0, BLOCK_D)
            tl.store(KCache + h.to(tl.int64) * stride_kch + off_k[:, None] + d[None, :],
                     k.to(KCache.dtype.element_ty), mask=ok[:, None] & (d[None, :] < HEAD_DIM))
            dv = tl.arange(0, BLOCK_DV)
            VNb = VNew + b.to(tl.int64) * stride_vnb + h.to(tl.int64) * stride_vnh
            vmask = ok[:, None] & (dv[None, :] < HEAD_DIM_V)
            v = tl.load(VNb + rows[:, None] * stride_vnm + dv[None, :], mask=vmask, other=0.0)
            tl.store(VCache + h.to(tl.int64) * stride_vch + off_v[:, None] + dv[None, :],
                     v.to(VCache.dtype.element_ty), mask=vmask)


@triton.jit
def _attn_blocks(acc, l_i, m_i, q, K, V, BtRow, stride_kb, stride_kn, stride_vb, stride_vn, cache_row,
                 key_start, qi, slope_log2, offs_n, offs_d, offs_dv, start, end, seqlen_k, diag_off,
                 window_left, window_right, qk_scale, softcap_scale, softcap_log2,
                 IS_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                 WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """Online softmax over key blocks [start, end) (relative to key_start, the first visible cache row).
    K and V already point at the kv head; dense caches also at the sequence's cache row and key_start."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if MASK:
            col_ok = cols < seqlen_k
        else:
            col_ok = cols >= 0
        if PAGED:
            pos = key_start + cols
            k_rows = _cache_row_offsets(pos, col_ok, BtRow, stride_kb, stride_kn, cache_row, True, PAGE_SIZE)
            v_rows = _cache_row_offsets(pos, col_ok, BtRow, stride_vb, stride_vn, cache_row, True, PAGE_SIZE)
            k_ptrs = K + k_rows[:, None] + offs_d[None, :]
            v_ptrs = V + v_rows[:, None] + offs_dv[None, :]
        else:
            k_ptrs = K + cols[:, None] * stride_kn + offs_d[None, :]
            v_ptrs = V + cols[:, None] * stride_vn + offs_dv[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=col_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        s, _, _ = _scores(qk, qi[:, None], cols[None, :], diag_off, seqlen_k, window_left, window_right,
                          qk_scale, softcap_scale, softcap_log2, slope_log2, MASK, WINDOW_LEFT, WINDOW_RIGHT,
                          HAS_SOFTCAP, HAS_ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(v_ptrs, mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        elif BLOCK_DV != HEAD_DIM_V:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
        else:
            v = tl.load(v_ptrs)
        if IS_FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


# Lengths, windows, the split count and the lse strides (multiples of Sq) are runtime values: no new cache
# length, split count or query length compiles a new kernel.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_new", "capacity", "num_splits", "window_left",
                               "window_right", "stride_lb", "stride_lh", "stride_ls", "stride_btb",
                               "stride_ab", "stride_ah"])
def _kvcache_attn_kernel(
    Q, KCache, VCache, Out, Lse, CacheSeqlens, CacheBatchIdx, CacheLeftpad, BlockTable, Alibi, Sink,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh,
    stride_btb, stride_ab, stride_ah,
    seqlen_q, seqlen_new, capacity, num_splits, num_heads, group_size,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right,
    IS_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SPLIT: tl.constexpr, HAS_SINK: tl.constexpr = False,
):
    pid = tl.program_id(0)
    split = pid % num_splits
    bhk = pid // num_splits
    num_kv_heads = num_heads // group_size
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    m0 = tl.program_id(1) * BLOCK_M
    n_rows = seqlen_q * group_size

    # This sequence's keys: cache rows [key_start, key_end), relative index j = row - key_start.
    key_end = tl.minimum(tl.load(CacheSeqlens + b).to(tl.int32) + seqlen_new, capacity)
    if HAS_LEFTPAD:
        key_start = tl.minimum(tl.load(CacheLeftpad + b).to(tl.int32), key_end)
    else:
        key_start = key_end * 0
    seqlen_k = key_end - key_start
    diag_off = seqlen_k - seqlen_q

    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qi = rows // group_size
    h = hk * group_size + rows % group_size
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Qb = Q + b.to(tl.int64) * stride_qb
    q = tl.load(Qb + qi[:, None] * stride_qm + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah, mask=row_ok, other=0.0)[:, None] * 1.4426950408889634
    else:
        slope_log2 = 0.0

    if HAS_BATCH_IDX:
        cache_row = tl.load(CacheBatchIdx + b)
    else:
        cache_row = b
    BtRow = BlockTable + b.to(tl.int64) * stride_btb
    K = KCache + hk.to(tl.int64) * stride_kh
    V = VCache + hk.to(tl.int64) * stride_vh
    if not PAGED:
        K += cache_row.to(tl.int64) * stride_kb + key_start.to(tl.int64) * stride_kn
        V += cache_row.to(tl.int64) * stride_vb + key_start.to(tl.int64) * stride_vn

    # Key blocks the rows see; this split takes its share of whole blocks of [lo, hi).
    q_lo = m0 // group_size
    q_hi = (tl.minimum(m0 + BLOCK_M, n_rows) - 1) // group_size
    lo, full_lo, full_hi, hi = _kv_block_range(q_lo, q_hi, seqlen_k, diag_off, window_left, window_right,
                                               BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT)
    hi = tl.maximum(hi, lo)
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if WINDOW_LEFT:
        acc, l_i, m_i = _attn_blocks(
            acc, l_i, m_i, q, K, V, BtRow, stride_kb, stride_kn, stride_vb, stride_vn, cache_row, key_start,
            qi, slope_log2, offs_n, offs_d, offs_dv, tl.maximum(lo, s_lo), tl.minimum(full_lo, s_hi),
            seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2, IS_FP32,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, PAGED, PAGE_SIZE, WINDOW_LEFT,
            WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
    acc, l_i, m_i = _attn_blocks(
        acc, l_i, m_i, q, K, V, BtRow, stride_kb, stride_kn, stride_vb, stride_vn, cache_row, key_start,
        qi, slope_log2, offs_n, offs_d, offs_dv, tl.maximum(full_lo, s_lo), tl.minimum(full_hi, s_hi),
        seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2, IS_FP32,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, PAGED, PAGE_SIZE, WINDOW_LEFT,
        WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
    acc, l_i, m_i = _attn_blocks(
        acc, l_i, m_i, q, K, V, BtRow, stride_kb, stride_kn, stride_vb, stride_vn, cache_row, key_start,
        qi, slope_log2, offs_n, offs_d, offs_dv, tl.maximum(full_hi, s_lo), tl.minimum(hi, s_hi),
        seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2, IS_FP32,
        HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, PAGED, PAGE_SIZE, WINDOW_LEFT,
        WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI)

    if HAS_SINK:  # (one split only: split partials stay sink-free, the combine kernel adds it)
        # exp(sink) joins the row sum with no value, l and acc rebased to the larger of the row max and the sink
        # (log2 units); a row with neither keeps 0 so that no difference is inf - inf.
        sink2 = tl.load(Sink + h, mask=row_ok, other=float("-inf")) * LOG2E
        m_fin = tl.maximum(m_i, sink2)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink2 - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse2 = m_i + tl.log2(l_safe)
    Ob = Out + split.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob
    o_ptrs = Ob + qi[:, None] * stride_om + h[:, None] * stride_oh + offs_dv[None, :]
    o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    Lb = Lse + split.to(tl.int64) * stride_ls + b.to(tl.int64) * stride_lb
    if SPLIT:
        # Partials: fp32 output normalised within the split, log2-domain lse; -inf marks an empty split.
        tl.store(o_ptrs, out, mask=o_mask)
        tl.store(Lb + h * stride_lh + qi, tl.where(empty, float("-inf"), lse2), mask=row_ok)
    else:
        # Rows with no visible key: output 0, lse +inf (contract).
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
        tl.store(Lb + h * stride_lh + qi, tl.where(empty, float("inf"), lse2 * LN2), mask=row_ok)


@triton.jit(do_not_specialize=["seqlen_q", "num_splits", "stride_ls", "stride_lb", "stride_lh", "stride_xb",
                               "stride_xh"])
def _kvcache_combine_kernel(
    OPart, LPart, Out, Lse, Sink,
    stride_os, stride_ob, stride_om, stride_oh,
    stride_ls, stride_lb, stride_lh,
    stride_outb, stride_outm, stride_outh,
    stride_xb, stride_xh,
    seqlen_q, num_splits, num_heads,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
    HAS_SINK: tl.constexpr = False,
):
    pid = tl.program_id(0)
    b = tl.program_id(1)
    qi = pid // num_heads
    h = pid % num_heads
    Lb = LPart + b.to(tl.int64) * stride_lb + h * stride_lh + qi
    s_all = tl.arange(0, BLOCK_SPLITS)
    lse_all = tl.load(Lb + s_all * stride_ls, mask=s_all < num_splits, other=float("-inf"))
    m = tl.max(lse_all, 0)
    if HAS_SINK:  # one more term of the sum, exp(sink), with no output
        sink2 = tl.load(Sink + h) * LOG2E
        m = tl.maximum(m, sink2)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    total = tl.sum(tl.exp2(lse_all - m_safe), 0)
    if HAS_SINK:
        total += tl.exp2(sink2 - m_safe)
    inv = 1.0 / tl.where(empty, 1.0, total)

    offs_dv = tl.arange(0, BLOCK_DV)
    Ob = OPart + b.to(tl.int64) * stride_ob + qi.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    s_chunk = tl.arange(0, CHUNK)
    for s0 in range(0, num_splits, CHUNK):
        s = s0 + s_chunk
        s_ok = s < num_splits
        w = tl.exp2(tl.load(Lb + s * stride_ls, mask=s_ok, other=float("-inf")) - m_safe) * inv
        o = tl.load(Ob + s.to(tl.int64)[:, None] * stride_os + offs_dv[None, :],
                    mask=s_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        acc += tl.sum(o * w[:, None], 0)
    Outp = Out + b.to(tl.int64) * stride_outb + qi.to(tl.int64) * stride_outm + h.to(tl.int64) * stride_outh
    tl.store(Outp + offs_dv, acc.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)
    lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    tl.store(Lse + b.to(tl.int64) * stride_xb + h * stride_xh + qi, lse)


# ------------------------------------------------------------------------------------------------ host side

_L_PREP = Launcher(_kvcache_prep_kernel)
_L_ATTN = Launcher(_kvcache_attn_kernel)
_L_COMBINE = Launcher(_kvcache_combine_kernel)


def _pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def attn_config(arch, head_dim, rows, causal, interpret, dtype):
    """(block_m, block_n, num_warps, num_stages) for a tile of `rows` packed query rows (Sq * group).

    Decode-sized tiles (<= 64 rows) stream K/V with a memory-bound config; larger ones (a prompt appended
    through the cache) take the forward kernel's table entry for the head dim."""
    if interpret:
        return 16, 16, 1, 1
    if dtype == torch.float32:
        return min(max(16, _pow2(rows)), 64), 32, 4, 2
    if rows <= 64:
        return max(16, _pow2(rows)), 64, 4, (3 if _configs.padded_dim(head_dim) <= 128 else 2)
    if _configs.padded_dim(head_dim) == 256:
        # the forward table's d256 entries spill here (the packed-row indices take registers); these do not
        return (128, 32, 8, 3) if _configs.family(arch) == 9 else (64, 32, 8, 2)
    cfg = _configs.fwd_config(arch, head_dim, causal, False, dtype)
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages


_SMS: dict = {}


def _num_sms(device):
    if device.type != "cuda":
        return 8  # the interpreter: small, so that the default path splits small test caches too
    n = _SMS.get(device.index)
    if n is None:
        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def choose_num_splits(programs, capacity, block_n, num_sms):
    """Splits of the keys so that programs * splits fills the GPU: programs = batch * kv heads * row blocks.

    Only shapes enter (the cache's capacity, not the current lengths), so a captured graph stays valid.
    One split when the programs alone fill 80% of the SMs; otherwise a power of two with a program per SM at
    least, and at least 16 (several programs per SM hide the tail of a streaming loop: at 8 and 64 programs
    on an H100, 16 or 32 splits ran within 3% of the fastest fixed count, where one program per SM ran up to
    30% behind; benchmarks/results/h100/kvcache_decode.md), no more than the key blocks of a full cache, at
    most MAX_SPLITS."""
    if programs >= 0.8 * num_sms:
        return 1
    n_blocks = -(-capacity // block_n)
    per_sm = 1 << (-(-num_sms // programs) - 1).bit_length()
    return max(1, min(max(16, per_sm), n_blocks, MAX_SPLITS))


def _grid_dim(n):
    if n > 65535:  # CUDA's limit on the second grid dimension
        raise ValueError(f"flash_attn_with_kvcache (Triton): {n} row blocks of queries or new keys exceed the "
                         "grid; pass long prompts through flash_attn_func / flash_attn_varlen_func instead")
    return n


def _strides3(t):
    return t.stride()[:3]


_PLANS: dict = {}  # the launch plan of each kind of call (_plan); small: a decoding loop repeats one kind


def _plan(pkey, block_d, block_dv):
    """(splits, attention grid, meta and launcher key, its scalar arguments, (combine grid, meta, key) or None) of a
    kind of call: what fwd_kvcache would otherwise rebuild on every step of a decoding loop."""
    (device, dtype, B, Sq, H, Hk, D, Dv, capacity, paged, page_size, has_batch_idx, has_leftpad, causal, window_left,
     window_right, softcap, softmax_scale, alibi_dim, has_sink, num_splits, interpret, arch) = pkey
    G = H // Hk
    block_m, block_n, warps, stages = attn_config(arch, max(D, Dv), Sq * G, causal or window_right >= 0,
                                                  interpret, dtype)
    m_blocks = _grid_dim(-(-(Sq * G) // block_m))
    if num_splits <= 0:
        splits = choose_num_splits(B * Hk * m_blocks, capacity, block_n, _num_sms(device))
    else:
        splits = min(num_splits, MAX_SPLITS)
    split = splits > 1
    if softcap > 0.0:
        softcap_scale, softcap_log2 = softmax_scale / softcap, softcap * _LOG2E
    else:
        softcap_scale, softcap_log2 = 0.0, 0.0
    wl = window_left if window_left >= 0 else NO_WINDOW
    wr = window_right if window_right >= 0 else NO_WINDOW
    meta = dict(IS_FP32=dtype == torch.float32, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv,
                BLOCK_M=block_m, BLOCK_N=block_n, PAGED=paged, PAGE_SIZE=page_size,
                HAS_BATCH_IDX=has_batch_idx, HAS_LEFTPAD=has_leftpad,
                WINDOW_LEFT=window_left >= 0, WINDOW_RIGHT=window_right >= 0, HAS_SOFTCAP=softcap > 0.0,
                HAS_ALIBI=alibi_dim is not None, SPLIT=split, HAS_SINK=has_sink and not split,
                num_warps=warps, num_stages=stages)
    key = ("attn", device, dtype, *meta.values())
    combine = None
    if split:
        block_s = _pow2(splits)
        chunk = min(block_s, 16 if block_dv > 128 else 32)
        c_meta = dict(HEAD_DIM_V=Dv, BLOCK_DV=block_dv, BLOCK_SPLITS=block_s, CHUNK=chunk, HAS_SINK=has_sink,
                      num_warps=1 if interpret else 4, num_stages=1)
        combine = ((Sq * H, B), c_meta, ("combine", device, *c_meta.values()))
    plan = (splits, (splits * B * Hk, m_blocks), meta, key,
            (softmax_scale * _LOG2E, softcap_scale, softcap_log2, wl, wr), combine)
    if len(_PLANS) >= 64:
        _PLANS.clear()
    _PLANS[pkey] = plan
    return plan


# The fp32 split parts of a kind of call, one buffer per (kind, device, stream) reused call after call instead of two
# allocations per decoding step: they are written and read on that stream only, so a call's attention kernel
# overwrites them after the previous call's combine read them (stream order), and dropping an entry frees memory the
# caching allocator reuses in that order. A CUDA graph being captured gets parts of its own (from the capture's pool),
# never shared with eager calls.
_PARTS: dict = {}
_PARTS_MAX_ELEMS = 1 << 21  # 8 MiB of fp32 parts per entry (16 entries); larger calls allocate per call
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _split_parts(pkey, device, splits, B, Sq, H, Dv):
    """(o parts (splits, B, Sq, H, Dv), lse parts (splits, B, H, Sq)) fp32 for a split call of kind pkey (whose key
    holds the device)."""
    n = splits * B * Sq * H
    cuda = device.type == "cuda"
    if n * (Dv + 1) > _PARTS_MAX_ELEMS or (cuda and _stream_capturing()):
        return (torch.empty((splits, B, Sq, H, Dv), dtype=torch.float32, device=device),
                torch.empty((splits, B, H, Sq), dtype=torch.float32, device=device))
    key = (pkey, _raw_stream(device.index) if cuda else 0)
    parts = _PARTS.get(key)
    if parts is None:
        buf = torch.empty(n * (Dv + 1), dtype=torch.float32, device=device)
        parts = buf[:n * Dv].view(splits, B, Sq, H, Dv), buf[n * Dv:].view(splits, B, H, Sq)
        if len(_PARTS) >= 16:
            _PARTS.clear()
        _PARTS[key] = parts
    return parts


def fwd_kvcache(q, k_cache, v_cache, *, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                rotary_interleaved, alibi_slopes, num_splits, interpret=False, arch=None, sink=None):
    """See flash_attn/backends/__init__.py (fwd_kvcache) and flash_attn.reference.fwd_kvcache; sink: the learnable
    sink, fp32 (H,), or None (then a dummy tensor in the kernels' Sink slot, unread: HAS_SINK is off)."""
    B, Sq, H, D = q.shape
    Hk, Dv = k_cache.shape[2], v_cache.shape[-1]
    G = H // Hk
    device = q.device
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 1
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    s_new = 0 if k is None else k.shape[1]
    if causal:
        window_right = 0
    local = window_left >= 0 or window_right >= 0
    rotary_dim = 0 if rotary_cos is None else 2 * rotary_cos.shape[1]
    append = s_new > 0 and B > 0
    rotate_q = rotary_dim > 0 and Sq > 0
    block_d, block_dv = _configs.padded_dim(D), _configs.padded_dim(Dv)
    dummy = cache_seqlens
    table = block_table if paged else dummy
    batch_idx = cache_batch_idx if cache_batch_idx is not None else dummy

    if append or rotate_q:
        q_rot = torch.empty((B, Sq, H, D), dtype=q.dtype, device=device) if rotate_q else q
        n = max(s_new if append else 0, Sq if rotate_q else 0)
        # about 8 elements of a (rows, head dim) tile per thread: x, its rotary partner, cos, sin and their
        # pointers stay in registers
        block_r = max(1, min(_pow2(n), 1024 // block_d))
        cos = rotary_cos if rotary_dim else q
        sin = rotary_sin if rotary_dim else q
        if cos.stride(-1) != 1 or sin.stride(-1) != 1:  # the kernel indexes the angle dim with stride 1
            cos, sin = cos.contiguous(), sin.contiguous()
        kn = k if append else q
        vn = v if append else q
        meta = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_R=block_r,
                    ROTARY_DIM=rotary_dim, INTERLEAVED=bool(rotary_interleaved), APPEND=append,
                    ROTATE_Q=rotate_q, Q_LOCAL=local, PAGED=paged, PAGE_SIZE=page_size,
                    HAS_BATCH_IDX=cache_batch_idx is not None,
                    num_warps=1 if interpret else max(1, min(4, block_r * block_d // 256)), num_stages=1)
        key = ("prep", device, q.dtype, cos.dtype, *meta.values())
        _L_PREP((B * H, _grid_dim(-(-n // block_r))), (
            q, q_rot, kn, vn, k_cache, v_cache, cos, sin, cache_seqlens, batch_idx, table,
            *_strides3(q), *_strides3(q_rot), *_strides3(kn), *_strides3(vn),
            *_strides3(k_cache), *_strides3(v_cache),
            cos.stride(0), sin.stride(0), table.stride(0) if paged else 0,
            Sq, s_new, H, Hk, capacity, cos.shape[0] if rotary_dim else 0), meta, key)
        q = q_rot

    out = torch.empty((B, Sq, H, Dv), dtype=q.dtype, device=device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=device)
    if B * Sq * H == 0:
        return out, lse

    pkey = (device, q.dtype, B, Sq, H, Hk, D, Dv, capacity, paged, page_size, cache_batch_idx is not None,
            cache_leftpad is not None, causal, window_left, window_right, softcap, softmax_scale,
            None if alibi_slopes is None else alibi_slopes.dim(), sink is not None, num_splits, interpret, arch)
    plan = _PLANS.get(pkey)
    if plan is None:
        plan = _plan(pkey, block_d, block_dv)
    splits, grid, meta, key, scalars, combine = plan
    split = splits > 1
    if split:
        o_acc, l_acc = _split_parts(pkey, device, splits, B, Sq, H, Dv)
        so_ = o_acc.stride()[:4]
        sl_ = l_acc.stride()[:3]
    else:
        o_acc, l_acc = out, lse
        so_ = (0, *out.stride()[:3])
        sl_ = (0, *lse.stride()[:2])
    if alibi_slopes is None:
        alibi, sa_ = dummy, (0, 0)
    else:
        alibi = alibi_slopes
        sa_ = (0, alibi.stride(0)) if alibi.dim() == 1 else (alibi.stride(0), alibi.stride(1))
    _L_ATTN(grid, (
        q, k_cache, v_cache, o_acc, l_acc, cache_seqlens, batch_idx,
        cache_leftpad if cache_leftpad is not None else dummy, table, alibi,
        sink if sink is not None and not split else dummy,
        *_strides3(q), *_strides3(k_cache), *_strides3(v_cache), *so_, *sl_,
        table.stride(0) if paged else 0, *sa_,
        Sq, s_new, capacity, splits, H, G, *scalars), meta, key)
    if split:
        c_grid, c_meta, c_key = combine
        _L_COMBINE(c_grid, (
            o_acc, l_acc, out, lse, dummy if sink is None else sink, *so_, *sl_, *out.stride()[:3], lse.stride(0),
            lse.stride(1), Sq, splits, H), c_meta, c_key)
    return out, lse


_FULL_LENGTHS: dict = {}  # (device, B, Sk) -> int32 (B,) of Sk: the lengths of a whole cache


def fwd_dense_decode(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, sink,
                     interpret, arch):
    """A dense decoding forward (q (B, Sq, H, D) with a few rows, k / v (B, Sk, Hk, D)) as a KV-cache call over the
    whole of k / v (cache_seqlens = Sk for every batch entry, nothing appended): the same masks (bottom-right causal
    and windows), softcap, ALiBi and sink as the dense forward, with choose_num_splits' split of the keys (the dense
    kernel gives each (batch, head) one program streaming every key). -> (out, lse)."""
    B, Sk = q.shape[0], k.shape[1]
    key = (q.device, B, Sk)
    lens = _FULL_LENGTHS.get(key)
    if lens is None:
        if len(_FULL_LENGTHS) >= 64:
            _FULL_LENGTHS.clear()
        lens = _FULL_LENGTHS[key] = torch.full((B,), Sk, dtype=torch.int32, device=q.device)
    return fwd_kvcache(q, k, v, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=lens,
                       cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=softmax_scale,
                       causal=causal, window_left=window_left, window_right=window_right, softcap=softcap,
                       rotary_interleaved=False, alibi_slopes=alibi_slopes, num_splits=0, interpret=interpret,
                       arch=arch, sink=sink)
