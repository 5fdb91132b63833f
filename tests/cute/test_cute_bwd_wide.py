"""The Hopper backward kernel at head dims 192 and 256 (FlashBwdSm90.split_d): 64 keys per CTA shared by the two
consumer warpgroups, each holding dK and dV for its half of D, S^T and dP^T split by query columns, P^T through
shared memory. Without a GPU: it compiles for sm_90a with the split-D WGMMA shapes, spill-free and pipelined, in
every variant the dispatcher may ask for; its configuration and the plan rule bwd_wide_d route calls as documented.
On a Hopper GPU (tests marked gpu): dq, dk, dv match the reference within the project's criterion (dense, unequal
lengths, GQA / MQA, windows, softcap, varlen, the gqa_loop walk, the direct dK / dV stores) and the deterministic
mode repeats bit for bit."""
import os
import sys

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn import testing  # noqa: E402
from flash_attn.cute import autograd, config, kernels  # noqa: E402
from flash_attn.cute import backend as cute_backend  # noqa: E402
from test_cute_bwd import _fresh_bwd_kernels, _reference, _run, cute_bwd_on  # noqa: E402,F401 (the backward tests' helpers)
from test_cute_bwd_varlen import U, _call, _hopper, _ptxas_spills, _run_varlen  # noqa: E402

WIDE = (192, 256)


# ----------------------------------------------------------------------------------------------------
# Compiled for sm_90a (no GPU)


@pytest.mark.parametrize("d,causal,variant", [
    (256, True, {}), (192, False, {}), (256, False, {"local": True, "softcap": True}),
    (192, True, {"varlen": True, "deterministic": True}), (256, True, {"gqa_loop": True}),
    (192, True, {"head_dim_v": 128}), (192, False, {"head_dim_v": 128, "varlen": True})])
def test_split_d_kernel_compiles_spill_free_with_its_wgmma_shapes(tmp_path, cute_env, d, causal, variant):
    """S^T and dP^T as m64n32k16 (64 keys by one warpgroup's 32 query columns, D / 16 and Dv / 16 K steps), dV as
    m64n{Dv/2}k16, dK and dQ as m64n{D/2}k16 (one warpgroup's half of the head dim); no spills, setmaxnreg kept, the
    WGMMAs not serialised; the 192 / 128 pair has a cache key of its own."""
    cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", **variant)
    assert cfg.block_m == 64 and not cfg.dq_tma and not cfg.overlap
    dv = variant.get("head_dim_v", d)
    assert ("head_dim_v" in cfg.key()) == (dv != d)
    kernels.compile_bwd(torch.bfloat16, d, causal, dump_dir=str(tmp_path), **variant)
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    text = ptx.read_text()
    shapes = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("wgmma.mma_async"):
            shape = line.split(".")[4]
            shapes[shape] = shapes.get(shape, 0) + 1
    want = {"m64n32k16": (d + dv) // 16, f"m64n{d // 2}k16": 2 * 64 // 16}
    want[f"m64n{dv // 2}k16"] = want.get(f"m64n{dv // 2}k16", 0) + 64 // 16
    assert shapes == want, shapes
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x == 0 for x in spills), log


@pytest.mark.parametrize("d,spill", [(192, 0), (256, 16)])
def test_split_d_overlap_compiles_without_serialised_wgmma(tmp_path, cute_env, d, spill):
    """bwd.overlap=1 (off by default, for an A/B): the next query block's S^T (at d192 with its dP^T) issued behind
    dK and dQ; spill-bounded (d256: dP^T waits for its own block, else ptxas serialises the WGMMAs and spills 200
    bytes) and the WGMMAs pipelined."""
    cute_env(OVERRIDES="bwd.overlap=1")
    assert kernels.bwd_config(torch.bfloat16, d, True, "sm_90a").overlap
    kernels.compile_bwd(torch.bfloat16, d, True, dump_dir=str(tmp_path))
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x <= spill for x in spills), log


def test_split_d_shapes_and_refusals():
    """Past D = 128 the kernel takes 64 keys per CTA (block_n 128 is refused), 64 query rows and the split dQ tile;
    two fp32 dQ tiles do not fit beside its other tiles (the shared-memory refusal names dq_tma)."""
    import cutlass

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    for d in WIDE:
        k = FlashBwdSm90(cutlass.BFloat16, d, True)
        assert k.split_d and k.block_n == 64 and k.smem_bytes() <= k.SMEM_LIMIT
        with pytest.raises(ValueError, match="block_n must be 64"):
            FlashBwdSm90(cutlass.BFloat16, d, True, block_n=128)
        with pytest.raises(ValueError, match="block_m 64"):
            FlashBwdSm90(cutlass.BFloat16, d, True, block_m=128)
        with pytest.raises(ValueError, match="dq_split"):
            FlashBwdSm90(cutlass.BFloat16, d, True, dq_split=False)
        with pytest.raises(ValueError, match="shared memory"):
            FlashBwdSm90(cutlass.BFloat16, d, True, dq_tma=True)
    assert not FlashBwdSm90(cutlass.BFloat16, 128, True).split_d
    with pytest.raises(ValueError, match="block_n must be 128"):
        FlashBwdSm90(cutlass.BFloat16, 128, True, block_n=64)


def test_wide_backward_is_served_under_its_rules(cute_env):
    """By default (bwd_wide_d on, bwd_d256 "causal"): d192 and the 192 / 128 pair go to the kernel, d256 only with a
    causal mask (the dispatcher names the rule when it refuses, flash_attn.cute's own autograd agrees); bwd_d256=on /
    off and bwd_wide_d=0 move them; FLASH_ATTN_CUTE_DISABLE=d256 / hdim_v send those on; a v head dim that is not a
    pair never goes."""
    q256, q192, v128 = torch.empty(2, 10, 2, 256), torch.empty(2, 10, 2, 192), torch.empty(2, 10, 2, 128)
    rules = config.plan_rules()
    assert rules.bwd_wide_d and rules.bwd_d256 == "causal"
    assert cute_backend.backward_head_dims() == (64, 96, 128, 192, 256)
    assert cute_backend.unsupported_reason(_call(head_dim=192, head_dim_v=192, causal=False)) is None
    assert cute_backend.unsupported_reason(_call(head_dim=192, head_dim_v=128)) is None  # the pair
    assert autograd._kernel_takes(q192, v128, True, U, U, 0.0, False, None)
    assert cute_backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, causal=True)) is None
    why = cute_backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, causal=False))
    assert why is not None and "bwd_d256" in why
    assert autograd._kernel_takes(q256, q256, True, U, U, 0.0, False, None)
    assert not autograd._kernel_takes(q256, q256, False, U, U, 0.0, False, None)
    assert cute_backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, causal=False, backward=False)) is None
    assert cute_backend.unsupported_reason(_call(head_dim=192, head_dim_v=64)) is not None  # not a pair
    assert not autograd._kernel_takes(q192, q192[..., :64], True, U, U, 0.0, False, None)
    cute_env(OVERRIDES="plan.bwd_d256=on")
    assert cute_backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, causal=False)) is None
    assert autograd._kernel_takes(q256, q256, False, U, U, 0.0, False, None)
    cute_env(OVERRIDES="plan.bwd_d256=off,plan.bwd_wide_d=0")
    assert cute_backend.backward_head_dims() == (64, 96, 128)
    for d, dv in ((256, 256), (192, 192), (192, 128)):
        why = cute_backend.unsupported_reason(_call(head_dim=d, head_dim_v=dv, causal=True))
        assert why is not None
    assert "bwd_wide_d" in cute_backend.unsupported_reason(_call(head_dim=192, head_dim_v=192))
    assert not autograd._kernel_takes(q256, q256, True, U, U, 0.0, False, None)
    assert not autograd._kernel_takes(q192, v128, True, U, U, 0.0, False, None)
    cute_env(OVERRIDES="plan.bwd_d256=on", DISABLE="d256,hdim_v")
    assert cute_backend.backward_head_dims() == (64, 96, 128, 192)
    assert not autograd._kernel_takes(q256, q256, True, U, U, 0.0, False, None)
    assert cute_backend.unsupported_reason(_call(head_dim=192, head_dim_v=128)) is not None
    assert not autograd._kernel_takes(q192, v128, True, U, U, 0.0, False, None)
    with pytest.raises(ValueError, match="bwd_d256"):
        cute_env(OVERRIDES="plan.bwd_d256=sometimes")
        config.plan_rules()


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


@pytest.fixture
def wide_on(cute_bwd_on, cute_env):
    """Every d192 / d256 backward on the kernel (bwd_d256=on: the non-causal d256 calls too)."""
    cute_env(OVERRIDES="plan.bwd_d256=on")
    return cute_bwd_on


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 128, 255, 1000, 2048])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 1)])
def test_wide_gradients_match_reference_on_gpu(wide_on, dtype, d, causal, seqlen, heads, heads_kv):
    _run(dtype, d, causal, 2, seqlen, seqlen, heads, heads_kv, wide_on)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (256, 77), (300, 1200), (1, 130)])
@pytest.mark.parametrize("window", [(-1, -1), (40, 7)])
def test_wide_gradients_with_unequal_lengths_and_windows_on_gpu(wide_on, d, causal, seqlen_q, seqlen_k, window):
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, 2, wide_on, seed=1,
         window=(window[0], 0 if causal else window[1]) if window[0] >= 0 else window)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("overrides", ["bwd.tma_dkv=0", "plan.bwd_gqa_loop=1"])
def test_wide_gradients_with_direct_stores_and_the_gqa_walk_on_gpu(wide_on, monkeypatch, cute_env, d, causal,
                                                                   overrides):
    cute_env(OVERRIDES="plan.bwd_d256=on," + overrides)
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, 1000, 1000, 6, 2, wide_on, seed=3)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 30))])
def test_wide_softcap_gradients_on_gpu(wide_on, d, causal, window):
    from flash_attn.cute import flash_attn_func

    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 300, 4, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 777, 2, d, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2))
    dout = torch.randn(2, 300, 4, d, generator=g).to("cuda", torch.bfloat16)
    out, _ = flash_attn_func(q, k, v, causal=causal, softcap=5.0,
                             window_size=tuple(None if w < 0 else w for w in window))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert wide_on
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref, _ = testing.attention_ref(qr, kr, vr, causal=causal, window_size=window, softcap=5.0, upcast=upcast,
                                       reorder_ops=not upcast)
        results.append(torch.autograd.grad(ref, (qr, kr, vr), dout))
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, *results):
        testing.assert_close_to_ref(a, r, p, name)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", [False, True])
def test_wide_varlen_gradients_on_gpu(wide_on, monkeypatch, d, causal):
    from flash_attn.cute import launch

    calls = []
    real = launch.backward_varlen
    monkeypatch.setattr(launch, "backward_varlen", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    _run_varlen(torch.bfloat16, d, causal, [0, 129, 1000, 33], [200, 64, 1000, 1200], 4, 2, calls, seed=d)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", WIDE)
@pytest.mark.parametrize("causal", [False, True])
def test_wide_deterministic_gradients_repeat_bit_for_bit_on_gpu(wide_on, cute_env, d, causal):
    from flash_attn.cute import flash_attn_func

    cute_env(OVERRIDES="plan.bwd_d256=on,plan.bwd_deterministic=1")
    g = torch.Generator().manual_seed(d)
    q = torch.randn(2, 1200, 4, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2048, 2, d, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2))
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    runs = []
    for _ in range(4):
        out, _ = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    assert wide_on
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref, pt = _reference(q.detach(), k.detach(), v.detach(), dout, causal)
    for name, a, r, p in zip(("dq", "dk", "dv"), runs[0], ref[1:], pt[1:]):
        testing.assert_close_to_ref(a, r, p, name)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (1000, 1000), (300, 1200), (256, 77)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_pair_192_128_gradients_on_gpu(wide_on, causal, seqlen_q, seqlen_k, heads, heads_kv):
    """q / k head dim 192, v 128 (the forward's pair): dv, dout and out are 128 wide."""
    from flash_attn.cute import flash_attn_func

    g = torch.Generator().manual_seed(seqlen_q + heads)
    q = torch.randn(2, seqlen_q, heads, 192, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(2, seqlen_k, heads_kv, 192, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    v = torch.randn(2, seqlen_k, heads_kv, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    dout = torch.randn(2, seqlen_q, heads, 128, generator=g).to("cuda", torch.bfloat16)
    out, _ = flash_attn_func(q, k, v, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert wide_on, "the backward did not run on the cute kernel"
    ref, pt = _reference(q.detach(), k.detach(), v.detach(), dout, causal)
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, ref[1:], pt[1:]):
        testing.assert_close_to_ref(a, r, p, name)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_pair_192_128_varlen_gradients_on_gpu(wide_on, monkeypatch, causal):
    from flash_attn.cute import flash_attn_varlen_func, launch

    from test_cute_bwd_varlen import _cu, _per_sequence_reference

    calls = []
    real = launch.backward_varlen
    monkeypatch.setattr(launch, "backward_varlen", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    lens_q, lens_k = [300, 1, 129, 0], [500, 64, 129, 77]
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    g = torch.Generator().manual_seed(7)
    q = torch.randn(int(cu_q[-1]), 4, 192, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(int(cu_k[-1]), 2, 192, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    v = torch.randn(int(cu_k[-1]), 2, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    dout = torch.randn(int(cu_q[-1]), 4, 128, generator=g).to("cuda", torch.bfloat16)
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert calls, "the backward did not run on the varlen kernel"
    ref, pt = _per_sequence_reference(q, k, v, dout, cu_q, cu_k, cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], causal,
                                      (-1, -1))
    for name, a, r, p in zip(("dq", "dk", "dv"), grads, ref[1:], pt[1:]):
        testing.assert_close_to_ref(a, r, p, name)
