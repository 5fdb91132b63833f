"""seqused_q in flash_attn.cute's varlen forward: sequence b uses its first seqused_q[b] query rows (masks align
its last used query with its last used key) and its other rows get out 0 and the lse of a row that sees no key.
The host runs it on the unchanged varlen kernel as 2B sequences (launch._split_unused_q). On the CPU: the
split, and whole calls with the kernel replaced by a torch model of its contract (sequence b = rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q against keys cu_seqlens_k[b] + [0, seqused_k[b])), against the
reference per sequence; the argument checks. On a Hopper GPU: the same calls on the kernel."""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import interface, kernels, launch  # noqa: E402
from _cute_table import swap_kernels  # noqa: E402
from flash_attn.testing import assert_close_to_ref, attention_lse_ref, attention_ref, fa4_window  # noqa: E402

I32 = torch.int32


def test_split_unused_q():
    cu_q = torch.tensor([0, 5, 5, 12], dtype=I32)
    cu_k = torch.tensor([0, 7, 9, 9], dtype=I32)
    used_q = torch.tensor([3, 0, 7], dtype=I32)
    used_k = torch.tensor([6, 1, 0], dtype=I32)
    q2, k2, u2 = launch._split_unused_q(cu_q, cu_k, used_q, used_k)
    assert q2.tolist() == [0, 3, 5, 5, 5, 12, 12]
    assert k2.tolist() == [0, 7, 7, 9, 9, 9, 9]
    assert u2.tolist() == [6, 0, 1, 0, 0, 0]
    assert q2.dtype == k2.dtype == u2.dtype == I32
    _, _, u2 = launch._split_unused_q(cu_q, cu_k, used_q, None)  # no seqused_k: every key of the sequence
    assert u2.tolist() == [7, 0, 2, 0, 0, 0]


def _kernel_model(causal, sink_given):
    """The varlen kernel's contract in torch (fp32 reference per sequence, no window or softcap)."""
    def run(q, k, v, out, lse, cu_q, cu_k, used_k, max_seqlen_q, scale, softcap, wl, wr, *sink):
        sink = sink[0] if sink_given else None
        for b in range(cu_q.shape[0] - 1):
            q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
            k1 = k0 + int(used_k[b])
            assert q1 - q0 <= max_seqlen_q
            if q1 == q0:
                continue
            if k1 == k0:
                out[q0:q1] = 0
                lse[:, q0:q1] = math.inf if sink is None else sink.view(-1, 1)
                continue
            qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
            o, _ = attention_ref(qs, ks, vs, causal=causal, softmax_scale=scale, learnable_sink=sink)
            out[q0:q1] = o[0].to(out.dtype)
            lse[:, q0:q1] = attention_lse_ref(qs, ks, causal=causal, softmax_scale=scale, learnable_sink=sink)[0]
    return run


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("with_used_k", [False, True])
def test_seqused_q_calls_per_sequence(monkeypatch, causal, sink, with_used_k):
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    key = (torch.float16, 64, causal, "sm_90a", False, False, True) + (("sink",) if sink else ())
    swap_kernels(monkeypatch, {key: _kernel_model(causal, sink)})  # the in-memory kernel table: the model only
    torch.manual_seed(0)
    H, Hk, D = 4, 2, 64
    lens_q, lens_k = [5, 0, 9, 4, 3], [7, 3, 12, 0, 6]
    used_q, used_k = [2, 0, 9, 4, 0], [7, 1, 5, 0, 6]
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(I32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(I32)
    q = torch.randn(int(cu_q[-1]) + 2, H, D, dtype=torch.float16)  # 2 rows past the last sequence
    k = torch.randn(int(cu_k[-1]), Hk, D, dtype=torch.float16)
    v = torch.randn(int(cu_k[-1]), Hk, D, dtype=torch.float16)
    sink_t = torch.randn(H) if sink else None
    if not with_used_k:
        used_k = lens_k
    out, lse = interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=torch.tensor(used_q, dtype=I32),
        seqused_k=torch.tensor(used_k, dtype=I32) if with_used_k else None, causal=causal, learnable_sink=sink_t,
        return_lse=True)
    for b in range(len(lens_q)):
        q0, k0, uq, uk = int(cu_q[b]), int(cu_k[b]), used_q[b], used_k[b]
        if uq and uk:
            qs, ks, vs = q[None, q0:q0 + uq], k[None, k0:k0 + uk], v[None, k0:k0 + uk]
            o_ref, _ = attention_ref(qs, ks, vs, causal=causal, learnable_sink=sink_t)
            o_pt, _ = attention_ref(qs, ks, vs, causal=causal, learnable_sink=sink_t, upcast=False, reorder_ops=True)
            assert_close_to_ref(out[None, q0:q0 + uq], o_ref, o_pt, name=f"sequence {b}")
            torch.testing.assert_close(lse[:, q0:q0 + uq],
                                       attention_lse_ref(qs, ks, causal=causal, learnable_sink=sink_t)[0])
        unused = slice(q0 + (uq if uk else 0), q0 + lens_q[b])  # no used key: every row is empty
        assert torch.all(out[unused] == 0), b
        empty = torch.full_like(lse[:, unused], math.inf) if sink_t is None else \
            sink_t.view(-1, 1).expand_as(lse[:, unused])
        assert torch.equal(lse[:, unused], empty), b
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isinf(lse[:, tail:]))


@pytest.mark.parametrize("on_lists", [True, False])
def test_seqused_q_checks(monkeypatch, on_lists):
    monkeypatch.setattr(interface, "_LIST_BATCH", 128 if on_lists else -1)  # (see interface._sequence_stats)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q = torch.zeros(6, 2, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(6, 1, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=I32)
    for used, exc, msg in [(torch.tensor([1, 2]), ValueError, "seqused_q must be an int32 tensor \\(2,\\)"),
                           (torch.tensor([1], dtype=I32), ValueError, "seqused_q must be an int32"),
                           (torch.tensor([3, 1], dtype=I32), ValueError, "seqused_q must lie in"),
                           (torch.tensor([1, -1], dtype=I32), ValueError, "seqused_q must lie in")]:
        with pytest.raises(exc, match=msg):
            interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used)
    # gradients with seqused_q: this package's own backward (autograd.Attention; the root dispatcher has no seqused)
    monkeypatch.setattr(launch, "forward_varlen", lambda q_, *a, **kw: (torch.zeros_like(q_),
                                                                           torch.zeros(q_.shape[1], q_.shape[0])))
    qg = q.clone().requires_grad_()
    out, _ = interface.flash_attn_varlen_func(qg, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                              seqused_q=torch.tensor([1, 2], dtype=I32))
    assert type(out.grad_fn).__name__ == "AttentionBackward"


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


_GPU_OPTIONS = [(False, (-1, -1), False), (True, (-1, -1), False), (True, (-1, -1), True), (False, (40, 8), False)]


def gpu_kernel_requests():
    """The forward calls' kernel choices of this file's GPU test, for benchmarks/tools/precompile_gpu_tests.py."""
    return [dict(dtype=torch.bfloat16, d=d, causal=c, window=w, sink=sink, varlen=True)
            for d in (64, 128) for c, w, sink in _GPU_OPTIONS]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,sink", _GPU_OPTIONS)
def test_seqused_q_matches_reference_per_sequence_on_gpu(d, causal, window, sink):
    from flash_attn.cute import flash_attn_varlen_func

    torch.manual_seed(0)
    H, Hk = 4, 2
    lens_q, lens_k = [17, 0, 300, 1, 129, 64], [40, 5, 300, 1, 260, 0]
    used_q, used_k = [9, 0, 300, 1, 0, 64], [40, 2, 123, 1, 260, 0]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(I32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(I32)
    q = torch.randn(int(cu_q[-1]), H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), Hk, d, device="cuda", dtype=torch.bfloat16)
    sink_t = torch.randn(H, device="cuda") if sink else None
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=torch.tensor(used_q, device="cuda", dtype=I32),
                                      seqused_k=torch.tensor(used_k, device="cuda", dtype=I32), causal=causal,
                                      window_size=fa4_window(window), learnable_sink=sink_t, return_lse=True)
    torch.cuda.synchronize()
    ref_window = (window[0], 0 if causal else window[1])
    for b in range(len(lens_q)):
        q0, k0, uq, uk = int(cu_q[b]), int(cu_k[b]), used_q[b], used_k[b]
        if uq and uk:
            qs, ks, vs = q[None, q0:q0 + uq], k[None, k0:k0 + uk], v[None, k0:k0 + uk]
            kw = dict(causal=causal, window_size=ref_window, learnable_sink=sink_t)
            o_ref, _ = attention_ref(qs, ks, vs, **kw)
            o_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True, **kw)
            assert_close_to_ref(out[None, q0:q0 + uq], o_ref, o_pt, name=f"sequence {b}")
        unused = slice(q0 + (uq if uk else 0), q0 + lens_q[b])
        assert torch.all(out[unused] == 0), b
        if sink_t is None:
            assert torch.all(torch.isinf(lse[:, unused])), b
        else:
            assert torch.equal(lse[:, unused], sink_t.view(-1, 1).expand_as(lse[:, unused])), b
