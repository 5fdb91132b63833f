"""flash_attn.cute's persistent forward with the TMA O store (FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=1,fwd.tma_o=1:
FlashFwdSm90 persistent + tma_o): its config (an O buffer of its own, fewer K / V stages where needed), the kernel's PTX for
sm_90a (no GPU: the bulk store, the wait for its reads before the buffer is written again, the wait for the last
store at the end; ptxas spills nothing), and on a Hopper GPU (tests marked gpu) out and lse bitwise equal to the
persistent kernel's direct store. It is the default short-key kernel (seqlen_k <= config.SHORT_SK) of the
(head dim, causal) pairs of config.SHORT_PERSISTENT (d128 non-causal)."""
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

from flash_attn.cute import config, interface, kernels, launch, plan, settings  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90  # noqa: E402
from flash_attn.testing import assert_ptxas_clean  # noqa: E402

_BULK_STORE = re.compile(r"^\s*cp\.async\.bulk\.tensor\.\d+d\.global\.shared::cta\b", re.M)
# the persistent kernel with its own O buffer
_ON = "fwd.persistent=1,fwd.tma_o=1"



def _cfg(dtype, d, causal, **kw):
    return kernels.fwd_config(dtype, d, causal, "sm_90a", **kw).key()


def test_config(cute_env):
    """Off unless asked; on, every persistent kernel with two consumer warpgroups gets "tma_o" and keeps the
    stages that fit beside its O buffer (d128: 2 of 3; d64: its 4); three warpgroups (d64 non-causal's default:
    ptxas spills there), one-tile and varlen configs stay as they are."""
    cfg = lambda d, causal, **kw: _cfg(torch.bfloat16, d, causal, **kw)  # noqa: E731
    off = {(d, c): cfg(d, c) for d in (64, 128) for c in (False, True)}
    assert "tma_o" not in off[(64, True)] and off[(64, True)]["persistent"]
    cute_env(OVERRIDES="fwd.tma_o=1")  # the persistent kernels of the defaults
    assert cfg(64, True) == {**off[(64, True)], "tma_o": True}  # d64: persistent by default
    assert cfg(64, False) == off[(64, False)] and off[(64, False)]["warpgroups"] == 3
    assert cfg(128, True) == off[(128, True)]  # one-tile: the TMA O rules decide (bf16 d128 has it)
    assert "tma_o" not in cfg(64, True, varlen=True)
    cute_env(OVERRIDES=_ON + ",fwd.warpgroups=2")
    for d, causal, stages in [(64, True, 4), (64, False, 4), (128, True, 2), (128, False, 2)]:
        c = kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a")
        assert c.persistent and c.tma_o and c.stages == stages, c
        k = kernels._make_kernel(c)
        assert k.persistent and k.tma_o and k.smem_bytes() <= FlashFwdSm90.SMEM_BYTES
    cute_env(OVERRIDES=_ON + ",fwd.stages=3")  # set explicitly: kept, and the kernel says it won't fit
    with pytest.raises(ValueError, match="shared memory"):
        kernels._make_kernel(kernels.fwd_config(torch.bfloat16, 128, True, "sm_90a"))


def test_smem_bytes_counts_the_o_buffer():
    assert config.SMEM_BYTES == FlashFwdSm90.SMEM_BYTES  # the config's copy of the kernel's limit
    args = (kernels._cutlass_dtype(torch.bfloat16), 128, True)
    base = FlashFwdSm90(*args, persistent=True, num_stages=2).smem_bytes()
    assert FlashFwdSm90(*args, persistent=True, num_stages=2, tma_o=True).smem_bytes() == base + 128 * 128 * 2
    assert FlashFwdSm90(*args, num_stages=2, tma_o=True).smem_bytes() == base  # one-tile: O reuses Q's buffer
    with pytest.raises(ValueError, match="varlen"):
        FlashFwdSm90(*args, varlen=True, tma_o=True)


def test_short_key_default(cute_env, monkeypatch):
    """The short-key kernel of d128 non-causal (both dtypes: fp16's one-tile TMA O kernel spills, this one does
    not) is the persistent kernel with its O buffer; causal, other head dims, long keys and calls with a window,
    softcap, varlen or a sink keep their kernels. An override of fwd.persistent or fwd.warpgroups: the former
    short-key kernel (the length rules yield)."""
    cfg = lambda dt, d, causal, **kw: _cfg(dt, d, causal, **kw)  # noqa: E731
    assert config.SHORT_PERSISTENT == {(128, False)} and 128 in config.short_dims()
    for dt in (torch.bfloat16, torch.float16):
        short = cfg(dt, 128, False, short=True)
        assert short["persistent"] and short["tma_o"] and short["stages"] == 2 and "warpgroups" not in short
        usual = cfg(dt, 128, False)
        assert "persistent" not in usual and usual["stages"] == 3
        assert "persistent" not in cfg(dt, 128, True, short=True)
        for kw in (dict(local=True), dict(softcap=True), dict(varlen=True), dict(sink=True)):
            assert cfg(dt, 128, False, short=True, **kw) == cfg(dt, 128, False, **kw)
        for overrides in ("fwd.persistent=0", "fwd.warpgroups=2"):
            cute_env(OVERRIDES=overrides)
            assert "persistent" not in cfg(dt, 128, False, short=True), overrides
            cute_env(OVERRIDES=None)
        assert cfg(dt, 128, False, short=True) == short
    monkeypatch.setattr(config, "LPT_SHORT_OFF", frozenset())  # the lpt rule no longer asks for d128's short kernel
    assert 128 in config.short_dims()  # ... this one still does
    monkeypatch.setattr(config, "SHORT_PERSISTENT", frozenset())
    assert 128 not in config.short_dims()


def test_short_keys_select_the_persistent_kernel_per_call(monkeypatch):
    """flash_attn_func's fast path and forward() run d128 non-causal calls with seqlen_k <= config.SHORT_SK on the
    "short" in-memory kernel, which fwd_kernel builds from the persistent config (with the launcher that adds the
    SM count)."""
    calls = []
    fns = {tag: (lambda q, k, v, out, lse, *a, tag=tag: calls.append(tag)) for tag in ("usual", "short")}
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    base = (torch.bfloat16, 128, False, "sm_90a", False, False)
    _swap_kernels(monkeypatch, {base: fns["usual"], base + ("short",): fns["short"]})
    limit = config.SHORT_SK
    for s, want in [(limit, "short"), (1, "short"), (limit + 1, "usual")]:
        q, k, v = (torch.randn(1, s, 1, 128, dtype=torch.bfloat16) for _ in range(3))
        interface.flash_attn_func(q, k, v)
        launch.forward(q, k, v, 0.1, False)
        assert calls[-2:] == [want, want], (s, calls)
    built = []
    _swap_kernels(monkeypatch, {})
    monkeypatch.setattr(kernels, "load_or_build", lambda *a, **kw: built.append(kw) or (fns["usual"], "compiled"))
    fn = kernels.fwd_kernel(torch.bfloat16, 128, False, short=True)
    assert built[-1]["short"] is True and fn is not fns["usual"]  # wrapped: the persistent launcher


# (head dim, causal, consumer warpgroups, dtype, config): "on" the overrides above, "short" the default short-key
# kernel
CONFIGS = [(64, True, 2, torch.bfloat16, "on"), (64, False, 2, torch.bfloat16, "on"),
           (128, True, 2, torch.bfloat16, "on"), (128, False, 2, torch.bfloat16, "short"),
           (128, False, 2, torch.float16, "short")]


@pytest.fixture(scope="module", params=CONFIGS,
                ids=lambda c: f"d{c[0]}-{'causal' if c[1] else 'full'}-wg{c[2]}-{str(c[3])[6:]}-{c[4]}")
def ptx(request, tmp_path_factory):
    d, causal, wg, dtype, how = request.param
    dump = tmp_path_factory.mktemp("ptx_ptma")
    try:
        with pytest.MonkeyPatch.context() as mp:
            short = how == "short"
            mp.delenv(settings.DISABLE, raising=False)
            if short:
                mp.delenv(settings.OVERRIDES, raising=False)
            else:
                mp.setenv(settings.OVERRIDES, f"{_ON},fwd.warpgroups={wg}")
            settings.reload()
            cfg = _cfg(dtype, d, causal, short=short)
            assert cfg["persistent"] and cfg["tma_o"] and cfg.get("warpgroups", 2) == wg
            kernels.compile_fwd(dtype, d, causal, dump_dir=str(dump), short=short)
    finally:
        settings.reload()
    (path,) = glob.glob(str(dump / "*.ptx"))
    with open(path) as f:
        return request.param, f.read(), path


def test_ptx_stores_o_with_tma_and_waits_before_reuse(ptx):
    """One bulk tensor store per warpgroup and tile; before each epilogue's stmatrix the wait for the previous
    store's reads; after the tile loop the wait for the last store; the kernel's other instructions as ever."""
    _, text, _ = ptx
    assert _BULK_STORE.search(text)
    lines = text.splitlines()
    stm = [i for i, line in enumerate(lines) if "stmatrix" in line]
    read_waits = [i for i, line in enumerate(lines) if re.search(r"cp\.async\.bulk\.wait_group\.read\s+0", line)]
    full_waits = [i for i, line in enumerate(lines) if re.search(r"cp\.async\.bulk\.wait_group\s+0", line)]
    assert stm and read_waits and full_waits
    assert min(read_waits) < min(stm)  # the buffer is free before it is written
    store = next(i for i, line in enumerate(lines) if _BULK_STORE.match(line))
    assert not any(store < i < store + 40 for i in read_waits)  # not waited for right after the store
    assert max(full_waits) > store
    assert "wgmma.mma_async" in text and "setmaxnreg" in text
    assert re.search(r"cp\.async\.bulk\.tensor\.\d+d\.shared::\w+\.global", text)  # the loads


def test_ptxas_spills_nothing(ptx):
    _, _, path = ptx
    assert_ptxas_clean(path)


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_equals_the_direct_store_on_gpu(cute_env, monkeypatch, d, causal):
    """Same tiles, same code but the O store (d128: 2 K / V stages, which change no product): out and lse
    bitwise equal to the persistent kernel's direct store, over many tiles per CTA, GQA, Sq != Sk and rows past
    Sq in a tile (a store not clipped at Sq would overwrite the next head's rows)."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    for b, sq, sk, h, hk in [(2, 3001, 2500, 8, 2), (1, 1, 1, 2, 2), (3, 777, 777, 16, 16), (1, 200, 4097, 4, 1)]:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        cute_env(OVERRIDES="fwd.persistent=1,fwd.tma_o=0,fwd.warpgroups=2")
        _swap_kernels(monkeypatch, {})  # the in-memory table does not key on the overrides
        assert not kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a").tma_o
        ref_out, ref_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        cute_env(OVERRIDES=_ON + ",fwd.warpgroups=2")
        _swap_kernels(monkeypatch, {})
        assert kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a").tma_o
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out), (b, sq, sk, h, hk)
        assert torch.equal(lse, ref_lse), (b, sq, sk, h, hk)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_key_default_matches_reference_on_gpu(monkeypatch, dtype):
    """d128 non-causal with seqlen_k <= _TMA_O_SHORT_SK through the default short-key kernel (persistent, TMA O):
    odd lengths, Sq != Sk both ways, GQA, more tiles than SMs."""
    from test_cute_compile import test_matches_reference_on_gpu

    _swap_kernels(monkeypatch, {})
    limit = config.SHORT_SK
    for shape in [(1, 1, 1, 2, 2), (2, 1000, limit, 8, 2), (3, 777, 777, 16, 16), (1, 3000, 200, 4, 1),
                  (16, limit, limit, 16, 16)]:
        test_matches_reference_on_gpu(dtype, 128, False, *shape)
    assert kernels.fwd_config(dtype, 128, False, "sm_90a", short=True).persistent
    assert (dtype, 128, False, "sm_90a", False, False, "short") in kernels._kernels
