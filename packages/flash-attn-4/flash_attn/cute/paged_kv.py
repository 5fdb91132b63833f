"""Paged K / V for the Hopper forward (varlen only): K and V are (num_pages, page_size, Hk, D) and each
sequence's keys are the pages its row of the page table names, in order (call_varlen takes the page table
where cu_seqlens_k goes, and seqused_k gives the key counts)."""
import cutlass
import cutlass.cute as cute

from flash_attn.cute.hopper_helpers import tma_tiles


class PagedKV:
    """Owns the paged addressing of K and V: their views, the TMA box of ``box_rows`` rows (min(page_size,
    block_n): whole pages, or block_n rows of one page) and each key block's loads, block_n / box_rows boxes
    for K and for V, each from its own page. box_rows 0: not paged."""

    def __init__(self, box_rows, block_n, head_dim, head_dim_v, varlen):
        self.box_rows = int(box_rows)
        self.block_n, self.head_dim, self.head_dim_v = block_n, head_dim, head_dim_v
        if self.box_rows and (not varlen or self.box_rows % 8 or block_n % self.box_rows):
            raise ValueError(f"paged {box_rows}: varlen only, with boxes of a multiple of 8 rows that divide "
                             f"block_n ({block_n})")

    def __bool__(self):
        return self.box_rows > 0

    def views(self, mK, mV):
        """K / V (num_pages, page_size, Hk, D) -> (page_size, D, Hk, num_pages), V^T (D, page_size, Hk,
        num_pages): the dense views with pages for batch entries (host side)."""
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        return mK, mVt

    def boxes(self, sK_box, sVt_box):
        """The (K, V^T) shared-memory boxes of one TMA copy and the box's key rows (host side)."""
        rows = self.box_rows if cutlass.const_expr(self.box_rows) else self.block_n
        if cutlass.const_expr(rows != self.block_n):
            sK_box = cute.composition(sK_box, (rows, self.head_dim))
            sVt_box = cute.composition(sVt_box, (self.head_dim_v, rows))
        return sK_box, sVt_box, rows

    @cute.jit
    def load(self, tma_k, mK, tma_v, mVt, sK, sVt, k_pipe, v_pipe, k_state, v_state, head_kv, n_block,
             page_table, sequence, seqlen_k):
        """Key block n_block of a paged sequence: box c holds keys n_block * BN + c * PB + [0, PB) from their
        page (page_table[sequence, key // page_size], rows key % page_size on). A box past the sequence's
        last key reads its last page instead (its keys are masked), so that no page table entry past the
        sequence's pages is read and every box lands on the stage's barrier."""
        BN, PB, D, Dv = self.block_n, self.box_rows, self.head_dim, self.head_dim_v
        page_size = cute.size(mK, mode=[0])
        # K's stage first, then V's (which frees later, after P V), as the dense producer does. The box loops
        # are not unrolled: unrolled, the producer's 24 registers spill at d192 (7 boxes of 16 rows).
        k_pipe.producer_acquire(k_state)
        sK_s = sK[None, None, k_state.index]
        for c in cutlass.range(BN // PB, unroll=1):
            key = cutlass.min(n_block * BN + c * PB, seqlen_k - 1)
            page = page_table[sequence, key // page_size]
            gK = cute.local_tile(mK[None, None, head_kv, page], (PB, D), (None, 0))  # (PB, D, page_size / PB)
            sK_c = sK_s if cutlass.const_expr(PB == BN) else cute.local_tile(sK_s, (PB, D), (c, 0))
            tKsK, tKgK = tma_tiles(tma_k, sK_c, gK)
            cute.copy(tma_k, tKgK[None, (key % page_size) // PB], tKsK,
                      tma_bar_ptr=k_pipe.producer_get_barrier(k_state))
        v_pipe.producer_acquire(v_state)
        sVt_s = sVt[None, None, v_state.index]
        for c in cutlass.range(BN // PB, unroll=1):
            key = cutlass.min(n_block * BN + c * PB, seqlen_k - 1)
            page = page_table[sequence, key // page_size]
            gVt = cute.local_tile(mVt[None, None, head_kv, page], (Dv, PB), (0, None))  # (Dv, PB, page_size / PB)
            sVt_c = sVt_s if cutlass.const_expr(PB == BN) else cute.local_tile(sVt_s, (Dv, PB), (0, c))
            tVsV, tVgV = tma_tiles(tma_v, sVt_c, gVt)
            cute.copy(tma_v, tVgV[None, (key % page_size) // PB], tVsV,
                      tma_bar_ptr=v_pipe.producer_get_barrier(v_state))
