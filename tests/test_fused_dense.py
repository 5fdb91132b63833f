"""flash_attn.ops.fused_dense: the bias-gradient column sum (Triton, interpreter on CPU) and FusedDense
against nn.Linear's autograd, with and without autocast."""
import pytest
import torch
import torch.nn.functional as F

from flash_attn.modules.mha import MHA
from flash_attn.ops import fused_dense as FD
from flash_attn.ops.triton import backend, triton_runs_on
from flash_attn.ops.triton import fused_dense as K
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
needs_triton = pytest.mark.skipif(not triton_runs_on(DEV), reason="triton cannot run here")


def _randn(shape, dtype=torch.float32, seed=0, device=DEV):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@needs_triton
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (130, 300), (1000, 513)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_col_sum_matches_a_fp64_sum(shape, dtype):
    x = _randn(shape, dtype)
    M, N = shape
    part = torch.full((K.col_sum_programs(M, N, x.device), N), float("nan"), device=x.device)
    K.col_sum(x, part)
    assert_close_to_ref(part.sum(0), x.double().sum(0), x.float().sum(0), name="col sum")


@needs_triton
def test_col_sum_reads_a_row_strided_view():
    big = _randn((64, 100))
    x = big[:, 10:60]  # row stride 100, unit column stride
    part = torch.zeros((K.col_sum_programs(64, 50, x.device), 50), device=x.device)
    K.col_sum(x, part)
    torch.testing.assert_close(part.sum(0), x.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_dense_matches_linear(path, dtype):
    if path == "triton" and not triton_runs_on(DEV):
        pytest.skip("triton cannot run here")
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24).to(DEV, dtype)
    fused = FD.FusedDense(40, 24).to(DEV, dtype)
    fused.load_state_dict(lin.state_dict())
    assert fused.state_dict().keys() == lin.state_dict().keys()
    x = _randn((2, 33, 40), dtype, 1)
    g = _randn((2, 33, 24), dtype, 2)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with backend(path):
        out = fused(x1)
    ref = lin(x2)
    torch.testing.assert_close(out, ref)
    with backend(path):
        out.backward(g)
    ref.backward(g)
    for a, b in ((x1.grad, x2.grad), (fused.weight.grad, lin.weight.grad), (fused.bias.grad, lin.bias.grad)):
        assert a.dtype == b.dtype
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-2)
        torch.testing.assert_close(a, b, **tol)


def test_autocast_casts_like_linear_and_returns_grads_in_param_dtypes():
    # The Function itself (it runs for CUDA inputs): the bias gradient through the torch path here.
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    x = _randn((4, 8, 32), torch.float32, 3, "cpu")
    g = _randn((4, 8, 16), torch.bfloat16, 4, "cpu")
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with backend("torch"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = FD.FusedDenseFunc.apply(x1, lin.weight, lin.bias)
    assert out.dtype == torch.bfloat16
    (out.float() * g.float()).sum().backward()
    fused_grads = [x1.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
    lin.weight.grad = lin.bias.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(x2, lin.weight, lin.bias)
    torch.testing.assert_close(out, ref)
    (ref.float() * g.float()).sum().backward()
    for a, b in zip(fused_grads, [x2.grad, lin.weight.grad, lin.bias.grad]):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-2)


@needs_triton
def test_bias_gradient_goes_through_the_column_sum_kernel(monkeypatch):
    calls = []
    real = K.col_sum
    monkeypatch.setattr(K, "col_sum", lambda x, part: (calls.append(tuple(x.shape)), real(x, part)))
    layer = FD.FusedDense(8, 6).to(DEV)
    layer(_randn((3, 5, 8), seed=6)).sum().backward()
    assert calls == [(15, 6)]
    torch.testing.assert_close(layer.bias.grad, torch.full((6,), 15.0, device=DEV))


def test_process_group_is_refused():
    with pytest.raises(NotImplementedError, match="process_group"):
        FD.fused_dense_func(torch.zeros(2, 3), torch.zeros(4, 3), process_group=object())


def test_mha_fused_bias_fc_builds_fused_dense_with_the_same_results():
    torch.manual_seed(0)
    plain = MHA(64, 4, causal=True).to(DEV)
    fused = MHA(64, 4, causal=True, fused_bias_fc=True).to(DEV)
    assert isinstance(fused.Wqkv, FD.FusedDense) and isinstance(fused.out_proj, FD.FusedDense)
    assert not isinstance(plain.Wqkv, FD.FusedDense)
    fused.load_state_dict(plain.state_dict())
    x = _randn((2, 9, 64), seed=5)
    out_p, out_f = plain(x), fused(x)
    torch.testing.assert_close(out_f, out_p)
    out_p.square().sum().backward()
    out_f.square().sum().backward()
    for (n, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=n)
