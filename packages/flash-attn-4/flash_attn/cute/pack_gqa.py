"""Packed GQA for the Hopper forward: the g query heads of one KV head share a query tile.

A short query sequence (decoding) then still fills the tile's rows, and K / V are loaded once for the g
heads. The tile holds block_q = block_m / g positions of each of the g heads, head-major (each head's rows
are one TMA box of (block_q, D)). With g = 1 everything here reduces to the plain layout: the tile's rows
are positions and the head is the CTA's.
"""
import cutlass
import cutlass.cute as cute


def packed_row(row, m_block, block_q, group):
    """(query position, query head within the KV head's group) of row ``row`` of query tile ``m_block``
    (python ints on the host and in tests, Int32 in the kernel): with group g > 1 row r is position
    m_block * block_q + r % block_q of head r // block_q; else (block_q = block_m) the rows are positions
    and the head is the CTA's."""
    if group == 1:
        return m_block * block_q + row, 0
    return m_block * block_q + row % block_q, row // block_q


class PackGQA:
    """Owns the mapping between a tile's rows, query heads and KV heads: the grid's head extent, the KV head
    a CTA loads, the query head of each Q box and output row, and where each head's Q box lands in the
    tile. group: query heads per tile (1: no packing)."""

    def __init__(self, group, block_m):
        self.group = int(group)
        if self.group < 1 or block_m % self.group or (block_m // self.group) % 8:
            raise ValueError(f"pack_gqa {group}: block_m ({block_m}) / pack_gqa must be a whole multiple of 8 "
                             "(the swizzle atom's rows, where each head's TMA box starts)")
        self.block_q = block_m // self.group  # query positions per tile

    @property
    def packed(self):
        return self.group > 1

    def grid_heads(self, mQ, mK):
        """The grid's head extent (trace time): one tile per KV head when packed, else per query head."""
        return cute.size(mK, mode=[2]) if cutlass.const_expr(self.packed) else cute.size(mQ, mode=[2])

    def head_kv(self, head, mQ, mK):
        """The KV head of grid head ``head`` (GQA / MQA: heads // Hk query heads per KV head)."""
        if cutlass.const_expr(self.packed):
            return head
        return head // (cute.size(mQ, mode=[2]) // cute.size(mK, mode=[2]))

    def q_head(self, head, j):
        """The query head of box / row group j of grid head ``head``."""
        return head * self.group + j if cutlass.const_expr(self.packed) else head

    def row(self, row, m_block):
        """(query position, j) of tile row ``row``: packed_row."""
        return packed_row(row, m_block, self.block_q, self.group)

    def q_box(self, sQ, j, head_dim):
        """The rows of the Q tile that head j's TMA box fills."""
        if cutlass.const_expr(not self.packed):
            return sQ
        return cute.local_tile(sQ, (self.block_q, head_dim), (j, 0))
