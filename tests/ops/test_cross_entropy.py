"""flash_attn.losses.cross_entropy / flash_attn.ops.triton.cross_entropy against F.cross_entropy (plus the
z-loss), on the Triton path (interpreter on CPU) and the plain-PyTorch path; vocab split over 2 gloo
processes."""
import os
import re

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from flash_attn.losses.cross_entropy import CrossEntropyLoss
from flash_attn.ops.triton import backend, triton_runs_on
from flash_attn.ops.triton import cross_entropy as ce
from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()


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


def ce_ref(logits, labels, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0, ignore_index=-100):
    """Per-row (loss + z-loss, z-loss) by F.cross_entropy at the logits' dtype."""
    z = logits * logit_scale
    loss = F.cross_entropy(z, labels, label_smoothing=smoothing, ignore_index=ignore_index, reduction="none")
    valid = labels != ignore_index
    z_loss = torch.where(valid, lse_square_scale * torch.logsumexp(z, dim=-1).square(), 0.0)
    return loss + z_loss, z_loss


def _data(device, dtype, n_rows, vocab, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n_rows, vocab, generator=g)).to(device, dtype)
    labels = torch.randint(0, vocab, (n_rows,), generator=g)
    if ignore and n_rows > 1:
        labels[1] = -100
    return logits, labels.to(device)


def _check(logits, labels, **kw):
    """losses, z_losses and d(losses)/d(logits) against ce_ref in fp64 and in the logits' dtype."""
    x = logits.detach().clone().requires_grad_()
    loss, z_loss = cross_entropy_loss(x, labels, **{k.replace("smoothing", "label_smoothing"): v for k, v in kw.items()})
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    x64 = logits.detach().double().requires_grad_()
    xpt = logits.detach().clone().requires_grad_()
    l64, z64 = ce_ref(x64, labels, **kw)
    lpt, zpt = ce_ref(xpt, labels, **kw)
    _assert_close(loss, l64, lpt, name="loss")
    _assert_close(z_loss, z64, zpt, name="z_loss")
    g = torch.rand(labels.shape, generator=torch.Generator().manual_seed(5)).to(logits.device)
    (dx,) = torch.autograd.grad(loss, x, g)
    (d64,) = torch.autograd.grad(l64, x64, g.double())
    (dpt,) = torch.autograd.grad(lpt, xpt, g.to(logits.dtype))
    assert dx.dtype == logits.dtype
    _assert_close(dx, d64, dpt, name="dlogits")


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_rows,vocab", [(1, 2), (3, 17), (4, 4099)])
def test_loss_and_grad(path, n_rows, vocab, dtype, smoothing):
    logits, labels = _data(_device(path), dtype, n_rows, vocab)
    _check(logits, labels, smoothing=smoothing)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_single_class(path, smoothing):
    """One class: loss and gradient are 0 up to fp32 rounding of their terms (lse = z, probability 1)."""
    x = torch.randn(3, 1, device=_device(path), requires_grad=True)
    loss, _ = cross_entropy_loss(x, torch.zeros(3, dtype=torch.long, device=x.device), label_smoothing=smoothing)
    eps = torch.finfo(torch.float32).eps
    assert (loss.abs() <= 4 * eps * x.detach()[:, 0].abs()).all(), loss
    (g,) = torch.autograd.grad(loss.sum(), x)
    assert g.abs().max().item() <= 2 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_logit_scale_and_z_loss(path, smoothing):
    logits, labels = _data(_device(path), torch.float32, 5, 300, seed=1)
    _check(logits, labels, smoothing=smoothing, logit_scale=0.7, lse_square_scale=1e-2, ignore_index=-100)


def test_custom_ignore_index(path):
    logits, labels = _data(_device(path), torch.float32, 4, 50, seed=2, ignore=False)
    labels[2] = 7
    _check(logits, labels, ignore_index=7, lse_square_scale=1e-3)


def test_vocab_split_into_programs(monkeypatch):
    """Few rows with a long vocab: each row is streamed by several programs (6 splits of 3 blocks here,
    with the limits lowered) whose partial (max, sum) pairs are merged."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    monkeypatch.setattr(ce, "FWD_BLOCK", 64)
    monkeypatch.setattr(ce, "MIN_SPLIT_COLS", 128)
    if not CUDA:
        assert ce._num_splits(3, 1000, "cpu") == 6
    with backend("triton"):
        logits, labels = _data(_device("triton"), torch.float32, 3, 1000, seed=3)
        _check(logits, labels, smoothing=0.1, lse_square_scale=1e-2)


def test_vec_align():
    """Rows of a padded GPT-2 vocab (50264 = 8 * 6283 bf16) load as 16-byte vectors; the real vocab
    (50257) and a stride that is not a multiple of 8 fall back to narrower accesses."""
    from flash_attn.ops.triton import vec_align
    assert vec_align(2, 50264, 50264) == 8
    assert vec_align(2, 50257, 50264) == 1
    assert vec_align(2, 50264, 50268) == 4
    assert vec_align(4, 50264, 50264) == 4
    assert vec_align(1, 48) == 16


def test_override_knobs(fa_env):
    """FLASH_ATTN_OVERRIDES' ce. items set a kernel module's constants by their defaults' types; a misspelt name
    raises (a typo never silently measures the default)."""
    from flash_attn import settings

    ns = {"BLOCK": 8, "LAYOUT": "row", "FAST": True}
    fa_env(OVERRIDES="ce.BLOCK=64, ce.LAYOUT=flat,ce.FAST=0")
    settings.apply_knobs("ce", ns)
    assert ns == {"BLOCK": 64, "LAYOUT": "flat", "FAST": False}
    fa_env(OVERRIDES="ce.BLOK=64")
    with pytest.raises(ValueError, match="BLOK"):
        settings.apply_knobs("ce", ns)
    with pytest.raises(ValueError, match="FLASH_ATTN_OVERRIDES"):
        fa_env(OVERRIDES="xe.BLOCK=64")


@pytest.mark.parametrize("inplace", [False, True])
def test_strided_rows_multiple_of_8(path, inplace):
    """A (6, 1000) fp16 view of (6, 1008) rows: length and stride multiples of 8 (vector loads and
    stores), the gradient written with the view's stride and the padding columns left alone."""
    dev = _device(path)
    g = torch.Generator().manual_seed(21)
    buf = (3 * torch.randn(6, 1008, generator=g)).to(dev, torch.float16)
    labels = torch.randint(0, 1000, (6,), generator=g).to(dev)
    labels[2] = -100
    x = buf.clone().requires_grad_()
    view = x * 1.0 if inplace else x
    loss, _ = cross_entropy_loss(view[:, :1000], labels, label_smoothing=0.1, inplace_backward=inplace)
    w = torch.rand(6, generator=g).to(dev)
    (dbuf,) = torch.autograd.grad(loss, x, w)
    x64 = buf[:, :1000].double().requires_grad_()
    xpt = buf[:, :1000].clone().requires_grad_()
    l64, _ = ce_ref(x64, labels, smoothing=0.1)
    lpt, _ = ce_ref(xpt, labels, smoothing=0.1)
    _assert_close(loss, l64, lpt, name="loss")
    (d64,) = torch.autograd.grad(l64, x64, w.double())
    (dpt,) = torch.autograd.grad(lpt, xpt, w.half())
    _assert_close(dbuf[:, :1000], d64, dpt, name="dlogits")
    assert not dbuf[:, 1000:].any()


@pytest.mark.parametrize("smoothing,inplace", [(0.0, False), (0.1, True)])
def test_flat_backward_layout(monkeypatch, smoothing, inplace):
    """BWD_LAYOUT="flat": 64-element blocks over contiguous (7, 100) logits straddle rows; labels in
    the first and last columns and an ignored row must give the row layout's gradient exactly."""
    if not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    dev = _device("triton")
    logits, labels = _data(dev, torch.float32, 7, 100, seed=22)
    labels[0], labels[3], labels[6] = 0, 99, 99
    w = torch.rand(7, generator=torch.Generator().manual_seed(23)).to(dev)

    def grad():
        x = logits.clone().requires_grad_()
        y = x * 1.0
        loss, _ = cross_entropy_loss(y, labels, label_smoothing=smoothing, logit_scale=0.7, lse_square_scale=1e-3,
                                     inplace_backward=inplace)
        return torch.autograd.grad(loss, y, w)[0]

    monkeypatch.setattr(ce, "BWD_BLOCK", 64)
    with backend("triton"):
        row = grad()
        monkeypatch.setattr(ce, "BWD_LAYOUT", "flat")
        flat = grad()
    assert torch.equal(flat, row)
    assert not flat[1].any()


_PTX_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from flash_attn.ops.triton import cross_entropy as ce, vec_align

def ptx(kernel, ptrs, ints, constexprs, num_warps):
    # Triton's own specialisation: pointers 16-byte aligned, ints marked divisible by 16 where they are.
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps})
    sig, attrs, consts = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", constexprs[p.name]
        elif p.name in ptrs:
            sig[p.name], attrs[(i,)] = ptrs[p.name], [["tt.divisibility", 16]]
        elif p.name in ("logit_scale", "smoothing", "lse_square_scale"):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
            if ints[p.name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    text = triton.compile(src, target=target, options=opts.__dict__).asm["ptx"]
    return {"v4": len(re.findall(r"[ls][dt]\.global(\.\w+)*\.v4\.b32", text)),
            "b16": len(re.findall(r"[ls][dt]\.global(\.\w+)*\.b16", text))}

n_rows, n_cols = 16384, 50264
vec = int(sys.argv[1]) if len(sys.argv) > 1 else vec_align(2, n_cols, n_cols)
bwd_ptrs = {"DLOGITS": "*bf16", "LOGITS": "*bf16", "DLOSS": "*fp32", "LSE": "*fp32", "LABELS": "*i64"}
scalars = {"ignore_index": -100, "total_classes": n_cols, "class_start": 0, "stride_dloss": 0}
out = {
    "partial": ptx(ce._ce_partial_kernel, {"LOGITS": "*bf16", "PART_M": "*fp32", "PART_S": "*fp32", "PART_Z": "*fp32"},
                   {"n_cols_v": n_cols // vec, "stride_row_v": n_cols // vec, "cols_per_split": 57344, "n_splits": 1},
                   {"HAS_SMOOTHING": False, "BLOCK": ce.FWD_BLOCK, "VEC": vec, "STAGES": 1}, ce.FWD_WARPS),
    "bwd": ptx(ce._ce_bwd_kernel, bwd_ptrs, {"n_cols_v": n_cols // vec, "stride_row_v": n_cols // vec,
               "stride_drow_v": n_cols // vec, **scalars}, {"HAS_SMOOTHING": False, "BLOCK": ce.BWD_BLOCK, "VEC": vec},
               ce.BWD_WARPS),
    "bwd_flat": ptx(ce._ce_bwd_flat_kernel, bwd_ptrs, {"n_rows": n_rows, "n_cols": n_cols,
                    "n_elems_v": n_rows * n_cols // vec, **scalars}, {"HAS_SMOOTHING": False, "BLOCK": 8192, "VEC": vec}, 8),
}
print(json.dumps(out))
"""


def _ptx_access_counts(*argv):
    """Run _PTX_SCRIPT in a fresh process: the interpreter that the other tests run patches
    triton.language for good, and the compiler needs it unpatched."""
    import json
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                           os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, *argv], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and _toolchain_missing(r.stderr):
        pytest.skip(f"cannot compile for sm_90 here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# The exception (the last line of the child's traceback) when this Triton cannot compile for sm_90 at all: no
# ptxas binary (Triton's NVIDIA backend ships one; a stripped install or a bad TRITON_PTXAS_PATH has none), a
# Triton without the NVIDIA backend, or one older than the GPUTarget / make_backend API. Anything else,
# e.g. the backend rejecting a launch config of these kernels (an illegal num_warps raises an AssertionError
# inside triton/backends/nvidia/compiler.py), is a failure of the test, not a reason to skip it.
_TOOLCHAIN_MISSING = (
    re.compile(r"^RuntimeError: Cannot find ptxas\b"),
    re.compile(r"^RuntimeError: 0 compatible backends for target \(cuda\)"),
    re.compile(r"^(ImportError|ModuleNotFoundError): cannot import name 'GPUTarget'"),
    re.compile(r"^ModuleNotFoundError: No module named 'triton\.backends(\.nvidia|\.compiler)?'"),
    re.compile(r"^AttributeError: module 'triton\.compiler' has no attribute 'make_backend'"),
)


def _toolchain_missing(stderr):
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return bool(lines) and any(p.search(lines[-1]) for p in _TOOLCHAIN_MISSING)


def test_compile_check_skips_only_for_a_missing_toolchain():
    nvidia = '  File "/site-packages/triton/backends/nvidia/compiler.py", line 164, in __post_init__\n'
    assert _toolchain_missing(f"Traceback (most recent call last):\n{nvidia}RuntimeError: Cannot find ptxas\n")
    assert _toolchain_missing("ImportError: cannot import name 'GPUTarget' from 'triton.backends.compiler'")
    assert _toolchain_missing("RuntimeError: 0 compatible backends for target (cuda) ([]). There should only be one.")
    # a failure inside the NVIDIA backend caused by the kernels or their launch config
    assert not _toolchain_missing(f"Traceback (most recent call last):\n{nvidia}"
                                  "    assert self.num_warps > 0 and (self.num_warps & (self.num_warps - 1)) == 0\n"
                                  "AssertionError: num_warps must be a power of 2\n")
    assert not _toolchain_missing(f"{nvidia}RuntimeError: PassManager::run failed\n")
    assert not _toolchain_missing(f"{nvidia}triton.runtime.errors.PTXASError: PTXAS error: Internal Triton PTX "
                                  "codegen error\n`ptxas` stderr:\nptxas fatal   : Unresolved extern function\n")


def test_padded_gpt2_vocab_compiles_to_vector_accesses():
    """The kernels at the GPT-2 training shape ((16384, 50264) bf16 logits, row stride 50264, not a
    multiple of 16) as the launchers pass it, compiled for sm_90: 16-byte loads and stores, no 2-byte
    ones. Without VEC (the second call) the row kernels' accesses are all scalar, as they were when the CE
    ran at about half of HBM bandwidth (the flat layout's addresses do not depend on the row stride)."""
    for name, c in _ptx_access_counts().items():
        assert c["v4"] > 0 and c["b16"] == 0, (name, c)
    for name, c in _ptx_access_counts("1").items():
        if name != "bwd_flat":
            assert c["v4"] == 0 and c["b16"] > 0, (name, c)


def test_torch_path_row_chunks(monkeypatch):
    monkeypatch.setattr(ce, "TORCH_CHUNK_ELEMS", 100)  # 2 rows of 50 per chunk, 3 chunks
    with backend("torch"):
        logits, labels = _data("cpu", torch.float32, 5, 50, seed=4)
        _check(logits, labels, smoothing=0.1, lse_square_scale=1e-2)


def test_vocab_256k(path):
    logits, labels = _data(_device(path), torch.float16, 2, 256 * 1024, seed=6, ignore=False)
    _check(logits, labels, smoothing=0.1)


def test_masked_vocab_minus_inf(path, monkeypatch):
    """Rows with -inf logits (masked-out vocab entries, here a whole block of one split) stay finite."""
    monkeypatch.setattr(ce, "FWD_BLOCK", 64)
    monkeypatch.setattr(ce, "MIN_SPLIT_COLS", 128)
    logits, labels = _data(_device(path), torch.float32, 3, 600, seed=7, ignore=False)
    logits[:, :200] = float("-inf")
    labels[:] = torch.tensor([300, 599, 450])
    x = logits.clone().requires_grad_()
    loss, _ = cross_entropy_loss(x, labels)
    (dx,) = torch.autograd.grad(loss.sum(), x)
    xr = logits.clone().requires_grad_()
    ref = F.cross_entropy(xr, labels, reduction="none")
    (dr,) = torch.autograd.grad(ref.sum(), xr)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, dr, atol=1e-6, rtol=1e-5)


def test_inplace_backward(path):
    logits, labels = _data(_device(path), torch.float32, 4, 100, seed=8)
    expect_x = logits.clone().requires_grad_()
    F.cross_entropy(expect_x, labels, reduction="sum").backward()
    x = logits.clone().requires_grad_()
    y = x * 1.0  # the tensor whose storage receives the gradient
    loss, _ = cross_entropy_loss(y, labels, inplace_backward=True)
    ptr = y.data_ptr()
    (dy,) = torch.autograd.grad(loss.sum(), y)
    assert dy.data_ptr() == ptr
    torch.testing.assert_close(dy, expect_x.grad, atol=1e-6, rtol=1e-5)


def test_precomputed_lse(path):
    logits, labels = _data(_device(path), torch.float32, 4, 77, seed=9)
    lse = torch.logsumexp(logits, dim=-1)
    x = logits.clone().requires_grad_()
    loss, _ = cross_entropy_loss(x, labels, precomputed_lse=lse, lse_square_scale=1e-2)
    ref, _ = ce_ref(logits, labels, lse_square_scale=1e-2)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    # a wrong lse is really used (not recomputed)
    loss_off, _ = cross_entropy_loss(logits, labels, precomputed_lse=lse + 1.0)
    valid = labels != -100
    torch.testing.assert_close(loss_off[valid], ce_ref(logits, labels)[0][valid] + 1.0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_module_reductions(path, reduction):
    logits, labels = _data(_device(path), torch.float32, 6, 40, seed=10)
    m = CrossEntropyLoss(reduction=reduction, lse_square_scale=1e-2, return_z_loss=True)
    x = logits.clone().requires_grad_()
    loss, z = m(x, labels)
    per, per_z = ce_ref(logits, labels, lse_square_scale=1e-2)
    n = (labels != -100).sum()
    red = {"mean": lambda t: t.sum() / n, "sum": lambda t: t.sum(), "none": lambda t: t}[reduction]
    torch.testing.assert_close(loss, red(per), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z, red(per_z), atol=1e-6, rtol=1e-5)
    assert not z.requires_grad
    if reduction == "mean":
        xr = logits.clone().requires_grad_()
        (red(ce_ref(xr, labels, lse_square_scale=1e-2)[0])).backward()
        loss.backward()
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-6, rtol=1e-5)


def test_bad_inputs():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        cross_entropy_loss(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        cross_entropy_loss(logits, torch.zeros(3))
    with pytest.raises(ValueError, match="logits must be"):
        cross_entropy_loss(torch.randn(3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy_loss(logits, torch.zeros(3, dtype=torch.long), label_smoothing=1.0)
    with pytest.raises(NotImplementedError, match="precomputed_lse"):
        cross_entropy_loss(logits, torch.zeros(3, dtype=torch.long), precomputed_lse=torch.zeros(3),
                           label_smoothing=0.1)
    with pytest.raises(NotImplementedError, match="reduction"):
        CrossEntropyLoss(reduction="avg")


def test_compile_fullgraph(path):
    logits, labels = _data(_device(path), torch.float32, 4, 33, seed=11)
    m = CrossEntropyLoss(label_smoothing=0.1)
    x = logits.clone().requires_grad_()
    loss = torch.compile(m, fullgraph=True, backend="aot_eager")(x, labels)
    (g,) = torch.autograd.grad(loss, x)
    x2 = logits.clone().requires_grad_()
    loss2 = m(x2, labels)
    (g2,) = torch.autograd.grad(loss2, x2)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(g, g2)


def _tp_worker(rank, world, out_dir):
    import torch.distributed as dist

    from flash_attn.ops.triton import backend as _backend

    # A file store, not a TCP port: no race with other processes for a free port.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator().manual_seed(0)
        logits = 3 * torch.randn(5, 2 * 37, generator=g)
        labels = torch.randint(0, 2 * 37, (5,), generator=g)
        labels[1] = -100
        labels[2], labels[3] = 3, 40  # one label on each rank's shard
        shard = logits[:, rank * 37:(rank + 1) * 37]
        out = {}
        for name in ("torch", "triton"):
            if name == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
                continue
            with _backend(name):
                x = shard.clone().requires_grad_()
                loss, z = cross_entropy_loss(x, labels, label_smoothing=0.1, lse_square_scale=1e-2,
                                             process_group=dist.group.WORLD)
                (dx,) = torch.autograd.grad(loss.sum(), x)
            out[name] = (loss.detach(), z, dx)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_two_processes(tmp_path):
    """Vocab split over 2 gloo ranks (each holds half the logits): every rank gets the full-vocab losses,
    and its gradient shard equals the matching columns of the full gradient."""
    mp.start_processes(_tp_worker, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(5, 74, generator=g)
    labels = torch.randint(0, 74, (5,), generator=g)
    labels[1] = -100
    labels[2], labels[3] = 3, 40
    x = logits.clone().requires_grad_()
    ref, ref_z = ce_ref(x, labels, smoothing=0.1, lse_square_scale=1e-2)
    (dref,) = torch.autograd.grad(ref.sum(), x)
    paths = set(results[0])
    assert "torch" in paths and (CUDA or "triton" in paths)
    for rank in range(2):
        for name, (loss, z, dx) in results[rank].items():
            torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")
            torch.testing.assert_close(z, ref_z.detach(), atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(dx, dref[:, rank * 37:(rank + 1) * 37], atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128 * 1024, 256 * 1024])
def test_gpu_bf16(vocab):
    with backend("triton"):
        logits, labels = _data("cuda", torch.bfloat16, 257, vocab, seed=12)
        _check(logits, labels, smoothing=0.1, lse_square_scale=1e-4)
        logits, labels = _data("cuda", torch.bfloat16, 3, vocab, seed=13)  # vocab split over programs
        _check(logits, labels)


@pytest.mark.gpu
def test_gpu_no_fp32_copy_of_logits():
    """Forward keeps no more than a sliver beyond its inputs: an fp32 copy of the (4096, 128k) bf16
    logits would add 2 GiB, the kernel's partials and per-row outputs add a few hundred KiB."""
    with backend("triton"):
        logits, labels = _data("cuda", torch.bfloat16, 4096, 128 * 1024, seed=14)
        logits.requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, _ = cross_entropy_loss(logits, labels, inplace_backward=True)
        torch.cuda.synchronize()
        fwd_extra = torch.cuda.max_memory_allocated() - base
        (dlogits,) = torch.autograd.grad(loss.sum(), logits)
        torch.cuda.synchronize()
        bwd_extra = torch.cuda.max_memory_allocated() - base
    assert fwd_extra < 2 * 1024 * 1024, fwd_extra
    # in-place backward: the gradient takes over the logits' storage
    assert dlogits.data_ptr() == logits.data_ptr()
    assert bwd_extra < 8 * 1024 * 1024, bwd_extra


def test_elementwise_benchmark_runs_every_knob_and_each_matches_the_default():
    # benchmarks/ops/bench_elementwise.py on small shapes in the interpreter: every configuration it sweeps
    # on the GPU runs and gives the default's output (it exits 1 on a mismatch)
    from benchmarks.ops import bench_elementwise as bench

    if torch.cuda.is_available():
        pytest.skip("the GPU run of the script is the benchmark itself")
    assert bench.main(["--cpu-smoke"]) == 0
