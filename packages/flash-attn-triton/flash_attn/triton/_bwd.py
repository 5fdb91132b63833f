"""Attention backward kernels: FlashAttention-2 (Dao 2023, Algorithm 2).

1. ``_bwd_preprocess_kernel``: delta = rowsum(dO * O) in fp32 (equals rowsum(P * dP), so dS = P * (dP -
   delta) needs no second pass over the keys).
2. ``_bwd_dkdv_kernel``: one program owns BLOCK_N keys of one (sequence, kv head), keeps K, V, dK, dV in
   registers and streams the query blocks of every query head of its GQA group, recomputing P from the
   saved lse. dK/dV of a group are therefore summed in registers, without repeating K/V or atomics.
   With DQ_ATOMIC it also adds dS K into an fp32 dQ accumulator (fast, but the order of the atomic adds
   varies run to run).
3. ``_bwd_dq_kernel`` (deterministic path): one program owns BLOCK_M query rows and streams the key
   blocks, recomputing P and dP; every dQ element is summed by one program in a fixed order.

The dK/dV kernel works on transposed tiles (keys x queries) so that P^T and dS^T feed the dV and dK
products directly.
"""
import triton
import triton.language as tl

from ._common import LOG2E, _dropout_keep, _dropout_row_key, _kv_block_range, _q_block_range, _scores


# Lengths and length-dependent strides are not specialised: see _fwd.py.
@triton.jit(do_not_specialize=["seqlen_q", "stride_lb", "stride_lh"])
def _bwd_preprocess_kernel(Out, DOut, Delta, CuSeqlensQ,
                           stride_ob, stride_om, stride_oh, stride_db, stride_dm, stride_dh,
                           stride_lb, stride_lh, seqlen_q, num_heads,
                           HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                           IS_VARLEN: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
    else:
        q_start = 0
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM_V)
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + (q_start + offs_m[:, None]).to(tl.int64) * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
                 + (q_start + offs_m[:, None]).to(tl.int64) * stride_dm + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + offs_m, delta,
             mask=offs_m < seqlen_q)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q_ptr, DO_ptr, Q_desc, DO_desc, Lse_ptr, Delta_ptr, DQ_ptr, Alibi_ptr, stride_qm,
                stride_qh, stride_dom, stride_doh, stride_dqm, stride_dqh, stride_lh, stride_ah, offs_n, offs_mb,
                offs_d, offs_dv, start, end, group_size, bh0, seqlen_q, seqlen_k, diag_off, window_left,
                window_right, sm_scale, qk_scale, softcap_scale, softcap_log2, max_seqlen_q, seed0, seed1,
                dropout_threshold, dropout_scale,
                IS_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, DQ_ATOMIC: tl.constexpr, USE_TMA: tl.constexpr,
                COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr):
    # One flat loop over (query head of the group, query block): a nested head loop around three block
    # loops keeps more values live across loop boundaries and spills on sm_90.
    n_steps = tl.cdiv(end - start, BLOCK_M)
    for it in range(0, n_steps * group_size):
        g = it // n_steps
        m0 = start + (it - g * n_steps) * BLOCK_M
        rows = m0 + offs_mb
        row_ok = rows < seqlen_q
        if USE_TMA:
            # The copy engine zero-fills rows past seqlen_q and columns past the head dim, so the steady
            # state issues no per-element address or mask arithmetic and keeps no pointer tensors live.
            q = tl.reshape(Q_desc.load([g, m0, 0]), (BLOCK_M, BLOCK_D))
            do = tl.reshape(DO_desc.load([g, m0, 0]), (BLOCK_M, BLOCK_DV))
        else:
            q = tl.load(Q_ptr + g * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
                        mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            do = tl.load(DO_ptr + g * stride_doh + rows[:, None] * stride_dom + offs_dv[None, :],
                         mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        # lse = +inf past the end of the sequence makes P = 0 there (and for rows that see no key).
        lse2 = tl.load(Lse_ptr + g * stride_lh + rows, mask=row_ok, other=float("inf")) * LOG2E
        delta = tl.load(Delta_ptr + g * stride_lh + rows, mask=row_ok, other=0.0)
        if HAS_ALIBI:
            slope_log2 = tl.load(Alibi_ptr + g * stride_ah) * LOG2E
        else:
            slope_log2 = 0.0
        # Both products are issued before the exponentials so the second overlaps the first's epilogue.
        if IS_FP32:
            qkT = tl.dot(k, tl.trans(q), input_precision="ieee")
        else:
            qkT = tl.dot(k, tl.trans(q))
        if COMPUTE_DK or DQ_ATOMIC:
            if IS_FP32:
                dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
            else:
                dpT = tl.dot(v, tl.trans(do))
        sT, tT, _ = _scores(qkT, rows[None, :], offs_n[:, None], diag_off, seqlen_k, window_left, window_right,
                            qk_scale, softcap_scale, softcap_log2, slope_log2, MASK, WINDOW_LEFT, WINDOW_RIGHT,
                            HAS_SOFTCAP, HAS_ALIBI)
        pT = tl.exp2(sT - lse2[None, :])
        if HAS_DROPOUT:
            row_key = _dropout_row_key(bh0 + g, rows, max_seqlen_q, seed0, seed1)
            keepT = _dropout_keep(row_key[None, :], offs_n[:, None], dropout_threshold)
            pT_drop = tl.where(keepT, pT * dropout_scale, 0.0)
            if COMPUTE_DK or DQ_ATOMIC:
                dpT = tl.where(keepT, dpT * dropout_scale, 0.0)
        else:
            pT_drop = pT
        if COMPUTE_DV:
            if IS_FP32:
                dv = tl.dot(pT_drop, do, dv, input_precision="ieee")
            else:
                dv = tl.dot(pT_drop.to(do.dtype), do, dv)
        if COMPUTE_DK or DQ_ATOMIC:
            dsT = pT * (dpT - delta[None, :])
            if HAS_SOFTCAP:
                dsT = dsT * (1.0 - tT * tT)
            if COMPUTE_DK:
                if IS_FP32:
                    dk = tl.dot(dsT, q, dk, input_precision="ieee")
                else:
                    dk = tl.dot(dsT.to(q.dtype), q, dk)
            if DQ_ATOMIC:
                if IS_FP32:
                    dq = tl.dot(tl.trans(dsT), k, input_precision="ieee")
                else:
                    dq = tl.dot(tl.trans(dsT.to(k.dtype)), k)
                tl.atomic_add(DQ_ptr + g * stride_dqh + rows[:, None] * stride_dqm + offs_d[None, :],
                              dq * sm_scale, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right", "seed0", "seed1",
                               "dropout_threshold", "stride_lb", "stride_lh"])
def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DQ, DK, DV, Alibi, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_dkb, stride_dkn, stride_dkh,
    stride_dvb, stride_dvn, stride_dvh,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    seqlen_q, seqlen_k, num_heads, group_size,
    sm_scale, qk_scale, softcap_scale, softcap_log2, window_left, window_right,
    seed0, seed1, dropout_threshold, dropout_scale,
    IS_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DQ_ATOMIC: tl.constexpr, USE_TMA: tl.constexpr = False,
    COMPUTE_DK: tl.constexpr = True, COMPUTE_DV: tl.constexpr = True,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    num_kv_heads = num_heads // group_size
    b = bhk // num_kv_heads
    hk = bhk % num_kv_heads
    max_seqlen_q = seqlen_q
    if IS_VARLEN:
        q_start = tl.load(CuSeqlensQ + b)
        seqlen_q = tl.load(CuSeqlensQ + b + 1) - q_start
        k_start = tl.load(CuSeqlensK + b)
        seqlen_k = tl.load(CuSeqlensK + b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    diag_off = seqlen_k - seqlen_q

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    K += b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=(offs_n[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vn + offs_dv[None, :],
                mask=(offs_n[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Pointers at the first query head of this kv head's group; the loops step over the group.
    h0 = hk * group_size
    Q += b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qm + h0.to(tl.int64) * stride_qh
    DO += b.to(tl.int64) * stride_dob + q_start.to(tl.int64) * stride_dom + h0.to(tl.int64) * stride_doh
    DQ += b.to(tl.int64) * stride_dqb + q_start.to(tl.int64) * stride_dqm + h0.to(tl.int64) * stride_dqh
    l_off = b.to(tl.int64) * stride_lb + h0.to(tl.int64) * stride_lh + q_start
    Lse += l_off
    Delta += l_off
    Alibi += b * stride_ab + h0 * stride_ah
    bh0 = b * num_heads + h0
    if USE_TMA:
        # (query head of the group, row, column) boxes of one sequence; the plan checks the 16-byte
        # alignment of the base and of the row and head strides that the copy engine requires.
        Q_desc = tl.make_tensor_descriptor(Q, shape=[group_size, seqlen_q, HEAD_DIM],
                                           strides=[stride_qh, stride_qm, 1], block_shape=[1, BLOCK_M, BLOCK_D])
        DO_desc = tl.make_tensor_descriptor(DO, shape=[group_size, seqlen_q, HEAD_DIM_V],
                                            strides=[stride_doh, stride_dom, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_DV])
    else:
        Q_desc = Q
        DO_desc = DO

    n_last = tl.minimum(n0 + BLOCK_N, seqlen_k) - 1
    lo, full_lo, full_hi, hi = _q_block_range(n0, n_last, seqlen_q, diag_off, window_left, window_right,
                                              BLOCK_M, WINDOW_LEFT, WINDOW_RIGHT)
    # Loads are bounded by seqlen_q in every loop, so without a left window the middle loop also takes the
    # partial last query block, and no trailing masked loop is compiled.
    if WINDOW_LEFT:
        mid_end = full_hi
    else:
        mid_end = hi
    if WINDOW_RIGHT:
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q, DO, Q_desc, DO_desc, Lse, Delta, DQ, Alibi, stride_qm, stride_qh, stride_dom, stride_doh,
            stride_dqm, stride_dqh, stride_lh, stride_ah, offs_n, offs_mb, offs_d, offs_dv, lo, full_lo, group_size,
            bh0, seqlen_q, seqlen_k, diag_off, window_left, window_right, sm_scale, qk_scale, softcap_scale,
            softcap_log2, max_seqlen_q, seed0, seed1, dropout_threshold, dropout_scale, IS_FP32, HEAD_DIM, HEAD_DIM_V,
            BLOCK_D, BLOCK_DV, BLOCK_M, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DQ_ATOMIC,
            USE_TMA, COMPUTE_DK, COMPUTE_DV)
    dk, dv = _dkdv_inner(
        dk, dv, k, v, Q, DO, Q_desc, DO_desc, Lse, Delta, DQ, Alibi, stride_qm, stride_qh, stride_dom, stride_doh,
        stride_dqm, stride_dqh, stride_lh, stride_ah, offs_n, offs_mb, offs_d, offs_dv, full_lo, mid_end, group_size,
        bh0, seqlen_q, seqlen_k, diag_off, window_left, window_right, sm_scale, qk_scale, softcap_scale, softcap_log2,
        max_seqlen_q, seed0, seed1, dropout_threshold, dropout_scale, IS_FP32, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
        BLOCK_M, False, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DQ_ATOMIC, USE_TMA, COMPUTE_DK,
        COMPUTE_DV)
    if WINDOW_LEFT:
        dk, dv = _dkdv_inner(
            dk, dv, k, v, Q, DO, Q_desc, DO_desc, Lse, Delta, DQ, Alibi, stride_qm, stride_qh, stride_dom, stride_doh,
            stride_dqm, stride_dqh, stride_lh, stride_ah, offs_n, offs_mb, offs_d, offs_dv, full_hi, hi, group_size,
            bh0, seqlen_q, seqlen_k, diag_off, window_left, window_right, sm_scale, qk_scale, softcap_scale,
            softcap_log2, max_seqlen_q, seed0, seed1, dropout_threshold, dropout_scale, IS_FP32, HEAD_DIM, HEAD_DIM_V,
            BLOCK_D, BLOCK_DV, BLOCK_M, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, DQ_ATOMIC,
            USE_TMA, COMPUTE_DK, COMPUTE_DV)

    n_ok = offs_n[:, None] < seqlen_k
    if COMPUTE_DK:
        DK += b.to(tl.int64) * stride_dkb + k_start.to(tl.int64) * stride_dkn + hk.to(tl.int64) * stride_dkh
        tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                 mask=n_ok & (offs_d[None, :] < HEAD_DIM))
    if COMPUTE_DV:
        DV += b.to(tl.int64) * stride_dvb + k_start.to(tl.int64) * stride_dvn + hk.to(tl.int64) * stride_dvh
        tl.store(DV + offs_n[:, None] * stride_dvn + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=n_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K_ptr, V_ptr, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d,
              offs_dv, start, end, seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale, softcap_log2,
              slope_log2, row_key, dropout_threshold, dropout_scale, IS_FP32: tl.constexpr,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              USE_TMA: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = K_ptr + cols[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = V_ptr + cols[:, None] * stride_vn + offs_dv[None, :]
        if USE_TMA:
            # zero fill past seqlen_k and the head dim, as the masked pointer loads below
            k = K_desc.load([start_n, 0])
            v = V_desc.load([start_n, 0])
        elif MASK:
            k = tl.load(k_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM), other=0.0)
            v = tl.load(v_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        else:
            if BLOCK_D != HEAD_DIM:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            else:
                k = tl.load(k_ptrs)
            if BLOCK_DV != HEAD_DIM_V:
                v = tl.load(v_ptrs, mask=offs_dv[None, :] < HEAD_DIM_V, other=0.0)
            else:
                v = tl.load(v_ptrs)
        if IS_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        s, t, _ = _scores(qk, offs_m[:, None], cols[None, :], diag_off, seqlen_k, window_left, window_right,
                          qk_scale, softcap_scale, softcap_log2, slope_log2, MASK, WINDOW_LEFT, WINDOW_RIGHT,
                          HAS_SOFTCAP, HAS_ALIBI)
        p = tl.exp2(s - lse2[:, None])
        if HAS_DROPOUT:
            keep = _dropout_keep(row_key[:, None], cols[None, :], dropout_threshold)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if IS_FP32:
            dq = tl.dot(ds, k, dq, input_precision="ieee")
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right", "seed0", "seed1",
                               "dropout_threshold", "stride_lb", "stride_lh"])
def _bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Alibi, CuSeqlensQ, CuSeqlensK,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_dob, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh,
    stride_lb, stride_lh,
    stride_ab, stride_ah,
    seqlen_q, seqlen_k, num_heads, group_size,
    sm_scale, qk_scale, softcap_scale, softcap_log2, window_left, window_right,
    seed0, seed1, dropout_threshold, dropout_scale,
    IS_FP32: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr,
    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, USE_TMA: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group_size
    if WINDOW_RIGHT:
        pid_m = tl.num_programs(0) - 1 - pid_m
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
    row_ok = offs_m < seqlen_q
    Q += b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qm + h.to(tl.int64) * stride_qh
    DO += b.to(tl.int64) * stride_dob + q_start.to(tl.int64) * stride_dom + h.to(tl.int64) * stride_doh
    K += b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_kn + hk.to(tl.int64) * stride_kh
    V += b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vn + hk.to(tl.int64) * stride_vh
    l_base = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dom + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
    lse2 = tl.load(Lse + l_base + offs_m, mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + l_base + offs_m, mask=row_ok, other=0.0)
    if HAS_ALIBI:
        slope_log2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    else:
        slope_log2 = 0.0
    if HAS_DROPOUT:
        row_key = _dropout_row_key(bh, offs_m, max_seqlen_q, seed0, seed1)
    else:
        row_key = offs_m

    if USE_TMA:
        K_desc = tl.make_tensor_descriptor(K, shape=[seqlen_k, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        V_desc = tl.make_tensor_descriptor(V, shape=[seqlen_k, HEAD_DIM_V], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_DV])
    else:
        K_desc = K
        V_desc = V
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_last = tl.minimum(m0 + BLOCK_M, seqlen_q) - 1
    lo, full_lo, full_hi, hi = _kv_block_range(m0, m_last, seqlen_k, diag_off, window_left, window_right,
                                               BLOCK_N, WINDOW_LEFT, WINDOW_RIGHT)
    if WINDOW_LEFT:
        dq = _dq_inner(dq, q, do, lse2, delta, K, V, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                       offs_dv, lo, full_lo, seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale,
                       softcap_log2, slope_log2, row_key, dropout_threshold, dropout_scale, IS_FP32, HEAD_DIM,
                       HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                       HAS_DROPOUT, USE_TMA)
    dq = _dq_inner(dq, q, do, lse2, delta, K, V, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                   offs_dv, full_lo, full_hi, seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale,
                   softcap_log2, slope_log2, row_key, dropout_threshold, dropout_scale, IS_FP32, HEAD_DIM,
                   HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, False, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                   HAS_DROPOUT, USE_TMA)
    dq = _dq_inner(dq, q, do, lse2, delta, K, V, K_desc, V_desc, stride_kn, stride_vn, offs_m, offs_n, offs_d,
                   offs_dv, full_hi, hi, seqlen_k, diag_off, window_left, window_right, qk_scale, softcap_scale,
                   softcap_log2, slope_log2, row_key, dropout_threshold, dropout_scale, IS_FP32, HEAD_DIM,
                   HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                   HAS_DROPOUT, USE_TMA)
    DQ += b.to(tl.int64) * stride_dqb + q_start.to(tl.int64) * stride_dqm + h.to(tl.int64) * stride_dqh
    tl.store(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
