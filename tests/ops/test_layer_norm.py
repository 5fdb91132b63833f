"""flash_attn.ops.triton.layer_norm against an unfused PyTorch reference, on both paths (Triton kernel --
the interpreter on CPU -- and the plain-PyTorch path). Errors are judged relative to PyTorch's own error
at the input dtype (flash_attn.testing.assert_close_to_ref), against an fp64 reference."""
import inspect
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from flash_attn.ops.triton import backend, triton_runs_on
from flash_attn.ops.triton import layer_norm as ln
from flash_attn.ops.triton.layer_norm import LayerNorm, RMSNorm, layer_norm_fn, layer_norm_ref, rms_norm_fn
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _triton_backward(fa_env):
    """These tests are the Triton kernels' (ops/triton/layer_norm.py): the CuTeDSL backward, the default for
    wide rows on sm_90 (tests/cute/test_layer_norm_cute.py), is switched off so that N >= 4096 runs Triton."""
    fa_env(DISABLE="ln_cute_bwd")


def _assert_close(out, ref, pt, name):
    return assert_close_to_ref(out, ref, pt, name=name, fp32_ulps=4)


@pytest.fixture(params=["triton", "torch"])
def path(request):
    if request.param == "triton" and not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    with backend(request.param):
        yield request.param


def _device(path):
    return "cuda" if CUDA and path == "triton" else "cpu"


def _inputs(device, dtype, M, N, residual=False, x1=False, weight1=False, bias=True, rowscale=False,
            weight_dtype=None):
    g = torch.Generator().manual_seed(M * 1000 + N)
    mk = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(device=device, dtype=dt)  # noqa: E731
    wdt = weight_dtype or dtype
    t = dict(x=mk(M, N), weight=1 + 0.5 * mk(N, dt=wdt), bias=mk(N, dt=wdt) if bias else None,
             residual=mk(M, N) if residual else None, x1=mk(M, N) if x1 else None,
             weight1=1 + 0.5 * mk(N, dt=wdt) if weight1 else None, bias1=mk(N, dt=wdt) if weight1 else None,
             rowscale=(torch.rand(M, generator=g) + 0.5).to(device=device, dtype=dtype) if rowscale else None)
    return {k: v.requires_grad_() if v is not None and k != "rowscale" else v for k, v in t.items()}


def _check(device, dtype, M, N, is_rms_norm=False, prenorm=False, dropout_p=0.0, residual_in_fp32=False,
           zero_centered_weight=False, out_dtype=None, eps=1e-6, **which):
    """Forward outputs and all gradients of layer_norm_fn against layer_norm_ref (fp64 and input dtype)."""
    inp = _inputs(device, dtype, M, N, **which)
    want_mask = dropout_p > 0.0
    outs = layer_norm_fn(**inp, eps=eps, dropout_p=dropout_p, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                         zero_centered_weight=zero_centered_weight, is_rms_norm=is_rms_norm,
                         return_dropout_mask=want_mask, out_dtype=out_dtype)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    masks = outs[-2:] if want_mask else [None, None]
    outs = outs[:-2] if want_mask else outs
    if want_mask:
        assert masks[0].dtype == torch.bool and masks[0].shape == inp["x"].shape
        assert (masks[1] is not None) == (inp["x1"] is not None)
        kept = masks[0].float().mean().item()
        # a binomial fraction over n draws: 5 standard deviations (a fixed 0.1 was 2 sigma at 2 x 17
        # elements and failed about one run in twenty)
        n = masks[0].numel()
        assert abs(kept - (1 - dropout_p)) < 5 * math.sqrt(dropout_p * (1 - dropout_p) / n) + 1e-6, kept
    if prenorm:
        res_dtype = inp["residual"].dtype if inp["residual"] is not None else (
            torch.float32 if residual_in_fp32 else dtype)
        assert outs[-1].dtype == res_dtype
    assert outs[0].dtype == (out_dtype or dtype)

    def ref(cast):
        r = {k: (v.detach().to(cast) if cast is not None else v.detach()).requires_grad_(k != "rowscale")
             if v is not None else None for k, v in inp.items()}
        o = layer_norm_ref(**r, eps=eps, dropout_p=dropout_p, prenorm=prenorm, zero_centered_weight=zero_centered_weight,
                           dropout_mask=masks[0], dropout_mask1=masks[1], is_rms_norm=is_rms_norm)
        return r, list(o) if isinstance(o, tuple) else [o]

    r64, o64 = ref(torch.float64)
    rpt, opt = ref(None)
    assert len(outs) == len(o64)
    for i, (o, a, b) in enumerate(zip(outs, o64, opt)):
        _assert_close(o, a, b, name=f"output {i}")
    g = torch.Generator().manual_seed(1)
    gouts = [torch.randn(o.shape, generator=g).to(o.device) for o in outs]
    names = [k for k, v in inp.items() if v is not None and v.requires_grad]
    grads = torch.autograd.grad(outs, [inp[k] for k in names], [go.to(o.dtype) for go, o in zip(gouts, outs)])
    g64 = torch.autograd.grad(o64, [r64[k] for k in names], [go.double() for go in gouts])
    gpt = torch.autograd.grad(opt, [rpt[k] for k in names], [go.to(o.dtype) for go, o in zip(gouts, opt)])
    for k, a, b, c in zip(names, grads, g64, gpt):
        assert a.dtype == inp[k].dtype, k
        _assert_close(a, b, c, name=f"grad {k}")
    return outs, masks


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N", [(3, 1), (1, 1), (1, 17), (3, 4099), (1, 4099)])
def test_plain(path, dtype, M, N, is_rms_norm):
    # At hidden 1 RMSNorm's input gradient is w*dy*eps/(x^2+eps)^1.5: with eps=1e-6 it is pure cancellation
    # noise of the size of one ulp of w*dy, so the 1-column case uses an eps that makes it a real value.
    _check(_device(path), dtype, M, N, is_rms_norm=is_rms_norm, bias=not is_rms_norm, eps=0.1 if N == 1 else 1e-6)


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("residual,residual_in_fp32", [(True, False), (False, True), (False, False)])
def test_residual_prenorm(path, residual, residual_in_fp32, is_rms_norm):
    _check(_device(path), torch.float16, 3, 40, is_rms_norm=is_rms_norm, prenorm=True, residual=residual,
           residual_in_fp32=residual_in_fp32)


def test_residual_without_prenorm(path):
    _check(_device(path), torch.float32, 3, 33, residual=True)


@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_dropout_rowscale_residual(path, is_rms_norm):
    _check(_device(path), torch.float32, 5, 130, is_rms_norm=is_rms_norm, dropout_p=0.3, rowscale=True, residual=True,
           prenorm=True)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_parallel_branch(path, dropout_p):
    _check(_device(path), torch.float16, 3, 70, x1=True, weight1=True, residual=True, prenorm=True, dropout_p=dropout_p)


def test_x1_without_weight1(path):
    _check(_device(path), torch.float32, 2, 17, x1=True, dropout_p=0.1)


def test_weight1_without_x1_rms(path):
    _check(_device(path), torch.float32, 3, 24, weight1=True, is_rms_norm=True)


def test_zero_centered_weight(path):
    _check(_device(path), torch.float32, 3, 19, zero_centered_weight=True, residual=True)


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_centered_weight_with_weight1(path, dtype, is_rms_norm):
    """The parallel branch's weight1 is zero-centred too (y1 = xhat * (1 + weight1) + bias1): forward and both
    branches' gradients, which meet in dx through g = dy * (1 + w) + dy1 * (1 + w1)."""
    _check(_device(path), dtype, 4, 37, zero_centered_weight=True, weight1=True, is_rms_norm=is_rms_norm,
           bias=not is_rms_norm)
    _check(_device(path), dtype, 3, 70, zero_centered_weight=True, x1=True, weight1=True, residual=True,
           prenorm=True, dropout_p=0.2, is_rms_norm=is_rms_norm)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_x1_with_rowscale(path, monkeypatch, dtype, dropout_p):
    """rowscale scales x only: pre = dropout(x * rowscale) + dropout(x1) + residual, so dx carries rowscale
    and dx1 does not. layer_norm_fn refuses rowscale together with x1 (as FA2's does), but the forward and
    backward it calls implement the pair (the kernels' HAS_X1 with HAS_ROWSCALE, and the PyTorch path):
    with the argument check relaxed, both paths must give the documented formula's outputs and gradients."""
    real = ln._check_args

    def check_args(x, weight, bias, residual, x1, weight1, bias1, dropout_p, rowscale, out, residual_out):
        real(x, weight, bias, residual, None, weight1, bias1, dropout_p, rowscale, out, residual_out)
        real(x, weight, bias, residual, x1, weight1, bias1, dropout_p, None, out, residual_out)

    monkeypatch.setattr(ln, "_check_args", check_args)
    dev = _device(path)
    _check(dev, dtype, 5, 33, x1=True, rowscale=True, dropout_p=dropout_p)
    _check(dev, dtype, 4, 40, x1=True, weight1=True, rowscale=True, residual=True, prenorm=True,
           dropout_p=dropout_p, is_rms_norm=True, bias=False)


def test_out_dtype_and_fp32_weights(path):
    _check(_device(path), torch.float16, 3, 21, out_dtype=torch.float32, weight_dtype=torch.float32, residual=True)


def test_hidden_65536(path):
    _check(_device(path), torch.float32, 2, 65536, residual=True, prenorm=True)


def test_row_tiles_and_prefetch(monkeypatch):
    """Narrow rows are batched BLOCK_M to a tile, and the backward prefetches the next tile: lowered
    tile sizes make 2-row tiles; one SM and a high register cap make the 37 rows 7 backward programs of
    6 rows (3 tiles) each but the last, which has a single row in a partial tile."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    monkeypatch.setattr(ln, "FWD_TILE", 64)
    monkeypatch.setattr(ln, "BWD_MIN_TILE", 64)
    monkeypatch.setattr(ln, "BWD_MAXNREG", (255,))
    monkeypatch.setattr(ln, "num_sms", lambda device: 1)
    assert ln._fwd_config(17)[:3] == (2, 32, 1)
    cfg = ln._bwd_config(37, 17, "cpu")
    assert (cfg.programs, cfg.rows_per_program, cfg.block_m, cfg.split, cfg.sub, cfg.prefetch) == (7, 6, 2, 1, 1, True)
    with backend("triton"):
        _check(_device("triton"), torch.float32, 37, 17, residual=True, x1=True, weight1=True, dropout_p=0.25,
               prenorm=True)
        _check(_device("triton"), torch.float32, 37, 17, is_rms_norm=True, rowscale=True, residual=True)


def test_chunked_split_rows(monkeypatch):
    """Wide rows: pass 1 reads them in chunks (7 of 16 columns for 100 columns), and a tight accumulator
    budget splits each row over programs: with dweight and dbias, two programs owning 64 columns each
    (the second only 36 of them) in two pass-2 sub-chunks of 32 with their own accumulators; with the
    parallel branch's two more gradients, four programs of 32 columns."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    monkeypatch.setattr(ln, "FWD_MAX_BLOCK_N", 16)
    monkeypatch.setattr(ln, "FWD_TILE", 64)
    monkeypatch.setattr(ln, "BWD_MIN_TILE", 16)
    monkeypatch.setattr(ln, "BWD_MAX_BLOCK_R", 16)
    monkeypatch.setattr(ln, "BWD_ELEMS_PER_THREAD", 1)
    monkeypatch.setattr(ln, "BWD_ACC_REGS", 8)  # halved with pass-1 chunks: 4 per thread
    monkeypatch.setattr(ln, "num_sms", lambda device: 1)
    cfg = ln._bwd_config(37, 100, "cpu", n_acc=2)
    assert (cfg.block_r, cfg.r_chunks, cfg.block_n, cfg.sub, cfg.split, cfg.prefetch) == (16, 7, 32, 2, 2, False)
    cfg = ln._bwd_config(37, 100, "cpu", n_acc=4)
    assert (cfg.block_n, cfg.sub, cfg.split) == (32, 1, 4)
    with backend("triton"):
        _check(_device("triton"), torch.float32, 37, 100, residual=True, x1=True, weight1=True, dropout_p=0.25,
               prenorm=True)
        _check(_device("triton"), torch.float32, 3, 100, is_rms_norm=True, rowscale=True, zero_centered_weight=True)
        # A single program per row group whose second sub-chunk lies partly past N.
        monkeypatch.setattr(ln, "BWD_ACC_REGS", 16)
        cfg = ln._bwd_config(5, 40, "cpu", n_acc=1)
        assert (cfg.split, cfg.sub, cfg.block_n) == (1, 2, 32)
        _check(_device("triton"), torch.float32, 5, 40, is_rms_norm=True, bias=False)


@pytest.mark.parametrize("pair,hold", [(False, False), (True, False), (False, True), (True, True)])
def test_row_sum_and_hold_variants(monkeypatch, pair, hold):
    """Both formulations of LayerNorm's pass-1 row sums (two reductions, or one of the pair joined) and
    both sources of pass 2 (re-read tile, or pass 1's registers), on multi-row prefetched tiles."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    monkeypatch.setattr(ln, "FWD_TILE", 64)
    monkeypatch.setattr(ln, "BWD_MIN_TILE", 64)
    monkeypatch.setattr(ln, "BWD_MAXNREG", (255,))
    monkeypatch.setattr(ln, "num_sms", lambda device: 1)
    monkeypatch.setattr(ln, "BWD_PAIR_SUM", pair)
    monkeypatch.setattr(ln, "BWD_HOLD", hold)
    monkeypatch.setattr(ln, "BWD_HOLD_MAX_ACC", 4)
    for n_acc in (1, 2):
        cfg = ln._bwd_config(37, 17, "cpu", n_acc)
        assert (cfg.block_m, cfg.prefetch, cfg.pair, cfg.hold) == (2, True, pair, hold)
    with backend("triton"):
        _check(_device("triton"), torch.float32, 37, 17, residual=True, prenorm=True)
        _check(_device("triton"), torch.float16, 37, 17, is_rms_norm=True, bias=False, zero_centered_weight=True)


def test_default_variants_and_tuned_table(monkeypatch):
    """Defaults: the joined row sums everywhere, pass 2 from registers for RMSNorm only (LayerNorm's
    second accumulator would spill at the 64-register cap). BWD_TUNED replaces fields of the plain
    configurations it names (the grid follows: programs per SM, split) and refuses unlaunchable ones."""
    monkeypatch.setattr(ln, "num_sms", lambda device: 1)
    rms, lnorm = ln._bwd_config(64, 2048, "cpu", 1), ln._bwd_config(64, 2048, "cpu", 2)
    assert rms.pair and rms.hold and rms.prefetch
    assert lnorm.pair and not lnorm.hold and lnorm.prefetch
    tuned = ln._bwd_config(64, 1024, "cpu", 2)  # the shipped table: LayerNorm 1024 measured faster so
    assert tuned.hold and tuned.maxnreg == 72
    monkeypatch.setattr(ln, "BWD_TUNED", {(2, 40): dict(block_n=16, sub=2, num_warps=1, per_sm=2, pair=False),
                                          (2, 48): dict(num_warps=32, maxnreg=128)})
    cfg = ln._bwd_config(37, 40, "cpu", 2)
    assert (cfg.block_n, cfg.sub, cfg.split, cfg.num_warps, cfg.pair, cfg.hold) == (16, 2, 2, 1, False, False)
    assert cfg.programs == 2 and cfg.rows_per_program >= 37  # 2 per SM: one row group of two programs
    assert ln._bwd_config(37, 40, "cpu", 1) == ln._bwd_config_cached(
        37, 40, 1, 1, 0, ln.BWD_MIN_TILE, ln.BWD_ELEMS_PER_THREAD, ln.BWD_MAX_BLOCK_R, ln.BWD_ACC_REGS,
        ln.BWD_MAXNREG, ln.BWD_PREFETCH, ln.BWD_PAIR_SUM, ln.BWD_HOLD)  # other n_acc: untouched
    with pytest.raises(ValueError, match="exceed"):
        ln._bwd_config(37, 48, "cpu", 2)
    if triton_runs_on("cuda" if CUDA else "cpu"):
        with backend("triton"):
            _check(_device("triton"), torch.float32, 37, 40)


def test_sweep_script_smoke(capsys):
    """benchmarks/ops/sweep_norm_bwd.py on CPU (interpreter, a tiny size): every candidate it tries is in
    BWD_TUNED's terms, runs, and has its gradient error checked."""
    if not triton_runs_on("cuda" if CUDA else "cpu") or CUDA:
        pytest.skip("CPU interpreter check")
    from benchmarks.ops import sweep_norm_bwd

    sweep_norm_bwd.main(["--cpu-smoke", "--elems", "48", "--hidden", "24", "--only", "plan,pair=0,hold=1 mr72"])
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| LayerNorm") or r.startswith("| RMSNorm")]
    assert len(rows) == 4 and not any("WRONG" in r or "failed" in r for r in rows), rows
    assert "BWD_TUNED[(2, 24)] = {'hold': True, 'maxnreg': 72}" in rows[2]


def test_partial_reduction():
    """The second backward kernel sums the (P, N) partials over P in BLOCK_P steps (here 5, the last
    partial) and column blocks (3, the last partial), casting to the parameters' dtypes."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    dev = _device("triton")
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(37, 20, generator=g).to(dev) for _ in range(4)]
    dtypes = (torch.float32, torch.float16, torch.float32, torch.float32)
    outs = [torch.empty(20, device=dev, dtype=dt) for dt in dtypes]
    ln._ln_bwd_reduce_kernel[(3,)](*parts, *outs, 37, 20, HAS_BIAS=True, HAS_W1=True, HAS_B1=False, BLOCK_P=8,
                                   BLOCK_C=8)
    for i in range(3):
        torch.testing.assert_close(outs[i], parts[i].sum(0).to(outs[i].dtype), rtol=1e-5, atol=1e-5)
    outs[3].fill_(7.0)
    ln._ln_bwd_reduce_kernel[(3,)](*parts, *outs, 37, 20, HAS_BIAS=False, HAS_W1=True, HAS_B1=True, BLOCK_P=8,
                                   BLOCK_C=8)
    torch.testing.assert_close(outs[3], parts[3].sum(0), rtol=1e-5, atol=1e-5)


def test_backward_is_deterministic():
    """Same inputs, bitwise-same gradients: the partials are summed in a fixed order, no atomics."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    inp = _inputs(_device("triton"), torch.float32, 37, 300, residual=True)
    with backend("triton"):
        y = layer_norm_fn(**inp)
        dy = torch.randn_like(y)
        g1 = torch.autograd.grad(y, [inp["x"], inp["weight"], inp["bias"], inp["residual"]], dy, retain_graph=True)
        g2 = torch.autograd.grad(y, [inp["x"], inp["weight"], inp["bias"], inp["residual"]], dy)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_chunked_large_mean(monkeypatch):
    """Chan's merge keeps the variance accurate for rows with mean >> std, where a single-pass
    sum of squares in fp32 loses every digit."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    monkeypatch.setattr(ln, "FWD_MAX_BLOCK_N", 32)
    dev = "cuda" if CUDA else "cpu"
    x = (3000.0 + torch.randn(2, 200, generator=torch.Generator().manual_seed(0))).to(dev)
    w, b = torch.ones(200, device=dev), torch.zeros(200, device=dev)
    with backend("triton"):
        y = layer_norm_fn(x, w, b, eps=1e-6)
    ref = torch.nn.functional.layer_norm(x.double(), (200,), eps=1e-6)
    assert (y.double() - ref).abs().max().item() < 2e-3


def test_dweight_reduced_over_many_rows(path):
    # fp32 with a residual, 4099 columns, on CPU (4 SMs): 2 row groups of 19 rows (the second 18), each
    # split over 2 programs that own 4096 columns and 3 columns.
    if path == "triton" and not CUDA:
        cfg = ln._bwd_config(37, 4099, "cpu", n_acc=2, extra=3)
        assert (cfg.programs, cfg.rows_per_program, cfg.split, cfg.block_n) == (4, 19, 2, 4096)
    _check(_device(path), torch.float32, 37, 4099, residual=True)


def test_paths_agree_on_dropout_mask():
    """Both paths draw the same mask from the same torch seed (one counter-based hash), and the output
    is exactly zero-dropout-compatible: equal masks give equal results."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    res = {}
    for p in ("triton", "torch"):
        inp = _inputs(_device(p), torch.float32, 4, 50, residual=True, x1=True)
        torch.manual_seed(7)
        with backend(p):
            y, m, m1 = layer_norm_fn(**inp, dropout_p=0.4, return_dropout_mask=True)
        res[p] = (y.cpu(), m.cpu(), m1.cpu())
    assert torch.equal(res["triton"][1], res["torch"][1])
    assert torch.equal(res["triton"][2], res["torch"][2])
    assert not torch.equal(res["triton"][1], res["triton"][2])
    torch.testing.assert_close(res["triton"][0], res["torch"][0], atol=1e-5, rtol=1e-5)


def test_dropout_changes_with_seed(path):
    inp = _inputs(_device(path), torch.float32, 4, 64)
    y1, ma, _ = layer_norm_fn(**inp, dropout_p=0.5, return_dropout_mask=True)
    y2, mb, _ = layer_norm_fn(**inp, dropout_p=0.5, return_dropout_mask=True)
    assert not torch.equal(ma, mb)
    assert not torch.equal(y1, y2)


def test_preallocated_outputs(path):
    dev = _device(path)
    inp = _inputs(dev, torch.float32, 3, 20, residual=True)
    out = torch.empty(3, 20, device=dev)
    res_out = torch.empty(3, 20, device=dev)
    with torch.no_grad():
        y, r = layer_norm_fn(**inp, prenorm=True, out=out, residual_out=res_out)
        y_ref, r_ref = layer_norm_ref(**inp, prenorm=True)
    assert y.data_ptr() == out.data_ptr() and r.data_ptr() == res_out.data_ptr()
    torch.testing.assert_close(out, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res_out, r_ref)


def test_batched_shape_and_empty(path):
    dev = _device(path)
    x = torch.randn(2, 3, 16, device=dev, requires_grad=True)
    w = torch.randn(16, device=dev, requires_grad=True)
    y = rms_norm_fn(x, w, None)
    assert y.shape == (2, 3, 16)
    y.sum().backward()
    empty = torch.randn(0, 16, device=dev, requires_grad=True)
    ye = layer_norm_fn(empty, w, None)
    ye.sum().backward()
    assert ye.shape == (0, 16) and empty.grad.shape == (0, 16)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_modules_match_torch(path, cls):
    dev = _device(path)
    torch.manual_seed(0)
    m = cls(48, eps=1e-5, device=dev)
    with torch.no_grad():
        m.weight.normal_()
    ref = (torch.nn.LayerNorm if cls is LayerNorm else torch.nn.RMSNorm)(48, eps=1e-5, device=dev)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 5, 48, device=dev)
    res = torch.randn(2, 5, 48, device=dev)
    y, r = m(x, residual=res, prenorm=True, residual_in_fp32=True)
    torch.testing.assert_close(y, ref(x + res), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r, x + res)
    y.square().sum().backward()
    ref(x + res).square().sum().backward()
    torch.testing.assert_close(m.weight.grad, ref.weight.grad, atol=1e-4, rtol=1e-5)


def test_module_dropout_only_in_training(path):
    dev = _device(path)
    m = LayerNorm(32, dropout_p=0.5, device=dev)
    x = torch.randn(4, 32, device=dev)
    y_train = m(x)
    m.eval()
    y_eval = m(x)
    torch.testing.assert_close(y_eval, torch.nn.functional.layer_norm(x, (32,), m.weight, m.bias, 1e-5))
    assert not torch.allclose(y_train, y_eval)


def test_bad_inputs():
    x = torch.randn(3, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm_fn(x, torch.ones(7), None)
    with pytest.raises(ValueError, match="residual must have the shape"):
        layer_norm_fn(x, w, None, residual=torch.randn(3, 7))
    with pytest.raises(ValueError, match="dropout_p"):
        layer_norm_fn(x, w, None, dropout_p=1.0)
    with pytest.raises(NotImplementedError, match="rowscale"):
        layer_norm_fn(x, w, None, x1=torch.randn(3, 8), rowscale=torch.ones(3))
    with pytest.raises(ValueError, match="bias1 needs weight1"):
        layer_norm_fn(x, w, None, bias1=w)
    with pytest.raises(TypeError, match="floating-point"):
        layer_norm_fn(torch.ones(3, 8, dtype=torch.int64), w, None)
    with pytest.raises(ValueError, match="at most 65536"):
        layer_norm_fn(torch.randn(1, 65537), torch.ones(65537), None)
    with pytest.raises(ValueError, match="unknown flash_attn backend .cuda."):
        with backend("cuda"):
            pass


def test_compile_fullgraph(path):
    dev = _device(path)
    inp = _inputs(dev, torch.float32, 3, 24, residual=True)
    fn = lambda x, w, b, r: layer_norm_fn(x, w, b, residual=r, prenorm=True)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    args = (inp["x"], inp["weight"], inp["bias"], inp["residual"])
    y, r = compiled(*args)
    y_e, r_e = fn(*args)
    torch.testing.assert_close(y, y_e)
    torch.testing.assert_close(r, r_e)
    gc = torch.autograd.grad((y * r).sum(), args)
    ge = torch.autograd.grad((y_e * r_e).sum(), args)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_ops_import_and_run_without_triton():
    """A CPU-only install without triton imports every fused-op module and runs its PyTorch path."""
    code = r"""
import sys
sys.modules["triton"] = None  # any 'import triton' now raises ImportError
import torch
import torch.nn.functional as F
from flash_attn.ops.triton import HAS_TRITON, use_triton
from flash_attn.ops.triton.layer_norm import layer_norm_fn
from flash_attn.layers.rotary import apply_rotary_emb
from flash_attn.losses.cross_entropy import CrossEntropyLoss
from flash_attn.ops.activations import bias_act
assert not HAS_TRITON and not use_triton(torch.zeros(1))
x = torch.randn(4, 16, requires_grad=True)
w, b = torch.ones(16), torch.zeros(16)
y = layer_norm_fn(x, w, b)
torch.testing.assert_close(y, F.layer_norm(x, (16,), w, b, 1e-6))
y.sum().backward()
q = torch.randn(1, 3, 2, 8)
cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
torch.testing.assert_close(apply_rotary_emb(q, cos, sin), q)
logits, labels = torch.randn(4, 10), torch.randint(0, 10, (4,))
torch.testing.assert_close(CrossEntropyLoss()(logits, labels), F.cross_entropy(logits, labels))
torch.testing.assert_close(bias_act(x, None, "relu"), F.relu(x))
print("ok")
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_backward_compiles_for_sm90_without_spills():
    """The backward as configured for an H200 compiles for sm_90 ahead of time (no GPU), and the plain bf16
    configurations up to 8192 columns fit their register cap without spilling (benchmarks/ops/bench_ops.py --aot)."""
    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-m", "benchmarks.ops.bench_ops", "--aot", "--hidden",
                        "1024,8192"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and "needs cuobjdump" in r.stderr + r.stdout:
        pytest.skip("cuobjdump not available")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| LayerNorm")
            or line.startswith("| RMSNorm")]
    assert len(rows) == 2 * 5 * 3  # norms x feature sets x (1024, 8192, 65536)
    for norm, feat, hidden, *_, maxnreg, regs, spill, _shared in rows:
        assert int(regs) <= int(maxnreg)
        n_acc = 2 if norm.strip() == "LayerNorm" else 1
        # BWD_TUNED holds configurations measured fastest on the GPU, spill or not
        if feat.strip() == "plain" and int(hidden) <= 8192 and (n_acc, int(hidden)) not in ln.BWD_TUNED:
            assert int(spill) == 0, (norm, hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("N", [1024, 4099, 8192, 16384, 65536])
def test_gpu_bf16(is_rms_norm, N):
    with backend("triton"):
        _check(_device("triton"), torch.bfloat16, 64, N, is_rms_norm=is_rms_norm, residual=True, prenorm=True,
               weight_dtype=torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("M,N", [(3000, 1024), (1000, 4096), (300, 8192), (300, 16384), (1, 16384), (20, 65536)])
def test_gpu_bf16_plain(is_rms_norm, M, N):
    # The benchmarked configurations (no residual, bf16 everywhere): several rows per persistent program,
    # prefetch up to 8192 columns, sub-chunks at 16384, split rows at 65536.
    with backend("triton"):
        _check(_device("triton"), torch.bfloat16, M, N, is_rms_norm=is_rms_norm, bias=not is_rms_norm)


@pytest.mark.gpu
def test_gpu_bf16_dropout_parallel():
    with backend("triton"):
        _check(_device("triton"), torch.bfloat16, 257, 2048, x1=True, weight1=True, residual=True, prenorm=True,
               dropout_p=0.1, residual_in_fp32=True)


@pytest.mark.gpu
def test_gpu_torch_path_on_cuda():
    with backend("torch"):
        _check("cuda", torch.bfloat16, 16, 1000, residual=True, prenorm=True, dropout_p=0.1)


# ------------------------------------------------------------------------------- launches (host side)
class _FakeCompiled:
    function = 1
    packed_metadata = ()

    def __init__(self, log, name):
        self.run = lambda *a: log.append((name, "fast", a))


class _FakeKernel:
    """Stands in for one of the norm kernels behind a Launcher on CPU: the real parameter list (so the
    launcher learns the real argument layout), launches recorded instead of run."""

    def __init__(self, kernel, log, name):
        from triton.runtime.jit import JITFunction

        params = getattr(kernel, "params", None)  # the interpreter's kernels have none: parse the function
        if params is None:
            src = inspect.getsource(kernel.fn)
            dns = ["seed0", "seed1"] if "do_not_specialize" in src.split("def ", 1)[0] else None
            params = JITFunction(kernel.fn, do_not_specialize=dns).params
        self.params, self.device_caches, self.pre_run_hooks = params, {}, []
        self.log, self.name = log, name

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append((self.name, "slow", args, meta))
            return _FakeCompiled(self.log, self.name)
        return launch


@pytest.fixture
def fake_launches(monkeypatch):
    """The norm launches go through Launchers over fake kernels (on CPU tensors): returns the log."""
    _launch = pytest.importorskip("flash_attn.triton._launch")
    pytest.importorskip("triton")
    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(_launch, "_current_stream", lambda device: 0)
    monkeypatch.setattr(ln, "use_triton", lambda x: True)
    log = []
    for attr, kernel, name in (("_L_FWD", ln._ln_fwd_kernel, "fwd"), ("_L_BWD", ln._ln_bwd_kernel, "bwd"),
                               ("_L_REDUCE", ln._ln_bwd_reduce_kernel, "reduce")):
        launcher = _launch.Launcher(_FakeKernel(kernel, log, name))
        if not launcher.enabled:
            pytest.skip("this Triton has no knobs/driver internals: the fast path is off")
        monkeypatch.setattr(ln, attr, launcher)
    return log


def _fwd_bwd(M=5, N=48, **kw):
    inp = _inputs("cpu", torch.float32, M, N, **{k: kw.pop(k) for k in ("residual", "x1", "weight1", "bias")
                                                 if k in kw})
    outs = layer_norm_fn(**inp, **kw)
    y = outs[0] if isinstance(outs, tuple) else outs
    params = [v for k, v in inp.items() if v is not None and k != "rowscale"]
    torch.autograd.grad(y, params, torch.ones_like(y), allow_unused=True)


def test_launch_plans_and_fast_relaunch(fake_launches, monkeypatch):
    """Each launch's plan determines all constexprs and launch options (the launcher caches on it); the
    second call of a kind relaunches the compiled kernels with None for the absent tensors; dropout seeds
    are runtime arguments (a new seed is no new kernel); other flags or knobs are other plans."""
    log = fake_launches
    _fwd_bwd(residual=True, prenorm=True)
    assert [(name, kind) for name, kind, *_ in log] == [("fwd", "slow"), ("bwd", "slow"), ("reduce", "slow")]
    for name, _, args, meta in log:
        kernel = {"fwd": ln._L_FWD, "bwd": ln._L_BWD, "reduce": ln._L_REDUCE}[name].kernel
        constexprs = {p.name for p in kernel.params if p.is_constexpr}
        assert constexprs <= set(meta) and "num_warps" in meta, name
        assert (name != "bwd") or "maxnreg" in meta
    fwd_args = log[0][2]
    assert fwd_args[1] is None and fwd_args[2] is not None  # no x1; the residual
    del log[:]
    _fwd_bwd(residual=True, prenorm=True)
    assert [(name, kind) for name, kind, *_ in log] == [("fwd", "fast"), ("bwd", "fast"), ("reduce", "fast")]
    # run(grid 3, stream, function, packed metadata, launch metadata and hooks, then the arguments)
    fast_fwd = log[0][2][9:]
    assert fast_fwd[1] is None and isinstance(fast_fwd[0], int) and isinstance(fast_fwd[2], int)
    assert fast_fwd[9] is None  # no y1
    for kw in (dict(), dict(residual=True, x1=True, weight1=True), dict(is_rms_norm=True, bias=False),
               dict(dropout_p=0.1)):
        del log[:]
        _fwd_bwd(**kw)
        _fwd_bwd(**kw)
        kinds = [(name, kind) for name, kind, *_ in log]
        # (the reduction's plan may be an earlier one's: it has fewer flags)
        assert kinds[:2] == [("fwd", "slow"), ("bwd", "slow")] and kinds[2][0] == "reduce", kw
        assert kinds[3:] == [("fwd", "fast"), ("bwd", "fast"), ("reduce", "fast")], kw
    # a changed knob: another config, so another plan, whose first launch takes Triton's path
    del log[:]
    tile = ln.FWD_TILE
    _fwd_bwd(M=64, N=16)
    monkeypatch.setattr(ln, "FWD_TILE", tile // 2)
    _fwd_bwd(M=64, N=16)
    monkeypatch.setattr(ln, "FWD_TILE", tile)
    _fwd_bwd(M=64, N=16)
    assert [kind for name, kind, *_ in log if name == "fwd"] == ["slow", "slow", "fast"]


def test_backward_plan_does_not_depend_on_the_row_count():
    # grid size and rows per program are runtime values: another row count, the same plan (and kernel)
    a, b = ln._bwd_config(1000, 256, "cpu", 2), ln._bwd_config(5003, 256, "cpu", 2)
    assert (a.programs, a.rows_per_program) != (b.programs, b.rows_per_program) and a[2:] == b[2:]
    flags = (False, True, False, False, False, False, False, False, False, False)
    assert ln._bwd_plan(*flags, *a[2:])[0] is ln._bwd_plan(*flags, *b[2:])[0]


def test_configs_follow_knobs(monkeypatch):
    """The launch configurations are cached per shape, with the knobs (and the SM count) in the key:
    changing a knob changes the next call's configuration."""
    base = ln._bwd_config(4096, 4096, "cpu", 2)
    assert ln._bwd_config(4096, 4096, "cpu", 2) is base  # cached
    monkeypatch.setattr(ln, "BWD_MAXNREG", (255,))
    assert ln._bwd_config(4096, 4096, "cpu", 2).maxnreg == 255
    monkeypatch.setattr(ln, "num_sms", lambda device: 1)
    assert ln._bwd_config(4096, 4096, "cpu", 2).programs < base.programs
    fwd = ln._fwd_config(4096)
    monkeypatch.setattr(ln, "FWD_MAX_BLOCK_N", 1024)
    assert ln._fwd_config(4096) != fwd and ln._fwd_config(4096)[1] == 1024


def test_num_sms_cached_per_device(monkeypatch):
    import types

    import flash_attn.ops.triton as ops_triton

    calls = []
    monkeypatch.setattr(ops_triton, "_SM_COUNTS", {})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: calls.append(i) or types.SimpleNamespace(multi_processor_count=100 + i))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert ops_triton.num_sms("cpu") == 4 and ops_triton.num_sms(torch.device("cpu")) == 4
    assert ops_triton.num_sms(torch.device("cuda", 0)) == 100
    assert ops_triton.num_sms("cuda:0") == 100 and ops_triton.num_sms(torch.device("cuda", 0)) == 100
    assert ops_triton.num_sms("cuda") == 101  # the current device's
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert ops_triton.num_sms("cuda") == 100
    assert calls == [0, 1]
    assert isinstance(ops_triton.device_ctx(torch.zeros(1)), type(ops_triton._NO_CTX))


@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_linear_fn_matches_norm_then_linear(is_rms_norm, prenorm, residual):
    """FA2's layer_norm_linear_fn: the values and gradients of layer_norm_fn followed by F.linear (its backward
    recomputes the normalised rows), the pre-norm sum too with prenorm, gradients in the inputs' dtypes."""
    from flash_attn import use_backend
    from flash_attn.ops.triton.layer_norm import layer_norm_linear_fn

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    r = torch.randn(3, 5, 16, generator=g, requires_grad=True) if residual else None
    w = torch.randn(16, generator=g, requires_grad=True)
    b = None if is_rms_norm else torch.randn(16, generator=g, requires_grad=True)
    lw, lb = torch.randn(8, 16, generator=g, requires_grad=True), torch.randn(8, generator=g, requires_grad=True)
    params = [t for t in (x, r, w, b, lw, lb) if t is not None]

    def loss(out):
        o, pre = out if prenorm else (out, None)
        return o.square().sum() + (0.5 * pre.sum() if prenorm else 0), o

    with use_backend("torch"):
        got, o1 = loss(layer_norm_linear_fn(x, w, b, lw, lb, residual=r, prenorm=prenorm, is_rms_norm=is_rms_norm))
        y = layer_norm_fn(x, w, b, residual=r, prenorm=prenorm, is_rms_norm=is_rms_norm)
        want, o2 = loss((F.linear(y[0], lw, lb), y[1]) if prenorm else F.linear(y, lw, lb))
    torch.testing.assert_close(o1, o2)
    for a, e in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)


def test_the_backend_switch_steers_the_fused_ops(fa_env):
    """flash_attn.use_backend / FLASH_ATTN_BACKEND pick the ops' path as they pick attention's: "torch" the PyTorch
    one, "triton" the Triton one (an error where it cannot run), nothing forced: by device."""
    import flash_attn
    from flash_attn.ops.triton import use_triton

    x = torch.zeros(2, 8)
    auto = triton_runs_on(x.device)
    assert use_triton(x) is auto
    with flash_attn.use_backend("torch"):
        assert use_triton(x) is False
    fa_env(BACKEND="torch")
    assert use_triton(x) is False
    fa_env(BACKEND=None)
    with flash_attn.use_backend("triton"):
        if auto:
            assert use_triton(x) is True
        else:
            with pytest.raises(RuntimeError, match="backend 'triton' was forced"):
                use_triton(x)
