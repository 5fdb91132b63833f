"""flash_attn.cute.flash_attn_combine's Triton kernel (combine._kernel()): in the interpreter on CPU tensors
(fp16 / fp32; tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) against an fp64 combine written here, and on a
GPU (marked gpu) against the module's torch expression in bf16 / fp16 / fp32. Dense and varlen shapes, 1 to 130
parts, head dims 8 / 64 / 96 / 128, empty parts (lse -inf or +inf) and rows no part saw, large lse, NaN lse, strided
inputs and outputs, out_dtype, return_lse=False, empty inputs, which calls take the kernel, that bad input raises
before any launch, and that the kernel compiles for sm_90 (ahead of time, no GPU needed)."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import combine  # noqa: E402

needs_kernel = pytest.mark.skipif(not combine.HAS_TRITON or not (combine._INTERPRET or torch.cuda.is_available()),
                                  reason="needs Triton with a CUDA GPU or TRITON_INTERPRET=1")
pytestmark = needs_kernel

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def defaults(cute_env):
    """The default settings (nothing overridden)."""
    cute_env()
# the only rounding beyond fp32's: the output's (a unit in the last place, relative)
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}


def combine_ref(out_partial, lse_partial):
    """(out, lse) in fp64, row by row from the definition: lse = log sum_s exp(lse_s) over the parts with a finite
    lse, out = sum_s exp(lse_s - lse) o_s; a row with no such part gets out 0 and lse -inf."""
    o = out_partial.double()
    lse_p = lse_partial.double()
    finite = torch.isfinite(lse_p)
    big = torch.where(finite, lse_p, -math.inf).amax(0)  # (..., H)
    any_part = finite.any(0)
    shift = torch.where(any_part, big, 0.0)
    e = torch.where(finite, torch.exp(lse_p - shift), 0.0)
    total = e.sum(0)
    lse = torch.where(any_part, shift + torch.log(torch.where(any_part, total, 1.0)), -math.inf)
    w = torch.where(any_part, e / torch.where(any_part, total, 1.0), 0.0)
    return (w.unsqueeze(-1) * o).sum(0), lse


def _parts(splits, rows, H, D, dtype, seed=0, scale=3.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(splits, *rows, H, D, generator=g).to(dtype)
    lse = torch.randn(splits, *rows, H, generator=g) * scale + offset
    return o.to(DEV), lse.to(DEV)


def _launches(monkeypatch):
    """The kernels launched from here on (the real launch still runs)."""
    seen = []
    real = combine._launch
    monkeypatch.setattr(combine, "_launch", lambda kernel, *a: (seen.append(kernel), real(kernel, *a))[1])
    return seen


def _close(out, lse, want_out, want_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=ULP[dtype], atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [1, 3, 17, 130])
def test_dense_matches_fp64(monkeypatch, dtype, splits):
    seen = _launches(monkeypatch)
    o, lse_p = _parts(splits, (2, 3), 2, 64, dtype)
    out, lse = combine.flash_attn_combine(o, lse_p)
    assert seen == [combine._kernel()]
    assert out.shape == (2, 3, 2, 64) and lse.shape == (2, 3, 2)
    _close(out, lse, *combine_ref(o, lse_p), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D", [8, 96, 128])
def test_head_dims(dtype, D):
    o, lse_p = _parts(3, (1, 5), 2, D, dtype, seed=D)
    out, lse = combine.flash_attn_combine(o, lse_p)
    _close(out, lse, *combine_ref(o, lse_p), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("splits", [1, 17])
def test_varlen_matches_fp64_and_lse_is_heads_major(monkeypatch, dtype, splits):
    seen = _launches(monkeypatch)
    o, lse_p = _parts(splits, (11,), 3, 96, dtype, seed=1)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEV)
    out, lse = combine.flash_attn_combine(o, lse_p, cu_seqlens=cu)
    assert seen == [combine._kernel()]
    assert out.shape == (11, 3, 96) and lse.shape == (11, 3) and lse.stride() == (1, 11)  # (H, total_q) storage
    _close(out, lse, *combine_ref(o, lse_p), dtype)


def test_dense_lse_is_heads_major():
    o, lse_p = _parts(2, (2, 5), 3, 8, torch.float32)
    _, lse = combine.flash_attn_combine(o, lse_p)
    assert lse.stride() == (15, 1, 5)  # (B, H, S) storage, as FA4's


@pytest.mark.parametrize("empty", [-math.inf, math.inf])
def test_empty_parts_add_nothing_and_unseen_rows_are_zero(empty):
    o, lse_p = _parts(4, (2, 3), 2, 64, torch.float32, seed=2)
    lse_p[:, 0, 0, 0] = empty  # no part saw row (0, 0), head 0
    lse_p[:, 1, 2, :] = empty
    lse_p[1:3, 0, 1, 1] = empty  # some parts of a row
    lse_p[0, 1, 0, 0] = empty
    o[1:3, 0, 1, 1] = 1e30  # what an empty part's o holds does not matter (its weight is exactly 0)
    out, lse = combine.flash_attn_combine(o, lse_p)
    assert not out[0, 0, 0].any() and not out[1, 2].any()  # exactly 0
    assert torch.isneginf(lse[0, 0, 0]) and torch.isneginf(lse[1, 2]).all()
    want_out, want_lse = combine_ref(o, lse_p)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out[0, 1, 1], combine.flash_attn_combine(o[[0, 3]], lse_p[[0, 3]])[0][0, 1, 1],
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("offset", [80.0, 1e4, -1e4])
def test_large_lse_does_not_overflow(offset):
    o, lse_p = _parts(5, (2, 2), 2, 64, torch.float32, seed=3, scale=20.0, offset=offset)
    out, lse = combine.flash_attn_combine(o, lse_p)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    _close(out, lse, *combine_ref(o, lse_p), torch.float32)


def test_nan_lse_as_the_torch_path():
    o, lse_p = _parts(3, (1, 4), 2, 8, torch.float32, seed=4)
    lse_p[1, 0, 2, 1] = math.nan
    out, lse = combine.flash_attn_combine(o, lse_p)
    want_out, want_lse = combine.combine_torch(o, lse_p)
    assert torch.isnan(lse[0, 2, 1]) and not out[0, 2, 1].any()
    torch.testing.assert_close(out, want_out, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, equal_nan=True)


def test_strided_inputs():
    # out_partial stored (B, H, splits, S, D) with padding on D, lse_partial (H, S, splits, B)
    g = torch.Generator().manual_seed(5)
    o = torch.randn(2, 3, 6, 4, 80, generator=g)[..., :72].permute(2, 0, 3, 1, 4)
    lse_p = torch.randn(3, 4, 6, 2, generator=g).permute(2, 3, 1, 0)
    assert o.shape == (6, 2, 4, 3, 72) and lse_p.shape == (6, 2, 4, 3) and not o.is_contiguous()
    out, lse = combine.flash_attn_combine(o.to(DEV), lse_p.to(DEV))
    _close(out, lse, *combine_ref(o, lse_p), torch.float32)


@pytest.mark.parametrize("varlen", [False, True])
def test_out_given_with_strides(monkeypatch, varlen):
    seen = _launches(monkeypatch)
    rows = (7,) if varlen else (2, 3)
    o, lse_p = _parts(3, rows, 2, 96, torch.float16, seed=6)
    # (..., H, D) inside a NaN-filled (..., D + 8, H) float32 buffer: D and H swapped in memory, padded
    big = torch.full((*rows, 104, 2), math.nan, dtype=torch.float32, device=DEV)
    dest = big[..., :96, :].transpose(-1, -2)
    res, none = combine.flash_attn_combine(o, lse_p, out=dest, out_dtype=torch.float16, return_lse=False)
    assert seen == [combine._kernel()]
    assert res is dest and none is None and dest.dtype == torch.float32  # out's dtype wins over out_dtype
    assert torch.isnan(big[..., 96:, :]).all()  # nothing written outside out
    torch.testing.assert_close(dest.double(), combine_ref(o, lse_p)[0], rtol=ULP[torch.float32], atol=1e-6)


@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_out_dtype(dtype, out_dtype):
    o, lse_p = _parts(3, (2, 2), 2, 64, dtype, seed=7)
    out, lse = combine.flash_attn_combine(o, lse_p, out_dtype=out_dtype)
    _close(out, lse, *combine_ref(o, lse_p), out_dtype)


def test_return_lse_false():
    o, lse_p = _parts(3, (2, 2), 2, 64, torch.float32, seed=8)
    out, lse = combine.flash_attn_combine(o, lse_p, return_lse=False)
    assert lse is None
    torch.testing.assert_close(out.double(), combine_ref(o, lse_p)[0], rtol=ULP[torch.float32], atol=1e-6)


def test_zero_splits_as_the_torch_path():
    o, lse_p = _parts(0, (2, 3), 2, 8, torch.float32)
    out, lse = combine.flash_attn_combine(o, lse_p)
    assert torch.equal(out, torch.zeros(2, 3, 2, 8, device=DEV)) and torch.isneginf(lse).all()
    want_out, want_lse = combine.combine_torch(o, lse_p)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("rows,H", [((0, 3), 2), ((2, 0), 2), ((2, 3), 0), ((0,), 2)])
def test_empty_outputs_launch_nothing(monkeypatch, rows, H):
    seen = _launches(monkeypatch)
    o, lse_p = _parts(3, rows, H, 8, torch.float32)
    out, lse = combine.flash_attn_combine(o, lse_p)
    assert out.shape == (*rows, H, 8) and lse.shape == (*rows, H) and seen == []


def test_plain_triton_launch_without_the_launcher_service(monkeypatch):
    # flash-attn-4 alone: no flash_attn.backends, the kernel launched as kernel[grid](...)
    from flash_attn.cute import triton_launch

    monkeypatch.setattr(triton_launch, "triton_launcher", None)
    monkeypatch.setattr(triton_launch, "_launchers", {})
    o, lse_p = _parts(3, (1, 3), 2, 8, torch.float32, seed=9)
    out, lse = combine.flash_attn_combine(o, lse_p)
    _close(out, lse, *combine_ref(o, lse_p), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU routing rules")
def test_torch_path_where_the_kernel_does_not_serve(monkeypatch):
    seen = _launches(monkeypatch)
    o, lse_p = _parts(2, (1, 3), 2, 8, torch.float32)
    combine.flash_attn_combine(o, lse_p, out_dtype=torch.bfloat16)  # the interpreter computes bf16 wrongly
    combine.flash_attn_combine(o, lse_p, out_dtype=torch.float64)
    combine.flash_attn_combine(o, lse_p.double())
    combine.flash_attn_combine(o.requires_grad_(), lse_p)  # the kernel has no backward
    assert seen == []
    out, _ = combine.flash_attn_combine(o.detach(), lse_p)
    kernel = combine._kernel()
    assert seen == [kernel]
    monkeypatch.setattr(combine, "_INTERPRET", False)  # a CPU tensor without the interpreter
    combine.flash_attn_combine(o.detach(), lse_p)
    monkeypatch.setattr(combine, "_INTERPRET", True)
    monkeypatch.setattr(combine, "HAS_TRITON", False)  # flash-attn-4 without Triton
    combine.flash_attn_combine(o.detach(), lse_p)
    monkeypatch.setattr(combine, "HAS_TRITON", True)
    monkeypatch.setattr(combine, "_kernel_fn", [None])  # a Triton that does not import
    combine.flash_attn_combine(o.detach(), lse_p)
    assert seen == [kernel]


def test_gradient_flows_on_the_torch_path():
    o, lse_p = _parts(3, (1, 2), 2, 8, torch.float32)
    o.requires_grad_()
    out, _ = combine.flash_attn_combine(o, lse_p)
    out.sum().backward()
    assert o.grad is not None and o.grad.shape == o.shape


def test_bad_input_raises_before_any_launch(monkeypatch):
    monkeypatch.setattr(combine, "_launch", lambda *a: pytest.fail("launched"))
    o, lse_p = _parts(2, (1, 3), 2, 8, torch.float32)
    with pytest.raises(ValueError, match="lse_partial must have shape"):
        combine.flash_attn_combine(o, lse_p[..., :1])
    with pytest.raises(ValueError, match="out must have shape"):
        combine.flash_attn_combine(o, lse_p, out=torch.empty(1, 3, 2, 7, device=DEV))
    with pytest.raises(ValueError, match="out_partial must be a tensor"):
        combine.flash_attn_combine(o[0, 0], lse_p[0, 0])
    with pytest.raises(ValueError, match="cu_seqlens must be a tensor"):
        combine.flash_attn_combine(o, lse_p, cu_seqlens=[0, 3])


_AOT_SCRIPT = r"""
import json, re
from flash_attn.cute import combine as cb
from flash_attn.testing import triton_sm90_compile

fn = cb._kernel()
names = fn.arg_names
for splits, rows, D in ((64, 4096, 128), (64, 1, 128), (16, 16, 96), (4, 4096, 256)):
    bk, bm, bd, warps = cb._tile(splits, rows, 32, D)
    ce = dict(HEAD_DIM=D, BLOCK_K=bk, BLOCK_M=bm, BLOCK_D=bd, WRITE_LSE=True, HAS_SINK=False, UNSEEN_POS_INF=False,
              s_pd=1, s_od=1, s_lh=1, s_es=1)
    types = {"OutPartial": "*bf16", "Out": "*bf16"}
    sig = {n: types.get(n, "*fp32" if n[0].isupper() else "i32") for n in names}
    # contiguous bf16 parts: pointers and strides other than the unit ones divisible by 16
    div = [n for n in names if n not in ce and (n[0].isupper() or n.startswith("s_"))]
    got = triton_sm90_compile(fn, sig, ce, div, num_warps=warps)
    print(json.dumps(dict(label=f"{splits} {rows} {D}", spills=got["spills"],
                          ld_v4=len(re.findall(r"ld\.global[.\w]*\.v4", got["ptx"])))))
"""


@pytest.mark.skipif(not combine.HAS_TRITON, reason="needs Triton")
def test_kernel_compiles_for_sm90_vectorised_without_spills(tmp_path):
    """The kernel as launched for bf16 parts (prefill and decoding tiles, D 96 / 128 / 256) compiles for sm_90 ahead
    of time (the interpreter never runs Triton's code generator), ptxas spills nothing, and o is read 16 bytes at a
    time."""
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, _PKG, os.environ.get("PYTHONPATH", "")]),
               TRITON_CACHE_DIR=str(tmp_path))  # a fresh cache, so ptxas runs and logs
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in r.stdout.splitlines() if x[:1] == "{"]
    assert len(rows) == 4, r.stdout
    for row in rows:
        assert row["spills"] in (0, None) and row["ld_v4"] >= 1, row  # None: a Triton without the ptxas log knob


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, (4, 1), 32, 128), (4, (2, 77), 8, 128), (64, (3, 1), 32, 64),
                                   (17, (333,), 4, 96), (257, (2, 5), 2, 256)])
def test_gpu_kernel_against_the_torch_path(dtype, shape):
    """On CUDA: the kernel's error against fp64 at most twice the torch path's plus a unit of the output's last
    place; lse as the torch path's; empty parts and unseen rows included."""
    splits, rows, H, D = shape
    g = torch.Generator(device="cuda").manual_seed(splits)
    o = torch.randn(splits, *rows, H, D, device="cuda", dtype=dtype, generator=g)
    lse_p = torch.randn(splits, *rows, H, device="cuda", generator=g) * 4 + 10
    lse_p.view(splits, -1, H)[: splits // 2, 0, 0] = -math.inf  # half the parts of a row empty
    lse_p.view(splits, -1, H)[:, -1, -1] = math.inf  # a row no part saw
    out, lse = combine.flash_attn_combine(o, lse_p)
    want_out, want_lse = combine.flash_attn_combine(o.cpu(), lse_p.cpu())  # the torch path (CPU, no interpreter)
    ref_out, _ = combine_ref(o.cpu(), lse_p.cpu())
    err = (out.cpu().double() - ref_out).abs().max().item()
    torch_err = (want_out.double() - ref_out).abs().max().item()
    assert err <= 2 * torch_err + ULP[dtype] * ref_out.abs().max().item() + 1e-6
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-5)
    # FA4's lse layout: a transposed view of heads-major storage (a size-1 dim's stride is arbitrary)
    assert ([st for st, n in zip(lse.stride(), lse.shape) if n > 1]
            == [st for st, n in zip(want_lse.stride(), want_lse.shape) if n > 1])
    assert torch.equal(out.reshape(-1, H, D)[-1, -1].cpu(), torch.zeros(D, dtype=dtype))


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("bounds", [[(0, 13), (13, 26), (26, 40)], [(0, 8), (8, 16), (16, 40), (40, 40)],
                                    [(0, 1), (1, 39), (39, 40)]])
def test_split_forward_merge_runs_the_kernel(monkeypatch, sink, bounds):
    """The split forward's merge (launch._combine_splits) runs the kernel where it serves the tensors: the sink
    joins each row's sum once with no value, a part no key of which a row sees (lse +inf) adds nothing, and a row
    no part saw keeps the forward's convention (out 0, lse +inf, or the sink); the same results as the merge's
    torch ops, in fp32 and fp16 outputs."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_cute_split import _parts  # the split kernel's contract in torch

    from flash_attn.cute import launch

    seen = _launches(monkeypatch)
    g = torch.Generator().manual_seed(len(bounds))
    q = torch.randn(2, 44, 4, 16, generator=g)  # causal, 4 more queries than keys: the first 4 rows see none
    k = torch.randn(2, 40, 2, 16, generator=g)
    v = torch.randn(2, 40, 2, 16, generator=g)
    sink_t = torch.randn(4, generator=g) if sink else None
    o_parts, lse_parts = _parts(q, k, v, True, bounds, 0.25)
    o_parts, lse_parts = o_parts.float().to(DEV).contiguous(), lse_parts.float().to(DEV).contiguous()
    sink_d = None if sink_t is None else sink_t.to(DEV)
    for dtype in (torch.float32, torch.float16):
        out, lse = launch._combine_splits(o_parts, lse_parts, sink_d, dtype)
        assert seen and seen[-1] is combine._kernel()
        n = len(seen)
        with monkeypatch.context() as m:
            m.setattr(combine, "use_kernel", lambda *a: False)
            want_out, want_lse = launch._combine_splits(o_parts, lse_parts, sink_d, dtype)
        assert len(seen) == n  # (the torch ops)
        assert out.dtype == dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
        torch.testing.assert_close(out.float(), want_out.float(), rtol=ULP[dtype], atol=2e-6 if dtype == torch.float32
                                   else 1e-3)
        torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)
        if not sink:
            assert torch.isposinf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-side import check")
def test_importing_the_api_imports_no_triton():
    """flash_attn.cute's API modules (interface, launch, combine) import neither Triton nor CuTeDSL: the combine
    kernel's module is imported at its first launch, so a first call that merges nothing never pays Triton's import
    (~0.1-0.3 s)."""
    code = ("import sys, flash_attn.cute.interface, flash_attn.cute.launch, flash_attn.cute.combine; "
            "print([m for m in ('triton', 'cutlass', 'flash_attn.cute._combine_triton') if m in sys.modules])")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, _PKG, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout

