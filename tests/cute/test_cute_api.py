"""flash_attn.cute's API semantics that must match the released FA4: how window_size resolves (negative sizes are
literal), that deterministic=True reaches the backward, and that the returned lse carries a gradient. On CPU: the
host's resolution composed with the kernel's mask rule against FA4's documented mask, and the arguments the
backward receives; on a Hopper GPU (marked gpu): the kernels against a naive masked softmax."""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import autograd, interface, launch, plan  # noqa: E402

U = plan._UNBOUNDED


def _stand_in(monkeypatch, name, fn):
    """Replace launch.<name> (forward / forward_varlen) where it is used: flash_attn_func's and
    flash_attn_varlen_func's own calls (interface's name) and autograd.Attention's (launch's)."""
    monkeypatch.setattr(interface, name, fn)
    monkeypatch.setattr(launch, name, fn)


def _fa4_mask(Sq, Sk, causal, window):
    """Visible (Sq, Sk) as FA4's tests define it (flash_attn/cute/testing.py: attention_ref with
    construct_local_mask): causal makes the right size 0; None is no limit on that side; sizes are literal."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(Sq).view(-1, 1)
    j = torch.arange(Sk).view(1, -1)
    diag = i + Sk - Sq
    if left is None and right is None:
        return torch.ones(Sq, Sk, dtype=torch.bool)
    if left is None:
        return j <= diag + right
    hidden = j < diag - left
    if right is not None:
        hidden |= j > torch.clamp(diag + right, max=Sk)
    return ~hidden


def _kernel_mask(Sq, Sk, causal, window):
    """Visible (Sq, Sk) as the kernel computes it (mask.AttentionMask.apply and its key-block range) from the sizes the
    host hands it: plan._options, then plan._window_args."""
    causal, left, right, _ = plan._options(window, 0.0, causal)
    left, right, local = plan._window_args(causal, left, right)
    i = torch.arange(Sq).view(-1, 1)
    j = torch.arange(Sk).view(1, -1)
    diag = i + Sk - Sq
    vis = (j < Sk).expand(Sq, Sk).clone()
    if causal and not local:
        vis &= j <= diag
    if local:
        vis &= (j <= diag + right) & (j >= diag - left)
    return vis


_SIZES = [None, -5, -1, 0, 2, 7]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left", _SIZES)
@pytest.mark.parametrize("right", _SIZES)
def test_window_resolution_matches_fa4(causal, left, right):
    right_eff = 0 if causal else right
    for Sq, Sk in ((9, 9), (5, 12), (12, 5)):
        got = _kernel_mask(Sq, Sk, causal, (left, right))
        if left is not None and right_eff is not None and left + right_eff < 0:
            # FA4's interface: two given sizes with a negative sum (FA2's (-1, -1)) are no window at all
            want = _fa4_mask(Sq, Sk, causal, (None, None))
        else:
            want = _fa4_mask(Sq, Sk, causal, (left, right))
        assert torch.equal(got, want), (Sq, Sk)


def test_one_unbounded_value_across_the_package():
    pytest.importorskip("cutlass.cute")
    from flash_attn.cute import bwd_torch
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    assert bwd_torch.UNBOUNDED == plan._UNBOUNDED == FlashFwdSm90.UNBOUNDED


def test_negative_sizes_stay_literal():
    assert plan._options((-3, None), 0.0, False) == (False, -3, U, 0.0)
    assert plan._options((None, -2), 0.0, False) == (False, U, -2, 0.0)
    assert plan._options((None, 0), 0.0, False) == (True, U, U, 0.0)  # FA4: this is the causal mask
    assert plan._options((-1, -1), 0.0, False) == (False, U, U, 0.0)
    assert plan._options((4, None), 0.0, True) == (False, 4, 0, 0.0)
    for bad in ((1,), (1.5, 2), "ab", None):
        with pytest.raises(ValueError, match="window_size"):
            plan._options(bad, 0.0, False)


def test_negative_windows_bypass_the_dispatcher():
    # the dispatcher's backends take sizes >= 0 (-1: no limit): a literal negative size never reaches them
    assert autograd.dispatcher_window(False, -3, U) is None
    assert autograd.dispatcher_window(False, U, -1) is None
    assert autograd.dispatcher_window(True, 5, -7) == (5, 0)  # causal: the right size is 0 whatever it was
    assert autograd.dispatcher_window(False, U, U) == (-1, -1)
    assert autograd.dispatcher_window(True, 5, U) == (5, 0)
    assert autograd.dispatcher_window(False, 0, 3) == (0, 3)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_and_lse_reach_the_dispatcher(monkeypatch, varlen, deterministic):
    """A call that needs gradients runs inside the root package's differentiable op: deterministic=True must arrive
    there (its backward is then a deterministic one), and lse must be marked as reaching the caller."""
    from flash_attn import _ops

    seen = []

    def record(call, q, *args):
        seen.append((call, args[-1]))
        lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
        return torch.zeros_like(q), torch.zeros(lse_shape), None

    monkeypatch.setattr(_ops, "attention", record)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    lead = (7,) if varlen else (2, 7)
    q, k, v = (torch.zeros(*lead, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    if varlen:
        cu = torch.tensor([0, 7], dtype=torch.int32)
        interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7, causal=True, deterministic=deterministic)
    else:
        interface.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    ((call, lse_grad),) = seen
    assert call.deterministic is deterministic and lse_grad is True


def test_sink_call_passes_deterministic_to_the_backward(monkeypatch):
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    _stand_in(monkeypatch, "forward", lambda q, k, v, *a, **kw: (
        torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    seen = []
    monkeypatch.setattr(autograd, "dispatcher_backward", lambda *a: seen.append(a) or tuple(
        torch.zeros_like(t) for t in a[1:4]))
    q, k, v = (torch.zeros(1, 5, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sink = torch.zeros(2, requires_grad=True)
    out, _ = interface.flash_attn_func(q, k, v, learnable_sink=sink, deterministic=True, window_size=(3, 1))
    out.float().sum().backward()
    (args,) = seen
    assert args[11] is True  # (dout, q, k, v, out, lse, scale, causal, left, right, softcap, deterministic, ...)


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _masked_attention(q, k, v, vis, scale):
    """fp32 softmax attention under the visibility mask vis (Sq, Sk); a row that sees nothing gives 0."""
    G = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(G, dim=2)
    vf = v.float().repeat_interleave(G, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q.float(), kf) * scale
    s = s.masked_fill(~vis.to(s.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhst,bthd->bshd", p, vf)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("window", [(-37, None), (None, -20), (-5, 40), (60, -9), (0, None), (None, 0)])
@pytest.mark.parametrize("seqlens", [(113, 203), (256, 256), (129, 64)])
def test_literal_windows_match_fa4_mask_on_gpu(dtype, d, window, seqlens):
    torch.manual_seed(0)
    Sq, Sk = seqlens
    q = torch.randn(2, Sq, 6, d, device="cuda", dtype=dtype)
    k = torch.randn(2, Sk, 3, d, device="cuda", dtype=dtype)
    v = torch.randn(2, Sk, 3, d, device="cuda", dtype=dtype)
    out, _ = interface.flash_attn_func(q, k, v, window_size=window)
    vis = _fa4_mask(Sq, Sk, False, window)
    ref = _masked_attention(q, k, v, vis, d ** -0.5)
    ref_lp = _masked_attention(q.to(dtype), k, v, vis, d ** -0.5).to(dtype).float()  # rounded once, as a bound
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (ref_lp - ref).abs().max().item() + 4 * torch.finfo(dtype).eps
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_on_gpu(dtype, causal):
    """The cute forward with the backward the dispatcher picks (the cute backward at d128): the lse term changes dq
    and dk, leaves dv bitwise alone, and the gradients meet fp32 autograd."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 200, 4, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out, lse = interface.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    g, w = torch.randn_like(out), torch.randn_like(lse)
    dq, dk, dv = torch.autograd.grad((out.float() * g).sum() + (lse * w).sum(), (q, k, v))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bshd,bthd->bhst", qf, kf) * 128 ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(200, 200, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    o = torch.einsum("bhst,bthd->bshd", torch.softmax(s, -1), vf)
    want = torch.autograd.grad((o * g.float()).sum() + (torch.logsumexp(s, -1) * w).sum(), (qf, kf, vf))
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        err = (got.float() - ref).abs().max().item()
        assert err <= 0.02 * max(1.0, ref.abs().max().item()), f"{name}: max error {err:.3e}"
    out2, _ = interface.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dq2, dk2, dv2 = torch.autograd.grad((out2.float() * g).sum(), (q, k, v))
    assert not torch.equal(dq, dq2) and not torch.equal(dk, dk2)
    assert (dv.float() - dv2.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps * dv2.abs().max().item()


# ----------------------------------------------------------------------------------------------------
# FA4's signatures, head dims and batch-shaped varlen calls (CPU: the kernel launch recorded, not run)

FA4_FUNC_PARAMS = ["q", "k", "v", "qv", "gather_kv_indices", "softmax_scale", "causal", "window_size",
                   "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod", "score_mod_bwd",
                   "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors", "block_sparse_tensors_bwd",
                   "return_lse"]
FA4_VARLEN_PARAMS = ["q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                     "min_seqlen_k", "seqused_q", "seqused_k", "gather_kv_indices", "page_table", "softmax_scale",
                     "causal", "window_size", "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic",
                     "score_mod", "score_mod_bwd", "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars",
                     "return_lse", "scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata"]


def test_signatures_are_fa4s():
    """Positional callers of FA4 (its order since beta 10, qv and gather_kv_indices early) reach the same arguments."""
    import inspect

    assert list(inspect.signature(interface.flash_attn_func).parameters) == FA4_FUNC_PARAMS
    assert list(inspect.signature(interface.flash_attn_varlen_func).parameters) == FA4_VARLEN_PARAMS


@pytest.mark.parametrize("name", ["qv", "gather_kv_indices"])
@pytest.mark.parametrize("varlen", [False, True])
def test_unimplemented_fa4_arguments_are_refused(name, varlen):
    lead = (7,) if varlen else (1, 7)
    q = k = v = torch.zeros(*lead, 2, 64, dtype=torch.bfloat16)
    value = (lambda *a: None) if name == "score_mod_bwd" else torch.zeros(1)
    fn = interface.flash_attn_varlen_func if varlen else interface.flash_attn_func
    with pytest.raises(NotImplementedError, match=f"does not take {name}"):
        fn(q, k, v, **{name: value})


class _Recorder:
    """Stands in for the kernel launches: records q / k / v shapes and the scale, returns zeros."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
        _stand_in(monkeypatch, "forward", self.dense)
        _stand_in(monkeypatch, "forward_varlen", self.varlen)

    def dense(self, q, k, v, softmax_scale, *a, **kw):
        self.calls.append((q.shape, k.shape, v.shape, softmax_scale))
        B, Sq, H, _ = q.shape
        return torch.ones(B, Sq, H, v.shape[-1], dtype=q.dtype), torch.zeros(B, H, Sq)

    def varlen(self, q, k, v, cu_q, cu_k, seqused_k, max_q, softmax_scale, *a, **kw):
        self.calls.append((q.shape, k.shape, v.shape, softmax_scale, cu_q.tolist()))
        return torch.ones(*q.shape[:2], v.shape[-1], dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0])


@pytest.mark.parametrize("d,dv,padded", [(8, 8, 64), (32, 32, 64), (80, 80, 96), (64, 128, 128), (200, 136, 256),
                                         (128, 64, 128)])
@pytest.mark.parametrize("varlen", [False, True])
def test_other_head_dims_run_zero_padded(monkeypatch, d, dv, padded, varlen):
    rec = _Recorder(monkeypatch)
    lead = (9,) if varlen else (1, 9)
    q, k, v = torch.randn(*lead, 4, d), torch.randn(*lead, 2, d), torch.randn(*lead, 2, dv)
    q, k, v = (t.to(torch.float16) for t in (q, k, v))
    if varlen:
        cu = torch.tensor([0, 9], dtype=torch.int32)
        out, _ = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9,
                                                  max_seqlen_k=9)
    else:
        out, _ = interface.flash_attn_func(q, k, v)
    (call,) = rec.calls
    assert call[0][-1] == call[1][-1] == call[2][-1] == padded
    assert call[3] == pytest.approx(d ** -0.5)  # the scale of the call's own head dim
    assert out.shape == (*lead, 4, dv) and out.is_contiguous()


@pytest.mark.parametrize("d,dv", [(4, 4), (148, 148), (288, 288), (64, 12), (260, 64)])
@pytest.mark.parametrize("varlen", [False, True])
def test_head_dims_fa4_refuses_raise_its_assertion(d, dv, varlen):
    lead = (5,) if varlen else (1, 5)
    q, k, v = (torch.zeros(*lead, 2, n, dtype=torch.bfloat16) for n in (d, d, dv))
    msg = rf"\(head_dim, head_dim_v\)=\({d}, {dv}\) is not supported on SM90"
    with pytest.raises(AssertionError, match=msg) as info:
        if varlen:
            cu = torch.tensor([0, 5], dtype=torch.int32)
            interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
        else:
            interface.flash_attn_func(q, k, v)
    assert isinstance(info.value, ValueError)


def test_varlen_takes_batch_shaped_tensors(monkeypatch):
    """FA4's varlen entry with cu_seqlens None: (B, S, H, D) tensors, sequences of S rows (seqused_* their used
    counts); out keeps q's batch shape and lse is (B, H, Sq)."""
    rec = _Recorder(monkeypatch)
    B, Sq, Sk, H, D = 3, 5, 7, 2, 64
    q = torch.randn(B, Sq, H, D, dtype=torch.float16)
    k, v = (torch.randn(B, Sk, H, D, dtype=torch.float16) for _ in range(2))
    used = torch.tensor([7, 0, 3], dtype=torch.int32)
    out, lse = interface.flash_attn_varlen_func(q, k, v, seqused_k=used, return_lse=True)
    (call,) = rec.calls
    assert call[0] == (B * Sq, H, D) and call[1] == (B * Sk, H, D) and call[4] == [0, 5, 10, 15]
    assert out.shape == (B, Sq, H, D) and lse.shape == (B, H, Sq)
    with pytest.raises(ValueError, match="k and v must both be batch-shaped"):
        interface.flash_attn_varlen_func(q, k, v[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", [(8, 8), (16, 16), (32, 32), (40, 40), (72, 72), (64, 128), (200, 136)])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_head_dims_on_gpu(dtype, d, dv, causal):
    torch.manual_seed(2)
    Sq, Sk = 129, 257
    q = torch.randn(2, Sq, 4, d, device="cuda", dtype=dtype)
    k = torch.randn(2, Sk, 2, d, device="cuda", dtype=dtype)
    v = torch.randn(2, Sk, 2, dv, device="cuda", dtype=dtype)
    out, _ = interface.flash_attn_func(q, k, v, causal=causal)
    vis = _fa4_mask(Sq, Sk, causal, (None, None))
    ref = _masked_attention(q, k, v, vis, d ** -0.5)
    ref_lp = _masked_attention(q, k, v, vis, d ** -0.5).to(dtype).float()
    err = (out.float() - ref).abs().max().item()
    assert out.shape == (2, Sq, 4, dv)
    assert err <= 2 * (ref_lp - ref).abs().max().item() + 4 * torch.finfo(dtype).eps, err


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_batch_shaped_varlen_on_gpu(causal):
    torch.manual_seed(3)
    B, Sq, Sk, H, Hk, D = 3, 17, 40, 4, 2, 128
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    used = torch.tensor([40, 1, 23], dtype=torch.int32, device="cuda")
    out, lse = interface.flash_attn_varlen_func(q, k, v, seqused_k=used, causal=causal, return_lse=True)
    assert out.shape == (B, Sq, H, D) and lse.shape == (B, H, Sq)
    for b in range(B):
        n = int(used[b])
        want, _ = interface.flash_attn_func(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
        assert (out[b:b + 1].float() - want.float()).abs().max().item() <= 1e-2


# ----------------------------------------------------------------------------------------------------
# flash_attn_combine and get_scheduler_metadata


def _parts(scores, values, bounds):
    """Per key range [a, b): (o normalised by its own sum, lse), empty ranges as FA4 writes them (o 0, lse -inf)."""
    outs, lses = [], []
    for a, b in bounds:
        s = scores[..., a:b]
        lse = torch.logsumexp(s, -1) if b > a else torch.full(s.shape[:-1], -math.inf, dtype=s.dtype)
        p = torch.exp(s - lse.unsqueeze(-1)) if b > a else s
        outs.append(p @ values[a:b] if b > a else torch.zeros(*s.shape[:-1], values.shape[-1], dtype=s.dtype))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)



@pytest.mark.parametrize("varlen", [False, True])
def test_flash_attn_combine_merges_parts(varlen):
    g = torch.Generator().manual_seed(4)
    rows = (6,) if varlen else (2, 3)
    H, Sk, D = 2, 20, 8
    scores = torch.randn(*rows, H, Sk, generator=g, dtype=torch.float64)
    values = torch.randn(Sk, D, generator=g, dtype=torch.float64)
    o_parts, lse_parts = _parts(scores, values, [(0, 7), (7, 7), (7, 20)])
    out, lse = interface.flash_attn_combine(o_parts.float(), lse_parts.float())
    full = torch.softmax(scores, -1) @ values
    assert out.shape == (*rows, H, D) and lse.shape == (*rows, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)
    # this package's split kernel marks an empty part with +inf: the same result
    lse_pos = torch.where(torch.isinf(lse_parts), math.inf, lse_parts).float()
    out2, _ = interface.flash_attn_combine(o_parts.float(), lse_pos, out_dtype=torch.bfloat16, return_lse=False)
    assert out2.dtype == torch.bfloat16
    torch.testing.assert_close(out2.double(), full, rtol=1e-2, atol=1e-2)
    dest = torch.empty(*rows, H, D)
    res, none = interface.flash_attn_combine(o_parts.float(), lse_parts.float(), out=dest, return_lse=False)
    assert res is dest and none is None and torch.allclose(dest, out)


def test_flash_attn_combine_row_no_part_saw():
    o = torch.zeros(2, 1, 1, 1, 4)
    lse = torch.full((2, 1, 1, 1), -math.inf)
    out, l_out = interface.flash_attn_combine(o, lse)
    assert torch.equal(out, torch.zeros(1, 1, 1, 4)) and torch.isneginf(l_out).all()
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        interface.flash_attn_combine(o, lse[0])
    with pytest.raises(NotImplementedError, match="virtual_batch_idx"):
        interface.flash_attn_combine(o, lse, virtual_batch_idx=torch.zeros(1, dtype=torch.int32))


def test_scheduler_metadata_round_trips(monkeypatch):
    meta = interface.get_scheduler_metadata(max_seqlen_q=5, max_seqlen_k=7, nheads=4, nheads_kv=2, headdim=64,
                                            num_splits=1, causal=True)
    assert isinstance(meta, interface.SchedulerMetadataTensorsTorch) and all(f is None for f in meta)
    rec = _Recorder(monkeypatch)
    q = k = v = torch.zeros(5, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, scheduler_metadata=meta,
                                     min_seqlen_k=5, seqlen_k_per_split=64)
    assert len(rec.calls) == 1


# ----------------------------------------------------------------------------------------------------
# Gradients without the root package (flash-attn-4 installed alone) and for negative window sizes: this package's
# own backward (autograd.own_backward: the CuTeDSL kernel where it serves the call, else bwd_torch). On CPU the
# forward kernel is stood in for by a naive fp64 computation with the kernel's mask rule.


def _naive(q, k, v, sink, softmax_scale, causal, window_left=U, window_right=U, softcap=0.0):
    """(out, lse, seen): fp64 attention under the kernel's mask rule (plan._window_args), differentiable
    without NaNs (hidden scores are a large negative number and P is multiplied by the mask); seen: rows with a
    visible key or a sink."""
    left, right, local = plan._window_args(causal, window_left, window_right)
    Sq, Sk = q.shape[1], k.shape[1]
    i, j = torch.arange(Sq).view(-1, 1), torch.arange(Sk).view(1, -1)
    diag = i + Sk - Sq
    vis = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal and not local:
        vis &= j <= diag
    if local:
        vis &= (j <= diag + right) & (j >= diag - left)
    G = q.shape[2] // k.shape[2]
    s = torch.einsum("bshd,bthd->bhst", q.double(), k.double().repeat_interleave(G, 2)) * softmax_scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, -1e30)
    if sink is not None:
        s = torch.cat([s, sink.double().view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1))[..., :Sk] * vis
    out = torch.einsum("bhst,bthd->bshd", p, v.double().repeat_interleave(G, 2))
    seen = vis.any(-1).expand_as(lse) if sink is None else torch.ones_like(lse, dtype=torch.bool)
    return out, lse, seen


def _stand_in_forward(q, k, v, softmax_scale, causal, arch="sm_90a", window_left=U, window_right=U, softcap=0.0,
                      sink=None, pack=1, splits=1, lse_scratch=False):
    out, lse, seen = _naive(q, k, v, sink, softmax_scale, causal, window_left, window_right, softcap)
    return out.to(q.dtype), torch.where(seen, lse, math.inf).float()


def _naive_grads(q, k, v, sink, dout, wlse, **kw):
    """fp64 autograd of sum(out * dout) + sum(lse * wlse) (rows that see nothing left out of the lse term)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if sink is not None:
        leaves.append(sink.detach().double().requires_grad_())
    out, lse, seen = _naive(*leaves[:3], leaves[3] if sink is not None else None, **kw)
    loss = (out * dout.double()).sum() + (lse * seen * wlse.double()).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.fixture
def alone(monkeypatch):
    """flash-attn-4 without the root package, on CPU: no dispatcher; the forward kernel stood in for."""
    monkeypatch.setattr(autograd, "dispatcher", lambda: None)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    monkeypatch.setattr(launch, "_device_arch", lambda q, k, v: "sm_90a")  # (lowlevel._flash_attn_bwd's)
    _stand_in(monkeypatch, "forward", _stand_in_forward)
    used = []
    from flash_attn.cute import bwd_torch

    real = bwd_torch.backward
    monkeypatch.setattr(bwd_torch, "backward", lambda *a, **kw: used.append(kw) or real(*a, **kw))
    return used


@pytest.mark.parametrize("case", [
    dict(causal=True, deterministic=True), dict(window_size=(5, 2)), dict(window_size=(-3, None)),
    dict(window_size=(None, -2), softcap=3.0), dict(causal=True, window_size=(4, None), sink=True),
    dict(window_size=(7, -2), sink=True)])
def test_own_backward_matches_autograd(alone, case, cute_env):
    cute_env(DISABLE="bwd")  # bwd_torch serves every case (else the kernel, GPU only, takes most of them)
    torch.manual_seed(5)
    B, Sq, Sk, H, Hk, D = 2, 11, 17, 4, 2, 64
    q = torch.randn(B, Sq, H, D, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(B, Sk, Hk, D, dtype=torch.float16, requires_grad=True) for _ in range(2))
    sink = torch.randn(H, requires_grad=True) if case.get("sink") else None
    kw = {n: case[n] for n in ("causal", "window_size", "softcap", "deterministic") if n in case}
    out, lse = interface.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **kw)
    assert type(out.grad_fn).__name__ == "AttentionBackward"
    dout, wlse = torch.randn(out.shape), torch.randn_like(lse)
    leaves = [q, k, v] + ([sink] if sink is not None else [])
    got = torch.autograd.grad((out.float() * dout).sum() + (lse.masked_fill(lse.isinf(), 0) * wlse).sum(), leaves)
    causal, left, right, softcap = plan._options(case.get("window_size", (None, None)), case.get("softcap", 0.0),
                                                      case.get("causal", False))
    want = _naive_grads(q, k, v, sink, dout, wlse, softmax_scale=D ** -0.5, causal=causal, window_left=left,
                        window_right=right, softcap=softcap)
    assert len(alone) == 1  # bwd_torch served it
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=5e-3, atol=5e-3, msg=name)  # fp16 gradients


def test_own_backward_takes_the_kernel_where_it_serves(alone, cute_env, monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "backward", lambda dout, q, k, v, out, lse, scale, causal, arch, dlse=None,
                        window=None, deterministic=False, softcap=0.0: seen.append((causal, dlse is not None, window))
                        or (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    q, k, v = (torch.randn(1, 9, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    out, lse = interface.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.autograd.grad(out.float().sum() + lse.sum(), (q, k, v))
    assert seen == [(True, True, None)] and alone == []
    # a window: bwd_torch with the plan rule bwd_window off, else the kernel with the resolved sizes
    cute_env(OVERRIDES="plan.bwd_window=0")
    out = interface.flash_attn_func(q, k, v, causal=True, window_size=(4, None))[0]
    torch.autograd.grad(out.float().sum(), (q, k, v))
    assert len(seen) == 1 and len(alone) == 1
    cute_env(OVERRIDES=None)
    for window, want in (((4, None), (4, 0)), ((None, 3), None), ((2, 5), (2, 0))):
        out = interface.flash_attn_func(q, k, v, causal=True, window_size=window)[0]
        torch.autograd.grad(out.float().sum(), (q, k, v))
        assert seen[-1][1:] == (False, want), (window, seen[-1])  # (FA4 resolves causal + window to a window)
    cute_env(OVERRIDES=None, DISABLE="bwd")  # switched off: bwd_torch
    out = interface.flash_attn_func(q, k, v, causal=True)[0]
    torch.autograd.grad(out.float().sum(), (q, k, v))
    assert len(seen) == 4 and len(alone) == 2


def test_own_backward_takes_the_d96_kernel_unless_disabled(alone, cute_env, monkeypatch):
    """d96 (and the head dims zero-padded to it) goes to the backward kernel; FLASH_ATTN_CUTE_DISABLE=d96 sends it to
    bwd_torch, as it sends the dispatcher's d96 calls to the next backend."""
    seen = []
    monkeypatch.setattr(launch, "backward", lambda dout, q, k, v, *a, **kw: seen.append(q.shape[-1])
                        or (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    for d in (96, 80):
        q, k, v = (torch.randn(1, 9, 2, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
        out = interface.flash_attn_func(q, k, v, causal=True)[0]
        torch.autograd.grad(out.float().sum(), (q, k, v))
    assert seen == [96, 96] and alone == []
    cute_env(DISABLE="d96")
    out = interface.flash_attn_func(q, k, v, causal=True)[0]
    torch.autograd.grad(out.float().sum(), (q, k, v))
    assert seen == [96, 96] and len(alone) == 1


def test_own_backward_varlen_with_seqused(alone, monkeypatch, cute_env):
    cute_env(OVERRIDES="plan.bwd_varlen=0")  # bwd_torch's varlen path (else the kernel, GPU only)
    def stand_in_varlen(q, k, v, cu_q, cu_k, used_k, max_q, scale, causal, arch, wl, wr, softcap,
                        fill_unused_rows=False, sink=None, **kw):
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), math.inf)
        for b in range(cu_q.shape[0] - 1):
            q0, q1, k0 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b])
            k1 = k0 + int(used_k[b]) if used_k is not None else int(cu_k[b + 1])
            if q1 > q0:
                o, l_ = _stand_in_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal, arch, wl, wr,
                                          softcap, sink)
                out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
        return out, lse

    _stand_in(monkeypatch, "forward_varlen", stand_in_varlen)
    torch.manual_seed(6)
    cu = torch.tensor([0, 6, 6, 15], dtype=torch.int32)
    used_q, used_k = torch.tensor([4, 0, 9], dtype=torch.int32), torch.tensor([6, 0, 5], dtype=torch.int32)
    q, k, v = (torch.randn(15, 2, 64, dtype=torch.float16, requires_grad=True) for _ in range(3))
    out, lse = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_q=used_q,
                                                seqused_k=used_k, causal=True, return_lse=True)
    dout = torch.randn(out.shape)
    got = torch.autograd.grad((out.float() * dout).sum(), (q, k, v))
    assert len(alone) == 1
    want = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b, (nq, nk) in enumerate(zip(used_q.tolist(), used_k.tolist())):
        s0 = int(cu[b])
        if nq == 0:
            continue
        g = _naive_grads(q[None, s0:s0 + nq], k[None, s0:s0 + nk], v[None, s0:s0 + nk], None, dout[None, s0:s0 + nq],
                         torch.zeros(1, 2, nq), softmax_scale=64 ** -0.5, causal=True)
        want[0][s0:s0 + nq] += g[0][0]
        want[1][s0:s0 + nk] += g[1][0]
        want[2][s0:s0 + nk] += g[2][0]
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=5e-3, atol=5e-3, msg=name)


def test_low_level_entry_points(alone):
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 10, 2, 64, dtype=torch.float16) for _ in range(3))
    sink = torch.randn(2)
    out, lse, p, row_max = interface._flash_attn_fwd(q, k, v, causal=True, window_size_left=3, learnable_sink=sink,
                                                     return_lse=True)
    assert p is None and row_max is None and lse.shape == (1, 2, 10)
    assert interface._flash_attn_fwd(q, k, v)[1] is None
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq = torch.empty_like(q)
    grads = interface._flash_attn_bwd(q, k, v, out, dout, lse, causal=True, window_size_left=3, dq=dq, dlse=dlse,
                                      learnable_sink=sink, deterministic=True)
    assert len(grads) == 4 and grads[0] is dq
    want = _naive_grads(q, k, v, sink, dout, dlse, softmax_scale=64 ** -0.5, causal=False, window_left=3,
                        window_right=0)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), grads, want):
        torch.testing.assert_close(g.double(), w, rtol=5e-3, atol=5e-3, msg=name)
    # the mods' backward (FA4's): its rules run before any kernel
    with pytest.raises(ValueError, match="needs score_mod_bwd"):
        interface._flash_attn_bwd(q, k, v, out, dout, lse, score_mod=lambda *a, **k: None)
    with pytest.raises(NotImplementedError, match="deterministic backward of mods"):
        interface._flash_attn_bwd(q, k, v, out, dout, lse, mask_mod=lambda *a: None, deterministic=True)
    with pytest.raises(ValueError, match=r"lse expected \(1, 2, 10\)"):
        interface._flash_attn_bwd(q, k, v, out, dout, lse[:, :1], mask_mod=lambda *a: None)
    with pytest.raises(ValueError, match="aux_scalars without a score_mod or mask_mod"):
        interface._flash_attn_bwd(q, k, v, out, dout, lse, aux_scalars=[1])


@pytest.mark.parametrize("varlen", [False, True])
def test_dtype_errors_say_what_is_wrong(varlen):
    """Three fp32 tensors: the dtype is the problem (not that they differ); mixed dtypes: that they differ."""
    lead = (7,) if varlen else (1, 7)
    cu = {name: torch.tensor([0, 7], dtype=torch.int32) for name in ("cu_seqlens_q", "cu_seqlens_k")}
    f = (lambda *t: interface.flash_attn_varlen_func(*t, **cu)) if varlen else interface.flash_attn_func
    q32 = torch.zeros(*lead, 2, 64)
    with pytest.raises(ValueError, match="must be fp16 or bf16; got float32"):
        f(q32, q32, q32)
    q16 = q32.to(torch.bfloat16)
    with pytest.raises(ValueError, match="must share one dtype"):
        f(q16, q16, q32)


@pytest.mark.parametrize("D,causal,Sk", [(128, False, 128), (64, True, 2000), (128, False, 9000), (128, True, 9000),
                                         (256, True, 16)])
def test_forward_plain_lane_finds_the_kernel_fwd_kernel_stores(monkeypatch, D, causal, Sk):
    """launch.forward's plain lane (_forward_plain, the dispatcher's common call) looks up the in-memory key under which
    kernels.fwd_kernel stored the kernel on the first call (short, middle and long key lengths): the second call
    launches without a build, on the same callable."""
    from _cute_table import swap_kernels

    from flash_attn.cute import kernels

    swap_kernels(monkeypatch, {})
    builds, launches = [], []

    def build(*args, **kwargs):
        builds.append((args, kwargs))
        return (lambda *a: launches.append(len(builds))), "test"

    general = []  # the general path's calls (it alone asks _length_kernel)
    length_kernel = launch._length_kernel
    monkeypatch.setattr(launch, "_length_kernel", lambda *a: general.append(a) or length_kernel(*a))
    monkeypatch.setattr(kernels, "load_or_build", build)
    monkeypatch.setattr(kernels, "_persistent_launcher", lambda fn: fn)
    q = torch.randn(1, 8, 2, D, dtype=torch.bfloat16)
    k = v = torch.randn(1, Sk, 2, D, dtype=torch.bfloat16)
    for scratch in (False, True, False):
        out, lse = launch.forward(q, k, v, 0.1, causal, "sm_90a", lse_scratch=scratch)
        assert out.shape == q.shape and lse.shape == (1, 2, 8) and lse.dtype == torch.float32
    assert len(builds) == 1 and launches == [1, 1, 1] and len(general) == 1


def test_backend_common_call_launches_without_launch_forward(monkeypatch):
    """The dispatcher's common call (dense, causal or not, no other window, softcap or sink; more query rows than
    decoding) goes from backend.fwd straight to launch._forward_plain once its kernel is in memory; a windowed call,
    a decoding call and the first call (kernel not loaded) take launch.forward."""
    from _cute_table import swap_kernels

    from flash_attn.call import describe
    from flash_attn.cute import backend, kernels

    swap_kernels(monkeypatch, {})
    launches = []
    monkeypatch.setattr(kernels, "load_or_build", lambda *a, **kw: ((lambda *x: launches.append(x)), "test"))
    monkeypatch.setattr(kernels, "_persistent_launcher", lambda fn: fn)
    general = []
    forward = launch.forward
    monkeypatch.setattr(launch, "forward", lambda *a, **kw: general.append(a) or forward(*a, **kw))
    q = torch.randn(1, 32, 2, 128, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 2, 128, dtype=torch.bfloat16)
    call = describe(q, k)
    for scratch in (True, False, True):
        out, lse, _ = backend.fwd(call, q, k, v, None, None, 32, 64, None, None, None, lse_scratch=scratch)
        assert out.shape == q.shape and lse.shape == (1, 2, 32)
    assert len(launches) == 3 and len(general) == 1  # only the first call (the build) went through launch.forward
    assert launches[-1][5] == call.softmax_scale
    causal = describe(q, k, causal=True)
    for _ in range(2):
        backend.fwd(causal, q, k, v, None, None, 32, 64, None, None, None)
    assert len(launches) == 5 and len(general) == 2  # causal: the plain lane too, once its kernel is built
    backend.fwd(describe(q, k, causal=True, window_left=16), q, k, v, None, None, 32, 64, None, None, None)
    assert len(general) == 3  # a window: the general path



def test_sequence_stats_on_lists_and_on_the_tensor_agree(monkeypatch):
    """interface._sequence_stats gives the same numbers from Python lists (up to _LIST_BATCH sequences) and from the
    host tensor (more), valid and invalid values alike: cu_seqlens that decrease or start past 0, seqused past their
    sequences, paged calls (the page table's capacity for every sequence), no sequence at all."""
    g = torch.Generator().manual_seed(0)
    for batch in (0, 1, 3, 17):
        for paged in (False, True):
            for has_k in (False, True) if not paged else (True,):
                for has_q in (False, True):
                    for trial in range(4):
                        lens = torch.randint(-2 if trial == 3 else 0, 9, (2, batch), generator=g)
                        cu = [torch.cat([torch.tensor([trial == 2]), lens[i].cumsum(0)]).long() for i in range(2)]
                        parts = [cu[0]] + ([] if paged else [cu[1]])
                        parts += [torch.randint(-1, 10, (batch,), generator=g) for h in (has_k, has_q) if h]
                        vec = torch.cat(parts)
                        args = (vec, batch, paged, 24, has_k, has_q)
                        monkeypatch.setattr(interface, "_LIST_BATCH", 128)
                        on_lists = interface._sequence_stats(*args)
                        monkeypatch.setattr(interface, "_LIST_BATCH", -1)
                        if batch == 0:  # (the tensor path serves calls with more than _LIST_BATCH sequences only)
                            continue
                        assert interface._sequence_stats(*args) == on_lists, (batch, paged, has_k, has_q, trial)
                        assert all(type(x) is int for x in on_lists)

@pytest.mark.parametrize("on_lists", [True, False])
def test_varlen_value_checks_name_what_is_wrong(monkeypatch, on_lists):
    """The varlen call's value checks (one host copy of the small int vectors, one sync): cu_seqlens that do not start
    at 0, decrease or end past the tokens, seqused_k past a sequence's keys, max_seqlen_q below the longest sequence;
    each a ValueError before any launch. on_lists: checked on Python lists (few sequences), else on the host tensor."""
    monkeypatch.setattr(interface, "_LIST_BATCH", 128 if on_lists else -1)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    I32 = torch.int32
    q = torch.zeros(12, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(12, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 12], dtype=I32)
    cases = [(dict(cu_seqlens_q=torch.tensor([1, 5, 12], dtype=I32)), "cu_seqlens_q must start at 0"),
             (dict(cu_seqlens_q=torch.tensor([0, 7, 5], dtype=I32)), "cu_seqlens_q must start at 0, never decrease"),
             (dict(cu_seqlens_k=torch.tensor([0, 5, 13], dtype=I32)), "cu_seqlens_k .*end at most at 12"),
             (dict(seqused_k=torch.tensor([6, 1], dtype=I32)), "seqused_k must lie in"),
             (dict(seqused_k=torch.tensor([5, -1], dtype=I32)), "seqused_k must lie in"),
             (dict(max_seqlen_q=6), r"max_seqlen_q \(6\) is below the longest sequence \(7\)")]
    for kw, match in cases:
        args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            interface.flash_attn_varlen_func(q, k, v, **args)
