"""exp2 on the FMA pipe, for the softmax: a share of the exponentials is computed with FADD / FFMA and
integer ops instead of MUFU.EX2, whose 16 results per SM per clock co-limit the Hopper forward at head
dim 64 (one exponential per 4 * 64 MMA FLOPs there).

Method (Cody-Waite range reduction, as in Cephes-style exp2): for x <= 0 (or -inf),
  xc = max(x, -127)                   -inf and everything below -127 land on -127
  t  = xc + 1.5 * 2^23                round to nearest: the low mantissa bits of t hold j = round(xc)
  f  = xc - (t - 1.5 * 2^23)          exact, in [-0.5, 0.5]
  p  = 1 + f (c1 + f (c2 + f c3 ...)) minimax for 2^f in relative error, p(0) = 1 exactly
  2^x = bits(p) + (bits(t) << 23)     adds j to p's exponent (the magic number's bits shift out)
Every step is exact except the polynomial and its fp32 evaluation, so 2^x's relative error is the
polynomial's (degree 3: 1.0e-4, degree 4: 2.9e-6, measured in tests/cute/test_cute_compile.py). x = 0 gives
exactly 1.0, x <= -127 (and -inf) exactly 0.0; for x < -125.5 the exponent field underflows and the
result is some value below 2^-125 instead of the denormal 2^x (harmless next to a row maximum of 1).

The sequence is one inline-PTX block with explicit .rn rounding, so neither LLVM nor ptxas may
reassociate (t - M) back to xc or contract anything: what runs is what exp2_poly_reference mirrors.
"""
import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 1 + f (c1 + f (c2 + ...)): relative-error minimax coefficients for 2^f on [-0.5, 0.5] with the
# constant term held at 1 (fitted with Lawson's iteratively reweighted least squares, rounded to fp32).
EXP2_POLY = {
    2: (0.7029359340667725, 0.23985956609249115),
    3: (0.6932829022407532, 0.24221037328243256, 0.05500858277082443),
    4: (0.6931241750717163, 0.24024099111557007, 0.05590637028217316, 0.009582818485796452),
}
MAGIC = 12582912.0  # 1.5 * 2^23: x + MAGIC rounds x to an integer held in the low mantissa bits
X_MIN = -127.0


def _ptx_f32(v):
    """A fp32 immediate in PTX's exact hex form, 0fXXXXXXXX."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


def _ptx(degree):
    c = EXP2_POLY[degree]
    m, lo = _ptx_f32(MAGIC), _ptx_f32(X_MIN)
    lines = [
        "{",
        ".reg .f32 %e2_x, %e2_t, %e2_r, %e2_f, %e2_p;",
        ".reg .b32 %e2_ti, %e2_pi;",
        f"max.f32 %e2_x, $1, {lo};",
        f"add.rn.f32 %e2_t, %e2_x, {m};",
        f"sub.rn.f32 %e2_r, %e2_t, {m};",
        "sub.rn.f32 %e2_f, %e2_x, %e2_r;",
        f"mov.f32 %e2_p, {_ptx_f32(c[-1])};",
    ]
    lines += [f"fma.rn.f32 %e2_p, %e2_p, %e2_f, {_ptx_f32(ck)};" for ck in (*reversed(c[:-1]), 1.0)]
    lines += [
        "mov.b32 %e2_ti, %e2_t;",
        "mov.b32 %e2_pi, %e2_p;",
        "shl.b32 %e2_ti, %e2_ti, 23;",
        "add.s32 %e2_pi, %e2_pi, %e2_ti;",
        "mov.b32 $0, %e2_pi;",
        "}",
    ]
    return "\n".join(lines)


@dsl_user_op
def exp2_poly(x, degree=3, *, loc=None, ip=None):
    """2^x for x <= 0 or -inf (tiny positive x from rounding is fine too), on the FMA / ALU pipes: a
    degree-``degree`` polynomial (2, 3 or 4) after range reduction; see the module docstring."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _ptx(degree), "=f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def emulated_columns(n, emu_per_16):
    """Which of a row's n values (in the thread's fragment order) use exp2_poly: emu_per_16 of every
    16, spread evenly (Bresenham), so MUFU and FMA work interleave. A compile-time choice."""
    return [(k * emu_per_16) // 16 != ((k + 1) * emu_per_16) // 16 for k in range(n)]


def exp2_poly_reference(x, degree=3):
    """exp2_poly's arithmetic on CPU with torch, step for step (fp32, round to nearest; the fused
    multiply-adds through float64, exact for the product and then rounded twice, which differs from
    one rounding by at most an ulp in rare ties)."""
    import torch

    c = EXP2_POLY[degree]
    x = torch.as_tensor(x, dtype=torch.float32)
    f32 = torch.float32

    def fma(a, b, cc):
        return (a.double() * b.double() + cc).to(f32)

    xc = torch.clamp_min(x, X_MIN)  # max.f32 with a NaN-free input; -inf -> X_MIN
    t = xc + torch.tensor(MAGIC, dtype=f32)
    r = t - torch.tensor(MAGIC, dtype=f32)
    f = xc - r
    p = torch.full_like(f, c[-1])
    for ck in (*reversed(c[:-1]), 1.0):
        p = fma(p, f, ck)
    bits = p.view(torch.int32).long() + (t.view(torch.int32).long() << 23)
    bits = ((bits + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)  # 32-bit wrap-around, as add.s32
    return bits.view(f32)
