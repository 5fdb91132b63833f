"""flash_attn.ops.fused_dense (FA2's FusedDense, FusedMLP and tensor-parallel layers) against plain PyTorch:
nn.Linear / F.linear compositions in fp32, bf16 and fp16, forward and gradients; checkpoint levels by what the
backward recomputes; the parallel layers on a gloo group of one (two ranks: test_fused_dense_dist.py)."""
import copy
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import flash_attn
import flash_attn.ops.fused_dense as fd
from flash_attn.ops.fused_dense import (
    ColumnParallelLinear, FusedDense, FusedMLP, ParallelFusedMLP, RowParallelLinear, fused_dense_func, fused_mlp_func,
)

K, N = 48, 40  # in / out features; hidden of the MLPs below is 56
ATOL = 1e-5
ACTS = {"gelu_approx": partial(F.gelu, approximate="tanh"), "relu": F.relu, "sqrelu": lambda t: F.relu(t).square(),
        "gelu": F.gelu}


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # bias_act on its PyTorch path (the Triton interpreter is slow)
        yield


def _params(*modules, seed=0):
    torch.manual_seed(seed)
    for m in modules:
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.3)


def _grads(tensors):
    return [t.grad for t in tensors]


# ------------------------------------------------------------------------------------------ FusedDense
@pytest.mark.parametrize("return_residual", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_dense_matches_linear_fp32(bias, return_residual):
    ref = torch.nn.Linear(K, N, bias=bias)
    ours = FusedDense(K, N, bias=bias, return_residual=return_residual)
    _params(ref)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict()) and isinstance(ours, torch.nn.Linear)
    x = torch.randn(3, 7, K, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = ours(x)
    if return_residual:
        out, residual = out
        assert residual is x
        out = out + F.gelu(residual[..., :N])  # a function of the residual: its gradient must reach x too
    out_ref = ref(x_ref)
    if return_residual:
        out_ref = out_ref + F.gelu(x_ref[..., :N])
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    for a, b in zip(_grads([x, *ours.parameters()]), _grads([x_ref, *ref.parameters()])):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_dense_half_is_linear(dtype):
    # Same GEMM as nn.Linear in the input dtype: equal, not merely close.
    ref = torch.nn.Linear(K, N, dtype=dtype)
    ours = FusedDense(K, N, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(5, K, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = ours(x), ref(x_ref)
    assert out.dtype == dtype
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    for a, b in zip(_grads([x, *ours.parameters()]), _grads([x_ref, *ref.parameters()])):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_fused_dense_computes_in_autocast_dtype():
    ours = FusedDense(K, N, return_residual=True)
    ref = torch.nn.Linear(K, N)
    _params(ref)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out, residual), out_ref = ours(x), ref(x)
    assert out.dtype == torch.bfloat16 and residual is x  # the caller's fp32 residual stays fp32
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
    out.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32 and ours.bias.grad.dtype == torch.float32


def test_fused_dense_func_arguments():
    w = torch.randn(N, K)
    torch.testing.assert_close(fused_dense_func(torch.ones(2, K), w), torch.ones(2, K) @ w.t())
    with pytest.raises(TypeError, match="x must be"):
        fused_dense_func(torch.ones(2, K, dtype=torch.int64), w)
    with pytest.raises(RuntimeError):
        fused_dense_func(torch.ones(2, K + 1), w)


# -------------------------------------------------------------------------------------------- FusedMLP
def _mlp_pair(activation, bias1=True, bias2=True, dtype=None, device=None, **kwargs):
    ours = FusedMLP(K, 56, K, activation=activation, bias1=bias1, bias2=bias2, dtype=dtype, device=device, **kwargs)
    fc1 = torch.nn.Linear(K, 56, bias=bias1, dtype=dtype, device=device)
    fc2 = torch.nn.Linear(56, K, bias=bias2, dtype=dtype, device=device)
    _params(fc1, fc2)
    ours.fc1.load_state_dict(fc1.state_dict())
    ours.fc2.load_state_dict(fc2.state_dict())
    return ours, lambda x: fc2(ACTS[activation](fc1(x))), [fc1, fc2]


@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "sqrelu", "gelu"])
def test_fused_mlp_matches_composition_fp32(activation, checkpoint_lvl):
    ours, ref, ref_mods = _mlp_pair(activation, checkpoint_lvl=checkpoint_lvl)
    x = torch.randn(2, 9, K, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    ref_params = [p for m in ref_mods for p in m.parameters()]
    for a, b in zip(_grads([x, *ours.parameters()]), _grads([x_ref, *ref_params])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bias1, bias2", [(False, True), (True, False), (False, False)])
def test_fused_mlp_without_biases(bias1, bias2):
    ours, ref, ref_mods = _mlp_pair("gelu_approx", bias1=bias1, bias2=bias2, checkpoint_lvl=1)
    assert (ours.fc1.bias is None) != bias1 and (ours.fc2.bias is None) != bias2
    x = torch.randn(11, K, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=0)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    ref_params = [p for m in ref_mods for p in m.parameters()]
    for a, b in zip(_grads([x, *ours.parameters()]), _grads([x_ref, *ref_params])):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("checkpoint_lvl", [0, 2])
def test_fused_mlp_return_residual_gradient(checkpoint_lvl):
    ours, ref, _ = _mlp_pair("relu", return_residual=True, checkpoint_lvl=checkpoint_lvl)
    x = torch.randn(3, 4, K, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, residual = ours(x)
    assert residual is x
    (out + F.gelu(residual)).sum().backward()
    (ref(x_ref) + F.gelu(x_ref)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-5)


def _within(ours, pt, ref):
    """ours' error against the fp32 reference is at most twice PyTorch's low-precision one, plus one rounding."""
    slack = torch.finfo(ours.dtype).eps * ref.abs().max().item()
    assert (ours.float() - ref).abs().max() <= 2 * (pt.float() - ref).abs().max() + slack


def _check_half_mlp(activation, dtype, shape, device="cpu", **kwargs):
    # fc1's bias add and activation run in fp32 here (PyTorch's in the half dtype).
    ours, ref, ref_mods = _mlp_pair(activation, dtype=dtype, device=device, **kwargs)
    fc1, fc2 = (copy.deepcopy(m).float() for m in ref_mods)
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    x_pt, x_32 = x.detach().clone().requires_grad_(), x.detach().float().requires_grad_()
    out, out_pt, out_32 = ours(x), ref(x_pt), fc2(ACTS[activation](fc1(x_32)))
    assert out.dtype == dtype
    _within(out, out_pt, out_32)
    g = torch.randn_like(out_32) / 8
    out.backward(g.to(dtype))
    out_pt.backward(g.to(dtype))
    out_32.backward(g)
    _within(x.grad, x_pt.grad, x_32.grad)
    for a, b, c in zip(_grads(ours.parameters()), _grads([*ref_mods[0].parameters(), *ref_mods[1].parameters()]),
                       _grads([*fc1.parameters(), *fc2.parameters()])):
        _within(a, b, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "sqrelu"])
def test_fused_mlp_half_within_pytorch_error(dtype, activation):
    # Enough rows that some pre-activations sit within a rounding of zero: relu's gradient there follows the sign
    # of the bias-added fp32 sum only if the bias is added before the rounding.
    _check_half_mlp(activation, dtype, (8, 256, K))


def test_fused_mlp_cpu_autocast_is_bf16_with_fp32_grads():
    ours, ref, _ = _mlp_pair("gelu_approx")
    x = torch.randn(6, K)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = ours(x), ref(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - out_ref.float()).abs().max() <= 4 * torch.finfo(torch.bfloat16).eps * out_ref.abs().max()
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters())


# What the backward recomputes, per checkpoint level: (bias_act calls, linear calls) in forward + backward.
@pytest.mark.parametrize("checkpoint_lvl, calls", [(0, (1, 2)), (1, (2, 3)), (2, (2, 4))])
def test_checkpoint_levels_recompute(monkeypatch, checkpoint_lvl, calls):
    counts = {"act": 0, "linear": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fd, "bias_act", counting("act", fd.bias_act))
    monkeypatch.setattr(fd, "linear", counting("linear", fd.linear))
    ours, _, _ = _mlp_pair("gelu_approx", checkpoint_lvl=checkpoint_lvl)
    x = torch.randn(5, K, requires_grad=True)
    ours(x).sum().backward()
    assert (counts["act"], counts["linear"]) == calls


def test_checkpoint_levels_keep_less():
    # Activations of the hidden width kept for the backward: fc1's output and the activation at level 0, fc1's
    # output (the checkpoint's input) at 1, none at 2.
    def hidden_saved(lvl):
        ours, _, _ = _mlp_pair("gelu_approx", checkpoint_lvl=lvl)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            ours(torch.randn(5, K, requires_grad=True))
        return sum(tuple(t.shape) == (5, 56) for t in saved)

    assert [hidden_saved(lvl) for lvl in (0, 1, 2)] == [2, 1, 0]


def test_save_pre_act_false_is_level_2(monkeypatch):
    counts = []
    monkeypatch.setattr(fd, "linear", lambda *a, **k: counts.append(1) or torch.nn.functional.linear(*a, **k))
    ours, _, _ = _mlp_pair("relu")
    x = torch.randn(3, K, requires_grad=True)
    fused_mlp_func(x, ours.fc1.weight, ours.fc2.weight, ours.fc1.bias, ours.fc2.bias, activation="relu",
                   save_pre_act=False).sum().backward()
    assert len(counts) == 4  # fc1 and fc2 run again in the backward
    counts.clear()
    ours.eval()  # FusedMLP passes save_pre_act=self.training, as FA2
    ours(x).sum().backward()
    assert len(counts) == 4


def test_fused_mlp_func_matches_module():
    ours, _, _ = _mlp_pair("sqrelu")
    x = torch.randn(2, 3, K)
    out = fused_mlp_func(x, ours.fc1.weight, ours.fc2.weight, ours.fc1.bias, ours.fc2.bias, activation="sqrelu",
                         heuristic=-1, return_residual=True)
    assert out[1] is x
    torch.testing.assert_close(out[0], ours(x), atol=0, rtol=0)
    assert ours.heuristic == -1  # sqrelu never used a cuBLASLt epilogue in FA2


@pytest.mark.parametrize("make, error, match", [
    (lambda: FusedMLP(K, activation="tanh"), ValueError, "activation"),
    (lambda: FusedMLP(K, activation="sigmoid"), ValueError, "activation"),
    (lambda: FusedMLP(K, checkpoint_lvl=3), ValueError, "checkpoint_lvl"),
    (lambda: FusedMLP(K, heuristic=5), ValueError, "heuristic"),
    (lambda: FusedMLP(K, heuristic="fast"), ValueError, "heuristic"),
    (lambda: fused_mlp_func(torch.ones(2, K), torch.ones(8, K), torch.ones(K, 8), heuristic="auto"), ValueError,
     "heuristic"),
    (lambda: fused_mlp_func(torch.ones(2, K), torch.ones(8, K), torch.ones(K, 8), checkpoint_lvl=True), ValueError,
     "checkpoint_lvl"),
    (lambda: fused_mlp_func([1.0], torch.ones(8, K), torch.ones(K, 8)), TypeError, "x must be"),
    (lambda: ColumnParallelLinear(K, N, None), ValueError, "process_group"),
    (lambda: ParallelFusedMLP(K), ValueError, "process_group"),
])
def test_invalid_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_modules_mlp_exports_the_same_classes():
    from flash_attn.modules import mlp

    assert mlp.FusedMLP is FusedMLP and mlp.ParallelFusedMLP is ParallelFusedMLP


# ------------------------------------------------------------------------------- parallel: group of one
@pytest.fixture
def group_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_parallel_layers_need_an_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        RowParallelLinear(K, N, object())


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parallel_mlp_on_group_of_one_is_fused_mlp(group_of_one, sequence_parallel):
    ours, ref, ref_mods = _mlp_pair("gelu_approx")
    par = ParallelFusedMLP(K, 56, K, process_group=group_of_one, sequence_parallel=sequence_parallel,
                           checkpoint_lvl=2)
    assert isinstance(par.fc1, ColumnParallelLinear) and isinstance(par.fc2, RowParallelLinear)
    par.load_state_dict(ours.state_dict())
    x = torch.randn(6, K, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = par(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=0)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(par.fc1.weight.grad, ref_mods[0].weight.grad, atol=1e-4, rtol=1e-5)


def test_fused_dense_with_group_of_one(group_of_one):
    lin = FusedDense(K, N)
    x = torch.randn(4, K)
    torch.testing.assert_close(lin(x, process_group=group_of_one), lin(x), atol=0, rtol=0)
    col = ColumnParallelLinear(K, 8, group_of_one, multiple_of=4)
    row = RowParallelLinear(8, N, group_of_one, multiple_of=4)
    assert col.weight.shape == (8, K) and row.weight.shape == (N, 8) and row.bias is not None
    with pytest.raises(ValueError, match="multiple_of"):
        ColumnParallelLinear(K, 10, group_of_one, multiple_of=4)
    with pytest.raises(ValueError, match="multiple_of"):
        RowParallelLinear(K, N, group_of_one, multiple_of=0)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("return_residual", [False, True])
def test_gpu_fused_dense(dtype, return_residual):
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 4096, device="cuda", dtype=dtype)
    ours = FusedDense(1024, 4096, return_residual=return_residual, device="cuda", dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(8, 512, 1024, device="cuda", dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = ours(x)
    out = out[0] + F.gelu(out[1]).repeat(1, 1, 4) if return_residual else out
    out_ref = ref(x_ref)
    out_ref = out_ref + F.gelu(x_ref).repeat(1, 1, 4) if return_residual else out_ref
    torch.testing.assert_close(out, out_ref, atol=1e-2, rtol=3e-3)
    g = torch.randn_like(out) / 32
    out.backward(g)
    out_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-2, rtol=3e-3)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-1, rtol=3e-3)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, atol=5e-2, rtol=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpoint_lvl", [0, 1, 2])
@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "sqrelu"])
def test_gpu_fused_mlp_bf16(activation, checkpoint_lvl):
    with flash_attn.use_backend("triton"):  # bias_act's Triton kernels
        _check_half_mlp(activation, torch.bfloat16, (8, 512, K), device="cuda", checkpoint_lvl=checkpoint_lvl)
