"""pack_gqa in flash_attn.cute's forward: the g query heads of a KV head share one tile (block_m / g positions of
each head), so that short query sequences (decoding) fill the tile and K / V are read once per group. On the CPU:
the row mapping, the selection rules and cache key, the per-call choice of kernel, and the packed kernels'
PTX (one Q box per head, each into its own rows of the tile; ptxas clean). On a Hopper GPU (tests marked gpu):
every option against the reference, dense and varlen.

The packed kernel was written without a GPU (session 15) and its GPU tests here passed in session 16;
FLASH_ATTN_CUTE_DISABLE=pack_gqa runs every call unpacked (plan._pack_group; the same result)."""
import glob
import os
import re
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, interface, kernels, launch, plan  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.cute.pack_gqa import packed_row  # noqa: E402
from flash_attn.testing import (  # noqa: E402
    assert_close_to_ref, assert_lse_close, assert_ptxas_clean, attention_lse_ref, attention_ref, fa4_window,
)



@pytest.fixture(autouse=True)
def _defaults(cute_env):
    """No FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE: the default kernels."""



# ----------------------------------------------------------------------------------------------------
# CPU: the mapping, the rules, the dispatch


@pytest.mark.parametrize("block_m,group", [(128, g) for g in (1, 2, 4, 8, 16)] + [(192, g) for g in (1, 2, 3, 8, 24)])
@pytest.mark.parametrize("seqlen_q", [1, 5, 8, 17, 100])
def test_packed_rows_cover_every_query_row_once(block_m, group, seqlen_q):
    """The tiles of the packed grid (ceil(Sq / block_q) of them) hold every (position, head of the group) once,
    rows past the sequence end map past it (the epilogue skips them), and each head's rows are one run of
    block_q rows starting on a multiple of 8 (one TMA box per head)."""
    block_q = block_m // group
    seen = []
    for m in range(-(-seqlen_q // block_q)):
        heads_of_rows = []
        for r in range(block_m):
            pos, j = packed_row(r, m, block_q, group)
            assert 0 <= j < group and m * block_q <= pos < (m + 1) * block_q
            heads_of_rows.append(j)
            if pos < seqlen_q:
                seen.append((pos, j))
        for j in range(group):
            rows = [r for r, h in enumerate(heads_of_rows) if h == j]
            assert rows == list(range(j * block_q, (j + 1) * block_q)) and rows[0] % 8 == 0
    assert sorted(seen) == [(s, j) for s in range(seqlen_q) for j in range(group)]


def test_pack_group_rules(cute_env):
    """pack_gqa=True packs H // Hk when that is one of config.PACK_GROUPS (by default: FLASH_ATTN_CUTE_DISABLE=pack_gqa
    turns the packed kernel off); None packs it where _pack_helps (short query sequences, varlen) with the plan rule
    plan.pack_gqa_auto=1, else not yet; False: unpacked."""
    assert config.PACK_GROUPS == (2, 4, 8, 16)
    for h, hk, want in [(16, 2, 8), (8, 4, 2), (32, 8, 4), (16, 1, 16), (4, 4, 1), (12, 4, 1), (32, 1, 1),
                        (40, 8, 1)]:
        assert plan._pack_group(True, h, hk) == want, (h, hk)
    assert plan._pack_group(False, 16, 2) == plan._pack_group(False, 16, 2, 1) == 1
    # None: unpacked until the rule is measured; with plan.pack_gqa_auto=1 packed where the packed tiles
    # hold clearly more real rows (decoding, short or ragged lengths; varlen)
    assert plan._pack_group(None, 16, 2, 1) == plan._pack_group(None, 16, 2) == 1
    cute_env(OVERRIDES="plan.pack_gqa_auto=1")
    assert plan._pack_group(True, 16, 2) == 8
    for sq, want in [(None, 8), (1, 8), (5, 8), (100, 8), (300, 8), (1024, 1), (4096, 1), (4000, 1), (129, 8)]:
        assert plan._pack_group(None, 16, 2, sq) == want, sq
    assert plan._pack_group(None, 12, 4, 1) == plan._pack_group(None, 8, 8, 1) == 1
    assert plan._pack_helps(8, 1) and plan._pack_helps(2, 1) and not plan._pack_helps(2, 120)
    assert not plan._pack_helps(16, 0) and not plan._pack_helps(4, 128) and not plan._pack_helps(4, 250)
    cute_env(OVERRIDES=None, DISABLE="pack_gqa")
    assert plan._pack_group(True, 16, 2) == plan._pack_group(None, 16, 2, 1) == 1


def test_disable_wins_over_the_auto_rule(cute_env):
    cute_env(OVERRIDES="plan.pack_gqa_auto=1", DISABLE="pack_gqa")
    assert plan._pack_group(True, 16, 2) == 1
    assert plan._pack_group(None, 16, 2, 1) == 1


def test_pack_config():
    """The packed kernel is the one-tile kernel with the direct O store at every length (no persistent, TMA O,
    short- or long-key kernel), keyed by its group; 2 warpgroups where 3 would give a head rows that do not start
    on an 8-row atom; pack=1 leaves every config as it was."""
    cfg = lambda d, causal, **kw: kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()  # noqa: E731
    for d, causal in [(64, False), (64, True), (128, False), (128, True), (256, True), (96, False)]:
        for kw in (dict(), dict(short=True), dict(long=True), dict(varlen=True), dict(sink=True), dict(local=True)):
            assert cfg(d, causal, pack=1, **kw) == cfg(d, causal, **kw)
            assert "pack_gqa" not in cfg(d, causal, **kw)
            for g in config.PACK_GROUPS:
                packed = cfg(d, causal, pack=g, **kw)
                assert packed["pack_gqa"] == g
                assert not packed.get("persistent") and not packed.get("tma_o")
                kernel = kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", pack=g, **kw))
                assert kernel.pack_gqa == g and kernel.block_q * g == kernel.block_m and kernel.block_q % 8 == 0
                unpacked = {k: v for k, v in cfg(d, causal, **{**kw, "short": False, "long": False}).items()
                            if k not in ("persistent", "tma_o", "reverse", "snake", "lpt", "warpgroups", "block_n",
                                          "stages")}
                assert {k: v for k, v in packed.items() if k in unpacked} == unpacked
    assert cfg(64, False)["warpgroups"] == 3 and cfg(64, False, pack=8)["warpgroups"] == 3  # 24 rows per head
    assert "warpgroups" not in cfg(64, False, pack=16)  # 12 rows per head: 2 warpgroups, 8 rows
    names = {kernels._entry(torch.bfloat16, 128, True, "sm_90a", pack=g)[2] for g in (1, 2, 8)}
    assert len(names) == 3 and any("-pack8-" in n for n in names)


def test_kernel_refuses_what_it_cannot_pack():
    import cutlass

    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    bf16 = cutlass.BFloat16
    for kw, msg in [(dict(pack_gqa=3), "multiple of 8"), (dict(pack_gqa=32), "multiple of 8"),
                    (dict(pack_gqa=0), "multiple of 8"), (dict(pack_gqa=4, persistent=True), "one-tile"),
                    (dict(pack_gqa=4, tma_o=True), "one-tile")]:
        with pytest.raises(ValueError, match=msg):
            FlashFwdSm90(bf16, 128, True, **kw)
    assert FlashFwdSm90(bf16, 64, False, num_warpgroups=3, pack_gqa=8).block_q == 24


def test_pack_gqa_selects_the_packed_kernel_per_call(cute_env, monkeypatch):
    """flash_attn_func / flash_attn_varlen_func with pack_gqa=True run the packed kernel of their group (any key
    length: never the short- or long-key one), and the usual one when the group cannot be packed, pack_gqa is not
    set, or the packed kernel is off."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    calls = []
    table = {}
    for d, causal in [(64, True), (128, False)]:
        for tail in [(), ("short",), ("long",), ("pack", 8), ("pack", 2), ("sink",), ("sink", "pack", 8),
                     (True,), (True, "pack", 8)]:
            key = (torch.bfloat16, d, causal, "sm_90a", False, False) + tail
            table[key] = (lambda *a, key=key: calls.append(key[6:]))
    _swap_kernels(monkeypatch, table)

    def fail(*a, **kw):
        raise AssertionError(f"not in the table: {a} {kw}")

    monkeypatch.setattr(launch, "fwd_kernel", fail)
    mk = lambda s, h, d: torch.randn(1, s, h, d, dtype=torch.bfloat16)  # noqa: E731
    # by default pack_gqa=True packs and None does not (its rule awaits its A/B)
    interface.flash_attn_func(mk(1, 16, 128), mk(500, 2, 128), mk(500, 2, 128), pack_gqa=True)
    assert calls[-1] == ("pack", 8)
    interface.flash_attn_func(mk(1, 16, 128), mk(500, 2, 128), mk(500, 2, 128))
    assert calls[-1] == ("short",)
    cute_env(OVERRIDES="plan.pack_gqa_auto=1")  # None's rule on
    cases = [  # (Sq, Sk, H, Hk, d, causal, kwargs, expected key tail)
        (1, 500, 16, 2, 128, False, dict(pack_gqa=True), ("pack", 8)),
        (3, 9000, 16, 2, 64, True, dict(pack_gqa=True), ("pack", 8)),  # not the long-key kernel
        (3, 9000, 16, 2, 64, True, dict(), ("pack", 8)),  # pack_gqa None: packed for 3 queries
        (1024, 9000, 16, 2, 64, True, dict(), ("long",)),  # and not for 1024
        (1, 500, 16, 2, 128, False, dict(), ("pack", 8)),
        (1, 500, 16, 16, 128, False, dict(), ("short",)),  # no GQA: nothing to pack
        (1, 500, 4, 2, 128, False, dict(pack_gqa=True), ("pack", 2)),
        (1, 500, 12, 4, 128, False, dict(pack_gqa=True), ("short",)),  # 3 per KV head: unpacked
        (1, 500, 16, 2, 128, False, dict(pack_gqa=False), ("short",)),
        (7, 70, 16, 2, 64, True, dict(pack_gqa=True, learnable_sink=torch.zeros(16)), ("sink", "pack", 8)),
    ]
    for sq, sk, h, hk, d, causal, kw, want in cases:
        interface.flash_attn_func(mk(sq, h, d), mk(sk, hk, d), mk(sk, hk, d), causal=causal, **kw)
        assert calls[-1] == want, (sq, sk, h, hk, d, kw, calls[-1])
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for kw, want in [(dict(pack_gqa=True), (True, "pack", 8)), (dict(), (True, "pack", 8)),
                     (dict(pack_gqa=False), (True,))]:
        q, k, v = mk(5, 16, 64)[0], mk(5, 2, 64)[0], mk(5, 2, 64)[0]
        interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, **kw)
        assert calls[-1] == want
    # pack_gqa None by the longest sequence: 1024 queries keep the unpacked kernel, pack_gqa=True packs them
    cu2 = torch.tensor([0, 3, 1027], dtype=torch.int32)
    q, k, v = mk(1027, 16, 64)[0], mk(1027, 2, 64)[0], mk(1027, 2, 64)[0]
    for kw, want in [(dict(), (True,)), (dict(pack_gqa=True), (True, "pack", 8))]:
        interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu2, cu_seqlens_k=cu2, causal=True, **kw)
        assert calls[-1] == want
    cute_env(OVERRIDES=None, DISABLE="pack_gqa")  # (the old single variable: "0" in place of "auto")
    interface.flash_attn_func(mk(1, 16, 128), mk(500, 2, 128), mk(500, 2, 128), pack_gqa=True)
    assert calls[-1] == ("short",)
    interface.flash_attn_func(mk(1, 16, 128), mk(500, 2, 128), mk(500, 2, 128))
    assert calls[-1] == ("short",)


# ----------------------------------------------------------------------------------------------------
# CPU: the packed kernels' PTX (compiled for sm_90a, no GPU)

# (dtype, head dim, causal, options, group): 2 and 3 warpgroups, dense and varlen, a sink, a window, d96's
# 64-byte swizzle
_PTX_CASES = [(torch.bfloat16, 128, True, dict(), 8), (torch.bfloat16, 64, False, dict(), 8),
              (torch.float16, 96, False, dict(varlen=True, sink=True, local=True), 4)]


@pytest.mark.parametrize("case", _PTX_CASES, ids=lambda c: f"d{c[1]}-g{c[4]}-{'-'.join(c[3]) or 'dense'}")
def test_packed_kernel_loads_one_q_box_per_head(tmp_path, case):
    """Q arrives as g TMA boxes per 64-byte / 128-byte swizzle column block (one per query head of the group),
    each written at the shared-memory offset of its head's first row, with one mbarrier for all of them; the
    kernel is ptxas clean."""
    dtype, d, causal, kw, g = case
    cfg = kernels.fwd_config(dtype, d, causal, "sm_90a", pack=g, **kw)
    kernel = kernels._make_kernel(cfg)
    kernels.compile_fwd(dtype, d, causal, dump_dir=str(tmp_path), pack=g, **kw)
    (ptx,) = glob.glob(str(tmp_path / "*.ptx"))
    text = open(ptx).read()
    # (shared address register, its offset, the mbarrier operand) of every TMA load
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[345]d\.shared::cta\.global\S* \[%r(\d+)\+?(\d*)\], "
                       r"\[%rd\d+, \{[^}]*\}\], \[([^]]+)\]", text)
    col = 64 if d % 64 == 0 else 32  # elements per swizzle column block (the TMA box's inner size)
    n_cols = d // col
    q_loads = loads[:g * n_cols]  # the producer issues Q first
    assert len(loads) == g * n_cols + 2 * n_cols  # Q, then one K and one V copy per column block
    assert len({bar for _, _, bar in q_loads}) == 1  # one barrier (Q's) for every box
    assert len({reg for reg, _, _ in q_loads}) == 1  # one base address, constant offsets
    base = min(int(off or 0) for _, off, _ in q_loads)
    offsets = sorted(int(off or 0) - base for _, off, _ in q_loads)
    row_bytes, tile_col_bytes = col * 2, kernel.block_m * col * 2
    want = sorted(c * tile_col_bytes + j * kernel.block_q * row_bytes for j in range(g) for c in range(n_cols))
    assert offsets == want
    assert_ptxas_clean(ptx)


# ----------------------------------------------------------------------------------------------------
# GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The GPU tests' cases, as constants that gpu_kernel_requests() reads too (benchmarks/tools/precompile_gpu_tests.py builds
# their kernels on a CPU first). Every head dim and both dtypes with groups of 8 and 4 (decode-like 1-row and
# 7-row queries, a long one, a single key); groups of 2 and 16 at d128.
_BF16, _FP16 = torch.bfloat16, torch.float16
_SHAPES_ALL = [(2, 1, 1000, 16, 2), (1, 1023, 517, 32, 8), (1, 300, 1, 8, 2)]
_SHAPES_D128 = [(1, 7, 333, 8, 4), (2, 100, 100, 16, 1)]
_GPU_DENSE = ([(dt, d, c, *shape) for dt, d in [(_BF16, 64), (_BF16, 96), (_BF16, 128), (_BF16, 192), (_BF16, 256),
                                                (_FP16, 128)] for c in (False, True) for shape in _SHAPES_ALL]
              + [(_BF16, 128, c, *shape) for c in (False, True) for shape in _SHAPES_D128])
_GPU_OPTIONS = [(False, (64, 16), 0.0, False), (True, (100, -1), 0.0, False), (True, (-1, -1), 20.0, False),
                (True, (-1, -1), 0.0, True), (False, (30, 30), 15.0, True)]  # (causal, window, softcap, sink)
_GPU_OPTION_SHAPES = [(1, 700, 16, 2), (129, 300, 16, 2), (500, 500, 32, 4)]  # (Sq, Sk, H, Hk): groups of 8
_GPU_VARLEN = [(False, (-1, -1), False), (True, (-1, -1), False), (False, (50, 10), True), (True, (-1, -1), True)]


def gpu_kernel_requests():
    """The forward calls' kernel choices of this file's GPU tests, for benchmarks/tools/precompile_gpu_tests.py."""
    out = [dict(dtype=dt, d=d, causal=c, pack=h // hk, seqlen_k=sk) for dt, d, c, _, _, sk, h, hk in _GPU_DENSE]
    out += [dict(dtype=_BF16, d=d, causal=c, window=w, softcap=cap, sink=sink, pack=h // hk, seqlen_k=sk)
            for d in (64, 128) for c, w, cap, sink in _GPU_OPTIONS for _, sk, h, hk in _GPU_OPTION_SHAPES]
    out += [dict(dtype=_BF16, d=d, causal=c, window=w, sink=sink, pack=8, varlen=True)
            for d in (64, 128, 256) for c, w, sink in _GPU_VARLEN]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype,d,causal,batch,seqlen_q,seqlen_k,heads,heads_kv", _GPU_DENSE)
def test_packed_matches_reference_on_gpu(monkeypatch, dtype, d, causal, batch, seqlen_q, seqlen_k, heads,
                                         heads_kv):
    from flash_attn.cute import flash_attn_func

    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, pack_gqa=True, return_lse=True)
    torch.cuda.synchronize()
    g = heads // heads_kv
    assert any(key[-2:] == ("pack", g) for key in kernels._kernels)  # the packed kernel ran
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)
    lse_ref = attention_lse_ref(q, k, causal=causal)
    assert_lse_close(lse, lse_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,softcap,sink", _GPU_OPTIONS)
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,heads_kv", _GPU_OPTION_SHAPES)
def test_packed_options_match_reference_on_gpu(monkeypatch, d, causal, window, softcap, sink, seqlen_q, seqlen_k,
                                               heads, heads_kv):
    from flash_attn.cute import flash_attn_func

    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    torch.manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(2, seqlen_q, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(2, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(2, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    sink_t = torch.randn(heads, device="cuda") if sink else None
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=fa4_window(window), softcap=softcap, learnable_sink=sink_t,
                               pack_gqa=True, return_lse=True)
    torch.cuda.synchronize()
    ref_window = (window[0], 0 if causal else window[1])
    kw = dict(causal=causal, window_size=ref_window, softcap=softcap, learnable_sink=sink_t)
    out_ref, _ = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_to_ref(out, out_ref, out_pt)
    lse_ref = attention_lse_ref(q, k, causal=causal, window_size=ref_window, softcap=softcap,
                                 learnable_sink=sink_t)
    assert_lse_close(lse, lse_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window,sink", _GPU_VARLEN)
@pytest.mark.parametrize("seqused", [False, True])
def test_packed_varlen_matches_reference_per_sequence_on_gpu(monkeypatch, d, causal, window, sink, seqused):
    """Packed sequences (decode-like 1-row ones, empty ones, Sq != Sk, one past a tile) with 8 query heads per KV
    head, each against the reference on its own slice; q rows after the last sequence stay 0 / +inf."""
    from flash_attn.cute import flash_attn_varlen_func

    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    torch.manual_seed(0)
    heads, heads_kv = 16, 2
    lens_q, lens_k, caps = [1, 0, 17, 1, 40, 300], [500, 9, 40, 1, 0, 260], [123, 9, 33, 0, 0, 260]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]) + 3, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), heads_kv, d, device="cuda", dtype=torch.bfloat16)
    used = [min(n, u) for n, u in zip(lens_k, caps)] if seqused else lens_k
    seqused_k = torch.tensor(used, device="cuda", dtype=torch.int32) if seqused else None
    sink_t = torch.randn(heads, device="cuda") if sink else None
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k, causal=causal, window_size=fa4_window(window),
                                      learnable_sink=sink_t, pack_gqa=True, return_lse=True)
    torch.cuda.synchronize()
    assert any(key[-2:] == ("pack", 8) and True in key for key in kernels._kernels)
    ref_window = (window[0], 0 if causal else window[1])
    for b, (sq, sk) in enumerate(zip(lens_q, used)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if sq == 0:
            continue
        qs, ks, vs = q[None, q0:q0 + sq], k[None, k0:k0 + sk], v[None, k0:k0 + sk]
        lse_ref = attention_lse_ref(qs, ks, causal=causal, window_size=ref_window, learnable_sink=sink_t)[0]
        assert_lse_close(lse[:, q0:q0 + sq], lse_ref, name=f"lse of sequence {b}")
        if sk == 0:
            assert torch.all(out[q0:q0 + sq] == 0)
            continue
        kw = dict(causal=causal, window_size=ref_window, learnable_sink=sink_t)
        out_ref, _ = attention_ref(qs, ks, vs, **kw)
        out_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True, **kw)
        assert_close_to_ref(out[None, q0:q0 + sq], out_ref, out_pt, name=f"out of sequence {b}")
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isinf(lse[:, tail:]))
