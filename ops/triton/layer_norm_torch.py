"""PyTorch path of the fused dropout + residual add + LayerNorm / RMSNorm (ops/triton/layer_norm.py picks it
where the Triton kernels do not run: see ops/triton/__init__.py's use_triton): the forward and backward of
layer_norm_fwd.py / layer_norm_bwd.py in fp32 tensor ops, with the kernels' dropout mask.
"""
from typing import Optional

import torch
from torch import Tensor

from flash_attn.dropout import hash32, threshold


def _keep_mask_torch(rng_state: Tensor, row0: int, M: int, N: int, p: float, device) -> Tensor:
    # Same hash as the kernel, on int64 tensors; seeds stay tensors so torch.compile needs no .tolist().
    seeds = rng_state.to(device)
    rows = torch.arange(row0, row0 + M, device=device, dtype=torch.int64)
    cols = torch.arange(N, device=device, dtype=torch.int64)
    h = hash32(hash32(rows ^ seeds[0]) ^ seeds[1])
    return hash32(h[:, None] ^ cols[None, :]) >= threshold(p)


def _weight_f32(w: Optional[Tensor], zero_centered: bool) -> Optional[Tensor]:
    if w is None:
        return None
    w = w.float()
    return w + 1.0 if zero_centered else w


def _ln_fwd_torch(x, weight, bias, residual, x1, weight1, bias1, rowscale, rng_state, y, y1, residual_out,
                  dropout_mask, mean, rstd, eps, dropout_p, is_rms_norm, zero_centered_weight):
    M, N = x.shape
    pre = x.float()
    if rowscale is not None:
        pre = pre * rowscale.float()[:, None]
    scale = 1.0 / (1.0 - dropout_p)
    if dropout_p > 0.0:
        keep = _keep_mask_torch(rng_state, 0, M, N, dropout_p, x.device)
        pre = torch.where(keep, pre * scale, 0.0)
        if dropout_mask is not None:
            dropout_mask[:M].copy_(keep)
    if x1 is not None:
        pre1 = x1.float()
        if dropout_p > 0.0:
            keep1 = _keep_mask_torch(rng_state, M, M, N, dropout_p, x.device)
            pre1 = torch.where(keep1, pre1 * scale, 0.0)
            if dropout_mask is not None:
                dropout_mask[M:].copy_(keep1)
        pre = pre + pre1
    if residual is not None:
        pre = pre + residual.float()
    if residual_out is not None:
        residual_out.copy_(pre)
    if is_rms_norm:
        mean.zero_()
        centered = pre
    else:
        mu = pre.mean(dim=1)
        mean.copy_(mu)
        centered = pre - mu[:, None]
    r = torch.rsqrt(centered.square().mean(dim=1) + eps)
    rstd.copy_(r)
    xhat = centered * r[:, None]
    out = xhat * _weight_f32(weight, zero_centered_weight)
    y.copy_(out + bias.float() if bias is not None else out)
    if y1 is not None:
        out1 = xhat * _weight_f32(weight1, zero_centered_weight)
        y1.copy_(out1 + bias1.float() if bias1 is not None else out1)


def _ln_bwd_torch(x, weight, weight1, dy, dy1, dresidual_out, rowscale, rng_state, mean, rstd, dx, dx1,
                  dresidual_in, dw, db, dw1, db1, dropout_p, is_rms_norm, zero_centered_weight):
    M, N = x.shape
    r = rstd[:, None]
    xhat = (x.float() - mean[:, None]) * r if not is_rms_norm else x.float() * r
    dyf = dy.float()
    g = dyf * _weight_f32(weight, zero_centered_weight)
    dw.copy_((dyf * xhat).sum(0))
    if db is not None:
        db.copy_(dyf.sum(0))
    if weight1 is not None:
        dy1f = dy1.float()
        g = g + dy1f * _weight_f32(weight1, zero_centered_weight)
        dw1.copy_((dy1f * xhat).sum(0))
        if db1 is not None:
            db1.copy_(dy1f.sum(0))
    g_xhat = (xhat * g).mean(dim=1, keepdim=True)
    if is_rms_norm:
        d = (g - xhat * g_xhat) * r
    else:
        d = (g - xhat * g_xhat - g.mean(dim=1, keepdim=True)) * r
    if dresidual_out is not None:
        d = d + dresidual_out.float()
    if dresidual_in is not None:
        dresidual_in.copy_(d)
    scale = 1.0 / (1.0 - dropout_p)
    if dx1 is not None:
        d1 = d
        if dropout_p > 0.0:
            d1 = torch.where(_keep_mask_torch(rng_state, M, M, N, dropout_p, x.device), d1 * scale, 0.0)
        dx1.copy_(d1)
    if rowscale is not None:
        d = d * rowscale.float()[:, None]
    if dropout_p > 0.0:
        d = torch.where(_keep_mask_torch(rng_state, 0, M, N, dropout_p, x.device), d * scale, 0.0)
    dx.copy_(d)
