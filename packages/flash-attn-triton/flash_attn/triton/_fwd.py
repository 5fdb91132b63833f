"""Attention forward kernel: FlashAttention-2 (Dao 2023, Algorithm 1) tiled online softmax.

One program owns BLOCK_M query rows of one (sequence, head), keeps them in registers and streams the
key/value blocks its rows can see, holding the running row max m, row sum l and the unnormalised output
in fp32. Scores live in log2 units (log2(e) folded into the scale) so each exponential is one exp2.
With HAS_SINK, FA4's learnable sink (one logit per head, an extra softmax term with no value) joins each
row's max and sum after the last key block, so the lse includes it.
"""
import triton
import triton.language as tl

from ._common import LN2, LOG2E, _dropout_keep, _dropout_row_key, _kv_block_range, _scores


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K_ptr, V_ptr, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d,
               offs_dv, start, end, seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale,
               softcap_log2, slope_log2, row_key, dropout_threshold, IS_FP32: tl.constexpr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr,
               RESCALE_THRESHOLD: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = K_ptr + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = V_ptr + cols[:, None] * stride_vn + offs_dv[None, :]
        # Interior blocks are fully inside the sequence: no row predicate, so loads stay vectorised.
        if USE_TMA:
            # The copy engine fills rows past seqlen_k with zeros and needs no per-thread addresses,
            # which frees the registers and issue slots of the cp.async address arithmetic.
            k = K_desc.load([start_n, 0])
        elif MASK:
            k = tl.load(k_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_ptrs)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        s, _, _ = _scores(qk, offs_m[:, None], cols[None, :], diag_off, seqlen_k, window_left, window_right,
                          qk_scale, softcap_scale, softcap_log2, slope_log2, MASK, WINDOW_LEFT, WINDOW_RIGHT,
                          HAS_SOFTCAP, HAS_ALIBI)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if RESCALE_THRESHOLD > 0:
            # Conditional rescale: the reference max of every row only moves (and acc, l are only
            # rescaled) when some row's max grew by more than RESCALE_THRESHOLD (log2 units). Otherwise
            # the stale m is kept, so p = exp2(s - m) <= 2**RESCALE_THRESHOLD: no overflow in fp32 l/acc
            # nor in the 16-bit P (fp16 max 65504 > 2**15), and the same relative rounding of P. The
            # result is unchanged in exact arithmetic because out = acc / l and lse = m + log2(l) use the
            # same m for numerator and denominator. The test is block-uniform (one branch for all rows)
            # so that skipping really skips the BLOCK_M x BLOCK_DV multiply.
            if tl.max((m_new > m_i + RESCALE_THRESHOLD).to(tl.int32), 0) > 0:
                if MASK:
                    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so
                    # that exp2(-inf - -inf) never makes a NaN.
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                else:
                    m_use = m_new
                alpha = tl.exp2(m_i - m_use)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            if MASK:
                m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            else:
                m_use = m_i
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i + tl.sum(p, 1)
            m_new = m_i
        else:
            if MASK:
                # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so that
                # exp2(-inf - -inf) never makes a NaN.
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_use = m_new
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            # The normaliser l sums the undropped probabilities; only P @ V sees the mask.
            p = tl.where(_dropout_keep(row_key[:, None], cols[None, :], dropout_threshold), p, 0.0)
        if USE_TMA:
            v = V_desc.load([start_n, 0])
        elif MASK:
            v = tl.load(v_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
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


# Sequence lengths, windows, seeds and the lse / probability row strides (multiples of a length) change
# between calls: specialising on them (== 1, % 16) would compile new variants for new lengths, for no
# gain. Batch strides (S * H * D) stay specialised: their divisibility by 16 is what tells the compiler
# that every tile row is 16-byte aligned, and it holds for every S once H * D is a multiple of 16.
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right", "seed0", "seed1",
                               "dropout_threshold", "stride_lb", "stride_lh", "stride_pb", "stride_ph",
                               "stride_pm"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Probs, Alibi, CuSeqlensQ, CuSeqlensK, Sink,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    stride_pb, stride_ph, stride_pm,
    seqlen_q, seqlen_k, num_heads, group_size,
    qk_scale, softcap_scale, softcap_log2, window_left, window_right,
    seed0, seed1, dropout_threshold, dropout_scale,
    IS_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, RETURN_PROBS: tl.constexpr, USE_TMA: tl.constexpr = False,
    RESCALE_THRESHOLD: tl.constexpr = 0.0, GROUP_HEADS: tl.constexpr = 0, HAS_SINK: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if WINDOW_RIGHT:
        # The last row blocks see the most keys under a causal/window mask: launch them first so the
        # short blocks fill the tail of the grid.
        n_m = tl.num_programs(0)
        if GROUP_HEADS > 0:
            # Blocks are dispatched in linear order (axis 0 fastest). Longest-first only within one
            # (sequence, head) still leaves long blocks late in the grid (~15% tail at 2k-4k causal with
            # one CTA per SM); longest-first across GROUP_HEADS pairs at a time fixes the tail while the
            # pairs in flight share their K/V in L2 (GROUP_HEADS * S * D * 4 bytes).
            lin = pid_m + bh * n_m
            g = lin // (GROUP_HEADS * n_m)
            r = lin % (GROUP_HEADS * n_m)
            g_size = tl.minimum(GROUP_HEADS, tl.num_programs(1) - g * GROUP_HEADS)
            pid_m = r // g_size
            bh = g * GROUP_HEADS + r % g_size
        pid_m = n_m - 1 - pid_m
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group_size
    max_seqlen_q = seqlen_q
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
        k_start = tl.load(CuSeqlensK + b)
        seqlen_k = tl.load(CuSeqlensK + b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    diag_off = seqlen_k - seqlen_q

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    Q += b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    K += b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    if USE_TMA:
        # Host side guarantees HEAD_DIM == BLOCK_D, HEAD_DIM_V == BLOCK_DV, 16-byte aligned bases and
        # row strides (TMA requirements); the descriptor's row extent is this sequence's length.
        K_desc = tl.make_tensor_descriptor(K, shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        V_desc = tl.make_tensor_descriptor(V, shape=[seqlen_k, HEAD_DIM_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        K_desc = K
        V_desc = V
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=(offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM), other=0.0)

    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * 1.4426950408889634
    else:
        slope_log2 = 0.0
    if HAS_DROPOUT:
        row_key = _dropout_row_key(bh, offs_m, max_seqlen_q, seed0, seed1)
    else:
        row_key = offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo, full_lo, full_hi, hi = _kv_block_range(m0, m_last, seqlen_k, diag_off, window_left, window_right,
                                               BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT)
    if WINDOW_LEFT:
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, K, V, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv, lo, full_lo,
            seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2, slope_log2,
            row_key, dropout_threshold, IS_FP32, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
            WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, USE_TMA, RESCALE_THRESHOLD)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv, full_lo, full_hi,
        seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2, slope_log2,
        row_key, dropout_threshold, IS_FP32, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False,
        WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, USE_TMA, RESCALE_THRESHOLD)
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, K, V, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d, offs_dv, full_hi, hi,
        seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2, slope_log2,
        row_key, dropout_threshold, IS_FP32, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True,
        WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, USE_TMA, RESCALE_THRESHOLD)

    if HAS_SINK:
        # exp(sink) joins the row sum with no value: l and acc are rebased to the larger of the row's reference
        # max and the sink (log2 units); a row with neither keeps 0 so that no difference is inf - inf.
        sink2 = tl.load(Sink + h) * LOG2E
        m_fin = tl.maximum(m_i, sink2)
        m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
        alpha = tl.exp2(m_i - m_fin)
        l_i = l_i * alpha + tl.exp2(sink2 - m_fin)
        acc = acc * alpha[:, None]
        m_i = m_fin
    # Rows with no visible key (and no sink) end with l = 0: their output is 0 and their lse +inf (contract).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (dropout_scale / l_safe)[:, None]
    row_ok = offs_m < seqlen_q
    Out += b.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_om + h.to(tl.int64) * stride_oh
    tl.store(Out + offs_m[:, None] * stride_om + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    lse2 = m_i + tl.log2(l_safe)
    lse = tl.where(empty, float("inf"), lse2 * LN2)
    Lse += b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    tl.store(Lse + offs_m, lse, mask=row_ok)

    if RETURN_PROBS:
        # Second pass for the (testing-only) probability matrix: it needs the final lse of each row.
        Probs += b.to(tl.int64) * stride_pb + h.to(tl.int64) * stride_ph
        lse_use = tl.where(empty, float("inf"), lse2)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + offs_n
            k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :],
                        mask=(cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
            if IS_FP32:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            s, _, _ = _scores(qk, offs_m[:, None], cols[None, :], diag_off, seqlen_k, window_left,
                              window_right, qk_scale, softcap_scale, softcap_log2, slope_log2, True,
                              WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI)
            p = tl.exp2(s - lse_use[:, None])
            if HAS_DROPOUT:
                p = tl.where(_dropout_keep(row_key[:, None], cols[None, :], dropout_threshold), p, -p)
            tl.store(Probs + offs_m[:, None] * stride_pm + cols[None, :], p,
                     mask=row_ok[:, None] & (cols[None, :] < seqlen_k))
