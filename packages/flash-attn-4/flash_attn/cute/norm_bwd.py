"""LayerNorm / RMSNorm backward for wide rows (hidden 4096..16384) as a CuTeDSL kernel for sm_90a: the kernel behind
flash_attn.ops' norm backward (ops/triton/layer_norm.py calls it where plan() serves the call), in this
distribution because it is built and cached like the attention kernels.

Why: the Triton backward (ops/triton/layer_norm.py) keeps the dweight/dbias column accumulators in
registers; at hidden 12288..16384 a row, its prefetch and two fp32 accumulators of N columns do not fit
64 registers a thread. Here the accumulators live in shared memory (fp32, N each, next to the fp32 weight:
192 KB for LayerNorm at 16384 of the 227 KB), so registers hold only the row being worked on and the next
one. Shared-memory accumulator and weight accesses are volatile ld/st.shared.v4 (ordered among themselves,
so ptxas does not hoist a whole row of them into registers), and pass 2 reads x and dy through an opaque
copy so their fp32 conversions are redone after the barrier instead of living across it. ptxas -v (sm_90a,
13.0), 512 threads: 0-16 bytes of spill up to 12288, 16-24 at 16384 (the 128-register cap), all of it a
few loop-invariant words: at most 5 local loads/stores per row iteration in the SASS; 1024 threads (64
registers) spill more (tests/cute/test_layer_norm_cute.py bounds both).

Measured against the Triton backward and the copy bandwidth: benchmarks/results/h200/ops_norm.md
(benchmarks/ops/bench_ln_cute_bwd.py).

Layout: persistent CTAs (every resident slot, at most one per row) of at most max_threads() threads (512;
THREADS_TABLE can say otherwise per size), each owning a contiguous block of rows; a thread holds K =
vectors(N) 16-byte vectors (8 columns each) of x and of dy (K = 4 at 16384 with 512 threads, 2 with 1024).
Thread t always owns the same columns (vector j covers columns (j * T + t) * 8 .. +8, coalesced across a
warp), so it accumulates dweight/dbias into its own shared-memory words: no atomics, no barrier for the
accumulators. In shared memory a thread's 8 values sit as two float4 at consecutive-thread stride 16
bytes, so a warp's 128-bit accesses are conflict-free. Each CTA writes its accumulators as one row of
(P, N) fp32 partial buffers, which the caller sums in a fixed order (the Triton reduce kernel), so results
are bitwise reproducible run to run.

Per row: xhat = (x - mean) * rstd (RMSNorm: mean 0), g = dy * w, the row sums sum(xhat * g), sum(g) by
warp butterflies and one shared-memory exchange (double-buffered, one barrier per row), then
dx = rstd * (g - (xhat * c1 + c2)) with c1 = sum(xhat * g) / N, c2 = sum(g) / N (RMSNorm: c2 = 0), plus
dresidual_out if given; dresidual_in gets the same values. x and dy of the next row are loaded before the
current row's reduction so the loads overlap it (ptxas sinks them below pass 1; the vld variant keeps them
above it).

Variants (FLASH_ATTN_CUTE_OVERRIDES' ln.opts, see OPTS; part of the compile key, checked on CPU compiles and
GPU-tested by tests/cute/test_layer_norm_cute.py::test_gpu_variants): w16, carve, p1, p2, vld, pp. OPTS_TABLE
picks them where measured faster (LayerNorm 16384: p1+p2).

Served (``plan`` returns a key, else None and the Triton path runs): CUDA sm_90, x / dy / dx (and
dresidual_out / dresidual_in) all bf16 or all fp16, weight bf16/fp16/fp32, 4096 <= N <= 16384 with
vectors(N) defined (N a multiple of 8 * 32 * K for some K <= 4), no dropout, rowscale, x1, weight1.
On by default; the root package's FLASH_ATTN_DISABLE=ln_cute_bwd runs the Triton backward instead. Rows are
symbolic, so one kernel per key: from memory, else this package's disk cache (cache.py; $FLASH_ATTN_CUTE_CACHE, default
~/.cache/flash_attn_cute: a new process loads it in milliseconds without importing the CuTeDSL compiler),
else compiled (about 2 s) and written there.
"""
import functools
from typing import Optional

import torch

from flash_attn.cute import config

VEC = 8  # 16-byte vectors of 2-byte elements
MAX_THREADS = 512  # the threads per CTA where THREADS_TABLE has no entry (512 measured best at every size)
# (is_rms_norm, N) -> threads per CTA at most; FLASH_ATTN_CUTE_OVERRIDES' ln.threads overrides it (in the key).
THREADS_TABLE = {}
MIN_N, MAX_N = 4096, 16384
SMEM_PER_SM = 227 * 1024
THREADS_PER_SM = 2048
_DTYPES = (torch.bfloat16, torch.float16)
_W_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# FLASH_ATTN_CUTE_OVERRIDES' ln.opts: "+"-separated kernel variants, all off by default and part of the key:
#   w16    a bf16 / fp16 weight stays 16-bit in shared memory (half its shared-memory traffic and size)
#   carve  preferred_smem_carveout just large enough for the kernel's shared memory (else 100: the rest
#          of the unified 256 KB is L1)
#   p1     LayerNorm pass 1 as sum(x * g) - mean * sum(g): one FADD an element less
#   p2     LayerNorm pass 2 as dx = g * rstd + (xhat * -c1 * rstd - c2 * rstd), two FFMAs: one op an
#          element less
#   vld    the next row's x / dy / mean / rstd (and this row's dresidual_out) as volatile loads, so that
#          ptxas issues them before pass 1 (it sinks plain loads below pass 1's row sums); mean and rstd
#          one row ahead instead of at the row's start
#   pp     two rows a loop iteration with the row registers swapping roles (no row-to-row register moves)
OPTS = ("w16", "carve", "p1", "p2", "vld", "pp")
# (is_rms_norm, N) -> the variants used unless FLASH_ATTN_CUTE_OVERRIDES gives ln.opts (the A/B behind each entry:
# benchmarks/results/h200/ops_norm.md)
OPTS_TABLE = {(False, 16384): ("p1", "p2")}


def options(wdtype, is_rms_norm, env=None, N=None) -> tuple:
    """The variants of FLASH_ATTN_CUTE_OVERRIDES' ln.opts ("p1+p2"; "none": none; ``env``: that value instead;
    unset: OPTS_TABLE's entry for (is_rms_norm, N)) that change this key's code, in OPTS order: w16 only with a
    16-bit weight, p1 and p2 only for LayerNorm."""
    value = config.overrides("ln").get("opts") if env is None else env
    if value is None:
        value = ",".join(OPTS_TABLE.get((bool(is_rms_norm), N), ()))
    if value.strip().lower() == "none":
        value = ""
    opts = {o.strip() for o in value.replace("+", ",").split(",") if o.strip()}
    bad = opts - set(OPTS)
    if bad:
        raise ValueError(f"FLASH_ATTN_CUTE_OVERRIDES ln.opts: unknown {sorted(bad)}; known: {', '.join(OPTS)}")
    if wdtype in (torch.float32, "fp32"):
        opts.discard("w16")
    if is_rms_norm:  # no mean: nothing for p1 to save, and p2's count equals the plain one
        opts.discard("p1")
        opts.discard("p2")
    return tuple(o for o in OPTS if o in opts)


def _on_hopper(x) -> bool:
    # an AMD GPU answers the capability query too (an MI200 says (9, 0)): a ROCm torch never is
    return x.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(x.device) == (9, 0)


@functools.lru_cache(maxsize=None)
def _cutedsl_installed() -> bool:
    # Found, not imported: importing the compiler takes about half a second, and a kernel from the disk
    # cache needs only its runtime library. A CuTeDSL that fails to compile warns once (kernel()).
    import importlib.util

    try:
        return importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _tvm_ffi_ok() -> bool:
    try:
        from flash_attn.cute.kernels import _tvm_ffi
    except Exception:  # flash-attn-4 (flash_attn.cute) not importable
        return False
    return _tvm_ffi()


def _same(dtype, *tensors) -> bool:
    return all(t is None or t.dtype == dtype for t in tensors)


def plan(x, weight, weight1, dy, dy1, dresidual_out, rowscale, dropout_p, mean, rstd, dx, dx1, dresidual_in,
         db, is_rms_norm, zero_centered_weight, check_device=True) -> Optional[tuple]:
    """The compile key when the CuTeDSL kernel serves this backward call, else None. ``check_device``:
    also require a CUDA sm_90 device and CuTeDSL (False: the shape/dtype decision alone, for tests)."""
    if weight1 is not None or dy1 is not None or dx1 is not None or rowscale is not None or dropout_p > 0.0:
        return None
    if x.dim() != 2:
        return None
    M, N = x.shape
    mt = max_threads(N, is_rms_norm)
    if not (MIN_N <= N <= MAX_N and N % VEC == 0 and vectors(N, mt) is not None):
        return None
    dt = x.dtype
    if dt not in _DTYPES or not _same(dt, dy, dx, dresidual_out, dresidual_in) or weight.dtype not in _W_DTYPES:
        return None
    for t in (x, dy, dx, dresidual_out, dresidual_in):
        # 16-byte vectors: unit column stride, 16-byte aligned rows.
        if t is not None and (t.shape != (M, N) or t.stride(1) != 1 or t.stride(0) % VEC != 0
                              or t.data_ptr() % 16 != 0):
            return None
    if not weight.is_contiguous() or weight.data_ptr() % 16 != 0:
        return None
    if not (mean.is_contiguous() and rstd.is_contiguous() and mean.dtype == torch.float32
            and rstd.dtype == torch.float32):
        return None
    if check_device:
        if not _on_hopper(x) or not _cutedsl_installed():
            return None
        if not _tvm_ffi_ok():  # the launch passes torch tensors straight through TVM-FFI
            return None
    return (_dtype_name(dt), _dtype_name(weight.dtype), N, bool(is_rms_norm), db is not None,
            dresidual_out is not None, dresidual_in is not None, bool(zero_centered_weight), mt,
            options(weight.dtype, is_rms_norm, N=N))


def _dtype_name(dt) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dt]


def max_threads(N: Optional[int] = None, is_rms_norm: bool = False) -> int:
    """Threads per CTA at most: FLASH_ATTN_CUTE_OVERRIDES' ln.threads (256, 512 or 1024), else THREADS_TABLE's
    entry for (is_rms_norm, N), else MAX_THREADS."""
    v = config.overrides("ln").get("threads")
    if v is None:
        return THREADS_TABLE.get((bool(is_rms_norm), N), MAX_THREADS)
    if v not in (256, 512, 1024):
        raise ValueError(f"FLASH_ATTN_CUTE_OVERRIDES ln.threads must be 256, 512 or 1024, got {v}")
    return v


def vectors(N: int, mt: Optional[int] = None) -> Optional[int]:
    """16-byte vectors per thread per row: the fewest (at most 4) that keep a CTA at <= mt threads
    (default max_threads()), a whole number of warps and every thread the same columns; None if there
    is none."""
    mt = mt or max_threads()
    for k in range(max(1, -(-N // (VEC * mt))), 5):
        if N % (VEC * k) == 0 and (N // (VEC * k)) % 32 == 0:
            return k
    return None


def threads(N: int, mt: Optional[int] = None) -> int:
    return N // (VEC * vectors(N, mt))


def smem_bytes(N: int, has_bias: bool, mt: Optional[int] = None, w16: bool = False) -> int:
    """Shared memory of one CTA: the weight (fp32, or 16-bit with the w16 variant), dweight (and dbias)
    fp32 rows plus the row-sum exchange."""
    return (1 + has_bias) * N * 4 + N * (2 if w16 else 4) + 2 * (threads(N, mt) // 32) * 2 * 4


def ctas_per_sm(N: int, has_bias: bool, mt: Optional[int] = None, w16: bool = False) -> int:
    """CTAs resident on one SM (the kernel's minimum-CTAs-per-SM bound, so ptxas caps registers to
    fit them): threads, shared memory, and a register estimate of 32 + 24 per vector a thread (ptxas
    -v, sm_90a: 4 vectors need about 145, 2 about 80)."""
    T, K = threads(N, mt), vectors(N, mt)
    return max(1, min(THREADS_PER_SM // T, SMEM_PER_SM // (smem_bytes(N, has_bias, mt, w16) + 1024),
                      65536 // (T * (32 + 24 * K))))


def programs(M: int, N: int, has_bias: bool, sms: int, mt: Optional[int] = None, w16: bool = False) -> int:
    """Grid size (and rows of the partial buffers): every resident CTA slot, at most one per row."""
    return max(1, min(M, sms * ctas_per_sm(N, has_bias, mt, w16)))


def grid(key, M: int, sms: int) -> int:
    """programs() for the compile key ``key`` (see :func:`plan`)."""
    return programs(M, key[2], key[4], sms, key[8], "w16" in key[9])


def carveout(key) -> int:
    """The launch's preferred shared-memory carveout (percent of the SM's shared-memory maximum): 100,
    or with the carve variant the least that holds ctas_per_sm CTAs (1 KB each reserved by the
    hardware), so the rest of the unified L1 stays cache."""
    if "carve" not in key[9]:
        return 100
    w16 = "w16" in key[9]
    need = ctas_per_sm(key[2], key[4], key[8], w16) * (smem_bytes(key[2], key[4], key[8], w16) + 1024)
    return min(100, -(-100 * need // (228 * 1024)))


def _opaque_i32(v):
    """v through a volatile PTX mov: the same value, which the compiler can neither fold, hoist nor
    merge with another use of v."""
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Int32(llvm.inline_asm(T.i32(), [Int32(v).ir_value()], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _lds4(addr):
    """Four fp32 from shared memory (byte address addr, 16-byte aligned), one volatile ld.shared.v4."""
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 4), [Int32(addr).ir_value()],
                          "ld.volatile.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i])) for i in range(4)]


def _lds4_b32(addr):
    """Four 32-bit words from shared memory (byte address addr, 16-byte aligned), one volatile
    ld.shared.v4 (ordered with _lds4 / _sts4)."""
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value()],
                          "ld.volatile.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), res, [i])) for i in range(4)]


def _ldg4(addr):
    """Four 32-bit words from global memory (byte address addr, 16-byte aligned), one ld.volatile.global.v4:
    ptxas keeps volatile accesses in program order, so a prefetch issued before the volatile shared-memory
    loads of pass 1 stays there instead of being sunk below pass 1 (which ptxas does to plain loads to
    shorten their registers' lives, leaving only pass 2 to hide the next row's latency)."""
    from cutlass import Int32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    res = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(addr).ir_value()],
                          "ld.volatile.global.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(T.i32(), res, [i])) for i in range(4)]


def _ldg1(addr):
    """One fp32 from global memory (byte address addr), ld.volatile.global (see _ldg4)."""
    from cutlass import Float32, Int64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    return Float32(llvm.inline_asm(T.f32(), [Int64(addr).ir_value()], "ld.volatile.global.f32 $0, [$1];", "=f,l",
                                   has_side_effects=True, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


def _sts4(addr, vals):
    """Four fp32 to shared memory, one volatile st.shared.v4 (ordered with _lds4)."""
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm

    llvm.inline_asm(None, [Int32(addr).ir_value()] + [Float32(v).ir_value() for v in vals],
                    "st.volatile.shared.v4.f32 [$0], {$1, $2, $3, $4};", "r,f,f,f,f",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


class LnBwdSm90:
    """The kernel for one compile key (see :func:`plan`)."""

    def __init__(self, dtype, wdtype, N, is_rms, has_bias, has_dres_out, store_dres_in, zero_centered, mt,
                 opts=()):
        import cutlass

        names = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
        self.dtype, self.wdtype = names[dtype], names[wdtype]
        self.N = N
        self.mt = mt
        self.T = threads(N, mt)
        self.K = vectors(N, mt)
        self.is_rms, self.has_bias = is_rms, has_bias
        self.has_dres_out, self.store_dres_in, self.zero_centered = has_dres_out, store_dres_in, zero_centered
        self.opts = tuple(opts)
        self.w16 = "w16" in opts and wdtype != "fp32"
        self.p1 = "p1" in opts and not is_rms
        self.p2 = "p2" in opts
        self.vld = "vld" in opts
        self.pp = "pp" in opts
        self.key = (dtype, wdtype, N, is_rms, has_bias, has_dres_out, store_dres_in, zero_centered, mt,
                    self.opts)

    def _thr_view(self, row_tensor, tid):
        """Thread tid's ((4, 2), K) slice of a (N,) row: vector j at columns (j * T + tid) * VEC."""
        import cutlass.cute as cute

        off = cute.assume(tid * VEC, divby=VEC)
        return cute.make_tensor(row_tensor.iterator + off,
                                cute.make_layout(((4, 2), self.K), stride=((1, 4), VEC * self.T)))

    def _smem_view(self, s_tensor, tid):
        """Thread tid's ((4, 2), K) slice of a shared fp32 row stored as float4 per (half-vector, thread):
        element ((e, h), j) at word tid * 4 + e + h * 4T + j * 8T (see _soff)."""
        import cutlass.cute as cute

        T = self.T
        off = cute.assume(tid * 4, divby=4)
        return cute.make_tensor(s_tensor.iterator + off,
                                cute.make_layout(((4, 2), self.K), stride=((1, 4 * T), 8 * T)))

    def _fresh(self, t):
        """A copy of the 2-byte register tensor t that the compiler cannot prove equal to t (each 32-bit
        word through a volatile PTX mov): its fp32 conversions after the row-sum barrier are formed
        again instead of being kept live across it (see the row loop)."""
        import cutlass.cute as cute
        from cutlass import Int32

        words = cute.recast_tensor(t, Int32)
        out = cute.make_rmem_tensor(cute.size(words), Int32)
        for i in range(cute.size(words)):  # unrolled at trace time (not a @cute.jit body)
            out[i] = _opaque_i32(words[i])
        return cute.make_tensor(cute.recast_tensor(out, self.dtype).iterator, t.layout)

    def _soff(self, j, h):
        """Byte offset of half-vector h of vector j in a thread's shared row (see _smem_view)."""
        return (j * 2 + h) * 4 * self.T * 4

    def _load_row(self, row_tensor, tid, dst):
        """Thread tid's K vectors of a 2-byte (N,) row into the register tensor dst: vectorised copies, or
        with the vld variant volatile 16-byte loads that ptxas issues where they are written."""
        import cutlass.cute as cute
        from cutlass import Int32

        if not self.vld:
            cute.autovec_copy(self._thr_view(row_tensor, tid), dst)
            return
        base = self._thr_view(row_tensor, tid).iterator.toint()
        words = cute.recast_tensor(dst, Int32)
        for j in range(self.K):
            w = _ldg4(base + j * self.T * 16)
            for i in range(4):
                words[4 * j + i] = w[i]

    def _weights(self, w_addr, j, h):
        """Four fp32 weights of half-vector h of vector j, read from shared memory (fp32 path: one
        ld.shared.v4; 1 + w already folded in when zero-centred)."""
        return _lds4(w_addr + self._soff(j, h))

    def _weights16(self, w_addr, j):
        """The eight fp32 weights of vector j from the 16-bit shared weight (w16 variant): one
        ld.shared.v4.b32 of the thread's 16 bytes (laid out as in global memory: consecutive threads 16
        bytes apart, conflict-free), converted here (1 + w when zero-centred: added in fp32, as the fp32
        path does once)."""
        import cutlass.cute as cute
        from cutlass import Float32, Int32

        words = _lds4_b32(w_addr + j * self.T * 16)
        r32 = cute.make_rmem_tensor(4, Int32)
        for i in range(4):
            r32[i] = words[i]
        v = cute.make_tensor(cute.recast_tensor(r32, self.wdtype).iterator, cute.make_layout(8)).load().to(Float32)
        if self.zero_centered:
            v = v + 1.0
        rf = cute.make_rmem_tensor(8, Float32)
        rf.store(v)
        return rf

    def _build(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32, Int32
        from cutlass.memory import SmemAllocator

        T, K, N, W = self.T, self.K, self.N, self.T // 32
        dt = self.dtype
        inv_n = 1.0 / N

        @cute.jit
        def row(self, r, buf, M, tid, lane, warp, mX, mDY, mDRO, mDX, mDRI, mMean, mRstd, sRed, w_addr, dw_addr,
                 db_addr, rX, rDY, rMS, rXn, rDYn, rMSn, rDR, rO):
            # One row: x, dy (rX, rDY) and (vld) mean, rstd (rMS) in registers, the next row's loaded
            # into rXn, rDYn (rMSn); buf: the row-sum exchange buffer. A function so that the pp variant
            # can run it on swapped buffers.
            if cutlass.const_expr(self.has_dres_out):
                self._load_row(mDRO[r, None], tid, rDR)
            # The next row (the last one again at the end: an L2 hit, never out of bounds) is in
            # flight during this row's reduction.
            nxt = cutlass.min(r + 1, M - 1)
            self._load_row(mX[nxt, None], tid, rXn)
            self._load_row(mDY[nxt, None], tid, rDYn)
            rstd = Float32(0.0)
            mu = Float32(0.0)
            if cutlass.const_expr(self.vld):
                rstd = rMS[1]
                rMSn[1] = _ldg1((mRstd.iterator + nxt).toint())
                # RMSNorm has no mean: mu stays 0 (rMS[0] is written for LayerNorm only; with pp a row's rMS
                # is the previous row's rMSn)
                if cutlass.const_expr(not self.is_rms):
                    mu = rMS[0]
                    rMSn[0] = _ldg1((mMean.iterator + nxt).toint())
            else:
                rstd = mRstd[r]
                if cutlass.const_expr(not self.is_rms):
                    mu = mMean[r]
            # Pass 1, before the barrier: only the two sums, a = sum((x - mean) * g), b = sum(g).
            # (p1: a = sum(x * g), and a - mean * b after the reduction: one FADD an element less.)
            a = Float32(0.0)
            b = Float32(0.0)
            for j in cutlass.range_constexpr(K):
                w8 = None
                if cutlass.const_expr(self.w16):
                    w8 = self._weights16(w_addr, j)
                for h in cutlass.range_constexpr(2):
                    w4 = None
                    if cutlass.const_expr(self.w16):
                        w4 = [w8[4 * h + e] for e in range(4)]
                    else:
                        w4 = self._weights(w_addr, j, h)
                    for e in cutlass.range_constexpr(4):
                        g = rDY[(e, h), j].to(Float32) * w4[e]
                        if cutlass.const_expr(self.p1):
                            a = a + rX[(e, h), j].to(Float32) * g
                        else:
                            a = a + (rX[(e, h), j].to(Float32) - mu) * g
                        if cutlass.const_expr(not self.is_rms):
                            b = b + g
            for i in cutlass.range_constexpr(5):
                a = a + cute.arch.shuffle_sync_bfly(a, offset=1 << i)
                if cutlass.const_expr(not self.is_rms):
                    b = b + cute.arch.shuffle_sync_bfly(b, offset=1 << i)
            if lane == 0:
                sRed[buf, 0, warp] = a
                sRed[buf, 1, warp] = b
            cute.arch.sync_threads()
            # Lane w of every warp takes warp w's sums (0 past the last warp) and a full butterfly
            # adds them: one load and two registers instead of W loads in flight. Partners add the
            # same two values at every level (a + b == b + a in fp32), so every lane of every warp
            # ends with bitwise the same c1, c2.
            a = Float32(0.0)
            b = Float32(0.0)
            if lane < W:
                a = sRed[buf, 0, lane]
                if cutlass.const_expr(not self.is_rms):
                    b = sRed[buf, 1, lane]
            for i in cutlass.range_constexpr(5):
                a = a + cute.arch.shuffle_sync_bfly(a, offset=1 << i)
                if cutlass.const_expr(not self.is_rms):
                    b = b + cute.arch.shuffle_sync_bfly(b, offset=1 << i)
            if cutlass.const_expr(self.p1):
                # sum((x - mean) * g) = sum(x * g) - mean * sum(g); the cancellation costs fp32
                # relative error (1 + |mean| / std) in c1, far below dx's 16-bit rounding.
                a = a - mu * b
            c1 = a * rstd * inv_n  # sum(xhat * g) / N = rstd * sum((x - mean) * g) / N
            c2 = b * inv_n
            mr = mu * rstd
            nc1 = -(c1 * rstd)  # p2: dx = g * rstd + (xhat * nc1 + nc2)
            nc2 = -(c2 * rstd)
            # Pass 2 from copies of x and dy that the compiler cannot merge with pass 1's: the fp32
            # conversions are formed again here instead of living across the barrier next to the
            # prefetched row. Shared-memory accesses are volatile, so they keep program order and
            # ptxas cannot hoist every load of the row to the top (a register peak of 3 x 32 values).
            fX, fDY = self._fresh(rX), self._fresh(rDY)
            gDX = self._thr_view(mDX[r, None], tid)
            gDRI = self._thr_view(mDRI[r, None], tid)
            for j in cutlass.range_constexpr(K):
                w8 = None
                if cutlass.const_expr(self.w16):
                    w8 = self._weights16(w_addr, j)
                for h in cutlass.range_constexpr(2):
                    so = self._soff(j, h)
                    w4 = None
                    if cutlass.const_expr(self.w16):
                        w4 = [w8[4 * h + e] for e in range(4)]
                    else:
                        w4 = self._weights(w_addr, j, h)
                    dw4 = _lds4(dw_addr + so)
                    db4 = dw4
                    if cutlass.const_expr(self.has_bias):
                        db4 = _lds4(db_addr + so)
                    for e in cutlass.range_constexpr(4):
                        dyf = fDY[(e, h), j].to(Float32)
                        xhat = fX[(e, h), j].to(Float32) * rstd - mr
                        dxv = None
                        if cutlass.const_expr(self.p2):
                            t = xhat * nc1
                            if cutlass.const_expr(not self.is_rms):
                                t = t + nc2
                            dxv = (dyf * w4[e]) * rstd + t
                        else:
                            dxv = dyf * w4[e] - xhat * c1
                            if cutlass.const_expr(not self.is_rms):
                                dxv = dxv - c2
                            dxv = dxv * rstd
                        if cutlass.const_expr(self.has_dres_out):
                            dxv = dxv + rDR[(e, h), j].to(Float32)
                        rO[(e, h), j] = dxv.to(dt)
                        dw4[e] = dw4[e] + dyf * xhat
                        if cutlass.const_expr(self.has_bias):
                            db4[e] = db4[e] + dyf
                    _sts4(dw_addr + so, dw4)
                    if cutlass.const_expr(self.has_bias):
                        _sts4(db_addr + so, db4)
                cute.autovec_copy(rO[None, j], gDX[None, j])
                if cutlass.const_expr(self.store_dres_in):
                    cute.autovec_copy(rO[None, j], gDRI[None, j])

        @cute.kernel
        def kernel(mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor,
                   mDRO: cute.Tensor, mDX: cute.Tensor, mDRI: cute.Tensor, mDWp: cute.Tensor, mDBp: cute.Tensor):
            tid, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            nctas, _, _ = cute.arch.grid_dim()
            lane = cute.arch.lane_idx()
            warp = cute.arch.warp_idx()
            M = mX.shape[0]
            rpc = (M + nctas - 1) // nctas
            start = cta * rpc
            end = cutlass.min(start + rpc, M)

            smem = SmemAllocator()
            sW = smem.allocate_tensor(self.wdtype if self.w16 else Float32, cute.make_layout((N,)),
                                      byte_alignment=16)
            sDW = smem.allocate_tensor(Float32, cute.make_layout((N,)), byte_alignment=16)
            sDB = sDW
            if cutlass.const_expr(self.has_bias):
                sDB = smem.allocate_tensor(Float32, cute.make_layout((N,)), byte_alignment=16)
            sRed = smem.allocate_tensor(Float32, cute.make_layout((2, 2, W), stride=(1, 2, 4)), byte_alignment=16)
            tDW, tDB = self._smem_view(sDW, tid), self._smem_view(sDB, tid)
            # Byte addresses (shared window) of this thread's first float4 in each row.
            w_addr = sW.iterator.toint() + tid * 16
            dw_addr = sDW.iterator.toint() + tid * 16
            db_addr = sDB.iterator.toint() + tid * 16

            # Weight to fp32 in shared memory (1 + w when zero-centred); accumulators to zero. Each thread
            # touches only its own words, so no barrier is needed before the row loop.
            rWg = cute.make_rmem_tensor(((4, 2), K), self.wdtype)
            cute.autovec_copy(self._thr_view(mW, tid), rWg)
            if cutlass.const_expr(self.w16):
                cute.autovec_copy(rWg, self._thr_view(sW, tid))
            else:
                rWf = cute.make_rmem_tensor(((4, 2), K), Float32)
                wv = rWg.load().to(Float32)
                if cutlass.const_expr(self.zero_centered):
                    wv = wv + 1.0
                rWf.store(wv)
                cute.autovec_copy(rWf, self._smem_view(sW, tid))
            rZ = cute.make_rmem_tensor(((4, 2), K), Float32)
            rZ.fill(0.0)
            cute.autovec_copy(rZ, tDW)
            if cutlass.const_expr(self.has_bias):
                cute.autovec_copy(rZ, tDB)

            rX = cute.make_rmem_tensor(((4, 2), K), dt)
            rDY = cute.make_rmem_tensor(((4, 2), K), dt)
            rXn = cute.make_rmem_tensor(((4, 2), K), dt)
            rDYn = cute.make_rmem_tensor(((4, 2), K), dt)
            rDR = cute.make_rmem_tensor(((4, 2), K), dt)
            rO = cute.make_rmem_tensor(((4, 2), K), dt)
            rAcc = cute.make_rmem_tensor(((4, 2), K), Float32)
            # vld: (mean, rstd) of the current and the next row, prefetched with x and dy (else loaded at
            # the row's start, where pass 1 waits for them).
            rMS = cute.make_rmem_tensor(2, Float32)
            rMSn = cute.make_rmem_tensor(2, Float32)
            first = cutlass.min(start, M - 1)
            cute.autovec_copy(self._thr_view(mX[first, None], tid), rX)
            cute.autovec_copy(self._thr_view(mDY[first, None], tid), rDY)
            if cutlass.const_expr(self.vld):
                rMS[0] = Float32(0.0)
                if cutlass.const_expr(not self.is_rms):
                    rMS[0] = mMean[first]
                rMS[1] = mRstd[first]

            if cutlass.const_expr(self.pp):
                # Two rows an iteration, the register buffers swapping roles instead of being copied:
                # the row-to-row moves (and the moves ptxas adds to keep the 16-byte load destinations
                # in place across the back edge) go away.
                for r0 in cutlass.range(start, end, 2, unroll=1):
                    row(self, r0, Int32(0), M, tid, lane, warp, mX, mDY, mDRO, mDX, mDRI, mMean, mRstd, sRed, w_addr,
                        dw_addr, db_addr, rX, rDY, rMS, rXn, rDYn, rMSn, rDR, rO)
                    if r0 + 1 < end:
                        row(self, r0 + 1, Int32(1), M, tid, lane, warp, mX, mDY, mDRO, mDX, mDRI, mMean, mRstd, sRed,
                            w_addr, dw_addr, db_addr, rXn, rDYn, rMSn, rX, rDY, rMS, rDR, rO)
            else:
                buf = Int32(0)
                for r in cutlass.range(start, end, unroll=1):
                    row(self, r, buf, M, tid, lane, warp, mX, mDY, mDRO, mDX, mDRI, mMean, mRstd, sRed, w_addr,
                        dw_addr, db_addr, rX, rDY, rMS, rXn, rDYn, rMSn, rDR, rO)
                    buf = 1 - buf
                    rX.store(rXn.load())
                    rDY.store(rDYn.load())
                    if cutlass.const_expr(self.vld):
                        rMS.store(rMSn.load())

            cute.autovec_copy(tDW, rAcc)
            cute.autovec_copy(rAcc, self._thr_view(mDWp[cta, None], tid))
            if cutlass.const_expr(self.has_bias):
                cute.autovec_copy(tDB, rAcc)
                cute.autovec_copy(rAcc, self._thr_view(mDBp[cta, None], tid))

        @cute.jit
        def launch(mX: cute.Tensor, mDY: cute.Tensor, mW: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor,
                   mDRO: cute.Tensor, mDX: cute.Tensor, mDRI: cute.Tensor, mDWp: cute.Tensor, mDBp: cute.Tensor,
                   grid: Int32, stream):
            kernel(mX, mDY, mW, mMean, mRstd, mDRO, mDX, mDRI, mDWp, mDBp).launch(
                # Dynamic shared memory: CuTeDSL sizes it from the SmemAllocator (as for the attention
                # kernels); carveout 100 (all of the unified L1 that can be shared memory) unless the
                # carve variant asks for just what the kernel needs.
                grid=(grid, 1, 1), block=(T, 1, 1), stream=stream,
                min_blocks_per_mp=ctas_per_sm(N, self.has_bias, self.mt, self.w16),
                preferred_smem_carveout=carveout(self.key))

        return launch


def compile_kernel(key, arch="sm_90a", dump_dir=None):
    """Compile the kernel for ``key`` (from :func:`plan`) for ``arch``; no GPU needed. ``dump_dir``: an
    existing folder that receives the PTX and cubin. Rows (M) and the partial-buffer rows (P) are
    symbolic: one compile serves every row count. With apache-tvm-ffi the call is
    ``(x, dy, weight, mean, rstd, dres_out, dx, dres_in, dw_part, db_part, grid)`` on torch tensors (absent
    optional tensors replaced by any tensor of the right shape and dtype: they are never touched)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from flash_attn.cute.kernels import _tvm_ffi

    k = LnBwdSm90(*key)
    dt, N = k.dtype, k.N
    M, P = cute.sym_int(), cute.sym_int()

    def rows():
        return make_fake_tensor(dt, (M, N), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)

    x, dy, dro, dx, dri = rows(), rows(), rows(), rows(), rows()
    w = make_fake_tensor(k.wdtype, (N,), (1,), assumed_align=16)
    mean = make_fake_tensor(cutlass.Float32, (M,), (1,), assumed_align=4)
    rstd = make_fake_tensor(cutlass.Float32, (M,), (1,), assumed_align=4)
    dwp = make_fake_tensor(cutlass.Float32, (P, N), (N, 1), assumed_align=16)
    dbp = make_fake_tensor(cutlass.Float32, (P, N), (N, 1), assumed_align=16)
    tvm_ffi = _tvm_ffi()
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    return cute.compile(k._build(), x, dy, w, mean, rstd, dro, dx, dri, dwp, dbp, cutlass.Int32(1), stream,
                        options=options)


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    # this file's own hash in its entries' keys: an edit of the attention kernels leaves the norm entries valid
    import hashlib

    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_entry(key, arch="sm_90a"):
    """(config, cache key, file name, exported C symbol) of ``key``'s entry in this package's disk
    cache (cache.py): the config names every field of the compile key, the architecture, the calling
    convention and the SHA-256 of this file; cache.entry_key adds the CuTeDSL / TVM-FFI versions."""
    from flash_attn.cute import cache

    dtype, wdtype, N, is_rms, bias, dres_out, dres_in, zc, mt, opts = key
    config = {"kernel": "LnBwdSm90", "dtype": dtype, "wdtype": wdtype, "N": int(N), "rms": bool(is_rms),
              "bias": bool(bias), "dres_out": bool(dres_out), "dres_in": bool(dres_in),
              "zero_centered": bool(zc), "threads": int(mt), "opts": list(opts), "arch": arch,
              "abi": "tvm-ffi-env-stream", "source": _source_hash()}
    ck = cache.entry_key(config)
    name = (f"lnbwd-{arch}-{dtype}-w{wdtype}-{N}-{'rms' if is_rms else 'ln'}{'-bias' if bias else ''}"
            f"{'-dres' if dres_out else ''}{'-dresin' if dres_in else ''}{'-zc' if zc else ''}-t{mt}"
            f"{''.join('-' + o for o in opts)}-{ck[:16]}")
    return config, ck, name, f"flash_attn_lnbwd_{ck[:16]}"


def load_or_build(key, arch="sm_90a", root=None, force=False):
    """(callable, origin) for ``key``: "so" / "o" loaded from the disk cache folder ``root`` (no compile,
    no import of the CuTeDSL compiler with "so"), else "compiled" now and written there. ``root=None``:
    no disk cache. Needs apache-tvm-ffi (plan() serves nothing without it)."""
    from flash_attn.cute.kernels import _load_or_build_entry

    return _load_or_build_entry(cache_entry(key, arch), lambda: compile_kernel(key, arch), root, force)


_kernels: dict = {}
_origins: dict = {}  # key -> "so" / "o" (disk cache) / "compiled"
_failed: dict = {}  # key -> the load / compile error, so a failing key is tried once


def kernel(key):
    """The kernel for ``key``: from memory, else this package's disk cache ($FLASH_ATTN_CUTE_CACHE,
    default ~/.cache/flash_attn_cute; a new process loads it in milliseconds), else compiled (about
    2 s; rows are symbolic, so one per key) and written there. None when that failed (warned once;
    the caller falls back to Triton)."""
    fn = _kernels.get(key)
    if fn is None:
        if key in _failed:
            return None
        from flash_attn.cute import cache

        with cache._lock:  # one builder per process, as for the attention kernels
            fn = _kernels.get(key)
            if fn is None and key not in _failed:
                try:
                    fn, _origins[key] = load_or_build(key, "sm_90a", cache.cache_dir())
                    _kernels[key] = fn
                except Exception as e:  # a CuTeDSL version the kernel does not compile with: keep training
                    import warnings

                    _failed[key] = e
                    warnings.warn(f"the CuTeDSL norm backward (FLASH_ATTN_DISABLE=ln_cute_bwd turns it off): compiling "
                                  f"it for {key} failed ({type(e).__name__}: {e}); using the Triton backward")
                    return None
    return fn


def launch(key, x, weight, dy, dresidual_out, mean, rstd, dx, dresidual_in, dw_part, db_part) -> None:
    """Fill dx (and dresidual_in) and the (P, N) fp32 partials dw_part (db_part) for ``key`` = plan(...);
    P = dw_part.shape[0] CTAs. The caller sums the partials over P."""
    kernel(key)(x, dy, weight, mean, rstd, dresidual_out if dresidual_out is not None else dy, dx,
                dresidual_in if dresidual_in is not None else dx, dw_part,
                db_part if db_part is not None else dw_part, dw_part.shape[0])
