"""Attention backward for Hopper (sm_90a) in CuTeDSL, after FlashAttention-2 (Dao 2023, algorithm 2) and
FlashAttention-3 (Shah et al. 2024, section 3): one CTA per (key block, head, batch) keeps its K and V
tiles and the dK, dV accumulators on chip and walks over the query blocks that see it, with Q, dO and
their per-row lse / delta streamed in by TMA through an mbarrier pipeline; dQ is accumulated across
CTAs with fp32 reduce-adds into a global buffer (TMA bulk reduce-adds of a shared-memory tile by
default, as FlashAttention-3 does; per-thread atomics as an option).

Transposed formulation: the consumers compute S^T = K Q^T and dP^T = V dO^T, so keys are the rows of the
accumulators. P^T is then already in the register layout of the A operand of dV += P^T dO (an m64nDk16 WGMMA with A
from registers), and the per-query values lse and delta are per-column constants read from shared memory.

Per query block, for each of the two consumer warpgroups (64 keys each):
  S^T  = K Q^T                     WGMMA, both operands in smem (K-major)
  dP^T = V dO^T                    WGMMA, both operands in smem (K-major)
  P^T  = exp2(S^T * scale * log2(e) - lse2[col])     (lse2 = lse * log2(e), +inf past Sq)
  dV  += P^T dO                    WGMMA, A = P^T from registers, B = dO^T (transposed smem view)
  dS^T = P^T * (dP^T - delta[col]) to smem by stmatrix (M-major dS tile, double-buffered; split_d: plain stores)
  dQ_wg = dS K                     WGMMA over the warpgroup's 64 keys, A = dS (M-major), B = K^T
  dK  += dS^T Q                    WGMMA, A = dS^T from smem, B = Q^T (transposed smem view)
  dq_accum[rows] += scale * dQ     with dq_tma (the default) the scaled tile to shared memory and one
                                   TMA reduce-add of it, issued by one warp behind the next block's dQ and
                                   dK WGMMAs; else red.global.add.v2.f32 (BwdConfig.dq_tma off)
dQ goes out (the loop waits for dV and dQ alone, dO's stage released) while dK still runs: the dQ epilogue and the
reduce-add's issue leave the tensor cores' critical path (the A/B: benchmarks/results/h100/cute_bwd_ab.md).
BLOCK_M = 128 issues dK first, from registers before the dS barrier.
With overlap (BwdConfig.overlap; dK first) the loop is software-pipelined: S^T and dP^T of the next query block
(D = 128 and BLOCK_M = 128: S^T only, for registers) are issued right behind dK and dQ, and this block's dQ goes
out while the tensor cores compute them.
BLOCK_M = 128 (head dim 64 only; the d64 default; bwd.block_m=64 in FLASH_ATTN_CUTE_OVERRIDES gives 64 rows): the
same steps on 128 query rows (S^T, dP^T are m64n128k16, dV, dK have K = 128), with changes that keep a
consumer thread within its 240 registers, spill-free (S^T, dP^T are 64 fp32 registers each, dK, dV 32
each), and the smem traffic down:
  - dS^T = P^T (dP^T - delta) takes P^T from the 16-bit copy the dV WGMMA reads (unpacked exactly), so
    the fp32 S^T dies when P^T is packed, before dP^T is waited for;
  - the swizzled addresses of the dS stores (stmatrix) are computed in the loop, not held across it;
  - the shared dQ tile is split by query rows (each warpgroup m64n64k16 over its 64 rows) instead of by D
    (m64n32k16), so K keeps 128-byte swizzle atoms;
  - dK += dS^T Q takes dS^T from registers (as dV takes P^T), issued before the dS barrier.
With overlap, the next block's S^T is issued once dV is done (P^T dead), behind dK and dQ.
Head dims 64, 96 and 128 (q, k, v alike; BLOCK_M 64 at 96 and 128). A D = 96 row is 192 bytes, no whole
number of 128-byte swizzle atoms: Q, dO and V take 64-byte atoms (32 elements); K takes 32-byte ones (16
elements), so that each warpgroup's 48-column half of K^T, the N of its dQ WGMMA (m64n48k16), starts on an
atom. The fp32 dQ tile is unswizzled at every head dim (config.permuted_column's layout: 16-byte stores per 16
columns of a row, one TMA box per block; bwd_dq.store_permuted).
Head dims 192 and 256 (split_d): 2 x 64 x D fp32 dK / dV accumulators per warpgroup do not fit its registers, so
a CTA takes 64 keys, which both warpgroups share: S^T and dP^T split by query columns (m64n32k16 each), P^T and
dS^T written to shared memory and read back whole as the A operands of dV and dK, which (as dQ) split D between
the warpgroups (m64n{D/2}k16); a barrier of both after the P^T stores, as after the dS^T ones.
BwdConfig.exp2_emu = k (off): k of every 16 exponentials of P^T by softmax_exp.exp2_poly on the FMA pipe, not MUFU.
After the loop dK is scaled by softmax_scale and dK, dV are stored: from the accumulators, or with BwdConfig.tma_dkv
through the dead K and V tiles in shared memory and TMA stores (dense calls). The host (launch.backward, bwd_host.py)
computes delta = rowsum(dO * O) and lse2 and zeroes dq_accum in one Triton launch before, and casts dq_accum to the
input dtype (and sums GQA's dK/dV) in one after.

Layouts seen by the kernel (views built on the host side of __call__, no copies):
  mQ, mdO (Sq, D, H, B); mK, mV (Sk, D, Hk, B); mLSE2, mDelta (Sq_pad, H, B) fp32, Sq_pad a multiple of
  BLOCK_M; mdQaccum (Sq, D, H, B) fp32; mdK, mdV (Sk, D, H, B): per query head (GQA sums on the host).
Varlen (call_varlen): the packed tensors as one batch entry, grid z over the sequences, each CTA's rows found by
seqlen_info.BwdSeqlens (lse2 / delta padded per sequence). tests/cute/test_cute_bwd.py checks it on a Hopper GPU.
"""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator

from flash_attn.cute.bwd_dq import DqAccumulator
from flash_attn.cute.bwd_entries import BwdEntries
from flash_attn.cute.bwd_epilogue import DkvEpilogue
from flash_attn.cute.bwd_parts import gemm, lse_stage_floats, pack_16, pack_pair, transpose_view
from flash_attn.cute.bwd_parts import unpack_16, unpack_half
from flash_attn.cute.bwd_walk import BwdWalk, GroupWalk, RotatedGroupWalk, RotatedWalk
from flash_attn.cute.hopper_helpers import opaque, tma_tiles
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.score_mod import ScoreMods
from flash_attn.cute.seqlen_info import BwdSeqlens
from flash_attn.cute.softmax_exp import EXP2_POLY, emulated_columns, exp2_poly
from flash_attn.cute.sparse_tiles import SparseTiles
from flash_attn.cute.tile_scheduler import lpt_tile


class FlashBwdSm90(BwdEntries, BwdWalk):
    """Compile-time configuration: dtype, head dim, causal, tile sizes and the Q/dO ring depth. Batch,
    sequence lengths, head counts, strides and the scale are runtime values of the compiled kernel."""

    HEAD_DIMS = (64, 96, 128, 192, 256)
    NUM_PRODUCER_THREADS = 128  # one warpgroup; a single thread issues the TMA copies
    NUM_MMA_WARPGROUPS = 2  # 64 keys each
    # 24 * 128 + 240 * 256 <= 64K registers. A consumer thread holds dK and dV (D/2 fp32 each), S^T and
    # dP^T (BLOCK_M/2 each), then P^T in 16 bits and its dQ partial (D/2): 192-208 at D = 128, BLOCK_M = 64.
    PRODUCER_REGS = 24
    CONSUMER_REGS = 240

    def __init__(self, dtype, head_dim, causal, block_m=64, block_n=None, num_stages=2, dq_split=True,
                 dq_tma=False, overlap=False, lpt=0, exp2_emu=0, exp2_emu_degree=3, local=False,
                 varlen=False, deterministic=False, softcap=False, mask_mod=None, aux=False, sparse=None,
                 scalars=(), score_mod=None, score_mod_bwd=None, tma_dkv=False, gqa_loop=False, head_dim_v=None,
                 dq_writer=False, turns_desc=False, dq_first_store=False):
        """head_dim: 64, 96, 128, 192 or 256 (HEAD_DIMS), of q, k and v alike; past 128 the warpgroups split D (split_d
        below) and block_n is 64. head_dim_v: V's (and dO's, dV's) head dim where it differs, with split_d (the
        192 / 128 pair): S^T's K steps run over D, dP^T's over head_dim_v.
        block_m: query rows per step, 64 or (head dim 64 only) 128, see the module docstring.
        local: a sliding window (sizes >= 0 per call, call_general; causal: right = 0), every block masked.
        varlen: packed sequences (call_varlen; seqlen_info.BwdSeqlens), the grid's x over the longest key sequence.
        deterministic: dQ's adds in key-block turns (bwd_dq; turns_desc, causal: descending, the grid reversed).
        softcap: scores s -> softcap * tanh(scale * s / softcap) as in the forward; dS^T = P^T (dP^T - delta) (1 -
        tanh^2), the derivative kept in 16 bits from the P^T step (the rounding dS^T gets anyway); BLOCK_M 64.
        mask_mod / aux: FA4's mask_mod (score_mod.ScoreMods' convention) and whether it reads aux tensors: -inf in
        S^T where it is False (entry call_mods). score_mod / score_mod_bwd: FA4's score_mod and its gradient: S^T's
        scaled scores kept in fp32 registers, score_mod's result in their place before the masks and the
        exponential, and score_mod_bwd(dS^T, scores) as dS^T; BLOCK_M 64.
        sparse: block sparsity, None or (has_full, row factor, walk factor): per sparse key block (row factor kernel
        key blocks) the lists of partial (the mask_mod runs on them) and full sparse query blocks (walk factor kernel
        query blocks each; sparse_tiles.SparseTiles); a CTA walks list positions, mapped to query blocks.
        dq_split: the two warpgroups compute one dQ tile together, each its half of D (block_m 128: its 64 query
        rows) over all BLOCK_N keys (a barrier of both per query block, since each reads the other's dS); else each
        computes dS K over its own 64 keys and both add into dq_accum (twice the atomic traffic, no barrier).
        dq_tma (needs dq_split): the scaled fp32 dQ tile goes to shared memory (two buffers), one warp adds it by TMA
        one query block late, after the next dS barrier (else red.global.add.v2.f32 per thread). dq_writer (dq_tma,
        no overlap): producer warp 1 issues the adds as the consumers hand the tiles over (bwd_dq).
        overlap: software-pipelined query loop: S^T and dP^T of the next query block are issued behind dK and dQ of
        this one and run while this block's dQ goes out; needs num_stages >= 2 (stages j and j + 1 are held at once).
        lpt > 0: a 1-D grid in groups of (head, batch) pairs of about lpt CTAs each, key block slowest
        within a group (longest first under a causal mask); 0: the (key block, head, batch) grid.
        exp2_emu: of every 16 exponentials of P^T a thread computes, this many use softmax_exp.exp2_poly (degree
        exp2_emu_degree) on the FMA pipe instead of MUFU.EX2 (degree 3's 1e-4 relative error is below P^T's rounding).
        tma_dkv: dK and dV go into the (dead) K and V tiles by stmatrix and out by TMA stores (rows past Sk clipped);
        varlen: where the key block ends inside its sequence (TMA clips at the packed tensor's end only).
        gqa_loop: one CTA per (key block, KV head, batch) walks the query blocks of its group's query heads, so dK and
        dV of the group accumulate in registers and are stored once per KV head (mdK / mdV (B, Sk, Hk, D)).
        dq_first_store (dq_tma; entries call_first_store, call_softcap_first_store): dq_accum not zeroed, the first
        CTA at a query block stores its dQ tile (bwd_dq's tickets); without a causal mask the walks are rotated
        (bwd_walk.RotatedWalk); deterministic (call_deterministic): the writer warp's first turn of a block stores."""
        if head_dim not in self.HEAD_DIMS:
            raise ValueError(f"head dim {head_dim} not in {self.HEAD_DIMS}")
        if not 0 <= exp2_emu <= 16 or exp2_emu_degree not in EXP2_POLY:
            raise ValueError(f"exp2_emu {exp2_emu} not in 0..16 or degree {exp2_emu_degree} not in {sorted(EXP2_POLY)}")
        self.exp2_emu = int(exp2_emu)
        self.exp2_emu_degree = int(exp2_emu_degree)
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise ValueError(f"dtype {dtype} not fp16/bf16")
        self.split_d = head_dim > 128  # (the module docstring's head dims 192 and 256)
        want_n = 64 if self.split_d else 64 * self.NUM_MMA_WARPGROUPS
        block_n = want_n if block_n is None else block_n
        if block_n != want_n:
            raise ValueError(f"block_n must be {want_n} at head dim {head_dim} (64 keys per warpgroup; past 128 the "
                             "warpgroups share 64 keys and split D)")
        if block_m not in (64, 128) or (self.split_d and (block_m != 64 or not dq_split)):
            raise ValueError(f"block_m {block_m} not in (64, 128); head dim {head_dim} > 128: block_m 64 and "
                             "dq_split (the split-D loop)")
        if num_stages < 1:
            raise ValueError(f"num_stages {num_stages} < 1")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim if head_dim_v is None else int(head_dim_v)
        if self.head_dim_v != head_dim and (not self.split_d or self.head_dim_v not in self.HEAD_DIMS):
            raise ValueError(f"head_dim_v {self.head_dim_v} with head dim {head_dim}: a v head dim of its own needs "
                             f"head dim > 128 (split_d) and one of {self.HEAD_DIMS}")
        self.causal = bool(causal)
        self.block_m = block_m
        self.block_n = block_n
        self.num_stages = num_stages
        self.dq_split = bool(dq_split)
        self.dq_tma = bool(dq_tma)
        if self.dq_tma and not self.dq_split:
            raise ValueError("dq_tma needs dq_split (the dS barrier of both warpgroups orders the dQ tile)")
        self.overlap = bool(overlap)
        # dQ's WGMMA before dK's, dQ out while dK runs (the module docstring); BLOCK_M = 128 and overlap: dK first
        self.dq_first = block_m == 64 and not self.overlap
        self.p16 = block_m == 128  # dS^T from the 16-bit P^T (the fp32 S^T dies at the packing: registers)
        self.tma_dkv = bool(tma_dkv)
        if lpt < 0:
            raise ValueError(f"lpt {lpt} < 0")
        self.lpt = int(lpt)
        if self.overlap and num_stages < 2:
            raise ValueError(f"overlap needs num_stages >= 2 (got {num_stages}): the consumers wait for the "
                             "next query block's stage while holding the current one")
        if self.overlap and not self.dq_split and (head_dim != 64 or block_m == 128):
            raise ValueError(f"overlap with the per-warpgroup dQ (dq_split=False) at head dim {head_dim}, block_m "
                             f"{block_m}: its dQ accumulator (D wide, or 128 rows) next to the next block's S^T does not "
                             "fit in 240 registers (ptxas serialises the WGMMAs; at D = 128 it also spills ~500 bytes)")
        if block_m == 128 and head_dim != 64:
            raise ValueError(f"block_m 128 needs head dim 64 (got {head_dim}): at D = 128 the dK and dV "
                             "accumulators (128 registers) next to S^T and dP^T (64 each) exceed 240 registers")
        # BLOCK_M = 128: the register-saving changes of the module docstring; dq_rows: the shared dQ tile split
        # between the warpgroups by query rows (m64nDk16 over all 128 keys) instead of by D.
        self.wide = block_m == 128
        self.dq_rows = self.dq_split and self.wide
        self.num_threads = self.NUM_PRODUCER_THREADS + 128 * self.NUM_MMA_WARPGROUPS
        self.local = bool(local)
        self.mask = AttentionMask(self.causal, self.local, block_m, block_n)
        self.varlen = bool(varlen)
        if self.varlen and self.lpt:
            raise ValueError("lpt orders a dense grid (varlen: lpt=0)")
        self.seqlens = BwdSeqlens(self.varlen, block_m)
        self.deterministic = bool(deterministic)
        self.softcap = bool(softcap)
        self.mods = None
        if (score_mod is None) != (score_mod_bwd is None):
            raise ValueError("score_mod and score_mod_bwd go together")
        if mask_mod is not None or score_mod is not None:
            if softcap or deterministic:
                raise ValueError("mask_mod / score_mod: the backward without softcap or determinism")
            if score_mod is not None and block_m != 64:
                raise ValueError("score_mod: block_m 64 (the scaled scores' registers)")
            self.mods = ScoreMods(score_mod, mask_mod, aux, block_m, block_n, scalars=scalars,
                                  score_mod_bwd=score_mod_bwd)
        # P^T in 16 bits only at d128 with the tanh derivative (softcap) or the fp32 scores (score_mod): beside S^T,
        # dP^T, dK and dV they exceed the 240 registers (ptxas spilled 112-232 bytes; h100/cute_bwd_ab.md)
        self.p16 = self.p16 or (head_dim == 128 and (self.softcap or score_mod is not None))
        self.gqa_loop = bool(gqa_loop)
        if self.gqa_loop and (varlen or deterministic or overlap or self.mods is not None or sparse is not None):
            raise ValueError("gqa_loop: the dense backward without determinism, overlap, mods or block sparsity")
        self.sparse = None
        if sparse is not None:
            if varlen or local or softcap or deterministic:
                raise ValueError("sparse: the dense backward without window, softcap or determinism")
            self.sparse = SparseTiles(*sparse)
        if self.softcap and self.wide:
            raise ValueError("softcap needs block_m 64 (the tanh derivative's registers)")
        self.turns_desc = bool(turns_desc) and self.deterministic and self.causal
        if self.deterministic and ((self.dq_tma and not dq_writer) or not self.dq_split or self.lpt or self.local):
            raise ValueError("deterministic needs dq_split, dq_tma off or the writer warp, lpt 0 and no window")
        self.dq_writer = bool(dq_writer) and self.dq_tma and not self.overlap
        self.first_store = bool(dq_first_store)
        # the consumers' tickets (bwd_dq); deterministic: the writer warp stores at a block's first turn instead
        self.tickets = self.first_store and not self.deterministic
        if self.first_store and (self.overlap or self.local or self.varlen or self.mods is not None
                                 or self.sparse is not None):
            raise ValueError("dq_first_store: dense calls without overlap, window, mods or block sparsity")
        self.dq = DqAccumulator(block_m, self.dq_tma, self.deterministic, self.seqlens, 128 * self.NUM_MMA_WARPGROUPS,
                                self.dq_writer, self.turns_desc, block_n, self.first_store)
        self.dkv = DkvEpilogue(dtype, head_dim, block_n, self.NUM_MMA_WARPGROUPS, self.tma_dkv, self.varlen,
                               self.seqlens, self.split_d, self.head_dim_v)
        if self.smem_bytes() > self.SMEM_LIMIT:
            raise ValueError(
                f"head dim {head_dim}, block_m {block_m}, {num_stages} stages, dq_tma={self.dq_tma} need "
                f"{self.smem_bytes()} bytes of shared memory, more than sm_90's {self.SMEM_LIMIT} per CTA (the "
                "TMA dQ's two fp32 tiles take 64 KB at D = 128: use 2 stages or bwd.dq_tma=0 in FLASH_ATTN_CUTE_OVERRIDES)")

    SMEM_LIMIT = 232448  # sm_90's largest dynamic shared memory per CTA (227 KB)

    def smem_bytes(self):
        """Dynamic shared memory of the kernel, in the order and with the alignments `kernel` allocates it
        (mbarriers, then the 1 KB-aligned tiles, then the lse / delta rows)."""
        es, BM, BN, D, Dv, st = 2, self.block_m, self.block_n, self.head_dim, self.head_dim_v, self.num_stages
        off = (2 + 4 * st) * 8
        tiles = [BM * D * es * st, BM * Dv * es * st, BN * D * es, BN * Dv * es, BM * BN * es * 2]
        tiles += [BM * BN * es * 2] if self.split_d else []  # P^T's tile (two buffers, as dS)
        for nbytes in tiles + ([BM * D * 4 * 2] if self.dq_tma else []):
            off = -(-off // 1024) * 1024 + nbytes
        for _ in range(2):
            off = -(-off // 128) * 128 + lse_stage_floats(BM) * 4 * st
        return off

    # ------------------------------------------------------------------------------------------------
    # Host side: views, TMA descriptors, launch

    # ------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_lse: cute.CopyAtom, mLSE2: cute.Tensor, tma_delta: cute.CopyAtom, mDelta: cute.Tensor,
               mdQaccum: cute.Tensor, tma_dq, mdQ_tma, mdK: cute.Tensor, mdV: cute.Tensor, tma_dk, tma_dv,
               mdK_tma, mdV_tma, scale_log2: Float32, softmax_scale: Float32, seqlen_q: Int32, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout, sLSE_layout: cute.Layout,
               tiled_mma_sdp: cute.TiledMma, tiled_mma_dv: cute.TiledMma, tiled_mma_dk: cute.TiledMma,
               tiled_mma_dq: cute.TiledMma, window_left, window_right, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ,
               mSeqUsedK, mSem, score_scale, cap_log2, aux, sparse, scalars, tma_dq_st):
        if cutlass.const_expr(self.lpt > 0):
            lin, _, _ = cute.arch.block_idx()
            n_block, head, batch = lpt_tile(lin, cute.ceil_div(cute.size(mK, mode=[0]), self.block_n),
                                            cute.size(mK if cutlass.const_expr(self.gqa_loop) else mQ, mode=[2]),
                                            cute.size(mQ, mode=[3]), self.lpt)
        else:
            n_block, head, batch = cute.arch.block_idx()
            if cutlass.const_expr(self.turns_desc):  # key blocks from the last down (bwd_dq)
                n_block = cute.arch.grid_dim()[0] - 1 - n_block
        tile = self.seqlens.tile(batch, seqlen_q, mK, (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK))
        cta = (tma_q, mQ, tma_k, mK, tma_v, mV, tma_do, mdO, tma_lse, mLSE2, tma_delta, mDelta, mdQaccum, tma_dq,
               mdQ_tma, mdK, mdV, (tma_dk, tma_dv, mdK_tma, mdV_tma), scale_log2, softmax_scale, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
               sdQ_layout, sLSE_layout, tiled_mma_sdp, tiled_mma_dv, tiled_mma_dk, tiled_mma_dq, window_left,
               window_right, n_block, head, tile, mSem, (score_scale, cap_log2), aux, sparse, scalars, tma_dq_st)
        if cutlass.const_expr(self.varlen):
            if n_block * self.block_n < tile.seqlen_k:  # the grid covers the longest sequence's keys
                self._cta(*cta)
        else:
            self._cta(*cta)

    @cute.jit
    def _cta(self, tma_q, mQ, tma_k, mK, tma_v, mV, tma_do, mdO, tma_lse, mLSE2, tma_delta, mDelta, mdQaccum,
             tma_dq, mdQ_tma, mdK, mdV, tma_dkv, scale_log2, softmax_scale, sQ_layout, sdO_layout, sK_layout, sV_layout,
             sdS_layout, sdQ_layout, sLSE_layout, tiled_mma_sdp, tiled_mma_dv, tiled_mma_dk, tiled_mma_dq,
             window_left, window_right, n_block, head, tile, mSem, cap, aux=None, sparse=None, scalars=None,
             tma_dq_st=None):
        """One CTA's key block ``n_block`` of head ``head`` (gqa_loop: of KV head ``head``) of the sequence ``tile``
        (seqlen_info.TileSeqlens)."""
        dt, BM, BN, stages = self.dtype, self.block_m, self.block_n, self.num_stages
        seqlen_q, seqlen_k = tile.seqlen_q, tile.seqlen_k
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        group = cute.size(mQ, mode=[2]) // cute.size(mK, mode=[2])  # GQA / MQA
        head_kv = head if cutlass.const_expr(self.gqa_loop) else head // group

        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.dq_tma):
                cpasync.prefetch_descriptor(tma_dq)

        smem = SmemAllocator()
        kv_bars = smem.allocate_array(cutlass.Int64, num_elems=2, byte_alignment=8)
        q_bars = smem.allocate_array(cutlass.Int64, num_elems=2 * stages, byte_alignment=8)
        do_bars = smem.allocate_array(cutlass.Int64, num_elems=2 * stages, byte_alignment=8)
        sQ = smem.allocate_tensor(dt, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sdO = smem.allocate_tensor(dt, sdO_layout.outer, byte_alignment=1024, swizzle=sdO_layout.inner)
        sK = smem.allocate_tensor(dt, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(dt, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
        sdS = smem.allocate_tensor(dt, sdS_layout.outer, byte_alignment=1024, swizzle=sdS_layout.inner)
        sP = None  # split_d: P^T in dS's layout, dV's A operand
        if cutlass.const_expr(self.split_d):
            sP = smem.allocate_tensor(dt, sdS_layout.outer, byte_alignment=1024, swizzle=sdS_layout.inner)
        sdQ = None
        if cutlass.const_expr(self.dq_tma):  # before the row buffers: no 1 KB alignment gap (D = 128: 226 of 227 KB)
            sdQ = smem.allocate_tensor(Float32, sdQ_layout.outer, byte_alignment=1024, swizzle=sdQ_layout.inner)
        sLSE = smem.allocate_tensor(Float32, sLSE_layout, byte_alignment=128)
        sDelta = smem.allocate_tensor(Float32, sLSE_layout, byte_alignment=128)

        num_mma_warps = self.NUM_MMA_WARPGROUPS * 4

        # Full barriers count the TMA bytes; empty barriers one arrival per consumer warp. Q travels with
        # its lse rows and dO with its delta rows, on one barrier each: S^T and P^T need Q and lse, dP^T
        # and dS^T need dO and delta.
        def tma_pipe(bars, n, nbytes):
            return pipeline.PipelineTmaAsync.create(
                num_stages=n, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_mma_warps),
                tx_count=nbytes, barrier_storage=bars, defer_sync=True)

        row_bytes = BM * 4
        kv_pipe = tma_pipe(kv_bars, 1, cute.size_in_bytes(dt, sK_layout) + cute.size_in_bytes(dt, sV_layout))
        q_pipe = tma_pipe(q_bars, stages, cute.size_in_bytes(dt, cute.slice_(sQ_layout, (None, None, 0)))
                          + row_bytes)
        do_pipe = tma_pipe(do_bars, stages, cute.size_in_bytes(dt, cute.slice_(sdO_layout, (None, None, 0)))
                           + row_bytes)
        # mbarrier inits must be visible to the async proxy (TMA) and to every thread before use.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # the query blocks that see this key block
        m_block_min, m_block_max = self.mask.m_block_range(n_block, seqlen_q, seqlen_k, window_left, window_right)
        tiles = None  # block sparsity: the CTA walks the positions of its key block's lists (sparse_tiles)
        if cutlass.const_expr(self.sparse is not None):
            tiles = self.sparse.tile(sparse, tile.batch, head, n_block)
            m_block_min, m_block_max = Int32(0), tiles.count
        if cutlass.const_expr(self.tickets and not self.causal):  # (each key block's walk from its own start)
            if cutlass.const_expr(self.gqa_loop):
                tiles = RotatedGroupWalk.make(m_block_min, m_block_max, head_kv * group, group, n_block,
                                              cute.ceil_div(seqlen_k, BN))
            else:
                tiles = RotatedWalk.make(m_block_min, m_block_max, n_block, cute.ceil_div(seqlen_k, BN))
            m_block_min, m_block_max = Int32(0), tiles.count(group)
        elif cutlass.const_expr(self.gqa_loop):  # walk positions over (query head of the group, query block)
            tiles = GroupWalk.make(m_block_min, m_block_max, head_kv * group)
            m_block_min, m_block_max = Int32(0), tiles.count(group)

        if warp_idx < 4:
            # Producer warpgroup: only TMA issue, so it hands its registers to the consumers.
            cute.arch.setmaxregister_decrease(self.PRODUCER_REGS)
            if cutlass.const_expr(self.dq_writer):
                if warp_idx == 1:
                    self._write_dq(tma_dq, mdQ_tma, sdQ, tile, head, m_block_min, m_block_max, tiles,
                                   (mSem, n_block, tile, head) if cutlass.const_expr(self.deterministic) else None,
                                   tma_dq_st)
            if tidx == 0:
                self._produce(tma_q, mQ, tma_k, mK, tma_v, mV, tma_do, mdO, tma_lse, mLSE2, tma_delta, mDelta,
                              sQ, sK, sV, sdO, sLSE, sDelta, kv_pipe, q_pipe, do_pipe, n_block, head, head_kv,
                              tile, m_block_min, m_block_max, tiles)
        else:
            cute.arch.setmaxregister_increase(self.CONSUMER_REGS)
            self._consume(mdQaccum, tma_dq, mdQ_tma, sdQ, mdK, mdV, tma_dkv, sQ, sK, sV, sdO, sdS, sLSE, sDelta,
                          kv_pipe, q_pipe, do_pipe, tiled_mma_sdp, tiled_mma_dv, tiled_mma_dk, tiled_mma_dq, scale_log2,
                          softmax_scale, tidx - self.NUM_PRODUCER_THREADS, n_block, head, tile, seqlen_q, seqlen_k,
                          m_block_min, m_block_max, (window_left, window_right), mSem, cap,
                          None if cutlass.const_expr(self.mods is None) else self.mods.context(tile, head, aux,
                                                                                               softmax_scale, scalars),
                          tiles, sP, tma_dq_st)

    @cute.jit
    def _produce(self, tma_q, mQ, tma_k, mK, tma_v, mV, tma_do, mdO, tma_lse, mLSE2, tma_delta, mDelta,
                 sQ, sK, sV, sdO, sLSE, sDelta, kv_pipe, q_pipe, do_pipe, n_block, head, head_kv, tile,
                 m_block_min, m_block_max, tiles=None):
        BM, BN, D, Dv = self.block_m, self.block_n, self.head_dim, self.head_dim_v
        sl = self.seqlens
        gQ = cute.local_tile(sl.rows(mQ, tile.q_start, head, tile), (BM, D), (None, 0))       # (BM, D, m)
        gdO = cute.local_tile(sl.rows(mdO, tile.q_start, head, tile), (BM, Dv), (None, 0))    # (BM, Dv, m)
        gK = cute.local_tile(sl.rows(mK, tile.k_start, head_kv, tile), (BN, D), (None, 0))    # (BN, D, n)
        gV = cute.local_tile(sl.rows(mV, tile.k_start, head_kv, tile), (BN, Dv), (None, 0))   # (BN, Dv, n)
        gLSE = cute.local_tile(sl.lse_rows(mLSE2, head, tile), (BM,), (None,))                # (BM, m)
        gDelta = cute.local_tile(sl.lse_rows(mDelta, head, tile), (BM,), (None,))             # (BM, m)
        tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
        tdOsdO, tdOgdO = tma_tiles(tma_do, sdO, gdO)
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        tLsL, tLgL = tma_tiles(tma_lse, sLSE, gLSE, modes=1)
        tDsD, tDgD = tma_tiles(tma_delta, sDelta, gDelta, modes=1)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_pipe.producer_acquire(kv_state)
        kv_bar = kv_pipe.producer_get_barrier(kv_state)
        cute.copy(tma_k, tKgK[None, n_block], tKsK, tma_bar_ptr=kv_bar)
        cute.copy(tma_v, tVgV[None, n_block], tVsV, tma_bar_ptr=kv_bar)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):  # (sparse: a position of the lists)
            gq, gdo, gl, gd = tQgQ, tdOgdO, tLgL, tDgD
            if cutlass.const_expr(self.gqa_loop):  # this position's query head: its tiles' coordinates
                gq, gdo, gl, gd = self._head_tiles(tma_q, tma_do, tma_lse, tma_delta, mQ, mdO, mLSE2, mDelta, sQ, sdO,
                                                   sLSE, sDelta, tile, tiles.head(m_block))
            if cutlass.const_expr(tiles is not None):
                m_block = tiles.block(m_block)
            q_pipe.producer_acquire(q_state)
            q_bar = q_pipe.producer_get_barrier(q_state)
            cute.copy(tma_q, gq[None, m_block], tQsQ[None, q_state.index], tma_bar_ptr=q_bar)
            cute.copy(tma_lse, gl[None, m_block], tLsL[None, q_state.index], tma_bar_ptr=q_bar)
            q_state.advance()
            do_pipe.producer_acquire(do_state)
            do_bar = do_pipe.producer_get_barrier(do_state)
            cute.copy(tma_do, gdo[None, m_block], tdOsdO[None, do_state.index], tma_bar_ptr=do_bar)
            cute.copy(tma_delta, gd[None, m_block], tDsD[None, do_state.index], tma_bar_ptr=do_bar)
            do_state.advance()

    @cute.jit
    def _consume(self, mdQaccum, tma_dq, mdQ_tma, sdQ, mdK, mdV, tma_dkv, sQ, sK, sV, sdO, sdS, sLSE, sDelta, kv_pipe,
                 q_pipe, do_pipe, tiled_mma_sdp, tiled_mma_dv, tiled_mma_dk, tiled_mma_dq, scale_log2,
                 softmax_scale, ctid, n_block, head, tile, seqlen_q, seqlen_k, m_block_min, m_block_max, window, mSem,
                 cap, mods=None, tiles=None, sP=None, tma_dq_st=None):
        dt, D, BM, BN = self.dtype, self.head_dim, self.block_m, self.block_n
        wg = cute.arch.make_warp_uniform(ctid // 128)
        turn = (mSem, n_block, ctid) if cutlass.const_expr(self.deterministic) else None
        thr_sdp = tiled_mma_sdp.get_slice(ctid)
        thr_dv = tiled_mma_dv.get_slice(ctid)
        thr_dk = tiled_mma_dk.get_slice(ctid)
        thr_dq = tiled_mma_dq.get_slice(ctid if cutlass.const_expr(self.dq_split) else ctid % 128)
        # Shared-memory operands are the same for a whole warpgroup: partition them with its first
        # thread (a warp-uniform index) so ptxas builds the WGMMA descriptors in uniform registers.
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        wg_dv = tiled_mma_dv.get_slice(wg * 128)
        wg_dk = tiled_mma_dk.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128 if cutlass.const_expr(self.dq_split) else 0)

        sdSt = transpose_view(sdS)  # (BN, BM, 2): dS^T, the accumulators' orientation
        tSrK = tiled_mma_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = tiled_mma_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = tiled_mma_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = tiled_mma_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrdOt = tiled_mma_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))  # (D, BM, stages)
        tdKrdSt = None  # BLOCK_M = 128: dS^T's registers, below
        if cutlass.const_expr(not self.wide):
            tdKrdSt = tiled_mma_dk.make_fragment_A(wg_dk.partition_A(sdSt))             # (BN, BM, 2)
        tdKrQt = tiled_mma_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))    # (D, BM, stages)
        tdQrdS, tdQrKt, acc_dQ, tdQcdQ, tdQsdQ = self.dq.fragments(tiled_mma_dq, wg_dq, thr_dq, sdS, sK, sdQ, wg, D,
                                                                   self.dq_split)

        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BN, BM)), Float32)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((BN, BM)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C((BN, self.head_dim_v)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dk.partition_shape_C((BN, D)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        tScS = thr_sdp.partition_C(cute.make_identity_tensor((BN, BM)))
        tdKcdK = (thr_dk.partition_C(cute.make_identity_tensor((BN, D))),
                  thr_dv.partition_C(cute.make_identity_tensor((BN, self.head_dim_v))))
        tQRsdQ, tQRgdQ = None, None
        if cutlass.const_expr(self.dq_tma):
            gdQ = cute.local_tile(self.seqlens.rows(mdQ_tma, tile.q_start, head, tile), (BM, D),
                                  (None, 0))  # (BM, D, m)
            tQRsdQ, tQRgdQ = tma_tiles(tma_dq, sdQ, gdQ)
        # The S^T accumulator's values are in the order of the register A operand of m64nDk16 once its
        # BM/8 column groups are split into (2, BM/16) (the forward's P layout, checked in
        # tests/cute/test_cute_compile.py and, for this kernel's shapes, tests/cute/test_cute_bwd.py).
        rP = cute.make_rmem_tensor_like(acc_S, dt)
        if cutlass.const_expr(self.split_d):  # P^T of both warpgroups' query columns, from shared memory
            tdVrP = (tiled_mma_dv.make_fragment_A(wg_dv.partition_A(transpose_view(sP))), thr_sdp, sP)
        else:
            tdVrP = cute.make_tensor(rP.iterator, cute.make_layout(((2, 2, 2), 1, BM // 16)))
        rdS = cute.make_rmem_tensor_like(acc_dP, dt)
        rdT = cute.make_rmem_tensor_like(acc_S, dt) if cutlass.const_expr(self.softcap) else None  # 1 - tanh^2
        if cutlass.const_expr(self.mods is not None):
            if cutlass.const_expr(self.mods.score_mod is not None):
                rdT = cute.make_rmem_tensor_like(acc_S, Float32)  # the scaled scores, for score_mod_bwd
        if cutlass.const_expr(self.wide):  # dS^T's registers as dK's A operand (the layout of tdVrP)
            tdKrdSt = cute.make_tensor(rdS.iterator, cute.make_layout(((2, 2, 2), 1, BM // 16)))
        ds_copy = None
        if cutlass.const_expr(not self.split_d):
            # dS^T to shared memory with stmatrix (4 8x8 matrices, 8 values, per instruction; a matrix row
            # is one key's 8 adjacent queries, 16 contiguous bytes of the M-major tile): a quarter of the
            # 4-byte stores, and a quarter of the swizzled addresses to hold or recompute (held, the 4-byte
            # stores' addresses made ptxas spill at D = 128).
            stsm = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), dt), tiled_mma_sdp)
            ds_copy = (stsm, stsm.get_slice(ctid).retile(rdS), ctid)

        # Query blocks below m_block_mask_end cross this key block's diagonal (causal); the key block
        # past the sequence end needs its tail rows masked in every query block.
        m_block_mask_end = self.mask.m_block_mask_end(n_block, seqlen_q, seqlen_k)
        key_tail = (n_block + 1) * BN > seqlen_k

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tiled_mma_dv.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_dk.set(warpgroup.Field.ACCUMULATE, True)

        # Wait for K and V even when no query block sees them: the CTA must not exit with TMA in flight.
        kv_pipe.consumer_wait(kv_state)
        buf = Int32(0)
        # The warp that issues, commits and waits for the dQ TMA reduce-adds: a whole warp, not one
        # thread, because cute.copy of a TMA atom elects its issuing lane with elect.sync over the full
        # warp, which waits for all 32 lanes; with one lane let in (ctid == 0) the other 31 never reach
        # it (they wait at the next barrier or WGMMA), a deadlock. The lanes that issue nothing commit
        # empty bulk groups and their waits return at once.
        dq_issuer = cute.arch.make_warp_uniform(ctid // 32) == 0

        # what the dQ TMA reduce-add of a walk position needs (_dq_dst; first_store: _dq_reduce)
        dq_dst = (tQRgdQ, tma_dq, sdQ, mdQ_tma, tile, tma_dq_st, mSem, head, tQRsdQ)
        ticket = Int32(0)  # (first_store: the ticket of the block whose tile goes out next)

        if cutlass.const_expr(not self.overlap):
            for pos in cutlass.range(m_block_min, m_block_max, unroll=1):
                m_block, partial = self._query_block(pos, tiles)
                self._issue_sdp(q_pipe, do_pipe, q_state, do_state, tiled_mma_sdp, acc_S, acc_dP, tSrK, tSrQ,
                                tdPrV, tdPrdO)
                self._p_and_dv(acc_S, tScS, rP, tdVrP, tdVrdOt, acc_dV, tiled_mma_dv, sLSE, scale_log2, m_block,
                               n_block, seqlen_q, seqlen_k, m_block_mask_end, key_tail, do_state.index,
                               q_state.index, window, cap, rdT, mods, partial, buf)
                stored = self._ds_dk_dq(acc_S, acc_dP, tScS, rdS, thr_sdp, sdSt, sDelta, tiled_mma_dk, acc_dK,
                                        tdKrdSt, tdKrQt, tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, tma_dq, tQRsdQ, dq_dst,
                                        dq_issuer, buf, pos, m_block_min, wg, q_state.index, do_state.index, rP=rP,
                                        ds_copy=ds_copy, rdT=rdT, tiles=tiles, mods=mods, n_block=n_block,
                                        m_block_of=m_block, ticket=ticket)
                if cutlass.const_expr(self.tickets):  # behind the previous block's reduce (bwd_dq: no wait cycle)
                    ticket = self.dq.take_ticket(mSem, tile, self._dq_head(dq_dst, pos, tiles), m_block, dq_issuer)
                dq_out = (mdQaccum, acc_dQ, tdQcdQ, tdQsdQ, softmax_scale, buf, m_block,
                          tiles.head(pos) if cutlass.const_expr(self.gqa_loop) else head, tile, seqlen_q, turn,
                          pos >= m_block_min + self.dq.buffers)
                if cutlass.const_expr(self.dq_first):
                    warpgroup.wait_group(1)  # dV and dQ done, dK runs on: dO's stage and rP are free
                    do_pipe.consumer_release(do_state)
                    self.dq.out(*dq_out)
                    warpgroup.wait_group(0)  # dK done: Q's stage is free
                    q_pipe.consumer_release(q_state)
                else:
                    warpgroup.wait_group(0)  # dV, dK, dQ done: the Q and dO stages and rP are free
                    q_pipe.consumer_release(q_state)
                    do_pipe.consumer_release(do_state)
                q_state.advance()
                do_state.advance()
                if cutlass.const_expr(not self.dq_first):
                    self.dq.out(*dq_out)
                if cutlass.const_expr(self.tickets):  # (the previous block's tile, stored a block's WGMMAs ago)
                    self.dq.publish(stored, self._dq_ticket(dq_dst, pos - 1, tiles))
                buf = 1 - buf
        else:
            # Software-pipelined: S^T and dP^T of block j + 1 are issued right behind dK and dQ of block j,
            # so that the tensor cores run them while this warpgroup waits for dQ(j) and adds it to
            # dq_accum. Stage j + 1 is waited for while stage j is still held (released after dK(j) and
            # dV(j), which read it): the ring needs 2 stages, else the producer waits for stage j's release
            # and the consumer for j + 1's data (__init__ refuses num_stages < 2 with overlap).
            # The issues are branch-free: a WGMMA issued under a runtime branch leaves its in-flight
            # accumulators to a phi at the join, and ptxas then serialises every WGMMA of the kernel
            # (C7515). So the prologue issues block m_block_min's S^T and dP^T even when the CTA has no
            # query block, and the last block issues the next stage's: unwaited (the producer loads
            # nothing more, so the stage is not being written), their results never read, waited for
            # after the loop.
            # At D = 128 and 256 and at BLOCK_M = 128 only S^T goes ahead (dP^T is issued at the top of its own
            # block): dK, dV, dQ, S^T and dP^T in flight at once need more than the 240 registers (ptxas
            # spills and serialises; BLOCK_M = 128: 260 bytes).
            ahead_dp = self.head_dim not in (128, 256) and not self.wide
            self._issue_sdp(q_pipe, do_pipe, q_state, do_state, tiled_mma_sdp, acc_S, acc_dP, tSrK, tSrQ,
                            tdPrV, tdPrdO, skip_wait=m_block_min >= m_block_max, dp=ahead_dp)
            for pos in cutlass.range(m_block_min, m_block_max, unroll=1):
                m_block, partial = self._query_block(pos, tiles)
                if cutlass.const_expr(not ahead_dp):
                    # S^T retired before dP^T is issued: a wait_group(1) after it would leave ptxas unsure
                    # that S^T retired on the loop's back edge, and it serialises every WGMMA (C7514).
                    warpgroup.wait_group(0)
                    self._issue_sdp(q_pipe, do_pipe, q_state, do_state, tiled_mma_sdp, acc_S, acc_dP, tSrK, tSrQ,
                                    tdPrV, tdPrdO, s=False)
                # rP is rewritten here only after the previous block's wait_group, which covered its dV.
                self._p_and_dv(acc_S, tScS, rP, tdVrP, tdVrdOt, acc_dV, tiled_mma_dv, sLSE, scale_log2, m_block,
                               n_block, seqlen_q, seqlen_k, m_block_mask_end, key_tail, do_state.index,
                               q_state.index, window, cap, rdT, mods, partial, buf)
                self._ds_dk_dq(acc_S, acc_dP, tScS, rdS, thr_sdp, sdSt, sDelta, tiled_mma_dk, acc_dK, tdKrdSt,
                               tdKrQt, tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, tma_dq, tQRsdQ, dq_dst, dq_issuer,
                               buf, pos, m_block_min, wg, q_state.index, do_state.index, rP=rP,
                               ds_copy=ds_copy, rdT=rdT, tiles=tiles, mods=mods, n_block=n_block, m_block_of=m_block)
                # acc_S and acc_dP are dead: dS^T of this block is in shared memory.
                if cutlass.const_expr(self.wide):
                    # dV done (dK, dQ may run): the 16-bit P^T is dead before the next S^T takes its 64
                    # registers (else ptxas serialises the WGMMAs, C7512). dS^T, dK's A operand, stays
                    # until the wait_group below.
                    warpgroup.wait_group(2)
                q_next = q_state.clone()
                q_next.advance()
                do_next = do_state.clone()
                do_next.advance()
                self._issue_sdp(q_pipe, do_pipe, q_next, do_next, tiled_mma_sdp, acc_S, acc_dP, tSrK, tSrQ,
                                tdPrV, tdPrdO, skip_wait=pos + 1 >= m_block_max, dp=ahead_dp)
                # Commit groups complete in order: all but the newest (S^T and dP^T of the next block) are
                # done, i.e. dV, dK and dQ of this block; its stages and rP are free.
                warpgroup.wait_group(2 if ahead_dp else 1)
                q_pipe.consumer_release(q_state)
                do_pipe.consumer_release(do_state)
                q_state.advance()
                do_state.advance()
                self.dq.out(mdQaccum, acc_dQ, tdQcdQ, tdQsdQ, softmax_scale, buf, m_block,
                            tiles.head(pos) if cutlass.const_expr(self.gqa_loop) else head, tile, seqlen_q, turn)
                buf = 1 - buf
            warpgroup.wait_group(0)  # the unread S^T and dP^T issued last

        if cutlass.const_expr(self.dq_tma and not self.dq_writer):  # the last tile, waited for before smem goes away
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
            if dq_issuer:
                if m_block_max > m_block_min:
                    stored = self._dq_reduce(dq_dst, m_block_max - 1, tiles, 1 - buf, ticket)
                    if cutlass.const_expr(self.tickets):
                        self.dq.publish(stored, self._dq_ticket(dq_dst, m_block_max - 1, tiles))
                cute.arch.cp_async_bulk_wait_group(0)

        self.dkv.store(mdK, mdV, tma_dkv, sK, sV, (tiled_mma_dk, tiled_mma_dv), acc_dK, acc_dV, tdKcdK,
                       softmax_scale, ctid, wg, n_block, head, tile, seqlen_k)

    @cute.jit
    def _issue_sdp(self, q_pipe, do_pipe, q_state, do_state, tiled_mma_sdp, acc_S, acc_dP, tSrK, tSrQ, tdPrV,
                   tdPrdO, skip_wait=None, s=True, dp=True):
        """Wait for the query block's Q and dO stages and issue S^T = K Q^T and dP^T = V dO^T (two commit groups).
        skip_wait (runtime Boolean, with overlap): true issues them on whatever the stages hold (a result nobody
        reads), with no wait: the mbarrier waits are then for the parity of the phase before the stage's current one,
        which try_wait.parity reports complete at once (the previous fill, or on a barrier never completed the phase
        "before" phase 0, as producers wait on fresh empty barriers). Branch-free on purpose: a branch around the
        waits, taken while WGMMAs are in flight, made ptxas spill more at D = 128 and can serialise the WGMMAs."""
        if cutlass.const_expr(skip_wait is not None):
            flip = Int32(skip_wait)
            q_state = pipeline.PipelineState(q_state.stages, q_state.count, q_state.index, q_state.phase ^ flip)
            do_state = pipeline.PipelineState(do_state.stages, do_state.count, do_state.index, do_state.phase ^ flip)
        if cutlass.const_expr(s):
            q_pipe.consumer_wait(q_state)
            gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ, None, q_state.index, zero_init=True)  # S^T = K Q^T
        if cutlass.const_expr(dp):
            do_pipe.consumer_wait(do_state)
            gemm(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO, None, do_state.index, zero_init=True)  # dP^T

    @cute.jit
    def _p_and_dv(self, acc_S, tScS, rP, tdVrP, tdVrdOt, acc_dV, tiled_mma_dv, sLSE, scale_log2, m_block, n_block,
                  seqlen_q, seqlen_k, m_block_mask_end, key_tail, do_stage, q_stage, window, cap, rdT, mods=None,
                  partial=None, buf=None):
        """Wait for S^T (dP^T may still run), P^T = exp2(S^T scale log2(e) - lse2) in place and in the
        input dtype in rP, and issue dV += P^T dO (one commit group). split_d: tdVrP is (dV's A fragment of the
        P^T tile, the S^T partition, the P^T tile); rP goes to buffer buf of the tile, and after a barrier of both
        warpgroups (each reads the other's query columns) dV's WGMMA reads it there."""
        if cutlass.const_expr(self.overlap):
            if cutlass.const_expr(self.head_dim not in (128, 256) and not self.wide):
                # S^T and dP^T both: they were issued a whole dQ epilogue ago. With wait_group(1) here
                # ptxas cannot tell S^T retired on the loop's back edge and serialises every WGMMA (C7514).
                warpgroup.wait_group(0)
            # (D = 128 and 256, BLOCK_M = 128: S^T was waited for before dP^T was issued.)
        else:
            warpgroup.wait_group(1)  # S^T is ready; dP^T may still run
        if cutlass.const_expr(self.mods is not None):
            if cutlass.const_expr(self.mods.score_mod is not None):
                self.mods.score_transposed(acc_S, rdT, tScS, m_block, n_block, mods)
        if cutlass.const_expr(self.softcap):
            score_scale, cap_log2 = cap
            rdT32 = cute.recast_tensor(rdT, Int32)
            for k in cutlass.range_constexpr(cute.size(acc_S) // 2):
                t0 = cute.math.tanh(acc_S[2 * k] * score_scale, fastmath=True)
                t1 = cute.math.tanh(acc_S[2 * k + 1] * score_scale, fastmath=True)
                rdT32[k] = pack_pair(1.0 - t0 * t0, 1.0 - t1 * t1, self.dtype)
                acc_S[2 * k] = t0 * cap_log2  # the capped score in log2 units (scale_log2 is 1)
                acc_S[2 * k + 1] = t1 * cap_log2
        if key_tail or m_block < m_block_mask_end:
            self.mask.apply_transposed(acc_S, tScS, m_block, n_block, seqlen_q, seqlen_k, *window)
        if cutlass.const_expr(mods is not None and self.mods.mask_mod is not None):
            if cutlass.const_expr(partial is None):
                self.mods.mask_transposed(acc_S, tScS, m_block, n_block, mods)
            else:
                if partial:  # (block sparsity: full blocks need no mask_mod)
                    self.mods.mask_transposed(acc_S, tScS, m_block, n_block, mods)
        if cutlass.const_expr(self.exp2_emu == 0):
            for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                # +inf lse2 (query past Sq, or a query that sees no key) gives P = 0 exactly.
                acc_S[i] = cute.math.exp2(acc_S[i] * scale_log2 - sLSE[tScS[i][1], q_stage], fastmath=True)
        else:
            # exp2_emu of every 16 on the FMA pipe (exp2_poly: x <= -127, so -inf too, gives 0 exactly).
            n = cute.size(acc_S)
            for i, emu in zip(range(n), emulated_columns(n, self.exp2_emu)):
                x = acc_S[i] * scale_log2 - sLSE[tScS[i][1], q_stage]
                if cutlass.const_expr(emu):
                    acc_S[i] = exp2_poly(x, self.exp2_emu_degree)
                else:
                    acc_S[i] = cute.math.exp2(x, fastmath=True)
        if cutlass.const_expr(self.p16):
            pack_16(acc_S, rP, self.dtype)
        else:
            rP.store(acc_S.load().to(self.dtype))
        if cutlass.const_expr(self.split_d):
            tdVrP_s, thr_sdp, sP = tdVrP
            cute.autovec_copy(rP, thr_sdp.partition_C(transpose_view(sP)[None, None, buf]))
            cute.arch.fence_view_async_shared()  # generic-proxy stores, read by the WGMMA's async proxy
            cute.arch.barrier(barrier_id=1, number_of_threads=256)  # (the dS barrier's id and count, in turn)
            gemm(tiled_mma_dv, acc_dV, tdVrP_s, tdVrdOt, buf, do_stage)  # dV += P^T dO
        else:
            gemm(tiled_mma_dv, acc_dV, tdVrP, tdVrdOt, None, do_stage)  # dV += P^T dO

    @cute.jit
    def _ds_dk_dq(self, acc_S, acc_dP, tScS, rdS, thr_sdp, sdSt, sDelta, tiled_mma_dk, acc_dK, tdKrdSt, tdKrQt,
                  tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, tma_dq, tQRsdQ, dq_dst, dq_issuer, buf, m_block,
                  m_block_min, wg, q_stage, do_stage, rP=None, ds_copy=None, rdT=None, tiles=None, mods=None,
                  n_block=None, m_block_of=None, ticket=None):
        """Wait for dP^T, dS^T = P^T (dP^T - delta) to shared memory (buffer buf), the dS barrier, and issue dQ = dS K
        and dK += dS^T Q (two commit groups; dK first where not dq_first); with dq_tma the previous block's dQ tile
        reduce-add behind them (dq_dst: what _dq_dst needs for a walk position's destination). m_block / m_block_min:
        the walk's positions (the query blocks themselves, or with block sparsity or gqa_loop's walk, tiles maps them)."""
        warpgroup.wait_group(1)  # dP^T is ready; dV may still run
        stored = Int32(0)  # (first_store: the previous block's tile stored, _dq_reduce)
        if cutlass.const_expr(self.p16):
            # P^T back from the 16-bit copy that dV reads: the fp32 S^T is dead since the conversion,
            # so S^T, dP^T (64 registers each at BLOCK_M = 128), the 16-bit P^T and dK, dV are never all
            # live (224 + addresses and indices > 240: with the fp32 S^T kept for dS^T, ptxas serialises
            # the WGMMAs, C7512). dS^T then carries P's 16-bit rounding (relative 2^-9 for bf16, 2^-12
            # for fp16), no more than its own rounding to 16 bits below.
            unpack_16(rP, acc_S, self.dtype)
        if cutlass.const_expr(self.softcap):  # times the tanh's derivative
            rdT32 = cute.recast_tensor(rdT, Int32)
            for k in cutlass.range_constexpr(cute.size(acc_dP) // 2):
                for h in cutlass.range_constexpr(2):
                    i = 2 * k + h
                    acc_dP[i] = acc_S[i] * (acc_dP[i] - sDelta[tScS[i][1], do_stage]) * unpack_half(rdT32[k], h,
                                                                                                   self.dtype)
        else:
            for i in cutlass.range(cute.size(acc_dP), unroll_full=True):
                acc_dP[i] = acc_S[i] * (acc_dP[i] - sDelta[tScS[i][1], do_stage])
        if cutlass.const_expr(mods is not None):
            if cutlass.const_expr(self.mods.score_mod is not None):  # the gradient through score_mod
                self.mods.grad_transposed(acc_dP, rdT, tScS, m_block_of, n_block, mods)
        rdS.store(acc_dP.load().to(self.dtype))
        if cutlass.const_expr(self.wide):
            # dK needs only this warpgroup's dS^T, from registers: issued before the smem stores and the
            # barrier, it runs while they do.
            gemm(tiled_mma_dk, acc_dK, tdKrdSt, tdKrQt, None, q_stage)  # dK += dS^T Q
        # dS^T to shared memory, where the dK and dQ WGMMAs read it through the async proxy.
        if cutlass.const_expr(ds_copy is not None):
            stsm, tRS_rdS, ctid = ds_copy  # partitioned from an opaque thread index: see hopper_helpers.opaque
            cute.copy(stsm, tRS_rdS, stsm.get_slice(opaque(ctid)).partition_D(sdSt)[None, None, None, buf])
        else:
            cute.autovec_copy(rdS, thr_sdp.partition_C(sdSt[None, None, buf]))
        cute.arch.fence_view_async_shared()
        if cutlass.const_expr(self.dq_tma and not self.dq_writer):
            # The reduce-add issued one block ago read the buffer this block's dQ tile is written to
            # below; its completion (.read) is published to all threads by the barrier.
            if dq_issuer:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if cutlass.const_expr(self.dq_split):  # both halves of dS are read by both warpgroups
            cute.arch.barrier(barrier_id=1, number_of_threads=256)
        else:
            cute.arch.barrier(barrier_id=1 + wg, number_of_threads=128)
        if cutlass.const_expr(self.dq_first):  # dQ = dS K
            self.dq.gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, buf)
        if cutlass.const_expr(not self.wide):
            gemm(tiled_mma_dk, acc_dK, tdKrdSt, tdKrQt, buf, q_stage)  # dK += dS^T Q
        if cutlass.const_expr(self.dq_tma and not self.dq_writer):
            # Past the dS barrier every thread has written and fenced the previous block's dQ tile (behind the WGMMAs:
            # the issuing warp does not hold its warpgroup's back).
            if dq_issuer and m_block > m_block_min:
                stored = self._dq_reduce(dq_dst, m_block - 1, tiles, 1 - buf, ticket)
        if cutlass.const_expr(not self.dq_first):
            gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, buf, None, zero_init=True)  # dQ = dS K
        return stored
