"""flash_attn.cute's one-tile causal kernel in longest-first order (FlashFwdSm90 lpt, fwd.lpt in FLASH_ATTN_CUTE_OVERRIDES):
the block -> tile map, a model of the hardware's block issue that shows what it buys, the switch and its cache
key, the kernel's PTX for sm_90a (no GPU needed), and on a Hopper GPU (tests marked gpu) bitwise equality with
the kernel in the former order plus the reference checks."""
import glob
import heapq
import itertools
import os
import re
import sys

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, kernels  # noqa: E402
from _cute_table import swap_kernels  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90  # noqa: E402
from flash_attn.cute.tile_scheduler import lpt_block  # noqa: E402



def _clean(cute_env, mp, overrides=None):
    """FLASH_ATTN_CUTE_OVERRIDES as given (None: the defaults), and an empty in-memory kernel table (it does not
    key on the overrides)."""
    cute_env(OVERRIDES=overrides)
    swap_kernels(mp, {})


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("num_m,heads,batches,group", [(1, 1, 1, 1), (3, 5, 2, 4), (7, 4, 3, 5), (16, 8, 8, 16),
                                                       (5, 2, 1, 100), (9, 3, 4, 1)])
def test_lpt_block_runs_every_tile_once(num_m, heads, batches, group):
    grid = itertools.product(range(batches), range(heads), range(num_m))
    tiles = [lpt_block(x, y, z, num_m, heads, batches, group) for z, y, x in grid]
    assert sorted(tiles) == sorted(itertools.product(range(num_m), range(heads), range(batches)))


def _makespan(seqlen, batch, heads, d, block_n, lpt, sms=132, block_m=128):
    """Finish time of the one-tile causal grid over the ideal (total work / SMs, or the longest tile) in a model
    of the hardware: blocks issued in linear order (x fastest), each to the SM that frees first, one CTA per SM
    (its shared memory), a tile costing its key blocks plus one (prologue and epilogue)."""
    num_m = -(-seqlen // block_m)
    group = max(FlashFwdSm90.L2_KV_BYTES // (2 * d * 2) // seqlen, 1)  # tile_scheduler.l2_group, Hk = H
    free = [0] * sms
    total = longest = 0
    for z, y, x in itertools.product(range(batch), range(heads), range(num_m)):
        m = lpt_block(x, y, z, num_m, heads, batch, group)[0] if lpt else num_m - 1 - x
        cost = -(-((m + 1) * block_m) // block_n) + 1
        total, longest = total + cost, max(longest, cost)
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free) / max(total / sms, longest)


# (seqlen, batch, heads, head dim, BLOCK_N): causal cells of the benchmark grid (16k tokens, hidden 2048)
@pytest.mark.parametrize("seqlen,batch,heads,d,block_n", [(1024, 16, 16, 128, 128), (4096, 4, 16, 128, 128),
                                                          (1024, 16, 8, 256, 80), (2048, 8, 8, 256, 80),
                                                          (8192, 2, 8, 256, 80)])
def test_lpt_order_balances_the_one_tile_grid(seqlen, batch, heads, d, block_n):
    """In the model, longest first over all heads finishes within 2.5% of the ideal; longest first within each
    head (the order before) leaves the SMs that drew the last heads' long tiles running 6-14% past it (ncu on
    the H200 agreed: SM active cycles max / mean 1.07 at d128 1k, 1.12 at d256 2k)."""
    assert _makespan(seqlen, batch, heads, d, block_n, True) <= 1.025
    assert _makespan(seqlen, batch, heads, d, block_n, False) >= 1.06


def test_lpt_in_the_cache_key_only_when_on(cute_env, monkeypatch):
    """Unset: on for dense causal calls of the one-tile kernel (not varlen, windowed or persistent, not
    without a mask); fwd.lpt=0 off; {"lpt": True} in the key exactly when the kernel is built with it."""
    _clean(cute_env, monkeypatch)
    cfg = lambda d, causal, **kw: kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()  # noqa: E731
    make = lambda d, causal, **kw: kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, **kw))  # noqa: E731
    for d in (96, 128, 192, 256):
        c = cfg(d, True)
        assert c["lpt"] is True and make(d, True).lpt
        assert cfg(d, True, softcap=True)["lpt"] and cfg(d, True, sink=True)["lpt"]
        # the short-key kernel of the head dims of config.LPT_SHORT_OFF (d128) keeps the former order
        assert cfg(d, True, short=True).get("lpt") is (None if d in config.LPT_SHORT_OFF else True)
        for causal, kw in ((False, {}), (True, dict(varlen=True)), (True, dict(local=True)), (False, dict(local=True))):
            assert "lpt" not in cfg(d, causal, **kw) and not make(d, causal, **kw).lpt
    assert config.LPT_SHORT_OFF == {128} and 128 in config.short_dims()
    assert cfg(256, True, short=True) == cfg(256, True)  # no short-key kernel of its own at d256
    assert cfg(64, True).get("persistent") and "lpt" not in cfg(64, True)  # d64 causal: the persistent kernel
    cute_env(OVERRIDES="fwd.persistent=0")
    assert cfg(64, True)["lpt"]
    cute_env(OVERRIDES="fwd.persistent=0,fwd.lpt=0")
    c = cfg(128, True)
    assert "lpt" not in c and not make(128, True).lpt and "lpt" not in cfg(256, True)
    assert "lpt" not in cfg(64, True)


def _ptx(d, cute_env, monkeypatch, lpt):
    import tempfile

    _clean(cute_env, monkeypatch, f"fwd.lpt={1 if lpt else 0}")
    with tempfile.TemporaryDirectory() as tmp:
        kernels.compile_fwd(torch.bfloat16, d, True, dump_dir=tmp)
        (path,) = glob.glob(os.path.join(tmp, "*.ptx"))
        return open(path).read()


@pytest.mark.parametrize("d", [128, 256])
def test_lpt_ptx_reads_the_whole_grid(cute_env, monkeypatch, d):
    """The lpt kernel maps its block through the grid's y and z extents (heads, batch); the former order reads
    only x's."""
    on, off = _ptx(d, cute_env, monkeypatch, True), _ptx(d, cute_env, monkeypatch, False)
    for ptx, want in ((on, True), (off, False)):
        assert "%nctaid.x" in ptx
        assert ("%nctaid.y" in ptx and "%nctaid.z" in ptx) == want
        assert len(re.findall(r"wgmma\.mma_async", ptx)) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [128, 256])
def test_lpt_equals_former_order_on_gpu(cute_env, monkeypatch, d):
    """Each tile runs the same code on the same blocks whatever CTA runs it: out and lse bitwise equal to the
    kernel in the former order, over many waves (GQA, Sq != Sk, several batches)."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    q = torch.randn(3, 3001, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 3300, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, 3300, 2, d, device="cuda", dtype=torch.bfloat16)
    _clean(cute_env, monkeypatch, "fwd.lpt=0")
    ref_out, ref_lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    _clean(cute_env, monkeypatch)
    assert kernels.fwd_config(torch.bfloat16, d, True, "sm_90a").lpt
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lpt_matches_reference_on_gpu(cute_env, monkeypatch, d, dtype):
    """The reference checks of the one-tile kernel's tests with the lpt order (the default), over shapes with
    one tile, odd lengths, GQA / MQA, Sq != Sk both ways and many waves."""
    from test_cute_compile import test_matches_reference_on_gpu

    _clean(cute_env, monkeypatch)
    assert kernels.fwd_config(dtype, d, True, "sm_90a").lpt
    for shape in [(1, 1, 1, 2, 2), (2, 113, 203, 6, 2), (1, 1023, 1023, 4, 1), (2, 256, 77, 2, 2),
                  (3, 17, 2049, 5, 1), (2, 4097, 4097, 16, 4), (1, 2000, 333, 12, 3), (9, 640, 640, 8, 8)]:
        test_matches_reference_on_gpu(dtype, d, True, *shape)
