"""flash_attn.layers.rotary beyond the kernels: FA2's plain-PyTorch helpers (rotate_half, apply_rotary_emb_torch)
against the RoFormer formula; RotaryEmbedding's buffers, its table cache (rebuilt exactly when the length, device,
dtype or inference state asks for it) and where its tables live (meta tensors show a table built on the wrong
device); its errors."""

import pytest
import torch

import flash_attn
from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_torch, rotate_half


# the module's tables come from fp32 angles (then cast), so an fp64 input carries their fp32 rounding
FP32_ANGLES = dict(atol=1e-6, rtol=1e-6)


@pytest.fixture(autouse=True)
def torch_path():
    with flash_attn.use_backend("torch"):
        yield


def _formula(x, pos, rd, base, interleaved):
    """Rotate pairs of x (B, S, H, D) by position * base^(-2i/rd), in fp64, one pair at a time."""
    out = x.double().clone()
    for i in range(rd // 2):
        theta = pos.double()[:, None] * base ** (-2 * i / rd)  # (S, 1)
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
        xa, xb = x[..., a].double(), x[..., b].double()
        c, s = theta.cos()[None], theta.sin()[None]  # (1, S, 1)
        out[..., a], out[..., b] = xa * c - xb * s, xa * s + xb * c
    return out


def test_rotate_half():
    x = torch.arange(8.0).view(1, 8)
    assert rotate_half(x).tolist() == [[-4.0, -5.0, -6.0, -7.0, 0.0, 1.0, 2.0, 3.0]]
    assert rotate_half(x, interleaved=True).tolist() == [[-1.0, 0.0, -3.0, 2.0, -5.0, 4.0, -7.0, 6.0]]
    assert rotate_half(x, False).shape == x.shape


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rd", [4, 8])
def test_apply_rotary_emb_torch_is_the_formula(interleaved, rd):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    inv = 1.0 / 100.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.outer(torch.arange(5, dtype=torch.float64), inv)
    out = apply_rotary_emb_torch(x.double(), ang.cos(), ang.sin(), interleaved)
    torch.testing.assert_close(out, _formula(x, torch.arange(5), rd, 100.0, interleaved))
    # and the module's function agrees
    torch.testing.assert_close(apply_rotary_emb(x.double(), ang.cos(), ang.sin(), interleaved), out)
    # per-batch tables (B, S, rd / 2)
    out_b = apply_rotary_emb_torch(x.double(), ang.cos().expand(2, 5, rd // 2), ang.sin().expand(2, 5, rd // 2),
                                   interleaved)
    torch.testing.assert_close(out_b, out)


def test_apply_rotary_emb_torch_refuses_a_table_wider_than_the_head():
    x = torch.randn(1, 2, 1, 4)
    with pytest.raises(ValueError, match=r"^rotary_dim 6 must be <= headdim 4$"):
        apply_rotary_emb_torch(x, torch.ones(2, 3), torch.zeros(2, 3))
    apply_rotary_emb_torch(x, torch.ones(2, 2), torch.zeros(2, 2))  # rotary_dim == headdim is fine


# ----------------------------------------------------------------------------------------------------
# RotaryEmbedding


@pytest.mark.parametrize("dim", [0, -2, 3, 1])
def test_module_dim_must_be_positive_and_even(dim):
    with pytest.raises(ValueError, match=rf"^dim \(the rotary dim\) must be a positive even number, got {dim}$"):
        RotaryEmbedding(dim)


def test_module_dim_two_is_allowed():
    assert RotaryEmbedding(2).inv_freq.tolist() == [1.0]


def test_module_buffers():
    rot = RotaryEmbedding(8, base=16.0, scale_base=64.0)
    assert rot.inv_freq.dtype == torch.float32 and rot.scale.dtype == torch.float32
    torch.testing.assert_close(rot.inv_freq, torch.tensor([1.0, 0.5, 0.25, 0.125]))
    torch.testing.assert_close(rot.scale, (torch.arange(0, 8, 2) + 3.2) / 11.2)
    assert list(rot.state_dict()) == []  # recomputed from the constructor's arguments, never saved
    assert RotaryEmbedding(8).scale is None
    assert rot._seq_len_cached == 0 and rot._cos_cached is None and rot._cos_k_cached is None


@pytest.mark.parametrize("scale_base", [None, 32.0])
def test_module_builds_its_buffers_and_tables_on_its_device(scale_base):
    rot = RotaryEmbedding(8, scale_base=scale_base, device="meta")
    assert rot.inv_freq.device.type == "meta"
    if scale_base is not None:
        assert rot.scale.device.type == "meta"
    qkv = torch.empty(2, 5, 3, 2, 8, device="meta", dtype=torch.float16)
    rot(qkv)
    for t in (rot._cos_cached, rot._sin_cached):
        assert t.device.type == "meta" and t.dtype == torch.float16 and t.shape == (5, 4)
    if scale_base is not None:
        for t in (rot._cos_k_cached, rot._sin_k_cached):
            assert t.device.type == "meta" and t.dtype == torch.float16


@pytest.mark.parametrize("pos_idx_in_fp32", [True, False])
def test_module_tables_on_another_device_than_its_buffers(pos_idx_in_fp32):
    # buffers on the CPU, inputs on meta: the tables follow the inputs, built from fp32 angles
    rot = RotaryEmbedding(8, scale_base=32.0, pos_idx_in_fp32=pos_idx_in_fp32)
    rot._update_cos_sin_cache(6, device=torch.device("meta"), dtype=torch.bfloat16)
    for t in (rot._cos_cached, rot._sin_cached, rot._cos_k_cached, rot._sin_k_cached):
        assert t.device.type == "meta" and t.dtype == torch.bfloat16 and t.shape == (6, 4)


def test_module_table_cache():
    rot = RotaryEmbedding(8)
    cpu = torch.device("cpu")
    rot._update_cos_sin_cache(10, device=cpu, dtype=torch.float32)
    first = rot._cos_cached
    rot._update_cos_sin_cache(10, device=cpu, dtype=torch.float32)
    rot._update_cos_sin_cache(4, device=cpu, dtype=torch.float32)  # shorter: the cached table covers it
    assert rot._cos_cached is first and rot._seq_len_cached == 10
    rot._update_cos_sin_cache(11, device=cpu, dtype=torch.float32)  # longer: rebuilt
    assert rot._cos_cached is not first and rot._cos_cached.shape == (11, 4) and rot._seq_len_cached == 11
    second = rot._cos_cached
    rot._update_cos_sin_cache(11, device=cpu, dtype=torch.float64)  # another dtype: rebuilt
    assert rot._cos_cached is not second and rot._cos_cached.dtype == torch.float64
    assert rot._sin_cached.dtype == torch.float64
    third = rot._cos_cached
    rot._update_cos_sin_cache(11, device=torch.device("meta"), dtype=torch.float64)  # another device: rebuilt
    assert rot._cos_cached is not third and rot._cos_cached.device.type == "meta"


def test_module_rebuilds_an_inference_table_for_training_only():
    rot = RotaryEmbedding(8)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        rot._update_cos_sin_cache(6, device=cpu, dtype=torch.float32)
    table = rot._cos_cached
    assert table.is_inference()
    rot.eval()
    rot._update_cos_sin_cache(6, device=cpu, dtype=torch.float32)
    assert rot._cos_cached is table  # evaluation may keep using it
    rot.train()
    rot._update_cos_sin_cache(6, device=cpu, dtype=torch.float32)
    assert rot._cos_cached is not table and not rot._cos_cached.is_inference()
    again = rot._cos_cached
    rot._update_cos_sin_cache(6, device=cpu, dtype=torch.float32)
    assert rot._cos_cached is again


def test_module_xpos_tables():
    rot = RotaryEmbedding(4, base=10.0, scale_base=8.0)
    rot._update_cos_sin_cache(5, device=torch.device("cpu"), dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)
    ang = torch.outer(pos, torch.tensor([1.0, 10 ** -0.5], dtype=torch.float64))
    zeta = ((torch.tensor([0.0, 2.0], dtype=torch.float64) + 1.6) / 5.6)[None] ** ((pos - 2) / 8.0)[:, None]
    torch.testing.assert_close(rot._cos_cached, ang.cos() * zeta)
    torch.testing.assert_close(rot._sin_cached, ang.sin() * zeta)
    torch.testing.assert_close(rot._cos_k_cached, ang.cos() / zeta)
    torch.testing.assert_close(rot._sin_k_cached, ang.sin() / zeta)


def test_module_default_offset_is_zero_and_tables_cover_the_call():
    torch.manual_seed(0)
    rot = RotaryEmbedding(8, base=100.0)
    qkv0 = torch.randn(1, 4, 3, 2, 8, dtype=torch.float64)
    out = rot(qkv0.clone())
    assert rot._seq_len_cached == 4
    torch.testing.assert_close(out[:, :, 0], _formula(qkv0[:, :, 0], torch.arange(4), 8, 100.0, False), **FP32_ANGLES)
    rot(qkv0.clone(), seqlen_offset=3)
    assert rot._seq_len_cached == 7


def test_module_kv_form_uses_the_k_tables_with_xpos():
    torch.manual_seed(0)
    rot = RotaryEmbedding(8, base=100.0, scale_base=4.0)
    q0, kv0 = torch.randn(1, 3, 2, 8, dtype=torch.float64), torch.randn(1, 3, 2, 2, 8, dtype=torch.float64)
    q, kv = rot(q0.clone(), kv0.clone())
    torch.testing.assert_close(q, apply_rotary_emb_torch(q0, rot._cos_cached, rot._sin_cached))
    torch.testing.assert_close(kv[:, :, 0], apply_rotary_emb_torch(kv0[:, :, 0], rot._cos_k_cached,
                                                                   rot._sin_k_cached))
    assert not torch.allclose(rot._cos_k_cached, rot._cos_cached)


@pytest.mark.parametrize("interleaved", [False, True])
def test_module_interleaved_in_every_form(interleaved):
    torch.manual_seed(0)
    rot = RotaryEmbedding(8, base=100.0, interleaved=interleaved)
    qkv0 = torch.randn(1, 3, 3, 2, 8, dtype=torch.float64)
    want = _formula(qkv0[:, :, 0], torch.arange(3), 8, 100.0, interleaved)
    torch.testing.assert_close(rot(qkv0.clone())[:, :, 0], want, **FP32_ANGLES)
    q, _ = rot(qkv0[:, :, 0].clone(), qkv0[:, :, 1:].clone())
    torch.testing.assert_close(q, want, **FP32_ANGLES)


def test_module_tensor_offsets_need_max_seqlen():
    rot = RotaryEmbedding(8)
    qkv = torch.randn(2, 3, 3, 2, 8)
    with pytest.raises(ValueError, match=r"^a tensor seqlen_offset needs max_seqlen \(the cos/sin tables must "
                                         r"cover it\)$"):
        rot(qkv, seqlen_offset=torch.tensor([1, 2]))
    rot(qkv.clone(), max_seqlen=8)
    rot(qkv.clone(), seqlen_offset=torch.tensor([1, 2]))  # tables on this device already cover it
    with pytest.raises(ValueError, match="needs max_seqlen"):
        rot(qkv.to("meta"), seqlen_offset=torch.tensor([1, 2], device="meta"))


def test_module_qkv_with_num_heads_q():
    torch.manual_seed(0)
    rot = RotaryEmbedding(8, base=100.0)
    qkv0 = torch.randn(1, 3, 4 + 2 * 2, 8, dtype=torch.float64)  # 4 query heads, 2 key/value heads
    out = rot(qkv0.clone(), num_heads_q=4)
    torch.testing.assert_close(out[:, :, :6], _formula(qkv0[:, :, :6], torch.arange(3), 8, 100.0, False), **FP32_ANGLES)
    torch.testing.assert_close(out[:, :, 6:], qkv0[:, :, 6:])


# ----------------------------------------------------------------------------------------------------
# Errors name the argument and what was expected


def _cs(n, half):
    return torch.ones(n, half), torch.zeros(n, half)


@pytest.mark.parametrize("call,error,message", [
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4, dtype=torch.int32), *_cs(2, 2)), TypeError,
     r"^x must be a floating-point tensor$"),
    (lambda: apply_rotary_emb(torch.zeros(2, 1, 4), *_cs(2, 2)), ValueError,
     r"^x must be \(batch, seqlen, nheads, headdim\), got shape \(2, 1, 4\)$"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), *_cs(2, 2), cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
                              max_seqlen=1), ValueError,
     r"^x must be \(total, nheads, headdim\) with cu_seqlens, got shape \(1, 2, 1, 4\)$"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), torch.ones(2, 2), torch.zeros(2, 1)), ValueError,
     r"^cos and sin must both be \(seqlen_ro, rotary_dim / 2\), got \(2, 2\) and \(2, 1\)$"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), torch.ones(2, 2, 1), torch.zeros(2, 2, 1)), ValueError,
     r"^cos and sin must both be \(seqlen_ro, rotary_dim / 2\)"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), *_cs(2, 3)), ValueError,
     r"^rotary_dim \(2 \* cos.shape\[-1\] = 6\) must be <= headdim 4$"),
    (lambda: apply_rotary_emb(torch.zeros(3, 1, 4), *_cs(4, 2), cu_seqlens=torch.tensor([0, 3], dtype=torch.int32)),
     ValueError, r"^max_seqlen is required with cu_seqlens$"),
    (lambda: apply_rotary_emb(torch.zeros(3, 1, 4), *_cs(4, 2), cu_seqlens=torch.tensor([0.0, 3.0]), max_seqlen=3),
     TypeError, r"^cu_seqlens must be an int32 tensor \(batch \+ 1,\)$"),
    (lambda: apply_rotary_emb(torch.zeros(3, 1, 4), *_cs(4, 2), cu_seqlens=torch.tensor([[0, 3]], dtype=torch.int32),
                              max_seqlen=3), TypeError, r"^cu_seqlens must be an int32 tensor"),
    (lambda: apply_rotary_emb(torch.zeros(1, 5, 1, 4), *_cs(3, 2)), ValueError,
     r"^cos/sin have 3 positions \(seqlen_ro\), fewer than seqlen 5$"),
    (lambda: apply_rotary_emb(torch.zeros(2, 2, 1, 4), *_cs(4, 2), seqlen_offsets=torch.zeros(3, dtype=torch.int32)),
     ValueError, r"^seqlen_offsets tensor must be int32/int64 of shape \(2,\), got torch.int32 \(3,\)$"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), *_cs(4, 2), seqlen_offsets=3), ValueError,
     r"^seqlen_offsets \+ seqlen \(3 \+ 2\) must be within the 4 positions of cos/sin$"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), *_cs(4, 2), seqlen_offsets=-1), ValueError,
     r"^seqlen_offsets \+ seqlen \(-1 \+ 2\) must be within"),
    (lambda: apply_rotary_emb(torch.zeros(1, 2, 1, 4), *_cs(4, 2), seqlen_offsets=1.0), TypeError,
     r"^seqlen_offsets must be an int or a tensor, got float$"),
])
def test_apply_rotary_emb_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_apply_rotary_emb_accepts_the_edges():
    x = torch.randn(1, 2, 1, 4, dtype=torch.float64)
    apply_rotary_emb(x, *_cs(4, 2), seqlen_offsets=2)  # offset + seqlen == seqlen_ro
    apply_rotary_emb(x, *_cs(2, 2))  # rotary_dim == headdim, seqlen == seqlen_ro
    apply_rotary_emb(x[0], *_cs(2, 2), cu_seqlens=torch.tensor([0, 2], dtype=torch.int64), max_seqlen=2)
    out = apply_rotary_emb(x, torch.ones(2, 1, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64))
    torch.testing.assert_close(out, x)  # angle 0 on the first pair, the rest passes through


@pytest.mark.parametrize("shape,num_heads_q,message", [
    ((1, 2, 4, 2, 8), None, r"^qkv must be \(batch, seqlen, 3, nheads, headdim\), got \(1, 2, 4, 2, 8\)$"),
    ((1, 2, 6, 8), None, r"^qkv must be \(batch, seqlen, 3, nheads, headdim\), or \(batch, seqlen, num_heads_q \+ "
                         r"2 \* num_heads_k, headdim\) with num_heads_q given; got \(1, 2, 6, 8\) and num_heads_q=None$"),
    ((1, 2, 7, 8), 4, r"^qkv's 7 heads are not num_heads_q \(4\) \+ 2 \* num_heads_k$"),
    ((1, 2, 6, 8), 0, r"^qkv's 6 heads are not num_heads_q \(0\) \+ 2 \* num_heads_k$"),
])
def test_packed_qkv_errors(shape, num_heads_q, message):
    rot = RotaryEmbedding(8)
    with pytest.raises(ValueError, match=message):
        rot(torch.zeros(shape), num_heads_q=num_heads_q)


def test_packed_qkv_with_one_query_head():
    rot = RotaryEmbedding(8, base=100.0)
    qkv0 = torch.randn(1, 3, 1 + 2 * 1, 8, dtype=torch.float64)
    out = rot(qkv0.clone(), num_heads_q=1)
    torch.testing.assert_close(out[:, :, :2], _formula(qkv0[:, :, :2], torch.arange(3), 8, 100.0, False),
                               **FP32_ANGLES)
    torch.testing.assert_close(out[:, :, 2:], qkv0[:, :, 2:])
