"""flash_attn_with_kvcache on the cute backend (flash_attn/cute/kvcache.py, plan rule kvcache).

CPU: the whole host path (rotary, the append into contiguous and paged caches, cache_batch_idx / cache_leftpad as
sequence windows of the packed cache, gathered pages, the lse layout) with the varlen kernel replaced by a reference
varlen attention over exactly the keys the kernel would read, against the reference backend's flash_attn_with_kvcache.
GPU: the kernels themselves, through the root API, against the reference backend."""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from flash_attn import call as _call
from flash_attn import reference

kvcache = pytest.importorskip("flash_attn.cute.kvcache")
from flash_attn.cute import backend, launch  # noqa: E402
from flash_attn.cute.plan import _UNBOUNDED  # noqa: E402

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _varlen_reference(q, k, v, cu_q, cu_k, used_k, max_q, scale, causal, arch, wl, wr, softcap, sink=None, pack=1,
                      splits=1, page_table=None, fill_unused_rows=False):
    """launch.forward_varlen's meaning, by the reference backend one sequence at a time: sequence b's keys are rows
    cu_k[b] .. cu_k[b] + used_k[b] - 1 of the packed k / v, or the first used_k[b] rows of its pages."""
    Tq, H, _ = q.shape
    out = torch.zeros(Tq, H, v.shape[-1], dtype=q.dtype)
    lse = torch.full((H, Tq), math.inf)
    for b in range(cu_q.numel() - 1):
        q0, q1, n = int(cu_q[b]), int(cu_q[b + 1]), int(used_k[b])
        if page_table is None:
            kb, vb = k[int(cu_k[b]):int(cu_k[b]) + n], v[int(cu_k[b]):int(cu_k[b]) + n]
        else:
            page = k.shape[1]
            rows = torch.tensor([int(page_table[b, j // page]) * page + j % page for j in range(n)], dtype=torch.long)
            kb, vb = k.flatten(0, 1)[rows], v.flatten(0, 1)[rows]
        c = _call.describe(q, v, causal=causal, window_left=-1 if wl >= _UNBOUNDED else wl,
                           window_right=-1 if wr >= _UNBOUNDED else wr, softcap=softcap, scale=scale,
                           sink=sink is not None)
        o, lb, _ = reference.fwd(c, q[None, q0:q1], kb[None], vb[None], None, None, None, None, None, None, None,
                                 sink=sink)
        out[q0:q1], lse[:, q0:q1] = o[0], lb[0]
    return out, lse


def _case(paged, B=3, Sq=2, H=4, Hk=2, D=64, s_new=2, leftpad=False, batch_idx=False, rotary=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    cap = 48
    q = r(B, Sq, H, D)
    if paged:
        page, pages = 8, 6
        k_cache, v_cache = r(B * pages + 2, page, Hk, D), r(B * pages + 2, page, Hk, D)
        table = torch.randperm(B * pages + 2, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    else:
        Bc = B + 2 if batch_idx else B
        k_cache, v_cache = r(Bc, cap, Hk, D), r(Bc, cap, Hk, D)
        table = None
    seqlens = torch.tensor([5, 17, 30][:B], dtype=torch.int32)
    kw = dict(k=r(B, s_new, Hk, D) if s_new else None, v=r(B, s_new, Hk, D) if s_new else None,
              cache_seqlens=seqlens, cache_batch_idx=torch.tensor([4, 0, 2][:B], dtype=torch.int32) if batch_idx
              else None, cache_leftpad=torch.tensor([3, 0, 7][:B], dtype=torch.int32) if leftpad else None,
              block_table=table, rotary_cos=None, rotary_sin=None)
    if rotary is not None:
        angles = r(64, D // 4)
        kw.update(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    return q, k_cache, v_cache, kw


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, False, True])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("extra", ["", "leftpad", "batch_idx", "sink", "no_new"])
def test_host_path_matches_the_reference(monkeypatch, paged, rotary, mask, extra):
    if extra == "batch_idx" and paged:
        pytest.skip("cache_batch_idx picks rows of a contiguous cache")
    if extra == "no_new" and rotary is not None:
        pytest.skip("rotary rotates the new keys: FA2 needs k / v with it")
    seen = []

    def varlen(*a, **kw):
        seen.append(kw)
        return _varlen_reference(*a, **kw)

    monkeypatch.setattr(launch, "forward_varlen", varlen)
    q, k_cache, v_cache, kw = _case(paged, leftpad=extra == "leftpad", batch_idx=extra == "batch_idx",
                                    rotary=rotary, s_new=0 if extra == "no_new" else 2)
    causal = mask == "causal"
    left, right = (6, 1) if mask == "window" else (-1, -1)
    sink = torch.randn(q.shape[2]) if extra == "sink" else None
    c = _call.describe(q, v_cache, paged=paged, causal=causal, window_left=left, window_right=right, kvcache=True,
                       scale=0.3, sink=sink is not None)
    args = [kw[n] for n in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                            "cache_leftpad", "block_table")]
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    out_ref, lse_ref = reference.fwd_kvcache(c, q, kc_ref, vc_ref, *args, None, bool(rotary), 0, sink=sink)
    out, lse = kvcache.fwd_kvcache(c, q, k_cache, v_cache, *args, bool(rotary), 0, sink,
                                   lambda *a: (1, 1), lambda page: page % 8 == 0)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)  # the same appends, in place
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
    assert (seen[0].get("page_table") is not None) == (paged and extra != "leftpad")


def test_pages_the_kernel_cannot_box_are_gathered(monkeypatch):
    monkeypatch.setattr(launch, "forward_varlen", lambda *a, **kw: _varlen_reference(*a, **kw))
    q, k_cache, v_cache, kw = _case(True)
    c = _call.describe(q, v_cache, paged=True, kvcache=True)
    args = [kw[n] for n in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                            "cache_leftpad", "block_table")]
    out_ref, lse_ref = reference.fwd_kvcache(c, q, k_cache.clone(), v_cache.clone(), *args, None, False, 0)
    out, lse = kvcache.fwd_kvcache(c, q, k_cache, v_cache, *args, False, 0, None, lambda *a: (1, 1),
                                   lambda page: False)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)


def test_decoding_calls_take_the_plan_and_num_splits(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "forward_varlen", lambda *a, **kw: seen.append(kw) or _varlen_reference(*a, **kw))
    q, k_cache, v_cache, kw = _case(False, Sq=1)
    c = _call.describe(q, v_cache, kvcache=True)
    args = [kw[n] for n in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                            "cache_leftpad", "block_table")]
    plans = []
    kvcache.fwd_kvcache(c, q, k_cache, v_cache, *args, False, 0, None, lambda *a: plans.append(a[1:]) or (2, 3),
                        lambda page: True)
    assert plans == [(3, 1, 4, 48, 2, _UNBOUNDED, _UNBOUNDED)] and (seen[-1]["pack"], seen[-1]["splits"]) == (2, 3)
    kvcache.fwd_kvcache(c, q, k_cache, v_cache, *args, False, 1, None, lambda *a: (2, 3), lambda page: True)
    assert (seen[-1]["pack"], seen[-1]["splits"]) == (2, 1)  # num_splits=1: unsplit, as the caller asked


def test_the_dispatcher_takes_kvcache_under_the_plan_rule(cute_env):
    c = _call.AttnCall("cuda", torch.bfloat16, 128, 128, (9, 0), kvcache=True)
    cute_env()
    assert "plan rule kvcache" in backend.unsupported_reason(c)
    cute_env(OVERRIDES="plan.kvcache=1")
    assert backend.unsupported_reason(c) is None
    assert backend.unsupported_reason(c._replace(alibi=True)) == "alibi"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("Sq, s_new", [(1, 1), (1, 0), (5, 5)])
@pytest.mark.parametrize("opts", ["", "causal", "window", "rotary", "leftpad", "batch_idx", "sink", "softcap"])
def test_root_kvcache_on_the_kernels_matches_the_reference(cute_env, paged, Sq, s_new, opts):
    import flash_attn
    from flash_attn import dispatch

    if opts == "batch_idx" and paged or opts == "rotary" and not s_new:
        pytest.skip("not a valid combination")
    cute_env(OVERRIDES="plan.kvcache=1")
    torch.manual_seed(1)
    B, H, Hk, D, dev, dt = 3, 8, 2, 128, "cuda", torch.bfloat16
    if paged:
        page = 16
        k_cache = torch.randn(40, page, Hk, D, device=dev, dtype=dt)
        table = torch.randperm(40, device=dev)[:36].view(B, 12).to(torch.int32)
    else:
        k_cache = torch.randn(B + 2 if opts == "batch_idx" else B, 700, Hk, D, device=dev, dtype=dt)
        table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, Sq, H, D, device=dev, dtype=dt)
    seqlens = torch.tensor([100, 1, 150], dtype=torch.int32, device=dev)
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=opts == "causal",
              window_size=(64, 0) if opts == "window" else (-1, -1), softcap=20.0 if opts == "softcap" else 0.0,
              return_softmax_lse=True)
    if s_new:
        kw.update(k=torch.randn(B, s_new, Hk, D, device=dev, dtype=dt), v=torch.randn(B, s_new, Hk, D, device=dev,
                                                                                      dtype=dt))
    if opts == "rotary":
        angles = torch.rand(200, D // 4, device=dev) * 6
        kw.update(rotary_cos=angles.cos().to(dt), rotary_sin=angles.sin().to(dt), causal=True)
    if opts == "leftpad":
        kw["cache_leftpad"] = torch.tensor([3, 0, 40], dtype=torch.int32, device=dev)
    if opts == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32, device=dev)
    if opts == "sink":
        kw["learnable_sink"] = torch.randn(H, device=dev)
    kc, vc = k_cache.clone(), v_cache.clone()
    with dispatch.use_backend("cute"):
        out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    with dispatch.use_backend("torch"):
        ref, ref_lse = flash_attn.flash_attn_with_kvcache(q.float(), kc.float(), vc.float(),
                                                          **{n: (t.float() if isinstance(t, torch.Tensor)
                                                                 and t.is_floating_point() and n != "learnable_sink"
                                                                 else t) for n, t in kw.items()})
        kc_lp, vc_lp = kc.clone(), vc.clone()
        ref_lp, lse_lp = flash_attn.flash_attn_with_kvcache(q, kc_lp, vc_lp, **kw)
    if opts != "rotary":  # the same rows appended (rotated keys may differ in their last bit)
        assert torch.equal(k_cache, kc_lp) and torch.equal(v_cache, vc_lp)
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (ref_lp.float() - ref).abs().max().item() + ref.abs().max().item() * 2 ** -8
    assert err <= bound, (err, bound)
    # lse by the same criterion (rotary rounds the rotated q to bf16 here and in the bf16 reference, not in fp32's)
    lse_err = (lse - ref_lse).abs().max().item()
    assert lse_err <= 2 * (lse_lp - ref_lse).abs().max().item() + 1e-3, lse_err


@pytest.mark.skipif(not torch.cuda.is_available() and not kvcache.use_prep_kernel(torch.zeros(1), torch.zeros(1)),
                    reason="needs Triton with a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rotary", [None, "half", "interleaved", "partial"])
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
@pytest.mark.parametrize("Sq,s_new,bounded", [(1, 1, False), (3, 3, True), (2, 0, True), (4, 2, False)])
def test_prep_kernel_matches_the_torch_prep(dtype, rotary, layout, Sq, s_new, bounded):
    """kvcache.prep_kernel (one Triton launch; the interpreter on the CPU, fp16 / fp32) gives prep's result: the
    returned q and both caches after the append, bit for bit in fp32 and within a unit of the last place in fp16
    (the rotation in fp32 both ways), for rotary none / half-split / interleaved / over part of the head dim,
    contiguous caches, cache_batch_idx and paged caches, one decoding step or several new rows."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(Sq * 10 + s_new)
    B, H, Hk, D, Dv, S_cache, page = 3, 4, 2, 64, 48, 24, 8
    q = torch.randn(B, Sq, H, D, generator=g).to(dev, dtype)
    k = torch.randn(B, s_new, Hk, D, generator=g).to(dev, dtype) if s_new else None
    v = torch.randn(B, s_new, Hk, Dv, generator=g).to(dev, dtype) if s_new else None
    seqlens = torch.tensor([0, 5, 13], dtype=torch.int32, device=dev)
    batch_idx = block_table = None
    if layout == "paged":
        kc = torch.randn(10, page, Hk, D, generator=g).to(dev, dtype)
        vc = torch.randn(10, page, Hk, Dv, generator=g).to(dev, dtype)
        block_table = torch.tensor([[3, 0, 7], [9, 1, 2], [4, 8, 5]], dtype=torch.int32, device=dev)
    else:
        kc = torch.randn(B + 1, S_cache, Hk, D, generator=g).to(dev, dtype)
        vc = torch.randn(B + 1, S_cache, Hk, Dv, generator=g).to(dev, dtype)
        if layout == "batch_idx":
            batch_idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    cos = sin = None
    if rotary is not None:
        half = 12 if rotary == "partial" else D // 2
        angles = torch.rand(40, half, generator=g) * 6.0
        cos, sin = angles.cos().to(dev, dtype), angles.sin().to(dev, dtype)
    interleaved = rotary == "interleaved"
    caches = (kc.clone(), vc.clone())
    want_q = kvcache.prep(q, *caches, k, v, cos, sin, seqlens, batch_idx, block_table, interleaved, bounded)
    got_caches = (kc.clone(), vc.clone())
    got_q = kvcache.prep_kernel(q, *got_caches, k, v, cos, sin, seqlens, batch_idx, block_table, interleaved,
                                bounded)
    tol = 0.0 if dtype == torch.float32 else 2.0 ** -10
    for got, want in ((got_q, want_q), (got_caches[0], caches[0]), (got_caches[1], caches[1])):
        assert got.shape == want.shape and got.dtype == want.dtype
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        assert err <= tol * max(1.0, want.float().abs().max().item()) + (1e-6 if dtype == torch.float32 else 0), err
    if rotary is None:
        assert got_q is q  # nothing to rotate: q as given
    assert kvcache.use_prep_kernel(q, kc) == (dtype != torch.bfloat16)


_AOT_SCRIPT = r"""
import json
from flash_attn.cute import kvcache as kv
from flash_attn.testing import triton_sm90_compile

fn = kv._prep_kernel()
for rotary, interleaved, paged, batch_idx in ((True, False, False, False), (True, True, True, False),
                                              (False, False, False, True)):
    ce = dict(HEADS_Q=32, HEADS_KV=8, HEAD_DIM=128, HEAD_DIM_V=128, BLOCK_D=128, BLOCK_DV=128, ROT_HALF=64,
              BLOCK_HALF=64, ROTARY=rotary, INTERLEAVED=interleaved, Q_STEPS=False, HAS_BATCH_IDX=batch_idx,
              PAGED=paged)
    bf16 = ("Q", "QOut", "K", "V", "KCache", "VCache", "Cos", "Sin")
    sig = {n: "*bf16" if n in bf16 else "*i32" if n[0].isupper() else "i32" for n in fn.arg_names}
    div = [n for n in fn.arg_names if n not in ce and (n[0].isupper() or n.startswith("s_"))]
    got = triton_sm90_compile(fn, sig, ce, div, num_warps=1)
    print(json.dumps(dict(rotary=rotary, spills=got["spills"], stores=got["ptx"].count("st.global"))))
"""


@pytest.mark.skipif(not importlib.util.find_spec("triton"), reason="needs Triton")
def test_prep_kernel_compiles_for_sm90(tmp_path):
    """The prep kernel as launched for bf16 decoding (H 32, Hk 8, d 128: rotary half / interleaved, paged or with
    cache_batch_idx) compiles for sm_90 ahead of time (the interpreter never runs Triton's code generator), without
    spills."""
    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pkg = os.path.join(root, "packages", "flash-attn-4")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, pkg, os.environ.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in r.stdout.splitlines() if x[:1] == "{"]
    assert len(rows) == 3, r.stdout
    for row in rows:
        assert row["spills"] in (0, None) and row["stores"] >= 1, row


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_decode_step_on_the_kernels(cute_env, paged):
    """A decode step on the cute backend (append one rotated token with prep_kernel, attend with the decoding plan)
    captured in a CUDA graph: no host sync in it, and replays for cache lengths set in place in cache_seqlens give
    what eager calls on copies of the caches give, caches included, bit for bit."""
    import flash_attn
    from flash_attn import dispatch

    cute_env(OVERRIDES="plan.kvcache=1")
    torch.manual_seed(0)
    B, H, Hk, D, S, dev, dt = 2, 32, 8, 128, 2048, "cuda", torch.bfloat16
    if paged:
        k_cache = torch.randn(B * S // 256, 256, Hk, D, device=dev, dtype=dt)
        table = torch.randperm(B * S // 256, device=dev).view(B, -1).to(torch.int32)
    else:
        k_cache = torch.randn(B, S, Hk, D, device=dev, dtype=dt)
        table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    k_new, v_new = (torch.randn(B, 1, Hk, D, device=dev, dtype=dt) for _ in range(2))
    seqlens = torch.full((B,), 100, dtype=torch.int32, device=dev)
    angle = torch.rand(S, D // 2, device=dev) * 6.28
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)

    def step(kc, vc):
        return flash_attn.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                                  cache_seqlens=seqlens, block_table=table, causal=True,
                                                  return_softmax_lse=True)

    with dispatch.use_backend("cute"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(k_cache, v_cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g, lse_g = step(k_cache, v_cache)
        for L in (0, 1, 255, 256, 1000, 2047):
            seqlens.fill_(L)
            q.normal_()
            k_new.normal_()
            v_new.normal_()
            kc, vc = k_cache.clone(), v_cache.clone()
            out_e, lse_e = step(kc, vc)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc), L
            assert torch.equal(out_g, out_e) and torch.equal(lse_g, lse_e), L
