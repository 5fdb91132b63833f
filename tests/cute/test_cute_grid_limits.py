"""flash_attn.cute's launches keep a grid's z extent (batch entries or sequences, times split-KV parts) within CUDA's
65535 (launch._MAX_GRID_Z): dense calls launch on batch slices, varlen calls on chunks of sequences (slices of
cu_seqlens, seqused_k and the page table: the kernels read absolute row offsets), split-KV calls take fewer parts.
On the CPU: whole calls with the limit lowered and the kernels replaced by torch models of their contracts, against
the reference."""
import math
import os
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import interface, kernels, launch  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.testing import (assert_close_to_ref, attention_lse_ref, attention_ref,  # noqa: E402
                                paged_from_dense)
from test_cute_split import _split_kernel_model, _varlen_split_kernel_model  # noqa: E402

I32 = torch.int32
F16 = torch.float16


@pytest.fixture(autouse=True)
def _setup(cute_env, monkeypatch, request):
    # (cute_env: no FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE)
    if request.node.get_closest_marker("gpu") is None:  # CPU tests: the limit lowered, the kernels modelled
        monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
        # (flash_attn_func's fast path reads interface's copy; the launches launch's)
        monkeypatch.setattr(interface, "_MAX_GRID_Z", 4)
        monkeypatch.setattr(launch, "_MAX_GRID_Z", 4)



def _dense_model(launches):
    """The dense kernel's contract (non-causal, no options): out / lse of its batch entries; records each launch's
    batch."""
    def run(q, k, v, out, lse, scale, softcap, wl, wr):
        launches.append(q.shape[0])
        o, _ = attention_ref(q, k, v, softmax_scale=scale)
        out.copy_(o.to(out.dtype))
        lse.copy_(attention_lse_ref(q, k, softmax_scale=scale))
    return run


def _varlen_model(launches):
    """The varlen kernel's contract (non-causal, no options; cu_seqlens_k or a page table): each sequence's rows
    against its first used_k[b] keys; records each launch's sequence count."""
    def run(q, k, v, out, lse, cu_q, keys, used_k, max_seqlen_q, scale, softcap, wl, wr):
        launches.append(used_k.shape[0])
        for b in range(used_k.shape[0]):
            q0, q1, n = int(cu_q[b]), int(cu_q[b + 1]), int(used_k[b])
            if keys.dim() == 2:
                pages = keys[b, :-(-n // k.shape[1])].long()
                ks, vs = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
            else:
                ks, vs = k[int(keys[b]):int(keys[b]) + n], v[int(keys[b]):int(keys[b]) + n]
            if q1 == q0:
                continue
            if n == 0:
                out[q0:q1] = 0
                lse[:, q0:q1] = math.inf
                continue
            o, _ = attention_ref(q[None, q0:q1], ks[None], vs[None], softmax_scale=scale)
            out[q0:q1] = o[0].to(out.dtype)
            lse[:, q0:q1] = attention_lse_ref(q[None, q0:q1], ks[None], softmax_scale=scale)[0]
    return run


def _check_dense(q, k, v, out, lse):
    o_ref, _ = attention_ref(q, k, v)
    o_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, o_ref, o_pt)
    torch.testing.assert_close(lse, attention_lse_ref(q, k), rtol=1e-5, atol=1e-5)


def test_dense_calls_launch_on_batch_slices(monkeypatch):
    launches = []
    flags = (F16, 64, False, "sm_90a", False, False)
    model = _dense_model(launches)
    _swap_kernels(monkeypatch, {flags: model, flags + ("short",): model})
    torch.manual_seed(0)
    q, k, v = (torch.randn(10, 5, 2, 64, dtype=F16) for _ in range(3))
    out, lse = interface.flash_attn_func(q, k, v, return_lse=True)  # the fast path: it must not launch 10 at once
    assert launches == [4, 4, 2]
    _check_dense(q, k, v, out, lse)
    launches.clear()
    out, lse = launch.forward(q, k, v, 64 ** -0.5, False)
    assert launches == [4, 4, 2]
    _check_dense(q, k, v, out, lse)
    launches.clear()
    interface.flash_attn_func(q[:4], k[:4], v[:4])
    assert launches == [4]


def test_split_calls_take_fewer_parts(monkeypatch):
    """Split-KV: parts x batch entries per launch within the limit (4 here): 2 entries take 2 parts, not 3; 4 entries
    run unsplit."""
    parts, launches = [], []
    split_model = _split_kernel_model(kernels.fwd_config(F16, 64, False, "sm_90a", split=True).key())

    def split(*a):
        parts.append(a[-1])
        split_model(*a)

    flags = (F16, 64, False, "sm_90a", False, False)
    _swap_kernels(monkeypatch, {flags + ("split",): split, flags: _dense_model(launches)})
    torch.manual_seed(0)
    q = torch.randn(2, 3, 2, 64, dtype=F16)
    k, v = (torch.randn(2, 600, 2, 64, dtype=F16) for _ in range(2))
    out, lse = interface.flash_attn_func(q, k, v, num_splits=3, return_lse=True)
    assert parts == [2] and not launches
    _check_dense(q, k, v, out, lse)
    q, k, v = (torch.cat([t, t]) for t in (q, k, v))
    out, lse = interface.flash_attn_func(q, k, v, num_splits=3, return_lse=True)
    assert parts == [2] and launches == [4]
    _check_dense(q, k, v, out, lse)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_varlen_calls_launch_on_sequence_chunks(monkeypatch, paged, num_splits):
    """Varlen: 9 sequences (empty ones among them) run as launches of at most 4, each on its slice of cu_seqlens /
    seqused_k / the page table, into the same out and lse (num_splits=2: 18 CTAs in z would not fit, so unsplit; 2
    sequences x 2 parts fit: one split launch)."""
    launches = []
    page = 16 if paged else 0
    flags = (F16, 64, False, "sm_90a", False, False, True) + (("paged", page) if paged else ())
    split_model = _varlen_split_kernel_model(kernels.fwd_config(F16, 64, False, "sm_90a", varlen=True, paged=page,
                                                                split=True).key())

    def split(*a):
        launches.append((a[7].shape[0], a[-1]))
        split_model(*a)

    _swap_kernels(monkeypatch, {flags: _varlen_model(launches), flags + ("split",): split})
    torch.manual_seed(0)
    lens_q, lens_k = [3, 0, 5, 1, 2, 4, 0, 6, 1], [300, 7, 0, 150, 30, 9, 12, 200, 1]
    H, D = 2, 64
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(I32)
    q = torch.randn(int(cu_q[-1]) + 1, H, D, dtype=F16)
    kd = torch.randn(len(lens_k), max(lens_k), H, D, dtype=F16)
    vd = torch.randn(len(lens_k), max(lens_k), H, D, dtype=F16)
    if paged:
        num_pages = len(lens_k) * -(-max(lens_k) // page) + 2
        k, table = paged_from_dense(kd, page, num_blocks=num_pages, generator=torch.Generator().manual_seed(1))
        v, _ = paged_from_dense(vd, page, block_table=table, num_blocks=num_pages)
        keys = dict(page_table=table, seqused_k=torch.tensor(lens_k, dtype=I32))
    else:
        k = torch.cat([kd[b, :n] for b, n in enumerate(lens_k)])
        v = torch.cat([vd[b, :n] for b, n in enumerate(lens_k)])
        keys = dict(cu_seqlens_k=torch.tensor([0] + lens_k).cumsum(0).to(I32))
    out, lse = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, num_splits=num_splits, return_lse=True, **keys)
    assert launches == [4, 4, 1]
    for b in range(len(lens_q)):
        q0, n, m = int(cu_q[b]), lens_q[b], lens_k[b]
        if n and m:
            qs, ks, vs = q[None, q0:q0 + n], kd[b:b + 1, :m], vd[b:b + 1, :m]
            o_ref, _ = attention_ref(qs, ks, vs)
            o_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True)
            assert_close_to_ref(out[None, q0:q0 + n], o_ref, o_pt, name=f"sequence {b}")
            torch.testing.assert_close(lse[:, q0:q0 + n], attention_lse_ref(qs, ks)[0], rtol=1e-5, atol=1e-5)
        elif n:
            assert torch.all(out[q0:q0 + n] == 0) and torch.all(torch.isposinf(lse[:, q0:q0 + n])), b
    assert torch.all(out[-1:] == 0) and torch.all(torch.isposinf(lse[:, -1:]))
    if num_splits == 2:
        two = dict(page_table=table[:2], seqused_k=keys["seqused_k"][:2]) if paged else \
            dict(cu_seqlens_k=keys["cu_seqlens_k"][:3])
        out2, _ = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q[:3], num_splits=2, **two)
        assert launches[3:] == [(2, 2)]
        torch.testing.assert_close(out2[:int(cu_q[2])], out[:int(cu_q[2])], rtol=0, atol=1e-3)


def test_backward_launches_on_batch_slices(monkeypatch):
    """The backward kernel's grid is (key blocks, heads, batch) too: it launches on batch slices within the limit
    (the kernel replaced by a recorder here; tests/cute/test_cute_bwd.py checks its gradients on a GPU)."""
    launches = []

    def kernel(q, k, v, dout, lse2, delta, dq_accum, dk, dv, scale):
        launches.append(q.shape[0])
        for t in (dq_accum, dk, dv):
            t.zero_()

    monkeypatch.setitem(kernels._bwd_kernels, (F16, 64, False, "sm_90a"), kernel)  # (launch reads this dict)
    q, k, v, out, dout = (torch.randn(10, 5, 2, 64, dtype=F16) for _ in range(5))
    lse = torch.zeros(10, 2, 5)
    dq, dk, dv = launch.backward(dout, q, k, v, out, lse, 0.125, False, "sm_90a")
    assert launches == [4, 4, 2] and dq.shape == q.shape and dk.shape == k.shape


# ----------------------------------------------------------------------------------------------------
# GPU: real launches past 65535 batch entries / sequences (before: an error at launch)


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


_GPU_B = 70000  # > 65535


def gpu_kernel_requests():
    """The forward calls' kernel choices of this file's GPU tests, for benchmarks/tools/precompile_gpu_tests.py."""
    return [dict(dtype=torch.bfloat16, d=64, causal=True, seqlen_k=5),
            dict(dtype=torch.bfloat16, d=64, causal=True, varlen=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_more_batch_entries_than_a_grid_holds_on_gpu():
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    torch.manual_seed(0)
    q, k, v = (torch.randn(_GPU_B, 5, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    o_ref, _ = attention_ref(q, k, v, causal=True)
    o_pt, _ = attention_ref(q, k, v, causal=True, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, o_ref, o_pt)
    # varlen: 70000 sequences of 5 queries and keys
    cu = torch.arange(0, 5 * _GPU_B + 1, 5, device="cuda", dtype=I32)
    out_v, _ = flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    torch.cuda.synchronize()
    assert_close_to_ref(out_v.view_as(out), o_ref, o_pt)
