"""FA4's learnable sink in the root API (flash_attn_func and its packed / varlen forms, flash_attn_with_kvcache) on
every backend: one logit per query head, not scaled by softmax_scale, joining each softmax row as a term exp(sink)
with no value; the lse includes it, a row that sees no key gets out 0 and lse = sink, and the sink gets a gradient.

The oracle is flash_attn.testing.attention_ref / attention_lse_ref with ``learnable_sink``, differentiated by
autograd (fp64 for fp32 inputs); the criterion is assert_close_to_ref's (2x PyTorch's own error at the input dtype
plus its rounding). CPU: the reference backend (small tiles, so the sink meets many blocks), and the Triton backend in
Triton's interpreter (fp16 / fp32, a few small cases: the interpreter is slow). GPU-marked: Triton and cute on CUDA.
"""
import contextlib
import math

import pytest
import torch

import flash_attn
from flash_attn import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_attn import reference as R
from flash_attn.testing import (
    assert_close_to_ref,
    attention_lse_ref,
    attention_ref,
    backend_bwd,
    backend_fwd,
    backend_fwd_kvcache,
    cu_seqlens_from_seqlens,
    padded_to_varlen,
    padding_mask_from_seqlens,
)

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # The reference backend's tiles made small: the sink joins rows after many key blocks, and whole query blocks
    # that see no key are skipped.
    monkeypatch.setattr(R, "BLOCK_K", 8)
    monkeypatch.setattr(R, "BLOCK_Q", 4)


def _inputs(B, Sq, Sk, H, Hk, D, dtype, device="cpu", seed=0):
    """q, k, v, sink (leaves that need gradients; the sink fp32 with logits of the scores' size), dout, dlse."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(device, dtype).requires_grad_()
    k = torch.randn(B, Sk, Hk, D, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(B, Sk, Hk, D, generator=g).to(device, dtype).requires_grad_()
    sink = (torch.randn(H, generator=g) + 1.0).to(device).requires_grad_()
    dout = torch.randn(B, Sq, H, D, generator=g).to(device, dtype)
    dlse = torch.randn(B, H, Sq, generator=g).to(device)
    return q, k, v, sink, dout, dlse


def _grads(out, lse, dout, dlse, inputs):
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:  # (rows of +inf lse, padding or no key and no sink, have no gradient)
        loss = loss + (torch.where(torch.isfinite(lse), lse.float(), 0.0) * dlse).sum()
    return torch.autograd.grad(loss, inputs)


def _oracle(q, k, v, sink, dout, dlse, **kw):
    """[(out, lse, dq, dk, dv, dsink) of the upcast oracle, the same by PyTorch at the input dtype]."""
    results = []
    for upcast in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
        out, _ = attention_ref(*leaves[:3], learnable_sink=leaves[3], upcast=upcast, reorder_ops=not upcast, **kw)
        lse = attention_lse_ref(*leaves[:2], learnable_sink=leaves[3], **{
            n: kw[n] for n in kw if n not in ("dropout_p", "dropout_mask")})
        results.append((out.detach(), lse.detach(), *_grads(out, lse, dout, dlse, leaves)))
    return results


def _check(ours, ref, pt):
    """ours / ref / pt: (out, lse, dq, dk, dv, dsink)."""
    for name, a, r, p in zip(("out", "lse", "dq", "dk", "dv", "dsink"), ours, ref, pt):
        if name == "lse":
            if a is None:
                continue
            finite = torch.isfinite(r)
            assert torch.equal(torch.isfinite(a), finite), "lse: +inf rows differ"
            torch.testing.assert_close(a[finite], r[finite].float(), rtol=1e-5, atol=1e-4)
            continue
        # (the sink's gradient is an fp32 sum over rows whose fp32 error can round to 0 in PyTorch's: allow ulps)
        assert_close_to_ref(a, r, p, name, fp32_ulps=8 if name == "dsink" else None)


def _dense_case(dtype, B=2, Sq=13, Sk=19, H=4, Hk=2, D=16, lse_grad=True, device="cpu", seed=0, **kw):
    q, k, v, sink, dout, dlse = _inputs(B, Sq, Sk, H, Hk, D, dtype, device, seed)
    dlse = dlse if lse_grad else None
    if lse_grad:  # (the root API returns lse with the probabilities)
        out, lse, _ = flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True, **kw)
    else:  # the out-only call: no lse to compare, none in the loss
        out, lse = flash_attn_func(q, k, v, learnable_sink=sink, **kw), None
    ours = (out.detach(), None if lse is None else lse.detach(), *_grads(out, lse, dout, dlse, (q, k, v, sink)))
    ref_kw = {n: kw[n] for n in ("causal", "window_size", "softcap", "alibi_slopes", "softmax_scale") if n in kw}
    _check(ours, *_oracle(q, k, v, sink, dout, dlse, **ref_kw))
    return q, k, v, sink, ours


# ----------------------------------------------------------------------------------------------------
# The reference backend (the CPU's default)

CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_rows_without_keys": dict(causal=True, Sq=23, Sk=9),
    "window": dict(window_size=(5, 3)),
    "causal_window_mqa": dict(causal=True, window_size=(4, -1), H=4, Hk=1),
    "softcap_alibi_scale": dict(softcap=5.0, alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.05]), softmax_scale=0.4),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_dense_matches_reference(dtype, case):
    _dense_case(dtype, **CASES[case])


def test_out_only_loss_gives_the_sink_its_gradient():
    # no gradient flows into lse (the out-only call): the backward takes the path without dlse
    _dense_case(torch.float32, causal=True, lse_grad=False)


def test_rows_without_keys_get_zero_out_and_the_sink_as_lse():
    # causal, Sq = 11 > Sk = 4: the first 7 rows of each sequence see no key
    q, k, v, sink, (out, lse, dq, *_) = _dense_case(torch.float32, causal=True, Sq=11, Sk=4)
    assert torch.equal(out[:, :7], torch.zeros_like(out[:, :7]))
    assert torch.equal(lse[:, :, :7], sink.detach().view(1, -1, 1).expand(2, 4, 7))
    assert torch.equal(dq[:, :7], torch.zeros_like(dq[:, :7]))


def test_sink_of_minus_infinity_is_no_sink():
    # a -inf sink is no term at all: bitwise the call without one, +inf lse of rows without keys included
    q, k, v, _, dout, dlse = _inputs(2, 11, 6, 4, 2, 16, torch.float32)
    sink = torch.full((4,), -math.inf, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
    grads = _grads(out, lse, dout, dlse, (q, k, v, sink))
    out0, lse0, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    grads0 = _grads(out0, lse0, dout, dlse, (q, k, v))
    assert torch.equal(out, out0) and torch.equal(lse, lse0) and torch.isinf(lse0[:, :, :5]).all()
    for g, g0 in zip(grads, grads0):
        assert torch.equal(g, g0)
    assert torch.equal(grads[3], torch.zeros(4))


def test_probabilities_leave_out_the_sink_share():
    q, k, v, sink, _, _ = _inputs(1, 7, 9, 2, 2, 16, torch.float32)
    _, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
    _, probs_ref = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    torch.testing.assert_close(probs, probs_ref.float())
    # each row's probabilities sum to 1 - exp(sink - lse)
    share = torch.exp(sink.detach().view(1, -1, 1) - lse)
    torch.testing.assert_close(probs.sum(-1), 1 - share)


def test_sink_in_bf16_and_fp16_gets_a_gradient_in_its_dtype():
    q, k, v, _, dout, _ = _inputs(1, 9, 9, 2, 2, 16, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        sink = torch.tensor([0.5, -1.0], dtype=dtype, requires_grad=True)
        out = flash_attn_func(q, k, v, learnable_sink=sink)
        (dsink,) = torch.autograd.grad(out, sink, dout)
        ref_sink = sink.detach().double().requires_grad_()
        ref, _ = attention_ref(*(t.detach().double() for t in (q, k, v)), learnable_sink=ref_sink)
        (dsink_ref,) = torch.autograd.grad(ref, ref_sink, dout.double())
        assert dsink.dtype == dtype
        torch.testing.assert_close(dsink, dsink_ref.to(dtype))


def test_only_the_sink_needs_a_gradient():
    q, k, v, sink, dout, _ = _inputs(1, 8, 8, 2, 2, 16, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    (dsink,) = torch.autograd.grad(out, sink, dout)
    ref_sink = sink.detach().double().requires_grad_()
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=True, learnable_sink=ref_sink)
    (dsink_ref,) = torch.autograd.grad(ref, ref_sink, dout.double())
    torch.testing.assert_close(dsink, dsink_ref.float())


def _varlen_case(dtype, seqlens_q, seqlens_k, H=4, Hk=2, D=16, backend=None, **kw):
    """The varlen call against the oracle on padded tensors: out, lse, dq, dk, dv, d sink."""
    B, Sq, Sk = len(seqlens_q), max(seqlens_q), max(seqlens_k)
    q_pad, k_pad, v_pad, sink, dout_pad, dlse_pad = _inputs(B, Sq, Sk, H, Hk, D, dtype)
    mask_q = padding_mask_from_seqlens(torch.tensor(seqlens_q), Sq)
    mask_k = padding_mask_from_seqlens(torch.tensor(seqlens_k), Sk)
    q, cu_q, max_q = padded_to_varlen(q_pad.detach(), mask_q)
    k, cu_k, max_k = padded_to_varlen(k_pad.detach(), mask_k)
    v, _, _ = padded_to_varlen(v_pad.detach(), mask_k)
    dout, _, _ = padded_to_varlen(dout_pad, mask_q)
    dlse = padded_to_varlen(dlse_pad.transpose(1, 2), mask_q)[0].t()  # (H, total_q)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with flash_attn.use_backend(backend) if backend else contextlib.nullcontext():
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, learnable_sink=sink,
                                             return_attn_probs=True, **kw)
        grads = _grads(out, lse, dout, dlse, (q, k, v, sink))
    # the oracle's results on the valid rows, packed like ours
    ref_kw = dict(query_padding_mask=mask_q, key_padding_mask=mask_k, **kw)
    packed = []
    for out_r, lse_r, dq_r, dk_r, dv_r, dsink_r in _oracle(q_pad, k_pad, v_pad, sink, dout_pad, dlse_pad, **ref_kw):
        packed.append((padded_to_varlen(out_r, mask_q)[0], padded_to_varlen(lse_r.transpose(1, 2), mask_q)[0].t(),
                       padded_to_varlen(dq_r, mask_q)[0], padded_to_varlen(dk_r, mask_k)[0],
                       padded_to_varlen(dv_r, mask_k)[0], dsink_r))
    _check((out.detach(), lse.detach(), *grads), *packed)
    return cu_q, out, lse, sink


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_reference(causal):
    # sequences: plain, no queries, no keys, more queries than keys (causal: rows without keys)
    cu_q, out, lse, sink = _varlen_case(torch.float32, [5, 0, 4, 9], [7, 3, 0, 4], causal=causal)
    rows = slice(int(cu_q[2]), int(cu_q[3]))  # the sequence without keys: out 0, lse = sink
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    assert torch.equal(lse[:, rows], sink.detach().view(-1, 1).expand(-1, 4))


def test_varlen_window_fp16():
    _varlen_case(torch.float16, [6, 11], [9, 8], window_size=(3, 2))


def test_packed_forms_take_the_sink():
    q, k, v, sink, dout, _ = _inputs(2, 8, 8, 4, 4, 16, torch.float32)
    q, k, v = q.detach(), k.detach(), v.detach()
    want = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    (dsink,) = torch.autograd.grad(want, sink, dout)
    qkv = torch.stack([q, k, v], 2)
    kv = torch.stack([k, v], 2)
    got = {
        "qkvpacked": lambda s: flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=s),
        "kvpacked": lambda s: flash_attn_kvpacked_func(q, kv, causal=True, learnable_sink=s),
    }
    cu = cu_seqlens_from_seqlens(torch.tensor([8, 8]))
    flat = lambda t: t.reshape(16, *t.shape[2:])  # noqa: E731
    got["varlen_qkvpacked"] = lambda s: flash_attn_varlen_qkvpacked_func(
        flat(qkv), cu, 8, causal=True, learnable_sink=s).view(2, 8, 4, 16)
    got["varlen_kvpacked"] = lambda s: flash_attn_varlen_kvpacked_func(
        flat(q), flat(kv), cu, cu, 8, 8, causal=True, learnable_sink=s).view(2, 8, 4, 16)
    for name, fn in got.items():
        s = sink.detach().clone().requires_grad_()
        out = fn(s)
        torch.testing.assert_close(out, want, msg=name)
        torch.testing.assert_close(torch.autograd.grad(out, s, dout)[0], dsink, msg=name)


def test_kvcache_matches_reference():
    # decode 2 new tokens per sequence into caches of different lengths, GQA, causal
    g = torch.Generator().manual_seed(3)
    B, S_cache, H, Hk, D = 2, 24, 4, 2, 16
    q = torch.randn(B, 2, H, D, generator=g)
    k_new, v_new = torch.randn(B, 2, Hk, D, generator=g), torch.randn(B, 2, Hk, D, generator=g)
    k_cache, v_cache = torch.randn(B, S_cache, Hk, D, generator=g), torch.randn(B, S_cache, Hk, D, generator=g)
    seqlens = torch.tensor([5, 17], dtype=torch.int32)
    sink = torch.randn(H, generator=g) + 1.0
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                       learnable_sink=sink, return_softmax_lse=True)
    for b in range(B):
        n = int(seqlens[b]) + 2
        kb, vb = k_cache[b:b + 1, :n], v_cache[b:b + 1, :n]
        ref, _ = attention_ref(q[b:b + 1], kb, vb, causal=True, learnable_sink=sink)
        torch.testing.assert_close(out[b:b + 1], ref)
        torch.testing.assert_close(lse[b:b + 1], attention_lse_ref(q[b:b + 1], kb, causal=True, learnable_sink=sink))


# ----------------------------------------------------------------------------------------------------
# Bad sinks


BAD = {
    "shape_more_heads": (lambda H: torch.zeros(H + 1), ValueError, r"learnable_sink must have shape \(4,\)"),
    "shape_2d": (lambda H: torch.zeros(1, H), ValueError, r"learnable_sink must have shape \(4,\)"),
    "shape_scalar": (lambda H: torch.zeros(()), ValueError, r"learnable_sink must have shape \(4,\)"),
    "dtype_int": (lambda H: torch.zeros(H, dtype=torch.int64), TypeError, "learnable_sink must have dtype"),
    "dtype_fp64": (lambda H: torch.zeros(H, dtype=torch.float64), TypeError, "learnable_sink must have dtype"),
    "not_a_tensor": (lambda H: [0.0] * H, TypeError, "learnable_sink must be a torch.Tensor"),
    "device": (lambda H: torch.zeros(H, device="meta"), ValueError, "learnable_sink is on meta but q is on cpu"),
}


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("api", ["func", "varlen", "kvcache"])
def test_bad_sink_is_refused(api, bad):
    make, error, message = BAD[bad]
    q = torch.randn(1, 4, 4, 16)
    sink = make(4)
    with pytest.raises(error, match=message):
        if api == "func":
            flash_attn_func(q, q, q, learnable_sink=sink)
        elif api == "varlen":
            cu = torch.tensor([0, 4], dtype=torch.int32)
            flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, learnable_sink=sink)
        else:
            flash_attn_with_kvcache(q, q, q, learnable_sink=sink)


# ----------------------------------------------------------------------------------------------------
# torch.compile (the custom ops carry the sink and its gradient)


def test_compile_fullgraph_with_sink_forward_and_backward():
    q, k, v, sink, dout, dlse = _inputs(2, 9, 7, 4, 2, 16, torch.float32)

    def f(q, k, v, sink):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
        return (out * dout).sum() + (lse * dlse).sum()

    eager = f(q, k, v, sink)
    grads = torch.autograd.grad(eager, (q, k, v, sink))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, sink)
    torch.testing.assert_close(compiled, eager)
    for g, g_eager in zip(torch.autograd.grad(compiled, (q, k, v, sink)), grads):
        torch.testing.assert_close(g, g_eager)


def test_compile_fullgraph_varlen_out_only():
    q = torch.randn(10, 2, 16, requires_grad=True)
    sink = torch.tensor([0.5, 2.0], requires_grad=True)
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)

    def f(q, sink):
        return flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, causal=True, learnable_sink=sink).square().sum()

    eager = f(q, sink)
    grads = torch.autograd.grad(eager, (q, sink))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, sink)
    torch.testing.assert_close(compiled, eager)
    for g, g_eager in zip(torch.autograd.grad(compiled, (q, sink)), grads):
        torch.testing.assert_close(g, g_eager)


def test_opcheck_fwd_with_sink():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 2, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 6, 1, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 6, 1, 16, generator=g, requires_grad=True)
    sink = torch.randn(2, generator=g, requires_grad=True)
    args = (q, k, v, None, None, 6, 6, None, 0.25, True, -1, 0, 0.0, None, 0.0, None, False, False, True, sink)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, args)


def test_opcheck_kvcache_with_sink():
    q = torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.zeros(2, 8, 1, 16), torch.zeros(2, 8, 1, 16)
    k, v = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 16)
    seqlens = torch.tensor([2, 5], dtype=torch.int32)
    args = (q, k_cache, v_cache, k, v, None, None, seqlens, None, None, None, 0.25, True, -1, 0, 0.0, True,
            None, 0, torch.tensor([0.5, -1.0]))
    torch.library.opcheck(torch.ops.flash_attn.fwd_kvcache.default, args)


# ----------------------------------------------------------------------------------------------------
# Triton in the interpreter (CPU): a handful of small cases


def _triton_or_skip():
    tb = pytest.importorskip("flash_attn.triton.backend")
    if tb.unavailable_reason() is not None:
        pytest.skip(tb.unavailable_reason())
    return tb


@pytest.mark.skipif(CUDA, reason="the CPU interpreter's cases (the GPU has its own)")
def test_triton_dense_fp16_causal_gqa_rows_without_keys():
    _triton_or_skip()
    with flash_attn.use_backend("triton"):
        _, _, _, sink, (out, lse, *_) = _dense_case(torch.float16, B=1, Sq=37, Sk=21, H=4, Hk=2, D=32, causal=True)
    assert torch.equal(out[:, :16], torch.zeros_like(out[:, :16]))
    # (the kernel's lse goes through log2 units: the sink within an fp32 rounding or two)
    torch.testing.assert_close(lse[:, :, :16], sink.detach().view(1, -1, 1).expand(1, 4, 16), rtol=1e-6, atol=0)


@pytest.mark.skipif(CUDA, reason="the CPU interpreter's cases (the GPU has its own)")
def test_triton_varlen_fp32_window():
    _triton_or_skip()
    _varlen_case(torch.float32, [9, 0, 20], [14, 5, 0], backend="triton", window_size=(6, 0))


@pytest.mark.skipif(CUDA, reason="the CPU interpreter's cases (the GPU has its own)")
def test_triton_sink_of_minus_infinity_is_no_sink():
    _triton_or_skip()
    q, k, v, _, _, _ = _inputs(1, 20, 12, 2, 2, 16, torch.float16)
    with flash_attn.use_backend("triton"):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                      learnable_sink=torch.full((2,), -math.inf))
        out0, lse0, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.skipif(CUDA, reason="the CPU interpreter's cases (the GPU has its own)")
def test_triton_warp_specialized_configs_take_sink_calls_correctly():
    # an explicit warp-specialized forward config: its kernel has no sink, so a sink call runs _fwd.py's; the
    # warp-specialized backward reads the sink-inclusive lse as it is
    tb = _triton_or_skip()
    from flash_attn.triton import _configs

    q, k, v, sink, dout, _ = _inputs(1, 32, 32, 2, 2, 32, torch.float16)
    q, k, v, sink = (t.detach() for t in (q, k, v, sink))
    kw = dict(softmax_scale=32 ** -0.5, causal=True, window_right=0, learnable_sink=sink)
    out, lse, _ = backend_fwd(tb, q, k, v, config=_configs.FwdConfig(16, 16, 1, 1, tma=True, variant=1), **kw)
    dq, dk, dv, dsink = backend_bwd(tb, dout, q, k, v, out, lse, config=_configs.BwdWsConfig(16, 32, 0, 0), **kw)
    ref, pt = _oracle(q, k, v, sink, dout, None, causal=True)
    _check((out, lse, dq, dk, dv, dsink), ref, pt)


@pytest.mark.skipif(CUDA, reason="the CPU interpreter's cases (the GPU has its own)")
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_kvcache_matches_reference_backend(num_splits):
    tb = _triton_or_skip()
    g = torch.Generator().manual_seed(5)
    B, S_cache, H, Hk, D = 2, 40, 4, 2, 16
    q = torch.randn(B, 3, H, D, generator=g, dtype=torch.float32)
    k_cache, v_cache = torch.randn(B, S_cache, Hk, D, generator=g), torch.randn(B, S_cache, Hk, D, generator=g)
    seqlens = torch.tensor([9, 30], dtype=torch.int32)
    sink = torch.tensor([0.5, 3.0, -1.0, -math.inf])
    kw = dict(cache_seqlens=seqlens, causal=True, window_left=-1, window_right=0, learnable_sink=sink,
              num_splits=num_splits)
    out, lse = backend_fwd_kvcache(tb, q, k_cache, v_cache, **kw)
    out_ref, lse_ref = backend_fwd_kvcache(R, q, k_cache, v_cache, **kw)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# GPU: Triton and cute on CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_triton_dense(dtype, D):
    _triton_or_skip()
    with flash_attn.use_backend("triton"):
        _dense_case(dtype, B=2, Sq=1000, Sk=700, H=8, Hk=2, D=D, causal=True, device="cuda", seed=D)
        _dense_case(dtype, B=2, Sq=512, Sk=777, H=4, Hk=4, D=D, window_size=(100, 30), device="cuda", seed=D + 1)


@pytest.mark.gpu
def test_gpu_triton_kvcache_matches_reference_backend():
    tb = _triton_or_skip()
    g = torch.Generator().manual_seed(6)
    B, S_cache, H, Hk, D = 3, 4096, 16, 2, 128
    q = torch.randn(B, 1, H, D, generator=g).cuda().half()
    k_cache = torch.randn(B, S_cache, Hk, D, generator=g).cuda().half()
    v_cache = torch.randn(B, S_cache, Hk, D, generator=g).cuda().half()
    seqlens = torch.tensor([100, 4000, 2500], dtype=torch.int32).cuda()
    sink = (torch.randn(H, generator=g) * 3).cuda()
    for splits in (1, 0):  # one split, and the kernel's own choice (several, for a batch this small)
        kw = dict(cache_seqlens=seqlens, causal=True, window_left=-1, window_right=0, learnable_sink=sink,
                  num_splits=splits)
        out, lse = backend_fwd_kvcache(tb, q, k_cache, v_cache, **kw)
        out_ref, lse_ref = backend_fwd_kvcache(R, q, k_cache, v_cache, **kw)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=2e-3)
        torch.testing.assert_close(lse, lse_ref, rtol=0, atol=1e-3)


def _cute_or_skip():
    pytest.importorskip("cutlass.cute")
    cb = pytest.importorskip("flash_attn.cute.backend")
    if cb.unavailable_reason() is not None:
        pytest.skip(cb.unavailable_reason())
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper (sm_90) GPU")
    return cb


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D,causal", [(torch.bfloat16, 64, True), (torch.float16, 128, False)])
def test_gpu_cute_dense(dtype, D, causal):
    # the forward on cute's sink kernel; the backward (dense, no window) on its backward kernel, from that lse
    _cute_or_skip()
    with flash_attn.use_backend("cute"):  # (out only: cute returns no probabilities, the root API's lse path)
        _dense_case(dtype, B=2, Sq=1024, Sk=768, H=8, Hk=2, D=D, causal=causal, device="cuda", seed=D, lse_grad=False)


@pytest.mark.gpu
def test_gpu_cute_varlen_and_paged_forward():
    _cute_or_skip()
    g = torch.Generator().manual_seed(9)
    seqlens_q, seqlens_k, H, Hk, D = [300, 0, 77, 512], [200, 64, 0, 900], 8, 2, 128
    cu_q = cu_seqlens_from_seqlens(torch.tensor(seqlens_q)).cuda()
    cu_k = cu_seqlens_from_seqlens(torch.tensor(seqlens_k)).cuda()
    q = torch.randn(sum(seqlens_q), H, D, generator=g).cuda().bfloat16()
    k = torch.randn(sum(seqlens_k), Hk, D, generator=g).cuda().bfloat16()
    v = torch.randn(sum(seqlens_k), Hk, D, generator=g).cuda().bfloat16()
    sink = torch.randn(H, generator=g).cuda()
    with flash_attn.use_backend("cute"):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
                                     learnable_sink=sink)
    with flash_attn.use_backend("torch"):
        want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
                                      learnable_sink=sink)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-2)
    # paged: the same keys in pages of 64 rows
    page, n_pages = 64, 16
    table = torch.randperm(4 * n_pages, generator=g)[:4 * n_pages].view(4, n_pages).int().cuda()
    k_pages = torch.zeros(4 * n_pages, page, Hk, D, dtype=k.dtype, device="cuda")
    v_pages = torch.zeros_like(k_pages)
    for b, n in enumerate(seqlens_k):
        rows = torch.arange(n, device="cuda")
        k_pages[table[b].long()[rows // page], rows % page] = k[cu_k[b]:cu_k[b + 1]]
        v_pages[table[b].long()[rows // page], rows % page] = v[cu_k[b]:cu_k[b + 1]]
    with flash_attn.use_backend("cute"):
        paged = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True,
                                       learnable_sink=sink, block_table=table)
    torch.testing.assert_close(paged, want, rtol=0, atol=2e-2)
