"""The gradient that flows into the returned lse (logsumexp of the scores), on every backend's backward.

d lse_i / d s_ij = P_ij, so a loss that uses lse adds dlse_i * P_ij to dS_ij (and nothing to dV): the backends
take it as delta_i - dlse_i in dS = P * (dP - delta). The oracle is fp64 autograd through the naive reference
(flash_attn.testing), whose lse is a plain logsumexp. On the CPU the Triton kernels run in the interpreter (fp32).
"""
import pytest
import torch

import flash_attn
from flash_attn.testing import attention_lse_ref, attention_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKENDS = ["torch", "triton"]


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _oracle(q, k, v, dout, wlse, **kw):
    """fp64 gradients of sum(out * dout) + sum(lse * wlse) (dout None: the lse term alone)."""
    qq, kk, vv = _leaves(*(t.double() for t in (q, k, v)))
    out, _ = attention_ref(qq, kk, vv, **kw)
    lse = attention_lse_ref(qq, kk, **kw).double()
    loss = (lse.masked_fill(lse.isinf(), 0.0) * wlse.double()).sum()
    if dout is not None:
        loss = loss + (out * dout.double()).sum()
    return torch.autograd.grad(loss, (qq, kk, vv), allow_unused=True)


def _loss(out, lse, dout, wlse):
    loss = (lse.masked_fill(lse.isinf(), 0.0) * wlse).sum()
    return loss if dout is None else loss + (out.float() * dout).sum()


def _check(got, want, scale=1.0):
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        w = torch.zeros_like(g, dtype=torch.float64) if w is None else w
        torch.testing.assert_close(g.double().cpu(), w.cpu(), rtol=2e-4, atol=2e-4 * scale, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [dict(causal=True), dict(window=(5, 3)), dict(softcap=4.0), dict()])
@pytest.mark.parametrize("lse_only", [False, True])
def test_dense_lse_gradient(backend, case, lse_only):
    g = torch.Generator().manual_seed(0)
    B, Sq, Sk, H, Hk, D = 2, 13, 21, 4, 2, 32
    q, k, v = (torch.randn(B, s, h, D, generator=g).to(DEVICE) for s, h in ((Sq, H), (Sk, Hk), (Sk, Hk)))
    dout = None if lse_only else torch.randn(B, Sq, H, D, generator=g).to(DEVICE)
    wlse = torch.randn(B, H, Sq, generator=g).to(DEVICE)
    window = case.get("window", (-1, -1))
    kw = dict(causal=case.get("causal", False), window_size=window, softcap=case.get("softcap", 0.0))
    qq, kk, vv = _leaves(q, k, v)
    with flash_attn.use_backend(backend):
        out, lse, _ = flash_attn.flash_attn_func(qq, kk, vv, return_attn_probs=True, **kw)
    assert lse.requires_grad
    got = torch.autograd.grad(_loss(out, lse, dout, wlse), (qq, kk, vv))
    _check(got, _oracle(q, k, v, dout, wlse, **kw))
    if lse_only:  # lse does not depend on v
        assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_lse_gradient(backend):
    g = torch.Generator().manual_seed(1)
    lens_q, lens_k, H, Hk, D = [5, 1, 9], [7, 4, 9], 2, 1, 32
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D, generator=g).to(DEVICE)
    k = torch.randn(int(cu_k[-1]), Hk, D, generator=g).to(DEVICE)
    v = torch.randn(int(cu_k[-1]), Hk, D, generator=g).to(DEVICE)
    dout = torch.randn(q.shape, generator=g).to(DEVICE)
    wlse = torch.randn(H, q.shape[0], generator=g).to(DEVICE)
    qq, kk, vv = _leaves(q, k, v)
    with flash_attn.use_backend(backend):
        out, lse, _ = flash_attn.flash_attn_varlen_func(qq, kk, vv, cu_q.to(DEVICE), cu_k.to(DEVICE), max(lens_q),
                                                        max(lens_k), causal=True, return_attn_probs=True)
    got = torch.autograd.grad(_loss(out, lse, dout, wlse), (qq, kk, vv))
    want = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        gb = _oracle(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], dout[None, q0:q1], wlse[None, :, q0:q1],
                     causal=True)
        want[0][q0:q1] += gb[0][0].cpu()
        want[1][k0:k1] += gb[1][0].cpu()
        want[2][k0:k1] += gb[2][0].cpu()
    _check(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_lse_changes_nothing(backend):
    """A returned lse that the loss does not use gives bitwise the gradients of a call that returns none."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 17, 2, 32, generator=g).to(DEVICE) for _ in range(3))
    dout = torch.randn(1, 17, 2, 32, generator=g).to(DEVICE)
    grads = []
    for probs in (False, True):
        qq, kk, vv = _leaves(q, k, v)
        with flash_attn.use_backend(backend):
            res = flash_attn.flash_attn_func(qq, kk, vv, causal=True, return_attn_probs=probs)
        out = res[0] if probs else res
        grads.append(torch.autograd.grad(out, (qq, kk, vv), dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_compiled_lse_gradient_and_no_lse_term_when_lse_is_not_returned(monkeypatch, request):
    """Under torch.compile the backward gets a tangent for every output (zeros for an unused lse): the lse term
    reaches the backend only when the call returns lse (return_attn_probs), and is then right."""
    from flash_attn import reference

    seen = []
    real = reference.bwd
    monkeypatch.setattr(reference, "bwd", lambda *a, **kw: seen.append("dlse" in kw) or real(*a, **kw))
    # (a graph cached on disk by an earlier process would skip the Python backward under test; the config's own
    # patch, since monkeypatch's undo leaves torch's config entry hidden for every later compile in the process)
    patch = torch.compiler.config.patch(force_disable_caches=True)
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 11, 2, 16, generator=g) for _ in range(3))
    dout, wlse = torch.randn(1, 11, 2, 16, generator=g), torch.randn(1, 2, 11, generator=g)

    def with_lse(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]

    def plain(q, k, v):
        return flash_attn.flash_attn_func(q, k, v, causal=True)

    torch._dynamo.reset()
    with flash_attn.use_backend("torch"):
        qq, kk, vv = _leaves(q, k, v)
        out, lse = torch.compile(with_lse, fullgraph=True)(qq, kk, vv)
        got = torch.autograd.grad(_loss(out, lse, dout, wlse), (qq, kk, vv))
        assert seen == [True]
        _check(got, _oracle(q, k, v, dout, wlse, causal=True))
        qq, kk, vv = _leaves(q, k, v)
        torch.autograd.grad(torch.compile(plain, fullgraph=True)(qq, kk, vv), (qq, kk, vv), dout)
        assert seen == [True, False]
