"""The reference backend keeps every tensor it makes on its inputs' device, whatever the default device is.

The meta device stands in for a GPU on a CPU-only machine: ops on meta tensors carry shapes, dtypes and devices
without data, and an op that mixes a meta tensor with a CPU one raises, as one that mixes CUDA and CPU tensors
does. Inputs on meta therefore show a tensor allocated on the default device (the CPU) where the inputs' device
was meant; and with the default device set to meta (``torch.set_default_device``, which users also set to
"cuda"), CPU inputs show the same from the other side, for the paths that read values on the host (varlen
offsets, the KV cache's lengths), which meta tensors cannot hold."""
import math

import pytest
import torch

from flash_attn import reference as R
from flash_attn.testing import backend_bwd, backend_fwd, backend_fwd_kvcache, paged_from_dense

META = torch.device("meta")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # Small tiles so that every call runs through several query and key blocks.
    monkeypatch.setattr(R, "BLOCK_K", 16)
    monkeypatch.setattr(R, "BLOCK_Q", 8)


@pytest.fixture
def default_device_meta():
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def _meta(x):
    return None if x is None else x.to(META)


def _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g).to(dtype), torch.randn(B, Sk, Hk, D, generator=g).to(dtype),
            torch.randn(B, Sk, Hk, Dv, generator=g).to(dtype))


def _assert_like(t, device, dtype, shape, name):
    assert t.device == device and t.dtype == dtype and tuple(t.shape) == tuple(shape), \
        (name, t.device, t.dtype, tuple(t.shape))


DENSE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True, window_right=0),
    "window": dict(window_left=5, window_right=3),
    "alibi_h": dict(alibi=(4,)),
    "alibi_bh": dict(alibi=(2, 4), causal=True, window_right=0),
    "softcap": dict(softcap=2.0),
    "dropout": dict(dropout_p=0.2, rng_state=torch.tensor([7, 9])),
    "sink": dict(sink=True, causal=True, window_right=0),
    "probs_dropout": dict(return_probs=True, dropout_p=0.2, rng_state=torch.tensor([1, 2])),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_on_meta(case, dtype):
    """Forward and backward of meta inputs: every output on meta with the contract's dtype and shape."""
    kw = dict(DENSE_CASES[case])
    B, Sq, Sk, H, Hk, D, Dv = 2, 20, 37, 4, 2, 16, 24
    q, k, v = (_meta(x) for x in _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype))
    shape = kw.pop("alibi", None)
    if shape is not None:
        kw["alibi_slopes"] = torch.rand(*shape, device=META)
    if kw.pop("sink", False):
        kw["learnable_sink"] = torch.randn(H, device=META)
    return_probs = kw.pop("return_probs", False)
    out, lse, probs = backend_fwd(R, q, k, v, softmax_scale=D ** -0.5, return_probs=return_probs, **kw)
    _assert_like(out, META, dtype, (B, Sq, H, Dv), "out")
    _assert_like(lse, META, torch.float32, (B, H, Sq), "lse")
    if return_probs:
        _assert_like(probs, META, torch.float32, (B, H, Sq, Sk), "probs")
    else:
        assert probs is None
    grads = backend_bwd(R, torch.ones_like(out), q, k, v, out, lse, softmax_scale=D ** -0.5, **kw)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _assert_like(g, META, dtype, x.shape, name)


def _varlen(dtype, paged):
    """Packed q, k, v of 4 sequences (one without queries, one without keys), cu_seqlens on the CPU, and a
    block_table when paged."""
    qlens, klens = [13, 0, 31, 7], [20, 9, 0, 7]
    H, Hk, D, Dv = 4, 2, 16, 24
    g = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + klens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(qlens), H, D, generator=g).to(dtype)
    k = torch.randn(sum(klens), Hk, D, generator=g).to(dtype)
    v = torch.randn(sum(klens), Hk, Dv, generator=g).to(dtype)
    bt = None
    if paged:
        Sk = max(klens)
        kp, vp = torch.zeros(4, Sk, Hk, D, dtype=dtype), torch.zeros(4, Sk, Hk, Dv, dtype=dtype)
        k, bt = paged_from_dense(kp, 4, num_blocks=3 * 4 * (-(-Sk // 4)), generator=g)
        v, _ = paged_from_dense(vp, 4, num_blocks=k.shape[0], block_table=bt)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(qlens), max_seqlen_k=max(klens),
              block_table=bt, softmax_scale=D ** -0.5, causal=True, window_right=0, alibi_slopes=None)
    return q, k, v, kw


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_varlen_on_meta(dtype, paged):
    """Varlen forward (with the dropout mask and P) and backward of meta q, k, v, block_table and alibi slopes
    (the offsets stay on the CPU: the backend reads them on the host, a meta tensor has no values)."""
    q, k, v, kw = _varlen(dtype, paged)
    q, k, v = _meta(q), _meta(k), _meta(v)
    kw.update(block_table=_meta(kw["block_table"]), alibi_slopes=torch.rand(4, 4, device=META), dropout_p=0.1,
              rng_state=torch.tensor([3, 4]))
    out, lse, probs = backend_fwd(R, q, k, v, return_probs=True, **kw)
    _assert_like(out, META, dtype, (q.shape[0], 4, 24), "out")
    _assert_like(lse, META, torch.float32, (4, q.shape[0]), "lse")
    _assert_like(probs, META, torch.float32, (4, 4, 31, 20), "probs")
    assert backend_fwd(R, q, k, v, return_probs=False, **kw)[2] is None
    grads = backend_bwd(R, torch.ones_like(out), q, k, v, out, lse, **kw)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _assert_like(g, META, dtype, x.shape, name)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_with_default_device_meta(paged, default_device_meta):
    with torch.device("cpu"):
        q, k, v, kw = _varlen(torch.float16, paged)
        want = backend_fwd(R, q, k, v, **kw)[:2]
        want_grads = backend_bwd(R, torch.ones_like(want[0]), q, k, v, *want, **kw)
    out, lse, _ = backend_fwd(R, q, k, v, **kw)
    grads = backend_bwd(R, torch.ones_like(out, device="cpu"), q, k, v, out, lse, **kw)
    for got, ref in zip((out, lse, *grads), (*want, *want_grads)):
        assert got.device == ref.device and torch.equal(got, ref)


KVCACHE_CASES = {
    # B = 3: a query position tensor of another batch size cannot broadcast against the 3 rows
    "rotary_noncausal": dict(rotary=True, causal=False),
    "rotary_causal": dict(rotary=True, causal=True),
    "leftpad_batch_idx": dict(leftpad=True, batch_idx=True, causal=True),
    "paged_rotary": dict(paged=True, rotary=True, causal=True),
    "paged_leftpad": dict(paged=True, leftpad=True, causal=False),
    "no_append": dict(append=False, causal=True),
}


def _kvcache_args(rotary=False, causal=True, leftpad=False, batch_idx=False, paged=False, append=True):
    B, Sq, S, H, Hk, D, s_new = 3, 2, 24, 4, 2, 16, 3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, Sq, H, D, generator=g).to(torch.float16)
    B_cache = B + 2 if batch_idx else B
    k_cache = torch.randn(B_cache, S, Hk, D, generator=g).to(torch.float16)
    v_cache = torch.randn(B_cache, S, Hk, D, generator=g).to(torch.float16)
    kw = dict(cache_seqlens=torch.tensor([5, 0, 17], dtype=torch.int32), softmax_scale=D ** -0.5, causal=causal,
              window_right=0 if causal else -1, rotary_interleaved=False)
    if append:
        kw.update(k=torch.randn(B, s_new, Hk, D, generator=g).to(torch.float16),
                  v=torch.randn(B, s_new, Hk, D, generator=g).to(torch.float16))
    if rotary:
        angle = torch.rand(S, 4, generator=g) * 2 * math.pi
        kw.update(rotary_cos=torch.cos(angle), rotary_sin=torch.sin(angle))
    if leftpad:
        kw["cache_leftpad"] = torch.tensor([2, 0, 4], dtype=torch.int32)
    if batch_idx:
        kw["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    if paged:
        k_cache, bt = paged_from_dense(k_cache, 8, num_blocks=2 * B * 3, generator=g)
        v_cache, _ = paged_from_dense(v_cache, 8, num_blocks=k_cache.shape[0], block_table=bt)
        kw["block_table"] = bt
    return q, k_cache, v_cache, kw


@pytest.mark.parametrize("case", list(KVCACHE_CASES))
def test_kvcache_with_default_device_meta(case, default_device_meta):
    """fwd_kvcache of CPU tensors while the default device is meta: the same output, lse and updated caches as
    with the CPU as the default."""
    with torch.device("cpu"):
        q, k_cache, v_cache, kw = _kvcache_args(**KVCACHE_CASES[case])
        kc_want, vc_want = k_cache.clone(), v_cache.clone()
        want = backend_fwd_kvcache(R, q, kc_want, vc_want, **kw)
    out, lse = backend_fwd_kvcache(R, q, k_cache, v_cache, **kw)
    for got, ref in zip((out, lse, k_cache, v_cache), (*want, kc_want, vc_want)):
        assert got.device == ref.device and got.dtype == ref.dtype and torch.equal(got, ref)
