"""flash_attn.cute forward with fwd.reverse (FLASH_ATTN_CUTE_OVERRIDES; FlashFwdSm90 reverse): each tile walks its key
blocks from the last down (FA3's order), so a causal or windowed tile's masked diagonal blocks come first.

Without a GPU: the switch, its cache key and the precompile entry point; the order function the producer
and the consumers share (key_block) and, traced from a real compile, that both call it with the kernel's
flag; the persistent kernel's synchronisation model (tests/cute/test_cute_persistent_protocol.py) with the
reverse order, and failing when producer and consumers disagree; a step-by-step model of the consumers'
online softmax over the kernel's blocks, masks and mask predicate in both orders (a row that sees no key
in the first block it processes must keep max -inf without NaN); the reverse kernels compiled for sm_90a
(PTX holds WGMMA, TMA and setmaxnreg; ptxas spills nothing). On a Hopper GPU (marked gpu): the reference
checks of the default kernel's tests, and reverse output equal to the default order's within rounding."""
import glob
import math
import os
import shutil
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from flash_attn.cute import cache, config, flash_fwd_sm90, kernels, settings  # noqa: E402
from _cute_table import swap_kernels  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90  # noqa: E402
from flash_attn.cute.tile_scheduler import key_block  # noqa: E402
from flash_attn.testing import assert_ptxas_clean  # noqa: E402

UNBOUNDED = FlashFwdSm90.UNBOUNDED


# ----------------------------------------------------------------------------------------------------
# The switch


def test_reverse_in_the_config_only_for_masked_calls_when_on(cute_env):
    """Unset: only d64 causal's persistent kernel (dense calls) is reversed (config.REVERSE); fwd.reverse=0: none
    (the other keys unchanged, so their disk entries stay); fwd.reverse=1: in the key of causal and windowed calls
    (one-tile and persistent, varlen, softcap, sink) and not of calls without a mask; the kernel gets
    reverse=True."""
    cfg = lambda d, causal, **kw: kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()  # noqa: E731
    make = lambda d, causal, **kw: kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, **kw))  # noqa: E731
    kinds = [dict(), dict(local=True), dict(varlen=True), dict(softcap=True), dict(sink=True),
             dict(local=True, varlen=True)]
    default = {(d, c, i): cfg(d, c, **kw) for d in (64, 128) for c in (False, True) for i, kw in enumerate(kinds)}
    assert {key for key, b in default.items() if "reverse" in b} == {(64, True, 0)}
    assert default[(64, True, 0)]["reverse"] is True and default[(64, True, 0)]["persistent"] is True
    cute_env(OVERRIDES="fwd.reverse=0")
    base = {key: cfg(key[0], key[1], **kinds[key[2]]) for key in default}
    assert not any("reverse" in b for b in base.values())
    assert {key: b for key, b in base.items() if key != (64, True, 0)} == {
        key: b for key, b in default.items() if key != (64, True, 0)}
    assert {k: v for k, v in default[(64, True, 0)].items() if k != "reverse"} == base[(64, True, 0)]
    cute_env(OVERRIDES="fwd.reverse=1")
    for (d, causal, i), b in base.items():
        on = cfg(d, causal, **kinds[i])
        if causal or kinds[i].get("local"):
            assert on == {**b, "reverse": True}
            assert cache.entry_key(on) != cache.entry_key(b)
            assert make(d, causal, **kinds[i]).reverse
        else:
            assert on == b and not make(d, causal, **kinds[i]).reverse
    assert cfg(64, True)["persistent"] is True  # d64 causal: the persistent kernel, reversed
    key_config, key, name, _ = kernels._entry(torch.bfloat16, 128, True, "sm_90a")
    assert "-reverse-" in name and key_config["reverse"] is True
    assert FlashFwdSm90(kernels._cutlass_dtype(torch.bfloat16), 64, True, persistent=True, reverse=True).reverse


def test_precompile_honours_the_switch(cute_env, monkeypatch, tmp_path):
    """python -m flash_attn.cute.precompile builds the configs the environment selects: with the switch on,
    the causal entries it writes are the reverse kernels (compiling is stubbed out here)."""
    from flash_attn.cute import precompile

    if not kernels._tvm_ffi():
        pytest.skip("precompiling needs apache-tvm-ffi")
    # not the short-key kernels as well (fwd.tma_o=0; fwd.lpt=0: d128's short-key kernel differs in its CTA
    # order; no short-key persistent kernel: d128 non-causal's), nor the long-key ones (no config.LONG entry)
    monkeypatch.setattr(config, "LONG", {})
    monkeypatch.setattr(config, "SHORT_PERSISTENT", frozenset())
    seen = []

    def stub(entry, compile_fn, root, force):
        seen.append(entry[0])
        raise RuntimeError("stub: not compiled")

    monkeypatch.setattr(kernels, "_load_or_build_entry", stub)
    for env in ("0", "1"):
        cute_env(OVERRIDES=f"fwd.tma_o=0,fwd.lpt=0,fwd.reverse={env}")
        report = precompile.precompile(str(tmp_path), "sm_90a", dtypes=("bf16",), head_dims=(64, 128),
                                       log=lambda *a: None)
        assert len(report) == 4 and all("stub" in r["error"] for r in report)
    assert [c.get("reverse", False) for c in seen] == [False] * 4 + [False, True, False, True]
    assert [c["causal"] for c in seen] == [False, True] * 4


# ----------------------------------------------------------------------------------------------------
# The order


@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 5), (3, 9), (7, 8), (2, 2)])
def test_key_block_order(lo, hi):
    """Positions lo .. hi - 1 map onto the same blocks, ascending or from the last down."""
    asc = [key_block(p, lo, hi, False) for p in range(lo, hi)]
    rev = [key_block(p, lo, hi, True) for p in range(lo, hi)]
    assert asc == list(range(lo, hi))
    assert rev == list(range(hi - 1, lo - 1, -1))


def test_protocol_model_with_the_reverse_order():
    """The persistent kernel's synchronisation model (pipeline states carried across tiles, the turn
    circulating over tile boundaries) with the kernel's key_block order: it completes when producer and
    consumers walk the blocks in the same order (stages and turns count positions, the same in both
    orders), and reads the wrong block (a Race) when only one side is reversed."""
    from test_cute_persistent_protocol import SHAPES, Race, cta_schedule, simulate

    rev = lambda j, n: key_block(j, 0, n, True)  # noqa: E731  (the persistent kernel's n_block_min is 0)
    asc = lambda j, n: key_block(j, 0, n, False)  # noqa: E731
    for shape in (SHAPES[0], SHAPES[3], SHAPES[6]):
        b, sq, sk, h, hk, d, causal, bm, bn, stages, nwg = shape
        tiles, nb = cta_schedule(b, sq, sk, h, hk, d, causal, bm, bn)
        for seed in range(2):
            simulate(tiles, nb, num_wg=nwg, stages=stages, seed=seed, order=rev)
            for producer_order, consumer_order in ((rev, asc), (asc, rev)):
                with pytest.raises(Race):
                    simulate(tiles, nb, num_wg=nwg, stages=stages, seed=seed, order=producer_order,
                             consumer_order=consumer_order)


# A model of one query tile as the kernel computes it (AttentionMask's block ranges, _mainloop's mask
# predicate, AttentionMask.apply, OnlineSoftmax.step, the P rounding and O's rescale), in plain torch:
# fp32 scores and running state, P rounded to bf16.

def _tile_range(m, bm, bn, sq, sk, causal, local, wl, wr):
    lo, hi = 0, -(-sk // bn)
    if causal or local:
        right = 0 if causal else wr
        hi = min(hi, -(-max((m + 1) * bm + sk - sq + right, 0) // bn))
    if local:
        lo = max(m * bm + sk - sq - wl, 0) // bn
    below, since = 0, sk // bn
    if causal or local:
        right = 0 if causal else wr
        since = min(since, max(m * bm + sk - sq + right + 1, 0) // bn)
    if local:
        below = -(-max((m + 1) * bm - 1 + sk - sq - wl, 0) // bn)
    return lo, hi, below, since


def _mask(m, n, bm, bn, sq, sk, causal, local, wl, wr):
    row = m * bm + torch.arange(bm).view(-1, 1)
    col = n * bn + torch.arange(bn).view(1, -1)
    masked = (col >= sk) & (row >= 0)  # (bm, bn)
    if causal:
        masked |= col > row + sk - sq
    if local:
        diag = row + sk - sq
        masked |= (col > diag + wr) | (col < diag - wl)
    return masked


def _run_tile(q, k, v, m, bm, bn, causal, local, wl, wr, scale_log2, reverse, guard=True):
    """(O / l rows, row max, row sum, rows that saw no key in the first block processed) of query tile m,
    the blocks in key_block's order. guard=False: the softmax without its rule for an all -inf row."""
    sq, sk = q.shape[0], k.shape[0]
    qt = torch.zeros(bm, q.shape[1])
    rows = q[m * bm:(m + 1) * bm]
    qt[:rows.shape[0]] = rows  # TMA fills rows past the sequence with zeros
    lo, hi, below, since = _tile_range(m, bm, bn, sq, sk, causal, local, wl, wr)
    o = torch.zeros(bm, v.shape[1])
    row_max = torch.full((bm,), -math.inf)
    row_sum = torch.zeros(bm)
    first_empty = None
    for pos in range(lo, hi):
        n = key_block(pos, lo, hi, reverse)
        kt = torch.zeros(bn, k.shape[1])
        vt = torch.zeros(bn, v.shape[1])
        kk, vv = k[n * bn:(n + 1) * bn], v[n * bn:(n + 1) * bn]
        kt[:kk.shape[0]], vt[:vv.shape[0]] = kk, vv
        s = qt @ kt.T
        masked = _mask(m, n, bm, bn, sq, sk, causal, local, wl, wr)
        if n >= since or n < below:
            s = s.masked_fill(masked, -math.inf)
        else:  # the predicate skips only blocks that need no mask
            assert not masked.any(), (m, n)
        if pos == lo:
            first_empty = torch.isneginf(s).all(1)
        m_new = torch.maximum(s.max(1).values, row_max)
        m_scaled = m_new * scale_log2
        if guard:
            m_scaled = torch.where(torch.isneginf(m_new), torch.zeros_like(m_scaled), m_scaled)
        corr = torch.exp2(row_max * scale_log2 - m_scaled)
        p = torch.exp2(s * scale_log2 - m_scaled.view(-1, 1))
        row_sum = row_sum * corr + p.sum(1)
        row_max = m_new
        o = o * corr.view(-1, 1) + p.to(torch.bfloat16).float() @ vt
    inv = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
    return (o * inv.view(-1, 1))[:max(min(sq - m * bm, bm), 0)], row_max, row_sum, first_empty


def _reference(q, k, v, sq, sk, causal, local, wl, wr, scale):
    row = torch.arange(sq).view(-1, 1)
    col = torch.arange(sk).view(1, -1)
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if causal:
        masked |= col > row + sk - sq
    if local:
        diag = row + sk - sq
        masked |= (col > diag + wr) | (col < diag - wl)
    s = (q.double() @ k.double().T * scale).masked_fill(masked, -math.inf)
    p = torch.softmax(s, 1).nan_to_num(0.0)  # a row with no visible key: 0
    return (p @ v.double()).float()


# (Sq, Sk, BM, BN, causal, window (left, right), -1: unbounded): square and odd lengths, Sq < Sk (200 x 1000:
# the diagonal off the block grid, so a tile's top rows see no key of its last block), Sq > Sk (rows with no
# key at all),
# 64-row tiles under 128-key blocks, 3 warpgroups (192 x 96), 176-key blocks, windows on both sides,
# causal with a left window, a window of width 1.
MODEL_CASES = [(1000, 1000, 128, 128, True, None), (17, 1000, 128, 128, True, None), (200, 1000, 128, 128, True, None),
               (1000, 17, 128, 128, True, None), (1, 1, 128, 128, True, None),
               (300, 333, 128, 176, True, None), (4097, 4097, 192, 96, True, None),
               (129, 517, 128, 128, False, (64, 16)), (700, 200, 128, 128, False, (100, -1)),
               (333, 333, 128, 128, False, (-1, 40)), (333, 333, 128, 128, False, (0, 0)),
               (517, 129, 192, 96, True, (48, -1)), (1000, 1000, 128, 96, False, (64, 16))]


def _case_id(c):
    sq, sk, bm, bn, causal, window = c
    return f"{sq}x{sk}-{bm}x{bn}-{'causal' if causal else 'full'}{f'-w{window[0]}_{window[1]}' if window else ''}"


@pytest.mark.parametrize("case", MODEL_CASES, ids=_case_id)
def test_reverse_online_softmax_model(case):
    """Both orders through the kernel's tile computation: no NaN, the reference's result (P rounded to
    bf16 as the kernel does), and each other's within that rounding. Rows a tile's first processed block
    shows no key keep max -inf and sum 0 there (the guard in OnlineSoftmax.step makes exp2(-inf - -inf) an
    exp2(-inf) = 0); in the cases that have such rows, the softmax without the guard gives NaN."""
    sq, sk, bm, bn, causal, window = case
    local = window is not None
    wl, wr = window if local else (-1, -1)
    wl = UNBOUNDED if wl < 0 else wl
    wr = 0 if causal else (UNBOUNDED if wr < 0 else wr)
    causal = causal and not local  # as the kernel: a causal window is local with right = 0
    d = 16
    g = torch.Generator().manual_seed(sq * 7 + sk)
    q, k, v = (torch.randn(n, d, generator=g).to(torch.bfloat16).float() for n in (sq, sk, sk))
    scale = d ** -0.5
    scale_log2 = scale * math.log2(math.e)
    ref = _reference(q, k, v, sq, sk, causal, local, wl, wr, scale)
    outs = {}
    empty_first = False
    for reverse in (False, True):
        out = torch.cat([_run_tile(q, k, v, m, bm, bn, causal, local, wl, wr, scale_log2, reverse)[0]
                         for m in range(-(-sq // bm))])
        assert torch.isfinite(out).all()
        assert (out - ref).abs().max().item() < 2e-2, reverse
        outs[reverse] = out
        if reverse:
            for m in range(-(-sq // bm)):
                _, row_max, row_sum, first = _run_tile(q, k, v, m, bm, bn, causal, local, wl, wr, scale_log2, True)
                if first is not None and first[:sq - m * bm].any():  # a row of the sequence, not padding
                    empty_first = True
                    unguarded = _run_tile(q, k, v, m, bm, bn, causal, local, wl, wr, scale_log2, True,
                                          guard=False)
                    assert torch.isnan(unguarded[2]).any()
                assert not torch.isnan(row_max).any() and not torch.isnan(row_sum).any()
    assert (outs[True] - outs[False]).abs().max().item() < 2e-2
    expect_empty = {(200, 1000, 128, 128, True, None), (300, 333, 128, 176, True, None),
                    (129, 517, 128, 128, False, (64, 16)), (1000, 1000, 128, 96, False, (64, 16))}
    if case in expect_empty:
        assert empty_first, "the case was meant to start a tile with rows that see no key"


# ----------------------------------------------------------------------------------------------------
# Compiled for sm_90a (no GPU)

# (head dim, mask, persistent): d64 causal is persistent by default (reversed too); its one-tile kernel;
# d128 causal; a d128 window.
CONFIGS = [(64, "causal", True), (64, "causal", False), (128, "causal", False), (128, "local", False)]


@pytest.fixture(scope="module", params=CONFIGS,
                ids=lambda c: f"d{c[0]}-{c[1]}{'-persistent' if c[2] else ''}")
def reverse_ptx(request, tmp_path_factory):
    """(params, config, PTX text, PTX path, key_block calls traced during the compile: (caller, reverse))."""
    d, mask, persistent = request.param
    dump = tmp_path_factory.mktemp("ptx_reverse")
    calls = []
    real = flash_fwd_sm90.key_block

    methods = set(vars(FlashFwdSm90))

    def traced(position, n_block_min, n_block_max, reverse):
        # the nearest FlashFwdSm90 method up the stack (CuTeDSL traces loop and branch bodies as
        # functions of their own: loop_body_0, then_block_8, ...)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name not in methods:
            frame = frame.f_back
        calls.append((frame.f_code.co_name if frame is not None else None, reverse))
        return real(position, n_block_min, n_block_max, reverse)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv(settings.DISABLE, raising=False)
            mp.setenv(settings.OVERRIDES, f"fwd.persistent={1 if persistent else 0},fwd.reverse=1")
            settings.reload()
            mp.setattr(flash_fwd_sm90, "key_block", traced)
            causal, local = mask == "causal", mask == "local"
            cfg = kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", local=local).key()
            kernels.compile_fwd(torch.bfloat16, d, causal, arch="sm_90a", dump_dir=str(dump), local=local)
    finally:
        settings.reload()
    (path,) = glob.glob(str(dump / "*.ptx"))
    with open(path) as f:
        return request.param, cfg, f.read(), path, calls


def _lines(text, start):
    return [line.strip() for line in text.splitlines() if line.lstrip().startswith(start)]


def test_reverse_ptx_has_the_kernels_instructions(reverse_ptx):
    (d, _, persistent), config, text, _, _ = reverse_ptx
    assert config["reverse"] is True and config.get("persistent", False) is persistent
    assert ".target sm_90a" in text
    assert (".entry kernel_cutlass_kernel_persistent" in text) is persistent
    block_n = config.get("block_n", 128)
    assert len(_lines(text, f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16")) >= d // 16
    assert len(_lines(text, f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.bf16.bf16")) >= block_n // 16
    assert len(_lines(text, "cp.async.bulk.tensor")) >= 3  # Q, K, V
    regs = FlashFwdSm90.REGS[config.get("warpgroups", 2)]
    assert _lines(text, "setmaxnreg.dec.sync.aligned.u32") == [f"setmaxnreg.dec.sync.aligned.u32 \t{regs[0]};"]
    assert _lines(text, "setmaxnreg.inc.sync.aligned.u32") == [f"setmaxnreg.inc.sync.aligned.u32 \t{regs[1]};"]


def test_reverse_order_reaches_producer_and_consumers(reverse_ptx):
    """Traced from the compile: the producer's loads (_produce) and the consumers' masks (_mainloop: the
    first block and the loop) all take their key block from key_block with reverse=True; removing the order
    from either side (or the flag from the kernel) fails here."""
    *_, calls = reverse_ptx
    assert calls and all(reverse is True for _, reverse in calls), calls
    callers = [name for name, _ in calls]
    assert callers.count("_produce") == 1 and callers.count("_mainloop") == 2, callers


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_reverse_fits_the_registers(reverse_ptx):
    assert_ptxas_clean(reverse_ptx[3])


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _reverse(cute_env, monkeypatch, on=True, persistent=None, warpgroups=None):
    """fwd.reverse on / off (unset: d64 causal's default is on), fwd.persistent and fwd.warpgroups (d64 calls
    only) when given, and an empty in-memory kernel table (it does not key on the overrides)."""
    cute_env(OVERRIDES=f"fwd.reverse={1 if on else 0}"
             + (f",fwd.persistent={1 if persistent else 0}" if persistent is not None else "")
             + (f",fwd.warpgroups={warpgroups}" if warpgroups else ""))
    swap_kernels(monkeypatch, {})


# (batch, seqlen_q, seqlen_k, heads, heads_kv): lengths 1, 17, 1000, 4097; Sq != Sk both ways (Sq > Sk:
# rows and tiles with no key; Sq < Sk: the diagonal off the block grid); GQA and MQA.
GPU_SHAPES = [(1, 1, 1, 2, 2), (2, 17, 17, 4, 2), (1, 1000, 1000, 4, 1), (1, 4097, 4097, 8, 2),
              (2, 17, 1000, 4, 4), (1, 1000, 17, 6, 3), (2, 113, 203, 6, 2), (1, 300, 1200, 8, 4),
              (2, 1000, 4097, 4, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,persistent", [(64, None), (64, False), (128, None), (128, True)])
def test_reverse_matches_reference_on_gpu(cute_env, monkeypatch, dtype, d, persistent):
    """Causal: test_cute_compile's reference checks (out within the project's bound, lse) with the reverse
    order, d64 in its default persistent kernel and one-tile, d128 one-tile (default) and persistent."""
    from test_cute_compile import test_matches_reference_on_gpu

    _reverse(cute_env, monkeypatch, persistent=persistent)
    assert kernels.fwd_config(dtype, d, True, "sm_90a").reverse is True
    for shape in GPU_SHAPES:
        test_matches_reference_on_gpu(dtype, d, True, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, (64, 16)), (False, (-1, 40)), (False, (100, -1)),
                                           (True, (48, -1)), (False, (0, 0))])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_reverse_window_matches_reference_on_gpu(cute_env, monkeypatch, d, causal, window, softcap):
    from test_cute_compile import test_window_and_softcap_match_reference_on_gpu

    _reverse(cute_env, monkeypatch)
    assert kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", local=True).reverse is True
    for shape in [(2, 333, 333, 4, 2), (1, 129, 517, 2, 1), (1, 700, 200, 2, 2), (1, 17, 1000, 2, 1),
                  (1, 4097, 4097, 2, 2)]:
        test_window_and_softcap_match_reference_on_gpu(d, causal, window, softcap, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (50, 10), 0.0),
                                                   (True, (-1, -1), 15.0)])
def test_reverse_varlen_matches_reference_on_gpu(cute_env, monkeypatch, d, causal, window, softcap):
    from test_cute_compile import test_varlen_matches_reference_per_sequence_on_gpu

    _reverse(cute_env, monkeypatch)
    for seqused in (False, True):
        test_varlen_matches_reference_per_sequence_on_gpu(d, causal, window, softcap, seqused)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("persistent", [False, True])
def test_reverse_three_warpgroups_on_gpu(cute_env, monkeypatch, persistent):
    """d64 causal with 3 consumer warpgroups (BLOCK_M 192, the round robin), reversed."""
    from test_cute_compile import SHAPES3, test_matches_reference_on_gpu

    _reverse(cute_env, monkeypatch, persistent=persistent, warpgroups=3)
    assert kernels.fwd_config(torch.bfloat16, 64, True, "sm_90a").warpgroups == 3
    for shape in SHAPES3:
        test_matches_reference_on_gpu(torch.bfloat16, 64, True, *shape)


def _attn(q, k, v, **kw):
    from flash_attn.cute import flash_attn_func

    out, lse = flash_attn_func(q, k, v, return_lse=True, **kw)
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(64, 16)), dict(causal=True, window_size=(48, -1))],
                         ids=["causal", "window", "causal-window"])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [
    (2, 1000, 1000, 4, 2), (1, 17, 1000, 4, 4), (1, 1000, 17, 2, 1), (1, 4097, 4097, 4, 1), (2, 113, 203, 6, 2)])
def test_reverse_equals_the_default_order_within_rounding_on_gpu(cute_env, monkeypatch, d, kw, batch, seqlen_q, seqlen_k,
                                                                 heads, heads_kv):
    """The same sums in another order: out within the project's bound of the default order's out (2 x
    PyTorch's own low-precision error + rounding), lse to 1e-3 where finite and +inf in the same rows."""
    from flash_attn.testing import attention_ref, rounding_error

    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    _reverse(cute_env, monkeypatch, on=False)
    out_def, lse_def = _attn(q, k, v, **kw)
    _reverse(cute_env, monkeypatch)
    out, lse = _attn(q, k, v, **kw)
    window = kw.get("window_size", (-1, -1))
    ref_kw = dict(causal=kw.get("causal", False), window_size=(window[0], 0 if kw.get("causal") else window[1]))
    out_ref, _ = attention_ref(q, k, v, **ref_kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **ref_kw)
    err_pt = (out_pt.float() - out_ref.float()).abs().max().item()
    diff = (out.float() - out_def.float()).abs().max().item()
    assert torch.isfinite(out).all()
    assert diff <= 2 * err_pt + rounding_error(out_def), (diff, err_pt)
    finite = torch.isfinite(lse_def)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse[finite] - lse_def[finite]).abs().max().item() < 1e-3
