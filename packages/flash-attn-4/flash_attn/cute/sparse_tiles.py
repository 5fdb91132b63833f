"""Block sparsity in the Hopper forward (FA4's ``block_sparse_tensors``, FlexAttention's block mask): per query tile,
a list of partially masked key blocks (the mask_mod runs on them) and optionally a list of fully computed ones (no
mask_mod); the tile visits those blocks and no other. The host side (checks, shapes, FlexAttention's BlockMask) is
block_sparsity.py.

Device view (kernel argument ``sparse``, a tuple): (mask_cnt, mask_idx) or (mask_cnt, mask_idx, full_cnt, full_idx),
Int32 tensors (Bs, Hs, M) and (Bs, Hs, M, N'), Bs in {1, B} and Hs in {1, H} (1: shared by every batch entry / head).
A sparse query block is q_factor kernel tiles, a sparse key block kv_factor kernel key blocks (compile-time factors).

The tile's walk: positions 0 .. (mask_cnt + full_cnt) * kv_factor - 1, the partial blocks' key blocks first, then the
full ones'. The producer's loads and the consumers' masks map a position to its key block through ``block``; the
pipeline stages and the warpgroups' turns count positions, as they do for a dense walk (tile_scheduler.key_block).
The native masks (keys past Sk, causal, window) still apply on the key block itself, so a listed block outside them
is masked, never read as visible.
"""
import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@dataclasses.dataclass(frozen=True)
class TileSparsity:
    """One CTA's lists (trace-time object of runtime values; frozen, so that CuTeDSL's loops read it without
    carrying it): ``count`` positions, the first ``masked`` of them partial; b / h / m index the tensors."""
    sparse: tuple
    b: object
    h: object
    m: object
    mask_cnt: object
    count: object
    masked: object
    kv_factor: int

    @cute.jit
    def block(self, pos):
        """The key block at walk position ``pos``."""
        f = self.kv_factor
        j = pos // f
        nb = Int32(0)
        if cutlass.const_expr(len(self.sparse) == 2):
            nb = self.sparse[1][self.b, self.h, self.m, j]
        else:
            if j < self.mask_cnt:
                nb = self.sparse[1][self.b, self.h, self.m, j]
            else:
                nb = self.sparse[3][self.b, self.h, self.m, j - self.mask_cnt]
        return nb * f + (pos - j * f)

    def partial(self, pos):
        """Whether position ``pos`` is in a partially masked block (the mask_mod applies)."""
        return pos < self.masked


class SparseTiles:
    """The kernel's block-sparsity component: whether full-block lists are passed (``has_full``), the sparse block
    in kernel tiles (``q_factor`` query tiles, ``kv_factor`` key blocks). Built by ScoreMods' kernels only."""

    def __init__(self, has_full, q_factor, kv_factor):
        if q_factor < 1 or kv_factor < 1:
            raise ValueError(f"sparse block factors must be >= 1, got q {q_factor}, kv {kv_factor}")
        self.has_full = bool(has_full)
        self.q_factor = int(q_factor)
        self.kv_factor = int(kv_factor)

    def tile(self, sparse, batch, head, m_block):
        """The TileSparsity of query tile m_block of (batch, head) (trace time; reads the counts)."""
        cnt = sparse[0]
        b = cutlass.min(batch, cute.size(cnt, mode=[0]) - 1)  # a size-1 dim is shared
        h = cutlass.min(head, cute.size(cnt, mode=[1]) - 1)
        m = m_block // self.q_factor
        # Counts past an index row's length are cut to it: a bad count never reads outside the tensors.
        mask_cnt = cutlass.min(cnt[b, h, m], cute.size(sparse[1], mode=[3]))
        full_cnt = Int32(0)
        if cutlass.const_expr(self.has_full):
            full_cnt = cutlass.min(sparse[2][b, h, m], cute.size(sparse[3], mode=[3]))
        f = self.kv_factor
        return TileSparsity(sparse, b, h, m, mask_cnt, (mask_cnt + full_cnt) * f, mask_cnt * f, f)
