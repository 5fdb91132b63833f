"""flash_attn.cute.mod_library: the ready score / mask mods. CPU: their references against independent definitions
(T5's buckets against transformers' T5, ALiBi's slopes against the paper's values), argument checks, and every mod
compiled for sm_90a with the mod in the PTX, forward and (score mods) backward. GPU: each mod through
flash_attn_func, outputs and gradients against its reference by FlashAttention's criterion."""
import glob
import math
import os

import pytest
import torch

L = pytest.importorskip("flash_attn.cute.mod_library")
import _cute_mods as m_  # noqa: E402
from flash_attn.cute import kernels, mods  # noqa: E402

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
CPU = torch.device("cpu")


def _cases(device="cpu", H=4, S=256):
    g = torch.Generator().manual_seed(0)
    slopes = L.alibi_slopes(H).to(device)
    table = (torch.randn(H, 65, generator=g) * 0.5).to(device)
    buckets = (torch.randn(H, 32, generator=g) * 0.5).to(device)
    docs = (torch.arange(S) // 37).repeat(2, 1).to(torch.int32).to(device)
    docs[1] = torch.arange(S) // 61
    return {"causal": L.causal(), "window": L.sliding_window(48, 16), "prefix": L.prefix_lm(40),
            "document": L.document(docs), "document_causal": L.document(docs, causal=True), "alibi": L.alibi(slopes),
            "relative": L.relative_position_bias(table), "t5": L.t5_relative_bias(buckets, S), "softcap": L.softcap(5.0),
            "alibi_causal": L.combine(L.alibi(slopes), L.causal()),
            "softcap_document": L.combine(L.softcap(5.0), L.document(docs))}


def test_t5_buckets_are_t5s():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-700, 701)
    for bidirectional in (True, False):
        for buckets, dist in ((32, 128), (16, 64)):
            want = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets,
                                                            max_distance=dist)
            assert torch.equal(L.t5_bucket(rel, buckets, dist, bidirectional), want)


def test_alibi_slopes_are_the_papers():
    assert torch.allclose(L.alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 12 heads: the 8 of n = 8, then the odd ones of n = 16 (2^-0.5, 2^-1.5, ...)
    want = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert torch.allclose(L.alibi_slopes(12), torch.tensor(want))


def test_references_mean_what_the_docs_say():
    s = torch.zeros(1, 2, 4, 6)
    keep = L.causal().reference(s).isfinite()[0, 0]
    assert torch.equal(keep, torch.ones(4, 6, dtype=torch.bool).tril(2))  # bottom-right: query i sees keys <= i + 2
    keep = L.sliding_window(1, 0).reference(s).isfinite()[0, 0]
    assert torch.equal(keep, torch.ones(4, 6, dtype=torch.bool).tril(2) & ~torch.ones(4, 6, dtype=torch.bool).tril(0))
    keep = L.prefix_lm(4).reference(s).isfinite()[0, 0]
    assert keep[0].tolist() == [True] * 4 + [False] * 2 and keep[3].all()
    got = L.alibi(torch.tensor([0.5, 1.0])).reference(s)
    assert got[0, 1, 0].tolist() == [-2.0, -1.0, 0.0, -1.0, -2.0, -3.0]  # query 0 sits at key position 2
    table = torch.arange(10.0).view(2, 5)  # R = 2
    got = L.relative_position_bias(table).reference(s)
    assert got[0, 1, 0].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0, 9.0]  # table[1, clamp(j - 2, -2, 2) + 2]
    docs = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    keep = L.document(docs, causal=True).reference(torch.zeros(1, 1, 4, 4)).isfinite()[0, 0]
    assert keep.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert torch.allclose(L.softcap(2.0).reference(torch.tensor([10.0])), torch.tensor([2.0 * math.tanh(5.0)]))


@pytest.mark.parametrize("call, match", [
    (lambda: L.sliding_window(-1), "must be >= 0"),
    (lambda: L.prefix_lm(-3), "must be >= 0"),
    (lambda: L.document(torch.zeros(2, 3)), "int32"),
    (lambda: L.alibi(torch.zeros(2, 2)), r"fp32 \(H,\)"),
    (lambda: L.relative_position_bias(torch.zeros(2, 4)), r"\(H, 2R \+ 1\)"),
    (lambda: L.softcap(0.0), "> 0"),
    (lambda: L.combine(L.causal(), L.softcap(1.0)), "a Mods with a score_mod"),
    (lambda: L.combine(L.alibi(torch.zeros(2)), L.document(torch.zeros(1, 2, dtype=torch.int32))), "both read"),
])
def test_bad_arguments_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_functions_are_built_once_per_constant():
    assert L.sliding_window(8, 0).mask_mod is L.sliding_window(8, 0).mask_mod
    assert L.sliding_window(8, 0).mask_mod is not L.sliding_window(9, 0).mask_mod
    assert L.softcap(3.0).score_mod is L.softcap(3).score_mod
    assert L.alibi(torch.zeros(2)).score_mod is L.alibi(torch.ones(3)).score_mod  # slopes are runtime values


@pytest.mark.parametrize("name", list(_cases()))
def test_every_mod_compiles_for_sm90a(tmp_path, name):
    m = _cases()[name]
    spec = mods.aux_spec(m.aux_tensors, CPU) if m.aux_tensors else ()
    mods.compile_fwd_mods(torch.bfloat16, 128, False, dump_dir=str(tmp_path), score_mod=m.score_mod,
                          mask_mod=m.mask_mod, spec=spec)
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert "wgmma.mma_async" in text
    if m.aux_tensors:
        assert "ld.global" in text  # the mod reads its aux tensor in the loop
    if "softcap" in name:
        assert "tanh.approx.f32" in text
    if m.score_mod is not None:  # and its backward kernel, with score_mod_bwd
        kernels.compile_bwd(torch.bfloat16, 128, False, "sm_90a", score_mod=m.score_mod,
                            score_mod_bwd=m.score_mod_bwd, mask_mod=m.mask_mod, spec=spec)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("Sq", [256, 200])
def test_every_mod_matches_its_reference(cute_env, name, Sq):
    """Forward and gradients of each ready mod against its reference (Sq < Sk: the bottom-right alignment)."""
    from flash_attn.cute import interface

    cute_env()
    S = 256
    if "document" in name:
        Sq = S  # self-attention over packed documents
    m = _cases("cuda", S=S)[name]
    torch.manual_seed(3)
    B, H, d = 2, 4, 128
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    out = interface.flash_attn_func(q, k, v, **m.kwargs())[0]
    out.backward(dout)

    def reference(dtype):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        s = (qr.transpose(1, 2) @ kr.transpose(1, 2).transpose(-1, -2)).float() * d ** -0.5
        p = torch.softmax(m.reference(s), -1).nan_to_num(0.0).to(dtype)
        o = (p @ vr.transpose(1, 2)).transpose(1, 2)
        o.backward(dout.to(dtype))
        return [o.float()] + [t.grad.float() for t in (qr, kr, vr)]

    m_.assert_close_to_oracle((out, q.grad, k.grad, v.grad), reference(torch.float32), reference(torch.bfloat16),
                              where=(name, Sq))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("varlen", [False, True])
def test_native_softcap_with_a_mask_mod(cute_env, varlen):
    """softcap= with a mask_mod (FA4 turns the cap into a score_mod): forward and gradients against softcap's and the
    mask's references applied in turn, dense and varlen (forward)."""
    from flash_attn.cute import interface

    cute_env()
    torch.manual_seed(5)
    B, S, H, d, cap = 2, 256, 4, 128, 5.0
    mask = L.sliding_window(40, 0)
    q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=not varlen)
               for _ in range(3))
    dout = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    if varlen:
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
        out = interface.flash_attn_varlen_func(*(t.reshape(B * S, H, d) for t in (q, k, v)), cu_seqlens_q=cu,
                                               cu_seqlens_k=cu, mask_mod=mask.mask_mod, softcap=cap)[0].view(B, S, H, d)
    else:
        out = interface.flash_attn_func(q, k, v, mask_mod=mask.mask_mod, softcap=cap)[0]
        out.backward(dout)

    def reference(dtype):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        s = (qr.transpose(1, 2) @ kr.transpose(1, 2).transpose(-1, -2)).float() * d ** -0.5
        p = torch.softmax(mask.reference(L.softcap(cap).reference(s)), -1).to(dtype)
        o = (p @ vr.transpose(1, 2)).transpose(1, 2)
        o.backward(dout.to(dtype))
        return [o.float()] + [t.grad.float() for t in (qr, kr, vr)]

    got = (out,) if varlen else (out, q.grad, k.grad, v.grad)
    m_.assert_close_to_oracle(got, reference(torch.float32), reference(torch.bfloat16), where=(varlen,))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("name", ["sliding_window", "alibi_causal"])
def test_learnable_sink_with_mods(cute_env, varlen, name):
    """A learnable sink with a mask_mod / score_mod: forward, lse and the gradients of q, k, v and the sink against
    the reference (one more softmax term exp(sink) per row, no value), dense and varlen."""
    from flash_attn.cute import interface

    cute_env()
    torch.manual_seed(6)
    B, S, H, d = 2, 256, 4, 128
    m = {"sliding_window": L.sliding_window(40, 0),
         "alibi_causal": L.combine(L.alibi(L.alibi_slopes(H).cuda()), L.causal())}[name]
    q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sink = torch.randn(H, device="cuda", dtype=torch.float32, requires_grad=True)
    dout = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    if varlen:
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
        out, lse = interface.flash_attn_varlen_func(*(t.reshape(B * S, H, d) for t in (q, k, v)), cu_seqlens_q=cu,
                                                    cu_seqlens_k=cu, learnable_sink=sink, return_lse=True,
                                                    **m.kwargs())
        out, lse = out.view(B, S, H, d), lse.view(H, B, S).transpose(0, 1)
    else:
        out, lse = interface.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **m.kwargs())
    out.backward(dout)

    def reference(dtype):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        sr = sink.detach().clone().requires_grad_()
        s = (qr.transpose(1, 2) @ kr.transpose(1, 2).transpose(-1, -2)).float() * d ** -0.5
        s = torch.cat([m.reference(s), sr.view(1, H, 1, 1).expand(B, H, S, 1)], -1)
        p = torch.softmax(s, -1)[..., :-1].to(dtype)
        o = (p @ vr.transpose(1, 2)).transpose(1, 2)
        o.backward(dout.to(dtype))
        return [o.float(), torch.logsumexp(s, -1)] + [t.grad.float() for t in (qr, kr, vr, sr)]

    got = (out, lse, q.grad, k.grad, v.grad, sink.grad)
    m_.assert_close_to_oracle(got, reference(torch.float32), reference(torch.bfloat16), names=["o", "lse", "q", "k",
                                                                                                 "v", "sink"],
                              where=(name, varlen))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("window", [(40, 0), (24, 16)])
def test_score_mod_with_a_native_window(cute_env, varlen, window):
    """A score_mod (ALiBi) with window_size: forward and gradients (the backward kernel built with the window) against
    the score mod's and the window's references applied in turn, dense and varlen."""
    from flash_attn.cute import interface

    cute_env()
    torch.manual_seed(7)
    B, S, H, d = 2, 256, 4, 128
    score = L.alibi(L.alibi_slopes(H).cuda())
    mask = L.sliding_window(*window)
    q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    kw = dict(window_size=window, causal=window[1] == 0, **score.kwargs())
    if varlen:
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device="cuda")
        out = interface.flash_attn_varlen_func(*(t.reshape(B * S, H, d) for t in (q, k, v)), cu_seqlens_q=cu,
                                               cu_seqlens_k=cu, **kw)[0].view(B, S, H, d)
    else:
        out = interface.flash_attn_func(q, k, v, **kw)[0]
    out.backward(dout)

    def reference(dtype):
        qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        s = (qr.transpose(1, 2) @ kr.transpose(1, 2).transpose(-1, -2)).float() * d ** -0.5
        p = torch.softmax(mask.reference(score.reference(s)), -1).to(dtype)
        o = (p @ vr.transpose(1, 2)).transpose(1, 2)
        o.backward(dout.to(dtype))
        return [o.float()] + [t.grad.float() for t in (qr, kr, vr)]

    m_.assert_close_to_oracle((out, q.grad, k.grad, v.grad), reference(torch.float32), reference(torch.bfloat16),
                              where=(window, varlen))
