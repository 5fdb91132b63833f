"""The Hopper backward CTA's walk over the query blocks that see its key block (flash_bwd_sm90.py's component): the
walks that map a position to a query block and head (GroupWalk, RotatedWalk; sparse_tiles' lists have the same
interface) and, per position, where the producer's Q / dO copies and the dQ tile's TMA reduce go (BwdWalk, a mixin of
FlashBwdSm90)."""
import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from flash_attn.cute.hopper_helpers import tma_tiles


@dataclasses.dataclass(frozen=True)
class GroupWalk:
    """gqa_loop's walk of a key block's CTA: position p is query block m_min + p % n of query head first_head + p // n
    (n the query blocks that see the key block, the same for every head of the group), head by head; the interface
    of sparse_tiles' lists (block, partial) plus the head. A dataclass: the DSL carries its fields through loops."""

    m_min: Int32
    n: Int32
    first_head: Int32

    @staticmethod
    def make(m_min, m_max, first_head):
        return GroupWalk(m_min, cutlass.max(m_max - m_min, 0), first_head)

    def count(self, group):
        return group * self.n

    def block(self, pos):
        return self.m_min + pos % self.n

    def head(self, pos):
        return self.first_head + pos // self.n

    def partial(self, pos):
        return None  # (no lists: every position's block is masked as the mask says)


@dataclasses.dataclass(frozen=True)
class RotatedWalk:
    """The plain walk (query blocks m_min .. m_min + n - 1) started ``rot`` positions in and wrapped around: position p
    is query block m_min + (p + rot) % n. Without a causal mask the key blocks of a head otherwise all start at its
    first query block together; rotated (BwdConfig.dq_first_store, rot = n_block * n // key blocks) each starts at its
    own, so a query block's first dQ tile is stored before the next key block's CTA reaches it."""

    m_min: Int32
    n: Int32
    rot: Int32

    @staticmethod
    def make(m_min, m_max, n_block, n_blocks):
        n = cutlass.max(m_max - m_min, 0)
        return RotatedWalk(m_min, n, n_block * n // cutlass.max(n_blocks, 1))

    def count(self, group):
        return self.n

    def block(self, pos):
        return self.m_min + (pos + self.rot) % self.n

    def partial(self, pos):
        return None  # (no lists)



@dataclasses.dataclass(frozen=True)
class RotatedGroupWalk:
    """GroupWalk's walk rotated as RotatedWalk's (gqa_loop without a causal mask, BwdConfig.dq_first_store): position p
    is GroupWalk's position (p + rot) % total, total = group * n, rot = n_block * total // key blocks."""

    m_min: Int32
    n: Int32
    first_head: Int32
    total: Int32
    rot: Int32

    @staticmethod
    def make(m_min, m_max, first_head, group, n_block, n_blocks):
        n = cutlass.max(m_max - m_min, 0)
        return RotatedGroupWalk(m_min, n, first_head, group * n, n_block * group * n // cutlass.max(n_blocks, 1))

    def count(self, group):
        return self.total

    def block(self, pos):
        return self.m_min + (pos + self.rot) % self.total % self.n

    def head(self, pos):
        return self.first_head + (pos + self.rot) % self.total // self.n

    def partial(self, pos):
        return None

class BwdWalk:
    """FlashBwdSm90's per-position helpers (self: the kernel object: block_m, head_dim, seqlens, dq, gqa_loop,
    first_store, tickets)."""

    def _write_dq(self, tma_dq, mdQ_tma, sdQ, tile, head, m_block_min, m_block_max, tiles, turn, tma_dq_st=None):
        gdQ = cute.local_tile(self.seqlens.rows(mdQ_tma, tile.q_start, head, tile), (self.block_m, self.head_dim), (None, 0))
        tQRsdQ, tQRgdQ = tma_tiles(tma_dq, sdQ, gdQ)
        dst = (tQRgdQ, tma_dq, sdQ, mdQ_tma, tile)
        self.dq.writer(tma_dq, tQRsdQ, lambda pos: self._dq_dst(dst, pos, tiles), m_block_min, m_block_max, turn,
                       tma_dq_st)

    def _head_tiles(self, tma_q, tma_do, tma_lse, tma_delta, mQ, mdO, mLSE2, mDelta, sQ, sdO, sLSE, sDelta, tile, head):
        """The gmem sides of the producer's Q, dO, lse2 and delta TMA copies for query head ``head`` (gqa_loop: the
        head changes along the walk), indexed by query block."""
        BM, D, Dv, sl = self.block_m, self.head_dim, self.head_dim_v, self.seqlens
        return (tma_tiles(tma_q, sQ, cute.local_tile(sl.rows(mQ, tile.q_start, head, tile), (BM, D), (None, 0)))[1],
                tma_tiles(tma_do, sdO, cute.local_tile(sl.rows(mdO, tile.q_start, head, tile), (BM, Dv), (None, 0)))[1],
                tma_tiles(tma_lse, sLSE, cute.local_tile(sl.lse_rows(mLSE2, head, tile), (BM,), (None,)), modes=1)[1],
                tma_tiles(tma_delta, sDelta, cute.local_tile(sl.lse_rows(mDelta, head, tile), (BM,), (None,)),
                          modes=1)[1])

    @cute.jit
    def _dq_reduce(self, dst, pos, tiles, buf, ticket):
        """The issuing warp's TMA reduce of walk position pos's tile buf (tickets: reduce_first, ticket that
        position's); 1 where it stored the query block's first tile. dst: _consume's (tQRgdQ, tma_dq, sdQ, mdQ_tma,
        tile, tma_dq_st, mSem, head, tQRsdQ)."""
        g, m = self._dq_dst(dst, pos, tiles)
        stored = Int32(0)
        if cutlass.const_expr(self.tickets):
            stored = self.dq.reduce_first(dst[1], dst[5], dst[8], g, buf, m, ticket, self._dq_ticket(dst, pos, tiles))
        else:
            self.dq.reduce(dst[1], dst[8], g, buf, m)
        return stored

    def _dq_head(self, dst, pos, tiles):
        """The query head of walk position pos (gqa_loop: the walk's; else the CTA's)."""
        return tiles.head(pos) if cutlass.const_expr(self.gqa_loop) else dst[7]

    def _dq_ticket(self, dst, pos, tiles):
        """The address of walk position pos's ticket (its query head and block)."""
        return self.dq.ticket_ptr(dst[6], dst[4], self._dq_head(dst, pos, tiles), self._query_block(pos, tiles)[0])

    def _dq_dst(self, dst, pos, tiles):
        """(the gmem partition of the dQ TMA reduce-add, query block) of walk position ``pos``; dst = (the CTA's
        partition, tma_dq, sdQ, mdQ_tma, tile); with gqa_loop the position's query head's partition."""
        m = self._query_block(pos, tiles)[0]
        if cutlass.const_expr(self.gqa_loop):
            _, tma_dq, sdQ, mdQ_tma, tile = dst[:5]
            gdQ = cute.local_tile(self.seqlens.rows(mdQ_tma, tile.q_start, tiles.head(pos), tile),
                                  (self.block_m, self.head_dim), (None, 0))
            return tma_tiles(tma_dq, sdQ, gdQ)[1], m
        return dst[0], m

    def _query_block(self, pos, tiles):
        """(query block, partial or None) at walk position ``pos``: itself, or block sparsity's block and kind."""
        if cutlass.const_expr(tiles is None):
            return pos, None
        return tiles.block(pos), tiles.partial(pos)

