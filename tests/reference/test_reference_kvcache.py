"""fwd_kvcache of the reference backend (FA2's flash_attn_with_kvcache semantics) against a plain torch
implementation written here: cache update by Python loops, rotary by complex multiplication, attention by
the oracle on each sequence's slice of keys."""
import math

import pytest
import torch

from flash_attn import reference as R
from flash_attn.testing import (
    assert_close_to_ref,
    backend_fwd_kvcache,
    attention_lse_ref,
    attention_ref,
    padding_mask_from_seqlens,
    paged_from_dense,
)


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(R, "BLOCK_K", 16)
    monkeypatch.setattr(R, "BLOCK_Q", 4)


def _rotary_complex(x, cos, sin, positions, interleaved):
    """x (S, Hx, D) rotated at positions (S,) by complex multiplication (an independent formulation)."""
    rd = cos.shape[-1] * 2
    xr = x[..., :rd].float()
    if interleaved:
        pairs = xr.reshape(*xr.shape[:-1], rd // 2, 2)
    else:
        pairs = torch.stack((xr[..., : rd // 2], xr[..., rd // 2:]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    rot = torch.complex(cos.float()[positions], sin.float()[positions]).unsqueeze(1)  # (S, 1, rd / 2)
    w = torch.view_as_real(z * rot)
    out = w.flatten(-2) if interleaved else torch.cat((w[..., 0], w[..., 1]), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)


def _torch_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, cache_leftpad, causal,
                   window, interleaved, softcap, alibi_slopes):
    """Plain torch: (out_ref, out_pt, lse_ref, new k_cache, new v_cache, rotated q) on dense caches."""
    B, Sq = q.shape[:2]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q = q.clone()
    s_new = 0 if k is None else k.shape[1]
    local = causal or window[0] >= 0 or window[1] >= 0
    for b in range(B):
        L = int(cache_seqlens[b])
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        if cos is not None:
            qpos = torch.arange(L, L + Sq) if local else torch.full((Sq,), L)
            q[b] = _rotary_complex(q[b], cos, sin, qpos, interleaved)
        if k is not None:
            kb = k[b] if cos is None else _rotary_complex(k[b], cos, sin, torch.arange(L, L + s_new), interleaved)
            for i in range(s_new):
                k_cache[row, L + i] = kb[i]
                v_cache[row, L + i] = v[b, i]
    outs_ref, outs_pt, lses = [], [], []
    for b in range(B):
        row = b if cache_batch_idx is None else int(cache_batch_idx[b])
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        end = int(cache_seqlens[b]) + s_new
        kb, vb = k_cache[row:row + 1, start:end], v_cache[row:row + 1, start:end]
        slopes = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b])
        kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
        outs_ref.append(attention_ref(q[b:b + 1], kb, vb, **kw)[0])
        outs_pt.append(attention_ref(q[b:b + 1], kb, vb, upcast=False, reorder_ops=True, **kw)[0])
        lses.append(attention_lse_ref(q[b:b + 1], kb, causal=causal, window_size=window, softcap=softcap,
                                      alibi_slopes=slopes))
    return torch.cat(outs_ref), torch.cat(outs_pt), torch.cat(lses), k_cache, v_cache, q


def _make(B=2, Sq=3, S_cache=40, H=4, Hk=2, D=32, Dv=None, dtype=torch.float16, s_new=3, rotary_dim=0,
          B_cache=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    B_cache = B if B_cache is None else B_cache
    q = torch.randn(B, Sq, H, D, generator=g).to(dtype)
    k_cache = torch.randn(B_cache, S_cache, Hk, D, generator=g).to(dtype)
    v_cache = torch.randn(B_cache, S_cache, Hk, Dv, generator=g).to(dtype)
    k = torch.randn(B, s_new, Hk, D, generator=g).to(dtype) if s_new else None
    v = torch.randn(B, s_new, Hk, Dv, generator=g).to(dtype) if s_new else None
    cache_seqlens = torch.randint(0, S_cache - max(s_new, Sq) + 1, (B,), generator=g, dtype=torch.int32)
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(S_cache, rotary_dim // 2, generator=g) * 2 * math.pi
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cos=cos, sin=sin, cache_seqlens=cache_seqlens)


def _run(c, causal=False, window=(-1, -1), interleaved=False, cache_batch_idx=None, cache_leftpad=None,
         softcap=0.0, alibi_slopes=None, block_size=None, num_splits=0):
    """Backend result (out, lse, k_cache, v_cache as dense (B_cache, S, Hk, D)) and the torch one."""
    q = c["q"]
    D = q.shape[-1]
    ref = _torch_kvcache(q, c["k_cache"], c["v_cache"], c["k"], c["v"], c["cos"], c["sin"], c["cache_seqlens"],
                         cache_batch_idx, cache_leftpad, causal, window, interleaved, softcap, alibi_slopes)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    block_table = None
    if block_size is not None:
        S = kc.shape[1]
        kc, block_table = paged_from_dense(kc, block_size, num_blocks=2 * kc.shape[0] * (-(-S // block_size)),
                                           generator=torch.Generator().manual_seed(9))
        vc, _ = paged_from_dense(c["v_cache"], block_size, num_blocks=kc.shape[0], block_table=block_table)
    out, lse = backend_fwd_kvcache(R,
        q, kc, vc, k=c["k"], v=c["v"], rotary_cos=c["cos"], rotary_sin=c["sin"],
        cache_seqlens=c["cache_seqlens"], cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, softmax_scale=1.0 / math.sqrt(D), causal=causal, window_left=window[0],
        window_right=0 if causal else window[1], softcap=softcap, rotary_interleaved=interleaved,
        alibi_slopes=alibi_slopes, num_splits=num_splits)
    if block_table is not None:
        S = c["k_cache"].shape[1]
        kc = kc[block_table.long()].flatten(1, 2)[:, :S]
        vc = vc[block_table.long()].flatten(1, 2)[:, :S]
    return (out, lse, kc, vc), ref


def _check(got, ref, exact_cache=True):
    out, lse, kc, vc = got
    out_ref, out_pt, lse_ref, kc_ref, vc_ref, _ = ref
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype
    assert_close_to_ref(out, out_ref, out_pt)
    assert lse.dtype == torch.float32 and lse.shape == lse_ref.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse[fin], lse_ref[fin], atol=1e-4, rtol=1e-5)
    if exact_cache:
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    else:
        torch.testing.assert_close(kc, kc_ref)
        assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_append_and_attend(dtype, causal):
    _check(*_run(_make(dtype=dtype), causal=causal))


def test_append_is_in_place_and_touches_only_new_rows():
    c = _make(s_new=5)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    before = kc.clone()
    backend_fwd_kvcache(R, c["q"], kc, vc, k=c["k"], v=c["v"], rotary_cos=None, rotary_sin=None,
                  cache_seqlens=c["cache_seqlens"], cache_batch_idx=None, cache_leftpad=None, block_table=None,
                  softmax_scale=0.2, causal=True, window_left=-1, window_right=0, softcap=0.0,
                  rotary_interleaved=False, alibi_slopes=None, num_splits=1)
    for b in range(2):
        L = int(c["cache_seqlens"][b])
        assert torch.equal(kc[b, L:L + 5], c["k"][b]) and torch.equal(vc[b, L:L + 5], c["v"][b])
        assert torch.equal(kc[b, :L], before[b, :L]) and torch.equal(kc[b, L + 5:], before[b, L + 5:])


def test_no_new_kv_attends_to_cache_seqlens():
    c = _make(s_new=0)
    c["cache_seqlens"] = torch.tensor([0, 17], dtype=torch.int32)  # an empty cache row gives 0 and +inf
    got, ref = _run(c, causal=False)
    _check(got, ref)
    assert torch.all(got[0][0] == 0) and torch.all(got[1][0] == float("inf"))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary(interleaved, causal):
    c = _make(rotary_dim=32, Sq=3, s_new=3)
    got, ref = _run(c, causal=causal, interleaved=interleaved)
    _check(got, ref, exact_cache=False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_partial_dim_and_local_window(interleaved):
    c = _make(rotary_dim=16, D=40, Sq=4, s_new=4, dtype=torch.bfloat16)
    got, ref = _run(c, window=(5, 2), interleaved=interleaved)
    _check(got, ref, exact_cache=False)
    # Dims past rotary_dim are written unrotated.
    for b in range(2):
        L = int(c["cache_seqlens"][b])
        assert torch.equal(got[2][b, L:L + 4, :, 16:], c["k"][b, :, :, 16:])


def test_rotary_noncausal_rotates_all_queries_at_one_position():
    c = _make(rotary_dim=32, Sq=3, s_new=1, dtype=torch.float32)
    c["q"][:, 1:] = c["q"][:, :1]  # identical queries get identical rotations, hence identical outputs
    out = _run(c, causal=False)[0][0]
    assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 0], out[:, 2])
    out_causal = _run(c, causal=True)[0][0]
    assert not torch.equal(out_causal[:, 0], out_causal[:, 2])


def test_cache_batch_idx():
    c = _make(B=2, B_cache=5)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    before = c["k_cache"].clone()
    got, ref = _run(c, causal=True, cache_batch_idx=idx)
    _check(got, ref)
    for r in (0, 2, 4):  # rows no batch entry maps to stay untouched
        assert torch.equal(got[2][r], before[r])


@pytest.mark.parametrize("alibi", [False, True])
def test_cache_leftpad(alibi):
    c = _make(B=3, s_new=2, Sq=2, H=2, Hk=2)
    c["cache_seqlens"] = torch.tensor([10, 25, 4], dtype=torch.int32)
    leftpad = torch.tensor([3, 0, 4], dtype=torch.int32)  # the last row has no cached key left
    slopes = torch.rand(3, 2) * 0.5 if alibi else None
    _check(*_run(c, causal=True, cache_leftpad=leftpad, alibi_slopes=slopes))


def test_cache_leftpad_oracle_path():
    # The same leftpad problem through attention_ref's key_padding_mask + key_leftpad arguments.
    c = _make(B=2, s_new=0, Sq=2, H=2, Hk=2, dtype=torch.float32)
    seqlens = torch.tensor([20, 31], dtype=torch.int32)
    leftpad = torch.tensor([5, 2], dtype=torch.int32)
    c["cache_seqlens"] = seqlens
    (out, _, _, _), _ = _run(c, causal=True, cache_leftpad=leftpad)
    S = c["k_cache"].shape[1]
    kpm = padding_mask_from_seqlens(seqlens, S)
    o_ref, _ = attention_ref(c["q"], c["k_cache"], c["v_cache"], key_padding_mask=kpm, causal=True,
                             key_leftpad=leftpad)
    o_pt, _ = attention_ref(c["q"], c["k_cache"], c["v_cache"], key_padding_mask=kpm, causal=True,
                            key_leftpad=leftpad, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, o_ref, o_pt)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_paged_cache(block_size):
    c = _make(s_new=4, Sq=4, rotary_dim=16)
    _check(*_run(c, causal=True, block_size=block_size), exact_cache=False)


def test_paged_cache_leftpad_gqa_softcap():
    c = _make(B=2, H=4, Hk=1, s_new=2, Sq=2)
    c["cache_seqlens"] = torch.tensor([9, 30], dtype=torch.int32)
    _check(*_run(c, causal=True, block_size=8, cache_leftpad=torch.tensor([2, 7], dtype=torch.int32),
                 softcap=4.0))


@pytest.mark.parametrize("Hk", [4, 2, 1])
def test_gqa_window_softcap_alibi(Hk):
    c = _make(Hk=Hk, Sq=5, s_new=5)
    _check(*_run(c, window=(6, 1), softcap=3.0, alibi_slopes=torch.rand(4) * 0.5))


def test_head_dim_v_differs():
    _check(*_run(_make(D=40, Dv=24, Sq=2, s_new=2), causal=True))


def test_num_splits_is_only_a_hint():
    c = _make(Sq=2, s_new=2)
    a = _run(c, causal=True, num_splits=1)[0]
    b = _run(c, causal=True, num_splits=4)[0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_append_one_token():
    # The decoding step: one new key per sequence.
    _check(*_run(_make(s_new=1, Sq=1), causal=True))


def test_append_zero_tokens_is_no_append():
    c = _make(s_new=3)
    c["k"], c["v"] = c["k"][:, :0], c["v"][:, :0]
    got = _run(c, causal=True)[0]
    c["k"] = c["v"] = None
    want = _run(c, causal=True)[0]
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def _append(c, cache_seqlens, block_table=None):
    backend_fwd_kvcache(R, c["q"], c["k_cache"], c["v_cache"], k=c["k"], v=c["v"], cache_seqlens=cache_seqlens,
                        block_table=block_table, softmax_scale=0.2, causal=True, window_right=0)


def test_append_past_the_cache_raises():
    # The API checks the capacity before the backend runs; the backend checks it too, for its direct callers.
    c = _make(B=2, S_cache=40, s_new=3)
    with pytest.raises(ValueError, match=r"^k: appending 3 tokens at cache_seqlens up to 38 overflows the cache of "
                                         r"40 rows$"):
        _append(c, torch.tensor([38, 0], dtype=torch.int32))
    _append(c, torch.tensor([37, 0], dtype=torch.int32))  # the last 3 rows: fits


def test_append_past_the_block_table_raises():
    c = _make(B=2, S_cache=40, s_new=3)
    c["k_cache"], bt = paged_from_dense(c["k_cache"], 8, num_blocks=12, generator=torch.Generator().manual_seed(1))
    c["v_cache"], _ = paged_from_dense(c["v_cache"], 8, num_blocks=12, block_table=bt)
    with pytest.raises(ValueError, match=r"^k: appending 3 tokens overflows block_table of 5 blocks of 8$"):
        _append(c, torch.tensor([0, 38], dtype=torch.int32), bt)
    _append(c, torch.tensor([0, 37], dtype=torch.int32), bt)


def test_rotate_at_position_past_the_table_raises():
    x = torch.randn(2, 3, 2, 8)
    cos, sin = torch.ones(8, 4), torch.zeros(8, 4)
    pos = torch.tensor([[5, 6, 7], [6, 7, 8]])
    with pytest.raises(ValueError, match=r"^rotary_cos/rotary_sin: position 8 needs at least 9 rows, got 8$"):
        R.rotate_at(x, cos, sin, pos, False)
    # position 7, the last row: a zero angle leaves x as it is
    assert torch.equal(R.rotate_at(x, cos, sin, pos - 1, False), x)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotate_at_one_position_per_row(interleaved):
    # Positions (T,) for packed rows x (T, Hx, D), as FA3's varlen KV-cache path passes them.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, 20, generator=g).to(torch.bfloat16)
    angle = torch.rand(30, 6, generator=g) * 2 * math.pi
    cos, sin = torch.cos(angle), torch.sin(angle)
    pos = torch.tensor([0, 29, 3, 3, 17, 8])
    got = R.rotate_at(x, cos, sin, pos, interleaved)
    torch.testing.assert_close(got, _rotary_complex(x, cos, sin, pos, interleaved), atol=0, rtol=0.01)


def test_kvcache_computes_each_tile_once(monkeypatch):
    # Sequence b attends to cache_seqlens[b] + 3 keys: 8 and 20 keys, one and two 16-key tiles for the 3 queries.
    tiles = []
    monkeypatch.setattr(R, "debug_tile_hook", lambda shape: tiles.append(shape))
    c = _make(B=2, Sq=3, s_new=3)
    c["cache_seqlens"] = torch.tensor([5, 17], dtype=torch.int32)
    _run(c, causal=False)
    assert [t[-2:] for t in tiles] == [(3, 8), (3, 16), (3, 4)]
