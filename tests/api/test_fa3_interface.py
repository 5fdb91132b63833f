"""FA3's API module ``flash_attn_interface`` (flash_attn/fa3_interface.py): its signatures and argument order, qv,
attention_chunk, seqused_q / seqused_k, the packed forms, the KV-cache call, flash_attn_combine and
get_scheduler_metadata, and the errors for what is not served.

The oracle here is written from FA3's definitions, independently of the package: fp64 scores of one sequence with
the causal / window / chunk masks built elementwise (query i at key position p = i + Sk - Sq sees key j iff j - p is
in [-left, right] and, with a chunk c, p - p mod c <= j < p - p mod c + c), softmax, and autograd for the
gradients. CPU cases run on the reference backend; GPU-marked cases run the same on CUDA (cute / Triton)."""
import inspect
import math

import pytest
import torch

import flash_attn_interface as f3
from flash_attn import flash_attn_with_kvcache as fa2_kvcache
from flash_attn.fa3_interface import _segments
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()


def _oracle(q, k, v, qv=None, causal=False, window=(-1, -1), chunk=0, softcap=0.0, scale=None):
    """One sequence: q (Sq, H, D), k (Sk, Hk, D), v (Sk, Hk, Dv), qv (Sq, H, Dv) -> (out (Sq, H, Dv), lse (H, Sq));
    lse -inf for a row that sees no key (whose out is 0)."""
    Sq, H, D = q.shape
    Sk, Hk, Dv = v.shape
    g = H // Hk
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if scale is None:
        scale = (D + (Dv if qv is not None else 0)) ** -0.5
    s = torch.einsum("qhd,khd->hqk", q, k)
    if qv is not None:
        s = s + torch.einsum("qhd,khd->hqk", qv, v)
    s = s * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.arange(Sq)[:, None] + Sk - Sq
    j = torch.arange(Sk)[None, :]
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= p - left
    if right >= 0:
        allowed &= j <= p + right
    if chunk:
        start = p - torch.remainder(p, chunk)
        allowed &= (j >= start) & (j < start + chunk)
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    probs = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v), lse


def _rand(*shape, dtype=torch.float32, device="cpu", grad=True):
    t = torch.randn(*shape, dtype=torch.float64).to(device=device, dtype=dtype)
    return t.requires_grad_(grad)


def _check_lse(lse, want):
    """Ours: +inf for a row that sees no key (the oracle's -inf); finite rows close."""
    empty = torch.isinf(want)
    assert torch.equal(torch.isinf(lse.double().cpu()), empty) and bool((lse.cpu()[empty] > 0).all())
    torch.testing.assert_close(lse.double().cpu()[~empty], want[~empty], atol=2e-5, rtol=1e-5)


def _grads(out, tensors, dout):
    return torch.autograd.grad(out, tensors, dout)


def _dense_case(device, dtype, B, Sq, Sk, H, Hk, D, Dv=None, qv=False, chunk=0, causal=False, window=(-1, -1),
                softcap=0.0, seed=0):
    torch.manual_seed(seed)
    Dv = Dv or D
    q, k, v = _rand(B, Sq, H, D, dtype=dtype, device=device), _rand(B, Sk, Hk, D, dtype=dtype, device=device), \
        _rand(B, Sk, Hk, Dv, dtype=dtype, device=device)
    qvt = _rand(B, Sq, H, Dv, dtype=dtype, device=device) if qv else None
    out, lse = f3.flash_attn_func(q, k, v, causal=causal, qv=qvt, window_size=window, attention_chunk=chunk,
                                  softcap=softcap, return_attn_probs=True)
    assert out.shape == (B, Sq, H, Dv) and lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    ins = [q, k, v] + ([qvt] if qv else [])
    dout = torch.randn_like(out)
    got = _grads(out, ins, dout)
    for b in range(B):
        ref_ins = [t[b].detach().double().cpu().requires_grad_() for t in ins]
        ref_out, ref_lse = _oracle(*ref_ins[:3], qv=ref_ins[3] if qv else None, causal=causal, window=window,
                                   chunk=chunk, softcap=softcap)
        _check_lse(lse[b], ref_lse)
        ref_grads = _grads(ref_out, ref_ins, dout[b].double().cpu())
        # PyTorch's own error at the input dtype: the oracle on inputs rounded to it, computed in that dtype
        low_ins = [t.detach().to(dtype) for t in ref_ins]
        low_out, _ = _oracle(*low_ins[:3], qv=low_ins[3] if qv else None, causal=causal, window=window, chunk=chunk,
                             softcap=softcap)
        assert_close_to_ref(out[b].cpu(), ref_out, low_out)
        for g, rg in zip(got, ref_grads):
            torch.testing.assert_close(g[b].double().cpu(), rg, atol=1e-4 if dtype == torch.float32 else 2e-2,
                                       rtol=1e-3 if dtype == torch.float32 else 2e-2)


# ----------------------------------------------------------------------------------------------------
# the module and its signatures


def test_top_level_module_is_fa3s():
    from flash_attn import fa3_interface

    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                 "flash_attn_combine", "get_scheduler_metadata", "_flash_attn_forward", "_flash_attn_backward"):
        assert getattr(f3, name) is getattr(fa3_interface, name)


@pytest.mark.parametrize("fn,params", [
    ("flash_attn_func", "q k v softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
                        "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs"),
    ("flash_attn_qkvpacked_func", "qkv softmax_scale causal q_descale k_descale v_descale window_size attention_chunk "
                                  "softcap deterministic num_heads_q sm_margin return_attn_probs"),
    ("flash_attn_varlen_func", "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k "
                               "softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk "
                               "softcap num_splits pack_gqa deterministic sm_margin return_attn_probs"),
    ("flash_attn_with_kvcache", "q k_cache v_cache k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx "
                                "cache_leftpad page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens "
                                "q_descale k_descale v_descale softmax_scale causal window_size attention_chunk "
                                "softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin "
                                "return_softmax_lse"),
    ("flash_attn_combine", "out_partial lse_partial out out_dtype"),
    ("_flash_attn_forward", "q k v k_new v_new qv out_ cu_seqlens_q cu_seqlens_k cu_seqlens_k_new seqused_q seqused_k "
                            "max_seqlen_q max_seqlen_k page_table kv_batch_idx leftpad_k rotary_cos rotary_sin "
                            "seqlens_rotary q_descale k_descale v_descale softmax_scale causal window_size_left "
                            "window_size_right attention_chunk softcap rotary_interleaved scheduler_metadata num_splits "
                            "pack_gqa sm_margin"),
    ("_flash_attn_backward", "dout q k v out softmax_lse cu_seqlens_q cu_seqlens_k sequed_q sequed_k max_seqlen_q "
                             "max_seqlen_k dq dk dv softmax_scale is_causal window_size_left window_size_right softcap "
                             "deterministic sm_margin"),
    ("get_scheduler_metadata", "batch_size max_seqlen_q max_seqlen_k num_heads_q num_heads_kv headdim cache_seqlens "
                               "qkv_dtype headdim_v cu_seqlens_q cu_seqlens_k_new cache_leftpad page_size "
                               "max_seqlen_k_new causal window_size attention_chunk has_softcap num_splits pack_gqa "
                               "sm_margin"),
])
def test_argument_order_is_fa3s(fn, params):
    """Positional callers depend on FA3's order."""
    assert list(inspect.signature(getattr(f3, fn)).parameters) == params.split()


# ----------------------------------------------------------------------------------------------------
# dense calls: the plain call, attention_chunk, qv


def test_plain_call_matches_fa2s_and_returns_lse():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 7, 4, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
    from flash_attn import flash_attn_func as fa2

    out = f3.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, fa2(q, k, v, causal=True))
    out2, lse = f3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out2, out)
    _, want = _oracle(q[1].double(), k[1].double(), v[1].double(), causal=True)
    _check_lse(lse[1], want)


@pytest.mark.parametrize("Sq,Sk,chunk,causal,window", [
    (16, 16, 4, True, (-1, -1)),
    (16, 16, 5, False, (-1, -1)),
    (9, 23, 4, True, (-1, -1)),      # fewer queries than keys
    (23, 9, 4, True, (-1, -1)),      # more queries than keys: rows before the first key see nothing
    (23, 9, 3, False, (-1, -1)),
    (12, 30, 7, False, (5, 2)),      # chunk and window together
    (20, 20, 1, True, (-1, -1)),     # each query sees only its own position
    (10, 17, 64, True, (-1, -1)),    # one chunk covers every key: plain causal
    (1, 33, 8, True, (-1, -1)),      # decoding
    (17, 17, 16, False, (3, -1)),    # a chunk boundary one before the end
])
def test_chunk(Sq, Sk, chunk, causal, window):
    _dense_case("cpu", torch.float32, B=2, Sq=Sq, Sk=Sk, H=4, Hk=2, D=16, chunk=chunk, causal=causal, window=window,
                seed=Sq * 100 + Sk + chunk)


def test_chunk_changes_the_result():
    """A chunk smaller than the keys is not ignored (the oracle without it disagrees)."""
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
    a = f3.flash_attn_func(q, k, v, causal=True, attention_chunk=4)
    b = f3.flash_attn_func(q, k, v, causal=True)
    assert (a - b).abs().max() > 1e-2
    assert torch.equal(f3.flash_attn_func(q, k, v, causal=True, attention_chunk=12), b)


@pytest.mark.parametrize("D,Dv,causal,chunk", [(16, 16, False, 0), (8, 24, True, 0), (16, 8, True, 5),
                                               (32, 32, False, 0)])
def test_qv(D, Dv, causal, chunk):
    _dense_case("cpu", torch.float32, B=2, Sq=9, Sk=14, H=4, Hk=1, D=D, Dv=Dv, qv=True, causal=causal, chunk=chunk,
                seed=D + Dv)


def test_qv_default_scale_counts_both_head_dims():
    torch.manual_seed(3)
    q, k, v, qv = torch.randn(1, 5, 2, 16), torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 48), \
        torch.randn(1, 5, 2, 48)
    a = f3.flash_attn_func(q, k, v, qv=qv)
    b = f3.flash_attn_func(q, k, v, qv=qv, softmax_scale=64 ** -0.5)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    c = f3.flash_attn_func(q, k, v, qv=qv, softmax_scale=16 ** -0.5)
    assert (a - c).abs().max() > 1e-3


def test_softcap_and_fp16():
    _dense_case("cpu", torch.float16, B=1, Sq=10, Sk=10, H=2, Hk=2, D=16, chunk=3, causal=True, softcap=5.0, seed=7)


def test_qkvpacked_forms():
    torch.manual_seed(4)
    B, S, H, Hk, D = 2, 11, 6, 2, 16
    qkv = torch.randn(B, S, 3, H, D, requires_grad=True)
    out, lse = f3.flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=4, return_attn_probs=True)
    want, want_lse = f3.flash_attn_func(*qkv.unbind(2), causal=True, attention_chunk=4, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.abs().sum() > 0
    packed = torch.randn(B, S, H + 2 * Hk, D)
    q, k, v = packed.split([H, Hk, Hk], 2)
    assert torch.equal(f3.flash_attn_qkvpacked_func(packed, num_heads_q=H, causal=True),
                       f3.flash_attn_func(q, k, v, causal=True))
    with pytest.raises(ValueError, match="num_heads_q"):
        f3.flash_attn_qkvpacked_func(packed)
    with pytest.raises(ValueError, match="num_heads_q"):
        f3.flash_attn_qkvpacked_func(packed, num_heads_q=5)
    with pytest.raises(ValueError, match="qkv"):
        f3.flash_attn_qkvpacked_func(torch.randn(B, S, 2, H, D))


# ----------------------------------------------------------------------------------------------------
# varlen: seqused_q / seqused_k, chunks, sub-sequences


def _varlen_case(seqlens_q, seqlens_k, used_q=None, used_k=None, chunk=0, causal=False, window=(-1, -1), qv=False,
                 seed=0, device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    H, Hk, D, Dv = 4, 2, 16, 8
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(seqlens_k).cumsum(0)), dtype=torch.int32, device=device)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k, v = _rand(tq, H, D, dtype=dtype, device=device), _rand(tk, Hk, D, dtype=dtype, device=device), \
        _rand(tk, Hk, Dv, dtype=dtype, device=device)
    qvt = _rand(tq, H, Dv, dtype=dtype, device=device) if qv else None
    sq = None if used_q is None else torch.tensor(used_q, dtype=torch.int32, device=device)
    sk = None if used_k is None else torch.tensor(used_k, dtype=torch.int32, device=device)
    out, lse = f3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), seqused_q=sq,
                                         seqused_k=sk, causal=causal, qv=qvt, window_size=window,
                                         attention_chunk=chunk, return_attn_probs=True)
    assert out.shape == (tq, H, Dv) and lse.shape == (H, tq)
    ins = [q, k, v] + ([qvt] if qv else [])
    dout = torch.randn_like(out)
    got = _grads(out, ins, dout)
    for b in range(len(seqlens_q)):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        uq = q1 - q0 if used_q is None else min(used_q[b], q1 - q0)
        uk = k1 - k0 if used_k is None else min(used_k[b], k1 - k0)
        parts = [q[q0:q0 + uq], k[k0:k0 + uk], v[k0:k0 + uk]] + ([qvt[q0:q0 + uq]] if qv else [])
        ref_ins = [t.detach().double().cpu().requires_grad_() for t in parts]
        ref_out, ref_lse = _oracle(*ref_ins[:3], qv=ref_ins[3] if qv else None, causal=causal, window=window,
                                   chunk=chunk)
        torch.testing.assert_close(out[q0:q0 + uq].double().cpu(), ref_out, atol=1e-5, rtol=1e-4)
        _check_lse(lse[:, q0:q0 + uq], ref_lse)
        # rows past seqused_q: out 0, lse +inf, no gradient; keys past seqused_k: no gradient
        assert not out[q0 + uq:q1].any() and bool((lse[:, q0 + uq:q1] == math.inf).all())
        if uq:
            ref_grads = _grads(ref_out, ref_ins, dout[q0:q0 + uq].double().cpu())
            spans = [(q0, q0 + uq), (k0, k0 + uk), (k0, k0 + uk)] + ([(q0, q0 + uq)] if qv else [])
            for g, rg, (a, e) in zip(got, ref_grads, spans):
                torch.testing.assert_close(g[a:e].double().cpu(), rg, atol=1e-4, rtol=1e-3)
        assert not got[0][q0 + uq:q1].any() and not got[1][k0 + uk:k1].any() and not got[2][k0 + uk:k1].any()


@pytest.mark.parametrize("kw", [
    dict(used_q=[3, 7, 0], used_k=[9, 4, 5]),
    dict(used_q=[3, 7, 2], used_k=[9, 4, 5], causal=True),
    dict(used_k=[2, 11, 1], causal=True, window=(3, 0)),
    dict(used_q=[5, 1, 4]),
    dict(chunk=4, causal=True),
    dict(chunk=3, window=(4, 1)),
    dict(chunk=5, used_q=[6, 3, 4], used_k=[10, 12, 2], causal=True),
    dict(chunk=2, used_q=[9, 9, 9], used_k=[20, 20, 20]),   # used counts past the lengths act as the lengths
    dict(chunk=4, causal=True, qv=True),
])
def test_varlen(kw):
    _varlen_case([6, 8, 4], [11, 12, 5], seed=len(kw), **kw)


def test_varlen_plain_call_is_fa2s():
    torch.manual_seed(5)
    from flash_attn import flash_attn_varlen_func as fa2

    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v = torch.randn(10, 2, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    assert torch.equal(f3.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True),
                       fa2(q, k, v, cu, cu, 7, 7, causal=True))


def test_segments_boundaries():
    """One sequence of 5 queries over 7 keys, chunk 3 (query positions 2..6): rows before the first key none, then
    the chunks [0, 3) [3, 6) [6, 9) with their queries, then the unused rows and keys (none here); the second
    sequence (seqused 2 of 4 queries, 3 of 6 keys) follows with the same layout."""
    cu_q, cu_k = _segments(torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([0, 7, 13], dtype=torch.int32),
                           torch.tensor([5, 2], dtype=torch.int32), torch.tensor([7, 3], dtype=torch.int32), 3, 7)
    # each sequence: (0, 0), t = 0..3 (ceil(7 / 3) = 3), (len_q, used_k); its (len_q, len_k) is the next one's start
    # seq 0: a = 2 -> query boundaries clamp(3t - 2, 0, 5) = 0, 1, 4, 5; keys clamp(3t, 0, 7) = 0, 3, 6, 7; (5, 7)
    # seq 1 (+5, +7): Lq 2, Lk 3, a = 1 -> clamp(3t - 1, 0, 2) = 0, 2, 2, 2; keys 0, 3, 3, 3; (4, 3); end (9, 13)
    assert cu_q.tolist() == [0, 0, 1, 4, 5, 5,
                             5, 5, 7, 7, 7, 9, 9]
    assert cu_k.tolist() == [0, 0, 3, 6, 7, 7,
                             7, 7, 10, 10, 10, 10, 13]
    assert cu_q.dtype == cu_k.dtype == torch.int32


# ----------------------------------------------------------------------------------------------------
# KV cache, combine, scheduler metadata


def test_kvcache_is_fa2s_with_fa3s_order():
    torch.manual_seed(6)
    B, H, Hk, D, page = 2, 4, 2, 16, 4
    q = torch.randn(B, 3, H, D)
    k_cache, v_cache = torch.randn(8, page, Hk, D), torch.randn(8, page, Hk, D)
    table = torch.tensor([[3, 1, 0, 2], [7, 6, 5, 4]], dtype=torch.int32)
    k_new, v_new = torch.randn(B, 3, Hk, D), torch.randn(B, 3, Hk, D)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    meta = f3.get_scheduler_metadata(B, 3, 16, H, Hk, D, seqlens, torch.float32, page_size=page, causal=True)
    out, lse = f3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, page_table=table,
                                          causal=True, scheduler_metadata=meta, return_softmax_lse=True)
    want, want_lse = fa2_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table, causal=True,
                                 return_softmax_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)  # both appended the same keys in place


@pytest.mark.parametrize("extras", [False, True])
def test_kvcache_page_table_rows_picked_by_cache_batch_idx(extras):
    """FA3: with a page table and cache_batch_idx, sequence b reads and appends through page_table[cache_batch_idx[b]]
    (FA2 refuses the pair); the same call with those rows gathered beforehand gives the same outputs and caches."""
    torch.manual_seed(9)
    B, H, Hk, D, page = 2, 4, 2, 16, 4
    q = torch.randn(B, 3, H, D)
    k_cache, v_cache = torch.randn(12, page, Hk, D), torch.randn(12, page, Hk, D)
    table = torch.tensor([[3, 1, 0], [11, 10, 9], [7, 6, 5]], dtype=torch.int32)  # 3 rows for 2 sequences
    idx = torch.tensor([2, 0], dtype=torch.int32)
    k_new, v_new = torch.randn(B, 2, Hk, D), torch.randn(B, 2, Hk, D)
    seqlens = torch.tensor([5, 7], dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    if extras:
        kw["rotary_seqlens"] = seqlens  # (no rotary tables: takes the extras route, the same numbers)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = f3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, page_table=table, cache_batch_idx=idx,
                                          **kw)
    want, want_lse = f3.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, page_table=table[idx.long()], **kw)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-5)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    with pytest.raises(ValueError, match="cache_batch_idx values"):
        f3.flash_attn_with_kvcache(q, k_cache, v_cache, page_table=table, cache_batch_idx=idx + 2, **kw)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no FP8 dtype in this torch")
def test_fp8_tensors_and_fa3_only_head_dims_raise_not_implemented():
    """What FA3 serves and this package does not: FP8 inputs, head dims past 256 (V's up to 512, or q's with qv):
    NotImplementedError (FA3's own tests count those as unsupported), never a ValueError for a bad input."""
    q, cache = torch.randn(1, 1, 2, 64), torch.randn(1, 4, 2, 64)
    with pytest.raises(NotImplementedError, match="k_cache is float8_e4m3fn"):
        f3.flash_attn_with_kvcache(q, cache.to(torch.float8_e4m3fn), cache, cache_seqlens=1)
    with pytest.raises(NotImplementedError, match="q is float8_e4m3fn"):
        f3.flash_attn_func(q.to(torch.float8_e4m3fn), cache, cache)
    with pytest.raises(NotImplementedError, match="v head dim 512"):
        f3.flash_attn_func(q, cache, torch.randn(1, 4, 2, 512))
    with pytest.raises(NotImplementedError, match="head dim 320"):
        f3.flash_attn_func(q, cache, torch.randn(1, 4, 2, 256), qv=torch.randn(1, 1, 2, 256))
    with pytest.raises(NotImplementedError, match="v head dim 512"):
        f3.flash_attn_varlen_func(q[0], cache[0], torch.randn(4, 2, 512), torch.tensor([0, 1], dtype=torch.int32),
                                  torch.tensor([0, 4], dtype=torch.int32), 1, 4)
    with pytest.raises(NotImplementedError, match="v head dim 512"):
        f3.flash_attn_with_kvcache(q, cache, torch.randn(1, 4, 2, 512), cache_seqlens=1)
    with pytest.raises(ValueError, match="head dim"):  # past FA3's own limits: a bad input
        f3.flash_attn_func(torch.randn(1, 1, 2, 600), torch.randn(1, 4, 2, 600), torch.randn(1, 4, 2, 600))


@pytest.mark.parametrize("name,value", [("qv", torch.zeros(1, 1, 2, 8)), ("k_descale", torch.ones(1, 2))])
def test_kvcache_refuses_what_it_does_not_serve(name, value):
    q, cache = torch.randn(1, 1, 2, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match=name):
        f3.flash_attn_with_kvcache(q, cache, cache, **{name: value})


def _rot(x, cos, sin, pos, interleaved):
    """Rotary at integer positions pos (N,) of rows x (N, H, D), written from the definition (fp64)."""
    rd = 2 * cos.shape[1]
    x = x.double().clone()
    for n in range(x.shape[0]):
        c, s = cos[pos[n]].double(), sin[pos[n]].double()
        for i in range(rd // 2):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + rd // 2)
            xa, xb = x[n, :, a].clone(), x[n, :, b].clone()
            x[n, :, a], x[n, :, b] = xa * c[i] - xb * s[i], xa * s[i] + xb * c[i]
    return x


def _kvcache_case(varlen_q=False, varlen_new=False, paged=False, batch_idx=False, leftpad=False, rotary=None,
                  rotary_seqlens=False, chunk=0, causal=False, window=(-1, -1), new=True, seed=0, device="cpu",
                  dtype=torch.float32):
    """FA3's KV-cache call against the definition: the caches after the append (rotated new keys at cache_seqlens +
    i), and each sequence's queries (rotated) over its cache rows [leftpad, end) with the masks."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hk, D, Dv, S_cache, page = 3, 4, 2, 16, 8, 24, 3
    seqlens_q = [3, 1, 4] if varlen_q else [3, 3, 3]
    n_new = ([2, 0, 3] if varlen_new else [2, 2, 2]) if new else [0, 0, 0]
    cache_seqlens = torch.tensor([7, 12, 4], dtype=torch.int32)
    pad = torch.tensor([2, 0, 3], dtype=torch.int32) if leftpad else torch.zeros(3, dtype=torch.int32)
    rows = torch.tensor([3, 0, 2], dtype=torch.int32) if batch_idx else torch.arange(3, dtype=torch.int32)
    B_cache = 4 if batch_idx else B
    k_dense = torch.randn(B_cache, S_cache, Hk, D, generator=g)
    v_dense = torch.randn(B_cache, S_cache, Hk, Dv, generator=g)
    if paged:  # pages in a shuffled order: page j of sequence b is table[b, j]
        n_pages = S_cache // page
        table = torch.randperm(B * n_pages, generator=g).reshape(B, n_pages).to(torch.int32)
        k_cache = torch.empty(B * n_pages, page, Hk, D)
        v_cache = torch.empty(B * n_pages, page, Hk, Dv)
        for b in range(B):
            for j in range(n_pages):
                k_cache[table[b, j]] = k_dense[b, j * page:(j + 1) * page]
                v_cache[table[b, j]] = v_dense[b, j * page:(j + 1) * page]
    else:
        table, k_cache, v_cache = None, k_dense.clone(), v_dense.clone()
    cu_q = torch.tensor([0] + list(torch.tensor(seqlens_q).cumsum(0)), dtype=torch.int32)
    q_rows = torch.randn(int(cu_q[-1]), H, D, generator=g)
    cu_new = torch.tensor([0] + list(torch.tensor(n_new).cumsum(0)), dtype=torch.int32)
    k_rows, v_rows = torch.randn(int(cu_new[-1]), Hk, D, generator=g), torch.randn(int(cu_new[-1]), Hk, Dv, generator=g)
    cos = sin = None
    if rotary is not None:
        angles = torch.rand(40, 4, generator=g) * 6
        cos, sin = angles.cos(), angles.sin()
    rot_base = torch.tensor([9, 3, 6], dtype=torch.int32) if rotary_seqlens else None

    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=rows if batch_idx else None,
              cache_leftpad=pad if leftpad else None, page_table=table, rotary_seqlens=rot_base, causal=causal,
              window_size=window, attention_chunk=chunk, rotary_interleaved=rotary == "interleaved",
              return_softmax_lse=True)
    if varlen_q:
        kw.update(cu_seqlens_q=cu_q, max_seqlen_q=max(seqlens_q))
        q_in = q_rows
    else:
        q_in = q_rows.reshape(B, 3, H, D)
    if new and varlen_new:
        kw.update(cu_seqlens_k_new=cu_new)
        k_in, v_in = k_rows, v_rows
    elif new:
        k_in, v_in = k_rows.reshape(B, 2, Hk, D), v_rows.reshape(B, 2, Hk, Dv)
    else:
        k_in = v_in = None
    def dev(x):
        return x.to(device=device, dtype=dtype if x.is_floating_point() and x.dim() > 2 else x.dtype)

    kw = {name: dev(val) if isinstance(val, torch.Tensor) else val for name, val in kw.items()}
    caches = [dev(k_cache), dev(v_cache)]
    out, lse = f3.flash_attn_with_kvcache(dev(q_in), *caches, None if k_in is None else dev(k_in),
                                          None if v_in is None else dev(v_in), **kw)
    # the oracle's inputs: the same values at the call's dtype
    out, lse, (k_cache, v_cache) = out.float().cpu(), lse.cpu(), [c.float().cpu() for c in caches]
    q_rows, k_rows, v_rows = (t.to(dtype).float() for t in (q_rows, k_rows, v_rows))
    k_dense, v_dense = k_dense.to(dtype).float(), v_dense.to(dtype).float()
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if not varlen_q:
        out, lse = out.reshape(-1, H, Dv), lse.transpose(0, 1).reshape(H, -1)

    base = cache_seqlens if rot_base is None else rot_base
    for b in range(B):
        kd, vd = k_dense[int(rows[b])].clone(), v_dense[int(rows[b])].clone()
        nk = k_rows[cu_new[b]:cu_new[b + 1]]
        if cos is not None and len(nk):
            nk = _rot(nk, cos, sin, [int(base[b]) + i for i in range(len(nk))], rotary == "interleaved").float()
        end = int(cache_seqlens[b]) + len(nk)
        kd[int(cache_seqlens[b]):end] = nk
        vd[int(cache_seqlens[b]):end] = v_rows[cu_new[b]:cu_new[b + 1]]
        # the caches hold the appended rows
        if paged:
            got_k = torch.cat([k_cache[table[b, j]] for j in range(S_cache // page)])
        else:
            got_k = k_cache[int(rows[b])]
        torch.testing.assert_close(got_k[:end], kd[:end], **tol)
        qb = q_rows[cu_q[b]:cu_q[b + 1]]
        if cos is not None:
            bounded = causal or window != (-1, -1)
            qb = _rot(qb, cos, sin, [int(base[b]) + (i if bounded else 0) for i in range(len(qb))],
                      rotary == "interleaved").float()
        p0 = int(pad[b])
        ref_out, ref_lse = _oracle(qb.double(), kd[p0:end].double(), vd[p0:end].double(), causal=causal,
                                   window=window, chunk=chunk)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].double(), ref_out, **tol)
        if dtype == torch.float32:
            _check_lse(lse[:, cu_q[b]:cu_q[b + 1]], ref_lse)


@pytest.mark.parametrize("kw", [
    dict(varlen_q=True),
    dict(varlen_q=True, varlen_new=True, causal=True),
    dict(varlen_new=True, paged=True, causal=True),
    dict(chunk=4, causal=True),
    dict(chunk=3, varlen_q=True, leftpad=True, causal=True),
    dict(chunk=5, window=(6, 0), batch_idx=True),
    dict(rotary="interleaved", rotary_seqlens=True, causal=True),
    dict(rotary="neox", rotary_seqlens=True),                       # q rows all at the base position
    dict(rotary="neox", varlen_q=True, varlen_new=True, paged=True, leftpad=True, chunk=4, causal=True),
    dict(rotary="interleaved", batch_idx=True, leftpad=True, varlen_new=True, window=(3, 1)),
    dict(new=False, varlen_q=True, chunk=2),
    dict(new=False, paged=True, leftpad=True, chunk=6, causal=True),
])
def test_kvcache_extras(kw):
    _kvcache_case(seed=len(kw), **kw)


def test_kvcache_extras_match_the_fast_path():
    """Without extras the call takes FA2's op; with rotary_seqlens equal to cache_seqlens it takes the paged-varlen
    route: the same numbers (and the same appended caches)."""
    torch.manual_seed(8)
    B, H, Hk, D = 2, 4, 2, 16
    q, kc, vc = torch.randn(B, 3, H, D), torch.randn(B, 20, Hk, D), torch.randn(B, 20, Hk, D)
    kn, vn = torch.randn(B, 3, Hk, D), torch.randn(B, 3, Hk, D)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    angles = torch.rand(40, 4) * 6
    common = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin(), cache_seqlens=seqlens, causal=True,
                  return_softmax_lse=True)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    a = f3.flash_attn_with_kvcache(q, k1, v1, kn, vn, **common)
    b = f3.flash_attn_with_kvcache(q, k2, v2, kn, vn, rotary_seqlens=seqlens, **common)
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(k1, k2, atol=1e-6, rtol=1e-5)
    assert torch.equal(v1, v2)


def test_kvcache_extras_errors():
    q, cache = torch.randn(4, 2, 8), torch.randn(2, 6, 2, 8)
    cu = torch.tensor([0, 1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        f3.flash_attn_with_kvcache(q, cache, cache, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        f3.flash_attn_with_kvcache(q.reshape(1, 4, 2, 8)[:, :2].expand(2, 2, 2, 8), cache, cache, max_seqlen_q=2)
    k_new = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="capacity"):
        f3.flash_attn_with_kvcache(q, cache, cache, k_new, k_new, cache_seqlens=torch.tensor([5, 2], dtype=torch.int32),
                                   cu_seqlens_q=cu, max_seqlen_q=3,
                                   cu_seqlens_k_new=torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k_new"):
        f3.flash_attn_with_kvcache(q, cache, cache, cu_seqlens_q=cu, max_seqlen_q=3,
                                   cu_seqlens_k_new=torch.tensor([0, 2, 3], dtype=torch.int32))


@pytest.mark.parametrize("shape", [(3, 4, 5, 4, 16), (4, 9, 3, 8)])
def test_combine(shape):
    torch.manual_seed(7)
    out_p = torch.randn(*shape)
    lse_p = torch.randn(*shape[:-1]) * 3
    lse_p[1:, 0] = -math.inf            # rows only the first part saw
    lse_p[:, 1] = -math.inf             # a row no part saw
    lse_p[0, 2] = math.inf              # a part that saw no key, written as +inf
    out, lse = f3.flash_attn_combine(out_p, lse_p, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32 and lse.shape == shape[1:-1]
    o64, l64 = out_p.double(), lse_p.double()
    l64 = torch.where(torch.isinf(l64), torch.full_like(l64, -math.inf), l64)
    want_lse = torch.logsumexp(l64, 0)
    w = torch.exp(l64 - want_lse).nan_to_num(0.0)
    want = (w.unsqueeze(-1) * o64).sum(0)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert not out[1].any() and bool((lse[1] == -math.inf).all())
    dest = torch.empty(shape[1:])
    got, _ = f3.flash_attn_combine(out_p, lse_p, out=dest)
    assert got is dest
    torch.testing.assert_close(dest.double(), want, atol=1e-5, rtol=1e-5)


def test_combine_errors():
    with pytest.raises(ValueError, match="lse_partial"):
        f3.flash_attn_combine(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="out_partial"):
        f3.flash_attn_combine(torch.randn(2, 8), torch.randn(2))
    with pytest.raises(ValueError, match="out must"):
        f3.flash_attn_combine(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4), out=torch.empty(3, 4, 7))


def test_scheduler_metadata_errors():
    with pytest.raises(ValueError, match="num_heads_kv"):
        f3.get_scheduler_metadata(1, 1, 8, 6, 4, 64, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_seqlens"):
        f3.get_scheduler_metadata(1, 1, 8, 8, 4, 64, torch.zeros(1))


# ----------------------------------------------------------------------------------------------------
# the lower-level functions


def test_low_level_forward_routes_each_kind_of_call():
    torch.manual_seed(9)
    q, k, v = torch.randn(2, 6, 4, 16), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
    out, lse, acc, lse_acc = f3._flash_attn_forward(q, k, v, causal=True, window_size_left=3, attention_chunk=4)
    want, want_lse = f3.flash_attn_func(q, k, v, causal=True, window_size=(3, -1), attention_chunk=4,
                                        return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and acc.numel() == 0 and lse_acc.numel() == 0
    dest = torch.empty_like(out)
    assert f3._flash_attn_forward(q, k, v, out_=dest)[0] is dest
    assert torch.equal(dest, f3.flash_attn_func(q, k, v))
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)
    qr, kr, vr = q.reshape(12, 4, 16), k.reshape(18, 2, 16), v.reshape(18, 2, 16)
    used = torch.tensor([4, 7], dtype=torch.int32)
    out, lse, *_ = f3._flash_attn_forward(qr, kr, vr, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=used,
                                          max_seqlen_q=7, max_seqlen_k=9, causal=True)
    want, want_lse = f3.flash_attn_varlen_func(qr, kr, vr, cu_q, cu_k, 7, 9, seqused_k=used, causal=True,
                                               return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    kc, vc = torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 16)
    kn, vn = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    seqlens = torch.tensor([3, 8], dtype=torch.int32)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out, lse, *_ = f3._flash_attn_forward(q[:, :1], k1, v1, kn, vn, seqused_k=seqlens, causal=True)
    want, want_lse = f3.flash_attn_with_kvcache(q[:, :1], k2, v2, kn, vn, cache_seqlens=seqlens, causal=True,
                                                return_softmax_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and torch.equal(k1, k2)
    with pytest.raises(ValueError, match="seqused_k"):
        f3._flash_attn_forward(q, k, v, seqused_k=used)


@pytest.mark.parametrize("varlen", [False, True])
def test_low_level_backward_matches_autograd(varlen):
    torch.manual_seed(10)
    q, k, v = (torch.randn(2, 7, 4, 16, requires_grad=True), torch.randn(2, 9, 2, 16, requires_grad=True),
               torch.randn(2, 9, 2, 16, requires_grad=True))
    dout = torch.randn(2, 7, 4, 16)
    if not varlen:
        out, lse = f3.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), return_attn_probs=True)
        want = torch.autograd.grad(out, (q, k, v), dout)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = f3._flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dq=dq,
                                        dk=dk, dv=dv, is_causal=True, window_size_left=4)
        torch.testing.assert_close(delta, (dout * out.detach()).sum(-1).transpose(1, 2))
    else:
        cu_q, cu_k = torch.tensor([0, 7, 14], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)
        used_q, used_k = torch.tensor([5, 7], dtype=torch.int32), torch.tensor([9, 4], dtype=torch.int32)
        qr, kr, vr = q.reshape(14, 4, 16), k.reshape(18, 2, 16), v.reshape(18, 2, 16)
        out, lse = f3.flash_attn_varlen_func(qr, kr, vr, cu_q, cu_k, 7, 9, used_q, used_k, causal=True,
                                             return_attn_probs=True)
        want = [g.reshape(t.shape) for g, t in zip(torch.autograd.grad(out, (qr, kr, vr), dout.reshape(14, 4, 16)),
                                                   (q, k, v))]
        dq, dk, dv = torch.empty(14, 4, 16), torch.empty(18, 2, 16), torch.empty(18, 2, 16)
        f3._flash_attn_backward(dout.reshape(14, 4, 16), qr.detach(), kr.detach(), vr.detach(), out.detach(),
                                lse.detach(), cu_q, cu_k, used_q, used_k, 7, 9, dq, dk, dv, is_causal=True)
        dq, dk, dv = dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
    for got, w in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-4)
    if varlen:  # unused rows and keys: zero gradients
        assert not dq[0, 5:].any() and not dk[1, 4:].any() and not dv[1, 4:].any()


# ----------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attn_varlen_func"])
@pytest.mark.parametrize("name", ["q_descale", "k_descale", "v_descale"])
def test_fp8_descales_are_refused(fn, name):
    q = torch.randn(1, 4, 2, 8)
    args = (q, q, q) if fn == "flash_attn_func" else (q[0], q[0], q[0], torch.tensor([0, 4], dtype=torch.int32),
                                                      torch.tensor([0, 4], dtype=torch.int32), 4, 4)
    with pytest.raises(NotImplementedError, match=name):
        getattr(f3, fn)(*args, **{name: torch.ones(1, 2)})


@pytest.mark.parametrize("kw,err,match", [
    (dict(attention_chunk=-1), ValueError, "attention_chunk"),
    (dict(attention_chunk=2.5), TypeError, "attention_chunk"),
    (dict(num_splits=1.5), TypeError, "num_splits"),
    (dict(sm_margin=-1), ValueError, "sm_margin"),
    (dict(pack_gqa="yes"), TypeError, "pack_gqa"),
    (dict(qv=torch.randn(1, 4, 2, 5)), ValueError, "qv must have shape"),
    (dict(qv=torch.randn(1, 4, 2, 8, dtype=torch.float64)), TypeError, "qv"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
])
def test_bad_arguments(kw, err, match):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(err, match=match):
        f3.flash_attn_func(q, q, q, **kw)


def test_varlen_seqused_must_be_int32_per_sequence():
    q, cu = torch.randn(6, 2, 8), torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k"):
        f3.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, seqused_k=torch.ones(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="seqused_q"):
        f3.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, seqused_q=torch.ones(2))
    with pytest.raises(ValueError, match="max_seqlen"):  # the caller's offsets are checked before sub-sequences
        f3.flash_attn_varlen_func(q, q, q, cu, cu, 3, 4, attention_chunk=2)


# ----------------------------------------------------------------------------------------------------
# Triton's interpreter (CPU): the sub-sequences on a kernel backend, empty ones included


@pytest.mark.skipif(CUDA, reason="the CPU interpreter's case (the GPU has its own)")
def test_triton_interpreter_chunk_and_seqused():
    pytest.importorskip("triton")
    import flash_attn

    with flash_attn.use_backend("triton"):
        _varlen_case([6, 8, 4], [11, 12, 5], used_q=[5, 8, 1], used_k=[11, 3, 5], chunk=4, causal=True, seed=9)


# ----------------------------------------------------------------------------------------------------
# GPU: the same calls on the CUDA backends


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(chunk=64, causal=True), dict(chunk=100, window=(50, 10)),
                                dict(qv=True, D=64, Dv=64, causal=True), dict(chunk=128, causal=True, Hk=1)])
def test_gpu_dense(dtype, kw):
    kw = dict(dict(B=2, Sq=300, Sk=500, H=4, Hk=2, D=128), **kw)
    _dense_case("cuda", dtype, seed=7, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [dict(used_q=[3, 7, 0], used_k=[9, 4, 5], causal=True), dict(chunk=4, causal=True)])
def test_gpu_varlen(kw):
    _varlen_case([6, 8, 4], [11, 12, 5], seed=3, device="cuda", dtype=torch.float32, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [dict(varlen_q=True, varlen_new=True, paged=True, leftpad=True, chunk=4, causal=True,
                                     rotary="neox"),
                                dict(rotary="interleaved", rotary_seqlens=True, batch_idx=True, causal=True)])
def test_gpu_kvcache_extras(kw):
    _kvcache_case(seed=5, device="cuda", dtype=torch.bfloat16, **kw)


def test_fa3_operators_have_fa3s_schemas_and_run_the_api():
    """torch.ops.flash_attn_3.{fwd, bwd, fwd_combine, get_scheduler_metadata} (fa3_ops.py, registered by importing
    flash_attn_interface): FA3's schemas (each backward compatible with FA3's own), and each op gives what the Python
    API gives; bwd writes the gradients into dq / dk / dv when given; registering again is a no-op."""
    from torch._C import parse_schema

    from flash_attn import fa3_ops

    for name, schema in fa3_ops._SCHEMAS.items():
        assert getattr(torch.ops.flash_attn_3, name).default._schema.is_backward_compatible_with(
            parse_schema("flash_attn_3::" + schema))
    assert not fa3_ops.register()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 4, 64, generator=g)
    k, v = torch.randn(2, 50, 2, 64, generator=g), torch.randn(2, 50, 2, 64, generator=g)
    out, lse, out_accum, lse_accum = torch.ops.flash_attn_3.fwd(q, k, v, is_causal=True, window_size_left=7)
    want, want_lse = f3.flash_attn_func(q, k, v, causal=True, window_size=(7, -1), return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and out_accum.numel() == lse_accum.numel() == 0
    dout = torch.randn(out.shape, generator=g)
    dq = torch.full_like(q, float("nan"))
    grads = torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, dq=dq, is_causal=True, window_size_left=7)
    assert grads[0] is dq and len(grads) == 8
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    f3.flash_attn_func(qq, kk, vv, causal=True, window_size=(7, -1)).backward(dout)
    for got, ref in zip(grads[:3], (qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(got, ref)
    torch.testing.assert_close(grads[3], (dout * out).sum(-1).transpose(1, 2))  # softmax_d (B, H, Sq)
    parts, lse_parts = torch.randn(3, 2, 5, 4, 8, generator=g), torch.randn(3, 2, 5, 4, generator=g)
    for a, b in zip(torch.ops.flash_attn_3.fwd_combine(parts, lse_parts, out_dtype=torch.float16),
                    f3.flash_attn_combine(parts, lse_parts, out_dtype=torch.float16)):
        assert torch.equal(a, b)
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    meta = torch.ops.flash_attn_3.get_scheduler_metadata(2, 1, 128, 8, 2, 128, 128, torch.bfloat16, seqlens)
    assert meta.dtype == torch.int32
    with pytest.raises(ValueError, match="multiple of num_heads_kv"):
        torch.ops.flash_attn_3.get_scheduler_metadata(2, 1, 128, 6, 4, 128, 128, torch.bfloat16, seqlens)
