"""Helpers that mod authors call inside CuTeDSL score_mod / mask_mod functions (FA4's ``flash_attn.cute.utils``
module path, where FA4's mod definitions and tests import them from).

- ``scalar_to_ssa(value, dtype)``: a one-element TensorSSA of ``dtype`` holding ``value`` (a Python number or a
  runtime cutlass value), to combine a scalar with the index TensorSSAs a mod receives (``n_idx <= m_idx +
  scalar_to_ssa(offset, cutlass.Int32)``).
- ``shr_u32(x, n)`` / ``shl_u32(x, n)``: 32-bit logical shifts with PTX's semantics for counts of 32 or more (the
  result is 0, where a plain ``>>`` / ``<<`` of LLVM is undefined), for mods that build key bitmasks.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def scalar_to_ssa(value, dtype, *, loc=None, ip=None):
    """A TensorSSA of shape (1,) and element type ``dtype`` holding ``value``."""
    frag = cute.make_rmem_tensor(1, dtype)
    frag[0] = dtype(value)
    return frag.load()


def _shift(op, x, n, loc, ip):
    return Uint32(llvm.inline_asm(T.i32(), [Uint32(x).ir_value(loc=loc, ip=ip), Uint32(n).ir_value(loc=loc, ip=ip)],
                                  f"{op}.b32 $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
                                  asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def shr_u32(x, n, *, loc=None, ip=None):
    """x >> n on 32 unsigned bits; 0 when n >= 32 (PTX shr.b32 clamps the count)."""
    return _shift("shr", x, n, loc, ip)


@dsl_user_op
def shl_u32(x, n, *, loc=None, ip=None):
    """x << n on 32 bits; 0 when n >= 32 (PTX shl.b32 clamps the count)."""
    return _shift("shl", x, n, loc, ip)


__all__ = ["scalar_to_ssa", "shr_u32", "shl_u32"]
