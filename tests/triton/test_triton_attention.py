"""The Triton attention backend (flash_attn.triton.backend) against the oracle flash_attn.testing.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1): fp16 and fp32 only, small shapes, blocks of 16 so that small shapes span several
blocks. GPU-marked tests run bf16/fp16 at real sizes, determinism and the long-sequence memory check.

Criterion (flash_attn.testing.assert_close_to_ref): max error vs the fp32 reference (fp64 for fp32
inputs) at most 2x PyTorch's own error at the input dtype plus the dtype's rounding error, for the
output and every gradient; lse is compared to the fp32 reference lse.
"""

import pytest
import torch

import flash_attn
from flash_attn import testing
from flash_attn.triton import _configs, backend as tb
from flash_attn.testing import backend_bwd, backend_fwd

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter computes bf16 wrongly; on CPU, fp16 is the 16-bit type under test.
DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]


# ----------------------------------------------------------------------------------------------------
# Helpers


def _kwargs(causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
            softmax_scale=None, head_dim=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
            max_seqlen_k=None):
    wl, wr = window
    if causal:
        wr = 0
    return dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, block_table=None,
                softmax_scale=head_dim ** -0.5 if softmax_scale is None else softmax_scale, causal=causal,
                window_left=wl, window_right=wr, softcap=softcap, alibi_slopes=alibi_slopes,
                dropout_p=dropout_p, rng_state=rng_state)


def _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Sk, Hk, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Sk, Hk, Dv, generator=g).to(DEVICE, dtype)
    return q, k, v


def _dense(q, k, v, dout, deterministic=False, return_probs=False, **kw):
    """Our forward + backward on dense tensors -> (out, lse, probs, dq, dk, dv)."""
    kw = _kwargs(head_dim=q.shape[-1], max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], **kw)
    out, lse, probs = backend_fwd(tb, q, k, v, return_probs=return_probs, **kw)
    dq, dk, dv = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=deterministic, **kw)
    return out, lse, probs, dq, dk, dv


def _reference(q, k, v, dout, causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
               dropout_mask=None, softmax_scale=None, query_padding_mask=None, key_padding_mask=None):
    """(out, dq, dk, dv) of the upcast oracle and of PyTorch at the input dtype."""
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = testing.attention_ref(
            qr, kr, vr, query_padding_mask=query_padding_mask, key_padding_mask=key_padding_mask,
            dropout_p=dropout_p, dropout_mask=dropout_mask, causal=causal, window_size=window, softcap=softcap,
            alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, upcast=upcast, reorder_ops=not upcast)
        grads = torch.autograd.grad(out, (qr, kr, vr), dout)
        results.append((out.detach(), *grads))
    return results


def _check_all(ours, ref, pt, names=("out", "dq", "dk", "dv")):
    for name, a, r, p in zip(names, ours, ref, pt):
        testing.assert_close_to_ref(a, r, p, name)


def _check_lse(lse, q, k, **ref_kw):
    lse_ref = testing.attention_lse_ref(q, k, **ref_kw)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isinf(lse), ~finite), "lse must be +inf exactly where a row sees no key"
    assert (lse[~finite] > 0).all()
    # lse is accumulated in fp32 from 16-bit products: its error is bounded by the fp32 rounding of
    # a sum of |scores| of size ~ scale * |q| |k|, far below this bound (1e-3 relative).
    err = (lse[finite] - lse_ref[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= 1e-3 * max(1.0, lse_ref[finite].abs().max().item() if finite.any() else 1.0), err


def _run_case(B, Sq, Sk, H, Hk, D, Dv, dtype, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
              softmax_scale=None, deterministic=False, seed=0):
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype, seed)
    dout = torch.randn(B, Sq, H, Dv, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    slopes = None
    if alibi == "h":
        slopes = (torch.rand(H, generator=torch.Generator().manual_seed(seed + 2)) * 0.5).to(DEVICE)
    elif alibi == "bh":
        slopes = (torch.rand(B, H, generator=torch.Generator().manual_seed(seed + 2)) * 0.5).to(DEVICE)
    out, lse, _, dq, dk, dv = _dense(q, k, v, dout, deterministic=deterministic, causal=causal, window=window,
                                     softcap=softcap, alibi_slopes=slopes, softmax_scale=softmax_scale)
    ref, pt = _reference(q, k, v, dout, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes,
                         softmax_scale=softmax_scale)
    _check_all((out, dq, dk, dv), ref, pt)
    _check_lse(lse, q, k, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
               softmax_scale=softmax_scale)


# ----------------------------------------------------------------------------------------------------
# Dense forward + backward, every feature (CPU interpreter and GPU)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_basic(dtype, causal):
    _run_case(2, 45, 45, 4, 4, 64, 64, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Sq,Sk", [(1, 37), (37, 3), (33, 70), (70, 33), (16, 48)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_seqlens(dtype, Sq, Sk, causal):
    # Sq > Sk with causal leaves the first Sq - Sk rows without any visible key (out 0, lse +inf).
    # (Sk = 1 is left out: there dQ is exactly 0 and the fp32 rounding of dP - delta, ~1e-7, exceeds a
    # bound of 2 x 0 + rounding(0) = 0.)
    _run_case(1, Sq, Sk, 2, 1, 32, 32, dtype, causal=causal, seed=Sq * 100 + Sk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(8, 0), (5, 11), (-1, 3), (20, -1), (0, 1)])
def test_dense_sliding_window(dtype, window):
    _run_case(1, 50, 61, 2, 2, 32, 32, dtype, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dense_softcap(dtype, causal):
    # softcap 2 on scores of size ~3 saturates tanh, so a wrong (1 - tanh^2) factor shows in the grads.
    _run_case(2, 40, 40, 2, 2, 64, 64, dtype, causal=causal, softcap=2.0, softmax_scale=0.4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("alibi", ["h", "bh"])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_alibi(dtype, alibi, causal):
    _run_case(2, 30, 41, 4, 2, 32, 32, dtype, causal=causal, alibi=alibi)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hk", [(6, 2), (4, 1)])
def test_dense_gqa_mqa(dtype, H, Hk):
    _run_case(2, 40, 40, H, Hk, 32, 32, dtype, causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,Dv", [(40, 40), (72, 72), (128, 128), (200, 200), (256, 256), (64, 32), (24, 96)])
def test_dense_head_dims(dtype, D, Dv):
    _run_case(1, 24, 33, 2, 1, D, Dv, dtype, causal=D % 3 == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_softmax_scale(dtype):
    _run_case(1, 33, 33, 2, 2, 64, 64, dtype, softmax_scale=0.05)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_path_is_correct(dtype, causal):
    # deterministic=True takes the separate dQ kernel instead of the atomic one.
    _run_case(2, 45, 52, 4, 2, 64, 64, dtype, causal=causal, window=(30, -1), deterministic=True)


# The backward's optional code paths (BwdConfig.tma, .split_dkdv), at the interpreter's block sizes.
_VARIANTS = {"tma": dict(tma=True), "split": dict(split_dkdv=True), "tma_split": dict(tma=True, split_dkdv=True)}


def _variant_config(name, dq_atomic=True):
    from flash_attn.triton._configs import BwdConfig
    return BwdConfig(16, 16, 1, 1, 16, 16, 1, 1, dq_atomic, **_VARIANTS[name])


@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_variants_are_correct(variant, deterministic):
    # GQA (3-d descriptor over the group's heads), lengths that end inside a block and a head dim below
    # the padded one (zero fill past both), causal with a left window (every masked loop), softcap+ALiBi.
    dtype = DTYPES[0]
    B, Sq, Sk, H, Hk, D = 2, 37, 45, 4, 2, 40
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, D, dtype, seed=5)
    dout = torch.randn(B, Sq, H, D, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    slopes = (torch.rand(H, generator=torch.Generator().manual_seed(7)) * 0.5).to(DEVICE)
    ref_kw = dict(causal=True, window=(20, -1), softcap=5.0, alibi_slopes=slopes)
    kw = _kwargs(head_dim=D, max_seqlen_q=Sq, max_seqlen_k=Sk, **ref_kw)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    cfg = _variant_config(variant)
    grads = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=deterministic, config=cfg, **kw)
    ref, pt = _reference(q, k, v, dout, **ref_kw)
    _check_all(grads, ref[1:], pt[1:], names=("dq", "dk", "dv"))
    # the path under test was the one taken
    plan = tb._bwd_plan(q, D, D, False, (True, True), True, True, False, deterministic, cfg)
    assert plan[5]["USE_TMA"] == cfg.tma and len(plan[4]) == 1 + cfg.split_dkdv


def test_backward_tma_falls_back_for_unaligned_strides():
    # Row strides that are not a multiple of 16 bytes cannot be described to the copy engine: the pointer
    # path must run (and give the right answer).
    dtype = DTYPES[0]
    B, S, H, D = 1, 20, 2, 40
    q = torch.randn(B, S, H, D + 4, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)[..., :D]
    _, k, v = _qkv(B, S, S, H, H, D, D, dtype, seed=9)
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(10)).to(DEVICE, dtype)
    assert not tb._tma_aligned(q) and tb._tma_aligned(k)
    kw = _kwargs(head_dim=D, max_seqlen_q=S, max_seqlen_k=S)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    grads = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, config=_variant_config("tma"), **kw)
    ref, pt = _reference(q, k, v, dout)
    _check_all(grads, ref[1:], pt[1:], names=("dq", "dk", "dv"))


def test_split_dkdv_with_dropout_matches_single_launch():
    # dV and dK launches apply the same keep mask as the single launch: identical gradients.
    dtype = DTYPES[0]
    B, S, H, D = 1, 33, 2, 32
    q, k, v = _qkv(B, S, S, H, H, D, D, dtype, seed=11)
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    rng = torch.tensor([1234, 5678], dtype=torch.int64)
    kw = _kwargs(head_dim=D, max_seqlen_q=S, max_seqlen_k=S, causal=True, dropout_p=0.2, rng_state=rng)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    from flash_attn.triton._configs import BwdConfig
    base = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, config=BwdConfig(16, 16, 1, 1, 16, 16, 1, 1, True),
                  **kw)
    split = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, config=_variant_config("split"), **kw)
    for a, b in zip(base, split):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_non_contiguous_packed_qkv():
    dtype = DTYPES[0]
    B, S, H, D = 2, 35, 3, 32
    qkv = torch.randn(B, S, 3, H, D, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    q, k, v = qkv.unbind(2)  # strides (S*3*H*D, 3*H*D, D, 1): not contiguous
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    out, lse, _, dq, dk, dv = _dense(q, k, v, dout, causal=True)
    ref, pt = _reference(q, k, v, dout, causal=True)
    _check_all((out, dq, dk, dv), ref, pt)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_writes_into_given_grads(deterministic):
    # grads=(dq, dk, dv) slices of one packed gradient: the kernels write there (no copy), with the
    # slices' strides, and the result is what the unbind path computes.
    dtype = DTYPES[0]
    B, S, H, D = 2, 37, 3, 32
    qkv = torch.randn(B, S, 3, H, D, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    q, k, v = qkv.unbind(2)
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    kw = _kwargs(causal=True, head_dim=D, max_seqlen_q=S, max_seqlen_k=S)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    dqkv = torch.full_like(qkv, float("nan"))
    grads = dqkv.unbind(2)
    result = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=deterministic, grads=grads, **kw)
    assert all(r is g for r, g in zip(result, grads))
    if deterministic:  # bitwise what the same computation gives into fresh tensors
        for got, want in zip(grads, backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, **kw)):
            assert torch.equal(got, want)
    ref, pt = _reference(q, k, v, dout, causal=True)
    _check_all((out, *grads), ref, pt)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_qkvpacked_api_backward_is_one_packed_gradient(backend):
    # flash_attn_qkvpacked_func's backward returns the packed gradient directly (no stack of three);
    # a backend without the grads argument (the reference) has its gradients copied in.
    dtype = DTYPES[0]
    B, S, H, D = 2, 29, 2, 32
    qkv = torch.randn(B, S, 3, H, D, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    qkv.requires_grad_()
    with flash_attn.use_backend(backend):
        out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
    assert type(out.grad_fn).__name__ == "_EagerPackedDenseAttentionBackward"
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = qkv.detach().unbind(2)
    ref, pt = _reference(q, k, v, dout, causal=True)
    _check_all((out.detach(), *dqkv.unbind(2)), ref, pt)


def test_empty_sequences_dense():
    dtype = DTYPES[0]
    q, k, v = _qkv(2, 0, 9, 2, 2, 32, 32, dtype)
    out, lse, _, dq, dk, dv = _dense(q, k, v, torch.zeros_like(q))
    assert out.shape == (2, 0, 2, 32) and lse.shape == (2, 2, 0)
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))
    q, k, v = _qkv(2, 7, 0, 2, 2, 32, 32, dtype)
    dout = torch.randn_like(q)
    out, lse, _, dq, dk, dv = _dense(q, k, v, dout)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all() and (lse > 0).all()
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape


# The sm_90 candidates of the forward (TMA descriptors for K/V, conditional rescale), selected here by an
# explicit config: the interpreter runs the descriptor loads too (zero fill past the sequence end included).
_FWD_VARIANTS = [
    pytest.param(_configs.FwdConfig(16, 16, 1, 1, tma=True), 64, id="tma"),
    pytest.param(_configs.FwdConfig(16, 16, 1, 1, tma=True), 40, id="tma-fallback-d40"),
    pytest.param(_configs.FwdConfig(16, 16, 1, 1, rescale=0.5), 64, id="rescale0.5"),
    pytest.param(_configs.FwdConfig(32, 16, 1, 1, tma=True, rescale=8.0), 64, id="tma-rescale8"),
    # 2 x 4 (sequence, head) pairs in groups of 3: the last group is smaller.
    pytest.param(_configs.FwdConfig(16, 16, 1, 1, group=3), 64, id="group3"),
]


@pytest.mark.parametrize("cfg,D", _FWD_VARIANTS)
@pytest.mark.parametrize("causal", [False, True])
def test_fwd_config_variants(cfg, D, causal):
    dtype = DTYPES[0]
    q, k, v = _qkv(2, 37, 53, 4, 2, D, D, dtype, seed=3)
    # Keys that grow along the sequence keep raising the row maxima block after block, so a conditional
    # rescale both skips and takes the rescale within one row.
    k = (k.float() * torch.linspace(0.3, 4.0, 53).view(1, -1, 1, 1)).to(dtype)
    kw = _kwargs(causal=causal, head_dim=D, max_seqlen_q=37, max_seqlen_k=53)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **kw)
    ref, pt = _reference(q, k, v, torch.zeros_like(q), causal=causal)
    testing.assert_close_to_ref(out, ref[0], pt[0], "out")
    _check_lse(lse, q, k, causal=causal)
    if cfg.tma and D == 64:
        assert any(p[3] for p in tb._FWD_PLANS.values() if p[1].what[-2] is cfg), "TMA plan not used"


# ----------------------------------------------------------------------------------------------------
# Varlen


def _varlen_case(seqlens_q, seqlens_k, H, Hk, D, dtype, causal=False, window=(-1, -1), alibi=False,
                 softcap=0.0, deterministic=False, seed=0):
    B = len(seqlens_q)
    Sq, Sk = max(max(seqlens_q), 1), max(max(seqlens_k), 1)
    lq = torch.tensor(seqlens_q, dtype=torch.int32)
    lk = torch.tensor(seqlens_k, dtype=torch.int32)
    qmask = testing.padding_mask_from_seqlens(lq, Sq).to(DEVICE)
    kmask = testing.padding_mask_from_seqlens(lk, Sk).to(DEVICE)
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, D, dtype, seed)
    dout = torch.randn(B, Sq, H, D, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    dout = dout.masked_fill(~qmask[:, :, None, None], 0.0)
    slopes = (torch.rand(B, H, generator=torch.Generator().manual_seed(seed + 2)) * 0.5).to(DEVICE) if alibi \
        else None
    q_u, cu_q, max_q = testing.padded_to_varlen(q, qmask)
    k_u, cu_k, max_k = testing.padded_to_varlen(k, kmask)
    v_u, _, _ = testing.padded_to_varlen(v, kmask)
    do_u, _, _ = testing.padded_to_varlen(dout, qmask)
    cu_q, cu_k = cu_q.to(DEVICE), cu_k.to(DEVICE)
    kw = _kwargs(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes, head_dim=D,
                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    out_u, lse, _ = backend_fwd(tb, q_u, k_u, v_u, return_probs=False, **kw)
    dq_u, dk_u, dv_u = backend_bwd(tb, do_u, q_u, k_u, v_u, out_u, lse, deterministic=deterministic, **kw)
    assert lse.shape == (H, q_u.shape[0])
    ref, pt = _reference(q, k, v, dout, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes,
                         query_padding_mask=qmask, key_padding_mask=kmask)
    ours = []
    for t, mask in ((out_u, qmask), (dq_u, qmask), (dk_u, kmask), (dv_u, kmask)):
        ours.append(testing.varlen_to_padded(t, cu_q if mask is qmask else cu_k, mask.shape[1])[0])
    _check_all(ours, ref, pt)
    # lse: (H, total_q) -> padded (B, H, Sq); padded rows are not compared.
    lse_pad = testing.varlen_to_padded(lse.t(), cu_q, Sq)[0].permute(0, 2, 1)
    lse_ref = testing.attention_lse_ref(q, k, query_padding_mask=qmask, key_padding_mask=kmask, causal=causal,
                                        window_size=window, softcap=softcap, alibi_slopes=slopes)
    valid = qmask[:, None, :].expand_as(lse_ref)
    a, r = lse_pad[valid], lse_ref[valid]
    assert torch.equal(torch.isinf(a), torch.isinf(r))
    fin = torch.isfinite(r)
    if fin.any():
        assert (a[fin] - r[fin]).abs().max().item() <= 1e-3 * max(1.0, r[fin].abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(dtype, causal):
    # includes an empty query sequence, an empty key sequence and Sq != Sk per sequence
    _varlen_case([17, 0, 40, 5, 33], [17, 12, 29, 0, 50], 4, 2, 32, dtype, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_window_alibi_deterministic(dtype):
    _varlen_case([30, 9, 47], [41, 9, 20], 2, 1, 64, dtype, window=(6, 9), alibi=True, deterministic=True,
                 seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_softcap(dtype):
    _varlen_case([21, 34], [34, 21], 2, 2, 32, dtype, causal=True, softcap=3.0, seed=7)


# ----------------------------------------------------------------------------------------------------
# Dropout and returned probabilities


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference_mask(dtype, causal):
    B, Sq, Sk, H, Hk, D = 2, 37, 45, 4, 2, 32
    p = 0.17
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, D, dtype, seed=11)
    dout = torch.randn(B, Sq, H, D, generator=torch.Generator().manual_seed(12)).to(DEVICE, dtype)
    rng_state = torch.tensor([987654321, 123456789], dtype=torch.int64)
    out, lse, probs, dq, dk, dv = _dense(q, k, v, dout, return_probs=True, causal=causal, dropout_p=p,
                                         rng_state=rng_state)
    keep = testing.dropout_keep_mask(rng_state, p, B, H, Sq, Sk, device=DEVICE)
    # S_dmask: probabilities, negated where dropped; the sign pattern is the shared hash's mask.
    _, attn = testing.attention_ref(q.float(), k.float(), v.float(), causal=causal)
    visible = attn > 0
    assert torch.equal(probs[visible] > 0, keep[visible])
    torch.testing.assert_close(probs.abs(), attn, atol=1e-5, rtol=1e-4)
    ref, pt = _reference(q, k, v, dout, causal=causal, dropout_p=p, dropout_mask=keep)
    _check_all((out, dq, dk, dv), ref, pt)
    # the deterministic path regenerates the same mask in its dQ kernel
    _, _, _, dq2, dk2, dv2 = _dense(q, k, v, dout, deterministic=True, causal=causal, dropout_p=p,
                                    rng_state=rng_state)
    _check_all((dq2, dk2, dv2), ref[1:], pt[1:], names=("dq", "dk", "dv"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_varlen_uses_max_seqlen_row_key(dtype):
    seqlens = [13, 0, 29]
    p = 0.3
    B, H, D = len(seqlens), 2, 32
    S = max(seqlens)
    lq = torch.tensor(seqlens, dtype=torch.int32)
    mask = testing.padding_mask_from_seqlens(lq, S).to(DEVICE)
    q, k, v = _qkv(B, S, S, H, H, D, D, dtype, seed=21)
    dout = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(22)).to(DEVICE, dtype)
    dout = dout.masked_fill(~mask[:, :, None, None], 0.0)
    rng_state = torch.tensor([5, 77], dtype=torch.int64)
    q_u, cu, max_s = testing.padded_to_varlen(q, mask)
    k_u, _, _ = testing.padded_to_varlen(k, mask)
    v_u, _, _ = testing.padded_to_varlen(v, mask)
    do_u, _, _ = testing.padded_to_varlen(dout, mask)
    cu = cu.to(DEVICE)
    kw = _kwargs(dropout_p=p, rng_state=rng_state, head_dim=D, cu_seqlens_q=cu, cu_seqlens_k=cu,
                 max_seqlen_q=max_s, max_seqlen_k=max_s)
    out_u, lse, probs = backend_fwd(tb, q_u, k_u, v_u, return_probs=True, **kw)
    dq_u, dk_u, dv_u = backend_bwd(tb, do_u, q_u, k_u, v_u, out_u, lse, deterministic=False, **kw)
    assert probs.shape == (B, H, max_s, max_s)
    keep = testing.dropout_keep_mask(rng_state, p, B, H, S, S, cu_seqlens_q=cu.cpu(), cu_seqlens_k=cu.cpu(),
                                     max_seqlen_q=max_s, device=DEVICE)
    inside = (mask[:, None, :, None] & mask[:, None, None, :]).expand(B, H, S, S)
    assert torch.equal(probs[~inside], torch.zeros_like(probs[~inside]))
    assert torch.equal(probs[inside] > 0, keep[inside])
    ref, pt = _reference(q, k, v, dout, dropout_p=p, dropout_mask=keep, query_padding_mask=mask,
                         key_padding_mask=mask)
    ours = [testing.varlen_to_padded(t, cu, S)[0] for t in (out_u, dq_u, dk_u, dv_u)]
    _check_all(ours, ref, pt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_return_probs_without_dropout(dtype):
    q, k, v = _qkv(1, 30, 47, 2, 1, 32, 32, dtype, seed=31)
    kw = _kwargs(window=(10, 4), alibi_slopes=torch.tensor([0.2, 0.05], device=DEVICE), head_dim=32,
                 max_seqlen_q=30, max_seqlen_k=47)
    out, lse, probs = backend_fwd(tb, q, k, v, return_probs=True, **kw)
    _, attn = testing.attention_ref(q.float(), k.float(), v.float(), window_size=(10, 4),
                                    alibi_slopes=torch.tensor([0.2, 0.05], device=DEVICE))
    assert probs.dtype == torch.float32 and probs.shape == (1, 2, 30, 47)
    assert torch.equal(probs == 0, attn == 0)
    torch.testing.assert_close(probs, attn, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------
# Block skipping and compile stability


def _poison(t, idx):
    t = t.clone()
    t[:, idx] = float("nan")
    return t


@pytest.mark.parametrize("causal", [True, False])
def test_fully_masked_blocks_are_skipped(causal):
    # NaN in one key (or one query) that distant blocks cannot see: a kernel that loaded and masked those
    # blocks would spread the NaN (0 * NaN = NaN in P @ V, dS K, dS^T Q); one that skips them stays finite
    # there. Blocks are 16 wide in the interpreter and at most 128 on a GPU; `span` clears both.
    dtype = DTYPES[0]
    S, W, span = (1024, 16, 300) if CUDA else (128, 8, 48)
    window = (-1, 0) if causal else (W, W)
    rows = torch.arange(S, device=DEVICE)
    dout = torch.randn(1, S, 2, 32, generator=torch.Generator().manual_seed(42)).to(DEVICE, dtype)
    q, k, v = _qkv(1, S, S, 2, 2, 32, 32, dtype, seed=41)
    # Poisoned key: causal, key j is seen by queries i >= j; windowed, by |i - j| <= W.
    bad = S - 8 if causal else S // 2
    far_q = (bad - rows > span) if causal else ((bad - rows).abs() > span)
    kp, vp = _poison(k, bad), _poison(v, bad)
    for det in (False, True):
        out, _, _, dq, _, _ = _dense(q, kp, vp, dout, deterministic=det, causal=causal, window=window)
        assert not torch.isfinite(out).all()  # the poison is real: queries that see it get NaN
        assert torch.isfinite(out[:, far_q]).all() and torch.isfinite(dq[:, far_q]).all()
    # Poisoned query (and its dO): key j sees it only if bad >= j (causal) or |bad - j| <= W.
    bad = 8 if causal else S // 2
    far_k = (rows - bad > span) if causal else ((rows - bad).abs() > span)
    qp, dop = _poison(q, bad), _poison(dout, bad)
    for det in (False, True):
        _, _, _, _, dk, dv = _dense(qp, k, v, dop, deterministic=det, causal=causal, window=window)
        assert not torch.isfinite(dk).all()
        assert torch.isfinite(dk[:, far_k]).all() and torch.isfinite(dv[:, far_k]).all()


def test_seqlens_are_runtime_arguments():
    # A new sequence length must not compile a new kernel: lengths, windows and seeds are neither
    # constexpr nor value-specialised (== 1, % 16).
    import inspect

    import triton.language as tl

    from flash_attn.triton import _bwd, _fwd
    # lse row strides (Sq) change with the sequence length too
    runtime = ["seqlen_q", "seqlen_k", "window_left", "window_right", "seed0", "seed1", "dropout_threshold",
               "stride_lb", "stride_lh"]
    for kern in (_fwd._attn_fwd_kernel, _bwd._bwd_dkdv_kernel, _bwd._bwd_dq_kernel):
        params = inspect.signature(kern.fn).parameters
        # JITFunction keeps the option as an attribute, the interpreter's wrapper in .kwargs
        dns = getattr(kern, "kwargs", {}).get("do_not_specialize") or kern.do_not_specialize
        dns = [kern.arg_names[i] if isinstance(i, int) else i for i in dns]
        for name in runtime:
            assert params[name].annotation is not tl.constexpr, name
            assert name in dns, name
        assert params["BLOCK_M"].annotation is tl.constexpr


# ----------------------------------------------------------------------------------------------------
# Contract and public API


def _call(**kw):
    from flash_attn.dispatch import Call
    base = dict(device_type=DEVICE, dtype=torch.float16, head_dim=64, head_dim_v=64)
    base.update(kw)
    return Call(**base)


def test_unsupported_reasons():
    assert tb.NAME == "triton"
    assert tb.unavailable_reason() is None
    assert tb.unsupported_reason(_call()) is None
    assert tb.unsupported_reason(_call(causal=True, window_left=8, window_right=0, softcap=30.0, alibi=True,
                                       varlen=True, dropout_p=0.1, return_probs=True, backward=True,
                                       deterministic=True)) is None
    assert tb.unsupported_reason(_call(kvcache=True, paged=True)) is None  # kvcache.py
    assert "paged" in tb.unsupported_reason(_call(paged=True, varlen=True))
    assert "head dim" in tb.unsupported_reason(_call(head_dim=320, head_dim_v=320))
    if not CUDA:
        assert "bf16" in tb.unsupported_reason(_call(dtype=torch.bfloat16))


def test_public_api_uses_triton_backend():
    import flash_attn

    dtype = DTYPES[0]
    q, k, v = _qkv(2, 33, 40, 4, 2, 32, 32, dtype, seed=51)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with flash_attn.use_backend("triton"):
        out = flash_attn.flash_attn_func(q, k, v, causal=True, window_size=(12, -1))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, pt = _reference(q.detach(), k.detach(), v.detach(), dout, causal=True, window=(12, 0))
    _check_all((out.detach(), *grads), ref, pt)


# ----------------------------------------------------------------------------------------------------
# GPU: real sizes, bf16, determinism, memory, compile stability


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_real_sizes(dtype, D, causal):
    S = 2048 if D != 128 else 4096
    _run_case(2, S, S, 4, 2, D, D, dtype, causal=causal, seed=D)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_seqlen_8k(causal):
    _run_case(1, 8192, 8192, 2, 1, 128, 128, torch.bfloat16, causal=causal, seed=8)


@pytest.mark.gpu
def test_gpu_varlen_real_sizes():
    g = torch.Generator().manual_seed(61)
    seqlens_q = torch.randint(0, 1500, (6,), generator=g).tolist()
    seqlens_k = torch.randint(0, 1500, (6,), generator=g).tolist()
    _varlen_case(seqlens_q, seqlens_k, 8, 2, 128, torch.bfloat16, causal=True, seed=62)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_deterministic_bitwise(D):
    q, k, v = _qkv(2, 2048, 2048, 8, 2, D, D, torch.bfloat16, seed=71)
    dout = torch.randn_like(q)
    kw = _kwargs(causal=True, head_dim=D, max_seqlen_q=2048, max_seqlen_k=2048)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    first = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, **kw)
    for _ in range(9):
        again = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=True, **kw)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_long_sequence_memory_is_linear():
    # 64k keys: an S x S buffer would need 16 GiB per head in fp32; the kernels need O(S) extra memory.
    H, D = 4, 64
    peaks = {}
    for S in (16384, 65536):
        q, k, v = _qkv(1, S, S, H, H, D, D, torch.bfloat16, seed=S)
        dout = torch.randn_like(q)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        kw = _kwargs(causal=True, head_dim=D, max_seqlen_q=S, max_seqlen_k=S)
        out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
        dq, dk, dv = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=False, **kw)
        torch.cuda.synchronize()
        peaks[S] = torch.cuda.max_memory_allocated() - base
        assert torch.isfinite(out).all() and torch.isfinite(dq).all()
        del q, k, v, dout, out, lse, dq, dk, dv
    input_bytes = 65536 * H * D * 2
    # outputs, lse, delta, fp32 dQ accumulator and grads: a small multiple of one input, linear in S
    assert peaks[65536] <= 12 * input_bytes, peaks
    assert peaks[65536] <= 4.5 * peaks[16384], peaks


@pytest.mark.gpu
def test_gpu_no_recompile_for_new_seqlens():
    from flash_attn.triton import _fwd

    def n_compiled():
        caches = getattr(_fwd._attn_fwd_kernel, "device_caches", None)
        if caches is None:
            pytest.fail("Triton JITFunction without device_caches: update this test for the new API")
        return sum(len(c[0]) for c in caches.values())

    dtype = torch.bfloat16
    q, k, v = _qkv(1, 100, 100, 2, 2, 64, 64, dtype)
    backend_fwd(tb, q, k, v, return_probs=False, **_kwargs(causal=True, head_dim=64, max_seqlen_q=100, max_seqlen_k=100))
    before = n_compiled()
    for S in (129, 1000, 1, 64, 4097):
        q, k, v = _qkv(1, S, S + 3, 2, 2, 64, 64, dtype)
        backend_fwd(tb, q, k, v, return_probs=False, **_kwargs(causal=True, head_dim=64, max_seqlen_q=S,
                                                        max_seqlen_k=S + 3))
    assert n_compiled() == before


@pytest.mark.gpu
def test_gpu_fast_relaunch_matches_first_launch():
    # Repeated calls skip Triton's argument binding (flash_attn/triton/_launch.py); a misaligned pointer
    # must not reuse a kernel compiled for 16-byte-aligned ones.
    q, k, v = _qkv(2, 300, 300, 4, 2, 64, 64, torch.bfloat16, seed=81)
    kw = _kwargs(causal=True, head_dim=64, max_seqlen_q=300, max_seqlen_k=300)
    first = backend_fwd(tb, q, k, v, return_probs=False, **kw)[0]
    n, slow = len(tb._L_FWD.cache), tb._L_FWD.slow_launches
    again = backend_fwd(tb, q, k, v, return_probs=False, **kw)[0]
    assert len(tb._L_FWD.cache) == n and n > 0
    assert tb._L_FWD.slow_launches == slow, "the repeated call did not take the fast relaunch"
    assert torch.equal(first, again)
    # the same through the public API, with and without autograd, and the backward's kernels
    with flash_attn.use_backend("triton"):
        api = flash_attn.flash_attn_func(q, k, v, causal=True)
        slow = tb._L_FWD.slow_launches
        assert torch.equal(flash_attn.flash_attn_func(q, k, v, causal=True), api)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_attn.flash_attn_func(qg, kg, vg, causal=True, deterministic=True)
        assert torch.equal(out, api) and tb._L_FWD.slow_launches == slow
        out.sum().backward()
        grads = [t.grad.clone() for t in (qg, kg, vg)]
        slow_bwd = tb._L_DKDV.slow_launches + tb._L_DQ.slow_launches + tb._L_PRE.slow_launches
        for t in (qg, kg, vg):
            t.grad = None
        flash_attn.flash_attn_func(qg, kg, vg, causal=True, deterministic=True).sum().backward()
        assert tb._L_DKDV.slow_launches + tb._L_DQ.slow_launches + tb._L_PRE.slow_launches == slow_bwd
        assert all(torch.equal(t.grad, g) for t, g in zip((qg, kg, vg), grads))
    flat = torch.empty(q.numel() + 1, device=DEVICE, dtype=q.dtype)
    q_odd = flat[1:].view_as(q)  # data_ptr % 16 == 2
    q_odd.copy_(q)
    odd = backend_fwd(tb, q_odd, k, v, return_probs=False, **kw)[0]
    assert len(tb._L_FWD.cache) == n + 1
    dout = torch.zeros_like(q)
    (ref, *_), (pt, *_) = _reference(q, k, v, dout, causal=True)
    testing.assert_close_to_ref(odd, ref, pt)


def test_unavailable_reason_tells_a_broken_triton_from_a_missing_one(monkeypatch):
    import builtins

    real = builtins.__import__
    for missing, expect in (("triton", "triton is not installed"), ("numpy", "triton does not import")):
        def fake(name, *args, _missing=missing, **kwargs):
            if name == "triton":
                raise ModuleNotFoundError(f"No module named {_missing!r}", name=_missing)
            return real(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", fake)
        reason = tb.unavailable_reason()
        monkeypatch.setattr(builtins, "__import__", real)
        assert reason.startswith(expect) and (missing == "triton" or "numpy" in reason), reason
