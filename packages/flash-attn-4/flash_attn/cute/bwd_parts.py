"""Pieces of the Hopper backward kernel (flash_bwd_sm90.py) that stand on their own: the transposed view of a
shared-memory tile, the two-column fp32 reduction of dQ into global memory, and 16-bit packing and exact unpacking
(P^T's whole tensor, or one pair: softcap's tanh derivative), one WGMMA product as a commit group, the lse2 / delta
stage stride in shared memory. Plain functions called while the kernel is traced (their loops and branches are on
trace-time values)."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def lse_stage_floats(block_m):
    """The floats between two stages of the lse2 / delta rows in shared memory: block_m rounded up to 32, so that every
    stage, a TMA destination, starts on 128 bytes (64 and 128 rows: their own width)."""
    return -(-block_m // 32) * 32


def transpose_view(t):
    """The same shared memory seen with its first two modes swapped (an MN-major operand view of a
    K-major tile, or the reverse)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


@dsl_user_op
def red_add_f32x2(ptr, a, b, *, loc=None, ip=None):
    """*ptr += (a, b) as one red.global.add.v2.f32 (sm_90): two adjacent fp32 columns of a dQ row in
    one 8-byte reduction, half the L2 atomic operations of two scalar ones. ptr is 8-byte aligned."""
    f32 = Float32.mlir_type
    pair = vector.from_elements(ir.VectorType.get([2], f32),
                                [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                                loc=loc, ip=ip)
    cute.arch.red(ptr, pair, op="add", dtype=Float32, sem="relaxed", scope="gpu", loc=loc, ip=ip)


def pack_16(acc_S, rP, dtype):
    """rP = acc_S in ``dtype`` (bf16 / fp16), one cvt.rn.{bf16x2,f16x2}.f32 per pair of values into a 32-bit
    word (value 2k in the low half, 2k + 1 in the high half, the order of the 16-bit view). Written
    out because rP is read back value by value (unpack_16): left to LLVM, the pairs are then
    converted one value at a time (F2F, on the pipe of the exponentials, and a PRMT to pack)."""
    rP32 = cute.recast_tensor(rP, Int32)
    for k in range(cute.size(rP32)):
        rP32[k] = pack_pair(acc_S[2 * k], acc_S[2 * k + 1], dtype)


def unpack_16(rP, acc, dtype):
    """acc = the 16-bit values of rP in fp32 (exact). bf16 is the high half of an fp32: a shift or a
    mask of the packed word, no conversion instruction."""
    rP32 = cute.recast_tensor(rP, Int32)
    if dtype == cutlass.BFloat16:
        acc32 = cute.recast_tensor(acc, Int32)
        for k in range(cute.size(rP32)):
            acc32[2 * k] = rP32[k] << 16
            acc32[2 * k + 1] = rP32[k] & Int32(-65536)
    else:
        for k in range(cute.size(rP32)):
            for h in range(2):
                acc[2 * k + h] = unpack_half(rP32[k], h, dtype)


def pack_pair(a, b, dtype):
    """(a, b) fp32 as one 32-bit word of two ``dtype`` (bf16 / fp16) values, a in the low half (cvt.rn.*x2.f32)."""
    op = "cvt.rn.bf16x2.f32 $0, $2, $1;" if dtype == cutlass.BFloat16 else "cvt.rn.f16x2.f32 $0, $2, $1;"
    return Int32(llvm.inline_asm(T.i32(), [Float32(a).ir_value(), Float32(b).ir_value()], op, "=r,f,f",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def unpack_half(word, h, dtype):
    """Half ``h`` (0: low) of a 32-bit word of two ``dtype`` values, in fp32 (exact)."""
    cvt = "cvt.f32.bf16" if dtype == cutlass.BFloat16 else "cvt.f32.f16"
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(word).ir_value()],
        f"{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $1; {cvt} $0, {('lo', 'hi')[h]}; }}",
        "=f,r", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def gemm(tiled_mma, acc, tArA, tBrB, a_stage, b_stage, zero_init=False):
    """acc (+)= A B over the K blocks of the fragments, one WGMMA commit group; a_stage / b_stage index a trailing
    stage mode of A / B (None: the fragment has none)."""
    if zero_init:
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
    warpgroup.fence()
    for k in range(cute.size(tArA, mode=[2])):
        a = tArA[None, None, k] if a_stage is None else tArA[None, None, k, a_stage]
        b = tBrB[None, None, k] if b_stage is None else tBrB[None, None, k, b_stage]
        cute.gemm(tiled_mma, acc, a, b, acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
