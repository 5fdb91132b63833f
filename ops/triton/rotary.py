"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer", section 3.4) applied to the first
rotary_dim features of each head: pairs (x_a, x_b) are rotated by the angle of their position,

    out_a = x_a * cos - x_b * sin,   out_b = x_a * sin + x_b * cos

with pairs (2i, 2i+1) when interleaved (GPT-J) or (i, i + rotary_dim/2) otherwise (GPT-NeoX). The
backward pass is the same rotation with sin negated (``conjugate=True``). Token s of sequence b sits at
position s + seqlen_offsets[b]; a position past the end of the cos/sin tables is left unrotated.
"""
from typing import Optional, Union

import torch
from torch import Tensor

from . import cdiv, device_ctx, next_power_of_2, tl, triton, use_triton


@triton.jit
def _rotary_kernel(
    OUT, X, COS, SIN, CU_SEQLENS, OFFSETS,
    stride_ob, stride_os, stride_oh, stride_od, stride_xb, stride_xs, stride_xh, stride_xd,
    stride_cs, seqlen, nheads, seqlen_ro, offset,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_OFFSETS_TENSOR: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr,
):
    pid_r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if IS_VARLEN:
        start = tl.load(CU_SEQLENS + b).to(tl.int64)
        seqlen = (tl.load(CU_SEQLENS + b + 1) - start).to(tl.int32)
        X += start * stride_xs
        OUT += start * stride_os
    else:
        X += b * stride_xb
        OUT += b * stride_ob
    if HAS_OFFSETS_TENSOR:
        offset = tl.load(OFFSETS + b).to(tl.int32)
    # Rows are (position, head) pairs of this sequence, so one program covers several heads of a few
    # positions and the cos/sin rows it loads are shared by those heads.
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    s = rows // nheads
    h = rows % nheads
    row_ok = s < seqlen
    k = tl.arange(0, BLOCK_K)
    k_ok = k < HALF
    pos = s + offset
    cs_ok = row_ok & (pos < seqlen_ro) & (pos >= 0)
    cs = pos.to(tl.int64)[:, None] * stride_cs + k[None, :]
    m_cs = cs_ok[:, None] & k_ok[None, :]
    cos = tl.load(COS + cs, mask=m_cs, other=1.0).to(tl.float32)
    sin = tl.load(SIN + cs, mask=m_cs, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin
    if INTERLEAVED:
        col_a = 2 * k
        col_b = 2 * k + 1
    else:
        col_a = k
        col_b = k + HALF
    m = row_ok[:, None] & k_ok[None, :]
    x_row = s.to(tl.int64)[:, None] * stride_xs + h.to(tl.int64)[:, None] * stride_xh
    o_row = s.to(tl.int64)[:, None] * stride_os + h.to(tl.int64)[:, None] * stride_oh
    xa = tl.load(X + x_row + col_a[None, :] * stride_xd, mask=m, other=0.0).to(tl.float32)
    xb = tl.load(X + x_row + col_b[None, :] * stride_xd, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + o_row + col_a[None, :] * stride_od, xa * cos - xb * sin, mask=m)
    tl.store(OUT + o_row + col_b[None, :] * stride_od, xa * sin + xb * cos, mask=m)


# CUDA's limit on a grid's y extent, where the kernel puts the sequences: more run as several launches
_MAX_GRID_Y = 65535


def _strides4(t: Tensor, varlen: bool):
    # (batch, seq, head, dim) strides; varlen tensors (total, head, dim) have no batch stride.
    return (0, *t.stride()) if varlen else t.stride()


def _rotary_launch(
    out: Tensor, x: Optional[Tensor], cos: Tensor, sin: Tensor, seqlen_offsets: Optional[Tensor], offset: int,
    cu_seqlens: Optional[Tensor], max_seqlen: int, interleaved: bool, conjugate: bool,
) -> None:
    """Rotates ``x`` (or ``out`` itself when x is None) into ``out``; shapes as :func:`apply_rotary`."""
    src = out if x is None else x
    varlen = cu_seqlens is not None
    batch = cu_seqlens.shape[0] - 1 if varlen else src.shape[0]
    seqlen = max_seqlen if varlen else src.shape[1]
    nheads = src.shape[-2]
    half = cos.shape[-1]
    if batch == 0 or seqlen == 0 or nheads == 0 or half == 0:
        return
    block_k = next_power_of_2(half)
    block_r = max(1, min(next_power_of_2(seqlen * nheads), max(1, 4096 // block_k)))
    with device_ctx(src):
        # sequences [lo, hi) per launch (grid axis 1): dense, batch slices; varlen, slices of cu_seqlens, whose
        # absolute offsets the kernel reads
        for lo in range(0, batch, _MAX_GRID_Y):
            hi = min(lo + _MAX_GRID_Y, batch)
            whole = lo == 0 and hi == batch
            o, x_, cu = out, src, cu_seqlens
            if not whole:
                if varlen:
                    cu = cu_seqlens[lo:hi + 1]
                else:
                    o, x_ = out[lo:hi], src[lo:hi]
            offs = seqlen_offsets if whole or seqlen_offsets is None else seqlen_offsets[lo:hi]
            _rotary_kernel[(cdiv(seqlen * nheads, block_r), hi - lo)](
                o, x_, cos, sin, cu, offs,
                *_strides4(o, varlen), *_strides4(x_, varlen), cos.stride(0),
                seqlen, nheads, cos.shape[0], offset,
                HALF=half, BLOCK_R=block_r, BLOCK_K=block_k, IS_VARLEN=varlen,
                HAS_OFFSETS_TENSOR=seqlen_offsets is not None, INTERLEAVED=interleaved, CONJUGATE=conjugate,
                num_warps=4,
            )


_rotary_op = torch.library.custom_op("flash_attn_ops::rotary", mutates_args=("out",))(_rotary_launch)


@_rotary_op.register_fake
def _(*args):
    return None


def _positions(x, seqlen_offsets, cu_seqlens):
    """Position of every token: (B, S) dense, (total,) varlen."""
    dev = x.device
    if cu_seqlens is None:
        B, S = x.shape[:2]
        pos = torch.arange(S, device=dev).expand(B, S)
        off = seqlen_offsets.to(dev).view(B, 1) if isinstance(seqlen_offsets, Tensor) else seqlen_offsets
        return pos + off
    total = x.shape[0]
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    tok = torch.arange(total, device=dev)
    b = torch.searchsorted(cu, tok, right=True) - 1
    pos = tok - cu[b]
    if isinstance(seqlen_offsets, Tensor):
        return pos + seqlen_offsets.to(dev)[b]
    return pos + seqlen_offsets


def _rotary_torch(out, x, cos, sin, seqlen_offsets, cu_seqlens, interleaved, conjugate):
    src = out if x is None else x
    half = cos.shape[-1]
    pos = _positions(src, seqlen_offsets, cu_seqlens)
    ok = (pos >= 0) & (pos < cos.shape[0])
    idx = pos.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(ok[..., None], cos.float()[idx], 1.0).unsqueeze(-2)  # (..., 1, half)
    s = torch.where(ok[..., None], sin.float()[idx], 0.0).unsqueeze(-2)
    if conjugate:
        s = -s
    xr = src[..., : 2 * half].float()
    if interleaved:
        xa, xb = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((xa * c - xb * s, xa * s + xb * c), dim=-1).flatten(-2)
    else:
        xa, xb = xr[..., :half], xr[..., half:]
        rot = torch.cat((xa * c - xb * s, xa * s + xb * c), dim=-1)
    out[..., : 2 * half].copy_(rot)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: Union[int, Tensor] = 0,
                 cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None, interleaved=False,
                 inplace=False, conjugate=False) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of every head (no autograd).

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens int32
    (batch + 1,) and max_seqlen. cos, sin: (seqlen_ro, rotary_dim / 2), seqlen_ro >= seqlen.
    seqlen_offsets: int or int tensor (batch,), added to each sequence's positions. inplace writes into x.
    conjugate rotates by the negative angle (the backward pass). Returns a tensor shaped like x.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError("x must be a floating-point tensor")
    varlen = cu_seqlens is not None
    if x.dim() != (3 if varlen else 4):
        raise ValueError(f"x must be {'(total, nheads, headdim) with cu_seqlens' if varlen else '(batch, seqlen, nheads, headdim)'}"
                         f", got shape {tuple(x.shape)}")
    if cos.shape != sin.shape or cos.dim() != 2:
        raise ValueError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must have the same dtype, got {cos.dtype} and {sin.dtype}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim (2 * cos.shape[-1] = {rotary_dim}) must be <= headdim {x.shape[-1]}")
    if varlen:
        if max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError("cu_seqlens must be an int32 tensor (batch + 1,)")
        batch, seqlen = cu_seqlens.shape[0] - 1, int(max_seqlen)
    else:
        batch, seqlen = x.shape[0], x.shape[1]
    if seqlen > cos.shape[0]:
        raise ValueError(f"cos/sin have {cos.shape[0]} positions (seqlen_ro), fewer than seqlen {seqlen}")
    if isinstance(seqlen_offsets, Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seqlen_offsets tensor must be int32/int64 of shape ({batch},), got "
                             f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)}")
    elif isinstance(seqlen_offsets, int):
        if seqlen_offsets < 0 or seqlen_offsets + seqlen > cos.shape[0]:
            raise ValueError(f"seqlen_offsets + seqlen ({seqlen_offsets} + {seqlen}) must be within the "
                             f"{cos.shape[0]} positions of cos/sin")
    else:
        raise TypeError(f"seqlen_offsets must be an int or a tensor, got {type(seqlen_offsets).__name__}")
    if inplace:
        out, src = x, None
    else:
        out, src = torch.empty_like(x), x
        if rotary_dim < x.shape[-1]:
            out[..., rotary_dim:].copy_(x[..., rotary_dim:])
    if use_triton(x):
        off_t = seqlen_offsets if isinstance(seqlen_offsets, Tensor) else None
        off_i = seqlen_offsets if isinstance(seqlen_offsets, int) else 0
        # The custom op is what torch.compile traces; eager calls skip its dispatcher overhead.
        launch = _rotary_op if torch.compiler.is_compiling() else _rotary_launch
        launch(out, src, cos, sin, off_t, off_i, cu_seqlens, seqlen, bool(interleaved), bool(conjugate))
    else:
        _rotary_torch(out, src, cos, sin, seqlen_offsets, cu_seqlens, interleaved, conjugate)
    return out
