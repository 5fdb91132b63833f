"""Which keys each query row sees, for the Hopper kernels.

Masks are bottom-right aligned: query row i's diagonal is key i + Sk - Sq. A row sees every key below Sk;
with ``causal`` only those up to its diagonal; with ``local`` those in [diagonal - window_left, diagonal +
window_right] (runtime sizes >= 0; a causal window is local with window_right = 0).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn.cute.pack_gqa import packed_row


class AttentionMask:
    """Owns a kernel's mask at block and element granularity: the key blocks a query tile visits, the
    blocks among them that need no element mask, and the -inf masking of a score tile; for the backward
    (whose tiles are S^T, keys by rows) the query blocks a key block meets and the transposed element mask.
    block_m: query rows (positions) per tile; block_n: keys per block; pack_gqa: query heads packed into a
    tile (forward only; tile row -> position via packed_row)."""

    def __init__(self, causal, local, block_m, block_n, pack_gqa=1):
        self.causal = bool(causal) and not local
        self.local = bool(local)
        self.block_m = block_m
        self.block_n = block_n
        self.pack_gqa = pack_gqa

    def n_block_range(self, m_block, seqlen_q, seqlen_k, window_left=None, window_right=None):
        """[n_block_min, n_block_max) of the key blocks query tile m_block sees (trace time): all; up to
        the diagonal (causal); or the window around it (local)."""
        BM, BN = self.block_m, self.block_n
        n_block_min = Int32(0)
        n_block_max = cute.ceil_div(seqlen_k, BN)
        if cutlass.const_expr(self.causal or self.local):
            last_col = (m_block + 1) * BM + seqlen_k - seqlen_q  # exclusive bound of visible keys
            if cutlass.const_expr(self.local):
                last_col = last_col + window_right
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(last_col, 0), BN))
        if cutlass.const_expr(self.local):
            first_col = m_block * BM + seqlen_k - seqlen_q - window_left  # first key row m_block * BM sees
            n_block_min = cutlass.max(first_col, 0) // BN
        return n_block_min, n_block_max

    def unmasked_blocks(self, m_block, seqlen_q, seqlen_k, window_left=None, window_right=None):
        """[below, from): the key blocks in which every row of the tile sees every key (trace time). Outside
        it: the sequence's tail block, keys past a row's diagonal (causal) or outside its window (local)."""
        BM, BN = self.block_m, self.block_n
        below = Int32(0)
        above = seqlen_k // BN
        if cutlass.const_expr(self.causal or self.local):
            first_hidden = m_block * BM + seqlen_k - seqlen_q
            if cutlass.const_expr(self.local):
                first_hidden = first_hidden + window_right
            above = cutlass.min(above, cutlass.max(first_hidden + 1, 0) // BN)
        if cutlass.const_expr(self.local):
            # the last row of the tile sees keys from (m_block + 1) * BM - 1 + Sk - Sq - window_left on
            below = cute.ceil_div(cutlass.max((m_block + 1) * BM - 1 + seqlen_k - seqlen_q - window_left, 0), BN)
        return below, above

    @cute.jit
    def apply(self, acc_S, tScS, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right):
        """-inf for the scores of acc_S (tile coordinates tScS, key block n_block) whose key the row does not
        see; keys past Sk are there too (TMA zero-fills them)."""
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            row, _ = packed_row(tScS[i][0], m_block, self.block_m, self.pack_gqa)  # the query position
            col = n_block * self.block_n + tScS[i][1]
            masked = col >= seqlen_k
            if cutlass.const_expr(self.causal):
                masked = masked | (col > row + seqlen_k - seqlen_q)
            if cutlass.const_expr(self.local):
                diag = row + seqlen_k - seqlen_q
                masked = masked | (col > diag + window_right) | (col < diag - window_left)
            if masked:
                acc_S[i] = -Float32.inf

    # Backward: tiles are S^T, one key block per CTA. Window sizes (local) are >= 0 here (the host sends calls with a
    # negative size elsewhere).

    def m_block_range(self, n_block, seqlen_q, seqlen_k, window_left=None, window_right=None):
        """[m_block_min, m_block_max) of the query blocks that see key block n_block: query i sees key j iff
        j <= i + Sk - Sq (causal) or i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right (local)."""
        BM, BN = self.block_m, self.block_n
        m_block_max = cute.ceil_div(seqlen_q, BM)
        m_block_min = Int32(0)
        if cutlass.const_expr(self.causal):
            m_block_min = cutlass.max(n_block * BN + seqlen_q - seqlen_k, 0) // BM
        if cutlass.const_expr(self.local):
            # the first query whose window reaches the block's first key, the last whose reaches its last key
            m_block_min = cutlass.max(n_block * BN - window_right + seqlen_q - seqlen_k, 0) // BM
            last = (n_block + 1) * BN - 1 + window_left + seqlen_q - seqlen_k
            m_block_max = cutlass.min(m_block_max, cute.ceil_div(cutlass.max(last + 1, 0), BM))
        return m_block_min, m_block_max

    def m_block_mask_end(self, n_block, seqlen_q, seqlen_k):
        """The query blocks below this one need the element mask: those crossing key block n_block's diagonal
        (causal), every one (local: either edge of the window may cross the block), else none."""
        end = Int32(0)
        if cutlass.const_expr(self.causal):
            end = cute.ceil_div(cutlass.max((n_block + 1) * self.block_n - 1 + seqlen_q - seqlen_k, 0), self.block_m)
        if cutlass.const_expr(self.local):
            end = cute.ceil_div(seqlen_q, self.block_m)
        return end

    @cute.jit
    def apply_transposed(self, acc_S, tScS, m_block, n_block, seqlen_q, seqlen_k, window_left=None,
                         window_right=None):
        """-inf in S^T (tScS: (key, query) coordinates) for keys past Sk (TMA zero-fills them; unmasked they
        would give P^T = 2^-lse2 rows, harmless for dV but an overflow risk in dQ) and for keys right of each
        query's diagonal (causal) or outside its window (local)."""
        # local: key - diagonal = base + (tile key - tile query); one scalar for the block keeps registers free
        base = n_block * self.block_n - m_block * self.block_m - (seqlen_k - seqlen_q)
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            key = n_block * self.block_n + tScS[i][0]
            masked = key >= seqlen_k
            if cutlass.const_expr(self.causal):
                query = m_block * self.block_m + tScS[i][1]
                masked = masked | (key > query + seqlen_k - seqlen_q)
            if cutlass.const_expr(self.local):
                off = base + (tScS[i][0] - tScS[i][1])
                masked = masked | (off > window_right) | (off < -window_left)
            if masked:
                acc_S[i] = -Float32.inf
