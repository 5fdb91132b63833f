"""The Hopper backward kernel with soft-capped scores (FlashBwdSm90(softcap=True)): s -> softcap * tanh(scale * s /
softcap) as the forward computes it, P^T from the capped scores, dS^T = P^T (dP^T - delta) (1 - tanh^2) with the
tanh's derivative kept in 16 bits between the two steps. On the CPU: the config (64 query rows), the PTX (one
tanh.approx per score), ptxas's spills bounded and the WGMMAs pipelined, the derivative's rounding within dS's own,
the host's scalars for each entry and the plan rule bwd_softcap's routing. On a Hopper GPU (tests marked gpu): the
reference's gradients, dense, windowed, GQA and varlen."""
import os
import re
import sys

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn import testing  # noqa: E402
from flash_attn.cute import autograd, kernels, launch  # noqa: E402
from flash_attn.cute import backend as cute_backend  # noqa: E402
from test_cute_bwd_varlen import _call, _hopper, _ptxas_spills  # noqa: E402 (the backward tests' shared helpers)

U = launch._UNBOUNDED


@pytest.mark.parametrize("d,causal,kw,spill_limit", [(64, False, {}, 0), (128, True, {}, 4), (128, False, {}, 4),
                                                     (128, True, dict(varlen=True), 4),
                                                     (64, True, dict(varlen=True), 0), (96, False, {}, 0),
                                                     (96, True, dict(varlen=True), 0)])
def test_softcap_kernel_compiles_with_one_tanh_per_score(tmp_path, cute_env, d, causal, kw, spill_limit):
    """64 query rows whatever the override; its own cache key; one tanh.approx.f32 per score of a thread's S^T tile
    (64 query rows x 128 keys over 256 consumer threads: 32); ptxas keeps setmaxnreg and the WGMMA pipeline and spills
    at most ``spill_limit`` bytes (d128: 0-4 with P^T kept in 16 bits only, 112-232 with the fp32 copy beside the
    derivative's 16 registers; bounded so that it cannot grow unnoticed; d96: none, with its dQ smem addresses
    partitioned in the loop, 16 / 32 bytes without)."""
    cute_env(OVERRIDES="bwd.block_m=128")
    cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", softcap=True, **kw)
    assert cfg.block_m == 64 and cfg.key()["softcap"] is True
    assert "softcap" not in kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()
    cute_env(OVERRIDES=None)
    kernels.compile_bwd(torch.bfloat16, d, causal, dump_dir=str(tmp_path), softcap=True, **kw)
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    assert ("call_varlen" if kw else "call_general") in ptx.name
    text = ptx.read_text()
    assert len(re.findall(r"tanh\.approx\.f32", text)) == 32
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x <= spill_limit for x in spills), log


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_derivative_in_16_bits_stays_within_the_rounding_of_ds(dtype):
    """The kernel rounds 1 - tanh^2 to the input dtype before dS^T = P^T (dP^T - delta) (1 - tanh^2), which is then
    rounded to the input dtype itself: the extra error is at most about one more rounding of dS (relative to
    P^T (dP^T - delta), which the factor in [0, 1] only shrinks; near saturation 1 - tanh^2 has no relative precision
    in fp32 either)."""
    g = torch.Generator().manual_seed(0)
    t = torch.tanh(torch.randn(4096, generator=g, dtype=torch.float64) * 3)
    rest = torch.randn(4096, generator=g, dtype=torch.float64)
    exact = rest * (1 - t * t)
    kernel = (rest.float() * (1 - t.float() * t.float()).to(dtype).float()).to(dtype).double()
    plain = exact.to(dtype).double()
    eps = torch.finfo(dtype).eps
    assert ((kernel - exact).abs() <= 2 * eps * rest.abs()).all()
    assert (kernel - exact).abs().max() <= 2.5 * (plain - exact).abs().max()


def test_host_hands_each_entry_its_scalars(monkeypatch, cute_env):
    """call_general gets (scale, softcap, window sizes or 0, 0); call_deterministic (counters, scale, softcap);
    call_varlen (..., max_seqlen_k, scale, softcap, window sizes)."""
    cute_env(OVERRIDES="plan.bwd_host=torch")
    dtype, D = torch.float16, 64
    seen = []

    def kernel(*args):
        seen.append(args[9:])

    for key in ((False, False, False), (True, False, False), (False, False, True), (False, True, False)):
        local, varlen, det = key
        monkeypatch.setitem(kernels._bwd_kernels,
                            kernels.bwd_mem_key(dtype, D, False, "sm_90a", local, varlen, det, True), kernel)
    q, k = torch.randn(1, 70, 2, D).to(dtype), torch.randn(1, 90, 2, D).to(dtype)
    lse = torch.randn(1, 2, 70)
    launch.backward(q, q, k, k, q, lse, 0.125, False, softcap=30.0)
    assert seen[-1] == (0.125, 30.0, 0, 0)
    launch.backward(q, q, k, k, q, lse, 0.125, False, window=(8, 3), softcap=30.0)
    assert seen[-1] == (0.125, 30.0, 8, 3)
    launch.backward(q, q, k, k, q, lse, 0.125, False, deterministic=True, softcap=30.0)
    assert seen[-1][0].dtype == torch.int32 and seen[-1][1:] == (0.125, 30.0)
    cu_q = torch.tensor([0, 70], dtype=torch.int32)
    cu_k = torch.tensor([0, 90], dtype=torch.int32)
    launch.backward_varlen(q[0], q[0], k[0], k[0], q[0], lse[0], cu_q, cu_k, None, None, 70, 90, 0.125, False,
                           softcap=30.0)
    assert seen[-1][4:] == (90, 0.125, 30.0, 0, 0)


def test_softcap_backward_is_admitted_under_its_rule(cute_env, monkeypatch):
    """On by default (its GPU tests pass, and it is ahead of Triton's soft-capped backward); plan.bwd_softcap=0 sends
    soft-capped calls to the next backend / bwd_torch."""
    q = torch.empty(1, 10, 2, 64)
    cute_env(OVERRIDES="plan.bwd_softcap=0")
    assert cute_backend.unsupported_reason(_call(softcap=30.0)) is not None
    assert not autograd._kernel_takes(q, q, True, U, U, 30.0, False, None)
    cute_env(OVERRIDES=None)
    assert cute_backend.unsupported_reason(_call(softcap=30.0)) is None
    assert cute_backend.unsupported_reason(_call(softcap=30.0, window_left=8)) is None  # windows: on by default
    assert autograd._kernel_takes(q, q, True, U, U, 30.0, False, None)
    got = []
    monkeypatch.setattr(launch, "backward", lambda *a, **kw: got.append(kw) or "g")
    autograd.own_backward(q, q, q, q, q, None, 0.5, True, U, U, 30.0, False, "sm_90a", None)
    assert got[-1]["softcap"] == 30.0


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


@pytest.fixture
def softcap_on(monkeypatch, cute_env):
    from flash_attn import dispatch

    cute_env(OVERRIDES="plan.bwd_softcap=1,plan.bwd_varlen=1", DISABLE=None)
    monkeypatch.setattr(dispatch, "_choice", {})
    calls = []
    for name in ("backward", "backward_varlen"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _r=real, **kw: (calls.append(kw.get("softcap")),
                                                                     _r(*a, **kw))[1])
    return calls


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 30))])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (300, 777), (1, 130)])
def test_softcap_gradients_match_reference_on_gpu(softcap_on, dtype, d, causal, window, seqlen_q, seqlen_k):
    _check_softcap_gradients(softcap_on, dtype, d, causal, window, seqlen_q, seqlen_k)


def _check_softcap_gradients(softcap_on, dtype, d, causal, window, seqlen_q, seqlen_k):
    from flash_attn.cute import flash_attn_func

    g = torch.Generator().manual_seed(d + seqlen_q)
    q = torch.randn(2, seqlen_q, 4, d, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(2, seqlen_k, 2, d, generator=g).to("cuda", dtype).requires_grad_() for _ in range(2))
    dout = torch.randn(2, seqlen_q, 4, d, generator=g).to("cuda", dtype)
    softcap = 5.0  # small enough that the tanh bends the scores of unit-variance inputs
    out, _ = flash_attn_func(q, k, v, causal=causal, softcap=softcap,
                             window_size=tuple(None if w < 0 else w for w in window))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    assert softcap_on and all(c == softcap for c in softcap_on), softcap_on
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref, _ = testing.attention_ref(qr, kr, vr, causal=causal, window_size=window, softcap=softcap, upcast=upcast,
                                       reorder_ops=not upcast)
        results.append((ref.detach(), *torch.autograd.grad(ref, (qr, kr, vr), dout)))
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), (out.detach(), *grads), *results):
        testing.assert_close_to_ref(a, r, p, name)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
def test_softcap_varlen_gradients_on_gpu(softcap_on, d):
    from flash_attn.cute import flash_attn_varlen_func

    from test_cute_bwd_varlen import _cu, _per_sequence_reference

    lens_q, lens_k = [300, 1, 129], [500, 64, 129]
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    g = torch.Generator().manual_seed(d)
    q = torch.randn(int(cu_q[-1]), 4, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(int(cu_k[-1]), 2, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, softcap=5.0)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert softcap_on
    ref, pt = _per_sequence_reference(q, k, v, dout, cu_q, cu_k, cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], True,
                                      (-1, -1), softcap=5.0)
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, ref[1:], pt[1:]):
        testing.assert_close_to_ref(a, r, p, name)
