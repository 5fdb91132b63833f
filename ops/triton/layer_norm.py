"""Fused dropout + residual add + LayerNorm / RMSNorm (Ba et al. 2016; Zhang & Sennrich 2019), forward
and backward, with an optional second input ``x1`` added before the norm and a second output branch
``weight1/bias1`` normalising the same sum (parallel attention/MLP blocks). API of FA2's
``flash_attn.ops.triton.layer_norm``.

Per row r of the (M, N) input, with s = 1 / (1 - dropout_p):

    pre  = dropout(x * rowscale[r]) + dropout(x1) + residual         (accumulated in fp32)
    xhat = (pre - mean) * rstd        (RMSNorm: mean = 0)
    y    = xhat * w + b,   y1 = xhat * w1 + b1   (w = 1 + weight if zero_centered_weight)

The dropout mask is a counter-based hash of (seed, row, column) (flash_attn.dropout, with rows M..2M-1
for x1), so the backward pass and the PyTorch path regenerate exactly the forward mask without storing it.
The backward pass reduces dweight/dbias in two steps: each program accumulates over its own block of rows
into a private row of a fp32 partial buffer, then a second kernel adds the partials in a fixed order, so no
two programs ever write the same address (no atomics, bitwise reproducible).
"""
import functools
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from flash_attn import settings
from flash_attn.dropout import hash32, new_rng_state, threshold

from . import Plan, cdiv, device_ctx, launcher, next_power_of_2, num_sms, tl, triton, use_triton
# Kernels and the PyTorch path live in their own modules; their names are bound here too, where callers, tests
# and benchmarks look them up. The launch code stays with its knobs below, which tests and benchmarks set on
# this module (and num_sms, use_triton, _HIP, the _L_* launchers).
from .layer_norm_bwd import (  # noqa: F401
    _col_sum, _ln_bwd_grads, _ln_bwd_kernel, _ln_bwd_load, _ln_bwd_pass2, _ln_bwd_reduce_kernel, _ln_bwd_stats,
    _ln_bwd_store, _ln_bwd_store_parts, _row_sums,
)
from .layer_norm_fwd import _hash32, _keep, _ln_fwd_input, _ln_fwd_kernel, _ln_fwd_output, _row_hash  # noqa: F401
from .layer_norm_torch import _keep_mask_torch, _ln_bwd_torch, _ln_fwd_torch, _weight_f32  # noqa: F401

# Launch shape. Forward (from a sweep on an H200, benchmarks/ops/bench_ops.py --sweep): a program works on a
# tile of BLOCK_M rows x BLOCK_N columns; rows wider than FWD_MAX_BLOCK_N go in chunks (two passes over
# each row, the second from L2); BLOCK_M = FWD_TILE // BLOCK_N batches narrow rows, one warp per
# FWD_ELEMS_PER_WARP tile elements.
# Backward (_bwd_config; register counts checked ahead of time for sm_90, see bench_ops.py --aot): a
# persistent grid sized by a register cap (BWD_MAXNREG, by how many costly features a call has), tiles
# of at least BWD_MIN_TILE elements at BWD_ELEMS_PER_THREAD elements per thread, pass-1 chunks of at most
# BWD_MAX_BLOCK_R columns, at most BWD_ACC_REGS accumulator registers per thread, and the next tile
# prefetched where a row fits one pass-1 chunk (BWD_PREFETCH). Tests lower the limits to exercise
# chunked, split and multi-row paths on small inputs.
FWD_MAX_BLOCK_N = 16384
FWD_TILE = 2048
FWD_ELEMS_PER_WARP = 1024
BWD_MIN_TILE = 1024
BWD_ELEMS_PER_THREAD = 8
BWD_MAX_BLOCK_R = 16384
BWD_ACC_REGS = 32
BWD_MAXNREG = (64, 80, 96, 128)
BWD_PREFETCH = True
# Row sums of LayerNorm's pass 1 (sum((x - mean) * g) and sum(g)) in one reduction of the two joined:
# one cross-warp exchange through shared memory (2 barriers, STS.64/LDS.64) instead of two in a row (4
# barriers, the second waiting on the first; SASS, sm_90).
BWD_PAIR_SUM = True
# Pass 2 reuses pass 1's xc, g, dy from registers instead of re-reading the tile from L1 (where prefetch
# holds a row in one pass-1 chunk, one program owns it whole): 20% fewer instructions in the row loop
# (RMSNorm 172 instead of 216, LayerNorm 232 instead of 282, sm_90) for 8-9 registers a thread. RMSNorm fits its 64
# register cap; LayerNorm's two accumulators push it to 72 (16 bytes of spill at 64), so it is on
# for n_acc <= BWD_HOLD_MAX_ACC only.
BWD_HOLD = True
BWD_HOLD_MAX_ACC = 1
# Measured exceptions to the rules above, for plain calls (bf16, no extra features): (n_acc, hidden) ->
# BwdConfig fields to replace (and "per_sm", programs per SM); benchmarks/ops/sweep_norm_bwd.py prints the
# candidates and their timings. n_acc: 1 RMSNorm, 2 LayerNorm (dweight and dbias).
# On an H200 they beat the rules' plan: LayerNorm 1024 428 us against 449, 8192 457 us against 482, the latter
# although it spills 16 bytes at 64 registers (benchmarks/results/h200/ops_norm_bwd_sweep.md).
BWD_TUNED = {(2, 1024): {"hold": True, "maxnreg": 72}, (2, 8192): {"hold": True}}
MAX_HIDDEN = 65536
# ROCm builds of torch: warps of 64 lanes (a workgroup holds at most 16), and no register cap (Triton's AMD backend
# has no maxnreg option: a launch with it raises). The rules below still count NVIDIA's 32-lane warps and 64K
# registers an SM, so on AMD they size tiles and grids conservatively; untimed there (no AMD GPU here), compiled
# for gfx942 / gfx90a in CI (benchmarks/tools/triton_rocm_compile.py).
_HIP = getattr(torch.version, "hip", None) is not None


# --------------------------------------------------------------------------------------------- launchers
# The launch configurations are cached per call shape; the module's knobs are part of each cache key, so
# changing them (tests, benchmarks/ops/bench_ops.py --sweep) takes effect on the next call.
def _fwd_config(N: int):
    """(BLOCK_M, BLOCK_N, chunks, warps) of the forward."""
    return _fwd_config_cached(N, FWD_MAX_BLOCK_N, FWD_TILE, FWD_ELEMS_PER_WARP)


@functools.lru_cache(maxsize=1024)
def _fwd_config_cached(N, max_block_n, tile, elems_per_warp):
    block_n = min(next_power_of_2(N), max_block_n)
    block_m = max(1, tile // block_n)
    num_warps = max(1, min(16, block_m * block_n // elems_per_warp))
    return block_m, block_n, cdiv(N, block_n), num_warps


class BwdConfig(NamedTuple):
    programs: int  # grid size: row groups x split
    rows_per_program: int
    block_m: int  # rows per tile
    block_r: int  # pass-1 columns per chunk (the row sums)
    r_chunks: int  # pass-1 chunks per row
    block_n: int  # pass-2 columns per sub-chunk (dx, dweight)
    sub: int  # pass-2 sub-chunks per program
    split: int  # programs sharing each row group
    prefetch: bool
    num_warps: int
    maxnreg: int
    pair: bool = False  # one joined reduction for LayerNorm's two row sums
    hold: bool = False  # pass 2 from pass 1's registers (needs prefetch, split == sub == 1)


def _bwd_config(M: int, N: int, device, n_acc: int = 2, extra: int = 0) -> BwdConfig:
    """Launch shape of the backward for M rows of N columns, n_acc parameter gradients accumulated (dweight,
    dbias, dweight1, dbias1) and ``extra`` costly features (see _bwd_extra).

    A register cap (maxnreg, from BWD_MAXNREG by extra; multi-row tiles count as one more) fixes how many
    programs fit on an SM; the grid has at most that many per SM (persistent), so every program is
    resident from the start and no partial wave trails. Tiles hold BWD_ELEMS_PER_THREAD elements per
    thread and tensor, up to twice that where the warps the cap allows do not cover a row; wider rows go
    in pass-1 chunks. The own columns of a program are cut (split over programs, then into two
    sub-chunks) until its accumulators take at most BWD_ACC_REGS registers per thread (half that with
    costly features or pass-1 chunks)."""
    tuned = BWD_TUNED.get((n_acc, N)) if extra == 0 else None
    return _bwd_config_cached(M, N, num_sms(device), n_acc, extra, BWD_MIN_TILE, BWD_ELEMS_PER_THREAD,
                              BWD_MAX_BLOCK_R, BWD_ACC_REGS, BWD_MAXNREG, BWD_PREFETCH, BWD_PAIR_SUM,
                              BWD_HOLD and n_acc <= BWD_HOLD_MAX_ACC, tuple(sorted(tuned.items())) if tuned else (),
                              16 if _HIP else 32)


@functools.lru_cache(maxsize=4096)
def _bwd_config_cached(M, N, sms, n_acc, extra, min_tile, elems_per_thread, max_block_r, max_acc_regs, maxnregs,
                       prefetch_ok, pair, hold_ok, tuned=(), warps_cap=32) -> BwdConfig:
    width = next_power_of_2(N)
    block_m = max(1, min_tile // width)
    maxnreg = maxnregs[min(len(maxnregs) - 1, extra + int(block_m > 1))]
    max_warps = min(warps_cap, 1 << ((65536 // (maxnreg * 32)).bit_length() - 1))
    block_r = min(width, max_block_r, 2 * elems_per_thread * 32 * max_warps)
    num_warps = max(1, min(max_warps, block_m * block_r // (32 * elems_per_thread)))
    threads = 32 * num_warps
    own = width
    # Costly features and pass-1 chunk loops leave fewer registers to the accumulators.
    acc_regs = max_acc_regs if extra == 0 and block_r >= N else max_acc_regs // 2
    limit = acc_regs * threads
    # At 32 warps (64 registers a thread) a whole row held for pass 1 plus accumulators filling the limit
    # spill (LayerNorm at 16384: 96 bytes, 0.45 of copy bandwidth; split in two: 0.54, H200).
    tight = num_warps == 32 and block_r >= N
    while own > 1 and (n_acc * block_m * own > limit or tight and n_acc * block_m * own >= limit):
        own //= 2
    sub = 2 if own > 1 and block_m * own >= 2 * elems_per_thread * threads else 1
    split = cdiv(N, own)
    prefetch = prefetch_ok and block_r >= N and block_m * block_r <= elems_per_thread * threads
    block_n = own // sub
    hold = hold_ok and prefetch and split == 1 and sub == 1
    per_sm = None
    if tuned:
        f = dict(tuned)
        per_sm = f.pop("per_sm", None)
        f = dict(dict(block_m=block_m, block_r=block_r, block_n=block_n, sub=sub, prefetch=prefetch,
                      num_warps=num_warps, maxnreg=maxnreg, pair=pair, hold=hold), **f)
        block_m, block_r, block_n, sub = f["block_m"], f["block_r"], f["block_n"], f["sub"]
        num_warps, maxnreg, pair = f["num_warps"], f["maxnreg"], f["pair"]
        threads = 32 * num_warps
        if maxnreg * threads > 65536:
            raise ValueError(f"BWD_TUNED[{n_acc}, {N}]: {num_warps} warps of {maxnreg} registers exceed an SM")
        split = cdiv(N, block_n * sub)
        prefetch = f["prefetch"] and block_r >= N
        hold = f["hold"] and prefetch and split == 1 and sub == 1
    per_sm = max(1, min(per_sm or 32, 65536 // (maxnreg * threads), 64 // num_warps, 32))
    tiles = cdiv(M, block_m)
    groups = max(1, min(tiles, sms * per_sm // split))
    rows = cdiv(tiles, groups) * block_m
    groups = cdiv(M, rows) if M else 1
    return BwdConfig(groups * split, rows, block_m, block_r, cdiv(N, block_r), block_n, sub, split, prefetch,
                     num_warps, maxnreg, pair, hold)


def _bwd_extra(x: Tensor, dy: Tensor, dy1, dresidual_out, dresidual_in, dx1, rowscale, dropout_p: float) -> int:
    """How much a backward call carries beyond the plain norm (each adds registers): 32-bit x or dy, the
    residual gradients, the parallel branch (counted twice), x1's gradient, rowscale, dropout."""
    return (int(x.element_size() > 2) + int(dy.element_size() > 2) + int(dresidual_out is not None
            or dresidual_in is not None) + 2 * int(dy1 is not None) + int(dx1 is not None)
            + int(rowscale is not None) + int(dropout_p > 0.0))


def _reduce_config(P: int, N: int, device):
    """(BLOCK_P, BLOCK_C, warps) of the partial-sum reduction: column blocks narrow enough for about one
    program per SM, tiles of 8192 elements."""
    return _reduce_config_cached(P, N, num_sms(device))


@functools.lru_cache(maxsize=4096)
def _reduce_config_cached(P, N, sms):
    block_c = max(8, min(128, next_power_of_2(cdiv(N, sms))))
    block_p = max(1, min(next_power_of_2(P), 8192 // block_c))
    return block_p, block_c, max(1, min(8, block_p * block_c // 1024))


def _drop_args(rng_state: Optional[Tensor], dropout_p: float):
    if rng_state is None or dropout_p == 0.0:
        return 0, 0, 0, 1.0
    seed0, seed1 = (int(s) for s in rng_state.tolist())
    return seed0, seed1, threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _stride0(t: Optional[Tensor]) -> int:
    return t.stride(0) if t is not None else 0


# One launcher per kernel (the Launcher is disabled, i.e. Triton's own path, under the interpreter).
_L_FWD = launcher(_ln_fwd_kernel)
_L_BWD = launcher(_ln_bwd_kernel)
_L_REDUCE = launcher(_ln_bwd_reduce_kernel)


@functools.lru_cache(maxsize=1024)
def _fwd_plan(is_rms_norm, has_res, has_x1, has_rowscale, has_dropout, store_dmask, store_res_out, has_bias,
              has_w1, has_b1, zero_centered, block_m, block_n, chunks, num_warps):
    """(plan key, constexpr and launch keywords) of a forward launch; the arguments determine both."""
    meta = dict(IS_RMS_NORM=is_rms_norm, HAS_RES=has_res, HAS_X1=has_x1, HAS_ROWSCALE=has_rowscale,
                HAS_DROPOUT=has_dropout, STORE_DMASK=store_dmask, STORE_RES_OUT=store_res_out, HAS_BIAS=has_bias,
                HAS_W1=has_w1, HAS_B1=has_b1, ZERO_CENTERED=zero_centered, BLOCK_M=block_m, BLOCK_N=block_n,
                NUM_CHUNKS=chunks, num_warps=num_warps)
    return Plan(("ln_fwd", *meta.items())), meta


@functools.lru_cache(maxsize=1024)
def _bwd_plan(is_rms_norm, has_bias, has_w1, has_b1, has_dres_out, store_dres_in, has_x1, has_rowscale,
              has_dropout, zero_centered, block_m, block_r, r_chunks, block_n, sub, split, prefetch, num_warps,
              maxnreg, pair, hold):
    """(plan key, constexpr and launch keywords) of a backward launch (the tile fields of a BwdConfig; its
    grid size and rows per program are runtime values, so a new row count keeps the plan)."""
    meta = dict(IS_RMS_NORM=is_rms_norm, HAS_BIAS=has_bias, HAS_W1=has_w1, HAS_B1=has_b1,
                HAS_DRES_OUT=has_dres_out, STORE_DRES_IN=store_dres_in, HAS_X1=has_x1, HAS_ROWSCALE=has_rowscale,
                HAS_DROPOUT=has_dropout, ZERO_CENTERED=zero_centered, BLOCK_M=block_m, BLOCK_R=block_r,
                R_CHUNKS=r_chunks, BLOCK_N=block_n, SUB=sub, SPLIT=split, PREFETCH=prefetch,
                PAIR=pair, HOLD=hold, num_warps=num_warps, **({} if _HIP else dict(maxnreg=maxnreg)))
    return Plan(("ln_bwd", *meta.items())), meta


@functools.lru_cache(maxsize=1024)
def _reduce_plan(has_bias, has_w1, has_b1, block_p, block_c, num_warps):
    meta = dict(HAS_BIAS=has_bias, HAS_W1=has_w1, HAS_B1=has_b1, BLOCK_P=block_p, BLOCK_C=block_c,
                num_warps=num_warps)
    return Plan(("ln_bwd_reduce", *meta.items())), meta


def _ln_fwd_launch(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], x1: Optional[Tensor],
    weight1: Optional[Tensor], bias1: Optional[Tensor], rowscale: Optional[Tensor], rng_state: Optional[Tensor],
    y: Tensor, y1: Optional[Tensor], residual_out: Optional[Tensor], dropout_mask: Optional[Tensor],
    mean: Tensor, rstd: Tensor, eps: float, dropout_p: float, is_rms_norm: bool, zero_centered_weight: bool,
) -> None:
    M, N = x.shape
    if M == 0:
        return
    seed0, seed1, drop_threshold, drop_scale = _drop_args(rng_state, dropout_p)
    block_m, block_n, chunks, num_warps = _fwd_config(N)
    plan, meta = _fwd_plan(
        is_rms_norm, residual is not None, x1 is not None, rowscale is not None, dropout_p > 0.0,
        dropout_mask is not None, residual_out is not None, bias is not None, weight1 is not None,
        bias1 is not None, zero_centered_weight, block_m, block_n, chunks, num_warps)
    with device_ctx(x):
        _L_FWD((cdiv(M, block_m),), (
            x, x1, residual, rowscale, weight, bias, weight1, bias1, y, y1, residual_out, dropout_mask,
            mean, rstd,
            x.stride(0), _stride0(x1), _stride0(residual), y.stride(0), _stride0(y1), _stride0(residual_out),
            M, N, eps, seed0, seed1, drop_threshold, drop_scale,
        ), meta, plan)


_ln_fwd_op = torch.library.custom_op(
    "flash_attn_ops::layer_norm_fwd", mutates_args=("y", "y1", "residual_out", "dropout_mask", "mean", "rstd"),
)(_ln_fwd_launch)


@_ln_fwd_op.register_fake
def _(*args):
    return None


def _ln_bwd_launch(
    x: Tensor, weight: Tensor, weight1: Optional[Tensor], dy: Tensor, dy1: Optional[Tensor],
    dresidual_out: Optional[Tensor], rowscale: Optional[Tensor], rng_state: Optional[Tensor], mean: Tensor,
    rstd: Tensor, dx: Tensor, dx1: Optional[Tensor], dresidual_in: Optional[Tensor], dw: Tensor,
    db: Optional[Tensor], dw1: Optional[Tensor], db1: Optional[Tensor], dropout_p: float,
    is_rms_norm: bool, zero_centered_weight: bool,
) -> None:
    M, N = x.shape
    if M == 0:
        for t in (dw, db, dw1, db1):
            if t is not None:
                t.zero_()
        return
    seed0, seed1, drop_threshold, drop_scale = _drop_args(rng_state, dropout_p)
    has_bias, has_w1, has_b1 = db is not None, dw1 is not None, db1 is not None
    n_acc = 1 + has_bias + has_w1 + has_b1
    dev = x.device
    cfg = _bwd_config(M, N, dev, n_acc,
                      _bwd_extra(x, dy, dy1, dresidual_out, dresidual_in, dx1, rowscale, dropout_p))
    # Every program writes its whole row of columns (the split programs of a group their own parts), so
    # the partial buffers need no zeroing; one allocation holds all of them.
    P = cfg.programs // cfg.split
    parts = iter(torch.empty((n_acc, P, N), device=dev, dtype=torch.float32).unbind(0))
    dw_part = next(parts)
    db_part = next(parts) if has_bias else None
    dw1_part = next(parts) if has_w1 else None
    db1_part = next(parts) if has_b1 else None
    plan, meta = _bwd_plan(is_rms_norm, has_bias, has_w1, has_b1, dresidual_out is not None,
                           dresidual_in is not None, dx1 is not None, rowscale is not None, dropout_p > 0.0,
                           zero_centered_weight, *cfg[2:])
    block_p, block_c, warps = _reduce_config(P, N, dev)
    rplan, rmeta = _reduce_plan(has_bias, has_w1, has_b1, block_p, block_c, warps)
    with device_ctx(x):
        _L_BWD((cfg.programs,), (
            x, weight, weight1, dy, dy1, dresidual_out, rowscale, mean, rstd, dx, dx1, dresidual_in,
            dw_part, db_part, dw1_part, db1_part,
            x.stride(0), dy.stride(0), _stride0(dy1), _stride0(dresidual_out), dx.stride(0), _stride0(dx1),
            _stride0(dresidual_in),
            M, N, cfg.rows_per_program, seed0, seed1, drop_threshold, drop_scale,
        ), meta, plan)
        _L_REDUCE((cdiv(N, block_c),), (dw_part, db_part, dw1_part, db1_part, dw, db, dw1, db1, P, N), rmeta, rplan)


_ln_bwd_op = torch.library.custom_op(
    "flash_attn_ops::layer_norm_bwd",
    mutates_args=("dx", "dx1", "dresidual_in", "dw", "db", "dw1", "db1"),
)(_ln_bwd_launch)


@_ln_bwd_op.register_fake
def _(*args):
    return None


# ------------------------------------------------------------------------------------ forward/backward
def _layer_norm_fwd(x, weight, bias, eps, residual=None, x1=None, weight1=None, bias1=None, dropout_p=0.0,
                    rowscale=None, out_dtype=None, residual_dtype=None, is_rms_norm=False,
                    zero_centered_weight=False, return_dropout_mask=False, out=None, residual_out=None):
    """x, residual, x1: (M, N); weight, bias, weight1, bias1: (N,); rowscale: (M,). Returns
    (y, y1, mean, rstd, residual_out, rng_state, dropout_mask, dropout_mask1); residual_out is x itself
    when nothing had to be added or cast."""
    M, N = x.shape
    if residual is not None:
        residual_dtype = residual.dtype
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=out_dtype if out_dtype is not None else x.dtype)
    y1 = torch.empty_like(out) if weight1 is not None else None
    need_residual_out = (residual is not None or dropout_p > 0.0 or rowscale is not None or x1 is not None
                         or (residual_dtype is not None and residual_dtype != x.dtype))
    if residual_out is None and need_residual_out:
        residual_out = torch.empty((M, N), device=x.device,
                                   dtype=residual_dtype if residual_dtype is not None else x.dtype)
    mean = torch.empty((M,), device=x.device, dtype=torch.float32)
    rstd = torch.empty((M,), device=x.device, dtype=torch.float32)
    rng_state = new_rng_state() if dropout_p > 0.0 else None
    dropout_mask = None
    if return_dropout_mask and dropout_p > 0.0:
        dropout_mask = torch.empty((2 * M if x1 is not None else M, N), device=x.device, dtype=torch.bool)
    args = (x, weight, bias, residual, x1, weight1, bias1, rowscale, rng_state, out, y1, residual_out,
            dropout_mask, mean, rstd, float(eps), float(dropout_p), bool(is_rms_norm),
            bool(zero_centered_weight))
    if use_triton(x):
        # The custom op is what torch.compile traces; eager calls skip its dispatcher overhead.
        (_ln_fwd_op if torch.compiler.is_compiling() else _ln_fwd_launch)(*args)
    else:
        _ln_fwd_torch(*args)
    dropout_mask1 = None
    if dropout_mask is not None and x1 is not None:
        dropout_mask, dropout_mask1 = dropout_mask[:M], dropout_mask[M:]
    return (out, y1, mean, rstd, residual_out if residual_out is not None else x, rng_state, dropout_mask,
            dropout_mask1)


def _layer_norm_bwd(dy, x, weight, bias, mean, rstd, dresidual_out=None, dy1=None, weight1=None, bias1=None,
                    rng_state=None, dropout_p=0.0, rowscale=None, has_residual=False, has_x1=False,
                    is_rms_norm=False, zero_centered_weight=False, x_dtype=None, residual_dtype=None,
                    x1_dtype=None):
    """Gradients (dx, dweight, dbias, dresidual, dx1, dweight1, dbias1) of :func:`_layer_norm_fwd`; x is
    the pre-norm sum it returned as residual_out."""
    M, N = x.shape
    dev = x.device
    dx = torch.empty((M, N), device=dev, dtype=x_dtype if x_dtype is not None else x.dtype)
    dx1 = torch.empty((M, N), device=dev, dtype=x1_dtype if x1_dtype is not None else dx.dtype) if has_x1 else None
    dres_in = None
    if has_residual:
        dres_in = torch.empty((M, N), device=dev, dtype=residual_dtype if residual_dtype is not None else x.dtype)
    dw = torch.empty_like(weight)
    db = torch.empty_like(bias) if bias is not None else None
    dw1 = torch.empty_like(weight1) if weight1 is not None else None
    db1 = torch.empty_like(bias1) if bias1 is not None else None
    args = (x, weight, weight1, dy, dy1, dresidual_out, rowscale, rng_state, mean, rstd, dx, dx1, dres_in,
            dw, db, dw1, db1, float(dropout_p), bool(is_rms_norm), bool(zero_centered_weight))
    if use_triton(x):
        if torch.compiler.is_compiling():
            _ln_bwd_op(*args)
        elif not _ln_bwd_cute(*args):
            _ln_bwd_launch(*args)
    else:
        _ln_bwd_torch(*args)
    return dx, dw, db, dres_in, dx1, dw1, db1


def cute_bwd_enabled() -> bool:
    """The CuTeDSL norm backward serves the calls it can (default on); FLASH_ATTN_DISABLE=ln_cute_bwd turns it off."""
    return not settings.disabled("ln_cute_bwd")


def _ln_bwd_cute(x, weight, weight1, dy, dy1, dresidual_out, rowscale, rng_state, mean, rstd, dx, dx1,
                 dresidual_in, dw, db, dw1, db1, dropout_p, is_rms_norm, zero_centered_weight) -> bool:
    """The CuTeDSL backward for wide rows (flash_attn.cute.norm_bwd, in the flash-attn-4 distribution) when it is
    installed and serves the call (the default; FLASH_ATTN_DISABLE=ln_cute_bwd turns it off); False (nothing done)
    otherwise, and the Triton path runs."""
    if x.shape[1] < 4096 or not x.is_cuda or not cute_bwd_enabled():  # norm_bwd.MIN_N: narrower rows never import it
        return False
    from flash_attn import dispatch

    cute = dispatch.load("cute")  # None where flash-attn-4 is not installed or cannot run here
    if cute is None:
        return False
    cute_bwd = cute.norm_backward()

    key = cute_bwd.plan(x, weight, weight1, dy, dy1, dresidual_out, rowscale, dropout_p, mean, rstd, dx, dx1,
                        dresidual_in, db, is_rms_norm, zero_centered_weight)
    if key is None or (x.shape[0] > 0 and cute_bwd.kernel(key) is None):
        return False
    M, N = x.shape
    if M == 0:
        for t in (dw, db):
            if t is not None:
                t.zero_()
        return True
    P = cute_bwd.grid(key, M, num_sms(x.device))
    parts = iter(torch.empty((1 + (db is not None), P, N), device=x.device, dtype=torch.float32).unbind(0))
    dw_part = next(parts)
    db_part = next(parts) if db is not None else None
    block_p, block_c, warps = _reduce_config(P, N, x.device)
    rplan, rmeta = _reduce_plan(db is not None, False, False, block_p, block_c, warps)
    with device_ctx(x):
        cute_bwd.launch(key, x, weight, dy, dresidual_out, mean, rstd, dx, dresidual_in, dw_part, db_part)
        _L_REDUCE((cdiv(N, block_c),), (dw_part, db_part, None, None, dw, db, None, None, P, N), rmeta, rplan)
    return True


def _rows(t: Optional[Tensor], N: int) -> Optional[Tensor]:
    if t is None:
        return None
    t = t.reshape(-1, N)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_args(x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, out, residual_out):
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {type(x).__name__}"
                        f"{'' if not isinstance(x, Tensor) else ' of dtype ' + str(x.dtype)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., hidden)")
    N = x.shape[-1]
    if N > MAX_HIDDEN:
        raise ValueError(f"hidden size (x.shape[-1]) must be at most {MAX_HIDDEN}, got {N}")
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a tensor of shape ({N},), got {type(weight).__name__}")
    for name, t in (("weight", weight), ("bias", bias), ("weight1", weight1), ("bias1", bias1)):
        if t is not None and tuple(t.shape) != (N,):
            raise ValueError(f"{name} must have shape ({N},) (the hidden size of x), got {tuple(t.shape)}")
    for name, t in (("residual", residual), ("x1", x1), ("out", out), ("residual_out", residual_out)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    for name, t in (("residual", residual), ("x1", x1)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    if bias1 is not None and weight1 is None:
        raise ValueError("bias1 needs weight1 (the second output branch)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if rowscale is not None:
        if x1 is not None:
            raise NotImplementedError("rowscale is not supported together with x1 (parallel branch input)")
        if rowscale.numel() != x.numel() // max(N, 1):
            raise ValueError(f"rowscale must have one entry per row ({x.numel() // max(N, 1)}), "
                             f"got shape {tuple(rowscale.shape)}")


class LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6,
                dropout_p=0.0, rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                is_rms_norm=False, return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
        _check_args(x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, out, residual_out)
        shape = x.shape
        N = shape[-1]
        x2, residual2, x12 = _rows(x, N), _rows(residual, N), _rows(x1, N)
        out2, residual_out2 = _rows(out, N), _rows(residual_out, N)
        for name, t, t2 in (("out", out, out2), ("residual_out", residual_out, residual_out2)):
            if t is not None and t2.data_ptr() != t.data_ptr():
                raise ValueError(f"{name} must be viewable as (rows, hidden) with unit stride on the last dim")
        if out is not None and out_dtype is None:
            out_dtype = out.dtype
        elif out is not None and out.dtype != out_dtype:
            raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        weight_c = weight.contiguous()
        bias_c = bias.contiguous() if bias is not None else None
        weight1_c = weight1.contiguous() if weight1 is not None else None
        bias1_c = bias1.contiguous() if bias1 is not None else None
        rowscale_c = rowscale.reshape(-1).contiguous() if rowscale is not None else None
        residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else None)
        y, y1, mean, rstd, res_out, rng_state, mask, mask1 = _layer_norm_fwd(
            x2, weight_c, bias_c, eps, residual2, x12, weight1_c, bias1_c, dropout_p, rowscale_c, out_dtype,
            residual_dtype, is_rms_norm, zero_centered_weight, return_dropout_mask, out2, residual_out2)
        ctx.save_for_backward(res_out, weight_c, bias_c, weight1_c, bias1_c, rowscale_c, rng_state, mean, rstd)
        ctx.shape = shape
        ctx.eps = eps
        ctx.dropout_p = dropout_p
        ctx.is_rms_norm = is_rms_norm
        ctx.zero_centered_weight = zero_centered_weight
        ctx.has_residual = residual is not None
        ctx.has_x1 = x1 is not None
        ctx.prenorm = prenorm
        ctx.x_dtype = x.dtype
        ctx.x1_dtype = x1.dtype if x1 is not None else None
        ctx.residual_dtype = residual.dtype if residual is not None else None
        outs = [y.reshape(shape)]
        if weight1 is not None:
            outs.append(y1.reshape(shape))
        if prenorm:
            outs.append(res_out.reshape(shape))
        if return_dropout_mask:
            masks = [m.reshape(shape) if m is not None else None for m in (mask, mask1)]
            ctx.mark_non_differentiable(*[m for m in masks if m is not None])
            outs.extend(masks)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, dy, *args):
        x, weight, bias, weight1, bias1, rowscale, rng_state, mean, rstd = ctx.saved_tensors
        N = x.shape[-1]
        dy = _rows(dy, N)
        dy1 = None
        if weight1 is not None:
            dy1, args = _rows(args[0], N), args[1:]
        dres_out = _rows(args[0], N) if ctx.prenorm else None
        dx, dw, db, dres_in, dx1, dw1, db1 = _layer_norm_bwd(
            dy, x, weight, bias, mean, rstd, dres_out, dy1, weight1, bias1, rng_state, ctx.dropout_p, rowscale,
            ctx.has_residual, ctx.has_x1, ctx.is_rms_norm, ctx.zero_centered_weight, ctx.x_dtype,
            ctx.residual_dtype, ctx.x1_dtype)
        shape = ctx.shape
        return (dx.reshape(shape), dw, db, dres_in.reshape(shape) if dres_in is not None else None,
                dx1.reshape(shape) if dx1 is not None else None, dw1, db1,
                *([None] * 11))


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                  is_rms_norm=False, return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    """Fused ``norm(dropout(x * rowscale) + dropout(x1) + residual)``.

    x, residual, x1: (..., N), N <= 65536; weight, bias, weight1, bias1: (N,); rowscale: (...,) one scale
    per row. residual_in_fp32 keeps the returned pre-norm sum in fp32 when no residual is given (else it
    has residual's dtype). zero_centered_weight scales by (1 + weight). out / residual_out: preallocated
    outputs. Returns y, then y1 if weight1 is given, then the pre-norm sum if prenorm, then the two bool
    dropout masks (x's and x1's, None where absent) if return_dropout_mask.
    """
    return LayerNormFn.apply(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                             residual_in_fp32, zero_centered_weight, is_rms_norm, return_dropout_mask, out_dtype,
                             out, residual_out)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    """:func:`layer_norm_fn` with RMSNorm (no mean subtraction)."""
    return LayerNormFn.apply(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                             residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype, out,
                             residual_out)


class LayerNormLinearFn(torch.autograd.Function):
    """norm(x + residual) then a linear layer (FA2's layer_norm_linear_fn): the normalised rows are not kept for the
    backward, which recomputes them from the pre-norm sum it keeps (one (M, N) tensor fewer alive per layer)."""

    @staticmethod
    def forward(ctx, x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm, residual_in_fp32,
                is_rms_norm):
        y, pre = layer_norm_fn(x, norm_weight, norm_bias, residual=residual, eps=eps, prenorm=True,
                               residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else y.dtype
        weight = linear_weight.to(dtype)
        bias = linear_bias.to(dtype) if linear_bias is not None else None
        with torch.autocast(device_type, enabled=False):
            out = F.linear(y.to(dtype), weight, bias)
        ctx.save_for_backward(pre, norm_weight, norm_bias, weight)
        ctx.args = (eps, is_rms_norm, prenorm, y.dtype, x.dtype, None if residual is None else residual.dtype,
                    linear_bias is not None, linear_weight.dtype)
        return (out, pre) if prenorm else out

    @staticmethod
    def backward(ctx, dout, *rest):
        pre, norm_weight, norm_bias, weight = ctx.saved_tensors
        eps, is_rms_norm, prenorm, y_dtype, x_dtype, res_dtype, has_bias, w_dtype = ctx.args
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() if t is not None else None for t in (pre, norm_weight, norm_bias)]
            y = layer_norm_fn(leaves[0], leaves[1], leaves[2], eps=eps, is_rms_norm=is_rms_norm, out_dtype=y_dtype)
        d2 = dout.reshape(-1, dout.shape[-1]).to(weight.dtype)
        dy = (d2 @ weight).reshape(y.shape).to(y.dtype)
        dlinear_weight = (d2.t() @ y.detach().reshape(-1, y.shape[-1]).to(weight.dtype)).to(w_dtype)
        dlinear_bias = d2.sum(0).to(w_dtype) if has_bias else None
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dy)
        dpre, dnorm_weight = grads[0], grads[1]
        dnorm_bias = grads[2] if norm_bias is not None else None
        if prenorm and rest and rest[0] is not None:
            dpre = dpre + rest[0].to(dpre.dtype)
        dres = dpre.to(res_dtype) if res_dtype is not None else None
        return dpre.to(x_dtype), dnorm_weight, dnorm_bias, dlinear_weight, dlinear_bias, dres, None, None, None, None


def layer_norm_linear_fn(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-6,
                         prenorm=False, residual_in_fp32=False, is_rms_norm=False):
    """``F.linear(norm(x + residual), linear_weight, linear_bias)`` (FA2's function; under autocast the linear layer
    runs in the autocast dtype), recomputing the normalised rows in the backward instead of keeping them. Returns the
    output, and the pre-norm sum too if prenorm."""
    return LayerNormLinearFn.apply(x, norm_weight, norm_bias, linear_weight, linear_bias, residual, eps, prenorm,
                                   residual_in_fp32, is_rms_norm)


# ------------------------------------------------------------------------------------------ references
def layer_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                   rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None,
                   dropout_mask1=None, upcast=False, is_rms_norm=False):
    """Unfused composition of standard PyTorch ops with the semantics of :func:`layer_norm_fn`; dropout
    takes the given boolean masks (or ``F.dropout``). upcast computes in fp32."""
    dtype = x.dtype
    if upcast:
        x, residual, x1 = (t.float() if t is not None else None for t in (x, residual, x1))
        weight, bias, weight1, bias1 = (t.float() if t is not None else None for t in (weight, bias, weight1, bias1))
    if zero_centered_weight:
        weight = weight + 1.0
        weight1 = weight1 + 1.0 if weight1 is not None else None
    if rowscale is not None:
        x = x * rowscale[..., None]
    if dropout_p > 0.0:
        x = (x.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_p) if dropout_mask is not None
             else F.dropout(x, p=dropout_p))
        if x1 is not None:
            x1 = (x1.masked_fill(~dropout_mask1, 0.0) / (1.0 - dropout_p) if dropout_mask1 is not None
                  else F.dropout(x1, p=dropout_p))
    if x1 is not None:
        x = x + x1
    if residual is not None:
        x = (x + residual).to(x.dtype)

    def norm(w, b):
        if is_rms_norm:
            xf = x.to(w.dtype)
            o = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps) * w
            return (o + b if b is not None else o).to(dtype)
        return F.layer_norm(x.to(w.dtype), x.shape[-1:], weight=w, bias=b, eps=eps).to(dtype)

    outs = [norm(weight, bias)]
    if weight1 is not None:
        outs.append(norm(weight1, bias1))
    if prenorm:
        outs.append(x)
    return outs[0] if len(outs) == 1 else tuple(outs)


def rms_norm_ref(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                 rowscale=None, prenorm=False, zero_centered_weight=False, dropout_mask=None, dropout_mask1=None,
                 upcast=False):
    """:func:`layer_norm_ref` for RMSNorm."""
    return layer_norm_ref(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                          zero_centered_weight, dropout_mask, dropout_mask1, upcast, is_rms_norm=True)


# --------------------------------------------------------------------------------------------- modules
class LayerNorm(torch.nn.Module):
    """LayerNorm over the last dim (hidden_size) with optional fused residual add and dropout of x."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None,
                 dtype=None):
        super().__init__()
        self.eps = eps
        self.dropout_p = dropout_p
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        (torch.nn.init.zeros_ if self.zero_centered_weight else torch.nn.init.ones_)(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        """x, residual: (..., hidden_size). Returns y, or (y, pre-norm sum) if prenorm."""
        return layer_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                             dropout_p=self.dropout_p if self.training else 0.0, prenorm=prenorm,
                             residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered_weight)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim (hidden_size) with optional fused residual add and dropout of x."""

    def __init__(self, hidden_size, eps=1e-5, dropout_p=0.0, zero_centered_weight=False, device=None,
                 dtype=None):
        super().__init__()
        self.eps = eps
        self.dropout_p = dropout_p
        self.zero_centered_weight = zero_centered_weight
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        (torch.nn.init.zeros_ if self.zero_centered_weight else torch.nn.init.ones_)(self.weight)

    def forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        """x, residual: (..., hidden_size). Returns y, or (y, pre-norm sum) if prenorm."""
        return rms_norm_fn(x, self.weight, self.bias, residual=residual, eps=self.eps,
                           dropout_p=self.dropout_p if self.training else 0.0, prenorm=prenorm,
                           residual_in_fp32=residual_in_fp32, zero_centered_weight=self.zero_centered_weight)
