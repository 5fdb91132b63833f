"""flash_attn.cute's long-key forward kernel (interface._FWD_LONG: plain dense d64 causal calls with seqlen_k >=
_FWD_LONG_SK run the one-tile kernel with 3 consumer warpgroups instead of the persistent one): its config, the
per-call choice, precompile, and on a Hopper GPU (tests marked gpu) the reference checks."""
import os
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import interface  # noqa: E402

_KNOBS = ("FLASH_ATTN_CUTE_FWD_LONG", "FLASH_ATTN_CUTE_FWD_PERSISTENT", "FLASH_ATTN_CUTE_FWD_WARPGROUPS",
          "FLASH_ATTN_CUTE_FWD_TMA_O", "FLASH_ATTN_CUTE_BLOCK_N", "FLASH_ATTN_CUTE_STAGES", "FLASH_ATTN_CUTE_FWD_LPT")


def _clear(mp):
    for var in _KNOBS:
        mp.delenv(var, raising=False)


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_long_config(monkeypatch):
    """d64 causal, long: the one-tile kernel (lpt order) with 3 warpgroups; everything else, and d64 causal
    with a window, softcap, varlen or a sink, the usual config. FLASH_ATTN_CUTE_FWD_LONG=0 (or "64:0"), or the
    persistent / warpgroup variables set: the usual config too."""
    _clear(monkeypatch)
    cfg = lambda d, causal, **kw: interface._fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw)  # noqa: E731
    usual, long = cfg(64, True), cfg(64, True, long=True)
    assert usual["persistent"] and "warpgroups" not in usual
    assert long["warpgroups"] == interface._FWD_LONG[(64, True)] == 3
    assert "persistent" not in long and long["lpt"] and "reverse" not in long
    kernel = interface._make_kernel(long)
    assert kernel.num_mma_warpgroups == 3 and kernel.block_m == 192 and not kernel.persistent and kernel.lpt
    for d, causal in [(64, False), (128, True), (128, False), (256, True)]:
        assert cfg(d, causal, long=True) == cfg(d, causal)
    for kw in (dict(local=True), dict(softcap=True), dict(varlen=True), dict(sink=True)):
        assert cfg(64, True, long=True, **kw) == cfg(64, True, **kw)
    for var, value in [("FLASH_ATTN_CUTE_FWD_LONG", "0"), ("FLASH_ATTN_CUTE_FWD_LONG", "64:0"),
                       ("FLASH_ATTN_CUTE_FWD_PERSISTENT", "1"), ("FLASH_ATTN_CUTE_FWD_WARPGROUPS", "64:2")]:
        monkeypatch.setenv(var, value)
        assert cfg(64, True, long=True) == cfg(64, True)
        monkeypatch.delenv(var)
    monkeypatch.setenv("FLASH_ATTN_CUTE_FWD_LONG", "128:0")  # another head dim's entry: d64 keeps the rule
    assert cfg(64, True, long=True) == long


def test_long_keys_select_their_kernel_per_call(monkeypatch):
    """flash_attn_func's fast path and forward() take the "long" in-memory kernel for seqlen_k >= _FWD_LONG_SK at
    (64, causal) only; a softcap call never does; fwd_kernel(long=True) is the usual kernel where the configs
    agree (built once)."""
    _clear(monkeypatch)
    calls = []
    fns = {tag: (lambda q, k, v, out, lse, *a, tag=tag: calls.append(tag)) for tag in ("usual", "long", "short")}
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    table = {}
    for d in (64, 128):
        for causal in (False, True):
            base = (torch.bfloat16, d, causal, "sm_90a", False, False)
            table.update({base: fns["usual"], base + ("long",): fns["long"], base + ("short",): fns["short"]})
    monkeypatch.setattr(interface, "_kernels", table)
    limit = interface._FWD_LONG_SK
    mk = lambda s, d: [torch.randn(1, s, 1, d, dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
    for s, d, causal, want in [(limit, 64, True, "long"), (limit + 77, 64, True, "long"), (limit - 1, 64, True, "usual"),
                               (limit, 64, False, "usual"), (limit, 128, True, "usual")]:
        q, k, v = mk(s, d)
        interface.flash_attn_func(q, k, v, causal=causal)
        interface.forward(q, k, v, 0.1, causal)
        assert calls[-2:] == [want, want], (s, d, causal, calls)
    q, k, v = mk(limit, 64)
    seen = []
    monkeypatch.setattr(interface, "fwd_kernel", lambda *a, **kw: seen.append(kw) or fns["usual"])
    interface.forward(q, k, v, 0.1, True, softcap=5.0)
    assert seen and seen[-1]["long"] is False
    monkeypatch.undo()
    _clear(monkeypatch)
    built = []
    monkeypatch.setattr(interface, "_kernels", {})
    monkeypatch.setattr(interface, "load_or_build", lambda *a, **kw: built.append(kw) or (fns["usual"], "compiled"))
    assert interface.fwd_kernel(torch.bfloat16, 128, True, long=True) is fns["usual"]
    assert interface.fwd_kernel(torch.bfloat16, 128, True) is fns["usual"]
    assert len(built) == 1 and built[0]["long"] is False
    interface.fwd_kernel(torch.bfloat16, 64, True, long=True)
    assert built[-1]["long"] is True


def test_precompile_adds_the_long_key_kernel(monkeypatch, tmp_path):
    from flash_attn.cute import precompile

    _clear(monkeypatch)
    monkeypatch.setattr(interface, "_tvm_ffi", lambda: True)
    built = []
    monkeypatch.setattr(precompile, "_build", lambda out, arch, dt, d, c, force, kind: built.append((kind, d, c))
                        or ("compiled", 0.0, None))
    precompile.precompile(str(tmp_path), dtypes=("bf16",), head_dims=(64, 128, 256), log=lambda *a: None)
    assert [k for k in built if k[0] == "fwd-long"] == [("fwd-long", 64, True)]
    built.clear()
    monkeypatch.setenv("FLASH_ATTN_CUTE_FWD_LONG", "0")
    precompile.precompile(str(tmp_path), dtypes=("bf16",), head_dims=(64, 128), log=lambda *a: None)
    assert not [k for k in built if k[0] == "fwd-long"]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_kernel_matches_reference_on_gpu(monkeypatch, dtype):
    """Key lengths at and above _FWD_LONG_SK (odd ones, Sq != Sk both ways, GQA) through the long-key kernel."""
    from test_cute_compile import test_matches_reference_on_gpu

    _clear(monkeypatch)
    monkeypatch.setattr(interface, "_kernels", {})
    limit = interface._FWD_LONG_SK
    for shape in [(1, limit, limit, 2, 2), (2, limit + 131, limit + 131, 2, 1), (1, 300, limit + 5, 4, 2),
                  (1, limit + 700, limit, 2, 2)]:
        test_matches_reference_on_gpu(dtype, 64, True, *shape)
    assert (dtype, 64, True, "sm_90a", False, False, "long") in interface._kernels
