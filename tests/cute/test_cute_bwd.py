"""flash_attn.cute's Hopper backward kernel (flash_bwd_sm90.py): it compiles for sm_90a without a GPU and
its PTX holds the instructions the design rests on; its layout reinterpretations are checked on the
CuTe layouts; the cute backend serves backward calls by default and refuses them when FLASH_ATTN_CUTE_DISABLE names bwd;
on a Hopper GPU (tests marked gpu) dq, dk, dv match the reference within the project's criterion
(flash_attn.testing.assert_close_to_ref, as the Triton backward tests use it)."""
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

cute = pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn import testing  # noqa: E402
from flash_attn.cute import backend as cute_backend  # noqa: E402
from flash_attn.cute import config, kernels, launch, settings  # noqa: E402
from test_cute_bwd_varlen import kernel_layout  # noqa: E402 (dq_accum's layout, the stand-in kernels')
from _cute_table import cute_settings as _cute_settings  # noqa: E402
from flash_attn.dispatch import Call  # noqa: E402
from flash_attn.testing import backend_bwd, backend_fwd


def _overrides(fields):
    """FLASH_ATTN_CUTE_OVERRIDES's text for {"section.field": value} (bools as 1 / 0; None: left out)."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in fields.items() if v is not None)


def _fresh_bwd_kernels(monkeypatch):
    """An empty in-memory backward kernel table (it does not key on the overrides), where kernels.py fills it and
    launch.py reads it."""
    table = {}
    monkeypatch.setattr(kernels, "_bwd_kernels", table)
    monkeypatch.setattr(launch, "_bwd_kernels", table)

# (dtype, head dim, causal, dq_split, dq_tma): every dtype / head dim / mask with the default dQ split
# and atomics, the per-warpgroup dQ variant (bwd.dq_split=0) and the TMA reduce-add of dQ (bwd.dq_tma=1) at every
# head dim
CONFIGS = ([(dtype, d, causal, True, False) for dtype in (torch.bfloat16, torch.float16) for d in (64, 96, 128)
            for causal in (False, True)]
           + [(torch.bfloat16, 64, True, False, False), (torch.bfloat16, 96, False, False, False),
              (torch.bfloat16, 128, False, False, False)]
           + [(torch.bfloat16, 64, True, True, True), (torch.bfloat16, 96, False, True, True),
              (torch.float16, 96, True, True, True), (torch.bfloat16, 128, False, True, True)])


# TMA boxes of one dQ tile reduce-add: one, the unswizzled tile in config.permuted_column's layout (dq_perm, which every
# dq_tma kernel takes)
DQ_BOXES = 1


def _ids(cfg):
    dtype, d, causal, dq_split, dq_tma = cfg
    return (f"{str(dtype).split('.')[-1]}-d{d}-{'causal' if causal else 'full'}{'' if dq_split else '-dq_per_wg'}"
            f"{'-dq_tma' if dq_tma else ''}")


@pytest.fixture(scope="module", params=CONFIGS, ids=_ids)
def compiled(request, tmp_path_factory):
    """(config dict, PTX text, PTX path) of one backward compile, shared by the PTX checks."""
    dtype, d, causal, dq_split, dq_tma = request.param
    dump = tmp_path_factory.mktemp("bwd")
    # The 64-row loop at both head dims (d64's default is the 128-row loop, whose PTX and ptxas checks
    # are test_block_m_128_kernel_is_spill_free's).
    with _cute_settings(OVERRIDES=_overrides({"bwd.block_m": 64, "bwd.dq_split": dq_split, "bwd.dq_tma": dq_tma})):
        cfg = kernels.bwd_config(dtype, d, causal, "sm_90a").key()
        assert cfg["dq_tma"] == dq_tma
        t0 = time.perf_counter()
        kernels.compile_bwd(dtype, d, causal, arch="sm_90a", dump_dir=str(dump))
    print(f"\ncompile bwd {_ids(request.param)}: {time.perf_counter() - t0:.2f} s")
    (ptx,) = glob.glob(str(dump / "*.ptx"))
    with open(ptx) as f:
        return cfg, f.read(), ptx


def _count(text, needle):
    return sum(line.lstrip().startswith(needle) for line in text.splitlines())


def test_ptx_targets_sm90a(compiled):
    assert ".target sm_90a" in compiled[1]


def test_ptx_has_the_five_wgmma_products(compiled):
    cfg, text, _ = compiled
    d = cfg["head_dim"]
    ab = "bf16.bf16" if cfg["dtype"] == "bf16" else "f16.f16"
    bm = cfg["block_m"]
    shapes = {}
    # S^T = K Q^T and dP^T = V dO^T: m64n{BM}k16, D/16 each; dV += P^T dO and dK += dS^T Q:
    # m64n{D}k16, BM/16 each; dQ = dS K: m64n{D/2}k16 over all 128 keys (dq_split), else m64n{D}k16
    # over the warpgroup's 64 keys.
    dq = (d // 2, 128 // 16) if cfg["dq_split"] else (d, 64 // 16)
    for n, count in ((bm, 2 * d // 16), (d, 2 * bm // 16), dq):
        shapes[n] = shapes.get(n, 0) + count
    for n, count in shapes.items():
        assert _count(text, f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}") == count, n
    assert _count(text, "wgmma.fence") >= 1 and _count(text, "wgmma.wait_group") >= 1


def test_ptx_loads_with_tma_and_mbarriers(compiled):
    text = compiled[1]
    assert _count(text, "cp.async.bulk.tensor") >= 6  # Q, dO, K, V tiles and the lse, delta rows
    assert "mbarrier.try_wait" in text and "expect_tx" in text


def test_ptx_is_warp_specialised_and_accumulates_dq_atomically(compiled):
    cfg, text, _ = compiled
    assert _count(text, "setmaxnreg.dec.sync.aligned.u32") == 1
    assert _count(text, "setmaxnreg.inc.sync.aligned.u32") == 1
    reduce_add = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
    if cfg["dq_tma"]:
        # dq_accum += the smem dQ tile by TMA: one box of 32 fp32 columns (a 128-byte swizzle atom) per
        # D / 32 (D = 96: 16-column boxes, 64-byte atoms), in the loop (previous block's tile) and after it (the
        # last one); bulk groups committed, the buffer's reads waited for before reuse, everything waited for
        # before exit
        assert _count(text, reduce_add) == 2 * DQ_BOXES
        # (+1 each: the dK / dV TMA stores' group and its read wait, tma_dkv, the dense default)
        tma_dkv = int(cfg.get("tma_dkv", False))
        assert _count(text, "cp.async.bulk.commit_group") == 2 + tma_dkv
        assert _count(text, "cp.async.bulk.wait_group.read") == 1 + tma_dkv
        # the final full wait ("wait_group \t0"); dq_first_store (the default): a query block's first tile stored by
        # TMA in the loop's and the last block's reduce, each store waited for in full before its ticket is marked
        # ready (release), the block's ticket taken by an atomic add and a later tile's add behind an acquire
        first = cfg.get("dq_first_store", False)
        assert _count(text, "cp.async.bulk.wait_group ") == 1 + 2 * first
        assert _count(text, "atom.global.add.u32") == first  # (the stores: test_cute_bwd_first_store.py)
        assert (_count(text, "ld.acquire.gpu.global"), _count(text, "red.release.gpu.global.add")) == (4 * first,
                                                                                                        2 * first)
        assert "red.relaxed.gpu.global.add" not in text
        # dQ to smem: 16 bytes per row and 16 columns of a thread (dq_perm)
        assert cfg["dq_perm"] and _count(text, "st.shared.v4.b32") >= cfg["head_dim"] // 16
    else:
        assert _count(text, "red.relaxed.gpu.global.add.v2.f32") >= 1  # dq_accum += dS K, column pairs
        assert reduce_add not in text
    assert "fence.proxy.async.shared::cta" in text  # dS stores made visible to the WGMMA's async proxy
    assert "ex2.approx" in text
    # launched with .minnctapersm 1: without it ptxas may drop setmaxnreg (C7508)
    assert ".minnctapersm 1" in text


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_ptxas_keeps_setmaxnreg_and_wgmma_pipelined(compiled):
    """ptxas honours the register split (no C7508) and does not serialise the WGMMAs (C7510-C7520:
    'wgmma.mma_async instructions are serialized'), the two silent performance cliffs of this design."""
    cfg, _, ptx = compiled
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True,
                         text=True, check=True)
    log = out.stdout + out.stderr
    assert "setmaxnreg' ignored" not in log, log
    assert "are serialized" not in log, log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    print(f"\nptxas: {spills} bytes of spill stores")
    # Nothing, but one word in the TMA dQ kernel (the default) at D = 128: more means the 240-register budget broke.
    # (With the dS^T stores' swizzled addresses held across the loop, before stmatrix, that kernel spilled 76-88
    # bytes, reloaded per block.)
    limit = 4 if cfg["dq_tma"] and cfg["head_dim"] == 128 else 0
    assert all(x <= limit for x in spills), log


def test_loop_issues_dq_before_dk_and_stores_ds_by_stmatrix(compiled):
    """The 64-row loop: dS^T goes to shared memory by stmatrix (four m8n8.x4 per thread and block, before the dS
    barrier), then dQ's WGMMAs (both operands MN-major) are issued before dK's (A K-major, B MN-major), the previous
    tile's TMA reduce-add behind both, and the loop waits for dV and dQ alone (wait_group 1) before dQ goes out while dK
    runs (1.04-1.11x the old order on an H100, benchmarks/results/h100/cute_bwd_ab.md)."""
    cfg, text, _ = compiled
    lines = [l.strip() for l in text.splitlines()]
    barrier = "bar.sync \t1, 256;" if cfg["dq_split"] else "bar.sync \t%r"
    first = next(i for i, l in enumerate(lines) if l.startswith(barrier))
    stsm = [i for i, l in enumerate(lines[:first]) if l.startswith("stmatrix.sync.aligned.m8n8.x4.shared.b16")]
    assert len(stsm) == 4 and all(i > first - 200 for i in stsm)  # this block's dS^T, just before the barrier
    after = lines[first:]
    mma = [l for l in after if l.startswith("wgmma.mma_async")]
    d = cfg["head_dim"]
    dq_n = d // 2 if cfg["dq_split"] else d
    n_dq = (128 if cfg["dq_split"] else 64) // 16
    assert all(f"m64n{dq_n}k16" in l and l.endswith("p, 1,  1, 1, 1;") for l in mma[:n_dq]), mma[:n_dq]
    assert all(f"m64n{d}k16" in l and l.endswith("p, 1,  1, 0, 1;") for l in mma[n_dq:n_dq + 4]), mma[n_dq:n_dq + 4]
    last_dk = max(i for i, l in enumerate(after[:after.index(mma[n_dq + 3]) + 1]) if l.startswith("wgmma.mma_async"))
    waits = [l for l in after[last_dk:] if l.startswith("wgmma.wait_group")][:2]
    assert waits == ["wgmma.wait_group.sync.aligned \t1;", "wgmma.wait_group.sync.aligned \t0;"]
    if cfg["dq_tma"]:
        reduce_at = next(i for i, l in enumerate(after) if l.startswith("cp.reduce.async.bulk.tensor"))
        assert last_dk < reduce_at < after.index(waits[0])


@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, True)])
def test_dq_writer_warp_issues_the_reduce_adds(tmp_path, cute_env, d, causal):
    """bwd.dq_writer=1 (off by default until timed; only with the TMA dQ, not with overlap): one reduce-add site (the
    writer warp's loop) instead of two (in the loop and after it), handed over through the named barriers 6 / 7
    (FULL: the consumers arrive, the writer waits) and 8 / 9 (EMPTY: the writer arrives, the consumers wait), each
    counting the 256 consumer threads and the writer's 32; the consumers wait for no bulk group; issued by a
    converged warp; ptxas spills nothing more than the default kernel and keeps the WGMMAs pipelined."""
    cfg = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a")
    assert "dq_writer" not in cfg.key()
    cute_env(OVERRIDES="bwd.dq_writer=1,bwd.dq_tma=0")
    assert not kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a").dq_writer
    cute_env(OVERRIDES="bwd.dq_writer=1,bwd.overlap=1")
    assert not kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a").dq_writer
    base, base_ptx = _compile_ptx(tmp_path, cute_env, d, causal, {"bwd.dq_writer": False})
    text, ptx = _compile_ptx(tmp_path, cute_env, d, causal, {"bwd.dq_writer": True})
    assert kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a").key()["dq_writer"] is True
    reduce_add = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
    assert _count(base, reduce_add) == 2 * DQ_BOXES and _count(text, reduce_add) == DQ_BOXES
    assert _count(text, "bar.arrive") == 2 and text.count(", 288;") == 4  # 2 syncs, 2 arrives
    assert base.count(", 288;") == 0
    # the writer's one wait for the reads and its final wait; the TMA dK / dV store's read wait
    assert _count(text, "cp.async.bulk.wait_group.read") == _count(base, "cp.async.bulk.wait_group.read")
    code = _sass(ptx)
    assert sum("UTMAREDG" in ins for _, ins in code) == DQ_BOXES and _divergent_tma_reduces(code) == []
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    spills = {}
    for name, path in (("default", base_ptx), ("writer", ptx)):
        log = _ptxas_log(path)
        assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
        spills[name] = max([int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)] or [0])
    assert spills["writer"] <= spills["default"], spills


def _sass(ptx_path):
    """[(address, instruction)] of the cubin CuTeDSL wrote next to ptx_path."""
    tool = testing.cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    (cubin,) = glob.glob(os.path.join(os.path.dirname(ptx_path), "*.cubin"))
    out = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", out)]


def _divergent_tma_reduces(code):
    """Addresses of the TMA reduce-adds (UTMAREDG) reached after a BRA.DIV since the last barrier: ptxas
    emits BRA.DIV (to a WARPSYNC.COLLECTIVE fallback) before an elect.sync it cannot prove to run on a
    converged warp."""
    bad, div = [], False
    for addr, ins in code:
        if ins.startswith("BAR.SYNC"):
            div = False
        elif "BRA.DIV" in ins:
            div = True
        elif "UTMAREDG" in ins and div:
            bad.append(hex(addr))
    return bad


def test_tma_dq_reduce_is_issued_by_a_converged_warp(compiled):
    """The dQ TMA reduce-adds are issued by a whole warp: cute.copy of a TMA atom picks its issuing lane
    with elect.sync over the full warp, which waits for all 32 lanes; with one lane let in (ctid == 0,
    the first dq_tma build) the other 31 wait at the next barrier or WGMMA instead, and the kernel hung
    on the GPU. That build's SASS has a BRA.DIV before every reduce."""
    cfg, _, ptx = compiled
    if not cfg["dq_tma"]:
        pytest.skip("no TMA reduce-add in this variant")
    code = _sass(ptx)
    assert sum("UTMAREDG" in ins for _, ins in code) == 2 * DQ_BOXES
    assert _divergent_tma_reduces(code) == []


# ----------------------------------------------------------------------------------------------------
# bwd.tma_dkv: dK and dV through the K / V tiles in shared memory and TMA stores


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, True)])
def test_tma_dkv_stores_dk_and_dv_through_shared_memory(tmp_path, cute_env, d, causal):
    """bwd.tma_dkv=1: the epilogue writes dK and dV into the K and V tiles with stmatrix (D / 16 instructions per
    tensor a thread: its D / 2 values, 8 each) and sends them by TMA stores (bulk groups, their smem reads waited for
    before the CTA exits), and no 16-bit st.global is left (the default kernel stores every value with one); the
    loop's register budget holds (no more spill than the default kernel, no serialised WGMMA)."""
    # (the first_store kernel's dQ tile stores off: they are TMA stores too)
    base, base_ptx = _compile_ptx(tmp_path, cute_env, d, causal, {"bwd.tma_dkv": False, "bwd.dq_first_store": False})
    text, ptx = _compile_ptx(tmp_path, cute_env, d, causal, {"bwd.tma_dkv": True, "bwd.dq_first_store": False})
    store = "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group"
    assert _count(base, store) == 0 and _count(text, store) >= 2
    assert _count(base, "st.global.b16") == 2 * d // 2 and _count(text, "st.global.b16") == 0
    stsm = "stmatrix.sync.aligned.m8n8.x4.shared.b16"
    assert _count(text, stsm) - _count(base, stsm) == 2 * d // 16
    assert _count(text, "cp.async.bulk.wait_group.read") == _count(base, "cp.async.bulk.wait_group.read") + 1
    spills = {}
    for name, path in (("default", base_ptx), ("tma_dkv", ptx)):
        log = _ptxas_log(path)
        assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
        spills[name] = max([int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)] or [0])
    print(f"\nptxas spill bytes d{d}: {spills}")
    assert spills["tma_dkv"] <= spills["default"]


def test_tma_dkv_config_key_and_refusals(cute_env):
    """On by default for dense calls and varlen calls at d64-d128 (in their keys; their key blocks that end inside
    the sequence by TMA, a sequence's last partial block by the direct stores); bwd.tma_dkv=0 gives the direct
    stores' keys back; the split-D kernel's varlen calls take it only from the override."""
    for d in (64, 96, 128):
        assert kernels.bwd_config(torch.bfloat16, d, True, "sm_90a").key()["tma_dkv"] is True
        assert kernels.bwd_config(torch.bfloat16, d, True, "sm_90a", varlen=True).key()["tma_dkv"] is True
    assert "tma_dkv" not in kernels.bwd_config(torch.bfloat16, 256, True, "sm_90a", varlen=True).key()
    cute_env(OVERRIDES="bwd.tma_dkv=0")
    assert "tma_dkv" not in kernels.bwd_config(torch.bfloat16, 128, False, "sm_90a").key()
    assert "tma_dkv" not in kernels.bwd_config(torch.bfloat16, 128, False, "sm_90a", varlen=True).key()
    cute_env(OVERRIDES="bwd.tma_dkv=1")
    assert kernels.bwd_config(torch.bfloat16, 256, True, "sm_90a", varlen=True).key()["tma_dkv"] is True


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_varlen_tma_dkv_keeps_the_direct_stores_for_a_sequences_last_block(tmp_path, cute_env):
    """bwd.tma_dkv=1 on the varlen kernel: the TMA stores and stmatrix of the dense epilogue, and the direct 16-bit
    stores as well (a sequence's last partial key block, which TMA cannot clip at the sequence's end); ptxas spills no
    more than the varlen kernel without it."""
    logs = {}
    for tma in (False, True):
        cute_env(OVERRIDES=f"bwd.tma_dkv={int(tma)}")
        dump = tmp_path / f"tma{int(tma)}"
        dump.mkdir()
        kernels.compile_bwd(torch.bfloat16, 128, True, arch="sm_90a", dump_dir=str(dump), varlen=True)
        (ptx,) = glob.glob(str(dump / "*.ptx"))
        text = open(ptx).read()
        store = _count(text, "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group")
        assert (store >= 2) == tma and _count(text, "st.global.b16") == 2 * 128 // 2
        log = _ptxas_log(ptx)
        assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
        logs[tma] = max([int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)] or [0])
    assert logs[True] <= logs[False], logs


# ----------------------------------------------------------------------------------------------------
# bwd.overlap: the software-pipelined query loop


def _compile_ptx(tmp_path, cute_env, d, causal, fields):
    """The PTX text and path of the bf16 backward built with the overrides {"bwd.field": value} (left set)."""
    cute_env(OVERRIDES=_overrides(fields))
    dump = tmp_path / "_".join(f"{k.split('.')[-1]}{int(v) if isinstance(v, bool) else v}"
                               for k, v in fields.items())
    dump.mkdir()
    kernels.compile_bwd(torch.bfloat16, d, causal, arch="sm_90a", dump_dir=str(dump))
    (ptx,) = glob.glob(str(dump / "*.ptx"))
    with open(ptx) as f:
        return f.read(), ptx


def _wgmmas_between_dq_and_atomics(text, d, bm):
    """WGMMAs of S^T / dP^T shape (m64n{bm}k16, both operands K-major) issued after the last dQ WGMMA
    (m64n{d/2}k16, both MN-major) that precedes the first dq_accum atomic, and the wait_group just before that atomic."""
    lines = [l.strip() for l in text.splitlines()]
    first_red = next(i for i, l in enumerate(lines) if l.startswith("red.relaxed.gpu.global.add"))
    last_dq = max(i for i, l in enumerate(lines[:first_red])  # dQ: both operands MN-major (transposed)
                  if f"wgmma.mma_async.sync.aligned.m64n{d // 2}k16" in l and l.endswith("p, 1,  1, 1, 1;"))
    sdp = [l for l in lines[last_dq:first_red]
           if f"wgmma.mma_async.sync.aligned.m64n{bm}k16" in l and l.endswith("p, 1,  1, 0, 0;")]
    waits = [l for l in lines[last_dq:first_red] if l.startswith("wgmma.wait_group")]
    return len(sdp), waits


@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, False)])
def test_overlap_issues_the_next_block_before_the_dq_atomics(tmp_path, cute_env, d, causal):
    """With bwd.overlap=1, between this block's dQ WGMMA and its dq_accum atomics the
    loop issues the next block's S^T and dP^T (D = 64 / 96; D = 128: S^T only, 2 x D/16 or D/16 WGMMAs)
    and waits only for the older groups (wait_group 2 / 1); the default build issues nothing there and
    waits for dV and dQ (wait_group 1: dK, issued after dQ, runs on). ptxas keeps the WGMMAs pipelined and spills
    at most a few words."""
    # the atomics path (the TMA dQ has its own test), the 64-row loop (128 rows: its own overlap test)
    fields = {"bwd.dq_tma": False, "bwd.block_m": 64}
    cute_env(OVERRIDES=_overrides(fields))
    bm = kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a").block_m
    assert bm == 64
    base, _ = _compile_ptx(tmp_path, cute_env, d, causal, {**fields, "bwd.overlap": False})
    text, ptx = _compile_ptx(tmp_path, cute_env, d, causal, {**fields, "bwd.overlap": True})
    assert _wgmmas_between_dq_and_atomics(base, d, bm) == (0, ["wgmma.wait_group.sync.aligned \t1;"])
    ahead = 2 * d // 16 if d != 128 else d // 16
    assert _wgmmas_between_dq_and_atomics(text, d, bm) == (
        ahead, [f"wgmma.wait_group.sync.aligned \t{2 if d != 128 else 1};"])
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas not on PATH")
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                         check=True)
    log = out.stdout + out.stderr
    assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert all(x <= (32 if d == 128 else 0) for x in spills), log


def test_overlap_config_key_and_refusals(monkeypatch, cute_env):
    """The option is in the cache key only when on (the default kernels keep their disk entries); the
    kernel refuses a 1-stage ring (stage j + 1 waited for while j is held: a deadlock) and the
    per-warpgroup dQ at D = 96 / 128 (does not fit the register budget)."""
    import cutlass

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    base = kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()
    assert "overlap" not in base and config.BWD_OVERLAP == {64: False, 96: False, 128: False}
    key = kernels._bwd_entry(torch.bfloat16, 64, True, "sm_90a")[1]
    cute_env(OVERRIDES="bwd.overlap=0")
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key() == base
    cute_env(OVERRIDES="bwd.overlap=1")
    # (the first_store kernel takes no overlap: where it is the default, overlap turns it off)
    expect = {k: v for k, v in base.items() if k != "dq_first_store"}
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key() == {**expect, "overlap": True}
    assert kernels._bwd_entry(torch.bfloat16, 64, True, "sm_90a")[1] != key
    monkeypatch.setitem(config.BWD_OVERLAP, 128, True)
    cute_env(OVERRIDES=None)
    assert kernels.bwd_config(torch.bfloat16, 128, False, "sm_90a").overlap is True
    assert "overlap" not in kernels.bwd_config(torch.bfloat16, 64, False, "sm_90a").key()
    with pytest.raises(ValueError, match="num_stages >= 2"):
        FlashBwdSm90(cutlass.BFloat16, 64, True, num_stages=1, overlap=True)
    for d in (96, 128):
        with pytest.raises(ValueError, match="dq_split=False"):
            FlashBwdSm90(cutlass.BFloat16, d, True, dq_split=False, overlap=True)
        FlashBwdSm90(cutlass.BFloat16, d, True, dq_split=False)  # without the option: allowed
    FlashBwdSm90(cutlass.BFloat16, 64, True, num_stages=1)  # without the option: allowed
    FlashBwdSm90(cutlass.BFloat16, 64, True, dq_split=False, overlap=True)


# ----------------------------------------------------------------------------------------------------
# bwd.lpt: the grouped longest-first CTA order


@pytest.mark.parametrize("n_blocks,heads,batches,lpt", [(16, 16, 8, 128), (8, 5, 3, 16), (64, 4, 2, 128),
                                                        (3, 7, 1, 1), (1, 2, 2, 1000), (5, 3, 3, 12)])
def test_lpt_order_covers_every_tile_once_longest_first_per_group(n_blocks, heads, batches, lpt):
    from flash_attn.cute.tile_scheduler import lpt_tile

    pairs = heads * batches
    tiles = [lpt_tile(i, n_blocks, heads, batches, lpt) for i in range(n_blocks * pairs)]
    assert sorted(tiles) == sorted((n, h, b) for n in range(n_blocks) for h in range(heads) for b in range(batches))
    g = max(min(lpt // n_blocks, pairs), 1)
    for start in range(0, n_blocks * pairs, g * n_blocks):  # inside a group: key block 0 of every pair first
        blocks = [t[0] for t in tiles[start:start + g * n_blocks]]
        assert blocks == sorted(blocks) and blocks[0] == 0


def test_lpt_config_key_and_one_dimensional_grid(tmp_path, cute_env):
    """The option is in the cache key only when on (the plain-grid kernels keep their disk entries): by
    default for causal d64, and its kernel reads only blockIdx.x (the 1-D grid) where the plain grid
    reads blockIdx.y for the head."""
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()["lpt"] == 128
    for d, causal in ((64, False), (128, True), (128, False)):
        assert "lpt" not in kernels.bwd_config(torch.bfloat16, d, causal, "sm_90a").key()
    cute_env(OVERRIDES="bwd.lpt=0")
    base = kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()
    assert "lpt" not in base
    cute_env(OVERRIDES="bwd.lpt=128")
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key() == {**base, "lpt": 128}
    text, _ = _compile_ptx(tmp_path, cute_env, 64, True, {"bwd.lpt": 128})
    assert "%ctaid.y" not in text and "%ctaid.z" not in text and "%ctaid.x" in text
    base_text, _ = _compile_ptx(tmp_path, cute_env, 64, True, {"bwd.lpt": 0})
    assert "%ctaid.y" in base_text
# bwd.block_m=128 (head dim 64): 128 query rows per step


def _ptxas_log(ptx):
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                         check=True)
    return out.stdout + out.stderr


@pytest.mark.parametrize("d", [64, 96, 128])
def test_dq_perm_writes_the_dq_tile_128_bits_at_a_time(tmp_path, cute_env, d):
    """dq_perm (every dq_tma kernel's; H100: the kernel 1.02-1.13x over the swizzled tile it replaced): dq_accum in
    config.permuted_column's layout, so each thread's four dQ values of a row in 16 columns go to the shared tile in one
    16-byte store (half the stores of 8-byte pairs: d128 8 per query block; d64's 128-row loop and d96's 48-column
    halves too) and the unswizzled tile goes out in one TMA reduce-add (the swizzled one took a box per 32 columns, 16
    at d96); only where dQ goes by the TMA tile (the split-D kernel's atomics do not); ptxas spills nothing."""
    text, ptx = _compile_ptx(tmp_path, cute_env, d, True, {"bwd.dq_split": True})  # (the default)
    v2, v4 = r"\bst\.shared\.v2\.b32\b", r"\bst\.shared\.v4\.b32\b"
    pairs = kernels.bwd_config(torch.bfloat16, d, True, "sm_90a").block_m * d // 512  # 8-byte stores it would take
    assert len(re.findall(v4, text)) == pairs // 2 and not re.findall(v2, text)
    reduce = r"cp\.reduce\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.add"
    assert len(re.findall(reduce, text)) == 2  # (issued in the loop and after it)
    assert kernels.bwd_config(torch.bfloat16, d, True, "sm_90a").key()["dq_perm"] is True
    assert not kernels.bwd_config(torch.bfloat16, 256, True, "sm_90a").dq_perm
    if shutil.which("ptxas"):
        log = _ptxas_log(ptx)
        assert "are serialized" not in log, log
        assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes spill stores", log)), log


@pytest.mark.parametrize("d,split,rows", [(64, True, False), (96, True, False), (128, True, False), (192, True, False),
                                           (256, True, False), (128, False, False), (64, True, True)])
def test_dq_fragment_columns_step_by_8_from_each_row(d, split, rows):
    """DqAccumulator.atomic_add addresses a thread's dQ values from one pointer per row: value (x, r, j), m, n of the
    kernel's dQ tiled MMA (bwd_entries: N = D / 2 per warpgroup with dq_split, D without; dq_rows: the warpgroups
    split 128 rows) is row R + 8 r and column c + 8 j + x, with (R, c) the coordinates of value (0, r, 0), m, n."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    block_m = 128 if rows else 64
    n, atoms = (d, (2, 1, 1)) if rows else ((d // 2, (1, 2, 1)) if split else (d, (1, 1, 1)))
    bad = []

    def compare(mma):  # plain Python (not @cute.jit, whose loops become device code): every value is static
        for t in (0, 1, 5, 37, 127, 128, 130, 255):
            c = mma.get_slice(t if split or rows else t % 128).partition_C(cute.make_identity_tensor((block_m, d)))
            for m in range(cute.size(c, mode=[1])):
                for nn in range(cute.size(c, mode=[2])):
                    for r in range(2):
                        row, col = c[(0, r, 0), m, nn]
                        for j in range(cute.size(c, mode=[0, 2])):
                            for x in range(2):
                                if tuple(c[(x, r, j), m, nn]) != (row, col + 8 * j + x):
                                    bad.append((t, x, r, j, m, nn))

    @cute.jit
    def check():
        compare(cute.make_tiled_mma(cute.make_mma_atom(warpgroup.MmaF16BF16Op(
            cutlass.BFloat16, cutlass.Float32, (64, n, 16), warpgroup.OperandSource.SMEM, OperandMajorMode.MN,
            OperandMajorMode.MN)), atoms))

    cute.compile(check, options="--gpu-arch sm_90a")
    assert bad == [], bad[:20]


def test_dq_atomics_test_and_address_once_per_row(tmp_path, cute_env):
    """The split-D kernel (d256) adds dQ with red.global.add.v2.f32: per row of a thread one bounds test (a branch
    around 16 adds) and one address, the adds at constant offsets from it, not a branch and a recomputed 64-bit
    address per add (SASS: 32 BSSY and 91 S2UR before, 1147 loop instructions against 628)."""
    _, ptx = _compile_ptx(tmp_path, cute_env, 256, True, {"bwd.dq_split": True})
    ops = [ins.split()[1 if ins.startswith("@") else 0].split(".")[0] for _, ins in _sass(ptx)]
    assert ops.count("REDG") == 32 and ops.count("BSSY") <= 2, (ops.count("REDG"), ops.count("BSSY"))
    assert ops.count("S2UR") <= 40 and ops.count("LEA") <= 20, (ops.count("S2UR"), ops.count("LEA"))


def test_dq_perm_needs_the_tma_tile_at_head_dims_of_32():
    base = dict(dtype="bf16", causal=True, arch="sm_90a", abi="cute", block_m=64, stages=2, dq_split=True)
    config.BwdConfig(head_dim=96, dq_tma=True, dq_perm=True, **base)
    with pytest.raises(ValueError, match="dq_perm"):
        config.BwdConfig(head_dim=64, dq_tma=False, dq_perm=True, **base)
    with pytest.raises(ValueError, match="dq_perm"):  # the TMA dQ tile is the permuted one
        config.BwdConfig(head_dim=64, dq_tma=True, dq_perm=False, **base)
    with pytest.raises(ValueError, match="dq_perm is not a tunable"):  # (it follows dq_tma)
        with _cute_settings(OVERRIDES="bwd.dq_perm=0"):
            config.overrides("bwd")
    with pytest.raises(ValueError, match="dq_perm"):
        config.BwdConfig(head_dim=80, dq_tma=True, dq_perm=True, **base)


def test_dq_perm_layout_is_what_the_cast_reads_back():
    """config.permuted_column is a permutation of each row's columns; a thread's columns 8 g + 2 q + x (g, x in 0, 1)
    of a 16-column block land on 16 contiguous bytes; in odd rows the blocks swap in pairs (the two rows a quarter warp
    stores at once on different banks); bwd_host.unpermute (the torch cast) reads a tensor stored that way back."""
    from flash_attn.cute import bwd_host, config

    for D in (64, 96, 128):
        for row in (0, 1, 6, 7):
            cols = [config.permuted_column(row, c) for c in range(D)]
            assert sorted(cols) == list(range(D))
            for b in range(D // 16):
                for q in range(4):
                    four = sorted(cols[16 * b + 8 * g + 2 * q + x] for g in (0, 1) for x in (0, 1))
                    assert four == list(range(four[0], four[0] + 4)) and four[0] % 4 == 0
                    assert four[0] // 16 == b ^ (row & 1)
    for S in (6, 7):
        x = torch.randn(2, S, 3, 96)
        stored = torch.empty_like(x)
        for r in range(S):
            stored[:, r, :, [config.permuted_column(r, c) for c in range(96)]] = x[:, r]
        assert torch.equal(bwd_host.unpermute(stored), x)


@pytest.mark.parametrize("D", [64, 96, 128])
def test_triton_cast_of_the_permuted_layout_matches_the_torch_cast(D):
    """bwd_host.finish's cast of a dq_accum in config.permuted_column's layout (loaded in stored order, reordered in
    registers, stored 16 bytes at a time) equals the torch cast bit for bit: rows of both parities, Sq cut inside a
    64-row tile, D = 96 masked inside the 128-column tile, dq a strided slice; fp16 (the interpreter's bf16 is wrong)."""
    from flash_attn.cute import bwd_host, config

    if bwd_host.triton is None or not bwd_host._INTERPRET:
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1)")
    B, Sq, H = 2, 77, 3
    g = torch.Generator().manual_seed(D)
    vals = torch.randn(B, Sq, H, D, generator=g) * 100
    acc = torch.empty_like(vals)
    for r in range(Sq):
        acc[:, r, :, [config.permuted_column(r, c) for c in range(D)]] = vals[:, r]
    got = torch.full((B, Sq, 2, H, D), float("nan"), dtype=torch.float16)[:, :, 1]
    want = torch.empty(B, Sq, H, D, dtype=torch.float16)
    bwd_host.finish(acc, got, perm=True)
    bwd_host.finish_torch(acc, want, perm=True)
    assert torch.equal(got, want) and torch.equal(want, vals.half())


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("overlap,emu", [(False, 0), (True, 0), (False, 6)], ids=["plain", "overlap", "exp2_emu"])
def test_block_m_128_kernel_is_spill_free(tmp_path, cute_env, overlap, emu):
    """The BLOCK_M = 128 kernel (d64, causal, TMA dQ: the configuration bwd.block_m=128
    gives) fits its 240 registers: ptxas spills nothing and keeps the WGMMAs pipelined. Its first build
    (the BLOCK_M = 64 code on 128 rows) spilled 160 bytes and serialised them; then the fp32 S^T live
    until dS^T, the swizzled smem-store addresses hoisted out of the loop, or dS^T stored 4 bytes at a
    time each broke the budget. Also the PTX of the design: m64n128k16 S^T and dP^T, m64n64k16 dV, dK
    (both with A from registers) and the row-split dQ (no m64n32k16), dS^T by stmatrix, P^T packed and
    unpacked in 32-bit words.
    With bwd.overlap=1 (the next block's S^T issued behind dK and dQ, once dV is
    done: wait_group 2) the same holds; with dP^T ahead too it spilled 260 bytes and serialised. And
    with bwd.exp2_emu=6: 6 of every 16 exponentials by the FMA-pipe polynomial."""
    cfg = kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()
    assert cfg["block_m"] == 128 and "exp2_emu" not in cfg  # the default at d64 (measured faster)
    text, ptx = _compile_ptx(tmp_path, cute_env, 64, True, {"bwd.block_m": 128, "bwd.overlap": overlap,
                                                            "bwd.exp2_emu": emu})
    cfg = kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()
    assert (cfg["block_m"], cfg["stages"], cfg["dq_split"], cfg["dq_tma"]) == (128, 2, True, True)
    assert cfg.get("overlap", False) == overlap and cfg.get("exp2_emu", 0) == emu
    assert _count(text, "ex2.approx") == 64 - 64 * emu // 16  # P^T: 64 exponentials a thread
    assert (_count(text, "wgmma.wait_group.sync.aligned \t2;") > 0) == overlap
    log = _ptxas_log(ptx)
    assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    print(f"\nptxas BLOCK_M=128: {spills} bytes of spill stores, loads")
    assert spills and all(x == 0 for x in spills), log
    wgmma = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.bf16.bf16"
    # S^T, dP^T: K = D (overlap: S^T issued in the prologue and behind each block's dQ)
    assert _count(text, wgmma.format(128)) == (3 if overlap else 2) * 64 // 16
    assert _count(text, wgmma.format(64)) == 3 * 128 // 16  # dV, dK: K = 128 queries; dQ: K = 128 keys
    assert _count(text, wgmma.format(32)) == 0
    # dV and dK with A from registers (P^T, dS^T: "{accumulators}, {A}, desc_B"), dQ from smem
    rs = [l for l in text.splitlines()
          if l.strip().startswith(wgmma.format(64)) and l.split("}", 1)[1].startswith(", {")]
    assert len(rs) == 2 * 128 // 16
    # dS^T (64 values a thread, 8 a stmatrix), then the epilogue's dK and dV (tma_dkv: 32 values each)
    assert _count(text, "stmatrix.sync.aligned.m8n8.x4.shared.b16") == 128 * 128 // (256 * 8) + 2 * 32 // 8
    # P^T and dS^T (64 values a thread each) packed by pairs, and the epilogue's dK, dV (32 each); P^T unpacked by
    # shifts and masks
    assert _count(text, "cvt.rn.bf16x2.f32") == 2 * 64 // 2 + 2 * 32 // 2
    assert "cvt.f32.bf16" not in text
    # the dQ tile's reduce-add (in the loop and after it), one box each (dq_perm's unswizzled tile)
    assert _count(text, "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group") == 2 * DQ_BOXES


def test_bwd_exp2_emu_config_key_and_refusals(cute_env):
    """bwd.exp2_emu is in the cache key only when on (the degree only when not 3); the
    kernel refuses counts outside 0..16 and degrees without coefficients."""
    import cutlass

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    base = kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()
    assert "exp2_emu" not in base and set(config.BWD_EXP2_EMU.values()) == {0}
    cute_env(OVERRIDES="bwd.exp2_emu=0")
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key() == base
    cute_env(OVERRIDES="bwd.exp2_emu=6")
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key() == {**base, "exp2_emu": 6}
    cute_env(OVERRIDES="bwd.exp2_emu=6,bwd.exp2_emu_degree=4")
    assert kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key() == {**base, "exp2_emu": 6,
                                                                             "exp2_emu_degree": 4}
    with pytest.raises(ValueError, match="exp2_emu"):
        FlashBwdSm90(cutlass.BFloat16, 64, True, exp2_emu=17)
    with pytest.raises(ValueError, match="degree"):
        FlashBwdSm90(cutlass.BFloat16, 64, True, exp2_emu=4, exp2_emu_degree=5)


def test_block_m_128_refusals_and_shared_memory():
    """BLOCK_M = 128 is for head dim 64 (at 128 the accumulators alone exceed the registers), and its
    overlapped loop for the shared dQ tile only; its 2-stage TMA-dQ configuration fills shared memory
    exactly."""
    import cutlass

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    k = FlashBwdSm90(cutlass.BFloat16, 64, True, block_m=128, num_stages=2, dq_tma=True)
    assert k.smem_bytes() == FlashBwdSm90.SMEM_LIMIT and k.wide and k.dq_rows
    assert not FlashBwdSm90(cutlass.BFloat16, 64, True, block_m=128, dq_split=False).dq_rows
    assert not FlashBwdSm90(cutlass.BFloat16, 64, True, dq_tma=True).wide
    with pytest.raises(ValueError, match="head dim 64"):
        FlashBwdSm90(cutlass.BFloat16, 128, True, block_m=128, num_stages=1)
    with pytest.raises(ValueError, match="dq_split=False"):
        FlashBwdSm90(cutlass.BFloat16, 64, True, block_m=128, dq_split=False, overlap=True)
    FlashBwdSm90(cutlass.BFloat16, 64, True, block_m=128, overlap=True)


# ----------------------------------------------------------------------------------------------------
# Layouts (trace-time CuTe algebra, no GPU)


def _compare_transposed(t, tt, shape, bad):
    # Plain Python (not @cute.jit, whose loops and ifs become device code): every value here is static.
    stages = shape[2] if len(shape) == 3 else 1
    for i in (0, 1, 7, 8, 31, 63):
        for j in (0, 1, 15, 16, 63) + ((shape[1] // 2 + 1, shape[1] - 1) if shape[1] > 64 else ()):
            for s in range(stages):
                c, ct = ((i, j, s), (j, i, s)) if len(shape) == 3 else ((i, j), (j, i))
                if cute.crd2idx(c, t.layout) != cute.crd2idx(ct, tt.layout):
                    bad.append((shape, c))


@pytest.mark.parametrize("d", [64, 96, 128])
def test_transposed_smem_views_address_the_same_elements(d):
    """The MN-major B operands (dO^T, Q^T, K^T) and the dS^T view are bwd_parts.transpose_view of K-major (or
    M-major) tiles: element (j, i) of the view must be element (i, j) of the tile, stage by stage."""
    import cutlass
    from cutlass.cute.nvgpu import warpgroup

    from flash_attn.cute.bwd_parts import transpose_view
    from flash_attn.cute.hopper_helpers import k_atom_for
    from flash_attn.cute.hopper_helpers import smem_layout as _smem_layout

    bad = []
    # the kernel's tiles (Q / dO, K of either dQ split, V; dS) and the other K-major atoms that fit D
    kinds = [(k_atom_for(d, cutlass.BFloat16), (64, d, 2)), (k_atom_for(d, cutlass.BFloat16), (128, d)),
             (k_atom_for(d // 2, cutlass.BFloat16), (128, d)), (warpgroup.SmemLayoutAtomKind.MN_SW128, (64, 128, 2))]
    kinds += [(kind, (128, d)) for kind, row in ((warpgroup.SmemLayoutAtomKind.K_SW64, 32),
                                                 (warpgroup.SmemLayoutAtomKind.K_SW32, 16)) if d % row == 0]

    @cute.jit
    def check():
        for kind, shape in kinds:
            layout = _smem_layout(kind, cutlass.BFloat16, shape).outer
            t = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.smem, assumed_align=16),
                                 layout)
            _compare_transposed(t, transpose_view(t), shape, bad)

    cute.compile(check, options="--gpu-arch sm_90a")
    assert bad == [], bad[:20]


def _compare_fragments(sdp, dv, block_n, block_m, mismatches):
    # Plain Python, as _compare_transposed.
    a_layout = cute.make_layout(((2, 2, 2), 1, block_m // 16))
    for t in (0, 1, 5, 37, 127, 128, 130, 255):
        cS = sdp.get_slice(t).partition_C(cute.make_identity_tensor((block_n, block_m)))
        cA = dv.get_slice(t).partition_A(cute.make_identity_tensor((block_n, block_m)))
        if cute.size(cS) != cute.size(a_layout) or cute.size(cA) != cute.size(a_layout):
            mismatches.append((t, "size", cute.size(cS), cute.size(cA)))
            continue
        for i in range(cute.size(a_layout)):
            if a_layout(i) != i or tuple(cS[i]) != tuple(cA[i]):
                mismatches.append((t, i, cS[i], cA[i]))


@pytest.mark.parametrize("d,block_m", [(64, 64), (96, None), (128, None), (64, None)])
def test_p_fragment_reuses_the_st_accumulator_layout(d, block_m):
    """P^T goes to dV += P^T dO by reinterpreting the S^T accumulator (m64n{BM}k16) registers as the A
    operand of m64n{D}k16 with K = BM, layout ((2, 2, 2), 1, BM / 16): each register must then hold the
    (key, query) the A operand expects, for every thread of both warpgroups (block_m None: the
    configured default; 128: bwd.block_m=128)."""
    import cutlass
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    block_n = 128
    block_m = block_m or kernels.bwd_config(torch.bfloat16, d, False, "sm_90a").block_m
    mismatches = []

    @cute.jit
    def check():
        def mma(n, src, b_major):
            op = warpgroup.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (64, n, 16), src,
                                        OperandMajorMode.K, b_major)
            return cute.make_tiled_mma(cute.make_mma_atom(op), (FlashBwdSm90.NUM_MMA_WARPGROUPS, 1, 1))

        sdp = mma(block_m, warpgroup.OperandSource.SMEM, OperandMajorMode.K)
        dv = mma(d, warpgroup.OperandSource.RMEM, OperandMajorMode.MN)
        _compare_fragments(sdp, dv, block_n, block_m, mismatches)

    cute.compile(check, options="--gpu-arch sm_90a")
    assert mismatches == [], mismatches[:30]


def _check_dq_pairs(dq, block_m, d, threads, bad):
    # Plain Python, as _compare_transposed. Also: the threads' values cover the (block_m, d) tile once.
    seen = {}
    for t in range(threads):
        c = dq.get_slice(t).partition_C(cute.make_identity_tensor((block_m, d)))
        for i in range(0, cute.size(c), 2):
            if c[i][1] % 2 or tuple(c[i + 1]) != (c[i][0], c[i][1] + 1):
                bad.append((t, i, c[i], c[i + 1]))
        for i in range(cute.size(c)):
            seen[tuple(c[i])] = seen.get(tuple(c[i]), 0) + 1
    if len(seen) != block_m * d or set(seen.values()) != {1}:
        bad.append(("coverage", len(seen), sorted(set(seen.values()))))


@pytest.mark.parametrize("dq_split", [True, False])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_dq_accumulator_values_pair_up_as_adjacent_columns(d, dq_split):
    """_atomic_add_dq adds accumulator values 2 i and 2 i + 1 with one red.global.add.v2.f32 at the
    address of value 2 i: they must be columns c, c + 1 (c even) of one row, for every thread; and the
    dQ tile (one per CTA with dq_split, else one per warpgroup) is covered exactly once."""
    import cutlass
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    block_m = kernels.bwd_config(torch.bfloat16, d, False, "sm_90a").block_m
    bad = []

    @cute.jit
    def check():
        n, atoms = (d // 2, (1, 2, 1)) if dq_split else (d, (1, 1, 1))
        op = warpgroup.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (64, n, 16), warpgroup.OperandSource.SMEM,
                                    OperandMajorMode.MN, OperandMajorMode.MN)
        _check_dq_pairs(cute.make_tiled_mma(cute.make_mma_atom(op), atoms), block_m, d, 256 if dq_split else 128,
                        bad)

    cute.compile(check, options="--gpu-arch sm_90a")
    assert bad == [], bad[:20]


def test_dq_rows_split_pairs_up_and_covers_the_tile():
    """BLOCK_M = 128's shared dQ tile, split between the warpgroups by query rows (m64n64k16, atoms
    (2, 1, 1)): the column pairs of _atomic_add_dq (bwd.dq_tma=0) hold there too, and
    the 256 threads cover the (128, 64) tile once."""
    import cutlass
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    bad = []

    @cute.jit
    def check():
        op = warpgroup.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (64, 64, 16), warpgroup.OperandSource.SMEM,
                                    OperandMajorMode.MN, OperandMajorMode.MN)
        _check_dq_pairs(cute.make_tiled_mma(cute.make_mma_atom(op), (2, 1, 1)), 128, 64, 256, bad)

    cute.compile(check, options="--gpu-arch sm_90a")
    assert bad == [], bad[:20]


def _check_stsm(sdp, stsm, bad):
    # Plain Python, as _compare_transposed. The copy's source side (partition_S) says where each register
    # value goes; the destination side is the rows each lane addresses, another grouping of the same tile.
    ident = cute.make_identity_tensor((128, 128))
    for t in (0, 1, 5, 37, 127, 128, 130, 255):
        acc = stsm.get_slice(t).retile(sdp.get_slice(t).partition_C(ident))  # accumulator coords, copy order
        src = stsm.get_slice(t).partition_S(ident)
        if cute.size(acc) != cute.size(src) or cute.size(src) != 64:
            bad.append((t, "size", cute.size(acc), cute.size(src)))
            continue
        for i in range(cute.size(src)):
            if tuple(acc[i]) != tuple(src[i]):
                bad.append((t, i, acc[i], src[i]))


def test_ds_stmatrix_copy_writes_each_value_where_the_accumulator_has_it():
    """BLOCK_M = 128 stores dS^T with a stmatrix tiled copy built on the S^T / dP^T MMA, its source the
    retiled register fragment: for every thread (of both warpgroups), the copy's register value i must
    be the (key, query) the accumulator's value i is. (Where the copy's lanes then write is CuTe's
    stmatrix atom on the smem layout; the GPU tests check the result.)"""
    import cutlass
    from cutlass.cute.nvgpu import OperandMajorMode, warp, warpgroup

    bad = []

    @cute.jit
    def check():
        op = warpgroup.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (64, 128, 16), warpgroup.OperandSource.SMEM,
                                    OperandMajorMode.K, OperandMajorMode.K)
        sdp = cute.make_tiled_mma(cute.make_mma_atom(op), (2, 1, 1))
        stsm = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16), sdp)
        _check_stsm(sdp, stsm, bad)

    cute.compile(check, options="--gpu-arch sm_90a")
    assert bad == [], bad[:20]


def test_shared_memory_is_counted_and_an_oversized_config_refused():
    # the H200 refused the d128 3-stage TMA dQ kernel at launch: "Allocated: 264704 bytes. Max: 232448"
    import cutlass

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    k = FlashBwdSm90(cutlass.BFloat16, 128, True, num_stages=2, dq_tma=True)
    assert k.smem_bytes() == 231424 <= FlashBwdSm90.SMEM_LIMIT
    with pytest.raises(ValueError, match="264704 bytes of shared memory"):
        FlashBwdSm90(cutlass.BFloat16, 128, True, num_stages=3, dq_tma=True)
    assert FlashBwdSm90(cutlass.BFloat16, 128, True, num_stages=3, dq_tma=False).smem_bytes() <= 232448
    assert FlashBwdSm90(cutlass.BFloat16, 64, True, num_stages=3, dq_tma=True).smem_bytes() <= 232448
    # d96 (the defaults: 64 rows, 2 stages, TMA dQ): 178 KB; 3 stages would fit too
    assert FlashBwdSm90(cutlass.BFloat16, 96, True, num_stages=2, dq_tma=True).smem_bytes() == 182272
    assert FlashBwdSm90(cutlass.BFloat16, 96, True, num_stages=3, dq_tma=True).smem_bytes() <= 232448


def test_unsupported_head_dim_is_refused():
    for d in (32, 160):
        with pytest.raises(ValueError, match="head dim"):
            kernels.compile_bwd(torch.bfloat16, d, False)


def test_cache_key_has_only_what_changes_code():
    cfg = kernels.bwd_config(torch.bfloat16, 64, False, "sm_90a").key()
    assert set(cfg) == {"kernel", "dtype", "head_dim", "causal", "block_m", "stages", "dq_split", "dq_tma", "arch",
                        "abi", "tma_dkv", "dq_perm"} | ({"dq_first_store"} if config.BWD_FIRST_STORE.get(64) else set())
    # (tma_dkv, dq_perm, dq_first_store where on: not the fields' defaults)
    assert set(kernels.bwd_config(torch.bfloat16, 64, True, "sm_90a").key()) == set(cfg) | {"lpt"}
    assert kernels._bwd_entry(torch.bfloat16, 64, True, "sm_90a")[1] != \
        kernels._bwd_entry(torch.bfloat16, 64, False, "sm_90a")[1]


@pytest.mark.parametrize("d", [64, 96, 128])
def test_default_backward_adds_dq_by_tma_and_the_override_switches_it(cute_env, d):
    # the TMA dQ measured 1.19-1.39x the atomics kernel on the H200 (attention_cute_bwd.md, session 5)
    cfg = kernels.bwd_config(torch.bfloat16, d, True, "sm_90a").key()
    assert cfg["dq_tma"] and cfg["dq_split"] and "overlap" not in cfg
    cute_env(OVERRIDES="bwd.dq_tma=0")
    assert not kernels.bwd_config(torch.bfloat16, d, True, "sm_90a").dq_tma


# ----------------------------------------------------------------------------------------------------
# Host side of launch.backward, with the kernel replaced by a stand-in (CPU tensors)


_HOST_CASES = {  # name: (H, Hk, Sq, Sk, grads layout)
    "gqa": (4, 2, 70, 50, None),
    "mqa": (4, 1, 70, 130, None),
    "mha": (4, 4, 70, 50, None),
    "packed": (4, 4, 70, 70, "packed"),  # slices of one (B, S, 4, H, D) buffer; the fourth must stay as it was
    "mha-transposed": (4, 4, 70, 50, "transposed"),  # dk/dv in a layout the kernel refuses: copied after it
    "gqa-transposed": (4, 2, 130, 50, "transposed"),
    # causal: the first Sq - Sk >= block_m rows make whole query blocks that no key block sees, so the first_store
    # kernel's dq_accum is zeroed for them
    "mha-unseen-rows": (4, 4, 200, 50, None),
}


@pytest.fixture(params=[("triton", 0), ("triton", 1), ("torch", 0), ("torch", 1)],
                ids=["triton", "triton-first_store", "torch", "torch-first_store"])
def host(request, monkeypatch, cute_env):
    """The host path ("triton": bwd_host's kernels, in the interpreter on CPU; "torch": the fallback),
    with bwd_host's allocations NaN-filled (every element the kernel reads must be written) and a
    record of which path's functions ran; GQA with per-query-head dK / dV summed after the kernel (plan.bwd_gqa_loop=0:
    test_gqa_loop_rule_runs_the_kernel_that_writes_dk_dv_per_kv_head has the default's kernel)."""
    from flash_attn.cute import bwd_host

    path, first = request.param
    if path == "triton":
        if bwd_host.triton is None:
            pytest.skip("Triton is not installed")
        cute_env(OVERRIDES=f"plan.bwd_gqa_loop=0,bwd.dq_first_store={first}")
    else:
        cute_env(OVERRIDES=f"plan.bwd_host=torch,plan.bwd_gqa_loop=0,bwd.dq_first_store={first}")
    monkeypatch.setattr(bwd_host, "_empty", lambda shape, **kw: torch.full(shape, float("nan"), **kw))
    ran = []
    for name in ("prepare", "finish", "prepare_torch", "finish_torch"):
        real = getattr(bwd_host, name)
        monkeypatch.setattr(bwd_host, name, lambda *a, _n=name, _f=real, **kw: (ran.append(_n), _f(*a, **kw))[1])
    return path, ran


def _stand_in_grads(layout, B, Sq, Sk, H, Hk, D, dtype):
    """(dq, dk, dv) outputs for backward's grads (NaN-filled), and the buffer behind them, or (None, None)."""
    nan = float("nan")
    if layout is None:
        return None, None
    if layout == "packed":  # as the packed-qkv path hands them (Sq == Sk, H == Hk)
        buf = torch.full((B, Sq, 4, H, D), nan, dtype=dtype)
        return buf.unbind(2)[:3], buf
    return ((torch.full((B, H, Sq, D), nan, dtype=dtype).transpose(1, 2),
             torch.full((B, Hk, Sk, D), nan, dtype=dtype).transpose(1, 2),
             torch.full((B, Hk, Sk, D), nan, dtype=dtype).transpose(1, 2)), None)


@pytest.mark.parametrize("case", list(_HOST_CASES))
def test_backward_host_steps_with_a_stand_in_kernel(monkeypatch, host, case):
    """lse2 = lse * log2(e) (+inf for rows whose lse is +-inf) padded with +inf and delta = rowsum(dO * O)
    padded with 0 to the query block; dq_accum zero before the kernel, or with the first_store kernel (the default)
    left as it was and the query blocks' tickets zero (the kernel stores each block's first tile), dq_accum zeroed only
    where query blocks see no key block (the Triton path; the torch path zeroes it always); dq = dq_accum in the
    input dtype into the caller's dq (any strides); GQA dK/dV summed over each group of query heads, into the caller's
    dk/dv. Exact values (small integers where the stand-in kernel writes); fp16 (the interpreter computes
    bf16 wrongly)."""
    path, ran = host
    H, Hk, Sq, Sk, layout = _HOST_CASES[case]
    B, D, dtype = 2, 64, torch.float16
    g = torch.Generator().manual_seed(0)
    q, out, dout = (torch.randn(B, Sq, H, D, generator=g).to(dtype) for _ in range(3))
    k, v = (torch.randn(B, Sk, Hk, D, generator=g).to(dtype) for _ in range(2))
    lse = torch.randn(B, H, Sq, generator=g)
    lse[0, 1, 3] = float("inf")  # a row that sees no key
    lse[1, 2, 5] = -float("inf")  # the same, as a backend may write it: the kernel needs +inf
    dq_vals = torch.randint(-1024, 1024, (B, Sq, H, D), generator=g).float()
    dk_vals, dv_vals = (torch.randint(-64, 64, (B, Sk, H, D), generator=g).to(dtype) for _ in range(2))
    seen = {}

    cfg = kernels.bwd_config(dtype, D, True, "sm_90a")
    perm, first = cfg.dq_perm, cfg.dq_first_store

    def kernel(q_, k_, v_, dout_, lse2, delta, dq_accum, dk, dv, *rest):
        tickets, scale = rest if first else (None, *rest)
        seen.update(lse2=lse2.clone(), delta=delta.clone(), dq_accum=dq_accum.clone(), scale=scale,
                    tickets=None if tickets is None else tickets.clone())
        vals = kernel_layout(dq_vals) if perm else dq_vals
        # the kernel adds into dq_accum, in its layout (first_store: stores a query block's first tile; one here)
        dq_accum.copy_(vals) if first else dq_accum.add_(vals)
        assert dk.shape == dv.shape == (B, Sk, H, D)
        dk.copy_(dk_vals)
        dv.copy_(dv_vals)

    block_m = kernels.bwd_config(dtype, D, True, "sm_90a").block_m
    monkeypatch.setitem(kernels._bwd_kernels, (dtype, D, True, "sm_90a"), kernel)
    grads, buf = _stand_in_grads(layout, B, Sq, Sk, H, Hk, D, dtype)
    dq, dk, dv = launch.backward(dout, q, k, v, out, lse, 0.5, True, "sm_90a", grads=grads)
    assert ran == (["prepare", "finish"] if path == "triton" else ["prepare_torch", "finish_torch"])

    pad = -(-Sq // block_m) * block_m
    assert pad > Sq
    assert seen["lse2"].shape == seen["delta"].shape == (B, H, pad)
    expect = lse * 1.4426950408889634
    expect[0, 1, 3] = expect[1, 2, 5] = float("inf")
    assert torch.equal(seen["lse2"][..., :Sq], expect)  # one fp32 multiply on both paths: the same bits
    assert torch.equal(seen["lse2"][..., Sq:], torch.full((B, H, pad - Sq), float("inf")))
    torch.testing.assert_close(seen["delta"][..., :Sq], (dout.float() * out.float()).sum(-1).transpose(1, 2))
    assert torch.equal(seen["delta"][..., Sq:], torch.zeros(B, H, pad - Sq))
    unseen = Sq - Sk >= block_m  # whole query blocks that no key block sees (causal)
    if not first or path == "torch" or unseen:
        assert torch.equal(seen["dq_accum"], torch.zeros(B, Sq, H, D))
    else:
        assert seen["dq_accum"].isnan().all()  # not zeroed: the kernel stores each block's first tile
    if first:
        assert torch.equal(seen["tickets"], torch.zeros(B, H, pad // block_m, dtype=torch.int32))
    assert seen["scale"] == 0.5

    assert dq.dtype == dk.dtype == dv.dtype == dtype
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert torch.equal(dq.float(), dq_vals)  # the kernel applies the scale
    group = H // Hk
    for got, vals in ((dk, dk_vals), (dv, dv_vals)):
        assert torch.equal(got, vals.float().view(B, Sk, Hk, group, D).sum(3).to(dtype))
    if grads is not None:
        assert all(r is g_ for r, g_ in zip((dq, dk, dv), grads))
    if buf is not None:
        assert buf[:, :, 3].isnan().all()  # the rest of a packed buffer is not written


@pytest.mark.parametrize("case", ["gqa", "mqa", "gqa-transposed", "mha"])
def test_gqa_loop_rule_runs_the_kernel_that_writes_dk_dv_per_kv_head(monkeypatch, cute_env, case):
    """plan.bwd_gqa_loop=1 (the default): a GQA / MQA backward launches the gqa_loop kernel (its own memory key), which gets dk / dv
    (B, Sk, Hk, D) and writes the group sums itself: they are the gradients as written (no sum after it; copied into
    gradients of a layout it refuses). MHA, deterministic calls and the rule off keep the per-query-head kernel."""
    H, Hk, Sq, Sk, layout = _HOST_CASES[case]
    B, D, dtype = 2, 64, torch.float16
    g = torch.Generator().manual_seed(1)
    q, out, dout = (torch.randn(B, Sq, H, D, generator=g).to(dtype) for _ in range(3))
    k, v = (torch.randn(B, Sk, Hk, D, generator=g).to(dtype) for _ in range(2))
    lse = torch.randn(B, H, Sq, generator=g)
    dk_vals, dv_vals = (torch.randint(-64, 64, (B, Sk, Hk, D), generator=g).to(dtype) for _ in range(2))
    ran = []

    def gqa_kernel(q_, k_, v_, dout_, lse2, delta, dq_accum, dk, dv, scale):
        ran.append("gqa")
        assert dk.shape == dv.shape == (B, Sk, Hk, D)
        dk.copy_(dk_vals)
        dv.copy_(dv_vals)

    def head_kernel(q_, k_, v_, dout_, lse2, delta, dq_accum, dk, dv, *scalars):
        ran.append("per-head")
        assert dk.shape == dv.shape == (B, Sk, H, D)
        dk.zero_()
        dv.zero_()

    cute_env(OVERRIDES="plan.bwd_gqa_loop=1,plan.bwd_host=torch")
    for det in (False, True):
        monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, True, "sm_90a", deterministic=det),
                            head_kernel)
    monkeypatch.setitem(kernels._bwd_kernels, kernels.bwd_mem_key(dtype, D, True, "sm_90a", gqa_loop=True), gqa_kernel)
    grads, _ = _stand_in_grads(layout, B, Sq, Sk, H, Hk, D, dtype)
    dq, dk, dv = launch.backward(dout, q, k, v, out, lse, 0.5, True, "sm_90a", grads=grads)
    if H == Hk:
        assert ran == ["per-head"]
        return
    assert ran == ["gqa"]
    assert torch.equal(dk, dk_vals) and torch.equal(dv, dv_vals)
    if grads is not None:
        assert dk is grads[1] and dv is grads[2]
    ran.clear()
    launch.backward(dout, q, k, v, out, lse, 0.5, True, "sm_90a", deterministic=True)
    cute_env(OVERRIDES="plan.bwd_host=torch,plan.bwd_gqa_loop=0")
    launch.backward(dout, q, k, v, out, lse, 0.5, True, "sm_90a")
    assert ran == ["per-head", "per-head"]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, True)])
def test_gqa_loop_kernel_walks_the_group_and_fits_its_registers(tmp_path, cute_env, d, causal):
    """The gqa_loop kernel (compile_bwd(gqa_loop=True), sm_90a): its walk splits a position into query head and
    query block (integer division and remainder, none in the per-head kernel's loop), the Q / dO / lse2 / delta TMA
    loads and the dQ reduce-adds stay as many as the per-head kernel's, and ptxas neither serialises its WGMMAs nor
    spills more than the per-head kernel does. (The per-head kernel without dq_first_store, which gqa_loop does not take:
    its rotated walk divides too.)"""
    cute_env(OVERRIDES="bwd.dq_first_store=0")
    texts = {}
    for gqa in (False, True):
        dump = tmp_path / f"gqa{int(gqa)}"
        dump.mkdir()
        kernels.compile_bwd(torch.bfloat16, d, causal, arch="sm_90a", dump_dir=str(dump), gqa_loop=gqa)
        (ptx,) = glob.glob(str(dump / "*.ptx"))
        texts[gqa] = (open(ptx).read(), ptx)
    div = ("div.s32", "rem.s32", "div.u32", "rem.u32")
    assert sum(_count(texts[True][0], x) for x in div) > sum(_count(texts[False][0], x) for x in div)
    for needle in ("cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier",
                   "cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier",
                   "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"):
        assert _count(texts[True][0], needle) == _count(texts[False][0], needle) > 0, needle
    spills = {}
    for gqa, (_, path) in texts.items():
        log = _ptxas_log(path)
        assert "are serialized" not in log and "setmaxnreg' ignored" not in log, log
        spills[gqa] = max([int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)] or [0])
    print(f"\nptxas spill bytes d{d}: per-head {spills[False]}, gqa_loop {spills[True]}")
    assert spills[True] <= spills[False]


@pytest.mark.parametrize("m_min,m_max,group", [(3, 7, 3), (0, 1, 8), (5, 2, 4), (2, 2, 2), (0, 16, 1)])
def test_gqa_loop_walk_visits_each_head_and_query_block_once_head_by_head(m_min, m_max, group):
    """bwd_walk.GroupWalk (the gqa_loop kernel's positions, here on Python ints): position p is query block m_min + p % n of
    query head first + p // n; every (head of the group, block in [m_min, m_max)) once, head by head, blocks ascending
    within a head (the causal mask's order); none when no query block sees the key block."""
    from flash_attn.cute.bwd_walk import GroupWalk

    first = 8
    walk = GroupWalk.make(m_min, m_max, first)
    seen = [(walk.head(p), walk.block(p)) for p in range(walk.count(group))]
    assert seen == [(first + j, m) for j in range(group) for m in range(m_min, m_max)]
    assert walk.partial(0) is None


def test_gqa_loop_config_and_refusals():
    """gqa_loop is the call's (not an override), in the key when on; it drops overlap; the kernel refuses varlen,
    determinism, overlap, mods and block sparsity."""
    import cutlass

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    base = kernels.bwd_config(torch.bfloat16, 128, True, "sm_90a").key()
    assert "gqa_loop" not in base
    expect = {k: v for k, v in base.items() if k != "dq_first_store"}  # (gqa_loop without dq_first_store)
    assert kernels.bwd_config(torch.bfloat16, 128, True, "sm_90a", gqa_loop=True).key() == {**expect, "gqa_loop": True}
    assert kernels._bwd_entry(torch.bfloat16, 128, True, "sm_90a", gqa_loop=True)[2].startswith(
        "bwd-sm_90a-bf16-d128-causal-gqa-")
    with pytest.raises(ValueError, match="not a tunable"):
        with _cute_settings(OVERRIDES="bwd.gqa_loop=1"):
            config.overrides("bwd")
    with pytest.raises(ValueError, match="gqa_loop"):
        config.BwdConfig(dtype="bf16", head_dim=128, causal=False, arch="sm_90a", abi="x", block_m=64, stages=2,
                         dq_split=True, dq_tma=True, deterministic=False, varlen=True, gqa_loop=True)
    for kw in (dict(varlen=True), dict(deterministic=True, dq_tma=False), dict(overlap=True)):
        with pytest.raises(ValueError, match="gqa_loop"):
            FlashBwdSm90(cutlass.BFloat16, 128, True, gqa_loop=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_host_paths_agree(dtype):
    """bwd_host's Triton kernels (interpreter on CPU) against its torch expressions on random inputs with
    strided out/dout/lse and strided outputs: lse2, the padding, dq_accum and dq bit for bit, delta and
    the GQA sums within fp32 rounding."""
    from flash_attn.cute import bwd_host

    if bwd_host.triton is None:
        pytest.skip("Triton is not installed")
    B, Sq, Sk, H, Hk, D, pad = 2, 77, 45, 6, 2, 128, 128
    g = torch.Generator().manual_seed(1)
    out = torch.randn(B, Sq, 3, H, D, generator=g).to(dtype)[:, :, 1]  # a slice of a packed tensor
    dout = torch.randn(B, H, Sq, D, generator=g).to(dtype).transpose(1, 2)
    lse = torch.randn(B, H, Sq + 5, generator=g)[:, :, 2:Sq + 2]  # a wider buffer's window
    lse[1, 0, :4] = float("inf")
    got, want = bwd_host.prepare(out, dout, lse, pad), bwd_host.prepare_torch(out, dout, lse, pad)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1][..., Sq:], want[1][..., Sq:])
    assert torch.equal(got[2], want[2])

    dq_accum = torch.randn(B, Sq, H, D, generator=g) * 3
    dk_h, dv_h = (torch.randn(B, Sk, H, D, generator=g).to(dtype) for _ in range(2))
    outs = []
    for fn in (bwd_host.finish, bwd_host.finish_torch):
        dq = torch.full((B, H, Sq, D, 2), float("nan"), dtype=dtype)[..., 1].transpose(1, 2)  # no unit stride
        dk = torch.full((B, Sk, Hk, D), float("nan"), dtype=dtype)
        dv = torch.full((B, Sk, 2, Hk, D), float("nan"), dtype=dtype)[:, :, 0]
        fn(dq_accum, dq, dk_h, dv_h, dk, dv)
        outs.append((dq, dk, dv))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1:], outs[1][1:]):
        torch.testing.assert_close(a, b, rtol=2e-7 if dtype == torch.float32 else 1e-3, atol=1e-6)
    # dq only (no dK/dV work in the launch)
    dq = torch.empty(B, Sq, H, D, dtype=dtype)
    bwd_host.finish(dq_accum, dq)
    assert torch.equal(dq, outs[1][0])
    # perm (a kernel built with dq_perm leaves dq_accum in config.permuted_column's layout): read back in order
    from flash_attn.cute import config

    stored = torch.empty_like(dq_accum)
    for r in range(Sq):
        stored[:, r, :, [config.permuted_column(r, c) for c in range(D)]] = dq_accum[:, r]
    back = [torch.empty(B, Sq, H, D, dtype=dtype) for _ in range(2)]
    bwd_host.finish(stored, back[0], perm=True)
    bwd_host.finish_torch(stored, back[1], perm=True)
    assert torch.equal(back[0], back[1]) and torch.equal(back[0], dq)


def test_triton_host_path_is_two_launches_and_no_torch_compute(monkeypatch, cute_env):
    """With the Triton host path, backward's own torch calls are allocations and views only (no kernel
    launch of torch's on a GPU): one preprocess launch, the kernel, one postprocess launch, with GQA and
    grads in layouts the kernel refuses."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flash_attn.cute import bwd_host

    if bwd_host.triton is None:
        pytest.skip("Triton is not installed")
    cute_env(OVERRIDES="plan.bwd_gqa_loop=0")  # the default host path (plan.bwd_host=triton), the per-head sums
    launches = []
    monkeypatch.setattr(bwd_host, "_launch", lambda kernel, *a: launches.append(kernel))
    ops = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    B, Sq, Sk, H, Hk, D, dtype = 2, 70, 50, 4, 2, 64, torch.float16
    q, out, dout = (torch.zeros(B, Sq, H, D, dtype=dtype) for _ in range(3))
    k, v = (torch.zeros(B, Sk, Hk, D, dtype=dtype) for _ in range(2))
    lse = torch.zeros(B, H, Sq)
    grads = (torch.empty(B, H, Sq, D, dtype=dtype).transpose(1, 2),
             torch.empty(B, Hk, Sk, D, dtype=dtype).transpose(1, 2), torch.empty(B, Sk, Hk, D, dtype=dtype))
    kernel_calls = []
    monkeypatch.setitem(kernels._bwd_kernels, (dtype, D, True, "sm_90a"),
                        lambda *a: kernel_calls.append(len(launches)))
    with Record():
        launch.backward(dout, q, k, v, out, lse, 0.5, True, "sm_90a", grads=grads)
    assert launches == [bwd_host._bwd_prep_kernel, bwd_host._bwd_post_kernel] and kernel_calls == [1]
    compute = {str(f) for f in ops if not (f.is_view or str(f).startswith("aten.empty"))}
    assert not compute, compute


_HOST_AOT_SCRIPT = r"""
import contextlib, io, json, re
import triton
from triton.backends.compiler import GPUTarget
from flash_attn.cute import bwd_host as bh

target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
try:
    triton.knobs.nvidia.dump_ptxas_log = True
except AttributeError:
    pass


def compile_kernel(label, fn, types, constexprs, num_warps):
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else types(n) for n in names}
    # what Triton sees for contiguous bf16 tensors at head dims 64/96/128: pointers and strides other than the
    # unit last ones divisible by 16 (the lengths are not specialised)
    div = [n for n in names if n not in constexprs and (n[0].isupper() or n.startswith("s_"))]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    opts = backend.parse_options({"num_warps": num_warps})
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        ptx = triton.compile(src, target=target, options=opts.__dict__).asm["ptx"]
    m = re.search(r"(\d+) bytes spill stores", log.getvalue())
    print(json.dumps(dict(label=label, spills=int(m.group(1)) if m else None,
                          ld_v4=len(re.findall(r"ld\.global[.\w]*\.v4", ptx)),
                          st_v4=len(re.findall(r"st\.global[.\w]*\.v4", ptx)))))


for D in (64, 96, 128):
    meta = bh._meta(D)
    ce = dict(HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_M=meta["BLOCK_M"], s_od=1, s_gd=1, s_ls=1, ZERO_DQ=True,
              TICKET_ROWS=0)
    types = lambda n: {"Out": "*bf16", "DOut": "*bf16", "Tickets": "*i32"}.get(n, "*fp32" if n[0].isupper() else "i32")
    compile_kernel(f"prep d{D}", bh._bwd_prep_kernel, types, ce, meta["num_warps"])
    # the first_store kernel's: dq_accum not zeroed, the tickets of 64-row query blocks zeroed
    compile_kernel(f"prep first d{D}", bh._bwd_prep_kernel, types, dict(ce, ZERO_DQ=False, TICKET_ROWS=64),
                   meta["num_warps"])
    for kv in (False, True):
        for perm in (False, True):
            meta = bh._meta(D, kv)
            ce = dict(HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_S=meta["BLOCK_S"], KV=kv, PERM=perm, s_qd=1, s_kd=1,
                      s_vd=1)
            types = lambda n: "*fp32" if n == "DQAccum" else "*bf16" if n[0].isupper() else "i32"
            compile_kernel(f"post d{D} kv={kv}" + (" perm" if perm else ""), bh._bwd_post_kernel, types, ce,
                           meta["num_warps"])
"""


def test_host_kernels_compile_for_sm90_vectorised_without_spills(tmp_path):
    """bwd_host's kernels as launched on an H200 compile for sm_90 ahead of time (the interpreter never
    runs Triton's code generator), ptxas spills nothing, and every global access of out/dout/dq_accum/dq
    is 16 bytes wide (v4) for unit last strides."""
    import json

    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, _PKG, os.environ.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path))  # a fresh cache, so ptxas runs and logs
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _HOST_AOT_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row.pop("label"): row for row in map(json.loads, (x for x in r.stdout.splitlines() if x[:1] == "{"))}
    assert len(rows) == 18, r.stdout
    for label, row in rows.items():
        assert row["spills"] in (0, None), (label, row)  # None: a Triton without the ptxas log knob
    # per thread, bf16 tiles of 64 x D over 32 * num_warps threads: out and dout 2 x 4 loads of 8 values,
    # dq_accum's zeros 8 stores of 4 fp32; the cast 8 loads of 4 fp32 and 4 stores of 8 bf16; with KV
    # also the group's 2 x 4 loads per query head and 2 x 4 stores (D = 96: the 128-column tile masked to 96 columns,
    # still 16-byte accesses). With PERM (dq_accum in config.permuted_column's layout) the same: dq_accum read 16 bytes
    # at a time in stored order, reordered in registers, dq written 16 bytes at a time (4-byte scatters of dq took the
    # cast 540 us against 69 at d128 1k on an H100)
    for D in (64, 96, 128):
        assert (rows[f"prep d{D}"]["ld_v4"], rows[f"prep d{D}"]["st_v4"]) == (8, 8), rows
        assert (rows[f"prep first d{D}"]["ld_v4"], rows[f"prep first d{D}"]["st_v4"]) == (8, 0), rows
        assert (rows[f"post d{D} kv=False"]["ld_v4"], rows[f"post d{D} kv=False"]["st_v4"]) == (8, 4), rows
        assert (rows[f"post d{D} kv=True"]["ld_v4"], rows[f"post d{D} kv=True"]["st_v4"]) == (16, 12), rows
        assert (rows[f"post d{D} kv=False perm"]["ld_v4"], rows[f"post d{D} kv=False perm"]["st_v4"]) == (8, 4), rows
        assert (rows[f"post d{D} kv=True perm"]["ld_v4"], rows[f"post d{D} kv=True perm"]["st_v4"]) == (16, 12), rows


def test_torch_host_path_without_triton(monkeypatch, cute_env):
    """Without Triton (flash-attn-4 does not require it), or with plan.bwd_host=torch, backward takes the torch
    expressions."""
    from flash_attn.cute import bwd_host

    t = torch.zeros(1)
    if bwd_host.triton is not None:
        assert bwd_host.use_triton(t) == bwd_host._INTERPRET
        cute_env(OVERRIDES="plan.bwd_host=torch")
        assert not bwd_host.use_triton(t)
        cute_env(OVERRIDES=None)
    monkeypatch.setattr(bwd_host, "triton", None)
    assert not bwd_host.use_triton(t)


# ----------------------------------------------------------------------------------------------------
# Dispatch: on by default, off with FLASH_ATTN_CUTE_DISABLE=bwd


def _call(**kw):
    base = dict(device_type="cuda", dtype=torch.bfloat16, head_dim=64, head_dim_v=64, arch=(9, 0),
                causal=True, backward=True)
    base.update(kw)
    return Call(**base)


def test_backward_is_served_by_default_and_refused_when_disabled(cute_env):
    assert cute_backend.unsupported_reason(_call()) is None
    cute_env(DISABLE="bwd")
    why = cute_backend.unsupported_reason(_call())
    assert why is not None and settings.DISABLE in why and "bwd" in why, why
    # forward calls are untouched
    assert cute_backend.unsupported_reason(_call(backward=False)) is None


@pytest.mark.parametrize("disable", [None, "paged,split"])
def test_backward_is_served_only_where_the_kernel_applies(cute_env, disable):
    cute_env(DISABLE=disable)  # (features other than bwd leave the backward on)
    assert cute_backend.unsupported_reason(_call()) is None
    assert cute_backend.unsupported_reason(_call(causal=False, dtype=torch.float16, head_dim=128,
                                                 head_dim_v=128)) is None
    # under their plan rules, on by default (deterministic: "writer", d64-d128)
    for what in (dict(varlen=True), dict(softcap=30.0), dict(deterministic=True)):
        assert cute_backend.unsupported_reason(_call(**what)) is None, what
    for what in (dict(deterministic=True, head_dim=192, head_dim_v=192), dict(alibi=True), dict(dropout_p=0.1),
                 dict(paged=True)):
        assert cute_backend.unsupported_reason(_call(**what)) is not None, what
    assert cute_backend.unsupported_reason(_call(head_dim=96, head_dim_v=96)) is None
    assert cute_backend.unsupported_reason(_call(head_dim=96, head_dim_v=64)) is not None
    assert cute_backend.unsupported_reason(_call(head_dim=192, head_dim_v=192)) is None  # (the split-D kernel)
    assert cute_backend.unsupported_reason(_call(head_dim=256, head_dim_v=256)) is None  # (causal: bwd_d256)
    assert cute_backend.unsupported_reason(_call(head_dim=256, head_dim_v=256, causal=False)) is not None
    assert cute_backend.unsupported_reason(_call(arch=(8, 0))) is not None


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def cute_bwd_on(monkeypatch, cute_env):
    """The backward on (FLASH_ATTN_CUTE_DISABLE unset, in case the environment names bwd there) with the
    dispatcher's cached choices dropped (they may have been made with it off), and a count of the backward
    launches the cute backend makes (launch.backward, which backend.bwd and autograd.py call)."""
    from flash_attn import dispatch

    cute_env(DISABLE=None)
    monkeypatch.setattr(dispatch, "_choice", {})
    calls = []
    real = launch.backward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "backward", counted)
    return calls


def _reference(q, k, v, dout, causal, window=(-1, -1)):
    """(out, dq, dk, dv) of the upcast oracle and of PyTorch at the input dtype."""
    results = []
    for upcast in (True, False):
        qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = testing.attention_ref(qr, kr, vr, causal=causal, window_size=window, upcast=upcast,
                                       reorder_ops=not upcast)
        results.append((out.detach(), *torch.autograd.grad(out, (qr, kr, vr), dout)))
    return results


def _run(dtype, d, causal, batch, seqlen_q, seqlen_k, heads, heads_kv, calls, seed=0, window=(-1, -1)):
    """window: the root's encoding (-1 unbounded); FA4's (None unbounded) for flash_attn.cute."""
    from flash_attn.cute import flash_attn_func

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g).to("cuda", dtype).requires_grad_()
    k = torch.randn(batch, seqlen_k, heads_kv, d, generator=g).to("cuda", dtype).requires_grad_()
    v = torch.randn(batch, seqlen_k, heads_kv, d, generator=g).to("cuda", dtype).requires_grad_()
    dout = torch.randn(batch, seqlen_q, heads, d, generator=g).to("cuda", dtype)
    out, _ = flash_attn_func(q, k, v, causal=causal, window_size=tuple(None if w < 0 else w for w in window))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    assert calls, "the backward did not run on the cute backend"
    ref, pt = _reference(q.detach(), k.detach(), v.detach(), dout, causal, window)
    for name, a, r, p in zip(("out", "dq", "dk", "dv"), (out.detach(), dq, dk, dv), ref, pt):
        testing.assert_close_to_ref(a, r, p, name)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 17, 128, 255, 1000, 2048])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 1)])
def test_gradients_match_reference_on_gpu(cute_bwd_on, dtype, d, causal, seqlen, heads, heads_kv):
    _run(dtype, d, causal, 2, seqlen, seqlen, heads, heads_kv, cute_bwd_on)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 203), (256, 77), (300, 1200), (1, 130)])
def test_gradients_with_unequal_lengths_on_gpu(cute_bwd_on, d, causal, seqlen_q, seqlen_k):
    # bottom-right aligned causal mask; with Sq > Sk the first Sq - Sk queries see no key (zero gradients)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, 2, cute_bwd_on, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [17, 255, 1000])
def test_gradients_with_per_warpgroup_dq_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen):
    # the bwd.dq_split=0 variant (the in-memory kernel cache does not key on it: emptied)
    cute_env(OVERRIDES="bwd.dq_split=0")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen, seqlen, 4, 2, cute_bwd_on, seed=2)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (255, 255), (1000, 1000), (2048, 2048), (113, 203),
                                               (256, 77), (1, 130)])
def test_gradients_with_atomic_dq_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k):
    # the bwd.dq_tma=0 variant: dQ added by per-thread red.global.add.v2.f32 (the default,
    # the TMA reduce-add, runs in every other gradient test)
    cute_env(OVERRIDES="bwd.dq_tma=0")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, 2, cute_bwd_on, seed=4)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (255, 255), (1000, 1000), (2048, 2048), (113, 203),
                                               (256, 77)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 1)])
def test_gradients_with_overlap_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k, heads,
                                      heads_kv):
    # the bwd.overlap=1 variant: the software-pipelined query loop (key blocks with one
    # query block, none (causal, Sq < Sk), and many; the in-memory kernel cache does not key on it: emptied)
    cute_env(OVERRIDES="bwd.overlap=1")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=5)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (1000, 1000), (113, 203), (256, 77), (1, 130),
                                               (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv", [(6, 2), (8, 1), (4, 2)])
@pytest.mark.parametrize("window", [(-1, -1), (40, 7)])
def test_gradients_with_gqa_loop_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k, heads,
                                        heads_kv, window):
    # plan.bwd_gqa_loop=1: one CTA per KV head walks its group's query heads (query blocks cut by Sq, keys by Sk,
    # groups of 3, 8 (MQA) and 2; a sliding window); dK / dV summed in the kernel
    cute_env(OVERRIDES="plan.bwd_gqa_loop=1")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=12,
         window=(window[0], 0 if causal else window[1]))
    assert any(key[-1] == "gqa" for key in kernels._bwd_kernels), "the gqa_loop kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (1000, 1000), (2048, 2048), (113, 203), (256, 77),
                                               (1, 130), (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
@pytest.mark.parametrize("tma_dkv", [1, 0])
def test_gradients_with_tma_dkv_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k, heads,
                                       heads_kv, tma_dkv):
    # bwd.tma_dkv=1 (the default): dK and dV by TMA stores from the K / V tiles (key blocks cut by Sk: 1, 17, 77, 130,
    # 203 keys, and whole ones; GQA's per-query-head dK / dV summed on the host after the stores); 0: the direct stores
    # (varlen's) on dense calls
    cute_env(OVERRIDES=f"bwd.tma_dkv={tma_dkv}")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=11)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,causal", [(64, False), (64, True), (96, True), (128, False), (128, True)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (113, 203), (1000, 1000), (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_gradients_with_dq_perm_on_gpu(cute_bwd_on, d, causal, seqlen_q, seqlen_k, heads, heads_kv):
    # dq_perm: dq_accum in config.permuted_column's layout, the cast reads it back (rows of both parities, cut by Sq)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=19)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (100, 130), (200, 200), (1000, 1000), (2048, 2048), (113, 203),
                                               (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_gradients_with_the_dq_writer_warp_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, seqlen_q, seqlen_k,
                                                  heads, heads_kv):
    # bwd.dq_writer=1: producer warp 1 issues the dQ reduce-adds as the consumers hand the tiles over (walks of 1, 2, 3
    # and many query blocks: the buffer hand-back starts at the third; GQA on the gqa_loop kernel)
    cute_env(OVERRIDES="bwd.dq_writer=1")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=12)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (1000, 1000), (2048, 2048), (113, 203), (256, 77),
                                               (1, 130)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (6, 2)])
def test_gradients_with_block_m_64_at_d64_on_gpu(cute_bwd_on, monkeypatch, cute_env, causal, seqlen_q, seqlen_k,
                                                 heads, heads_kv):
    # bwd.block_m=64 at d64: the former default (d64 now takes 128 query rows)
    cute_env(OVERRIDES="bwd.block_m=64")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, 64, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=8)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lpt", ["16", "128"])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [(3, 1000, 1000, 5, 5), (2, 2048, 2048, 6, 2),
                                                                    (3, 113, 203, 5, 1), (1, 256, 77, 4, 4),
                                                                    (2, 17, 17, 3, 3)])
def test_gradients_with_lpt_order_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, lpt, batch, seqlen_q,
                                         seqlen_k, heads, heads_kv):
    # bwd.lpt: the 1-D grid in grouped longest-first order, groups of one or several
    # (head, batch) pairs, a smaller last group (15 pairs in groups of 2)
    cute_env(OVERRIDES=f"bwd.lpt={lpt}")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, batch, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=7)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,causal,fields", [(64, True, {"bwd.dq_tma": 1}), (128, False, {"bwd.dq_tma": 1}),
                                             (64, True, {"bwd.stages": 3, "bwd.block_m": 64}),
                                             (128, True, {"bwd.stages": 3, "bwd.dq_tma": 0}),
                                             (64, False, {"bwd.dq_split": 0, "bwd.block_m": 64}),
                                             (96, True, {"bwd.stages": 3}), (96, False, {"bwd.dq_tma": 0})])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (1000, 1000), (113, 203), (256, 77)])
def test_gradients_with_overlap_variants_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, causal, fields, seqlen_q,
                                                seqlen_k):
    # bwd.overlap=1 with the dQ TMA reduce-add, a 3-stage ring and the per-warpgroup dQ (the last two at d64 with
    # 64-row blocks: at d64's default 128 rows neither fits, and the kernel refuses them)
    cute_env(OVERRIDES=_overrides({"bwd.overlap": 1, **fields}))
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, 2, cute_bwd_on, seed=6)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (255, 255), (1000, 1000), (2048, 2048), (113, 203),
                                               (256, 77), (1, 130), (300, 1200)])
@pytest.mark.parametrize("heads,heads_kv", [(4, 4), (4, 1), (6, 2)])
def test_gradients_with_block_m_128_on_gpu(cute_bwd_on, monkeypatch, cute_env, dtype, causal, seqlen_q, seqlen_k,
                                           heads, heads_kv):
    # bwd.block_m=128 at d64: 128 query rows per step (dS^T from the 16-bit P^T, dS^T by
    # stmatrix, dQ split by rows; fp16 unpacks P^T with cvt, bf16 with shifts). Key blocks with one
    # query block, none (causal, Sq < Sk), many, and partial ones on both sides; MHA, MQA, GQA.
    cute_env(OVERRIDES="bwd.block_m=128")
    _fresh_bwd_kernels(monkeypatch)  # the in-memory cache does not key on it
    assert kernels.bwd_config(dtype, 64, causal, "sm_90a").block_m == 128
    _run(dtype, 64, causal, 2, seqlen_q, seqlen_k, heads, heads_kv, cute_bwd_on, seed=8)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("fields", [{"bwd.dq_tma": 0}, {"bwd.dq_split": 0}, {"bwd.stages": 1}, {"bwd.overlap": 1},
                                    {"bwd.overlap": 1, "bwd.dq_tma": 0}],
                         ids=["atomic_dq", "dq_per_wg", "stages1", "overlap", "overlap_atomic_dq"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (1000, 1000), (2048, 2048), (113, 203), (256, 77),
                                               (1, 130)])
def test_gradients_with_block_m_128_variants_on_gpu(cute_bwd_on, monkeypatch, cute_env, causal, fields, seqlen_q,
                                                    seqlen_k):
    # BLOCK_M = 128 with the row-split dQ added by red.global atomics, with the per-warpgroup dQ (M = 128
    # queries over the warpgroup's 64 keys), with a 1-stage Q/dO ring, and the overlapped loop (next
    # block's S^T issued behind dK and dQ) with either dQ
    cute_env(OVERRIDES=_overrides({"bwd.block_m": 128, **fields}))
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, 64, causal, 2, seqlen_q, seqlen_k, 4, 2, cute_bwd_on, seed=9)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,block_m", [(64, "64"), (96, "64"), (128, "64"), (64, "128")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("emu", ["6", "16"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (1000, 1000), (113, 203), (256, 77)])
def test_gradients_with_exp2_emu_on_gpu(cute_bwd_on, monkeypatch, cute_env, d, block_m, causal, emu, seqlen_q,
                                        seqlen_k):
    # bwd.exp2_emu: a share of P^T's exponentials (16: all) by the FMA-pipe polynomial;
    # masked keys and padded / keyless queries (+inf lse2) must still give P = 0 exactly
    cute_env(OVERRIDES=f"bwd.exp2_emu={emu},bwd.block_m={block_m}")
    _fresh_bwd_kernels(monkeypatch)
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, 2, cute_bwd_on, seed=10)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
def test_backend_writes_into_given_grads_on_gpu(cute_bwd_on):
    # the packed-qkv path hands (dq, dk, dv) slices of one gradient (BWD_OUT)
    B, S, H, D = 2, 257, 4, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, S, 3, H, D, generator=g).to("cuda", torch.bfloat16)
    q, k, v = qkv.unbind(2)
    dout = torch.randn(B, S, H, D, generator=g).to("cuda", torch.bfloat16)
    kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=S, max_seqlen_k=S, block_table=None,
              softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=0, softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, rng_state=None)
    out, lse, _ = backend_fwd(cute_backend, q, k, v, return_probs=False, **kw)
    grads = torch.full_like(qkv, float("nan")).unbind(2)
    result = backend_bwd(cute_backend, dout, q, k, v, out, lse, deterministic=False, grads=grads, **kw)
    assert all(r is g_ for r, g_ in zip(result, grads))
    ref, pt = _reference(q, k, v, dout, True)
    for name, a, r, p in zip(("dq", "dk", "dv"), result, ref[1:], pt[1:]):
        testing.assert_close_to_ref(a, r, p, name)


def _bwd_kw(S, D, causal):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=S, max_seqlen_k=S, block_table=None,
                softmax_scale=D ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("heads_kv,packed", [(4, False), (4, True), (1, False)])
def test_backward_is_three_launches_on_gpu(cute_bwd_on, cute_env, heads_kv, packed):
    """The backward's GPU work, counted by the profiler: the preprocess, the kernel and the postprocess,
    nothing else (no memset, copy or torch kernel), for MHA into packed dqkv slices and for MQA. The
    torch host path's count is printed for comparison (-s)."""
    B, S, H, D = 2, 1000, 4, 64
    g = torch.Generator().manual_seed(5)
    if packed:
        q, k, v = torch.randn(B, S, 3, H, D, generator=g).to("cuda", torch.bfloat16).unbind(2)
        grads = torch.empty(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16).unbind(2)
    else:
        q = torch.randn(B, S, H, D, generator=g).to("cuda", torch.bfloat16)
        k, v = (torch.randn(B, S, heads_kv, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        grads = None
    dout = torch.randn(B, S, H, D, generator=g).to("cuda", torch.bfloat16)
    kw = _bwd_kw(S, D, True)
    out, lse, _ = backend_fwd(cute_backend, q, k, v, return_probs=False, **kw)
    counts = {}
    for path in ("torch", "triton"):
        cute_env(OVERRIDES="plan.bwd_host=torch" if path == "torch" else None)
        backend_bwd(cute_backend, dout, q, k, v, out, lse, deterministic=False, grads=grads, **kw)  # compiles
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            backend_bwd(cute_backend, dout, q, k, v, out, lse, deterministic=False, grads=grads, **kw)
            torch.cuda.synchronize()
        gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[path] = [e.name for e in sorted(gpu, key=lambda e: e.time_range.start)]
    print(f"\nGPU work per backward (heads_kv={heads_kv}, packed={packed}): torch host path "
          f"{len(counts['torch'])}: {counts['torch']}; Triton host path {len(counts['triton'])}")
    names = counts["triton"]
    assert len(names) == 3, names
    assert "_bwd_prep_kernel" in names[0] and "_bwd_post_kernel" in names[2], names


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_host_paths_agree_on_gpu(dtype, d):
    """bwd_host's Triton kernels against its torch expressions on CUDA tensors: lse2 (with +-inf rows), the
    padding, dq_accum and the dq cast bit for bit, delta and the GQA sums within fp32 rounding."""
    from flash_attn.cute import bwd_host

    if bwd_host.triton is None:
        pytest.skip("Triton is not installed")
    B, Sq, Sk, H, Hk, pad = 3, 1000, 777, 8, 2, 1024
    g = torch.Generator().manual_seed(6)
    out = torch.randn(B, Sq, 3, H, d, generator=g).to("cuda", dtype)[:, :, 1]
    dout = torch.randn(B, Sq, H, d, generator=g).to("cuda", dtype)
    lse = torch.randn(B, H, Sq, generator=g).cuda()
    lse[0, 1, :7] = float("inf")
    lse[2, 3, 9] = -float("inf")
    got, want = bwd_host.prepare(out, dout, lse, pad), bwd_host.prepare_torch(out, dout, lse, pad)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1][..., Sq:], want[1][..., Sq:])
    assert torch.equal(got[2], want[2])
    dq_accum = torch.randn(B, Sq, H, d, generator=g).cuda()
    dk_h, dv_h = (torch.randn(B, Sk, H, d, generator=g).to("cuda", dtype) for _ in range(2))
    outs = []
    for fn in (bwd_host.finish, bwd_host.finish_torch):
        dq = torch.empty(B, Sq, 3, H, d, device="cuda", dtype=dtype)[:, :, 0]
        dk = torch.empty(B, Sk, Hk, d, device="cuda", dtype=dtype)
        dv = torch.empty(B, Hk, Sk, d, device="cuda", dtype=dtype).transpose(1, 2)
        fn(dq_accum, dq, dk_h, dv_h, dk, dv)
        outs.append((dq, dk, dv))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1:], outs[1][1:]):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_kv", [(255, 255, 4), (1000, 1000, 1), (300, 1200, 2),
                                                       (256, 77, 2)])
def test_gradients_with_torch_host_steps_on_gpu(cute_bwd_on, cute_env, d, causal, seqlen_q, seqlen_k, heads_kv):
    # the fallback host path (no Triton, or plan.bwd_host=torch) around the same kernel
    cute_env(OVERRIDES="plan.bwd_host=torch")
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, heads_kv, cute_bwd_on, seed=7)


def test_precompile_fills_the_disk_cache_with_backward_kernels(tmp_path):
    """`python -m flash_attn.cute.precompile --backward` writes the backward entries too; a second run
    finds them on disk and compiles nothing."""
    pytest.importorskip("tvm_ffi")
    from flash_attn.cute import precompile

    lines = []
    kw = dict(dtypes=("bf16",), head_dims=(64,), causals=(True,), kinds=("bwd",), log=lines.append)
    (row,) = precompile.precompile(str(tmp_path), "sm_90a", **kw)
    assert (row["kind"], row["how"], row["error"]) == ("bwd", "compiled", None), lines
    files = kernels.bwd_disk_entry(torch.bfloat16, 64, True, "sm_90a", str(tmp_path))
    assert "o" in files and all(os.path.exists(p) for p in files.values())
    assert kernels.disk_entry(torch.bfloat16, 64, True, "sm_90a", str(tmp_path)) == {}  # no forward asked
    (again,) = precompile.precompile(str(tmp_path), "sm_90a", **kw)
    assert again["how"] in ("so", "o") and again["error"] is None
    assert lines[0].startswith("bwd bf16 d64 causal: compiled")


# ----------------------------------------------------------------------------------------------------
# Sliding windows (the plan rule bwd_window, on by default)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("window", [(0, 0), (5, 0), (0, 9), (100, 30), (300, 1 << 30), (1 << 30, 7), (64, 64)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 500), (500, 300), (1, 700), (257, 257)])
def test_window_query_block_range_is_exactly_the_blocks_that_see_the_key_block(block_m, window, seqlen_q, seqlen_k):
    """mask.m_block_range under a window, evaluated in Python against the definition: query block m is visited by
    key block n iff some query of m sees some key of n's BN columns (query i sees key j iff i + Sk - Sq - left <=
    j <= i + Sk - Sq + right); every query block is masked (m_block_mask_end)."""
    from flash_attn.cute.mask import AttentionMask

    BN, (left, right) = 128, window
    mask = AttentionMask(False, True, block_m, BN)
    off = seqlen_k - seqlen_q
    n_q_blocks = -(-seqlen_q // block_m)
    for n in range(-(-seqlen_k // BN)):
        lo, hi = mask.m_block_range(n, seqlen_q, seqlen_k, left, right)
        want = [m for m in range(n_q_blocks)
                if any(max(i + off - left, n * BN) <= min(i + off + right, (n + 1) * BN - 1)
                       for i in range(m * block_m, min((m + 1) * block_m, seqlen_q)))]
        assert list(range(lo, max(lo, hi))) == want, (n, lo, hi, want)
        assert mask.m_block_mask_end(n, seqlen_q, seqlen_k) == n_q_blocks


def test_window_backward_is_admitted_under_its_rule_on_by_default(cute_env):
    from flash_attn.cute import autograd

    windowed = [dict(window_left=8), dict(causal=False, window_right=8), dict(window_left=3, window_right=0)]
    cute_env(OVERRIDES="plan.bwd_window=0")
    for what in windowed:
        assert cute_backend.unsupported_reason(_call(**what)) is not None, what
    cute_env(OVERRIDES=None)
    for what in windowed:
        assert cute_backend.unsupported_reason(_call(**what)) is None, what
    assert cute_backend.unsupported_reason(_call(window_left=8, softcap=5.0)) is None  # softcap: its own rule, on
    cute_env(OVERRIDES="plan.bwd_softcap=0")
    assert cute_backend.unsupported_reason(_call(window_left=8, softcap=5.0)) is not None
    cute_env(OVERRIDES=None)
    q = torch.empty(1, 4, 2, 64)
    U = autograd._UNBOUNDED
    assert autograd._kernel_takes(q, q, False, 8, 3, 0.0, False, None)
    assert autograd._kernel_takes(q, q, True, 8, U, 0.0, False, None)
    assert not autograd._kernel_takes(q, q, False, -2, 5, 0.0, False, None)  # FA4's negative sizes: bwd_torch
    assert not autograd._kernel_takes(q, q, False, 8, -1, 0.0, False, None)
    assert autograd._kernel_window(False, U, U) is None and autograd._kernel_window(True, U, U) is None
    assert autograd._kernel_window(True, 8, U) == (8, 0) and autograd._kernel_window(False, U + 5, 4) == (U, 4)
    cute_env(OVERRIDES="plan.bwd_window=0")
    assert not autograd._kernel_takes(q, q, False, 8, 3, 0.0, False, None)


def test_window_backward_compiles_for_sm90a_with_its_own_key(tmp_path):
    cfg, base = kernels.bwd_config(torch.bfloat16, 128, True, "sm_90a", local=True), kernels.bwd_config(
        torch.bfloat16, 128, True, "sm_90a")
    assert cfg.key()["local"] is True and "local" not in base.key()  # existing cache entries keep their keys
    kernels.compile_bwd(torch.bfloat16, 64, False, dump_dir=str(tmp_path), local=True)
    ptx = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    assert len(ptx) == 1 and "call_general" in ptx[0].name
    text = ptx[0].read_text()
    assert _count(text, "wgmma.mma_async") >= 5 and ".target sm_90a" in text


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,window", [(False, (100, 30)), (True, (64, -1)), (False, (0, 0)), (False, (-1, 200)),
                                           (False, (513, -1)), (True, (1, -1))])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1000, 1000), (300, 777), (777, 300), (1, 900)])
def test_window_gradients_on_gpu(cute_bwd_on, cute_env, d, causal, window, seqlen_q, seqlen_k):
    cute_env(OVERRIDES=None, DISABLE=None)  # the plan rule bwd_window is on by default
    _run(torch.bfloat16, d, causal, 2, seqlen_q, seqlen_k, 4, 2, cute_bwd_on, seed=d + seqlen_q, window=window)
