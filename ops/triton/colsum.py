"""Triton column sum of a (M, N) matrix into fp32: the bias gradient of a Linear layer (the output
gradient summed over all tokens). The public entry is flash_attn.ops.linear.

Two launches, no atomics, so the result is bitwise reproducible: each program of the first kernel sums
a contiguous run of rows of one column block into a private row of a fp32 partial buffer (P, N); the
second kernel adds the P partials of each column in a fixed order. The input is read once at full width
(16-byte loads along the rows), which is what torch's generic dim-0 reduction of a bf16 (16384, N)
gradient does not reach on Hopper.
"""
import functools

from torch import Tensor

from . import cdiv, device_ctx, launcher, num_sms, plan, tl, triton


@triton.jit
def _colsum_part_kernel(X, PART, M, N, rows_per_program, stride_x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # A 2D accumulator: rows are only added across threads once, at the end, not per tile.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row0 = pid_m.to(tl.int64) * rows_per_program
    for r in range(0, rows_per_program, BLOCK_M):
        rows = row0 + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        acc += tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _colsum_final_kernel(PART, OUT, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(PART + ps.to(tl.int64)[:, None] * N + cols[None, :], mask=(ps < P)[:, None] & col_ok[None, :],
                       other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0), mask=col_ok)


_L_PART = launcher(_colsum_part_kernel)
_L_FINAL = launcher(_colsum_final_kernel)

# 32 x 256 tiles with 4 warps: each thread loads 8 x 16 bytes of bf16 per tile and keeps 64 fp32 sums, so
# four programs fit on an SM (64 KB of loads in flight per SM, enough to cover the DRAM latency).
BLOCK_M, BLOCK_N = 32, 256
FINAL_BLOCK_P, FINAL_BLOCK_N = 32, 64


@functools.lru_cache(maxsize=1024)
def _grid(M: int, N: int, sms: int):
    if M == 0:
        return 1, BLOCK_M, cdiv(N, BLOCK_N)
    programs_n = cdiv(N, BLOCK_N)
    programs_m = max(1, min(cdiv(M, BLOCK_M), cdiv(4 * sms, programs_n)))
    rows = cdiv(cdiv(M, programs_m), BLOCK_M) * BLOCK_M
    return cdiv(M, rows), rows, programs_n


def partial_programs(M: int, N: int, device) -> int:
    """Rows of the fp32 partial buffer (P, N) that :func:`colsum` needs for an (M, N) input."""
    return _grid(M, N, num_sms(device))[0]


def colsum(x: Tensor, part: Tensor, out: Tensor) -> None:
    """out (N,) = x (M, N) summed over its rows, in fp32 (stored in out's dtype); x has unit column stride;
    part: fp32 scratch of shape (partial_programs(M, N, x.device), N)."""
    M, N = x.shape
    if N == 0:
        return
    if M == 0:
        out.zero_()
        return
    programs_m, rows, programs_n = _grid(M, N, num_sms(x.device))
    key_p, meta_p = plan("colsum_part", BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4)
    key_f, meta_f = plan("colsum_final", BLOCK_P=FINAL_BLOCK_P, BLOCK_N=FINAL_BLOCK_N, num_warps=4)
    with device_ctx(x):
        _L_PART((programs_m, programs_n), (x, part, M, N, rows, x.stride(0)), meta_p, key_p)
        _L_FINAL((cdiv(N, FINAL_BLOCK_N),), (part, out, programs_m, N), meta_f, key_f)
