"""FlashAttention-4's Python API (``flash_attn.cute.flash_attn_func`` / ``flash_attn_varlen_func``): argument checks
and the per-call path, over the plan (plan.py), the launches (launch.py) and the compiled kernels (kernels.py).
``python -m flash_attn.cute.precompile`` fills the disk cache ahead of time, without a GPU.
"""
import math

import torch

from flash_attn.cute import autograd as _autograd
from flash_attn.cute import config, settings
from flash_attn.cute import mods as _mods
from flash_attn.cute.combine import SchedulerMetadataTensorsTorch, flash_attn_combine, get_scheduler_metadata  # noqa: F401 (FA4's API)
from flash_attn.cute.config import HEAD_DIM_PAIRS, LONG_SK, SHORT_SK, SUPPORTED_HEAD_DIMS
from flash_attn.cute.kernels import _kernels
from flash_attn.cute.launch import (_device_arch, _kernel_layout, _lse_buffer, _MAX_ELEMS, _MAX_GRID_Z,
                                    _gather_pages, _split_unused_q, forward, forward_varlen)
from flash_attn.cute.plan import (_FWD_LONG_ON, _SHORT_DIMS, _UNBOUNDED, HeadDimError, _options,  # noqa: F401
                                  _pack_group, _pad_last, _padded_dim, _split_count, _tile_splits)


_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_F32 = torch.float32


def _dtype_message(q, k, v):
    if k.dtype == q.dtype and v.dtype == q.dtype:
        return f"q, k, v must be fp16 or bf16; got {str(q.dtype).replace('torch.', '')}"
    return f"q, k, v must share one dtype, fp16 or bf16; got {q.dtype}, {k.dtype}, {v.dtype}"


def _check_tensors(q, k, v):
    """Raises ValueError naming the first of q, k, v that is not a 4-D tensor, or their dtypes when they are
    not one of fp16 / bf16 (the per-call path's checks, spelled out for the message)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, S, H, D)")
    if q.dtype not in _DTYPE_NAMES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(_dtype_message(q, k, v))


def _check_dims(D, Dv, H, Hk):
    if Dv != D:
        if (D, Dv) not in HEAD_DIM_PAIRS:
            raise NotImplementedError(f"head dim of v ({Dv}) must equal that of q and k ({D}), or the pair be one "
                                      f"of {sorted(HEAD_DIM_PAIRS)}")
        if settings.disabled("hdim_v"):
            raise NotImplementedError(f"head dim of v ({Dv}) != that of q and k ({D}): {settings.DISABLE} names hdim_v")
    if D not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim {D} not in {SUPPORTED_HEAD_DIMS}")
    if H % Hk != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k heads ({Hk})")


def _check_sink(learnable_sink, H, device):
    """learnable_sink as the kernel takes it: fp32, contiguous, (H,)."""
    if not isinstance(learnable_sink, torch.Tensor):
        raise ValueError(f"learnable_sink must be a tensor of shape ({H},), got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"learnable_sink must be fp32, bf16 or fp16, got {learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (H,):
        raise ValueError(f"learnable_sink must have shape ({H},) (one logit per query head), got "
                         f"{tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink must be on {device} (q's device), got {learnable_sink.device}")
    return learnable_sink.detach().to(_F32).contiguous()


_DEFAULT_WINDOW = (None, None)  # flash_attn_func's default window_size (identity-checked on the fast path)
# A varlen call's page table of up to this many entries (256 KiB) is checked on the host, in the call's one copy of its
# small int vectors (no device ops for it); a larger one on the device.
_HOST_PAGE_ENTRIES = 1 << 16
_LIST_BATCH = 128  # varlen calls of up to this many sequences check their values on Python lists (_sequence_stats)
_LIST_PAGES = 256  # and page tables of up to this many entries (_pages_bad; Python is slower past it)


def _refuse_unsupported(**given):
    """NotImplementedError naming the first FA4 argument this package does not implement yet that the call set."""
    for name, value in given.items():
        if value is not None and not (name.startswith("aux") and not value):
            raise NotImplementedError(f"flash_attn.cute does not take {name} yet (FA4's {name} is not implemented "
                                      "here); leave it None")


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, window_size=_DEFAULT_WINDOW,
                    learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
                    score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
                    block_sparse_tensors_bwd=None, return_lse=False):
    """Attention forward on Hopper, with FA4's signature: q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv)
    fp16/bf16 CUDA tensors, D and Dv multiples of 8 in [8, 256] (the kernels' own head dims 64, 96, 128, 192, 256
    and the pair (192, 128); other sizes run zero-padded to the next of those, _padded_dim; others raise
    HeadDimError, an AssertionError as in FA4), H % Hk == 0 (GQA/MQA). score_mod, mask_mod, aux_tensors and
    block_sparse_tensors (block_sparsity.BlockSparseTensorsTorch; the query tiles visit only the listed key blocks,
    the mask_mod runs on the partial ones; with gradients block_sparse_tensors_bwd too, the key tiles' lists): FA4's
    (calling convention in score_mod.py); their backward (a score_mod's through score_mod_bwd, FA4's gradient function)
    on dense calls (mods.check_call lists what they do not combine with yet); aux_scalars: FA4's runtime scalars for
    mods with an aux_scalars parameter. qv and gather_kv_indices raise NotImplementedError when given.
    Causal and sliding-window masks are bottom-right aligned: query i sees key j iff j - (i + Sk - Sq) lies in
    [-window_size[0], window_size[1]] (None: no limit on that side; negative sizes are literal, as in FA4, except
    that two sizes with a negative sum mean no window; causal sets the right size to 0; see _options; the gradients
    of a negative size raise NotImplementedError for now). softcap > 0: scores become
    softcap * tanh(scale * q.k / softcap). learnable_sink: None or (H,) fp32/bf16/fp16 logits, one per
    query head, that join every softmax row as a term exp(sink) with no value (not scaled by
    softmax_scale; lse includes it, a row that sees no key gets out 0 and lse = sink); its gradient
    is computed when it requires one (autograd.py). pack_gqa=True: the H / Hk query heads of each KV head
    share the kernel's tiles (_pack_group: groups of 2, 4, 8 or 16; other groups, and FLASH_ATTN_CUTE_DISABLE=pack_gqa, run
    unpacked, the same result); None: unpacked for now (with the plan rule pack_gqa_auto packed where that fills
    the tiles better, _pack_helps: short query sequences, decoding). num_splits > 1: split-KV (_forward_split;
    FLASH_ATTN_CUTE_DISABLE=split: unsplit); num_splits <= 0: as many parts as fill the
    GPU's SMs when the grid alone does not (_choose_splits), 1 otherwise. Returns (out, lse): out
    like q, lse fp32 (B, H, Sq) natural log (+inf for a row that sees no key) when return_lse or a
    gradient needs it, else None (as FA4; the kernel still writes it). When q, k or v needs a
    gradient its backward runs on this package's backward kernel when the call is one it handles (dense, no
    window, softcap or determinism; FLASH_ATTN_CUTE_DISABLE=bwd switches it off), else on the root package's Triton
    backward when that package is installed, else on this package's PyTorch backward (autograd.py;
    deterministic=True: a deterministic one). A loss that uses the returned lse sends its gradient back too."""
    # Every check reads attributes only (no tensor ops, no CUDA queries): this is the per-call path. What is
    # not a 4-D tensor fails the unpacking or the dtype lookup; _check_tensors then names the problem.
    try:
        dtype = q.dtype
        B, Sq, H, D = q.shape
        Bk, Sk, Hk, Dk = k.shape
        Bv, Sv, Hv, Dv = v.shape
        if dtype not in _DTYPE_NAMES or k.dtype != dtype or v.dtype != dtype:
            raise TypeError
    except (AttributeError, TypeError, ValueError):
        _check_tensors(q, k, v)
        raise
    if (qv is not None or gather_kv_indices is not None or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors or aux_scalars or block_sparse_tensors is not None
            or block_sparse_tensors_bwd is not None):
        _refuse_unsupported(qv=qv, gather_kv_indices=gather_kv_indices)
        if (_mods.requested(score_mod, mask_mod, aux_tensors, block_sparse_tensors)
                or block_sparse_tensors_bwd is not None or score_mod_bwd is not None):
            return _mods_func(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap, score_mod,
                              mask_mod, aux_tensors, return_lse, block_sparse_tensors, block_sparse_tensors_bwd,
                              aux_scalars, score_mod_bwd, deterministic)
    if Bk != B or Bv != Bk or Sv != Sk or Hv != Hk or Dk != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if D not in SUPPORTED_HEAD_DIMS or (Dv != D and (D, Dv) not in HEAD_DIM_PAIRS):
        P = _padded_dim(D, Dv)
        out, lse = flash_attn_func(_pad_last(q, P), _pad_last(k, P), _pad_last(v, P),
                                   softmax_scale=D ** -0.5 if softmax_scale is None else softmax_scale, causal=causal,
                                   window_size=window_size, learnable_sink=learnable_sink, softcap=softcap,
                                   num_splits=num_splits, pack_gqa=pack_gqa, deterministic=deterministic,
                                   return_lse=return_lse)
        return out[..., :Dv].contiguous(), lse
    if Dv != D or not Hk or H % Hk:  # (D is one of SUPPORTED_HEAD_DIMS here: the call above pads the others)
        _check_dims(D, Dv, H, Hk)
    pack = splits = 1
    if (window_size is _DEFAULT_WINDOW and learnable_sink is None and not softcap and num_splits == 1
            and not pack_gqa and (H == Hk or pack_gqa is False or _pack_group(None, H, Hk, Sq) == 1)):
        window_left = window_right = _UNBOUNDED  # the common call: no option to parse
        softcap = 0.0
        plain = True
    else:
        causal, window_left, window_right, softcap = _options(window_size, softcap, causal)
        pack = _pack_group(pack_gqa, H, Hk, Sq)
        splits = _tile_splits(num_splits, pack, B, Sq, H, Hk, Sk, window_left, 0 if causal else window_right, q)
        if learnable_sink is not None:
            sink = _check_sink(learnable_sink, H, q.device)
            arch = _device_arch(q, k, v)
            args = (D ** -0.5 if softmax_scale is None else float(softmax_scale), bool(causal), window_left,
                    window_right, softcap, bool(deterministic), arch, None)
            if _autograd.needs_grad(q, k, v, learnable_sink):
                return _autograd.Attention.apply(q, k, v, learnable_sink, args)
            out, lse = forward(q, k, v, args[0], bool(causal), arch, window_left, window_right, softcap, sink,
                               pack=pack, splits=splits, lse_scratch=not return_lse)
            return out, (lse if return_lse else None)
        plain = window_left == _UNBOUNDED and window_right == _UNBOUNDED and not softcap and pack == 1 and splits == 1
    arch = _device_arch(q, k, v)
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        res = _autograd.with_fallback_backward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                               deterministic=deterministic)
        if res is not None:
            return res
        return _autograd.Attention.apply(q, k, v, None, (float(softmax_scale), bool(causal), window_left,
                                                         window_right, softcap, bool(deterministic), arch, None))
    if plain and Sk and B * Sq * H and Dv == D:
        # Dense, no window or softcap (the common call): forward() without its general-case work.
        key = (dtype, D, bool(causal), arch, False, False)
        if Sk <= SHORT_SK:
            fn = _kernels.get(key + ("short",) if D in _SHORT_DIMS else key)
        else:
            fn = _kernels.get(key + ("long",) if Sk >= LONG_SK and (D, key[2]) in _FWD_LONG_ON else key)
        if fn is not None and B * max(Sq * H, Sk * Hk) * D < _MAX_ELEMS and B <= _MAX_GRID_Z:
            qs, ks, vs = q.stride(), k.stride(), v.stride()
            if (qs[3] != 1 or qs[2] != D or qs[1] & 7 or qs[0] & 7 or q.data_ptr() & 15
                    or ks[3] != 1 or ks[2] != D or ks[1] & 7 or ks[0] & 7 or k.data_ptr() & 15
                    or vs[3] != 1 or vs[2] != D or vs[1] & 7 or vs[0] & 7 or v.data_ptr() & 15):
                q, k, v = _kernel_layout(q, D), _kernel_layout(k, D), _kernel_layout(v, D)
            out = torch.empty_like(q)
            lse = _lse_buffer(q, B, H, Sq, not return_lse)
            fn(q, k, v, out, lse, float(softmax_scale), 0.0, 0, 0)
            return out, (lse if return_lse else None)
    out, lse = forward(q, k, v, softmax_scale, bool(causal), arch, window_left, window_right, softcap, pack=pack,
                       splits=splits, lse_scratch=not return_lse)
    return out, (lse if return_lse else None)


def _mods_func(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap, score_mod, mask_mod,
               aux_tensors, return_lse, block_sparse=None, block_sparse_bwd=None, aux_scalars=None, score_mod_bwd=None,
               deterministic=False):
    """flash_attn_func with score_mod / mask_mod / aux_tensors / block_sparse_tensors (mods.py). num_splits
    and pack_gqa are performance hints here: the mod kernel runs unsplit and unpacked, the same result."""
    if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    D, Dv, H, Hk = q.shape[3], v.shape[3], q.shape[2], k.shape[2]
    causal, window_left, window_right, softcap = _options(window_size, softcap, causal)
    grads = _autograd.needs_grad(q, k, v, learnable_sink)
    _mods.check_call(score_mod, mask_mod, aux_tensors, causal, window_left, window_right, softcap, grads, D, Dv,
                     block_sparse, block_sparse_bwd, aux_scalars, score_mod_bwd)
    _check_dims(D, Dv, H, Hk)
    sink = None if learnable_sink is None else _check_sink(learnable_sink, H, q.device)
    score_mod, score_mod_bwd = _mods.with_softcap(softcap, score_mod, score_mod_bwd)
    arch = _device_arch(q, k, v)
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    if grads:  # check_call refused what has no backward
        if deterministic:
            raise NotImplementedError("flash_attn.cute: a deterministic backward of mods / block sparsity is not "
                                      "implemented yet (their backward adds dQ in whatever order the CTAs finish)")
        out, lse = _mods.ModAttention.apply(q, k, v, learnable_sink, (scale, arch, score_mod, score_mod_bwd, mask_mod,
                                                                      aux_tensors, block_sparse, block_sparse_bwd,
                                                                      aux_scalars, bool(causal), window_left,
                                                                      window_right))
        return out, (lse if return_lse else None)
    out, lse = _mods.forward(q, k, v, scale, bool(causal), arch, window_left, window_right, score_mod, mask_mod,
                             aux_tensors, block_sparse, aux_scalars, sink)
    return out, (lse if return_lse else None)


def _check_cu_seqlens(name, cu, device, batch=None):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        raise ValueError(f"{name} must be a 1-D int32 tensor (batch + 1,), got "
                         f"{getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device}, got {cu.device}")
    if cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        raise ValueError(f"{name} must have batch + 1 entries, got {cu.shape[0]}")


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None,
                           page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                           learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                           score_mod=None, score_mod_bwd=None, mask_mod=None, block_sparse_tensors=None,
                           aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
                           seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """FA4's varlen entry (see _varlen_func for the packed layout). q may also be batch-shaped (B, Sq, H, D) with
    cu_seqlens_q None (sequence b: the first seqused_q[b] of its Sq rows, all without seqused_q), and k / v
    (B, Sk, Hk, D) with cu_seqlens_k None (likewise with seqused_k); out then has q's batch shape and lse is
    (B, H, Sq). min_seqlen_k, scheduler_metadata (get_scheduler_metadata), seqlen_k_per_split and
    disable_scheduler_metadata are scheduling hints in FA4 that change no result; the kernels here need none of
    them. score_mod, mask_mod, aux_tensors, aux_scalars, score_mod_bwd: as flash_attn_func's (batch index = the
    sequence's; q_idx / kv_idx from the sequence's first row; not with page_table or seqused_q yet).
    block_sparse_tensors: FA4's varlen form (block_sparsity.BlockSparseTensorsTorch: packed over the sequences with
    cu_total_m_blocks, or (B, H, M, N) for batch-shaped queries), forward only. qv and gather_kv_indices raise
    NotImplementedError when given."""
    mods = None
    if (qv is not None or gather_kv_indices is not None or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors or aux_scalars or block_sparse_tensors is not None):
        _refuse_unsupported(qv=qv, gather_kv_indices=gather_kv_indices)
        if (_mods.requested(score_mod, mask_mod, aux_tensors, block_sparse_tensors) or aux_scalars
                or score_mod_bwd is not None):
            mods = (score_mod, mask_mod, aux_tensors, aux_scalars, score_mod_bwd, block_sparse_tensors)
    batch_q = isinstance(q, torch.Tensor) and q.dim() == 4 and cu_seqlens_q is None
    batch_k = (page_table is None and isinstance(k, torch.Tensor) and k.dim() == 4 and cu_seqlens_k is None)
    if batch_q:
        B, Sq = q.shape[:2]
        q = q.reshape(B * Sq, *q.shape[2:])
        cu_seqlens_q = torch.arange(0, (B + 1) * Sq, Sq, dtype=torch.int32, device=q.device)[:B + 1]
        max_seqlen_q = Sq if max_seqlen_q is None else max_seqlen_q
    if batch_k:
        if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"k and v must both be batch-shaped (B, Sk, Hk, D) like each other, got k "
                             f"{tuple(k.shape)}, v {tuple(getattr(v, 'shape', ()))}")
        Bk, Sk = k.shape[:2]
        k, v = k.reshape(Bk * Sk, *k.shape[2:]), v.reshape(Bk * Sk, *v.shape[2:])
        cu_seqlens_k = torch.arange(0, (Bk + 1) * Sk, Sk, dtype=torch.int32, device=k.device)[:Bk + 1]
        max_seqlen_k = Sk if max_seqlen_k is None else max_seqlen_k
    out, lse = _varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                            page_table, softmax_scale, causal, window_size, learnable_sink, softcap, num_splits,
                            pack_gqa, deterministic, return_lse, mods)
    if batch_q:
        out = out.view(B, Sq, *out.shape[1:])
        lse = None if lse is None else lse.view(lse.shape[0], B, Sq).transpose(0, 1)
    return out, lse


def _sequence_stats(vec, batch, paged, capacity, has_used_k, has_used_q):
    """The varlen checks' numbers from ``vec``, the host (int64) copy of cu_seqlens_q, cu_seqlens_k (not for a paged
    call, whose sequences' key capacity is ``capacity``), seqused_k and seqused_q (those given), in that order:
    (first_q, last_q, decreasing steps of cu_seqlens_q, longest query count, the same three for cu_seqlens_k (0 when
    paged), longest key count (seqused_k's if given), seqused_k values outside their sequences, seqused_q values
    outside theirs). Up to _LIST_BATCH sequences on Python lists (one conversion: a torch op on a small CPU tensor costs
    about a microsecond, and these would be some twenty), more on the tensor (vectorised)."""
    if batch <= _LIST_BATCH:
        vals = vec.tolist()
        cu_q, pos = vals[:batch + 1], batch + 1
        lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
        if paged:
            first_k = last_k = 0
            lens_k = [capacity] * batch
        else:
            cu_k, pos = vals[pos:pos + batch + 1], pos + batch + 1
            first_k, last_k = cu_k[0], cu_k[-1]
            lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
        used_k, used_bad, used_q_bad = lens_k, 0, 0
        if has_used_k:
            used_k, pos = vals[pos:pos + batch], pos + batch
            used_bad = sum(u < 0 or u > n for u, n in zip(used_k, lens_k))
        if has_used_q:
            used_q_bad = sum(u < 0 or u > n for u, n in zip(vals[pos:pos + batch], lens_q))
        return (cu_q[0], cu_q[-1], sum(n < 0 for n in lens_q), max(lens_q, default=0), first_k, last_k,
                sum(n < 0 for n in lens_k), max(used_k, default=0), used_bad, used_q_bad)
    cu_q_h, rest = vec[:batch + 1], vec[batch + 1:]
    lens_q = cu_q_h[1:] - cu_q_h[:-1]
    if paged:
        first_k = last_k = 0
        lens_k = torch.full_like(lens_q, capacity)
    else:
        cu_k_h, rest = rest[:batch + 1], rest[batch + 1:]
        first_k, last_k = int(cu_k_h[0]), int(cu_k_h[-1])
        lens_k = cu_k_h[1:] - cu_k_h[:-1]
    used_k, used_bad, used_q_bad = lens_k, 0, 0
    if has_used_k:
        used_k, rest = rest[:batch], rest[batch:]
        used_bad = int(((used_k < 0) | (used_k > lens_k)).sum())
    if has_used_q:
        used_q = rest[:batch]
        used_q_bad = int(((used_q < 0) | (used_q > lens_q)).sum())
    return (int(cu_q_h[0]), int(cu_q_h[-1]), int((lens_q < 0).sum()), int(lens_q.max()), first_k, last_k,
            int((lens_k < 0).sum()), int(used_k.max()), used_bad, used_q_bad)


def _pages_bad(table, used_k, page_size, num_pages):
    """How many of the host page table's (B, max_pages) entries that the sequences use (the first ceil(used_k[b] /
    page_size) of row b) are not page indices in [0, num_pages): on Python lists for a table of up to _LIST_PAGES
    entries (a decoding step's), else on the tensor."""
    if table.numel() <= _LIST_PAGES:
        rows, used = table.tolist(), used_k.tolist()
        return sum(not 0 <= p < num_pages
                   for row, n in zip(rows, used) for p in row[:(n + page_size - 1) // page_size])
    return int(_pages_bad_count(table, used_k, page_size, num_pages))


def _pages_bad_count(table, used_k, page_size, num_pages):
    """_pages_bad's count as a 0-dim tensor on the table's device (torch ops, no sync)."""
    used_pages = torch.arange(table.shape[1], device=table.device) < ((used_k + page_size - 1) // page_size).view(-1, 1)
    return (((table < 0) | (table >= num_pages)) & used_pages).sum()


def _varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                 window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                 pack_gqa=None, deterministic=False, return_lse=False, mods=None):
    """Attention forward over packed sequences: q (total_q, H, D), k/v (total_k, Hk, D); sequence b is, of q, the
    first seqused_q[b] rows from cu_seqlens_q[b] (all of cu_seqlens_q[b]:cu_seqlens_q[b + 1] without seqused_q)
    and, of k/v, the first seqused_k[b] rows from cu_seqlens_k[b] (all of cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    without seqused_k); masks align the sequence's last used query with its last used key. Rows of q past
    seqused_q[b] get out 0 and the lse of a row that sees no key (+inf, or the sink). Masks, softcap and
    dtypes and learnable_sink as flash_attn_func. Returns (out (total_q, H, D), lse (H, total_q) fp32, or None as in
    flash_attn_func). Checks the
    cu_seqlens / seqused values (one device sync); max_seqlen_q is computed (another sync) when not given.
    page_table (paged K / V): k / v (num_pages, page_size, Hk, D), page_table int32 (B, max_pages): sequence b's
    keys are the first seqused_k[b] rows of its pages page_table[b, 0], page_table[b, 1], ... in order (give
    seqused_k, not cu_seqlens_k; page_size a multiple of 8, see paged_block_n). Forward only. num_splits, pack_gqa:
    as flash_attn_func's (pack_gqa None with the plan rule pack_gqa_auto: _pack_helps for the longest sequence's
    length; num_splits <= 0 reads the longest sequence's key count in the call's one sync). mods: (score_mod,
    mask_mod, aux_tensors, aux_scalars, score_mod_bwd, block_sparse_tensors) of a call with FA4's mods (mods.py), run
    unsplit and unpacked."""
    paged = page_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        want = 4 if paged and name != "q" else 3
        if not isinstance(t, torch.Tensor) or t.dim() != want:
            raise ValueError(f"{name} must be a {want}-D tensor "
                             + ("(num_pages, page_size, Hk, D) with page_table" if want == 4 else "(total, H, D)"))
    if paged:
        if settings.disabled("paged"):
            raise NotImplementedError(f"page_table: {settings.DISABLE} names paged (the paged kernel is off)")
        if cu_seqlens_k is not None or seqused_k is None:
            raise ValueError("page_table: give each sequence's key count as seqused_k (and cu_seqlens_k None)")
    if cu_seqlens_q is None or (cu_seqlens_k is None and not paged):
        raise NotImplementedError("flash_attn.cute's varlen path needs both cu_seqlens_q and cu_seqlens_k")
    dtype = q.dtype
    if dtype not in _DTYPE_NAMES or k.dtype != dtype or v.dtype != dtype:
        raise ValueError(_dtype_message(q, k, v))
    Tq, H, D = q.shape
    if paged:
        num_pages, page_size, Hk, Dk = k.shape
        Tk = num_pages * page_size
        same = v.shape[:3] == k.shape[:3]
    else:
        Tk, Hk, Dk = k.shape
        same = v.shape[:2] == k.shape[:2]
    if not same or Dk != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    Dv = v.shape[-1]
    if mods is not None:
        if paged or seqused_q is not None:
            raise NotImplementedError("score_mod / mask_mod with page_table or seqused_q is not implemented yet")
        c, left, right, cap = _options(window_size, softcap, causal)
        grads = _autograd.needs_grad(q, k, v, learnable_sink)
        if grads and mods[5] is not None:
            raise NotImplementedError("flash_attn.cute: the varlen backward with block sparsity is not implemented "
                                      "yet (FA4's varlen call has no backward lists)")
        _mods.check_call(*mods[:3], c, left, right, cap, grads, D, Dv, mods[5], aux_scalars=mods[3],
                         score_mod_bwd=mods[4])
        if cap:  # the cap as a score_mod; the kernels below then see no softcap
            score_mod, score_mod_bwd = _mods.with_softcap(cap, mods[0], mods[4])
            mods = (score_mod, *mods[1:4], score_mod_bwd, mods[5])
            softcap = 0.0
    if D not in SUPPORTED_HEAD_DIMS or (Dv != D and (D, Dv) not in HEAD_DIM_PAIRS):
        P = _padded_dim(D, Dv)
        out, lse = _varlen_func(_pad_last(q, P), _pad_last(k, P), _pad_last(v, P), cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
                                D ** -0.5 if softmax_scale is None else softmax_scale, causal, window_size,
                                learnable_sink, softcap, num_splits, pack_gqa, deterministic, return_lse)
        return out[..., :Dv].contiguous(), lse
    _check_dims(D, Dv, H, Hk)
    causal, window_left, window_right, softcap = _options(window_size, softcap, causal)
    splits = _split_count(num_splits)  # (num_splits <= 0: chosen below, with the sequence lengths)
    sink = None if learnable_sink is None else _check_sink(learnable_sink, H, q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got stride {t.stride(-1)}")
    arch = _device_arch(q, k, v)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if paged:
        if (not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2
                or page_table.shape[0] != batch or page_table.device != q.device or page_table.stride(-1) != 1):
            raise ValueError(f"page_table must be an int32 tensor (batch={batch}, max_pages) on {q.device} with a "
                             f"contiguous last dimension, got {getattr(page_table, 'dtype', type(page_table))} of "
                             f"shape {tuple(getattr(page_table, 'shape', ()))}")
    else:
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch)
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None and (not isinstance(used, torch.Tensor) or used.dtype != torch.int32
                                 or used.shape != (batch,) or used.device != q.device):
            raise ValueError(f"{name} must be an int32 tensor ({batch},) on {q.device}")
    # One device sync for every value check (and max_seqlen_q): the small int32 vectors travel to the host in one
    # copy and are checked there (a decoding step would otherwise launch ~20 tiny kernels for it). A page table of up
    # to _HOST_PAGE_ENTRIES entries travels with them; a larger one is checked on the device and only its count of
    # bad entries travels.
    pages_bad = None
    table_to_host = paged and batch and 0 < page_table.numel() <= _HOST_PAGE_ENTRIES
    if paged and batch and page_table.shape[1] and not table_to_host:
        # the page table entries the sequences use: each a page of k / v
        pages_bad = _pages_bad_count(page_table, seqused_k, page_size, num_pages).view(1).to(torch.int32)
    parts = ([cu_seqlens_q] + ([] if paged else [cu_seqlens_k])
             + [t for t in (seqused_k, seqused_q, pages_bad) if t is not None]
             + ([page_table.reshape(-1)] if table_to_host else []))
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).to("cpu", torch.int64)
    n_vec = (batch + 1) * (1 if paged else 2) + batch * ((seqused_k is not None) + (seqused_q is not None))
    (first_q, last_q, down_q, max_q, first_k, last_k, down_k, max_k, used_bad,
     used_q_bad) = _sequence_stats(host[:n_vec], batch, paged, page_table.shape[1] * page_size if paged else 0,
                                   seqused_k is not None, seqused_q is not None)
    rest = host[n_vec:]
    # the split rule, the cap on num_splits and the backward's grid need the longest sequence's key count
    choose = (splits > 1 or num_splits <= 0) and not settings.disabled("split")
    checks = [("cu_seqlens_q", first_q, down_q, last_q, Tq)]
    if not paged:  # (a paged call's keys are its pages: no cu_seqlens_k)
        checks.append(("cu_seqlens_k", first_k, down_k, last_k, Tk))
    for name, first, down, last, total in checks:
        if first != 0 or down or last > total:
            raise ValueError(f"{name} must start at 0, never decrease and end at most at {total} "
                             f"(got first {first}, last {last})")
    if used_bad:
        raise ValueError("seqused_k must lie in [0, page_table.shape[1] * page_size]" if paged else
                         "seqused_k must lie in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]]")
    if table_to_host:  # (after the seqused_k check: the pages a sequence uses follow from its key count)
        used_k_h = host[n_vec - batch * (1 + (seqused_q is not None)):][:batch]
        pages_bad = _pages_bad(rest.view(batch, -1), used_k_h, page_size, num_pages)
    elif pages_bad is not None:
        pages_bad = int(rest[0])
    if pages_bad:
        raise ValueError(f"page_table: {pages_bad} entries that sequences use are not page indices in "
                         f"[0, {num_pages})")
    if used_q_bad:
        raise ValueError("seqused_q must lie in [0, cu_seqlens_q[b + 1] - cu_seqlens_q[b]]")
    if paged and config.paged_block_n(128, page_size) is None:
        # Pages of fewer than 8 rows (or not a multiple of 8) fill no TMA box: the sequences' pages are gathered into
        # contiguous keys (a copy of each sequence's page-table capacity) for the unpaged kernel.
        # (causal and softcap are resolved by now: the window goes on resolved too, or causal's right size is lost)
        k, v, cu_k, cap = _gather_pages(k, v, page_table)
        resolved = tuple(None if w >= _UNBOUNDED else w for w in (window_left, window_right))
        return _varlen_func(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, cap, seqused_q, seqused_k, None,
                            softmax_scale, causal, resolved, learnable_sink, softcap, num_splits, pack_gqa,
                            deterministic, return_lse)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    if max_seqlen_q is None:
        max_seqlen_q = max_q
    elif int(max_seqlen_q) < max_q:
        raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is below the longest sequence ({max_q})")
    if mods is not None and _autograd.needs_grad(q, k, v, learnable_sink):  # (check_call refused what has none)
        if deterministic:
            raise NotImplementedError("flash_attn.cute: a deterministic backward of mods is not implemented yet "
                                      "(their backward adds dQ in whatever order the CTAs finish)")
        out, lse = _mods.VarlenModAttention.apply(
            q, k, v, learnable_sink, (float(softmax_scale), arch, mods, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                      int(max_seqlen_q), max(max_k, int(max_seqlen_k or 0)), bool(causal),
                                      window_left, window_right))
        return out, (lse if return_lse else None)
    if _autograd.needs_grad(q, k, v, learnable_sink):
        if paged:
            raise NotImplementedError("gradients with page_table (paged K / V is a forward-only path)")
        # the backward's grid covers the longest used key count, whatever max_seqlen_k says
        varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), max(max_k, int(max_seqlen_k or 0)), seqused_q,
                  seqused_k)
        if sink is None and seqused_q is None and seqused_k is None:
            res = _autograd.with_fallback_backward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                                   varlen, deterministic=deterministic)
            if res is not None:
                return res
        return _autograd.Attention.apply(q, k, v, learnable_sink, (float(softmax_scale), bool(causal), window_left,
                                                                   window_right, softcap, bool(deterministic), arch,
                                                                   varlen))
    pack = _pack_group(pack_gqa, H, Hk, int(max_seqlen_q))
    if choose:
        splits = _tile_splits(num_splits, pack, batch, int(max_seqlen_q), H, Hk, max_k, window_left,
                              0 if causal else window_right, q)
    if seqused_q is not None:
        cu_seqlens_q, keys, seqused_k = _split_unused_q(cu_seqlens_q, page_table if paged else cu_seqlens_k,
                                                        seqused_q, seqused_k, paged)
        if paged:
            page_table = keys
        else:
            cu_seqlens_k = keys
    if mods is not None:
        out, lse = _mods.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q),
                                        softmax_scale, bool(causal), arch, window_left, window_right, *mods[:4],
                                        block_sparse=mods[5], max_seqlen_k=max(max_k, int(max_seqlen_k or 0)),
                                        sink=sink)
    else:
        out, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q), softmax_scale,
                                  bool(causal), arch, window_left, window_right, softcap, sink=sink,
                                  pack=pack, page_table=page_table, splits=splits)
    if last_q < Tq:  # rows of q after the last sequence belong to none: out 0, lse +inf
        out[last_q:] = 0
        lse[:, last_q:] = math.inf
    return out, (lse if return_lse else None)



# FA4's low-level entry points (downstream libraries import them from here)
from flash_attn.cute.lowlevel import _flash_attn_bwd, _flash_attn_fwd  # noqa: E402, F401
