"""The Hopper backward's first-store dQ (BwdConfig.dq_first_store, bwd.dq_first_store=1): dq_accum is not zeroed; the
first key block's CTA to take a query block's ticket stores its dQ tile by TMA, the others add theirs once that store
has completed (bwd_dq.DqAccumulator.reduce_first / publish); without a causal mask each key block's walk is rotated
(bwd_walk.RotatedWalk). On the CPU: the config's rules, the walk, the PTX against the kernel without it; on a Hopper
GPU (tests marked gpu): gradients within the project's criterion, run after run."""
import glob
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
from flash_attn.cute import config, kernels  # noqa: E402
from test_cute_bwd import _sass  # noqa: E402 (a cubin's SASS as (address, instruction))

ON = "bwd.dq_first_store=1"


def test_config_takes_first_store_only_for_the_plain_dense_kernel(cute_env):
    """Under the override the dense kernels (causal or not, d64-d128, gqa_loop's and softcap's too, and the
    deterministic writer warp's turns) take it; windows, varlen, the deterministic consumers' red.global turns
    (bwd.dq_writer=0) and the d192 / d256 kernels (no TMA dQ) do not; the config refuses it where the kernel cannot
    (the consumers' TMA reduce-adds hold the tickets, the writer warp the deterministic turns)."""
    cute_env(OVERRIDES=ON)
    for d in (64, 96, 128):
        for causal in (False, True):
            assert kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a").dq_first_store
            assert kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", gqa_loop=True).dq_first_store
            assert kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", softcap=True).dq_first_store
            assert kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", deterministic=True).dq_first_store
    for kw in (dict(local=True), dict(local=True, softcap=True), dict(varlen=True),
               dict(varlen=True, deterministic=True)):
        assert not kernels.bwd_config(torch.bfloat16, 128, True, "sm_90a", **kw).dq_first_store, kw
    assert not kernels.bwd_config(torch.bfloat16, 256, True, "sm_90a").dq_first_store
    base = kernels.bwd_config(torch.bfloat16, 128, False, "sm_90a")
    assert "dq_first_store" in base.key() and base.key() != kernels.bwd_config(torch.bfloat16, 128, True,
                                                                               "sm_90a").key()
    cute_env(OVERRIDES=ON + ",bwd.dq_writer=0")
    assert not kernels.bwd_config(torch.bfloat16, 128, True, "sm_90a", deterministic=True).dq_first_store
    cute_env(OVERRIDES=None)
    assert "dq_first_store" not in kernels.bwd_config(torch.bfloat16, 128, False, "sm_90a").key()
    for bad in (dict(dq_tma=False, dq_perm=False), dict(dq_writer=True),
                dict(deterministic=True, dq_writer=False, dq_tma=False, dq_perm=False),
                dict(local=True), dict(varlen=True)):
        with pytest.raises(ValueError, match="dq_first_store"):
            config.BwdConfig(**{**dataclass_fields(base), "dq_first_store": True, **bad})


def dataclass_fields(cfg):
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


@pytest.mark.parametrize("m_min,m_max,n_blocks", [(0, 16, 8), (0, 8, 8), (3, 7, 5), (0, 1, 4), (0, 64, 32)])
def test_rotated_walk_visits_each_query_block_once_from_its_own_start(m_min, m_max, n_blocks):
    """bwd_walk.RotatedWalk on Python ints: each key block's walk covers its query blocks once, and the key blocks start
    n // key blocks apart (the first taker of a block's ticket is then the key block that starts there)."""
    from flash_attn.cute.bwd_walk import RotatedWalk

    starts = []
    for n_block in range(n_blocks):
        walk = RotatedWalk.make(m_min, m_max, n_block, n_blocks)
        blocks = [walk.block(p) for p in range(walk.count(1))]
        assert sorted(blocks) == list(range(m_min, m_max)) and walk.partial(0) is None
        starts.append(blocks[0])
    n = m_max - m_min
    assert starts == [m_min + b * n // n_blocks for b in range(n_blocks)]


@pytest.mark.parametrize("n_blocks,m_blocks,causal", [(8, 16, False), (8, 8, False), (8, 16, True), (3, 7, False),
                                                     (16, 16, True)])
def test_ticket_protocol_model_finishes_with_one_store_per_block(n_blocks, m_blocks, causal):
    """The tickets' contract (bwd_dq.DqAccumulator) as the issuing warps run it, on Python objects under random
    interleavings of the key blocks' CTAs (one head; causal: key block n walks query blocks n * m // n_blocks on;
    else RotatedWalk's rotated walks). A CTA's step t: the reduce of step t - 1's block with the ticket taken then
    (ticket 0: a store; else it may go only once the block is marked ready), then the ticket of step t's block, then
    the mark of a block it stored (its publish). Some CTA can always move (no cycle of waits); each query block gets
    one store, before every add; every add lands."""
    import random

    from flash_attn.cute.bwd_walk import RotatedWalk

    rng = random.Random(n_blocks * 100 + m_blocks)
    for _ in range(20):
        walks = []
        for n in range(n_blocks):
            if causal:
                walks.append(list(range(n * m_blocks // n_blocks, m_blocks)))
            else:
                w = RotatedWalk.make(0, m_blocks, n, n_blocks)
                walks.append([w.block(p) for p in range(w.count(1))])
        taken = [0] * m_blocks
        ready = [False] * m_blocks
        log = {m: [] for m in range(m_blocks)}
        state = [dict(step=0, ticket=None, prev=None, stored=None) for _ in walks]

        def move(n):
            st, walk = state[n], walks[n]
            if st["step"] > len(walk):
                return False
            if st["prev"] is not None:  # the previous block's reduce
                m = st["prev"]
                if st["ticket"] != 0 and not ready[m]:
                    return False  # waits for the first taker's mark
                log[m].append("store" if st["ticket"] == 0 else "add")
                st["stored"] = m if st["ticket"] == 0 else None
            if st["step"] < len(walk):
                m = walk[st["step"]]
                st["ticket"], st["prev"] = taken[m], m
                taken[m] += 1
            else:
                st["prev"] = None
            if st["stored"] is not None:
                ready[st["stored"]] = True
            st["step"] += 1
            return True

        while any(st["step"] <= len(walks[n]) for n, st in enumerate(state)):
            movable = [n for n in range(n_blocks) if state[n]["step"] <= len(walks[n])]
            rng.shuffle(movable)
            assert any(move(n) for n in movable), "no CTA can move: a cycle of waits"
        for m in range(m_blocks):
            seen = sum(m in w for w in walks)
            assert log[m] == (["store"] + ["add"] * (seen - 1) if seen else []), (m, log[m])


def _ptx(tmp_path, cute_env, d, causal, on, gqa=False, softcap=False):
    cute_env(OVERRIDES=f"bwd.dq_first_store={int(on)}")
    dump = tmp_path / f"d{d}_{int(causal)}_{int(on)}_{int(gqa)}_{int(softcap)}"
    dump.mkdir()
    kernels.compile_bwd(torch.bfloat16, d, causal, arch="sm_90a", dump_dir=str(dump), gqa_loop=gqa, softcap=softcap)
    (ptx,) = glob.glob(str(dump / "*.ptx"))
    return open(ptx).read(), ptx


def _count(text, needle):
    return sum(line.lstrip().startswith(needle) for line in text.splitlines())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("d,causal,gqa,softcap", [(64, True, False, False), (96, False, False, False),
                                                  (128, False, False, False), (128, True, False, False),
                                                  (64, False, True, False), (128, False, True, False),
                                                  (128, True, True, False), (128, False, False, True),
                                                  (64, True, False, True), (128, False, True, True)])
def test_ptx_stores_the_first_tile_and_orders_the_adds_behind_it(tmp_path, cute_env, d, causal, gqa, softcap):
    """Against the same kernel without it: the in-loop and the last block's reduce each gain a TMA store of the dQ tile
    (the reduce-adds stay), one atomic add takes the tickets, the waits for a ticket's ready mark are acquire loads
    (two per reduce: the first try and the loop's), the marks release adds after a full bulk-group wait (two each);
    the loop's registers hold (no serialised WGMMA; no spill, but for gqa_loop's causal d128 kernel, whose ptxas keeps
    one value in local memory from before the loop to after it: no local access between the first and last WGMMA);
    the stores and adds are issued by a converged warp (no BRA.DIV since the last barrier: elect.sync). softcap: the
    entry call_softcap_first_store."""
    base, _ = _ptx(tmp_path, cute_env, d, causal, False, gqa, softcap)
    text, path = _ptx(tmp_path, cute_env, d, causal, True, gqa, softcap)
    name = os.path.basename(path)
    assert ("call_softcap_first_store" if softcap else "call_first_store") in name
    store = "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
    reduce_add = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
    assert _count(text, store) - _count(base, store) == 2
    assert _count(text, reduce_add) == _count(base, reduce_add) == 2
    assert (_count(base, "atom.global.add"), _count(text, "atom.global.add.u32")) == (0, 1)
    assert (_count(base, "ld.acquire.gpu.global"), _count(text, "ld.acquire.gpu.global")) == (0, 4)
    assert (_count(base, "red.release.gpu.global.add"), _count(text, "red.release.gpu.global.add")) == (0, 2)
    assert _count(text, "cp.async.bulk.wait_group ") - _count(base, "cp.async.bulk.wait_group ") == 2
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True,
                         check=True)
    log = out.stdout + out.stderr
    assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
    spill = max([int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)] or [0])
    assert spill == 0 or (gqa and (d, causal) == (128, True) and spill <= 16), log
    code = _sass(path)
    wgmma = [i for i, (_, ins) in enumerate(code) if ins.startswith("HGMMA")]
    assert not [ins for _, ins in code[wgmma[0]:wgmma[-1]] if ins.startswith(("LDL", "STL"))]
    div, bad = False, []
    for addr, ins in code:
        if ins.startswith("BAR.SYNC"):
            div = False
        elif "BRA.DIV" in ins:
            div = True
        elif ("UTMAREDG" in ins or "UTMASTG" in ins) and div:
            bad.append(hex(addr))
    assert bad == [] and sum("UTMAREDG" in ins for _, ins in code) == 2


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("d,causal", [(64, True), (128, False), (128, True)])
def test_deterministic_first_turn_stores(tmp_path, cute_env, d, causal):
    """Deterministic (the writer warp's turns): the first turn's TMA store beside the reduce-add at the writer's one
    site (one more store than the kernel without it), no tickets (no atom), the turns' acquire / release as before."""
    texts = []
    for on in (False, True):
        cute_env(OVERRIDES=f"bwd.dq_first_store={int(on)}")
        dump = tmp_path / f"det{int(on)}"
        dump.mkdir()
        kernels.compile_bwd(torch.bfloat16, d, causal, arch="sm_90a", dump_dir=str(dump), deterministic=True)
        (ptx,) = glob.glob(str(dump / "*.ptx"))
        texts.append(open(ptx).read())
    base, text = texts
    store = "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
    assert _count(text, store) - _count(base, store) == 1 and "atom.global.add" not in text
    for needle in ("cp.reduce.async.bulk.tensor", "ld.acquire.gpu.global", "red.release.gpu.global.add"):
        assert _count(text, needle) == _count(base, needle) > 0, needle


def test_host_hands_the_tickets_before_the_scalars(monkeypatch, cute_env):
    """launch.backward with dq_first_store: the tickets (B, H, query blocks) int32 after the tensors, then
    call_first_store's scale, or call_softcap_first_store's scale, softcap, 0, 0 (the torch host path: zeroed)."""
    from flash_attn.cute import launch

    cute_env(OVERRIDES="plan.bwd_host=torch," + ON)
    dtype, D = torch.float16, 64
    seen = []

    def kernel(*args):
        seen.append(args[9:])

    block_m = kernels.bwd_config(dtype, D, False, "sm_90a").block_m
    for softcap in (False, True):
        monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, False, "sm_90a", softcap=softcap),
                            kernel)
    q, k = torch.randn(2, 70, 2, D).to(dtype), torch.randn(2, 90, 2, D).to(dtype)
    lse = torch.randn(2, 2, 70)
    launch.backward(q, q, k, k, q, lse, 0.125, False)
    tickets, *rest = seen[-1]
    assert tickets.dtype == torch.int32 and tickets.shape == (2, 2, -(-70 // block_m)) and not tickets.any()
    assert rest == [0.125]
    launch.backward(q, q, k, k, q, lse, 0.125, False, softcap=30.0)
    tickets, *rest = seen[-1]
    block_m = kernels.bwd_config(dtype, D, False, "sm_90a", softcap=True).block_m  # (64: softcap's)
    assert tickets.shape == (2, 2, -(-70 // block_m)) and rest == [0.125, 30.0, 0, 0]


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _kernels_for(monkeypatch, cute_env, on):
    """bwd.dq_first_store=on, with an empty in-memory table of backward kernels (keyed by the call, not the config:
    a kernel built under the other setting would be reused)."""
    from flash_attn.cute import launch

    cute_env(OVERRIDES=f"bwd.dq_first_store={int(on)}")
    table = {}
    monkeypatch.setattr(kernels, "_bwd_kernels", table)
    monkeypatch.setattr(launch, "_bwd_kernels", table)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (4096, 4096), (3000, 700)])
def test_deterministic_first_turn_repeats_bit_for_bit_on_gpu(monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k):
    """Deterministic with the first turn's store: five runs give the same bits, equal to the kernel without it (the
    same adds in the same order, the first onto nothing instead of onto zero: x + 0 is x)."""
    from flash_attn.cute import flash_attn_func

    g = torch.Generator().manual_seed(d + seqlen_q)
    q = torch.randn(2, seqlen_q, 4, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, seqlen_k, 2, d, generator=g).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2))
    dout = torch.randn(2, seqlen_q, 4, d, generator=g).to("cuda", torch.bfloat16)
    runs = {}
    for on in (False, True):
        _kernels_for(monkeypatch, cute_env, on)
        assert kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", deterministic=True).dq_first_store == on
        runs[on] = []
        for _ in range(5 if on else 1):
            out, _ = flash_attn_func(q, k, v, causal=causal, deterministic=True)
            runs[on].append(torch.autograd.grad(out, (q, k, v), dout))
    for run in runs[True]:
        for a, b in zip(run, runs[False][0]):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (4096, 4096), (256, 77), (300, 1200), (3000, 700)])
@pytest.mark.parametrize("heads_kv", [4, 1])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_gradients_run_after_run_on_gpu(monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k, heads_kv, softcap):
    """dq, dk, dv within the project's criterion against the upcast oracle, in three runs (a store that an add
    overtook, or tickets left unzeroed, changes a run's dQ); and within a few roundings of the kernel without
    first_store. (3000, 700) causal: whole query blocks that no key block sees (dq_accum zeroed for them). heads_kv 1:
    MQA on the gqa_loop kernel (plan rule bwd_gqa_loop, on), its walk over the group rotated without a causal mask.
    softcap 30: call_softcap_first_store's kernel."""
    from flash_attn.cute import flash_attn_func

    g = torch.Generator().manual_seed(d + seqlen_q)
    B, H = 2, 4
    q = torch.randn(B, seqlen_q, H, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(B, seqlen_k, heads_kv, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    v = torch.randn(B, seqlen_k, heads_kv, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    dout = torch.randn(B, seqlen_q, H, d, generator=g).to("cuda", torch.bfloat16)
    grads = {}
    for on in (False, True):
        _kernels_for(monkeypatch, cute_env, on)
        cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a", gqa_loop=heads_kv < H, softcap=softcap > 0)
        assert cfg.dq_first_store == on
        runs = []
        for _ in range(3 if on else 1):
            out, _ = flash_attn_func(q, k, v, causal=causal, softcap=softcap)
            runs.append(torch.autograd.grad(out, (q, k, v), dout))
        grads[on] = runs
    ref, pt = [], []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = testing.attention_ref(qr, kr, vr, causal=causal, softcap=softcap, upcast=upcast, reorder_ops=not upcast)
        (ref if upcast else pt).extend(torch.autograd.grad(o, (qr, kr, vr), dout))
    for run in grads[True]:
        for name, a, r, p, off in zip(("dq", "dk", "dv"), run, ref, pt, grads[False][0]):
            testing.assert_close_to_ref(a, r, p, name)
            # dK / dV do not depend on dQ's order; dQ only by its fp32 rounding
            assert (a.float() - off.float()).abs().max() <= 4 * (off.float() - r.float()).abs().max() + 1e-3, name
