"""FA2's lower-level functions and autograd classes (flash_attn.fa2_private, imported from
flash_attn.flash_attn_interface as downstream libraries import them): FA2's signatures and return values, the same
results as the public functions, dropout replayed from the returned rng_state, and clear refusals."""
import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func, reference
from flash_attn.flash_attn_interface import (
    FlashAttnFunc,
    FlashAttnKVPackedFunc,
    FlashAttnQKVPackedFunc,
    FlashAttnVarlenFunc,
    FlashAttnVarlenKVPackedFunc,
    FlashAttnVarlenQKVPackedFunc,
    _flash_attn_backward,
    _flash_attn_forward,
    _flash_attn_varlen_backward,
    _flash_attn_varlen_forward,
)
from flash_attn.testing import backend_bwd, backend_fwd

F32 = torch.float32  # (the reference computes fp32 inputs in fp64)


def _qkv(B=2, Sq=9, Sk=13, H=4, Hk=2, D=16, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g, dtype=dtype), torch.randn(B, Sk, Hk, D, generator=g, dtype=dtype),
            torch.randn(B, Sk, Hk, D, generator=g, dtype=dtype))


def _grads(fn, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                    (False, (3, 2), 0.0), (True, (-1, -1), 5.0)])
def test_dense_forward_and_backward_match_the_public_function(causal, window, softcap):
    q, k, v = _qkv()
    dout = torch.randn(q.shape, dtype=F32, generator=torch.Generator().manual_seed(9))
    out, lse, probs, rng_state = _flash_attn_forward(q, k, v, 0.0, None, causal, window[0], window[1], softcap,
                                                     None, False)
    want = _grads(lambda a, b, c: flash_attn_func(a, b, c, causal=causal, window_size=window, softcap=softcap),
                  q, k, v, dout)
    assert torch.equal(out, want[0]) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert probs.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    delta = _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, causal, window[0], window[1],
                                 softcap, None, False)
    for got, w in zip((dq, dk, dv), want[1:]):
        torch.testing.assert_close(got, w)
    torch.testing.assert_close(delta, (dout * out).sum(-1).transpose(1, 2).float())
    # the probabilities, as flash_attn_func(return_attn_probs=True) gives them
    _, _, probs, _ = _flash_attn_forward(q, k, v, 0.0, None, causal, window[0], window[1], softcap, None, True)
    assert torch.equal(probs, flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                              return_attn_probs=True)[2])


def test_dropout_replays_from_the_returned_rng_state():
    q, k, v = _qkv(dtype=torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    out, lse, _, rng_state = _flash_attn_forward(q, k, v, 0.3, 0.25, True, -1, -1, 0.0, None, False)
    kw = dict(softmax_scale=0.25, causal=True, dropout_p=0.3, rng_state=rng_state)
    ref_out, ref_lse, _ = backend_fwd(reference, q, k, v, **kw)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.25, True, -1, -1, 0.0, None, True, rng_state)
    for got, want in zip((dq, dk, dv), backend_bwd(reference, dout, q, k, v, out, lse, deterministic=True, **kw)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="rng_state"):
        _flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.3, 0.25, True, -1, -1, 0.0, None, True)


def _varlen(seed=0):
    lens_q, lens_k = [3, 0, 7], [5, 2, 9]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), 4, 16, generator=g, dtype=F32)
    k, v = (torch.randn(sum(lens_k), 2, 16, generator=g, dtype=F32) for _ in range(2))
    cu = [torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32) for lens in (lens_q, lens_k)]
    return q, k, v, cu[0], cu[1], max(lens_q), max(lens_k)


def test_varlen_forward_and_backward_match_the_public_function():
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    dout = torch.randn(q.shape, dtype=F32, generator=torch.Generator().manual_seed(3))
    out, lse, probs, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True, 4, 0)
    want = _grads(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_k, mq, mk, causal=True, window_size=(4, 0)),
                  q, k, v, dout)
    assert torch.equal(out, want[0]) and lse.shape == (4, q.shape[0]) and probs.numel() == 0
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    delta = _flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, mq, mk, 0.0, None, True, 4, 0,
                                        0.0, None, False)
    for got, w in zip((dq, dk, dv), want[1:]):
        torch.testing.assert_close(got, w)
    assert delta.shape == (4, q.shape[0])
    for name, kw in (("leftpad_k", dict(leftpad_k=cu_k[:-1])), ("seqused_k", dict(seqused_k=cu_k[1:]))):
        with pytest.raises(NotImplementedError, match=name):
            _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, 0.0, None, True, **kw)


def test_autograd_classes_match_the_public_functions():
    q, k, v = _qkv(Sq=11, Sk=11, Hk=4)  # (the qkv-packed form: one length, as many heads)
    dout = torch.randn(q.shape, dtype=F32, generator=torch.Generator().manual_seed(5))
    args = (0.0, None, True, (-1, -1), 0.0, None, False, False, True)  # dropout .. return_softmax, is_grad_enabled
    want = _grads(lambda a, b, c: flash_attn_func(a, b, c, causal=True), q, k, v, dout)
    got = _grads(lambda a, b, c: FlashAttnFunc.apply(a, b, c, *args), q, k, v, dout)
    packed = _grads(lambda a, b, c: FlashAttnQKVPackedFunc.apply(torch.stack((a, b, c), 2), *args), q, k, v, dout)
    kv = _grads(lambda a, b, c: FlashAttnKVPackedFunc.apply(a, torch.stack((b, c), 2), *args), q, k, v, dout)
    for res in (got, packed, kv):
        for a, b in zip(res, want):
            torch.testing.assert_close(a, b)
    out, lse, probs = FlashAttnFunc.apply(q, k, v, 0.0, None, True, (-1, -1), 0.0, None, False, True, False)
    assert lse.shape == (2, 4, 11) and probs.shape == (2, 4, 11, 11)

    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    k, v = k.repeat(1, 2, 1), v.repeat(1, 2, 1)  # as many heads as q (the qkv-packed form)
    dout = torch.randn(q.shape, dtype=F32, generator=torch.Generator().manual_seed(6))
    vargs = (0.0, None, False, (-1, -1), 0.0, None, False, False)
    want = _grads(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_k, mq, mk), q, k, v, dout)
    got = _grads(lambda a, b, c: FlashAttnVarlenFunc.apply(a, b, c, cu_q, cu_k, mq, mk, *vargs, None, True),
                 q, k, v, dout)
    kv = _grads(lambda a, b, c: FlashAttnVarlenKVPackedFunc.apply(a, torch.stack((b, c), 1), cu_q, cu_k, mq, mk,
                                                                  *vargs, True), q, k, v, dout)
    for res in (got, kv):
        for a, b in zip(res, want):
            torch.testing.assert_close(a, b)
    # qkv-packed: one set of sequences for q, k and v
    k, v = (t[: q.shape[0]] for t in (k, v))
    want = _grads(lambda a, b, c: flash_attn_varlen_func(a, b, c, cu_q, cu_q, mq, mq), q, k, v, dout)
    packed = _grads(lambda a, b, c: FlashAttnVarlenQKVPackedFunc.apply(torch.stack((a, b, c), 1), cu_q, mq, *vargs,
                                                                       True), q, k, v, dout)
    for a, b in zip(packed, want):
        torch.testing.assert_close(a, b)
