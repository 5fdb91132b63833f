"""flash_attn.ops.activations (kernels in ops/triton/activations.py) against autograd of the standard
PyTorch activations, on the Triton path (interpreter on CPU) and the plain-PyTorch path."""
import pytest
import torch
import torch.nn.functional as F

from flash_attn.ops import activations as A
from flash_attn.ops.triton import backend, triton_runs_on
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()

REF = {
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "sqrelu": lambda x: F.relu(x).square(),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}


@pytest.fixture(params=["triton", "torch"])
def path(request):
    if request.param == "triton" and not triton_runs_on("cuda" if CUDA else "cpu"):
        pytest.skip("triton is not installed")
    with backend(request.param):
        yield request.param


def _device(path):
    return "cuda" if CUDA and path == "triton" else "cpu"


def _assert_close(out, ref, pt, name):
    return assert_close_to_ref(out, ref, pt, name=name, fp32_ulps=4)


def _check(fn, ref, inputs, seed=0):
    """fn(*inputs) and the gradients of all inputs against ref at fp64 and at the input dtype."""
    ins = [t.detach().clone().requires_grad_() for t in inputs]
    i64 = [t.detach().double().requires_grad_() for t in inputs]
    ipt = [t.detach().clone().requires_grad_() for t in inputs]
    out, o64, opt = fn(*ins), ref(*i64), ref(*ipt)
    assert out.dtype == inputs[0].dtype and out.shape == o64.shape
    _assert_close(out, o64, opt, "out")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    grads = torch.autograd.grad(out, ins, g.to(out.dtype))
    g64 = torch.autograd.grad(o64, i64, g.double())
    gpt = torch.autograd.grad(opt, ipt, g.to(out.dtype))
    for i, (a, b, c) in enumerate(zip(grads, g64, gpt)):
        assert a.dtype == inputs[i].dtype
        _assert_close(a, b, c, f"grad {i}")


def _randn(shape, device, dtype, seed):
    return (2 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


@pytest.mark.parametrize("activation", list(REF))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 17), (1, 4099), (2, 3, 1)])
def test_bias_act(path, activation, dtype, shape):
    dev = _device(path)
    x, b = _randn(shape, dev, dtype, 0), _randn(shape[-1:], dev, dtype, 1)
    _check(lambda x, b: A.bias_act(x, b, activation), lambda x, b: REF[activation](x + b), [x, b])


@pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "sqrelu"])
def test_act_without_bias(path, activation):
    x = _randn((5, 33), _device(path), torch.float32, 2)
    _check(lambda x: A.bias_act(x, None, activation), REF[activation], [x])


def test_fp32_bias_with_fp16_input(path):
    dev = _device(path)
    x = _randn((4, 24), dev, torch.float16, 3).requires_grad_()
    b = _randn((24,), dev, torch.float32, 4).requires_grad_()
    y = A.bias_act(x, b, "gelu")
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float16 and b.grad.dtype == torch.float32
    ref_b = b.detach().double().requires_grad_()
    F.gelu(x.detach().double() + ref_b).sum().backward()
    torch.testing.assert_close(b.grad.double(), ref_b.grad, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "sigmoid", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bias_gated_act(path, activation, dtype):
    dev = _device(path)
    x, b = _randn((3, 2 * 37), dev, dtype, 5), _randn((2 * 37,), dev, dtype, 6)

    def ref(x, b):
        value, gate = (x + b).chunk(2, dim=-1)
        return value * REF[activation](gate)

    _check(lambda x, b: A.bias_gated_act(x, b, activation), ref, [x, b])


def test_swiglu_and_geglu(path):
    dev = _device(path)
    x, y = _randn((2, 3, 20), dev, torch.float16, 7), _randn((2, 3, 20), dev, torch.float16, 8)
    _check(A.swiglu, lambda x, y: F.silu(x) * y, [x, y])
    _check(A.geglu, lambda x, y: F.gelu(x) * y, [x, y])


def test_gated_with_separate_biases(path):
    dev = _device(path)
    g, v = _randn((4, 9), dev, torch.float32, 9), _randn((4, 9), dev, torch.float32, 10)
    bg, bv = _randn((9,), dev, torch.float32, 11), _randn((9,), dev, torch.float32, 12)
    _check(lambda g, v, bg, bv: A.gated_act(g, v, "silu", bg, bv), lambda g, v, bg, bv: (v + bv) * F.silu(g + bg),
           [g, v, bg, bv])


def test_bias_grad_over_many_row_programs(path):
    """4000 rows x 80 columns: the bias gradient is summed inside programs over 4 row tiles each (2 for
    the gated halves), then across 32 programs' partial rows (CPU grid); the last tile is partial."""
    dev = _device(path)
    if dev == "cpu":
        from flash_attn.ops.triton.activations import bwd_row_programs
        assert bwd_row_programs(4000, 80, "cpu", True) == (32, 128)
    x, b = _randn((4000, 80), dev, torch.float32, 13), _randn((80,), dev, torch.float32, 14)
    _check(lambda x, b: A.bias_act(x, b, "gelu_tanh"), lambda x, b: REF["gelu_tanh"](x + b), [x, b])
    _check(lambda x, b: A.bias_gated_act(x, b, "silu"),
           lambda x, b: (x + b).chunk(2, -1)[0] * F.silu((x + b).chunk(2, -1)[1]), [x, b])


@pytest.mark.parametrize("one_exp", [True, False])
def test_gelu_tanh_grad_tails(path, one_exp, monkeypatch):
    """gelu_tanh's derivative from one exp(-2|u|) (GELU_ONE_EXP) or two sigmoids, out to the tails where
    exp(2|u|) overflows fp32 and sigmoid(2u) rounds to 0 or 1."""
    from flash_attn.ops.triton import activations as K
    monkeypatch.setattr(K, "GELU_ONE_EXP", one_exp)
    dev = _device(path)
    v = torch.tensor([-100.0, -30.0, -12.0, -5.0, -2.0, -1e-3, 0.0, 1e-3, 0.5, 2.0, 5.0, 12.0, 30.0, 100.0])
    x = torch.cat([v, -v.flip(0)]).reshape(2, 14).to(dev)
    b = torch.zeros(14, device=dev)
    _check(lambda x, b: A.bias_act(x, b, "gelu_tanh"), lambda x, b: REF["gelu_tanh"](x + b), [x, b])
    _check(lambda g, v: A.gated_act(g, v, "gelu_tanh"), lambda g, v: v * REF["gelu_tanh"](g), [x, x.flip(1)])


@pytest.mark.parametrize("knobs", [dict(BWD_TILE=2048, BWD_WARPS=8), dict(BWD_TILE=8192, BWD_BLOCK_N=512),
                                   dict(BWD_STAGES=2), dict(BWD_PROGRAMS_PER_SM=1), dict(FWD_TILE=1024, FWD_WARPS=8)])
def test_tile_knobs(path, knobs, monkeypatch):
    """Every tiling the benchmark sweeps gives the same results (1000 x 300: partial tiles both ways)."""
    from flash_attn.ops.triton import activations as K
    for name, value in knobs.items():
        monkeypatch.setattr(K, name, value)
    dev = _device(path)
    x, b = _randn((1000, 300), dev, torch.float32, 15), _randn((300,), dev, torch.float32, 16)
    _check(lambda x, b: A.bias_act(x, b, "gelu_tanh"), lambda x, b: REF["gelu_tanh"](x + b), [x, b])


def test_fa2_helpers(path):
    dev = _device(path)
    x, b, g = _randn((6, 10), dev, torch.float32, 15), _randn((10,), dev, torch.float32, 16), \
        _randn((6, 10), dev, torch.float32, 17)
    tol = dict(atol=1e-6, rtol=1e-5)
    ref_x = x.clone().requires_grad_()
    ref_b = b.clone().requires_grad_()
    y = REF["gelu_tanh"](ref_x + ref_b)
    dx_ref, db_ref = torch.autograd.grad(y, (ref_x, ref_b), g)
    torch.testing.assert_close(A.bias_gelu(x, b), y.detach(), **tol)
    dx, db = A.bias_gelu_back(g, x, b)
    torch.testing.assert_close(dx, dx_ref, **tol)
    torch.testing.assert_close(db, db_ref, **tol)
    torch.testing.assert_close(A.gelu_fwd(x), REF["gelu_tanh"](x), **tol)
    xr = x.clone().requires_grad_()
    torch.testing.assert_close(A.gelu_bwd(g, x), torch.autograd.grad(REF["gelu_tanh"](xr), xr, g)[0], **tol)
    torch.testing.assert_close(A.sqrelu_fwd(x), F.relu(x).square(), **tol)
    torch.testing.assert_close(A.sqrelu_bwd(g, x), torch.autograd.grad(F.relu(xr).square(), xr, g)[0], **tol)
    torch.testing.assert_close(A.relu_bwd(g, x), torch.autograd.grad(F.relu(xr), xr, g)[0], **tol)
    xa = x.clone().requires_grad_()
    A.fast_gelu_impl(xa).backward(g)
    torch.testing.assert_close(xa.grad, torch.autograd.grad(REF["gelu_tanh"](xr), xr, g)[0], **tol)
    xa.grad = None
    ba = b.clone().requires_grad_()
    A.bias_gelu_impl(xa, ba).backward(g)
    torch.testing.assert_close(ba.grad, db_ref, **tol)


def test_aliases_and_bad_inputs():
    x = torch.randn(2, 8)
    torch.testing.assert_close(A.bias_act(x, None, "gelu_approx"), A.bias_act(x, None, "gelu_tanh"))
    torch.testing.assert_close(A.bias_act(x, None, "swish"), F.silu(x), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="activation must be one of"):
        A.bias_act(x, None, "tanh")
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        A.bias_act(x, torch.zeros(7))
    with pytest.raises(ValueError, match="even"):
        A.bias_gated_act(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate and value must match"):
        A.swiglu(torch.randn(2, 8), torch.randn(2, 4))
    with pytest.raises(ValueError, match="together"):
        A.gated_act(x, x, "silu", torch.zeros(8), None)
    with pytest.raises(TypeError, match="floating-point"):
        A.bias_act(torch.ones(2, 8, dtype=torch.int32))


def test_compile_fullgraph(path):
    dev = _device(path)
    x, b = _randn((3, 16), dev, torch.float32, 18).requires_grad_(), _randn((16,), dev, torch.float32, 19)
    fn = lambda x: A.bias_gated_act(A.bias_act(x, b, "gelu"), None, "silu")  # noqa: E731
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, fn(x))
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(fn(x).sum(), x)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", list(REF))
def test_gpu_bf16(activation):
    with backend("triton"):
        x, b = _randn((4096, 1000), "cuda", torch.bfloat16, 20), _randn((1000,), "cuda", torch.bfloat16, 21)
        _check(lambda x, b: A.bias_act(x, b, activation), lambda x, b: REF[activation](x + b), [x, b])

        def ref(x, b):
            value, gate = (x + b).chunk(2, dim=-1)
            return value * REF[activation](gate)

        _check(lambda x, b: A.bias_gated_act(x, b, activation), ref, [x, b])
