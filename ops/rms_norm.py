"""FlashAttention 2's ``flash_attn.ops.rms_norm``: the RMSNorm (Zhang & Sennrich 2019) forms of
``flash_attn.ops.layer_norm`` (same signatures and return values; that module's docstring gives the semantics),
out = pre * rsqrt(mean(pre^2) + eps) * weight (+ bias).
"""
import torch
from torch.nn import init

from .layer_norm import _dropout_add_norm, _dropout_add_norm_parallel, _dropout_add_norm_subset


def rms_norm(x, weight, epsilon):
    """RMSNorm of x (..., hidden_size) with weight (hidden_size,); output in x's dtype."""
    return _dropout_add_norm(x, None, weight, None, 0.0, epsilon, None, None, False, False, False, True)


def dropout_add_rms_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                         prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """RMSNorm(dropout(x0 * rowscale * layerscale) + residual) * weight (+ bias); shapes and returns as
    flash_attn.ops.layer_norm.dropout_add_layer_norm."""
    return _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                             residual_in_fp32, return_dropout_mask, True)


def dropout_add_rms_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale=None, x0_subset=None,
                                out_subset=None, rowscale_const=1.0, out_numrows=0, prenorm=False,
                                residual_in_fp32=False, return_dropout_mask=False):
    """RMSNorm form of flash_attn.ops.layer_norm.dropout_add_layer_norm_subset."""
    return _dropout_add_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset,
                                    out_subset, rowscale_const, out_numrows, prenorm, residual_in_fp32,
                                    return_dropout_mask, True)


def dropout_add_rms_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """RMSNorm form of flash_attn.ops.layer_norm.dropout_add_layer_norm_parallel_residual."""
    return _dropout_add_norm_parallel(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                      residual_in_fp32, return_dropout_mask, True)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim with a weight (hidden_size,) (no bias). forward(x) -> x's shape and dtype."""

    def __init__(self, hidden_size, eps=1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        init.ones_(self.weight)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class DropoutAddRMSNorm(torch.nn.Module):
    """RMSNorm(dropout(x0) + residual) with a weight (hidden_size,); dropout p in training only.
    forward(x0, residual=None) -> out, or (out, pre-norm sum) with prenorm."""

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None,
                 dtype=None):
        super().__init__()
        self.prenorm = prenorm
        self.p = p
        self.eps = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        init.ones_(self.weight)

    def forward(self, x0, residual=None):
        return dropout_add_rms_norm(x0, residual, self.weight, None, self.p if self.training else 0.0, self.eps,
                                    prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
