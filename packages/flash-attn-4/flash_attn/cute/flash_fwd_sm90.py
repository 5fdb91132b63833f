"""Attention forward for Hopper (sm_90a) in CuTeDSL, after FlashAttention-3 (Shah et al. 2024, sections
3.1-3.2): TMA loads into swizzled shared memory through an mbarrier pipeline, WGMMA with fp32 register
accumulators, a producer warpgroup that only issues TMA (registers given back with setmaxnreg) and two
or three consumer warpgroups of 64 query rows each that compute (BLOCK_M 128 or 192), online softmax in
fp32 with exp2 (Milakov & Gimelshein 2018).

Layouts seen by the kernel (views built on the host, no copies):
  mQ (Sq, D, H, B), mK (Sk, D, Hk, B), mV (Sk, D, Hk, B), mO (Sq, D, H, B), mLSE (Sq, H, B) fp32,
  mSink (H,) fp32 (kernels built with sink=True only).
One CTA per (BLOCK_M query tile, head, batch); or, built with persistent=True (dense calls: by default d64
causal ones, see config.PERSISTENT; FwdConfig.persistent), one CTA per
SM looping over the tiles in a static order, the next tile's loads overlapping the current one's last blocks
and epilogue (kernel_persistent).

The kernel class holds the pipeline (producer, consumers, main loop) and composes one component per concern,
each built once in __init__ from its settings:
  mask.AttentionMask           the key blocks a tile visits and the -inf masking of scores
  seqlen_info.SeqlenInfo       a CTA's sequence: dense, varlen, split-KV's parts
  tile_scheduler               the grid order (one-tile, lpt) and the persistent schedule; key_block's order
  pack_gqa.PackGQA             query heads packed into one tile
  paged_kv.PagedKV             paged K / V addressing
  softmax.OnlineSoftmax        the online softmax, soft-capping
  epilogue.Epilogue            O and lse out (direct, TMA, split parts), the sink
  score_mod.ScoreMods          the user's score_mod / mask_mod (FA4's convention; entries call_mods*)
  sparse_tiles.SparseTiles     block sparsity: the key blocks a tile visits from per-tile lists (with the mods)
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from flash_attn.cute.epilogue import Epilogue
from flash_attn.cute.fwd_entries import FwdEntries
from flash_attn.cute.hopper_helpers import opaque, smem_layout, tma_tiles
from flash_attn.cute.mask import AttentionMask
from flash_attn.cute.mma import ConsumerMma
from flash_attn.cute.pack_gqa import PackGQA
from flash_attn.cute.paged_kv import PagedKV
from flash_attn.cute.score_mod import ModEntries, ScoreMods
from flash_attn.cute.seqlen_info import SeqlenInfo
from flash_attn.cute.softmax import OnlineSoftmax, pin
from flash_attn.cute.softmax_exp import EXP2_POLY
from flash_attn.cute.tile_scheduler import OneTileScheduler, PersistentScheduler, key_block

LOG2_E = math.log2(math.e)


class FlashFwdSm90(FwdEntries, ModEntries):
    """Compile-time configuration of the kernel: dtype, head dim, the mask (none, causal, or a local
    window whose sizes are runtime values), whether scores are soft-capped and whether each head has a
    learnable sink logit (an extra softmax term with no value, folded in at the end). Everything else (batch,
    sequence lengths, head counts, strides, scale, softcap, window sizes) is a runtime value of the
    compiled kernel."""

    NUM_PRODUCER_THREADS = 128  # one warpgroup; a single thread issues the TMA copies
    NUM_MMA_WARPGROUPS = 2  # the default; 3 with num_warpgroups=3
    # setmaxnreg budgets (producer, consumer) per consumer warpgroup count, within the SM's 64K registers
    # (multiples of 8, as setmaxnreg requires): 2: 24*128 + 240*256 = 64512 (FA3's split); 3: 24*128 +
    # 160*384 = 64512 (168 would need 67584). During the overlap a consumer thread holds the S, P and O
    # accumulators at once (BLOCK_N + BLOCK_N / 2 + D / 2 registers) plus the loop's state: with 160 (and
    # pack_p) that is BLOCK_N 128 at head dim 64 for dense calls, 96 with softcap, varlen or a window
    # (config.BLOCK_N_3WG*).
    # 1 (the mod kernels' 64-row tile): none (0, 0): 256 threads may each hold ptxas's maximum of 255, and ptxas
    # ignores a setmaxnreg whose entry count it cannot bound (C7508).
    REGS = {1: (0, 0), 2: (24, 240), 3: (24, 160)}
    PRODUCER_REGS, CONSUMER_REGS = REGS[2]

    UNBOUNDED = 1 << 30  # window size standing for "no limit on this side" (host passes it for -1)
    # Bytes of K and V (all key rows of the KV heads of one causal section, see tile_scheduler.tile_coords)
    # that the persistent order keeps in use together: FA3's scheduler budgets 32 MiB of the L2 (50 MiB on
    # H100 / H200) for K and V (it also rounds its sections to a power of two heads; this one does not).
    L2_KV_BYTES = 32 << 20
    HEAD_DIMS = (64, 96, 128, 192, 256)
    # Dynamic shared memory of one CTA on sm_90 (227 KB), which holds the barriers (below 1 KB, padded
    # to the 1024-byte alignment of the swizzled tiles), Q and the K / V stages.
    SMEM_BYTES = 232448

    def __init__(self, dtype, head_dim, causal, local=False, softcap=False, varlen=False, block_m=None,
                 block_n=128, num_stages=2, exp2_emu=0, exp2_emu_degree=3, sink=False, num_warpgroups=2,
                 wg_order=True, persistent=False, tma_o=False, reverse=False, pin=True, snake=True, lpt=False,
                 tiles_desc=False, pack_gqa=1, head_dim_v=None, paged=0, split=False, score_mod=None, mask_mod=None,
                 aux=False, sparse=None, scalars=()):
        """exp2_emu / exp2_emu_degree: of every 16 softmax exponentials a thread computes, this many use a
        polynomial on the FMA pipe instead of MUFU.EX2 (softmax.OnlineSoftmax). num_warpgroups: consumer
        warpgroups (1, 2 or 3) of 64 query rows each; block_m must be 64 * num_warpgroups (the default).
        wg_order=False: no named barriers between the consumer warpgroups (each keeps only its
        intra-warpgroup overlap). persistent: one CTA per SM loops over the tiles (kernel_persistent; entry
        point call_persistent; tile_scheduler.PersistentScheduler), dense calls only (no window, softcap,
        varlen or sink). tma_o: O goes out through shared memory and TMA (epilogue.Epilogue; dense calls only:
        a TMA box would write past a packed sequence's end into the next one, so varlen keeps the direct
        store). reverse: each tile walks its key blocks from the last down (tile_scheduler.key_block), so a
        causal or local tile's masked blocks come first and its warpgroups end on unmasked ones (FA3's
        order); both kernels, every mask (without a mask only the tail block is masked and comes first:
        correct, but config.select_fwd asks for it only for causal and local calls). pin: each softmax
        branch of the key-block loop ends in softmax.pin, which keeps the whole softmax ahead of the P V
        wait (ignored with three warpgroups and a sink). snake (persistent causal kernels) and lpt (one-tile
        dense causal kernels): the longest-first tile orders of tile_scheduler; tiles_desc (one-tile kernel): each head's
        query tiles from the last down, as causal kernels always run them. pack_gqa: g > 1 packs the g
        query heads of each KV head into one tile (pack_gqa.PackGQA; the kernel then serves exactly H = g *
        Hk; one-tile kernel only, direct O store). head_dim_v: V's (and O's) head dim when it differs from
        Q's and K's (e.g. 192 / 128, DeepSeek's MLA without absorption; one-tile kernel with the direct O
        store, as the TMA O store goes through Q's buffer); None: head_dim. paged: > 0 for a paged K / V
        cache (varlen only; paged_kv.PagedKV): the rows of each TMA box, min(page_size, block_n). split
        (call_split, call_varlen_split; one-tile kernel, direct O store, no sink): split-KV, the key blocks
        of each tile divided among num_splits CTAs (a runtime argument; grid z = batch (or sequences) x
        num_splits), each writing its part's O (divided by its own row sums) and lse in fp32 to entry split
        * B + b of mO / mLSE (varlen: entry split, see call_varlen_split), for the host to combine
        (launch._combine_splits, which adds a sink). score_mod / mask_mod / aux: FA4's user mods (compile-time
        functions; score_mod.ScoreMods.build says which kernels take them; entries call_mods*). sparse: block sparsity
        (FA4's block_sparse_tensors), None or (has_full, q_factor, kv_factor) (sparse_tiles.SparseTiles; with the
        mods' kernels only)."""
        if not 0 <= exp2_emu <= 16 or exp2_emu_degree not in EXP2_POLY:
            raise ValueError(f"exp2_emu {exp2_emu} not in 0..16 or degree {exp2_emu_degree} not in "
                             f"{tuple(EXP2_POLY)}")
        if head_dim not in self.HEAD_DIMS:
            raise ValueError(f"head dim {head_dim} not in {self.HEAD_DIMS}")
        head_dim_v = head_dim if head_dim_v is None else int(head_dim_v)
        if head_dim_v not in self.HEAD_DIMS:
            raise ValueError(f"head dim of v {head_dim_v} not in {self.HEAD_DIMS}")
        if head_dim_v != head_dim and (persistent or tma_o):
            raise ValueError("head_dim_v != head_dim: the one-tile kernel with the direct O store only")
        self.split = bool(split)
        if self.split and (persistent or tma_o or sink):
            raise ValueError("split: the one-tile kernel with the direct O store, without a sink")
        self.paged_kv = PagedKV(paged, block_n, head_dim, head_dim_v, varlen)
        self.paged = self.paged_kv.box_rows
        if dtype not in (cutlass.Float16, cutlass.BFloat16):
            raise ValueError(f"dtype {dtype} not fp16/bf16")
        if num_warpgroups not in self.REGS:
            raise ValueError(f"num_warpgroups {num_warpgroups} not in {tuple(self.REGS)}")
        block_m = 64 * num_warpgroups if block_m is None else block_m
        if block_m != 64 * num_warpgroups:
            raise ValueError(f"block_m {block_m} != 64 * num_warpgroups ({num_warpgroups})")
        self.num_mma_warpgroups = int(num_warpgroups)
        self.producer_regs, self.consumer_regs = self.REGS[self.num_mma_warpgroups]
        self.wg_order = bool(wg_order)
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = bool(causal) and not local  # a causal local window is local with right = 0
        self.local = bool(local)
        self.softcap = bool(softcap)
        self.varlen = bool(varlen)
        self.sink = bool(sink)
        self.block_m = block_m
        self.block_n = block_n
        self.num_stages = num_stages
        self.exp2_emu = int(exp2_emu)
        self.exp2_emu_degree = int(exp2_emu_degree)
        self.num_threads = self.NUM_PRODUCER_THREADS + 128 * self.num_mma_warpgroups
        self.persistent = bool(persistent)
        if self.persistent and (self.local or self.softcap or self.varlen or self.sink):
            raise ValueError("the persistent kernel is dense only (no window, softcap, varlen or sink)")
        self.tma_o = bool(tma_o)
        self.reverse = bool(reverse)
        # Not with three warpgroups and a sink: at their 160 registers CuTeDSL's cubin of the causal d64 sink
        # kernel then spills one register (one STL / LDL pair; ptxas 13.0 on the same PTX spills none).
        self.pin = bool(pin) and not (self.num_mma_warpgroups == 3 and self.sink)
        self.snake = bool(snake) and self.persistent and self.causal
        self.lpt = bool(lpt) and (self.causal or bool(tiles_desc)) and not (self.persistent or self.varlen)
        if self.tma_o and self.varlen:
            raise ValueError("tma_o: dense calls only (no varlen)")
        self.pack_gqa = int(pack_gqa)
        if self.pack_gqa > 1 and (self.persistent or self.tma_o):
            raise ValueError("pack_gqa: the one-tile kernel with the direct O store only (not persistent or tma_o)")
        self.pack = PackGQA(self.pack_gqa, block_m)
        self.block_q = self.pack.block_q  # query positions per tile: block_m, or block_m / g of each of g heads
        if block_n % 16 or not 16 <= block_n <= 256:
            raise ValueError(f"block_n {block_n} not a multiple of 16 in [16, 256] (WGMMA N, P's k-blocks)")
        self.mma = ConsumerMma(dtype, head_dim, head_dim_v, block_m, block_n, self.num_mma_warpgroups,
                               self.persistent)
        self.pack_p = self.mma.pack_p
        if self.smem_bytes() > self.SMEM_BYTES:
            raise ValueError(f"head dim {head_dim}, block_m {block_m}, block_n {block_n}, {num_stages} stages "
                             f"need {self.smem_bytes()} bytes of shared memory, more than {self.SMEM_BYTES}")
        # The components (see the module docstring).
        self.mask = AttentionMask(self.causal, self.local, self.block_q, block_n, self.pack_gqa)
        self.seqlens = SeqlenInfo(self.varlen, self.paged, self.split)
        self.scheduler = (PersistentScheduler(self.causal, self.snake) if self.persistent
                          else OneTileScheduler(self.causal or bool(tiles_desc), self.lpt))
        self.softmax = OnlineSoftmax(block_n, head_dim_v, self.exp2_emu, self.exp2_emu_degree)
        self.epilogue = Epilogue(dtype, head_dim, head_dim_v, self.pack, self.split, self.sink, self.tma_o,
                                 self.persistent, self.num_mma_warpgroups)
        self.mods = ScoreMods.build(self, score_mod, mask_mod, aux, sparse, scalars)
        self.sparse = None if self.mods is None else self.mods.sparse

    def smem_bytes(self):
        """Shared memory the kernel allocates: the barriers (padded to the tiles' 1024-byte alignment),
        the Q tile, num_stages K and V tiles and, persistent with tma_o, the O tile; 2-byte elements."""
        o_rows = self.block_m if self.persistent and self.tma_o else 0
        D, Dv = self.head_dim, self.head_dim_v
        return 1024 + 2 * (D * self.block_m + Dv * o_rows + (D + Dv) * self.num_stages * self.block_n)

    # ------------------------------------------------------------------------------------------------
    # Host side: views, TMA descriptors, launch

    @cute.jit
    def _launch(self, mQ, mK, mVt, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, softmax_scale, softcap,
                window_left, window_right, grid, stream, mSink, sched=None, num_splits=None, aux=None, sparse=None,
                scalars=None):
        """Views are (S, D, H, B) for Q/K/O, (D, S, H, B) for V, (S, H, B) for the lse."""
        dt, D, Dv, BM, BN = self.dtype, self.head_dim, self.head_dim_v, self.block_m, self.block_n
        # 128-byte swizzle atoms span 64 elements of D; head dim 96 is tiled with 64-byte atoms (32 of D)
        # instead, which TMA and the WGMMA descriptors support as well (Q and K by D, V by Dv).
        K_SW = warpgroup.SmemLayoutAtomKind.K_SW128 if D % 64 == 0 else warpgroup.SmemLayoutAtomKind.K_SW64
        MN_SW = warpgroup.SmemLayoutAtomKind.MN_SW128 if Dv % 64 == 0 else warpgroup.SmemLayoutAtomKind.MN_SW64
        sQ_layout = smem_layout(K_SW, dt, (BM, D))
        sK_layout = smem_layout(K_SW, dt, (BN, D, self.num_stages))
        # V^T's atoms (64 of D x 8 keys; 32 of D at d96) are stacked along the keys first: each 64-wide
        # slice of D is then one contiguous (64, BN) block, which one TMA box covers (D-first stacking gave
        # 64 x 8 boxes, 2 * BN / 8 TMA copies per stage).
        sVt_layout = smem_layout(MN_SW, dt, (Dv, BN, self.num_stages), order=(1, 0, 2))

        tiled_mma_qk, tiled_mma_pv = self.mma.tiled_mmas()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        BQ = self.block_q
        # pack_gqa: one (BQ, D) box per query head, into rows [j * BQ, (j + 1) * BQ) of the tile (_produce)
        sQ_box = sQ_layout if cutlass.const_expr(BQ == BM) else cute.composition(sQ_layout, (BQ, D))
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_box, (BQ, D))
        # paged: boxes of PB rows, each into its rows of the stage (PagedKV.load)
        sK_box, sVt_box, PB = self.paged_kv.boxes(cute.slice_(sK_layout, (None, None, 0)),
                                                  cute.slice_(sVt_layout, (None, None, 0)))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, sK_box, (PB, D))
        tma_v, mVt_tma = cpasync.make_tiled_tma_atom(g2s, mVt, sVt_box, (Dv, PB))
        tma_o = None
        if cutlass.const_expr(self.tma_o):
            tma_o, mO = self.epilogue.tma_atom(mO, sQ_layout)

        # exp2 with log2(e) folded into the scale: one FFMA per score instead of FMUL + ex2 scaling.
        # Soft-capped scores are softcap * tanh(scale * s / softcap): the scale goes into the tanh
        # argument and the softmax sees log2(e) only.
        scale_log2 = softmax_scale * LOG2_E
        score_scale = Float32(1.0)
        if cutlass.const_expr(self.softcap):
            score_scale = softmax_scale / softcap
            scale_log2 = Float32(LOG2_E)
        if cutlass.const_expr(self.mods is not None):
            scale_log2, score_scale = self.mods.scales(scale_log2, score_scale, softmax_scale)
        kernel = self.kernel
        # sched: the lpt order's section size, else None
        sched_args = (tma_o, sched, num_splits) + ((aux, sparse, scalars) if cutlass.const_expr(self.mods is not None)
                                                   else ())
        if cutlass.const_expr(self.persistent):
            kernel = self.kernel_persistent
            sched_args = (*sched, tma_o)
        kernel(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mVt_tma, mO, mLSE, mSink, mCuSeqlensQ, mCuSeqlensK,
               mSeqUsedK, scale_log2, score_scale, softcap, window_left, window_right, sQ_layout,
               sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, *sched_args).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream,
            # .minnctapersm 1 pins the register count at entry (65536 / 512 threads): a 3-warpgroup
            # kernel that needs fewer registers (d64 BLOCK_N 64) otherwise has setmaxnreg ignored
            # (C7508). The 2-warpgroup kernels, tuned without it, launch without it.
            **({"min_blocks_per_mp": 1} if self.num_mma_warpgroups == 3 else {}))

    # ------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSink,
               mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, scale_log2: Float32, score_scale: Float32,
               softcap: Float32, window_left: Int32, window_right: Int32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, tma_o, group, num_splits, aux=None, sparse=None, scalars=None):
        """The one-tile kernel. tma_o: the O store's TMA atom (mO is then its coordinate tensor), None
        for the direct store. group: with lpt, the (head, batch) pairs per section of
        tile_scheduler.tile_coords' order (else None). num_splits: split-KV's part count (split=True; else
        None). aux, sparse, scalars: the mods' aux tensors, block-sparsity lists and aux scalars (kernels built with score_mod /
        mask_mod / sparse)."""
        m_block, head, batch = self.scheduler.tile(group)
        seqlen = self.seqlens.tile(batch, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, num_splits)
        args = (tma_q, mQ, tma_k, mK, tma_v, mVt, mO, mLSE, mSink, scale_log2, score_scale, softcap, window_left,
                window_right, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, m_block, head, seqlen,
                tma_o)
        if cutlass.const_expr(self.mods is not None):
            args = args + (aux, sparse, scalars)
        if cutlass.const_expr(self.varlen):
            if m_block * self.block_q < seqlen.seqlen_q:  # the grid covers the longest sequence
                self._cta(*args)
        else:
            self._cta(*args)

    @cute.kernel
    def kernel_persistent(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                          tma_v: cute.CopyAtom, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSink,
                          mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, scale_log2: Float32, score_scale: Float32,
                          softcap: Float32, window_left: Int32, window_right: Int32,
                          sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
                          sVt_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
                          tiled_mma_pv: cute.TiledMma, num_m: Int32, num_hb: Int32, group: Int32,
                          num_tiles: Int32, tma_o):
        """The persistent kernel (dense, causal or not): CTA b runs tiles b, b + G, b + 2G, ... below
        num_tiles (G CTAs, G <= num_tiles; order: PersistentScheduler, with num_m, num_hb and group). The
        pipeline states carry from tile to tile, so the producer loads the next tile's K and V as soon as
        stages free up and its Q once the consumers' last S = Q K^T of the current tile is done, under
        that tile's last P V and epilogue. O and lse go from registers to global memory; with tma_o (its
        atom; None otherwise) O goes through a shared-memory buffer of its own and a TMA store (Epilogue)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        sQ, sK, sVt, q_pipe, k_pipe, v_pipe, sO = self._setup(warp_idx, tma_q, tma_k, tma_v, tma_o, sQ_layout,
                                                              sK_layout, sVt_layout)

        seqlen_q = cute.size(mQ, mode=[0])
        seqlen_k = cute.size(mK, mode=[0])
        heads = cute.size(mQ, mode=[2])
        qheads_per_kv = heads // cute.size(mK, mode=[2])
        sched = (num_m, heads, num_hb, group, num_tiles)

        if warp_idx < 4:
            if cutlass.const_expr(self.producer_regs):
                cute.arch.setmaxregister_decrease(self.producer_regs)
            if tidx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                produce = (tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, sched, seqlen_q,
                           seqlen_k, qheads_per_kv)
                self.scheduler.run(num_tiles, lambda tile, q, k, v: self._produce_tile(tile, produce, q, k, v),
                                   q_state, k_state, v_state)
        else:
            if cutlass.const_expr(self.consumer_regs):
                cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume_persistent(mO, mLSE, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, tiled_mma_qk, tiled_mma_pv,
                                     scale_log2, tidx - self.NUM_PRODUCER_THREADS, sched, seqlen_q, seqlen_k,
                                     tma_o, sO)

    @cute.jit
    def _produce_tile(self, tile, produce, q_state, k_state, v_state):
        """The persistent producer's loads of one tile (linear index ``tile``)."""
        (tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, sched, seqlen_q, seqlen_k,
         qheads_per_kv) = produce
        m_block, head, batch, n_block_max = self._tile(tile, sched, seqlen_q, seqlen_k)
        q_state, k_state, v_state = self._produce(
            tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, m_block, head,
            head // qheads_per_kv, batch, Int32(0), Int32(0), Int32(0), n_block_max,
            states=(q_state, k_state, v_state))
        return q_state, k_state, v_state

    def _tile(self, tile, sched, seqlen_q, seqlen_k):
        """(m_block, head, batch, n_block_max) of the persistent kernel's tile index (trace time)."""
        m_block, hb = self.scheduler.coords(tile, sched)
        _, n_block_max = self.mask.n_block_range(m_block, seqlen_q, seqlen_k)
        return m_block, hb % sched[1], hb // sched[1], n_block_max

    @cute.jit
    def _consume_persistent(self, mO, mLSE, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, tiled_mma_qk, tiled_mma_pv,
                            scale_log2, ctid, sched, seqlen_q, seqlen_k, tma_o=None, sO=None):
        """_consume over the CTA's tiles. Named barriers: the turn to issue GEMMs (see _consume) keeps
        circulating across tile boundaries, as every warpgroup runs the same blocks of the same tiles:
        the last warpgroup hands warpgroup 0 the first turn once, before the first tile; each warpgroup
        then passes it on after every block, the last one included (so warpgroup 0 can start its next
        tile while the others finish theirs); warpgroup 0 takes the final turn back after the last tile,
        so that every arrival meets a wait (per barrier: arrivals = waits = blocks run, + 1 on barrier 1).
        tma_o / sO: O's TMA store atom and shared-memory buffer (persistent kernels built with tma_o)."""
        (wg, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max, row_sum,
         corr) = self.mma.fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, ctid)
        pingpong = cutlass.const_expr(self.num_mma_warpgroups >= 2 and self.wg_order)
        n_threads_pp = 2 * 128
        turn_bar = (wg + 1) % self.num_mma_warpgroups + 1
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(pingpong):
            if wg == self.num_mma_warpgroups - 1:
                cute.arch.barrier_arrive(barrier_id=1, number_of_threads=n_threads_pp)

        consume = (mO, mLSE, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP,
                   row_max, row_sum, corr, k_pipe, v_pipe, q_pipe, scale_log2, ctid, wg, turn_bar, sched, seqlen_q,
                   seqlen_k, tma_o, sO)
        self.scheduler.run(sched[4], lambda tile, q, k, v: self._consume_tile(tile, consume, q, k, v),
                           q_state, k_state, v_state)
        if cutlass.const_expr(pingpong):
            if wg == 0:
                cute.arch.barrier(barrier_id=1, number_of_threads=n_threads_pp)
        if cutlass.const_expr(tma_o is not None):
            if ctid % 128 == 0:  # the last tile's O store: done before the CTA (and its shared memory) goes
                cute.arch.cp_async_bulk_wait_group(0, read=False)

    @cute.jit
    def _consume_tile(self, tile, consume, q_state, k_state, v_state):
        """The persistent consumers' work on one tile (linear index ``tile``): main loop and epilogue."""
        (mO, mLSE, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max,
         row_sum, corr, k_pipe, v_pipe, q_pipe, scale_log2, ctid, wg, turn_bar, sched, seqlen_q, seqlen_k, tma_o,
         sO) = consume
        m_block, head, batch, n_block_max = self._tile(tile, sched, seqlen_q, seqlen_k)
        acc_O.fill(0.0)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        _, n_block_mask_from = self.mask.unmasked_blocks(m_block, seqlen_q, seqlen_k)
        q_pipe.consumer_wait(q_state)
        k_state, v_state = self._mainloop(
            tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, rP, tOrP, row_max, row_sum,
            corr, k_pipe, v_pipe, k_state, v_state, scale_log2, Float32(1.0), Float32(0.0), Int32(0),
            Int32(0), m_block, seqlen_q, seqlen_k, Int32(0), n_block_max, Int32(0), n_block_mask_from, wg,
            turn_bar, n_block_max, q_pipe=q_pipe, q_state=q_state)
        if n_block_max <= 0:  # no key block (causal, Sq > Sk): Q was waited for, not yet released
            q_pipe.consumer_release(q_state)
        q_state.advance()
        # The epilogue's coordinates are recomputed from an opaque copy of the tile index: the ones
        # above would otherwise stay live across the main loop (the one-tile kernel rereads them from
        # blockIdx), which costs the 3-warpgroup kernels registers they do not have.
        m_block, head, batch, _ = self._tile(opaque(tile), sched, seqlen_q, seqlen_k)
        self.epilogue.store(mO, mLSE, acc_O, row_max, row_sum, tOcO, scale_log2, Float32(0.0), ctid, m_block,
                            head, batch, Int32(0), seqlen_q, tma_o, sO, tiled_mma_pv)
        return q_state, k_state, v_state

    @cute.jit
    def _cta(self, tma_q, mQ, tma_k, mK, tma_v, mVt, mO, mLSE, mSink, scale_log2, score_scale, softcap, window_left,
             window_right, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, m_block, head, seqlen,
             tma_o=None, aux=None, sparse=None, scalars=None):
        """One CTA's query tile: rows [m_block * BM, (m_block + 1) * BM) of the sequence ``seqlen``
        (seqlen_info.TileSeqlens; pack_gqa: positions [m_block * BQ, (m_block + 1) * BQ) of the g query heads of
        KV head `head`, see PackGQA), the key blocks that the mask (and split-KV's part) leave it."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head_kv = self.pack.head_kv(head, mQ, mK)
        sQ, sK, sVt, q_pipe, k_pipe, v_pipe, _ = self._setup(warp_idx, tma_q, tma_k, tma_v, tma_o, sQ_layout,
                                                             sK_layout, sVt_layout)
        n_block_min, n_block_max = self.mask.n_block_range(m_block, seqlen.seqlen_q, seqlen.seqlen_k, window_left,
                                                           window_right)
        n_block_min, n_block_max = seqlen.split_blocks(n_block_min, n_block_max, self.block_n)
        mods = None
        if cutlass.const_expr(self.mods is not None):
            mods = self.mods.context(seqlen, head, aux, score_scale, scalars)
        tiles = None  # block sparsity: the tile walks the positions of its lists (sparse_tiles)
        if cutlass.const_expr(self.sparse is not None):
            # (a varlen call's lists are per sequence)
            tiles = self.sparse.tile(sparse, seqlen.batch if seqlen.sequence is None else seqlen.sequence, head,
                                     m_block)
            n_block_min, n_block_max = Int32(0), tiles.count

        if warp_idx < 4:
            # Producer warpgroup: only TMA issue, so it hands its registers to the consumers.
            if cutlass.const_expr(self.producer_regs):
                cute.arch.setmaxregister_decrease(self.producer_regs)
            if tidx == 0:
                self._produce(tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe,
                              m_block, head, head_kv, seqlen.batch, seqlen.q_start, seqlen.k_start, n_block_min,
                              n_block_max, paging=seqlen.paging, tiles=tiles)
        else:
            if cutlass.const_expr(self.consumer_regs):
                cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(mO, mLSE, mSink, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, tiled_mma_qk, tiled_mma_pv,
                          scale_log2, score_scale, softcap, window_left, window_right,
                          tidx - self.NUM_PRODUCER_THREADS, m_block, head, seqlen.out_batch, seqlen.q_start,
                          seqlen.seqlen_q, seqlen.seqlen_k, n_block_min, n_block_max, tma_o, mods, tiles)

    @cute.jit
    def _setup(self, warp_idx, tma_q, tma_k, tma_v, tma_o, sQ_layout, sK_layout, sVt_layout):
        """The CTA's start (trace time): warp 0 prefetches the TMA descriptors, then the shared memory and
        pipelines (_shared), their mbarrier inits made visible to the async proxy (TMA) and to every thread."""
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(tma_o is not None):
                cpasync.prefetch_descriptor(tma_o)
        shared = self._shared(sQ_layout, sK_layout, sVt_layout)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return shared

    def _shared(self, sQ_layout, sK_layout, sVt_layout):
        """The shared-memory tiles and the Q, K, V mbarrier pipelines, and the persistent kernel's O buffer when
        built with tma_o, else None (trace time; no control flow, so that the kernels place these ops where they
        call it)."""
        dt, stages = self.dtype, self.num_stages
        smem = SmemAllocator()
        q_bars = smem.allocate_array(cutlass.Int64, num_elems=2, byte_alignment=8)
        k_bars = smem.allocate_array(cutlass.Int64, num_elems=2 * stages, byte_alignment=8)
        v_bars = smem.allocate_array(cutlass.Int64, num_elems=2 * stages, byte_alignment=8)
        sQ = smem.allocate_tensor(dt, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(dt, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sVt = smem.allocate_tensor(dt, sVt_layout.outer, byte_alignment=1024, swizzle=sVt_layout.inner)
        sO = None  # the persistent kernel's O buffer (tma_o): a tile of Q's layout
        if cutlass.const_expr(self.persistent and self.tma_o):
            sO = smem.allocate_tensor(dt, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)

        num_mma_warps = self.num_mma_warpgroups * 4
        # Full barriers count the TMA bytes; empty barriers one arrival per consumer warp. K and V have
        # their own pipelines: S = Q K^T starts when K has landed, and a K stage is free again as soon
        # as S is computed, while V stays until P V is done.
        def tma_pipe(bars, n, nbytes):
            return pipeline.PipelineTmaAsync.create(
                num_stages=n, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_mma_warps),
                tx_count=nbytes, barrier_storage=bars, defer_sync=True)

        q_pipe = tma_pipe(q_bars, 1, cute.size_in_bytes(dt, sQ_layout))
        k_pipe = tma_pipe(k_bars, stages, cute.size_in_bytes(dt, cute.slice_(sK_layout, (None, None, 0))))
        v_pipe = tma_pipe(v_bars, stages, cute.size_in_bytes(dt, cute.slice_(sVt_layout, (None, None, 0))))
        return sQ, sK, sVt, q_pipe, k_pipe, v_pipe, sO

    @cute.jit
    def _produce(self, tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, m_block,
                 head, head_kv, batch, q_start, k_start, n_block_min, n_block_max, states=None, paging=None,
                 tiles=None):
        """The TMA loads of one tile: Q, then K and V of each visible key block. states: the persistent
        kernel's (q, k, v) producer states, carried from tile to tile and returned advanced past this tile
        (None: the one-tile kernel, which starts them here). paging (paged kernel): (page table, the sequence's
        index, its key count). tiles: block sparsity's TileSparsity (positions -> key blocks), else None."""
        BQ, BN, D, G = self.block_q, self.block_n, self.head_dim, self.pack_gqa
        if cutlass.const_expr(paging is None):  # (paged: per box, PagedKV.load)
            mK_h = mK[None, None, head_kv, batch]
            mVt_h = mVt[None, None, head_kv, batch]
            if cutlass.const_expr(self.varlen):  # the sequence's first row becomes row 0
                mK_h = cute.domain_offset((k_start, 0), mK_h)
                mVt_h = cute.domain_offset((0, k_start), mVt_h)
            gK = cute.local_tile(mK_h, (BN, D), (None, 0))      # (BN, D, n)
            gVt = cute.local_tile(mVt_h, (self.head_dim_v, BN), (0, None))    # (Dv, BN, n)
            tKsK, tKgK = tma_tiles(tma_k, sK, gK)
            tVsV, tVgV = tma_tiles(tma_v, sVt, gVt)

        if cutlass.const_expr(states is None):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        else:
            q_state, k_state, v_state = states
        q_pipe.producer_acquire(q_state)
        # One box (G = 1), or one per query head of the KV head's group (pack_gqa), all on Q's barrier, whose
        # transaction count is the whole tile's bytes.
        for j in cutlass.range_constexpr(G):
            mQ_h = mQ[None, None, self.pack.q_head(head, j), batch]
            if cutlass.const_expr(self.varlen):  # the sequence's first row becomes row 0
                mQ_h = cute.domain_offset((q_start, 0), mQ_h)
            gQ = cute.local_tile(mQ_h, (BQ, D), (None, 0))      # (BQ, D, m)
            tQsQ, tQgQ = tma_tiles(tma_q, self.pack.q_box(sQ, j, D), gQ)
            cute.copy(tma_q, tQgQ[None, m_block], tQsQ, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))

        if cutlass.const_expr(states is None):
            k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        else:
            # The single Q buffer is acquired again for the next tile only when every consumer warp has
            # released it (after this tile's last S = Q K^T): the phase flips once per tile.
            q_state.advance()
        for n in cutlass.range(n_block_min, n_block_max, unroll=1):  # n: the position (key_block)
            n_block = key_block(n, n_block_min, n_block_max, self.reverse)
            if cutlass.const_expr(tiles is not None):
                n_block = tiles.block(n)
            if cutlass.const_expr(paging is not None):
                self.paged_kv.load(tma_k, mK, tma_v, mVt, sK, sVt, k_pipe, v_pipe, k_state, v_state, head_kv,
                                   n_block, *paging)
                k_state.advance()
                v_state.advance()
            else:
                k_pipe.producer_acquire(k_state)
                cute.copy(tma_k, tKgK[None, n_block], tKsK[None, k_state.index],
                          tma_bar_ptr=k_pipe.producer_get_barrier(k_state))
                k_state.advance()
                v_pipe.producer_acquire(v_state)
                cute.copy(tma_v, tVgV[None, n_block], tVsV[None, v_state.index],
                          tma_bar_ptr=v_pipe.producer_get_barrier(v_state))
                v_state.advance()
        return q_state, k_state, v_state

    @cute.jit
    def _consume(self, mO, mLSE, mSink, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, tiled_mma_qk, tiled_mma_pv,
                 scale_log2, score_scale, softcap, window_left, window_right, ctid, m_block, head, batch,
                 q_start, seqlen_q, seqlen_k, n_block_min, n_block_max, tma_o=None, mods=None, tiles=None):
        """FlashAttention-3's consumer (Shah et al. 2024, sections 3.1-3.2). Within a warpgroup, block j's
        S = Q K_j^T and the previous block's O += P V_{j-1} are both in flight while the softmax of
        block j-1 has finished; the softmax of S_j then runs while P V_{j-1} is still computing. Across
        the warpgroups, named barriers pass the turn to issue GEMMs around (ping-pong with two, a round
        robin with three): one issues its GEMMs while the others do softmax."""
        (wg, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max, row_sum,
         corr) = self.mma.fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, ctid)
        sink_log2 = self.epilogue.load_sink(mSink, head, m_block, tOcO)

        # Ping-pong: warpgroup w waits on named barrier 1 + w before issuing GEMMs and then lets the
        # next one go (barrier 0 is __syncthreads; 1..NW are these, nothing else in the kernel uses named
        # barriers). All warpgroups run the same number of blocks. One turn circulates, so barrier
        # 1 + w's generations alternate strictly between the previous warpgroup's arrive and w's wait
        # (2 x 128 threads each).
        # With three warpgroups the turn goes round robin 0 -> 1 -> 2 -> 0. Why order them at all (FA3
        # keeps its scheduler barriers for three warpgroups too): unordered warpgroups drift into step,
        # all issuing GEMMs together and then all waiting on MUFU together, which leaves the tensor cores
        # idle during the softmax; in a fixed rotation each warpgroup's softmax runs under the other two
        # warpgroups' GEMMs (2 of 3 slots, where ping-pong has 1 of 2), so a slower softmax (d64: a short
        # GEMM per exponential) still hides.
        last_wg = self.num_mma_warpgroups - 1
        # Turn passing (see _pass_turn), loop-invariant parts: warpgroup w arrives on barrier 1 + (w + 1)
        # mod NW after every block, except the last warpgroup after its last block (the turn it would
        # pass was given up front); i.e. after the block at position n iff n < n_block_max - (w == NW - 1)
        # (positions n_block_min .. n_block_max - 1 in processing order: the key block itself, or with
        # reverse its mirror, see key_block; the turns do not depend on the order).
        if cutlass.const_expr(self.num_mma_warpgroups == 2):
            turn_bar = 2 - wg
            turn_below = n_block_max - wg
        else:
            turn_bar = wg + 2
            turn_below = n_block_max
            if wg == last_wg:
                turn_bar = Int32(1)
                turn_below = n_block_max - 1

        # Blocks in [n_block_mask_below, n_block_mask_from) need no mask: every row of the tile sees every key.
        n_block_mask_below, n_block_mask_from = self.mask.unmasked_blocks(m_block, seqlen_q, seqlen_k, window_left,
                                                                          window_right)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)

        # Wait for Q even when no key block is visible: the CTA must not exit with its TMA load in flight.
        q_pipe.consumer_wait(q_state)
        self._mainloop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, rP, tOrP, row_max,
                       row_sum, corr, k_pipe, v_pipe, k_state, v_state, scale_log2, score_scale, softcap,
                       window_left, window_right, m_block, seqlen_q, seqlen_k, n_block_min, n_block_max,
                       n_block_mask_below, n_block_mask_from, wg, turn_bar, turn_below, mods=mods, tiles=tiles)

        self.epilogue.store(mO, mLSE, acc_O, row_max, row_sum, tOcO, scale_log2, sink_log2, ctid, m_block, head,
                            batch, q_start, seqlen_q, tma_o, sQ, tiled_mma_pv)

    @cute.jit
    def _mainloop(self, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, rP, tOrP, row_max,
                  row_sum, corr, k_pipe, v_pipe, k_state, v_state, scale_log2, score_scale, softcap, window_left,
                  window_right, m_block, seqlen_q, seqlen_k, n_block_min, n_block_max, n_block_mask_below,
                  n_block_mask_from, wg, turn_bar, turn_below, q_pipe=None, q_state=None, mods=None, tiles=None):
        """One tile's key blocks [n_block_min, n_block_max) into acc_O / row_max / row_sum (see
        _consume), in key_block's order (ascending, or descending when built with reverse). Returns the K and V
        consumer states advanced past them. q_pipe / q_state (persistent kernel): Q is released after the tile's
        last S = Q K^T, and the turn to issue GEMMs is not handed to warpgroup 0 here (the caller did once, before
        its first tile). tiles: block sparsity's TileSparsity: positions [n_block_min, n_block_max) are its list
        positions, mapped to key blocks by tiles.block (the mask_mod on the partial ones only)."""
        pingpong = cutlass.const_expr(self.num_mma_warpgroups >= 2 and self.wg_order)
        n_threads_pp = 2 * 128
        last_wg = self.num_mma_warpgroups - 1
        if n_block_max > n_block_min:
            if cutlass.const_expr(pingpong and q_pipe is None):
                if wg == last_wg:  # warpgroup 0 goes first: the last one hands it the first turn
                    cute.arch.barrier_arrive(barrier_id=1, number_of_threads=n_threads_pp)
            # The first block: S = Q K^T, then its softmax (nothing to overlap with yet).
            k_pipe.consumer_wait(k_state)
            if cutlass.const_expr(q_pipe is not None and self.num_mma_warpgroups == 2):
                # S = Q K^T's WGMMA names acc_S as an input too (scale-d 0 ignores the values, the register
                # constraint does not): in the persistent kernel the last tile's scores would be live
                # through that tile's epilogue, and at d128 ptxas then serialises the WGMMAs (C7512).
                # Not with three warpgroups: at their 160 registers ptxas spills 80 bytes with it (d64,
                # no mask) and keeps the WGMMAs in order without it.
                acc_S.fill(0.0)
            if cutlass.const_expr(pingpong):
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=n_threads_pp)
            self.mma.gemm_qk(tiled_mma_qk, acc_S, tSrQ, tSrK, k_state.index)
            if cutlass.const_expr(pingpong):
                self._pass_turn(turn_bar, n_block_min < turn_below, n_threads_pp)
            warpgroup.wait_group(0)
            k_pipe.consumer_release(k_state)
            k_state.advance()
            if cutlass.const_expr(self.softcap):
                self.softmax.cap(acc_S, score_scale, softcap)
            # Reverse: this first block is the tile's last one, where a row may see no key yet (rows above
            # the diagonal; a window's right edge): OnlineSoftmax.step keeps its max at -inf and its P at 0.
            n_first = key_block(n_block_min, n_block_min, n_block_max, self.reverse)
            partial = None  # (block sparsity: whether the mask_mod applies; else it always does)
            if cutlass.const_expr(tiles is not None):
                n_first = tiles.block(n_block_min)
                partial = tiles.partial(n_block_min)
            if cutlass.const_expr(mods is not None):
                self.mods.apply(acc_S, tScS, m_block, n_first, mods, partial)
            if n_first >= n_block_mask_from or n_first < n_block_mask_below:
                self.mask.apply(acc_S, tScS, m_block, n_first, seqlen_q, seqlen_k, window_left, window_right)
            self.softmax.step(acc_S, row_max, row_sum, corr, scale_log2)
            self.mma.to_p(acc_S, rP)

            # n_block: the position; the turns count positions, the mask takes the key block (key_block)
            for n_block in cutlass.range(n_block_min + 1, n_block_max, unroll=1):
                k_pipe.consumer_wait(k_state)
                v_pipe.consumer_wait(v_state)
                if cutlass.const_expr(pingpong):
                    cute.arch.barrier(barrier_id=1 + wg, number_of_threads=n_threads_pp)
                self.mma.gemm_qk(tiled_mma_qk, acc_S, tSrQ, tSrK, k_state.index)   # S_j = Q K_j^T
                self.softmax.rescale(acc_O, corr)  # O was final up to block j-2; scale it to block j-1's max
                self.mma.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrV, v_state.index)   # O += P_{j-1} V_{j-1}
                if cutlass.const_expr(pingpong):
                    self._pass_turn(turn_bar, n_block < turn_below, n_threads_pp)
                warpgroup.wait_group(1)  # S_j is ready; P V may still run
                k_pipe.consumer_release(k_state)
                k_state.advance()
                # The softmax sits in both branches so the wait below starts its own basic block:
                # ptxas hoists a wait it finds in the softmax's block above the softmax, which would
                # end the overlap with P V. softmax.pin keeps LLVM from merging the branches' common tail
                # (the second row's exponentials) into that block again: without it every causal, local or
                # softcap kernel runs half its exponentials after the wait (ptxas 13.0 SASS,
                # benchmarks/tools/cute_sass.py "P V wait" line: 33 of 66 MUFU.EX2 at d128 causal; with it 0).
                if cutlass.const_expr(self.softcap):
                    self.softmax.cap(acc_S, score_scale, softcap)
                n_key = key_block(n_block, n_block_min, n_block_max, self.reverse)
                partial = None
                if cutlass.const_expr(tiles is not None):
                    n_key = tiles.block(n_block)
                    partial = tiles.partial(n_block)
                if cutlass.const_expr(mods is not None):
                    self.mods.apply(acc_S, tScS, m_block, n_key, mods, partial)
                if n_key >= n_block_mask_from or n_key < n_block_mask_below:
                    self.mask.apply(acc_S, tScS, m_block, n_key, seqlen_q, seqlen_k, window_left, window_right)
                    self.softmax.step(acc_S, row_max, row_sum, corr, scale_log2)
                    if cutlass.const_expr(self.pin):
                        pin(acc_S, row_sum, corr, "masked")
                else:
                    self.softmax.step(acc_S, row_max, row_sum, corr, scale_log2)
                    if cutlass.const_expr(self.pin):
                        pin(acc_S, row_sum, corr, "unmasked")
                warpgroup.wait_group(0)  # P V done: P's registers and V's stage are free
                v_pipe.consumer_release(v_state)
                self.mma.to_p(acc_S, rP)
                v_state.advance()

            if cutlass.const_expr(q_pipe is not None):
                # Every S = Q K^T of the tile is complete (the last wait_group(0) above): Q's buffer goes
                # back to the producer, which loads the next tile's Q while this P V and the epilogue run.
                q_pipe.consumer_release(q_state)
            # The last block's O += P V.
            v_pipe.consumer_wait(v_state)
            self.softmax.rescale(acc_O, corr)
            self.mma.gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrV, v_state.index)
            warpgroup.wait_group(0)
            v_pipe.consumer_release(v_state)
            # The persistent kernel carries v_state into the next tile: without this advance it would
            # wait on this stage (already full) and release it a second time there, one stage behind the
            # producer per tile, until the phases wrap and both sides wait on each other (the hang).
            v_state.advance()
        return k_state, v_state

    @cute.jit
    def _pass_turn(self, turn_bar, arrive, n_threads):
        """Let the next warpgroup issue its GEMMs: arrive on named barrier turn_bar (1 + the next
        warpgroup's index) when `arrive`. The last warpgroup skips this after its last block, so that
        every arrival on a named barrier meets a wait (warpgroup 0 waits once more than the last one
        arrives after blocks: the first turn was given up front)."""
        if arrive:
            cute.arch.barrier_arrive(barrier_id=turn_bar, number_of_threads=n_threads)
