"""flash_attn.cute's persistent forward (FwdConfig.persistent, FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=1, dense calls): the static tile
order, the switch and its cache key, the launch argument it adds, the kernel's PTX / SASS for sm_90a (no
GPU needed), and on a Hopper GPU (tests marked gpu) the reference checks of the one-tile kernel's tests."""
import glob
import itertools
import os
import re
import subprocess
import sys

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, interface, kernels, plan, settings  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90  # noqa: E402
from flash_attn.cute.tile_scheduler import cta_tile, tile_coords  # noqa: E402
from flash_attn.testing import assert_ptxas_clean, cuobjdump_path  # noqa: E402




def _cfg(dtype, d, causal, **kw):
    return kernels.fwd_config(dtype, d, causal, "sm_90a", **kw).key()


def _make(dtype, d, causal, **kw):
    return kernels._make_kernel(kernels.fwd_config(dtype, d, causal, "sm_90a", **kw))


# ----------------------------------------------------------------------------------------------------
# The schedule


@pytest.mark.parametrize("num_m,num_hb,group", [(1, 1, 1), (3, 5, 2), (7, 4, 4), (5, 6, 16), (33, 12, 8),
                                                (2, 9, 3), (128, 32, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_order_is_a_permutation(num_m, num_hb, group, causal):
    """Every (query block, head-batch pair) exactly once over tiles 0 .. num_m * num_hb - 1."""
    seen = [tile_coords(t, num_m, num_hb, group, causal) for t in range(num_m * num_hb)]
    assert sorted(seen) == sorted(itertools.product(range(num_m), range(num_hb)))


@pytest.mark.parametrize("num_m,num_hb,group", [(3, 5, 2), (7, 4, 4), (33, 12, 8), (2, 9, 3), (6, 7, 100)])
def test_causal_order_is_longest_first_per_section(num_m, num_hb, group):
    """Causal: sections of `group` pairs in order; within one, the query block never grows (the last
    block sees the most keys); group >= num_hb: longest first over all pairs."""
    order = [tile_coords(t, num_m, num_hb, group, True) for t in range(num_m * num_hb)]
    sections = [order[i:i + group * num_m] for i in range(0, len(order), group * num_m)]
    for k, section in enumerate(sections):
        assert {hb for _, hb in section} == set(range(k * group, min((k + 1) * group, num_hb)))
        blocks = [m for m, _ in section]
        assert blocks == sorted(blocks, reverse=True)
    if group >= num_hb:
        assert [m for m, _ in order] == sorted((m for m, _ in order), reverse=True)


def _cta_work(num_m, num_hb, group, num_ctas, snake, block_m=128, block_n=128):
    """Per CTA: key blocks over its tiles (plus one per tile for its prologue and epilogue), causal, Sq = Sk."""
    n = num_m * num_hb
    work = [0] * num_ctas
    for bid in range(num_ctas):
        for p in range(-(-n // num_ctas)):
            t = cta_tile(p, bid, num_ctas, snake)
            if t < n:
                m, _ = tile_coords(t, num_m, num_hb, group, True)
                work[bid] += -(-((m + 1) * block_m) // block_n) + 1
    return work


@pytest.mark.parametrize("num_tiles,num_ctas", [(1, 1), (5, 3), (17, 4), (2048, 132), (131, 132), (264, 132)])
def test_snake_deals_every_tile_once(num_tiles, num_ctas):
    dealt = sorted(t for bid in range(num_ctas) for p in range(-(-num_tiles // num_ctas))
                   if (t := cta_tile(p, bid, num_ctas, True)) < num_tiles)
    assert dealt == list(range(num_tiles))
    assert [cta_tile(p, 2 % num_ctas, num_ctas, False) for p in range(3)] == [2 % num_ctas + p * num_ctas
                                                                             for p in range(3)]


# (seqlen, batch, heads, head dim, BLOCK_N): the grid's causal shapes at 16k tokens, hidden 2048
@pytest.mark.parametrize("seqlen,batch,heads,d,block_n", [(16384, 1, 16, 128, 128), (4096, 4, 16, 128, 128),
                                                          (16384, 1, 32, 64, 128), (16384, 1, 8, 256, 80),
                                                          (4096, 4, 8, 256, 80)])
def test_snake_balances_the_causal_tiles(seqlen, batch, heads, d, block_n):
    """The default causal schedule (one longest-first order, dealt in a snake) keeps every CTA's work
    within 3% of the mean on 132 SMs; the former one (L2-sized sections dealt round robin, fwd.snake=0 in
    FLASH_ATTN_CUTE_OVERRIDES) gave one CTA 1.15x (d128) to 1.42x (d256) of the mean, and the CTAs wait for it."""
    num_m, num_hb = seqlen // 128, batch * heads
    snake = _cta_work(num_m, num_hb, num_hb, 132, True, block_n=block_n)
    assert max(snake) <= 1.03 * sum(snake) / 132
    group = max(FlashFwdSm90.L2_KV_BYTES // (2 * d * 2) // seqlen, 1)
    old = _cta_work(num_m, num_hb, group, 132, False, block_n=block_n)
    if d != 64:
        assert max(old) >= 1.1 * sum(old) / 132


def test_snake_in_the_cache_key_only_when_off(cute_env, monkeypatch):
    """Unset: the snake for persistent causal kernels but at d64 (config.SNAKE_OFF, its measured default);
    fwd.snake=1 / 0 on / off; {"snake": False} in the key only for a persistent causal kernel without it."""
    cfg = lambda d, causal: _cfg(torch.bfloat16, d, causal)  # noqa: E731
    make = lambda d, causal: _make(torch.bfloat16, d, causal)  # noqa: E731
    d64 = cfg(64, True)
    assert d64["persistent"] and d64["snake"] is False and not make(64, True).snake
    assert "snake" not in cfg(128, True)  # the one-tile kernel: nothing to switch
    # (d64 non-causal: persistent without a causal schedule, so no snake either)
    assert not make(64, False).snake and "snake" not in cfg(64, False)
    cute_env(OVERRIDES="fwd.persistent=1")
    d128 = cfg(128, True)
    assert "snake" not in d128 and make(128, True).snake
    assert not make(128, False).snake
    cute_env(OVERRIDES="fwd.persistent=1,fwd.snake=1")
    assert cfg(64, True) == {k: v for k, v in d64.items() if k != "snake"} and make(64, True).snake
    cute_env(OVERRIDES="fwd.persistent=1,fwd.snake=0")
    assert cfg(128, True) == {**d128, "snake": False} and not make(128, True).snake
    cute_env(OVERRIDES=None)  # per head dim: the table (the former "D:1" values are gone)
    monkeypatch.setattr(config, "SNAKE_OFF", frozenset())
    assert cfg(64, True) == {k: v for k, v in d64.items() if k != "snake"} and make(64, True).snake


def test_dense_order_runs_a_heads_query_blocks_together():
    order = [tile_coords(t, 4, 3, 1, False) for t in range(12)]
    assert order[:4] == [(0, 0), (1, 0), (2, 0), (3, 0)] and order[4] == (0, 1)


# ----------------------------------------------------------------------------------------------------
# The switch, the cache key, the launch


def test_persistent_in_the_cache_key_only_when_on(cute_env):
    # by default d64 calls only (the measured wins; see config.PERSISTENT)
    for d, causal in itertools.product((64, 128), (False, True)):
        cfg = _cfg(torch.bfloat16, d, causal)
        assert cfg.get("persistent", False) is (d == 64)
    cute_env(OVERRIDES="fwd.persistent=0")
    for d, causal in itertools.product((64, 128), (False, True)):
        assert "persistent" not in _cfg(torch.bfloat16, d, causal)
    assert "persistent" not in _cfg(torch.bfloat16, 64, True)
    off_key = kernels._entry(torch.bfloat16, 64, True, "sm_90a")[1]
    cute_env(OVERRIDES="fwd.persistent=1")
    for d, causal in itertools.product((64, 128), (False, True)):
        cfg = _cfg(torch.float16, d, causal)
        assert cfg["persistent"] is True
        assert _make(torch.float16, d, causal).persistent
    cfg, key, name, _ = kernels._entry(torch.bfloat16, 64, True, "sm_90a")
    assert key != off_key and "-persistent-" in name
    # windows, softcap, varlen and sinks keep the one-tile kernel (and its key)
    for kw in (dict(local=True), dict(softcap=True), dict(varlen=True), dict(sink=True)):
        assert "persistent" not in _cfg(torch.bfloat16, 64, True, **kw)


def test_persistent_kernel_refuses_what_it_does_not_do():
    import cutlass

    for kw in (dict(local=True), dict(softcap=True), dict(varlen=True), dict(sink=True)):
        with pytest.raises(ValueError, match="persistent"):
            FlashFwdSm90(cutlass.BFloat16, 64, True, persistent=True, **kw)


def test_fwd_kernel_adds_the_sm_count(monkeypatch):
    """The cached callable takes the one-tile kernel's arguments and appends the device's SM count,
    the persistent kernel's last argument; the one-tile kernel is returned as it is."""
    seen = []

    def fake(*args):
        seen.append(args)

    monkeypatch.setattr(kernels, "load_or_build", lambda *a, **k: (fake, "compiled"))
    _swap_kernels(monkeypatch, {})
    monkeypatch.setattr(kernels, "_origins", {})
    monkeypatch.setitem(plan._sm_counts, -1, 132)  # CPU tensors: device index -1 (kernels reads plan's dict)
    q = torch.zeros(1)
    assert kernels.fwd_kernel(torch.bfloat16, 128, False) is fake
    _swap_kernels(monkeypatch, {})
    fn = kernels.fwd_kernel(torch.bfloat16, 64, True)  # persistent by default
    fn(q, q, q, q, q, 0.125, 0.0, 0, 0)
    assert seen[-1][5:] == (0.125, 0.0, 0, 0, 132)
    # a window still gets the one-tile kernel, unwrapped
    assert kernels.fwd_kernel(torch.bfloat16, 64, True, local=True) is fake


# ----------------------------------------------------------------------------------------------------
# The compiled kernel (sm_90a, no GPU)

# (dtype, head dim, causal, consumer warpgroups forced or None for the default table)
PCONFIGS = [(torch.bfloat16, 64, False, None), (torch.bfloat16, 64, True, None), (torch.bfloat16, 128, False, None),
            (torch.float16, 128, True, None), (torch.bfloat16, 64, True, 3)]


def _pid(cfg):
    dtype, d, causal, wg = cfg
    return f"{str(dtype).split('.')[-1]}-d{d}-{'causal' if causal else 'full'}{f'-wg{wg}' if wg else ''}"


@pytest.fixture(scope="module", params=PCONFIGS, ids=_pid)
def persistent(request, tmp_path_factory):
    """(config tuple, fwd config, PTX text, PTX path, cubin path) of the persistent forward."""
    dtype, d, causal, wg = request.param
    dump = tmp_path_factory.mktemp("ptxp")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(settings.DISABLE, raising=False)
            mp.setenv(settings.OVERRIDES, "fwd.persistent=1" + (f",fwd.warpgroups={wg}" if wg else ""))
            settings.reload()
            cfg = _cfg(dtype, d, causal)
            kernels.compile_fwd(dtype, d, causal, arch="sm_90a", dump_dir=str(dump))
    finally:
        settings.reload()
    (path,) = glob.glob(str(dump / "*.ptx"))
    (cubin,) = glob.glob(str(dump / "*.cubin"))
    with open(path) as f:
        return request.param, cfg, f.read(), path, cubin


def _lines(text, start):
    return [line.strip() for line in text.splitlines() if line.lstrip().startswith(start)]


def test_persistent_ptx_has_the_kernels_instructions(persistent):
    (dtype, d, _, _), config, text, _, _ = persistent
    assert config["persistent"] and ".target sm_90a" in text
    assert ".entry kernel_cutlass_kernel_persistent" in text
    ab = "bf16.bf16" if dtype == torch.bfloat16 else "f16.f16"
    block_n = config.get("block_n", 128)
    assert len(_lines(text, f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.{ab}")) >= d // 16
    assert len(_lines(text, f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{ab}")) >= block_n // 16
    assert len(_lines(text, "cp.async.bulk.tensor")) >= 3  # Q, K, V
    if d == 128 or config.get("warpgroups", 2) == 3:  # P converted pairwise (FlashFwdSm90.pack_p), two sites
        pair = "cvt.rn.bf16x2.f32" if dtype == torch.bfloat16 else "cvt.rn.f16x2.f32"
        assert len(_lines(text, pair)) >= 2 * (block_n // 4)
    regs = FlashFwdSm90.REGS[config.get("warpgroups", 2)]
    assert _lines(text, "setmaxnreg.dec.sync.aligned.u32") == [f"setmaxnreg.dec.sync.aligned.u32 \t{regs[0]};"]
    assert _lines(text, "setmaxnreg.inc.sync.aligned.u32") == [f"setmaxnreg.inc.sync.aligned.u32 \t{regs[1]};"]


def test_persistent_ptx_loops_over_tiles(persistent):
    """A 1-D grid (no blockIdx.y / .z: head and batch come from the tile index), and two tile loops
    (producer, consumers): round robin they step their tile by gridDim.x; in a snake (causal, but d64 by
    default) they count positions and take the tile from cta_tile, so no tile index steps by gridDim.x."""
    _, config, text, _, _ = persistent
    assert "%ctaid.y" not in text and "%ctaid.z" not in text
    nctaid = re.findall(r"mov\.u32\s+(%r\d+), %nctaid\.x;", text)
    steps = [line for line in _lines(text, "add.s32") for r in nctaid
             if re.fullmatch(rf"add\.s32\s+(%r\d+), \1, {r};", line)]
    if config["causal"] and config.get("snake", True):
        assert len(nctaid) >= 2 and not steps, (nctaid, steps)
    else:
        assert len(steps) == 2, (nctaid, steps)


def test_persistent_ptx_turn_circulates_across_tiles(persistent):
    """Named barriers: the first turn handed to warpgroup 0 once (bar.arrive 1) and taken back once
    after the last tile (bar.sync 1); the rest at run-time barrier ids, all of 2 x 128 threads."""
    _, config, text, _, _ = persistent
    assert _lines(text, "bar.arrive 1,") == ["bar.arrive 1, 256;"]
    assert _lines(text, "bar.sync \t1,") == ["bar.sync \t1, 256;"]
    named = [line for line in _lines(text, "bar.") if line != "bar.sync \t0;"]
    assert len(named) >= 4 and all(line.endswith(", 256;") for line in named), named


def test_persistent_ptx_consumers_advance_k_and_v_alike(persistent):
    """The consumers' K and V pipeline states both advance after a tile's first and in-loop blocks, and
    V once more after the tile's last P V: without that last advance (the first GPU run's hang) V lags
    the producer by one stage per tile (tests/cute/test_cute_persistent_protocol.py models it). In the PTX: the
    phase register of the consumers' V full-barrier waits is flipped at as many sites as K's (2)."""
    _, _, text, _, _ = persistent
    body = text[text.index("setmaxnreg.inc"):]  # the consumer warpgroups' code
    offsets = dict(re.findall(r"add\.s32\s+(%r\d+), %r\d+, (\d+);", body))
    phases = {}  # barrier offset from the shared-memory base -> phase registers waited on
    for addr, phase in re.findall(r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[(%r\d+)\], (%r\d+),", body):
        if addr in offsets:  # Q's full barrier sits at the base itself
            phases.setdefault(int(offsets[addr]), set()).add(phase)
    assert len(phases) == 2, phases  # K full (offset 16), V full (after K's full and empty barriers)
    flips = [sum(len(re.findall(rf"xor\.b32\s+{r}, {r}, %r\d+;", body)) for r in regs)
             for _, regs in sorted(phases.items())]
    assert flips == [2, 2], (phases, flips)


@pytest.mark.skipif(__import__("shutil").which("ptxas") is None, reason="ptxas not on PATH")
def test_persistent_kernel_fits_its_registers(persistent):
    """No spills, no C7508 (setmaxnreg ignored) and no C7510-C7520 (WGMMAs serialised, warpgroup.arrive
    injected); CuTeDSL's cubin has no local-memory traffic and one WARPGROUP.ARRIVE per wgmma.fence."""
    _, _, text, ptx_path, cubin = persistent
    assert_ptxas_clean(ptx_path)
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    assert "HGMMA" in sass and " STL" not in sass and " LDL" not in sass
    assert sass.count("WARPGROUP.ARRIVE") == len(_lines(text, "wgmma.fence"))


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU: the one-tile kernel's reference test, persistent


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _persistent_on(cute_env, monkeypatch, warpgroups=None, wg_order=None):
    """fwd.persistent=1 (fwd.warpgroups / fwd.wg_order as given: d64 calls only)."""
    cute_env(OVERRIDES="fwd.persistent=1" + (f",fwd.warpgroups={warpgroups}" if warpgroups else "")
             + (f",fwd.wg_order={wg_order}" if wg_order is not None else ""))
    _swap_kernels(monkeypatch, {})  # the in-memory table does not key on the overrides


# (batch, seqlen_q, seqlen_k, heads, heads_kv): 1 row; odd lengths; GQA / MQA; Sq != Sk both ways (causal
# Sq > Sk: tiles with no visible key); and many waves of tiles on 132 SMs (2 x 33 x 16 = 1056 at BLOCK_M
# 128, 2 x 22 x 16 = 704 at 192).
PSHAPES = [(1, 1, 1, 2, 2), (2, 128, 128, 4, 4), (2, 113, 203, 6, 2), (1, 1023, 1023, 4, 1), (2, 256, 77, 2, 2),
           (1, 300, 1200, 8, 4), (3, 17, 2049, 5, 1), (2, 4097, 4097, 16, 4), (1, 2000, 333, 12, 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_matches_reference_on_gpu(cute_env, monkeypatch, dtype, d, causal):
    from test_cute_compile import test_matches_reference_on_gpu

    _persistent_on(cute_env, monkeypatch)
    assert kernels.fwd_config(dtype, d, causal, "sm_90a").persistent
    for shape in PSHAPES:
        test_matches_reference_on_gpu(dtype, d, causal, *shape)
    fn = kernels._kernels[(dtype, d, causal, "sm_90a", False, False)]
    assert fn.__qualname__.startswith("_persistent_launcher")  # the persistent kernel ran


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("warpgroups,wg_order", [(2, None), (3, None), (3, "0"), (2, "0")])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_d64_warpgroups_on_gpu(cute_env, monkeypatch, warpgroups, wg_order, causal):
    """d64 with 2 and 3 consumer warpgroups (BLOCK_M 128 / 192) whatever the mask, ordered or not."""
    from test_cute_compile import test_matches_reference_on_gpu

    _persistent_on(cute_env, monkeypatch, warpgroups, wg_order)
    assert kernels.fwd_config(torch.bfloat16, 64, causal, "sm_90a").warpgroups == warpgroups
    for shape in PSHAPES + [(1, 191, 191, 4, 4), (2, 192, 192, 4, 1), (1, 193, 385, 2, 2)]:
        test_matches_reference_on_gpu(torch.bfloat16, 64, causal, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_persistent_equals_one_tile_kernel_on_gpu(cute_env, monkeypatch, d, causal):
    """Each tile runs the one-tile kernel's code on the same blocks in the same order, so out and lse
    should be bitwise equal to it (a failure here with the reference tests passing points at code
    generation, e.g. a different FMA contraction, rather than at the schedule)."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    q = torch.randn(2, 3001, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2500, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2500, 2, d, device="cuda", dtype=torch.bfloat16)
    _swap_kernels(monkeypatch, {})
    ref_out, ref_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    _persistent_on(cute_env, monkeypatch)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)
