"""The Hopper backward kernel's deterministic mode (FlashBwdSm90(deterministic=True), bwd_dq.DqAccumulator): dQ's
fp32 adds from the key blocks' CTAs take turns in key-block order through a counter per (sequence, head, query
block), so the gradients are the same bits every run. On the CPU: the config it forces (split dQ tile, atomics, no
lpt, no window), the PTX of the turn (ld.acquire / fence / red.release around the adds, no TMA reduce), the host's
zeroed counters, the masks' precondition (each query block's key blocks are 0..n_max, so no CTA waits for one that
never comes) and the plan rule bwd_deterministic's routing. On a Hopper GPU (tests marked gpu): the reference's
gradients, and repeated runs equal bit for bit."""
import dataclasses
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
from flash_attn.cute import autograd, config, kernels, launch  # noqa: E402
from flash_attn.cute import backend as cute_backend  # noqa: E402
from test_cute_bwd_varlen import _cu, _call, _hopper, _ptxas_spills  # noqa: E402 (the backward tests' shared helpers)

U = launch._UNBOUNDED


@pytest.mark.parametrize("d,causal,varlen", [(64, False, False), (96, False, False), (128, True, False),
                                             (96, True, True), (128, True, True)])
def test_deterministic_kernel_takes_turns_in_its_ptx(tmp_path, cute_env, d, causal, varlen):
    """bwd.dq_writer=0 (the consumers' turns): its own cache key; red.global.add of dQ (no TMA reduce-add), the turn:
    one ld.acquire.gpu spin, a barrier of the 256 consumer threads, then fence.acq_rel.gpu, the barrier and one
    red.release.gpu per query block; ptxas keeps the WGMMA pipeline and setmaxnreg and spills nothing."""
    # (dq_tma, lpt and dq_split: what the deterministic kernel overrides)
    cute_env(OVERRIDES="bwd.dq_tma=1,bwd.lpt=4,bwd.dq_split=0,bwd.dq_writer=0")
    cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", varlen=varlen, deterministic=True)
    assert cfg.deterministic and cfg.dq_split and not cfg.dq_tma and cfg.lpt == 0
    assert cfg.key()["deterministic"] is True
    assert "deterministic" not in kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", varlen=varlen).key()
    cute_env(OVERRIDES="bwd.dq_writer=0")
    kernels.compile_bwd(torch.bfloat16, d, causal, dump_dir=str(tmp_path), varlen=varlen, deterministic=True)
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    assert ("call_varlen_deterministic" if varlen else "call_deterministic") in ptx.name
    text = ptx.read_text()
    assert "cp.reduce.async.bulk" not in text and "red.global.add" in text.replace("red.relaxed.gpu.global.add",
                                                                                   "red.global.add")
    assert re.search(r"ld\.acquire\.gpu\.global\.b32", text)
    assert re.search(r"fence\.acq_rel\.gpu;\s*\n\s*bar\.sync\s+2, 256;", text)
    assert len(re.findall(r"red\.release\.gpu\.global\.add\.s32", text)) == 1
    assert text.count("bar.sync \t2, 256;") >= 2
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x == 0 for x in spills), log


@pytest.mark.parametrize("d,varlen", [(128, False), (64, True)])
def test_descending_turns_reverse_the_grid(tmp_path, cute_env, d, varlen):
    """The deterministic causal kernel whose writer warp takes the turns (BwdConfig.turns_desc) runs key blocks from
    the last down (n = gridDim.x - 1 - blockIdx.x) and takes its turns in descending order; no other kernel does (the
    consumers' turns, bwd.dq_writer=0 and the split-D kernel's, ascend); ptxas spills nothing."""
    cfg = kernels.bwd_config(torch.bfloat16, d, True, "sm_90a", varlen=varlen, deterministic=True)
    assert cfg.turns_desc and cfg.dq_writer and cfg.key()["turns_desc"] is True
    assert not kernels.bwd_config(torch.bfloat16, d, False, "sm_90a", varlen=varlen, deterministic=True).turns_desc
    assert not kernels.bwd_config(torch.bfloat16, d, True, "sm_90a", varlen=varlen).turns_desc
    assert not kernels.bwd_config(torch.bfloat16, 256, True, "sm_90a", varlen=varlen, deterministic=True).turns_desc
    cute_env(OVERRIDES="bwd.dq_writer=0")
    assert not kernels.bwd_config(torch.bfloat16, d, True, "sm_90a", varlen=varlen, deterministic=True).turns_desc
    cute_env(OVERRIDES=None)
    kernels.compile_bwd(torch.bfloat16, d, True, dump_dir=str(tmp_path), varlen=varlen, deterministic=True)
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    text = ptx.read_text()
    assert "%nctaid.x" in text and re.search(r"ld\.acquire\.gpu\.global\.b32", text)
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x == 0 for x in spills) and "are serialized" not in log, log
    with pytest.raises(ValueError, match="turns_desc"):
        dataclasses.replace(kernels.bwd_config(torch.bfloat16, d, True, "sm_90a"), turns_desc=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_turn_order_covers_each_query_blocks_key_blocks_once(causal, block_m):
    """DqAccumulator.turn_place with the kernel's own functions on host integers: for every query block, the key blocks
    whose CTA walks it (mask.m_block_range, the CTAs of the grid) hold the places 0 .. c - 1 once each, so the turns
    end and none waits forever; ascending, or descending (key block n after n + 1: turns_desc, causal), where key
    block n + 1's walk reaches the query block no later than n's (it starts there or before), so with the grid run
    from the last key block down no CTA waits for one that starts later."""
    from collections import namedtuple

    from flash_attn.cute.bwd_dq import DqAccumulator
    from flash_attn.cute.mask import AttentionMask

    Tile = namedtuple("Tile", "seqlen_q seqlen_k")
    BN = 128
    dq = DqAccumulator(block_m, True, True, None, 256, writer=True, descending=causal, block_n=BN)
    mask = AttentionMask(causal, False, block_m, BN)
    for sq, sk in [(1, 1), (1, 1000), (1000, 1), (64, 64), (100, 130), (1000, 1000), (1200, 300), (300, 1200),
                   (2048, 2048), (113, 203), (4096, 1024), (1024, 4096)]:
        tile = Tile(sq, sk)
        n_k = -(-sk // BN)
        ranges = [tuple(int(x) for x in mask.m_block_range(n, sq, sk)) for n in range(n_k)]
        for m in range(-(-sq // block_m)):
            walkers = [n for n in range(n_k) if ranges[n][0] <= m < ranges[n][1]]
            assert walkers == list(range(len(walkers))), (sq, sk, m)  # key blocks 0 .. c - 1
            places = [int(dq.turn_place(n, m, tile)) for n in walkers]
            assert sorted(places) == list(range(len(walkers))), (sq, sk, m, places)
            assert places == (walkers[::-1] if causal else walkers), (sq, sk, m, places)
            if causal:
                for n in walkers[:-1]:
                    assert ranges[n + 1][0] >= ranges[n][0]


@pytest.mark.parametrize("d,causal,varlen", [(64, False, False), (128, True, False), (96, True, True)])
def test_deterministic_writer_warp_takes_turns_in_its_ptx(tmp_path, cute_env, d, causal, varlen):
    """The deterministic kernel's dQ goes by the writer warp's TMA reduce-adds by default (one site, D / 32 boxes;
    D = 96: 16-column ones) in turns: its ld.acquire.gpu spin, the add, a full wait for the bulk
    group (not only its reads), the proxy and acq_rel fences and one red.release.gpu per query block; no consumer
    thread adds with red.global or waits for a turn; ptxas spills nothing and keeps the WGMMAs pipelined."""
    cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", varlen=varlen, deterministic=True)
    assert cfg.deterministic and cfg.dq_tma and cfg.dq_writer and cfg.lpt == 0
    # the split-D kernel's deterministic calls keep the consumers' turns (its fp32 dQ tiles do not fit)
    wide = kernels.bwd_config(torch.bfloat16, 256, causal, "sm_90a", varlen=varlen, deterministic=True)
    assert not wide.dq_tma and not wide.dq_writer
    kernels.compile_bwd(torch.bfloat16, d, causal, dump_dir=str(tmp_path), varlen=varlen, deterministic=True)
    (ptx,) = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    text = ptx.read_text()
    assert cfg.dq_perm  # (the unswizzled tile: one box)
    assert text.count("cp.reduce.async.bulk.tensor") == 1 and "red.relaxed.gpu.global.add" not in text
    assert re.search(r"ld\.acquire\.gpu\.global\.b32", text) and "bar.sync \t2, 256;" not in text
    assert re.search(r"cp\.async\.bulk\.wait_group \t0;[\s\S]*fence\.proxy\.async\.global;[\s\S]*fence\.acq_rel\.gpu;"
                     r"[\s\S]*red\.release\.gpu\.global\.add\.s32", text)
    assert len(re.findall(r"red\.release\.gpu\.global\.add\.s32", text)) == 1
    # causal: descending turns, key blocks from the last down (n = gridDim.x - 1 - blockIdx.x); else the grid's own order
    assert ("%nctaid.x" in text) == causal
    spills, log = _ptxas_spills(ptx)
    assert spills and all(x == 0 for x in spills) and "are serialized" not in log, log


def test_deterministic_config_refusals():
    base = dict(dtype="bf16", head_dim=64, causal=True, arch="sm_90a", abi="cute", block_m=64, stages=2)
    for bad in (dict(dq_split=True, dq_tma=True, dq_perm=True), dict(dq_split=False, dq_tma=False),
                dict(dq_split=True, dq_tma=False, lpt=4), dict(dq_split=True, dq_tma=False, local=True)):
        with pytest.raises(ValueError, match="deterministic"):
            config.BwdConfig(**base, **bad, deterministic=True)
    config.BwdConfig(**base, dq_split=True, dq_tma=False, deterministic=True)
    config.BwdConfig(**base, dq_split=True, dq_tma=True, dq_perm=True, dq_writer=True, deterministic=True)  # the writer


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 500), (500, 300), (1, 700), (257, 257), (700, 1), (128, 128)])
def test_every_query_block_meets_key_blocks_from_zero(causal, block_m, seqlen_q, seqlen_k):
    """The turn's precondition: for each query block m, the key blocks whose m_block_range holds m are exactly
    0, 1, ..., n_max (key block n waits for n earlier turns: a gap would leave it waiting forever)."""
    from flash_attn.cute.mask import AttentionMask

    BN = 128
    mask = AttentionMask(causal, False, block_m, BN)
    ranges = [mask.m_block_range(n, seqlen_q, seqlen_k) for n in range(-(-seqlen_k // BN))]
    for m in range(-(-seqlen_q // block_m)):
        meet = [n for n, (lo, hi) in enumerate(ranges) if lo <= m < hi]
        assert meet == list(range(len(meet))), (m, meet)


def test_host_zeroes_the_turn_counters(monkeypatch, cute_env):
    """backward(deterministic=True) hands the kernel zeroed int32 counters (B, H, query blocks) after the tensors;
    backward_varlen (sequences, H, blocks of max_seqlen_q); both refuse a window."""
    cute_env(OVERRIDES="plan.bwd_host=torch")
    dtype, D = torch.float16, 64
    seen = []

    def kernel(*args):
        seen.append([a.clone() if isinstance(a, torch.Tensor) else a for a in args])

    for varlen in (False, True):
        monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, True, "sm_90a", False, varlen, True),
                            kernel)
    block_m = kernels.bwd_config(dtype, D, True, "sm_90a", deterministic=True).block_m
    q = torch.randn(2, 200, 4, D).to(dtype)
    k = torch.randn(2, 300, 2, D).to(dtype)
    lse = torch.randn(2, 4, 200)
    launch.backward(q, q, k, k, q, lse, 0.1, True, deterministic=True)
    sem = seen[-1][9]
    assert sem.dtype == torch.int32 and sem.shape == (2, 4, -(-200 // block_m)) and sem.eq(0).all()
    assert seen[-1][10] == 0.1
    with pytest.raises(NotImplementedError, match="window"):
        launch.backward(q, q, k, k, q, lse, 0.1, False, window=(8, 8), deterministic=True)

    cu_q, cu_k = _cu([150, 50]), _cu([100, 200])
    qv, kv, lsev = q[0], k[0], lse[0]
    launch.backward_varlen(qv, qv, kv, kv, qv, lsev, cu_q, cu_k, None, None, 150, 200, 0.1, True,
                           deterministic=True)
    args = seen[-1]
    sem = args[13]
    assert sem.dtype == torch.int32 and sem.shape == (2, 4, -(-150 // block_m)) and sem.eq(0).all()
    assert args[14] == 200 and args[15] == 0.1
    with pytest.raises(NotImplementedError, match="window"):
        launch.backward_varlen(qv, qv, kv, kv, qv, lsev, cu_q, cu_k, None, None, 150, 200, 0.1, False,
                               window=(8, 8), deterministic=True)


def test_deterministic_backward_is_admitted_under_its_rule(cute_env):
    """The dispatcher's cute backend takes deterministic calls at the head dims plan.bwd_deterministic admits: by
    default ("writer") d64-d128, whose turns the dQ writer warp takes (0.97-1.30x Triton's deterministic backward),
    not d192; "on" every head dim, "off" (or 0) none; another value is refused by name. flash_attn.cute's own
    backward (no root package: the alternative is bwd_torch) takes them with the kernel either way, windows
    excepted."""
    q = torch.empty(1, 10, 2, 64)
    for d in (64, 96, 128):
        assert cute_backend.unsupported_reason(_call(deterministic=True, head_dim=d, head_dim_v=d)) is None, d
    assert cute_backend.unsupported_reason(_call(deterministic=True, head_dim=192, head_dim_v=192)) is not None
    cute_env(OVERRIDES="plan.bwd_deterministic=on")
    assert cute_backend.unsupported_reason(_call(deterministic=True, head_dim=192, head_dim_v=192)) is None
    for off in ("off", "0"):
        cute_env(OVERRIDES=f"plan.bwd_deterministic={off}")
        assert cute_backend.unsupported_reason(_call(deterministic=True)) is not None
    cute_env(OVERRIDES="plan.bwd_deterministic=sometimes")
    with pytest.raises(ValueError, match="plan.bwd_deterministic='sometimes'"):
        cute_backend.unsupported_reason(_call(deterministic=True))
    cute_env(OVERRIDES="plan.bwd_deterministic=off")
    assert autograd._kernel_takes(q, q, True, U, U, 0.0, True, None)
    assert not autograd._kernel_takes(q, q, False, 8, 3, 0.0, True, None)
    cute_env(OVERRIDES="plan.bwd_deterministic=1,plan.bwd_window=1")
    assert cute_backend.unsupported_reason(_call(deterministic=True)) is None
    assert cute_backend.unsupported_reason(_call(deterministic=True, window_left=8)) is not None
    assert autograd._kernel_takes(q, q, True, U, U, 0.0, True, None)
    assert autograd._kernel_takes(q, q, False, U, U, 0.0, True, None)
    assert not autograd._kernel_takes(q, q, False, 8, 3, 0.0, True, None)  # windows: bwd_torch, deterministic too
    assert autograd._kernel_takes(q, q, False, 8, 3, 0.0, False, None)


def test_own_backward_passes_deterministic_to_the_kernel(monkeypatch, cute_env):
    """Without the root package (own_backward), deterministic calls take the kernel, the rule at its default."""
    got = []
    monkeypatch.setattr(launch, "backward", lambda *a, **kw: got.append(("dense", kw)) or "g")
    monkeypatch.setattr(launch, "backward_varlen", lambda *a, **kw: got.append(("varlen", kw)) or "g")
    q = torch.empty(1, 10, 2, 64)
    cu = _cu([10])
    autograd.own_backward(q, q, q, q, q, None, 0.5, True, U, U, 0.0, True, "sm_90a", None)
    autograd.own_backward(q[0], q[0], q[0], q[0], q[0], None, 0.5, True, U, U, 0.0, True, "sm_90a",
                          (cu, cu, 10, 10, None, None))
    assert [(w, kw["deterministic"]) for w, kw in got] == [("dense", True), ("varlen", True)]


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


@pytest.fixture(params=[",bwd.dq_writer=0", ""], ids=["red_add", "writer_warp"])
def det_on(request, monkeypatch, cute_env):
    """The deterministic (and varlen) rules on, the dispatcher's cached choices dropped, and the deterministic flag
    of each kernel launch recorded; the turns taken by every consumer thread's red.global.add, or by the writer warp's
    TMA reduce-adds (the default at d64-d128; with a causal mask in descending turns)."""
    from flash_attn import dispatch

    cute_env(OVERRIDES="plan.bwd_deterministic=1,plan.bwd_varlen=1" + request.param, DISABLE=None)
    monkeypatch.setattr(dispatch, "_choice", {})
    table = {}
    monkeypatch.setattr(kernels, "_bwd_kernels", table)  # (the in-memory table does not key on the overrides)
    monkeypatch.setattr(launch, "_bwd_kernels", table)
    calls = []
    for name in ("backward", "backward_varlen"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _r=real, **kw: (calls.append(kw.get("deterministic")),
                                                                     _r(*a, **kw))[1])
    return calls


def _inputs(dtype, d, batch, seqlen_q, seqlen_k, heads, heads_kv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(batch, seqlen_k, heads_kv, d, generator=g).to("cuda", dtype).requires_grad_()
            for _ in range(2))
    dout = torch.randn(batch, seqlen_q, heads, d, generator=g).to("cuda", dtype)
    return q, k, v, dout


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (300, 1200), (1200, 300), (1, 130), (4096, 4096)])
def test_deterministic_gradients_are_exact_and_repeat_bit_for_bit_on_gpu(det_on, dtype, d, causal, seqlen_q,
                                                                        seqlen_k):
    """The reference's gradients within the criterion, and five runs of the same backward give the same bits
    (at 4096 x 4096, 32 key blocks add into every query block)."""
    from flash_attn.cute import flash_attn_func

    q, k, v, dout = _inputs(dtype, d, 2, seqlen_q, seqlen_k, 4, 2, seed=d + seqlen_q)
    runs = []
    for _ in range(5):
        out, _ = flash_attn_func(q, k, v, causal=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    torch.cuda.synchronize()
    assert det_on and all(det_on), det_on
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref, _ = testing.attention_ref(qr, kr, vr, causal=causal, upcast=upcast, reorder_ops=not upcast)
        results.append(torch.autograd.grad(ref, (qr, kr, vr), dout))
    for name, a, r, p in zip(("dq", "dk", "dv"), runs[0], *results):
        testing.assert_close_to_ref(a, r, p, name)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_varlen_gradients_repeat_bit_for_bit_on_gpu(det_on, d, causal):
    """Varlen through FA4's flash_attn_varlen_func(deterministic=True): five runs, the same bits; the gradients of
    each sequence match its own reference (tests/cute/test_cute_bwd_varlen.py's helper)."""
    from flash_attn.cute import flash_attn_varlen_func

    from test_cute_bwd_varlen import _per_sequence_reference

    lens_q, lens_k = [1000, 1, 300, 0, 2048], [700, 129, 1200, 64, 2048]
    cu_q, cu_k = _cu(lens_q, "cuda"), _cu(lens_k, "cuda")
    g = torch.Generator().manual_seed(d)
    q = torch.randn(int(cu_q[-1]), 4, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(int(cu_k[-1]), 2, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn(q.shape, generator=g).to("cuda", torch.bfloat16)
    runs = []
    for _ in range(5):
        out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=causal,
                                        deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    assert det_on and all(det_on), det_on
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref, pt = _per_sequence_reference(q, k, v, dout, cu_q, cu_k, cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1], causal,
                                      (-1, -1))
    for name, a, r, p in zip(("dq", "dk", "dv"), runs[0], ref[1:], pt[1:]):
        testing.assert_close_to_ref(a, r, p, name)
