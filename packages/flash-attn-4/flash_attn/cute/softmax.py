"""The Hopper forward's online softmax (Milakov & Gimelshein 2018) on WGMMA score accumulators, in fp32
with exp2 and the scale's log2(e) folded in."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

from flash_attn.cute.softmax_exp import emulated_columns, exp2_poly


def tree(op, values):
    """op folded over values as a balanced tree (trace time: emits log2(n) levels of independent ops)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def pin(acc_S, row_sum, corr, tag):
    """Ends a softmax branch of the main loop: every value it computed passes through a side-effecting
    inline asm (a mov ptxas folds away), so LLVM cannot sink the two branches' common tail (the second
    row's exponentials) into the join block, nor move exponentials below the P V wait that follows it,
    where ptxas then issues them after the wait (the softmax no longer overlaps P V). The tag differs per
    branch so that the two asm statements are not identical either."""
    op = f"mov.b32 $0, $1; // pin {tag}"
    for t in (acc_S, row_sum, corr):
        for i in range(cute.size(t)):
            t[i] = Float32(llvm.inline_asm(T.f32(), [Float32(t[i]).ir_value()], op, "=f,f",
                                           has_side_effects=True, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


class OnlineSoftmax:
    """Owns a consumer thread's softmax of one score block after another: the running row max and sum, the
    factor that rescales O, soft-capping, and which exponentials run on the FMA pipe (exp2_emu of every 16,
    a degree-exp2_emu_degree polynomial, softmax_exp.py) instead of MUFU.EX2. Accumulator of an m64nNk16
    WGMMA: per thread ((2 cols, 2 rows, N/8 col groups), 1, 1), value (c, r, j) at index c + 2 r + 4 j; the
    row's other columns live in the 3 other threads of its quad (lanes 4q..4q+3)."""

    def __init__(self, block_n, head_dim_v, exp2_emu, exp2_emu_degree):
        self.block_n = block_n
        self.head_dim_v = head_dim_v
        self.exp2_emu = int(exp2_emu)
        self.exp2_emu_degree = int(exp2_emu_degree)

    @cute.jit
    def cap(self, acc_S, score_scale, softcap):
        """Soft-capping: s -> softcap * tanh(scale * s / softcap) (the scale is in score_scale)."""
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            acc_S[i] = softcap * cute.math.tanh(acc_S[i] * score_scale, fastmath=True)

    @cute.jit
    def step(self, acc_S, row_max, row_sum, corr, scale_log2):
        """One score block, in place: acc_S becomes exp2(scale * (s - new max)) (fp32), row_max / row_sum
        are updated and corr gets the factor exp2(scale * (old max - new max)) that rescales the rows of O."""
        num_col_groups = self.block_n // 8
        for r in cutlass.range_constexpr(2):
            idx = [c + 2 * r + 4 * j for j in range(num_col_groups) for c in range(2)]
            # Pairwise trees, not a chain: 2N/8 dependent max/add steps would leave the warp waiting
            # on latency (only two or three consumer warps share a scheduler).
            m_new = tree(cute.arch.fmax, [acc_S[i] for i in idx] + [row_max[r]])
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=1))
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=2))
            # A row with no visible key so far keeps max -inf; subtract 0 then so exp2 gives 0.
            m_scaled = m_new * scale_log2
            if m_new == -Float32.inf:
                m_scaled = Float32(0.0)
            corr[r] = cute.math.exp2(row_max[r] * scale_log2 - m_scaled, fastmath=True)
            row_max[r] = m_new
            for i, emu in zip(idx, emulated_columns(len(idx), self.exp2_emu)):
                if cutlass.const_expr(emu):
                    acc_S[i] = exp2_poly(acc_S[i] * scale_log2 - m_scaled, self.exp2_emu_degree)
                else:
                    acc_S[i] = cute.math.exp2(acc_S[i] * scale_log2 - m_scaled, fastmath=True)
            # partial over this thread's columns; the quad is summed at the end
            row_sum[r] = row_sum[r] * corr[r] + tree(lambda a, b: a + b, [acc_S[i] for i in idx])

    @cute.jit
    def rescale(self, acc_O, corr):
        """O's rows times corr (O was final up to the previous block's max)."""
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(self.head_dim_v // 8):
                for c in cutlass.range_constexpr(2):
                    acc_O[c + 2 * r + 4 * j] = acc_O[c + 2 * r + 4 * j] * corr[r]
