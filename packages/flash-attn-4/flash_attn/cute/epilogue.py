"""The Hopper forward's epilogue: a tile's O and lse from the consumers' registers to global memory."""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync, warp

from flash_attn.cute.hopper_helpers import tma_tiles

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class Epilogue:
    """Owns the end of a tile: O / l and the lse, the sink logit (an extra softmax term with no value),
    and how O is written: a direct store from registers (split-KV: fp32 parts for the host's combine), or
    with tma_o through shared memory and one TMA store per consumer warpgroup. The one-tile kernel stores
    through Q's buffer, free once the tile's last S = Q K^T is done; the persistent kernel, whose producer
    loads the next tile's Q under the epilogue, through an O buffer of its own, and waits for a tile's store
    (its reads of the buffer) only before the next tile's epilogue writes it, so that it runs under the
    next tile's main loop. pack: the kernel's PackGQA (each row has its own query head)."""

    def __init__(self, dtype, head_dim, head_dim_v, pack, split, sink, tma_o, persistent, num_mma_warpgroups):
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.pack = pack
        self.split = split
        self.sink = sink
        self.tma_o = tma_o
        self.persistent = persistent
        self.num_mma_warpgroups = num_mma_warpgroups

    def tma_atom(self, mO, sQ_layout):
        """Host side, tma_o: the store's atom and coordinate tensor. One warpgroup's 64 rows of Q's buffer
        (the first ones; the kernel offsets the others) go out as one (64, D) box per warpgroup; rows past
        Sq are clipped by TMA."""
        D = self.head_dim
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                           cute.composition(sQ_layout, (64, D)), (64, D))

    def load_sink(self, mSink, head, m_block, tOcO):
        """The head's sink logit times log2(e) (0 without a sink; packed: one per row of the thread, each of
        its own query head), loaded before the main loop so that its latency hides behind it."""
        sink_log2 = Float32(0.0)
        if cutlass.const_expr(self.sink):
            if cutlass.const_expr(self.pack.packed):
                G = self.pack.group
                sink_log2 = [mSink[head * G + self.pack.row(tOcO[2 * r][0], m_block)[1]] * LOG2_E
                             for r in range(2)]
            else:
                sink_log2 = mSink[head] * LOG2_E
        return sink_log2

    @cute.jit
    def store(self, mO, mLSE, acc_O, row_max, row_sum, tOcO, scale_log2, sink_log2, ctid, m_block, head,
              batch, q_start, seqlen_q, tma_o=None, sQ=None, tiled_mma_pv=None):
        """O / l and lse = ln(sum exp(scale * s)) = (max * scale_log2 + log2 l) * ln 2; a row with no
        visible key gets O = 0 and lse = +inf. With a sink (sink_log2 = sink * log2 e) the sum gains
        exp(sink): O / l' and lse = ln(sum exp(scale * s) + exp(sink)), so a row with no visible key
        gets O = 0 and lse = sink. tma_o: O through the shared-memory buffer sQ and a TMA store
        (_store_o_tma). Packed: ``head`` is the KV head and sink_log2 a pair, one per row of the thread."""
        dt, D, G = self.dtype, self.head_dim_v, self.pack.group  # D: O's head dim
        if cutlass.const_expr(self.split):
            dt = Float32  # a part's O, for the host's combine
        lane = ctid % 32
        gO = mO[None, None, head, batch]  # (Sq, D)
        for r in cutlass.range_constexpr(2):
            l = row_sum[r]
            l += cute.arch.shuffle_sync_bfly(l, offset=1)
            l += cute.arch.shuffle_sync_bfly(l, offset=2)
            inv = Float32(0.0)
            lse = Float32.inf
            if cutlass.const_expr(self.sink):
                # Rebase l (relative to the row max) and the sink term to their common max. A row with no
                # visible key has m2 = -inf and l = 0: its scale exp2(m2 - m) is 0 and l becomes exp2(0);
                # when the sink is -inf too, m = 0 keeps every difference free of inf - inf.
                sink_r = sink_log2[r] if G > 1 else sink_log2
                m2 = row_max[r] * scale_log2
                m = cute.arch.fmax(m2, sink_r)
                if m == -Float32.inf:
                    m = Float32(0.0)
                rescale = cute.math.exp2(m2 - m, fastmath=True)
                l = l * rescale + cute.math.exp2(sink_r - m, fastmath=True)
                if l > 0.0:
                    inv = rescale / l
                    lse = (m + cute.math.log2(l)) * LN_2
            else:
                if l > 0.0:
                    inv = 1.0 / l
                    lse = (row_max[r] * scale_log2 + cute.math.log2(l)) * LN_2
            row, j = self.pack.row(tOcO[2 * r][0], m_block)  # the query position (and head, packed)
            head_q = head
            if cutlass.const_expr(G > 1):
                head_q = head * G + j
                gO = mO[None, None, head_q, batch]
            if cutlass.const_expr(tma_o is not None):
                for j in cutlass.range_constexpr(D // 8):
                    for c in cutlass.range_constexpr(2):
                        acc_O[c + 2 * r + 4 * j] = acc_O[c + 2 * r + 4 * j] * inv
                if row < seqlen_q and lane % 4 == 0:
                    mLSE[row, head_q, batch] = lse
            else:
                if row < seqlen_q:
                    for j in cutlass.range_constexpr(D // 8):
                        for c in cutlass.range_constexpr(2):
                            i = c + 2 * r + 4 * j
                            gO[q_start + row, tOcO[i][1]] = (acc_O[i] * inv).to(dt)
                    if lane % 4 == 0:
                        mLSE[q_start + row, head_q, batch] = lse
        if cutlass.const_expr(tma_o is not None):
            self._store_o_tma(tma_o, mO, sQ, tiled_mma_pv, acc_O, ctid, m_block, head, batch)

    @cute.jit
    def _store_o_tma(self, tma_o, mO, sQ, tiled_mma_pv, acc_O, ctid, m_block, head, batch):
        """O (acc_O, already divided by l) into Q's buffer with stmatrix, then this warpgroup's 64 rows to
        global memory with one TMA store. Persistent kernel: sQ is O's own buffer, which the previous tile's
        store may still be reading: the warpgroup's issuing thread waits for those reads first (then the
        warpgroup syncs), and the new store is not waited for here but before the next tile's epilogue (and at
        the end of the consumers' tile loop). Q's rows of this warpgroup are read only by its own S = Q K^T
        WGMMAs, all complete here (their last wait_group(0)), and Q's TMA load landed before the main loop
        (q_pipe.consumer_wait), so each warpgroup syncs only its own 128 threads. ptxas 13.0 then keeps the
        main loop's pipeline indices and WGMMA descriptors in per-thread registers (d128: 13 R2UR and 28
        more instructions per key block); a direct store without its row < Sq branch does the same, and
        neither an opaque smem address nor opaque coordinates here avoid it (the cause is unknown)."""
        dt, D = self.dtype, self.head_dim
        wg = cute.arch.make_warp_uniform(ctid // 128)
        if cutlass.const_expr(self.persistent):
            if ctid % 128 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=self.num_mma_warpgroups + 1 + wg, number_of_threads=128)
        rO = cute.make_rmem_tensor_like(acc_O, dt)
        rO.store(acc_O.load().to(dt))
        copy_o = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dt), tiled_mma_pv)
        thr_o = copy_o.get_slice(ctid)
        cute.copy(copy_o, thr_o.retile(rO), thr_o.partition_D(sQ))
        # The generic-proxy stores must be visible to the async proxy (TMA) before it reads the tile.
        cute.arch.fence_proxy("async.shared", space="cta")
        # Named barriers 1..NW are the GEMM turns (the consumers' main loop); NW + 1 + wg is this warpgroup's own.
        cute.arch.barrier(barrier_id=self.num_mma_warpgroups + 1 + wg, number_of_threads=128)
        if ctid % 128 == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (64, D), (None, 0))  # (64, D, Sq / 64)
            tOsO, tOgO = tma_tiles(tma_o, cute.local_tile(sQ, (64, D), (wg, 0)), gO)
            cute.copy(tma_o, tOsO, tOgO[None, m_block * self.num_mma_warpgroups + wg])
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.persistent):
                # The CTA's shared memory must stay until TMA has read it: wait for the reads, not the writes.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
