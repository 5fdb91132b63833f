"""The public FA2 API end to end on the CPU (served by the reference backend): every argument reaches
the computation, packed and varlen layouts agree with the dense one, and results meet the criterion."""
import pytest
import torch

import flash_attn
from flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from flash_attn.testing import (assert_close_to_ref, attention_lse_ref, attention_ref, paged_from_dense,
                                pad, random_padding_mask, unpad)


def _qkv(B=2, Sq=33, Sk=33, H=4, Hk=2, D=32, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Sk, Hk, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Sk, Hk, Dv or D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def _check_fwd_bwd(fn, q, k, v, **ref_kwargs):
    out = fn(q, k, v)
    ref, _ = attention_ref(q, k, v, **ref_kwargs)
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **ref_kwargs)
    assert_close_to_ref(out, ref, pt)
    for name, a, b, c in zip("qkv", _grads(out, (q, k, v)), _grads(ref, (q, k, v)), _grads(pt, (q, k, v))):
        assert_close_to_ref(a, b, c, name=f"d{name}")


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (5, 3)},
    "causal_window": {"causal": True, "window_size": (7, -1)},
    "softcap": {"softcap": 2.5},
    "scale": {"softmax_scale": 0.3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_flash_attn_func_features(feature, dtype):
    kw = FEATURES[feature]
    q, k, v = _qkv(Sq=33, Sk=47, dtype=dtype)
    _check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, **kw), q, k, v, **kw)


@pytest.mark.parametrize("shape", ["heads", "batch_heads"])
def test_flash_attn_func_alibi(shape):
    q, k, v = _qkv()
    slopes = torch.rand(4) if shape == "heads" else torch.rand(2, 4)
    _check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, alibi_slopes=slopes, causal=True), q, k, v,
                   alibi_slopes=slopes, causal=True)


def test_head_dim_v_differs_and_mqa():
    q, k, v = _qkv(H=4, Hk=1, D=32, Dv=16)
    _check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, causal=True), q, k, v, causal=True)


def test_qkvpacked_matches_unpacked():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 17, 3, 4, 32, generator=g, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = (t.detach().clone().requires_grad_() for t in qkv.unbind(2))
    ref = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (dqkv,) = _grads(out, (qkv,))
    torch.testing.assert_close(dqkv, torch.stack(_grads(ref, (q, k, v)), dim=2), rtol=0, atol=0)


def test_kvpacked_matches_unpacked():
    q, k, v = _qkv(Sq=9, Sk=21)
    kv = torch.stack([k.detach(), v.detach()], dim=2).requires_grad_()
    out = flash_attn_kvpacked_func(q, kv, window_size=(4, 4))
    ref = flash_attn_func(q, k, v, window_size=(4, 4))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (dkv,) = _grads(out, (kv,))
    torch.testing.assert_close(dkv, torch.stack(_grads(ref, (k, v)), dim=2), rtol=0, atol=0)


def _varlen_case(seed=0, B=3, S=29, H=4, Hk=2, D=32):
    g = torch.Generator().manual_seed(seed)
    qmask = random_padding_mask(B, S, generator=g)
    kmask = random_padding_mask(B, S, generator=g)
    qmask[0] = False  # an empty sequence
    q, k, v = _qkv(B=B, Sq=S, Sk=S, H=H, Hk=Hk, D=D, seed=seed)
    return q, k, v, qmask, kmask


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_padded_reference(causal):
    q, k, v, qmask, kmask = _varlen_case()
    q_u, qi, cu_q, msq = unpad(q.detach(), qmask)
    k_u, _, cu_k, msk = unpad(k.detach(), kmask)
    v_u, _, _, _ = unpad(v.detach(), kmask)
    q_u, k_u, v_u = (t.requires_grad_() for t in (q_u, k_u, v_u))
    out_u, lse, _ = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, msq, msk, causal=causal,
                                           return_attn_probs=True)
    out = pad(out_u, qi, *qmask.shape)
    kw = dict(query_padding_mask=qmask, key_padding_mask=kmask, causal=causal)
    ref, _ = attention_ref(q, k, v, **kw)
    pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_to_ref(out, ref, pt)
    assert lse.shape == (4, q_u.shape[0]) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)) * qmask[..., None, None]
    dq_u, dk_u = torch.autograd.grad(out_u, (q_u, k_u), unpad(dout, qmask)[0])
    dq_ref, dk_ref = torch.autograd.grad(ref, (q, k), dout)
    dq_pt, dk_pt = torch.autograd.grad(pt, (q, k), dout)
    assert_close_to_ref(pad(dq_u, qi, *qmask.shape), dq_ref, dq_pt, name="dq")
    assert_close_to_ref(pad(dk_u, unpad(k.detach(), kmask)[1], *kmask.shape), dk_ref, dk_pt, name="dk")


def test_varlen_packed_variants_match_varlen():
    q, k, v, qmask, _ = _varlen_case(H=2, Hk=2)
    qkv = torch.stack([q, k, v], dim=2).detach()
    qkv_u, _, cu, ms = unpad(qkv, qmask)
    out = flash_attn_varlen_qkvpacked_func(qkv_u, cu, ms, causal=True)
    q_u, k_u, v_u = qkv_u.unbind(1)
    ref = flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, ms, ms, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    kv_u = qkv_u[:, 1:]
    out2 = flash_attn_varlen_kvpacked_func(q_u, kv_u, cu, cu, ms, ms, causal=True)
    torch.testing.assert_close(out2, ref, rtol=0, atol=0)


def test_varlen_paged_block_table_matches_contiguous():
    q, k, v, qmask, kmask = _varlen_case(seed=3)
    g = torch.Generator().manual_seed(5)
    k_paged, table = paged_from_dense(k.detach(), block_size=8, generator=g)
    v_paged, _ = paged_from_dense(v.detach(), block_size=8, block_table=table, generator=g)
    q_u, _, cu_q, msq = unpad(q.detach(), qmask)
    k_u, _, cu_k, msk = unpad(k.detach(), kmask)
    v_u, _, _, _ = unpad(v.detach(), kmask)
    out_paged = flash_attn_varlen_func(q_u, k_paged, v_paged, cu_q, cu_k, msq, msk, causal=True,
                                       block_table=table)
    out = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, msq, msk, causal=True)
    torch.testing.assert_close(out_paged, out)


def test_return_attn_probs_and_lse():
    q, k, v = _qkv(Sq=20, Sk=12)
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    _, probs_ref = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(probs, probs_ref.float(), rtol=1e-5, atol=1e-6)
    lse_ref = attention_lse_ref(q, k, causal=True)
    torch.testing.assert_close(lse, lse_ref)
    assert torch.isinf(lse[:, :, :8]).all()  # Sq > Sk, bottom-right causal: the first 8 rows see nothing
    assert (out[:, :8] == 0).all()


def test_dropout_is_seeded_and_consistent_with_its_mask():
    q, k, v = _qkv()
    torch.manual_seed(123)
    out1, _, s1 = flash_attn_func(q, k, v, dropout_p=0.25, return_attn_probs=True)
    torch.manual_seed(123)
    out2 = flash_attn_func(q, k, v, dropout_p=0.25)
    out3 = flash_attn_func(q, k, v, dropout_p=0.25)
    torch.testing.assert_close(out1, out2, rtol=0, atol=0)
    assert not torch.equal(out2, out3)
    keep = s1 > 0  # non-causal: every probability is positive, so the sign is the keep mask
    frac = keep.float().mean().item()
    assert 0.7 < frac < 0.8
    ref, _ = attention_ref(q, k, v, dropout_p=0.25, dropout_mask=keep)
    pt, _ = attention_ref(q, k, v, dropout_p=0.25, dropout_mask=keep, upcast=False, reorder_ops=True)
    assert_close_to_ref(out1, ref, pt)
    for a, b, c in zip(_grads(out1, (q, k, v)), _grads(ref, (q, k, v)), _grads(pt, (q, k, v))):
        assert_close_to_ref(a, b, c, name="dropout grad")


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v = _qkv()
    g1 = _grads(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v))
    g2 = _grads(flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v))
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def _rotate(x, cos, sin, pos, interleaved):
    # x (B, S, H, D), pos (B, S) positions -> rotary on the first 2 * cos.shape[1] dims
    rd = 2 * cos.shape[1]
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    xr, rest = x[..., :rd].float(), x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), rest], dim=-1)


@pytest.mark.parametrize("paged", [False, True])
def test_with_kvcache_appends_rotates_and_attends(paged):
    g = torch.Generator().manual_seed(0)
    B, S_cache, H, Hk, D, S_new = 2, 24, 4, 2, 32, 3
    k_cache = torch.randn(B, S_cache, Hk, D, generator=g)
    v_cache = torch.randn(B, S_cache, Hk, D, generator=g)
    q = torch.randn(B, S_new, H, D, generator=g)
    k_new = torch.randn(B, S_new, Hk, D, generator=g)
    v_new = torch.randn(B, S_new, Hk, D, generator=g)
    seqlens = torch.tensor([5, 11], dtype=torch.int32)
    cos, sin = torch.randn(64, 8, generator=g), torch.randn(64, 8, generator=g)
    pos = seqlens[:, None].long() + torch.arange(S_new)[None]
    k_rot, q_rot = _rotate(k_new, cos, sin, pos, True), _rotate(q, cos, sin, pos, True)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b in range(B):
        expect_k[b, seqlens[b]:seqlens[b] + S_new] = k_rot[b]
        expect_v[b, seqlens[b]:seqlens[b] + S_new] = v_new[b]
    kc, vc, table = k_cache, v_cache, None
    if paged:
        kc, table = paged_from_dense(k_cache, block_size=8, generator=g)
        vc, _ = paged_from_dense(v_cache, block_size=8, block_table=table, generator=g)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, block_table=table, causal=True,
                                       return_softmax_lse=True)
    if paged:
        kc = kc[table.long()].flatten(1, 2)
        vc = vc[table.long()].flatten(1, 2)
    torch.testing.assert_close(kc, expect_k, rtol=0, atol=0)
    torch.testing.assert_close(vc, expect_v, rtol=0, atol=0)
    kmask = torch.arange(S_cache)[None] < (seqlens[:, None] + S_new)
    ref, _ = attention_ref(q_rot, expect_k, expect_v, key_padding_mask=kmask, causal=True)
    pt, _ = attention_ref(q_rot, expect_k, expect_v, key_padding_mask=kmask, causal=True, upcast=False,
                          reorder_ops=True)
    assert_close_to_ref(out, ref, pt)
    assert lse.shape == (B, H, S_new)


def test_with_kvcache_int_seqlens_and_no_append():
    q, k, v = _qkv(Sq=1, Sk=16)
    q, k, v = q.detach(), k.detach(), v.detach()
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=10)
    ref = flash_attn_func(q, k[:, :10], v[:, :10])
    torch.testing.assert_close(out, ref)


def test_with_kvcache_leftpad_without_block_table():
    """cache_leftpad on a dense cache (no block_table): row b attends to its keys [leftpad[b], cache_seqlens[b]);
    a leftpad past the cache's capacity is refused naming cache_leftpad."""
    q, k, v = _qkv(Sq=2, Sk=16)
    q, k, v = q.detach(), k.detach(), v.detach()
    seqlens = torch.tensor([12, 9], dtype=torch.int32)[: q.shape[0]]
    leftpad = torch.tensor([3, 0], dtype=torch.int32)[: q.shape[0]]
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad)
    for b in range(q.shape[0]):
        lo, hi = int(leftpad[b]), int(seqlens[b])
        torch.testing.assert_close(out[b:b + 1], flash_attn_func(q[b:b + 1], k[b:b + 1, lo:hi], v[b:b + 1, lo:hi]))
    with pytest.raises(ValueError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, cache_leftpad=leftpad + k.shape[1])


def test_with_kvcache_eager_skips_the_custom_op(monkeypatch):
    """An eager call runs the op's implementation directly (the custom op's eager dispatch costs more than the rest of
    a decoding call's host work) and bumps the appended caches' version counters as the op's mutation does; a call
    whose inputs want gradients still goes through the op, whose missing backward then refuses them."""
    from flash_attn import _ops

    q, k, v = _qkv(Sq=1, Sk=16)
    q, k, v = q.detach(), k.detach(), v.detach()
    kc, vc = torch.zeros_like(k), torch.zeros_like(v)
    through_op = []
    real = _ops.fwd_kvcache
    monkeypatch.setattr(_ops, "fwd_kvcache", lambda *a: through_op.append(1) or real(*a))
    versions = kc._version, vc._version
    lens = torch.tensor([3] * q.shape[0], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, kc, vc, k[:, :2], v[:, :2], cache_seqlens=lens)
    assert through_op == []
    assert kc._version > versions[0] and vc._version > versions[1]
    torch.testing.assert_close(kc[:, 3:5], k[:, :2])
    torch.testing.assert_close(out, flash_attn_func(q, kc[:, :5], vc[:, :5]))
    qg = q.clone().requires_grad_()
    out = flash_attn_with_kvcache(qg, kc, vc, cache_seqlens=lens)
    assert through_op == [1]
    with pytest.raises(RuntimeError):
        out.sum().backward()


def test_import_is_lazy():
    import subprocess
    import sys
    code = ("import sys, flash_attn; "
            "bad = [m for m in sys.modules if m.startswith(('torch', 'triton', 'cutlass', 'flash_attn.'))]; "
            "print(bad)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=flash_attn.__path__[0] + "/..")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
