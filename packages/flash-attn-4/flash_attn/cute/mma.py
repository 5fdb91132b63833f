"""The Hopper forward's two consumer WGMMAs: S = Q K^T from shared memory and O += P V with P from registers."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T


class ConsumerMma:
    """Owns the consumers' matrix products: the tiled WGMMAs (one 64-row slice per consumer warpgroup), a
    consumer thread's operand views and accumulators, P's conversion from the S accumulator (pack_p: pairwise
    into 32-bit registers) and the GEMM issue."""

    def __init__(self, dtype, head_dim, head_dim_v, block_m, block_n, num_mma_warpgroups, persistent):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.block_m = block_m
        self.block_n = block_n
        self.num_mma_warpgroups = num_mma_warpgroups
        # P converted pairwise into 32-bit registers that the P V WGMMA reads as they are (to_p). The
        # element-wise conversion leaves one 16-bit value per register and packs the pairs next to each
        # WGMMA, after its fence: at the 160-register budget ptxas then injects a warpgroup.arrive per
        # WGMMA (C7519, d64 BLOCK_N 96-112) or spills (BLOCK_N 128: 112 bytes); packed, d64 BLOCK_N 128
        # is clean. Off for 2 warpgroups at head dims 64 and 128, whose tuned SASS uses the element-wise form; on for
        # the others, where the S, P and O accumulators (D / 2 + 3 BLOCK_N / 4 registers) fill the
        # 240-register budget too: d256 at BLOCK_N 80 with element-wise P gets 8 injected
        # warpgroup.arrive (C7519) around the P V WGMMAs, packed none. On in the persistent kernel at d128,
        # where the element-wise conversion takes 2 F2FP per pair in the key-block loop (64, not 32; at
        # d64 it stays at 32 and packing adds 12 instructions to the loop's steady-state path).
        # Also on for blocks of more than 128 keys (2 warpgroups, d128): element-wise, BLOCK_N 176 spills
        # 348 bytes with 10 injected warpgroup.arrive (C7519); packed it is clean (ptxas 13.0, sm_90a).
        self.pack_p = (num_mma_warpgroups == 3 or head_dim not in (64, 128) or (persistent and head_dim == 128)
                       or block_n > 128)

    def tiled_mmas(self):
        """(S = Q K^T, O += P V) tiled WGMMAs (host side). P stays in registers (converted from the S
        accumulator) and feeds the second WGMMA directly."""
        dt = self.dtype
        tiled_mma_qk = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, self.block_n, 16), warpgroup.OperandSource.SMEM,
                OperandMajorMode.K, OperandMajorMode.K)),
            (self.num_mma_warpgroups, 1, 1))
        tiled_mma_pv = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, self.head_dim_v, 16), warpgroup.OperandSource.RMEM,
                OperandMajorMode.K, OperandMajorMode.MN)),
            (self.num_mma_warpgroups, 1, 1))
        return tiled_mma_qk, tiled_mma_pv

    def fragments(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, ctid):
        """A consumer thread's operand views and accumulators, O zeroed and the softmax state reset
        (trace time, no control flow)."""
        dt, Dv, BM, BN = self.dtype, self.head_dim_v, self.block_m, self.block_n
        thr_qk = tiled_mma_qk.get_slice(ctid)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        # The shared-memory operands are the same for all 128 threads of a warpgroup: partition them
        # with the warpgroup's first thread, a warp-uniform index, so that ptxas can build the WGMMA
        # descriptors in uniform registers (with ctid it computes them per thread and moves each one
        # with R2UR before every WGMMA).
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((BM, BN)), Float32)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((BM, Dv)), Float32)
        acc_O.fill(0.0)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((BM, BN)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((BM, Dv)))
        # The S accumulator's value order matches the register A operand of m64nDk16 when its N/8 column
        # groups are split into (2, N/16) (checked by tests/cute/test_cute_compile.py).
        p_layout = cute.make_layout(((2, 2, 2), 1, BN // 16))
        if cutlass.const_expr(self.pack_p):
            # P as 32-bit registers of two values each, the A operand a view of them (see to_p)
            rP = cute.make_rmem_tensor((cute.size(acc_S) // 2,), Int32)
            tOrP = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=dt), p_layout)
        else:
            rP = cute.make_rmem_tensor_like(acc_S, dt)
            tOrP = cute.make_tensor(rP.iterator, p_layout)

        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        corr = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return wg, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max, row_sum, corr

    @cute.jit
    def to_p(self, acc_S, rP):
        """P = the softmax numerators (acc_S) in the input dtype, round to nearest even. pack_p: one
        cvt.rn.{bf16x2,f16x2}.f32 per pair into a 32-bit register (a goes to the upper half, so value
        2i + 1 is a and 2i is b: the little-endian order of the bf16 view tOrP)."""
        if cutlass.const_expr(self.pack_p):
            op = "cvt.rn.bf16x2.f32 $0, $2, $1;" if cutlass.const_expr(self.dtype == cutlass.BFloat16) else \
                "cvt.rn.f16x2.f32 $0, $2, $1;"
            for i in cutlass.range_constexpr(cute.size(rP)):
                rP[i] = Int32(llvm.inline_asm(T.i32(), [Float32(acc_S[2 * i]).ir_value(),
                                                        Float32(acc_S[2 * i + 1]).ir_value()],
                                              op, "=r,f,f", has_side_effects=False, is_align_stack=False,
                                              asm_dialect=llvm.AsmDialect.AD_ATT))
        else:
            rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def gemm_qk(self, tiled_mma_qk, acc_S, tSrQ, tSrK, stage):
        """S = Q K^T of one key block (stage: K's), one commit group."""
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(tiled_mma_qk, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
            tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def gemm_pv(self, tiled_mma_pv, acc_O, tOrP, tOrV, stage):
        """O += P V of one key block (stage: V's), one commit group."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.block_n // 16):
            cute.gemm(tiled_mma_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
        warpgroup.commit_group()
