"""Rotary position embeddings (RoPE, Su et al. 2021, "RoFormer") and XPos (Sun et al. 2022,
"A Length-Extrapolatable Transformer", section 3.2) for attention inputs, API of FA2's
``flash_attn.layers.rotary``. The rotation itself is :func:`flash_attn.ops.triton.rotary.apply_rotary`
(Triton kernel, or plain PyTorch on CPU); its backward pass is the rotation by the negative angle.
"""
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from flash_attn.ops.triton.rotary import apply_rotary


def rotate_half(x: Tensor, interleaved: bool = False) -> Tensor:
    """(x_a, x_b) -> (-x_b, x_a) over the pairs of the last dim (halves, or even/odd if interleaved)."""
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Reference rotation without offsets. x: (batch, seqlen, nheads, headdim); cos, sin: (seqlen,
    rotary_dim / 2) or (batch, seqlen, rotary_dim / 2)."""
    ro_dim = cos.shape[-1] * 2
    if ro_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {ro_dim} must be <= headdim {x.shape[-1]}")
    if interleaved:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xr = x[..., :ro_dim]
    return torch.cat((xr * cos + rotate_half(xr, interleaved) * sin, x[..., ro_dim:]), dim=-1)


def _save_offsets(ctx, seqlen_offsets, *tensors):
    if isinstance(seqlen_offsets, Tensor):
        ctx.save_for_backward(*tensors, seqlen_offsets)
        ctx.seqlen_offsets = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.seqlen_offsets = seqlen_offsets


def _load_offsets(ctx):
    saved = ctx.saved_tensors
    if ctx.seqlen_offsets is None:
        return saved[:-1], saved[-1]
    return saved, ctx.seqlen_offsets


def _mark_rotated(ctx, x):
    """x was rotated in place: its version counter moves, so a copy of it that another op saved is caught at that op's
    backward. A leaf that requires grad cannot be marked dirty (autograd refuses in-place ops on one); as FA2 does, its
    storage holds the rotation and the returned alias of it carries the gradient to it."""
    if x.is_leaf and x.requires_grad:
        torch.autograd.graph.increment_version(x)
    else:
        ctx.mark_dirty(x)


class ApplyRotaryEmb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                max_seqlen=None):
        out = apply_rotary(x, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                           max_seqlen=max_seqlen, interleaved=interleaved, inplace=inplace)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cu_seqlens)
        ctx.interleaved, ctx.inplace, ctx.max_seqlen = interleaved, inplace, max_seqlen
        if inplace:
            _mark_rotated(ctx, x)
            return x
        return out

    @staticmethod
    def backward(ctx, dout):
        (cos, sin, cu_seqlens), seqlen_offsets = _load_offsets(ctx)
        # Never in place on dout: autograd may hand the same gradient tensor to other inputs too
        # (the two operands of an add), which would then see the rotated values.
        dx = apply_rotary(dout, cos, sin, seqlen_offsets=seqlen_offsets, cu_seqlens=cu_seqlens,
                          max_seqlen=ctx.max_seqlen, interleaved=ctx.interleaved, conjugate=True)
        return dx, None, None, None, None, None, None, None


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: Union[int, Tensor] = 0, cu_seqlens: Optional[Tensor] = None,
                     max_seqlen: Optional[int] = None) -> Tensor:
    """Rotary embedding of the first rotary_dim = 2 * cos.shape[-1] features of each head.

    x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens (batch + 1,)
    int32 and max_seqlen. cos, sin: (seqlen_rotary, rotary_dim / 2). interleaved: rotate pairs of even
    and odd features (GPT-J) instead of the two halves (GPT-NeoX). seqlen_offsets: int or (batch,) int
    tensor shifting each sequence's positions (KV-cache decoding). Returns a tensor shaped like x.
    """
    return ApplyRotaryEmb.apply(x, cos, sin, interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)


apply_rotary_emb_func = apply_rotary_emb  # FA2's older name


def _split_qkv(qkv: Tensor, num_heads_q: Optional[int]):
    """(q, k) views of a packed qkv: (B, S, 3, H, D), or (B, S, Hq + 2 * Hk, D) with num_heads_q."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.dim() != 4 or num_heads_q is None:
        raise ValueError("qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, "
                         f"num_heads_q + 2 * num_heads_k, headdim) with num_heads_q given; got {tuple(qkv.shape)}"
                         f" and num_heads_q={num_heads_q}")
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q <= 0 or qkv.shape[2] != num_heads_q + 2 * num_heads_k:
        raise ValueError(f"qkv's {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) + 2 * num_heads_k")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def _rotate_qk_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate):
    if cos_k is None and sin_k is None:
        # With one table for q and k, their heads form one evenly strided run: a single launch.
        if qkv.dim() == 5 and qkv.stride(2) == qkv.shape[3] * qkv.stride(3):
            B, S, _, H, D = qkv.shape
            qk = qkv[:, :, :2].view(B, S, 2 * H, D)
            apply_rotary(qk, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)
            return
        if qkv.dim() == 4:
            qk = qkv[:, :, :num_heads_q + (qkv.shape[2] - num_heads_q) // 2]
            apply_rotary(qk, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)
            return
    q, k = _split_qkv(qkv, num_heads_q)
    apply_rotary(q, cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True, conjugate=conjugate)
    apply_rotary(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k, seqlen_offsets,
                 interleaved=interleaved, inplace=True, conjugate=conjugate)


class ApplyRotaryEmbQKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0,
                num_heads_q=None):
        _split_qkv(qkv, num_heads_q)  # validates the layout
        _rotate_qk_(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q, conjugate=False)
        _save_offsets(ctx, seqlen_offsets, cos, sin, cos_k, sin_k)
        ctx.interleaved, ctx.num_heads_q = interleaved, num_heads_q
        _mark_rotated(ctx, qkv)
        return qkv

    @staticmethod
    def backward(ctx, dqkv):
        (cos, sin, cos_k, sin_k), seqlen_offsets = _load_offsets(ctx)
        dqkv = dqkv.clone(memory_format=torch.contiguous_format)  # see ApplyRotaryEmb.backward
        _rotate_qk_(dqkv, cos, sin, cos_k, sin_k, ctx.interleaved, seqlen_offsets, ctx.num_heads_q,
                    conjugate=True)
        return dqkv, None, None, None, None, None, None, None


def apply_rotary_emb_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Optional[Tensor] = None,
                          sin_k: Optional[Tensor] = None, interleaved: bool = False,
                          seqlen_offsets: Union[int, Tensor] = 0, num_heads_q: Optional[int] = None) -> Tensor:
    """Rotary embedding applied in place to q and k of a packed qkv.

    qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim)
    (MQA/GQA) with num_heads_q. cos, sin: (seqlen, rotary_dim / 2) for q (and k); cos_k, sin_k: separate
    tables for k (XPos). Returns qkv.
    """
    return ApplyRotaryEmbQKV_.apply(qkv, cos, sin, cos_k, sin_k, interleaved, seqlen_offsets, num_heads_q)


class ApplyRotaryEmbKV_(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, cos, sin, interleaved=False, seqlen_offsets=0):
        if kv.dim() != 5 or kv.shape[2] != 2:
            raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got {tuple(kv.shape)}")
        apply_rotary(kv[:, :, 0], cos, sin, seqlen_offsets, interleaved=interleaved, inplace=True)
        _save_offsets(ctx, seqlen_offsets, cos, sin)
        ctx.interleaved = interleaved
        _mark_rotated(ctx, kv)
        return kv

    @staticmethod
    def backward(ctx, dkv):
        (cos, sin), seqlen_offsets = _load_offsets(ctx)
        dkv = dkv.clone(memory_format=torch.contiguous_format)  # see ApplyRotaryEmb.backward
        apply_rotary(dkv[:, :, 0], cos, sin, seqlen_offsets, interleaved=ctx.interleaved, inplace=True,
                     conjugate=True)
        return dkv, None, None, None, None


def apply_rotary_emb_kv_(kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                         seqlen_offsets: Union[int, Tensor] = 0) -> Tensor:
    """Rotary embedding applied in place to k of a packed kv (batch, seqlen, 2, nheads, headdim).
    cos, sin: (seqlen, rotary_dim / 2). Returns kv."""
    return ApplyRotaryEmbKV_.apply(kv, cos, sin, interleaved, seqlen_offsets)


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding with cached cos/sin tables; XPos (length-extrapolatable scaling of q by
    zeta^(n/scale_base) and k by its inverse) when scale_base is set (512 is a common choice).

    forward rotates qkv (and kv) in place; see :meth:`forward` for shapes.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False,
                 scale_base: Optional[float] = None, pos_idx_in_fp32: bool = True, device=None):
        super().__init__()
        if dim <= 0 or dim % 2:
            raise ValueError(f"dim (the rotary dim) must be a positive even number, got {dim}")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        scale = self._compute_scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _compute_scale(self, device=None):
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None):
        if (seqlen <= self._seq_len_cached and self._cos_cached is not None
                and self._cos_cached.device == device and self._cos_cached.dtype == dtype
                # a table built under inference_mode cannot enter autograd; rebuild it for training
                # (never while compiling: Dynamo cannot trace is_inference, and traced tables are normal)
                and not (self.training and not torch.compiler.is_compiling()
                         and self._cos_cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # Angles in fp32 whatever the module's dtype: position * inv_freq reaches ~seqlen radians, where
        # bf16 keeps no fractional digits at all.
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._compute_inv_freq(device)
        if self.pos_idx_in_fp32:
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
        else:
            t = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, inv_freq.to(device=device, dtype=t.dtype)).float()
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._compute_scale(device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2) / self.scale_base
        zeta = scale.to(device)[None, :] ** power[:, None]  # (seqlen, dim / 2), fp32
        self._cos_cached, self._sin_cached = (cos * zeta).to(dtype), (sin * zeta).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / zeta).to(dtype), (sin / zeta).to(dtype)

    def forward(self, qkv: Tensor, kv: Optional[Tensor] = None, seqlen_offset: Union[int, Tensor] = 0,
                max_seqlen: Optional[int] = None, num_heads_q: Optional[int] = None
                ) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k,
        headdim) with num_heads_q; or, when kv (batch, seqlen, 2, nheads, headdim) is given, just q
        (batch, seqlen, nheads, headdim). seqlen_offset: int or (batch,) tensor; with a tensor pass
        max_seqlen so the tables cover every position. Rotates in place; returns qkv, or (q, kv).
        """
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        elif self._cos_cached is None or self._cos_cached.device != qkv.device:
            raise ValueError("a tensor seqlen_offset needs max_seqlen (the cos/sin tables must cover it)")
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                                         num_heads_q=num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, interleaved=self.interleaved, inplace=True,
                             seqlen_offsets=seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, interleaved=self.interleaved,
                                  seqlen_offsets=seqlen_offset)
        return q, kv
