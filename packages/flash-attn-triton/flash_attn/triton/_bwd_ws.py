"""Experimental attention backward for sm_90: the dK/dV and dQ loops under Triton's automatic warp
specialization (the backward counterpart of _fwd_ws.py; its module docstring lists what the Hopper pass
accepts: one specialized loop, no runtime ``if`` inside it, every load in it from a tensor descriptor).

Three launches, no atomics (so the gradients are bitwise reproducible run to run):

1. ``_bwd_ws_preprocess_kernel``: delta = rowsum(dO * O), lse * log2(e) and lse into fp32 rows of
   ``seqlen_q`` rounded up to 128 per (sequence, head) (16-byte aligned rows, as a descriptor needs). Rows
   past seqlen_q, and rows that saw no key (lse +-inf; their output is 0), get lse2 = +inf and delta = 0, so
   P = exp2(s - lse2) = 0 there: the loops below need no row mask. (With the warp-specialized dQ kernel also
   its row terms, LD.)
2. ``_bwd_dkdv_ws_kernel``: a program owns BLOCK_N keys of one (sequence, kv head); K and V are loaded once
   (to shared memory), and the specialized loop streams (query head of the GQA group, query block) pairs:
   the producer warpgroup issues the Q / dO / lse2 / delta copies, two consumer warpgroups each own half of
   the keys (the products' M dimension) and compute S^T = K Q^T, dP^T = V dO^T, P^T, dS^T and the dV += P^T dO
   and dK += dS^T Q products. Keys past seqlen_k are the next sequence's (finite) and never stored.
3. dQ: by default the FA2-style ``_bwd.py`` dQ kernel on the padded rows (measured faster); or
   ``_bwd_dq_ws_kernel``: a program owns BLOCK_M query rows of one (sequence, head); Q, dO and the row terms
   are loaded once and the specialized loop streams the key blocks (producer: K and V copies; consumers: 64
   rows each) for S, dP, dS and dQ += dS K.

Descriptors are one per tensor over all sequences and heads (B * S rows by the row's elements), made at the
kernel's start: the form _fwd_ws.py found right under triton 3.6's Hopper pass. The backend serves dense
16-bit calls with power-of-two head dims, no window but causal (seqlen_q <= seqlen_k), no softcap, ALiBi or
dropout, whose tensors' batch stride is seqlen x row stride (backend._bwd_ws_plan).
"""
import triton
import triton.language as tl

from ._common import LOG2E


@triton.jit
def _split3(x):
    """x (fp32) as three bf16 terms hi + mid + lo (each the rounding of what the previous ones left): their
    fp32 sum is x to ~2^-24 relative."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit(do_not_specialize=["seqlen_q", "stride_lb", "stride_lh", "stride_p"])
def _bwd_ws_preprocess_kernel(Out, DOut, Lse, Delta, Lse2, LseN, LD, stride_ob, stride_om, stride_oh, stride_db,
                              stride_dm, stride_dh, stride_lb, stride_lh, stride_p, seqlen_q, num_heads, qk_scale,
                              HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, WRITE_LD: tl.constexpr = True):
    """Per (sequence, head) row of stride_p >= seqlen_q entries: Delta = rowsum(dO * O), Lse2 = lse * log2(e)
    (+inf past seqlen_q and where lse is -inf), LseN = lse (the same rows; for the FA2-style dQ kernel), and
    LD, 16 bf16 per query row: -lse2 / qk_scale (a large finite value past seqlen_q) in columns 0-2 and
    -delta in columns 8-10, each as hi + mid + lo terms (_bwd_dq_ws_kernel adds them to its products)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // num_heads
    h = bh % num_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_V)
    row_ok = offs_m < seqlen_q
    mask = row_ok[:, None]
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
                 + offs_m[:, None].to(tl.int64) * stride_dm + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse = tl.load(Lse + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m, mask=row_ok,
                  other=float("inf"))
    seen = (lse > float("-inf")) & (lse < float("inf"))
    lse2 = tl.where(seen, lse * LOG2E, float("inf"))
    delta = tl.where(seen, delta, 0.0)
    dst = bh.to(tl.int64) * stride_p + offs_m
    tl.store(Lse2 + dst, lse2)
    tl.store(LseN + dst, tl.where(seen, lse, float("inf")))
    tl.store(Delta + dst, delta)
    if WRITE_LD:
        # exp2((s - 1e30 / qk_scale) * qk_scale) = 0, without the NaN an infinite split would give
        lh, lm, ll = _split3(tl.where(seen, -lse2, -1e30) / qk_scale)
        dh, dm, dl = _split3(-delta)
        col = tl.arange(0, 16)[None, :]
        z = tl.zeros([BLOCK_M, 16], dtype=tl.bfloat16)
        ld = tl.where(col == 0, lh[:, None], tl.where(col == 1, lm[:, None], tl.where(col == 2, ll[:, None], z)))
        ld = tl.where(col == 8, dh[:, None], tl.where(col == 9, dm[:, None], tl.where(col == 10, dl[:, None], ld)))
        tl.store(LD + dst[:, None] * 16 + col, ld)


@triton.jit
def _rows_desc(T, n_rows, n_heads, stride_row, stride_head, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """One descriptor over a (sequences x rows, heads x WIDTH) tensor: every sequence and head (a box's
    coordinates pick the row and the head's first column)."""
    return tl.make_tensor_descriptor(T, shape=[n_rows, (n_heads - 1) * stride_head + WIDTH],
                                     strides=[stride_row, 1], block_shape=[BLOCK_ROWS, WIDTH])


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_p", "n_b"])
def _bwd_dkdv_ws_kernel(
    Q, K, V, DO, Lse2, Delta, DK, DV,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
    stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh, stride_p,
    seqlen_q, seqlen_k, num_heads, group_size, n_b, sm_scale, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, COMPUTE_DK: tl.constexpr = True, COMPUTE_DV: tl.constexpr = True,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    num_kv = num_heads // group_size
    b = bhk // num_kv
    hk = bhk % num_kv
    Q_desc = _rows_desc(Q, n_b * seqlen_q, num_heads, stride_qm, stride_qh, HEAD_DIM, BLOCK_M)
    DO_desc = _rows_desc(DO, n_b * seqlen_q, num_heads, stride_dom, stride_doh, HEAD_DIM_V, BLOCK_M)
    K_desc = _rows_desc(K, n_b * seqlen_k, num_kv, stride_kn, stride_kh, HEAD_DIM, BLOCK_N)
    V_desc = _rows_desc(V, n_b * seqlen_k, num_kv, stride_vn, stride_vh, HEAD_DIM_V, BLOCK_N)
    L_desc = tl.make_tensor_descriptor(Lse2, shape=[n_b * num_heads, stride_p], strides=[stride_p, 1],
                                       block_shape=[1, BLOCK_M])
    D_desc = tl.make_tensor_descriptor(Delta, shape=[n_b * num_heads, stride_p], strides=[stride_p, 1],
                                       block_shape=[1, BLOCK_M])
    n0 = pid_n * BLOCK_N
    k = K_desc.load([b * seqlen_k + n0, hk * stride_kh])
    v = V_desc.load([b * seqlen_k + n0, hk * stride_vh])
    diag_off = seqlen_k - seqlen_q
    if CAUSAL:
        # Query row i sees keys j <= i + diag_off: rows before n0 - diag_off see none of this block's keys.
        lo = (tl.maximum(n0 - diag_off, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    n_steps = tl.cdiv(tl.maximum(seqlen_q - lo, 0), BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_mb = tl.arange(0, BLOCK_M)
    h0 = hk * group_size
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V], dtype=tl.float32)
    for it in tl.range(0, n_steps * group_size, warp_specialize=True):
        g = it // n_steps
        m0 = lo + (it - g * n_steps) * BLOCK_M
        h = h0 + g
        q = Q_desc.load([b * seqlen_q + m0, h * stride_qh])
        do = DO_desc.load([b * seqlen_q + m0, h * stride_doh])
        lse2 = L_desc.load([b * num_heads + h, m0])  # (1, BLOCK_M): broadcasts over the keys
        delta = D_desc.load([b * num_heads + h, m0])
        qkT = tl.dot(k, tl.trans(q))
        dpT = tl.dot(v, tl.trans(do))
        if CAUSAL:
            vis = offs_n[:, None] <= (m0 + offs_mb)[None, :] + diag_off
            pT = tl.exp2(tl.where(vis, qkT * qk_scale, float("-inf")) - lse2)
        else:
            pT = tl.exp2(qkT * qk_scale - lse2)
        if COMPUTE_DV:
            dv = tl.dot(pT.to(do.dtype), do, dv)
        if COMPUTE_DK:
            dsT = pT * (dpT - delta)
            dk = tl.dot(dsT.to(q.dtype), q, dk)
    n_ok = offs_n[:, None] < seqlen_k
    if COMPUTE_DK:
        offs_d = tl.arange(0, HEAD_DIM)
        DK += b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh
        tl.store(DK + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :],
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok)
    if COMPUTE_DV:
        offs_dv = tl.arange(0, HEAD_DIM_V)
        DV += b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh
        tl.store(DV + offs_n[:, None].to(tl.int64) * stride_dvn + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=n_ok)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "stride_p", "n_b"])
def _bwd_dq_ws_kernel(
    Q, K, V, DO, LD, DQ,
    stride_qm, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_dom, stride_doh,
    stride_dqb, stride_dqm, stride_dqh, stride_p,
    seqlen_q, seqlen_k, num_heads, group_size, n_b, sm_scale, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_K: tl.constexpr,
):
    """The rows' lse2 and delta enter through the tensor cores: the consumers add them to S and dP with one
    more k=16 product each, LD's (BLOCK_M, 16) box (split like Q between the consumers) times a 0/1 selector,
    so S - lse2 / qk_scale and dP - delta come out in S's layout. (A pointer load of lse2 here fails the
    Hopper pass, a reduction or a reshape of a loaded box too, and (1, BLOCK_M) boxes transposed to columns
    computed wrong dQ with two consumers on the H200, triton 3.6.)"""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # the longest rows first (the tail wave)
    b = bh // num_heads
    h = bh % num_heads
    hk = h // group_size
    num_kv = num_heads // group_size
    Q_desc = _rows_desc(Q, n_b * seqlen_q, num_heads, stride_qm, stride_qh, HEAD_DIM, BLOCK_M)
    DO_desc = _rows_desc(DO, n_b * seqlen_q, num_heads, stride_dom, stride_doh, HEAD_DIM_V, BLOCK_M)
    K_desc = _rows_desc(K, n_b * seqlen_k, num_kv, stride_kn, stride_kh, HEAD_DIM, BLOCK_N)
    V_desc = _rows_desc(V, n_b * seqlen_k, num_kv, stride_vn, stride_vh, HEAD_DIM_V, BLOCK_N)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = Q_desc.load([b * seqlen_q + m0, h * stride_qh])
    do = DO_desc.load([b * seqlen_q + m0, h * stride_doh])
    # Rows are padded to a multiple of 128 >= BLOCK_M per (sequence, head), with P = 0 there: no mask.
    LD_desc = tl.make_tensor_descriptor(LD, shape=[n_b * num_heads * stride_p, 16], strides=[16, 1],
                                        block_shape=[BLOCK_M, 16])
    ld = LD_desc.load([bh * stride_p + m0, 0])
    r = tl.arange(0, 16)[:, None]
    ones = tl.full([16, BLOCK_N], 1.0, tl.float32)
    sel_l = tl.where(r < 3, ones, 0.0).to(tl.bfloat16)
    sel_d = tl.where((r >= 8) & (r < 11), ones, 0.0).to(tl.bfloat16)
    diag_off = seqlen_k - seqlen_q
    if CAUSAL:
        hi = tl.minimum(m0 + BLOCK_M + diag_off, seqlen_k)
    else:
        hi = seqlen_k
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=True):
        k = K_desc.load([b * seqlen_k + start_n, hk * stride_kh])
        v = V_desc.load([b * seqlen_k + start_n, hk * stride_vh])
        qk = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
        qk = tl.dot(ld, sel_l, qk)  # S - lse2 / qk_scale
        dp = tl.dot(ld, sel_d, dp)  # dP - delta
        if CAUSAL or not EVEN_K:
            cols = start_n + offs_n
            if CAUSAL:
                # implies cols < seqlen_k for every stored row (i < seqlen_q)
                vis = cols[None, :] <= offs_m[:, None] + diag_off
            else:
                vis = cols[None, :] < seqlen_k
            p = tl.exp2(tl.where(vis, qk * qk_scale, float("-inf")))
        else:
            p = tl.exp2(qk * qk_scale)
        ds = p * dp
        dq = tl.dot(ds.to(k.dtype), k, dq)
    offs_d = tl.arange(0, HEAD_DIM)
    DQ += b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
    tl.store(DQ + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(offs_m < seqlen_q)[:, None])
