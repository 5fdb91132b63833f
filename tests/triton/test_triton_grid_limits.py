"""The Triton backend's calls with more (sequence, head) pairs than a grid's y extent (CUDA: 65535, the kernels'
axis 1) run as launches on chunks of the batch or of the sequences (backend._MAX_GRID_Y, _fwd_chunked,
_bwd_chunked). On the CPU (interpreter) with the limit lowered: the chunked results equal the one-launch results
bit for bit (dense, varlen with empty sequences, GQA, causal, ALiBi per sequence, gradients into given tensors),
and dropout keeps one mask per chunk that the backward finds again (checked against the reference with that mask)."""
import pytest
import torch

import flash_attn
from flash_attn import testing
from flash_attn.triton import backend as tb
from flash_attn.testing import backend_bwd, backend_fwd

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16


def _kw(D, Sq, Sk, causal=False, **extra):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=Sq, max_seqlen_k=Sk, block_table=None,
                softmax_scale=D ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_state=None, **extra)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, DTYPE)


def _fwd_bwd(q, k, v, dout, kw, grads=None):
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    dq, dk, dv = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, grads=grads, **kw)
    return out, lse, dq, dk, dv


@pytest.fixture
def chunk_spy(monkeypatch):
    """Lowers the limit to 6 (pairs) and counts the launches of the one-chunk paths."""
    calls = {"fwd": 0, "bwd": 0}
    fwd, bwd_chunked = tb._fwd, tb._bwd_chunked

    def spy_fwd(*a):
        calls["fwd"] += 1
        return fwd(*a)

    def spy_bwd(*a):
        calls["bwd"] += 1
        return bwd_chunked(*a)

    monkeypatch.setattr(tb, "_fwd", spy_fwd)
    monkeypatch.setattr(tb, "_bwd_chunked", spy_bwd)
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_dense_chunks_match_one_launch(monkeypatch, chunk_spy, causal):
    B, Sq, Sk, H, Hk, D = 7, 19, 33, 2, 1, 32
    q, k, v, dout = _rand(B, Sq, H, D, seed=1), _rand(B, Sk, Hk, D, seed=2), _rand(B, Sk, Hk, D, seed=3), \
        _rand(B, Sq, H, D, seed=4)
    slopes = (torch.rand(B, H, generator=torch.Generator().manual_seed(5)) * 0.5).to(DEVICE)
    kw = _kw(D, Sq, Sk, causal)
    kw["alibi_slopes"] = slopes
    whole = _fwd_bwd(q, k, v, dout, kw)
    assert chunk_spy == {"fwd": 1, "bwd": 0}
    monkeypatch.setattr(tb, "_MAX_GRID_Y", 6)  # 3 sequences x 2 heads per launch: chunks of 3, 3, 1
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    chunked = _fwd_bwd(q, k, v, dout, kw, grads=grads)
    assert chunk_spy["fwd"] == 1 + 3 and chunk_spy["bwd"] == 1
    assert all(a is b for a, b in zip(chunked[2:], grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), whole, chunked):
        assert torch.equal(a, b), name
    launches = chunk_spy["fwd"]
    with flash_attn.use_backend("triton"):
        out = flash_attn.flash_attn_func(q, k, v, causal=causal)  # the API's common call is chunked alike
    assert chunk_spy["fwd"] == launches + 3
    kw["alibi_slopes"] = None
    monkeypatch.setattr(tb, "_MAX_GRID_Y", 65535)
    ref_out, _, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    assert torch.equal(out, ref_out)


def test_varlen_chunks_match_one_launch(monkeypatch, chunk_spy):
    lens_q, lens_k = [5, 0, 17, 3, 9, 1, 12], [9, 4, 17, 0, 30, 2, 12]
    H, Hk, D = 2, 2, 32
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(DEVICE, torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(DEVICE, torch.int32)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q, k, v, dout = _rand(Tq, H, D, seed=1), _rand(Tk, Hk, D, seed=2), _rand(Tk, Hk, D, seed=3), \
        _rand(Tq, H, D, seed=4)
    kw = _kw(D, max(lens_q), max(lens_k), causal=True)
    kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    whole = _fwd_bwd(q, k, v, dout, kw)
    monkeypatch.setattr(tb, "_MAX_GRID_Y", 4)  # 2 sequences x 2 heads per launch: 4 launches
    chunked = _fwd_bwd(q, k, v, dout, kw)
    assert chunk_spy["fwd"] == 1 + 4 and chunk_spy["bwd"] == 1
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), whole, chunked):
        assert torch.equal(a, b), name


def test_dropout_masks_per_chunk_match_forward_and_backward(monkeypatch):
    """Each chunk's mask is the shared hash's with the chunk's seeds (the call's, first one + chunk index): the
    forward's S_dmask shows it, and the gradients match the reference with that mask."""
    B, Sq, Sk, H, Hk, D, p = 5, 21, 27, 2, 2, 32, 0.2
    q, k, v, dout = _rand(B, Sq, H, D, seed=1), _rand(B, Sk, Hk, D, seed=2), _rand(B, Sk, Hk, D, seed=3), \
        _rand(B, Sq, H, D, seed=4)
    rng_state = torch.tensor([987654321, 123456789], dtype=torch.int64)
    kw = _kw(D, Sq, Sk)
    kw.update(dropout_p=p, rng_state=rng_state)
    monkeypatch.setattr(tb, "_MAX_GRID_Y", 4)  # chunks of 2, 2, 1 batch entries
    out, lse, probs = backend_fwd(tb, q, k, v, return_probs=True, **kw)
    dq, dk, dv = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=False, **kw)
    chunks = tb._batch_chunks(B, H)
    assert chunks == [(0, 2), (2, 4), (4, 5)]
    keep = torch.cat([testing.dropout_keep_mask(tb._chunk_rng(rng_state, c), p, hi - lo, H, Sq, Sk, device=DEVICE)
                      for c, (lo, hi) in enumerate(chunks)])
    assert torch.equal(probs > 0, keep)
    assert not torch.equal(keep[0], keep[2])  # the chunks' masks differ (same index within their launches)
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = testing.attention_ref(qr, kr, vr, dropout_p=p, dropout_mask=keep, upcast=upcast,
                                     reorder_ops=not upcast)
        results.append((o.detach(), *torch.autograd.grad(o, (qr, kr, vr), dout)))
    for name, a, r, pt in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), *results):
        testing.assert_close_to_ref(a, r, pt, name)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_more_pairs_than_a_grid_holds_on_gpu():
    """33000 sequences x 2 heads (> 65535 pairs): forward and backward through real launches, dense and varlen,
    against the reference (before: an error at launch)."""
    B, S, H, D = 33000, 4, 2, 64
    q, k, v, dout = (_rand(B, S, H, D, seed=i) for i in range(4))
    kw = _kw(D, S, S, causal=True)
    out, lse, dq, dk, dv = _fwd_bwd(q, k, v, dout, kw)
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = testing.attention_ref(qr, kr, vr, causal=True, upcast=upcast, reorder_ops=not upcast)
        results.append((o.detach(), *torch.autograd.grad(o, (qr, kr, vr), dout)))
    for name, a, r, pt in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), *results):
        testing.assert_close_to_ref(a, r, pt, name)
    cu = torch.arange(0, S * B + 1, S, device=DEVICE, dtype=torch.int32)
    kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    flat = [t.flatten(0, 1) for t in (q, k, v, dout)]
    out_v, _, dq_v, dk_v, dv_v = _fwd_bwd(*flat, kw)
    for name, a, r, pt in zip(("out", "dq", "dk", "dv"), (out_v, dq_v, dk_v, dv_v), *results):
        testing.assert_close_to_ref(a.view_as(r), r, pt, name + " (varlen)")
