"""A pure-Python model of the persistent CuTeDSL forward's synchronisation (flash_fwd_sm90.py,
kernel_persistent: _produce with carried states, _consume_persistent, _mainloop with q_pipe), run under
random interleavings: mbarriers with arrival counts, transaction bytes and phase parity as PTX defines
them, named barriers counting threads, TMA copies that land in any order. It checks that one CTA's
producer thread and consumer warpgroups finish (no deadlock), that every consumer wait finds the tile
and key block it expects in the stage it reads, and that no copy lands in a buffer a consumer still
holds. The operation order is written out by hand from the kernel; test_cute_persistent.py ties the
part that hung to the compiled PTX (the consumers advance K and V the same number of times)."""
import os
import random
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute.tile_scheduler import cta_tile, tile_coords  # noqa: E402  (plain Python, no cutlass needed)

L2_KV_BYTES = 32 << 20  # FlashFwdSm90.L2_KV_BYTES, repeated so that this file needs no cutlass


class Deadlock(Exception):
    pass


class Race(Exception):
    pass


class MBarrier:
    """PTX mbarrier: a phase completes when its pending arrivals and its transaction count are both 0;
    try_wait.parity(p) succeeds once the phase of parity p has completed, i.e. while the current
    phase's parity differs from p."""

    def __init__(self, count, name=""):
        self.count, self.pending, self.tx, self.completed = count, count, 0, 0
        self.name = name

    def __repr__(self):
        return f"{self.name} (phases completed {self.completed})"

    def _check(self):
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def arrive(self, n=1, tx=0):
        self.tx += tx
        self.pending -= n
        if self.pending < 0:
            raise Race("more arrivals than the barrier's count in one phase")
        self._check()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._check()

    def passed(self, parity):
        return self.completed % 2 != parity


class NamedBarrier:
    """bar.sync / bar.arrive id, n: a generation completes when n threads have arrived."""

    def __init__(self):
        self.arrived, self.generation, self.n = 0, 0, None

    def arrive(self, n, threads=128):
        if self.n is not None and self.n != n:
            raise Race("named barrier used with two thread counts")
        self.n = n
        self.arrived += threads
        gen = self.generation
        if self.arrived >= n:
            if self.arrived > n:
                raise Race("more threads than the named barrier's count in one generation")
            self.arrived, self.generation = 0, self.generation + 1
        return gen


class State:
    """cutlass.pipeline's PipelineState: stage index and phase; advance flips the phase on wrap."""

    def __init__(self, stages, phase):
        self.stages, self.index, self.phase = stages, 0, phase

    def advance(self):
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


class Pipe:
    """PipelineTmaAsync: full barriers (1 arrival: the producer's arrive.expect_tx, plus the TMA bytes),
    empty barriers (one arrival per consumer warp)."""

    def __init__(self, name, stages, consumer_warps):
        self.stages = stages
        self.full = [MBarrier(1, f"{name} full[{i}]") for i in range(stages)]
        self.empty = [MBarrier(consumer_warps, f"{name} empty[{i}]") for i in range(stages)]
        self.content = [None] * stages
        self.holders = [set() for _ in range(stages)]


def cta_tiles(bid, num_ctas, num_m, num_hb, group, causal, snake=False):
    """kernel_persistent's tiles of CTA bid: round robin, or with snake (causal) cta_tile's order."""
    n = num_m * num_hb
    if snake:
        ts = [cta_tile(p, bid, num_ctas, True) for p in range(-(-n // num_ctas))]
        return [tile_coords(t, num_m, num_hb, group, causal) for t in ts if t < n]
    return [tile_coords(t, num_m, num_hb, group, causal) for t in range(bid, n, num_ctas)]


def n_blocks(m_block, causal, seqlen_q, seqlen_k, block_m, block_n):
    """FlashFwdSm90._tile's n_block_max."""
    n = -(-seqlen_k // block_n)
    if causal:
        n = min(n, -(-max((m_block + 1) * block_m + seqlen_k - seqlen_q, 0) // block_n))
    return n


def _ascending(position, n):
    return position


def producer(tiles, nblocks, q, k, v, order=_ascending):
    """_produce, states carried from tile to tile (kernel_persistent's producer thread). order(position,
    n): the key block loaded at that position of a tile of n blocks (FlashFwdSm90's key_block)."""
    qs, ks, vs = State(1, 1), State(k.stages, 1), State(v.stages, 1)
    for tile, n in zip(tiles, nblocks):
        yield ("wait", q.empty[0], qs.phase)
        yield ("expect", q.full[0], "Q")
        yield ("tma", q, 0, (tile, "Q"))
        qs.advance()
        for j in range(n):
            for pipe, st in ((k, ks), (v, vs)):
                yield ("wait", pipe.empty[st.index], st.phase)
                yield ("expect", pipe.full[st.index], "KV")
                yield ("tma", pipe, st.index, (tile, order(j, n)))
                st.advance()


def consumer(wg, num_wg, tiles, nblocks, q, k, v, pingpong, advance_v_after_last, order=_ascending):
    """_consume_persistent + _mainloop(q_pipe=...) for one warpgroup (its 4 warps act together: 4
    arrivals on an empty barrier, 128 threads on a named barrier); order: the key block it expects at
    each position (as producer's)."""
    qs, ks, vs = State(1, 0), State(k.stages, 0), State(v.stages, 0)
    turn_bar = (wg + 1) % num_wg + 1
    me = ("wg", wg)

    def take(pipe, st, tag):
        yield ("wait", pipe.full[st.index], st.phase)
        yield ("hold", pipe, st.index, tag, me)

    def give(pipe, st):
        yield ("release", pipe, st.index, me)

    if pingpong and wg == num_wg - 1:
        yield ("bar_arrive", 1)
    for i, (tile, n) in enumerate(zip(tiles, nblocks)):
        yield ("tile", i)
        yield from take(q, qs, (tile, "Q"))
        if n > 0:
            yield from take(k, ks, (tile, order(0, n)))
            if pingpong:
                yield ("bar_sync", 1 + wg)
            if pingpong:
                yield ("bar_arrive", turn_bar)
            yield from give(k, ks)
            ks.advance()
            for j in range(1, n):
                yield from take(k, ks, (tile, order(j, n)))
                yield from take(v, vs, (tile, order(j - 1, n)))
                if pingpong:
                    yield ("bar_sync", 1 + wg)
                if pingpong:
                    yield ("bar_arrive", turn_bar)
                yield from give(k, ks)
                ks.advance()
                yield from give(v, vs)
                vs.advance()
            yield from give(q, qs)
            yield from take(v, vs, (tile, order(n - 1, n)))
            yield from give(v, vs)
            if advance_v_after_last:
                vs.advance()
        else:
            yield from give(q, qs)
        qs.advance()
    if pingpong and wg == 0:
        yield ("bar_sync", 1)


def simulate(tiles, nblocks, num_wg=2, stages=2, pingpong=True, advance_v_after_last=True, seed=0,
             check_reads=True, max_steps=10 ** 7, order=_ascending, consumer_order=None):
    """Runs one CTA's agents in a random order until all finish. Raises Deadlock when none can move
    with some unfinished, Race on an over-arrival and (check_reads) on a stale read or an overwrite of a
    held buffer. Returns the number of steps."""
    rng = random.Random(seed)
    warps = 4 * num_wg
    q, k, v = Pipe("Q", 1, warps), Pipe("K", stages, warps), Pipe("V", stages, warps)
    named = {i: NamedBarrier() for i in range(1, num_wg + 1)}
    agents = {"producer": producer(tiles, nblocks, q, k, v, order)}
    for wg in range(num_wg):
        agents[("wg", wg)] = consumer(wg, num_wg, tiles, nblocks, q, k, v, pingpong, advance_v_after_last,
                                      order if consumer_order is None else consumer_order)
    current = {name: next(gen) for name, gen in agents.items()}
    in_flight = []  # TMA copies issued, not landed: (pipe, stage, tag)
    progress = {}  # consumer warpgroup -> the index of the tile it is in
    sync_gen = {}  # warpgroup -> (barrier, generation) it waits on after its bar.sync arrival

    def blocked(name, op):
        if op[0] == "wait":
            return not op[1].passed(op[2])
        return name in sync_gen and sync_gen[name][0].generation == sync_gen[name][1]

    def step(name, op):
        """Executes op if it can; returns False when the agent is blocked on it."""
        kind = op[0]
        if kind == "wait":
            return op[1].passed(op[2])
        if kind == "expect":
            op[1].arrive(1, tx=1)
            return True
        if kind == "tma":
            in_flight.append(op[1:])
            return True
        if kind == "tile":
            progress[name] = op[1]
            return True
        if kind == "hold":
            _, pipe, stage, tag, who = op
            if check_reads and pipe.content[stage] != tag:
                raise Race(f"{who} expected {tag} in stage {stage}, found {pipe.content[stage]}")
            pipe.holders[stage].add(who)
            return True
        if kind == "release":
            _, pipe, stage, who = op
            pipe.holders[stage].discard(who)
            pipe.empty[stage].arrive(4)  # one arrival per warp of the warpgroup
            return True
        if kind == "bar_arrive":
            named[op[1]].arrive(2 * 128)
            return True
        if kind == "bar_sync":
            if name not in sync_gen:
                sync_gen[name] = (named[op[1]], named[op[1]].arrive(2 * 128))
            bar, gen = sync_gen[name]
            if bar.generation == gen:
                return False
            del sync_gen[name]
            return True
        raise AssertionError(op)

    for steps in range(max_steps):
        runnable = [n for n, op in current.items() if op is not None and not blocked(n, op)]
        choices = runnable + (["tma"] if in_flight else [])
        if not choices:
            if all(op is None for op in current.values()):
                # every arrival met its wait: no named barrier or mbarrier phase left half full
                left = [i for i, bar in named.items() if bar.arrived] + [
                    bar for pipe in (q, k, v) for bar in pipe.full + pipe.empty if bar.pending != bar.count or bar.tx]
                if left:
                    raise Race(f"arrivals left at the end: {left}")
                return steps
            raise Deadlock({n: op[:3] for n, op in current.items() if op is not None}, progress)
        name = rng.choice(choices)
        if name == "tma":
            pipe, stage, tag = in_flight.pop(rng.randrange(len(in_flight)))
            if check_reads and pipe.holders[stage]:
                raise Race(f"copy of {tag} landed in stage {stage} held by {pipe.holders[stage]}")
            pipe.content[stage] = tag
            pipe.full[stage].complete_tx(1)
            continue
        if step(name, current[name]):
            current[name] = next(agents[name], None)
    raise AssertionError("no end within max_steps")


def cta_schedule(batch, seqlen_q, seqlen_k, heads, heads_kv, d, causal, block_m=128, block_n=128,
                 num_ctas=132, bid=0):
    """(tiles, key blocks per tile) of CTA bid, as kernel_persistent computes them (_dense's group)."""
    num_m = -(-seqlen_q // block_m)
    num_hb = heads * batch
    group = max(L2_KV_BYTES // (2 * d * 2) // seqlen_k, 1) * (heads // heads_kv)
    snake = causal and d != 64  # FlashFwdSm90 snake (config.SNAKE_OFF: d64 keeps the sections)
    if snake:  # one longest-first order over all pairs, dealt in a snake
        group = num_hb
    num_ctas = min(num_ctas, num_m * num_hb)
    tiles = cta_tiles(bid, num_ctas, num_m, num_hb, group, causal, snake=snake)
    return tiles, [n_blocks(m, causal, seqlen_q, seqlen_k, block_m, block_n) for m, _ in tiles]


# (batch, seqlen_q, seqlen_k, heads, heads_kv, d, causal, block_m, block_n, stages, warpgroups): the
# benchmark's first shape (d64 causal 1024, 4096 tiles on 132 CTAs), the reference test's many-wave shape,
# causal Sq > Sk (tiles without keys), one block per tile, three warpgroups (BLOCK_M 192).
SHAPES = [(16, 1024, 1024, 32, 32, 64, True, 128, 128, 4, 2),
          (2, 4097, 4097, 16, 4, 64, False, 128, 128, 4, 2),
          (2, 4097, 4097, 16, 4, 128, True, 128, 128, 2, 2),
          (2, 3001, 2500, 8, 2, 64, True, 128, 128, 4, 2),
          (1, 2000, 333, 12, 3, 64, True, 128, 128, 4, 2),
          (8, 128, 128, 32, 32, 64, False, 128, 128, 2, 2),
          (2, 4097, 4097, 16, 4, 64, True, 192, 128, 2, 3),
          (1, 2000, 333, 12, 3, 64, True, 192, 96, 2, 3)]


def _cases():
    for shape in SHAPES:
        b, sq, sk, h, hk, d, causal, bm, bn, stages, nwg = shape
        for bid in (0, 131):
            tiles, nb = cta_schedule(b, sq, sk, h, hk, d, causal, bm, bn, bid=bid)
            yield shape, bid, tiles, nb, stages, nwg


@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: f"{c[0][:7]}-bm{c[0][7]}-cta{c[1]}")
def test_persistent_protocol_completes(case, pingpong):
    """The kernel's protocol: every CTA schedule finishes under several random interleavings, with
    every read finding its tile's block."""
    _, _, tiles, nb, stages, nwg = case
    assert tiles
    for seed in range(3):
        simulate(tiles, nb, num_wg=nwg, stages=stages, pingpong=pingpong, seed=seed)


def test_zero_key_tiles_are_in_the_cases():
    """causal Sq > Sk gives tiles with no key block (they only wait for Q and release it)."""
    assert any(0 in nb for _, _, _, nb, _, _ in _cases())


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=["bench-d64-causal", "ref-4097"])
def test_v_state_not_advanced_after_the_last_block_fails(shape):
    """The bug the GPU hit: without the V state's advance after a tile's last P V, the consumers lag the
    producer by one V stage per tile: they read a stale V (a race) and, where timing lets them run on,
    the phases wrap until both sides wait forever. The model must catch it on every interleaving."""
    b, sq, sk, h, hk, d, causal, bm, bn, stages, nwg = shape
    tiles, nb = cta_schedule(b, sq, sk, h, hk, d, causal, bm, bn)
    for seed in range(5):
        with pytest.raises((Deadlock, Race)):
            simulate(tiles, nb, num_wg=nwg, stages=stages, advance_v_after_last=False, seed=seed)
    # one tile per CTA never shows it (the reference test's first shapes ran before the hang)
    simulate(tiles[:1], nb[:1], num_wg=nwg, stages=stages, advance_v_after_last=False)


def test_a_model_without_reads_checked_still_deadlocks():
    """The hang itself, not only the stale read: with the buggy state and the content check off (the
    hardware reads whatever is there), the benchmark's CTA 0 ends in a deadlock."""
    shape = SHAPES[0]
    b, sq, sk, h, hk, d, causal, bm, bn, stages, nwg = shape
    tiles, nb = cta_schedule(b, sq, sk, h, hk, d, causal, bm, bn)
    outcomes = set()
    for seed in range(5):
        try:
            simulate(tiles, nb, num_wg=nwg, stages=stages, advance_v_after_last=False, seed=seed,
                     check_reads=False)
            outcomes.add("finished")
        except Deadlock:
            outcomes.add("deadlock")
    assert outcomes == {"deadlock"}, outcomes
