"""Triton forward kernel of the fused dropout + residual add + LayerNorm / RMSNorm (ops/triton/layer_norm.py
has the launch, the autograd Function and the public API), and the dropout hash of (seed, row, column) that
the backward kernel (layer_norm_bwd.py) shares to regenerate the forward's mask.

A program normalises a tile of BLOCK_M rows: it forms the pre-norm sum (rowscale, dropout, x1, residual)
in fp32, stores it as residual_out where asked, and writes y (and y1) with the row's mean and rstd; rows
wider than BLOCK_N go in NUM_CHUNKS chunks: one pass for the statistics, a second that recomputes the sum
from the inputs for y.
"""
from . import tl, triton


@triton.jit
def _hash32(h):
    h = ((h >> 16) ^ h) * 0x45D9F3B
    h = ((h >> 16) ^ h) * 0x45D9F3B
    return (h >> 16) ^ h


@triton.jit
def _row_hash(seed0, seed1, row):
    # flash_attn.dropout's row hash; the row index stays below 2**32, so its high word is zero.
    h = _hash32(tl.cast(row, tl.uint32) ^ tl.cast(seed0, tl.uint32))
    return _hash32(h ^ tl.cast(seed1, tl.uint32))


@triton.jit
def _keep(row_hash, cols, drop_threshold):
    return _hash32(row_hash ^ tl.cast(cols, tl.uint32)).to(tl.int64) >= drop_threshold


# Helpers take r: (BLOCK_M, 1) int64 row indices, r_ok = r < M, cols: (1, BLOCK_N), mask = r_ok & cols < N.
@triton.jit
def _ln_fwd_input(X, X1, RES, ROWSCALE, RES_OUT, DMASK, r, r_ok, M, N, cols, mask,
                  stride_x, stride_x1, stride_res, stride_res_out, hash0, hash1, drop_threshold, drop_scale,
                  HAS_RES: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
                  HAS_DROPOUT: tl.constexpr, STORE_DMASK: tl.constexpr, STORE_RES_OUT: tl.constexpr):
    x = tl.load(X + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROWSCALE:
        x *= tl.load(ROWSCALE + r, mask=r_ok, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _keep(hash0, cols, drop_threshold)
        x = tl.where(keep, x * drop_scale, 0.0)
        if STORE_DMASK:
            tl.store(DMASK + r * N + cols, keep, mask=mask)
    if HAS_X1:
        x1 = tl.load(X1 + r * stride_x1 + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep1 = _keep(hash1, cols, drop_threshold)
            x1 = tl.where(keep1, x1 * drop_scale, 0.0)
            if STORE_DMASK:
                tl.store(DMASK + (M + r) * N + cols, keep1, mask=mask)
        x += x1
    if HAS_RES:
        x += tl.load(RES + r * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_RES_OUT:
        tl.store(RES_OUT + r * stride_res_out + cols, x, mask=mask)
    return x


@triton.jit
def _ln_fwd_output(W, B, W1, B1, Y, Y1, r, cols, mask, N, xhat, stride_y, stride_y1,
                   HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr,
                   ZERO_CENTERED: tl.constexpr):
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w += 1.0
    y = xhat * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(Y + r * stride_y + cols, y, mask=mask)
    if HAS_W1:
        w1 = tl.load(W1 + cols, mask=col_ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w1 += 1.0
        y1 = xhat * w1
        if HAS_B1:
            y1 += tl.load(B1 + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(Y1 + r * stride_y1 + cols, y1, mask=mask)


# The dropout seeds change on every call: not specialised, so a new seed is no new kernel (Triton keys
# specialised ints on == 1 and % 16, the fast launcher on their values).
@triton.jit(do_not_specialize=["seed0", "seed1"])
def _ln_fwd_kernel(
    X, X1, RES, ROWSCALE, W, B, W1, B1, Y, Y1, RES_OUT, DMASK, MEAN, RSTD,
    stride_x, stride_x1, stride_res, stride_y, stride_y1, stride_res_out,
    M, N, eps, seed0, seed1, drop_threshold, drop_scale,
    IS_RMS_NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_DMASK: tl.constexpr, STORE_RES_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    r = rows[:, None]
    r_ok = row_ok[:, None]
    hash0 = seed0
    hash1 = seed1
    if HAS_DROPOUT:
        hash0 = _row_hash(seed0, seed1, r)
        if HAS_X1:
            hash1 = _row_hash(seed0, seed1, r + M)
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = r_ok & (cols < N)
        x = _ln_fwd_input(X, X1, RES, ROWSCALE, RES_OUT, DMASK, r, r_ok, M, N, cols, mask,
                          stride_x, stride_x1, stride_res, stride_res_out, hash0, hash1, drop_threshold,
                          drop_scale, HAS_RES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_DMASK, STORE_RES_OUT)
        if not IS_RMS_NORM:
            mean = tl.sum(x, axis=1) / N
            x = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        _ln_fwd_output(W, B, W1, B1, Y, Y1, r, cols, mask, N, x * rstd[:, None], stride_y, stride_y1,
                       HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED)
    else:
        # Chunk statistics merged with Chan et al.'s parallel update: a plain sum of squares would
        # cancel catastrophically for rows with a large mean.
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        count = 0.0
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            mask = r_ok & (cols < N)
            x = _ln_fwd_input(X, X1, RES, ROWSCALE, RES_OUT, DMASK, r, r_ok, M, N, cols, mask,
                              stride_x, stride_x1, stride_res, stride_res_out, hash0, hash1, drop_threshold,
                              drop_scale, HAS_RES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_DMASK,
                              STORE_RES_OUT)
            if IS_RMS_NORM:
                m2 += tl.sum(x * x, axis=1)
            else:
                n_c = tl.minimum(N - c * BLOCK_N, BLOCK_N).to(tl.float32)
                c_mean = tl.sum(x, axis=1) / n_c
                d = tl.where(mask, x - c_mean[:, None], 0.0)
                total = count + n_c
                delta = c_mean - mean
                mean += delta * (n_c / total)
                m2 += tl.sum(d * d, axis=1) + delta * delta * (count * n_c / total)
                count = total
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        # Second pass recomputes the fp32 sum from the inputs (L2-resident) rather than re-reading a
        # possibly low-precision residual_out, so chunked and one-piece rows give the same y.
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            mask = r_ok & (cols < N)
            x = _ln_fwd_input(X, X1, RES, ROWSCALE, RES_OUT, DMASK, r, r_ok, M, N, cols, mask,
                              stride_x, stride_x1, stride_res, stride_res_out, hash0, hash1, drop_threshold,
                              drop_scale, HAS_RES, HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, False, False)
            _ln_fwd_output(W, B, W1, B1, Y, Y1, r, cols, mask, N, (x - mean[:, None]) * rstd[:, None],
                           stride_y, stride_y1, HAS_BIAS, HAS_W1, HAS_B1, ZERO_CENTERED)
    tl.store(MEAN + rows, mean, mask=row_ok)  # zeros for RMSNorm (saves the host a fill launch)
    tl.store(RSTD + rows, rstd, mask=row_ok)
