"""FlashAttention 2's older fused norm API, ``flash_attn.ops.layer_norm`` (its RMSNorm twin is
``flash_attn.ops.rms_norm``): dropout + residual add + LayerNorm (Ba et al. 2016) with FA2's signatures, argument
order, defaults and return values, built on the fused front end ``flash_attn.ops.triton.layer_norm.layer_norm_fn``
(Triton kernels; its PyTorch path on a CPU).

Per row, with s = 1 / (1 - dropout_p) and keep the dropout mask (one bit per element of x0):

    pre = keep * s * x0 * rowscale * layerscale (+ keep1 * s * x1) (+ residual)      (fp32)
    out = LayerNorm(pre) * weight + bias                                            (x0's dtype)

``pre`` (returned with prenorm) has residual's dtype, else fp32 with residual_in_fp32, else x0's dtype. The
mask is returned as uint8 with return_dropout_mask (all ones without dropout), and it is reproducible: the
kernels draw it from a hash of a seed taken from torch's generator (flash_attn.dropout), so torch.manual_seed
repeats it. The subset form (stochastic depth over whole sequences) reads x0 rows and writes output rows through
1-based row maps: row r of the residual stream takes x0 row x0_subset[r] - 1 (none where 0), times rowscale_const,
and output row out_subset[r] - 1 of out_numrows (none where 0) is row r's norm.

layerscale is applied in fp32 on the way in (the input becomes an fp32 copy of x0 * layerscale), so its gradient
is summed in fp32; the subset form gathers and scatters rows with index ops around the same kernel (which then
normalises every row of the residual stream, output rows or not). Row maps are not checked for values (that would
cost a host sync): an index past x0's rows or out_numrows fails in the index op (a device-side assert on CUDA).
Unlike FA2's kernel, which applies rowscale_const only together with x0_subset, rowscale_const always scales x0.
rowscale gets no gradient, as in FA2.
"""
from numbers import Integral, Real
from typing import Optional

import torch
from torch import Tensor
from torch.nn import init

from .triton.layer_norm import layer_norm_fn


def _check_x0(x0):
    if not isinstance(x0, Tensor) or not x0.is_floating_point() or x0.dim() == 0:
        raise TypeError("x0 must be a floating-point tensor of shape (..., hidden_size)")


def _check_vector(name: str, t: Optional[Tensor], x0: Tensor):
    N = x0.shape[-1]
    if t is None:
        return
    if not isinstance(t, Tensor) or tuple(t.shape) != (N,):
        raise ValueError(f"{name} must be a tensor of shape ({N},) (the hidden size of x0), got "
                         f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if t.device != x0.device:
        raise ValueError(f"{name} must be on x0's device {x0.device}, got {t.device}")


def _check_epsilon(epsilon):
    if not isinstance(epsilon, Real) or epsilon < 0:
        raise ValueError(f"epsilon must be a number >= 0, got {epsilon!r}")


def _residual_dtype(x0: Tensor, residual: Optional[Tensor], residual_in_fp32: bool) -> torch.dtype:
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else x0.dtype


def _scaled(x0: Tensor, layerscale: Optional[Tensor]) -> Tensor:
    # In fp32, as the CUDA kernels scale: a half-precision product would round once more before the norm.
    return x0 if layerscale is None else x0.float() * layerscale.float()


def _mask_u8(mask: Optional[Tensor], x0: Tensor) -> Tensor:
    """FA2's dropout mask of x0's shape: uint8, all ones where nothing was dropped."""
    if mask is None:
        return torch.ones(x0.shape, dtype=torch.uint8, device=x0.device)
    return mask.to(torch.uint8).reshape(x0.shape)


def _as_x0_blocks(t: Tensor, x0: Tensor, what: str) -> Tensor:
    """(rows, N) -> (-1, *x0.shape[1:]), FA2's shape for the subset outputs."""
    per_block = x0.shape[1:-1].numel()
    if t.shape[0] % per_block:
        raise ValueError(f"{what} has {t.shape[0]} rows, not a multiple of the {per_block} rows of one "
                         f"{tuple(x0.shape[1:-1])} block of x0 (shape {tuple(x0.shape)})")
    return t.reshape(-1, *x0.shape[1:])


def _split(outs, n_y: int, prenorm: bool, return_dropout_mask: bool):
    """layer_norm_fn's outputs as (ys, pre, masks)."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    ys, rest = list(outs[:n_y]), outs[n_y:]
    pre = None
    if prenorm:
        pre, rest = rest[0], rest[1:]
    masks = list(rest) if return_dropout_mask else []
    return ys, pre, masks


def _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                      residual_in_fp32, return_dropout_mask, is_rms_norm):
    _check_x0(x0)
    _check_vector("layerscale", layerscale, x0)
    _check_epsilon(epsilon)
    x = _scaled(x0, layerscale)
    res_dtype = _residual_dtype(x0, residual, residual_in_fp32)
    outs = layer_norm_fn(x, weight, bias, residual=residual, eps=epsilon, dropout_p=dropout_p, rowscale=rowscale,
                         prenorm=prenorm, residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm,
                         return_dropout_mask=return_dropout_mask, out_dtype=x0.dtype)
    (y,), pre, masks = _split(outs, 1, prenorm, return_dropout_mask)
    result = [y]
    if prenorm:
        # Without a residual the kernel gives the sum the dtype of its input, fp32 after layerscale.
        result.append(pre.to(res_dtype))
    if return_dropout_mask:
        result.append(_mask_u8(masks[0], x0))
    return result[0] if len(result) == 1 else tuple(result)


def _row_map(name: str, t, rows: Optional[int], x0: Tensor) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor of 1-based row indices (0 = no row)")
    if t.device != x0.device:
        raise ValueError(f"{name} must be on x0's device {x0.device}, got {t.device}")
    if rows is not None and t.numel() != rows:
        raise ValueError(f"{name} must have one entry per row of the residual stream ({rows}), got shape "
                         f"{tuple(t.shape)}")
    return t.reshape(-1).long()


def _scatter_rows(rows: Tensor, index: Tensor, numrows: int, fill) -> Tensor:
    """(numrows, N): row index[r] - 1 is rows[r] for index[r] > 0, the rest ``fill``. Rows with index 0 go to a
    spare row that is cut off."""
    spare = torch.full((numrows + 1, rows.shape[1]), fill, dtype=rows.dtype, device=rows.device)
    return spare.index_copy(0, torch.where(index > 0, index - 1, numrows), rows)[:numrows]


def _dropout_add_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset, out_subset,
                             rowscale_const, out_numrows, prenorm, residual_in_fp32, return_dropout_mask,
                             is_rms_norm):
    _check_x0(x0)
    _check_vector("layerscale", layerscale, x0)
    _check_epsilon(epsilon)
    if not isinstance(rowscale_const, Real):
        raise TypeError(f"rowscale_const must be a number, got {type(rowscale_const).__name__}")
    N = x0.shape[-1]
    x0_rows = _scaled(x0, layerscale).reshape(-1, N)
    if x0_subset is not None:
        src = _row_map("x0_subset", x0_subset, None, x0)
        # Row 0 of the padded copy is zeros: index 0 (a dropped row) reads it, and no row of x0 is multiplied by 0
        # (an inf there would turn into NaN).
        x = torch.cat([x0_rows.new_zeros(1, N), x0_rows]).index_select(0, src)
    else:
        x = x0_rows
    M = x.shape[0]
    if residual is not None:
        if not isinstance(residual, Tensor) or residual.numel() != M * N or residual.shape[-1] != N:
            raise ValueError(f"residual must hold {M} rows of {N} (one per entry of x0_subset, else per row of x0), "
                             f"got shape {tuple(residual.shape) if isinstance(residual, Tensor) else None}")
        residual = residual.reshape(M, N)
    if out_subset is not None:
        if not isinstance(out_numrows, Integral) or out_numrows < 0:
            raise ValueError(f"out_numrows must be an int >= 0 (rows of the output), got {out_numrows!r}")
        dst = _row_map("out_subset", out_subset, M, x0)
    rowscale = None
    if rowscale_const != 1.0:
        rowscale = torch.full((M,), float(rowscale_const), dtype=torch.float32, device=x0.device)
    res_dtype = _residual_dtype(x0, residual, residual_in_fp32)
    outs = layer_norm_fn(x, weight, bias, residual=residual, eps=epsilon, dropout_p=dropout_p, rowscale=rowscale,
                         prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                         is_rms_norm=is_rms_norm, return_dropout_mask=return_dropout_mask, out_dtype=x0.dtype)
    (y,), pre, masks = _split(outs, 1, prenorm, return_dropout_mask)
    if out_subset is not None:
        y = _scatter_rows(y, dst, int(out_numrows), 0)
    result = [_as_x0_blocks(y, x0, "the output (out_numrows)" if out_subset is not None else "the output")]
    if prenorm:
        result.append(_as_x0_blocks(pre.to(res_dtype), x0, "the pre-norm sum"))
    if return_dropout_mask:
        mask = masks[0]
        if mask is None or x0_subset is None:
            result.append(_mask_u8(mask, x0))
        else:
            # Back to x0's rows: full row r drew the bits of x0 row x0_subset[r] - 1; rows no one read stay ones.
            rows = _scatter_rows(mask.reshape(M, N).to(torch.uint8), src, x0_rows.shape[0], 1)
            result.append(rows.reshape(x0.shape))
    return result[0] if len(result) == 1 else tuple(result)


def _dropout_add_norm_parallel(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                               residual_in_fp32, return_dropout_mask, is_rms_norm):
    _check_x0(x0)
    _check_epsilon(epsilon)
    outs = layer_norm_fn(x0, weight0, bias0, residual=residual, x1=x1, weight1=weight1, bias1=bias1, eps=epsilon,
                         dropout_p=dropout_p, prenorm=prenorm, residual_in_fp32=residual_in_fp32,
                         is_rms_norm=is_rms_norm, return_dropout_mask=return_dropout_mask, out_dtype=x0.dtype)
    ys, pre, masks = _split(outs, 2 if weight1 is not None else 1, prenorm, return_dropout_mask)
    result = [ys[0], ys[1] if weight1 is not None else None]
    if prenorm:
        result.append(pre)
    if return_dropout_mask:
        result.extend(_mask_u8(m, x0) for m in masks)
    return tuple(result)


# -------------------------------------------------------------------------------------------- public API
def layer_norm(x, weight, bias, epsilon):
    """LayerNorm of x (..., hidden_size) with weight, bias (hidden_size,); output in x's dtype."""
    return _dropout_add_norm(x, None, weight, bias, 0.0, epsilon, None, None, False, False, False, False)


def dropout_add_layer_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale=None, layerscale=None,
                           prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """LayerNorm(dropout(x0 * rowscale * layerscale) + residual) * weight + bias.

    x0, residual: (..., hidden_size); weight, bias, layerscale: (hidden_size,); rowscale: (...,) one scale per row.
    residual_in_fp32 only has an effect if residual is None (else the pre-norm sum has residual's dtype).
    Returns out (x0's dtype), then the pre-norm sum if prenorm, then the uint8 dropout mask (x0's shape) if
    return_dropout_mask.
    """
    return _dropout_add_norm(x0, residual, weight, bias, dropout_p, epsilon, rowscale, layerscale, prenorm,
                             residual_in_fp32, return_dropout_mask, False)


def dropout_add_layer_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale=None, x0_subset=None,
                                  out_subset=None, rowscale_const=1.0, out_numrows=0, prenorm=False,
                                  residual_in_fp32=False, return_dropout_mask=False):
    """:func:`dropout_add_layer_norm` over row subsets (stochastic depth on whole sequences).

    x0: (rows of x0, ..., hidden_size); x0_subset, out_subset: int32/int64 (M,) or (B, S), 1-based row maps (module
    docstring); residual: M rows. x0 rows are scaled by rowscale_const. Returns out with out_numrows rows (all M
    rows without out_subset), shaped (-1, *x0.shape[1:]); then the pre-norm sum (M rows, same shaping) if prenorm;
    then the uint8 dropout mask of x0's shape if return_dropout_mask.
    """
    return _dropout_add_norm_subset(x0, residual, weight, bias, dropout_p, epsilon, layerscale, x0_subset,
                                    out_subset, rowscale_const, out_numrows, prenorm, residual_in_fp32,
                                    return_dropout_mask, False)


def dropout_add_layer_norm_parallel_residual(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon,
                                             prenorm=False, residual_in_fp32=False, return_dropout_mask=False):
    """pre = dropout(x0) + dropout(x1) + residual, normalised twice: out0 with (weight0, bias0), out1 with
    (weight1, bias1) (None when weight1 is None: a tied norm). x0, x1, residual: (..., hidden_size); x1 and
    residual optional. Returns (out0, out1), then pre if prenorm, then the uint8 masks of x0 and x1 if
    return_dropout_mask.
    """
    return _dropout_add_norm_parallel(x0, x1, residual, weight0, bias0, weight1, bias1, dropout_p, epsilon, prenorm,
                                      residual_in_fp32, return_dropout_mask, False)


class DropoutAddLayerNorm(torch.nn.Module):
    """LayerNorm(dropout(x0) + residual) with parameters weight, bias (hidden_size,); dropout p in training only.
    forward(x0, residual=None) -> out, or (out, pre-norm sum) with prenorm."""

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None,
                 dtype=None):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        self.prenorm = prenorm
        self.p = p
        self.eps = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, **factory_kwargs))
        self.reset_parameters()

    def reset_parameters(self):
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x0, residual=None):
        return dropout_add_layer_norm(x0, residual, self.weight, self.bias, self.p if self.training else 0.0,
                                      self.eps, prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32)
