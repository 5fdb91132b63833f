"""Dense layers whose backward reduces the bias gradient in a Triton kernel (FA2's
``flash_attn.ops.fused_dense`` import path: ``FusedDense``, ``fused_dense_func``).

The GEMMs are torch's (cuBLAS); what changes is the bias gradient, the column sum of the output
gradient, which torch's dim-0 reduction computes at about a third of the bandwidth on an H200
(``flash_attn.ops.triton.fused_dense``). Under autocast the layer casts its input, weight and bias to
the autocast dtype itself, as autocast's linear would, and returns the gradients in the parameters' own
dtypes. Off CUDA (and without Triton) the plain ``F.linear`` path runs.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .triton import fused_dense as _k
from .triton import use_triton


@torch.library.custom_op("flash_attn_ops::col_sum", mutates_args=("part",))
def _col_sum_op(x: Tensor, part: Tensor) -> None:
    _k.col_sum(x, part)


@_col_sum_op.register_fake
def _(*args):
    return None


def bias_grad(dout: Tensor, dtype: torch.dtype) -> Tensor:
    """Column sums of dout (..., N) in fp32, returned in ``dtype`` (the bias's)."""
    d2 = dout.reshape(-1, dout.shape[-1])
    if d2.stride(-1) != 1:
        d2 = d2.contiguous()
    if not use_triton(d2):
        return d2.sum(0, dtype=torch.float32).to(dtype)
    M, N = d2.shape
    part = torch.empty((_k.col_sum_programs(M, N, d2.device), N), device=d2.device, dtype=torch.float32)
    (_col_sum_op if torch.compiler.is_compiling() else _k.col_sum)(d2, part)
    return part.sum(0).to(dtype)


class FusedDenseFunc(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias):
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dout = dout.to(x.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (dout @ weight).to(x_dtype)  # (..., K)
        if ctx.needs_input_grad[1]:
            dw = (dout.reshape(-1, dout.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(w_dtype)  # (N, K)
        if ctx.needs_input_grad[2]:
            db = bias_grad(dout, b_dtype)
        return dx, dw, db


def fused_dense_func(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, return_residual: bool = False,
                     process_group=None, sequence_parallel: bool = True):
    """F.linear(x, weight, bias) with the bias gradient reduced by a Triton kernel; (out, x) when
    return_residual. Tensor parallelism (process_group) is not supported."""
    if process_group is not None:
        raise NotImplementedError("fused_dense_func: process_group (tensor parallelism) is not supported")
    if (bias is None or not (bias.requires_grad and torch.is_grad_enabled()) or not use_triton(x)
            or x.shape[-1] != weight.shape[-1]):
        out = F.linear(x, weight, bias)  # nothing to gain (or a shape error F.linear words well)
    else:
        out = FusedDenseFunc.apply(x, weight, bias)
    return (out, x) if return_residual else out


class FusedDense(nn.Linear):
    """nn.Linear (same parameters and state dict) whose backward reduces the bias gradient in a Triton
    kernel; forward returns (out, x) when return_residual."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, return_residual: bool = False,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.return_residual = return_residual

    def forward(self, x):
        return fused_dense_func(x, self.weight, self.bias, return_residual=self.return_residual)
