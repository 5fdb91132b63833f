"""flash_attn.layers.rotary (kernel ops/triton/rotary.py) against a direct PyTorch reference, on the
Triton path (interpreter on CPU) and the plain-PyTorch path."""

import pytest
import torch

from flash_attn.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,
                                      apply_rotary_emb_qkv_)
from flash_attn.ops.triton import backend, triton_runs_on
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()


@pytest.fixture(params=["triton", "torch"])
def path(request):
    if request.param == "triton" and not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    with backend(request.param):
        yield request.param


def _device(path):
    return "cuda" if CUDA and path == "triton" else "cpu"


def rotary_ref(x, cos, sin, interleaved=False, offsets=0):
    """x (B, S, H, D); cos/sin (S_ro, rd/2); position s + offsets[b]; past the table: no rotation."""
    B, S = x.shape[:2]
    half = cos.shape[1]
    off = offsets.view(B, 1).long() if torch.is_tensor(offsets) else torch.full((B, 1), offsets)
    pos = torch.arange(S).view(1, S) + off.cpu()
    ok = (pos < cos.shape[0]).to(x.device)
    idx = pos.clamp(max=cos.shape[0] - 1).to(x.device)
    c = torch.where(ok[..., None], cos[idx].to(x.dtype), torch.ones((), dtype=x.dtype, device=x.device))
    s = torch.where(ok[..., None], sin[idx].to(x.dtype), torch.zeros((), dtype=x.dtype, device=x.device))
    c, s = c.unsqueeze(2), s.unsqueeze(2)  # (B, S, 1, half)
    xr, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def _tables(seqlen_ro, rd, device, dtype, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.outer(torch.arange(seqlen_ro, dtype=torch.float64), inv)
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


def _check_fwd_bwd(fn, ref_fn, x, name="out"):
    """fn(x) against ref_fn at fp64 and at x's dtype, outputs and input gradients."""
    x = x.detach().requires_grad_()
    out = fn(x)
    x64 = x.detach().double().requires_grad_()
    xpt = x.detach().clone().requires_grad_()
    o64, opt = ref_fn(x64), ref_fn(xpt)
    assert_close_to_ref(out, o64, opt, name=name)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device)
    (dx,) = torch.autograd.grad(out, x, g.to(out.dtype))
    (d64,) = torch.autograd.grad(o64, x64, g.double())
    (dpt,) = torch.autograd.grad(opt, xpt, g.to(out.dtype))
    assert_close_to_ref(dx, d64, dpt, name=f"grad of {name}")


@pytest.mark.parametrize("offsets", ["int", "tensor"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,S,H,D,rd", [(2, 5, 3, 16, 16), (1, 1, 1, 10, 6), (3, 17, 2, 64, 32)])
def test_apply_rotary_emb(path, B, S, H, D, rd, dtype, interleaved, offsets):
    dev = _device(path)
    g = torch.Generator().manual_seed(B * S + D)
    x = torch.randn(B, S, H, D, generator=g).to(dev, dtype)
    seqlen_ro = S + 4
    cos, sin = _tables(seqlen_ro, rd, dev, dtype)
    cos64, sin64 = _tables(seqlen_ro, rd, dev, torch.float64)
    off = 2 if offsets == "int" else torch.randint(0, 5, (B,), generator=g, dtype=torch.int32).to(dev)

    def ref(t):
        c, s = (cos64, sin64) if t.dtype == torch.float64 else (cos, sin)
        return rotary_ref(t, c, s, interleaved, off)

    _check_fwd_bwd(lambda t: apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=off), ref, x)


def test_inplace(path):
    dev = _device(path)
    base = torch.randn(2, 6, 3, 8, device=dev, requires_grad=True)
    cos, sin = _tables(6, 8, dev, torch.float32)
    x = base * 1.0  # a non-leaf may be rotated in place
    out = apply_rotary_emb(x, cos, sin, inplace=True)
    assert out is x
    ref = rotary_ref(base.detach(), cos, sin)
    torch.testing.assert_close(x.detach(), ref, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(ref)
    (dbase,) = torch.autograd.grad(out, base, g)
    b2 = base.detach().requires_grad_()
    (dref,) = torch.autograd.grad(rotary_ref(b2, cos, sin), b2, g)
    torch.testing.assert_close(dbase, dref, atol=1e-6, rtol=1e-5)


def test_inplace_on_a_leaf_that_requires_grad(path):
    """FA2's in-place semantics on a leaf that requires grad (autograd refuses to mark one dirty): its storage holds
    the rotation, the returned alias carries the gradient to it, for the single, qkv- and kv-packed forms; another
    op's saved copy of the leaf is still caught at that op's backward."""
    dev = _device(path)
    cos, sin = _tables(6, 8, dev, torch.float32)
    g = torch.Generator().manual_seed(4)
    for shape, fn, ref in (
            ((2, 6, 3, 8), lambda t: apply_rotary_emb(t, cos, sin, inplace=True), lambda t: rotary_ref(t, cos, sin)),
            ((2, 6, 3, 3, 8), lambda t: apply_rotary_emb_qkv_(t, cos, sin),
             lambda t: torch.stack([rotary_ref(t[:, :, 0], cos, sin), rotary_ref(t[:, :, 1], cos, sin), t[:, :, 2]],
                                   2)),
            ((2, 6, 2, 3, 8), lambda t: apply_rotary_emb_kv_(t, cos, sin),
             lambda t: torch.stack([rotary_ref(t[:, :, 0], cos, sin), t[:, :, 1]], 2))):
        x0 = torch.randn(shape, generator=g).to(dev)
        leaf, leaf_r = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        out = fn(leaf)
        expect = ref(leaf_r)
        torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(leaf.detach(), expect.detach(), atol=1e-6, rtol=1e-5)  # rotated in place
        gout = torch.randn(shape, generator=g).to(dev)
        out.backward(gout)
        expect.backward(gout)
        torch.testing.assert_close(leaf.grad, leaf_r.grad, atol=1e-6, rtol=1e-5)
    x = torch.randn(2, 6, 3, 8, device=dev, requires_grad=True)
    y = (x * x).sum()
    apply_rotary_emb(x, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_shared_gradient_not_modified(path):
    """The backward pass must not rotate the incoming gradient in place: an add hands the very same
    gradient tensor to its other operand."""
    dev = _device(path)
    q = torch.randn(1, 4, 2, 8, device=dev, requires_grad=True)
    other = torch.randn(1, 4, 2, 8, device=dev, requires_grad=True)
    cos, sin = _tables(4, 8, dev, torch.float32)
    z = apply_rotary_emb(q * 1.0, cos, sin, inplace=True) + other
    g = torch.randn_like(z)
    z.backward(g)
    torch.testing.assert_close(other.grad, g)


@pytest.mark.parametrize("offsets", ["tensor", "int"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_varlen(path, interleaved, offsets):
    dev = _device(path)
    g = torch.Generator().manual_seed(0)
    lens = [3, 1, 6]
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32, device=dev)
    H, D, rd = 2, 12, 8
    x = torch.randn(10, H, D, generator=g).to(dev)
    off = torch.tensor([0, 5, 2], dtype=torch.int32, device=dev) if offsets == "tensor" else 3
    cos, sin = _tables(12, rd, dev, torch.float32)
    cos64, sin64 = _tables(12, rd, dev, torch.float64)

    def ref(t):
        c, s = (cos64, sin64) if t.dtype == torch.float64 else (cos, sin)
        parts = [rotary_ref(t[int(cu[i]):int(cu[i + 1])].unsqueeze(0), c, s, interleaved,
                            int(off[i]) if offsets == "tensor" else off)[0] for i in range(len(lens))]
        return torch.cat(parts)

    _check_fwd_bwd(lambda t: apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=off,
                                              cu_seqlens=cu, max_seqlen=max(lens)), ref, x)


def test_positions_past_table_stay_unrotated(path):
    dev = _device(path)
    x = torch.randn(2, 4, 1, 8, device=dev)
    cos, sin = _tables(5, 8, dev, torch.float32)
    off = torch.tensor([0, 3], dtype=torch.int64, device=dev)  # batch 1 reaches positions 3..6 of 0..4
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=off)
    torch.testing.assert_close(out, rotary_ref(x, cos, sin, False, off), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out[1, 2:], x[1, 2:])


@pytest.mark.parametrize("layout", ["qkv5d", "gqa4d"])
@pytest.mark.parametrize("xpos", [False, True])
def test_qkv_packed(path, layout, xpos):
    dev = _device(path)
    g = torch.Generator().manual_seed(1)
    B, S, Hq, Hk, D, rd = 2, 5, 4, 2, 16, 8
    if layout == "qkv5d":
        qkv0 = torch.randn(B, S, 3, Hq, D, generator=g).to(dev)
        split = lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2])  # noqa: E731
        nq = None
    else:
        qkv0 = torch.randn(B, S, Hq + 2 * Hk, D, generator=g).to(dev)
        split = lambda t: (t[:, :, :Hq], t[:, :, Hq:Hq + Hk], t[:, :, Hq + Hk:])  # noqa: E731
        nq = Hq
    cos, sin = _tables(S + 3, rd, dev, torch.float32)
    cos_k, sin_k = (cos * 0.5, sin * 0.5) if xpos else (None, None)
    leaf = qkv0.clone().requires_grad_()
    qkv = leaf * 1.0
    out = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=1, num_heads_q=nq)
    assert out is qkv

    def ref(t):
        q, k, v = split(t)
        ck, sk = (cos_k, sin_k) if xpos else (cos, sin)
        parts = [rotary_ref(q, cos, sin, False, 1), rotary_ref(k, ck, sk, False, 1), v]
        return torch.stack(parts, 2) if layout == "qkv5d" else torch.cat(parts, 2)

    leaf_r = qkv0.clone().requires_grad_()
    expect = ref(leaf_r)
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-5)
    gout = torch.randn_like(expect)
    (d,) = torch.autograd.grad(out, leaf, gout)
    (dr,) = torch.autograd.grad(expect, leaf_r, gout)
    torch.testing.assert_close(d, dr, atol=1e-6, rtol=1e-5)


def test_kv_packed(path):
    dev = _device(path)
    kv0 = torch.randn(2, 3, 2, 2, 8, device=dev)
    cos, sin = _tables(6, 4, dev, torch.float32)
    off = torch.tensor([1, 3], device=dev)
    leaf = kv0.clone().requires_grad_()
    kv = apply_rotary_emb_kv_(leaf * 1.0, cos, sin, interleaved=True, seqlen_offsets=off)
    leaf_r = kv0.clone().requires_grad_()
    expect = torch.stack([rotary_ref(leaf_r[:, :, 0], cos, sin, True, off), leaf_r[:, :, 1]], 2)
    torch.testing.assert_close(kv, expect, atol=1e-6, rtol=1e-5)
    gout = torch.randn_like(expect)
    torch.testing.assert_close(torch.autograd.grad(kv, leaf, gout)[0], torch.autograd.grad(expect, leaf_r, gout)[0],
                               atol=1e-6, rtol=1e-5)


def _module_tables(dim, seqlen, base, scale_base):
    """cos/sin (and XPos k tables) straight from the RoFormer/XPos formulas, in fp64."""
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.outer(torch.arange(seqlen, dtype=torch.float64), inv)
    cos, sin = ang.cos(), ang.sin()
    if scale_base is None:
        return cos, sin, cos, sin
    zeta = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    scale = zeta[None, :] ** ((torch.arange(seqlen, dtype=torch.float64) - seqlen // 2) / scale_base)[:, None]
    return cos * scale, sin * scale, cos / scale, sin / scale


@pytest.mark.parametrize("scale_base", [None, 16.0])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_module(path, scale_base, interleaved):
    dev = _device(path)
    B, S, H, D, rd = 2, 7, 2, 16, 8
    rot = RotaryEmbedding(rd, base=500.0, interleaved=interleaved, scale_base=scale_base, device=dev)
    qkv0 = torch.randn(B, S, 3, H, D, device=dev)
    qkv = qkv0.clone()
    out = rot(qkv, seqlen_offset=2)
    assert out is qkv
    cq, sq, ck, sk = _module_tables(rd, S + 2, 500.0, scale_base)
    q = rotary_ref(qkv0[:, :, 0].double(), cq, sq, interleaved, 2)
    k = rotary_ref(qkv0[:, :, 1].double(), ck, sk, interleaved, 2)
    torch.testing.assert_close(out[:, :, 0].double(), q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, :, 1].double(), k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, :, 2], qkv0[:, :, 2])


def test_rotary_embedding_module_kv_offsets_tensor(path):
    dev = _device(path)
    B, S, H, D = 2, 3, 2, 8
    rot = RotaryEmbedding(D, device=dev)
    q0, kv0 = torch.randn(B, S, H, D, device=dev), torch.randn(B, S, 2, H, D, device=dev)
    off = torch.tensor([4, 9], device=dev)
    q, kv = rot(q0.clone(), kv0.clone(), seqlen_offset=off, max_seqlen=16)
    assert rot._seq_len_cached == 16
    c, s, _, _ = _module_tables(D, 16, 10000.0, None)
    torch.testing.assert_close(q.double(), rotary_ref(q0.double(), c, s, False, off), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, :, 0].double(), rotary_ref(kv0[:, :, 0].double(), c, s, False, off),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv[:, :, 1], kv0[:, :, 1])


def test_module_tables_in_fp32_for_half_modules():
    rot = RotaryEmbedding(8).half()
    rot._update_cos_sin_cache(4096, device=torch.device("cpu"), dtype=torch.float32)
    c, _, _, _ = _module_tables(8, 4096, 10000.0, None)
    # fp16 angles would be off by whole radians at position 4000; fp32 keeps ~1e-3
    assert (rot._cos_cached.double() - c).abs().max().item() < 1e-3


def test_bad_inputs():
    x = torch.randn(1, 4, 2, 8)
    cos, sin = _tables(4, 8, "cpu", torch.float32)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary_emb(x, *_tables(4, 10, "cpu", torch.float32))
    with pytest.raises(ValueError, match="seqlen_ro|positions"):
        apply_rotary_emb(x, *_tables(3, 8, "cpu", torch.float32))
    with pytest.raises(ValueError, match="seqlen_offsets"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=1)
    with pytest.raises(ValueError, match="seqlen_offsets tensor"):
        apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen"):
        apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="same dtype"):
        apply_rotary_emb(x, cos, sin.double())
    with pytest.raises(ValueError, match="num_heads_q"):
        apply_rotary_emb_qkv_(torch.randn(1, 4, 6, 8), cos, sin)
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match=r"kv must be \(batch, seqlen, 2, nheads, headdim\), got \(1, 4, 3, 2, 8\)"):
        apply_rotary_emb_kv_(torch.randn(1, 4, 3, 2, 8), cos, sin)  # five dims, but not 2 in dim 2
    with pytest.raises(ValueError, match="kv must be"):
        apply_rotary_emb_kv_(torch.randn(1, 4, 2, 8), cos, sin)  # four dims


def test_compile_fullgraph(path):
    dev = _device(path)
    x = torch.randn(2, 4, 2, 8, device=dev, requires_grad=True)
    cos, sin = _tables(6, 8, dev, torch.float32)
    off = torch.tensor([0, 2], device=dev)
    fn = lambda t: apply_rotary_emb(t, cos, sin, seqlen_offsets=off)  # noqa: E731
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, fn(x))
    torch.testing.assert_close(torch.autograd.grad(out.square().sum(), x)[0],
                               torch.autograd.grad(fn(x).square().sum(), x)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_bf16(interleaved):
    with backend("triton"):
        x = torch.randn(4, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
        cos, sin = _tables(1100, 64, "cuda", torch.bfloat16)
        cos64, sin64 = _tables(1100, 64, "cuda", torch.float64)
        off = torch.randint(0, 100, (4,), device="cuda", dtype=torch.int32)
        ref = lambda t: rotary_ref(t, *((cos64, sin64) if t.dtype == torch.float64 else (cos, sin)),  # noqa: E731
                                   interleaved, off)
        _check_fwd_bwd(lambda t: apply_rotary_emb(t, cos, sin, interleaved=interleaved, seqlen_offsets=off), ref, x)


@pytest.mark.parametrize("varlen", [False, True])
def test_more_sequences_than_a_grid_holds(monkeypatch, varlen):
    """The kernel's grid has one row per sequence (CUDA: at most 65535): more run as several launches (batch
    slices, or slices of cu_seqlens), the same result. The limit lowered to 2 here, 5 sequences: 3 launches."""
    from flash_attn.ops.triton import rotary as rot

    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    dev = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    H, D, rd, lens = 2, 8, 8, [3, 1, 4, 2, 5]
    cos, sin = _tables(16, rd, dev, torch.float32)
    off = torch.tensor([0, 5, 2, 7, 1], dtype=torch.int32, device=dev)
    if varlen:
        x = torch.randn(sum(lens), H, D, generator=g).to(dev)
        kw = dict(cu_seqlens=torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32), max_seqlen=max(lens))
    else:
        x = torch.randn(len(lens), 5, H, D, generator=g).to(dev)
        kw = {}
    with backend("triton"):
        whole = apply_rotary_emb(x, cos, sin, seqlen_offsets=off, **kw)
        launches = []
        kernel = rot._rotary_kernel

        class Spy:
            def __getitem__(self, grid):
                launches.append(grid)
                return kernel[grid]

        monkeypatch.setattr(rot, "_MAX_GRID_Y", 2)
        monkeypatch.setattr(rot, "_rotary_kernel", Spy())
        chunked = apply_rotary_emb(x, cos, sin, seqlen_offsets=off, **kw)
    assert [grid[1] for grid in launches] == [2, 2, 1]
    assert torch.equal(chunked, whole)
