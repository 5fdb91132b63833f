"""flash_attn.cute forward with the TMA O store (FwdConfig.tma_o, FLASH_ATTN_CUTE_OVERRIDES=fwd.tma_o=1): O goes from registers into
Q's shared-memory buffer (stmatrix) and out with one TMA store per consumer warpgroup. Compiled for sm_90a
without a GPU: the PTX holds the shared -> global bulk tensor store behind an async-proxy fence, ptxas
spills nothing; the config gives it to dense one-tile calls only. On a Hopper GPU (marked gpu) its output
and lse equal the direct store's bit for bit."""
import glob
import os
import re
import shutil
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, kernels, launch, plan, settings  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.cute import interface  # noqa: E402
from flash_attn.cute.kernels import compile_fwd  # noqa: E402
from flash_attn.testing import assert_ptxas_clean  # noqa: E402

_BULK_STORE = re.compile(r"^\s*cp\.async\.bulk\.tensor\.\d+d\.global\.shared::cta\b", re.M)


def _cfg(dtype, d, causal, **kw):
    """The forward config of a call in the old dict form (FwdConfig.key())."""
    return kernels.fwd_config(dtype, d, causal, "sm_90a", **kw).key()


def _with_env(mp, overrides=None):
    """Set FLASH_ATTN_CUTE_OVERRIDES (None: unset) and FLASH_ATTN_CUTE_DISABLE unset on ``mp``, and read them
    again (for module-scoped fixtures, where the cute_env fixture is not available)."""
    mp.delenv(settings.DISABLE, raising=False)
    if overrides:
        mp.setenv(settings.OVERRIDES, overrides)
    else:
        mp.delenv(settings.OVERRIDES, raising=False)
    settings.reload()



# (head dim, causal): d64 without a mask has 3 consumer warpgroups (BLOCK_M 192), the others 2; d64 is
# persistent by default, so these compile with fwd.persistent=0. d256: BLOCK_N 80, 2 stages.
CONFIGS = [(64, False), (64, True), (128, False), (128, True), (256, False), (256, True)]
# the TMA O kernels of the default rules in fp16 (bf16 above; fp16 d128 non-causal is config.TMA_O_SPILLS')
CONFIGS_FP16 = [(128, True), (256, False), (256, True)]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"d{c[0]}-{'causal' if c[1] else 'full'}")
def tma_o_ptx(request, tmp_path_factory):
    d, causal = request.param
    dump = tmp_path_factory.mktemp("ptx_tma_o")
    try:
        with pytest.MonkeyPatch.context() as mp:
            _with_env(mp, "fwd.persistent=0,fwd.tma_o=1")
            cfg = _cfg(torch.bfloat16, d, causal)
            compile_fwd(torch.bfloat16, d, causal, arch="sm_90a", dump_dir=str(dump))
    finally:
        settings.reload()
    (path,) = glob.glob(str(dump / "*.ptx"))
    with open(path) as f:
        return request.param, cfg, f.read(), path


def test_ptx_stores_o_with_tma(tma_o_ptx):
    """stmatrix into shared memory, the async-proxy fence, the warpgroup's own named barrier (128 threads),
    then D / 64 bulk tensor stores (one per 64-column box of the (64, D) tile) and a wait for their reads;
    the Q load stays a global -> shared bulk copy."""
    (d, _), cfg, text, _ = tma_o_ptx
    assert cfg.get("tma_o") is True and "persistent" not in cfg
    stores = _BULK_STORE.findall(text)
    assert len(stores) == d // 64, stores
    assert "fence.proxy.async.shared::cta;" in text
    assert re.search(r"^\s*stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", text, re.M)
    assert re.search(r"^\s*bar\.sync\s+%r\d+, 128;", text, re.M)
    assert "cp.async.bulk.commit_group;" in text and re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", text)
    assert re.search(r"cp\.async\.bulk\.tensor\.\d+d\.shared::cta\.global", text)  # the loads
    # the fence comes before the stores in program order
    assert text.index("fence.proxy.async.shared::cta;") < _BULK_STORE.search(text).start()


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_tma_o_fits_the_registers(tma_o_ptx, tmp_path):
    (d, causal), _, _, path = tma_o_ptx
    assert_ptxas_clean(path)


def _ptxas_report(cute_env, dtype, d, causal, tmp, overrides=None):
    cute_env(OVERRIDES=overrides)
    cfg = _cfg(dtype, d, causal)
    compile_fwd(dtype, d, causal, arch="sm_90a", dump_dir=str(tmp))
    (path,) = glob.glob(str(tmp / "*.ptx"))
    return cfg, path


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("d,causal", CONFIGS_FP16, ids=lambda v: str(v))
def test_default_fp16_tma_o_kernels_fit_the_registers(cute_env, d, causal, tmp_path):
    """The fp16 kernels the default rules give the TMA O store: no spill, no C75xx message."""
    cfg, path = _ptxas_report(cute_env, torch.float16, d, causal, tmp_path)
    assert cfg["tma_o"]
    assert_ptxas_clean(path)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_the_excluded_tma_o_kernel_still_spills(cute_env, tmp_path):
    """config.TMA_O_SPILLS: fp16 d128 non-causal keeps the direct store by default because its TMA O kernel spills
    (forced here with fwd.tma_o=1). When a ptxas no longer spills, this fails: drop the exclusion then."""
    import subprocess

    assert ("fp16", 128, False) in config.TMA_O_SPILLS
    assert "tma_o" not in _cfg(torch.float16, 128, False)
    cfg, path = _ptxas_report(cute_env, torch.float16, 128, False, tmp_path, "fwd.tma_o=1")
    assert cfg["tma_o"] and "persistent" not in cfg
    report = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True,
                            text=True, check=True).stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) > 0, report


def test_tma_o_in_the_config_only_for_dense_one_tile_calls(cute_env):
    """Absent when off (fwd.tma_o=0: the configs, and disk-cache keys, of the direct store); never for varlen; the
    cache key changes only when it is on. Unset: the plain dense one-tile calls of d128 / d256 take it (see
    test_tma_o_rules). With fwd.persistent=1 it is the persistent kernel's own O buffer (two warpgroups only:
    tests/cute/test_cute_persistent_tma_o.py)."""
    from flash_attn.cute import cache
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    cfg = lambda d, causal, **kw: _cfg(torch.bfloat16, d, causal, **kw)  # noqa: E731
    cute_env(OVERRIDES="fwd.tma_o=0")
    base = {(d, c, v): cfg(d, c, varlen=v) for d in (64, 128) for c in (False, True) for v in (False, True)}
    assert not any("tma_o" in b for b in base.values())
    assert not any("tma_o" in cfg(k[0], k[1], varlen=k[2], short=True) for k in base if k != (128, False, False))
    # (d128 non-causal's short-key kernel is the persistent one, whose O buffer config.SHORT_PERSISTENT
    # and fwd.tma_o decide: tests/cute/test_cute_persistent_tma_o.py)
    assert cfg(128, False, short=True)["persistent"]
    cute_env(OVERRIDES=None)
    for (d, causal, varlen), b in base.items():
        want = {**b, "tma_o": True} if d == 128 and not varlen else b  # d64: persistent
        assert cfg(d, causal, varlen=varlen) == want
    assert not kernels._make_kernel(kernels.fwd_config(torch.bfloat16, 64, False)).tma_o
    cute_env(OVERRIDES="fwd.tma_o=1")
    for (d, causal, varlen), b in base.items():
        on = cfg(d, causal, varlen=varlen)
        if varlen or (b.get("persistent") and b.get("warpgroups", 2) != 2):
            assert on == b and cache.entry_key(on) == cache.entry_key(b)
        else:  # (d64 causal: the persistent kernel with two warpgroups takes its own O buffer)
            assert on == {**b, "tma_o": True} and cache.entry_key(on) != cache.entry_key(b)
            assert kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, varlen=varlen)).tma_o
    for kw in (dict(local=True), dict(softcap=True), dict(sink=True)):  # dense one-tile variants take it
        assert cfg(128, False, **kw)["tma_o"] is True
    assert "tma_o" not in cfg(128, True, local=True, varlen=True)
    with pytest.raises(ValueError, match="tma_o"):
        FlashFwdSm90(kernels._cutlass_dtype(torch.bfloat16), 128, False, tma_o=True, varlen=True)
    # the persistent kernel takes it as its own O buffer, with two consumer warpgroups only
    cute_env(OVERRIDES="fwd.persistent=1,fwd.tma_o=1")
    assert cfg(128, False)["persistent"] and cfg(128, False)["tma_o"] is True
    assert cfg(64, False)["persistent"] and cfg(64, False)["warpgroups"] == 3 and "tma_o" not in cfg(64, False)


def test_tma_o_rules(cute_env, monkeypatch):
    """config.TMA_O per head dim ("plain" at d128 / d256, "short" at d64): "plain" gives the TMA O store to every
    plain dense one-tile call (no window, softcap, sink or varlen; not the persistent kernel), "short" only to those
    with seqlen_k <= config.SHORT_SK (their own config), none to a head dim it does not name; fwd.tma_o=0 to none,
    fwd.tma_o=1 to every dense one-tile call. config.short_dims(): the head dims with a short-key kernel ("short",
    and d128 for its CTA order)."""
    cfg = lambda d, causal, **kw: _cfg(torch.bfloat16, d, causal, **kw)  # noqa: E731
    no_lpt = lambda c: {k: v for k, v in c.items() if k != "lpt"}  # noqa: E731
    assert config.TMA_O == {64: "short", 128: "plain", 256: "plain"}
    # unset: the defaults
    assert config.short_dims() == frozenset({64, 128}) == plan._SHORT_DIMS
    for d in (128, 256):
        for causal in (False, True):
            assert cfg(d, causal)["tma_o"] and cfg(d, causal, short=True)["tma_o"]
            for kw in (dict(sink=True), dict(varlen=True), dict(local=True, sink=True), dict(softcap=True, varlen=True)):
                assert "tma_o" not in cfg(d, causal, **kw) and "tma_o" not in cfg(d, causal, short=True, **kw)
    # config.TMA_O_OPTIONS: window calls at every head dim, softcap calls at d128 / d256 (without a sink)
    assert config.TMA_O_OPTIONS == {64: {"local"}, 128: {"local", "softcap"}, 256: {"local", "softcap"}}
    for d in (64, 128, 256):
        for causal in (False, True):
            assert cfg(d, causal, local=True)["tma_o"]
            assert ("tma_o" in cfg(d, causal, softcap=True)) == (d != 64)
            assert ("tma_o" in cfg(d, causal, local=True, softcap=True)) == (d != 64)
    assert "tma_o" not in cfg(128, False, local=True, softcap=True, sink=True)
    monkeypatch.setattr(config, "TMA_O_OPTIONS", {128: frozenset({"softcap"})})
    assert cfg(128, True, softcap=True)["tma_o"] and "tma_o" not in cfg(128, True, local=True)
    assert "tma_o" not in cfg(256, True, softcap=True) and "tma_o" not in cfg(128, True, local=True, softcap=True)
    monkeypatch.undo()
    assert cfg(256, True, short=True) == cfg(256, True) and cfg(256, False, short=True) == cfg(256, False)
    assert cfg(128, False, short=True)["persistent"]  # d128 non-causal's short-key kernel: config.SHORT_PERSISTENT
    assert cfg(128, True, short=True) == no_lpt(cfg(128, True))  # d128's short-key kernel: the former order
    for causal in (False, True):  # d64: persistent, whose kernel has no TMA O
        assert cfg(64, causal)["persistent"] and cfg(64, causal, short=True) == cfg(64, causal)
        assert "tma_o" not in cfg(64, causal)
    # an override of fwd.persistent makes the short-key persistent rule yield: from here the TMA O rules alone
    cute_env(OVERRIDES="fwd.persistent=0")
    assert cfg(128, False, short=True) == cfg(128, False)
    # "short" everywhere (the table's rule): only the short-key kernels
    monkeypatch.setattr(config, "TMA_O", {d: "short" for d in config.SUPPORTED_HEAD_DIMS})
    assert config.short_dims() == frozenset(config.SUPPORTED_HEAD_DIMS)
    for d, causal in [(128, False), (128, True), (256, False), (256, True)]:
        assert "tma_o" not in cfg(d, causal)
        assert cfg(d, causal, short=True) == {**(no_lpt(cfg(d, causal)) if d == 128 else cfg(d, causal)), "tma_o": True}
        for kw in (dict(sink=True), dict(varlen=True)):
            assert "tma_o" not in cfg(d, causal, short=True, **kw)
    # none in the table: short and long calls share one config but for d128's CTA order
    monkeypatch.setattr(config, "TMA_O", {})
    assert config.short_dims() == frozenset({128})
    for d in (64, 128, 256):
        for causal in (False, True):
            assert "tma_o" not in cfg(d, causal) and "tma_o" not in cfg(d, causal, short=True)
    # the CTA order set for every length: no short kernel
    cute_env(OVERRIDES="fwd.persistent=0,fwd.lpt=1")
    assert cfg(128, True, short=True) == cfg(128, True)
    monkeypatch.setattr(config, "LPT_SHORT_OFF", frozenset())
    monkeypatch.setattr(config, "SHORT_PERSISTENT", frozenset())
    assert config.short_dims() == frozenset()
    monkeypatch.undo()
    # per head dim in the table; an unnamed one has none
    cute_env(OVERRIDES="fwd.persistent=0")
    monkeypatch.setattr(config, "TMA_O", {64: "short", 256: "short"})
    assert config.short_dims() == frozenset({64, 128, 256})
    assert "tma_o" not in cfg(128, False) and "tma_o" not in cfg(256, False) and cfg(256, False, short=True)["tma_o"]
    monkeypatch.undo()
    cute_env(OVERRIDES="fwd.tma_o=1")  # every dense one-tile call, options included
    assert cfg(256, False, softcap=True)["tma_o"] and "tma_o" not in cfg(256, False, varlen=True)
    assert cfg(128, False)["tma_o"]


def test_short_keys_select_their_kernel_per_call(cute_env, monkeypatch):
    """flash_attn_func's fast path and forward() pick the "short" in-memory kernel for seqlen_k <=
    config.SHORT_SK when the head dim has the switch (the key ends in "short"), the usual one otherwise;
    fwd_kernel(short=True) shares the usual kernel when the configs are the same."""
    calls = []
    long_fn = lambda q, k, v, out, lse, *a: calls.append("long")  # noqa: E731
    short_fn = lambda q, k, v, out, lse, *a: calls.append("short")  # noqa: E731
    base = (torch.bfloat16, 128, False, "sm_90a", False, False)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    _swap_kernels(monkeypatch, {base: long_fn, base + ("short",): short_fn})
    mk = lambda s: [torch.randn(1, s, 2, 128, dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
    limit = config.SHORT_SK

    def short_dims(dims):  # the per-call paths' copies: flash_attn_func's fast path, launch._forward_plain and
        # plan._length_kernel
        monkeypatch.setattr(interface, "_SHORT_DIMS", dims)
        monkeypatch.setattr(launch, "_SHORT_DIMS", dims)
        monkeypatch.setattr(plan, "_SHORT_DIMS", dims)

    short_dims(frozenset({128}))
    for s, want in [(limit, "short"), (limit + 1, "long"), (64, "short")]:
        q, k, v = mk(s)
        interface.flash_attn_func(q, k, v)
        launch.forward(q, k, v, 0.1, False)
        assert calls[-2:] == [want, want], (s, calls)
    short_dims(frozenset())
    q, k, v = mk(64)
    interface.flash_attn_func(q, k, v)
    launch.forward(q, k, v, 0.1, False)
    assert calls[-2:] == ["long", "long"]
    # a window or softcap never takes the short kernel (forward's key has no "short")
    short_dims(frozenset({128}))
    seen = []
    monkeypatch.setattr(launch, "fwd_kernel", lambda *a, **kw: seen.append(kw) or long_fn)
    launch.forward(q, k, v, 0.1, False, softcap=5.0)
    assert seen and seen[-1]["short"] is False
    # same configs (no TMA O, no persistent kernel): fwd_kernel(short=True) is the usual kernel, built once
    monkeypatch.undo()
    cute_env(OVERRIDES="fwd.tma_o=0,fwd.persistent=0")  # (else d128 non-causal's is persistent)
    built = []
    _swap_kernels(monkeypatch, {})
    monkeypatch.setattr(kernels, "load_or_build", lambda *a, **kw: built.append(kw) or (long_fn, "compiled"))
    assert kernels.fwd_kernel(torch.bfloat16, 128, False, short=True) is long_fn
    assert kernels.fwd_kernel(torch.bfloat16, 128, False) is long_fn
    assert len(built) == 1 and built[0]["short"] is False
    # a short-key TMA O rule: the short-key kernel is its own
    cute_env(OVERRIDES="fwd.persistent=0")
    monkeypatch.setattr(config, "TMA_O", {128: "short"})
    _swap_kernels(monkeypatch, {})
    kernels.fwd_kernel(torch.bfloat16, 128, False, short=True)
    assert built[-1]["short"] is True


def test_precompile_adds_the_short_key_kernels_where_they_differ(cute_env, monkeypatch, tmp_path):
    """precompile also builds the forward of short key lengths where its config differs: by default d128 only
    (causal: its CTA order; non-causal: the persistent kernel; d64 is persistent, d256 takes TMA O at every
    length); with the "short" rule everywhere, the one-tile d256 kernels too; with no TMA O and the CTA order set,
    d128 non-causal's persistent one, and none once that is overridden too."""
    from flash_attn.cute import precompile

    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)
    built = []
    monkeypatch.setattr(precompile, "_build", lambda out, arch, dt, d, c, force, kind: built.append((kind, d, c))
                        or ("compiled", 0.0, None))
    run = lambda: precompile.precompile(str(tmp_path), dtypes=("bf16",), head_dims=(64, 128, 256),  # noqa: E731
                                        log=lambda *a: None)
    for table, overrides, want in [(None, None, [(128, False), (128, True)]),
                                   ({d: "short" for d in config.SUPPORTED_HEAD_DIMS}, None,
                                    [(128, False), (128, True), (256, False), (256, True)]),
                                   (None, "fwd.tma_o=0", [(128, False), (128, True)])]:
        built.clear()
        if table is not None:
            monkeypatch.setattr(config, "TMA_O", table)
        cute_env(OVERRIDES=overrides)
        run()
        assert sorted(k for k in built if k[0] == "fwd") == [("fwd", d, c) for d in (64, 128, 256) for c in (False, True)]
        assert sorted((d, c) for kind, d, c in built if kind == "fwd-short") == want
        monkeypatch.setattr(config, "TMA_O", {64: "short", 128: "plain", 256: "plain"})
    cute_env(OVERRIDES="fwd.tma_o=0,fwd.lpt=1")
    built.clear()
    run()
    assert [k for k in built if k[0] == "fwd-short"] == [("fwd-short", 128, False)]
    cute_env(OVERRIDES="fwd.tma_o=0,fwd.lpt=1,fwd.persistent=0")
    built.clear()
    run()
    assert not [k for k in built if k[0] == "fwd-short"]


def test_short_key_kernel_builds_into_the_disk_cache(cute_env, monkeypatch, tmp_path):
    """precompile's "fwd-short" build (a real compile for sm_90a, no GPU): its disk entry is the tma_o
    config's, another file than the usual kernel's."""
    from flash_attn.cute import precompile

    if not kernels._tvm_ffi():
        pytest.skip("the disk cache holds TVM-FFI functions")
    cute_env(OVERRIDES="fwd.persistent=0")
    monkeypatch.setattr(config, "TMA_O", {**config.TMA_O, 128: "short"})
    how, _, error = precompile._build(str(tmp_path), "sm_90a", "bf16", 128, False, False, "fwd-short")
    assert error is None and how == "compiled"
    short = kernels.disk_entry(torch.bfloat16, 128, False, "sm_90a", str(tmp_path), short=True)
    assert short and not kernels.disk_entry(torch.bfloat16, 128, False, "sm_90a", str(tmp_path))
    cfg, _, name, _ = kernels._entry(torch.bfloat16, 128, False, "sm_90a", short=True)
    assert cfg["tma_o"] and "-tmao-" in name


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _run(cute_env, monkeypatch, tma_o, q, k, v, causal, window=None, softcap=0.0):
    from flash_attn.cute import flash_attn_func

    cute_env(OVERRIDES=f"fwd.persistent=0,fwd.tma_o={1 if tma_o else 0}")
    _swap_kernels(monkeypatch, {})  # the in-memory table does not key on the overrides
    local = window is not None
    assert kernels.fwd_config(q.dtype, q.shape[-1], causal and not local, "sm_90a", local=local,
                              softcap=softcap > 0).tma_o == tma_o
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, softcap=softcap,
                               **({} if window is None else {"window_size": window}))
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [
    (1, 1, 1, 2, 2), (2, 1000, 1000, 4, 2), (1, 1000, 193, 6, 3), (2, 193, 1000, 4, 1), (1, 2048, 2048, 2, 2),
    (1, 64, 300, 4, 4)])
def test_tma_o_matches_the_direct_store_bit_for_bit_on_gpu(cute_env, monkeypatch, d, causal, batch, seqlen_q, seqlen_k,
                                                          heads, heads_kv):
    """The same kernel but for the O store (the one-tile kernel for both: fwd.persistent=0),
    so O and lse must be equal; with Sq not a multiple of 64 a box that TMA did not clip at Sq would
    overwrite the next batch entry's first rows."""
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    out_ref, lse_ref = _run(cute_env, monkeypatch, False, q, k, v, causal)
    out, lse = _run(cute_env, monkeypatch, True, q, k, v, causal)
    assert out.shape == out_ref.shape and torch.equal(out, out_ref)
    assert torch.equal(lse, lse_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,window,softcap", [(True, (100, 0), 0.0), (False, (64, 37), 0.0), (True, None, 30.0),
                                                   (False, None, 30.0), (False, (300, 5), 20.0)])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [(2, 1000, 1000, 4, 2), (1, 193, 1000, 4, 1)])
def test_tma_o_matches_the_direct_store_with_windows_and_softcap_on_gpu(cute_env, monkeypatch, d, causal, window,
                                                                        softcap, batch, seqlen_q, seqlen_k, heads,
                                                                        heads_kv):
    """config.TMA_O_OPTIONS' calls (a window and / or softcap): the TMA O store gives the direct store's O and lse bit
    for bit."""
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    out_ref, lse_ref = _run(cute_env, monkeypatch, False, q, k, v, causal, window, softcap)
    out, lse = _run(cute_env, monkeypatch, True, q, k, v, causal, window, softcap)
    assert out.shape == out_ref.shape and torch.equal(out, out_ref)
    assert torch.equal(lse, lse_ref)
