"""FA4's split-KV helpers beside the attention calls: ``flash_attn_combine`` (merge partial attention results) and
``get_scheduler_metadata`` (the varlen scheduler's precomputed tensors).

Combining parts: part s of a row holds o_s (normalised by its own row sum) and lse_s, the natural-log sum of its
exponentiated scores; the whole row has lse = log(sum_s exp(lse_s)) and o = sum_s exp(lse_s - lse) o_s. A part that
saw no key (lse -inf, or +inf as this package's split kernel writes it) adds nothing; a row no part saw gets o = 0
and lse = -inf; a NaN lse makes the row's lse NaN and its o 0.

On CUDA tensors (and on CPU ones under TRITON_INTERPRET=1, bf16 aside: the interpreter computes it wrongly) one
Triton launch does it all: a program per (block of rows, head, slice of D) reads the parts' lse of its rows (max,
then the sum of exp relative to it), then each part's lse and o rows once more, a few parts at a time where the rows
are few (decoding), accumulating in fp32, and writes o and lse. Memory traffic: o_s read once, lse_s three times
(1/D of o's bytes each), o and lse written once, where the torch expression below makes about six passes and fp32
temporaries of out_partial's size. The torch expression (``combine_torch``) serves elsewhere: CPU tensors, no
Triton (flash-attn-4 does not require it), other dtypes, autograd (the kernel has no backward) and torch.compile's
tracing (Inductor fuses it there).
"""
from __future__ import annotations

import importlib.util
import math
from typing import NamedTuple, Optional

import torch

from flash_attn.cute import settings
from flash_attn.cute.triton_launch import launch as _launch

_INTERPRET = settings.current.triton_interpret
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Triton is imported with the kernel, at its first launch (_combine_triton): importing it costs a first call of
# this package ~0.1-0.3 s that a call without a split never needs.
HAS_TRITON = importlib.util.find_spec("triton") is not None  # (installed; whether it imports: _kernel)
_kernel_fn = []  # [the kernel] once imported, [None] when Triton does not import


def _kernel():
    """The Triton kernel (module _combine_triton), imported on first use; None when Triton does not import (a broken
    install: the torch path serves)."""
    if not _kernel_fn:
        try:
            from flash_attn.cute._combine_triton import _combine_kernel
        except Exception:  # ImportError, or a Triton whose own imports fail
            _combine_kernel = None
        _kernel_fn.append(_combine_kernel)
    return _kernel_fn[0]


def _next_pow2(n):
    return 1 << max(0, n - 1).bit_length()


def _tile(n_splits, n_rows, heads, head_dim):
    """(BLOCK_K, BLOCK_M, BLOCK_D, num_warps): up to 32 rows x 128 columns; with few programs (decoding: a handful
    of rows) fewer rows, down to 8, and D slices down to 64 columns; then parts (BLOCK_K, a power of 2) until the
    tile holds 2048 values."""
    block_d = min(_next_pow2(head_dim), 128)
    block_m = min(_next_pow2(n_rows), 32)

    def programs():
        return -(-n_rows // block_m) * heads * -(-head_dim // block_d)

    while programs() < 512 and block_m > 8:
        block_m //= 2
    while programs() < 256 and block_d > 64:
        block_d //= 2
    block_k = 1
    while block_k < n_splits and block_k * block_m * block_d < 2048:
        block_k *= 2
    return block_k, block_m, block_d, max(1, min(8, block_k * block_m * block_d // 512))


def use_kernel(out_partial, lse_partial, out_dtype, out_device):
    """Whether the Triton kernel combines these tensors into an output of out_dtype on out_device: Triton installed,
    CUDA tensors on one device (or CPU ones in the interpreter, not bf16), fp16 / bf16 / fp32 parts and out, fp32 lse,
    no gradient wanted through the inputs, not inside torch.compile's tracing."""
    dev = out_partial.device
    if not HAS_TRITON or not (dev.type == "cuda" or (dev.type == "cpu" and _INTERPRET)):
        return False
    if lse_partial.device != dev or out_device != dev or lse_partial.dtype != torch.float32:
        return False
    if out_partial.dtype not in _KERNEL_DTYPES or out_dtype not in _KERNEL_DTYPES:
        return False
    if dev.type == "cpu" and torch.bfloat16 in (out_partial.dtype, out_dtype):
        return False
    if torch.is_grad_enabled() and (out_partial.requires_grad or lse_partial.requires_grad):
        return False
    return not torch.compiler.is_compiling() and _kernel() is not None


def combine_kernel(out_partial, lse_partial, out, lse, sink=None, unseen_pos_inf=False):
    """One launch of _combine_kernel: out_partial (num_splits, B, S, H, D) and lse_partial (num_splits, B, S, H) fp32,
    out (B, S, H, D) and lse (B, S, H) fp32 or None, any strides; writes out (in its dtype) and lse. sink: fp32 (H,)
    logits that join each row's sum with no value, or None; unseen_pos_inf: a row with no finite term gets lse +inf
    (else -inf)."""
    bound_combine(out_partial, lse_partial, out.stride(), None if lse is None else lse.stride(), sink is not None,
                  unseen_pos_inf)(out, lse, sink)


def bound_combine(out_partial, lse_partial, out_strides, lse_strides, has_sink=False, unseen_pos_inf=False,
                  row_limit=False):
    """combine_kernel with the parts and every stride fixed: launch(out, lse, sink[, limit]) for an out of strides
    out_strides (B, S, H, D) and an lse of lse_strides (B, S, H) (None: no lse; pass lse None then), sink given iff
    has_sink: what the split-KV paths reuse call after call (their parts are reused too). out and lse may be any
    tensors whose storage those strides address from their first element. row_limit: launch takes ``limit`` too, a
    one-element int32 tensor on the device (a varlen call's cu_seqlens_q[-1:]): rows (B x S flattened) from it on get
    out 0 and lse +inf, their parts unread for the result."""
    _, B, S, H, D = out_partial.shape
    n_rows = B * S
    if n_rows == 0 or H == 0:
        return lambda out, lse, sink, limit=None: None
    n_splits = out_partial.shape[0]
    block_k, block_m, block_d, warps = _tile(n_splits, n_rows, H, D)
    write_lse = lse_strides is not None
    meta = {"HEAD_DIM": D, "BLOCK_K": block_k, "BLOCK_M": block_m, "BLOCK_D": block_d, "WRITE_LSE": write_lse,
            "HAS_SINK": has_sink, "UNSEEN_POS_INF": bool(unseen_pos_inf), "ROW_LIMIT": bool(row_limit),
            "num_warps": warps}
    grid = (-(-n_rows // block_m) * H, max(1, -(-D // block_d)))
    tail = (*out_partial.stride(), *lse_partial.stride(), *out_strides, *(lse_strides if write_lse else (0, 0, 0)),
            n_splits, S, n_rows, H)
    plan_key = ("combine", D, block_k, block_m, block_d, write_lse, has_sink, bool(unseen_pos_inf), bool(row_limit),
                warps)
    kernel = _kernel()

    def launch(out, lse, sink, limit=None):
        _launch(kernel, grid, (out_partial, lse_partial, out, lse, sink if has_sink else lse_partial,
                               limit if row_limit else lse_partial, *tail), meta, plan_key)

    return launch


def combine_torch(out_partial, lse_partial):
    """(out fp32, lse fp32) of the combine as torch ops: out (..., H, D), lse (..., H) contiguous."""
    lse_parts = lse_partial.float()
    terms = torch.where(torch.isinf(lse_parts), torch.full_like(lse_parts, -math.inf), lse_parts)
    lse = torch.logsumexp(terms, 0)  # (..., H); -inf where no part saw a key
    weights = torch.where(torch.isfinite(lse), torch.exp(terms - lse), torch.zeros_like(terms))
    return (out_partial.float() * weights.unsqueeze(-1)).sum(0), lse


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, cu_seqlens=None, seqused=None,
                       virtual_batch_idx=None, return_lse=True):
    """Merges split-KV parts, with FA4's signature. out_partial (num_splits, B, S, H, D) or, varlen,
    (num_splits, total_q, H, D); lse_partial (num_splits, B, S, H) or (num_splits, total_q, H), fp32. Returns
    (out, lse): out (B, S, H, D) / (total_q, H, D) in out_dtype (default out_partial's), written into ``out`` when
    given (any strides; its dtype wins); lse (B, S, H) / (total_q, H) fp32 (a transposed view of (B, H, S) /
    (H, total_q) storage, as FA4's), or None without return_lse. cu_seqlens / seqused (varlen bounds) change no
    value: every row is combined. virtual_batch_idx (FA4's persistent-scheduler batch order) raises
    NotImplementedError."""
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
    shape = tuple(out_partial.shape[1:])
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    dtype = out_dtype or out_partial.dtype
    dest_dtype, dest_device = (dtype, out_partial.device) if out is None else (out.dtype, out.device)
    if use_kernel(out_partial, lse_partial, dest_dtype, dest_device):
        dest = out if out is not None else torch.empty(shape, dtype=dtype, device=out_partial.device)
        lse = None
        if return_lse:  # FA4's layout: heads-major storage (B, H, S) / (H, total_q), returned transposed
            lse = torch.empty((*shape[:-3], shape[-2], shape[-3]), dtype=torch.float32, device=dest.device)
            lse = lse.transpose(-1, -2)
        if out_partial.dim() == 4:  # varlen: one sequence of total_q rows
            combine_kernel(out_partial.unsqueeze(1), lse_partial.unsqueeze(1), dest.unsqueeze(0),
                           None if lse is None else lse.unsqueeze(0))
        else:
            combine_kernel(out_partial, lse_partial, dest, lse)
        return dest, lse
    combined, lse = combine_torch(out_partial, lse_partial)
    if out is None:
        out = combined.to(dtype)
    else:
        out.copy_(combined)
    if not return_lse:
        return out, None
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
