"""flash_attn.cute's forward with O rescaled at the end of each key block (FlashFwdSm90 rescale_end,
FLASH_ATTN_CUTE_FWD_RESCALE_END): the switch and its cache key, the kernel's PTX for sm_90a (no GPU needed: no
multiply between the S = Q K^T and the P V WGMMAs), and on a Hopper GPU (tests marked gpu) bitwise equality with
the former place of the rescale."""
import glob
import os
import re
import sys
import tempfile

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import interface  # noqa: E402

_KNOBS = ("FLASH_ATTN_CUTE_FWD_RESCALE_END", "FLASH_ATTN_CUTE_FWD_PERSISTENT", "FLASH_ATTN_CUTE_FWD_WARPGROUPS",
          "FLASH_ATTN_CUTE_BLOCK_N", "FLASH_ATTN_CUTE_STAGES")


def _clean(mp):
    for var in _KNOBS:
        mp.delenv(var, raising=False)
    mp.setattr(interface, "_kernels", {})  # the in-memory table does not key on the variables


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _set(mp, value):
    mp.delenv("FLASH_ATTN_CUTE_FWD_RESCALE_END", raising=False)
    if value is not None:
        mp.setenv("FLASH_ATTN_CUTE_FWD_RESCALE_END", value)
    mp.setattr(interface, "_kernels", {})


def test_rescale_end_in_the_cache_key_only_when_on(monkeypatch):
    _clean(monkeypatch)
    cfg = lambda d, causal=False, **kw: interface._fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw)  # noqa: E731
    _set(monkeypatch, "1")
    on = cfg(128, True)
    assert on["rescale_end"] is True and interface._make_kernel(on).rescale_end
    assert cfg(64, True, varlen=True)["rescale_end"] and cfg(256, softcap=True)["rescale_end"]
    _set(monkeypatch, "0")
    off = cfg(128, True)
    assert "rescale_end" not in off and not interface._make_kernel(off).rescale_end
    assert off == {k: v for k, v in on.items() if k != "rescale_end"}
    _set(monkeypatch, "256:1")
    assert "rescale_end" not in cfg(128) and cfg(256)["rescale_end"]


def _mul_gaps(ptx):
    """(kind before, kind after, f32 multiplies between) for each pair of consecutive WGMMAs of the PTX; kind "pv"
    for a WGMMA with P in registers (two register lists), "qk" for one with both operands in shared memory."""
    lines = ptx.splitlines()
    idx = [i for i, line in enumerate(lines) if "wgmma.mma_async" in line]
    kind = lambda i: "pv" if lines[i].count("{") >= 2 else "qk"  # noqa: E731
    return [(kind(a), kind(b), sum(1 for line in lines[a:b] if re.search(r"\bmul(\.rn)?(\.ftz)?\.f32", line)))
            for a, b in zip(idx, idx[1:])]


@pytest.mark.parametrize("d,causal", [(64, False), (128, True), (256, False), (256, True)])
def test_ptx_has_no_rescale_between_the_gemms(monkeypatch, d, causal):
    """The former kernel multiplies O's D / 2 values per thread between its S and P V WGMMAs (what ptxas then
    interleaves with the S WGMMAs' issue); with rescale_end there is no multiply there at all."""
    _clean(monkeypatch)
    found = {}
    for value in ("0", "1"):
        _set(monkeypatch, value)
        with tempfile.TemporaryDirectory() as tmp:
            interface.compile_fwd(torch.bfloat16, d, causal, dump_dir=tmp)
            (path,) = glob.glob(os.path.join(tmp, "*.ptx"))
            found[value] = [n for a, b, n in _mul_gaps(open(path).read()) if (a, b) == ("qk", "pv")]
    assert d // 2 in found["0"]
    assert found["1"] and not any(found["1"])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extra", ["dense", "softcap+window", "persistent"])
def test_rescale_end_equals_former_on_gpu(monkeypatch, d, causal, extra):
    """The same multiplies of O by the same factors, between the same P V products: out and lse bitwise equal
    to the kernel with the rescale between the GEMMs (GQA, Sq != Sk, odd lengths, many key blocks)."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    q = torch.randn(2, 1531, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 1777, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 1777, 2, d, device="cuda", dtype=torch.bfloat16)
    kw = dict(causal=causal, return_lse=True)
    if extra == "softcap+window":
        kw.update(softcap=15.0, window_size=(300, None if causal else 200))
    _clean(monkeypatch)
    if extra == "persistent":
        monkeypatch.setenv("FLASH_ATTN_CUTE_FWD_PERSISTENT", "1")
    results = []
    for value in ("0", "1"):
        _set(monkeypatch, value)
        results.append(flash_attn_func(q, k, v, **kw))
        cfg = interface._fwd_config(torch.bfloat16, d, causal, "sm_90a", local="window_size" in kw,
                                    softcap="softcap" in kw)
        assert cfg.get("rescale_end", False) == (value == "1")
        if extra == "persistent":
            assert cfg["persistent"]
    torch.cuda.synchronize()
    (out0, lse0), (out1, lse1) = results
    assert torch.equal(out0, out1)
    assert torch.equal(lse0, lse1)
