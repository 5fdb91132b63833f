"""Triton kernels for fused bias + activation and gated activations (GLU variants, Shazeer 2020,
"GLU Variants Improve Transformer"), forward and backward. The public API is flash_attn.ops.activations.

Activations, on pre = x + bias in fp32:
    gelu_tanh  x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)   (= 0.5 x (1 + tanh u), no cancellation)
    gelu       x * Phi(x), Phi the normal CDF (erf form)
    relu, sqrelu (relu(x)^2), silu (x * sigmoid x), sigmoid
Gated: out = value * act(gate). The backward kernels also reduce the bias gradient: each program sums
its own rows into a private row of a fp32 partial buffer, added up afterwards (no atomics).
"""
import functools
from typing import Optional

from torch import Tensor

from flash_attn import settings

from . import cdiv, device_ctx, launcher, next_power_of_2, num_sms, plan, tl, triton

ACT_IDS = {"gelu_tanh": 0, "gelu": 1, "relu": 2, "sqrelu": 3, "silu": 4, "sigmoid": 5}

_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327

# Tiles: BLOCK_N = min(next_power_of_2(N), *_BLOCK_N) columns by *_TILE / BLOCK_N rows, *_WARPS warps.
# FLASH_ATTN_OVERRIDES="act.BWD_TILE=8192,act.BWD_WARPS=8" overrides them (benchmarks/ops/bench_elementwise.py).
FWD_TILE = 4096
FWD_BLOCK_N = 1024
FWD_WARPS = 4
BWD_TILE = 4096
BWD_BLOCK_N = 1024
BWD_WARPS = 4
# With a bias the backward's programs loop over rows (fp32 bias partials per program, not per tile):
# about this many programs per SM along the rows times the column tiles.
BWD_PROGRAMS_PER_SM = 8
# Software-pipelining depth of that row loop (1: none, the PTX of a plain range loop).
BWD_STAGES = 1
# gelu_tanh's derivative from one exp and one reciprocal (sigmoid(2u) and sigmoid(-2u) of the same
# exp(-2|u|)); False: two sigmoids, four MUFU ops an element, about 64 us of SFU issue on an H200 at
# (16384, 4096) against about 95 us of memory time: half of it hides nothing.
GELU_ONE_EXP = True
settings.apply_knobs("act", globals())


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x * tl.sigmoid(2.0 * u)
    elif ACT == 1:
        y = x * (0.5 + 0.5 * tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        y = tl.maximum(x, 0.0)
    elif ACT == 3:
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 4:
        y = x * tl.sigmoid(x)
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def _act_grad(x, ACT: tl.constexpr, ONE_EXP: tl.constexpr):
    if ACT == 0:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        if ONE_EXP:
            # e = exp(-2|u|) <= 1 never overflows; r = sigmoid(2|u|) and e * r = sigmoid(-2|u|) = 1 - r
            # without the cancellation of 1 - r, so s = sigmoid(2u) and s * (1 - s) = r * e * r.
            e = tl.exp(-2.0 * tl.abs(u))
            r = 1.0 / (1.0 + e)
            q = e * r
            s = tl.where(u >= 0.0, r, q)
            d = s + 2.0 * x * (r * q) * du
        else:
            s = tl.sigmoid(2.0 * u)
            # 1 - s as sigmoid(-2u): the subtraction would lose all digits of the tail where s -> 1.
            d = s + 2.0 * x * s * tl.sigmoid(-2.0 * u) * du
    elif ACT == 1:
        d = 0.5 + 0.5 * tl.erf(x * 0.7071067811865476) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 2:
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 3:
        d = 2.0 * tl.maximum(x, 0.0)
    elif ACT == 4:
        d = tl.sigmoid(x) * (1.0 + x * tl.sigmoid(-x))
    else:
        d = tl.sigmoid(x) * tl.sigmoid(-x)
    return d


@triton.jit
def _bias_act_fwd_kernel(X, BIAS, OUT, M, N, stride_x, stride_o, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + r64 * stride_o + cols[None, :], _act(x, ACT), mask=mask)


@triton.jit
def _bias_act_bwd_kernel(DOUT, X, BIAS, DX, DB_PART, M, N, rows_per_program, stride_do, stride_x, stride_dx,
                         ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         ONE_EXP: tl.constexpr, STAGES: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_BIAS:
        b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row0 = pid_m.to(tl.int64) * rows_per_program
    for r in tl.range(0, rows_per_program, BLOCK_M, num_stages=STAGES):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += b
        dout = tl.load(DOUT + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = tl.where(mask, dout * _act_grad(x, ACT, ONE_EXP), 0.0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx, mask=mask)
        acc += dx
    if HAS_BIAS:
        tl.store(DB_PART + pid_m.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _gated_fwd_kernel(G, V, BIAS_G, BIAS_V, OUT, M, N, stride_g, stride_v, stride_o, ACT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(G + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    v = tl.load(V + r64 * stride_v + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        g += tl.load(BIAS_G + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        v += tl.load(BIAS_V + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + r64 * stride_o + cols[None, :], v * _act(g, ACT), mask=mask)


@triton.jit
def _gated_bwd_kernel(DOUT, G, V, BIAS_G, BIAS_V, DG, DV, DBG_PART, DBV_PART, M, N, rows_per_program,
                      stride_do, stride_g, stride_v, stride_dg, stride_dv, ACT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ONE_EXP: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_BIAS:
        bg = tl.load(BIAS_G + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        bv = tl.load(BIAS_V + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_v = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row0 = pid_m.to(tl.int64) * rows_per_program
    for r in range(0, rows_per_program, BLOCK_M):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * stride_v + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += bg
            v += bv
        dout = tl.load(DOUT + rows[:, None] * stride_do + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dv = tl.where(mask, dout * _act(g, ACT), 0.0)
        dg = tl.where(mask, dout * v * _act_grad(g, ACT, ONE_EXP), 0.0)
        tl.store(DV + rows[:, None] * stride_dv + cols[None, :], dv, mask=mask)
        tl.store(DG + rows[:, None] * stride_dg + cols[None, :], dg, mask=mask)
        acc_g += dg
        acc_v += dv
    if HAS_BIAS:
        tl.store(DBG_PART + pid_m.to(tl.int64) * N + cols, tl.sum(acc_g, axis=0), mask=col_ok)
        tl.store(DBV_PART + pid_m.to(tl.int64) * N + cols, tl.sum(acc_v, axis=0), mask=col_ok)


# Launchers (flash_attn.triton's fast relaunch where installed); each launch's plan key stands for its
# constexprs and options.
_L_BIAS_ACT_FWD = launcher(_bias_act_fwd_kernel)
_L_BIAS_ACT_BWD = launcher(_bias_act_bwd_kernel)
_L_GATED_FWD = launcher(_gated_fwd_kernel)
_L_GATED_BWD = launcher(_gated_bwd_kernel)


@functools.lru_cache(maxsize=1024)
def _tiles(M: int, N: int, tile: int = 4096, max_block_n: int = 1024):
    block_n = min(next_power_of_2(N), max_block_n)
    block_m = max(1, min(next_power_of_2(M), tile // block_n))
    return block_m, block_n


def _bwd_tiles(M: int, N: int):
    return _tiles(M, N, BWD_TILE, BWD_BLOCK_N)


def bwd_row_programs(M: int, N: int, device, has_bias: bool):
    """(programs along rows, rows per program) of the backward grid: one row tile per program without
    a bias; with one, enough rows per program that the fp32 bias partials stay small."""
    block_m, block_n = _bwd_tiles(M, N)
    tiles = cdiv(M, block_m)
    if has_bias:
        tiles = min(tiles, max(1, cdiv(BWD_PROGRAMS_PER_SM * num_sms(device), cdiv(N, block_n))))
    rows = cdiv(cdiv(M, tiles), block_m) * block_m
    return cdiv(M, rows), rows


def bias_act_fwd(x: Tensor, bias: Optional[Tensor], out: Tensor, activation: str) -> None:
    """out = act(x + bias); x, out: (M, N) with unit column stride; bias: (N,)."""
    M, N = x.shape
    if M == 0 or N == 0:
        return
    block_m, block_n = _tiles(M, N, FWD_TILE, FWD_BLOCK_N)
    key, meta = plan("bias_act_fwd", ACT=ACT_IDS[activation], HAS_BIAS=bias is not None, BLOCK_M=block_m,
                     BLOCK_N=block_n, num_warps=FWD_WARPS)
    with device_ctx(x):
        _L_BIAS_ACT_FWD((cdiv(M, block_m), cdiv(N, block_n)), (x, bias, out, M, N, x.stride(0), out.stride(0)),
                        meta, key)


def bias_act_bwd(dout: Tensor, x: Tensor, bias: Optional[Tensor], dx: Tensor, db_part: Optional[Tensor],
                 activation: str) -> None:
    """dx = dout * act'(x + bias); db_part (programs, N) fp32 receives per-program column sums of dx."""
    M, N = x.shape
    if M == 0 or N == 0:
        return
    block_m, block_n = _bwd_tiles(M, N)
    programs, rows = bwd_row_programs(M, N, x.device, bias is not None)
    key, meta = plan("bias_act_bwd", ACT=ACT_IDS[activation], HAS_BIAS=bias is not None, BLOCK_M=block_m,
                     BLOCK_N=block_n, ONE_EXP=GELU_ONE_EXP, STAGES=BWD_STAGES, num_warps=BWD_WARPS)
    with device_ctx(x):
        _L_BIAS_ACT_BWD((programs, cdiv(N, block_n)), (
            dout, x, bias, dx, db_part, M, N, rows, dout.stride(0), x.stride(0), dx.stride(0)), meta, key)


def gated_fwd(gate: Tensor, value: Tensor, bias_g: Optional[Tensor], bias_v: Optional[Tensor], out: Tensor,
              activation: str) -> None:
    """out = (value + bias_v) * act(gate + bias_g); all (M, N) with unit column stride."""
    M, N = gate.shape
    if M == 0 or N == 0:
        return
    block_m, block_n = _tiles(M, N)
    key, meta = plan("gated_fwd", ACT=ACT_IDS[activation], HAS_BIAS=bias_g is not None, BLOCK_M=block_m,
                     BLOCK_N=block_n, num_warps=4)
    with device_ctx(gate):
        _L_GATED_FWD((cdiv(M, block_m), cdiv(N, block_n)), (
            gate, value, bias_g, bias_v, out, M, N, gate.stride(0), value.stride(0), out.stride(0)), meta, key)


def gated_bwd(dout: Tensor, gate: Tensor, value: Tensor, bias_g: Optional[Tensor], bias_v: Optional[Tensor],
              dgate: Tensor, dvalue: Tensor, dbg_part: Optional[Tensor], dbv_part: Optional[Tensor],
              activation: str) -> None:
    M, N = gate.shape
    if M == 0 or N == 0:
        return
    block_m, block_n = _bwd_tiles(M, N)
    programs, rows = bwd_row_programs(M, N, gate.device, bias_g is not None)
    key, meta = plan("gated_bwd", ACT=ACT_IDS[activation], HAS_BIAS=bias_g is not None, BLOCK_M=block_m,
                     BLOCK_N=block_n, ONE_EXP=GELU_ONE_EXP, num_warps=4)
    with device_ctx(gate):
        _L_GATED_BWD((programs, cdiv(N, block_n)), (
            dout, gate, value, bias_g, bias_v, dgate, dvalue, dbg_part, dbv_part, M, N, rows, dout.stride(0),
            gate.stride(0), value.stride(0), dgate.stride(0), dvalue.stride(0)), meta, key)
