"""flash_attn.modules.mha.MHA against an independent oracle (flash_attn.testing.attention_ref on the module's
own projections), for both attention paths: FlashAttention kernels (use_flash_attn=True, the reference
backend on CPU) and the plain-PyTorch attention (use_flash_attn=False)."""
import pytest
import torch
import torch.nn.functional as F


import flash_attn
from flash_attn.bert_padding import unpad_input
from flash_attn.modules.mha import MHA, get_alibi_slopes
from flash_attn.testing import assert_close_to_ref, attention_ref
from flash_attn.utils.generation import InferenceParams

D, H = 64, 4
ATOL = 2e-5  # fp32 module vs fp64 oracle: only the fp32 rounding of a few GEMMs differs


def make(seed=0, **kwargs):
    torch.manual_seed(seed)
    m = MHA(D, H, **kwargs)
    for p in m.parameters():  # non-zero biases so a skipped bias shows up
        torch.nn.init.normal_(p, std=0.2)
    return m.eval()


def split_self(m, x):
    """q (B, S, H, d), k, v (B, S, Hk, d) from the module's own Wqkv."""
    qkv = F.linear(x, m.Wqkv.weight, m.Wqkv.bias)
    d, hk = m.head_dim, m.num_heads_kv
    q, k, v = qkv.split([H * d, hk * d, hk * d], dim=-1)
    return q.unflatten(-1, (H, d)), k.unflatten(-1, (hk, d)), v.unflatten(-1, (hk, d))


def finish(m, out):
    return F.linear(out.flatten(-2), m.out_proj.weight, m.out_proj.bias)


def rotate(x, rotary_dim, interleaved, base=10000.0):
    """RoPE written out: pairs (2i, 2i+1) if interleaved else (i, i + rotary_dim/2) turn by pos * base^(-2i/rd)."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv_freq  # (S, rd/2)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # broadcast over heads
    xr = x[..., :rotary_dim].double()
    a, b = (xr[..., 0::2], xr[..., 1::2]) if interleaved else xr.chunk(2, dim=-1)
    ra, rb = a * cos - b * sin, a * sin + b * cos
    rot = torch.stack([ra, rb], dim=-1).flatten(-2) if interleaved else torch.cat([ra, rb], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rotary_dim:]], dim=-1)


def mha_ref(m, x, key_padding_mask=None, **kwargs):
    q, k, v = split_self(m, x)
    if m.rotary_emb_dim > 0:
        q = rotate(q, m.rotary_emb_dim, m.rotary_emb.interleaved)
        k = rotate(k, m.rotary_emb_dim, m.rotary_emb.interleaved)
    out, _ = attention_ref(q, k, v, query_padding_mask=key_padding_mask, key_padding_mask=key_padding_mask,
                           causal=m.causal, **kwargs)
    return finish(m, out)


def cross_ref(m, x, x_kv, key_padding_mask=None):
    d, hk = m.head_dim, m.num_heads_kv
    q = F.linear(x, m.Wq.weight, m.Wq.bias).unflatten(-1, (H, d))
    k, v = F.linear(x_kv, m.Wkv.weight, m.Wkv.bias).unflatten(-1, (2, hk, d)).unbind(2)
    return finish(m, attention_ref(q, k, v, key_padding_mask=key_padding_mask)[0])


def padding_mask(lengths, seqlen):
    return torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]


@pytest.fixture(autouse=True)
def torch_ops():
    # Fused ops (rotary) on their PyTorch path: the Triton interpreter is far too slow for module tests
    # and the kernels have their own tests.
    with flash_attn.use_backend("torch"):
        yield


flash_param = pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])


@flash_param
@pytest.mark.parametrize("num_heads_kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_matches_reference(use_flash_attn, num_heads_kv, causal):
    m = make(num_heads_kv=num_heads_kv, causal=causal, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 13, D)
    torch.testing.assert_close(m(x), mha_ref(m, x), atol=ATOL, rtol=0)


@flash_param
@pytest.mark.parametrize("num_heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_matches_reference(use_flash_attn, num_heads_kv, causal):
    # The flash path unpads, runs the varlen kernel and pads back; padded rows carry only out_proj's bias.
    m = make(num_heads_kv=num_heads_kv, causal=causal, use_flash_attn=use_flash_attn)
    x = torch.randn(3, 11, D)
    mask = padding_mask([11, 6, 1], 11)
    out = m(x, key_padding_mask=mask)
    torch.testing.assert_close(out, mha_ref(m, x, key_padding_mask=mask), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[~mask], m.out_proj.bias.expand(int((~mask).sum()), D), atol=0, rtol=0)


@flash_param
def test_left_padding_matches_reference(use_flash_attn):
    m = make(causal=True, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 9, D)
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1, :] = True
    out = m(x, key_padding_mask=mask)
    torch.testing.assert_close(out[mask], mha_ref(m, x, key_padding_mask=mask)[mask], atol=ATOL, rtol=0)


@pytest.mark.parametrize("num_heads_kv", [4, 2], ids=["mha", "gqa"])
def test_varlen_input_matches_padded(num_heads_kv):
    m = make(num_heads_kv=num_heads_kv, causal=True, use_flash_attn=True)
    x = torch.randn(3, 10, D)
    mask = padding_mask([10, 4, 7], 10)
    x_unpad, _, cu_seqlens, max_seqlen, _ = unpad_input(x, mask)
    out = m(x_unpad, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    assert out.shape == (14 + 7, D)
    torch.testing.assert_close(out, mha_ref(m, x, key_padding_mask=mask)[mask], atol=ATOL, rtol=0)


@flash_param
@pytest.mark.parametrize("num_heads_kv", [4, 2], ids=["mha", "gqa"])
def test_cross_attention_with_key_padding(use_flash_attn, num_heads_kv):
    m = make(num_heads_kv=num_heads_kv, cross_attn=True, use_flash_attn=use_flash_attn)
    x, x_kv = torch.randn(2, 5, D), torch.randn(2, 8, D)
    mask = padding_mask([8, 3], 8)
    torch.testing.assert_close(m(x, x_kv=x_kv, key_padding_mask=mask), cross_ref(m, x, x_kv, mask), atol=ATOL,
                               rtol=0)


@flash_param
@pytest.mark.parametrize("window_size", [(-1, -1), (3, 1)], ids=["full", "window"])
def test_alibi_and_sliding_window(use_flash_attn, window_size):
    m = make(use_alibi=True, window_size=window_size, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 12, D)
    slopes = torch.tensor(get_alibi_slopes(H))
    torch.testing.assert_close(m(x), mha_ref(m, x, alibi_slopes=slopes, window_size=window_size), atol=ATOL,
                               rtol=0)


@flash_param
@pytest.mark.parametrize("num_heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rotary_emb_dim", [8, 16], ids=["partial", "full"])
def test_rotary_matches_reference(use_flash_attn, num_heads_kv, interleaved, rotary_emb_dim):
    m = make(num_heads_kv=num_heads_kv, causal=True, rotary_emb_dim=rotary_emb_dim,
             rotary_emb_interleaved=interleaved, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 11, D)
    torch.testing.assert_close(m(x), mha_ref(m, x), atol=ATOL, rtol=0)


@flash_param
def test_softmax_scale(use_flash_attn):
    m = make(softmax_scale=0.5, causal=True, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 7, D)
    torch.testing.assert_close(m(x), mha_ref(m, x, softmax_scale=0.5), atol=ATOL, rtol=0)


def test_bf16_flash_path_within_pytorch_error():
    m32 = make(num_heads_kv=2, causal=True, use_flash_attn=True)
    x32 = torch.randn(2, 33, D)
    m16 = make(num_heads_kv=2, causal=True, use_flash_attn=True).to(torch.bfloat16)
    m16.load_state_dict(m32.state_dict())
    ref = mha_ref(m32, x32)
    pt16 = make(num_heads_kv=2, causal=True, use_flash_attn=False).to(torch.bfloat16)
    pt16.load_state_dict(m32.state_dict())
    out = m16(x32.bfloat16())
    assert out.dtype == torch.bfloat16
    assert_close_to_ref(out, ref, pt16(x32.bfloat16()))


def grads_of(m, x, dtype):
    m = m.to(dtype)
    xg = x.to(dtype).requires_grad_()
    m(xg, key_padding_mask=padding_mask([9, 5], 9)).square().sum().backward()
    return [xg.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("num_heads_kv", [4, 2], ids=["mha", "gqa"])
def test_gradients_within_pytorch_error(num_heads_kv):
    # Oracle: the plain-PyTorch path in fp64; the fp32 flash path may err at most ~2x the fp32 PyTorch path.
    x = torch.randn(2, 9, D)
    ref = grads_of(make(num_heads_kv=num_heads_kv, causal=True), x, torch.float64)
    pt = grads_of(make(num_heads_kv=num_heads_kv, causal=True), x, torch.float32)
    flash = grads_of(make(num_heads_kv=num_heads_kv, causal=True, use_flash_attn=True), x, torch.float32)
    for i, (g, g_ref, g_pt) in enumerate(zip(flash, ref, pt)):
        assert_close_to_ref(g, g_ref, g_pt, name=f"grad {i}")


def test_checkpointing_gives_same_gradients():
    x = torch.randn(2, 9, D)
    grads = []
    for checkpointing in (False, True):
        m = make(causal=True, use_flash_attn=True, checkpointing=checkpointing).train()
        m(x).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@flash_param
def test_return_residual(use_flash_attn):
    m = make(return_residual=True, use_flash_attn=use_flash_attn)
    plain = make(use_flash_attn=use_flash_attn)
    x = torch.randn(2, 6, D)
    out, residual = m(x)
    assert residual is x
    torch.testing.assert_close(out, plain(x), atol=0, rtol=0)


@flash_param
def test_dwconv_is_causal_and_changes_output(use_flash_attn):
    m = make(dwconv=True, causal=True, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 10, D)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 4, D)
    out, out2 = m(x), m(x2)
    torch.testing.assert_close(out[:, :6], out2[:, :6], atol=0, rtol=0)
    m.dwconv_qkv.weight.data.zero_()
    m.dwconv_qkv.weight.data[:, 0, -1] = 1.0  # identity tap on the current position
    m.dwconv_qkv.bias.data.zero_()
    torch.testing.assert_close(m(x), mha_ref(m, x), atol=ATOL, rtol=0)


@flash_param
@pytest.mark.parametrize("cross_attn", [False, True], ids=["self", "cross"])
def test_mixer_subset(use_flash_attn, cross_attn):
    m = make(cross_attn=cross_attn, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 9, D)
    subset = torch.tensor([0, 4, 5])
    ref = cross_ref(m, x[:, subset], x) if cross_attn else mha_ref(m, x)[:, subset]
    torch.testing.assert_close(m(x, mixer_subset=subset), ref, atol=ATOL, rtol=0)


def as_cross(m, **kwargs):
    """The same weights in a cross_attn=True module (Wqkv split into Wq and Wkv)."""
    c = MHA(D, H, num_heads_kv=m.num_heads_kv, cross_attn=True, causal=m.causal, **kwargs).eval()
    q_dim = H * m.head_dim
    c.Wq.weight.data, c.Wq.bias.data = m.Wqkv.weight[:q_dim].clone(), m.Wqkv.bias[:q_dim].clone()
    c.Wkv.weight.data, c.Wkv.bias.data = m.Wqkv.weight[q_dim:].clone(), m.Wqkv.bias[q_dim:].clone()
    c.out_proj.load_state_dict(m.out_proj.state_dict())
    return c


@flash_param
def test_cross_attn_module_on_one_input_is_self_attention(use_flash_attn):
    # BERT's last layer is a cross_attn module; without x_kv it must behave exactly like self-attention,
    # padded queries included.
    m = make(num_heads_kv=2)
    c = as_cross(m, use_flash_attn=use_flash_attn)
    x = torch.randn(3, 8, D)
    mask = padding_mask([8, 2, 5], 8)
    torch.testing.assert_close(c(x, key_padding_mask=mask), mha_ref(m, x, key_padding_mask=mask), atol=ATOL,
                               rtol=0)


@flash_param
def test_mixer_subset_with_key_padding(use_flash_attn):
    m = make(cross_attn=True, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 9, D)
    mask = padding_mask([9, 4], 9)
    subset = torch.tensor([0, 2, 3])
    torch.testing.assert_close(m(x, key_padding_mask=mask, mixer_subset=subset),
                               cross_ref(m, x[:, subset], x, mask), atol=ATOL, rtol=0)


def test_varlen_cross_attention_on_token_subset():
    # BERT's packed last layer: queries are a subset of each sequence's tokens, keys all of them.
    m = make(cross_attn=True, use_flash_attn=True)
    x = torch.randn(2, 7, D)
    mask = padding_mask([7, 4], 7)
    subset = torch.zeros(2, 7, dtype=torch.bool)
    subset[0, [0, 5]] = True
    subset[1, [0, 1, 3]] = True
    x_unpad, _, cu_seqlens_k, max_seqlen_k, _ = unpad_input(x, mask)
    cu_seqlens = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = m(x[subset], x_kv=x_unpad, cu_seqlens=cu_seqlens, max_seqlen=3, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_k=max_seqlen_k)
    ref = torch.cat([cross_ref(m, x[b:b + 1, subset[b]], x[b:b + 1, mask[b]])[0] for b in range(2)])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------- KV cache
def decode_in_steps(m, x, steps, inference_params=None):
    """Prefill x[:, :steps[0]], then feed the remaining tokens in chunks of the given sizes."""
    params = inference_params or InferenceParams(max_seqlen=x.shape[1] + 3, max_batch_size=x.shape[0])
    outs, pos = [], 0
    for n in steps:
        outs.append(m(x[:, pos:pos + n], inference_params=params))
        params.seqlen_offset += n
        pos += n
    return torch.cat(outs, dim=1), params


@flash_param
@pytest.mark.parametrize("num_heads_kv", [4, 1], ids=["mha", "mqa"])
def test_kv_cache_matches_full_forward(use_flash_attn, num_heads_kv):
    m = make(num_heads_kv=num_heads_kv, causal=True, layer_idx=0, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 9, D)
    out, params = decode_in_steps(m, x, [5, 1, 2, 1])
    torch.testing.assert_close(out, m(x), atol=ATOL, rtol=0)
    cache = params.key_value_memory_dict[0]
    assert cache.shape == (2, 12, 2, num_heads_kv, m.head_dim)
    k = split_self(m, x)[1]
    torch.testing.assert_close(cache[:, :9, 0], k, atol=ATOL, rtol=0)


@flash_param
@pytest.mark.parametrize("num_heads_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_kv_cache_with_rotary_matches_full_forward(use_flash_attn, num_heads_kv, interleaved):
    m = make(num_heads_kv=num_heads_kv, causal=True, layer_idx=0, rotary_emb_dim=8,
             rotary_emb_interleaved=interleaved, use_flash_attn=use_flash_attn)
    x = torch.randn(2, 9, D)
    out, _ = decode_in_steps(m, x, [4, 1, 3, 1])
    torch.testing.assert_close(out, m(x), atol=ATOL, rtol=0)


@flash_param
def test_kv_cache_with_alibi_and_window(use_flash_attn):
    m = make(causal=True, layer_idx=0, use_alibi=True, window_size=(4, 0), use_flash_attn=use_flash_attn)
    x = torch.randn(2, 10, D)
    out, _ = decode_in_steps(m, x, [6, 1, 1, 1, 1])
    torch.testing.assert_close(out, m(x), atol=ATOL, rtol=0)


@flash_param
def test_kv_cache_per_sample_lengths_and_batch_offset(use_flash_attn):
    # Sequence 0 has a 6-token prompt, sequence 1 a 3-token one; each is prefilled alone (batch_size_offset),
    # then one step decodes both with lengths_per_sample = [6, 3].
    m = make(causal=True, layer_idx=3, rotary_emb_dim=8, use_flash_attn=use_flash_attn)
    a, b = torch.randn(1, 7, D), torch.randn(1, 4, D)
    params = InferenceParams(max_seqlen=8, max_batch_size=2)
    params.batch_size_offset = 0
    m(a[:, :6], inference_params=params)
    params.batch_size_offset = 1
    m(b[:, :3], inference_params=params)
    params.batch_size_offset = 0
    params.lengths_per_sample = torch.tensor([6, 3], dtype=torch.int32)
    step = m(torch.cat([a[:, 6:], b[:, 3:]]), inference_params=params)
    torch.testing.assert_close(step[0], m(a)[0, 6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(step[1], m(b)[0, 3:], atol=ATOL, rtol=0)


def test_allocate_inference_cache():
    m = make(num_heads_kv=2, layer_idx=0)
    cache = m.allocate_inference_cache(3, 17, dtype=torch.bfloat16)
    assert cache.shape == (3, 17, 2, 2, D // H) and cache.dtype == torch.bfloat16
    assert m.allocate_inference_cache(1, 4).dtype == torch.float32


@flash_param
def test_kv_cache_overflow_raises(use_flash_attn):
    m = make(causal=True, layer_idx=0, use_flash_attn=use_flash_attn)
    params = InferenceParams(max_seqlen=4, max_batch_size=1)
    params.seqlen_offset = 3
    with pytest.raises((ValueError, RuntimeError)):
        m(torch.randn(1, 2, D), inference_params=params)


# --------------------------------------------------------------------------------------------- misc
def test_alibi_slopes_values():
    assert get_alibi_slopes(8) == [2.0 ** -k for k in range(1, 9)]
    assert get_alibi_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]


def test_alibi_slopes_stay_fp32_after_cast():
    m = make(use_alibi=True, num_heads_kv=H).to(torch.bfloat16)
    assert m.inner_attn.alibi_slopes.dtype == torch.float32
    assert m.inner_attn.alibi_slopes.tolist() == get_alibi_slopes(H)
    assert "inner_attn.alibi_slopes" not in m.state_dict()


@pytest.mark.parametrize("kwargs, error", [
    (dict(embed_dim=60, num_heads=8), ValueError),
    (dict(embed_dim=64, num_heads=4, num_heads_kv=3), ValueError),
    (dict(embed_dim=64, num_heads=4, window_size=(2,)), ValueError),
    (dict(embed_dim=64, num_heads=4, rotary_emb_dim=3), ValueError),
    (dict(embed_dim=64, num_heads=4, rotary_emb_dim=32), ValueError),
    (dict(embed_dim=64, num_heads=4, dropout=1.0), ValueError),
])
def test_invalid_constructor_arguments(kwargs, error):
    with pytest.raises(error):
        MHA(**kwargs)


def test_invalid_forward_arguments():
    m = make()
    x = torch.randn(2, 5, D)
    with pytest.raises(ValueError, match="x_kv"):
        m(x, x_kv=x)
    with pytest.raises(NotImplementedError, match="use_flash_attn"):
        m(x.flatten(0, 1), cu_seqlens=torch.tensor([0, 5, 10], dtype=torch.int32), max_seqlen=5)
    with pytest.raises(ValueError, match="embed_dim"):
        m(torch.randn(2, 5, D + 1))
    with pytest.raises(TypeError, match="unexpected"):
        m(x, foo=1)
    with pytest.raises(ValueError, match="layer_idx"):
        m(x, inference_params=InferenceParams(max_seqlen=8, max_batch_size=2))
