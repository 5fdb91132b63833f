"""Experimental attention forward for sm_90: the key loop under Triton's automatic warp specialization.

Triton >= 3.5 runs Meta's Hopper warp-specialization pass on loops marked ``tl.range(...,
warp_specialize=True)``. With num_warps=4 and BLOCK_M=128 it builds three warpgroups: a producer that
issues the Q/K/V tensor-descriptor (TMA) copies with few registers (setmaxnreg.dec 40) and two consumers
that each own 64 query rows, do both GEMMs and the softmax with the registers freed by the producer
(setmaxnreg.inc 232). Every warp of _fwd.py instead waits on its own copies and keeps their addresses
live. Within a consumer the schedule stays FA2's (the Q K^T wgmma is waited on before its softmax); the
overlap comes from the two consumers and the producer running side by side.

What the pass accepts (Triton 3.6 and 3.9 alike, found by compiling for sm_90): one specialized loop,
possibly with a plain loop nested inside; a second loop after it or an early return fail with an
assertion; an ``if`` inside the loop makes it silently skip the specialization; a pointer load of Q
fails ("unsupported load type for producer commit"); a 4-D descriptor with a reshape to 2-D fails in
its data partitioning. So each tile has one loop over every key block its rows can see and applies the
causal / sequence-end mask with a select on every block when the call needs one (a constexpr, not a
branch), and Q comes through a descriptor too.

PERSISTENT: one program per SM walks the tiles and the tile loop is the specialized one, so the
producer loads the next tile's Q/K/V while the consumers finish the last one's softmax and store. Its
descriptors are rebuilt (in the program's global scratch) per tile, as they depend on the (sequence,
head) base pointer.

Serves only dense 16-bit calls with power-of-two head dims, no softcap, ALiBi, dropout or probabilities,
and causal calls with seqlen_q <= seqlen_k (every row then sees key 0, so no row keeps m = -inf); the
backend routes other calls to _fwd.py.
"""
import triton
import triton.language as tl

from ._common import LN2


@triton.jit
def _tile_coords(lin, n_m, n_bh, CAUSAL: tl.constexpr, GROUP_HEADS: tl.constexpr):
    """Linear tile index (row block fastest) -> (row block, sequence*head). Causal grids run the longest
    row blocks first, across GROUP_HEADS (sequence, head) pairs at a time (the tail wave; see _fwd.py)."""
    pid_m = lin % n_m
    bh = lin // n_m
    if CAUSAL:
        if GROUP_HEADS > 0:
            g = lin // (GROUP_HEADS * n_m)
            r = lin % (GROUP_HEADS * n_m)
            g_size = tl.minimum(GROUP_HEADS, n_bh - g * GROUP_HEADS)
            pid_m = r // g_size
            bh = g * GROUP_HEADS + r % g_size
        pid_m = n_m - 1 - pid_m
    return pid_m, bh


@triton.jit
def _ws_tile(Q, K, V, Out, Lse, pid_m, bh, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
             stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh, stride_lb, stride_lh,
             seqlen_q, seqlen_k, num_heads, group_size, qk_scale, HEAD_DIM: tl.constexpr,
             HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
             EVEN_K: tl.constexpr, WS_KEYS: tl.constexpr):
    """Output rows [pid_m * BLOCK_M, +BLOCK_M) of (sequence, head) bh. WS_KEYS: the key loop is the
    warp-specialized one (else an enclosing tile loop is)."""
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group_size
    m0 = pid_m * BLOCK_M
    diag_off = seqlen_k - seqlen_q

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    Q += b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    # The copy engine fills rows past seqlen_k with zeros: finite scores, masked below when needed.
    K_desc = tl.make_tensor_descriptor(K, shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    V_desc = tl.make_tensor_descriptor(V, shape=[seqlen_k, HEAD_DIM_V], strides=[stride_vn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM_V])
    # Q through a descriptor too: the pass rejects a pointer load ("unsupported load type for producer
    # commit"). Rows past seqlen_q read zeros (finite scores); they are never stored.
    Q_desc = tl.make_tensor_descriptor(Q, shape=[seqlen_q, HEAD_DIM], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    q = Q_desc.load([m0, 0])

    if CAUSAL:
        # Row i sees keys j <= i + diag_off: the tile's last row bounds the loop.
        hi = tl.minimum(m0 + BLOCK_M + diag_off, seqlen_k)
    else:
        hi = seqlen_k

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS_KEYS):
        k = K_desc.load([start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        if CAUSAL or not EVEN_K:
            cols = start_n + offs_n
            if CAUSAL:
                # Implies cols < seqlen_k for every stored row (i < seqlen_q).
                vis = cols[None, :] <= offs_m[:, None] + diag_off
            else:
                vis = cols[None, :] < seqlen_k
            s = tl.where(vis, qk * qk_scale, float("-inf"))
            # Key 0 is visible to every row (seqlen_q <= seqlen_k when causal), so after the first block
            # m_new is finite and exp2(-inf - m_new) = 0 for the masked scores.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            # One FMA per score: scale and max subtraction together.
            p = tl.exp2(qk * qk_scale - m_new[:, None])
        # exp2(-inf - finite) = 0 on the first block: acc and l start at zero either way.
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = V_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    out = acc * (1.0 / l_i)[:, None]
    row_ok = offs_m < seqlen_q
    Out += b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(Out + offs_m[:, None] * stride_om + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])
    Lse += b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    tl.store(Lse + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


# Sequence lengths, lse strides and B * H change between calls: no specialisation on them (see _fwd.py).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "num_bh"])
def _attn_fwd_ws_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, num_heads, group_size, num_bh, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_K: tl.constexpr, GROUP_HEADS: tl.constexpr = 0, PERSISTENT: tl.constexpr = False,
):
    """Grid (row blocks, B * H), one tile per program, the key loop warp-specialized; or, PERSISTENT,
    grid (#SMs,): each program walks the tiles lin = pid, pid + #programs, ... and the tile loop is the
    warp-specialized one, so the producer loads the next tile's Q/K/V while the consumers still finish
    the last one's softmax and store (and no tail of short programs waits on CTA launches)."""
    n_m = tl.cdiv(seqlen_q, BLOCK_M)
    if PERSISTENT:
        for lin in tl.range(tl.program_id(0), n_m * num_bh, tl.num_programs(0), warp_specialize=True):
            pid_m, bh = _tile_coords(lin, n_m, num_bh, CAUSAL, GROUP_HEADS)
            _ws_tile(Q, K, V, Out, Lse, pid_m, bh, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn,
                     stride_kh, stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh, stride_lb,
                     stride_lh, seqlen_q, seqlen_k, num_heads, group_size, qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_M,
                     BLOCK_N, CAUSAL, EVEN_K, False)
    else:
        pid_m, bh = _tile_coords(tl.program_id(0) + tl.program_id(1) * n_m, n_m, num_bh, CAUSAL, GROUP_HEADS)
        _ws_tile(Q, K, V, Out, Lse, pid_m, bh, stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_ob, stride_om, stride_oh, stride_lb, stride_lh, seqlen_q,
                 seqlen_k, num_heads, group_size, qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, CAUSAL, EVEN_K,
                 True)
