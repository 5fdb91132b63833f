"""flash_attn.cute's long-key forward kernel (config.LONG: plain dense d64 causal calls with seqlen_k >=
config.LONG_SK run the one-tile kernel with 3 consumer warpgroups instead of the persistent one): its config, the
per-call choice, precompile, and on a Hopper GPU (tests marked gpu) the reference checks."""
import os
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, interface, kernels, launch  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402



def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def test_long_config(cute_env, monkeypatch):
    """d64 causal, long: the one-tile kernel (lpt order) with 3 warpgroups; everything else, and d64 causal
    with a window, softcap, varlen or a sink, the usual config. An override of fwd.persistent or fwd.warpgroups
    (the length rules yield), or no entry in config.LONG: the usual config too."""
    cfg = lambda d, causal, **kw: kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()  # noqa: E731
    usual, long = cfg(64, True), cfg(64, True, long=True)
    assert usual["persistent"] and "warpgroups" not in usual
    assert long["warpgroups"] == config.LONG[(64, True)] == 3
    assert "persistent" not in long and long["lpt"] and "reverse" not in long
    kernel = kernels._make_kernel(kernels.fwd_config(torch.bfloat16, 64, True, "sm_90a", long=True))
    assert kernel.num_mma_warpgroups == 3 and kernel.block_m == 192 and not kernel.persistent and kernel.lpt
    for d, causal in [(64, False), (128, True), (128, False), (256, True)]:
        assert cfg(d, causal, long=True) == cfg(d, causal)
    for kw in (dict(local=True), dict(softcap=True), dict(varlen=True), dict(sink=True)):
        assert cfg(64, True, long=True, **kw) == cfg(64, True, **kw)
    for overrides in ("fwd.persistent=1", "fwd.warpgroups=2"):
        cute_env(OVERRIDES=overrides)
        assert cfg(64, True, long=True) == cfg(64, True), overrides
    cute_env(OVERRIDES=None)
    assert cfg(64, True, long=True) == long
    monkeypatch.setattr(config, "LONG", {(128, True): 3})  # another pair's entry only: d64 has no long-key kernel
    assert cfg(64, True, long=True) == usual


def test_long_keys_select_their_kernel_per_call(monkeypatch):
    """flash_attn_func's fast path and forward() take the "long" in-memory kernel for seqlen_k >= config.LONG_SK at
    (64, causal) only; a softcap call never does; fwd_kernel(long=True) is the usual kernel where the configs
    agree (built once)."""
    calls = []
    fns = {tag: (lambda q, k, v, out, lse, *a, tag=tag: calls.append(tag)) for tag in ("usual", "long", "short")}
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    table = {}
    for d in (64, 128):
        for causal in (False, True):
            base = (torch.bfloat16, d, causal, "sm_90a", False, False)
            table.update({base: fns["usual"], base + ("long",): fns["long"], base + ("short",): fns["short"]})
    _swap_kernels(monkeypatch, table)
    limit = config.LONG_SK
    mk = lambda s, d: [torch.randn(1, s, 1, d, dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
    for s, d, causal, want in [(limit, 64, True, "long"), (limit + 77, 64, True, "long"), (limit - 1, 64, True, "usual"),
                               (limit, 64, False, "usual"), (limit, 128, True, "usual")]:
        q, k, v = mk(s, d)
        interface.flash_attn_func(q, k, v, causal=causal)
        launch.forward(q, k, v, 0.1, causal)
        assert calls[-2:] == [want, want], (s, d, causal, calls)
    q, k, v = mk(limit, 64)
    seen = []
    monkeypatch.setattr(launch, "fwd_kernel", lambda *a, **kw: seen.append(kw) or fns["usual"])
    launch.forward(q, k, v, 0.1, True, softcap=5.0)
    assert seen and seen[-1]["long"] is False
    monkeypatch.undo()
    built = []
    _swap_kernels(monkeypatch, {})
    monkeypatch.setattr(kernels, "load_or_build", lambda *a, **kw: built.append(kw) or (fns["usual"], "compiled"))
    assert kernels.fwd_kernel(torch.bfloat16, 128, True, long=True) is fns["usual"]
    assert kernels.fwd_kernel(torch.bfloat16, 128, True) is fns["usual"]
    assert len(built) == 1 and built[0]["long"] is False
    kernels.fwd_kernel(torch.bfloat16, 64, True, long=True)
    assert built[-1]["long"] is True


def test_precompile_adds_the_long_key_kernel(cute_env, monkeypatch, tmp_path):
    from flash_attn.cute import precompile

    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)
    built = []
    monkeypatch.setattr(precompile, "_build", lambda out, arch, dt, d, c, force, kind: built.append((kind, d, c))
                        or ("compiled", 0.0, None))
    precompile.precompile(str(tmp_path), dtypes=("bf16",), head_dims=(64, 128, 256), log=lambda *a: None)
    assert [k for k in built if k[0] == "fwd-long"] == [("fwd-long", 64, True)]
    for overrides in ("fwd.persistent=1", "fwd.warpgroups=2"):  # the length rules yield to these
        built.clear()
        cute_env(OVERRIDES=overrides)
        precompile.precompile(str(tmp_path), dtypes=("bf16",), head_dims=(64, 128), log=lambda *a: None)
        assert [k for k in built if k[0] == "fwd"] and not [k for k in built if k[0] == "fwd-long"], overrides
    cute_env(OVERRIDES=None)
    built.clear()
    monkeypatch.setattr(config, "LONG", {})  # no long-key kernel in the table
    precompile.precompile(str(tmp_path), dtypes=("bf16",), head_dims=(64, 128), log=lambda *a: None)
    assert not [k for k in built if k[0] == "fwd-long"]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_kernel_matches_reference_on_gpu(monkeypatch, dtype):
    """Key lengths at and above config.LONG_SK (odd ones, Sq != Sk both ways, GQA) through the long-key kernel."""
    from test_cute_compile import test_matches_reference_on_gpu

    _swap_kernels(monkeypatch, {})
    limit = config.LONG_SK
    for shape in [(1, limit, limit, 2, 2), (2, limit + 131, limit + 131, 2, 1), (1, 300, limit + 5, 4, 2),
                  (1, limit + 700, limit, 2, 2)]:
        test_matches_reference_on_gpu(dtype, 64, True, *shape)
    assert (dtype, 64, True, "sm_90a", False, False, "long") in kernels._kernels
