"""fwd_kvcache of the Triton backend (flash_attn/triton/kvcache.py): FA2's flash_attn_with_kvcache.

Oracle: the plain-torch implementation of tests/reference/test_reference_kvcache.py (cache update by Python loops,
rotary by complex multiplication, attention_ref on each sequence's slice of keys) and its checks
(assert_close_to_ref on the output, lse against the fp32 reference lse, the cache bit-exact, or close
where rotary rounds). Without a GPU the kernels run in Triton's interpreter (fp16/fp32, small shapes,
blocks of 16); GPU-marked tests run bf16 at decoding sizes and capture a decode step in a CUDA graph.
"""
import functools
import math
import os
import sys

import pytest
import torch

import flash_attn
from flash_attn import flash_attn_with_kvcache
from flash_attn.testing import assert_close_to_ref, backend_fwd_kvcache, paged_from_dense
from flash_attn.triton import backend as tb

# the reference backend's kvcache tests (tests/reference/) hold the shared oracle
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reference"))
from test_reference_kvcache import _check, _make, _torch_kvcache  # noqa: E402  (the shared oracle)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _to(c, device):
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in c.items()}


def _clone_strided(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _run(c, causal=False, window=(-1, -1), interleaved=False, cache_batch_idx=None, cache_leftpad=None,
         softcap=0.0, alibi_slopes=None, block_size=None, num_splits=0, fn=None):
    """(Triton result (out, lse, k_cache, v_cache as dense (B_cache, S, Hk, D)), torch oracle result)."""
    fn = functools.partial(backend_fwd_kvcache, tb) if fn is None else fn
    c = _to(c, DEVICE)
    cache_batch_idx = None if cache_batch_idx is None else cache_batch_idx.to(DEVICE)
    cache_leftpad = None if cache_leftpad is None else cache_leftpad.to(DEVICE)
    alibi_slopes = None if alibi_slopes is None else alibi_slopes.to(DEVICE)
    q = c["q"]
    ref = _torch_kvcache(q, c["k_cache"], c["v_cache"], c["k"], c["v"], c["cos"], c["sin"], c["cache_seqlens"],
                         cache_batch_idx, cache_leftpad, causal, window, interleaved, softcap, alibi_slopes)
    kc, vc = _clone_strided(c["k_cache"]), _clone_strided(c["v_cache"])
    block_table = None
    if block_size is not None:
        S = kc.shape[1]
        kc, block_table = paged_from_dense(kc, block_size, num_blocks=2 * kc.shape[0] * (-(-S // block_size)),
                                           generator=torch.Generator().manual_seed(9))
        vc, _ = paged_from_dense(c["v_cache"], block_size, num_blocks=kc.shape[0], block_table=block_table)
    out, lse = fn(
        q, kc, vc, k=c["k"], v=c["v"], rotary_cos=c["cos"], rotary_sin=c["sin"],
        cache_seqlens=c["cache_seqlens"], cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, softmax_scale=1.0 / math.sqrt(q.shape[-1]), causal=causal,
        window_left=window[0], window_right=0 if causal else window[1], softcap=softcap,
        rotary_interleaved=interleaved, alibi_slopes=alibi_slopes, num_splits=num_splits)
    if block_table is not None:
        S = c["k_cache"].shape[1]
        kc = kc[block_table.long()].flatten(1, 2)[:, :S]
        vc = vc[block_table.long()].flatten(1, 2)[:, :S]
    return (out, lse, kc, vc), ref


# ----------------------------------------------------------------------------------------------------
# Interpreter (CPU) or GPU, small shapes


def test_backend_serves_kvcache_calls():
    from flash_attn.dispatch import Call
    for paged in (False, True):
        call = Call(DEVICE, torch.float16, 64, 64, kvcache=True, paged=paged, causal=True, window_left=8,
                    window_right=0, softcap=30.0, alibi=True)
        assert tb.unsupported_reason(call) is None
    assert "paged" in tb.unsupported_reason(Call(DEVICE, torch.float16, 64, 64, varlen=True, paged=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_append_and_attend(dtype, causal):
    _check(*_run(_make(dtype=dtype), causal=causal))


@pytest.mark.parametrize("Hk", [4, 1])
def test_decode_step_one_token(Hk):
    # The decoding shape: one query, one new key per sequence, GQA/MQA heads packed into one tile.
    c = _make(B=3, Sq=1, s_new=1, H=4, Hk=Hk, S_cache=50, seed=1)
    _check(*_run(c, causal=True))


def test_append_touches_only_new_rows():
    c = _make(s_new=5, Sq=2)
    got, _ = _run(c, causal=True)
    kc = got[2].cpu()
    for b in range(2):
        L = int(c["cache_seqlens"][b])
        assert torch.equal(kc[b, L:L + 5], c["k"][b])
        assert torch.equal(kc[b, :L], c["k_cache"][b, :L]) and torch.equal(kc[b, L + 5:], c["k_cache"][b, L + 5:])


def test_no_new_kv_and_an_empty_cache_row():
    c = _make(s_new=0)
    c["cache_seqlens"] = torch.tensor([0, 17], dtype=torch.int32)  # an empty row gives 0 and +inf
    for num_splits in (1, 3):
        got, ref = _run(c, causal=False, num_splits=num_splits)
        _check(got, ref)
        assert torch.all(got[0][0] == 0) and torch.all(got[1][0] == float("inf"))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary(interleaved, causal):
    c = _make(rotary_dim=32, Sq=3, s_new=3)
    _check(*_run(c, causal=causal, interleaved=interleaved), exact_cache=False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_partial_dim_and_local_window(interleaved):
    c = _make(rotary_dim=16, D=40, Sq=4, s_new=4, dtype=torch.float32)
    got, ref = _run(c, window=(5, 2), interleaved=interleaved)
    _check(got, ref, exact_cache=False)
    for b in range(2):  # dims past rotary_dim are written unrotated
        L = int(c["cache_seqlens"][b])
        assert torch.equal(got[2][b, L:L + 4, :, 16:].cpu(), c["k"][b, :, :, 16:])


def test_rotary_without_new_kv_rotates_q():
    c = _make(rotary_dim=32, Sq=2, s_new=0)
    _check(*_run(c, causal=True))


def test_strided_views_like_the_model():
    # MHA's cache is one (B, S, 2, Hk, D) buffer and q/k/v are views into a packed (B, S, H + 2 Hk, D) qkv;
    # the rotary tables are column slices and a transposed (non-contiguous) table.
    c = _make(B=2, Sq=2, s_new=2, H=4, Hk=2, D=32, rotary_dim=16, seed=16)
    B, S, Hk, D = c["k_cache"].shape
    kv_buf = torch.randn(B, S, 2, Hk, D).to(c["k_cache"].dtype)
    kv_buf[:, :, 0], kv_buf[:, :, 1] = c["k_cache"], c["v_cache"]
    qkv = torch.cat([c["q"], c["k"], c["v"]], dim=2)
    wide = torch.randn(S, 24).to(c["cos"].dtype)
    wide[:, 3:11] = c["cos"]
    sin_t = c["sin"].t().contiguous().t()
    strided = dict(c, q=qkv[:, :, :4], k=qkv[:, :, 4:6], v=qkv[:, :, 6:], k_cache=kv_buf[:, :, 0],
                   v_cache=kv_buf[:, :, 1], cos=wide[:, 3:11], sin=sin_t)
    assert strided["sin"].stride(-1) != 1

    def fn(q, k_cache, v_cache, **kw):
        assert q.stride(1) == 8 * D and k_cache.stride(1) == v_cache.stride(1) == 2 * Hk * D
        return backend_fwd_kvcache(tb, q, k_cache, v_cache, **kw)

    _check(*_run(strided, causal=True, fn=fn), exact_cache=False)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_paged_cache(block_size):
    c = _make(s_new=4, Sq=4, rotary_dim=16)
    _check(*_run(c, causal=True, block_size=block_size), exact_cache=False)


def test_paged_cache_leftpad_mqa_softcap_splits():
    c = _make(B=2, H=4, Hk=1, s_new=2, Sq=2)
    c["cache_seqlens"] = torch.tensor([9, 30], dtype=torch.int32)
    _check(*_run(c, causal=True, block_size=8, cache_leftpad=torch.tensor([2, 7], dtype=torch.int32),
                 softcap=4.0, num_splits=3))


def test_cache_batch_idx():
    c = _make(B=2, B_cache=5)
    before = c["k_cache"].clone()
    got, ref = _run(c, causal=True, cache_batch_idx=torch.tensor([3, 1], dtype=torch.int32))
    _check(got, ref)
    for r in (0, 2, 4):  # rows no batch entry maps to stay untouched
        assert torch.equal(got[2][r].cpu(), before[r])


@pytest.mark.parametrize("alibi", [False, True])
def test_cache_leftpad(alibi):
    c = _make(B=3, s_new=2, Sq=2, H=2, Hk=2)
    c["cache_seqlens"] = torch.tensor([10, 25, 4], dtype=torch.int32)
    leftpad = torch.tensor([3, 0, 4], dtype=torch.int32)  # the last row keeps only its 2 new keys
    slopes = torch.rand(3, 2, generator=torch.Generator().manual_seed(3)) * 0.5 if alibi else None
    _check(*_run(c, causal=True, cache_leftpad=leftpad, alibi_slopes=slopes))


@pytest.mark.parametrize("Hk", [4, 2, 1])
def test_gqa_window_softcap_alibi(Hk):
    c = _make(Hk=Hk, Sq=5, s_new=5)
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(4)) * 0.5
    _check(*_run(c, window=(6, 1), softcap=3.0, alibi_slopes=slopes))


def test_head_dim_v_differs():
    _check(*_run(_make(D=40, Dv=24, Sq=2, s_new=2), causal=True))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 16])
def test_num_splits(num_splits):
    # 40 cached keys in blocks of 16 (interpreter): 3 blocks, so 5 and 16 splits leave splits with no keys;
    # a sequence with no keys at all gives 0 and +inf through the combine step too.
    c = _make(B=3, Sq=2, s_new=2, S_cache=40, seed=5)
    c["cache_seqlens"] = torch.tensor([38, 5, 0], dtype=torch.int32)
    got, ref = _run(c, causal=True, num_splits=num_splits,
                    cache_leftpad=torch.tensor([0, 0, 2], dtype=torch.int32))
    _check(got, ref)
    assert torch.all(got[0][2] == 0) and torch.all(got[1][2] == float("inf"))


def test_splits_with_local_window_and_leftpad():
    c = _make(B=2, Sq=3, s_new=1, S_cache=48, H=4, Hk=2, seed=6)
    c["cache_seqlens"] = torch.tensor([44, 20], dtype=torch.int32)
    _check(*_run(c, window=(9, 0), cache_leftpad=torch.tensor([5, 1], dtype=torch.int32), num_splits=4))


def test_launch_plan_is_per_kind_of_call(monkeypatch):
    """fwd_kvcache keeps one launch plan per kind of call (kvcache._plan) and reuses it on the next call of that kind;
    a call that differs in anything its launch depends on (here the window and softcap) gets its own, so each result
    matches the oracle."""
    from flash_attn.triton import kvcache as kv

    monkeypatch.setattr(kv, "_PLANS", {})
    c = _make(dtype=torch.float32, Sq=1, s_new=0, rotary_dim=0, seed=3)
    _check(*_run(c))
    assert len(kv._PLANS) == 1
    plan = next(iter(kv._PLANS.values()))
    _check(*_run(c))
    assert len(kv._PLANS) == 1 and next(iter(kv._PLANS.values())) is plan
    _check(*_run(c, window=(5, 0)))
    _check(*_run(c, softcap=10.0))
    assert len(kv._PLANS) == 3


def test_split_parts_are_reused_per_kind_of_call(monkeypatch):
    """A split call's fp32 parts (kvcache._split_parts) are one buffer per kind of call and stream, reused by the next
    call of that kind (whose result is its own: the oracle's for new values); another kind gets its own; a call while
    a CUDA graph is being captured allocates parts of its own."""
    from flash_attn.triton import kvcache as kv

    monkeypatch.setattr(kv, "_PARTS", {})
    made = []
    real_split_parts = kv._split_parts
    monkeypatch.setattr(kv, "_split_parts", lambda *a: made.append(real_split_parts(*a)) or made[-1])
    for seed in (1, 2):
        c = _make(B=2, Sq=1, s_new=0, S_cache=40, rotary_dim=0, seed=seed)
        _check(*_run(c, num_splits=3))
    assert len(kv._PARTS) == 1 and made[0][0].data_ptr() == made[1][0].data_ptr()
    assert made[0][0].shape[:3] == (3, 2, 1) and made[0][1].shape[:2] == (3, 2)  # (splits, B, Sq ...), (splits, B ...)
    _check(*_run(_make(B=2, Sq=1, s_new=0, S_cache=40, rotary_dim=0, seed=3), num_splits=2))
    assert len(kv._PARTS) == 2
    if DEVICE == "cuda":
        monkeypatch.setattr(kv, "_stream_capturing", lambda: True)
        _check(*_run(c, num_splits=3))
        assert len(kv._PARTS) == 2 and made[-1][0].data_ptr() != made[0][0].data_ptr()


def test_choose_num_splits():
    from flash_attn.triton.kvcache import MAX_SPLITS, choose_num_splits
    # Issue 6's decode on an H200: batch 1, 8 kv heads, 2k prompt + 256 new tokens, key blocks of 64.
    assert choose_num_splits(1 * 8, 2304, 64, 132) == 32  # a program per SM at least, a power of two
    assert choose_num_splits(8 * 8, 32768, 64, 132) == 16  # 16 at least
    assert choose_num_splits(100, 32768, 64, 132) == 16
    assert choose_num_splits(64 * 8, 4096, 64, 132) == 1  # the programs alone fill the GPU
    assert choose_num_splits(1, 100, 64, 132) == 2  # no more splits than key blocks
    assert choose_num_splits(1, 1 << 20, 64, 1000) == MAX_SPLITS


def test_public_api_through_dispatch():
    # flash_attn_with_kvcache -> flash_attn::fwd_kvcache -> the Triton backend, forced (CPU: interpreter).
    c = _to(_make(dtype=torch.float32, Sq=1, s_new=1, rotary_dim=16, seed=7), DEVICE)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    kr, vr = c["k_cache"].clone(), c["v_cache"].clone()
    kw = dict(k=c["k"], v=c["v"], rotary_cos=c["cos"], rotary_sin=c["sin"], cache_seqlens=c["cache_seqlens"],
              causal=True, rotary_interleaved=False, return_softmax_lse=True)
    with flash_attn.use_backend("triton"):
        out, lse = flash_attn_with_kvcache(c["q"], kc, vc, **kw)
    with flash_attn.use_backend("torch"):
        out_r, lse_r = flash_attn_with_kvcache(c["q"], kr, vr, **kw)
    torch.testing.assert_close(out, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, lse_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc, kr, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc, vr)


def test_no_host_reads(monkeypatch):
    # Graph capture forbids reading device values on the host: the backend call must use none of these.
    c = _to(_make(Sq=2, s_new=2, rotary_dim=16, seed=8), DEVICE)
    kc, table = paged_from_dense(c["k_cache"], 8, num_blocks=12, generator=torch.Generator().manual_seed(9))
    vc, _ = paged_from_dense(c["v_cache"], 8, num_blocks=12, block_table=table)
    leftpad = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    batch_idx = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    slopes = torch.rand(4, device=DEVICE)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    for paged in (True, False):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
                m.setattr(torch.Tensor, name, forbidden)
            out, lse = backend_fwd_kvcache(tb,
                c["q"], kc if paged else c["k_cache"], vc if paged else c["v_cache"], k=c["k"], v=c["v"],
                rotary_cos=c["cos"], rotary_sin=c["sin"], cache_seqlens=c["cache_seqlens"],
                cache_batch_idx=None if paged else batch_idx, cache_leftpad=leftpad,
                block_table=table if paged else None, softmax_scale=0.2, causal=True, window_left=3,
                window_right=0, softcap=2.0, rotary_interleaved=False, alibi_slopes=slopes, num_splits=2)
        assert torch.isfinite(out).all()


_AOT_SCRIPT = r"""
import contextlib, io, json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
import flash_attn
from flash_attn.triton import kvcache as kv

target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
try:
    triton.knobs.nvidia.dump_ptxas_log = True
except AttributeError:
    pass


def compile_kernel(label, fn, types, constexprs, num_warps, num_stages):
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else types(n) for n in names}
    # pointers and the strides Triton would see divisible by 16 (contiguous bf16 tensors, head dims 64/128)
    div = [n for n in names if n not in constexprs and (sig[n].startswith("*") or n in (
        "stride_qb", "stride_qm", "stride_qh", "stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn",
        "stride_vh", "stride_os", "stride_ob", "stride_om", "stride_oh", "num_heads"))]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    opts = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        triton.compile(src, target=target, options=opts.__dict__)
    m = re.search(r"(\d+) bytes spill stores", log.getvalue())
    r = re.search(r"Used (\d+) registers", log.getvalue())
    print(json.dumps(dict(label=label, spills=int(m.group(1)) if m else None, regs=int(r.group(1)) if r else None)))


def attn_types(n, split):
    if n in ("Q", "KCache", "VCache"):
        return "*bf16"
    if n == "Out":
        return "*fp32" if split else "*bf16"
    if n in ("Lse", "Alibi", "Sink"):
        return "*fp32"
    if n[0].isupper():
        return "*i32"
    return "fp32" if n in ("qk_scale", "softcap_scale", "softcap_log2") else "i32"


def attn(label, D, rows, split, **flags):
    bm, bn, w, st = kv.attn_config((9, 0), D, rows, True, False, torch.bfloat16)
    ce = dict(IS_FP32=False, HEAD_DIM=D, HEAD_DIM_V=D, BLOCK_D=D, BLOCK_DV=D, BLOCK_M=bm, BLOCK_N=bn, PAGED=False,
              PAGE_SIZE=1, HAS_BATCH_IDX=False, HAS_LEFTPAD=False, WINDOW_LEFT=False, WINDOW_RIGHT=True,
              HAS_SOFTCAP=False, HAS_ALIBI=False, SPLIT=split, HAS_SINK=False)
    ce.update(flags)
    compile_kernel(label, kv._kvcache_attn_kernel, lambda n: attn_types(n, split), ce, w, st)


attn("decode d64 split", 64, 4, True)
attn("decode d128 paged, every feature", 128, 4, False, PAGED=True, PAGE_SIZE=256, HAS_LEFTPAD=True,
     WINDOW_LEFT=True, HAS_SOFTCAP=True, HAS_ALIBI=True, HAS_SINK=True)
attn("prompt d128", 128, 8192, False)
compile_kernel("combine d128", kv._kvcache_combine_kernel,
               lambda n: "*fp32" if n in ("OPart", "LPart", "Lse", "Sink") else "*bf16" if n == "Out" else "i32",
               dict(HEAD_DIM_V=128, BLOCK_DV=128, BLOCK_SPLITS=32, CHUNK=32, HAS_SINK=True), 4, 1)
compile_kernel("prep d128 rotary paged", kv._kvcache_prep_kernel,
               lambda n: "*i32" if n in ("CacheSeqlens", "CacheBatchIdx", "BlockTable") else "*bf16"
               if n[0].isupper() else "i32",
               dict(HEAD_DIM=128, HEAD_DIM_V=128, BLOCK_D=128, BLOCK_DV=128, BLOCK_R=1, ROTARY_DIM=128,
                    INTERLEAVED=False, APPEND=True, ROTATE_Q=True, Q_LOCAL=True, PAGED=True, PAGE_SIZE=256,
                    HAS_BATCH_IDX=False), 1, 1)
"""


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """The decode, prompt, combine and prep kernels as configured for an H200 compile for sm_90 ahead of time
    (no GPU: the interpreter never runs Triton's code generator) and ptxas spills no registers."""
    import subprocess

    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_CACHE_DIR=str(tmp_path))  # a fresh cache, so ptxas runs and logs
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 5, r.stdout
    for row in rows:
        assert row["spills"] in (0, None), row  # None: a Triton without the ptxas log knob


# ----------------------------------------------------------------------------------------------------
# GPU: bf16 at decoding sizes, CUDA-graph capture


def _gpu_case(B, Sq, s_new, S_cache, H, Hk, D, seed, rotary_dim=0):
    c = _make(B=B, Sq=Sq, s_new=s_new, S_cache=S_cache, H=H, Hk=Hk, D=D, dtype=torch.bfloat16, seed=seed,
              rotary_dim=rotary_dim)
    return c


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 7])
def test_gpu_decode_bf16(D, paged, num_splits):
    # LLaMA-shaped decoding: 32 q heads over 8 kv heads, one new token, caches of a few thousand rows.
    c = _gpu_case(B=2, Sq=1, s_new=1, S_cache=3000, H=32, Hk=8, D=D, seed=10)
    c["cache_seqlens"] = torch.tensor([2047, 2900], dtype=torch.int32)
    _check(*_run(c, causal=True, block_size=256 if paged else None, num_splits=num_splits))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_prompt_through_cache_bf16(D):
    # A prompt appended through the cache (Sq = S_new = 512, rotary), the large-tile config.
    c = _gpu_case(B=2, Sq=512, s_new=512, S_cache=1024, H=32, Hk=8, D=D, seed=11, rotary_dim=D)
    c["cache_seqlens"] = torch.tensor([0, 300], dtype=torch.int32)
    _check(*_run(c, causal=True, interleaved=False), exact_cache=False)


@pytest.mark.gpu
def test_gpu_features_bf16():
    c = _gpu_case(B=3, Sq=4, s_new=4, S_cache=2048, H=16, Hk=4, D=128, seed=12, rotary_dim=64)
    c["cache_seqlens"] = torch.tensor([1500, 0, 2000], dtype=torch.int32)
    slopes = torch.rand(3, 16, generator=torch.Generator().manual_seed(13)) * 0.1
    _check(*_run(c, causal=True, interleaved=True, cache_leftpad=torch.tensor([7, 0, 100], dtype=torch.int32),
                 softcap=20.0, alibi_slopes=slopes, block_size=16), exact_cache=False)
    c = _gpu_case(B=2, Sq=1, s_new=1, S_cache=4096, H=8, Hk=8, D=64, seed=14)
    c["cache_seqlens"] = torch.tensor([4000, 3000], dtype=torch.int32)
    _check(*_run(c, window=(511, 0), cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)))


def _compiled_count(kernel):
    caches = getattr(kernel, "device_caches", None) or {}
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.gpu
def test_gpu_cuda_graph_decode_step():
    """Capture one decode step (append 1 token, attend) in a CUDA graph, replay it for several cache lengths
    set in place in cache_seqlens, and compare each replay with an eager call on a copy of the caches."""
    from flash_attn.triton import kvcache as kv

    torch.manual_seed(0)
    B, H, Hk, D, S = 2, 32, 8, 64, 2304
    dev, dt = "cuda", torch.bfloat16
    k_cache = torch.randn(B, S, Hk, D, device=dev, dtype=dt)
    v_cache = torch.randn(B, S, Hk, D, device=dev, dtype=dt)
    q = torch.randn(B, 1, H, D, device=dev, dtype=dt)
    k_new = torch.randn(B, 1, Hk, D, device=dev, dtype=dt)
    v_new = torch.randn(B, 1, Hk, D, device=dev, dtype=dt)
    seqlens = torch.full((B,), 100, dtype=torch.int32, device=dev)
    angle = torch.rand(S, D // 2, device=dev) * 6.28
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)

    def step(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens, causal=True, rotary_interleaved=False,
                                       return_softmax_lse=True)

    with flash_attn.use_backend("triton"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(k_cache, v_cache)
        torch.cuda.current_stream().wait_stream(stream)
        compiled = (_compiled_count(kv._kvcache_attn_kernel), _compiled_count(kv._kvcache_prep_kernel))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g, lse_g = step(k_cache, v_cache)
        for L in (0, 1, 127, 128, 1000, 2047, 2303):
            seqlens.fill_(L)
            q.normal_()
            k_new.normal_()
            v_new.normal_()
            before = (k_cache.clone(), v_cache.clone())
            kc, vc = before[0].clone(), before[1].clone()
            out_e, lse_e = step(kc, vc)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc), L
            assert torch.equal(out_g, out_e), L
            assert torch.equal(lse_g, lse_e), L
        # new cache lengths compiled nothing new
        assert compiled == (_compiled_count(kv._kvcache_attn_kernel), _compiled_count(kv._kvcache_prep_kernel))
    # and the replayed step is right: the last one against the oracle
    out_ref, out_pt, lse_ref, kc_ref, vc_ref, _ = _torch_kvcache(
        q, before[0], before[1], k_new, v_new, cos, sin, seqlens, None, None, True, (-1, -1), False, 0.0, None)
    assert_close_to_ref(out_g, out_ref, out_pt)
    torch.testing.assert_close(lse_g, lse_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(k_cache, kc_ref)
    assert torch.equal(v_cache, vc_ref)


@pytest.mark.parametrize("case", [dict(), dict(causal=True), dict(window_left=5, window_right=2), dict(softcap=8.0),
                                  dict(alibi=True), dict(sink=True), dict(causal=True, Sq=6, Sk=4)])
def test_dense_decoding_call_runs_the_kvcache_kernels(monkeypatch, case):
    """A dense forward whose lse the caller drops (lse_scratch) with at most _DECODE_ROWS query rows runs as a
    KV-cache call over the whole of k / v (its split of the keys): the reference backend's out and lse, masks,
    softcap, ALiBi and the sink included, rows that see no key too (causal, more queries than keys); a call that
    keeps its lse, or has more query rows, takes the dense kernel."""
    from flash_attn import reference
    from flash_attn.testing import backend_fwd
    from flash_attn.triton import kvcache as kv

    case = dict(case)
    Sq, Sk = case.pop("Sq", 3), case.pop("Sk", 40)
    g = torch.Generator().manual_seed(Sq * 100 + Sk)
    B, H, Hk, D = 2, 4, 2, 16
    q = torch.randn(B, Sq, H, D, generator=g).to(DEVICE)
    k = torch.randn(B, Sk, Hk, D, generator=g).to(DEVICE)
    v = torch.randn(B, Sk, Hk, D, generator=g).to(DEVICE)
    kw = dict(causal=case.get("causal", False), window_left=case.get("window_left", -1),
              window_right=case.get("window_right", -1), softcap=case.get("softcap", 0.0))
    if case.get("alibi"):
        kw["alibi_slopes"] = (torch.rand(H, generator=g) * 0.3).to(DEVICE)
    if case.get("sink"):
        kw["learnable_sink"] = torch.randn(H, generator=g).to(DEVICE)
    runs = []
    real = kv.fwd_kvcache
    monkeypatch.setattr(kv, "fwd_kvcache", lambda *a, **k_: runs.append(1) or real(*a, **k_))
    out, lse, _ = backend_fwd(tb, q, k, v, lse_scratch=True, **kw)
    assert runs == [1]
    want_out, want_lse, _ = backend_fwd(reference, q, k, v, **kw)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
    backend_fwd(tb, q, k, v, **kw)  # the lse kept: the dense kernel
    assert runs == [1]
    if Sq <= tb._DECODE_ROWS:
        monkeypatch.setattr(tb, "_DECODE_ROWS", Sq - 1)
        backend_fwd(tb, q, k, v, lse_scratch=True, **kw)  # more query rows than decoding has
        assert runs == [1]
