"""Split-KV in flash_attn.cute's dense forward (num_splits > 1): the split kernel divides each tile's key blocks among
num_splits CTAs, each writing its part's O (divided by its own row sums) and lse in fp32; the host merges them
(launch._combine_splits) and adds the sink. On the CPU: the merge against the reference (parts computed in fp32,
empty parts and rows, the sink), the rules and config, whole calls with the kernel replaced by a torch model of
its contract, and the PTX (fp32 O stores; ptxas clean). Varlen calls (flash_attn_varlen_func, with cu_seqlens_k or a
page table, and seqused_q) the same way, per sequence. On a Hopper GPU (tests marked gpu): against the reference.

The split kernel was written without a GPU (sessions 15 and 16); its GPU tests here passed in session 16 (18 cases
failed only at a check of the test, fixed since, not yet rerun);
FLASH_ATTN_CUTE_DISABLE=split runs every call unsplit (the same result)."""
import collections
import glob
import math
import os
import re
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, interface, kernels, launch, plan  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.testing import (  # noqa: E402
    assert_close_to_ref, assert_lse_close, assert_ptxas_clean, attention_lse_ref, attention_ref, fa4_window,
    paged_from_dense,
)

I32 = torch.int32



@pytest.fixture(autouse=True)
def _defaults(cute_env):
    """No FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE: the default kernels."""



def _cfg(dtype, d, causal, **kw):
    return kernels.fwd_config(dtype, d, causal, "sm_90a", **kw).key()


def _parts(q, k, v, causal, bounds, scale, window=(-1, -1), softcap=0.0):
    """The split kernel's contract in fp32 torch: for each key range [lo, hi) of bounds, the part's O (softmax over
    the part's visible keys, times V) and lse (+inf, and O 0, for a row that sees none of the part's keys).
    q (B, Sq, H, D), k / v (B, Sk, Hk, D): returns o (S, B, Sq, H, Dv), lse (S, B, H, Sq)."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(H // Hk, 2)
    vv = v.double().repeat_interleave(H // Hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq).view(-1, 1) + Sk - Sq
    j = torch.arange(Sk).view(1, -1)
    visible = torch.ones(Sq, Sk, dtype=torch.bool)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    os_, lses = [], []
    for lo, hi in bounds:
        part = visible & (j >= lo) & (j < hi)
        sp = s.masked_fill(~part, -math.inf)
        lse = torch.logsumexp(sp, -1)  # (B, H, Sq)
        p = torch.where(torch.isfinite(lse)[..., None], torch.exp(sp - lse[..., None]), torch.zeros_like(sp))
        os_.append(torch.einsum("bhqk,bkhd->bqhd", p, vv))
        lses.append(torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse))
    return torch.stack(os_), torch.stack(lses)


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (5, 3), 0.0), (True, (-1, -1), 10.0)])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("bounds", [[(0, 40)], [(0, 13), (13, 26), (26, 40)], [(0, 8), (8, 16), (16, 40), (40, 40)],
                                    [(0, 1), (1, 39), (39, 40)]])
def test_combine_matches_the_reference(causal, window, softcap, sink, bounds):
    """Parts over any partition of the keys (empty parts, parts some rows see none of) merge into the reference's
    out and lse, the sink counted once; a row that sees no key gets out 0 and lse +inf (or the sink)."""
    torch.manual_seed(0)
    q = torch.randn(2, 12, 4, 16, dtype=torch.float64)
    k = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    v = torch.randn(2, 40, 2, 16, dtype=torch.float64)
    sink_t = torch.randn(4, dtype=torch.float64) if sink else None
    o_parts, lse_parts = _parts(q, k, v, causal, bounds, 0.25, window, softcap)
    out, lse = launch._combine_splits(o_parts, lse_parts, sink_t, torch.float64)
    kw = dict(causal=causal, window_size=(window[0], 0 if causal else window[1]), softcap=softcap,
              softmax_scale=0.25, learnable_sink=sink_t)
    out_ref = attention_ref(q, k, v, **kw)[0].double()
    lse_ref = attention_lse_ref(q, k, **kw).double()
    # (the parts are float64; the reference computes in fp32: its rounding, ~3e-7 here, is the tolerance)
    empty = torch.isinf(lse_ref) if sink_t is None else torch.zeros_like(lse_ref, dtype=torch.bool)
    torch.testing.assert_close(out, torch.where(empty.permute(0, 2, 1)[..., None], torch.zeros_like(out_ref), out_ref),
                               rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(torch.where(empty, 0.0, lse), torch.where(empty, 0.0, lse_ref), rtol=2e-5, atol=2e-6)
    assert torch.equal(torch.isposinf(lse), empty)


def test_split_count_rules(cute_env, monkeypatch):
    assert [plan._split_count(n) for n in (4, 2, 1, 0, -3)] == [4, 2, 1, 1, 1]  # on by default
    assert plan._split_count(torch.tensor(3)) == 3  # integer scalars of other types
    for bad in (2.0, True, "2"):
        with pytest.raises(ValueError, match="num_splits must be an int"):
            plan._split_count(bad)
    # num_splits <= 0: chosen for the grid on q's device's SMs (none for a CPU tensor: unsplit)
    q = torch.zeros(1)
    assert plan._split_count(0, 32, 8192, q) == 1
    monkeypatch.setattr(plan, "_device_sms", lambda t: 132)
    assert [plan._split_count(n, 32, 8192, q) for n in (0, -1, 1, 3)] == [4, 4, 1, 3]
    assert plan._split_count(0, 0, 8192, q) == plan._split_count(0, 32, 8192) == 1
    # explicit counts: at most one part per 128-key block the tiles see (the others would be empty)
    assert [plan._split_count(n, 32, 300, q) for n in (2, 3, 4, 64)] == [2, 3, 3, 3]
    assert plan._split_count(64, 32, 0, q) == plan._split_count(5, 1, 100, q) == 1
    assert plan._split_count(64) == 64  # no key count given: as asked
    cute_env(DISABLE="split")  # the switch: every call unsplit
    assert plan._split_count(0, 32, 8192, q) == plan._split_count(4) == 1


@pytest.mark.parametrize("tiles,key_blocks,want", [
    (32, 64, 4),  # decoding, 32 heads, 8k keys: 128 CTAs in one wave
    (8, 64, 16),  # packed (4 query heads per KV head): 8 tiles
    (1, 1000, 112), (1, 2, 2), (4, 8, 8),  # at most one part per key block
    (105, 64, 5),  # just under 0.8 of the SMs: the fewest parts near whole waves
    (106, 64, 1), (128, 64, 1), (500, 64, 1),  # the grid fills the GPU already
    (16, 1, 1)])  # one key block: nothing to split
def test_choose_splits(tiles, key_blocks, want):
    assert plan._choose_splits(tiles, key_blocks, 132) == want



def test_choose_splits_searches_once_per_arguments():
    """The split search is remembered per (tiles, key blocks, SMs) and the rule's constants: a decoding call, which
    asks every step, finds it; other constants search again."""
    plan._search_splits.cache_clear()
    first = plan._choose_splits(8, 64, 132)
    assert plan._choose_splits(8, 64, 132) == first and plan._search_splits.cache_info().hits == 1
    assert plan._search_splits(8, 64, 132, 4, plan._SPLIT_EFFICIENCY) <= 4  # (the cap is part of the key)

def test_choose_splits_properties():
    """For every small grid: the parts never exceed the key blocks or _MAX_SPLITS, each part count is the fewest with
    its blocks per part, and the waves of the split grid reach _SPLIT_EFFICIENCY of the best such part count's (a
    count with as many blocks per part as one fewer takes as long per CTA: not a candidate)."""
    for sms in (78, 132):
        for tiles in range(1, int(0.8 * sms) + 1, 7):
            for key_blocks in (2, 3, 16, 64, 129, 1000):
                s = plan._choose_splits(tiles, key_blocks, sms)
                top = min(key_blocks, plan._MAX_SPLITS)
                assert 1 <= s <= top
                per = lambda n: -(-key_blocks // n)  # noqa: E731
                assert s == 1 or per(s) < per(s - 1)
                eff = lambda n: (tiles * n / sms) / -(-(tiles * n / sms) // 1)  # noqa: E731
                best = max(eff(n) for n in range(1, top + 1) if n == 1 or per(n) < per(n - 1))
                assert eff(s) >= plan._SPLIT_EFFICIENCY * best, (sms, tiles, key_blocks, s)
                assert all(eff(n) < plan._SPLIT_EFFICIENCY * best for n in range(1, s)
                           if n == 1 or per(n) < per(n - 1))  # the fewest


def test_split_config():
    cfg = lambda d, causal, **kw: _cfg(torch.bfloat16, d, causal, **kw)  # noqa: E731
    make = lambda d, causal, **kw: kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, **kw))  # noqa: E731
    for d, causal in [(64, False), (64, True), (128, True), (256, False)]:
        for kw in (dict(), dict(short=True), dict(long=True), dict(local=True), dict(pack=8)):
            split = cfg(d, causal, split=True, **kw)
            assert split["split"] and not split.get("persistent") and not split.get("tma_o")
            assert "split" not in cfg(d, causal, **kw)
            kernel = make(d, causal, split=True, **kw)
            assert kernel.split and not kernel.persistent
    for kw in (dict(), dict(local=True), dict(paged=16), dict(pack=4)):
        split = cfg(128, True, varlen=True, split=True, **kw)
        assert split["split"] and split["varlen"]
        assert "split" not in cfg(128, True, varlen=True, **kw)
        kernel = make(128, True, varlen=True, split=True, **kw)
        assert kernel.split and kernel.varlen and not kernel.persistent and not kernel.tma_o
    for kw in (dict(), dict(varlen=True)):
        with pytest.raises(NotImplementedError, match="split-KV: the sink"):
            cfg(128, True, split=True, sink=True, **kw)
    names = {kernels._entry(torch.bfloat16, 128, True, "sm_90a", split=s)[2] for s in (False, True)}
    assert len(names) == 2 and any("-split-" in n for n in names)


def _split_kernel_model(cfg):
    """The split kernel's contract (call_split) in torch, with the kernel's partition of the key blocks: part s of
    batch entry b takes blocks [s * per, (s + 1) * per), per = ceil(ceil(Sk / block_n) / num_splits), written to
    entry s * B + b."""
    block_n = cfg.get("block_n", 128)
    causal, local = cfg["causal"], cfg["local"]

    def run(q, k, v, out, lse, scale, softcap, wl, wr, num_splits):
        B, Sk = q.shape[0], k.shape[1]
        per = -(-(-(-Sk // block_n)) // num_splits)
        bounds = [(min(s * per * block_n, Sk), min((s + 1) * per * block_n, Sk)) for s in range(num_splits)]
        window = ((-1 if wl >= plan._UNBOUNDED else wl), (-1 if wr >= plan._UNBOUNDED else wr)) if local \
            else (-1, -1)
        o, l_ = _parts(q, k, v, causal, bounds, scale, window, softcap)
        out.copy_(o.flatten(0, 1))
        lse.copy_(l_.flatten(0, 1))
    return run


@pytest.mark.parametrize("causal,window,softcap,sink", [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, True),
                                                        (False, (20, 4), 5.0, False)])
@pytest.mark.parametrize("num_splits", [2, 3, 9])
def test_split_calls(cute_env, monkeypatch, causal, window, softcap, sink, num_splits):
    """flash_attn_func(num_splits=n) runs the split kernel (its model here) and merges the parts into the
    reference's out and lse; unsplit with FLASH_ATTN_CUTE_DISABLE=split (the usual kernel)."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    local = window != (-1, -1)
    key = (torch.float16, 64, causal and not local, "sm_90a", local, softcap > 0, "split")
    cfg = _cfg(torch.float16, 64, causal and not local, local=local, softcap=softcap > 0, split=True)
    usual = []
    short, long = plan._length_kernel(64, causal and not local, 300, not (local or softcap or sink))
    plain = ((torch.float16, 64, causal and not local, "sm_90a", local, softcap > 0) + (("sink",) if sink else ())
             + (("short",) if short else ()) + (("long",) if long else ()))
    _swap_kernels(monkeypatch, {key: _split_kernel_model(cfg), plain: lambda *a: usual.append(1)})
    torch.manual_seed(0)
    q = torch.randn(2, 5, 4, 64, dtype=torch.float16)
    k = torch.randn(2, 300, 2, 64, dtype=torch.float16)
    v = torch.randn(2, 300, 2, 64, dtype=torch.float16)
    sink_t = torch.randn(4) if sink else None
    kw = dict(causal=causal, window_size=fa4_window(window), softcap=softcap, learnable_sink=sink_t)
    # (pack_gqa=None would pack these under plan.pack_gqa_auto=1)
    cute_env(DISABLE="pack_gqa,split")
    interface.flash_attn_func(q, k, v, num_splits=num_splits, **kw)
    assert usual == [1]
    cute_env(DISABLE="pack_gqa")
    monkeypatch.setattr(launch, "_split_parts_cache", {})
    out, lse = interface.flash_attn_func(q, k, v, num_splits=num_splits, return_lse=True, **kw)
    assert usual == [1] and out.dtype == torch.float16 and out.shape == q.shape
    if launch._combine.use_kernel(torch.zeros(2, 1, 1, 1, 8), torch.zeros(2, 1, 1, 1), q.dtype, q.device):
        (parts,) = launch._split_parts_cache.values()  # the parts (and combine) kept for the next call
        assert parts[0].shape[1:] == (5, 4, 64) and parts[0].shape[0] % 2 == 0  # (parts x batch 2, Sq, H, D)
    ref_kw = dict(causal=causal, window_size=(window[0], 0 if causal else window[1]), softcap=softcap,
                  learnable_sink=sink_t)
    out_ref, _ = attention_ref(q, k, v, **ref_kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **ref_kw)
    assert_close_to_ref(out, out_ref, out_pt)
    torch.testing.assert_close(lse, attention_lse_ref(q, k, **ref_kw), rtol=1e-5, atol=1e-5)


def _varlen_split_kernel_model(cfg):
    """The varlen split kernel's contract (call_varlen_split) in torch: sequence b is rows cu_q[b]:cu_q[b + 1] of q
    against its first used_k[b] keys (from cu_k[b], or its pages when the page table comes in cu_k's place); part s
    takes its key blocks [s * per, (s + 1) * per), per = ceil(ceil(used_k[b] / block_n) / num_splits), and writes
    entry s of out / lse. Rows after the last sequence are left as they were (NaN here: the kernel never writes
    them)."""
    block_n = cfg.get("block_n", 128)
    causal, local = cfg["causal"], cfg["local"]

    def run(q, k, v, out, lse, cu_q, keys, used_k, max_seqlen_q, scale, softcap, wl, wr, num_splits):
        out.fill_(math.nan)
        lse.fill_(math.nan)
        window = ((-1 if wl >= plan._UNBOUNDED else wl), (-1 if wr >= plan._UNBOUNDED else wr)) if local \
            else (-1, -1)
        for b in range(cu_q.shape[0] - 1):
            q0, q1, n = int(cu_q[b]), int(cu_q[b + 1]), int(used_k[b])
            if keys.dim() == 2:  # the page table
                pages = keys[b, :-(-n // k.shape[1])].long()
                ks, vs = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
            else:
                ks, vs = k[int(keys[b]):int(keys[b]) + n], v[int(keys[b]):int(keys[b]) + n]
            per = -(-(-(-n // block_n)) // num_splits)
            bounds = [(min(s * per * block_n, n), min((s + 1) * per * block_n, n)) for s in range(num_splits)]
            o, l_ = _parts(q[None, q0:q1], ks[None], vs[None], causal, bounds, scale, window, softcap)
            out[:, q0:q1] = o[:, 0].to(out.dtype)
            lse[:, :, q0:q1] = l_[:, 0]
    return run


@pytest.mark.parametrize("causal,window,softcap,sink", [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, True),
                                                        (False, (20, 4), 5.0, False)])
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("with_used_q", [False, True])
def test_varlen_split_calls_per_sequence(cute_env, monkeypatch, causal, window, softcap, sink, num_splits, paged, with_used_q):
    """flash_attn_varlen_func(num_splits=n) runs the varlen split kernel (its model here: one part of each
    sequence's keys per entry) and merges the parts into the reference's out and lse per sequence (empty sequences,
    sequences without keys, unused query rows, rows after the last sequence); unsplit with FLASH_ATTN_CUTE_DISABLE=split."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    local = window != (-1, -1)
    page_size = 16 if paged else 0
    flags = (torch.float16, 64, causal and not local, "sm_90a", local, softcap > 0, True)
    key = flags + (("paged", page_size) if paged else ()) + ("split",)
    cfg = _cfg(torch.float16, 64, causal and not local, local=local, softcap=softcap > 0, varlen=True,
               paged=page_size, split=True)
    usual = []
    plain = flags + (("sink",) if sink else ()) + (("paged", page_size) if paged else ())
    _swap_kernels(monkeypatch, {key: _varlen_split_kernel_model(cfg), plain: lambda *a: usual.append(1)})
    torch.manual_seed(0)
    lens_q, lens_k = [5, 0, 9, 3, 4, 1], [300, 3, 9, 0, 160, 129]
    used_q = [2, 0, 9, 3, 0, 1] if with_used_q else lens_q
    H, Hk, D = 4, 2, 64
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(I32)
    q = torch.randn(int(cu_q[-1]) + 2, H, D, dtype=torch.float16)  # two rows after the last sequence
    kd = torch.randn(len(lens_k), max(lens_k), Hk, D, dtype=torch.float16)
    vd = torch.randn(len(lens_k), max(lens_k), Hk, D, dtype=torch.float16)
    if paged:
        num_pages = len(lens_k) * -(-max(lens_k) // page_size) + 3
        k, table = paged_from_dense(kd, page_size, num_blocks=num_pages, generator=torch.Generator().manual_seed(1))
        v, _ = paged_from_dense(vd, page_size, block_table=table, num_blocks=num_pages)
        keys = dict(cu_seqlens_k=None, page_table=table, seqused_k=torch.tensor(lens_k, dtype=I32))
    else:
        k = torch.cat([kd[b, :n] for b, n in enumerate(lens_k)])
        v = torch.cat([vd[b, :n] for b, n in enumerate(lens_k)])
        keys = dict(cu_seqlens_k=torch.tensor([0] + lens_k).cumsum(0).to(I32))
    sink_t = torch.randn(H) if sink else None
    kw = dict(causal=causal, window_size=fa4_window(window), softcap=softcap, learnable_sink=sink_t, return_lse=True,
              seqused_q=torch.tensor(used_q, dtype=I32) if with_used_q else None, **keys)
    cute_env(DISABLE="pack_gqa,split")  # (None would pack these under plan.pack_gqa_auto=1)
    interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, num_splits=num_splits, **kw)
    assert usual == [1]
    cute_env(DISABLE="pack_gqa")
    out, lse = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, num_splits=num_splits, **kw)
    assert usual == [1] and out.dtype == torch.float16 and out.shape == q.shape and lse.shape == (H, q.shape[0])
    ref_kw = dict(causal=causal, window_size=(window[0], 0 if causal else window[1]), softcap=softcap,
                  learnable_sink=sink_t)
    _check_per_sequence(out, lse, q, kd, vd, cu_q, lens_q, used_q, lens_k, ref_kw,
                        lambda a, b, name: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5))
    for b in range(len(lens_q)):  # rows that see no key: lse +inf or the sink
        q0, uq, uk = int(cu_q[b]), used_q[b], lens_k[b]
        empty = slice(q0 + (uq if uk else 0), q0 + lens_q[b])
        want = math.inf if sink_t is None else sink_t.view(H, 1).expand(H, empty.stop - empty.start)
        torch.testing.assert_close(lse[:, empty], torch.as_tensor(want).expand(H, empty.stop - empty.start))


def _check_per_sequence(out, lse, q, kd, vd, cu_q, lens_q, used_q, lens_k, ref_kw, lse_check):
    """A varlen call's out / lse against the reference per sequence b: its first used_q[b] rows against kd / vd's
    first lens_k[b] keys (out by the criterion, lse by lse_check(lse, ref, name)); its other rows, and those after
    the last sequence, out 0 (the latter lse +inf)."""
    for b in range(len(lens_q)):
        q0, uq, uk = int(cu_q[b]), used_q[b], lens_k[b]
        if uq and uk:
            qs, ks, vs = q[None, q0:q0 + uq], kd[b:b + 1, :uk], vd[b:b + 1, :uk]
            o_ref, _ = attention_ref(qs, ks, vs, **ref_kw)
            o_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True, **ref_kw)
            assert_close_to_ref(out[None, q0:q0 + uq], o_ref, o_pt, name=f"sequence {b}")
            lse_check(lse[:, q0:q0 + uq], attention_lse_ref(qs, ks, **ref_kw)[0], f"lse of sequence {b}")
        empty = slice(q0 + (uq if uk else 0), q0 + lens_q[b])
        assert torch.all(out[empty] == 0), b
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isposinf(lse[:, tail:]))


def test_forward_varlen_split_fills_unused_rows(monkeypatch):
    """forward_varlen (the dispatcher's entry) with splits and fill_unused_rows: rows after the last sequence get out 0
    and lse +inf (the parts leave them unwritten), with no host sync; the next call of these sizes reuses the parts
    (launch._split_parts) and gets its own result."""
    cfg = _cfg(torch.float16, 64, False, varlen=True, split=True)
    key = (torch.float16, 64, False, "sm_90a", False, False, True, "split")
    _swap_kernels(monkeypatch, {key: _varlen_split_kernel_model(cfg)})
    monkeypatch.setattr(launch, "_split_parts_cache", {})
    kernel = launch._combine.use_kernel(torch.zeros(2, 1, 1, 1, 8), torch.zeros(2, 1, 1, 1), torch.float16,
                                        torch.device("cpu"))  # (Triton's interpreter: the parts path)
    buffers = set()
    for seed in (0, 1):
        torch.manual_seed(seed)
        q = torch.randn(10, 2, 64, dtype=torch.float16)
        k = torch.randn(200, 2, 64, dtype=torch.float16)
        v = torch.randn(200, 2, 64, dtype=torch.float16)
        cu_q, cu_k = torch.tensor([0, 3, 7], dtype=I32), torch.tensor([0, 150, 200], dtype=I32)
        out, lse = launch.forward_varlen(q, k, v, cu_q, cu_k, None, 4, 0.125, False, fill_unused_rows=True, splits=3)
        assert torch.all(out[7:] == 0) and torch.all(torch.isposinf(lse[:, 7:]))
        for b in range(2):
            qs = q[None, int(cu_q[b]):int(cu_q[b + 1])]
            ks, vs = k[None, int(cu_k[b]):int(cu_k[b + 1])], v[None, int(cu_k[b]):int(cu_k[b + 1])]
            o_ref, _ = attention_ref(qs, ks, vs, softmax_scale=0.125)
            o_pt, _ = attention_ref(qs, ks, vs, softmax_scale=0.125, upcast=False, reorder_ops=True)
            assert_close_to_ref(out[None, int(cu_q[b]):int(cu_q[b + 1])], o_ref, o_pt)
        if kernel:
            (parts,) = launch._split_parts_cache.values()
            buffers.add(parts[0].data_ptr())
    assert len(buffers) == (1 if kernel else 0)


def test_num_splits_zero_chooses_per_call(monkeypatch):
    """num_splits=0 (FA4's "choose"): a small grid (decoding) runs split into _choose_splits's parts for its tiles and
    key blocks, dense and varlen (the longest sequence's keys, read in the call's one sync), with the reference's
    result; a grid that fills the GPU runs unsplit."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    monkeypatch.setattr(plan, "_device_sms", lambda t: 132)
    parts, usual = [], []

    def spy(model):
        def run(*a):
            parts.append(a[-1])
            model(*a)
        return run

    dense = _cfg(torch.float16, 64, False, split=True)
    varlen = _cfg(torch.float16, 64, False, varlen=True, split=True)
    flags = (torch.float16, 64, False, "sm_90a", False, False)
    table = {flags + ("split",): spy(_split_kernel_model(dense)),
             flags + (True, "split"): spy(_varlen_split_kernel_model(varlen))}
    for tail in [(), ("short",), ("long",)]:
        table[flags + tail] = lambda *a: usual.append(1)
    _swap_kernels(monkeypatch, table)
    torch.manual_seed(0)
    H, D = 32, 64
    q = torch.randn(1, 1, H, D, dtype=torch.float16)
    k = torch.randn(1, 8192, H, D, dtype=torch.float16)
    v = torch.randn(1, 8192, H, D, dtype=torch.float16)
    out, _ = interface.flash_attn_func(q, k, v, num_splits=0)
    assert parts == [plan._choose_splits(H, 64, 132)] == [4] and not usual
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)
    interface.flash_attn_func(torch.randn(1, 1024, H, D, dtype=torch.float16), k, v, num_splits=0)
    assert len(parts) == 1 and usual == [1]  # 8 x 32 tiles fill the SMs: unsplit
    lens_k = [3000, 5000]
    cu_q = torch.tensor([0, 1, 2], dtype=I32)
    cu_k = torch.tensor([0] + lens_k, dtype=I32).cumsum(0).to(I32)
    kv = k[0, :8000, :8], v[0, :8000, :8]
    out, _ = interface.flash_attn_varlen_func(q[0].repeat(2, 1, 1)[:, :8], *kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                              num_splits=0)
    assert parts[1:] == [plan._choose_splits(2 * 8, 40, 132)] and parts[1] > 1 and usual == [1]
    for b in range(2):
        qs = q[:, :, :8]
        ks, vs = (t[None, int(cu_k[b]):int(cu_k[b + 1])] for t in kv)
        o_ref, _ = attention_ref(qs, ks, vs)
        o_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True)
        assert_close_to_ref(out[None, b:b + 1], o_ref, o_pt)


@pytest.mark.parametrize("kw", [dict(), dict(varlen=True), dict(varlen=True, paged=16)],
                         ids=["dense", "varlen", "paged"])
def test_split_kernel_stores_fp32_parts(tmp_path, kw):
    """The split kernel stores O in fp32 (pairs: st.global.v2.b32, Dv / 8 per row, two rows per thread) and the lse;
    ptxas clean. The usual kernel stores bf16 pairs (st.global.b32)."""
    kernels.compile_fwd(torch.bfloat16, 128, True, dump_dir=str(tmp_path), split=True, **kw)
    (ptx,) = glob.glob(str(tmp_path / "*.ptx"))
    stores = collections.Counter(re.findall(r"st\.global[\.\w]*", open(ptx).read()))
    assert stores == {"st.global.v2.b32": 2 * 128 // 8, "st.global.b32": 2}
    assert_ptxas_clean(ptx)


# ----------------------------------------------------------------------------------------------------
# GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# (d, dv, causal, window, softcap, sink, pack) x num_splits x shapes: gpu_kernel_requests() reads them too
_GPU_OPTIONS = [(64, 64, False, (-1, -1), 0.0, False, False), (128, 128, True, (-1, -1), 0.0, False, False),
                (128, 128, False, (-1, -1), 0.0, True, True), (256, 256, True, (-1, -1), 0.0, False, False),
                (128, 128, False, (64, 0), 20.0, False, False), (192, 128, True, (-1, -1), 0.0, False, False)]
_GPU_SHAPES = [(2, 1, 8192, 16, 2), (1, 300, 1000, 8, 8), (3, 77, 77, 4, 1)]  # (B, Sq, Sk, H, Hk)


_GPU_SPLITS = [2, 3, 64]


def _dense_parts(num_splits, seqlen_k, window, rows):
    """The parts a dense GPU test call runs (num_splits capped at the 128-key blocks a tile sees)."""
    visible = seqlen_k if window == (-1, -1) else min(seqlen_k, window[0] + rows + window[1])
    return min(num_splits, -(-visible // 128))


def gpu_kernel_requests():
    """The forward calls' kernel choices of this file's GPU test, for benchmarks/tools/precompile_gpu_tests.py."""
    out = []
    for d, dv, c, w, cap, sink, pack in _GPU_OPTIONS:
        for _, _, sk, h, hk in _GPU_SHAPES:
            g = h // hk if pack and h // hk in config.PACK_GROUPS else 1
            for n in _GPU_SPLITS:
                out.append(dict(dtype=torch.bfloat16, d=d, dv=dv, causal=c, window=w, softcap=cap, sink=sink,
                                split=_dense_parts(n, sk, w, 128 // g) > 1, pack=g, seqlen_k=sk))
    return out + _gpu_varlen_requests()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,dv,causal,window,softcap,sink,pack", _GPU_OPTIONS)
@pytest.mark.parametrize("num_splits", _GPU_SPLITS)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", _GPU_SHAPES)
def test_split_matches_reference_on_gpu(monkeypatch, d, dv, causal, window, softcap, sink, pack, num_splits, batch,
                                        seqlen_q, seqlen_k, heads, heads_kv):
    from flash_attn.cute import flash_attn_func

    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, heads_kv, dv, device="cuda", dtype=torch.bfloat16)
    sink_t = torch.randn(heads, device="cuda") if sink else None
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=fa4_window(window), softcap=softcap, learnable_sink=sink_t,
                               num_splits=num_splits, pack_gqa=pack, return_lse=True)
    torch.cuda.synchronize()
    rows = 128 // (heads // heads_kv if pack and heads // heads_kv in config.PACK_GROUPS else 1)
    # (more parts than key blocks are not launched: the varlen test's short sequences have empty parts)
    assert any(key[-1] == "split" for key in kernels._kernels) == (_dense_parts(num_splits, seqlen_k, window,
                                                                                  rows) > 1)
    ref_kw = dict(causal=causal, window_size=(window[0], 0 if causal else window[1]), softcap=softcap,
                  learnable_sink=sink_t)
    out_ref, _ = attention_ref(q, k, v, **ref_kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **ref_kw)
    assert_close_to_ref(out, out_ref, out_pt)
    lse_ref = attention_lse_ref(q, k, **ref_kw)
    assert_lse_close(lse, lse_ref)


# Varlen (d, dv, causal, window, sink, pack, page size or 0 for cu_seqlens_k), num_splits in (3, 16): every head dim
# once, the sink, pack_gqa, a window, pages of 16 / 64 / 256 rows. gpu_kernel_requests() reads them too.
_GPU_VARLEN = [(64, 64, False, (-1, -1), False, False, 0), (128, 128, True, (-1, -1), True, True, 0),
               (128, 128, True, (-1, -1), False, False, 16), (128, 128, False, (64, 0), False, True, 256),
               (256, 256, True, (-1, -1), False, False, 0), (192, 128, False, (-1, -1), False, False, 64)]


def _gpu_varlen_requests():
    return [dict(dtype=torch.bfloat16, d=d, dv=dv, causal=c, window=w, sink=sink, split=True, varlen=True,
                 pack=4 if pack else 1, paged=page) for d, dv, c, w, sink, pack, page in _GPU_VARLEN]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,dv,causal,window,sink,pack,page_size", _GPU_VARLEN)
@pytest.mark.parametrize("num_splits", [3, 16])
def test_varlen_split_matches_reference_per_sequence_on_gpu(monkeypatch, d, dv, causal, window, sink, pack, page_size,
                                                            num_splits):
    from flash_attn.cute import flash_attn_varlen_func

    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    torch.manual_seed(0)
    heads, heads_kv = 8, 2
    lens_q, lens_k = [1, 0, 77, 1, 300, 5], [500, 9, 77, 0, 300, 8000]
    used_q = [1, 0, 70, 1, 300, 2]  # seqused_q: some rows of a sequence unused
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(I32)
    q = torch.randn(int(cu_q[-1]) + 3, heads, d, device="cuda", dtype=torch.bfloat16)
    kd = torch.randn(len(lens_k), max(lens_k), heads_kv, d, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn(len(lens_k), max(lens_k), heads_kv, dv, device="cuda", dtype=torch.bfloat16)
    if page_size:
        num_pages = len(lens_k) * -(-max(lens_k) // page_size) + 3
        k, table = paged_from_dense(kd, page_size, num_blocks=num_pages, generator=torch.Generator().manual_seed(1))
        v, _ = paged_from_dense(vd, page_size, block_table=table, num_blocks=num_pages)
        keys = dict(page_table=table, seqused_k=torch.tensor(lens_k, dtype=I32, device="cuda"))
    else:
        k = torch.cat([kd[b, :n] for b, n in enumerate(lens_k)])
        v = torch.cat([vd[b, :n] for b, n in enumerate(lens_k)])
        keys = dict(cu_seqlens_k=torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(I32))
    sink_t = torch.randn(heads, device="cuda") if sink else None
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, causal=causal, window_size=fa4_window(window), learnable_sink=sink_t,
                                      seqused_q=torch.tensor(used_q, dtype=I32, device="cuda"), num_splits=num_splits,
                                      pack_gqa=pack, return_lse=True, **keys)
    torch.cuda.synchronize()
    # a window of 64 keys: a tile of packed rows sees at most 64 + 32 keys, one 128-key block, so the plan runs the call
    # unsplit (plan._split_count: more parts would be empty)
    split_ran = any(key[-1] == "split" and True in key for key in kernels._kernels)
    assert split_ran == (window == (-1, -1)), (window, split_ran)
    ref_kw = dict(causal=causal, window_size=(window[0], 0 if causal else window[1]), learnable_sink=sink_t)
    _check_per_sequence(out, lse, q, kd, vd, cu_q, lens_q, used_q, lens_k, ref_kw,
                        lambda a, b, name: assert_lse_close(a, b, name=name))


def test_dispatcher_splits_and_packs_decoding_calls(monkeypatch, cute_env):
    """The root dispatcher's cute forward (backend.fwd) gives a decoding call (a query row or a few per head, lse
    dropped) a GQA group packed where that fills the tiles and flash_attn.cute's num_splits=0 choice of parts (1 when
    the grid fills the GPU); a call with more query rows than decoding has, or whose lse is kept (a gradient follows,
    or the caller returns it), goes unsplit and unpacked without consulting the rules."""
    from flash_attn.call import describe
    from flash_attn.cute import backend

    cute_env()
    monkeypatch.setattr(plan, "_device_sms", lambda t: 132)
    seen = []
    monkeypatch.setattr(launch, "forward", lambda q, k, v, *a, pack=1, splits=1, **kw: seen.append((pack, splits))
                        or (torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))

    def run(B, Sq, Sk, H, Hk, causal=False, lse_scratch=True):
        q = torch.zeros(B, Sq, H, 128, dtype=torch.bfloat16)
        k = torch.zeros(B, Sk, Hk, 128, dtype=torch.bfloat16)
        call = describe(q, k, causal=causal)
        backend.fwd(call, q, k, k, None, None, Sq, Sk, None, None, None, lse_scratch=lse_scratch)
        return seen[-1]

    pack, splits = run(1, 1, 8192, 32, 8)
    assert pack == 4 and splits > 1 and splits == plan._choose_splits(8, 64, 132)
    assert run(1, 1, 8192, 32, 8, causal=True) == (pack, splits)
    assert run(1, 1, 8192, 32, 32)[0] == 1 and run(1, 1, 8192, 32, 32)[1] > 1  # MHA: split, nothing to pack
    cute_env(DISABLE="split,pack_gqa")
    assert run(1, 1, 8192, 32, 8) == (1, 1)  # FLASH_ATTN_CUTE_DISABLE=split,pack_gqa: the same result, unsplit
    cute_env(DISABLE=None)
    consulted = []
    real = backend._decode_plan
    monkeypatch.setattr(backend, "_decode_plan", lambda *a: consulted.append(a) or real(*a))
    assert run(8, 2048, 2048, 16, 16) == (1, 1) and not consulted  # 2048 query rows: no decoding call
    assert run(1, 100, 8192, 32, 8) == (1, 1) and not consulted  # 100 query rows: no decoding call
    # a batch whose packed grid fills the GPU: packed (each K / V tile serves the group), unsplit
    assert run(64, 1, 4096, 32, 8) == (4, 1) and len(consulted) == 1
    assert run(64, 1, 4096, 32, 32) == (1, 1)  # MHA with 2048 tiles: nothing to pack or split
    consulted.clear()
    assert run(1, 1, 8192, 32, 8, lse_scratch=False) == (1, 1) and not consulted  # the lse is kept
    assert run(1, 1, 8192, 32, 8) == (pack, splits) and len(consulted) == 1
    assert run(1, 1, 8192, 32, 8) == (pack, splits) and len(consulted) == 1  # remembered per kind of call
    # varlen (a padded batch decoding: one query row per sequence), the same rules on the longest sequences
    monkeypatch.setattr(launch, "forward_varlen", lambda q, *a, pack=1, splits=1, **kw: seen.append((pack, splits))
                        or (torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])))

    def run_varlen(batch, Sk, H, Hk, lse_scratch=True):
        q = torch.zeros(batch, H, 128, dtype=torch.bfloat16)
        k = torch.zeros(batch * Sk, Hk, 128, dtype=torch.bfloat16)
        cu_q = torch.arange(batch + 1, dtype=torch.int32)
        cu_k = torch.arange(0, (batch + 1) * Sk, Sk, dtype=torch.int32)
        backend.fwd(describe(q, k, varlen=True), q, k, k, cu_q, cu_k, 1, Sk, None, None, None,
                    lse_scratch=lse_scratch)
        return seen[-1]

    assert run_varlen(1, 8192, 32, 8) == (pack, splits)
    assert run_varlen(1, 8192, 32, 8, lse_scratch=False) == (1, 1)
    assert run_varlen(64, 2048, 32, 8) == (4, 1)  # 64 x 8 packed tiles fill the GPU: packed, unsplit


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen_k,heads,heads_kv", [(1, 8192, 32, 8), (3, 2000, 16, 16), (2, 300, 8, 1)])
def test_root_api_decoding_calls_split_on_gpu(monkeypatch, causal, batch, seqlen_k, heads, heads_kv):
    """The root flash_attn_func / flash_attn_varlen_func on decoding shapes (one query row per sequence, no gradient)
    through the cute backend's decode plan (split-KV, GQA packed): the reference's output; and with a gradient (the
    lse kept: unsplit) the same output within rounding."""
    import flash_attn
    from flash_attn.dispatch import use_backend

    torch.manual_seed(0)
    q = torch.randn(batch, 1, heads, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with use_backend("cute"):
        out = flash_attn.flash_attn_func(q, k, v, causal=causal)
        cu_q = torch.arange(batch + 1, dtype=I32, device="cuda")
        cu_k = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=I32, device="cuda")
        out_var = flash_attn.flash_attn_varlen_func(q.view(batch, heads, 128), k.view(-1, heads_kv, 128),
                                                    v.view(-1, heads_kv, 128), cu_q, cu_k, 1, seqlen_k, causal=causal)
        qg = q.clone().requires_grad_()
        out_grad = flash_attn.flash_attn_func(qg, k, v, causal=causal)
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)
    assert_close_to_ref(out_var.view_as(out), out_ref, out_pt)
    assert_close_to_ref(out_grad.detach(), out_ref, out_pt)


def _plain_kernel_model(causal):
    """An unsplit kernel's contract (the packed decoding kernel's too) in torch: out and lse of every row."""
    def run(q, k, v, out, lse, scale, softcap, wl, wr):
        o, l_ = _parts(q, k, v, causal, [(0, k.shape[1])], scale)
        out.copy_(o[0])
        lse.copy_(l_[0])
    return run


@pytest.mark.parametrize("causal", [False, True])
def test_dispatcher_decoding_reuses_its_parts(monkeypatch, cute_env, causal):
    """backend.fwd's decoding calls (lse dropped) on launch._forward_decode: split-KV parts and the bound combine
    launch made once per kind of call and stream, reused by the next calls (whose output is their own, the
    reference's); a packed unsplit plan writes out directly; a kernel not in memory yet or a graph being captured
    takes forward()'s general path, which allocates per call."""
    from flash_attn.call import describe
    from flash_attn.cute import backend, combine

    if not combine.use_kernel(torch.zeros(2, 1, 1, 1, 8), torch.zeros(2, 1, 1, 1), torch.float16, torch.device("cpu")):
        pytest.skip("the combine kernel needs Triton's interpreter on the CPU (TRITON_INTERPRET=1)")
    cute_env()
    monkeypatch.setattr(plan, "_device_sms", lambda t: 132)
    monkeypatch.setattr(launch, "_decode_entries", {})
    backend._decode_plans.clear()
    split_key = (torch.float16, 64, causal, "sm_90a", False, False, "pack", 4, "split")
    packed_key = (torch.float16, 64, causal, "sm_90a", False, False, "pack", 4)
    split_cfg = _cfg(torch.float16, 64, causal, pack=4, split=True)
    general = []
    real_forward = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *a, **kw: general.append(kw) or real_forward(*a, **kw))

    def run(B, Sk, seed):
        torch.manual_seed(seed)
        q = torch.randn(B, 1, 8, 64, dtype=torch.float16)
        k, v = (torch.randn(B, Sk, 2, 64, dtype=torch.float16) for _ in range(2))
        out, lse, _ = backend.fwd(describe(q, k, causal=causal), q, k, v, None, None, 1, Sk, None, None, None,
                                  lse_scratch=True)
        out_ref, _ = attention_ref(q, k, v, causal=causal)
        out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
        assert_close_to_ref(out, out_ref, out_pt)
        return out, lse

    _swap_kernels(monkeypatch, {})  # nothing in memory: the general path (which compiles; here its model)
    monkeypatch.setattr(launch, "fwd_kernel", lambda *a, **kw: _split_kernel_model(split_cfg))
    run(1, 1000, 0)
    assert len(general) == 1 and general[0]["splits"] > 1 and general[0]["pack"] == 4 and not launch._decode_entries
    _swap_kernels(monkeypatch, {split_key: _split_kernel_model(split_cfg), packed_key: _plain_kernel_model(causal)})
    general.clear()
    run(1, 1000, 1)
    (key, entry), = launch._decode_entries.items()
    parts = entry[1][0].data_ptr()
    run(1, 1000, 2)  # the same parts, new values
    assert not general and len(launch._decode_entries) == 1 and entry[1][0].data_ptr() == parts
    monkeypatch.setattr(launch, "_capturing", lambda index: True)
    run(1, 1000, 3)
    assert len(general) == 1 and len(launch._decode_entries) == 1
    monkeypatch.setattr(launch, "_capturing", lambda index: False)
    general.clear()
    _swap_kernels(monkeypatch, {packed_key: _plain_kernel_model(causal)})  # the table cleared (settings changed)
    run(1, 1000, 5)
    assert len(general) == 1 and general[0]["splits"] > 1  # not the entry's former kernel: the general path
    _swap_kernels(monkeypatch, {split_key: _split_kernel_model(split_cfg), packed_key: _plain_kernel_model(causal)})
    general.clear()
    # a batch whose packed grid fills the GPU: packed, unsplit, straight into out
    _, lse = run(160, 200, 4)
    assert backend._decode_plans[(torch.device("cpu"), 160, 1, 8, 200, 2, plan._UNBOUNDED,
                                  0 if causal else plan._UNBOUNDED)] == (4, 1)
    assert not general and len(launch._decode_entries) == 2 and lse.shape == (160, 8, 1)
