"""How the Hopper backward computes dQ and how its partials reach dq_accum (flash_bwd_sm90.py's dQ component)."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn.cute.bwd_parts import gemm, red_add_f32x2, transpose_view

# The named barrier of the deterministic turn (the kernel's dS barrier is 1; with dq_split=False, which the
# deterministic kernel does not build, 1 and 2 are the per-warpgroup dS barriers; 3 to 5 are the TMA dK / dV
# epilogue's, bwd_epilogue.py). One id never serves two thread counts at once: that is an illegal instruction.
TURN_BARRIER = 2
# The dQ writer's barriers (``writer``), one pair per dQ tile buffer: FULL + buf (the consumers wrote and fenced the
# tile; the writer waits), EMPTY + buf (the writer's reduce-add has read it; the consumers wait before their next write
# into it). Each counts the consumer threads and the writer warp.
DQ_FULL, DQ_EMPTY = 6, 8
# A query block's ticket (``first_store``): how many key blocks' CTAs have taken it, plus FIRST_READY once the first
# one's dQ tile (a TMA store) has completed in global memory.
FIRST_READY = 1 << 30


def permuted_tile_layout(block_m, head_dim):
    """The shared dQ tile of dq_perm (config.permuted_column's layout): two row-major fp32 buffers (block_m,
    head_dim), unswizzled (an identity swizzle, so that the kernel's tile stays a composed layout), one TMA box."""
    return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0,
                                     cute.make_ordered_layout((block_m, head_dim, 2), order=(1, 0, 2)))


def store_permuted(acc, cdQ, sdQ, buf, row0):
    """sdQ[rows, config.permuted_column(rows, columns), buf] = acc, acc the m64nNk16 C fragment ((2, 2, N / 8), M, N')
    in registers and cdQ its (row, column) coordinates in the tile: per row and 16 columns (n8-groups 2 p and 2 p + 1)
    one 16-byte store. row0: dq_accum's row of the tile's row 0 (the row parity that decides the block swap)."""
    BM, D = cute.size(sdQ, mode=[0]), cute.size(sdQ, mode=[1])
    groups = cute.size(acc, mode=[0, 2]) // 2
    for m in range(cute.size(acc, mode=[1])):
        for n in range(cute.size(acc, mode=[2])):
            for r in range(2):
                for p in range(groups):
                    four = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                    for g in range(2):
                        for x in range(2):
                            four[2 * g + x] = acc[(x, r, 2 * p + g), m, n]
                    row, col = cdQ[(0, r, 2 * p), m, n]  # col = 16 b + 2 q: permuted_column 16 (b ^ parity) + 4 q
                    at = buf * (BM * D) + row * D + 16 * ((col // 16) ^ ((row0 + row) & 1)) + 2 * (col % 16)
                    dst = cute.make_tensor(sdQ.iterator + cute.assume(at, divby=4), cute.make_layout(4))
                    cute.autovec_copy(four, dst)


class DqAccumulator:
    """Owns the way each key block's CTA adds softmax_scale * dS K of a query block into the fp32 dq_accum, which
    other key blocks' CTAs add into too: per-thread red.global.add (the order in which CTAs arrive decides the
    rounding, so results vary in the last bits run to run), or with ``dq_tma`` the scaled tile in shared memory
    and one TMA reduce-add of it. ``deterministic`` (red.global.add, dq_split: each element of the tile belongs to
    one thread of the CTA): the CTAs of a query block take turns in a fixed key-block order, so every element receives
    its additions in the same order each run. A turn counter per (sequence, head, query block) in global memory (mSem,
    zeroed by the host) counts the key blocks that have added: key block n waits (one thread, ld.acquire) until it
    reads its place (turn_place), adds, and hands the turn on (each thread fences its adds, a barrier of the
    consumers, one red.release). Every query block's key blocks are 0, 1, ..., c - 1 (no window: causal and full
    masks start at key block 0). Without a mask the order ascends and lower key blocks are earlier in the grid's x;
    with a causal one (``descending``) it descends from c - 1, the key block whose walk starts at this query block, so
    key block n's CTA, which reaches the block one step after key block n + 1's, never waits at the start of its walk
    for CTAs that reach the block much later; the kernel then runs key blocks from the last down in the grid's x. Either
    way the key block waited for has been scheduled."""

    def __init__(self, block_m, dq_tma, deterministic, seqlens, num_consumer_threads, writer=False, descending=False,
                 block_n=128, first_store=False):
        if deterministic and dq_tma and not writer:
            raise ValueError("deterministic dQ adds with red.global.add (dq_tma off), or by the writer warp's TMA")
        if writer and not dq_tma:
            raise ValueError("the dQ writer warp issues TMA reduce-adds (dq_tma)")
        self.writer_warp = bool(writer)  # a producer warp issues the reduce-adds (``writer``), not a consumer warp
        self.buffers = 2  # of the shared dQ tile
        self.block_m = block_m
        self.dq_tma = dq_tma
        self.deterministic = deterministic
        self.seqlens = seqlens
        self.num_consumer_threads = num_consumer_threads
        self.descending = bool(descending)  # (deterministic causal turns: see the class docstring)
        self.block_n = block_n
        # The consumers' TMA dQ without the zeroed dq_accum: per query block a ticket in mSem (zeroed by the host); the
        # CTA that takes it first stores its tile, the others add theirs once that store has completed (reduce_first).
        # The issuing warp takes a block's ticket right after the previous block's reduce and reads it at this block's
        # reduce, a block later: the first taker stores the tile there, with no wait between taking the ticket and
        # marking the block ready (publish), so every CTA that waits waits for one that does not: no cycle of waits.
        # Deterministic (the writer warp's turns): a block's first turn stores its tile instead (writer).
        self.first_store = bool(first_store)
        if self.first_store and (not dq_tma or writer != deterministic):
            raise ValueError("first_store: the consumers' TMA reduce-adds (dq_tma, no writer warp) or, deterministic, "
                             "the writer warp's turns")

    def ticket_ptr(self, mSem, tile, head, m_block):
        """Query block m_block's ticket (first_store) in mSem (batch or sequence, head, query block)."""
        return mSem.iterator + cute.crd2idx((tile.z, head, m_block), mSem.layout)

    @cute.jit
    def take_ticket(self, mSem, tile, head, m_block, issuer):
        """The issuing warp's lane 0 takes query block m_block's ticket (0: its first taker); the reduce that reads it
        comes a block later, so the atomic's latency is hidden. 0 in the other threads."""
        ticket = Int32(0)
        if issuer:
            if cute.arch.lane_idx() == 0:
                ticket = cute.arch.atomic_add(self.ticket_ptr(mSem, tile, head, m_block), Int32(1), sem="relaxed",
                                              scope="gpu")
        return ticket

    @cute.jit
    def reduce_first(self, tma_dq, tma_dq_st, tQRsdQ, tQRgdQ, buf, m_block, ticket, sem):
        """reduce's first_store form, by the issuing warp (ticket: its lane 0's, sem: the block's ticket): the first
        taker stores sdQ[buf] into dq_accum (TMA), a later one waits until that store completed and adds. Returns 1
        where it stored (``publish`` then marks the block ready), else 0."""
        stored = Int32(0)
        if cute.arch.shuffle_sync(ticket, 0) == 0:
            cute.copy(tma_dq_st, tQRsdQ[None, buf], tQRgdQ[None, m_block])
            stored = Int32(1)
        else:
            if cute.arch.lane_idx() == 0:
                seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                while seen < FIRST_READY:
                    seen = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                cute.arch.fence_proxy("async.global")  # the TMA add (async proxy) after the acquire
            cute.arch.sync_warp()
            cute.copy(tma_dq, tQRsdQ[None, buf], tQRgdQ[None, m_block])
        cute.arch.cp_async_bulk_commit_group()
        return stored

    @cute.jit
    def publish(self, stored, sem):
        """After reduce_first stored a block's tile (stored 1; the issuing warp): wait until the store has completed,
        then mark the block's ticket ready for the CTAs that add after it."""
        if stored != 0:
            cute.arch.cp_async_bulk_wait_group(0)
            if cute.arch.lane_idx() == 0:
                cute.arch.fence_proxy("async.global")
                cute.arch.fence_acq_rel_gpu()
                cute.arch.red(sem, Int32(FIRST_READY), op="add", dtype=Int32, sem="release", scope="gpu")

    def turn_place(self, n_block, m_block, tile):
        """Key block n_block's place in query block m_block's order of adds: n_block, or descending from the last of
        the c key blocks that see the query block (c - 1 - n_block; key block n sees it iff its CTA's walk,
        mask.m_block_range, starts at or before it: n * BN < (m + 1) * BM + Sk - Sq)."""
        place = n_block
        if cutlass.const_expr(self.descending):
            reach = cutlass.max((m_block + 1) * self.block_m + tile.seqlen_k - tile.seqlen_q, 0)
            count = cutlass.min(cute.ceil_div(tile.seqlen_k, self.block_n), cute.ceil_div(reach, self.block_n))
            place = count - 1 - n_block
        return place

    def fragments(self, tiled_mma_dq, wg_dq, thr_dq, sdS, sK, sdQ, wg, head_dim, split):
        """(dS's and K^T's WGMMA fragments, the dQ accumulator, its coordinates, its partition of the shared dQ tile or
        None): split, all keys with the tiled MMA picking this warpgroup's half of D; else this warpgroup's keys,
        columns [64 wg, 64 wg + 64) of dS (BM, BN) and of K^T (D, BN)."""
        BM, D = self.block_m, head_dim
        if cutlass.const_expr(split):
            tdQrdS = tiled_mma_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tdQrKt = tiled_mma_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        else:
            tdQrdS = tiled_mma_dq.make_fragment_A(wg_dq.partition_A(cute.local_tile(sdS, (BM, 64, 2), (0, wg, 0))))
            tdQrKt = tiled_mma_dq.make_fragment_B(wg_dq.partition_B(cute.local_tile(transpose_view(sK), (D, 64), (0, wg))))
        acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((BM, D)), Float32)
        # dq_tma: the tile itself, addressed by store_permuted (dq_accum in config.permuted_column's layout)
        tdQsdQ = sdQ if cutlass.const_expr(self.dq_tma) else None
        return tdQrdS, tdQrKt, acc_dQ, thr_dq.partition_C(cute.make_identity_tensor((BM, D))), tdQsdQ

    def gemm(self, tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, buf):
        """Issue dQ = dS K over dS buffer buf, one commit group."""
        gemm(tiled_mma_dq, acc_dQ, tdQrdS, tdQrKt, buf, None, zero_init=True)

    @cute.jit
    def out(self, mdQaccum, acc_dQ, tdQcdQ, tdQsdQ, softmax_scale, buf, m_block, head, tile, seqlen_q, turn,
            reused=None):
        """The finished dQ partial of m_block: red.global.add into dq_accum, or with dq_tma scaled into
        the shared dQ tile buf (added by TMA after the next dS barrier, or by the writer warp once it is handed over).
        turn (deterministic): (mSem, n_block, ctid). reused (writer warp): whether buffer buf
        held an earlier block's tile (the walk's third block on), whose reduce-add must have read it first."""
        if cutlass.const_expr(self.writer_warp):
            if reused:
                cute.arch.barrier(barrier_id=DQ_EMPTY + buf, number_of_threads=self.num_consumer_threads + 32)
        if cutlass.const_expr(self.dq_tma):
            for i in cutlass.range(cute.size(acc_dQ), unroll_full=True):
                acc_dQ[i] = acc_dQ[i] * softmax_scale
            # Made visible to the TMA (async proxy) by the next block's dS fence, before its barrier (writer warp: here).
            store_permuted(acc_dQ, tdQcdQ, tdQsdQ, buf, tile.q_start)
            if cutlass.const_expr(self.writer_warp):
                cute.arch.fence_view_async_shared()
                cute.arch.barrier_arrive(barrier_id=DQ_FULL + buf, number_of_threads=self.num_consumer_threads + 32)
        else:
            sem = None
            if cutlass.const_expr(self.deterministic):
                mSem, n_block, ctid = turn
                sem = mSem.iterator + cute.crd2idx((tile.z, head, m_block), mSem.layout)
                self._wait_turn(sem, self.turn_place(n_block, m_block, tile), ctid)
            self.atomic_add(mdQaccum, acc_dQ, tdQcdQ, softmax_scale, m_block, head, tile, seqlen_q)
            if cutlass.const_expr(self.deterministic):
                self._pass_turn(sem, turn[2])

    @cute.jit
    def _wait_turn(self, sem, place, ctid):
        if ctid == 0:
            done = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
            while done != place:
                done = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
        cute.arch.barrier(barrier_id=TURN_BARRIER, number_of_threads=self.num_consumer_threads)

    @cute.jit
    def _pass_turn(self, sem, ctid):
        cute.arch.fence_acq_rel_gpu()  # this thread's adds before the release below (cumulative through the barrier)
        cute.arch.barrier(barrier_id=TURN_BARRIER, number_of_threads=self.num_consumer_threads)
        if ctid == 0:
            cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")

    @cute.jit
    def writer(self, tma_dq, tQRsdQ, dst, pos_min, pos_max, turn=None, tma_dq_st=None):
        """The writer warp's walk (one producer warp, all its lanes): per position, wait until the consumers have
        handed over its tile (FULL), add it into dq_accum by TMA (``dst(pos)``: the gmem partition and query block),
        wait until the TMA has read it and hand the buffer back (EMPTY) where a later block will reuse it; at the end
        wait for every add to complete before the CTA's shared memory goes away. The consumers never issue or wait
        for a reduce-add. turn (deterministic: (mSem, n_block, tile, head)): the add waits for this key block's turn
        at its query block's counter, completes, and passes the turn on, so each element of dq_accum receives its
        adds in key-block order while the consumers go on; with ``first_store`` (tma_dq_st, the plain TMA store) the
        block's first turn stores its tile, so dq_accum needs no zeroing."""
        buf = Int32(0)
        for pos in cutlass.range(pos_min, pos_max, unroll=1):
            cute.arch.barrier(barrier_id=DQ_FULL + buf, number_of_threads=self.num_consumer_threads + 32)
            g, m = dst(pos)
            sem = None
            if cutlass.const_expr(turn is not None):
                mSem, n_block, tile, head = turn
                sem = mSem.iterator + cute.crd2idx((tile.z, head, m), mSem.layout)
                place = self.turn_place(n_block, m, tile)
                if cute.arch.lane_idx() == 0:
                    done = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                    while done != place:
                        done = cute.arch.load(sem, Int32, sem="acquire", scope="gpu")
                    cute.arch.fence_proxy("async.global")  # the TMA add (async proxy) after the acquire
                cute.arch.sync_warp()
            if cutlass.const_expr(self.first_store):
                if place == 0:
                    cute.copy(tma_dq_st, tQRsdQ[None, buf], g[None, m])
                    cute.arch.cp_async_bulk_commit_group()
                else:
                    self.reduce(tma_dq, tQRsdQ, g, buf, m)
            else:
                self.reduce(tma_dq, tQRsdQ, g, buf, m)
            if cutlass.const_expr(turn is not None):
                # the adds complete (not only read) before the turn passes: the next key block's adds follow them
                cute.arch.cp_async_bulk_wait_group(0)
                if cute.arch.lane_idx() == 0:
                    cute.arch.fence_proxy("async.global")
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.red(sem, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            if pos + self.buffers < pos_max:
                cute.arch.barrier_arrive(barrier_id=DQ_EMPTY + buf, number_of_threads=self.num_consumer_threads + 32)
            buf = 1 - buf
        cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def reduce(self, tma_dq, tQRsdQ, tQRgdQ, buf, m_block):
        """dq_accum[m_block's rows] += sdQ[buf] (rows past Sq dropped by the TMA unit), one bulk group."""
        cute.copy(tma_dq, tQRsdQ[None, buf], tQRgdQ[None, m_block])
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def atomic_add(self, mdQaccum, acc_dQ, tdQcdQ, softmax_scale, m_block, head, tile, seqlen_q):
        """dq_accum[rows of this block] += softmax_scale * dS K (this thread's part, fp32 red.global.add)."""
        BM = self.block_m
        gdQ = self.seqlens.rows(mdQaccum, tile.q_start, head, tile)  # (Sq, D), columns contiguous
        # Accumulator value (x, r, j) of an m64nNk16 C fragment is row R + 8 r, column c + 8 j + x
        # (tests/cute/test_cute_bwd.py checks it): per row of the thread one bounds test and one address, its
        # (x = 0, 1) pairs 8-byte aligned (c even, rows D * 4 bytes apart) at constant offsets 32 j bytes from it,
        # so that ptxas neither recomputes addresses nor branches per pair.
        for m in cutlass.range_constexpr(cute.size(acc_dQ, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(acc_dQ, mode=[2])):
                for r in cutlass.range_constexpr(2):
                    row, col = tdQcdQ[(0, r, 0), m, n]
                    if m_block * BM + row < seqlen_q:
                        base = gdQ.iterator + cute.crd2idx((m_block * BM + row, col), gdQ.layout)
                        for j in cutlass.range_constexpr(cute.size(acc_dQ, mode=[0, 2])):
                            red_add_f32x2(base + 8 * j, acc_dQ[(0, r, j), m, n] * softmax_scale,
                                          acc_dQ[(1, r, j), m, n] * softmax_scale)
