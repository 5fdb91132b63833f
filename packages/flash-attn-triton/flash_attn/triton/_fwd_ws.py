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

Descriptors: one per tensor, made once at the kernel's start over all sequences and heads (a tile
offsets its coordinates). Descriptors made per (sequence, head) on offset base pointers compile the
same way but computed wrong results on an H200 (triton 3.6; see _attn_fwd_ws_kernel).

PERSISTENT: one program per SM walks the tiles and the tile loop is the specialized one, so the
producer loads the next tile's Q/K/V while the consumers finish the last one's softmax and store.

Serves only dense 16-bit calls whose Q, K and V have a batch stride of seqlen x row stride (or one
sequence), with power-of-two head dims, no softcap, ALiBi, dropout or probabilities,
and causal calls with seqlen_q <= seqlen_k (every row then sees key 0, so no row keeps m = -inf); the
backend routes other calls to _fwd.py.
"""
import triton
import triton.language as tl

from ._common import LN2


@triton.jit
def _tile_coords(lin, n_m, n_bh, CAUSAL: tl.constexpr, GROUP_HEADS: tl.constexpr, BALANCED: tl.constexpr = False):
    """Linear tile index (row block fastest) -> (row block, sequence*head). Causal grids run the longest
    row blocks first, across GROUP_HEADS (sequence, head) pairs at a time (the tail wave; see _fwd.py), or
    (BALANCED, a persistent grid) in a snake over the programs."""
    pid_m = lin % n_m
    bh = lin // n_m
    if CAUSAL:
        if BALANCED:
            # lin = program + round * programs: round r deals tiles [r * P, r * P + P) of the longest-first
            # order (row block descending, (sequence, head) fastest), forwards on even rounds and backwards
            # on odd ones (within the tiles left in a last partial round), so every program's total is
            # within about one tile of the mean.
            P = tl.num_programs(0)
            r = lin // P
            p = lin - r * P
            n_round = tl.minimum(P, n_m * n_bh - r * P)
            t = r * P + tl.where(r % 2 == 0, p, n_round - 1 - p)
            bh = t % n_bh
            pid_m = t // n_bh
        elif GROUP_HEADS > 0:
            g = lin // (GROUP_HEADS * n_m)
            r = lin % (GROUP_HEADS * n_m)
            g_size = tl.minimum(GROUP_HEADS, n_bh - g * GROUP_HEADS)
            pid_m = r // g_size
            bh = g * GROUP_HEADS + r % g_size
        pid_m = n_m - 1 - pid_m
    return pid_m, bh


@triton.jit
def _ws_tile(Q_desc, K_desc, V_desc, Out, Lse, pid_m, bh, stride_qh, stride_kh, stride_vh, stride_ob, stride_om,
             stride_oh, stride_lb, stride_lh, seqlen_q, seqlen_k, num_heads, group_size, qk_scale,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAUSAL: tl.constexpr, EVEN_K: tl.constexpr, WS_KEYS: tl.constexpr):
    """Output rows [pid_m * BLOCK_M, +BLOCK_M) of (sequence, head) bh. The descriptors view each tensor as
    (sequences x rows, row elements) (see _attn_fwd_ws_kernel): sequence b's row i is row b * seqlen + i,
    head h's columns start at h * stride_h. WS_KEYS: the key loop is the warp-specialized one (else an
    enclosing tile loop is)."""
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group_size
    m0 = pid_m * BLOCK_M
    diag_off = seqlen_k - seqlen_q
    q_row = b * seqlen_q
    k_row = b * seqlen_k
    q_col = h * stride_qh
    k_col = hk * stride_kh
    v_col = hk * stride_vh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    # Rows past this sequence's end are the next sequence's first rows (zeros past the tensor's end):
    # finite, so Q's are never stored and K's are masked below when the last block is partial.
    q = Q_desc.load([q_row + m0, q_col])

    if CAUSAL:
        # Row i sees keys j <= i + diag_off: the tile's last row bounds the loop.
        hi = tl.minimum(m0 + BLOCK_M + diag_off, seqlen_k)
    else:
        hi = seqlen_k

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WS_KEYS):
        k = K_desc.load([k_row + start_n, k_col])
        qk = tl.dot(q, tl.trans(k))
        if CAUSAL or not EVEN_K:
            cols = start_n + offs_n
            if CAUSAL:
                # Implies cols < seqlen_k for every stored row (i < seqlen_q).
                vis = cols[None, :] <= offs_m[:, None] + diag_off
            else:
                vis = cols[None, :] < seqlen_k
            # The mask on the raw scores (qk_scale > 0), so the scale still folds into the FMA below.
            # Key 0 is visible to every row (seqlen_q <= seqlen_k when causal), so after the first block
            # m_new is finite and exp2(-inf - m_new) = 0 for the masked scores.
            qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        # One FMA per score: scale and max subtraction together.
        p = tl.exp2(qk * qk_scale - m_new[:, None])
        # exp2(-inf - finite) = 0 on the first block: acc and l start at zero either way.
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = V_desc.load([k_row + start_n, v_col])
        # The rescale as its own statement, not folded into the dot's accumulator operand.
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
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
    stride_qm, stride_qh,
    stride_kn, stride_kh,
    stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, num_heads, group_size, num_bh, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_K: tl.constexpr, GROUP_HEADS: tl.constexpr = 0, PERSISTENT: tl.constexpr = False,
    BALANCED: tl.constexpr = False,
):
    """Grid (row blocks, B * H), one tile per program, the key loop warp-specialized; or, PERSISTENT,
    grid (#SMs,): each program walks the tiles lin = pid, pid + #programs, ... and the tile loop is the
    warp-specialized one, so the producer loads the next tile's Q/K/V while the consumers still finish
    the last one's softmax and store (and no tail of short programs waits on CTA launches).

    Q, K and V each get ONE descriptor, made here before any loop, over the tensor as a 2-D array of
    B * seqlen rows (the batch stride must be seqlen x the row stride: backend._fwd_ws_plan checks it)
    by the row's elements up to the last head's end (so only row and head strides are arguments). Descriptors per (sequence, head), on offset base
    pointers, give wrong results under the Hopper pass on an H200 (triton 3.6: max |out - ref| 0.3-5,
    NaN at 3 stages); this form matches the reference to 1e-3 (benchmarks/tools/triton_ws_probe.py)."""
    n_b = num_bh // num_heads
    Q_desc = tl.make_tensor_descriptor(Q, shape=[n_b * seqlen_q, (num_heads - 1) * stride_qh + HEAD_DIM],
                                       strides=[stride_qm, 1], block_shape=[BLOCK_M, HEAD_DIM])
    num_kv = num_heads // group_size
    K_desc = tl.make_tensor_descriptor(K, shape=[n_b * seqlen_k, (num_kv - 1) * stride_kh + HEAD_DIM],
                                       strides=[stride_kn, 1], block_shape=[BLOCK_N, HEAD_DIM])
    V_desc = tl.make_tensor_descriptor(V, shape=[n_b * seqlen_k, (num_kv - 1) * stride_vh + HEAD_DIM_V],
                                       strides=[stride_vn, 1], block_shape=[BLOCK_N, HEAD_DIM_V])
    n_m = tl.cdiv(seqlen_q, BLOCK_M)
    if PERSISTENT:
        for lin in tl.range(tl.program_id(0), n_m * num_bh, tl.num_programs(0), warp_specialize=True):
            pid_m, bh = _tile_coords(lin, n_m, num_bh, CAUSAL, GROUP_HEADS, BALANCED)
            _ws_tile(Q_desc, K_desc, V_desc, Out, Lse, pid_m, bh, stride_qh, stride_kh, stride_vh, stride_ob,
                     stride_om, stride_oh, stride_lb, stride_lh, seqlen_q, seqlen_k, num_heads, group_size,
                     qk_scale, HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, CAUSAL, EVEN_K, False)
    else:
        pid_m, bh = _tile_coords(tl.program_id(0) + tl.program_id(1) * n_m, n_m, num_bh, CAUSAL, GROUP_HEADS)
        _ws_tile(Q_desc, K_desc, V_desc, Out, Lse, pid_m, bh, stride_qh, stride_kh, stride_vh, stride_ob,
                 stride_om, stride_oh, stride_lb, stride_lh, seqlen_q, seqlen_k, num_heads, group_size, qk_scale,
                 HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, CAUSAL, EVEN_K, True)
