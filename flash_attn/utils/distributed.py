"""Collectives for tensor and sequence parallelism (FlashAttention-2's ``flash_attn.utils.distributed``).

Sequence-parallel activations are split on their first dimension across the ranks of a process group. The
``*_raw`` functions run one collective (``async_op=True`` returns the work handle to ``wait()`` on) and carry no
gradient; ``all_gather``, ``reduce_scatter`` and ``all_reduce`` are autograd functions whose backward is the dual
collective (the sequence parallelism of Megatron-LM, Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models"):

- ``all_gather``: (B, ...) per rank -> (world * B, ...); backward reduce-scatters the gradient.
- ``reduce_scatter``: (world * B, ...) per rank -> (B, ...), summed over ranks; backward all-gathers the gradient.
- ``all_reduce``: sum over ranks; backward passes the gradient through (the consumers are replicated).

Any backend that has the collectives works, gloo on the CPU included.
"""
import operator

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renames the tensor-to-tensor collectives *_single and deprecates the old names; both take the same
# arguments
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_tensor(name, x):
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have a first dimension to gather or scatter along, got a 0-d tensor")


def all_gather_raw(input_: Tensor, process_group, async_op: bool = False):
    """Concatenate every rank's ``input_`` (B, ...) along dim 0 -> (world * B, ...), in rank order.

    Returns ``(output, handle)``; ``handle`` is None unless ``async_op``, and output is valid after
    ``handle.wait()``."""
    _check_tensor("input_", input_)
    world_size = dist.get_world_size(process_group)
    output = input_.new_empty((world_size * input_.shape[0], *input_.shape[1:]))
    handle = _all_gather_single(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def reduce_scatter_raw(input_: Tensor, process_group, async_op: bool = False):
    """Sum ``input_`` (world * B, ...) over ranks and keep this rank's chunk of dim 0 -> (B, ...).

    Returns ``(output, handle)`` as ``all_gather_raw``."""
    _check_tensor("input_", input_)
    world_size = dist.get_world_size(process_group)
    if input_.shape[0] % world_size:
        raise ValueError(f"input_ has {input_.shape[0]} rows in dim 0, not a multiple of the process group's "
                         f"{world_size} ranks")
    output = input_.new_empty((input_.shape[0] // world_size, *input_.shape[1:]))
    handle = _reduce_scatter_single(output, input_.contiguous(), group=process_group, async_op=async_op)
    return output, handle


def all_reduce_raw(input_: Tensor, process_group, async_op: bool = False):
    """Sum ``input_`` over ranks, in place when it is contiguous (else in a contiguous copy).

    Returns ``(output, handle)`` as ``all_gather_raw``."""
    if not isinstance(input_, Tensor):
        raise TypeError(f"input_ must be a torch.Tensor, got {type(input_).__name__}")
    output = input_.contiguous()
    handle = dist.all_reduce(output, group=process_group, async_op=async_op)
    return output, handle


class AllGatherFunc(torch.autograd.Function):
    """``all_gather_raw`` with the reduce-scatter of the gradient as backward."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group) -> Tensor:
        ctx.process_group = process_group
        return all_gather_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return reduce_scatter_raw(grad_output, ctx.process_group)[0], None


class ReduceScatterFunc(torch.autograd.Function):
    """``reduce_scatter_raw`` with the all-gather of the gradient as backward."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group) -> Tensor:
        ctx.process_group = process_group
        return reduce_scatter_raw(input_, process_group)[0]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return all_gather_raw(grad_output, ctx.process_group)[0], None


class AllReduceFunc(torch.autograd.Function):
    """``all_reduce_raw`` with the identity as backward: every rank computes the same loss from the sum, so each
    rank's gradient of its own summand is the gradient of the sum."""

    @staticmethod
    def forward(ctx, input_: Tensor, process_group) -> Tensor:
        output = all_reduce_raw(input_, process_group)[0]
        if output is input_:
            # reduced in place (FA2's behaviour, no copy); autograd is told, so a use of the old value in some
            # other backward is an error instead of a wrong gradient
            ctx.mark_dirty(input_)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        return grad_output, None


def all_gather(input_: Tensor, process_group) -> Tensor:
    """Differentiable ``all_gather_raw``: (B, ...) per rank -> (world * B, ...)."""
    return AllGatherFunc.apply(input_, process_group)


def reduce_scatter(input_: Tensor, process_group) -> Tensor:
    """Differentiable ``reduce_scatter_raw``: (world * B, ...) per rank -> (B, ...), summed over ranks."""
    return ReduceScatterFunc.apply(input_, process_group)


def all_reduce(input_: Tensor, process_group) -> Tensor:
    """Differentiable ``all_reduce_raw`` (in place on a contiguous non-leaf ``input_``): the sum over ranks."""
    return AllReduceFunc.apply(input_, process_group)


def _flagged(model, flag):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    # sorted by name: ranks may own different parameters (a bias only on rank 0), and every rank must issue the
    # collectives of the flagged ones in one order
    return sorted((name, p) for name, p in model.named_parameters() if getattr(p, flag, False))


def sync_shared_params(model: torch.nn.Module, process_group):
    """Broadcast the parameters marked ``p._shared_params = True`` from the process group's rank 0, so the copies
    that every rank holds (e.g. a replicated norm or bias) start equal."""
    params = _flagged(model, "_shared_params")
    group = dist.group.WORLD if process_group is None else process_group
    # broadcast takes the source as a global rank
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for _, p in params:
            dist.broadcast(p.data, src=src, group=process_group)


def allreduce_sequence_parallel_grad(model: torch.nn.Module, process_group):
    """Sum over the process group the gradients of the parameters marked ``p._sequence_parallel = True``.

    Such parameters (norms, biases applied to sequence-parallel activations) see only this rank's part of the
    sequence, so their full gradient is the sum of the ranks'. One all-reduce per dtype and device."""
    params = _flagged(model, "_sequence_parallel")
    buckets = {}
    for name, p in params:
        if p.grad is None:
            # the ranks would disagree on the flattened layout and the collective would mismatch or hang
            raise RuntimeError(f"allreduce_sequence_parallel_grad: parameter {name} is marked _sequence_parallel "
                               f"but has no gradient")
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    with torch.no_grad():
        for grads in buckets.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=process_group)
            for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(synced.view_as(g))


def get_dim_for_local_rank(dim: int, world_size: int, local_rank: int, multiple_of: int = 1) -> int:
    """This rank's share of ``dim`` split over ``world_size`` ranks in units of ``multiple_of``; the first
    ``(dim / multiple_of) % world_size`` ranks take one unit more. The shares sum to ``dim``."""
    try:
        dim, world_size, local_rank, multiple_of = map(operator.index, (dim, world_size, local_rank, multiple_of))
    except TypeError:
        raise TypeError(f"dim, world_size, local_rank and multiple_of must be ints, got {dim!r}, {world_size!r}, "
                        f"{local_rank!r}, {multiple_of!r}") from None
    if world_size < 1 or multiple_of < 1 or dim < 0:
        raise ValueError(f"need dim >= 0, world_size >= 1 and multiple_of >= 1, got dim={dim}, "
                         f"world_size={world_size}, multiple_of={multiple_of}")
    if not 0 <= local_rank < world_size:
        raise ValueError(f"local_rank must be in [0, world_size={world_size}), got {local_rank}")
    if dim % multiple_of:
        raise ValueError(f"dim={dim} is not a multiple of multiple_of={multiple_of}")
    units, extra = divmod(dim // multiple_of, world_size)
    return (units + (local_rank < extra)) * multiple_of
