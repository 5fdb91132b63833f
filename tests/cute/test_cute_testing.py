"""flash_attn.cute.testing, FA4's test helpers in the flash-attn-4 distribution: the reference against the root
package's oracle (flash_attn.testing) and against elementwise definitions of its masks, the padding helpers'
round trips, generate_qkv's forms and the fake-tensor helpers. CPU only (plain PyTorch)."""
import functools
import math

import pytest
import torch

from flash_attn import testing as root
from flash_attn.cute import testing as T

close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)  # fp32 here, fp64 in the root oracle


def _qkv(B=2, Sq=7, Sk=11, H=4, Hk=2, D=16, Dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Sq, H, D, generator=g, dtype=dtype), torch.randn(B, Sk, Hk, D, generator=g, dtype=dtype),
            torch.randn(B, Sk, Hk, Dv or D, generator=g, dtype=dtype))


def _root_window(window_size):
    return tuple(-1 if w is None else w for w in window_size)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(window_size=(3, 2)),
    dict(window_size=(None, 1)),
    dict(window_size=(2, None)),
    dict(softcap=3.0, causal=True),
    dict(padding=True, causal=True),
    dict(padding=True, window_size=(4, 0)),
    dict(sink=True, causal=True),
    dict(sink=True, padding=True),
    dict(bias=True),
])
@pytest.mark.parametrize("Sq,Sk", [(7, 11), (11, 7), (9, 9)])
def test_reference_matches_the_root_oracle(kw, Sq, Sk):
    q, k, v = _qkv(Sq=Sq, Sk=Sk, seed=Sq * Sk)
    B, H = q.shape[0], q.shape[2]
    qpm = kpm = sink = bias = None
    if kw.get("padding"):
        qpm = torch.arange(Sq)[None] < torch.tensor([[Sq], [Sq - 2]])
        kpm = torch.arange(Sk)[None] < torch.tensor([[Sk - 3], [Sk]])
    if kw.get("sink"):
        sink = torch.randn(H)
    if kw.get("bias"):
        bias = torch.randn(B, H, Sq, Sk)
    window = kw.get("window_size", (None, None))
    out, attn, lse = T.attention_ref(q, k, v, qpm, kpm, attn_bias=bias, causal=kw.get("causal", False),
                                     window_size=window, learnable_sink=sink, softcap=kw.get("softcap", 0.0),
                                     return_lse=True)
    want, want_attn = root.attention_ref(q, k, v, qpm, kpm, attn_bias=bias, causal=kw.get("causal", False),
                                         window_size=_root_window(window), softcap=kw.get("softcap", 0.0),
                                         learnable_sink=sink)
    close(out, want)
    close(attn, want_attn)
    # lse: logsumexp over the visible scores (and the sink), -inf where a row sees nothing
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("bihd,bjhd->bhij", q * scale, k.repeat_interleave(H // k.shape[2], 2))
    if kw.get("softcap"):
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    visible = attn.abs() > 0 if sink is None else None
    if visible is not None and bias is None and not kw.get("padding"):
        hidden = ~(_visible(Sq, Sk, window, kw.get("causal", False)))
        ref_lse = torch.logsumexp(s.masked_fill(hidden, -math.inf), -1)
        close(lse, ref_lse)


def _visible(Sq, Sk, window, causal, chunk=0, sink_tokens=0):
    """Elementwise: query i (key position p = i + Sk - Sq) sees key j."""
    left, right = window
    if causal:
        right = 0
    vis = torch.zeros(Sq, Sk, dtype=torch.bool)
    for i in range(Sq):
        p = i + Sk - Sq
        for j in range(Sk):
            ok = True
            if right is not None and j > min(p + right, Sk) if left is not None else (right is not None and j > p + right):
                ok = False
            if left is not None and j < p - left and j >= sink_tokens:
                ok = False
            if chunk:
                start = p - (p % chunk)  # Python's % floors: p < 0 lands in a chunk of negative positions
                ok = ok and start <= j < start + chunk
            vis[i, j] = ok
    return vis


@pytest.mark.parametrize("window,sink_tokens", [((2, 1), 0), ((None, 0), 0), ((3, None), 0), ((1, 0), 2),
                                                ((0, 0), 0), ((5, 3), 1)])
@pytest.mark.parametrize("Sq,Sk", [(5, 9), (9, 5), (6, 6)])
def test_local_mask_elementwise(window, sink_tokens, Sq, Sk):
    got = T.construct_local_mask(Sq, Sk, window, sink_tokens)
    assert torch.equal(got, ~_visible(Sq, Sk, window, False, sink_tokens=sink_tokens))


@pytest.mark.parametrize("chunk", [1, 3, 4, 16])
@pytest.mark.parametrize("Sq,Sk", [(5, 9), (9, 5), (8, 8)])
def test_chunk_mask_elementwise(chunk, Sq, Sk):
    got = T.construct_chunk_mask(Sq, Sk, chunk)
    assert torch.equal(got, ~_visible(Sq, Sk, (None, None), False, chunk=chunk))


def test_masks_with_padding_and_leftpad_use_each_batchs_lengths():
    qpm = torch.arange(6)[None] < torch.tensor([[6], [4]])
    kpm = torch.arange(9)[None] < torch.tensor([[9], [7]])
    got = T.construct_local_mask(6, 9, (2, 0), 0, qpm, kpm)
    assert got.shape == (2, 1, 6, 9)
    assert torch.equal(got[0, 0], ~_visible(6, 9, (2, 0), False))
    assert torch.equal(got[1, 0, :4, :7], ~_visible(4, 7, (2, 0), False))
    leftpad = torch.tensor([0, 3])
    shifted = T.construct_chunk_mask(6, 9, 4, key_leftpad=leftpad)
    assert shifted.shape == (2, 1, 6, 9)
    assert torch.equal(shifted[0, 0], ~_visible(6, 9, (None, None), False, chunk=4))
    assert bool(shifted[1, 0, :, :3].all())  # columns before the left pad: hidden
    # key j of batch 1 is column j + 3: with Sk = 9 counted, query i's chunk is the unshifted one, moved right by 3
    assert torch.equal(shifted[1, 0, :, 3:], ~_visible(6, 9, (None, None), False, chunk=4)[:, :6])


def test_chunk_in_the_reference():
    q, k, v = _qkv(Sq=9, Sk=13)
    out, attn = T.attention_ref(q, k, v, causal=True, attention_chunk=4)
    vis = _visible(9, 13, (None, 0), False, chunk=4)
    want, want_attn = root.attention_ref(q, k, v, attn_bias=torch.zeros(9, 13, dtype=q.dtype).masked_fill(~vis, -math.inf))
    close(out, want)
    close(attn, want_attn)


def test_qv_is_attention_over_concatenated_heads():
    q, k, v = _qkv(D=16, Dv=8)
    qv = torch.randn(*q.shape[:3], 8, dtype=q.dtype)
    out, _ = T.attention_ref(q, k, v, qv=qv, causal=True)
    want, _ = root.attention_ref(torch.cat([q, qv], -1), torch.cat([k, v], -1), v, causal=True)
    close(out, want)
    only, _ = T.attention_ref(None, None, v, qv=qv)  # qv alone: scale Dv ** -0.5
    want_only, _ = root.attention_ref(qv, v, v)
    close(only, want_only)


def test_gather_kv_indices_keep_only_the_listed_keys():
    q, k, v = _qkv(B=1, Sq=4, Sk=10)
    idx = torch.tensor([[[1, 5, -1], [0, 9, 9], [3, -1, -1], [2, 4, 6]]])
    out, _ = T.attention_ref(q, k, v, gather_kv_indices=idx)
    keep = torch.zeros(4, 10, dtype=torch.bool)
    for i in range(4):
        for j in idx[0, i].tolist():
            if j >= 0:
                keep[i, j] = True
    want, _ = root.attention_ref(q, k, v, attn_bias=torch.zeros(4, 10, dtype=q.dtype).masked_fill(~keep, -math.inf))
    close(out, want)


def test_descales_multiply_before_the_scores():
    q, k, v = _qkv()
    qd, kd, vd = (torch.rand(2, 2) + 0.5 for _ in range(3))
    out, _ = T.attention_ref(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    want, _ = T.attention_ref(q * qd.repeat_interleave(2, 1)[:, None, :, None], k * kd[:, None, :, None],
                              v * vd[:, None, :, None])
    close(out, want)


def test_dropout_mask_and_reorder_and_intermediate_dtype():
    q, k, v = _qkv(dtype=torch.float16)
    keep = torch.rand(2, 4, 7, 11) > 0.3
    out, attn = T.attention_ref(q, k, v, dropout_p=0.3, dropout_mask=keep, causal=True)
    want, _ = root.attention_ref(q, k, v, dropout_p=0.3, dropout_mask=keep, causal=True)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    assert out.dtype == attn.dtype == torch.float16
    low, _ = T.attention_ref(q, k, v, causal=True, upcast=False, reorder_ops=True)
    assert low.dtype == torch.float16 and (low.float() - T.attention_ref(q, k, v, causal=True)[0].float()).abs().max() < 5e-3
    rounded, _ = T.attention_ref(q, k, v, causal=True, intermediate_dtype=torch.bfloat16)
    assert not torch.equal(rounded, T.attention_ref(q, k, v, causal=True)[0])


def test_unpad_and_pad_round_trip():
    x = torch.randn(3, 5, 2, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    rows, idx, cu, max_len, used = T.unpad_input(x, mask)
    assert rows.shape == (8, 2, 4) and cu.tolist() == [0, 3, 8, 8] and max_len == 5 and used.tolist() == [3, 5, 0]
    assert cu.dtype == used.dtype == torch.int32
    assert torch.equal(T.pad_input(rows, idx, 3, 5), x * mask[..., None, None])
    unused = torch.tensor([[0, 0, 0, 1, 0], [0] * 5, [1, 0, 0, 0, 0]], dtype=torch.bool)
    rows, idx, cu, max_len, used = T.unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 9, 10] and used.tolist() == [3, 5, 0] and rows.shape[0] == 10


def test_pad_helpers_are_differentiable():
    x = torch.randn(6, 3, requires_grad=True)
    idx = torch.tensor([0, 2, 5])
    T.index_first_axis(x, idx).sum().backward()
    assert x.grad[:, 0].tolist() == [1, 0, 1, 0, 0, 1]
    vals = torch.randn(3, 3, requires_grad=True)
    T.index_put_first_axis(vals, idx, 6)[idx].sum().backward()
    assert torch.equal(vals.grad, torch.ones(3, 3))


@pytest.mark.parametrize("mode", ["full", "random", "third"])
def test_random_padding_mask(mode):
    torch.manual_seed(0)
    m = T.generate_random_padding_mask(40, 12, "cpu", mode=mode)
    lens = m.sum(-1)
    low = {"full": 40, "random": 20, "third": 13}[mode]
    assert m.shape == (12, 40) and bool((lens >= low).all()) and bool((lens <= 40).all())
    assert torch.equal(m, torch.arange(40)[None] < lens[:, None])  # a prefix each
    z = T.generate_random_padding_mask(40, 12, "cpu", mode=mode, zero_lengths=True).sum(-1)
    assert [i for i in range(12) if z[i] == 0] == [0, 5, 10, 11]
    with pytest.raises(ValueError, match="mode"):
        T.generate_random_padding_mask(4, 2, "cpu", mode="half")


def test_generate_qkv_forms():
    q, k, v = _qkv(B=2, Sq=5, Sk=6, H=2, Hk=2, dtype=torch.float32)
    qpm = torch.arange(5)[None] < torch.tensor([[5], [3]])
    kpm = torch.arange(6)[None] < torch.tensor([[4], [6]])
    res = T.generate_qkv(q, k, v, qpm, kpm)
    assert len(res) == 17
    q_u, k_u, v_u, qv_u, cu_q, cu_k, used_q, used_k, max_q, max_k, q2, k2, v2, qv2, out_fn, dq_fn, dk_fn = res
    assert q_u.shape == (8, 2, 16) and k_u.shape == (10, 2, 16) and cu_q.tolist() == [0, 5, 8]
    assert cu_k.tolist() == [0, 4, 10] and (max_q, max_k) == (5, 6) and used_q.tolist() == [5, 3]
    assert q_u.requires_grad and q2.requires_grad and qv_u is None and qv2 is None
    assert torch.equal(out_fn(q_u), q * qpm[..., None, None]) and torch.equal(dk_fn(k_u), k * kpm[..., None, None])
    dense = T.generate_qkv(q, k, v)
    assert dense[6] is None and dense[4].tolist() == [0, 5, 10] and torch.equal(dense[14](dense[0]), q)
    kv_res = T.generate_qkv(q, k, v, qpm, kpm, kvpacked=True)
    assert len(kv_res) == 11 and kv_res[1].shape == (10, 2, 2, 16) and kv_res[7].shape == (2, 6, 2, 2, 16)
    qkv_res = T.generate_qkv(q, q.clone(), q.clone(), qpm, qpm, qkvpacked=True)
    assert len(qkv_res) == 6 and qkv_res[0].shape == (8, 3, 2, 16) and qkv_res[3].shape == (2, 5, 3, 2, 16)
    assert torch.equal(qkv_res[5](qkv_res[0]), qkv_res[3].detach() * qpm[..., None, None, None])
    with pytest.raises(ValueError):
        T.generate_qkv(q, k, v, qpm, kpm, qkvpacked=True)


def test_fake_tensor_mode_helpers():
    assert not T.is_fake_mode()

    @T.maybe_fake_tensor_mode()
    def inside():
        t = torch.empty(3, 4)
        return T.is_fake_mode(), type(t).__name__

    assert inside() == (True, "FakeTensor")
    assert T.maybe_fake_tensor_mode(False)(lambda: T.is_fake_mode())() is False
