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
    """Owns the host's views of Q, K, V, O and the lse, and how grid z maps to a CTA's sequence in them
    (device side, trace time). Dense: batch entry
    z of the views, every sequence Sq x Sk. Varlen: sequence z is rows [cu_seqlens_q[z], cu_seqlens_q[z +
    1]) of the packed tensors (batch index 0), its keys the seqused_k[z] rows from cu_seqlens_k[z] (paged:
    its pages, cu_seqlens_k being the page table). Split-KV: z = split * B + b."""

    def __init__(self, varlen, paged, split):
        self.varlen = varlen
        self.paged = paged
        self.split = split

    def dense_views(self, mQ, mK, mV, mO, mLSE):
        """Host side: the kernel's (S, D, H, B) views of dense (B, S, H, D) Q, K, O, the (D, Sk, Hk, B) view
        of V (the B operand of O = P V, N = D contiguous: MN-major) and the (Sq, H, B) view of the (B, H, Sq)
        lse; the first two modes are the tile, the others index the CTA. Split-KV's parts are batch entries."""
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        return mQ, mK, mVt, mO, mLSE

    def varlen_views(self, mQ, mK, mV, mO, mLSE, paged_kv, split):
        """Host side: packed (T, H, D) tensors as the dense views with one batch entry, the sequences being
        row offsets into it; with split, split-KV's (S, T, H, Dv) O and (S, H, T) lse with the parts as batch
        entries; paged K / V as PagedKV's views."""
        unit = cute.make_layout(1)
        mQ = cute.make_tensor(mQ.iterator, cute.append(cute.select(mQ.layout, mode=[0, 2, 1]), unit))
        if cutlass.const_expr(split):
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        else:
            mO = cute.make_tensor(mO.iterator, cute.append(cute.select(mO.layout, mode=[0, 2, 1]), unit))
            mLSE = cute.make_tensor(mLSE.iterator, cute.append(cute.select(mLSE.layout, mode=[1, 0]), unit))
        if cutlass.const_expr(self.paged):
            mK, mVt = paged_kv.views(mK, mV)  # cu_seqlens_k is the page table
        else:
            mK = cute.make_tensor(mK.iterator, cute.append(cute.select(mK.layout, mode=[0, 2, 1]), unit))
            mVt = cute.make_tensor(mV.iterator, cute.append(cute.select(mV.layout, mode=[2, 0, 1]), unit))
        return mQ, mK, mVt, mO, mLSE

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


class BwdSeqlens:
    """The backward kernel's SeqlenInfo: its host views and where grid z's sequence is. Dense: batch entry z,
    every sequence Sq x Sk. Varlen: sequence z is the used_q[z] rows from cu_seqlens_q[z] of packed Q, dO, dQ and
    its keys the used_k[z] rows from cu_seqlens_k[z] of packed K, V, dK, dV, which the host hands over as dense
    tensors of one batch entry (the dense kernel's views and TMA descriptors); its lse2 / delta rows start at
    (cu_seqlens_q[z] // block_m + z) * block_m, the host having padded each sequence to a multiple of block_m
    (+inf / 0: the padded queries contribute nothing). The start is a multiple of block_m because a TMA tile
    load's innermost coordinate must fall on 16 bytes (an unaligned one is an illegal instruction). A tile that runs past
    its sequence reads the next one's rows (finite values, which the +inf lse2 and the key mask zero out) and adds
    nothing to them: its dQ rows past the sequence are exact zeros, its dK / dV rows are not stored."""

    def __init__(self, varlen, block_m):
        self.varlen = varlen
        self.block_m = block_m

    def views(self, rows, lse_rows):
        """Host side: (S, D, H, B) views of the (B, S, H, D) tensors ``rows`` (varlen: B = 1, S the packed rows)
        and (S, H, B) views of the (B, H, S) fp32 rows ``lse_rows``; the first modes are the tile, the others index
        the CTA."""
        rows = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in rows]
        lse_rows = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in lse_rows]
        return rows, lse_rows

    def tile(self, z, seqlen_q, mK, seqs):
        """Device side: grid z's sequence (a TileSeqlens with ``lse_start`` and ``z``); seqs = (cu_seqlens_q,
        cu_seqlens_k, used_q, used_k) for varlen, dense seqlen_q and mK's rows otherwise."""
        if cutlass.const_expr(self.varlen):
            cu_q, cu_k, used_q, used_k = seqs
            q_start = cu_q[z]
            tile = TileSeqlens(Int32(0), q_start, cu_k[z], used_q[z], used_k[z], sequence=z)
            tile.lse_start = (q_start // self.block_m + z) * self.block_m
        else:
            tile = TileSeqlens(z, Int32(0), Int32(0), seqlen_q, cute.size(mK, mode=[0]))
            tile.lse_start = Int32(0)
        tile.z = z
        return tile

    def rows(self, t, start, head, tile):
        """The 2-D (rows, D) view of head ``head`` of the sequence's rows of ``t`` ((S, D, H, B); TMA
        coordinate tensors too), row 0 at ``start`` (its q_start / k_start) for varlen."""
        v = t[None, None, head, tile.batch]
        if cutlass.const_expr(self.varlen):
            v = cute.domain_offset((start, 0), v)
        return v

    def lse_rows(self, t, head, tile):
        """The sequence's lse2 / delta rows of head ``head`` ((S_pad, H, B) view)."""
        v = t[None, head, tile.batch]
        if cutlass.const_expr(self.varlen):
            v = cute.domain_offset((tile.lse_start,), v)
        return v
