"""flash_attn.cute (distribution flash-attn-4): the Hopper forward kernel compiles for sm_90a without a
GPU and its PTX holds the instructions the design rests on; on a Hopper GPU (tests marked gpu) it matches
the reference within the project's accuracy criterion."""
import glob
import math
import os
import re
import sys
import time

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:  # the checkout's flash_attn/__init__ also finds it; this keeps the test standalone
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, kernels, launch, plan, settings  # noqa: E402
from _cute_table import cute_settings as _cute_settings  # noqa: E402
from flash_attn.cute.kernels import compile_fwd  # noqa: E402
from flash_attn.testing import assert_close_to_ref, assert_ptxas_clean, attention_ref, cuobjdump_path, fa4_window  # noqa: E402

def _kernel_table(monkeypatch, table=None):
    """One in-memory forward kernel table (``table``, default empty) where kernels.py fills it and launch.py and
    interface.py's fast path read it (it does not key on the overrides)."""
    from flash_attn.cute import interface

    table = {} if table is None else table
    for module in (kernels, launch, interface):
        monkeypatch.setattr(module, "_kernels", table)
    return table


# (dtype, head dim, causal, local, softcap, varlen): the standard configurations, and the window /
# softcap / varlen variants
CONFIGS = [(dtype, d, causal, False, False, False) for dtype in (torch.bfloat16, torch.float16)
           for d in (64, 128) for causal in (False, True)] + [
    (torch.bfloat16, 128, False, True, False, False), (torch.float16, 64, True, False, True, False),
    (torch.bfloat16, 128, True, False, False, True)]


def _ids(cfg):
    dtype, d, causal, local, softcap, varlen = cfg
    mask = "local" if local else "causal" if causal else "full"
    return (f"{str(dtype).split('.')[-1]}-d{d}-{mask}{'-softcap' if softcap else ''}"
            f"{'-varlen' if varlen else ''}")


@pytest.fixture(scope="module", params=CONFIGS, ids=_ids)
def ptx(request, tmp_path_factory):
    dtype, d, causal, local, softcap, varlen = request.param
    dump = tmp_path_factory.mktemp("ptx")
    t0 = time.perf_counter()
    compile_fwd(dtype, d, causal, arch="sm_90a", dump_dir=str(dump), local=local, softcap=softcap, varlen=varlen)
    print(f"\ncompile {_ids(request.param)}: {time.perf_counter() - t0:.2f} s")
    (path,) = glob.glob(str(dump / "*.ptx"))
    with open(path) as f:
        return request.param, f.read()


def _count(text, needle):
    return sum(line.lstrip().startswith(needle) for line in text.splitlines())


def test_ptx_targets_sm90a(ptx):
    _, text = ptx
    assert ".target sm_90a" in text


def test_ptx_uses_wgmma_for_both_products(ptx):
    (dtype, d, *_), text = ptx
    ab = "bf16.bf16" if dtype == torch.bfloat16 else "f16.f16"
    block_n = 128
    # S = Q K^T: m64n{block_n}k16, d/16 of them; O += P V: m64n{d}k16 with P from registers, block_n/16.
    assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.{ab}") >= d // 16
    assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{ab}") >= block_n // 16
    assert _count(text, "wgmma.fence") >= 1 and _count(text, "wgmma.wait_group") >= 1


def test_ptx_loads_with_tma_and_mbarriers(ptx):
    _, text = ptx
    assert _count(text, "cp.async.bulk.tensor") >= 3  # Q, K, V tiles
    assert "mbarrier.try_wait" in text
    assert "expect_tx" in text


def test_ptx_o_store_follows_the_config(ptx):
    """O goes through shared memory and a TMA store exactly where the config says tma_o (by default the plain
    dense d128 / d256 calls, window calls and softcap calls but d64's, never varlen or fp16 d128 non-causal, see
    tests/cute/test_cute_tma_o.py), else straight from registers to global memory: no shared -> global bulk tensor
    store, no async-proxy fence."""
    (dtype, d, causal, local, softcap, varlen), text = ptx
    tma_o = kernels.fwd_config(dtype, d, causal, "sm_90a", local=local, softcap=softcap, varlen=varlen).tma_o
    by_rule = (local or softcap) and not (softcap and d == 64) or (d == 128 and not (local or softcap))
    assert tma_o == (by_rule and not varlen and (dtype, d, causal) != (torch.float16, 128, False))
    assert "cp.async.bulk.tensor" in text  # the loads
    assert any(line.lstrip().startswith("cp.async.bulk.tensor") and ".global.shared::cta" in line
               for line in text.splitlines()) == tma_o
    assert ("fence.proxy.async" in text) == tma_o


def test_ptx_is_warp_specialised(ptx):
    cfg, text = ptx
    assert _count(text, "setmaxnreg.dec.sync.aligned.u32") == 1
    assert _count(text, "setmaxnreg.inc.sync.aligned.u32") == 1
    assert "ex2.approx" in text  # softmax through exp2
    assert ("tanh.approx" in text) == cfg[4]  # soft-capping, only where asked for


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);")


def _exps_from_pv_wait_block(text):
    """ex2.approx in the key-block loop from the start of the basic block that holds the P V wait (the
    first wait_group 0 after the loop's S wait, wait_group 1) to the loop's back-edge. ptxas hoists a
    wait above the independent instructions of its own block, so any exponential there, or after the
    wait, is computed after P V is done instead of under it."""
    lines = text.splitlines()
    s_wait = next(i for i, line in enumerate(lines) if (m := _WAIT.search(line)) and m.group(1) == "1")
    pv_wait = next(i for i in range(s_wait, len(lines)) if (m := _WAIT.search(lines[i])) and m.group(1) == "0")
    start = max([s_wait] + [i for i in range(s_wait, pv_wait) if _LABEL.match(lines[i])])
    loop_heads = {m.group(1) for line in lines[:s_wait] if (m := _LABEL.match(line))}
    back_edge = next(i for i in range(pv_wait, len(lines))
                     if (m := _BRANCH.search(lines[i])) and m.group(1) in loop_heads)
    return sum("ex2.approx" in line for line in lines[start:back_edge + 1])


def test_ptx_softmax_ends_before_the_p_v_wait(ptx):
    """The key-block loop's softmax of S_j (both branches, masked or not) stays ahead of the wait for
    O += P_{j-1} V_{j-1}, so the exponentials overlap that WGMMA (softmax.pin)."""
    _, text = ptx
    assert _exps_from_pv_wait_block(text) == 0


def test_unpinned_loop_puts_exponentials_behind_the_p_v_wait(tmp_path, cute_env):
    """Without softmax.pin (fwd.pin=0) LLVM merges the branches' common tail, the second row's
    exponentials, into the wait's block: the check above sees it (d128 causal: 41 ex2 there)."""
    cute_env(OVERRIDES="fwd.pin=0")
    assert not kernels.fwd_config(torch.bfloat16, 128, True, "sm_90a").pin
    compile_fwd(torch.bfloat16, 128, True, arch="sm_90a", dump_dir=str(tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    with open(path) as f:
        text = f.read()
    assert "// pin" not in text
    assert _exps_from_pv_wait_block(text) >= 32


def test_pin_in_the_cache_key_only_when_off(cute_env):
    args = (torch.bfloat16, 128, True, "sm_90a")
    base = kernels.fwd_config(*args).key()
    assert "pin" not in base and kernels._make_kernel(kernels.fwd_config(*args)).pin
    cute_env(OVERRIDES="fwd.pin=1")  # the default, given: the same key
    assert kernels.fwd_config(*args).key() == base
    cute_env(OVERRIDES="fwd.pin=0")
    assert kernels.fwd_config(*args).key() == {**base, "pin": False}
    assert not kernels._make_kernel(kernels.fwd_config(*args)).pin


def _compare_fragments(qk, pv, block_m, block_n, mismatches):
    # Plain Python (not @cute.jit, whose loops and ifs become device code): every value here is static.
    p_layout = cute.make_layout(((2, 2, 2), 1, block_n // 16))
    threads = [t for t in (0, 1, 5, 37, 127, 128, 130, 255, 256, 301, 383) if t < 2 * block_m]  # 128 per 64 rows
    for t in threads:
        cS = qk.get_slice(t).partition_C(cute.make_identity_tensor((block_m, block_n)))
        cA = pv.get_slice(t).partition_A(cute.make_identity_tensor((block_m, block_n)))
        if cute.size(cS) != cute.size(p_layout) or cute.size(cA) != cute.size(p_layout):
            mismatches.append((t, "size", cute.size(cS), cute.size(cA)))
            continue
        for i in range(cute.size(p_layout)):
            if p_layout(i) != i:  # the reinterpretation keeps register i as A-operand value i
                mismatches.append((t, i, "p_layout"))
            if tuple(cS[i]) != tuple(cA[i]):
                mismatches.append((t, i, cS[i], cA[i]))
            if cS[i][0] != cS[2 * ((i // 2) % 2)][0]:
                mismatches.append((t, i, "row"))


@pytest.mark.parametrize("d,warpgroups,block_n", [(64, 2, 128), (128, 2, 128), (64, 3, 96), (64, 3, 128),
                                                  (128, 3, 64), (96, 2, 128), (192, 2, 112), (192, 2, 96),
                                                  (256, 2, 80)])
def test_p_fragment_reuses_the_s_accumulator_layout(d, warpgroups, block_n):
    """The kernel feeds P to the second WGMMA by reinterpreting the S accumulator registers as the A
    operand with layout ((2, 2, 2), 1, BLOCK_N / 16); check, thread by thread, that each register then
    holds the (row, col) the A operand expects, and that a row's values are indices c + 2 r + 4 j
    (two consumer warpgroups, and three: BLOCK_M 192, threads up to 383)."""
    import cutlass
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    block_m = 64 * warpgroups
    mismatches = []

    @cute.jit
    def check():
        def mma(n, src, b_major):
            op = warpgroup.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (64, n, 16), src,
                                        OperandMajorMode.K, b_major)
            return cute.make_tiled_mma(cute.make_mma_atom(op), (warpgroups, 1, 1))

        qk = mma(block_n, warpgroup.OperandSource.SMEM, OperandMajorMode.K)
        pv = mma(d, warpgroup.OperandSource.RMEM, OperandMajorMode.MN)
        _compare_fragments(qk, pv, block_m, block_n, mismatches)

    cute.compile(check, options="--gpu-arch sm_90a")
    assert mismatches == [], mismatches[:30]


def test_host_and_kernel_agree_on_the_unbounded_window_size():
    from flash_attn.cute import interface
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    assert plan._UNBOUNDED == interface._UNBOUNDED == FlashFwdSm90.UNBOUNDED
    U = FlashFwdSm90.UNBOUNDED
    assert plan._window_args(True, U, U) == (0, 0, False)  # causal alone: no window variant
    assert plan._window_args(True, 10, 5) == (10, 0, True)  # causal caps the right side at 0
    assert plan._window_args(False, U, 7) == (U, 7, True)
    assert plan._window_args(False, -3, U) == (-3, U, True)  # FA4's negative sizes are literal
    assert plan._window_args(False, 2 ** 40, 5) == (U, 5, True)  # (the root API's ints: no Int32 overflow)


def test_unsupported_head_dim_is_refused():
    with pytest.raises(ValueError, match="head dim"):
        compile_fwd(torch.bfloat16, 72, False)


# ----------------------------------------------------------------------------------------------------
# exp2 on the FMA pipe (softmax_exp.py, fwd.exp2_emu)


def test_common_call_launches_the_cached_kernel_directly(monkeypatch):
    # flash_attn_func's fast path (dense, no window or softcap, kernel already in memory): the kernel gets
    # q, k, v as they are when their layout is the kernel's (packed qkv slices included), a copy otherwise,
    # and the scalars (scale, softcap 0, windows 0 0). A kernel not yet in memory goes through forward().
    from flash_attn.cute import interface

    calls = []

    def fake(q, k, v, out, lse, *scalars):
        calls.append((q, k, v, out, lse, scalars))

    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    # (both kernels of each key: the "short" one serves seqlen_k <= config.SHORT_SK at d64 non-causal)
    _kernel_table(monkeypatch, {(torch.bfloat16, 64, c, "sm_90a", False, False) + s: fake
                                for c in (False, True) for s in ((), ("short",))})
    B, S, H, D = 2, 16, 4, 64
    qkv = torch.randn(B, S, 3, H, D, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out, lse = interface.flash_attn_func(q, k, v, causal=True, return_lse=True)
    (cq, ck, cv, cout, clse, scalars), = calls
    assert cq is q and ck is k and cv is v and cout is out and clse is lse
    assert scalars == (D ** -0.5, 0.0, 0, 0)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (B, H, S) and lse.dtype == torch.float32
    assert interface.flash_attn_func(q, k, v, causal=True)[1] is None  # lse only when asked (FA4's API)
    calls.clear()
    qt = torch.randn(B, H, S, D, dtype=torch.bfloat16).transpose(1, 2)  # heads S*D apart: not the layout
    interface.flash_attn_func(qt, k, v, softmax_scale=0.5)
    (cq, ck, cv, _, _, scalars), = calls
    assert cq is not qt and torch.equal(cq, qt) and cq.stride() == (S * H * D, H * D, D, 1) and ck is k
    assert scalars == (0.5, 0.0, 0, 0)
    # not in memory: the general path (which would compile); a window: the general path too
    seen = []
    monkeypatch.setattr(interface, "forward", lambda *a, **kw: seen.append(a) or ("out", "lse"))
    assert interface.flash_attn_func(q.half(), k.half(), v.half()) == ("out", None)
    assert interface.flash_attn_func(q, k, v, window_size=(8, None), return_lse=True) == ("out", "lse")
    assert len(seen) == 2 and seen[1][6:8] == (8, interface._UNBOUNDED) and len(calls) == 1


def test_common_call_reuses_an_unreturned_lse(monkeypatch):
    # The fast path's lse when the call does not return it: one fp32 (B, H, Sq) buffer per (device, stream, B, H, Sq),
    # handed to the kernel on every such call (nobody reads it); return_lse gets a fresh one each call. Buffers
    # above _LSE_SCRATCH_MAX_ELEMS are not kept, and the table is emptied when it reaches
    # _LSE_SCRATCH_MAX_SHAPES shapes.
    from flash_attn.cute import interface

    lses = []
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    _kernel_table(monkeypatch, {(torch.bfloat16, 64, False, "sm_90a", False, False) + s:
                                (lambda q, k, v, out, lse, *a: lses.append(lse)) for s in ((), ("short",))})
    scratch = {}  # where launch._new_lse_scratch keeps the buffers and launch._lse_buffer reads them
    monkeypatch.setattr(launch, "_lse_scratch", scratch)
    mk = lambda b, s, h: [torch.randn(b, s, h, 64, dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
    q, k, v = mk(2, 16, 4)
    assert interface.flash_attn_func(q, k, v)[1] is None
    assert interface.flash_attn_func(q, k, v)[1] is None
    assert lses[0] is lses[1] and lses[0].shape == (2, 4, 16) and lses[0].dtype == torch.float32
    assert scratch == {(-1, 0, 2, 4, 16): lses[0]}  # CPU tensors: get_device() is -1, stream 0
    _, lse = interface.flash_attn_func(q, k, v, return_lse=True)
    _, lse2 = interface.flash_attn_func(q, k, v, return_lse=True)
    assert lse is lses[2] and lse2 is lses[3] and lse is not lse2 and lse is not lses[0]
    interface.flash_attn_func(*mk(2, 8, 4))
    assert lses[4].shape == (2, 4, 8) and len(scratch) == 2
    monkeypatch.setattr(launch, "_LSE_SCRATCH_MAX_ELEMS", 2 * 4 * 8)
    interface.flash_attn_func(*mk(2, 9, 4))  # above the size limit: used once, not kept
    assert lses[5].shape == (2, 4, 9) and len(scratch) == 2
    monkeypatch.setattr(launch, "_LSE_SCRATCH_MAX_SHAPES", 2)
    interface.flash_attn_func(*mk(1, 8, 4))
    assert list(scratch) == [(-1, 0, 1, 4, 8)]
    # another stream gets its own buffer: a table drop frees a buffer only in the order of the stream that wrote it
    monkeypatch.setattr(launch, "_LSE_SCRATCH_MAX_SHAPES", 8)
    monkeypatch.setattr(launch, "_stream_id", lambda index: 7)
    interface.flash_attn_func(*mk(1, 8, 4))
    assert list(scratch) == [(-1, 0, 1, 4, 8), (-1, 7, 1, 4, 8)] and lses[-1] is scratch[(-1, 7, 1, 4, 8)]


def test_per_call_checks_name_what_is_not_a_4d_tensor():
    from flash_attn.cute import interface

    q = torch.zeros(2, 8, 4, 64, dtype=torch.bfloat16)
    for args, name in [((q[0], q, q), "q"), ((q, None, q), "k"), ((q, q, [1]), "v"),
                       ((q.float().numpy(), q, q), "q")]:
        with pytest.raises(ValueError, match=f"{name} must be a 4-D tensor"):
            interface.flash_attn_func(*args)
    with pytest.raises(ValueError, match="fp16 or bf16; got torch.bfloat16, torch.float16"):
        interface.flash_attn_func(q, q.half(), q)


@pytest.mark.parametrize("degree,max_rel", [(2, 2.0e-3), (3, 1.1e-4), (4, 3.0e-6)])
def test_exp2_poly_reference_error(degree, max_rel):
    """The kernel's polynomial exp2, step for step on CPU (exp2_poly_reference mirrors the PTX), against
    exp2 in float64: relative error over [-125.5, 0] and near 0, exact 1 at 0 and 0 at -inf / <= -127,
    below 2^-125 in between."""
    from flash_attn.cute.softmax_exp import exp2_poly_reference

    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-127, 0, 1_000_001), -torch.rand(500_000, generator=gen) * 127,
                   -torch.rand(100_000, generator=gen) * 1e-3, -torch.logspace(-40, 0, 5_000),
                   torch.tensor([-0.5, -1.5, -125.5, -126.5, 1e-7, 3e-7])]).float()
    y = exp2_poly_reference(x, degree).double()
    ref = torch.exp2(x.double())
    normal = x >= -125.5
    rel = (y - ref).abs()[normal] / ref[normal]
    assert rel.max().item() <= max_rel
    assert rel[x[normal] > -1e-3].max().item() <= 1e-5  # near 0 (the row maximum's neighbourhood)
    assert (y - ref).abs()[~normal].max().item() < 2.0 ** -125
    assert torch.all(y >= 0)
    special = torch.tensor([0.0, -0.0, -math.inf, -127.0, -128.0, -1e30, -1.0, -2.0, -20.0])
    assert exp2_poly_reference(special, degree).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.25,
                                                             2.0 ** -20]


def test_exp2_emulated_columns_spread_evenly():
    from flash_attn.cute.softmax_exp import emulated_columns

    assert emulated_columns(32, 0) == [False] * 32
    assert emulated_columns(32, 16) == [True] * 32
    for e in range(17):
        cols = emulated_columns(32, e)
        assert sum(cols) == 2 * e and sum(cols[:16]) == e


def test_exp2_emu_in_the_cache_key_only_when_on(cute_env):
    args = (torch.bfloat16, 64, False, "sm_90a")
    base = kernels.fwd_config(*args).key()
    assert "exp2_emu" not in base and "exp2_emu_degree" not in base
    cute_env(OVERRIDES="fwd.exp2_emu=0")
    assert kernels.fwd_config(*args).key() == base
    cute_env(OVERRIDES="fwd.exp2_emu=0,fwd.exp2_emu_degree=4")
    assert kernels.fwd_config(*args).key() == base  # the degree alone changes nothing
    cute_env(OVERRIDES="fwd.exp2_emu=4,fwd.exp2_emu_degree=4")
    assert kernels.fwd_config(*args).key() == {**base, "exp2_emu": 4, "exp2_emu_degree": 4}
    cute_env(OVERRIDES="fwd.exp2_emu=4,fwd.exp2_emu_degree=3")
    assert kernels.fwd_config(*args).key() == {**base, "exp2_emu": 4}
    kernel = kernels._make_kernel(kernels.fwd_config(*args))
    assert (kernel.exp2_emu, kernel.exp2_emu_degree) == (4, 3)
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    with pytest.raises(ValueError, match="exp2_emu"):
        FlashFwdSm90(kernel.dtype, 64, False, exp2_emu=17)


def test_block_n_in_the_cache_key_only_when_not_128(monkeypatch, cute_env):
    monkeypatch.setattr(config, "WARPGROUPS", {64: 2, 128: 2})
    args = (torch.bfloat16, 128, True, "sm_90a")
    base = kernels.fwd_config(*args).key()
    assert "block_n" not in base and kernels._make_kernel(kernels.fwd_config(*args)).block_n == 128
    cute_env(OVERRIDES="fwd.block_n=128")
    assert kernels.fwd_config(*args).key() == base
    cute_env(OVERRIDES="fwd.block_n=64")
    assert kernels.fwd_config(*args).key() == {**base, "block_n": 64}
    assert kernels._make_kernel(kernels.fwd_config(*args)).block_n == 64


def test_exp2_emu_moves_exponentials_off_mufu(tmp_path, cute_env):
    """One compile with 4 of 16 exponentials emulated: per softmax site (2 rows of 32 scores plus 2
    correction factors) the PTX holds 50 ex2.approx and 16 polynomial sequences; in the SASS the
    CuTeDSL cubin holds as many MUFU.EX2 as the PTX has ex2 (the polynomials stay on FADD / FFMA)."""
    import subprocess

    cute_env(OVERRIDES="fwd.exp2_emu=4")
    compile_fwd(torch.bfloat16, 64, False, arch="sm_90a", dump_dir=str(tmp_path))
    (ptx_path,) = glob.glob(str(tmp_path / "*.ptx"))
    text = open(ptx_path).read()
    n_ex2 = _count(text, "ex2.approx")
    n_poly = _count(text, "add.rn.f32 %e2_t")
    sites = n_poly // 16
    assert sites >= 2 and n_poly == 16 * sites and n_ex2 == 50 * sites
    tool = cuobjdump_path()
    (cubin,) = glob.glob(str(tmp_path / "*.cubin"))
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    assert sass.count("MUFU.EX2") == n_ex2
    assert sass.count(", 12582912 ;") == n_poly  # the range reduction's t = x + 1.5 * 2^23
    assert sass.count(", -127, !PT") == n_poly  # the clamp at -127 (FMNMX)


# ----------------------------------------------------------------------------------------------------
# Three consumer warpgroups (BLOCK_M 192; fwd.warpgroups / config.WARPGROUPS)


def test_default_forward_uses_three_warpgroups_for_d64_without_a_mask(cute_env):
    # same-process A/B on the H200 (benchmarks/attention/ab_cute_fwd.py): +4-13% at d64 non-causal, -12% at causal 1k
    cfg = lambda d, causal, **kw: kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()  # noqa: E731
    assert cfg(64, False)["warpgroups"] == 3 and cfg(64, False, varlen=True)["warpgroups"] == 3
    assert "warpgroups" not in cfg(64, True) and "warpgroups" not in cfg(64, False, local=True)
    assert "warpgroups" not in cfg(128, False) and "warpgroups" not in cfg(128, True)


def test_wide_key_blocks_pack_p():
    """Two warpgroups at d64 / d128 convert P element-wise up to 128 keys per block (the measured SASS);
    wider blocks pack it (element-wise, d128 BLOCK_N 176 spills 348 bytes at 240 registers)."""
    import cutlass
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    for d in (64, 128):
        assert not FlashFwdSm90(cutlass.BFloat16, d, False, block_n=128, num_stages=2).pack_p
        assert FlashFwdSm90(cutlass.BFloat16, d, False, block_n=176, num_stages=2).pack_p


def test_warpgroups_in_the_cache_key_only_when_not_2(monkeypatch, cute_env):
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    def fwd(d, causal=True, **kw):
        return kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw)

    monkeypatch.setattr(config, "WARPGROUPS", {64: 2, 128: 2})
    cfg = {d: fwd(d).key() for d in (64, 128)}
    for d, c in cfg.items():
        assert "warpgroups" not in c and "block_n" not in c
        kernel = kernels._make_kernel(fwd(d))
        assert (kernel.num_mma_warpgroups, kernel.block_m, kernel.block_n, kernel.num_threads) == (2, 128, 128, 384)
        assert (kernel.producer_regs, kernel.consumer_regs, kernel.pack_p) == (24, 240, False)
    cute_env(OVERRIDES="fwd.warpgroups=3")
    for d in (64, 128):
        c = fwd(d)
        block_n = config.BLOCK_N_3WG[d]
        assert c.key() == {**cfg[d], "warpgroups": 3, **({"block_n": block_n} if block_n != 128 else {})}
        kernel = kernels._make_kernel(c)
        assert (kernel.num_mma_warpgroups, kernel.block_m, kernel.num_threads) == (3, 192, 512)
        assert (kernel.producer_regs, kernel.consumer_regs, kernel.pack_p) == (24, 160, True)
        assert kernel.block_n == block_n
        # softcap, varlen or a window: the smaller block that fits the registers with their extra state
        for kw in (dict(softcap=True), dict(varlen=True), dict(local=True)):
            assert kernels._make_kernel(fwd(d, **kw)).block_n == config.BLOCK_N_3WG_OPTIONS[d]
        assert kernels._make_kernel(fwd(d, sink=True)).block_n == block_n
    # (per-head-dim values are gone: the override applies to every head dim, and one without a three-warpgroup
    # tile refuses it)
    for d in (96, 192, 256):
        with pytest.raises(ValueError, match=f"no three-warpgroup tile for head dim {d}"):
            fwd(d)
    if kernels._tvm_ffi():  # disk cache entries: the warpgroup count in the name when not 2
        assert "-wg3-" in kernels._entry(torch.bfloat16, 64, True, "sm_90a")[2]
        assert "-wg3-" in kernels._entry(torch.bfloat16, 128, True, "sm_90a")[2]
    cute_env(OVERRIDES="fwd.warpgroups=3,fwd.block_n=112")  # the block-size field still wins
    assert fwd(64).block_n == 112
    cute_env(OVERRIDES=None)
    assert fwd(128).key() == cfg[128]
    if kernels._tvm_ffi():
        assert "-wg" not in kernels._entry(torch.bfloat16, 128, True, "sm_90a")[2]
    # the table alone selects it, and the override overrides the table both ways
    monkeypatch.setattr(config, "WARPGROUPS", {64: 3, 128: 2})
    assert fwd(64, False).key()["warpgroups"] == 3
    # causal and windowed calls read their own table
    assert "warpgroups" not in fwd(64).key()
    assert "warpgroups" not in fwd(64, False, local=True).key()
    monkeypatch.setattr(config, "WARPGROUPS_MASKED", {64: 3, 128: 2})
    assert fwd(64).key()["warpgroups"] == 3
    cute_env(OVERRIDES="fwd.warpgroups=2")
    assert "warpgroups" not in fwd(64, False).key()
    # register budgets: producer warpgroup + consumers within the SM's 64K registers, multiples of 8
    for n, (producer, consumer) in FlashFwdSm90.REGS.items():
        assert 128 * producer + 128 * n * consumer <= 65536 and producer % 8 == 0 and consumer % 8 == 0
    with pytest.raises(ValueError, match="num_warpgroups"):
        FlashFwdSm90(kernel.dtype, 64, False, num_warpgroups=4)
    with pytest.raises(ValueError, match="block_m"):
        FlashFwdSm90(kernel.dtype, 64, False, block_m=128, num_warpgroups=3)


# (dtype, head dim, causal, variant flags): the variants the 3-warpgroup kernel serves, each compiled once
CONFIGS3 = [(torch.bfloat16, 64, False, {}), (torch.float16, 64, True, {}), (torch.bfloat16, 64, True, dict(sink=True)),
            (torch.bfloat16, 64, False, dict(local=True, softcap=True)),
            (torch.float16, 64, True, dict(varlen=True, sink=True)),
            (torch.bfloat16, 64, True, dict(varlen=True, softcap=True)), (torch.bfloat16, 128, True, {})]


def _ids3(cfg):
    dtype, d, causal, kw = cfg
    return f"{str(dtype).split('.')[-1]}-d{d}-{'causal' if causal else 'full'}{''.join('-' + k for k in kw)}"


@pytest.fixture(scope="module", params=CONFIGS3, ids=_ids3)
def three_wg(request, tmp_path_factory):
    """(config key, block_n, PTX text, cubin path) of the forward built with fwd.warpgroups=3."""
    dtype, d, causal, kw = request.param
    dump = tmp_path_factory.mktemp("ptx3")
    # fwd.tma_o=0: the direct O store (these tests count the named barriers)
    with _cute_settings(OVERRIDES="fwd.warpgroups=3,fwd.tma_o=0"):
        config = kernels.fwd_config(dtype, d, causal, "sm_90a", **kw).key()
        compile_fwd(dtype, d, causal, arch="sm_90a", dump_dir=str(dump), **kw)
    (path,) = glob.glob(str(dump / "*.ptx"))
    (cubin,) = glob.glob(str(dump / "*.cubin"))
    with open(path) as f:
        return request.param, config, f.read(), path, cubin


def test_three_warpgroups_ptx(three_wg):
    """512 threads, setmaxnreg 24 / 160, the two WGMMAs at BLOCK_N (P from registers), TMA loads, the
    round robin's named barriers (the up-front turn on barrier 1, arrives and waits of 2 x 128 threads),
    and P converted pairwise into the registers the WGMMA reads (no 16-bit values packed at the WGMMA)."""
    (dtype, d, _, kw), config, text, _, _ = three_wg
    assert config["warpgroups"] == 3
    block_n = config.get("block_n", 128)
    ab = "bf16.bf16" if dtype == torch.bfloat16 else "f16.f16"
    pair = "cvt.rn.bf16x2.f32" if dtype == torch.bfloat16 else "cvt.rn.f16x2.f32"
    assert _count(text, pair) >= 2 * (block_n // 4)  # a thread's 64 x BLOCK_N / 128 scores, two sites
    assert not any(line.lstrip().startswith("mov.b32") and "{%rs" in line for line in text.splitlines())
    assert ".reqntid 512, 1, 1" in text
    assert _count(text, "setmaxnreg.dec.sync.aligned.u32 \t24;") == 1
    assert _count(text, "setmaxnreg.inc.sync.aligned.u32 \t160;") == 1
    assert _count(text, "setmaxnreg") == 2
    assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.{ab}") >= d // 16
    assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{ab}") >= block_n // 16
    assert _count(text, "cp.async.bulk.tensor") >= 3
    assert _count(text, "bar.arrive 1, 256;") == 1  # the last warpgroup hands warpgroup 0 the first turn
    assert _count(text, "bar.arrive") >= 2 and _count(text, "bar.sync") >= 3  # + __syncthreads (bar.sync 0)
    assert all(line.rstrip(";").endswith(", 256") for line in text.splitlines()
               if line.lstrip().startswith(("bar.arrive", "bar.sync")) and "bar.sync \t0" not in line)
    assert ("tanh.approx" in text) == bool(kw.get("softcap"))


def test_three_warpgroups_softmax_ends_before_the_p_v_wait(three_wg):
    """The round-robin loop is pinned too (test_ptx_softmax_ends_before_the_p_v_wait), except with a sink,
    where the pin costs a spilled register at 160 (FlashFwdSm90: pin off there)."""
    (_, _, _, kw), _, text, _, _ = three_wg
    if kw.get("sink"):
        assert "// pin" not in text
    else:
        assert "// pin masked" in text and "// pin unmasked" in text
        assert _exps_from_pv_wait_block(text) == 0


@pytest.mark.skipif(__import__("shutil").which("ptxas") is None, reason="ptxas not on PATH")
def test_three_warpgroups_fit_160_registers(three_wg):
    """ptxas keeps the register split (no C7508 'setmaxnreg ignored'), spills nothing, does not serialise
    the WGMMAs and injects no warpgroup.arrive (C7510-C7520) at the 160-register consumer budget; the cubin
    CuTeDSL built (what runs) has no local-memory traffic and one WARPGROUP.ARRIVE per GEMM either."""
    import subprocess

    _, config, text, ptx_path, cubin = three_wg
    assert_ptxas_clean(ptx_path)  # no spill, no C75xx message
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    assert "HGMMA" in sass and " STL" not in sass and " LDL" not in sass
    fences = sum(line.lstrip().startswith("wgmma.fence") for line in text.splitlines())
    assert sass.count("WARPGROUP.ARRIVE") == fences  # none injected


@pytest.mark.parametrize("warpgroups", [2, 3])
def test_wg_order_off_drops_the_named_barriers(tmp_path, cute_env, warpgroups):
    """fwd.wg_order=0 (in the key only then): no bar.sync / bar.arrive but __syncthreads;
    the same WGMMAs as the ordered kernel."""
    texts = []
    for unordered in (False, True):
        cute_env(OVERRIDES=f"fwd.warpgroups={warpgroups}" + (",fwd.wg_order=0" if unordered else ""))
        cfg = kernels.fwd_config(torch.bfloat16, 64, True, "sm_90a")
        assert cfg.key().get("wg_order", True) == (not unordered)
        assert kernels._make_kernel(cfg).wg_order == (not unordered)
        dump = tmp_path / ("unordered" if unordered else "ordered")
        dump.mkdir()
        compile_fwd(torch.bfloat16, 64, True, arch="sm_90a", dump_dir=str(dump))
        (path,) = glob.glob(str(dump / "*.ptx"))
        texts.append(open(path).read())
    # (no per-head-dim values any more: the field applies to every head dim)
    assert kernels.fwd_config(torch.bfloat16, 128, True, "sm_90a").key()["wg_order"] is False
    cute_env(OVERRIDES=f"fwd.warpgroups={warpgroups}")
    assert "wg_order" not in kernels.fwd_config(torch.bfloat16, 128, True, "sm_90a").key()
    ordered, unordered = texts
    assert _count(ordered, "bar.arrive") >= 2 and _count(ordered, "bar.sync") >= 3
    assert _count(unordered, "bar.arrive") == 0 and _count(unordered, "bar.sync") == 1  # __syncthreads
    assert _count(ordered, "wgmma.mma_async") == _count(unordered, "wgmma.mma_async")


@pytest.mark.skipif(__import__("shutil").which("ptxas") is None, reason="ptxas not on PATH")
def test_default_kernels_fit_their_registers(ptx, tmp_path):
    """The default kernels (2 consumer warpgroups at 240 registers, d64 without a mask 3 at 160): no spills
    and no serialised WGMMAs either (the 3-warpgroup test's checks)."""

    _, text = ptx
    path = tmp_path / "k.ptx"
    path.write_text(text)
    assert_ptxas_clean(path)  # no spill, no C7508 / C7510-C7520 message
    assert ".reqntid 384, 1, 1" in text or ".reqntid 512, 1, 1" in text


# ----------------------------------------------------------------------------------------------------
# Head dims 96, 192, 256 (2 consumer warpgroups at 240 registers, packed P; the root dispatcher sends
# them here unless FLASH_ATTN_CUTE_DISABLE names d96 / d192 / d256)

# (dtype, head dim, causal, variant): each head dim's plain kernels and its heaviest variants
CONFIGS_WIDE = [(torch.bfloat16, 256, False, {}), (torch.float16, 256, True, {}),
                (torch.bfloat16, 256, False, dict(local=True, softcap=True, varlen=True, sink=True)),
                (torch.bfloat16, 192, False, {}), (torch.float16, 192, True, dict(sink=True)),
                (torch.bfloat16, 192, False, dict(local=True)),
                (torch.bfloat16, 96, False, {}), (torch.float16, 96, True, dict(varlen=True, softcap=True))]


@pytest.fixture(scope="module", params=CONFIGS_WIDE, ids=_ids3)
def wide(request, tmp_path_factory):
    """(config, forward config key, PTX text, PTX path, cubin path) of a head-dim 96 / 192 / 256 forward."""
    dtype, d, causal, kw = request.param
    dump = tmp_path_factory.mktemp("ptxwide")
    with _cute_settings():  # no overrides
        config = kernels.fwd_config(dtype, d, causal, "sm_90a", **kw).key()
        compile_fwd(dtype, d, causal, arch="sm_90a", dump_dir=str(dump), **kw)
    (path,) = glob.glob(str(dump / "*.ptx"))
    (cubin,) = glob.glob(str(dump / "*.cubin"))
    with open(path) as f:
        return request.param, config, f.read(), path, cubin


def test_wide_head_dims_ptx(wide):
    """384 threads, setmaxnreg 24 / 240, S = Q K^T at m64n{BLOCK_N} and O += P V at m64n{D} with P
    converted pairwise into the registers the WGMMA reads, TMA loads of Q, K and V."""
    (dtype, d, _, kw), config, text, _, _ = wide
    block_n = config.get("block_n", 128)
    ab = "bf16.bf16" if dtype == torch.bfloat16 else "f16.f16"
    pair = "cvt.rn.bf16x2.f32" if dtype == torch.bfloat16 else "cvt.rn.f16x2.f32"
    assert ".target sm_90a" in text and ".reqntid 384, 1, 1" in text
    assert _count(text, "setmaxnreg.dec.sync.aligned.u32 \t24;") == 1
    assert _count(text, "setmaxnreg.inc.sync.aligned.u32 \t240;") == 1
    assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.{ab}") >= d // 16
    assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.{ab}") >= block_n // 16
    assert _count(text, pair) >= 2 * (block_n // 4)
    assert not any(line.lstrip().startswith("mov.b32") and "{%rs" in line for line in text.splitlines())
    assert _count(text, "cp.async.bulk.tensor") >= 3 and "mbarrier.try_wait" in text
    assert ("tanh.approx" in text) == bool(kw.get("softcap"))


@pytest.mark.skipif(__import__("shutil").which("ptxas") is None, reason="ptxas not on PATH")
def test_wide_head_dims_fit_240_registers(wide):
    """ptxas: no spill, no C75xx message (setmaxnreg ignored, WGMMAs serialised, warpgroup.arrive
    injected); the cubin CuTeDSL built: no local memory, one WARPGROUP.ARRIVE per wgmma.fence, and
    registers numbered past the 168 that 384 threads get at launch, i.e. ptxas allocated the consumers
    against their setmaxnreg budget (the accumulators alone exceed 168 at d192 / d256)."""
    import re
    import subprocess

    (_, d, _, _), config, text, ptx_path, cubin = wide
    assert_ptxas_clean(ptx_path)  # no spill, no C75xx message
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    assert "HGMMA" in sass and " STL" not in sass and " LDL" not in sass
    fences = sum(line.lstrip().startswith("wgmma.fence") for line in text.splitlines())
    assert sass.count("WARPGROUP.ARRIVE") == fences
    top = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass))
    if d > 128:
        assert 168 <= top < 240, top


def test_wide_head_dim_configs(cute_env):
    """The tile tables: every default forward configuration fits shared memory; d256 takes FA3's 80-key
    blocks in 2 stages, d192 112 (96 with a window), d96 4 stages of 128; overrides of block_n and stages apply to
    every head dim; fwd.warpgroups=3 at a wide head dim (no three-warpgroup tile) is refused with ValueError; an
    oversized tile is refused."""
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    def cfg(d, causal=False, **kw):
        c = kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw)
        return c.block_n, c.stages, c.warpgroups

    assert cfg(256) == cfg(256, True) == cfg(256, local=True) == (80, 2, 2)
    assert cfg(192) == cfg(192, True, softcap=True, varlen=True) == (112, 2, 2)
    assert cfg(192, local=True) == cfg(192, True, local=True, sink=True) == (96, 2, 2)
    assert cfg(96) == cfg(96, True) == (128, 4, 2)
    for d in config.SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            for kw in ({}, dict(local=True), dict(softcap=True, varlen=True)):
                for wg in ("", "3"):
                    cute_env(OVERRIDES=f"fwd.warpgroups={wg}" if wg else None)
                    if wg and d not in (64, 128):
                        with pytest.raises(ValueError, match=f"no three-warpgroup tile for head dim {d}"):
                            kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw)
                        continue
                    kernel = kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw))
                    assert kernel.smem_bytes() <= FlashFwdSm90.SMEM_BYTES
                    table = config.WARPGROUPS_MASKED if causal or kw.get("local") else config.WARPGROUPS
                    assert kernel.num_mma_warpgroups == (3 if wg else table.get(d, 2))
    cute_env(OVERRIDES=None)
    assert FlashFwdSm90(cute_dtype(torch.bfloat16), 256, False, block_n=80, num_stages=2).smem_bytes() == 230400
    cute_env(OVERRIDES="fwd.block_n=64")
    assert cfg(256)[0] == cfg(128)[0] == cfg(192)[0] == 64
    cute_env(OVERRIDES="fwd.block_n=64,fwd.stages=3")
    assert cfg(256)[1] == cfg(128)[1] == cfg(64)[1] == 3
    with pytest.raises(ValueError, match="shared memory"):
        kernels._make_kernel(kernels.fwd_config(torch.bfloat16, 256, False, "sm_90a"))  # 64 x 3 stages
    with pytest.raises(ValueError, match="multiple of 16"):
        FlashFwdSm90(cute_dtype(torch.bfloat16), 256, False, block_n=72, num_stages=2)


def cute_dtype(dtype):
    return kernels._cutlass_dtype(dtype)


def test_backend_gates_the_wide_head_dims(cute_env):
    """The dispatcher's cute backend: d96 / d192 / d256 forwards by default, but those that
    FLASH_ATTN_CUTE_DISABLE names (d96, d192, d256); their backward too (unless named; d256's with a causal mask
    only, the plan rule bwd_d256; tests/cute/test_cute_bwd_wide.py has the rules); the package API accepts them."""
    from flash_attn.cute import backend, interface

    assert backend.forward_head_dims() == (64, 96, 128, 192, 256)
    assert backend.backward_head_dims() == (64, 96, 128, 192, 256)
    for d in (96, 192, 256):
        assert backend.unsupported_reason(_call(head_dim=d, head_dim_v=d, causal=True)) is None
        assert backend.unsupported_reason(_call(head_dim=d, head_dim_v=d, backward=True, causal=True)) is None
        assert (backend.unsupported_reason(_call(head_dim=d, head_dim_v=d, backward=True)) is None) == (d != 256)
    cute_env(DISABLE="d96,d192,d256")
    assert backend.forward_head_dims() == (64, 128)
    assert backend.backward_head_dims() == (64, 128)
    for d in (96, 192, 256):
        reason = backend.unsupported_reason(_call(head_dim=d, head_dim_v=d))
        assert reason is not None and settings.DISABLE in reason and f"d{d}" in reason, reason
        interface._check_dims(d, d, 4, 2)  # flash_attn.cute.flash_attn_func's check
    reason = backend.unsupported_reason(_call(head_dim=96, head_dim_v=96, backward=True))
    assert reason is not None and settings.DISABLE in reason and "d96" in reason, reason
    cute_env(DISABLE="d96,d192")
    assert backend.forward_head_dims() == (64, 128, 256)
    assert backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, causal=True)) is None
    assert backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, varlen=True, window_left=8)) is None
    assert "head dims 192" in backend.unsupported_reason(_call(head_dim=192, head_dim_v=192))
    assert "bwd_d256" in backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, backward=True))
    assert backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, backward=True, causal=True)) is None
    assert "head dims 256/128" in backend.unsupported_reason(_call(head_dim=256, head_dim_v=128))
    cute_env(DISABLE="paged, Split")  # other features leave every head dim on (names: any case, spaces)
    assert backend.forward_head_dims() == (64, 96, 128, 192, 256)
    assert backend.backward_head_dims() == (64, 96, 128, 192, 256)
    for d in (96, 192):
        assert backend.unsupported_reason(_call(head_dim=d, head_dim_v=d)) is None
        assert backend.unsupported_reason(_call(head_dim=d, head_dim_v=d, backward=True)) is None
    with pytest.raises(NotImplementedError, match="head dim 72"):
        interface._check_dims(72, 72, 4, 2)
    for bad in ("256", "d72", "96,192"):  # a head dim without its "d", or one with no gated kernel
        with pytest.raises(ValueError, match=settings.DISABLE):
            cute_env(DISABLE=bad)


def test_precompile_takes_the_enabled_head_dims(cute_env, tmp_path):
    """python -m flash_attn.cute.precompile: the default head dims are those FLASH_ATTN_CUTE_DISABLE leaves on;
    any forward head dim may be named; --backward builds backward kernels for d64 / d96 / d128 only."""
    from flash_attn.cute import precompile

    assert precompile.default_head_dims() == (64, 96, 128, 192, 256)
    cute_env(DISABLE="d96,d192,d256")
    assert precompile.default_head_dims() == (64, 128)
    cute_env(DISABLE="d96,d192")
    assert precompile.default_head_dims() == (64, 128, 256)
    assert precompile.precompile(str(tmp_path), "sm_90a", head_dims=(256, 192), kinds=("bwd",)) == []
    with pytest.raises(SystemExit):
        precompile.main(["--out", str(tmp_path), "--head-dims", "72"])


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [
    (2, 128, 128, 4, 4), (1, 1, 1, 2, 2), (2, 113, 203, 6, 2), (1, 1023, 1023, 4, 1),
    (2, 256, 77, 2, 2), (1, 300, 1200, 8, 4)])
def test_matches_reference_on_gpu(dtype, d, causal, batch, seqlen_q, seqlen_k, heads, heads_kv):
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)

    # lse against fp32 logsumexp of the masked scores (bottom-right aligned causal mask).
    kk = k.float().repeat_interleave(heads // heads_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) / math.sqrt(d)
    if causal:
        i = torch.arange(seqlen_q, device="cuda").view(-1, 1)
        j = torch.arange(seqlen_k, device="cuda").view(1, -1)
        s = s.masked_fill(j > i + seqlen_k - seqlen_q, -math.inf)
    lse_ref = torch.logsumexp(s, dim=-1)
    lse_ref = torch.where(torch.isneginf(lse_ref), torch.full_like(lse_ref, math.inf), lse_ref)
    assert lse.shape == (batch, heads, seqlen_q)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_pinned_loop_equals_unpinned_on_gpu(monkeypatch, cute_env, d):
    """softmax.pin only moves instructions (a mov per value that ptxas folds away): out and lse of a causal call
    are bitwise those of the loop built without it (fwd.pin=0). d64 causal is the
    persistent kernel, d128 / d256 the one-tile one; 3001 x 2500 spans masked and unmasked blocks."""
    from flash_attn.cute import flash_attn_func

    torch.manual_seed(0)
    q = torch.randn(2, 3001, 8, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2500, 2, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 2500, 2, d, device="cuda", dtype=torch.bfloat16)
    _kernel_table(monkeypatch)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    cute_env(OVERRIDES="fwd.pin=0")
    _kernel_table(monkeypatch)
    ref_out, ref_lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("exp2_emu,degree,dtype", [(4, 3, torch.bfloat16), (16, 3, torch.bfloat16),
                                                   (8, 4, torch.float16), (8, 2, torch.bfloat16)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_exp2_emulation_matches_reference_on_gpu(monkeypatch, cute_env, exp2_emu, degree, dtype, d, causal):
    """test_matches_reference_on_gpu's checks with a share of the softmax's exponentials (16: all of them)
    computed by the polynomial (fwd.exp2_emu)."""
    cute_env(OVERRIDES=f"fwd.exp2_emu={exp2_emu},fwd.exp2_emu_degree={degree}")
    _kernel_table(monkeypatch)  # the in-memory table does not key on the overrides
    for shape in [(2, 128, 128, 4, 4), (2, 113, 203, 6, 2), (1, 1023, 1023, 4, 1), (1, 300, 1200, 8, 4)]:
        test_matches_reference_on_gpu(dtype, d, causal, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, (64, 16)), (False, (-1, 40)), (False, (100, -1)),
                                           (True, (48, -1)), (False, (0, 0)), (False, (-1, -1))])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [
    (2, 333, 333, 4, 2), (1, 129, 517, 2, 1), (1, 700, 200, 2, 2)])
def test_window_and_softcap_match_reference_on_gpu(d, causal, window, softcap, batch, seqlen_q, seqlen_k,
                                                    heads, heads_kv):
    from flash_attn.cute import flash_attn_func

    if window == (-1, -1) and not softcap:
        pytest.skip("plain attention: test_matches_reference_on_gpu")
    torch.manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, heads_kv, d, device="cuda", dtype=dtype)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=fa4_window(window), softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    ref_window = (window[0], 0 if causal else window[1])
    kw = dict(causal=causal, window_size=ref_window, softcap=softcap)
    out_ref, _ = attention_ref(q, k, v, **kw)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **kw)
    assert_close_to_ref(out, out_ref, out_pt)
    # lse where a row sees keys, +inf where it sees none
    kk = k.float().repeat_interleave(heads // heads_kv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kk) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(seqlen_q, device="cuda").view(-1, 1) + seqlen_k - seqlen_q
    j = torch.arange(seqlen_k, device="cuda").view(1, -1)
    visible = torch.ones_like(s[0, 0], dtype=torch.bool)
    if ref_window[0] >= 0:
        visible &= j >= i - ref_window[0]
    if ref_window[1] >= 0:
        visible &= j <= i + ref_window[1]
    lse_ref = torch.logsumexp(s.masked_fill(~visible, -math.inf), dim=-1)
    lse_ref = torch.where(torch.isneginf(lse_ref), torch.full_like(lse_ref, math.inf), lse_ref)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse[finite] - lse_ref[finite]).abs().max().item() < 1e-2


def _varlen_case(lens_q, lens_k, heads, heads_kv, d, dtype=torch.bfloat16, extra_q=0):
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(cu_q[-1]) + extra_q, heads, d, device="cuda", dtype=dtype)
    k = torch.randn(int(cu_k[-1]), heads_kv, d, device="cuda", dtype=dtype)
    v = torch.randn(int(cu_k[-1]), heads_kv, d, device="cuda", dtype=dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (50, 10), 0.0), (True, (-1, -1), 15.0)])
@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_matches_reference_per_sequence_on_gpu(d, causal, window, softcap, seqused, lens=None):
    """Each packed sequence (lengths 0, 1, odd, > 2 tiles; Sq != Sk) against the reference on its own
    slice; seqused_k uses a prefix of each sequence's keys; q rows after the last sequence get 0 / +inf.
    lens: (q lengths, k lengths, seqused_k caps) instead of the default sequences."""
    from flash_attn.cute import flash_attn_varlen_func

    torch.manual_seed(0)
    lens_q, lens_k, caps = lens or ([17, 0, 300, 1, 129, 64], [40, 5, 300, 1, 260, 0], [33, 5, 123, 0, 260, 0])
    q, k, v, cu_q, cu_k = _varlen_case(lens_q, lens_k, 4, 2, d, extra_q=3)
    used = [min(n, u) for n, u in zip(lens_k, caps)] if seqused else lens_k
    seqused_k = torch.tensor(used, device="cuda", dtype=torch.int32) if seqused else None
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k, causal=causal,
                                      window_size=fa4_window(window), softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    ref_window = (window[0], 0 if causal else window[1])
    for b, (sq, sk) in enumerate(zip(lens_q, used)):
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        if sq == 0:
            continue
        qs, ks, vs = q[None, q0:q0 + sq], k[None, k0:k0 + sk], v[None, k0:k0 + sk]
        if sk == 0:
            assert torch.all(out[q0:q0 + sq] == 0) and torch.all(torch.isinf(lse[:, q0:q0 + sq]))
            continue
        kw = dict(causal=causal, window_size=ref_window, softcap=softcap)
        out_ref, _ = attention_ref(qs, ks, vs, **kw)
        out_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True, **kw)
        assert_close_to_ref(out[None, q0:q0 + sq], out_ref, out_pt, name=f"out of sequence {b}")
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isinf(lse[:, tail:]))


# Forced 3-warpgroup kernels on the GPU: the same checks as the default kernel's tests, at sequence lengths
# around the 192-row tile (1, 17, 191, 192, 193, 1000, 2048; Sq != Sk), GQA, windows, softcap, varlen
# (seqused_k, empty sequences), and the sink (tests/cute/test_cute_sink.py).


def _force_three_warpgroups(monkeypatch, cute_env, d=64, extra=""):
    cute_env(OVERRIDES="fwd.warpgroups=3" + extra)
    _kernel_table(monkeypatch)  # the in-memory table does not key on the overrides
    assert kernels.fwd_config(torch.bfloat16, d, True, "sm_90a").warpgroups == 3


SHAPES3 = [(1, 1, 1, 2, 2), (2, 17, 17, 4, 2), (1, 191, 191, 4, 4), (2, 192, 192, 4, 1), (1, 193, 193, 2, 2),
           (1, 1000, 1000, 4, 2), (1, 2048, 2048, 2, 1), (2, 193, 1000, 4, 4), (1, 1000, 193, 2, 2),
           (1, 2048, 17, 2, 2), (1, 17, 2048, 2, 1), (1, 385, 191, 6, 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_three_warpgroups_match_reference_on_gpu(monkeypatch, cute_env, dtype, causal):
    _force_three_warpgroups(monkeypatch, cute_env)
    for shape in SHAPES3:
        test_matches_reference_on_gpu(dtype, 64, causal, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("warpgroups", [2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_unordered_warpgroups_match_reference_on_gpu(monkeypatch, cute_env, warpgroups, causal):
    """fwd.wg_order=0 (no ping-pong / round robin) computes the same attention."""
    _force_three_warpgroups(monkeypatch, cute_env)
    cute_env(OVERRIDES=f"fwd.warpgroups={warpgroups},fwd.wg_order=0")
    for shape in [(2, 17, 17, 4, 2), (2, 193, 1000, 4, 4), (1, 2048, 2048, 2, 1), (1, 1000, 193, 2, 2)]:
        test_matches_reference_on_gpu(torch.bfloat16, 64, causal, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal,window,softcap", [(False, (64, 16), 0.0), (True, (48, -1), 20.0),
                                                   (False, (100, -1), 20.0), (False, (0, 0), 0.0),
                                                   (False, (-1, 200), 0.0), (True, (-1, -1), 30.0)])
def test_three_warpgroups_window_and_softcap_on_gpu(monkeypatch, cute_env, causal, window, softcap):
    _force_three_warpgroups(monkeypatch, cute_env)
    for shape in [(2, 333, 333, 4, 2), (1, 193, 517, 2, 1), (1, 700, 191, 2, 2), (1, 1000, 1000, 2, 2)]:
        test_window_and_softcap_match_reference_on_gpu(64, causal, window, softcap, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (50, 10), 0.0), (True, (-1, -1), 15.0)])
def test_three_warpgroups_varlen_on_gpu(monkeypatch, cute_env, causal, window, softcap):
    _force_three_warpgroups(monkeypatch, cute_env)
    lens = ([191, 0, 192, 1, 193, 17, 1000, 385], [191, 5, 300, 1, 193, 0, 1000, 200],
            [100, 5, 192, 0, 193, 0, 999, 200])
    for seqused in (False, True):
        test_varlen_matches_reference_per_sequence_on_gpu(64, causal, window, softcap, seqused)
        test_varlen_matches_reference_per_sequence_on_gpu(64, causal, window, softcap, seqused, lens=lens)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_varlen_bad_cu_seqlens_are_refused_on_gpu():
    from flash_attn.cute import flash_attn_varlen_func

    q, k, v, cu_q, cu_k = _varlen_case([5, 7], [5, 7], 2, 2, 64)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q.long(), cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="never decrease"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=torch.tensor([0, 7, 5], device="cuda", dtype=torch.int32), cu_seqlens_k=cu_k)
    with pytest.raises(ValueError, match="end at most"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k + 1)
    with pytest.raises(ValueError, match="seqused_k"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=torch.tensor([6, 1], device="cuda",
                                                                           dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_root_varlen_calls_use_cute_and_backward_falls_back():
    import flash_attn
    from flash_attn import dispatch

    assert dispatch.select(_call(varlen=True, causal=True)).NAME == "cute"
    torch.manual_seed(0)
    lens = [100, 1, 257]
    q, k, v, cu, _ = _varlen_case(lens, lens, 4, 4, 128)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    for b, n in enumerate(lens):
        s0 = int(cu[b])
        sl = slice(s0, s0 + n)
        qs, ks, vs = (t.detach()[None, sl].requires_grad_() for t in (q, k, v))
        o_ref, _ = attention_ref(qs, ks, vs, causal=True)
        o_pt, _ = attention_ref(qs, ks, vs, causal=True, upcast=False, reorder_ops=True)
        assert_close_to_ref(out[None, sl], o_ref, o_pt, name=f"out {b}")
        g_ref = torch.autograd.grad(o_ref, (qs, ks, vs), g[None, sl])
        g_pt = torch.autograd.grad(o_pt, (qs, ks, vs), g[None, sl])
        for name, mine, r, p in zip("qkv", (dq, dk, dv), g_ref, g_pt):
            assert_close_to_ref(mine[None, sl], r, p, name=f"d{name} {b}")


@pytest.mark.parametrize("varlen", [False, True])
def test_api_refuses_bad_arguments_before_touching_a_gpu(varlen):
    """The FA4-style entry points name what is wrong (checked on CPU tensors: every one of these is
    refused before the device check)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    def qkv(d=64, dv=64, h=4, hk=2, dtype=torch.bfloat16):
        lead = (7,) if varlen else (2, 7)
        return (torch.zeros(*lead, h, d, dtype=dtype), torch.zeros(*lead, hk, d, dtype=dtype),
                torch.zeros(*lead, hk, dv, dtype=dtype))

    def call(q, k, v, **kw):
        if varlen:
            cu = torch.tensor([0, 7], dtype=torch.int32)
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **kw)
        return flash_attn_func(q, k, v, **kw)

    cases = [
        (dict(tensors=qkv(dtype=torch.float32)), ValueError, "fp16 or bf16"),
        (dict(tensors=qkv(d=12, dv=12)), AssertionError, r"\(head_dim, head_dim_v\)=\(12, 12\) is not supported"),
        (dict(tensors=qkv(dv=264)), AssertionError, r"\(head_dim, head_dim_v\)=\(64, 264\) is not supported"),
        (dict(tensors=qkv(d=72, dv=72, h=3)), ValueError, "multiple of k heads"),  # (checked after the padding)
        (dict(tensors=qkv(h=3)), ValueError, "multiple of k heads"),
        (dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
        (dict(learnable_sink=torch.zeros(3)), ValueError, "learnable_sink must have shape \\(4,\\)"),
        (dict(num_splits=2.5), ValueError, "num_splits must be an int"),
    ]
    for kw, exc, msg in cases:
        tensors = kw.pop("tensors", qkv())
        with pytest.raises(exc, match=msg):
            call(*tensors, **kw)
    with pytest.raises(ValueError, match="CUDA tensors"):
        call(*qkv())


# ----------------------------------------------------------------------------------------------------
# The dispatcher's backend module (flash_attn.cute.backend)


def _call(**kw):
    from flash_attn.dispatch import Call

    base = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=128, head_dim_v=128, arch=(9, 0))
    base.update(kw)
    return Call(**base)


def test_backend_admits_only_what_the_kernel_does(cute_env):
    from flash_attn.cute import backend

    assert backend.unsupported_reason(_call()) is None
    assert backend.unsupported_reason(_call(causal=True, head_dim=64, head_dim_v=64,
                                            dtype=torch.float16)) is None
    assert backend.unsupported_reason(_call(window_left=8, softcap=30.0)) is None
    assert backend.unsupported_reason(_call(varlen=True, causal=True)) is None
    assert backend.unsupported_reason(_call(backward=True, causal=True)) is None  # dense: flash_bwd_sm90
    assert backend.unsupported_reason(_call(head_dim=96, head_dim_v=96, backward=True)) is None  # its d96 too
    assert backend.unsupported_reason(_call(backward=True, deterministic=True)) is None  # (bwd_deterministic "writer")
    refused = {
        "device cpu": _call(device_type="cpu", arch=None),
        "compute capability": _call(arch=(8, 0)),
        "dtype": _call(dtype=torch.float32),
        "head dims 72": _call(head_dim=72, head_dim_v=72),
        "head dims 192/64": _call(head_dim=192, head_dim_v=64, backward=True),  # not a pair
        "d256 backward without a causal mask": _call(head_dim=256, head_dim_v=256, backward=True),  # (bwd_d256)
        "head dims 128/64": _call(head_dim_v=64),
        # (plan rule bwd_deterministic "writer": d64-d128 only)
        "backward with deterministic": _call(head_dim=192, head_dim_v=192, backward=True, deterministic=True),
        "backward with paged": _call(backward=True, paged=True),
        "alibi": _call(alibi=True),
        "dropout": _call(dropout_p=0.1),
        "return_probs": _call(return_probs=True),
        "kvcache": _call(kvcache=True),
    }
    for why, call in refused.items():
        reason = backend.unsupported_reason(call)
        assert reason is not None and why in reason, (why, reason)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_dispatcher_serves_forward_and_backward_with_cute(causal):
    """flash_attn.flash_attn_func on Hopper runs this package's forward (automatically, and when forced)
    and its backward, deterministic=True too (the kernel's key-block turns at d128, plan rule bwd_deterministic);
    gradients meet the criterion either way; flash_attn.cute.flash_attn_func accepts inputs that need gradients the same way."""
    import flash_attn
    from flash_attn import dispatch
    from flash_attn.cute import flash_attn_func as cute_func

    assert dispatch.select(_call(causal=causal)).NAME == "cute"
    assert dispatch.select(_call(causal=causal, backward=True)).NAME == "cute"
    assert dispatch.select(_call(causal=causal, backward=True, deterministic=True)).NAME == "cute"  # (its turns)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 333, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(2, 333, 4, 128, device="cuda", dtype=torch.bfloat16)
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), g)
    grads_pt = torch.autograd.grad(out_pt, (q, k, v), g)
    for run in ("auto", "forced", "cute_api", "deterministic"):
        if run == "auto":
            out = flash_attn.flash_attn_func(q, k, v, causal=causal)
        elif run == "deterministic":
            out = flash_attn.flash_attn_func(q, k, v, causal=causal, deterministic=True)
        elif run == "forced":
            with flash_attn.use_backend("cute"):
                out = flash_attn.flash_attn_func(q, k, v, causal=causal)
        else:
            out, lse = cute_func(q, k, v, causal=causal)
            assert lse.shape == (2, 4, 333)
        assert_close_to_ref(out, out_ref, out_pt, name=f"out ({run})")
        for name, gr, gr_ref, gr_pt in zip("qkv", torch.autograd.grad(out, (q, k, v), g), grads_ref, grads_pt):
            assert_close_to_ref(gr, gr_ref, gr_pt, name=f"d{name} ({run})")


# Head dims 96, 192, 256 on the GPU (not yet run there when these tests were written): the default
# kernel's checks at sequence lengths around their key blocks (80 at d256, 112 / 96 at d192, 128 at
# d96) and the 128-row query tile, Sq != Sk, GQA / MQA, fp16 and bf16; windows, softcap, varlen, the
# sink (tests/cute/test_cute_sink.py); the dispatcher's gate.

WIDE_SHAPES = [(2, 128, 128, 4, 4), (1, 1, 1, 2, 2), (2, 113, 203, 6, 2), (1, 1023, 1023, 4, 1),
               (2, 256, 77, 2, 2), (1, 300, 1200, 8, 4), (2, 161, 161, 4, 2), (1, 80, 81, 2, 2),
               (1, 2048, 2048, 2, 1), (1, 129, 2000, 4, 4)]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [256, 192, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_wide_head_dims_match_reference_on_gpu(dtype, d, causal):
    for shape in WIDE_SHAPES:
        test_matches_reference_on_gpu(dtype, d, causal, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [256, 192, 96])
@pytest.mark.parametrize("causal,window,softcap", [(False, (64, 16), 0.0), (True, (48, -1), 20.0),
                                                   (False, (100, -1), 0.0), (False, (0, 0), 0.0),
                                                   (False, (-1, 200), 20.0), (True, (-1, -1), 30.0)])
def test_wide_head_dims_window_and_softcap_on_gpu(d, causal, window, softcap):
    for shape in [(2, 333, 333, 4, 2), (1, 129, 517, 2, 1), (1, 700, 200, 2, 2)]:
        test_window_and_softcap_match_reference_on_gpu(d, causal, window, softcap, *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [256, 192, 96])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (50, 10), 0.0), (True, (-1, -1), 15.0)])
def test_wide_head_dims_varlen_on_gpu(d, causal, window, softcap):
    for seqused in (False, True):
        test_varlen_matches_reference_per_sequence_on_gpu(d, causal, window, softcap, seqused)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_dispatcher_gates_the_wide_head_dims_on_gpu(monkeypatch, cute_env, causal):
    """flash_attn.flash_attn_func at d256: the cute forward runs by default (not with
    FLASH_ATTN_CUTE_DISABLE=d96,d192,d256), its backward on the cute kernel when causal (plan rule bwd_d256), else on
    the next backend; outputs and gradients meet the criterion
    either way, and through flash_attn.cute.flash_attn_func (whose own kernel runs either way: the variable gates the
    dispatcher)."""
    import flash_attn
    from flash_attn import dispatch
    from flash_attn.cute import flash_attn_func as cute_func
    from flash_attn.cute import interface

    launches = []
    real = launch.forward

    real_plain = launch._forward_plain

    def counted(*args, **kwargs):
        launches.append(args[0].shape[-1])
        return real(*args, **kwargs)

    def counted_plain(*args, **kwargs):  # the common call's direct path (None: not served, the general one follows)
        res = real_plain(*args, **kwargs)
        if res:
            launches.append(args[0].shape[-1])
        return res

    # where the dispatcher's backend.fwd (launch.forward, or launch._forward_plain once the kernel is in memory) and
    # flash_attn_func (interface.forward) find it
    monkeypatch.setattr(launch, "forward", counted)
    monkeypatch.setattr(launch, "_forward_plain", counted_plain)
    monkeypatch.setattr(interface, "forward", counted)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 333, 4, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn(2, 333, 4, 256, device="cuda", dtype=torch.bfloat16)
    out_ref, _ = attention_ref(q, k, v, causal=causal)
    out_pt, _ = attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)
    grads_ref = torch.autograd.grad(out_ref, (q, k, v), g)
    grads_pt = torch.autograd.grad(out_pt, (q, k, v), g)
    for enabled in (False, True):
        cute_env(DISABLE=None if enabled else "d96,d192,d256")  # None: the default
        monkeypatch.setattr(dispatch, "_choice", {})
        assert (dispatch.select(_call(head_dim=256, head_dim_v=256, causal=causal)).NAME == "cute") == enabled
        # the backward: the split-D kernel for causal calls under the default plan rule bwd_d256="causal"
        cute_bwd = enabled and causal and config.plan_rules().bwd_d256 == "causal"
        assert (dispatch.select(_call(head_dim=256, head_dim_v=256, causal=causal, backward=True)).NAME
                == "cute") == cute_bwd
        for run in ("auto", "cute_api"):
            del launches[:]
            out = (flash_attn.flash_attn_func(q, k, v, causal=causal) if run == "auto"
                   else cute_func(q, k, v, causal=causal)[0])
            # the package's own API has no gate: with gradients it runs its kernel and trains on its own route
            assert launches == ([256] if enabled or run == "cute_api" else []), (run, launches)
            assert_close_to_ref(out, out_ref, out_pt, name=f"out ({run}, gate {enabled})")
            grads = torch.autograd.grad(out, (q, k, v), g)
            for name, gr, gr_ref, gr_pt in zip("qkv", grads, grads_ref, grads_pt):
                assert_close_to_ref(gr, gr_ref, gr_pt, name=f"d{name} ({run}, gate {enabled})")
        with torch.no_grad():  # the package API without gradients: no gate
            out, _ = cute_func(q, k, v, causal=causal)
        assert_close_to_ref(out, out_ref, out_pt, name=f"out (no grad, gate {enabled})")
