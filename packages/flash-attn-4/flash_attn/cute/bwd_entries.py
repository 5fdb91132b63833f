"""The host side of the Hopper backward kernel (flash_bwd_sm90.FlashBwdSm90 inherits it): one entry point per calling
convention the compiled kernels have, each handing _host (views, shared-memory layouts, tiled MMAs, TMA atoms, grid,
launch) the kernel's tensors and runtime values.

Layouts, as PyTorch lays them out: mQ / mdO (B, Sq, H, D); mK / mV (B, Sk, Hk, D); mLSE2 / mDelta (B, H, Sq_pad) fp32
(lse in log2 units, +inf past Sq; delta = rowsum(dO * O) - dlse, 0 past Sq); mdQaccum (B, Sq, H, D) fp32 (zeroed by
the caller, receives softmax_scale * dS K); mdK / mdV (B, Sk, H, D) in the input dtype (per query head: GQA sums on
the host; a kernel built with gqa_loop: (B, Sk, Hk, D), the group summed in the kernel). Varlen: the packed tensors
as one batch entry (B = 1), sequence b's rows from cu_seqlens_q[b] / cu_seqlens_k[b], its lse2 / delta rows from
(cu_seqlens_q[b] // block_m + b) * block_m (seqlen_info.BwdSeqlens). Deterministic: mSem (B or sequences, H,
query blocks) int32 zeros, the turn counters (bwd_dq.DqAccumulator); with dq_first_store (call_first_store) the same
shape holds the query blocks' tickets, and mdQaccum need not be zeroed. softcap > 0 is read by a kernel built with
softcap=True, the window sizes (>= 0) by one built with local=True."""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from flash_attn.cute.bwd_dq import permuted_tile_layout
from flash_attn.cute.bwd_parts import lse_stage_floats
from flash_attn.cute.hopper_helpers import k_atom_for, smem_layout

LOG2_E = math.log2(math.e)


class BwdEntries:
    """The entry points and the host side of the launch (views, shared-memory layouts, tiled MMAs, TMA atoms, grid)."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, softmax_scale: Float32, stream):
        """Dense, no window, no softcap."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, None)

    @cute.jit
    def call_first_store(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                         mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                         mdV: cute.Tensor, mSem: cute.Tensor, softmax_scale: Float32, stream):
        """Dense, no window, no softcap, built with dq_first_store: mSem the query blocks' tickets (int32 zeros)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, mSem)

    @cute.jit
    def call_softcap_first_store(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                                 mdV: cute.Tensor, mSem: cute.Tensor, softmax_scale: Float32, softcap: Float32,
                                 window_left: Int32, window_right: Int32, stream):
        """call_general's arguments after the tickets, for a kernel built with softcap and dq_first_store (no window:
        the sizes are not read)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, mSem,
                   softcap)

    @cute.jit
    def call_general(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                     mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                     mdV: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                     window_right: Int32, stream):
        """Dense with a sliding window (local=True) and / or softcap (softcap=True)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream,
                   (window_left, window_right) if cutlass.const_expr(self.local) else None, None, None, softcap)

    @cute.jit
    def call_deterministic(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                           mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                           mdV: cute.Tensor, mSem: cute.Tensor, softmax_scale: Float32, softcap: Float32, stream):
        """Dense, deterministic=True (no window)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, mSem,
                   softcap)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                    mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                    mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedQ: cute.Tensor,
                    mSeqUsedK: cute.Tensor, max_seqlen_k: Int32, softmax_scale: Float32, softcap: Float32,
                    window_left: Int32, window_right: Int32, stream):
        """Varlen (varlen=True): int32 cu_seqlens (sequences + 1,), the rows each sequence uses from its start
        (sequences,), max_seqlen_k at least the longest used key count (the grid's x)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream,
                   (window_left, window_right) if cutlass.const_expr(self.local) else None,
                   (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k), None, softcap)

    @cute.jit
    def call_varlen_deterministic(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                                  mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                                  mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                                  mSeqUsedQ: cute.Tensor, mSeqUsedK: cute.Tensor, mSem: cute.Tensor,
                                  max_seqlen_k: Int32, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                                  window_right: Int32, stream):
        """call_varlen with deterministic=True (no window)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None,
                   (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k), mSem, softcap)

    @cute.jit
    def call_varlen_mods(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                         mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                         mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                         mSeqUsedQ: cute.Tensor, mSeqUsedK: cute.Tensor, max_seqlen_k: Int32, softmax_scale: Float32,
                         stream, aux, scalars):
        """call_varlen for a kernel built with varlen=True and mods (no softcap or block sparsity): aux and
        scalars as call_mods'."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None,
                   (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k), None, aux=aux, scalars=scalars)

    @cute.jit
    def call_varlen_mods_local(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                               mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                               mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                               mSeqUsedQ: cute.Tensor, mSeqUsedK: cute.Tensor, max_seqlen_k: Int32,
                               softmax_scale: Float32, window_left: Int32, window_right: Int32, stream, aux, scalars):
        """call_varlen_mods for a kernel built with local=True too: the window sizes (>= 0) after the scale."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream,
                   (window_left, window_right), (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k), None,
                   aux=aux, scalars=scalars)

    @cute.jit
    def call_mods_local(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                        mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                        mdV: cute.Tensor, softmax_scale: Float32, window_left: Int32, window_right: Int32, stream, aux,
                        scalars):
        """call_mods for a kernel built with local=True too (a score_mod with a sliding window; no block sparsity):
        the window sizes (>= 0) after the scale."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream,
                   (window_left, window_right), None, None, aux=aux, scalars=scalars)

    @cute.jit
    def call_mods(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                  mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                  softmax_scale: Float32, stream, aux, sparse, scalars):
        """Dense, built with mods (no softcap; a window: call_mods_local): aux, the mods' aux tensors (a tuple; None
        for a kernel built without); sparse, the per-key-block lists of query blocks (a tuple; None for a kernel built
        without); scalars, the mods' aux scalars (a tuple; None for a kernel built without)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, None,
                   aux=aux, sparse=sparse, scalars=scalars)

    @cute.jit
    def _host(self, mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, window, seqs, sem,
              softcap=None, aux=None, sparse=None, scalars=None):
        # (B, S, H, D) -> (S, D, H, B): the first two modes are the tile, the others index the CTA.
        (mQ, mK, mV, mdO, mdQaccum, mdK, mdV), (mLSE2, mDelta) = self.seqlens.views(
            (mQ, mK, mV, mdO, mdQaccum, mdK, mdV), (mLSE2, mDelta))

        dt, D, BM, BN, stages = self.dtype, self.head_dim, self.block_m, self.block_n, self.num_stages
        MN_SW128 = warpgroup.SmemLayoutAtomKind.MN_SW128
        # The D-wide tiles in the widest swizzle atom whose row (64 / 32 / 16 elements) divides D: 128-byte
        # atoms at D = 64 / 128, 64-byte ones at D = 96 (192-byte rows). split_d: Q^T and dO^T are B operands of
        # dK and dV split by D between the warpgroups, so a half of D starts on an atom (64-byte atoms at D = 192).
        d_atom = k_atom_for(D // 2 if self.split_d else D, dt)
        Dv = self.head_dim_v  # V's, dO's and dV's (D but for the 192 / 128 pair)
        dv_atom = k_atom_for(Dv // 2 if self.split_d else Dv, dt)
        sQ_layout = smem_layout(d_atom, dt, (BM, D, stages))
        sdO_layout = smem_layout(dv_atom, dt, (BM, Dv, stages))
        # With dq_split, K^T's D rows are split between the warpgroups as WGMMA N: each half must start
        # on a swizzle atom, so D = 64 uses 64-byte (32-element) atoms and D = 96 (halves of 48) 32-byte
        # (16-element) ones. (Split by rows, dQ's N is all of D: K keeps D's atoms.)
        k_atom = k_atom_for(D // 2, dt) if self.dq_split and not self.dq_rows else d_atom
        sK_layout = smem_layout(k_atom, dt, (BN, D))
        sV_layout = smem_layout(dv_atom, dt, (BN, Dv))  # (split_d: the TMA dV box is a half of Dv)
        # dS as the A operand of dQ = dS K, M-major (queries contiguous): the S^T accumulator holds
        # pairs of adjacent queries, which then land as 4-byte stores. Two buffers, so that a warpgroup
        # writes block j + 1's dS while a slower warp may still be in block j's dQ WGMMA.
        sdS_layout = smem_layout(MN_SW128, dt, (BM, BN, 2))
        # each stage's lse2 / delta row 128-byte aligned, as a TMA destination must be
        sLSE_layout = cute.make_layout((BM, stages), stride=(1, lse_stage_floats(BM)))

        # S^T = K Q^T and dP^T = V dO^T: keys on M (64 per warpgroup), queries on N. split_d: the 64 keys are both
        # warpgroups', which split the queries (N = BM / 2 each); dV and dK split N = D between them, A (P^T, dS^T)
        # from shared memory.
        wg_n = self.NUM_MMA_WARPGROUPS if self.split_d else 1
        atoms = (1, self.NUM_MMA_WARPGROUPS, 1) if self.split_d else (self.NUM_MMA_WARPGROUPS, 1, 1)
        tiled_mma_sdp = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, BM // wg_n, 16), warpgroup.OperandSource.SMEM,
                OperandMajorMode.K, OperandMajorMode.K)),
            atoms)
        # dV += P^T dO: A = P^T from the S^T accumulator's registers, B the transposed (D-contiguous,
        # MN-major) view of the dO tile.
        tiled_mma_dv = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, Dv // wg_n, 16),
                warpgroup.OperandSource.SMEM if cutlass.const_expr(self.split_d) else warpgroup.OperandSource.RMEM,
                OperandMajorMode.K, OperandMajorMode.MN)),
            atoms)
        # dK += dS^T Q: A = dS^T read back from shared memory (it is there for dQ anyway; from registers
        # it would stay live next to the dQ accumulator and push D = 128 past 240 registers), B = Q^T.
        # BLOCK_M = 128 (D = 64): A from the 16-bit dS^T registers, as P^T for dV (they fit there,
        # and an m64n64k16 with both operands in smem reads 4 KB per 32 tensor-core clocks, all of sm_90's
        # 128 bytes per clock).
        tiled_mma_dk = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, D // wg_n, 16),
                warpgroup.OperandSource.RMEM if cutlass.const_expr(self.wide) else warpgroup.OperandSource.SMEM,
                OperandMajorMode.K, OperandMajorMode.MN)),
            atoms)
        # dQ = dS K, A = the M-major dS tile, B = K^T (D contiguous, MN-major). dq_split: N = D split over
        # the two warpgroups, K = all BLOCK_N keys; else one warpgroup's MMA over its own 64 keys.
        # dq_rows: M = BM split over the warpgroups, N = D.
        dq_n, dq_atoms = (D // 2, (1, self.NUM_MMA_WARPGROUPS, 1)) if self.dq_split else (D, (1, 1, 1))
        if cutlass.const_expr(self.dq_rows):
            dq_n, dq_atoms = D, (self.NUM_MMA_WARPGROUPS, 1, 1)
        tiled_mma_dq = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, dq_n, 16), warpgroup.OperandSource.SMEM,
                OperandMajorMode.MN, OperandMajorMode.MN)),
            dq_atoms)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, cute.slice_(sQ_layout, (None, None, 0)), (BM, D))
        tma_do, mdO_tma = cpasync.make_tiled_tma_atom(
            g2s, mdO, cute.slice_(sdO_layout, (None, None, 0)), (BM, Dv))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, sK_layout, (BN, D))
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s, mV, sV_layout, (BN, Dv))
        row_layout = cute.make_layout(BM)
        tma_lse, mLSE2_tma = cpasync.make_tiled_tma_atom(g2s, mLSE2, row_layout, (BM,))
        tma_delta, mDelta_tma = cpasync.make_tiled_tma_atom(g2s, mDelta, row_layout, (BM,))
        # dQ tile for the TMA reduce-add (dq_tma): two unswizzled fp32 buffers in config.permuted_column's layout, one
        # TMA box each (bwd_dq.store_permuted; TMA drops rows past Sq). Without dq_tma no tile is allocated (the
        # kernel's layout argument is then a swizzled one, never used).
        if cutlass.const_expr(self.dq_tma):
            sdQ_layout = permuted_tile_layout(BM, D)
        else:
            sdQ_layout = smem_layout(k_atom_for(D // 2 if self.dq_split and not self.dq_rows else D, Float32),
                                     Float32, (BM, D, 2))
        tma_dq, mdQ_tma = None, None
        if cutlass.const_expr(self.dq_tma):
            tma_dq, mdQ_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD), mdQaccum,
                cute.slice_(sdQ_layout, (None, None, 0)), (BM, D))
        tma_dq_st = None  # first_store: the query block's first tile is stored, not added
        if cutlass.const_expr(self.first_store):
            tma_dq_st, _ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdQaccum,
                                                       cute.slice_(sdQ_layout, (None, None, 0)), (BM, D))

        # dK / dV by TMA (tma_dkv): the stores' atoms and coordinate tensors (bwd_epilogue.DkvEpilogue)
        (tma_dk, mdK_tma), (tma_dv, mdV_tma) = self.dkv.tma_atoms(mdK, mdV, sK_layout, sV_layout)

        # one CTA per key block and query head, or with gqa_loop per KV head (it walks its group's query heads)
        grid = (cute.ceil_div(cute.size(mK, mode=[0]), BN),
                cute.size(mK if cutlass.const_expr(self.gqa_loop) else mQ, mode=[2]), cute.size(mQ, mode=[3]))
        if cutlass.const_expr(self.lpt > 0):
            grid = (grid[0] * grid[1] * grid[2], 1, 1)
        tile_seqs = (None, None, None, None)
        if cutlass.const_expr(seqs is not None):  # x over the longest key sequence, z over the sequences
            grid = (cute.ceil_div(seqs[4], BN), cute.size(mQ, mode=[2]), cute.size(seqs[0], mode=[0]) - 1)
            tile_seqs = seqs[:4]
        # exp2 with log2(e) folded into the scale; soft-capped scores are softcap * tanh(scale * s / softcap): the
        # scale goes into the tanh argument, softcap * log2(e) multiplies the tanh.
        scale_log2 = softmax_scale * LOG2_E
        if cutlass.const_expr(self.mods is not None):
            if cutlass.const_expr(self.mods.score_mod is not None):  # the scores score_mod returns carry the scale
                scale_log2 = Float32(LOG2_E)
        cap = (None, None)
        if cutlass.const_expr(self.softcap):
            cap = (softmax_scale / softcap, softcap * LOG2_E)
            scale_log2 = Float32(1.0)
        self.kernel(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma, tma_do, mdO_tma, tma_lse, mLSE2_tma,
                    tma_delta, mDelta_tma, mdQaccum, tma_dq, mdQ_tma, mdK, mdV, tma_dk, tma_dv, mdK_tma, mdV_tma,
                    scale_log2,
                    softmax_scale, cute.size(mQ, mode=[0]), sQ_layout, sdO_layout, sK_layout, sV_layout,
                    sdS_layout, sdQ_layout, sLSE_layout, tiled_mma_sdp, tiled_mma_dv, tiled_mma_dk,
                    tiled_mma_dq, *(window if cutlass.const_expr(self.local) else (None, None)), *tile_seqs, sem, *cap,
                    aux, sparse, scalars, tma_dq_st).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream,
            # .minnctapersm 1 pins the register count at entry (65536 / 384 threads); without it ptxas
            # may ignore setmaxnreg (C7508) and cap the consumers at 168 registers.
            min_blocks_per_mp=1)
