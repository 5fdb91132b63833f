"""flash_attn.layers.rotary beyond the kernels (on the plain-PyTorch path): the autograd classes' defaults, the
packed-qkv layouts _rotate_qk_ takes apart, RotaryEmbedding's tables (dtype, device, fp32 angles) and in-place
rotation, and the devices the torch path puts its positions on."""
import math

import pytest
import torch

from flash_attn.layers.rotary import (ApplyRotaryEmb, ApplyRotaryEmbKV_, ApplyRotaryEmbQKV_, RotaryEmbedding,
                                      apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_)
from flash_attn.ops.triton import backend
from flash_attn.ops.triton.rotary import apply_rotary


@pytest.fixture(autouse=True)
def torch_path():
    with backend("torch"):
        yield


def _tables(rows, half, seed=0):
    angle = torch.rand(rows, half, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return torch.cos(angle), torch.sin(angle)


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_defaults_of_the_autograd_classes_and_apply_rotary():
    """FA2's autograd classes called with (x, cos, sin) only take the functions' defaults: not interleaved, offset
    0, not in place (x keeps its values)."""
    cos, sin = _tables(12, 4)
    x = _randn(2, 6, 3, 8)
    want = apply_rotary_emb(x, cos, sin)
    x0 = x.clone()
    torch.testing.assert_close(ApplyRotaryEmb.apply(x, cos, sin), want)
    assert torch.equal(x, x0)
    torch.testing.assert_close(apply_rotary(x, cos, sin), want)
    qkv = _randn(2, 6, 3, 3, 8)
    want = apply_rotary_emb_qkv_(qkv.clone(), cos, sin)
    torch.testing.assert_close(ApplyRotaryEmbQKV_.apply(qkv.clone(), cos, sin), want)
    kv = _randn(2, 6, 2, 3, 8)
    want = apply_rotary_emb_kv_(kv.clone(), cos, sin)
    torch.testing.assert_close(ApplyRotaryEmbKV_.apply(kv.clone(), cos, sin), want)


def _each_part(qkv, cos, sin, cos_k, sin_k, interleaved):
    # q and k of a (B, S, 3, H, D) qkv rotated one by one, v as it is
    q = apply_rotary_emb(qkv[:, :, 0], cos, sin, interleaved=interleaved)
    k = apply_rotary_emb(qkv[:, :, 1], cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                         interleaved=interleaved)
    return torch.stack((q, k, qkv[:, :, 2]), dim=2)


@pytest.mark.parametrize("k_tables", ["none", "cos_k", "sin_k", "both"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("uneven", [False, True])
def test_qkv_layouts_and_k_tables(uneven, interleaved, k_tables):
    """A contiguous (B, S, 3, H, D) qkv, or one cut from a wider one (dim 2 strides 2 H D = D * D, not H D): q and
    k are rotated as one by one; cos_k and sin_k each replace cos or sin for k alone."""
    B, S, H, D = 2, 5, 4, 8
    cos, sin = _tables(5, 3)
    cos_k, sin_k = _tables(5, 3, seed=7)
    cos_k = cos_k if k_tables in ("cos_k", "both") else None
    sin_k = sin_k if k_tables in ("sin_k", "both") else None
    wide = _randn(B, S, 3, 2 * H, D)
    qkv = wide[:, :, :, :H] if uneven else wide[:, :, :, :H].contiguous()
    assert qkv.stride(2) == (2 * H * D if uneven else H * D) and 2 * H * D == D * D
    want = _each_part(qkv, cos, sin, cos_k, sin_k, interleaved)
    got = apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, interleaved=interleaved)
    torch.testing.assert_close(got, want)
    assert torch.equal(wide[:, :, :, H:], _randn(B, S, 3, 2 * H, D)[:, :, :, H:])  # the rest stays


def test_gqa_packed_qkv_interleaved_forward_and_backward():
    # (B, S, H + 2 Hk, D) with num_heads_q = H: q's and k's heads rotated interleaved, v's left; the gradient rotated
    # back by the same (interleaved) pairs.
    B, S, H, Hk, D = 2, 5, 4, 2, 8
    cos, sin = _tables(5, 4)
    x = _randn(B, S, H + 2 * Hk, D)
    want = torch.cat((apply_rotary_emb(x[:, :, :H + Hk], cos, sin, interleaved=True), x[:, :, H + Hk:]), dim=2)
    leaf = x.clone().requires_grad_()
    got = apply_rotary_emb_qkv_(leaf * 1.0, cos, sin, interleaved=True, num_heads_q=H)
    torch.testing.assert_close(got, want)
    g = _randn(B, S, H + 2 * Hk, D, seed=3)
    got.backward(g)
    ref = x[:, :, :H + Hk].clone().requires_grad_()
    apply_rotary_emb(ref, cos, sin, interleaved=True).backward(g[:, :, :H + Hk])
    torch.testing.assert_close(leaf.grad, torch.cat((ref.grad, g[:, :, H + Hk:]), dim=2))


def test_qkv_interleaved_backward():
    cos, sin = _tables(6, 4)
    x = _randn(2, 6, 3, 2, 8)
    leaf = x.clone().requires_grad_()
    g = _randn(2, 6, 3, 2, 8, seed=4)
    apply_rotary_emb_qkv_(leaf * 1.0, cos, sin, interleaved=True).backward(g)
    ref = x[:, :, :2].clone().requires_grad_()
    apply_rotary_emb(ref.flatten(2, 3), cos, sin, interleaved=True).backward(g[:, :, :2].flatten(2, 3))
    torch.testing.assert_close(leaf.grad, torch.cat((ref.grad, g[:, :, 2:]), dim=2))


@pytest.mark.parametrize("max_seqlen", [None, 9])
def test_module_tables_follow_qkv_on_meta(max_seqlen):
    # The meta device stands in for a GPU: the tables are built on qkv's device, in qkv's dtype, and q and k are
    # rotated there (tables sized by the offset or by max_seqlen).
    rot = RotaryEmbedding(8)
    qkv = torch.empty(2, 6, 3, 2, 8, device="meta", dtype=torch.bfloat16)
    out = rot(qkv, max_seqlen=max_seqlen)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16
    assert rot._cos_cached.device.type == "meta" and rot._cos_cached.dtype == torch.bfloat16


@pytest.mark.parametrize("max_seqlen", [None, 9])
def test_module_tables_in_the_input_dtype(max_seqlen):
    # FA2's MHA hands _cos_cached / _sin_cached to flash_attn_with_kvcache: they are in qkv's dtype.
    rot = RotaryEmbedding(8)
    rot(_randn(1, 4, 3, 2, 8).to(torch.float16), max_seqlen=max_seqlen)
    assert rot._cos_cached.dtype == rot._sin_cached.dtype == torch.float16


def test_module_positions_in_the_module_dtype():
    """pos_idx_in_fp32=False takes positions and frequencies in the module's dtype (FA2): the same tables as fp32
    positions for an fp32 module, and bf16 positions times bf16 frequencies for a bf16 one."""
    S = 300
    ref, rot = RotaryEmbedding(16), RotaryEmbedding(16, pos_idx_in_fp32=False)
    ref._update_cos_sin_cache(S, torch.device("cpu"), torch.float32)
    rot._update_cos_sin_cache(S, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(rot._cos_cached, ref._cos_cached, atol=0, rtol=0)
    torch.testing.assert_close(rot._sin_cached, ref._sin_cached, atol=0, rtol=0)
    half = RotaryEmbedding(16, pos_idx_in_fp32=False).to(torch.bfloat16)
    half._update_cos_sin_cache(S, torch.device("cpu"), torch.bfloat16)
    freqs = torch.outer(torch.arange(S, dtype=torch.bfloat16), ref.inv_freq.to(torch.bfloat16)).float()
    torch.testing.assert_close(half._cos_cached, torch.cos(freqs).to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_half_module_tables_are_the_fp32_ones_rounded(scale_base):
    # Angles (and XPos scales) in fp32 whatever the module's dtype: a bf16 module's tables are the fp32 module's
    # tables rounded once.
    S = 256
    ref, half = RotaryEmbedding(16, scale_base=scale_base), RotaryEmbedding(16, scale_base=scale_base)
    half = half.to(torch.bfloat16)
    ref._update_cos_sin_cache(S, torch.device("cpu"), torch.bfloat16)
    half._update_cos_sin_cache(S, torch.device("cpu"), torch.bfloat16)
    names = ("_cos_cached", "_sin_cached") + (("_cos_k_cached", "_sin_k_cached") if scale_base else ())
    for name in names:
        assert torch.equal(getattr(half, name), getattr(ref, name)), name


@pytest.mark.parametrize("interleaved", [False, True])
def test_module_with_kv_rotates_q_in_place(interleaved):
    rot = RotaryEmbedding(8, interleaved=interleaved)
    q, kv = _randn(2, 5, 3, 8), _randn(2, 5, 2, 3, 8, seed=2)
    q0, kv0 = q.clone(), kv.clone()
    q_out, kv_out = rot(q, kv)
    cos, sin = rot._cos_cached, rot._sin_cached
    assert q_out.data_ptr() == q.data_ptr()  # in place, as FA2's module
    torch.testing.assert_close(q, apply_rotary_emb(q0, cos, sin, interleaved=interleaved))
    torch.testing.assert_close(kv_out, apply_rotary_emb_kv_(kv0, cos, sin, interleaved=interleaved))


def test_one_row_table_leaves_later_positions_unrotated():
    cos, sin = _tables(1, 4)
    x = _randn(2, 1, 2, 8)
    got = apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([0, 3]))
    torch.testing.assert_close(got[0], apply_rotary(x[:1], cos, sin)[0])
    assert torch.equal(got[1], x[1])


@pytest.mark.parametrize("varlen", [False, True])
def test_meta_inputs_with_offsets_and_cu_seqlens_on_the_cpu(varlen):
    # Offsets and cu_seqlens may sit on the host: the positions are built on x's device (meta, standing in for a GPU).
    cos, sin = (t.to("meta") for t in _tables(16, 4))
    if varlen:
        x = torch.empty(11, 2, 8, device="meta")
        out = apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([2, 0]), cu_seqlens=torch.tensor([0, 4, 11],
                           dtype=torch.int32), max_seqlen=7)
    else:
        x = torch.empty(2, 7, 2, 8, device="meta")
        out = apply_rotary(x, cos, sin, seqlen_offsets=torch.tensor([2, 0]))
    assert out.device.type == "meta" and out.shape == x.shape
