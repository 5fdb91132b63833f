"""Triton backward kernels of the fused dropout + residual add + LayerNorm / RMSNorm (ops/triton/layer_norm.py
has the launch configuration, the autograd Function and the public API).

_ln_bwd_kernel: a persistent program takes its block of rows; pass 1 forms each row's sums, pass 2 writes
dx (and dx1, dresidual_in) and accumulates the program's own columns of dweight / dbias (dweight1, dbias1)
into a private row of fp32 partial buffers. _ln_bwd_reduce_kernel then adds the partials in a fixed order,
so no two programs write the same address (no atomics, bitwise reproducible). Dropout masks come from the
forward's hash (layer_norm_fwd.py), regenerated per (row, column).
"""
from . import tl, triton
from .layer_norm_fwd import _keep, _row_hash


@triton.jit
def _ln_bwd_load(X, DY, DY1, r, cols, mask, stride_x, stride_dy, stride_dy1, HAS_W1: tl.constexpr,
                 CACHE: tl.constexpr):
    """x, dy and dy1 (the parallel branch's; dy again without one) of a tile, in their stored dtypes."""
    x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    dy = tl.load(DY + r * stride_dy + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    dy1 = dy
    if HAS_W1:
        dy1 = tl.load(DY1 + r * stride_dy1 + cols, mask=mask, other=0.0, cache_modifier=CACHE)
    return x, dy, dy1


@triton.jit
def _ln_bwd_stats(MEAN, RSTD, rows, ok, IS_RMS_NORM: tl.constexpr):
    mean = tl.zeros(rows.shape, dtype=tl.float32)
    if not IS_RMS_NORM:
        mean = tl.load(MEAN + rows, mask=ok, other=0.0)
    return mean, tl.load(RSTD + rows, mask=ok, other=0.0)


@triton.jit
def _ln_bwd_grads(x, dy, dy1, W, W1, cols, N, mean, HAS_W1: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """xc = x - mean and g = dy * w (+ dy1 * w1) of a tile; mean: (BLOCK_M,). g is zero outside the tile
    (dy, dy1 and w load as 0 there), which is all that keeps the padding out of the row sums and the
    dweight terms (both are products with g, dy or dy1), so xc needs no select of its own. The weights
    are re-read for every tile (L1 hits) instead of being held in registers across the row loop."""
    col_ok = cols < N
    xc = x.to(tl.float32) - mean[:, None]
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = tl.where(col_ok, w + 1.0, 0.0)
    g = dy.to(tl.float32) * w
    if HAS_W1:
        w1 = tl.load(W1 + cols, mask=col_ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w1 = tl.where(col_ok, w1 + 1.0, 0.0)
        g += dy1.to(tl.float32) * w1
    return xc, g


@triton.jit
def _ln_bwd_store(dx, DRES_OUT, DRES_IN, DX, DX1, ROWSCALE, r, r_ok, M, cols, mask,
                  stride_dres_out, stride_dres_in, stride_dx, stride_dx1, seed0, seed1, drop_threshold,
                  drop_scale, HAS_DRES_OUT: tl.constexpr, STORE_DRES_IN: tl.constexpr, HAS_X1: tl.constexpr,
                  HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    if HAS_DRES_OUT:
        dx += tl.load(DRES_OUT + r * stride_dres_out + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_DRES_IN:
        tl.store(DRES_IN + r * stride_dres_in + cols, dx, mask=mask)
    if HAS_X1:
        dx1 = dx
        if HAS_DROPOUT:
            dx1 = tl.where(_keep(_row_hash(seed0, seed1, r + M), cols, drop_threshold), dx1 * drop_scale, 0.0)
        tl.store(DX1 + r * stride_dx1 + cols, dx1, mask=mask)
    if HAS_ROWSCALE:
        dx *= tl.load(ROWSCALE + r, mask=r_ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        dx = tl.where(_keep(_row_hash(seed0, seed1, r), cols, drop_threshold), dx * drop_scale, 0.0)
    tl.store(DX + r * stride_dx + cols, dx, mask=mask)


@triton.jit
def _row_sums(a, b, PAIR: tl.constexpr):
    """Row sums of two (BLOCK_M, BLOCK) tiles. PAIR: as one reduction of the pair joined on a new minor
    axis, which Triton lowers to a single shared-memory exchange for both (one barrier pair, 64-bit
    stores); separately, the second exchange waits for the first to free the scratch buffer. (A
    two-operand tl.reduce also shares the exchange but runs ~8x slower in the interpreter.)"""
    if PAIR:
        sa, sb = tl.split(tl.sum(tl.join(a, b), axis=1))
    else:
        sa = tl.sum(a, axis=1)
        sb = tl.sum(b, axis=1)
    return sa, sb


@triton.jit
def _ln_bwd_pass2(X, W, W1, DY, DY1, DRES_OUT, ROWSCALE, DX, DX1, DRES_IN, r, r_ok, cols, M, N, mean, rstd, c1, c2,
                  acc_dw, acc_db, acc_dw1, acc_db1, stride_x, stride_dy, stride_dy1, stride_dres_out, stride_dx,
                  stride_dx1, stride_dres_in, seed0, seed1, drop_threshold, drop_scale, IS_RMS_NORM: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, HAS_DRES_OUT: tl.constexpr,
                  STORE_DRES_IN: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
                  HAS_DROPOUT: tl.constexpr, ZERO_CENTERED: tl.constexpr, held_xc, held_g, held_dy, held_dy1,
                  HOLD: tl.constexpr):
    """dx of the columns cols of rows r, given the row sums c1, c2; returns the accumulators with the
    tile's dweight/dbias terms added. The explicit (default) cache-all modifier keeps the compiler from
    merging these loads with pass 1's, which would hold the tile in registers across the reductions.
    HOLD: pass 1's xc, g, dy, dy1 of the same tile are given (held in registers) instead."""
    mask = r_ok & (cols < N)
    if HOLD:
        xc, g, dy, dy1 = held_xc, held_g, held_dy, held_dy1
    else:
        x, dy, dy1 = _ln_bwd_load(X, DY, DY1, r, cols, mask, stride_x, stride_dy, stride_dy1, HAS_W1, ".ca")
        xc, g = _ln_bwd_grads(x, dy, dy1, W, W1, cols, N, mean, HAS_W1, ZERO_CENTERED)
    xhat = xc * rstd[:, None]
    # dx = (g - xhat * c1 - c2) * rstd with c1, c2 pre-scaled by rstd (per row): two FMAs an element.
    if IS_RMS_NORM:
        dx = g * rstd[:, None] - xhat * c1[:, None]
    else:
        dx = g * rstd[:, None] - (xhat * c1[:, None] + c2[:, None])
    _ln_bwd_store(dx, DRES_OUT, DRES_IN, DX, DX1, ROWSCALE, r, r_ok, M, cols, mask,
                  stride_dres_out, stride_dres_in, stride_dx, stride_dx1, seed0, seed1, drop_threshold,
                  drop_scale, HAS_DRES_OUT, STORE_DRES_IN, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT)
    dyf = dy.to(tl.float32)
    acc_dw += dyf * xhat
    if HAS_BIAS:
        acc_db += dyf
    if HAS_W1:
        dy1f = dy1.to(tl.float32)
        acc_dw1 += dy1f * xhat
        if HAS_B1:
            acc_db1 += dy1f
    return acc_dw, acc_db, acc_dw1, acc_db1


@triton.jit
def _ln_bwd_store_parts(DW_PART, DB_PART, DW1_PART, DB1_PART, part, ok, acc_dw, acc_db, acc_dw1, acc_db1,
                        HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """Column sums of the (BLOCK_M, BLOCK_N) accumulators into the partial buffers at offsets part, a
    (1, BLOCK_N) tile."""
    tl.store(DW_PART + part, tl.sum(acc_dw, axis=0, keep_dims=True), mask=ok)
    if HAS_BIAS:
        tl.store(DB_PART + part, tl.sum(acc_db, axis=0, keep_dims=True), mask=ok)
    if HAS_W1:
        tl.store(DW1_PART + part, tl.sum(acc_dw1, axis=0, keep_dims=True), mask=ok)
        if HAS_B1:
            tl.store(DB1_PART + part, tl.sum(acc_db1, axis=0, keep_dims=True), mask=ok)


@triton.jit(do_not_specialize=["seed0", "seed1"])
def _ln_bwd_kernel(
    X, W, W1, DY, DY1, DRES_OUT, ROWSCALE, MEAN, RSTD, DX, DX1, DRES_IN, DW_PART, DB_PART, DW1_PART, DB1_PART,
    stride_x, stride_dy, stride_dy1, stride_dres_out, stride_dx, stride_dx1, stride_dres_in,
    M, N, rows_per_program, seed0, seed1, drop_threshold, drop_scale,
    IS_RMS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
    HAS_DRES_OUT: tl.constexpr, STORE_DRES_IN: tl.constexpr, HAS_X1: tl.constexpr,
    HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
    SUB: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr, PAIR: tl.constexpr,
    HOLD: tl.constexpr,
):
    """Rows [row_start, row_end), BLOCK_M at a time, in two passes over each tile of rows. Pass 1 reads
    the whole rows (R_CHUNKS chunks of BLOCK_R columns) for the two row sums; pass 2 reads again (from
    L1, where pass 1 left them) the BLOCK_N columns this program owns, writes their dx and adds their
    dweight/dbias terms to register accumulators, stored once at the end into this program's row of
    the fp32 partial buffers. Nothing but the accumulators and the row sums lives across the row
    reductions, which keeps registers low and programs per SM high.

    SPLIT > 1 programs (consecutive ids) share each row group: each owns SUB * BLOCK_N of its columns,
    so no program holds accumulators for a whole wide row; all of them read the whole rows in pass 1
    (the later ones from L2) and add the chunks in the same order, so they get the same row sums. SUB
    sub-chunks are worked one after the other with their own accumulators, which bounds the temporaries
    of pass 2. PREFETCH (one pass-1 chunk per row) loads the next tile's pass-1 data before working on
    this one; HOLD (with PREFETCH, one program owning the whole row in one chunk) skips pass 2's re-read
    and works on pass 1's values still in registers. PAIR: LayerNorm's two row sums in one reduction.

    Per row the kernel reads x and dy (and dy1, dresidual_out) once from DRAM and writes dx (and dx1,
    dresidual_in) once: xhat is recomputed from x, mean and rstd, nothing else is saved by the forward."""
    pid = tl.program_id(0)
    chunk = pid % SPLIT
    group = (pid // SPLIT).to(tl.int64)
    # int64 row bounds make the loop variable int64 on the GPU: row * stride can pass 2**31.
    row_start = group * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    arange_m = tl.arange(0, BLOCK_M)
    rcols = tl.arange(0, BLOCK_R)[None, :]
    cols = chunk * SUB * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    acc_dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_dw1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_db1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bcc_dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bcc_db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bcc_dw1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bcc_db1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        rows = row_start + arange_m
        ok = rows < row_end
        x_next, dy_next, dy1_next = _ln_bwd_load(X, DY, DY1, rows[:, None], rcols, ok[:, None] & (rcols < N),
                                                 stride_x, stride_dy, stride_dy1, HAS_W1, "")
        mean_next, rstd_next = _ln_bwd_stats(MEAN, RSTD, rows, ok, IS_RMS_NORM)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + arange_m
        ok = rows < row_end
        r = rows[:, None]
        r_ok = ok[:, None]
        # Pass 1: the row sums of (x - mean) * g and g.
        if PREFETCH:
            x, dy, dy1, mean, rstd = x_next, dy_next, dy1_next, mean_next, rstd_next
            nrows = rows + BLOCK_M
            nok = nrows < row_end
            x_next, dy_next, dy1_next = _ln_bwd_load(X, DY, DY1, nrows[:, None], rcols, nok[:, None] & (rcols < N),
                                                     stride_x, stride_dy, stride_dy1, HAS_W1, "")
            mean_next, rstd_next = _ln_bwd_stats(MEAN, RSTD, nrows, nok, IS_RMS_NORM)
            xc, g = _ln_bwd_grads(x, dy, dy1, W, W1, rcols, N, mean, HAS_W1, ZERO_CENTERED)
            if IS_RMS_NORM:
                c1 = tl.sum(xc * g, axis=1)
                c2 = c1
            else:
                c1, c2 = _row_sums(xc * g, g, PAIR)
        else:
            mean, rstd = _ln_bwd_stats(MEAN, RSTD, rows, ok, IS_RMS_NORM)
            c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
            c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
            xc, g, dy, dy1 = c1, c1, c1, c1  # nothing to hold for pass 2 (HOLD needs PREFETCH)
            for c in range(R_CHUNKS):
                ccols = c * BLOCK_R + rcols
                cmask = r_ok & (ccols < N)
                cx, cdy, cdy1 = _ln_bwd_load(X, DY, DY1, r, ccols, cmask, stride_x, stride_dy, stride_dy1, HAS_W1,
                                             "")
                cxc, cg = _ln_bwd_grads(cx, cdy, cdy1, W, W1, ccols, N, mean, HAS_W1, ZERO_CENTERED)
                if IS_RMS_NORM:
                    c1 += tl.sum(cxc * cg, axis=1)
                else:
                    s1, s2 = _row_sums(cxc * cg, cg, PAIR)
                    c1 += s1
                    c2 += s2
        # Pass 1 summed (x - mean) * g: one multiply by rstd a row instead of one an element. Pass 2
        # wants c1 and c2 times rstd once more.
        c1 = c1 * (rstd * rstd / N)
        c2 = c2 * (rstd / N)
        # Pass 2: dx and the dweight/dbias terms of the own columns, SUB chunks of BLOCK_N one after
        # the other (each with its own accumulators) to bound the temporaries live at once.
        acc_dw, acc_db, acc_dw1, acc_db1 = _ln_bwd_pass2(
            X, W, W1, DY, DY1, DRES_OUT, ROWSCALE, DX, DX1, DRES_IN, r, r_ok, cols, M, N, mean, rstd, c1, c2,
            acc_dw, acc_db, acc_dw1, acc_db1, stride_x, stride_dy, stride_dy1, stride_dres_out, stride_dx,
            stride_dx1, stride_dres_in, seed0, seed1, drop_threshold, drop_scale, IS_RMS_NORM, HAS_BIAS, HAS_W1,
            HAS_B1, HAS_DRES_OUT, STORE_DRES_IN, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, ZERO_CENTERED, xc, g, dy, dy1,
            HOLD)
        if SUB == 2:
            bcc_dw, bcc_db, bcc_dw1, bcc_db1 = _ln_bwd_pass2(
                X, W, W1, DY, DY1, DRES_OUT, ROWSCALE, DX, DX1, DRES_IN, r, r_ok, cols + BLOCK_N, M, N, mean, rstd,
                c1, c2, bcc_dw, bcc_db, bcc_dw1, bcc_db1, stride_x, stride_dy, stride_dy1, stride_dres_out,
                stride_dx, stride_dx1, stride_dres_in, seed0, seed1, drop_threshold, drop_scale, IS_RMS_NORM,
                HAS_BIAS, HAS_W1, HAS_B1, HAS_DRES_OUT, STORE_DRES_IN, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT,
                ZERO_CENTERED, xc, g, dy, dy1, False)
    _ln_bwd_store_parts(DW_PART, DB_PART, DW1_PART, DB1_PART, group * N + cols, cols < N, acc_dw, acc_db, acc_dw1,
                        acc_db1, HAS_BIAS, HAS_W1, HAS_B1)
    if SUB == 2:
        _ln_bwd_store_parts(DW_PART, DB_PART, DW1_PART, DB1_PART, group * N + cols + BLOCK_N, cols + BLOCK_N < N,
                            bcc_dw, bcc_db, bcc_dw1, bcc_db1, HAS_BIAS, HAS_W1, HAS_B1)


@triton.jit
def _col_sum(PART, OUT, P, N, cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)[:, None]
        acc += tl.load(PART + p * N + cols[None, :], mask=(p < P) & (cols[None, :] < N), other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0), mask=cols < N)


@triton.jit
def _ln_bwd_reduce_kernel(DW_PART, DB_PART, DW1_PART, DB1_PART, DW, DB, DW1, DB1, P, N,
                          HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """dweight (and dbias, dweight1, dbias1) = the (P, N) fp32 partials summed over P, in a fixed order,
    stored in the parameters' dtypes."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    _col_sum(DW_PART, DW, P, N, cols, BLOCK_P, BLOCK_C)
    if HAS_BIAS:
        _col_sum(DB_PART, DB, P, N, cols, BLOCK_P, BLOCK_C)
    if HAS_W1:
        _col_sum(DW1_PART, DW1, P, N, cols, BLOCK_P, BLOCK_C)
        if HAS_B1:
            _col_sum(DB1_PART, DB1, P, N, cols, BLOCK_P, BLOCK_C)
