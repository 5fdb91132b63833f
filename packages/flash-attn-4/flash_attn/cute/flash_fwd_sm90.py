"""Attention forward for Hopper (sm_90a) in CuTeDSL, after FlashAttention-3 (Shah et al. 2024, sections
3.1-3.2): TMA loads into swizzled shared memory through an mbarrier pipeline, WGMMA with fp32 register
accumulators, a producer warpgroup that only issues TMA (registers given back with setmaxnreg) and two
or three consumer warpgroups of 64 query rows each that compute (BLOCK_M 128 or 192), online softmax in
fp32 with exp2 (Milakov & Gimelshein 2018).

Layouts seen by the kernel (views built on the host, no copies):
  mQ (Sq, D, H, B), mK (Sk, D, Hk, B), mV (Sk, D, Hk, B), mO (Sq, D, H, B), mLSE (Sq, H, B) fp32,
  mSink (H,) fp32 (kernels built with sink=True only).
One CTA per (BLOCK_M query tile, head, batch); or, built with persistent=True (dense calls: by default d64
causal ones, see interface._FWD_PERSISTENT; FLASH_ATTN_CUTE_FWD_PERSISTENT=1 / 0 for all / none), one CTA per
SM looping over the tiles in a static order (causal: longest first within L2-sized sections of heads), the
next tile's loads overlapping the current one's last blocks and epilogue (kernel_persistent).
A tile's key blocks run ascending, or built with reverse=True (FLASH_ATTN_CUTE_FWD_REVERSE=1) from the last
down, FA3's order: a causal or windowed tile's masked blocks first (key_block).
"""
import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator

from flash_attn.cute.softmax_exp import EXP2_POLY, emulated_columns, exp2_poly

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def _tree(op, values):
    """op folded over values as a balanced tree (trace time: emits log2(n) levels of independent ops)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


def _tma_tiles(atom, s, g, modes=2):
    """(smem, gmem) views of one CTA's TMA copy ``atom``: the first ``modes`` modes of the shared tile ``s``
    and of the global tiles ``g`` form the copied box (trace time; no cluster multicast)."""
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, modes),
                                 cute.group_modes(g, 0, modes))


def _smem_layout(kind, dtype, shape, order=None):
    """A WGMMA-compatible swizzled smem layout of ``shape`` (first two modes: the MMA operand's),
    tiled with the layout atom in ``order`` (default: mode 0 first)."""
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, shape, order=order or tuple(range(len(shape))))


def _opaque(x):
    """x (Int32) through a mov the compiler cannot see through: values computed from it are recomputed
    where they are needed rather than kept live from an earlier identical computation."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value()], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def tile_coords(tile, num_m, num_hb, group, causal, minimum=min):
    """The persistent kernel's static tile order: (m_block, hb) of linear tile index ``tile`` among
    num_m query blocks x num_hb (head, batch) pairs, hb = head + heads * batch. Python ints or DSL
    integers (``minimum``: cutlass.min in the kernel). Without a mask the query blocks of one head are
    consecutive, so the CTAs running at once share that head's K and V in L2. Causal: longest tiles
    first (the last query block sees the most keys), within sections of ``group`` (head, batch) pairs
    whose K and V fit in L2 together: in section order, then query block from the last down, then pair.
    So every CTA's i-th tile comes from the same band of lengths and the cheapest tiles come last, where
    they fill the tail of the last wave (with group >= num_hb: longest first over all pairs)."""
    if causal:
        span = group * num_m
        section = tile // span
        first = section * group
        size = minimum(group, num_hb - first)  # the last section may be short
        r = tile - section * span
        return num_m - 1 - r // size, first + r % size
    return tile % num_m, tile // num_m


def lpt_block(x, y, z, num_m, heads, batches, group, minimum=min):
    """(m_block, head, batch) that the one-tile causal kernel built with lpt runs in block (x, y, z) of its
    (num_m, heads, batches) grid: the tile of linear block index x + num_m (y + heads z) in tile_coords' causal
    order with sections of ``group`` (head, batch) pairs. Python ints or DSL integers."""
    m_block, hb = tile_coords(x + num_m * (y + heads * z), num_m, heads * batches, group, True, minimum=minimum)
    return m_block, hb % heads, hb // heads


def cta_tile(position, bid, num_ctas, snake):
    """The linear tile index (into tile_coords' order) of CTA bid's position-th tile among num_ctas CTAs:
    rounds of num_ctas consecutive tiles, CTA bid taking the bid-th of each; with snake, the odd rounds
    from the other end (the bid-th from the last), so that over a longest-first order every CTA's total
    stays near the mean (the plain stride hands CTA 0 the longest tile of every round). Python ints or
    DSL integers; an index >= the tile count means no tile (the last round may be partial)."""
    if snake:
        odd = position % 2
        return position * num_ctas + bid + odd * (num_ctas - 1 - 2 * bid)
    return position * num_ctas + bid


def _pin(acc_S, row_sum, corr, tag):
    """Ends a softmax branch of the main loop: every value it computed passes through a side-effecting
    inline asm (a mov ptxas folds away), so LLVM cannot sink the two branches' common tail (the second
    row's exponentials) into the join block, nor move exponentials below the P V wait that follows it,
    where ptxas then issues them after the wait (the softmax no longer overlaps P V). The tag differs per
    branch so that the two asm statements are not identical either."""
    op = f"mov.b32 $0, $1; // pin {tag}"
    for t in (acc_S, row_sum, corr):
        for i in range(cute.size(t)):
            t[i] = Float32(llvm.inline_asm(T.f32(), [Float32(t[i]).ir_value()], op, "=f,f",
                                           has_side_effects=True, is_align_stack=False,
                                           asm_dialect=llvm.AsmDialect.AD_ATT))


def packed_row(row, m_block, block_q, group):
    """(query position, query head within the KV head's group) of row ``row`` of query tile ``m_block``
    (python ints on the host and in tests, Int32 in the kernel): with pack_gqa (group g > 1) the tile holds
    block_q positions of each of the g heads, head-major (each head's rows are one TMA box); else
    (group 1, block_q = block_m) the rows are positions and the head is the CTA's."""
    if group == 1:
        return m_block * block_q + row, 0
    return m_block * block_q + row % block_q, row // block_q


def key_block(position, n_block_min, n_block_max, reverse):
    """The key block a tile processes at ``position`` of its walk over [n_block_min, n_block_max), the
    positions running n_block_min, n_block_min + 1, ... in processing order: the block itself, or with
    ``reverse`` its mirror (n_block_max - 1 first, n_block_min last: FA3's order, a causal or local tile's
    masked diagonal blocks before the unmasked ones). Python ints or DSL integers. The producer's loads,
    the consumers' masks and nothing else go through it: the pipeline stages and the ping-pong turns count
    positions, which are the same in both orders."""
    if reverse:
        return n_block_max - 1 + n_block_min - position
    return position


class FlashFwdSm90:
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
    # (interface._FWD3_BLOCK_N*).
    REGS = {2: (24, 240), 3: (24, 160)}
    PRODUCER_REGS, CONSUMER_REGS = REGS[2]

    UNBOUNDED = 1 << 30  # window size standing for "no limit on this side" (host passes it for -1)
    # Bytes of K and V (all key rows of the KV heads of one causal section, see tile_coords) that the
    # persistent order keeps in use together: FA3's scheduler budgets 32 MiB of the L2 (50 MiB on H100 /
    # H200) for K and V (it also rounds its sections to a power of two heads; this one does not).
    L2_KV_BYTES = 32 << 20
    HEAD_DIMS = (64, 96, 128, 192, 256)
    # Dynamic shared memory of one CTA on sm_90 (227 KB), which holds the barriers (below 1 KB, padded
    # to the 1024-byte alignment of the swizzled tiles), Q and the K / V stages.
    SMEM_BYTES = 232448

    def __init__(self, dtype, head_dim, causal, local=False, softcap=False, varlen=False, block_m=None,
                 block_n=128, num_stages=2, exp2_emu=0, exp2_emu_degree=3, sink=False, num_warpgroups=2,
                 wg_order=True, persistent=False, tma_o=False, reverse=False, pin=True, snake=True, lpt=False,
                 pack_gqa=1, head_dim_v=None, paged=0, split=False):
        """exp2_emu: of every 16 softmax exponentials a thread computes, this many (0..16, spread evenly
        over its fragment) use a degree-exp2_emu_degree polynomial on the FMA pipe instead of MUFU.EX2
        (softmax_exp.py), to relieve the MUFU pipe. num_warpgroups: consumer warpgroups (2 or 3) of 64
        query rows each; block_m must be 64 * num_warpgroups (the default). wg_order=False: no named
        barriers between the consumer warpgroups (each keeps only its intra-warpgroup overlap), to
        measure what the ping-pong / round robin buys. persistent: one CTA per SM loops over the tiles
        (kernel_persistent; entry point call_persistent), dense calls only (no window, softcap, varlen or
        sink). tma_o: O goes through shared memory (Q's buffer, free once the tile's last S = Q K^T is
        done) and one TMA store per consumer warpgroup (dense calls only: a TMA box would write past a packed
        sequence's end into the next one, so varlen keeps the direct store). In the persistent kernel, whose
        producer loads the next tile's Q into Q's buffer under the epilogue, O has a buffer of its own
        (BLOCK_M x D more shared memory), and a tile's store is waited for (its reads of the buffer) only
        before the next tile's epilogue writes it, so that it runs under the next tile's main loop.
        reverse: each tile walks its key blocks from the last down (key_block), so a causal or local
        tile's masked blocks come first and its warpgroups end on unmasked ones (FA3's order); both
        kernels, every mask. Without a causal mask or window only the sequence's tail block is masked,
        and it comes first too: correct, but the config (interface._fwd_config) asks for it only for
        causal and local calls. pin: each softmax branch of the key-block loop ends in _pin, which keeps
        the whole softmax ahead of the P V wait (False: the code before it, for A/Bs; ignored with three
        warpgroups and a sink). snake (persistent causal kernels): the tiles in longest-first order over all
        (head, batch) pairs, dealt to the CTAs in a snake (cta_tile); False: longest first within L2-sized
        sections of heads, dealt round robin (the order before session 12, for A/Bs). lpt (one-tile dense
        causal kernels): CTA (x, y, z) runs the tile of linear index x + num_m (y + heads z) in tile_coords'
        causal order (longest first within L2-sized sections of (head, batch) pairs), so that the blocks the
        hardware issues first are the longest ones over all heads; False: longest first within each head
        (the x order reversed). pack_gqa: g > 1 packs the g query heads of each KV head into one tile (the
        kernel then serves exactly H = g * Hk; one-tile kernel only, direct O store): a CTA runs (block_m / g
        query positions x g heads, KV head, batch), so a short query sequence (decoding) fills the tile's rows
        and K / V are loaded once for the g heads. Tile row r is query head g * head_kv + r // (block_m / g) at
        position m_block * (block_m / g) + r % (block_m / g) (packed_row): Q arrives as g TMA boxes of
        (block_m / g, D), one per head, each in its own rows of the tile. head_dim_v: V's (and O's) head dim when it
        differs from Q's and K's (e.g. 192 / 128, DeepSeek's MLA without absorption; one-tile kernel with the direct O
        store, as the TMA O store goes through Q's buffer); None: head_dim. paged: > 0 for a paged K / V cache
        (varlen only): K and V are (num_pages, page_size, Hk, D) and each sequence's keys are the pages its row of
        the page table names, in order (call_varlen takes the page table where cu_seqlens_k goes, and seqused_k
        gives the key counts); each key block arrives as block_n / paged TMA boxes of ``paged`` rows (paged =
        min(page_size, block_n): whole pages, or block_n rows of one page), each from its own page. split
        (call_split, call_varlen_split; one-tile kernel, direct O store, no sink): split-KV, the key blocks of each
        tile divided among num_splits CTAs (a runtime argument; grid z = batch (or sequences) x num_splits), each
        writing its part's O (divided by its own row sums) and lse in fp32 to entry split * B + b of mO / mLSE
        (varlen: entry split, see call_varlen_split), for the host to combine (interface._combine_splits, which
        adds a sink)."""
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
        self.paged = int(paged)
        if self.paged and (not varlen or self.paged % 8 or block_n % self.paged):
            raise ValueError(f"paged {paged}: varlen only, with boxes of a multiple of 8 rows that divide block_n "
                             f"({block_n})")
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
        # P converted pairwise into 32-bit registers that the P V WGMMA reads as they are (_to_p). The
        # element-wise conversion leaves one 16-bit value per register and packs the pairs next to each
        # WGMMA, after its fence: at the 160-register budget ptxas then injects a warpgroup.arrive per
        # WGMMA (C7519, d64 BLOCK_N 96-112) or spills (BLOCK_N 128: 112 bytes); packed, d64 BLOCK_N 128
        # is clean. Off for 2 warpgroups at head dims 64 and 128, whose SASS stays as measured; on for
        # the others, where the S, P and O accumulators (D / 2 + 3 BLOCK_N / 4 registers) fill the
        # 240-register budget too: d256 at BLOCK_N 80 with element-wise P gets 8 injected
        # warpgroup.arrive (C7519) around the P V WGMMAs, packed none. On in the persistent kernel at d128,
        # where the element-wise conversion takes 2 F2FP per pair in the key-block loop (64, not 32; at
        # d64 it stays at 32 and packing adds 12 instructions to the loop's steady-state path).
        # Also on for blocks of more than 128 keys (2 warpgroups, d128): element-wise, BLOCK_N 176 spills
        # 348 bytes with 10 injected warpgroup.arrive (C7519); packed it is clean (ptxas 13.0, sm_90a).
        self.pack_p = (self.num_mma_warpgroups == 3 or head_dim not in (64, 128)
                       or (bool(persistent) and head_dim == 128) or block_n > 128)
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
        self.lpt = bool(lpt) and self.causal and not (self.persistent or self.varlen)
        if self.tma_o and self.varlen:
            raise ValueError("tma_o: dense calls only (no varlen)")
        self.pack_gqa = int(pack_gqa)
        if self.pack_gqa > 1 and (self.persistent or self.tma_o):
            raise ValueError("pack_gqa: the one-tile kernel with the direct O store only (not persistent or tma_o)")
        if self.pack_gqa < 1 or block_m % self.pack_gqa or (block_m // self.pack_gqa) % 8:
            raise ValueError(f"pack_gqa {pack_gqa}: block_m ({block_m}) / pack_gqa must be a whole multiple of 8 "
                             "(the swizzle atom's rows, where each head's TMA box starts)")
        # Query positions per tile: block_m, or block_m / g of each of the g heads with pack_gqa.
        self.block_q = block_m // self.pack_gqa
        if block_n % 16 or not 16 <= block_n <= 256:
            raise ValueError(f"block_n {block_n} not a multiple of 16 in [16, 256] (WGMMA N, P's k-blocks)")
        if self.smem_bytes() > self.SMEM_BYTES:
            raise ValueError(f"head dim {head_dim}, block_m {block_m}, block_n {block_n}, {num_stages} stages "
                             f"need {self.smem_bytes()} bytes of shared memory, more than {self.SMEM_BYTES}")

    def smem_bytes(self):
        """Shared memory the kernel allocates: the barriers (padded to the tiles' 1024-byte alignment),
        the Q tile, num_stages K and V tiles and, persistent with tma_o, the O tile; 2-byte elements."""
        o_rows = self.block_m if self.persistent and self.tma_o else 0
        D, Dv = self.head_dim, self.head_dim_v
        return 1024 + 2 * (D * self.block_m + Dv * o_rows + (D + Dv) * self.num_stages * self.block_n)

    # ------------------------------------------------------------------------------------------------
    # Host side: views, TMA descriptors, launch

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, stream):
        """Dense: mQ/mO (B, Sq, H, D), mK/mV (B, Sk, Hk, D), mLSE (B, H, Sq) fp32, as PyTorch lays them
        out. softcap is read when the kernel was built with softcap=True, window_left/right (>= 0,
        UNBOUNDED for no limit) when built with local=True."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None)

    @cute.jit
    def call_sink(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32, stream,
                  mSink: cute.Tensor):
        """__call__ for a kernel built with sink=True: mSink (H,) fp32, natural-log logits (not scaled by
        softmax_scale). A separate entry point, so that __call__'s compiled signature has no sink
        argument at all."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, mSink)

    @cute.jit
    def call_split(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                   softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                   num_splits: Int32, stream):
        """__call__ for a kernel built with split=True: mO (num_splits * B, Sq, H, Dv) and mLSE (num_splits * B, H,
        Sq) fp32, the parts of split s of batch entry b at s * B + b; num_splits >= 1."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None,
                    num_splits=num_splits)

    @cute.jit
    def call_persistent(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                        mLSE: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                        window_right: Int32, stream, max_ctas: Int32):
        """__call__ for a kernel built with persistent=True: min(tiles, max_ctas) CTAs loop over the
        tiles (max_ctas >= 1: the SM count, as one CTA fills an SM's shared memory)."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None,
                    max_ctas)

    @cute.jit
    def _dense(self, mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, mSink,
               max_ctas=None, num_splits=None):
        # (B, S, H, D) -> (S, D, H, B): the first two modes are the tile, the others index the CTA.
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 3, 2, 0]))
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
        # V is the B operand of O = P V with N = D contiguous (MN-major): view it as (D, Sk, Hk, B).
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        # pack_gqa: one tile per KV head covers its g query heads
        heads = cute.size(mK, mode=[2]) if cutlass.const_expr(self.pack_gqa > 1) else cute.size(mQ, mode=[2])
        grid = (cute.ceil_div(cute.size(mQ, mode=[0]), self.block_q), heads, cute.size(mQ, mode=[3]))
        if cutlass.const_expr(num_splits is not None):
            grid = (grid[0], grid[1], grid[2] * num_splits)  # z: split * B + batch entry
        sched = None
        if cutlass.const_expr(max_ctas is not None):
            # The persistent kernel's schedule (tile_coords), as kernel parameters: they stay in the
            # constant bank instead of taking consumer registers across the main loop; (head, batch)
            # pairs per causal section: _l2_group.
            num_m, heads, batch = grid
            group = self._l2_group(mK, heads)
            if cutlass.const_expr(self.snake):
                # One section: with sections, the stride deals CTA b tiles from the same place of every
                # section's sawtooth of lengths (max / mean work 1.16 at d128 16k, 1.42 at d256: the
                # balance test in tests/test_cute_persistent.py); the snake over one longest-first order
                # keeps it within 1.03.
                group = heads * batch
            sched = (num_m, heads * batch, group, num_m * heads * batch)
            grid = (cutlass.min(sched[3], max_ctas), 1, 1)
        elif cutlass.const_expr(self.lpt):
            sched = self._l2_group(mK, grid[1])
        self._launch(mQ, mK, mVt, mO, mLSE, None, None, None, softmax_scale, softcap, window_left,
                     window_right, grid, stream, mSink, sched, num_splits)

    def _l2_group(self, mK, heads):
        """(head, batch) pairs per causal section of tile_coords (trace time): as many KV heads as fit in
        L2_KV_BYTES (at least one), each serving heads / Hk query heads; a constant // Sk, so no 32-bit
        overflow. mK: the (Sk, D, Hk, B) view."""
        return cutlass.max(self.L2_KV_BYTES // ((self.head_dim + self.head_dim_v) * self.dtype.width // 8)
                           // cute.size(mK, mode=[0]), 1) * (heads // cute.size(mK, mode=[2]))

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                    mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                    window_left: Int32, window_right: Int32, stream):
        """Varlen (kernel built with varlen=True): mQ/mO (total_q, H, D), mK/mV (total_k, Hk, D), mLSE
        (H, total_q) fp32, cu_seqlens int32 (B + 1,), mSeqUsedK int32 (B,): the keys each sequence uses
        from its start (cu_seqlens_k's differences when the caller has none to give)."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, None)

    @cute.jit
    def call_varlen_sink(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                         mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                         mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                         window_left: Int32, window_right: Int32, stream, mSink: cute.Tensor):
        """call_varlen for a kernel built with varlen=True and sink=True; mSink as in call_sink."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, mSink)

    @cute.jit
    def call_varlen_split(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                          mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                          mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                          window_left: Int32, window_right: Int32, num_splits: Int32, stream):
        """call_varlen for a kernel built with varlen=True and split=True: mO (num_splits, total_q, H, Dv) and mLSE
        (num_splits, H, total_q) fp32, split s's part of every sequence's rows in entry s; num_splits >= 1."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, None, num_splits=num_splits)

    @cute.jit
    def _varlen(self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                softcap, window_left, window_right, stream, mSink, num_splits=None):
        # (T, H, D) -> (T, D, H, 1): the dense kernel's view with one batch entry; sequences are
        # row offsets into it.
        unit = cute.make_layout(1)
        mQ = cute.make_tensor(mQ.iterator, cute.append(cute.select(mQ.layout, mode=[0, 2, 1]), unit))
        if cutlass.const_expr(num_splits is not None):
            # split: (S, T, H, Dv) -> (T, Dv, H, S) and the lse (S, H, T) -> (T, H, S): the parts are the batch entries
            mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[1, 3, 2, 0]))
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        else:
            mO = cute.make_tensor(mO.iterator, cute.append(cute.select(mO.layout, mode=[0, 2, 1]), unit))
            mLSE = cute.make_tensor(mLSE.iterator, cute.append(cute.select(mLSE.layout, mode=[1, 0]), unit))
        if cutlass.const_expr(self.paged):
            # paged: K / V (num_pages, page_size, Hk, D) -> (page_size, D, Hk, num_pages), V^T (D, page_size, Hk,
            # num_pages): the dense views with pages for batch entries; mCuSeqlensK is the page table
            mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 3, 2, 0]))
            mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        else:
            mK = cute.make_tensor(mK.iterator, cute.append(cute.select(mK.layout, mode=[0, 2, 1]), unit))
            mVt = cute.make_tensor(mV.iterator, cute.append(cute.select(mV.layout, mode=[2, 0, 1]), unit))
        heads = cute.size(mK, mode=[2]) if cutlass.const_expr(self.pack_gqa > 1) else cute.size(mQ, mode=[2])
        grid = (cute.ceil_div(max_seqlen_q, self.block_q), heads, cute.size(mCuSeqlensQ, mode=[0]) - 1)
        if cutlass.const_expr(num_splits is not None):
            grid = (grid[0], grid[1], grid[2] * num_splits)  # z: split * sequences + sequence
        self._launch(mQ, mK, mVt, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, softmax_scale, softcap,
                     window_left, window_right, grid, stream, mSink, num_splits=num_splits)

    @cute.jit
    def _launch(self, mQ, mK, mVt, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, softmax_scale, softcap,
                window_left, window_right, grid, stream, mSink, sched=None, num_splits=None):
        """Views are (S, D, H, B) for Q/K/O, (D, S, H, B) for V, (S, H, B) for the lse."""
        dt, D, Dv, BM, BN = self.dtype, self.head_dim, self.head_dim_v, self.block_m, self.block_n
        # 128-byte swizzle atoms span 64 elements of D; head dim 96 is tiled with 64-byte atoms (32 of D)
        # instead, which TMA and the WGMMA descriptors support as well (Q and K by D, V by Dv).
        K_SW = warpgroup.SmemLayoutAtomKind.K_SW128 if D % 64 == 0 else warpgroup.SmemLayoutAtomKind.K_SW64
        MN_SW = warpgroup.SmemLayoutAtomKind.MN_SW128 if Dv % 64 == 0 else warpgroup.SmemLayoutAtomKind.MN_SW64
        sQ_layout = _smem_layout(K_SW, dt, (BM, D))
        sK_layout = _smem_layout(K_SW, dt, (BN, D, self.num_stages))
        # V^T's atoms (64 of D x 8 keys; 32 of D at d96) are stacked along the keys first: each 64-wide
        # slice of D is then one contiguous (64, BN) block, which one TMA box covers (D-first stacking gave
        # 64 x 8 boxes, 2 * BN / 8 TMA copies per stage).
        sVt_layout = _smem_layout(MN_SW, dt, (Dv, BN, self.num_stages), order=(1, 0, 2))

        tiled_mma_qk = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, BN, 16), warpgroup.OperandSource.SMEM,
                OperandMajorMode.K, OperandMajorMode.K)),
            (self.num_mma_warpgroups, 1, 1))
        # P stays in registers (converted from the S accumulator) and feeds the second WGMMA directly.
        tiled_mma_pv = cute.make_tiled_mma(
            cute.make_mma_atom(warpgroup.MmaF16BF16Op(
                dt, Float32, (64, Dv, 16), warpgroup.OperandSource.RMEM,
                OperandMajorMode.K, OperandMajorMode.MN)),
            (self.num_mma_warpgroups, 1, 1))

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        BQ = self.block_q
        # pack_gqa: one (BQ, D) box per query head, into rows [j * BQ, (j + 1) * BQ) of the tile (_produce)
        sQ_box = sQ_layout if cutlass.const_expr(BQ == BM) else cute.composition(sQ_layout, (BQ, D))
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_box, (BQ, D))
        # paged: boxes of PB rows (a page, or block_n rows of one), each into its rows of the stage (_produce)
        PB = self.paged if cutlass.const_expr(self.paged) else BN
        sK_box = cute.slice_(sK_layout, (None, None, 0))
        sVt_box = cute.slice_(sVt_layout, (None, None, 0))
        if cutlass.const_expr(PB != BN):
            sK_box = cute.composition(sK_box, (PB, D))
            sVt_box = cute.composition(sVt_box, (Dv, PB))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, sK_box, (PB, D))
        tma_v, mVt_tma = cpasync.make_tiled_tma_atom(g2s, mVt, sVt_box, (Dv, PB))
        tma_o = None
        if cutlass.const_expr(self.tma_o):
            # One warpgroup's 64 rows of Q's buffer (the first ones; the kernel offsets the others) go
            # out as one (64, D) box per warpgroup; rows past Sq are clipped by TMA.
            tma_o, mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.composition(sQ_layout, (64, D)), (64, D))

        # exp2 with log2(e) folded into the scale: one FFMA per score instead of FMUL + ex2 scaling.
        # Soft-capped scores are softcap * tanh(scale * s / softcap): the scale goes into the tanh
        # argument and the softmax sees log2(e) only.
        scale_log2 = softmax_scale * LOG2_E
        score_scale = Float32(1.0)
        if cutlass.const_expr(self.softcap):
            score_scale = softmax_scale / softcap
            scale_log2 = Float32(LOG2_E)
        kernel = self.kernel
        sched_args = (tma_o, sched, num_splits)  # sched: the lpt order's section size, else None
        if cutlass.const_expr(self.persistent):
            kernel = self.kernel_persistent
            sched_args = (*sched, tma_o)
        kernel(tma_q, mQ_tma, tma_k, mK_tma, tma_v, mVt_tma, mO, mLSE, mSink, mCuSeqlensQ, mCuSeqlensK,
               mSeqUsedK, scale_log2, score_scale, softcap, window_left, window_right, sQ_layout,
               sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, *sched_args).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream,
            # .minnctapersm 1 pins the register count at entry (65536 / 512 threads): a 3-warpgroup
            # kernel that needs fewer registers (d64 BLOCK_N 64) otherwise has setmaxnreg ignored
            # (C7508). The 2-warpgroup kernels are left as they were measured.
            **({"min_blocks_per_mp": 1} if self.num_mma_warpgroups == 3 else {}))

    # ------------------------------------------------------------------------------------------------
    # Device side

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mVt: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSink,
               mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, scale_log2: Float32, score_scale: Float32,
               softcap: Float32, window_left: Int32, window_right: Int32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, tma_o, group, num_splits):
        """The one-tile kernel. tma_o: the O store's TMA atom (mO is then its coordinate tensor), None
        for the direct store. group: with lpt, the (head, batch) pairs per section of tile_coords' order
        (else None). num_splits: split-KV's part count (split=True; else None)."""
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.lpt):
            # Longest first over all heads (within L2-sized sections): the hardware issues CTAs in linear
            # block order, so the first wave takes the longest tiles and the shortest ones fill the tail.
            m_block, head, batch = lpt_block(m_block, head, batch, *cute.arch.grid_dim(), group,
                                             minimum=cutlass.min)
        elif cutlass.const_expr(self.causal):
            # Longest first: the query tiles near the end see the most keys; the block scheduler issues
            # CTAs in x order, so the cheap tiles fill the tail of the grid.
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        if cutlass.const_expr(self.varlen):
            # Sequence `seq` is rows [start, start + length) of the packed tensors (batch index 0).
            seq = batch
            split = None
            if cutlass.const_expr(self.split):
                # z = split * sequences + sequence: the part's O / lse rows go to batch index `split` of the views
                seqs = cute.size(mCuSeqlensQ, mode=[0]) - 1
                seq = batch % seqs
                split = (batch // seqs, num_splits, batch // seqs)
            q_start = mCuSeqlensQ[seq]
            seqlen_q = mCuSeqlensQ[seq + 1] - q_start
            if cutlass.const_expr(self.paged):
                k_start = Int32(0)  # the sequence's keys are its pages (mCuSeqlensK: the page table)
                page_table = mCuSeqlensK
            else:
                k_start = mCuSeqlensK[seq]
                page_table = None
            seqlen_k = mSeqUsedK[seq]
            if m_block * self.block_q < seqlen_q:  # the grid covers the longest sequence
                self._cta(tma_q, mQ, tma_k, mK, tma_v, mVt, mO, mLSE, mSink, scale_log2, score_scale, softcap,
                          window_left, window_right, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk,
                          tiled_mma_pv, m_block, head, Int32(0), q_start, k_start, seqlen_q, seqlen_k, tma_o,
                          page_table, seq, split)
        elif cutlass.const_expr(self.split):
            # z = split * B + b: batch entry b's inputs, split `split`'s key blocks, outputs at z
            batches = cute.size(mQ, mode=[3])
            self._cta(tma_q, mQ, tma_k, mK, tma_v, mVt, mO, mLSE, mSink, scale_log2, score_scale, softcap,
                      window_left, window_right, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv,
                      m_block, head, batch % batches, Int32(0), Int32(0), cute.size(mQ, mode=[0]),
                      cute.size(mK, mode=[0]), tma_o, split=(batch // batches, num_splits, batch))
        else:
            self._cta(tma_q, mQ, tma_k, mK, tma_v, mVt, mO, mLSE, mSink, scale_log2, score_scale, softcap,
                      window_left, window_right, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv,
                      m_block, head, batch, Int32(0), Int32(0), cute.size(mQ, mode=[0]),
                      cute.size(mK, mode=[0]), tma_o)

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
        num_tiles (G CTAs, G <= num_tiles; order: tile_coords, with num_m, num_hb and group). The
        pipeline states carry from tile to tile, so the producer loads the next tile's K and V as soon as
        stages free up and its Q once the consumers' last S = Q K^T of the current tile is done, under
        that tile's last P V and epilogue. O and lse go from registers to global memory; with tma_o (its
        atom; None otherwise) O goes through a shared-memory buffer of its own and a TMA store (_store_o_tma)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(tma_o is not None):
                cpasync.prefetch_descriptor(tma_o)
        sQ, sK, sVt, q_pipe, k_pipe, v_pipe, sO = self._shared(sQ_layout, sK_layout, sVt_layout)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        seqlen_q = cute.size(mQ, mode=[0])
        seqlen_k = cute.size(mK, mode=[0])
        heads = cute.size(mQ, mode=[2])
        qheads_per_kv = heads // cute.size(mK, mode=[2])
        sched = (num_m, heads, num_hb, group, num_tiles)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if tidx == 0:
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                bid, _, _ = cute.arch.block_idx()
                num_ctas, _, _ = cute.arch.grid_dim()
                produce = (tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, sched, seqlen_q,
                           seqlen_k, qheads_per_kv)
                if cutlass.const_expr(self.snake):
                    for position in cutlass.range(cute.ceil_div(num_tiles, num_ctas), unroll=1):
                        tile = cta_tile(position, bid, num_ctas, True)
                        if tile < num_tiles:
                            q_state, k_state, v_state = self._produce_tile(tile, produce, q_state, k_state,
                                                                           v_state)
                else:
                    for tile in cutlass.range(bid, num_tiles, num_ctas, unroll=1):
                        q_state, k_state, v_state = self._produce_tile(tile, produce, q_state, k_state, v_state)
        else:
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
        num_m, heads, num_hb, group, _ = sched
        m_block, hb = tile_coords(tile, num_m, num_hb, group, self.causal, minimum=cutlass.min)
        n_block_max = cute.ceil_div(seqlen_k, self.block_n)
        if cutlass.const_expr(self.causal):
            last_col = (m_block + 1) * self.block_m + seqlen_k - seqlen_q  # as in _cta
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(last_col, 0), self.block_n))
        return m_block, hb % heads, hb // heads, n_block_max

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
        BN = self.block_n
        (wg, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max, row_sum,
         corr) = self._fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, ctid)
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

        bid, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        consume = (mO, mLSE, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP,
                   row_max, row_sum, corr, k_pipe, v_pipe, q_pipe, scale_log2, ctid, wg, turn_bar, sched, seqlen_q,
                   seqlen_k, tma_o, sO)
        if cutlass.const_expr(self.snake):
            for position in cutlass.range(cute.ceil_div(sched[4], num_ctas), unroll=1):
                tile = cta_tile(position, bid, num_ctas, True)
                if tile < sched[4]:
                    q_state, k_state, v_state = self._consume_tile(tile, consume, q_state, k_state, v_state)
        else:
            for tile in cutlass.range(bid, sched[4], num_ctas, unroll=1):
                q_state, k_state, v_state = self._consume_tile(tile, consume, q_state, k_state, v_state)
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
        BN = self.block_n
        m_block, head, batch, n_block_max = self._tile(tile, sched, seqlen_q, seqlen_k)
        acc_O.fill(0.0)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        n_block_mask_from = seqlen_k // BN  # see _consume
        if cutlass.const_expr(self.causal):
            n_block_mask_from = cutlass.min(
                n_block_mask_from, cutlass.max(m_block * self.block_m + seqlen_k - seqlen_q + 1, 0) // BN)
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
        m_block, head, batch, _ = self._tile(_opaque(tile), sched, seqlen_q, seqlen_k)
        self._epilogue(mO, mLSE, acc_O, row_max, row_sum, tOcO, scale_log2, Float32(0.0), ctid, m_block,
                       head, batch, Int32(0), seqlen_q, tma_o, sO, tiled_mma_pv)
        return q_state, k_state, v_state

    @cute.jit
    def _cta(self, tma_q, mQ, tma_k, mK, tma_v, mVt, mO, mLSE, mSink, scale_log2, score_scale, softcap, window_left,
             window_right, sQ_layout, sK_layout, sVt_layout, tiled_mma_qk, tiled_mma_pv, m_block, head, batch,
             q_start, k_start, seqlen_q, seqlen_k, tma_o=None, page_table=None, sequence=None, split=None):
        """One CTA's query tile: rows [m_block * BM, (m_block + 1) * BM) of the sequence that starts at
        row q_start (keys at k_start) of batch entry `batch` of the views (pack_gqa: positions [m_block * BQ,
        (m_block + 1) * BQ) of the g query heads of KV head `head`, see packed_row). split (split-KV): (this part's
        index, the part count, the outputs' batch index): the part's share of the key blocks."""
        BQ, BN = self.block_q, self.block_n
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if cutlass.const_expr(self.pack_gqa > 1):
            head_kv = head
        else:
            head_kv = head // (cute.size(mQ, mode=[2]) // cute.size(mK, mode=[2]))  # GQA / MQA

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            if cutlass.const_expr(tma_o is not None):
                cpasync.prefetch_descriptor(tma_o)

        sQ, sK, sVt, q_pipe, k_pipe, v_pipe, _ = self._shared(sQ_layout, sK_layout, sVt_layout)
        # mbarrier inits must be visible to the async proxy (TMA) and to every thread before use.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Key blocks this query tile sees (bottom-right aligned masks: row i's diagonal is key
        # i + Sk - Sq): all; up to the diagonal (causal); or the window around it (local).
        n_block_min = Int32(0)
        n_block_max = cute.ceil_div(seqlen_k, BN)
        if cutlass.const_expr(self.causal or self.local):
            right = Int32(0) if cutlass.const_expr(self.causal) else window_right
            last_col = (m_block + 1) * BQ + seqlen_k - seqlen_q + right  # exclusive bound of visible keys
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(last_col, 0), BN))
        if cutlass.const_expr(self.local):
            first_col = m_block * BQ + seqlen_k - seqlen_q - window_left  # first key row m_block*BQ sees
            n_block_min = cutlass.max(first_col, 0) // BN
        out_batch = batch
        if cutlass.const_expr(split is not None):
            # Part s takes key blocks [s * per, (s + 1) * per) of the sequence, those the tile sees: the parts
            # partition the blocks for every tile (a part with none writes O = 0, lse = +inf, no contribution).
            part, parts, out_batch = split
            per = cute.ceil_div(cute.ceil_div(seqlen_k, BN), parts)
            n_block_min = cutlass.max(n_block_min, part * per)
            n_block_max = cutlass.min(n_block_max, (part + 1) * per)

        if warp_idx < 4:
            # Producer warpgroup: only TMA issue, so it hands its registers to the consumers.
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if tidx == 0:
                self._produce(tma_q, mQ, tma_k, mK, tma_v, mVt, sQ, sK, sVt, q_pipe, k_pipe, v_pipe,
                              m_block, head, head_kv, batch, q_start, k_start, n_block_min, n_block_max,
                              paging=None if page_table is None else (page_table, sequence, seqlen_k))
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(mO, mLSE, mSink, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, tiled_mma_qk, tiled_mma_pv,
                          scale_log2, score_scale, softcap, window_left, window_right,
                          tidx - self.NUM_PRODUCER_THREADS, m_block, head, out_batch, q_start, seqlen_q,
                          seqlen_k, n_block_min, n_block_max, tma_o)

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
                 head, head_kv, batch, q_start, k_start, n_block_min, n_block_max, states=None, paging=None):
        """The TMA loads of one tile: Q, then K and V of each visible key block. states: the persistent
        kernel's (q, k, v) producer states, carried from tile to tile and returned advanced past this tile
        (None: the one-tile kernel, which starts them here). paging (paged kernel): (page table, the sequence's
        index, its key count)."""
        BQ, BN, D, G = self.block_q, self.block_n, self.head_dim, self.pack_gqa
        if cutlass.const_expr(paging is None):  # (paged: per box, _produce_paged)
            mK_h = mK[None, None, head_kv, batch]
            mVt_h = mVt[None, None, head_kv, batch]
            if cutlass.const_expr(self.varlen):  # the sequence's first row becomes row 0
                mK_h = cute.domain_offset((k_start, 0), mK_h)
                mVt_h = cute.domain_offset((0, k_start), mVt_h)
            gK = cute.local_tile(mK_h, (BN, D), (None, 0))      # (BN, D, n)
            gVt = cute.local_tile(mVt_h, (self.head_dim_v, BN), (0, None))    # (Dv, BN, n)
            tKsK, tKgK = _tma_tiles(tma_k, sK, gK)
            tVsV, tVgV = _tma_tiles(tma_v, sVt, gVt)

        if cutlass.const_expr(states is None):
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        else:
            q_state, k_state, v_state = states
        q_pipe.producer_acquire(q_state)
        # One box (G = 1), or one per query head of the KV head's group (pack_gqa), all on Q's barrier, whose
        # transaction count is the whole tile's bytes.
        for j in cutlass.range_constexpr(G):
            mQ_h = mQ[None, None, (head * G + j) if G > 1 else head, batch]
            if cutlass.const_expr(self.varlen):  # the sequence's first row becomes row 0
                mQ_h = cute.domain_offset((q_start, 0), mQ_h)
            gQ = cute.local_tile(mQ_h, (BQ, D), (None, 0))      # (BQ, D, m)
            sQ_j = sQ if cutlass.const_expr(G == 1) else cute.local_tile(sQ, (BQ, D), (j, 0))
            tQsQ, tQgQ = _tma_tiles(tma_q, sQ_j, gQ)
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
            if cutlass.const_expr(paging is not None):
                self._produce_paged(tma_k, mK, tma_v, mVt, sK, sVt, k_pipe, v_pipe, k_state, v_state, head_kv,
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
    def _produce_paged(self, tma_k, mK, tma_v, mVt, sK, sVt, k_pipe, v_pipe, k_state, v_state, head_kv, n_block,
                       page_table, sequence, seqlen_k):
        """Key block n_block of a paged sequence: BN / PB boxes of PB rows for K and for V, box c holding keys
        n_block * BN + c * PB + [0, PB) from their page (page_table[sequence, key // page_size], rows key % page_size
        on). A box past the sequence's last key reads its last page instead (its keys are masked), so that no page
        table entry past the sequence's pages is read and every box lands on the stage's barrier."""
        BN, PB, D, Dv = self.block_n, self.paged, self.head_dim, self.head_dim_v
        page_size = cute.size(mK, mode=[0])
        # K's stage first, then V's (which frees later, after P V), as the dense producer does. The box loops are not
        # unrolled: unrolled, the producer's 24 registers spill at d192 (7 boxes of 16 rows).
        k_pipe.producer_acquire(k_state)
        sK_s = sK[None, None, k_state.index]
        for c in cutlass.range(BN // PB, unroll=1):
            key = cutlass.min(n_block * BN + c * PB, seqlen_k - 1)
            page = page_table[sequence, key // page_size]
            gK = cute.local_tile(mK[None, None, head_kv, page], (PB, D), (None, 0))  # (PB, D, page_size / PB)
            sK_c = sK_s if cutlass.const_expr(PB == BN) else cute.local_tile(sK_s, (PB, D), (c, 0))
            tKsK, tKgK = _tma_tiles(tma_k, sK_c, gK)
            cute.copy(tma_k, tKgK[None, (key % page_size) // PB], tKsK,
                      tma_bar_ptr=k_pipe.producer_get_barrier(k_state))
        v_pipe.producer_acquire(v_state)
        sVt_s = sVt[None, None, v_state.index]
        for c in cutlass.range(BN // PB, unroll=1):
            key = cutlass.min(n_block * BN + c * PB, seqlen_k - 1)
            page = page_table[sequence, key // page_size]
            gVt = cute.local_tile(mVt[None, None, head_kv, page], (Dv, PB), (0, None))  # (Dv, PB, page_size / PB)
            sVt_c = sVt_s if cutlass.const_expr(PB == BN) else cute.local_tile(sVt_s, (Dv, PB), (0, c))
            tVsV, tVgV = _tma_tiles(tma_v, sVt_c, gVt)
            cute.copy(tma_v, tVgV[None, (key % page_size) // PB], tVsV,
                      tma_bar_ptr=v_pipe.producer_get_barrier(v_state))

    @cute.jit
    def _mask(self, acc_S, tScS, m_block, n_block, seqlen_q, seqlen_k, window_left, window_right):
        """-inf for the keys past the sequence end (zero-filled by TMA) and, when causal, past each row's
        diagonal, when local, outside [diagonal - window_left, diagonal + window_right]."""
        BN = self.block_n
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            row, _ = packed_row(tScS[i][0], m_block, self.block_q, self.pack_gqa)  # the query position
            col = n_block * BN + tScS[i][1]
            masked = col >= seqlen_k
            if cutlass.const_expr(self.causal):
                masked = masked | (col > row + seqlen_k - seqlen_q)
            if cutlass.const_expr(self.local):
                diag = row + seqlen_k - seqlen_q
                masked = masked | (col > diag + window_right) | (col < diag - window_left)
            if masked:
                acc_S[i] = -Float32.inf

    @cute.jit
    def _cap(self, acc_S, score_scale, softcap):
        """Soft-capping: s -> softcap * tanh(scale * s / softcap) (the scale is in score_scale)."""
        for i in cutlass.range(cute.size(acc_S), unroll_full=True):
            acc_S[i] = softcap * cute.math.tanh(acc_S[i] * score_scale, fastmath=True)

    @cute.jit
    def _softmax(self, acc_S, row_max, row_sum, corr, scale_log2):
        """Online softmax of one score block, in place: acc_S becomes exp2(scale * (s - new max)) (fp32),
        row_max / row_sum are updated and corr gets the factor exp2(scale * (old max - new max)) that
        rescales the rows of O. Accumulator of an m64nNk16 WGMMA: per thread ((2 cols, 2 rows, N/8
        col groups), 1, 1), value (c, r, j) at index c + 2 r + 4 j; the row's other columns live in
        the 3 other threads of its quad (lanes 4q..4q+3)."""
        num_col_groups = self.block_n // 8
        for r in cutlass.range_constexpr(2):
            idx = [c + 2 * r + 4 * j for j in range(num_col_groups) for c in range(2)]
            # Pairwise trees, not a chain: 2N/8 dependent max/add steps would leave the warp waiting
            # on latency (only two or three consumer warps share a scheduler).
            m_new = _tree(cute.arch.fmax, [acc_S[i] for i in idx] + [row_max[r]])
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=1))
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=2))
            # A row with no visible key so far keeps max -inf; subtract 0 then so exp2 gives 0.
            m_scaled = m_new * scale_log2
            if m_new == -Float32.inf:
                m_scaled = Float32(0.0)
            corr[r] = cute.math.exp2(row_max[r] * scale_log2 - m_scaled, fastmath=True)
            row_max[r] = m_new
            for i, emu in zip(idx, emulated_columns(len(idx), self.exp2_emu)):
                if cutlass.const_expr(emu):
                    acc_S[i] = exp2_poly(acc_S[i] * scale_log2 - m_scaled, self.exp2_emu_degree)
                else:
                    acc_S[i] = cute.math.exp2(acc_S[i] * scale_log2 - m_scaled, fastmath=True)
            # partial over this thread's columns; the quad is summed at the end
            row_sum[r] = row_sum[r] * corr[r] + _tree(lambda a, b: a + b, [acc_S[i] for i in idx])

    @cute.jit
    def _rescale(self, acc_O, corr):
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(self.head_dim_v // 8):
                for c in cutlass.range_constexpr(2):
                    acc_O[c + 2 * r + 4 * j] = acc_O[c + 2 * r + 4 * j] * corr[r]

    @cute.jit
    def _consume(self, mO, mLSE, mSink, sQ, sK, sVt, q_pipe, k_pipe, v_pipe, tiled_mma_qk, tiled_mma_pv,
                 scale_log2, score_scale, softcap, window_left, window_right, ctid, m_block, head, batch,
                 q_start, seqlen_q, seqlen_k, n_block_min, n_block_max, tma_o=None):
        """FlashAttention-3's consumer (Shah et al. 2024, sections 3.1-3.2). Within a warpgroup, block j's
        S = Q K_j^T and the previous block's O += P V_{j-1} are both in flight while the softmax of
        block j-1 has finished; the softmax of S_j then runs while P V_{j-1} is still computing. Across
        the warpgroups, named barriers pass the turn to issue GEMMs around (ping-pong with two, a round
        robin with three): one issues its GEMMs while the others do softmax."""
        BQ, BN, G = self.block_q, self.block_n, self.pack_gqa
        (wg, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max, row_sum,
         corr) = self._fragments(tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, ctid)
        # The head's sink logit, loaded now so that its global-memory latency hides behind the main loop
        # (pack_gqa: one per row of the thread, each of its own query head).
        sink_log2 = Float32(0.0)
        if cutlass.const_expr(self.sink):
            if cutlass.const_expr(G > 1):
                sink_log2 = [mSink[head * G + packed_row(tOcO[2 * r][0], m_block, BQ, G)[1]] * LOG2_E
                             for r in range(2)]
            else:
                sink_log2 = mSink[head] * LOG2_E

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

        # Blocks in [n_block_mask_below, n_block_mask_from) need no mask: every row of the tile sees
        # every key in them. Outside: the sequence tail, keys past a row's diagonal (causal) or outside
        # its window (local).
        n_block_mask_below = Int32(0)
        n_block_mask_from = seqlen_k // BN
        if cutlass.const_expr(self.causal or self.local):
            right = Int32(0) if cutlass.const_expr(self.causal) else window_right
            n_block_mask_from = cutlass.min(
                n_block_mask_from, cutlass.max(m_block * BQ + seqlen_k - seqlen_q + right + 1, 0) // BN)
        if cutlass.const_expr(self.local):
            # the last row of the tile sees keys from (m_block + 1) * BQ - 1 + Sk - Sq - window_left on
            n_block_mask_below = cute.ceil_div(
                cutlass.max((m_block + 1) * BQ - 1 + seqlen_k - seqlen_q - window_left, 0), BN)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)

        # Wait for Q even when no key block is visible: the CTA must not exit with its TMA load in flight.
        q_pipe.consumer_wait(q_state)
        self._mainloop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, rP, tOrP, row_max,
                       row_sum, corr, k_pipe, v_pipe, k_state, v_state, scale_log2, score_scale, softcap,
                       window_left, window_right, m_block, seqlen_q, seqlen_k, n_block_min, n_block_max,
                       n_block_mask_below, n_block_mask_from, wg, turn_bar, turn_below)

        self._epilogue(mO, mLSE, acc_O, row_max, row_sum, tOcO, scale_log2, sink_log2, ctid, m_block, head,
                       batch, q_start, seqlen_q, tma_o, sQ, tiled_mma_pv)

    def _fragments(self, tiled_mma_qk, tiled_mma_pv, sQ, sK, sVt, ctid):
        """A consumer thread's operand views and accumulators, O zeroed and the softmax state reset
        (trace time, no control flow)."""
        dt, Dv, BM, BN = self.dtype, self.head_dim_v, self.block_m, self.block_n
        thr_qk = tiled_mma_qk.get_slice(ctid)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        # The shared-memory operands are the same for all 128 threads of a warpgroup: partition them
        # with the warpgroup's first thread, a warp-uniform index, so that ptxas can build the WGMMA
        # descriptors in uniform registers (with ctid it computes them per thread and moves each one
        # with R2UR before every WGMMA).
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = tiled_mma_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((BM, BN)), Float32)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((BM, Dv)), Float32)
        acc_O.fill(0.0)
        tScS = thr_qk.partition_C(cute.make_identity_tensor((BM, BN)))
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((BM, Dv)))
        # The S accumulator's value order matches the register A operand of m64nDk16 when its N/8 column
        # groups are split into (2, N/16) (checked by tests/test_cute_compile.py).
        p_layout = cute.make_layout(((2, 2, 2), 1, BN // 16))
        if cutlass.const_expr(self.pack_p):
            # P as 32-bit registers of two values each, the A operand a view of them (see _to_p)
            rP = cute.make_rmem_tensor((cute.size(acc_S) // 2,), Int32)
            tOrP = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=dt), p_layout)
        else:
            rP = cute.make_rmem_tensor_like(acc_S, dt)
            tOrP = cute.make_tensor(rP.iterator, p_layout)

        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        corr = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return wg, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, tOcO, rP, tOrP, row_max, row_sum, corr

    @cute.jit
    def _mainloop(self, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_S, acc_O, tScS, rP, tOrP, row_max,
                  row_sum, corr, k_pipe, v_pipe, k_state, v_state, scale_log2, score_scale, softcap, window_left,
                  window_right, m_block, seqlen_q, seqlen_k, n_block_min, n_block_max, n_block_mask_below,
                  n_block_mask_from, wg, turn_bar, turn_below, q_pipe=None, q_state=None):
        """One tile's key blocks [n_block_min, n_block_max) into acc_O / row_max / row_sum (see
        _consume), in key_block's order (ascending, or descending when built with reverse). Returns the K and V
        consumer states advanced past them. q_pipe / q_state (persistent kernel): Q is released after the tile's
        last S = Q K^T, and the turn to issue GEMMs is not handed to warpgroup 0 here (the caller did once, before
        its first tile)."""
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
            self._gemm_qk(tiled_mma_qk, acc_S, tSrQ, tSrK, k_state.index)
            if cutlass.const_expr(pingpong):
                self._pass_turn(turn_bar, n_block_min < turn_below, n_threads_pp)
            warpgroup.wait_group(0)
            k_pipe.consumer_release(k_state)
            k_state.advance()
            if cutlass.const_expr(self.softcap):
                self._cap(acc_S, score_scale, softcap)
            # Reverse: this first block is the tile's last one, where a row may see no key yet (rows
            # above the diagonal; a window's right edge): _softmax keeps its max at -inf and its P at 0.
            n_first = key_block(n_block_min, n_block_min, n_block_max, self.reverse)
            if n_first >= n_block_mask_from or n_first < n_block_mask_below:
                self._mask(acc_S, tScS, m_block, n_first, seqlen_q, seqlen_k, window_left, window_right)
            self._softmax(acc_S, row_max, row_sum, corr, scale_log2)
            self._to_p(acc_S, rP)

            # n_block: the position; the turns count positions, the mask takes the key block (key_block)
            for n_block in cutlass.range(n_block_min + 1, n_block_max, unroll=1):
                k_pipe.consumer_wait(k_state)
                v_pipe.consumer_wait(v_state)
                if cutlass.const_expr(pingpong):
                    cute.arch.barrier(barrier_id=1 + wg, number_of_threads=n_threads_pp)
                self._gemm_qk(tiled_mma_qk, acc_S, tSrQ, tSrK, k_state.index)   # S_j = Q K_j^T
                self._rescale(acc_O, corr)  # O was final up to block j-2; scale it to block j-1's max
                self._gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrV, v_state.index)   # O += P_{j-1} V_{j-1}
                if cutlass.const_expr(pingpong):
                    self._pass_turn(turn_bar, n_block < turn_below, n_threads_pp)
                warpgroup.wait_group(1)  # S_j is ready; P V may still run
                k_pipe.consumer_release(k_state)
                k_state.advance()
                # The softmax sits in both branches so the wait below starts its own basic block:
                # ptxas hoists a wait it finds in the softmax's block above the softmax, which would
                # end the overlap with P V. _pin keeps LLVM from merging the branches' common tail (the
                # second row's exponentials) into that block again: without it every causal, local or
                # softcap kernel ran half its exponentials after the wait (ptxas 13.0 SASS,
                # benchmarks/tools/cute_sass.py "P V wait" line: 33 of 66 MUFU.EX2 at d128 causal, now 66).
                if cutlass.const_expr(self.softcap):
                    self._cap(acc_S, score_scale, softcap)
                n_key = key_block(n_block, n_block_min, n_block_max, self.reverse)
                if n_key >= n_block_mask_from or n_key < n_block_mask_below:
                    self._mask(acc_S, tScS, m_block, n_key, seqlen_q, seqlen_k, window_left, window_right)
                    self._softmax(acc_S, row_max, row_sum, corr, scale_log2)
                    if cutlass.const_expr(self.pin):
                        _pin(acc_S, row_sum, corr, "masked")
                else:
                    self._softmax(acc_S, row_max, row_sum, corr, scale_log2)
                    if cutlass.const_expr(self.pin):
                        _pin(acc_S, row_sum, corr, "unmasked")
                warpgroup.wait_group(0)  # P V done: P's registers and V's stage are free
                v_pipe.consumer_release(v_state)
                self._to_p(acc_S, rP)
                v_state.advance()

            if cutlass.const_expr(q_pipe is not None):
                # Every S = Q K^T of the tile is complete (the last wait_group(0) above): Q's buffer goes
                # back to the producer, which loads the next tile's Q while this P V and the epilogue run.
                q_pipe.consumer_release(q_state)
            # The last block's O += P V.
            v_pipe.consumer_wait(v_state)
            self._rescale(acc_O, corr)
            self._gemm_pv(tiled_mma_pv, acc_O, tOrP, tOrV, v_state.index)
            warpgroup.wait_group(0)
            v_pipe.consumer_release(v_state)
            # The persistent kernel carries v_state into the next tile: without this advance it would
            # wait on this stage (already full) and release it a second time there, one stage behind the
            # producer per tile, until the phases wrap and both sides wait on each other (the hang).
            v_state.advance()
        return k_state, v_state

    @cute.jit
    def _to_p(self, acc_S, rP):
        """P = the softmax numerators (acc_S) in the input dtype, round to nearest even. pack_p: one
        cvt.rn.{bf16x2,f16x2}.f32 per pair into a 32-bit register (a goes to the upper half, so value
        2i + 1 is a and 2i is b: the little-endian order of the bf16 view tOrP)."""
        if cutlass.const_expr(self.pack_p):
            op = "cvt.rn.bf16x2.f32 $0, $2, $1;" if cutlass.const_expr(self.dtype == cutlass.BFloat16) else \
                "cvt.rn.f16x2.f32 $0, $2, $1;"
            for i in cutlass.range_constexpr(cute.size(rP)):
                rP[i] = Int32(llvm.inline_asm(T.i32(), [Float32(acc_S[2 * i]).ir_value(),
                                                        Float32(acc_S[2 * i + 1]).ir_value()],
                                              op, "=r,f,f", has_side_effects=False, is_align_stack=False,
                                              asm_dialect=llvm.AsmDialect.AD_ATT))
        else:
            rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _pass_turn(self, turn_bar, arrive, n_threads):
        """Let the next warpgroup issue its GEMMs: arrive on named barrier turn_bar (1 + the next
        warpgroup's index) when `arrive`. The last warpgroup skips this after its last block, so that
        every arrival on a named barrier meets a wait (warpgroup 0 waits once more than the last one
        arrives after blocks: the first turn was given up front)."""
        if arrive:
            cute.arch.barrier_arrive(barrier_id=turn_bar, number_of_threads=n_threads)

    @cute.jit
    def _gemm_qk(self, tiled_mma_qk, acc_S, tSrQ, tSrK, stage):
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(tiled_mma_qk, acc_S, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_S)
            tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _gemm_pv(self, tiled_mma_pv, acc_O, tOrP, tOrV, stage):
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.block_n // 16):
            cute.gemm(tiled_mma_pv, acc_O, tOrP[None, None, k], tOrV[None, None, k, stage], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _epilogue(self, mO, mLSE, acc_O, row_max, row_sum, tOcO, scale_log2, sink_log2, ctid, m_block, head,
                  batch, q_start, seqlen_q, tma_o=None, sQ=None, tiled_mma_pv=None):
        """O / l and lse = ln(sum exp(scale * s)) = (max * scale_log2 + log2 l) * ln 2; a row with no
        visible key gets O = 0 and lse = +inf. With a sink (sink_log2 = sink * log2 e) the sum gains
        exp(sink): O / l' and lse = ln(sum exp(scale * s) + exp(sink)), so a row with no visible key
        gets O = 0 and lse = sink. tma_o: O through the shared-memory buffer sQ (Q's; the persistent kernel's
        own O buffer) and a TMA store (_store_o_tma). pack_gqa: ``head`` is the KV head, each row has its own
        query head (packed_row) and sink_log2 is a pair, one per row of the thread."""
        dt, D, BQ, G = self.dtype, self.head_dim_v, self.block_q, self.pack_gqa  # D: O's head dim
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
            row, j = packed_row(tOcO[2 * r][0], m_block, BQ, G)  # the query position (and head, pack_gqa)
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
        the end of _consume_persistent). Q's rows of this warpgroup are read only by its own S = Q K^T
        WGMMAs, all complete here (their last wait_group(0)), and Q's TMA load landed before the main loop
        (q_pipe.consumer_wait), so each warpgroup syncs only its own 128 threads. ptxas 13.0 then keeps the
        main loop's pipeline indices and WGMMA descriptors in per-thread registers (d128: 13 R2UR and 28
        more instructions per key block); a direct store without its row < Sq branch does the same, and
        neither an opaque smem address nor opaque coordinates here avoided it (not understood yet)."""
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
        # Named barriers 1..NW are the GEMM turns (_consume); NW + 1 + wg is this warpgroup's own.
        cute.arch.barrier(barrier_id=self.num_mma_warpgroups + 1 + wg, number_of_threads=128)
        if ctid % 128 == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (64, D), (None, 0))  # (64, D, Sq / 64)
            tOsO, tOgO = _tma_tiles(tma_o, cute.local_tile(sQ, (64, D), (wg, 0)), gO)
            cute.copy(tma_o, tOsO, tOgO[None, m_block * self.num_mma_warpgroups + wg])
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.persistent):
                # The CTA's shared memory must stay until TMA has read it: wait for the reads, not the writes.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
