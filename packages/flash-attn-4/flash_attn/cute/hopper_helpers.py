"""Small trace-time helpers shared by the Hopper kernels: TMA partitions, swizzled shared-memory layouts (and the
atom that fits a tile's width) and an opaque register move."""
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op


def tma_tiles(atom, s, g, modes=2):
    """(smem, gmem) views of one CTA's TMA copy ``atom``: the first ``modes`` modes of the shared tile ``s``
    and of the global tiles ``g`` form the copied box (no cluster multicast)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, modes),
                                 cute.group_modes(g, 0, modes))


def smem_layout(kind, dtype, shape, order=None):
    """A WGMMA-compatible swizzled smem layout of ``shape`` (first two modes: the MMA operand's), tiled with
    the layout atom in ``order`` (default: mode 0 first)."""
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, shape, order=order or tuple(range(len(shape))))


def k_atom_for(width, dtype):
    """The widest K-major swizzle atom kind (rows of 128, 64 or 32 bytes) whose row divides ``width`` elements of
    ``dtype``: a tile of that width, or tiles of it side by side, start each row on an atom (as WGMMA operand
    descriptors and tiled partitions need)."""
    kinds = warpgroup.SmemLayoutAtomKind
    for nbytes, kind in ((128, kinds.K_SW128), (64, kinds.K_SW64), (32, kinds.K_SW32)):
        if (width * dtype.width) % (nbytes * 8) == 0:
            return kind
    raise ValueError(f"no K-major swizzle atom divides a row of {width} {dtype} elements")


@dsl_user_op
def opaque(x, *, loc=None, ip=None):
    """x (Int32) through a volatile inline-asm move the compiler cannot see through: values computed from it
    are recomputed where they are needed (and can no longer be proven loop invariant) rather than kept live
    from an earlier identical computation. The backward keeps the swizzled shared-memory addresses of its
    BLOCK_M = 128 loop's stores in the loop with it (a few integer operations per block; hoisted, 24 of them
    held 24 registers across the loop and ptxas spilled)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))
