"""FA2's older norm API (flash_attn.ops.layer_norm, flash_attn.ops.rms_norm) against plain PyTorch: the pre-norm
sum written out with the dropout mask the function returns, then F.layer_norm / RMSNorm; fp32 exactly, bf16 and
fp16 within twice PyTorch's own error; forward and gradients of every input; subsets, parallel residual, modules.
Most cases run the fused front end's PyTorch path; a few run its Triton kernels (in the interpreter on a CPU)."""
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import flash_attn
from flash_attn.ops.layer_norm import (
    DropoutAddLayerNorm, dropout_add_layer_norm, dropout_add_layer_norm_parallel_residual,
    dropout_add_layer_norm_subset, layer_norm,
)
from flash_attn.ops.rms_norm import (
    DropoutAddRMSNorm, RMSNorm, dropout_add_rms_norm, dropout_add_rms_norm_parallel_residual,
    dropout_add_rms_norm_subset, rms_norm,
)

B, S, N = 3, 5, 40
EPS = 1e-5
FUNCS = {False: dropout_add_layer_norm, True: dropout_add_rms_norm}
SUBSET = {False: dropout_add_layer_norm_subset, True: dropout_add_rms_norm_subset}
PARALLEL = {False: dropout_add_layer_norm_parallel_residual, True: dropout_add_rms_norm_parallel_residual}


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # the fused front end's PyTorch path (the interpreter is slow)
        yield


def _norm_ref(pre, weight, bias, is_rms):
    if is_rms:
        out = pre * torch.rsqrt(pre.square().mean(-1, keepdim=True) + EPS) * weight
        return out + bias if bias is not None else out
    return F.layer_norm(pre, pre.shape[-1:], weight, bias, EPS)


def _drop(t, mask, p):
    return t * mask.to(t.dtype) / (1.0 - p) if p > 0 else t


def _leaf(t, dtype=None):
    """A detached copy (in dtype) that requires grad iff t does."""
    if t is None:
        return None
    out = t.detach().clone()
    out = out.to(dtype) if dtype is not None else out
    return out.requires_grad_(t.requires_grad)


def _inputs(dtype=torch.float32, residual_dtype=None, weight_dtype=torch.float32, rowscale=False, layerscale=False,
            residual=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, dt):
        return torch.randn(*shape, generator=g).to(dt)

    d = dict(x0=randn(B, S, N, dt=dtype), weight=1 + 0.3 * randn(N, dt=weight_dtype),
             bias=0.3 * randn(N, dt=weight_dtype) if bias else None,
             residual=randn(B, S, N, dt=residual_dtype or dtype) if residual else None,
             rowscale=(torch.rand(B, S, generator=g) < 0.7).to(dtype) / 0.7 if rowscale else None,
             layerscale=0.5 + randn(N, dt=weight_dtype) if layerscale else None)
    # rowscale gets no gradient (as in FA2): it is a per-row mask-like scale, not a parameter
    return {k: v.requires_grad_(k != "rowscale") if v is not None else None for k, v in d.items()}


def _check_grads(ours, refs, atol=1e-4):
    for name in ours:
        if ours[name] is None or not ours[name].requires_grad:
            continue
        torch.testing.assert_close(ours[name].grad, refs[name].grad.to(ours[name].grad.dtype), atol=atol, rtol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------- fp32
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.37])
@pytest.mark.parametrize("has_layerscale", [False, True])
@pytest.mark.parametrize("has_rowscale", [False, True])
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("is_rms", [False, True])
def test_dropout_add_norm_fp32(is_rms, has_residual, has_rowscale, has_layerscale, dropout_p, prenorm):
    t = _inputs(rowscale=has_rowscale, layerscale=has_layerscale, residual=has_residual)
    r = {k: _leaf(v) for k, v in t.items()}
    outs = FUNCS[is_rms](t["x0"], t["residual"], t["weight"], t["bias"], dropout_p, EPS, rowscale=t["rowscale"],
                         layerscale=t["layerscale"], prenorm=prenorm, return_dropout_mask=True)
    out, pre, mask = outs if prenorm else (outs[0], None, outs[1])
    assert mask.dtype == torch.uint8 and mask.shape == t["x0"].shape
    assert bool((mask == 1).all()) == (dropout_p == 0.0)
    x = r["x0"]
    if has_rowscale:
        x = x * r["rowscale"][..., None]
    if has_layerscale:
        x = x * r["layerscale"]
    pre_ref = _drop(x, mask, dropout_p) + (r["residual"] if has_residual else 0)
    out_ref = _norm_ref(pre_ref, r["weight"], r["bias"], is_rms)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    loss, loss_ref = out.square().sum(), out_ref.square().sum()
    if prenorm:
        torch.testing.assert_close(pre, pre_ref, atol=1e-5, rtol=1e-5)
        loss, loss_ref = loss + (pre * pre.detach()).sum(), loss_ref + (pre_ref * pre_ref.detach()).sum()
    loss.backward()
    loss_ref.backward()
    _check_grads(t, r)


def test_layerscale_and_rowscale_scale():
    t = _inputs(rowscale=True, layerscale=True, residual=False)
    t["layerscale"] = torch.full((N,), 3.0, requires_grad=True)
    _, pre = dropout_add_layer_norm(t["x0"], None, t["weight"], t["bias"], 0.0, EPS, rowscale=t["rowscale"],
                                    layerscale=t["layerscale"], prenorm=True)
    torch.testing.assert_close(pre, 3.0 * t["x0"] * t["rowscale"][..., None], atol=1e-6, rtol=1e-6)
    pre.sum().backward()
    # d(sum pre) / d layerscale_j = sum over rows of x0 * rowscale
    torch.testing.assert_close(t["layerscale"].grad, (t["x0"] * t["rowscale"][..., None]).sum((0, 1)).detach(),
                               atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------- dtype rules
@pytest.mark.parametrize("has_layerscale", [False, True])
@pytest.mark.parametrize("residual_in_fp32", [False, True])
@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16, torch.float32], ids=["none", "bf16", "fp32"])
def test_output_and_residual_dtypes(residual_dtype, residual_in_fp32, has_layerscale):
    # out: x0's dtype; pre-norm sum: residual's dtype, else fp32 with residual_in_fp32, else x0's dtype.
    t = _inputs(dtype=torch.bfloat16, residual_dtype=residual_dtype, residual=residual_dtype is not None,
                layerscale=has_layerscale)
    out, pre = dropout_add_layer_norm(t["x0"], t["residual"], t["weight"], t["bias"], 0.1, EPS,
                                      layerscale=t["layerscale"], prenorm=True, residual_in_fp32=residual_in_fp32)
    expected = residual_dtype or (torch.float32 if residual_in_fp32 else torch.bfloat16)
    assert out.dtype == torch.bfloat16 and pre.dtype == expected
    (out.float().sum() + pre.float().sum()).backward()
    assert t["x0"].grad.dtype == torch.bfloat16 and t["weight"].grad.dtype == torch.float32
    if t["residual"] is not None:
        assert t["residual"].grad.dtype == residual_dtype
    if has_layerscale:
        assert t["layerscale"].grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------- bf16/fp16
@pytest.mark.parametrize("weight_dtype", [torch.float32, "input"])
@pytest.mark.parametrize("residual_fp32", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_rms", [False, True])
def test_half_within_pytorch_error(is_rms, dtype, residual_fp32, weight_dtype):
    # PyTorch's own low-precision run: the pre-norm sum rounded to the residual dtype, normalised in the weight
    # dtype. Ours keeps the sum in fp32 for the norm; its error against the fp32 reference is at most twice
    # PyTorch's, plus one rounding of the result.
    weight_dtype = dtype if weight_dtype == "input" else weight_dtype
    p = 0.2
    t = _inputs(dtype=dtype, residual_dtype=torch.float32 if residual_fp32 else dtype, weight_dtype=weight_dtype,
                rowscale=True, layerscale=True)
    r32 = {k: _leaf(v, torch.float32) for k, v in t.items()}
    rpt = {k: _leaf(v) for k, v in t.items()}
    out, pre, mask = FUNCS[is_rms](t["x0"], t["residual"], t["weight"], t["bias"], p, EPS, rowscale=t["rowscale"],
                                   layerscale=t["layerscale"], prenorm=True, return_dropout_mask=True)
    assert out.dtype == dtype and pre.dtype == t["residual"].dtype

    def pre_of(d, cast):
        x = d["x0"].float() * d["rowscale"].float()[..., None] * d["layerscale"].float()
        s = _drop(x, mask, p) + d["residual"].float()
        return s.to(t["residual"].dtype) if cast else s

    pre32, prept = pre_of(r32, False), pre_of(rpt, True)
    out32 = _norm_ref(pre32, r32["weight"], r32["bias"], is_rms)
    outpt = _norm_ref(prept.to(weight_dtype), rpt["weight"], rpt["bias"], is_rms).to(dtype)

    def within(ours, pt, ref):
        slack = torch.finfo(dtype).eps * ref.abs().max().item()
        assert (ours.float() - ref).abs().max() <= 2 * (pt.float() - ref).abs().max() + slack

    within(out, outpt, out32)
    within(pre, prept, pre32)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    for o, pr in ((out, pre), (outpt, prept), (out32, pre32)):
        ((o.float() * g).sum() + (pr.float() * torch.sigmoid(pre32.detach())).sum()).backward()
    for name in ("x0", "residual", "weight", "bias", "layerscale"):
        within(t[name].grad, rpt[name].grad, r32[name].grad)


# -------------------------------------------------------------------------------------------- dropout
def test_dropout_mask_reproducible_and_fresh():
    t = _inputs(rowscale=True)
    args = (t["x0"], t["residual"], t["weight"], t["bias"], 0.3, EPS)
    torch.manual_seed(42)
    out0, m0 = dropout_add_layer_norm(*args, rowscale=t["rowscale"], return_dropout_mask=True)
    out1, m1 = dropout_add_layer_norm(*args, rowscale=t["rowscale"], return_dropout_mask=True)
    torch.manual_seed(42)
    out2, m2 = dropout_add_layer_norm(*args, rowscale=t["rowscale"], return_dropout_mask=True)
    assert not torch.equal(m0, m1) and torch.equal(m0, m2) and torch.equal(out0, out2)
    assert abs(1 - m0.float().mean().item() - 0.3) < 0.1


def test_no_dropout_mask_is_ones():
    t = _inputs()
    out, mask = dropout_add_rms_norm(t["x0"], t["residual"], t["weight"], None, 0.0, EPS, return_dropout_mask=True)
    assert mask.dtype == torch.uint8 and bool((mask == 1).all()) and mask.shape == t["x0"].shape


# --------------------------------------------------------------------------------------------- subset
def _drop_path_rows(keep):
    """keep (B,) bool -> (numrows, (B, S) int32 1-based row map) as FA2's drop-path callers build them."""
    rows = keep[:, None].expand(B, S).reshape(-1)
    subset = torch.cumsum(rows, 0, dtype=torch.int32).masked_fill(~rows, 0)
    return int(rows.sum()), subset.view(B, S)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("has_layerscale", [False, True])
@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("is_rms", [False, True])
def test_subset_matches_reference(is_rms, prenorm, has_residual, has_layerscale, dropout_p):
    x0_keep, out_keep = torch.tensor([True, False, True]), torch.tensor([False, True, True])
    x0_rows, x0_subset = _drop_path_rows(x0_keep)
    out_rows, out_subset = _drop_path_rows(out_keep)
    scale = 1 / 0.6
    t = _inputs(residual=has_residual, layerscale=has_layerscale)
    full_x0 = t["x0"].detach()
    t["x0"] = full_x0[x0_keep].requires_grad_()  # only the kept sequences are stored
    r = {k: _leaf(v) for k, v in t.items()}
    outs = SUBSET[is_rms](t["x0"], t["residual"], t["weight"], t["bias"], dropout_p, EPS, layerscale=t["layerscale"],
                          x0_subset=x0_subset, out_subset=out_subset, rowscale_const=scale, out_numrows=out_rows,
                          prenorm=prenorm, return_dropout_mask=True)
    out, pre, mask = outs if prenorm else (outs[0], None, outs[1])
    assert out.shape == (2, S, N) and mask.shape == t["x0"].shape and mask.dtype == torch.uint8
    full_mask = torch.zeros(B, S, N, dtype=torch.uint8)
    full_mask[x0_keep] = mask
    x = torch.zeros(B, S, N).index_put((x0_keep.nonzero()[:, 0],), r["x0"]) * scale
    if has_layerscale:
        x = x * r["layerscale"]
    pre_ref = _drop(x, full_mask, dropout_p) + (r["residual"] if has_residual else 0)
    out_ref = _norm_ref(pre_ref, r["weight"], r["bias"], is_rms)[out_keep]
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    loss, loss_ref = (out * out.detach()).sum(), (out_ref * out_ref.detach()).sum()
    if prenorm:
        assert pre.shape == (B, S, N)
        torch.testing.assert_close(pre, pre_ref, atol=1e-5, rtol=1e-5)
        loss, loss_ref = loss + pre.square().mean(), loss_ref + pre_ref.square().mean()
    loss.backward()
    loss_ref.backward()
    _check_grads(t, r)


def test_subset_one_side_only():
    t = _inputs()
    keep = torch.tensor([True, True, False])
    rows, subset = _drop_path_rows(keep)
    # out_subset alone: every x0 row is read, only kept rows are written
    out = dropout_add_layer_norm_subset(t["x0"], t["residual"], t["weight"], t["bias"], 0.0, EPS, out_subset=subset,
                                        out_numrows=rows)
    full = dropout_add_layer_norm(t["x0"], t["residual"], t["weight"], t["bias"], 0.0, EPS)
    torch.testing.assert_close(out, full[keep], atol=0, rtol=0)
    # x0_subset alone: dropped sequences add nothing to their residual; rowscale_const scales the rest
    out = dropout_add_rms_norm_subset(t["x0"][keep], t["residual"], t["weight"], None, 0.0, EPS, x0_subset=subset,
                                      rowscale_const=2.0)
    x = t["x0"].detach() * keep[:, None, None] * 2.0
    torch.testing.assert_close(out, _norm_ref(x + t["residual"].detach(), t["weight"].detach(), None, True),
                               atol=1e-5, rtol=1e-5)


def test_subset_dropout_mask_follows_x0_rows():
    # The mask comes back in x0's row order: dropping x0 * mask by hand gives the same pre-norm sum.
    t = _inputs(residual=False)
    keep = torch.tensor([False, True, True])
    rows, subset = _drop_path_rows(keep)
    x0 = t["x0"].detach()[keep]
    torch.manual_seed(3)
    _, pre, mask = dropout_add_layer_norm_subset(x0, None, t["weight"], t["bias"], 0.5, EPS, x0_subset=subset,
                                                 out_subset=subset, out_numrows=rows, prenorm=True,
                                                 return_dropout_mask=True)
    assert 0 < mask.float().mean() < 1
    torch.testing.assert_close(pre[keep], x0 * mask / 0.5, atol=1e-6, rtol=1e-6)
    assert bool((pre[~keep] == 0).all())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x0_subset=torch.ones(B, S)), TypeError, "x0_subset"),
    (dict(out_subset=torch.ones(B * S + 1, dtype=torch.int32), out_numrows=1), ValueError, "out_subset"),
    (dict(out_subset=torch.ones(B, S, dtype=torch.int32), out_numrows=-1), ValueError, "out_numrows"),
    (dict(out_subset=torch.ones(B, S, dtype=torch.int32), out_numrows=3), ValueError, "out_numrows"),
    (dict(rowscale_const="2"), TypeError, "rowscale_const"),
    (dict(layerscale=torch.ones(N + 1)), ValueError, "layerscale"),
])
def test_subset_invalid_arguments(kwargs, error, match):
    t = _inputs()
    with pytest.raises(error, match=match):
        dropout_add_layer_norm_subset(t["x0"], t["residual"], t["weight"], t["bias"], 0.0, EPS, **kwargs)


def test_subset_residual_rows_checked():
    t = _inputs()
    _, subset = _drop_path_rows(torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match="residual"):
        dropout_add_layer_norm_subset(t["x0"][:2], t["residual"][:2], t["weight"], t["bias"], 0.0, EPS,
                                      x0_subset=subset)


# ---------------------------------------------------------------------------------------- parallel residual
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.37])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("has_x1, has_residual", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("is_rms", [False, True])
def test_parallel_residual_matches_reference(is_rms, has_x1, has_residual, tied, dropout_p, prenorm):
    t = _inputs(residual=has_residual, bias=not is_rms)
    g = torch.Generator().manual_seed(9)
    t["x1"] = torch.randn(B, S, N, generator=g).requires_grad_() if has_x1 else None
    t["weight1"] = None if tied else (1 + 0.3 * torch.randn(N, generator=g)).requires_grad_()
    t["bias1"] = None if tied or is_rms else (0.3 * torch.randn(N, generator=g)).requires_grad_()
    r = {k: _leaf(v) for k, v in t.items()}
    outs = PARALLEL[is_rms](t["x0"], t["x1"], t["residual"], t["weight"], t["bias"], t["weight1"], t["bias1"],
                            dropout_p, EPS, prenorm=prenorm, return_dropout_mask=True)
    assert len(outs) == 4 + prenorm
    out0, out1, m0, m1 = outs[0], outs[1], outs[-2], outs[-1]
    assert (out1 is None) == tied and m0.dtype == m1.dtype == torch.uint8
    assert bool((m1 == 1).all()) == (dropout_p == 0.0 or not has_x1)
    pre_ref = _drop(r["x0"], m0, dropout_p)
    if has_x1:
        pre_ref = pre_ref + _drop(r["x1"], m1, dropout_p)
    if has_residual:
        pre_ref = pre_ref + r["residual"]
    ref0 = _norm_ref(pre_ref, r["weight"], r["bias"], is_rms)
    torch.testing.assert_close(out0, ref0, atol=1e-5, rtol=1e-5)
    loss, loss_ref = out0.square().sum(), ref0.square().sum()
    if not tied:
        ref1 = _norm_ref(pre_ref, r["weight1"], r["bias1"], is_rms)
        torch.testing.assert_close(out1, ref1, atol=1e-5, rtol=1e-5)
        loss, loss_ref = loss + (out1 * ref1.detach()).sum(), loss_ref + (ref1 * ref1.detach()).sum()
    if prenorm:
        torch.testing.assert_close(outs[2], pre_ref, atol=1e-5, rtol=1e-5)
        loss, loss_ref = loss + torch.sigmoid(outs[2]).sum(), loss_ref + torch.sigmoid(pre_ref).sum()
    loss.backward()
    loss_ref.backward()
    _check_grads(t, r)


def test_parallel_residual_without_mask_returns_pair():
    t = _inputs()
    out0, out1 = dropout_add_layer_norm_parallel_residual(t["x0"], None, t["residual"], t["weight"], t["bias"],
                                                          None, None, 0.0, EPS)
    assert out1 is None
    torch.testing.assert_close(out0, dropout_add_layer_norm(t["x0"], t["residual"], t["weight"], t["bias"], 0.0, EPS))


# -------------------------------------------------------------------------------------------- modules
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("cls, is_rms", [(DropoutAddLayerNorm, False), (DropoutAddRMSNorm, True)])
def test_dropout_add_norm_modules(cls, is_rms, prenorm):
    m = cls(N, prenorm=prenorm, p=0.5, eps=EPS, residual_in_fp32=True, dtype=torch.bfloat16)
    assert torch.equal(m.weight, torch.ones(N, dtype=torch.bfloat16)) and (m.bias is None) == is_rms
    if not is_rms:
        assert torch.equal(m.bias, torch.zeros(N, dtype=torch.bfloat16))
    torch.nn.init.normal_(m.weight)
    x0 = torch.randn(B, S, N, dtype=torch.bfloat16)
    m.eval()  # no dropout: the plain fused norm of x0 (+ residual)
    out = m(x0)
    ref = FUNCS[is_rms](x0, None, m.weight, m.bias, 0.0, EPS, prenorm=prenorm, residual_in_fp32=True)
    for a, b in zip(out if prenorm else [out], ref if prenorm else [ref]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    if prenorm:
        assert out[1].dtype == torch.float32  # residual_in_fp32 reaches the function
    m.train()
    torch.manual_seed(0)
    out_train = m(x0, torch.randn_like(x0))
    assert not torch.equal(out_train[0] if prenorm else out_train, out[0] if prenorm else out)


def test_rms_norm_and_layer_norm_functions_and_module():
    t = _inputs(dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
    x, w, b = (t[k].detach() for k in ("x0", "weight", "bias"))
    y = layer_norm(x, w, b, EPS)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), _norm_ref(x.float(), w.float(), b.float(), False), atol=2e-2, rtol=0)
    m = RMSNorm(N, eps=EPS, dtype=torch.bfloat16)
    assert m.bias is None and torch.equal(m.weight, torch.ones(N, dtype=torch.bfloat16))
    with torch.no_grad():
        m.weight.copy_(w)
    torch.testing.assert_close(m(x), rms_norm(x, w, EPS), atol=0, rtol=0)
    torch.testing.assert_close(m(x).float(), _norm_ref(x.float(), w.float(), None, True), atol=2e-2, rtol=0)


def test_block_takes_fa2_rms_norm_modules_as_rms():
    from flash_attn.modules.block import Block
    from flash_attn.modules.mha import MHA
    from flash_attn.modules.mlp import Mlp

    def block(fused):
        torch.manual_seed(0)
        return Block(N, partial(MHA, num_heads=4), partial(Mlp, hidden_features=64), norm_cls=partial(RMSNorm, eps=EPS),
                     fused_dropout_add_ln=fused).eval()

    x = torch.randn(B, S, N)
    for a, b in zip(block(True)(x), block(False)(x)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make, error, match", [
    (lambda t: dropout_add_layer_norm([1.0], None, t["weight"], t["bias"], 0.0, EPS), TypeError, "x0"),
    (lambda t: dropout_add_layer_norm(t["x0"], None, t["weight"], t["bias"], 0.0, -1.0), ValueError, "epsilon"),
    (lambda t: dropout_add_layer_norm(t["x0"], None, t["weight"], t["bias"], 1.0, EPS), ValueError, "dropout_p"),
    (lambda t: dropout_add_rms_norm(t["x0"], None, t["weight"], None, 0.0, EPS, layerscale=torch.ones(3)),
     ValueError, "layerscale"),
    (lambda t: dropout_add_rms_norm(t["x0"], t["residual"][:1], t["weight"], None, 0.0, EPS), ValueError, "residual"),
])
def test_invalid_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make(_inputs())


# ---------------------------------------------------------------------------------------- Triton path
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU the kernels run in the interpreter


def _on(d, device):
    return {k: _leaf(v.to(device)) if v is not None else None for k, v in d.items()}


def test_triton_path_everything_on():
    # rowscale, layerscale, dropout, residual and prenorm through the Triton kernels: same masks and values as the
    # PyTorch path (the mask hash is shared), gradients too.
    t = _on(_inputs(rowscale=True, layerscale=True), TRITON_DEVICE)
    r = {k: _leaf(v) for k, v in t.items()}
    outs = {}
    for name, d in (("triton", t), ("torch", r)):
        with flash_attn.use_backend(name):
            torch.manual_seed(1)
            outs[name] = dropout_add_layer_norm(d["x0"], d["residual"], d["weight"], d["bias"], 0.25, EPS,
                                                rowscale=d["rowscale"], layerscale=d["layerscale"], prenorm=True,
                                                return_dropout_mask=True)
            (outs[name][0].square().sum() + outs[name][1].sum()).backward()
    for a, b in zip(outs["triton"], outs["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    _check_grads(t, r)


def test_triton_path_subset():
    keep = torch.tensor([True, False, True])
    rows, subset = _drop_path_rows(keep)
    t = _on(_inputs(), TRITON_DEVICE)
    x0, subset = t["x0"].detach()[keep.to(TRITON_DEVICE)], subset.to(TRITON_DEVICE)
    res = {}
    for name in ("triton", "torch"):
        with flash_attn.use_backend(name):
            res[name] = dropout_add_rms_norm_subset(x0, t["residual"], t["weight"], None, 0.0, EPS, x0_subset=subset,
                                                    out_subset=subset, rowscale_const=1.5, out_numrows=rows)
    torch.testing.assert_close(res["triton"], res["torch"], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("hidden", [768, 3000])
def test_gpu_bf16_dropout_add_norm(is_rms, hidden):
    torch.manual_seed(0)
    dev, p = "cuda", 0.37
    x0 = torch.randn(8, 512, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    res = torch.randn(8, 512, hidden, device=dev, dtype=torch.float32, requires_grad=True)
    w = torch.randn(hidden, device=dev, requires_grad=True)
    b = torch.randn(hidden, device=dev, requires_grad=True)
    ls = torch.randn(hidden, device=dev, requires_grad=True)
    rs = ((torch.rand(8, 512, device=dev) < 0.87) / 0.87).to(torch.bfloat16)
    with flash_attn.use_backend("triton"):
        out, pre, mask = FUNCS[is_rms](x0, res, w, b, p, EPS, rowscale=rs, layerscale=ls, prenorm=True,
                                       return_dropout_mask=True)
        (out.float() * torch.sigmoid(pre)).sum().backward()
    leaves = [t.detach().float().requires_grad_() for t in (x0, res, w, b, ls)]
    pre_ref = _drop(leaves[0] * rs.float()[..., None] * leaves[4], mask, p) + leaves[1]
    out_ref = _norm_ref(pre_ref, leaves[2], leaves[3], is_rms)
    torch.testing.assert_close(pre, pre_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.float(), out_ref, atol=0.05, rtol=0.01)
    (out_ref.to(torch.bfloat16).float() * torch.sigmoid(pre_ref)).sum().backward()
    for ours, ref in zip((x0, res, w, b, ls), leaves):
        scale = ref.grad.abs().max().item()
        assert (ours.grad.float() - ref.grad).abs().max().item() <= 0.02 * scale


@pytest.mark.gpu
def test_gpu_subset_and_parallel_match_cpu_path():
    keep = torch.tensor([True, False, True])
    rows, subset = _drop_path_rows(keep)
    t = _inputs(layerscale=True)
    x0 = t["x0"].detach()[keep]
    args = (t["residual"].detach(), t["weight"].detach(), t["bias"].detach(), 0.0, EPS)
    kw = dict(layerscale=t["layerscale"].detach(), x0_subset=subset, out_subset=subset, rowscale_const=1.5,
              out_numrows=rows, prenorm=True)
    cpu = dropout_add_layer_norm_subset(x0, *args, **kw)
    with flash_attn.use_backend("triton"):
        gpu = dropout_add_layer_norm_subset(x0.cuda(), *(a.cuda() if torch.is_tensor(a) else a for a in args),
                                            **{k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()})
        par = dropout_add_rms_norm_parallel_residual(x0.cuda(), x0.cuda(), None, args[1].cuda(), None,
                                                     args[1].cuda() * 2, None, 0.0, EPS, prenorm=True)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(par[2].cpu(), 2 * x0, atol=1e-6, rtol=0)
