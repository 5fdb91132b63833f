"""FlashAttention 2's ``flash_attn.ops.fused_dense``: ``FusedDense``, ``fused_dense_func``, ``FusedMLP``,
``fused_mlp_func`` and the tensor-parallel layers ``ColumnParallelLinear``, ``RowParallelLinear`` and
``ParallelFusedMLP`` (Megatron-LM's column / row split, Shoeybi et al. 2019; with sequence parallelism, Korthikanti
et al. 2022: activations sharded along dim 0 between the parallel regions).

FA2 builds these on a cuBLASLt extension. Here the GEMMs are ``flash_attn.ops.linear.linear`` (F.linear; on CUDA,
or with FLASH_ATTN_FP32_WGRAD=1, weight and bias gradients in the parameters' dtype straight from the GEMM and a
column-sum kernel) and the MLP's activation is one elementwise kernel (``flash_attn.ops.activations.bias_act``, fp32
math). fc1's bias is added in its GEMM's epilogue, so the pre-activation is rounded once, after the bias, as in
FA2 and nn.Linear: its sign, which relu's gradient follows, is the fp32 sum's. As in FA2 the layers compute in the
autocast dtype under autocast, else in the input's dtype.

Differences from FA2, all deliberate:
- ``return_residual`` returns the caller's input tensor itself (FA2's CUDA path returns it cast to the autocast
  dtype), so an fp32 residual stream stays fp32.
- ``heuristic`` picked a cuBLASLt epilogue; it is validated and has no effect.
- ``checkpoint_lvl`` keeps what FA2 keeps (0: x, fc1's output and the activation; 1: x and fc1's output; 2: x only,
  gathered again in the backward under sequence parallelism) through ``torch.utils.checkpoint``; levels 1 and 2
  also recompute fc2's forward GEMM, which FA2's fused backward avoids.
- The FA2 activations are "gelu_approx", "relu" and "sqrelu"; any other ``bias_act`` name ("gelu", "silu", ...)
  except "sigmoid" works too.

Collectives (``flash_attn.utils.distributed``) run along dim 0 on any process group (NCCL, and gloo on CPU tensors);
a group of one is the identity.
"""
from numbers import Integral
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from flash_attn.utils.distributed import all_gather, all_reduce, all_reduce_raw, get_dim_for_local_rank, reduce_scatter

from .activations import ACTIVATIONS, _canon, bias_act
from .linear import Linear, linear

_MLP_ACTIVATIONS = tuple(sorted(set(ACTIVATIONS + ("gelu_approx",)) - {"sigmoid"}))


# ---------------------------------------------------------------------------------------- collectives
def _world(group) -> int:
    return dist.get_world_size(group)


class _ToGroup(torch.autograd.Function):
    """Identity forward for an input every rank already holds whole; backward sums its gradient over the ranks,
    each of which computed a part from its own shard of the weights."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_raw(grad.clone(), ctx.group)[0], None  # autograd may hand the same grad to others


def _enter_group(x: Tensor, process_group, sequence_parallel: bool) -> Tensor:
    """The full input of a column-parallel layer: x gathered from the ranks (sequence parallel), else x."""
    if process_group is None or _world(process_group) == 1:
        return x
    return all_gather(x, process_group) if sequence_parallel else _ToGroup.apply(x, process_group)


def _leave_group(out: Tensor, process_group, sequence_parallel: bool) -> Tensor:
    """The output of a row-parallel layer: the ranks' partial sums reduce-scattered (sequence parallel) or
    all-reduced."""
    if _world(process_group) == 1:
        return out
    return reduce_scatter(out, process_group) if sequence_parallel else all_reduce(out, process_group)


def _check_group(process_group, name: str):
    if process_group is None:
        raise ValueError(f"{name} needs a process_group (torch.distributed.group.WORLD for the default one)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs torch.distributed initialised (init_process_group)")


def _local_size(features: int, multiple_of: int, process_group, name: str) -> int:
    """This rank's share of ``features`` split in units of ``multiple_of``; the first ``units % world`` ranks take
    one unit more."""
    if not isinstance(multiple_of, Integral) or multiple_of < 1:
        raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
    if features % multiple_of:
        raise ValueError(f"{name} ({features}) must be a multiple of multiple_of ({multiple_of})")
    return get_dim_for_local_rank(features, _world(process_group), dist.get_rank(process_group), multiple_of)


# ------------------------------------------------------------------------------------------ FusedDense
def _check_x(x):
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise TypeError("x must be a floating-point tensor of shape (..., in_features)")


def fused_dense_func(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, return_residual: bool = False,
                     process_group=None, sequence_parallel: bool = True):
    """x @ weight^T + bias in the autocast dtype (else x's dtype).

    x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None. With a
    process_group the layer is column-parallel: x is this rank's rows, gathered along dim 0 from every rank
    before the GEMM (sequence_parallel), or already the full input (then its gradient is all-reduced).
    Returns out (..., out_features), or (out, x) with return_residual.
    """
    _check_x(x)
    out = linear(_enter_group(x, process_group, sequence_parallel), weight, bias)
    return (out, x) if return_residual else out


class FusedDense(Linear):
    """nn.Linear (same parameters, init and state dict) whose forward is :func:`fused_dense_func`.

    forward(x, process_group=None): x (..., in_features) -> (..., out_features), or (out, x) with
    return_residual; with a process_group, x is gathered along dim 0 from the ranks first (sequence parallel).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x, process_group=None):
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual,
                                process_group=process_group)


class ColumnParallelLinear(Linear):
    """This rank's rows of a linear layer split by output features (in units of multiple_of, the first ranks
    taking one unit more when they do not divide evenly). forward(x): x (..., in_features), this rank's rows
    of the input under sequence_parallel (gathered along dim 0 first), else the full input ->
    (..., local out_features)."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel=True, multiple_of=1, device=None, dtype=None) -> None:
        _check_group(process_group, "ColumnParallelLinear")
        local = _local_size(out_features, multiple_of, process_group, "out_features")
        super().__init__(in_features, local, bias=bias, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        return fused_dense_func(x, self.weight, self.bias, process_group=self.process_group,
                                sequence_parallel=self.sequence_parallel)


class RowParallelLinear(Linear):
    """This rank's columns of a linear layer split by input features (as ColumnParallelLinear splits its
    outputs); the bias lives on rank 0 only. forward(x): x (..., local in_features) -> the sum over the ranks
    (..., out_features), reduce-scattered along dim 0 under sequence_parallel, else all-reduced."""

    def __init__(self, in_features: int, out_features: int, process_group, bias: bool = True,
                 sequence_parallel=True, multiple_of=1, device=None, dtype=None) -> None:
        _check_group(process_group, "RowParallelLinear")
        local = _local_size(in_features, multiple_of, process_group, "in_features")
        rank = dist.get_rank(process_group)
        super().__init__(local, out_features, bias=bias and rank == 0, device=device, dtype=dtype)
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel

    def forward(self, x):
        out = fused_dense_func(x, self.weight, self.bias)
        return _leave_group(out, self.process_group, self.sequence_parallel)


# -------------------------------------------------------------------------------------------- FusedMLP
def _act_fc2(pre, weight2, bias2, activation):
    return linear(bias_act(pre, None, activation), weight2, bias2)


def _mlp(x, weight1, bias1, weight2, bias2, activation, process_group, sequence_parallel):
    pre = linear(_enter_group(x, process_group, sequence_parallel), weight1, bias1)
    return _act_fc2(pre, weight2, bias2, activation)


def _check_mlp_args(activation, checkpoint_lvl):
    if activation not in _MLP_ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(_MLP_ACTIVATIONS)}, got {activation!r}")
    if checkpoint_lvl not in (0, 1, 2) or isinstance(checkpoint_lvl, bool):
        raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")


def _check_heuristic(heuristic, allow_auto: bool):
    if allow_auto and heuristic == "auto":
        return
    if not isinstance(heuristic, Integral) or isinstance(heuristic, bool) or not -1 <= heuristic <= 4:
        raise ValueError(f"heuristic must be {'auto or ' if allow_auto else ''}an int in [-1, 4], got {heuristic!r}")


def fused_mlp_func(x: Tensor, weight1: Tensor, weight2: Tensor, bias1: Optional[Tensor] = None,
                   bias2: Optional[Tensor] = None, activation: str = "gelu_approx", save_pre_act: bool = True,
                   return_residual: bool = False, checkpoint_lvl: int = 0, heuristic: int = 0, process_group=None,
                   sequence_parallel: bool = True):
    """fc2(act(x @ weight1^T + bias1)): the GEMMs of flash_attn.ops.linear, the activation one kernel.

    x: (..., in_features); weight1: (hidden, in_features); weight2: (out_features, hidden); biases (hidden,) /
    (out_features,) or None. activation: "gelu_approx" (tanh GELU), "relu", "sqrelu", or another bias_act name.
    checkpoint_lvl: what the backward keeps (module docstring); save_pre_act=False means level 2. heuristic:
    FA2's cuBLASLt choice in [-1, 4], no effect. process_group: x is gathered along dim 0 from the ranks first
    (sequence_parallel), else it is the full input and its gradient is all-reduced; the output is this rank's
    partial sum, to reduce over the group. Returns out (..., out_features), or (out, x) with return_residual.
    """
    _check_x(x)
    _check_mlp_args(activation, checkpoint_lvl)
    _check_heuristic(heuristic, allow_auto=False)
    act = _canon(activation)
    if not save_pre_act:
        checkpoint_lvl = 2
    if checkpoint_lvl == 0 or not torch.is_grad_enabled():
        out = _mlp(x, weight1, bias1, weight2, bias2, act, process_group, sequence_parallel)
    elif checkpoint_lvl == 1:
        pre = linear(_enter_group(x, process_group, sequence_parallel), weight1, bias1)
        out = checkpoint(_act_fc2, pre, weight2, bias2, act, use_reentrant=False, preserve_rng_state=False)
    else:
        # The gather is inside the recomputed region: only this rank's x is kept, gathered again in the backward.
        out = checkpoint(_mlp, x, weight1, bias1, weight2, bias2, act, process_group, sequence_parallel,
                         use_reentrant=False, preserve_rng_state=False)
    return (out, x) if return_residual else out


class FusedMLP(nn.Module):
    """x (..., in_features) -> fc2(act(fc1(x))) (..., out_features) through :func:`fused_mlp_func`.

    Parameters ``fc1`` / ``fc2`` (flash_attn.ops.linear.Linear, i.e. nn.Linear) as FA2's, so state dicts move
    between this, FA2's FusedMLP and ``flash_attn.modules.mlp.Mlp``. hidden_features defaults to 4 * in_features,
    out_features to in_features. checkpoint_lvl 0 / 1 / 2 (module docstring); heuristic "auto" or [-1, 4], no
    effect. forward(x, process_group=None): with a process_group, x is gathered from the ranks along dim 0 and
    the output reduce-scattered. Returns out, or (out, x) with return_residual.
    """

    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
                 activation="gelu_approx", return_residual=False, checkpoint_lvl=0, heuristic="auto",
                 device=None, dtype=None):
        super().__init__()
        _check_mlp_args(activation, checkpoint_lvl)
        _check_heuristic(heuristic, allow_auto=True)
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.activation = activation
        self.return_residual = return_residual
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.fc2 = Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x, process_group=None):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             checkpoint_lvl=self.checkpoint_lvl, heuristic=-1, process_group=process_group)
        if process_group is not None:
            out = _leave_group(out, process_group, True)
        return (out, x) if self.return_residual else out


class ParallelFusedMLP(nn.Module):
    """FusedMLP split over a process group: fc1 a ColumnParallelLinear, fc2 a RowParallelLinear (hidden units
    split over the ranks). forward(x): x (..., in_features), this rank's rows under sequence_parallel ->
    (..., out_features), this rank's rows of the sum over the ranks (else the whole all-reduced output)."""

    def __init__(self, in_features, hidden_features=None, out_features=None, activation="gelu_approx",
                 process_group=None, bias1=True, bias2=True, sequence_parallel=True, checkpoint_lvl=0,
                 heuristic="auto", device=None, dtype=None):
        super().__init__()
        _check_mlp_args(activation, checkpoint_lvl)
        _check_heuristic(heuristic, allow_auto=True)
        _check_group(process_group, "ParallelFusedMLP")
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.activation = activation
        self.process_group = process_group
        self.sequence_parallel = sequence_parallel
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic if activation != "sqrelu" else -1
        self.fc1 = ColumnParallelLinear(in_features, hidden_features, process_group, bias=bias1, **factory_kwargs)
        self.fc2 = RowParallelLinear(hidden_features, out_features, process_group, bias=bias2, **factory_kwargs)

    def forward(self, x):
        out = fused_mlp_func(x, self.fc1.weight, self.fc2.weight, self.fc1.bias, self.fc2.bias,
                             activation=self.activation, save_pre_act=self.training,
                             checkpoint_lvl=self.checkpoint_lvl, heuristic=-1, process_group=self.process_group,
                             sequence_parallel=self.sequence_parallel)
        return _leave_group(out, self.process_group, self.sequence_parallel)
