"""The Hopper backward kernel on packed sequences (FlashBwdSm90(varlen=True).call_varlen, launch.backward_varlen):
it compiles for sm_90a without a GPU, spill-bounded and with the WGMMAs pipelined; the host's per-sequence padding
of lse2 / delta (seqlen_info.BwdSeqlens) is what the kernel reads, checked with a torch model of the kernel's
contract on the CPU (Triton's interpreter and the torch host path); the plan rule bwd_varlen routes varlen backward
calls to it; on a Hopper GPU (tests marked gpu) dq, dk, dv match the reference per sequence within the project's
criterion, with empty sequences, lengths one past a tile, unequal query / key lengths, GQA, seqused, windows and
the lse gradient."""
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn import testing  # noqa: E402
from flash_attn.cute import autograd, bwd_host, bwd_torch, config, kernels, launch  # noqa: E402
from flash_attn.cute import backend as cute_backend  # noqa: E402
from flash_attn.dispatch import Call  # noqa: E402

LOG2E = 1.4426950408889634
U = launch._UNBOUNDED


def _cu(lengths, device="cpu"):
    return torch.tensor([0] + list(lengths), dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------------
# Compiled for sm_90a (no GPU)


@pytest.mark.parametrize("d,causal", [(64, False), (96, True), (128, True)])
def test_varlen_backward_compiles_for_sm90a_with_its_own_key(tmp_path, cute_env, d, causal):
    """Its own cache key (the dense kernels' keys unchanged) and lpt off; the PTX is call_varlen's, with the five
    WGMMA products; ptxas keeps setmaxnreg and the WGMMA pipeline, and spills no more than the dense kernel of the
    same configuration (test_cute_bwd.py's bounds: none at d64's 128-row loop and at d96, <= 96 bytes at d128 with
    the TMA dQ)."""
    cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", varlen=True)
    base = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a")
    assert cfg.key()["varlen"] is True and "varlen" not in base.key() and cfg.lpt == 0
    assert cfg.block_m == base.block_m and cfg.dq_tma == base.dq_tma
    kernels.compile_bwd(torch.bfloat16, d, causal, dump_dir=str(tmp_path), varlen=True)
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    assert "call_varlen" in ptx.name
    text = ptx.read_text()
    assert ".target sm_90a" in text
    assert sum(line.lstrip().startswith("wgmma.mma_async") for line in text.splitlines()) >= 5
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x <= (96 if d == 128 else 0) for x in spills), log


def test_varlen_calls_store_dk_dv_by_tma_at_the_measured_head_dims(cute_env):
    # on by default at d64-d128 (measured faster), the split-D kernel's varlen calls keep the direct stores;
    # bwd.tma_dkv=0 turns it off
    cute_env(OVERRIDES=None, DISABLE=None)
    for d in (64, 96, 128):
        for causal in (False, True):
            assert kernels.bwd_config(torch.bfloat16, d, causal, varlen=True).tma_dkv
    for d in (192, 256):
        assert not kernels.bwd_config(torch.bfloat16, d, True, varlen=True).tma_dkv
    cute_env(OVERRIDES="bwd.tma_dkv=0", DISABLE=None)
    assert not kernels.bwd_config(torch.bfloat16, 128, True, varlen=True).tma_dkv


def test_varlen_config_refuses_lpt():
    with pytest.raises(ValueError, match="lpt"):
        config.BwdConfig(dtype="bf16", head_dim=64, causal=True, arch="sm_90a", abi="cute", block_m=64, stages=2,
                         dq_split=True, dq_tma=True, lpt=4, varlen=True)


# ----------------------------------------------------------------------------------------------------
# The host steps (CPU: Triton's interpreter, fp16 / fp32)


def _ptxas_spills(ptx):
    """(spill-store bytes per function, the log) of ``ptxas -v`` on ptx for sm_90a, after checking that ptxas kept
    the register split (setmaxnreg) and did not serialise the WGMMAs; skips without ptxas."""
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True,
                         check=True)
    log = out.stdout + out.stderr
    assert "setmaxnreg' ignored" not in log and "are serialized" not in log, log
    return [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)], log


def _prepare_loop(out, dout, lse, cu, used, block_pad, dlse, width):
    """prepare_varlen's contract, one row at a time."""
    H = out.shape[1]
    lse2 = torch.full((H, width), math.nan)
    delta = torch.full((H, width), math.nan)
    for b in range(cu.shape[0] - 1):
        start, n = int(cu[b]), int(used[b])
        for r in range(-(-n // block_pad) * block_pad):
            dst = (start // block_pad + b) * block_pad + r
            if r < n:
                row = lse[:, start + r]
                lse2[:, dst] = torch.where(row.isinf(), math.inf, row * LOG2E)
                delta[:, dst] = (dout[start + r].float() * out[start + r].float()).sum(-1)
                if dlse is not None:
                    delta[:, dst] -= dlse[:, start + r]
            else:
                lse2[:, dst] = math.inf
                delta[:, dst] = 0.0
    return lse2, delta


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("block_pad", [64, 128])
def test_prepare_varlen_pads_each_sequence_at_its_offset(dtype, with_dlse, block_pad):
    """Sequence b's used rows at (cu_seqlens_q[b] // block_pad + b) * block_pad of lse2 / delta, padded to a multiple of block_pad
    with +inf / 0 (what the kernel reads past a sequence's end); lse +-inf gives +inf; delta - dlse; dq_accum zero.
    Both host paths against a row-by-row loop (Triton's kernel through the interpreter); strided inputs; rows past
    seqused_q and after the last sequence ignored."""
    g = torch.Generator().manual_seed(2)
    lens, used_l = [5, 0, 130, 64, 1], [5, 0, 100, 64, 1]
    cu, used = _cu(lens), torch.tensor(used_l, dtype=torch.int32)
    T, H, D = int(cu[-1]) + 3, 3, 64  # 3 rows of no sequence
    out = torch.randn(T, 2, H, D, generator=g).to(dtype)[:, 1]  # a slice of a packed tensor
    dout = torch.randn(H, T, D, generator=g).to(dtype).transpose(0, 1)
    lse = torch.randn(H, T + 4, generator=g)[:, 1:T + 1]
    lse[0, 7] = math.inf
    lse[2, 9] = -math.inf
    dlse = torch.randn(H, T, generator=g) if with_dlse else None
    width = bwd_host.varlen_rows(T, len(lens), block_pad)
    assert width % 4 == 0 and width >= T + len(lens) * block_pad
    want_lse2, want_delta = _prepare_loop(out, dout, lse, cu, used, block_pad, dlse, width)
    read = ~want_lse2.isnan()  # the rows the kernel reads
    paths = [bwd_host.prepare_varlen_torch]
    if bwd_host.triton is not None:
        paths.append(bwd_host.prepare_varlen)
    for fn in paths:
        lse2, delta, dq_accum = fn(out, dout, lse, cu, used, max(lens), block_pad, dlse)
        assert lse2.shape == delta.shape == (H, width) and lse2.stride(0) % 4 == 0
        assert torch.equal(lse2[read], want_lse2[read]), fn.__name__
        torch.testing.assert_close(delta[read], want_delta[read], rtol=1e-5, atol=1e-5)
        assert torch.equal(dq_accum, torch.zeros(T, H, D))


def _varlen_forward(q, k, v, cu_q, cu_k, used_q, used_k, scale, causal):
    """(out, lse (H, T)): fp32 attention per sequence (bottom-right causal), out 0 / lse +inf outside used rows."""
    T, H, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(T, H, D)
    lse = torch.full((H, T), math.inf)
    for b in range(cu_q.shape[0] - 1):
        qs, ks, lq, lk = int(cu_q[b]), int(cu_k[b]), int(used_q[b]), int(used_k[b])
        if lq == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[qs:qs + lq].float(),
                         k[ks:ks + lk].float().repeat_interleave(G, 1)) * scale
        if causal:
            s.masked_fill_(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, -math.inf)
        m = torch.logsumexp(s, -1)  # -inf for a row that sees no key
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[qs:qs + lq] = torch.einsum("hqk,khd->qhd", p, v[ks:ks + lk].float().repeat_interleave(G, 1))
        lse[:, qs:qs + lq] = torch.where(m.isinf(), math.inf, m)
    return out.to(q.dtype), lse


def kernel_layout(dq):
    """dq (B, S, H, D) as a kernel built with dq_perm leaves it in dq_accum (config.permuted_column, by the row's parity:
    a stand-in kernel's contract; bwd_host's casts read it back)."""
    out = torch.empty_like(dq)
    for parity in (0, 1):
        out[:, parity::2, :, [config.permuted_column(parity, c) for c in range(dq.shape[-1])]] = dq[:, parity::2]
    return out


def _model_kernel(block_m, seen, causal, perm=False):
    """FlashBwdSm90.call_varlen's contract in torch (the packed tensors as batch entry 0): per sequence b and query head, P = exp2(S scale log2(e) -
    lse2) (0 where the bottom-right causal mask hides the key) and dS = P (dP - delta) with lse2 / delta read at rows (cu_seqlens_q[b] // block_m + b) * block_m (the padding rows,
    to the next multiple of block_m, must be +inf / 0: the kernel's tiles read them); dq_accum += scale dS K on the
    used rows; dK = scale dS^T Q, dV = P^T dO per query head on the used key rows (the rest untouched). perm: dq_accum
    in config.permuted_column's layout (BwdConfig.dq_perm)."""
    def kernel(q, k, v, dout, lse2, delta, dq_accum, dk, dv, cu_q, cu_k, used_q, used_k, max_seqlen_k, scale,
               softcap, wl, wr):
        assert softcap == 0.0
        seen.append(max_seqlen_k)
        # the packed tensors arrive as one batch entry of the dense layouts (views: the writes below land)
        assert all(t.dim() == 4 and t.shape[0] == 1 for t in (q, k, v, dout, dq_accum, dk, dv))
        assert all(t.dim() == 3 and t.shape[0] == 1 for t in (lse2, delta))
        q, k, v, dout, lse2, delta, dq_accum, dk, dv = (t[0] for t in (q, k, v, dout, lse2, delta, dq_accum, dk, dv))
        G = q.shape[1] // k.shape[1]
        dq_out, dq_accum = dq_accum, (bwd_host.unpermute(dq_accum[None])[0] if perm else dq_accum)
        for b in range(cu_q.shape[0] - 1):
            qs, ks, lq, lk = int(cu_q[b]), int(cu_k[b]), int(used_q[b]), int(used_k[b])
            assert lk <= max_seqlen_k
            row0 = (qs // block_m + b) * block_m
            pad = -(-lq // block_m) * block_m
            assert torch.equal(lse2[:, row0 + lq:row0 + pad], torch.full_like(lse2[:, row0 + lq:row0 + pad], math.inf))
            assert torch.equal(delta[:, row0 + lq:row0 + pad], torch.zeros_like(delta[:, row0 + lq:row0 + pad]))
            if lq == 0 or lk == 0:
                continue
            qf, dof = q[qs:qs + lq].float(), dout[qs:qs + lq].float()
            kf, vf = (t[ks:ks + lk].float().repeat_interleave(G, 1) for t in (k, v))
            s = torch.einsum("qhd,khd->hqk", qf, kf)
            p = torch.exp2(s * scale * LOG2E - lse2[:, row0:row0 + lq, None])
            if causal:
                p.masked_fill_(torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, 0.0)
            dp = torch.einsum("qhd,khd->hqk", dof, vf)
            ds = p * (dp - delta[:, row0:row0 + lq, None])
            dq_accum[qs:qs + lq] += scale * torch.einsum("hqk,khd->qhd", ds, kf)
            dk[ks:ks + lk] = (scale * torch.einsum("hqk,qhd->khd", ds, qf)).to(dk.dtype)
            dv[ks:ks + lk] = torch.einsum("hqk,qhd->khd", p, dof).to(dv.dtype)
        if perm:
            dq_out.copy_(kernel_layout(dq_accum[None])[0])
    return kernel


@pytest.mark.parametrize("host", ["triton", "torch"])
@pytest.mark.parametrize("heads_kv", [4, 2])
@pytest.mark.parametrize("with_used", [False, True])
@pytest.mark.parametrize("D", [64, 96])
def test_backward_varlen_host_steps_with_a_model_kernel(monkeypatch, cute_env, host, heads_kv, with_used, D):
    """launch.backward_varlen around the model kernel gives bwd_torch's gradients (the package's exact reference)
    for causal packed sequences with an empty one, one past a 64-row tile, unequal query / key lengths, rows of no
    sequence (zero gradients) and GQA; with seqused the unused rows' gradients are 0 too. fp16 (the interpreter
    computes bf16 wrongly). D = 96: the host kernels' 128-column tiles masked to the head dim."""
    if host == "triton" and bwd_host.triton is None:
        pytest.skip("Triton is not installed")
    cute_env(OVERRIDES=None if host == "triton" else "plan.bwd_host=torch")
    dtype, H = torch.float16, 4
    lens_q, lens_k = [3, 0, 65, 20], [7, 4, 65, 1]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    used_q = torch.tensor([3, 0, 50, 20], dtype=torch.int32) if with_used else None
    used_k = torch.tensor([5, 4, 65, 0], dtype=torch.int32) if with_used else None
    Tq, Tk = int(cu_q[-1]) + 2, int(cu_k[-1]) + 1  # rows after the last sequence
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(Tq, H, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(Tk, heads_kv, D, generator=g).to(dtype) for _ in range(2))
    uq = used_q if with_used else cu_q[1:] - cu_q[:-1]
    uk = used_k if with_used else cu_k[1:] - cu_k[:-1]
    scale = D ** -0.5
    out, lse = _varlen_forward(q, k, v, cu_q, cu_k, uq, uk, scale, True)
    block_m = kernels.bwd_config(dtype, D, True, "sm_90a", varlen=True).block_m
    seen = []
    monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, True, "sm_90a", varlen=True),
                        _model_kernel(block_m, seen, True,
                                      kernels.bwd_config(dtype, D, True, "sm_90a", varlen=True).dq_perm))
    dq, dk, dv = launch.backward_varlen(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max(lens_q),
                                        max(lens_k), scale, True)
    assert seen == [max(lens_k)]
    ref = bwd_torch.backward(dout, q, k, v, out, lse, scale, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             seqused_q=used_q, seqused_k=used_k)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert got.dtype == dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3, msg=name)
    assert dq[int(cu_q[-1]):].eq(0).all() and dk[int(cu_k[-1]):].eq(0).all() and dv[int(cu_k[-1]):].eq(0).all()
    if with_used:
        assert dq[int(cu_q[2]) + 50:int(cu_q[3])].eq(0).all() and dk[int(cu_k[0]) + 5:int(cu_k[1])].eq(0).all()


def test_backward_varlen_writes_into_given_grads_and_handles_no_sequence(monkeypatch, cute_env):
    """grads=(dq, dk, dv) are the tensors returned (dk / dv zeroed first: the kernel writes only used rows); no
    sequence, or no key anywhere, gives zeros without a launch."""
    cute_env(OVERRIDES="plan.bwd_host=torch")
    dtype, D, H = torch.float16, 64, 2
    cu = _cu([4, 9])
    q, dout = (torch.randn(13, H, D).to(dtype) for _ in range(2))
    k, v = (torch.randn(13, H, D).to(dtype) for _ in range(2))
    out, lse = _varlen_forward(q, k, v, cu, cu, cu[1:] - cu[:-1], cu[1:] - cu[:-1], 0.125, False)
    block_m = kernels.bwd_config(dtype, D, False, "sm_90a", varlen=True).block_m
    seen = []
    monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, False, "sm_90a", varlen=True),
                        _model_kernel(block_m, seen, False,
                                      kernels.bwd_config(dtype, D, False, "sm_90a", varlen=True).dq_perm))
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    res = launch.backward_varlen(dout, q, k, v, out, lse, cu, cu, None, None, 9, 9, 0.125, False, grads=grads)
    assert all(a is b for a, b in zip(res, grads)) and not any(t.isnan().any() for t in res)
    ref = bwd_torch.backward(dout, q, k, v, out, lse, 0.125, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for got, want in zip(res, ref):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    for cu_q, kk in ((_cu([]), k), (cu, k[:0])):
        zero = launch.backward_varlen(dout, q, kk, v[:kk.shape[0]], out, lse, cu_q, cu_q, None, None, 9, 9, 0.125,
                                      False)
        assert all(t.eq(0).all() and t.shape == s.shape for t, s in zip(zero, (q, kk, v[:kk.shape[0]])))
    assert len(seen) == 1


# ----------------------------------------------------------------------------------------------------
# Routing


def _call(**kw):
    base = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=128, head_dim_v=128, arch=(9, 0), causal=True,
                backward=True)
    base.update(kw)
    return Call(**base)


def test_varlen_backward_is_admitted_under_its_rule(cute_env):
    """On by default (its GPU tests pass, and it is ahead of Triton's varlen backward): the dispatcher's cute backend
    takes varlen backward calls and the package's own routing (autograd._kernel_takes) sends them to the kernel,
    cu_seqlens given (batch-shaped calls with seqused only stay on bwd_torch), deterministic ones too;
    plan.bwd_varlen=0 sends them all to the next backend / bwd_torch."""
    q = torch.empty(10, 2, 64)
    cu = _cu([4, 6])
    varlen = (cu, cu, 6, 6, None, None)
    assert cute_backend.unsupported_reason(_call(varlen=True)) is None
    assert autograd._kernel_takes(q, q, True, U, U, 0.0, False, varlen)
    assert autograd._kernel_takes(q, q, False, U, U, 0.0, False, (cu, cu, 6, 6, cu[1:] - cu[:-1], None))
    assert not autograd._kernel_takes(q, q, True, U, U, 0.0, False, (None, None, 6, 6, cu[1:] - cu[:-1], None))
    assert autograd._kernel_takes(q, q, True, U, U, 1.0, False, varlen)  # with the softcap rule (on by default)
    assert autograd._kernel_takes(q, q, True, U, U, 0.0, True, varlen)  # deterministic: the kernel, not bwd_torch
    assert autograd._kernel_takes(q, q, False, 8, 3, 0.0, False, varlen)  # with the window rule (on by default)
    cute_env(OVERRIDES="plan.bwd_softcap=0")
    assert not autograd._kernel_takes(q, q, True, U, U, 1.0, False, varlen)
    cute_env(OVERRIDES="plan.bwd_window=0")
    assert not autograd._kernel_takes(q, q, False, 8, 3, 0.0, False, varlen)
    cute_env(OVERRIDES="plan.bwd_varlen=0")
    assert cute_backend.unsupported_reason(_call(varlen=True)) is not None
    assert not autograd._kernel_takes(q, q, True, U, U, 0.0, False, varlen)


def test_own_backward_sends_varlen_calls_to_the_varlen_kernel(monkeypatch, cute_env):
    """Under the rule, own_backward calls launch.backward_varlen with the call's sequences, seqused, window and dlse."""
    cute_env(OVERRIDES="plan.bwd_varlen=1")
    got = {}

    def fake(*args, **kwargs):
        got.update(args=args, kwargs=kwargs)
        return "grads"

    monkeypatch.setattr(launch, "backward_varlen", fake)
    q = torch.empty(10, 2, 64)
    cu, used = _cu([4, 6]), torch.tensor([4, 5], dtype=torch.int32)
    dlse = torch.empty(2, 10)
    assert autograd.own_backward(q, q, q, q, q, dlse, 0.5, True, U, U, 0.0, False, "sm_90a",
                                 (cu, cu, 6, 7, used, None), dlse) == "grads"
    a = got["args"]
    assert a[6] is cu and a[7] is cu and a[8] is used and a[9] is None and a[10:14] == (6, 7, 0.5, True)
    assert got["kwargs"]["dlse"] is dlse and got["kwargs"]["window"] is None


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def varlen_on(monkeypatch, cute_env):
    """The varlen backward rule on, the dispatcher's cached choices dropped, and a count of the kernel's launches."""
    from flash_attn import dispatch

    cute_env(OVERRIDES="plan.bwd_varlen=1,plan.bwd_window=1", DISABLE=None)
    monkeypatch.setattr(dispatch, "_choice", {})
    calls = []
    real = launch.backward_varlen
    monkeypatch.setattr(launch, "backward_varlen", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    return calls


def _per_sequence_reference(q, k, v, dout, cu_q, cu_k, used_q, used_k, causal, window, dlse=None, softcap=0.0):
    """(out, dq, dk, dv) of the upcast oracle and of PyTorch at the input dtype, sequence by sequence (zeros outside
    the used rows); dlse (H, T): the lse's gradient, added through testing.attention_lse_ref."""
    results = []
    for upcast in (True, False):
        res = [torch.zeros_like(t) for t in (dout, q, k, v)]
        for b in range(cu_q.shape[0] - 1):
            qs, ks, lq, lk = int(cu_q[b]), int(cu_k[b]), int(used_q[b]), int(used_k[b])
            if lq == 0:
                continue
            qb, kb, vb = (t.detach()[s:s + n][None].clone().requires_grad_()
                          for t, s, n in ((q, qs, lq), (k, ks, lk), (v, ks, lk)))
            out, _ = testing.attention_ref(qb, kb, vb, causal=causal, window_size=window, softcap=softcap,
                                           upcast=upcast, reorder_ops=not upcast)
            loss = (out * dout[qs:qs + lq][None]).sum()
            if dlse is not None:
                lse = testing.attention_lse_ref(qb, kb, causal=causal, window_size=window, softcap=softcap)
                loss = loss + (torch.where(lse.isinf(), 0.0, lse) * dlse[None, :, qs:qs + lq]).sum()
            grads = torch.autograd.grad(loss, (qb, kb, vb), allow_unused=True)
            res[0][qs:qs + lq] = out.detach()[0]
            for r, gr, s, n in zip(res[1:], grads, (qs, ks, ks), (lq, lk, lk)):
                if gr is not None:
                    r[s:s + n] = gr[0]
        results.append(res)
    return results


def _run_varlen(dtype, d, causal, lens_q, lens_k, heads, heads_kv, calls, seed=0, used=None, window=(-1, -1),
                with_lse_grad=False):
    from flash_attn.cute import flash_attn_varlen_func

    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(Tq, heads, d, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(Tk, heads_kv, d, generator=g).to("cuda", dtype).requires_grad_() for _ in range(2))
    dout = torch.randn(Tq, heads, d, generator=g).to("cuda", dtype)
    used_q, used_k = used if used is not None else (None, None)
    used_q = None if used_q is None else torch.tensor(used_q, dtype=torch.int32, device="cuda")
    used_k = None if used_k is None else torch.tensor(used_k, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
                                      seqused_k=used_k, causal=causal, return_lse=True,
                                      window_size=tuple(None if w < 0 else w for w in window))
    dlse = None
    loss = (out.float() * dout.float()).sum()
    if with_lse_grad:
        dlse = torch.randn(lse.shape, generator=g).to("cuda")
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    torch.cuda.synchronize()
    assert calls, "the backward did not run on the varlen kernel"
    uq = used_q if used_q is not None else cu_q[1:] - cu_q[:-1]
    uk = used_k if used_k is not None else cu_k[1:] - cu_k[:-1]
    ref, pt = _per_sequence_reference(q, k, v, dout, cu_q, cu_k, uq, uk, causal, window, dlse)
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), (out.detach(), dq, dk, dv), ref, pt):
        testing.assert_close_to_ref(a, r, p, name)


LENGTHS = {  # (lens_q, lens_k): empty sequences, one row, one past a tile, unequal lengths, longer than a key block
    "mixed": ([1, 17, 129, 300], [1, 17, 129, 300]),
    "empty": ([0, 129, 255, 64], [200, 0, 64, 65]),
    "unequal": ([1000, 33, 1], [77, 1200, 130]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 1)])
def test_varlen_gradients_match_reference_on_gpu(varlen_on, dtype, d, causal, lengths, heads, heads_kv):
    _run_varlen(dtype, d, causal, *LENGTHS[lengths], heads, heads_kv, varlen_on, seed=d)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("tma_dkv", [1, 0])
def test_varlen_gradients_with_and_without_tma_dkv_on_gpu(varlen_on, monkeypatch, cute_env, d, causal, lengths,
                                                          tma_dkv):
    # bwd.tma_dkv=1 (the default at these head dims) on varlen calls: key blocks that end inside their sequence by TMA
    # stores, each sequence's last partial block by the direct stores (the next sequence's rows must keep their own
    # gradients); GQA's host sum. bwd.tma_dkv=0: every block by the direct stores.
    cute_env(OVERRIDES=f"plan.bwd_varlen=1,plan.bwd_window=1,bwd.tma_dkv={tma_dkv}", DISABLE=None)
    table = {}
    monkeypatch.setattr(kernels, "_bwd_kernels", table)  # (the in-memory table does not key on the overrides)
    monkeypatch.setattr(launch, "_bwd_kernels", table)
    _run_varlen(torch.bfloat16, d, causal, *LENGTHS[lengths], 4, 2, varlen_on, seed=13)
    _run_varlen(torch.bfloat16, d, causal, [700, 256, 1], [640, 256, 129], 4, 4, varlen_on, seed=14)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_varlen_gradients_with_the_dq_writer_warp_on_gpu(varlen_on, monkeypatch, cute_env, d, causal, lengths):
    # bwd.dq_writer=1 on varlen calls: the writer warp walks each CTA's own sequence's query blocks
    cute_env(OVERRIDES="plan.bwd_varlen=1,plan.bwd_window=1,bwd.dq_writer=1", DISABLE=None)
    table = {}
    monkeypatch.setattr(kernels, "_bwd_kernels", table)  # (the in-memory table does not key on the overrides)
    monkeypatch.setattr(launch, "_bwd_kernels", table)
    _run_varlen(torch.bfloat16, d, causal, *LENGTHS[lengths], 4, 2, varlen_on, seed=15)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_varlen_gradients_with_dq_perm_on_gpu(varlen_on, monkeypatch, cute_env, d, causal, lengths):
    # dq_perm on varlen calls: config.permuted_column's layout by the packed rows' parity
    cute_env(OVERRIDES="plan.bwd_varlen=1,plan.bwd_window=1", DISABLE=None)
    table = {}
    monkeypatch.setattr(kernels, "_bwd_kernels", table)  # (the in-memory table does not key on the overrides)
    monkeypatch.setattr(launch, "_bwd_kernels", table)
    _run_varlen(torch.bfloat16, d, causal, *LENGTHS[lengths], 4, 2, varlen_on, seed=16)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_gradients_with_seqused_on_gpu(varlen_on, d, causal):
    _run_varlen(torch.bfloat16, d, causal, [300, 40, 129], [500, 64, 10], 4, 2, varlen_on, seed=5,
                used=([250, 0, 129], [500, 33, 0]))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,window", [(False, (100, 30)), (True, (64, -1)), (False, (0, 0))])
def test_varlen_gradients_with_windows_on_gpu(varlen_on, d, causal, window):
    _run_varlen(torch.bfloat16, d, causal, [300, 777, 1], [777, 300, 900], 4, 2, varlen_on, seed=6, window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
def test_varlen_gradients_with_the_lse_gradient_on_gpu(varlen_on, d):
    _run_varlen(torch.float16, d, True, [130, 0, 257], [100, 50, 257], 4, 2, varlen_on, seed=7, with_lse_grad=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_root_varlen_api_runs_the_varlen_kernel_on_gpu(varlen_on, causal):
    """The root flash_attn_varlen_func through the dispatcher's cute backend (backend.bwd, grads given)."""
    import flash_attn

    g = torch.Generator().manual_seed(8)
    lens = [100, 1, 300]
    cu = _cu(lens, "cuda")
    q, k, v = (torch.randn(int(cu[-1]), 4, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    with flash_attn.use_backend("cute"):
        out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert varlen_on
    used = cu[1:] - cu[:-1]
    ref, pt = _per_sequence_reference(q, k, v, dout, cu, cu, used, used, causal, (-1, -1))
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), (out.detach(), dq, dk, dv), ref, pt):
        testing.assert_close_to_ref(a, r, p, name)
