"""Which tile a CTA runs and in what order the tiles (and a tile's key blocks) go, for the Hopper kernels.

The plain functions take Python ints (host code, tests) or DSL integers (traced in a kernel; ``minimum``
is then cutlass.min). The classes are built once from a kernel's settings:
  OneTileScheduler    the forward's one-CTA-per-tile grid: which (m_block, head, batch) block (x, y, z) runs;
  PersistentScheduler the forward's persistent kernel: one CTA per SM looping over a static tile order.
"""
import cutlass
import cutlass.cute as cute


def tile_coords(tile, num_m, num_hb, group, causal, minimum=min):
    """(m_block, hb) of linear tile index ``tile`` among num_m query blocks x num_hb (head, batch) pairs,
    hb = head + heads * batch. Without a mask the query blocks of one head are consecutive, so the CTAs
    running at once share that head's K and V in L2. Causal: longest tiles first (the last query block sees
    the most keys), within sections of ``group`` (head, batch) pairs whose K and V fit in L2 together: in
    section order, then query block from the last down, then pair. So every CTA's i-th tile comes from the
    same band of lengths and the cheapest tiles come last, where they fill the tail of the last wave (with
    group >= num_hb: longest first over all pairs)."""
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
    order with sections of ``group`` (head, batch) pairs."""
    m_block, hb = tile_coords(x + num_m * (y + heads * z), num_m, heads * batches, group, True, minimum=minimum)
    return m_block, hb % heads, hb // heads


def cta_tile(position, bid, num_ctas, snake):
    """The linear tile index (into tile_coords' order) of CTA bid's position-th tile among num_ctas CTAs:
    rounds of num_ctas consecutive tiles, CTA bid taking the bid-th of each; with snake, the odd rounds
    from the other end (the bid-th from the last), so that over a longest-first order every CTA's total
    stays near the mean (the plain stride hands CTA 0 the longest tile of every round). An index >= the
    tile count means no tile (the last round may be partial)."""
    if snake:
        odd = position % 2
        return position * num_ctas + bid + odd * (num_ctas - 1 - 2 * bid)
    return position * num_ctas + bid


def key_block(position, n_block_min, n_block_max, reverse):
    """The key block a tile processes at ``position`` of its walk over [n_block_min, n_block_max), the
    positions running n_block_min, n_block_min + 1, ... in processing order: the block itself, or with
    ``reverse`` its mirror (n_block_max - 1 first, n_block_min last: FA3's order, a causal or local tile's
    masked diagonal blocks before the unmasked ones). The producer's loads, the consumers' masks and nothing
    else go through it: the pipeline stages and the ping-pong turns count positions, which are the same in
    both orders."""
    if reverse:
        return n_block_max - 1 + n_block_min - position
    return position


def lpt_tile(lin, n_blocks, heads, batches, lpt):
    """The backward's grouped longest-first order: (key block, head, batch) of CTA ``lin`` of its 1-D grid,
    in groups of g = max(1, lpt // n_blocks) (head, batch) pairs, the last group possibly smaller; inside a
    group of `size` pairs CTA i is key block i // size of pair i % size."""
    pairs = heads * batches
    g = cutlass.max(cutlass.min(lpt // n_blocks, pairs), 1)
    group = lin // (g * n_blocks)
    rem = lin - group * g * n_blocks
    size = cutlass.min(g, pairs - group * g)
    n_block = rem // size
    pair = group * g + rem - n_block * size
    return n_block, pair % heads, pair // heads


def l2_group(l2_bytes, kv_row_bytes, mK, heads):
    """(head, batch) pairs per causal section of tile_coords (trace time): as many KV heads as fit in
    ``l2_bytes`` (at least one), each of kv_row_bytes per key row and serving heads / Hk query heads; a
    constant // Sk, so no 32-bit overflow. mK: the (Sk, D, Hk, B) view."""
    return cutlass.max(l2_bytes // kv_row_bytes // cute.size(mK, mode=[0]), 1) * (heads // cute.size(mK, mode=[2]))


class OneTileScheduler:
    """The forward's grid of one CTA per (query tile, head, batch). Causal tiles run longest first: with
    ``lpt``, CTA (x, y, z) runs the tile of linear index x + num_m (y + heads z) in tile_coords' causal order
    (longest first within L2-sized sections of (head, batch) pairs), so the blocks the hardware issues first
    are the longest over all heads; else longest first within each head (the x order reversed)."""

    def __init__(self, causal, lpt):
        self.causal = causal
        self.lpt = lpt

    def tile(self, group):
        """(m_block, head, batch) of this CTA (device, trace time); group: lpt's section size (else None)."""
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.lpt):
            # The hardware issues CTAs in linear block order, so the first wave takes the longest tiles and
            # the shortest ones fill the tail.
            m_block, head, batch = lpt_block(m_block, head, batch, *cute.arch.grid_dim(), group,
                                             minimum=cutlass.min)
        elif cutlass.const_expr(self.causal):
            # The query tiles near the end see the most keys; the block scheduler issues CTAs in x order.
            m_block = cute.arch.grid_dim()[0] - 1 - m_block
        return m_block, head, batch


class PersistentScheduler:
    """The persistent forward's static schedule: min(tiles, SMs) CTAs, CTA b running the tiles of
    tile_coords' order that cta_tile deals it. With ``snake`` (causal): one longest-first order over all
    (head, batch) pairs dealt in a snake; else longest first within L2-sized sections of heads, dealt round
    robin. The schedule's numbers (num_m, num_hb, group, num_tiles) are kernel parameters, so they stay in
    the constant bank instead of taking consumer registers across the main loop."""

    def __init__(self, causal, snake):
        self.causal = causal
        self.snake = snake

    def params(self, grid, group, max_ctas):
        """Host side: (the schedule's numbers, the launch grid) from the one-tile grid (num_m, heads, batch)
        and the L2 section size ``group``."""
        num_m, heads, batch = grid
        if cutlass.const_expr(self.snake):
            # One section: with sections, the stride deals CTA b tiles from the same place of every section's
            # sawtooth of lengths (max / mean work 1.16 at d128 16k, 1.42 at d256: the balance test in
            # tests/cute/test_cute_persistent.py); the snake over one longest-first order keeps it within 1.03.
            group = heads * batch
        sched = (num_m, heads * batch, group, num_m * heads * batch)
        return sched, (cutlass.min(sched[3], max_ctas), 1, 1)

    def coords(self, tile, sched):
        """(m_block, hb) of linear tile index ``tile`` (trace time); sched: (num_m, heads, num_hb, group, _)."""
        num_m, _, num_hb, group, _ = sched
        return tile_coords(tile, num_m, num_hb, group, self.causal, minimum=cutlass.min)

    @cute.jit
    def run(self, num_tiles, body, q_state, k_state, v_state):
        """body(tile, q_state, k_state, v_state) -> the states, for each of this CTA's tiles in order."""
        bid, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.snake):
            for position in cutlass.range(cute.ceil_div(num_tiles, num_ctas), unroll=1):
                tile = cta_tile(position, bid, num_ctas, True)
                if tile < num_tiles:
                    q_state, k_state, v_state = body(tile, q_state, k_state, v_state)
        else:
            for tile in cutlass.range(bid, num_tiles, num_ctas, unroll=1):
                q_state, k_state, v_state = body(tile, q_state, k_state, v_state)
        return q_state, k_state, v_state
