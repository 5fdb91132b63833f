"""Where a CTA's sequence is in the Hopper forward's views: dense batches, varlen (packed sequences with
cumulative offsets, keys counted by seqused_k), paged K / V, and split-KV's parts along the grid's z."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


class TileSeqlens:
    """One CTA's sequence: its batch index in the input views (``batch``; varlen: 0) and in the outputs
    (``out_batch``), the rows where its queries and keys start (q_start, k_start), its lengths, and for
    varlen its index (``sequence``), for paged K / V the page table, for split-KV (part, parts, out_batch)."""

    def __init__(self, batch, q_start, k_start, seqlen_q, seqlen_k, page_table=None, sequence=None, split=None):
        self.batch = batch
        self.q_start = q_start
        self.k_start = k_start
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.page_table = page_table
        self.sequence = sequence
        self.split = split
        self.out_batch = batch if split is None else split[2]

    @property
    def paging(self):
        """(page table, sequence, key count) for the paged producer, else None."""
        return None if self.page_table is None else (self.page_table, self.sequence, self.seqlen_k)

    def split_blocks(self, n_block_min, n_block_max, block_n):
        """The key blocks of [n_block_min, n_block_max) that this split-KV part runs: part s takes blocks
        [s * per, (s + 1) * per) of the sequence, so the parts partition the blocks of every tile (a part
        with none writes O = 0, lse = +inf: no contribution). Without split, the range as it is."""
        if cutlass.const_expr(self.split is not None):
            part, parts, _ = self.split
            per = cute.ceil_div(cute.ceil_div(self.seqlen_k, block_n), parts)
            n_block_min = cutlass.max(n_block_min, part * per)
            n_block_max = cutlass.min(n_block_max, (part + 1) * per)
        return n_block_min, n_block_max


class SeqlenInfo:
    """Owns how grid z and the views map to a CTA's sequence (device side, trace time). Dense: batch entry
    z of the views, every sequence Sq x Sk. Varlen: sequence z is rows [cu_seqlens_q[z], cu_seqlens_q[z +
    1]) of the packed tensors (batch index 0), its keys the seqused_k[z] rows from cu_seqlens_k[z] (paged:
    its pages, cu_seqlens_k being the page table). Split-KV: z = split * B + b."""

    def __init__(self, varlen, paged, split):
        self.varlen = varlen
        self.paged = paged
        self.split = split

    def tile(self, z, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, num_splits):
        if cutlass.const_expr(self.varlen):
            seq = z
            split = None
            if cutlass.const_expr(self.split):
                # the part's O / lse rows go to batch index `split` of the views
                seqs = cute.size(mCuSeqlensQ, mode=[0]) - 1
                seq = z % seqs
                split = (z // seqs, num_splits, z // seqs)
            q_start = mCuSeqlensQ[seq]
            seqlen_q = mCuSeqlensQ[seq + 1] - q_start
            if cutlass.const_expr(self.paged):
                k_start = Int32(0)  # the sequence's keys are its pages
                page_table = mCuSeqlensK
            else:
                k_start = mCuSeqlensK[seq]
                page_table = None
            seqlen_k = mSeqUsedK[seq]
            return TileSeqlens(Int32(0), q_start, k_start, seqlen_q, seqlen_k, page_table, seq, split)
        if cutlass.const_expr(self.split):
            # batch entry b's inputs, split `split`'s key blocks, outputs at z
            batches = cute.size(mQ, mode=[3])
            batch = z % batches
            return TileSeqlens(batch, Int32(0), Int32(0), cute.size(mQ, mode=[0]), cute.size(mK, mode=[0]),
                               split=(z // batches, num_splits, z))
        return TileSeqlens(z, Int32(0), Int32(0), cute.size(mQ, mode=[0]), cute.size(mK, mode=[0]))
