"""FA4's split-KV helpers beside the attention calls: ``flash_attn_combine`` (merge partial attention results) and
``get_scheduler_metadata`` (the varlen scheduler's precomputed tensors).

Combining parts: part s of a row holds o_s (normalised by its own row sum) and lse_s, the natural-log sum of its
exponentiated scores; the whole row has lse = log(sum_s exp(lse_s)) and o = sum_s exp(lse_s - lse) o_s. A part that
saw no key (lse -inf, or +inf as this package's split kernel writes it) adds nothing; a row no part saw gets o = 0
and lse = -inf.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, cu_seqlens=None, seqused=None,
                       virtual_batch_idx=None, return_lse=True):
    """Merges split-KV parts, with FA4's signature. out_partial (num_splits, B, S, H, D) or, varlen,
    (num_splits, total_q, H, D); lse_partial (num_splits, B, S, H) or (num_splits, total_q, H), fp32. Returns
    (out, lse): out (B, S, H, D) / (total_q, H, D) in out_dtype (default out_partial's), written into ``out`` when
    given; lse (B, S, H) / (total_q, H) fp32 (a transposed view of (B, H, S) / (H, total_q) storage, as FA4's), or
    None without return_lse. cu_seqlens / seqused (varlen bounds) change no value: every row is combined.
    virtual_batch_idx (FA4's persistent-scheduler batch order) raises NotImplementedError."""
    if virtual_batch_idx is not None:
        raise NotImplementedError("flash_attn_combine: virtual_batch_idx is not implemented here; leave it None")
    if not isinstance(out_partial, torch.Tensor) or out_partial.dim() not in (4, 5):
        raise ValueError("out_partial must be a tensor (num_splits, B, S, H, D) or (num_splits, total_q, H, D)")
    if not isinstance(lse_partial, torch.Tensor) or tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial must have shape {tuple(out_partial.shape[:-1])} (out_partial's without its "
                         f"last dim), got {tuple(getattr(lse_partial, 'shape', ()))}")
    for name, t in (("cu_seqlens", cu_seqlens), ("seqused", seqused)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor or None")
    dtype = out_dtype or out_partial.dtype
    lse_parts = lse_partial.float()
    terms = torch.where(torch.isinf(lse_parts), torch.full_like(lse_parts, -math.inf), lse_parts)
    lse = torch.logsumexp(terms, 0)  # (..., H); -inf where no part saw a key
    weights = torch.where(torch.isfinite(lse), torch.exp(terms - lse), torch.zeros_like(terms))
    combined = (out_partial.float() * weights.unsqueeze(-1)).sum(0)
    if out is None:
        out = combined.to(dtype)
    else:
        if tuple(out.shape) != tuple(combined.shape):
            raise ValueError(f"out must have shape {tuple(combined.shape)}, got {tuple(out.shape)}")
        out.copy_(combined)
    if not return_lse:
        return out, None
    # FA4's layout: heads-major storage, returned transposed to (..., S, H)
    lse_hm = lse.movedim(-1, -2).contiguous() if lse.dim() == 3 else lse.t().contiguous()
    return out, lse_hm.transpose(-1, -2)


class SchedulerMetadataTensorsTorch(NamedTuple):
    """FA4's varlen scheduler metadata (its field names). This package's varlen kernels schedule without it, so
    get_scheduler_metadata fills no field and a call that passes it back runs as without it."""

    num_m_blocks_ptr: Optional[torch.Tensor] = None
    num_splits_dynamic_ptr: Optional[torch.Tensor] = None
    virtual_batch_idx_ptr: Optional[torch.Tensor] = None
    num_nheads_in_l2_ptr: Optional[torch.Tensor] = None
    tile_count_semaphore: Optional[torch.Tensor] = None
    cu_total_m_blocks: Optional[torch.Tensor] = None
    cu_total_splits_m_blocks: Optional[torch.Tensor] = None
    blocks_to_batch_idx: Optional[torch.Tensor] = None


def get_scheduler_metadata(max_seqlen_q, max_seqlen_k, nheads, nheads_kv, headdim, num_splits, headdim_v=None,
                           pack_gqa=None, causal=False, window_size_left=None, window_size_right=None,
                           seqlen_k_new=0, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                           seqused_q=None, seqused_k=None, leftpad_k=None, seqlen_k_per_split=None, _arch=None):
    """FA4's signature; returns an empty SchedulerMetadataTensorsTorch (see there): nothing to precompute here."""
    if nheads % nheads_kv:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    return SchedulerMetadataTensorsTorch()
