"""Device-side pieces shared by the forward and backward kernels: score transform (scale, softcap,
ALiBi, mask), the ranges of K/V (or Q) blocks a tile must visit, and the counter-based dropout hash.

Every helper takes broadcastable row/column index tensors, so the forward kernel (rows = queries) and the
dK/dV kernel (which works on transposed tiles, rows = keys) share them.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Unbounded window sides travel as this (instead of -1) so the mask test needs no branch; far from
# int32 overflow for any i + Sk - Sq that fits in memory.
NO_WINDOW = 1 << 30


@triton.jit
def _tanh(x):
    # exp2-based so it lowers to ex2.approx on NVIDIA and v_exp on AMD alike (no libdevice); the
    # |x| form never overflows and keeps the absolute error at a few fp32 ulps.
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scores(qk, i, j, diag_off, seqlen_k, window_left, window_right, qk_scale, softcap_scale, softcap_log2,
            slope_log2, MASK: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """qk = q.k in fp32 -> (scores in log2 units, tanh term for the softcap gradient, visible mask).

    i (query positions) and j (key positions) broadcast against qk. With MASK, invisible scores are -inf.
    """
    if HAS_SOFTCAP:
        t = _tanh(qk * softcap_scale)
        s = t * softcap_log2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        s -= slope_log2 * tl.abs(i + diag_off - j).to(tl.float32)
    vis = j < seqlen_k
    if MASK:
        if WINDOW_LEFT:
            vis = vis & (j >= i + diag_off - window_left)
        if WINDOW_RIGHT:
            vis = vis & (j <= i + diag_off + window_right)
        s = tl.where(vis, s, float("-inf"))
    return s, t, vis


@triton.jit
def _kv_block_range(m_lo, m_hi, seqlen_k, diag_off, window_left, window_right, BLOCK_N: tl.constexpr,
                    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Key blocks seen by query rows [m_lo, m_hi] (inclusive): (lo, full_lo, full_hi, hi).

    Blocks in [lo, full_lo) and [full_hi, hi) need the mask; blocks in [full_lo, full_hi) are visible to
    every row and skip it. Blocks outside [lo, hi) are fully masked and never visited. Without a left
    window bound, lo = full_lo = 0 (the leading masked loop is compiled out).
    """
    hi = seqlen_k
    full_hi = seqlen_k
    if WINDOW_RIGHT:
        hi = tl.minimum(m_hi + diag_off + window_right + 1, hi)
        full_hi = tl.minimum(m_lo + diag_off + window_right + 1, full_hi)
    full_hi = (full_hi // BLOCK_N) * BLOCK_N
    if WINDOW_LEFT:
        lo = (tl.maximum(m_lo + diag_off - window_left, 0) // BLOCK_N) * BLOCK_N
        hi = tl.maximum(hi, lo)
        full_lo = tl.maximum(m_hi + diag_off - window_left, lo)
        full_lo = tl.minimum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, tl.cdiv(hi, BLOCK_N) * BLOCK_N)
        full_hi = tl.maximum(full_hi, full_lo)
    else:
        lo = 0
        full_lo = 0
        full_hi = tl.maximum(full_hi, 0)
    return lo, full_lo, full_hi, hi


@triton.jit
def _q_block_range(n_lo, n_hi, seqlen_q, diag_off, window_left, window_right, BLOCK_M: tl.constexpr,
                   WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Query blocks that see keys [n_lo, n_hi] (inclusive): (lo, full_lo, full_hi, hi), as above; query i
    sees key j iff j - diag_off - window_right <= i <= j - diag_off + window_left, so here the right
    window bound makes the leading masked loop."""
    hi = seqlen_q
    full_hi = seqlen_q
    if WINDOW_LEFT:
        hi = tl.minimum(n_hi - diag_off + window_left + 1, hi)
        full_hi = tl.minimum(n_lo - diag_off + window_left + 1, full_hi)
    full_hi = (full_hi // BLOCK_M) * BLOCK_M
    if WINDOW_RIGHT:
        lo = (tl.maximum(n_lo - diag_off - window_right, 0) // BLOCK_M) * BLOCK_M
        hi = tl.maximum(hi, lo)
        full_lo = tl.maximum(n_hi - diag_off - window_right, lo)
        full_lo = tl.minimum(tl.cdiv(full_lo, BLOCK_M) * BLOCK_M, tl.cdiv(hi, BLOCK_M) * BLOCK_M)
        full_hi = tl.maximum(full_hi, full_lo)
    else:
        lo = 0
        full_lo = 0
        full_hi = tl.maximum(full_hi, 0)
    return lo, full_lo, full_hi, hi


@triton.jit
def _hash32(x):
    # flash_attn.dropout.hash32 on uint32 words: multiplication wraps modulo 2**32, shifts are logical.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _dropout_row_key(bh, i, max_seqlen_q, seed0, seed1):
    """Per query row: h2 of flash_attn.dropout (uint32), for row index (b * H + h) * max_seqlen_q + i."""
    row = bh.to(tl.int64) * max_seqlen_q + i.to(tl.int64)
    lo = (row & 0xFFFFFFFF).to(tl.uint32)
    hi = (row >> 32).to(tl.uint32)
    h1 = _hash32(lo ^ seed0.to(tl.uint32))
    return _hash32(h1 ^ seed1.to(tl.uint32) ^ hi)


@triton.jit
def _dropout_keep(row_key, j, threshold_signed):
    """keep iff hash32(h2 ^ j) >= floor(p * 2**32); compared as int32 after flipping the sign bit, so
    the threshold is one runtime int32 argument for every p."""
    u = _hash32(row_key ^ j.to(tl.uint32))
    return (u ^ 0x80000000).to(tl.int32, bitcast=True) >= threshold_signed
