"""The in-kernel dQ cast of the Hopper backward (BwdConfig.dq_cast, ``bwd.dq_cast=1``): the last key block's CTA of
each query block casts its dq_accum rows into dQ (bwd_dq.DqAccumulator.cast_finished), so no cast launch follows the
kernel. CPU: the config's rules and refusals, the kernel's counters / ballot / cast in the PTX (spill-free), the host
path with a stand-in kernel. GPU: gradients against the reference with the cast in the kernel."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, kernels, launch  # noqa: E402
from test_cute_bwd import _fresh_bwd_kernels, _hopper, _run, cute_bwd_on, host  # noqa: E402,F401 (fixtures)
from test_cute_bwd_softcap import _check_softcap_gradients, softcap_on  # noqa: E402,F401 (a fixture)
from test_cute_bwd_varlen import kernel_layout  # noqa: E402 (dq_accum's layout, the stand-in kernels')


def _cfg(d=128, causal=False, **kw):
    return kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", **kw)


def test_dq_cast_rule_serves_the_plain_dense_kernels_only(cute_env):
    """Off by default (until timed); with bwd.dq_cast=1 on for the dense kernels with the TMA dQ tile (d64 / d96 /
    d128, causal or not, gqa_loop, a window or softcap: call_general_dq_cast), and off wherever dQ goes otherwise or
    the count would differ: deterministic (turns), varlen (counts per sequence), d192 / d256 (atomics), the 192 / 128
    pair; a cache key of its own; BwdConfig refuses the combinations it cannot serve."""
    assert not _cfg().dq_cast
    cute_env(OVERRIDES="bwd.dq_cast=1")
    for d in (64, 96, 128):
        for causal in (False, True):
            assert _cfg(d, causal).dq_cast and _cfg(d, causal, gqa_loop=True).dq_cast
            assert _cfg(d, causal, local=True).dq_cast and _cfg(d, causal, softcap=True).dq_cast
    for kw in (dict(deterministic=True), dict(varlen=True)):
        assert not _cfg(**kw).dq_cast, kw
    assert not _cfg(192).dq_cast and not _cfg(256, True).dq_cast and not _cfg(192, head_dim_v=128).dq_cast
    cute_env(OVERRIDES="bwd.dq_cast=1,bwd.dq_tma=0")
    assert not _cfg().dq_cast
    cute_env(OVERRIDES="bwd.dq_cast=0")
    base = _cfg()
    cast = config.BwdConfig(**{**base.__dict__, "dq_cast": True})
    assert cast.key() != base.key()
    for bad in (dict(dq_tma=False, dq_perm=False), dict(deterministic=True, dq_writer=True), dict(varlen=True, lpt=0),
                dict(head_dim=192, head_dim_v=128)):
        with pytest.raises(ValueError, match="dq_cast"):
            config.BwdConfig(**{**base.__dict__, "dq_cast": True, **bad})


def _ptx(tmp_path, cute_env, d, causal, overrides, **kw):
    cute_env(OVERRIDES=overrides)
    folder = tmp_path / f"{d}_{int(causal)}_{overrides}_{'_'.join(sorted(kw))}"
    folder.mkdir()
    kernels.compile_bwd(torch.bfloat16, d, causal, "sm_90a", dump_dir=str(folder), **kw)
    (path,) = glob.glob(str(folder / "*.ptx"))
    return open(path).read(), path


@pytest.mark.parametrize("d,causal,kw", [(64, False, {}), (96, True, {}), (128, False, {}),
                                         (128, True, dict(gqa_loop=True)), (128, False, dict(softcap=True)),
                                         (64, True, dict(local=True))])
def test_kernel_counts_query_blocks_and_casts_the_last_ones(tmp_path, cute_env, d, causal, kw):
    """The dq_cast kernel: the issuing warp's last reduce-add completed and fenced (proxy, then acq_rel), one acq_rel
    increment per (query head, query block) and lane, a ballot, then the warp's cast of each block whose increment
    was the last: per lane and step U pieces of a row (16 fp32 columns each: 4 x 16-byte loads; U = 8, 6 at d96's
    12 pieces per lane and block) all loaded before the first 16-bit store (2 x 16 bytes each); spill-free, register
    split and WGMMA pipelining kept, no more spills than without it. The default kernel has none of it."""
    text, path = _ptx(tmp_path, cute_env, d, causal, "bwd.dq_cast=1", **kw)
    assert text.count("atom.global.acq_rel.add.u32") == 1
    assert text.count("vote.sync.ballot.b32") == 1
    assert text.count("fence.proxy.async.global") == 1
    loads = [m.start() for m in re.finditer(r"ld\.global\.v4\.b32", text)]
    stores = [m.start() for m in re.finditer(r"st\.global\.v4\.b32", text)]
    pieces = 6 if d == 96 else 8
    assert len(loads) == 4 * pieces and len(stores) == 2 * pieces
    assert max(loads) < min(stores)
    assert text.index("atom.global.acq_rel.add.u32") < min(loads)
    plain, plain_path = _ptx(tmp_path, cute_env, d, causal, "bwd.dq_cast=0", **kw)
    assert "atom.global.acq_rel" not in plain and "vote.sync.ballot" not in plain
    assert "ld.global.v4" not in plain
    if shutil.which("ptxas") is not None:  # no more spilled than the kernel without it (d128 softcap: one word)
        assert _spills(path) <= _spills(plain_path) <= (4 if kw.get("softcap") else 0)


def _spills(path):
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True,
                         check=True)
    log = out.stdout + out.stderr
    assert "setmaxnreg' ignored" not in log and "are serialized" not in log, log
    return max(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))


def test_mods_kernels_keep_the_cast_launch(tmp_path, cute_env):
    """A mask_mod's backward kernel (entry call_mods, which has no dQ argument) is built without dq_cast even with the
    override on."""
    from flash_attn.cute import mod_library

    text, _ = _ptx(tmp_path, cute_env, 128, False, "bwd.dq_cast=1", mask_mod=mod_library._causal_fn())
    assert "atom.global.acq_rel" not in text and "vote.sync.ballot" not in text


@pytest.mark.parametrize("heads,heads_kv,gqa_loop,layout,most", [
    (4, 4, True, "kernel", None), (4, 4, True, "transposed", None), (4, 2, True, "kernel", None),
    (4, 2, False, "kernel", None), (4, 4, True, "kernel", 1), (4, 4, True, "transposed", 1), (4, 2, True, "kernel", 2)])
def test_host_hands_the_kernel_dq_and_zeroed_counters(monkeypatch, cute_env, host, heads, heads_kv, gqa_loop, layout,
                                                      most):
    """With dq_cast the host hands the kernel dQ (the caller's where the kernel accepts its layout, else its own,
    copied after) and the counters (B, H, query blocks) int32 zeros, and launches no cast: the finish step runs only
    for GQA's dK / dV sums (no gqa_loop), and then leaves dQ alone. Past plan.bwd_dq_cast_blocks query blocks (here 2
    of 128 rows) the counters have no query block (the kernel casts nothing) and the host casts into the caller's dQ.
    Both host paths (the preprocess zeroes the counters in its launch; its allocations NaN-filled here); fp16 (the
    interpreter computes bf16 wrongly)."""
    from flash_attn.cute import bwd_host

    path, _ = host
    rule = "" if most is None else f",plan.bwd_dq_cast_blocks={most}"
    torch_host = ",plan.bwd_host=torch" if path == "torch" else ""
    cute_env(OVERRIDES=f"bwd.dq_cast=1,plan.bwd_gqa_loop={int(gqa_loop)}{rule}{torch_host}")
    _fresh_bwd_kernels(monkeypatch)
    ran = []
    for name in ("finish", "finish_torch"):
        real = getattr(bwd_host, name)
        monkeypatch.setattr(bwd_host, name, lambda *a, _n=name, _f=real, **kw: (ran.append((_n, a[1])), _f(*a, **kw))[1])
    B, Sq, Sk, D, dtype = 2, 150, 70, 64, torch.float16
    g = torch.Generator().manual_seed(0)
    q, out, dout = (torch.randn(B, Sq, heads, D, generator=g).to(dtype) for _ in range(3))
    k, v = (torch.randn(B, Sk, heads_kv, D, generator=g).to(dtype) for _ in range(2))
    lse = torch.randn(B, heads, Sq, generator=g)
    dq_vals = torch.randint(-1024, 1024, (B, Sq, heads, D), generator=g).to(dtype)
    kv_heads = heads_kv if gqa_loop else heads
    dk_vals, dv_vals = (torch.randint(-64, 64, (B, Sk, kv_heads, D), generator=g).to(dtype) for _ in range(2))
    cfg = kernels.bwd_config(dtype, D, False, "sm_90a", gqa_loop=gqa_loop and heads > heads_kv)
    assert cfg.dq_cast
    seen = {}
    host_casts = most is not None and most < -(-Sq // cfg.block_m)

    def kernel(q_, k_, v_, dout_, lse2, delta, dq_accum, dk, dv, dq, counts, scale):
        seen.update(counts=counts.clone(), dq=dq)
        assert dq.dtype == dtype and launch._bwd_out_layout(dq, D)
        if host_casts:
            dq_accum.add_(kernel_layout(dq_vals.float()) if cfg.dq_perm else dq_vals.float())
        else:
            dq_accum.fill_(7.0)  # never cast by the host
            dq.copy_(dq_vals)
        dk.copy_(dk_vals)
        dv.copy_(dv_vals)

    monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, False, "sm_90a",
                                                                 gqa_loop=cfg.gqa_loop), kernel)
    grads = None
    if layout == "transposed":
        grads = tuple(torch.full((B, h, s, D), float("nan"), dtype=dtype).transpose(1, 2)
                      for h, s in ((heads, Sq), (heads_kv, Sk), (heads_kv, Sk)))
    dq, dk, dv = launch.backward(dout, q, k, v, out, lse, 0.5, False, "sm_90a", grads=grads)
    blocks = 0 if host_casts else -(-Sq // cfg.block_m)
    assert torch.equal(seen["counts"], torch.zeros(B, heads, blocks, dtype=torch.int32))
    assert torch.equal(dq, dq_vals)
    if grads is not None:
        assert dq is grads[0] and seen["dq"] is not dq  # the kernel got its own (written and copied, or not)
    sums = heads > heads_kv and not gqa_loop
    if host_casts:
        assert [r[1] is dq for r in ran] == [True]
    else:  # no dQ cast; GQA's sums or dK / dV into outputs of another layout alone
        assert all(r[1] is None for r in ran) and len(ran) == int(sums or layout == "transposed")
    group = heads // heads_kv
    for got, vals in ((dk, dk_vals), (dv, dv_vals)):
        want = vals.float().view(B, Sk, heads_kv, group, D).sum(3).to(dtype) if sums else vals
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (255, 255), (1000, 1000), (2048, 2048), (113, 203),
                                               (256, 77), (1, 130), (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv,gqa_loop", [(4, 4, True), (6, 2, True), (4, 2, False)])
def test_gradients_with_the_dq_cast_in_the_kernel_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q,
                                                         seqlen_k, heads, heads_kv, gqa_loop):
    """bwd.dq_cast=1: dQ cast by the last key block's CTA of each query block (query blocks cut by Sq, key blocks by
    Sk, blocks that no key block sees under a causal mask, GQA on the gqa_loop kernel and with the sums after it);
    no cast launch ran for dQ."""
    _dq_cast_run(monkeypatch, cute_env, cute_bwd_on, f"plan.bwd_gqa_loop={int(gqa_loop)}", False, d, causal,
                 seqlen_q, seqlen_k, heads, heads_kv)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(255, 255), (1000, 1000), (113, 203)])
def test_gradients_with_the_host_cast_past_the_rule_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q,
                                                            seqlen_k):
    """The dq_cast kernel with plan.bwd_dq_cast_blocks=0: counters with no query block, the kernel casts nothing, the
    host's cast launch does."""
    _dq_cast_run(monkeypatch, cute_env, cute_bwd_on, "plan.bwd_dq_cast_blocks=0", True, d, causal, seqlen_q, seqlen_k,
                 4, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(255, 255), (1000, 1000), (113, 203), (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_gradients_with_the_dq_cast_and_a_window_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q,
                                                        seqlen_k, heads, heads_kv):
    """call_general_dq_cast with a sliding window (query blocks no key block sees: their zero rows cast too)."""
    _dq_cast_run(monkeypatch, cute_env, cute_bwd_on, "", False, d, causal, seqlen_q, seqlen_k, heads, heads_kv,
                 window=(40, 0 if causal else 7))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 30))])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (300, 777), (1, 130)])
def test_softcap_gradients_with_the_dq_cast_on_gpu(softcap_on, monkeypatch, cute_env, d, causal, window, seqlen_q,
                                                   seqlen_k):
    """call_general_dq_cast with soft-capped scores (test_cute_bwd_softcap's check)."""
    cute_env(OVERRIDES="bwd.dq_cast=1,plan.bwd_softcap=1")
    _fresh_bwd_kernels(monkeypatch)
    _check_softcap_gradients(softcap_on, torch.bfloat16, d, causal, window, seqlen_q, seqlen_k)
    assert any("softcap" in key for key in kernels._bwd_kernels)


def _dq_cast_run(monkeypatch, cute_env, calls, overrides, host_casts, d, causal, seqlen_q, seqlen_k, heads, heads_kv,
                 window=(-1, -1)):
    from flash_attn.cute import bwd_host

    cute_env(OVERRIDES=",".join(x for x in ("bwd.dq_cast=1", overrides) if x))
    _fresh_bwd_kernels(monkeypatch)
    casts = []
    real = bwd_host.finish
    monkeypatch.setattr(bwd_host, "finish", lambda acc, dq, *a, **kw: (casts.append(dq is not None),
                                                                       real(acc, dq, *a, **kw))[1])
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, calls, seed=21, window=window)
    if host_casts:
        assert casts and all(casts), "the host did not cast dQ"
    else:
        assert not any(casts), "a cast launch ran for dQ"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,heads,heads_kv,seqlen", [(128, 8, 1, 4096), (64, 16, 2, 3000), (96, 4, 4, 8192)])
def test_dq_cast_with_more_query_blocks_than_consumer_threads_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, heads,
                                                                     heads_kv, seqlen):
    """A CTA counts (query head, query block) items in rounds of 256 (8 warps x 32 lanes): 512 items per gqa_loop CTA
    at d128 (8 heads x 64 blocks), 192 at d64 (8 x 24), 128 at d96 (one head, 128 blocks); fp16 and bf16."""
    cute_env(OVERRIDES="bwd.dq_cast=1")
    _fresh_bwd_kernels(monkeypatch)
    for dtype in (torch.bfloat16, torch.float16):
        _run(dtype, d, True, 1, seqlen, seqlen, heads, heads_kv, cute_bwd_on, seed=22)
