"""The Hopper backward's dK / dV epilogue (flash_bwd_sm90.py's component)."""
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from flash_attn.cute.hopper_helpers import tma_tiles

# Named barriers of the TMA epilogue: the loop's are 1 and 2 (bwd_dq.TURN_BARRIER's note), and one id never serves
# two thread counts at once (an illegal instruction): the 256-thread barrier that K and V are dead, then each
# warpgroup's own.
_DEAD_KV_BARRIER = 5
_WG_BARRIER = 3


class DkvEpilogue:
    """How a key block's dK (scaled by softmax_scale) and dV leave the consumers' accumulators: each value by a 16-bit
    store (rows past the sequence's keys dropped), or with ``tma_dkv`` through the K and V tiles in shared memory (dead
    after the loop) by stmatrix and one TMA store per warpgroup and tensor of its 64 keys. TMA clips only at the
    tensor's end: on varlen calls a sequence's last partial key block takes the direct stores. ``split_d``: the
    warpgroups share the block's 64 keys and hold half of D each, so each stores its (64, D / 2) box (dV: of
    ``head_dim_v``)."""

    def __init__(self, dtype, head_dim, block_n, num_mma_warpgroups, tma_dkv, varlen, seqlens, split_d=False,
                 head_dim_v=None):
        self.dtype = dtype
        self.head_dim = head_dim
        self.block_n = block_n
        self.num_mma_warpgroups = num_mma_warpgroups
        self.tma_dkv = tma_dkv
        self.varlen = varlen
        self.seqlens = seqlens
        self.split_d = split_d
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        # one warpgroup's TMA stores of dK and of dV
        self.boxes = tuple((64, d // num_mma_warpgroups if split_d else d) for d in (head_dim, self.head_dim_v))

    def tma_atoms(self, mdK, mdV, sK_layout, sV_layout):
        """Host side, tma_dkv: (atom, coordinate tensor) of the dK and the dV stores, one (64, D) box of the K / V
        tile's layout per warpgroup; (None, None) of each without it."""
        if not self.tma_dkv:
            return (None, None), (None, None)
        (bk, bv), s2g = self.boxes, cpasync.CopyBulkTensorTileS2GOp()
        return (cpasync.make_tiled_tma_atom(s2g, mdK, cute.composition(sK_layout, bk), bk),
                cpasync.make_tiled_tma_atom(s2g, mdV, cute.composition(sV_layout, bv), bv))

    @cute.jit
    def store(self, mdK, mdV, tma_dkv, sK, sV, tiled_mmas, acc_dK, acc_dV, tdKcdK, softmax_scale, ctid, wg, n_block,
              head, tile, seqlen_k):
        """dK and dV of key block n_block of head ``head`` (the KV head with gqa_loop) of the sequence ``tile``; tma_dkv:
        (tma_dk, tma_dv, mdK_tma, mdV_tma) from tma_atoms; tiled_mmas: the dK and the dV tiled MMAs, tdKcdK the
        coordinates of their accumulators' values."""
        if cutlass.const_expr(self.tma_dkv and self.varlen):
            if (n_block + 1) * self.block_n <= seqlen_k:  # the block ends inside its sequence (CTA-uniform)
                self._store_tma(tma_dkv, sK, sV, tiled_mmas, acc_dK, acc_dV, softmax_scale, ctid, wg, n_block, head,
                                tile)
            else:
                self._store_direct(mdK, mdV, acc_dK, acc_dV, tdKcdK, softmax_scale, n_block, head, tile, seqlen_k)
        elif cutlass.const_expr(self.tma_dkv):
            self._store_tma(tma_dkv, sK, sV, tiled_mmas, acc_dK, acc_dV, softmax_scale, ctid, wg, n_block, head,
                            tile)
        else:
            self._store_direct(mdK, mdV, acc_dK, acc_dV, tdKcdK, softmax_scale, n_block, head, tile, seqlen_k)

    @cute.jit
    def _store_direct(self, mdK, mdV, acc_dK, acc_dV, tdKcdK, softmax_scale, n_block, head, tile, seqlen_k):
        """dK = scale * dS^T Q (the scale of S = scale * Q K^T), dV as accumulated; rows past Sk dropped."""
        dt, BN = self.dtype, self.block_n
        gdK = self.seqlens.rows(mdK, tile.k_start, head, tile)  # (Sk, D)
        gdV = self.seqlens.rows(mdV, tile.k_start, head, tile)
        ck, cv = tdKcdK
        if cutlass.const_expr(self.head_dim_v == self.head_dim):  # one row test for both
            for i in cutlass.range(cute.size(acc_dK), unroll_full=True):
                row = n_block * BN + ck[i][0]
                if row < seqlen_k:
                    gdK[row, ck[i][1]] = (acc_dK[i] * softmax_scale).to(dt)
                    gdV[row, ck[i][1]] = acc_dV[i].to(dt)
        else:
            for i in cutlass.range(cute.size(acc_dK), unroll_full=True):
                if n_block * BN + ck[i][0] < seqlen_k:
                    gdK[n_block * BN + ck[i][0], ck[i][1]] = (acc_dK[i] * softmax_scale).to(dt)
            for i in cutlass.range(cute.size(acc_dV), unroll_full=True):
                if n_block * BN + cv[i][0] < seqlen_k:
                    gdV[n_block * BN + cv[i][0], cv[i][1]] = acc_dV[i].to(dt)

    @cute.jit
    def _store_tma(self, tma_dkv, sK, sV, tiled_mmas, acc_dK, acc_dV, softmax_scale, ctid, wg, n_block, head, tile):
        """dK (scaled) and dV through the K and V tiles: stmatrix of each warpgroup's 64 keys, then one TMA store per
        tensor of those rows."""
        dt, D = self.dtype, self.head_dim
        # K is read by both warpgroups' dQ WGMMAs (all keys; split_d: V by both dP^T ones); each waited for its own
        # before the loop ended, so past this barrier no WGMMA reads K or V.
        cute.arch.barrier(barrier_id=_DEAD_KV_BARRIER, number_of_threads=128 * self.num_mma_warpgroups)
        atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), dt)
        for acc, smem, mma, scale in ((acc_dK, sK, tiled_mmas[0], softmax_scale), (acc_dV, sV, tiled_mmas[1], None)):
            stsm = cute.make_tiled_copy_C(atom, mma)
            thr = stsm.get_slice(ctid)
            r = cute.make_rmem_tensor_like(acc, dt)
            r.store((acc.load() if scale is None else acc.load() * scale).to(dt))
            cute.copy(stsm, thr.retile(r), thr.partition_D(smem))
        # The generic-proxy stores must be visible to the async proxy (TMA) before it reads the tiles; each
        # warpgroup stores only its own box, so it syncs only its 128 threads.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=_WG_BARRIER + wg, number_of_threads=128)
        if ctid % 128 == 0:
            tma_dk, tma_dv, mdK, mdV = tma_dkv
            if cutlass.const_expr(self.split_d):  # the block's keys, this warpgroup's half of D
                bk, bv = self.boxes
                gdK = cute.local_tile(self.seqlens.rows(mdK, tile.k_start, head, tile), bk, (None, None))
                gdV = cute.local_tile(self.seqlens.rows(mdV, tile.k_start, head, tile), bv, (None, None))
                tKs, tKg = tma_tiles(tma_dk, cute.local_tile(sK, bk, (0, wg)), gdK)
                tVs, tVg = tma_tiles(tma_dv, cute.local_tile(sV, bv, (0, wg)), gdV)
                cute.copy(tma_dk, tKs, tKg[None, n_block, wg])
                cute.copy(tma_dv, tVs, tVg[None, n_block, wg])
            else:  # this warpgroup's 64 keys, all of D
                gdK = cute.local_tile(self.seqlens.rows(mdK, tile.k_start, head, tile), (64, D), (None, 0))
                gdV = cute.local_tile(self.seqlens.rows(mdV, tile.k_start, head, tile), (64, D), (None, 0))
                tKs, tKg = tma_tiles(tma_dk, cute.local_tile(sK, (64, D), (wg, 0)), gdK)
                tVs, tVg = tma_tiles(tma_dv, cute.local_tile(sV, (64, D), (wg, 0)), gdV)
                rows = n_block * self.num_mma_warpgroups + wg
                cute.copy(tma_dk, tKs, tKg[None, rows])
                cute.copy(tma_dv, tVs, tVg[None, rows])
            cute.arch.cp_async_bulk_commit_group()
            # The CTA's shared memory must stay until TMA has read it: wait for the reads, not the writes.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

