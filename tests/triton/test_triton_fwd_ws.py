"""The warp-specialized Triton forward (flash_attn/triton/_fwd_ws.py): the default on sm_90 for the
(head dim, causal) pairs of _configs.FWD_WS_DEFAULT, FLASH_ATTN_TRITON_OVERRIDES' fwd_variant overrides it.

CPU: the interpreter runs the kernel (fp16; fp32 calls must fall back to the default kernel) through an
explicit FwdConfig(variant=1), the backend's routing of calls it does not serve, the switch's parsing,
and an ahead-of-time compile for sm_90 that checks the Hopper warp-specialization pass really split the
loop (producer + two consumer warpgroups, TMA copies, wgmma, no spills, shared memory within the limit).
GPU: real sizes in bf16/fp16, and the switch through the public API in a fresh process.

Criterion: flash_attn.testing.assert_close_to_ref (2x PyTorch's error at the input dtype plus rounding).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from flash_attn import testing
from flash_attn.triton import _configs, _fwd_ws, backend as tb
from flash_attn.testing import backend_fwd

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Interpreter blocks: small shapes span several row and key blocks. The persistent form (variant 2) runs
# 4 programs there (backend._num_sms), so each walks several tiles.
_WS_INTERP = _configs.FwdConfig(16, 16, 1, 1, tma=True, variant=1)
_WSP_INTERP = _configs.FwdConfig(16, 16, 1, 1, tma=True, variant=2)
_WSB_INTERP = _configs.FwdConfig(16, 16, 1, 1, tma=True, variant=3)  # persistent, balanced causal order


def _kw(Sq, Sk, D, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    wl, wr = window
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=Sq, max_seqlen_k=Sk, block_table=None,
                softmax_scale=D ** -0.5 if scale is None else scale, causal=causal, window_left=wl,
                window_right=0 if causal else wr, softcap=softcap, alibi_slopes=alibi, dropout_p=0.0,
                rng_state=None)


def _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Sq, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Sk, Hk, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Sk, Hk, Dv, generator=g).to(DEVICE, dtype)
    return q, k, v


def _check(q, k, v, out, lse, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None):
    ref = testing.attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi,
                                softmax_scale=scale, upcast=True)[0]
    pt = testing.attention_ref(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi,
                               softmax_scale=scale, upcast=False, reorder_ops=True)[0]
    testing.assert_close_to_ref(out, ref, pt, "out")
    lse_ref = testing.attention_lse_ref(q, k, causal=causal, window_size=window, softcap=softcap,
                                        alibi_slopes=alibi, softmax_scale=scale)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(finite, torch.isfinite(lse))
    err = (lse[finite] - lse_ref[finite]).abs().max().item()
    assert err <= 1e-3 * max(1.0, lse_ref[finite].abs().max().item()), err


class _Spy:
    """Counts the calls that reach the warp-specialized forward's launcher."""

    def __init__(self, launcher):
        self.launcher, self.calls = launcher, 0

    def __call__(self, *args):
        self.calls += 1
        return self.launcher(*args)


@pytest.fixture
def ws_spy(monkeypatch):
    if tb._L_FWD_WS is None:
        tb._kernels()
    spy = _Spy(tb._L_FWD_WS)
    monkeypatch.setattr(tb, "_L_FWD_WS", spy)
    return spy


def _run(spy, cfg, B, Sq, Sk, H, Hk, D, Dv, dtype, causal, seed, expect_ws=True, **extra):
    q, k, v = _qkv(B, Sq, Sk, H, Hk, D, Dv, dtype, seed)
    before = spy.calls
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **_kw(Sq, Sk, D, causal, **extra))
    _check(q, k, v, out, lse, causal=causal, **extra)
    assert (spy.calls > before) == expect_ws, f"warp-specialized forward used: {spy.calls > before}"
    return out, lse


# ----------------------------------------------------------------------------------------------------
# CPU interpreter (and GPU): the kernel's numerics and the routing


@pytest.mark.parametrize("cfg", [_WS_INTERP, _WSP_INTERP, _WSB_INTERP], ids=["ws", "wsp", "wsb"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(37, 53), (48, 48), (16, 64), (45, 45), (1, 23)])
def test_ws_interpreter(ws_spy, cfg, causal, Sq, Sk):
    # Sk % 16 != 0 runs the sequence-end mask (EVEN_K=False); Sq % 16 != 0 a partial last row block;
    # causal with Sq < Sk the bottom-right diagonal; H=4 over Hk=2 the GQA head mapping.
    if tb._INTERPRET:
        dtype = torch.float16
    else:
        dtype = torch.bfloat16
    _run(ws_spy, cfg, 2, Sq, Sk, 4, 2, 64, 64, dtype, causal, seed=Sq * 7 + Sk)


@triton.jit
def _order_kernel(Out, n_m, n_bh, n_rounds, BALANCED: tl.constexpr):
    # what the persistent tile loop of program i visits: Out[i, j] = (row block, sequence*head) of its j-th tile
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for j in range(0, n_rounds):
        lin = pid + j * P
        if lin < n_m * n_bh:
            pid_m, bh = _fwd_ws._tile_coords(lin, n_m, n_bh, True, 0, BALANCED)
            tl.store(Out + (pid * n_rounds + j) * 2, pid_m)
            tl.store(Out + (pid * n_rounds + j) * 2 + 1, bh)


@pytest.mark.skipif(CUDA, reason="the order's arithmetic, in the interpreter (the GPU tests run the kernel)")
@pytest.mark.parametrize("n_m,n_bh,P", [(128, 16, 132), (16, 128, 132), (7, 5, 4), (5, 3, 8), (32, 16, 132)])
def test_persistent_causal_tile_order(n_m, n_bh, P):
    """Both persistent orders visit every causal tile once, longest (last row block) first; the balanced one
    (variant 3) gives no program more than the mean work plus one tile (the other: 1.56x the mean at
    seqlen 16k, h16, 132 programs)."""
    n_rounds = -(-n_m * n_bh // P)
    for balanced in (False, True):
        out = torch.full((P, n_rounds, 2), -1, dtype=torch.int32)
        _order_kernel[(P,)](out, n_m, n_bh, n_rounds, BALANCED=balanced)
        tiles = [tuple(t) for t in out.reshape(-1, 2).tolist() if t[0] >= 0]
        assert sorted(tiles) == [(m, b) for m in range(n_m) for b in range(n_bh)]
        work = (out[..., 0] + 1).clamp(min=0).sum(1).double()  # a tile's work ~ its row block + 1
        mean = n_m * n_bh * (n_m + 1) / 2 / P
        if not balanced and (n_m, n_bh, P) == (128, 16, 132):
            assert work.max().item() / mean > 1.5  # the imbalance variant 3 removes
        if balanced:
            assert work.max().item() <= mean + n_m + 1, (work.max().item(), mean)
            assert all(out[p, 0, 0].item() == n_m - 1 for p in range(min(P, n_bh)))  # longest first
    if (n_m, n_bh, P) == (128, 16, 132):
        assert work.max().item() / mean < 1.02


@pytest.mark.parametrize("cfg", [_WS_INTERP, _WSP_INTERP], ids=["ws", "wsp"])
def test_ws_interpreter_dv_differs(ws_spy, cfg):
    _run(ws_spy, cfg, 1, 40, 40, 2, 2, 64, 32, torch.float16 if tb._INTERPRET else torch.bfloat16, True, seed=5)


def test_wsp_interpreter_grouped_causal_order(ws_spy):
    # 3 x 5 (sequence, head) pairs in groups of 4 (the last group smaller), walked by 4 persistent programs
    cfg = _configs.FwdConfig(16, 16, 1, 1, tma=True, group=4, variant=2)
    _run(ws_spy, cfg, 3, 41, 41, 5, 5, 32, 32, torch.float16 if tb._INTERPRET else torch.bfloat16, True, seed=6)


@pytest.mark.parametrize("cfg", [_WS_INTERP, _WSP_INTERP], ids=["ws", "wsp"])
def test_ws_packed_qkv_strides(ws_spy, cfg):
    """q, k, v as views of one (B, S, 3, H, D) tensor (MHA's packed projection): rows of 3 * H * D
    elements, served in place (the descriptors' row stride), with GQA-free heads at stride D."""
    dtype = torch.float16 if tb._INTERPRET else torch.bfloat16
    B, S, H, D = 2, 45, 3, 32
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(B, S, 3, H, D, generator=g).to(DEVICE, dtype)
    q, k, v = qkv.unbind(2)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **_kw(S, S, D, True))
    _check(q, k, v, out, lse, causal=True)
    assert ws_spy.calls == 1


@pytest.mark.parametrize("case", ["fp32", "causal_sq_gt_sk", "window", "softcap", "alibi", "d40",
                                  "unaligned", "neg_scale", "batch_stride"])
def test_ws_falls_back(ws_spy, case):
    """Calls outside what the kernel serves run the default kernel (and are still right)."""
    dtype = torch.float16 if tb._INTERPRET else torch.bfloat16
    B, Sq, Sk, H, Hk, D, causal, extra = 1, 33, 40, 2, 2, 64, True, {}
    if case == "fp32":
        dtype = torch.float32
    elif case == "causal_sq_gt_sk":
        Sq, Sk = 50, 21
    elif case == "window":
        causal, extra = False, dict(window=(7, 3))
    elif case == "softcap":
        extra = dict(softcap=3.0)
    elif case == "alibi":
        extra = dict(alibi=(torch.rand(H) * 0.5).to(DEVICE))
    elif case == "d40":
        D = 40
    elif case == "neg_scale":
        extra = dict(scale=-0.1)
    if case == "batch_stride":
        # sequences that are not one row range of the tensor (the first Sq rows of a longer buffer)
        q, k, v = _qkv(2, Sq + 8, Sk, H, Hk, D, D, dtype, seed=10)
        q = q[:, :Sq]
        out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, config=_WS_INTERP, **_kw(Sq, Sk, D, causal))
        _check(q, k, v, out, lse, causal=causal)
        assert ws_spy.calls == 0
        return
    if case == "unaligned":
        q, k, v = _qkv(B, Sq, Sk, H, Hk, D, D, dtype, seed=9)
        flat = torch.empty(k.numel() + 1, device=DEVICE, dtype=dtype)
        k_odd = flat[1:].view_as(k)  # data_ptr % 16 == 2: the copy engine cannot address it
        k_odd.copy_(k)
        out, lse, _ = backend_fwd(tb, q, k_odd, v, return_probs=False, config=_WS_INTERP, **_kw(Sq, Sk, D, causal))
        _check(q, k, v, out, lse, causal=causal)
        assert ws_spy.calls == 0
        return
    _run(ws_spy, _WS_INTERP, B, Sq, Sk, H, Hk, D, D, dtype, causal, seed=11, expect_ws=False, **extra)


def test_tiny_calls_take_the_table_kernel(monkeypatch):
    """By default (switch unset) a forward of less work than one 128 x 128 block per SM takes the table's
    kernel (fewer host steps per launch); one block per SM or more takes the warp-specialized one; a set
    switch serves every size (the kernel tests above rely on it)."""
    if tb._L_FWD_WS is None:
        tb._kernels()
    monkeypatch.setattr(_configs, "FWD_VARIANT_SET", False)
    monkeypatch.setattr(tb, "_arch", lambda device: (9, 0))
    monkeypatch.setattr(tb, "_num_sms", lambda device: 132)
    monkeypatch.setattr(tb, "_tma_supported", lambda *a: True)
    monkeypatch.setattr(tb, "_FWD_WS_KINDS", {})
    monkeypatch.setattr(tb, "_FWD_WS_PLANS", {})
    dtype = torch.float16

    def plan(B, Sq, Sk, H):
        q, k, v = _qkv(B, Sq, Sk, H, H, 128, 128, dtype, seed=1)
        return tb._fwd_ws_plan(q, k, v, 128, 128, Sq, Sk, (False, False), 1 << 30, 1 << 30, 0.1, None)

    assert _configs.ws_variant(128, False)[0] != 0  # d128 non-causal has a default variant
    assert plan(1, 128, 128, 16) is None  # 16 blocks
    assert plan(1, 128, 1024, 16) is None  # 128 blocks
    assert plan(1, 128, 1152, 16) is not None  # 144 blocks
    assert plan(2, 512, 512, 4) is None  # 2 x 4 (sequence, head) pairs x 4 x 4 blocks = 128
    assert plan(2, 512, 640, 4) is not None  # 160 blocks
    assert plan(1, 1, 16384, 16) is not None  # a long key range: 16 x 128 blocks
    monkeypatch.setattr(_configs, "FWD_VARIANT_SET", True)
    monkeypatch.setattr(_configs, "FWD_VARIANT", (2, None))
    assert plan(1, 128, 128, 16) is not None


def test_flash_attn_func_runs_fwd_with_the_dense_description(monkeypatch):
    """flash_attn_func's common call reaches the backend's fwd with the description the API built (dense, the mask
    normalised, no probabilities) and gives fwd's results."""
    import flash_attn

    dtype = torch.float16 if tb._INTERPRET else torch.bfloat16
    for causal in (False, True):
        q, k, v = _qkv(2, 37, 45, 4, 2, 64, 64, dtype, seed=3 + causal)
        out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **_kw(37, 45, 64, causal))
        calls = []
        real = tb.fwd
        monkeypatch.setattr(tb, "fwd", lambda *a, **kw: calls.append(a[0]) or real(*a, **kw))
        with flash_attn.use_backend("triton"):
            api = flash_attn.flash_attn_func(q, k, v, causal=causal)
        monkeypatch.setattr(tb, "fwd", real)
        (call,) = calls
        assert (call.causal, call.window_left, call.window_right) == (causal, -1, 0 if causal else -1)
        assert not (call.varlen or call.return_probs or call.local) and call.softmax_scale == 64 ** -0.5
        assert torch.equal(api, out)
    # the table kernel gets a tensor where fwd has no probabilities (a None would compile another kernel)
    seen = []
    real_l = tb._L_FWD
    monkeypatch.setattr(tb, "_L_FWD", lambda grid, args, meta, key: seen.append(args) or real_l(grid, args, meta, key))
    backend_fwd(tb, q, k, v, window_left=3, window_right=2)  # a window: the table kernel
    assert len(seen) == 1 and all(isinstance(a, torch.Tensor) for a in seen[0][:9])


def test_variant_switch_parsing():
    from flash_attn.triton import settings

    for name, want in [("off", (0, None)), ("ws", (1, None)), ("WS64", (1, 64)),
                       ("ws128", (1, 128)), ("wsp", (2, None)), ("wsp64", (2, 64))]:
        assert _configs._fwd_variant(settings._overrides(f"fwd_variant={name}")["fwd_variant"]) == want
    with pytest.raises(ValueError, match="FLASH_ATTN_TRITON_OVERRIDES"):
        _configs._fwd_variant(settings._overrides("fwd_variant=pingpong")["fwd_variant"])
    with pytest.raises(ValueError, match="FLASH_ATTN_TRITON_OVERRIDES"):
        settings._overrides("fwd_varient=ws")  # a typo never silently measures the default
    # unset (the default): off, the table's configs
    assert _configs._fwd_variant(settings._overrides("").get("fwd_variant", "")) == (0, None)


def test_variant_configs():
    for d, causal in [(64, False), (128, False), (128, True), (256, False), (256, True)]:
        base = _configs._lookup(_configs._FWD, (9, 0), d, causal)
        assert _configs.fwd_variant_config((9, 0), d, causal, (0, None)) is base
        for kind in (1, 2):
            for bn in (None, 64, 128):
                cfg = _configs.fwd_variant_config((9, 0), d, causal, (kind, bn))
                assert (cfg.variant, cfg.block_m, cfg.num_warps, cfg.tma) == (kind, 128, 4, True)
                assert cfg.block_n == ((64 if kind == 1 else 32) if d == 256 else bn or base.block_n)
                # K/V stages x tile bytes + Q (twice when persistent): within the 227 KiB of shared
                # memory of one sm_90 CTA (the compile test below checks what Triton really allocates)
                assert 2 * cfg.num_stages * cfg.block_n * d * 2 + kind * 128 * d * 2 <= 227 * 1024
                assert cfg.group == base.group
        # other GPUs keep their table entries
        assert _configs.fwd_variant_config((8, 0), d, causal, (1, None)).variant == 0
        assert _configs.fwd_variant_config((10, 0), d, causal, (1, None)).variant == 0


def test_default_variants(monkeypatch):
    """Unset switch: FWD_WS_DEFAULT decides per (head dim, causal); set, the switch for every head dim."""
    monkeypatch.setattr(_configs, "FWD_VARIANT_SET", False)
    assert _configs.ws_variant(128, False) == (2, None)
    assert _configs.ws_variant(256, False) == (1, None) and _configs.ws_variant(256, True) == (1, None)
    assert _configs.ws_variant(128, True) == (3, 128) and _configs.ws_variant(64, False) == (0, None)
    monkeypatch.setattr(_configs, "FWD_VARIANT_SET", True)
    monkeypatch.setattr(_configs, "FWD_VARIANT", (0, None))  # "off"
    assert _configs.ws_variant(128, False) == (0, None)
    monkeypatch.setattr(_configs, "FWD_VARIANT", (1, 64))
    assert _configs.ws_variant(64, True) == (1, 64)
    # the served configs never take three stages (NaN on the GPU)
    for (d, causal), var in _configs.FWD_WS_DEFAULT.items():
        cfg = _configs.fwd_variant_config((9, 0), d, causal, var)
        assert cfg.variant == var[0] and cfg.num_stages == 2


@pytest.mark.parametrize("name", ["ws", "wsp"])
def test_switch_routes_calls(ws_spy, monkeypatch, name):
    """With the switch on (as if read at import) on an sm_90 device, eligible calls take the experimental
    kernel with fwd_variant_config's config, and every other call the default kernel with the table's
    entry (never the variant's num_warps=4 / 128-row tiles)."""
    if tb._L_FWD is None:
        tb._kernels()
    variant = _configs.FWD_VARIANTS[name]
    monkeypatch.setattr(_configs, "FWD_VARIANT", variant)
    monkeypatch.setattr(_configs, "FWD_VARIANT_SET", True)
    monkeypatch.setattr(tb, "_FWD_VARIANT_ON", True)
    monkeypatch.setattr(tb, "_arch", lambda device: (9, 0))
    monkeypatch.setattr(tb, "_FWD_PLANS", {})
    monkeypatch.setattr(tb, "_FWD_WS_KINDS", {})  # kinds cached under the real arch
    monkeypatch.setattr(tb, "_TMA_SUPPORTED", {})
    _configs.fwd_config.cache_clear()
    dtype = torch.float16 if tb._INTERPRET else torch.bfloat16
    D = 32  # the variant's 128 x 64 tiles at the smallest head dim keep the interpreter quick
    q, k, v = _qkv(1, 40, 40, 2, 2, D, D, dtype, seed=21)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **_kw(40, 40, D, causal=True))
    _check(q, k, v, out, lse, causal=True)
    assert ws_spy.calls == 1 and not tb._FWD_PLANS
    assert any(plan[1].what[-1] == _configs.fwd_variant_config((9, 0), D, True, variant)
               for plan in tb._FWD_WS_PLANS.values())
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **_kw(40, 40, D, causal=True, softcap=5.0))
    _check(q, k, v, out, lse, causal=True, softcap=5.0)
    assert ws_spy.calls == 1
    used = [key[-2] for key in tb._FWD_PLANS]
    assert used == [None], used  # the default kernel, config from the table (fwd_config)
    assert _configs.fwd_config((9, 0), D, True, False, dtype) == _configs._lookup(_configs._FWD, (9, 0), D, True)
    _configs.fwd_config.cache_clear()


# ----------------------------------------------------------------------------------------------------
# CPU: compile for sm_90 (no GPU) and check the schedule the Hopper pass built


_AOT = r"""
import json
from benchmarks.tools import triton_fwd_compile as c
from flash_attn.triton import _configs
res = []
# (seqlen_k % BLOCK_N != 0 adds the sequence-end select inside the loop: it must not stop the pass)
for d, causal, name, even_k in [(128, False, "ws", True), (256, True, "ws", True), (128, True, "ws128", True),
                                (64, False, "ws", False), (128, True, "wsp", True), (256, False, "wsp", False),
                                (128, True, "wsb128", True)]:
    cfg = _configs.fwd_variant_config((9, 0), d, causal, _configs.FWD_VARIANTS[name])
    ck, log = c.compile_fwd(d, causal, cfg, even_k=even_k)
    res.append(dict(d=d, causal=causal, name=name, **c.summary(ck, log)))
print("JSON" + json.dumps(res))
"""


@pytest.mark.skipif(CUDA, reason="compile check for CPU machines (the GPU tests run the kernel)")
def test_ws_compiles_for_sm90_with_warp_specialization():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "packages", "flash-attn-triton"), ROOT,
                                         env.get("PYTHONPATH", "")])
    # a fresh cache: ptxas's register/spill log is only printed when it really runs
    env["TRITON_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ws_aot_{os.getpid()}")
    r = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.split("JSON", 1)[1])
    for s in res:
        # the pass split the loop: a producer (default region) and two consumer partitions, 12 warps
        assert s["warp_specialize"] and s["partitions"] == 2 and s["num_warps"] == 12, s
        # the producer gives registers back, the consumers take them (setmaxnreg)
        assert "40" in s["setmaxnreg"] and "232" in s["setmaxnreg"], s
        assert s["tma_loads"] > 0 and s["cp_async"] == 0, s
        assert s["wgmma"] > 0 and s["ex2"] > 0, s
        assert s["spill_stores"] == 0, s
        assert s["smem"] <= 232448, s  # sm_90's opt-in shared memory per CTA


# ----------------------------------------------------------------------------------------------------
# GPU


# (kind, head dim, BLOCK_N or None for the config's own, dtype): every config the switch can select for
# bf16 at the default block, the BLOCK_N overrides at head dim 128, fp16 once (each config compiles once,
# ~5-10 s, so the list stays short).
_GPU_CASES = ([(kind, D, None, torch.bfloat16) for kind in (1, 2) for D in (64, 128, 256)]
              + [(1, 128, 64, torch.bfloat16), (1, 128, 128, torch.bfloat16), (2, 128, 64, torch.bfloat16),
                 (1, 128, None, torch.float16)])


@pytest.mark.gpu
@pytest.mark.parametrize("kind,D,bn,dtype", _GPU_CASES,
                         ids=[f"{'ws' if k == 1 else 'wsp'}-d{D}-bn{bn}-{str(dt)[6:]}" for k, D, bn, dt in _GPU_CASES])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_ws_real_sizes(ws_spy, kind, D, bn, dtype, causal):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized forward is tuned for sm_90")
    cfg = _configs.fwd_variant_config((9, 0), D, causal, (kind, bn))
    _run(ws_spy, cfg, 2, 2048, 2048, 4, 2, D, D, dtype, causal, seed=D + causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(1000, 1000), (777, 1531), (1, 4097), (3000, 3001)])
@pytest.mark.parametrize("kind", [1, 2, 3], ids=["ws", "wsp", "wsb"])
def test_gpu_ws_ragged_lengths(ws_spy, causal, Sq, Sk, kind):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized forward is tuned for sm_90")
    cfg = _configs.fwd_variant_config((9, 0), 128, causal, (kind, 128))  # d128's default blocks
    _run(ws_spy, cfg, 2, Sq, Sk, 8, 2, 128, 128, torch.bfloat16, causal, seed=Sq + Sk)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D,kind", [(128, 2), (256, 2), (128, 3)])
def test_gpu_wsp_many_tiles_per_program(ws_spy, causal, D, kind):
    # 4 x 16 (sequence, head) pairs x 32 row blocks over 132 programs: each walks ~15 tiles of changing
    # (sequence, head), re-creating its Q/K/V descriptors in place per tile while the previous tile's
    # copies may still be in flight; a stale or torn descriptor would read another head's rows.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized forward is tuned for sm_90")
    cfg = _configs.fwd_variant_config((9, 0), D, causal, (kind, None))
    _run(ws_spy, cfg, 4, 4096, 4096, 16, 4, D, D, torch.bfloat16, causal, seed=D + 7 * causal)


_ENV_SCRIPT = r"""
import torch, flash_attn
from flash_attn.triton import backend as tb
from flash_attn import testing
g = torch.Generator().manual_seed(3)
q, k, v = (torch.randn(2, 1024, 16, 128, generator=g).cuda().bfloat16() for _ in range(3))
with flash_attn.use_backend("triton"):
    for causal in (False, True):
        out = flash_attn.flash_attn_func(q, k, v, causal=causal)
        ref = testing.attention_ref(q, k, v, causal=causal, upcast=True)[0]
        pt = testing.attention_ref(q, k, v, causal=causal, upcast=False, reorder_ops=True)[0]
        testing.assert_close_to_ref(out, ref, pt, "out")
print("WS_PLANS", len(tb._FWD_WS_PLANS))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name,plans", [("ws", 2), ("wsp", 2), ("", 2), ("off", 0)])
def test_gpu_ws_env_switch_through_public_api(name, plans):
    """d128 through the public API in a fresh process, causal and not: the switch's variant, or unset
    the defaults (FWD_WS_DEFAULT), serve both calls; "off" runs the table's kernel for both."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized forward is tuned for sm_90")
    env = {k: v for k, v in os.environ.items() if k != "FLASH_ATTN_TRITON_OVERRIDES"}
    if name:
        env["FLASH_ATTN_TRITON_OVERRIDES"] = f"fwd_variant={name}"
    r = subprocess.run([sys.executable, "-c", _ENV_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"WS_PLANS {plans}" in r.stdout, r.stdout
