"""The PyTorch reference backend (flash_attn.reference) against the oracle (flash_attn.testing)."""
import math
from types import SimpleNamespace

import pytest
import torch

from flash_attn import dropout as fa_dropout
from flash_attn import reference as R
from flash_attn.testing import (
    assert_close_to_ref,
    backend_bwd,
    backend_fwd,
    attention_lse_ref,
    attention_ref,
    dropout_keep_mask,
    padded_to_varlen,
    padding_mask_from_seqlens,
    paged_from_dense,
    random_cu_seqlens,
    rounding_error,
    unpad,
    varlen_to_padded,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # Small tiles so that every test runs through many query and key blocks (and the skipping code).
    monkeypatch.setattr(R, "BLOCK_K", 16)
    monkeypatch.setattr(R, "BLOCK_Q", 8)


def _kwargs(D, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_table=None,
            softmax_scale=None):
    wl, wr = window
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, block_table=block_table,
                softmax_scale=1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale,
                causal=causal, window_left=wl, window_right=0 if causal else wr, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                rng_state=torch.tensor([0, 0]) if rng_state is None else rng_state)


def _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype)
    k = torch.randn(B, Sk, Hk, D, generator=g).to(dtype)
    v = torch.randn(B, Sk, Hk, Dv, generator=g).to(dtype)
    return q, k, v


def _ref_and_pt(q, k, v, dout, **ref_kwargs):
    """Oracle (upcast) and PyTorch-at-dtype outputs and gradients."""
    res = []
    for upcast, reorder in ((True, False), (False, True)):
        qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        out, _ = attention_ref(qq, kk, vv, upcast=upcast, reorder_ops=reorder, **ref_kwargs)
        grads = torch.autograd.grad(out, (qq, kk, vv), dout) if dout is not None else (None,) * 3
        res.append((out.detach(), *grads))
    return res


def _check_dense(B=2, Sq=33, Sk=45, H=4, Hk=2, D=32, Dv=None, dtype=torch.float16, causal=False,
                 window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, check_bwd=True):
    Dv = D if Dv is None else Dv
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype)
    slopes = None
    if alibi == "h":
        slopes = torch.rand(H) * 0.5
    elif alibi == "bh":
        slopes = torch.rand(B, H) * 0.5
    rng = torch.tensor([1234, 5678])
    keep = dropout_keep_mask(rng, dropout_p, B, H, Sq, Sk) if dropout_p > 0 else None
    kw = _kwargs(D, causal, window, softcap, slopes, dropout_p, rng, max_seqlen_q=Sq, max_seqlen_k=Sk)
    out, lse, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    dout = torch.randn(B, Sq, H, Dv, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref_kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                  dropout_p=dropout_p, dropout_mask=keep)
    (o_ref, *g_ref), (o_pt, *g_pt) = _ref_and_pt(q, k, v, dout if check_bwd else None, **ref_kw)
    attn = attention_ref(q, k, v, **ref_kw)[1]
    at_most_one_key = bool(((attn > 0).sum(-1) <= 1).all())
    assert out.dtype == dtype and out.shape == (B, Sq, H, Dv)
    assert_close_to_ref(out, o_ref, o_pt)
    lse_ref = attention_lse_ref(q, k, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Sq)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], atol=1e-4, rtol=1e-5)
    if check_bwd:
        dq, dk, dv = backend_bwd(R, dout, q, k, v, out, lse, deterministic=True, **kw)
        for name, got, ref, pt, x in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref, g_pt, (q, k, v)):
            assert got.dtype == dtype and got.shape == x.shape, name
            if name in ("dq", "dk") and at_most_one_key:
                _check_single_key_zero_grads(dq, dk, dout, q, k, v, attn)
            else:
                assert_close_to_ref(got, ref, pt, name)
    return out, lse


def _check_single_key_zero_grads(dq, dk, dout, q, k, v, attn):
    # When every row sees at most one key, P is 0/1 and dS = P (dO.v - dO.o) = 0: dq and dk are exactly 0.
    # PyTorch's softmax backward cancels exactly there, which makes the relative criterion degenerate; the
    # backend (like FlashAttention, which forms rowsum(dO * O) apart from dP = dO V^T) leaves the rounding
    # residue of two dot products of length Dv in its accumulation precision (fp32, or fp64 for fp32
    # inputs; u = 2**-24 bounds both): |dS_ij| <= 2 Dv u |dO_i|.|v_j| P_ij (Higham, Accuracy and
    # Stability, eq. 3.5), propagated through dq = scale dS K and dk = scale dS^T Q.
    B, Sq, H, D = q.shape
    Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    u = 2.0**-24
    g = H // Hk
    qa, ka, va, doa = (x.double().abs() for x in (q, k, v, dout))
    ka, va = ka.repeat_interleave(g, 2), va.repeat_interleave(g, 2)
    ds_bound = 2 * Dv * u * torch.einsum("bihd,bjhd->bhij", doa, va) * attn.double()  # (B, H, Sq, Sk)
    scale = 1.0 / math.sqrt(D)
    # The final matmul and the cast to the output dtype add at most a relative (Sq + Sk) u + eps(dtype).
    rel = 1 + (Sq + Sk) * u + torch.finfo(dq.dtype).eps
    dq_bound = rel * scale * torch.einsum("bhij,bjhd->bihd", ds_bound, ka)
    dk_bound = rel * scale * torch.einsum("bhij,bihd->bjhd", ds_bound, qa).view(B, Sk, Hk, g, D).sum(3)
    assert torch.all(dq.double().abs() <= dq_bound), (dq.double().abs() - dq_bound).max()
    assert torch.all(dk.double().abs() <= dk_bound), (dk.double().abs() - dk_bound).max()


# ----------------------------------------------------------------------------------------------------
# The oracle and helpers themselves


def test_oracle_matches_sdpa_causal_gqa():
    q, k, v = _qkv(2, 13, 21, 4, 2, 32, 24, torch.float32)
    out, attn = attention_ref(q, k, v, causal=True)
    mask = torch.ones(13, 21, dtype=torch.bool).tril(21 - 13)  # bottom-right aligned
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        attn_mask=mask)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert torch.all(attn[..., ~mask] == 0)


def test_oracle_padding_masks_equal_per_sequence_attention():
    B, S = 3, 20
    q, k, v = _qkv(B, S, S, 2, 2, 32, 32, torch.float32)
    qlens, klens = torch.tensor([5, 20, 0]), torch.tensor([12, 7, 3])
    qm, km = padding_mask_from_seqlens(qlens, S), padding_mask_from_seqlens(klens, S)
    out, _ = attention_ref(q, k, v, qm, km, causal=True, window_size=(3, -1))
    for b in range(B):
        ob, _ = attention_ref(q[b:b + 1, : qlens[b]], k[b:b + 1, : klens[b]], v[b:b + 1, : klens[b]],
                              causal=True, window_size=(3, -1))
        torch.testing.assert_close(out[b:b + 1, : qlens[b]], ob)
        assert torch.all(out[b, qlens[b]:] == 0)


def test_oracle_fully_masked_row_is_zero():
    q, k, v = _qkv(1, 6, 3, 2, 2, 32, 32, torch.float32)
    out, attn = attention_ref(q, k, v, causal=True)  # rows 0..2 see no key
    assert torch.all(out[:, :3] == 0) and torch.all(attn[:, :, :3] == 0)
    assert torch.isfinite(out).all()
    lse = attention_lse_ref(q, k, causal=True)
    assert torch.all(lse[:, :, :3] == float("inf")) and torch.isfinite(lse[:, :, 3:]).all()


def test_assert_close_to_ref_rejects_error_beyond_twice_pytorch():
    q, k, v = _qkv(1, 16, 16, 2, 2, 32, 32, torch.float16)
    o_ref, _ = attention_ref(q, k, v)
    o_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert_close_to_ref(o_ref, o_ref, o_pt)
    err_pt = (o_pt.double() - o_ref.double()).abs().max().item()
    bad = o_ref.clone()
    bad[0, 0, 0, 0] += 3 * err_pt + 4 * rounding_error(o_ref) + 1e-2
    with pytest.raises(AssertionError, match="max error"):
        assert_close_to_ref(bad, o_ref, o_pt)


def test_dropout_keep_mask_matches_hash():
    rng = torch.tensor([7, 11])
    m = dropout_keep_mask(rng, 0.25, 2, 3, 5, 9)
    b, h, i, j = 1, 2, 4, 7
    direct = fa_dropout.keep_mask(rng, torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j), 3, 5,
                                  0.25)
    assert bool(m[b, h, i, j]) == bool(direct)
    assert 0.6 < m.float().mean().item() < 0.9


def test_varlen_padded_roundtrip():
    cu, max_s = random_cu_seqlens(5, 9, generator=torch.Generator().manual_seed(3))
    x = torch.randn(int(cu[-1]), 2, 3)
    xp, mask = varlen_to_padded(x, cu, max_s)
    assert xp.shape == (5, max_s, 2, 3) and torch.all(xp[~mask] == 0)
    x2, cu2, max2 = padded_to_varlen(xp, mask)
    assert torch.equal(x2, x) and torch.equal(cu2, cu) and max2 == max_s


def test_paged_from_dense_layout():
    k = torch.randn(2, 11, 2, 8)
    kp, bt = paged_from_dense(k, 4, num_blocks=9, generator=torch.Generator().manual_seed(0))
    assert kp.shape == (9, 4, 2, 8) and bt.shape == (2, 3) and bt.dtype == torch.int32
    assert torch.equal(kp[bt.long()].flatten(1, 2)[:, :11], k)
    vp, bt2 = paged_from_dense(k * 2, 4, num_blocks=9, block_table=bt)
    assert torch.equal(bt2, bt) and torch.equal(vp[bt.long()].flatten(1, 2)[:, :11], 2 * k)


# ----------------------------------------------------------------------------------------------------
# Backend module surface


def test_backend_surface():
    assert R.NAME == "torch" and R.unavailable_reason() is None
    for dt in DTYPES:
        assert R.unsupported_reason(SimpleNamespace(dtype=dt, device=torch.device("cpu"))) is None
    assert "float64" in R.unsupported_reason(SimpleNamespace(dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# Dense forward and backward against the oracle


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (1, 17), (17, 1), (17, 113), (113, 17), (64, 64)])
def test_dense_fwd_bwd(Sq, Sk, causal, dtype):
    _check_dense(Sq=Sq, Sk=Sk, causal=causal, dtype=dtype)


@pytest.mark.parametrize("window", [(5, 3), (0, 0), (-1, 4), (7, -1), (0, -1)])
@pytest.mark.parametrize("Sq,Sk", [(40, 40), (23, 57), (57, 23)])
def test_local_window(window, Sq, Sk):
    _check_dense(Sq=Sq, Sk=Sk, window=window)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(causal, dtype):
    _check_dense(softcap=2.5, causal=causal, dtype=dtype)


@pytest.mark.parametrize("alibi", ["h", "bh"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(alibi, causal):
    _check_dense(alibi=alibi, causal=causal, Sq=29, Sk=41)


@pytest.mark.parametrize("H,Hk", [(4, 4), (4, 2), (4, 1)])
def test_gqa_mqa(H, Hk):
    _check_dense(H=H, Hk=Hk, causal=True)


@pytest.mark.parametrize("D,Dv", [(32, 32), (40, 40), (64, 32), (32, 64), (40, 24)])
def test_head_dims(D, Dv):
    _check_dense(D=D, Dv=Dv)


def test_softmax_scale_custom():
    q, k, v = _qkv(1, 9, 14, 2, 2, 32, 32, torch.float32)
    kw = _kwargs(32, softmax_scale=0.37)
    out, _, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    (o_ref, *_), (o_pt, *_) = _ref_and_pt(q, k, v, None, softmax_scale=0.37)
    assert_close_to_ref(out, o_ref, o_pt)
    (o_def, *_), _ = _ref_and_pt(q, k, v, None)
    assert (out - o_def).abs().max() > 1e-3  # the scale is really used


# ----------------------------------------------------------------------------------------------------
# Fully masked rows, return_probs


def test_fully_masked_rows_zero_out_inf_lse_zero_grads():
    # Sq > Sk with causal: the first Sq - Sk query rows see no key.
    B, Sq, Sk, H, D = 2, 30, 10, 2, 32
    q, k, v = _qkv(B, Sq, Sk, H, H, D, D, torch.float16)
    kw = _kwargs(D, causal=True)
    out, lse, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    assert torch.all(out[:, :20] == 0) and torch.all(lse[:, :, :20] == float("inf"))
    assert torch.isfinite(lse[:, :, 20:]).all()
    dout = torch.randn_like(out)
    dq, dk, dv = backend_bwd(R, dout, q, k, v, out, lse, deterministic=True, **kw)
    assert torch.all(dq[:, :20] == 0) and torch.isfinite(dq).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_window_row_without_keys():
    # window (0, 0) with Sq > Sk: rows i < Sq - Sk have their only key at a negative position.
    _check_dense(Sq=40, Sk=25, window=(0, 0))


@pytest.mark.parametrize("causal", [False, True])
def test_return_probs(causal):
    B, Sq, Sk, H, D = 2, 21, 35, 4, 32
    q, k, v = _qkv(B, Sq, Sk, H, 2, D, D, torch.float32)
    kw = _kwargs(D, causal=causal)
    _, _, probs = backend_fwd(R, q, k, v, return_probs=True, **kw)
    _, attn = attention_ref(q, k, v, causal=causal)
    assert probs.dtype == torch.float32 and probs.shape == (B, H, Sq, Sk)
    torch.testing.assert_close(probs, attn.float(), atol=1e-6, rtol=1e-5)
    _, _, none = backend_fwd(R, q, k, v, return_probs=False, **kw)
    assert none is None  # (the contract: no probabilities unless the call returns them)


# ----------------------------------------------------------------------------------------------------
# Dropout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_fwd_bwd_with_oracle_mask(causal, dtype):
    _check_dense(dropout_p=0.17, causal=causal, dtype=dtype, Sq=37, Sk=29)


def test_dropout_probs_sign_equals_keep_mask():
    B, Sq, Sk, H, D, p = 2, 19, 27, 4, 32, 0.3
    q, k, v = _qkv(B, Sq, Sk, H, 1, D, D, torch.float32)
    rng = torch.tensor([99, 3])
    kw = _kwargs(D, dropout_p=p, rng_state=rng)
    _, _, probs = backend_fwd(R, q, k, v, return_probs=True, **kw)
    keep = dropout_keep_mask(rng, p, B, H, Sq, Sk)
    assert torch.all((probs < 0) == ~keep)
    _, attn = attention_ref(q, k, v)
    torch.testing.assert_close(probs.abs(), attn.float(), atol=1e-6, rtol=1e-5)


def test_dropout_changes_with_rng_state():
    q, k, v = _qkv(1, 16, 16, 2, 2, 32, 32, torch.float32)
    o1, _, _ = backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, dropout_p=0.2, rng_state=torch.tensor([1, 2])))
    o2, _, _ = backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, dropout_p=0.2, rng_state=torch.tensor([1, 3])))
    o3, _, _ = backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, dropout_p=0.2, rng_state=torch.tensor([1, 2])))
    assert not torch.equal(o1, o2) and torch.equal(o1, o3)


# ----------------------------------------------------------------------------------------------------
# Varlen and paged K/V


def _varlen_case(dtype, causal=False, window=(-1, -1), dropout_p=0.0, alibi=False, paged_block=None, seed=0):
    B, H, Hk, D, Dv = 4, 4, 2, 32, 40
    g = torch.Generator().manual_seed(seed)
    qlens = torch.tensor([13, 0, 31, 7], dtype=torch.int32)
    klens = torch.tensor([20, 9, 0, 7], dtype=torch.int32) if not causal else torch.tensor([20, 9, 31, 7],
                                                                                             dtype=torch.int32)
    Sq, Sk = int(qlens.max()), int(klens.max())
    qm, km = padding_mask_from_seqlens(qlens, Sq), padding_mask_from_seqlens(klens, Sk)
    qp = (torch.randn(B, Sq, H, D, generator=g) * qm[..., None, None]).to(dtype)
    kp = (torch.randn(B, Sk, Hk, D, generator=g) * km[..., None, None]).to(dtype)
    vp = (torch.randn(B, Sk, Hk, Dv, generator=g) * km[..., None, None]).to(dtype)
    dop = (torch.randn(B, Sq, H, Dv, generator=g) * qm[..., None, None]).to(dtype)
    q, cu_q, max_q = padded_to_varlen(qp, qm)
    k, cu_k, max_k = padded_to_varlen(kp, km)
    v, _, _ = padded_to_varlen(vp, km)
    do, _, _ = padded_to_varlen(dop, qm)
    rng = torch.tensor([31337, 42])
    slopes = torch.rand(B, H, generator=g) * 0.5 if alibi else None
    bt = None
    if paged_block is not None:
        k, bt = paged_from_dense(kp, paged_block, num_blocks=3 * B * (-(-Sk // paged_block)), generator=g)
        v, _ = paged_from_dense(vp, paged_block, num_blocks=k.shape[0], block_table=bt)
    kw = _kwargs(D, causal, window, 0.0, slopes, dropout_p, rng, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=max_q, max_seqlen_k=max_k, block_table=bt)
    keep = (dropout_keep_mask(rng, dropout_p, B, H, Sq, Sk, cu_q, cu_k, max_seqlen_q=max_q)
            if dropout_p > 0 else None)
    ref_kw = dict(query_padding_mask=qm, key_padding_mask=km, causal=causal, window_size=window,
                  alibi_slopes=slopes, dropout_p=dropout_p, dropout_mask=keep)
    return SimpleNamespace(q=q, k=k, v=v, do=do, qp=qp, kp=kp, vp=vp, dop=dop, qm=qm, km=km, kw=kw,
                           ref_kw=ref_kw, bt=bt, B=B, H=H, Sq=Sq, Sk=Sk, klens=klens)


def _check_varlen(c):
    out, lse, _ = backend_fwd(R, c.q, c.k, c.v, return_probs=False, **c.kw)
    (o_ref, *g_ref), (o_pt, *g_pt) = _ref_and_pt(c.qp, c.kp, c.vp, c.dop, **c.ref_kw)
    assert_close_to_ref(out, unpad(o_ref, c.qm)[0], unpad(o_pt, c.qm)[0])
    assert lse.shape == (c.H, c.q.shape[0])
    lse_ref = attention_lse_ref(c.qp, c.kp, c.qm, c.km, causal=c.ref_kw["causal"],
                                window_size=c.ref_kw["window_size"], alibi_slopes=c.ref_kw["alibi_slopes"])
    lse_ref = unpad(lse_ref.transpose(1, 2), c.qm)[0].transpose(0, 1)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], atol=1e-4, rtol=1e-5)
    dq, dk, dv = backend_bwd(R, c.do, c.q, c.k, c.v, out, lse, deterministic=True, **c.kw)
    assert dq.shape == c.q.shape and dk.shape == c.k.shape and dv.shape == c.v.shape
    assert_close_to_ref(dq, unpad(g_ref[0], c.qm)[0], unpad(g_pt[0], c.qm)[0], "dq")
    if c.bt is None:
        dk_d, dv_d = dk, dv
    else:
        # Blocks no sequence uses get no gradient; the used ones map back to the dense layout.
        used = torch.zeros(dk.shape[0], dtype=torch.bool)
        for b in range(c.B):
            used[c.bt[b, : -(-int(c.klens[b]) // dk.shape[1])].long()] = True
        assert torch.all(dk[~used] == 0) and torch.all(dv[~used] == 0)
        dk_d = unpad(dk[c.bt.long()].flatten(1, 2)[:, : c.Sk], c.km)[0]
        dv_d = unpad(dv[c.bt.long()].flatten(1, 2)[:, : c.Sk], c.km)[0]
    assert_close_to_ref(dk_d, unpad(g_ref[1], c.km)[0], unpad(g_pt[1], c.km)[0], "dk")
    assert_close_to_ref(dv_d, unpad(g_ref[2], c.km)[0], unpad(g_pt[2], c.km)[0], "dv")
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_empty_sequences(dtype, causal):
    out, lse = _check_varlen(_varlen_case(dtype, causal=causal))
    if not causal:
        # Sequence 2 has 31 queries and no keys: zero output, +inf lse.
        assert torch.all(out[13:44] == 0) and torch.all(lse[:, 13:44] == float("inf"))


def test_varlen_window_alibi():
    _check_varlen(_varlen_case(torch.bfloat16, window=(4, 2), alibi=True))


def test_varlen_dropout_uses_max_seqlen_q_rows():
    _check_varlen(_varlen_case(torch.float32, causal=True, dropout_p=0.2))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_kv(block_size):
    _check_varlen(_varlen_case(torch.float16, causal=True, paged_block=block_size))


def test_varlen_return_probs_layout():
    c = _varlen_case(torch.float32)
    _, _, probs = backend_fwd(R, c.q, c.k, c.v, return_probs=True, **c.kw)
    _, attn = attention_ref(c.qp, c.kp, c.vp, c.qm, c.km)
    assert probs.shape == (c.B, c.H, c.Sq, c.Sk)
    torch.testing.assert_close(probs, attn.float(), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Tiling: chunking, skipping, determinism, memory bound


def _record_tiles(monkeypatch):
    tiles = []
    monkeypatch.setattr(R, "debug_tile_hook", lambda shape: tiles.append(shape))
    return tiles


def test_many_tiles_match_single_tile(monkeypatch):
    q, k, v = _qkv(2, 50, 70, 4, 2, 32, 32, torch.float32)
    kw = _kwargs(32, window=(9, 5), softcap=3.0)
    tiles = _record_tiles(monkeypatch)
    small = backend_fwd(R, q, k, v, return_probs=False, **kw)[0]
    assert len(tiles) > 10
    monkeypatch.setattr(R, "BLOCK_K", 1024)
    monkeypatch.setattr(R, "BLOCK_Q", None)
    tiles.clear()
    big = backend_fwd(R, q, k, v, return_probs=False, **kw)[0]
    assert len(tiles) == 1
    torch.testing.assert_close(small, big, atol=1e-6, rtol=1e-6)


def test_causal_skips_hidden_tiles(monkeypatch):
    S, bq, bk = 64, 8, 16
    q, k, v = _qkv(1, S, S, 2, 2, 32, 32, torch.float32)
    tiles = _record_tiles(monkeypatch)
    backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32))
    assert len(tiles) == (S // bq) * (S // bk)
    tiles.clear()
    backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, causal=True))
    # Query block [q0, q0 + 8) sees keys [0, q0 + 8): ceil((q0 + 8) / 16) key blocks.
    assert len(tiles) == sum(-(-(q0 + bq) // bk) for q0 in range(0, S, bq))
    tiles.clear()
    backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, window=(3, 0)))
    # Keys [q0 - 3, q0 + 8) span at most 11 keys: one or two 16-key blocks, never more.
    assert all(t[-1] <= bk for t in tiles) and len(tiles) <= 2 * (S // bq)


def test_backward_skips_hidden_tiles(monkeypatch):
    S = 64
    q, k, v = _qkv(1, S, S, 2, 2, 32, 32, torch.float32)
    kw = _kwargs(32, causal=True)
    out, lse, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    tiles = _record_tiles(monkeypatch)
    backend_bwd(R, torch.randn_like(out), q, k, v, out, lse, deterministic=True, **kw)
    assert len(tiles) == sum(-(-(q0 + 8) // 16) for q0 in range(0, S, 8))


def test_backward_deterministic_bitwise():
    q, k, v = _qkv(2, 45, 61, 4, 1, 32, 32, torch.bfloat16)
    kw = _kwargs(32, causal=True, dropout_p=0.1, softcap=5.0, rng_state=torch.tensor([5, 6]))
    out, lse, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    out2, lse2, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    dout = torch.randn_like(out)
    g1 = backend_bwd(R, dout, q, k, v, out, lse, deterministic=True, **kw)
    g2 = backend_bwd(R, dout, q, k, v, out, lse, deterministic=True, **kw)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_tile_bound_respected(monkeypatch):
    monkeypatch.setattr(R, "MAX_TILE_ELEMENTS", 4096)
    monkeypatch.setattr(R, "BLOCK_K", 512)
    monkeypatch.setattr(R, "BLOCK_Q", None)
    _check_dense(B=2, Sq=97, Sk=200, H=4, Hk=2, causal=True, dtype=torch.float32)
    tiles = _record_tiles(monkeypatch)
    _check_dense(B=2, Sq=97, Sk=200, H=4, Hk=2, causal=False, dtype=torch.float32, check_bwd=False)
    assert max(math.prod(t) for t in tiles) <= 4096 and len(tiles) > 1


def test_long_sequence_never_materialises_s_by_s(monkeypatch):
    # 16k tokens: every score tile stays within MAX_TILE_ELEMENTS and the block sizes, far below 16k x 16k,
    # and a local window computes only the tiles near the diagonal, forward and backward.
    monkeypatch.setattr(R, "BLOCK_K", 512)
    monkeypatch.setattr(R, "BLOCK_Q", 128)
    S, D, W = 16384, 16, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, 1, D, generator=g).to(torch.bfloat16) for _ in range(3))
    kw = _kwargs(D, causal=True, window=(W, 0))
    tiles = _record_tiles(monkeypatch)
    out, lse, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    largest = max(math.prod(t) for t in tiles)
    assert largest <= R.MAX_TILE_ELEMENTS and largest <= 128 * 512
    # Query block [q0, q0 + 128) sees keys [q0 - 32, q0 + 128): one tile of at most 160 keys.
    assert len(tiles) == S // 128 and sum(math.prod(t) for t in tiles) <= S * (128 + W)
    tiles.clear()
    backend_bwd(R, torch.ones_like(out), q, k, v, out, lse, deterministic=True, **kw)
    assert len(tiles) == S // 128 and max(math.prod(t) for t in tiles) == largest
    # Spot-check the last rows against the oracle on the slice of keys they can see.
    sl = (q[:, -64:], k[:, -64 - W:], v[:, -64 - W:])
    o_ref, _ = attention_ref(*sl, causal=True, window_size=(W, 0))
    o_pt, _ = attention_ref(*sl, causal=True, window_size=(W, 0), upcast=False, reorder_ops=True)
    assert_close_to_ref(out[:, -64:], o_ref, o_pt)


# ----------------------------------------------------------------------------------------------------
# Empty inputs, other devices


@pytest.mark.parametrize("B,Sq,Sk", [(0, 4, 5), (2, 0, 5), (2, 4, 0)])
def test_empty_dense(B, Sq, Sk):
    q, k, v = _qkv(B, Sq, Sk, 2, 2, 16, 16, torch.float16)
    kw = _kwargs(16, causal=True)
    out, lse, probs = backend_fwd(R, q, k, v, return_probs=True, **kw)
    assert out.shape == (B, Sq, 2, 16) and lse.shape == (B, 2, Sq) and probs.shape == (B, 2, Sq, Sk)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    dq, dk, dv = backend_bwd(R, torch.ones_like(out), q, k, v, out, lse, deterministic=True, **kw)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert not dq.any() and not dk.any() and not dv.any()


@pytest.mark.gpu
def test_cuda_matches_cpu():
    B, Sq, Sk, H, Hk, D = 2, 45, 70, 4, 2, 64
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, D, torch.bfloat16)
    kw = _kwargs(D, causal=True, dropout_p=0.1, softcap=4.0, rng_state=torch.tensor([3, 4]),
                 alibi_slopes=torch.rand(H))
    out, lse, _ = backend_fwd(R, q, k, v, return_probs=False, **kw)
    kw_cuda = dict(kw, alibi_slopes=kw["alibi_slopes"].cuda())
    out_c, lse_c, _ = backend_fwd(R, q.cuda(), k.cuda(), v.cuda(), return_probs=False, **kw_cuda)
    (o_ref, *_), (o_pt, *_) = _ref_and_pt(q, k, v, None, causal=True, softcap=4.0,
                                          alibi_slopes=kw["alibi_slopes"], dropout_p=0.1,
                                          dropout_mask=dropout_keep_mask(torch.tensor([3, 4]), 0.1, B, H, Sq, Sk))
    assert_close_to_ref(out_c.cpu(), o_ref, o_pt)
    torch.testing.assert_close(lse_c.cpu(), lse, atol=1e-4, rtol=1e-5)


def test_fp32_inputs_are_computed_in_fp64():
    """The reference is the tests' oracle: fp32 inputs accumulate in fp64, so the fp32 output is the exact result
    rounded once (within half an ulp of the largest value); fp32 accumulation over 4096 keys misses that by ~8x."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 2, 64), torch.randn(1, 4096, 2, 64), torch.randn(1, 4096, 2, 64)
    out, _, _ = backend_fwd(R, q, k, v, return_probs=False)
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 64 ** -0.5
    exact = torch.einsum("bhij,bjhd->bihd", s.softmax(-1), v.double())
    assert (out.double() - exact).abs().max().item() <= exact.abs().max().item() * 2 ** -24


def test_fp32_backward_is_computed_in_fp64():
    """The backward of fp32 inputs accumulates dq, dk and dv in fp64: each gradient is the fp64 result of the same
    formulas (P from the fp32-rounded scores and the saved fp32 lse, dS = P (dP - rowsum(dO O))), computed here
    untiled, rounded once to fp32 (half an ulp); fp32 accumulation over the 8 query and 16 key blocks misses that
    by hundreds of ulps. GQA: dk and dv also sum over the two query heads of their KV head."""
    Sq, Sk, D = 64, 256, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, Sq, 2, D, generator=g), torch.randn(1, Sk, 1, D, generator=g), torch.randn(1, Sk, 1, D,
                                                                                                         generator=g)
    dout = torch.randn(1, Sq, 2, D, generator=g)
    out, lse, _ = backend_fwd(R, q, k, v)
    grads = backend_bwd(R, dout, q, k, v, out, lse)
    scale = D ** -0.5
    qd, dod, od = q.double(), dout.double(), out.double()
    kd, vd = k.double().expand(1, Sk, 2, D), v.double().expand(1, Sk, 2, D)
    s = torch.einsum("bihd,bjhd->bhij", qd * scale, kd).float().double()
    p = torch.exp(s - lse.double().unsqueeze(-1))
    dp = torch.einsum("bihd,bjhd->bhij", dod, vd)
    ds = p * (dp - (dod * od).sum(-1).transpose(1, 2).unsqueeze(-1))
    exact = (torch.einsum("bhij,bjhd->bihd", ds, kd) * scale,
             torch.einsum("bhij,bihd->bjhd", ds, qd * scale).sum(2, keepdim=True),
             torch.einsum("bhij,bihd->bjhd", p, dod).sum(2, keepdim=True))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, exact):
        r = ref.float().abs()
        ulp = (torch.nextafter(r, torch.full_like(r, math.inf)) - r).double()
        # 2**-10 of an ulp: the fp64 rounding of the two computations' different summation orders
        assert ((got.double() - ref).abs() <= (0.5 + 2**-10) * ulp).all(), name


@pytest.mark.parametrize("max_tile", [1, 64, 4096, 1 << 24])
@pytest.mark.parametrize("block_q", [None, 1, 8, 1024])
@pytest.mark.parametrize("block_k", [1, 16, 512])
def test_block_sizes_contract(monkeypatch, block_k, block_q, max_tile):
    """The tile (block_q x block_k, over N * H heads) is the largest one that fits: never past the sequences, the
    block caps or MAX_TILE_ELEMENTS (whenever one row of one head fits at all), at least 1 x 1, and as large as those
    bounds allow (the fewest tiles)."""
    monkeypatch.setattr(R, "MAX_TILE_ELEMENTS", max_tile)
    monkeypatch.setattr(R, "BLOCK_K", block_k)
    monkeypatch.setattr(R, "BLOCK_Q", block_q)
    cap_q = math.inf if block_q is None else block_q
    for NH in (1, 3, 8, 64, 4096, 1 << 25):
        for Sq in (0, 1, 2, 7, 100, 5000):
            for Sk in (0, 1, 2, 9, 700):
                bq, bk = R._block_sizes(NH, 1, Sq, Sk)
                where = (NH, Sq, Sk, bq, bk)
                assert type(bq) is int and type(bk) is int, where
                assert 1 <= bq <= max(1, min(Sq, cap_q)) and 1 <= bk <= max(1, min(Sk, block_k)), where
                if NH <= max_tile:
                    assert NH * bq * bk <= max_tile, where
                # maximal: one more key (or query) row would pass a bound
                assert bk == max(1, min(Sk, block_k)) or NH * (bk + 1) > max_tile, where
                assert bq == max(1, min(Sq, cap_q)) or NH * (bq + 1) * bk > max_tile, where
                # N and H enter as their product
                assert R._block_sizes(1, NH, Sq, Sk) == (bq, bk), where


@pytest.mark.parametrize("softcap", [0.5, 1.0])
def test_softcap_at_most_one(softcap):
    # A cap of 1 or less still caps (tanh(s / c) * c): the scores of these inputs reach about 4.
    _check_dense(dtype=torch.float32, softcap=softcap, causal=True)


def test_window_left_zero_skips_the_keys_before_the_diagonal(monkeypatch):
    # window (0, 0): query i sees only key i; query block [q0, q0 + 8) lies in one 16-key block, the only tile computed.
    S = 64
    q, k, v = _qkv(1, S, S, 2, 2, 32, 32, torch.float32)
    tiles = _record_tiles(monkeypatch)
    backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, window=(0, 0)))
    assert len(tiles) == S // 8
    tiles.clear()
    backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, window=(0, -1)))
    # window (0, -1): keys [q0, 64), ceil((64 - q0) / 16) blocks starting at q0
    assert len(tiles) == sum(-(-(S - q0) // 16) for q0 in range(0, S, 8))


def test_return_probs_computes_each_tile_twice(monkeypatch):
    # P is written in a second pass once the row's lse is final: each visible tile once more, never more.
    q, k, v = _qkv(2, 40, 50, 4, 2, 32, 32, torch.float32)
    tiles = _record_tiles(monkeypatch)
    backend_fwd(R, q, k, v, return_probs=False, **_kwargs(32, causal=True))
    once = len(tiles)
    tiles.clear()
    backend_fwd(R, q, k, v, return_probs=True, **_kwargs(32, causal=True))
    assert once > 10 and len(tiles) == 2 * once


def test_memory_is_linear_in_the_sequence(monkeypatch):
    """No tensor of the forward or backward (dense and varlen; without return_probs) is larger than one score tile or
    the inputs: 4096 tokens on the meta device (shapes, no data), recorded for every aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    monkeypatch.setattr(R, "BLOCK_K", 512)
    monkeypatch.setattr(R, "BLOCK_Q", 256)
    S, H, D = 4096, 2, 16
    q, k, v = (torch.empty(1, S, H, D, device="meta") for _ in range(3))
    cu = torch.tensor([0, 1000, S], dtype=torch.int32)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S - 1000, max_seqlen_k=S - 1000)
    with Largest() as mode:
        out, lse, _ = backend_fwd(R, q, k, v, **_kwargs(D))
        backend_bwd(R, out, q, k, v, out, lse, **_kwargs(D))
        out, lse, _ = backend_fwd(R, q[0], k[0], v[0], **_kwargs(D, **varlen))
        backend_bwd(R, out, q[0], k[0], v[0], out, lse, **_kwargs(D, **varlen))
    assert 0 < mode.numel <= max(H * 256 * 512, S * H * D)


@pytest.mark.parametrize("dtype,acc", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                       (torch.float32, torch.float64)])
def test_matmuls_run_in_the_accumulation_dtype(dtype, acc):
    """fp16/bf16 inputs are computed in fp32, fp32 inputs in fp64 (the module's contract): every matrix product of
    the forward and backward, recorded at the aten level on meta tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm):
                self.dtypes.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    q, k, v = (x.to("meta") for x in _qkv(2, 20, 30, 4, 2, 16, 16, dtype))
    with Products() as mode:
        out, lse, _ = backend_fwd(R, q, k, v, **_kwargs(16, causal=True))
        backend_bwd(R, out, q, k, v, out, lse, **_kwargs(16, causal=True))
    assert mode.dtypes == {acc}
