"""The Triton kernel of flash_attn_combine and of the split forward's merge (combine.py says what it computes and
when it runs), in its own module so that importing the package does not import Triton."""
import triton
import triton.language as tl


@triton.jit
def _load_lse(lse_ptrs, k, s_ln, n_splits, row_ok):
    """Parts k's lse of the rows, [len(k), len(row_ok)] fp32, an infinite one (an empty part) as -inf."""
    mask = (k < n_splits)[:, None] & row_ok[None, :]
    t = tl.load(lse_ptrs[None, :] + k.to(tl.int64)[:, None] * s_ln, mask=mask, other=float("-inf"))
    t = t.to(tl.float32)
    return tl.where(tl.abs(t) == float("inf"), float("-inf"), t)


# Row counts and split counts change from call to call: not specialised (no recompile per batch). Strides are,
# so that a unit D stride and 16-divisible row strides vectorise the loads of o.
@triton.jit(do_not_specialize=["n_splits", "seqlen", "n_rows"])
def _combine_kernel(OutPartial, LsePartial, Out, Lse, Sink, RowLimit,
                    s_pn, s_pb, s_ps, s_ph, s_pd, s_ln, s_lb, s_ls, s_lh,
                    s_ob, s_os, s_oh, s_od, s_eb, s_es, s_eh,
                    n_splits, seqlen, n_rows, heads,
                    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr, HAS_SINK: tl.constexpr,
                    UNSEEN_POS_INF: tl.constexpr, ROW_LIMIT: tl.constexpr):
    # Sink (HAS_SINK): a per-head logit that joins each row's sum as exp(sink) with no value (the split kernels
    # leave it out so that it counts once). A row with no finite term gets lse -inf (FA4's flash_attn_combine), or
    # +inf with UNSEEN_POS_INF (the split forward's convention). ROW_LIMIT: rows from the int32 at RowLimit on (a
    # varlen call's rows after its last sequence, whose parts no CTA wrote) get o = 0 and lse +inf, whatever their
    # parts hold.
    # Rows are (batch, seqlen) flattened; heads vary fastest among programs, so programs running together read
    # whole (row, H, D) stretches of each part.
    pid = tl.program_id(0)
    m_blk = pid // heads
    h64 = (pid - m_blk * heads).to(tl.int64)
    d_blk = tl.program_id(1)
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    b = rows // seqlen
    # 64-bit offsets: a part's stride alone can pass 2^31 elements
    b64 = b.to(tl.int64)
    s64 = (rows - b * seqlen).to(tl.int64)
    cols = d_blk * BLOCK_D + tl.arange(0, BLOCK_D)
    tile = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    lse_ptrs = LsePartial + b64 * s_lb + s64 * s_ls + h64 * s_lh  # (BLOCK_M,)
    o_ptrs = OutPartial + (b64 * s_pb + s64 * s_ps + h64 * s_ph)[:, None] + cols[None, :].to(tl.int64) * s_pd
    # BLOCK_K parts at a time, [BLOCK_K, BLOCK_M(, BLOCK_D)] tiles: with few rows (decoding) the parts give the
    # program its parallel loads
    ks = tl.arange(0, BLOCK_K)

    # pass 1: the largest finite lse of each row (an infinite one is an empty part: -inf, it adds nothing)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    n_nan = tl.zeros([BLOCK_M], tl.int32)
    for k0 in range(0, n_splits, BLOCK_K):
        t = _load_lse(lse_ptrs, k0 + ks, s_ln, n_splits, row_ok)
        n_nan += tl.sum((t != t).to(tl.int32), 0)  # apart: max's NaN handling differs between GPU and interpreter
        row_max = tl.maximum(row_max, tl.max(t, 0))
    if HAS_SINK:
        sink = tl.load(Sink + h64).to(tl.float32)
        row_max = tl.maximum(row_max, tl.where(tl.abs(sink) == float("inf"), float("-inf"), sink))
    # pass 2: sum of exp(lse_s - max) (each term <= 1: no overflow however large the lse)
    seen = row_max > float("-inf")
    shift = tl.where(seen, row_max, 0.0)
    total = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, n_splits, BLOCK_K):
        t = _load_lse(lse_ptrs, k0 + ks, s_ln, n_splits, row_ok)
        total += tl.sum(tl.exp(t - shift[None, :]), 0)
    if HAS_SINK:
        total += tl.where(seen, tl.exp(sink - shift), 0.0)
    if UNSEEN_POS_INF:
        lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("inf"))
    else:
        lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    lse = tl.where(n_nan > 0, float("nan"), lse)
    # pass 3: o = sum_s exp(lse_s - max) / total o_s. Not exp(lse_s - lse) as the torch expression: lse_s - max
    # is exact where lse_s is near max (Sterbenz) while lse rounded to fp32 is off by up to half its ulp, which
    # at lse ~ 1e4 moves every weight by 5e-4. A row with no finite lse weighs every part 0 (o = 0; 0 * NaN
    # stays NaN, as there).
    ok = seen & (n_nan == 0)
    scale = tl.where(ok, 1.0 / tl.where(ok, total, 1.0), 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for k0 in range(0, n_splits, BLOCK_K):
        k = k0 + ks
        t = _load_lse(lse_ptrs, k, s_ln, n_splits, row_ok)
        w = tl.where(ok[None, :], tl.exp(t - shift[None, :]) * scale[None, :], 0.0)
        o = tl.load(o_ptrs[None, :, :] + k.to(tl.int64)[:, None, None] * s_pn,
                    mask=(k < n_splits)[:, None, None] & tile[None, :, :], other=0.0).to(tl.float32)
        acc += tl.sum(w[:, :, None] * o, 0)
    if ROW_LIMIT:
        used = rows < tl.load(RowLimit)
        acc = tl.where(used[:, None], acc, 0.0)
        lse = tl.where(used, lse, float("inf"))
    out_ptrs = Out + (b64 * s_ob + s64 * s_os + h64 * s_oh)[:, None] + cols[None, :].to(tl.int64) * s_od
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=tile)
    if WRITE_LSE:
        if d_blk == 0:
            tl.store(Lse + b64 * s_eb + s64 * s_es + h64 * s_eh, lse, mask=row_ok)
