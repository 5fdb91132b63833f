"""learnable_sink in flash_attn.cute: one logit per query head that joins every softmax row as a term
with no value (lse includes it, a row that sees no key gets out 0 and lse = sink). On CPU: the reference's
semantics, the sink kernels compile for sm_90a, the cache key, argument checks and the autograd
Function's backward (with the reference standing in for the kernel); on a Hopper GPU (marked gpu): the
kernels against the reference, and one gradient case."""
import glob
import math
import os
import sys

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import autograd, interface, kernels, launch, plan  # noqa: E402
from _cute_table import swap_kernels  # noqa: E402
from flash_attn.testing import assert_close_to_ref, attention_lse_ref, attention_ref  # noqa: E402

U = plan._UNBOUNDED


# ----------------------------------------------------------------------------------------------------
# The reference


def test_reference_sink_hand_computed():
    # One head, D = 1, scale 1: query 1 against keys 1 and 2 (scores 1, 2), values 3 and 5, sink 0.5.
    # Causal with Sq = 3, Sk = 2 (bottom-right aligned): row 0 sees no key, row 1 key 0, row 2 both.
    q = torch.tensor([[[[1.0]], [[1.0]], [[1.0]]]], dtype=torch.float64)  # (1, 3, 1, 1)
    k = torch.tensor([[[[1.0]], [[2.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0]], [[5.0]]]], dtype=torch.float64)
    sink = torch.tensor([0.5], dtype=torch.float64)
    out, probs = attention_ref(q, k, v, causal=True, softmax_scale=1.0, learnable_sink=sink)
    lse = attention_lse_ref(q, k, causal=True, softmax_scale=1.0, learnable_sink=sink)
    e = math.exp
    l1, l2 = e(1) + e(0.5), e(1) + e(2) + e(0.5)
    assert out[0, 0, 0, 0].item() == 0.0 and lse[0, 0, 0].item() == pytest.approx(0.5, abs=1e-6)
    assert out[0, 1, 0, 0].item() == pytest.approx(3 * e(1) / l1, rel=1e-12)
    assert out[0, 2, 0, 0].item() == pytest.approx((3 * e(1) + 5 * e(2)) / l2, rel=1e-12)
    assert lse[0, 0, 1].item() == pytest.approx(math.log(l1), rel=1e-6)
    assert lse[0, 0, 2].item() == pytest.approx(math.log(l2), rel=1e-6)
    # the probabilities leave out the sink's share
    assert probs[0, 0, 2].sum().item() == pytest.approx(1 - e(0.5) / l2, rel=1e-12)
    # the sink is not scaled by softmax_scale: a scale of 2 doubles the scores only
    lse2 = attention_lse_ref(q, k, softmax_scale=2.0, learnable_sink=sink)
    assert lse2[0, 0, 2].item() == pytest.approx(math.log(e(2) + e(4) + e(0.5)), rel=1e-6)


def test_reference_sink_of_minus_infinity_is_no_sink():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
    none = torch.full((4,), -math.inf)
    out, _ = attention_ref(q, k, v, learnable_sink=none)
    torch.testing.assert_close(out, attention_ref(q, k, v)[0], rtol=0, atol=0)
    torch.testing.assert_close(attention_lse_ref(q, k, learnable_sink=none), attention_lse_ref(q, k))


# ----------------------------------------------------------------------------------------------------
# Compiling the sink kernels (no GPU needed)


def _count(text, needle):
    return sum(line.lstrip().startswith(needle) for line in text.splitlines())


@pytest.mark.parametrize("dtype,d,causal,varlen", [(torch.bfloat16, 64, True, False),
                                                   (torch.float16, 128, False, True)])
def test_sink_kernel_compiles_for_sm90a(tmp_path, dtype, d, causal, varlen):
    kernels.compile_fwd(dtype, d, causal, arch="sm_90a", dump_dir=str(tmp_path), varlen=varlen, sink=True)
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    text = open(path).read()
    assert ".target sm_90a" in text
    assert _count(text, "wgmma.mma_async") > 0
    assert _count(text, "cp.async.bulk.tensor") > 0
    assert _count(text, "ld.global") > 0  # the head's sink logit


def test_sink_kernel_takes_the_sink_last(tmp_path):
    """The interface's calling convention, checked on the exported kernel (no GPU): the sink variant takes
    the plain call's arguments and then the (H,) sink; its TVM-FFI wrapper accepts that list and stops
    at the device check only."""
    pytest.importorskip("tvm_ffi")
    from flash_attn.cute import cache

    if not cache._c_compiler():
        pytest.skip("no C compiler: the entry holds an object only")
    fn, how = kernels.load_or_build(torch.bfloat16, 64, False, root=str(tmp_path), sink=True)
    assert how == "compiled"
    q = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="expected device_type=cuda"):
        fn(q, q, q, q, torch.zeros(1, 4, 8), 0.1, 0.0, 0, 0, torch.zeros(4))
    with pytest.raises(TypeError, match="Expects 10 parameters"):
        fn(q, q, q, q, torch.zeros(1, 4, 8), 0.1, 0.0, 0, 0)


def test_sink_in_the_cache_key_only_when_set():
    for varlen in (False, True):
        args = (torch.bfloat16, 128, True, "sm_90a", False, False, varlen)
        plain = kernels.fwd_config(*args).key()
        sinked = kernels.fwd_config(*args, sink=True).key()
        assert "sink" not in plain and kernels.fwd_config(*args, sink=False).key() == plain
        # (a sink call keeps the direct O store: the dense call's default TMA O is for plain calls only)
        assert sinked == {**{k: v for k, v in plain.items() if k != "tma_o"}, "sink": True}
        e_plain, e_sink = kernels._entry(*args), kernels._entry(*args, sink=True)
        assert e_plain[1] != e_sink[1] and "-sink-" in e_sink[2] and "sink" not in e_plain[2]
        assert kernels._make_kernel(kernels.fwd_config(*args, sink=True)).sink
        assert not kernels._make_kernel(kernels.fwd_config(*args)).sink


# ----------------------------------------------------------------------------------------------------
# Argument checks (CPU tensors: refused before the device check)


@pytest.mark.parametrize("varlen", [False, True])
def test_bad_learnable_sink_is_refused(varlen):
    lead = (7,) if varlen else (2, 7)
    q = torch.zeros(*lead, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(*lead, 2, 64, dtype=torch.bfloat16)

    def call(sink):
        if varlen:
            cu = torch.tensor([0, 7], dtype=torch.int32)
            return interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, learnable_sink=sink)
        return interface.flash_attn_func(q, k, v, learnable_sink=sink)

    for sink, msg in [(torch.zeros(2), r"have shape \(4,\)"), (torch.zeros(1, 4), r"have shape \(4,\)"),
                      (torch.zeros(4, dtype=torch.int32), "be fp32, bf16 or fp16"),
                      (torch.zeros(4, device="meta"), "be on cpu"), ([0.0] * 4, "be a tensor")]:
        with pytest.raises(ValueError, match="learnable_sink must " + msg):
            call(sink)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # accepted: the device check comes next
        with pytest.raises(ValueError, match="CUDA tensors"):
            call(torch.zeros(4, dtype=dtype))


# ----------------------------------------------------------------------------------------------------
# The autograd Function on CPU, the reference standing in for the kernel


def _stand_in_forward(q, k, v, softmax_scale, causal, arch="sm_90a", window_left=-1, window_right=-1,
                      softcap=0.0, sink=None, lse_scratch=False):
    kw = dict(causal=causal, window_size=(window_left, 0 if causal else window_right), softcap=softcap,
              softmax_scale=softmax_scale, learnable_sink=sink)
    out, _ = attention_ref(q, k, v, **kw)
    return out, attention_lse_ref(q, k, **kw)


def _stand_in_forward_varlen(q, k, v, cu_q, cu_k, seqused_k, max_seqlen_q, softmax_scale, causal, arch="sm_90a",
                             window_left=-1, window_right=-1, softcap=0.0, fill_unused_rows=False, sink=None):
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32)
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        o, l = _stand_in_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale, causal,
                                 arch, window_left, window_right, softcap, sink)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def _ref_grads(q, k, v, sink, dout, **kw):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    out, _ = attention_ref(*leaves[:3], learnable_sink=leaves[3], **kw)
    return torch.autograd.grad(out, leaves, dout.double())


def test_sink_backward_dense_against_reference_autograd(monkeypatch):
    """dq, dk, dv (the dispatcher's backward on the sink-inclusive lse: the reference backend on CPU) and
    d(sink) (the Function's formula) against fp64 autograd of the reference; GQA, causal with Sq > Sk
    so that the first rows see no key."""
    monkeypatch.setattr(launch, "forward", _stand_in_forward)
    torch.manual_seed(0)
    B, Sq, Sk, H, Hk, D = 2, 9, 6, 4, 2, 16
    q = torch.randn(B, Sq, H, D, requires_grad=True)
    k = torch.randn(B, Sk, Hk, D, requires_grad=True)
    v = torch.randn(B, Sk, Hk, D, requires_grad=True)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.bfloat16, requires_grad=True)
    scale = 0.3
    out, lse = autograd.Attention.apply(q, k, v, sink, (scale, True, U, U, 0.0, False, "sm_90a", None))
    assert torch.allclose(lse[:, :, 0], sink.detach().float().view(1, H))  # row 0 sees no key
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), dout)
    want = _ref_grads(q, k, v, sink, dout, causal=True, softmax_scale=scale)
    assert got[3].dtype == torch.bfloat16
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=name)
    # d(sink) in fp32, rounded once to the sink's dtype
    w_sink = want[3].to(torch.bfloat16).double()
    torch.testing.assert_close(got[3].double(), w_sink, rtol=0, atol=float(w_sink.abs().max()) * 2 ** -7)


@pytest.mark.parametrize("lse_only", [False, True])
def test_sink_backward_with_lse_gradient(monkeypatch, lse_only):
    """A loss that uses the returned (sink-inclusive) lse: dq, dk, dv and d(sink) take its gradient too (delta - dlse
    in both), against fp64 autograd of the reference's out and lse; with the lse term alone, dv is 0."""
    monkeypatch.setattr(launch, "forward", _stand_in_forward)
    torch.manual_seed(2)
    B, Sq, Sk, H, Hk, D = 2, 7, 5, 4, 2, 16
    q, k, v = (torch.randn(B, s, h, D, requires_grad=True) for s, h in ((Sq, H), (Sk, Hk), (Sk, Hk)))
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    U = plan._UNBOUNDED
    out, lse = autograd.Attention.apply(q, k, v, sink, (0.3, True, U, U, 0.0, False, "sm_90a", None))
    assert lse.requires_grad
    dout, wlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (lse * wlse).sum() + (0 if lse_only else (out * dout).sum())
    got = torch.autograd.grad(loss, (q, k, v, sink))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    kw = dict(causal=True, softmax_scale=0.3, learnable_sink=leaves[3])
    out_r, _ = attention_ref(*leaves[:3], **kw)
    lse_r = attention_lse_ref(*leaves[:2], **kw)
    loss_r = (lse_r * wlse.double()).sum() + (0 if lse_only else (out_r * dout.double()).sum())
    want = torch.autograd.grad(loss_r, leaves, allow_unused=True)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        w = torch.zeros_like(g, dtype=torch.float64) if w is None else w
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=name)
    if lse_only:
        assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_sink_backward_varlen_and_sink_only(monkeypatch):
    """Varlen (an empty sequence, a sequence with no key, rows after the last sequence) through
    flash_attn_varlen_func's gradient path, and a call where only the sink needs a gradient."""
    monkeypatch.setattr(launch, "forward_varlen", _stand_in_forward_varlen)  # (autograd.Attention's forward)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    torch.manual_seed(1)
    lens_q, lens_k, H, Hk, D = [5, 0, 3, 4], [6, 2, 0, 7], 2, 1, 64
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    Tq, Tk = int(cu_q[-1]) + 2, int(cu_k[-1])
    q = torch.randn(Tq, H, D, dtype=torch.bfloat16).float().requires_grad_()
    k = torch.randn(Tk, Hk, D).requires_grad_()
    v = torch.randn(Tk, Hk, D).requires_grad_()
    sink = torch.tensor([0.25, -0.5], requires_grad=True)
    args = (D ** -0.5, False, U, U, 0.0, False, "sm_90a", (cu_q, cu_k, max(lens_q), max(lens_k), None, None))
    out, lse = autograd.Attention.apply(q, k, v, sink, args)
    assert torch.isinf(lse[:, -2:]).all() and (out[-2:] == 0).all()
    s0 = int(cu_q[2])  # sequence 2 has no key: lse = sink
    assert torch.allclose(lse[:, s0:s0 + 3], sink.detach().view(H, 1).expand(H, 3))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), dout)
    want = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v, sink)]
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 == q0:
            continue
        g = _ref_grads(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], sink, dout[None, q0:q1])
        want[0][q0:q1] += g[0][0]
        want[1][k0:k1] += g[1][0]
        want[2][k0:k1] += g[2][0]
        want[3] += g[3]
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=name)

    # only the sink needs a gradient: through flash_attn_varlen_func, no dispatcher backward
    monkeypatch.setattr(autograd, "dispatcher_backward", lambda *a: pytest.fail("dq/dk/dv not needed"))
    qb, kb, vb = (t.detach().to(torch.bfloat16) for t in (q, k, v))
    out_b, _ = interface.flash_attn_varlen_func(qb, kb, vb, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, learnable_sink=sink)
    assert out_b.requires_grad
    (dsink,) = torch.autograd.grad(out_b.float(), (sink,), dout)
    assert dsink.dtype == torch.float32 and torch.isfinite(dsink).all()


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _sinks(H):
    # a dominant sink, a negligible one, and ordinary ones
    s = torch.randn(H, device="cuda") * 2
    s[0], s[1] = 8.0, -30.0
    return s


def _check_lse(lse, lse_ref, name="lse"):
    err = (lse - lse_ref).abs().max().item()
    assert err < 2e-3, f"{name}: max error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_sink_matches_reference_on_gpu(d, causal):
    """GQA (6 query heads over 2), Sq > Sk so that causal rows at the top see no key (lse = sink)."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    B, Sq, Sk, H, Hk = 2, 257, 193, 6, 2
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16)
    sink = _sinks(H)
    out, lse = flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_lse=True)
    out_ref, _ = attention_ref(q, k, v, causal=causal, learnable_sink=sink)
    out_pt, _ = attention_ref(q, k, v, causal=causal, learnable_sink=sink, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)
    _check_lse(lse, attention_lse_ref(q, k, causal=causal, learnable_sink=sink))
    if causal:
        # (sink * log2 e) * ln 2 in fp32: within an ulp or two of the sink
        assert torch.all(out[:, :Sq - Sk] == 0)
        assert torch.allclose(lse[:, :, 0], sink.view(1, H).expand(B, H), rtol=1e-6, atol=1e-6)
    # the sink's dtype is free (converted to fp32 once)
    out16, _ = flash_attn_func(q, k, v, causal=causal, learnable_sink=sink.to(torch.bfloat16))
    out_ref16, _ = attention_ref(q, k, v, causal=causal, learnable_sink=sink.to(torch.bfloat16))
    assert_close_to_ref(out16, out_ref16, out_pt)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_sink_varlen_matches_reference_on_gpu(d):
    """Packed sequences with an empty one, one with no key (out 0, lse = sink) and rows after the last
    sequence (out 0, lse +inf)."""
    from flash_attn.cute import flash_attn_varlen_func

    torch.manual_seed(0)
    lens_q, lens_k, H, Hk = [17, 0, 300, 5, 129], [40, 5, 300, 0, 260], 4, 2
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]) + 3, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), Hk, d, device="cuda", dtype=torch.bfloat16)
    sink = _sinks(H)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, learnable_sink=sink, return_lse=True)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if sq == 0:
            continue
        if sk == 0:
            assert torch.all(out[q0:q0 + sq] == 0)
            assert torch.allclose(lse[:, q0:q0 + sq], sink.view(H, 1).expand(H, sq), rtol=1e-6, atol=1e-6)
            continue
        qs, ks, vs = q[None, q0:q0 + sq], k[None, k0:k0 + sk], v[None, k0:k0 + sk]
        out_ref, _ = attention_ref(qs, ks, vs, causal=True, learnable_sink=sink)
        out_pt, _ = attention_ref(qs, ks, vs, causal=True, learnable_sink=sink, upcast=False, reorder_ops=True)
        assert_close_to_ref(out[None, q0:q0 + sq], out_ref, out_pt, name=f"out of sequence {b}")
        _check_lse(lse[None, :, q0:q0 + sq], attention_lse_ref(qs, ks, causal=True, learnable_sink=sink),
                   name=f"lse of sequence {b}")
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isinf(lse[:, tail:]))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_sink_with_three_warpgroups_on_gpu(cute_env, monkeypatch):
    """The sink tests above on the 3-warpgroup forward (BLOCK_M 192; Sq 257 spans two tiles)."""
    cute_env(OVERRIDES="fwd.warpgroups=3")  # (d64 calls only below)
    swap_kernels(monkeypatch, {})  # the in-memory table does not key on the overrides
    assert kernels.fwd_config(torch.bfloat16, 64, True, "sm_90a", sink=True).warpgroups == 3
    for causal in (False, True):
        test_sink_matches_reference_on_gpu(64, causal)
    test_sink_varlen_matches_reference_on_gpu(64)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_sink_gradients_on_gpu():
    """dq, dk, dv, d(sink) against autograd of the reference (GQA, causal, d128, bf16)."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    B, Sq, Sk, H, Hk, d = 2, 200, 160, 4, 2, 128
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(H, device="cuda", requires_grad=True)
    out, _ = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), dout)
    out_ref, _ = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    want = torch.autograd.grad(out_ref, (q, k, v, sink), dout)
    out_pt, _ = attention_ref(q, k, v, causal=True, learnable_sink=sink, upcast=False, reorder_ops=True)
    pt = torch.autograd.grad(out_pt, (q, k, v, sink), dout)
    assert_close_to_ref(out, out_ref, out_pt)
    for name, g, w, p in zip(("dq", "dk", "dv", "dsink"), got, want, pt):
        assert_close_to_ref(g, w, p, name=name, fp32_ulps=64)
