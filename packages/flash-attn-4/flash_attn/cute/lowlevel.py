"""FA4's low-level entry points ``_flash_attn_fwd`` and ``_flash_attn_bwd``, which downstream libraries import from
``flash_attn.cute.interface`` to build their own autograd Functions: FA4's signatures, this package's kernels.

FA4's kernel-tuning arguments (tile sizes, thread counts, swap and atom-layout flags, ``_arch``) choose among FA4's
kernel variants; this package picks its own configuration, so they are accepted and change nothing. Arguments for
features not implemented here (qv, fp8 descales, gather_kv_indices) raise NotImplementedError when given.
score_mod / mask_mod / aux_tensors / aux_scalars / block_sparse_tensors go to flash_attn_func /
flash_attn_varlen_func in the forward and to the mods' backward kernels (mods.backward / backward_varlen) in the
backward, where ``block_sparse_tensors`` are the backward's lists (per key block, FA4's convention). The mod
kernels live in the JITCaches ``_flash_attn_fwd.compile_cache`` / ``_flash_attn_bwd.compile_cache``
(cache_utils).
"""
from __future__ import annotations

import torch

from flash_attn.cute import autograd, cache_utils, interface, launch, mods, plan


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                    causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                    tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1,
                    pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
                    return_lse=False, out=None, lse=None, aux_tensors=None, aux_scalars=None, q_descale=None,
                    k_descale=None, v_descale=None, gather_kv_indices=None, scheduler_metadata=None,
                    seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """The forward without autograd -> (out, lse, None, None) as FA4's (its last two are the sparse-MLA kernel's,
    which has no counterpart here). Dense when cu_seqlens_q / cu_seqlens_k, seqused_* and page_table are all None,
    else the varlen entry. lse is returned when return_lse, when ``lse`` is given or when an input requires a
    gradient (as FA4), else None; ``out`` / ``lse``, when given, receive the results."""
    interface._refuse_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                  gather_kv_indices=gather_kv_indices)
    want_lse = return_lse or lse is not None or any(
        t is not None and t.requires_grad for t in (q, k, v, learnable_sink))
    common = dict(softmax_scale=softmax_scale, causal=causal, window_size=(window_size_left, window_size_right),
                  learnable_sink=learnable_sink, softcap=softcap or 0.0, num_splits=num_splits, pack_gqa=pack_gqa,
                  return_lse=True)
    with torch.no_grad():
        if (cu_seqlens_q is None and cu_seqlens_k is None and seqused_q is None and seqused_k is None
                and page_table is None):
            o, l = interface.flash_attn_func(q, k, v, score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                                             aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                                             **common)
        else:
            o, l = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                                    score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux_tensors,
                                                    aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                                    seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table,
                                                    **common)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return o, (l if want_lse else None), None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                    window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
                    num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
                    AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None,
                    cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None,
                    mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None,
                    learnable_sink=None):
    """The backward of a forward's (out, lse) -> (dq, dk, dv), with (…, dsink) appended when learnable_sink is
    given (in its dtype). Dense q / out / dout (B, Sq, H, D), lse (B, H, Sq); varlen (cu_seqlens_q and
    cu_seqlens_k): (total_q, H, D), lse (H, total_q). dlse: the gradient flowing into lse, or None. dq / dk / dv,
    when given, receive the gradients. Runs the backward autograd.dispatcher_backward picks."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise NotImplementedError("_flash_attn_bwd: give both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is None and (seqused_q is not None or seqused_k is not None):
        raise NotImplementedError("_flash_attn_bwd: seqused_q / seqused_k need cu_seqlens_q and cu_seqlens_k")
    causal, window_left, window_right, softcap = plan._options((window_size_left, window_size_right),
                                                                    softcap, causal)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    varlen = None
    if cu_seqlens_q is not None:
        lens = lambda cu: int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0  # noqa: E731
        varlen = (cu_seqlens_q, cu_seqlens_k, lens(cu_seqlens_q) if max_seqlen_q is None else int(max_seqlen_q),
                  lens(cu_seqlens_k) if max_seqlen_k is None else int(max_seqlen_k), seqused_q, seqused_k)
    arch = launch._device_arch(q, k, v)
    if (mods.requested(score_mod, mask_mod, aux_tensors, block_sparse_tensors) or score_mod_bwd is not None
            or aux_scalars):
        grads = _mods_bwd(q, k, v, out, dout, lse, dlse, scale, causal, window_left, window_right, softcap,
                          bool(deterministic), arch, varlen, score_mod, score_mod_bwd, mask_mod, aux_tensors,
                          aux_scalars, block_sparse_tensors)
    else:
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        grads = autograd.dispatcher_backward(dout, q, k, v, out, lse, scale, causal, window_left, window_right,
                                             softcap, bool(deterministic), arch, varlen, dlse)
    grads = tuple(g if given is None else given.copy_(g) for g, given in zip(grads, (dq, dk, dv)))
    if learnable_sink is None:
        return grads
    return (*grads, autograd.sink_grad(dout, out, lse, learnable_sink, dlse).to(learnable_sink.dtype))


def _mods_bwd(q, k, v, out, dout, lse, dlse, scale, causal, window_left, window_right, softcap, deterministic, arch,
              varlen, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars, block_sparse_bwd):
    """_flash_attn_bwd of a forward with mods: mods.check_call's rules for a call with gradients (block_sparse_bwd
    stands for both lists: the forward's are not needed here), then the mods' backward kernels."""
    D, Dv = q.shape[-1], v.shape[-1]
    H, Hk = q.shape[-2], k.shape[-2]
    lse_shape = (q.shape[0], H, q.shape[1]) if varlen is None else (H, q.shape[0])
    if (q.dim() != (4 if varlen is None else 3) or out.shape != q.shape[:-1] + (Dv,) or dout.shape != out.shape
            or k.shape[:-1] != v.shape[:-1] or k.shape[-1] != D or k.shape[0] != q.shape[0] and varlen is None
            or not Hk or H % Hk or tuple(lse.shape) != lse_shape):
        raise ValueError(f"_flash_attn_bwd: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out "
                         f"{tuple(out.shape)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)} do not match (lse "
                         f"expected {lse_shape}, H a multiple of Hk)")
    mods.check_call(score_mod, mask_mod, aux_tensors, causal, window_left, window_right, softcap, True, D, Dv,
                    block_sparse_bwd, block_sparse_bwd, aux_scalars, score_mod_bwd)
    score_mod, score_mod_bwd = mods.with_softcap(softcap, score_mod, score_mod_bwd)
    if deterministic:
        raise NotImplementedError("flash_attn.cute: a deterministic backward of mods / block sparsity is not "
                                  "implemented yet (their backward adds dQ in whatever order the CTAs finish)")
    if varlen is None:
        return mods.backward(dout, q, k, v, out, lse, dlse, scale, arch, score_mod, score_mod_bwd, mask_mod,
                             aux_tensors, block_sparse_bwd, aux_scalars, causal, window_left, window_right)
    cu_q, cu_k, max_q, max_k, seqused_q, seqused_k = varlen
    if block_sparse_bwd is not None or seqused_q is not None:
        raise NotImplementedError("flash_attn.cute: the varlen backward of mods takes no block sparsity or seqused_q "
                                  "yet")
    return mods.backward_varlen(dout, q, k, v, out, lse, dlse, scale, arch, score_mod, score_mod_bwd, mask_mod,
                                aux_tensors, aux_scalars, cu_q, cu_k, seqused_k, max_q, max_k, causal, window_left,
                                window_right)


_flash_attn_fwd.compile_cache = cache_utils.get_jit_cache("mods_fwd")
_flash_attn_bwd.compile_cache = cache_utils.get_jit_cache("mods_bwd")
