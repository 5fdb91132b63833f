"""v's head dim != q's in flash_attn.cute's forward (config.HEAD_DIM_PAIRS: 192 / 128, DeepSeek's MLA without
absorption): the kernel's V tiles, P V product, O accumulator and O store take Dv. On the CPU: the config and cache
key, the argument checks and the gate, the per-call choice of kernel and out's shape, the dispatcher's admission
(the forward, and the backward under the plan rule bwd_wide_d), and the PTX (WGMMA N = Dv for P V, V's TMA boxes, ptxas clean). On a Hopper GPU (tests marked gpu):
against the reference with every option, varlen, pack_gqa and the gradients (the split-D backward kernel; its own
tests: test_cute_bwd_wide.py).

The kernel was written without a GPU (session 15) and its GPU tests here passed in session 16; FLASH_ATTN_CUTE_DISABLE=hdim_v
turns such calls off (NotImplementedError)."""
import collections
import glob
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

from flash_attn.cute import config, interface, kernels, launch  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.testing import (  # noqa: E402
    assert_close_to_ref, assert_lse_close, assert_ptxas_clean, attention_lse_ref, attention_ref, fa4_window,
)



@pytest.fixture(autouse=True)
def _defaults(cute_env):
    """No FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE: the default kernels."""



def test_pairs_and_config():
    assert config.HEAD_DIM_PAIRS == {(192, 128)}
    cfg = lambda causal, **kw: kernels.fwd_config(torch.bfloat16, 192, causal, "sm_90a", **kw).key()  # noqa: E731
    make = lambda causal, **kw: kernels._make_kernel(kernels.fwd_config(torch.bfloat16, 192, causal, **kw))  # noqa: E731
    for causal in (False, True):
        for kw in (dict(), dict(varlen=True), dict(local=True, sink=True), dict(softcap=True), dict(short=True),
                   dict(pack=8)):
            plain = cfg(causal, **kw)
            assert "head_dim_v" not in plain and cfg(causal, dv=192, **kw) == plain
            mixed = cfg(causal, dv=128, **kw)
            assert mixed == {**plain, "head_dim_v": 128} or (
                # short: the same kernel as not short (no short-key kernel at d192)
                kw.get("short") and mixed == {**cfg(causal), "head_dim_v": 128})
            assert not mixed.get("persistent") and not mixed.get("tma_o")
            kernel = make(causal, dv=128, **kw)
            assert (kernel.head_dim, kernel.head_dim_v) == (192, 128)
            assert kernel.smem_bytes() <= kernel.SMEM_BYTES
            assert kernel.smem_bytes() < make(causal, **kw).smem_bytes()  # V's tiles are 128 wide
    e_plain, e_mixed = (kernels._entry(torch.bfloat16, 192, True, "sm_90a", dv=dv) for dv in (None, 128))
    assert e_plain[1] != e_mixed[1] and "-dv128-" in e_mixed[2] and "-dv" not in e_plain[2]


def test_kernel_refuses_what_it_does_not_do():
    import cutlass

    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    for kw, msg in [(dict(head_dim_v=100), "head dim of v 100"), (dict(head_dim_v=128, tma_o=True), "one-tile"),
                    (dict(head_dim_v=128, persistent=True), "one-tile")]:
        with pytest.raises(ValueError, match=msg):
            FlashFwdSm90(cutlass.BFloat16, 192, True, **kw)


def test_checks_and_gate(cute_env):
    interface._check_dims(128, 128, 4, 2)
    interface._check_dims(192, 128, 4, 2)  # on by default
    with pytest.raises(NotImplementedError, match=r"head dim of v \(128\) must equal that of q and k \(64\)"):
        interface._check_dims(64, 128, 4, 2)
    cute_env(DISABLE="hdim_v")
    with pytest.raises(NotImplementedError, match=r"head dim of v \(128\) != that of q and k \(192\)"):
        interface._check_dims(192, 128, 4, 2)
    interface._check_dims(128, 128, 4, 2)
    cute_env(DISABLE=None)
    interface._check_dims(192, 128, 4, 2)
    for d, dv in [(64, 128), (128, 192), (192, 64), (256, 128)]:
        with pytest.raises(NotImplementedError, match="must equal"):
            interface._check_dims(d, dv, 4, 2)


def test_calls_select_the_kernel_and_shape_out(cute_env, monkeypatch):
    """flash_attn_func / forward / flash_attn_varlen_func with v's head dim 128 and q's 192: the ("dv", 128)
    kernel (never the fast path's), out with v's head dim; v's own layout (heads Dv apart) kept."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    seen = []

    def kernel(tag):
        def run(q, k, v, out, lse, *args):
            seen.append((tag, tuple(q.shape), tuple(v.shape), tuple(out.shape), v.stride()))
        return run

    base = (torch.bfloat16, 192, True, "sm_90a", False, False)
    table = {base: kernel("same"), base + (("dv", 128)): kernel("dv"), base + (True, "dv", 128): kernel("varlen dv"),
             base + ("pack", 4, "dv", 128): kernel("pack dv"),
             base + (True, "pack", 4, "dv", 128): kernel("varlen pack dv")}
    _swap_kernels(monkeypatch, table)
    q = torch.randn(2, 5, 8, 192, dtype=torch.bfloat16)
    k = torch.randn(2, 9, 2, 192, dtype=torch.bfloat16)
    v = torch.randn(2, 9, 2, 128, dtype=torch.bfloat16)
    out, _ = interface.flash_attn_func(q, k, v, causal=True, pack_gqa=False)
    assert out.shape == (2, 5, 8, 128) and seen[-1][0] == "dv" and seen[-1][3] == (2, 5, 8, 128)
    assert seen[-1][4] == (9 * 2 * 128, 2 * 128, 128, 1)
    out, lse = launch.forward(q, k, v, 0.1, True)
    assert out.shape == (2, 5, 8, 128) and lse.shape == (2, 8, 5) and seen[-1][0] == "dv"
    interface.flash_attn_func(q, k, v, causal=True, pack_gqa=True)
    assert seen[-1][0] == "pack dv"
    cute_env(OVERRIDES="plan.pack_gqa_auto=1")  # pack_gqa=None's rule
    cu = torch.tensor([0, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 9], dtype=torch.int32)
    out, _ = interface.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu_k, causal=True, pack_gqa=False)
    assert out.shape == (5, 8, 128) and seen[-1][0] == "varlen dv"
    out, _ = interface.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu_k, causal=True)  # pack_gqa None: packed
    assert out.shape == (5, 8, 128) and seen[-1][0] == "varlen pack dv"
    with pytest.raises(ValueError, match="shape mismatch"):
        interface.flash_attn_varlen_func(q[0], k[0], v[0, :8], cu_seqlens_q=cu, cu_seqlens_k=cu_k, causal=True)


def test_hdim_v_refusal_names_the_disable_variable(cute_env):
    cute_env(DISABLE="hdim_v")
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_CUTE_DISABLE"):
        interface._check_dims(192, 128, 4, 2)


def test_dispatcher_admits_the_pair_forward_and_backward(cute_env):
    from flash_attn.cute import backend
    from flash_attn.dispatch import Call

    def call(d, dv, **kw):
        base = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=d, head_dim_v=dv, arch=(9, 0))
        return Call(**{**base, **kw})

    cute_env(DISABLE="hdim_v")
    assert "FLASH_ATTN_CUTE_DISABLE names hdim_v" in backend.unsupported_reason(call(192, 128))
    cute_env(DISABLE=None)
    assert backend.unsupported_reason(call(192, 128)) is None
    assert backend.unsupported_reason(call(192, 128, varlen=True, causal=True)) is None
    assert backend.unsupported_reason(call(192, 128, backward=True)) is None  # the split-D backward (bwd_wide_d)
    cute_env(OVERRIDES="plan.bwd_wide_d=0")
    assert "head dims 192/128" in backend.unsupported_reason(call(192, 128, backward=True))
    cute_env(OVERRIDES=None)
    assert backend.unsupported_reason(call(192, 128, alibi=True)) == "alibi"
    assert "equal for q/k and v" in backend.unsupported_reason(call(128, 64))
    cute_env(DISABLE="d96,d192")  # d192 forward switched off: the pair too
    assert "192/128" in backend.unsupported_reason(call(192, 128))


@pytest.mark.parametrize("causal,kw", [(True, dict()), (False, dict(varlen=True, sink=True, local=True))])
def test_ptx_takes_v_head_dim(tmp_path, causal, kw):
    """P V is an m64n128k16 WGMMA (S = Q K^T keeps N = BLOCK_N), V arrives as 2 TMA boxes of 64 columns per stage
    (Q and K as 3), O leaves as 128 / 8 * 2 packed pairs per thread (and 2 lse values), and ptxas is clean."""
    kernels.compile_fwd(torch.bfloat16, 192, causal, dump_dir=str(tmp_path), dv=128, **kw)
    (ptx,) = glob.glob(str(tmp_path / "*.ptx"))
    text = open(ptx).read()
    block_n = kernels.fwd_config(torch.bfloat16, 192, causal, "sm_90a", dv=128, **kw).block_n
    shapes = collections.Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", text))
    assert shapes == {f"m64n{block_n}k16": 2 * 192 // 16, "m64n128k16": 2 * block_n // 16}
    assert text.count("cp.async.bulk.tensor") == 3 + 3 + 2
    assert len(re.findall(r"st\.global\.b32", text)) == 2 * 128 // 8 + 2
    assert_ptxas_clean(ptx)


# ----------------------------------------------------------------------------------------------------
# GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The GPU tests' cases (gpu_kernel_requests() reads them too, for benchmarks/tools/precompile_gpu_tests.py)
_GPU_OPTIONS = [(False, (-1, -1), 0.0, False, False), (True, (-1, -1), 0.0, False, False),
                (False, (100, 20), 0.0, False, False), (True, (-1, -1), 30.0, False, False),
                (True, (-1, -1), 0.0, True, False), (True, (-1, -1), 0.0, False, True)]
# (each: causal, window, softcap, sink, pack_gqa)
_GPU_SHAPES = [(2, 128, 128, 4, 4), (1, 1, 700, 8, 2), (2, 333, 1000, 8, 2), (1, 1000, 300, 4, 1)]


def gpu_kernel_requests():
    """The forward calls' kernel choices of this file's GPU tests, for benchmarks/tools/precompile_gpu_tests.py."""
    out = [dict(dtype=dt, d=192, dv=128, causal=c, window=w, softcap=cap, sink=sink,
                pack=(h // hk) if pack and h // hk in config.PACK_GROUPS else 1, seqlen_k=sk)
           for dt in (torch.bfloat16, torch.float16) for c, w, cap, sink, pack in _GPU_OPTIONS
           for _, _, sk, h, hk in _GPU_SHAPES]
    out += [dict(dtype=torch.bfloat16, d=192, dv=128, causal=c, varlen=True) for c in (False, True)]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window,softcap,sink,pack", _GPU_OPTIONS)
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", _GPU_SHAPES)
def test_matches_reference_on_gpu(monkeypatch, dtype, causal, window, softcap, sink, pack, batch, seqlen_q, seqlen_k,
                                  heads, heads_kv):
    from flash_attn.cute import flash_attn_func

    # (no FLASH_ATTN_CUTE_DISABLE: hdim_v and pack_gqa on)
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, 192, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, 192, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, 128, device="cuda", dtype=dtype)
    sink_t = torch.randn(heads, device="cuda") if sink else None
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=fa4_window(window), softcap=softcap, learnable_sink=sink_t,
                               pack_gqa=pack, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (batch, seqlen_q, heads, 128)
    ref_window = (window[0], 0 if causal else window[1])
    kw = dict(causal=causal, window_size=ref_window, softcap=softcap, learnable_sink=sink_t)
    out_ref, _ = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_to_ref(out, out_ref, out_pt)
    lse_ref = attention_lse_ref(q, k, causal=causal, window_size=ref_window, softcap=softcap,
                                 learnable_sink=sink_t)
    assert_lse_close(lse, lse_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_reference_per_sequence_on_gpu(monkeypatch, causal):
    from flash_attn.cute import flash_attn_varlen_func

    # (no FLASH_ATTN_CUTE_DISABLE: hdim_v on)
    torch.manual_seed(0)
    lens_q, lens_k = [17, 0, 300, 1, 129], [40, 5, 300, 1, 260]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]), 4, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(int(cu_k[-1]), 2, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(int(cu_k[-1]), 2, 128, device="cuda", dtype=torch.bfloat16)
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal)
    torch.cuda.synchronize()
    assert out.shape == (q.shape[0], 4, 128)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if sq == 0:
            continue
        qs, ks, vs = q[None, q0:q0 + sq], k[None, k0:k0 + sk], v[None, k0:k0 + sk]
        out_ref, _ = attention_ref(qs, ks, vs, causal=causal)
        out_pt, _ = attention_ref(qs, ks, vs, causal=causal, upcast=False, reorder_ops=True)
        assert_close_to_ref(out[None, q0:q0 + sq], out_ref, out_pt, name=f"out of sequence {b}")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_on_gpu(monkeypatch, causal):
    """A call that needs gradients: this forward, then the backward from its out and lse (the split-D kernel under
    the plan rule bwd_wide_d); gradients against the fp32 reference by the project's criterion."""
    from flash_attn.cute import flash_attn_func

    # (no FLASH_ATTN_CUTE_DISABLE: hdim_v on)
    torch.manual_seed(0)
    q = torch.randn(2, 300, 4, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 400, 2, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 400, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
    out, _ = flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), dout)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
    grads_pt = torch.autograd.grad(out_pt, (q, k, v), dout)
    assert_close_to_ref(out, out_ref, out_pt)
    for name, g, g_ref, g_pt in zip("dq dk dv".split(), grads, grads_ref, grads_pt):
        assert_close_to_ref(g, g_ref, g_pt, name=name)
