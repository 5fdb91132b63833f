"""FA2's ``flash_attn_with_kvcache`` on the Hopper kernels (the root dispatcher's ``fwd_kvcache``, backend.py; under the
plan rule ``kvcache``).

A call is two steps. The new keys and values are rotated (rotary) and written into the caches in place, and the
queries rotated: one Triton launch (``prep_kernel``) where Triton serves the tensors, else torch ops (``prep``). Then the varlen kernel attends over the caches where they lie: a contiguous
cache (B_cache, S_cache, Hk, D) is the packed rows (B_cache * S_cache, Hk, D), sequence b's keys the window that
starts at row ``cache_batch_idx[b] * S_cache + cache_leftpad[b]`` (cu_seqlens_k) and holds ``cache_seqlens[b] + new -
cache_leftpad[b]`` rows (seqused_k); a paged cache goes to the paged kernel with its page table (pages the kernel
cannot box, or a paged cache with leftpad, are gathered into contiguous keys first). Calls of few query rows take the
decoding plan of the dense path (pack_gqa, split-KV: backend._decoding). No host sync: a decoding step can be
captured in a CUDA graph.
"""
import torch

from flash_attn.cute import launch
from flash_attn.cute.plan import _UNBOUNDED

_aranges: dict = {}  # (device, B, step) -> int32 0, step, ..., B * step (never written)


def _arange(device, B, step):
    """The cu_seqlens of B rows of ``step`` (a batch's queries, or its cache rows), kept per shape."""
    key = (device, B, step)
    cu = _aranges.get(key)
    if cu is None:
        if len(_aranges) >= 64:
            _aranges.clear()
        cu = _aranges[key] = torch.arange(0, (B + 1) * step, step, dtype=torch.int32, device=device)[:B + 1]
    return cu


def rotate(x, cos, sin, pos, interleaved):
    """x (B, S, h, D) with the first rotary_dim = 2 * cos.shape[1] dims rotated by the angles of positions pos (B, S)
    (rows of cos / sin (seqlen_ro, rotary_dim / 2)), in fp32, back in x's dtype. interleaved: pairs (0, 1), (2, 3),
    ... (GPT-J); else the two halves (GPT-NeoX)."""
    half = cos.shape[1]
    rd = 2 * half
    c = cos[pos].unsqueeze(2).float()  # (B, S, 1, rd / 2)
    s = sin[pos].unsqueeze(2).float()
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def prep(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
         rotary_interleaved, bounded):
    """FA2's first step: the new k / v (B, S_new, Hk, D), rotated when rotary_cos is given, written at rows
    cache_seqlens[b] + i of cache row cache_batch_idx[b] (or of the pages block_table[b] lists); q rotated at
    positions cache_seqlens[b] + i when the mask is bounded (causal / local), else all at cache_seqlens[b] (one
    decoding step). Returns q (rotated or as given)."""
    B, Sq = q.shape[:2]
    s_new = 0 if k is None else k.shape[1]
    if rotary_cos is None and not (s_new and B):
        return q
    seqlens = cache_seqlens.long()
    if rotary_cos is not None:
        step = torch.arange(Sq, device=q.device) if bounded else torch.zeros(Sq, dtype=torch.long, device=q.device)
        q = rotate(q, rotary_cos, rotary_sin, seqlens[:, None] + step, rotary_interleaved)
    if s_new and B:
        pos = seqlens[:, None] + torch.arange(s_new, device=q.device)  # (B, S_new)
        if rotary_cos is not None:
            k = rotate(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
        if block_table is None:
            rows = (torch.arange(B, device=q.device) if cache_batch_idx is None else cache_batch_idx.long())
            rows = rows[:, None].expand(B, s_new)
        else:
            page = k_cache.shape[1]
            rows = torch.gather(block_table.long(), 1, pos // page)
            pos = pos % page
        k_cache[rows, pos] = k.to(k_cache.dtype)
        v_cache[rows, pos] = v.to(v_cache.dtype)
    return q


_prep_fn = []  # [the Triton kernel] once imported, [None] when Triton does not import


def _prep_kernel():
    """The Triton kernel of the first step (module _kvcache_triton), imported on first use; None when Triton does not
    import (the torch path serves)."""
    if not _prep_fn:
        try:
            from flash_attn.cute._kvcache_triton import _prep_kernel as kernel
        except Exception:  # ImportError, or a Triton whose own imports fail
            kernel = None
        _prep_fn.append(kernel)
    return _prep_fn[0]


def use_prep_kernel(q, k_cache):
    """Whether prep_kernel serves the call: Triton installed, CUDA tensors (or CPU ones in the interpreter, not bf16:
    it computes bf16 wrongly), not inside torch.compile's tracing."""
    from flash_attn.cute import combine  # (its Triton facts: installed, interpreter)

    dev = q.device
    if not combine.HAS_TRITON or not (dev.type == "cuda" or (dev.type == "cpu" and combine._INTERPRET)):
        return False
    if dev.type == "cpu" and torch.bfloat16 in (q.dtype, k_cache.dtype):
        return False
    return not torch.compiler.is_compiling() and _prep_kernel() is not None


def _pow2(n):
    return 1 << max(0, n - 1).bit_length()


def prep_kernel(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
                rotary_interleaved, bounded):
    """prep in one Triton launch (_kvcache_triton._prep_kernel): the same result, the rotation in fp32. Tensors
    with a unit last stride (the core's checks), int32 cache_seqlens / cache_batch_idx / block_table."""
    from flash_attn.cute.triton_launch import launch as _launch

    B, Sq, H, D = q.shape
    s_new = 0 if k is None else k.shape[1]
    rotary = rotary_cos is not None
    heads_q = H if rotary else 0  # (without rotary q is returned as given)
    heads_kv = k_cache.shape[2] if s_new else 0
    rows = max(Sq if heads_q else 0, s_new)
    if not B or not rows or not heads_q + heads_kv:
        return q
    q_out = torch.empty_like(q) if rotary else q
    if rotary:
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (rotary_cos, rotary_sin))
        half = cos.shape[1]
        if sin.stride(0) != cos.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
    else:
        cos = sin = cache_seqlens  # (never read)
        half = 0
    kk, vv = (k, v) if s_new else (k_cache, v_cache)  # (never read without new rows)
    Dv = v_cache.shape[-1]
    dummy = cache_seqlens  # (the pointer of an absent cache_batch_idx / block_table: never read)
    meta = {"HEADS_Q": heads_q, "HEADS_KV": heads_kv, "HEAD_DIM": D, "HEAD_DIM_V": Dv, "BLOCK_D": _pow2(D),
            "BLOCK_DV": _pow2(Dv), "ROT_HALF": half, "BLOCK_HALF": _pow2(max(half, 1)), "ROTARY": rotary,
            "INTERLEAVED": bool(rotary_interleaved), "Q_STEPS": bool(bounded),
            "HAS_BATCH_IDX": cache_batch_idx is not None, "PAGED": block_table is not None, "num_warps": 1}
    page_size = k_cache.shape[1] if block_table is not None else 1
    _launch(_prep_kernel(), (rows, B, heads_q + heads_kv),
            (q, q_out, kk, vv, k_cache, v_cache, cos, sin, cache_seqlens,
             dummy if cache_batch_idx is None else cache_batch_idx, dummy if block_table is None else block_table,
             *q.stride()[:3], *q_out.stride()[:3], *kk.stride()[:3], *vv.stride()[:3], *k_cache.stride()[:3],
             *v_cache.stride()[:3], cos.stride(0), 0 if block_table is None else block_table.stride(0),
             Sq, s_new, page_size),
            meta, ("kvcache_prep",) + tuple(meta.values()))
    return q_out


def fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, rotary_interleaved, num_splits, sink, plan, boxes_pages):
    """(out (B, Sq, H, Dv), lse (B, H, Sq) fp32) of flash_attn_with_kvcache on validated inputs (the core's checks:
    flash_attn/_ops.py). plan(q, B, Sq, H, Sk, Hk, left, right) -> (pack, splits): the decoding plan (backend's);
    boxes_pages(page_size) -> whether the paged kernel takes pages of that size."""
    B, Sq, H, D = q.shape
    Hk, Dv = k_cache.shape[2], v_cache.shape[-1]
    if rotary_cos is not None or k is not None:  # (else nothing to append or rotate)
        q = (prep_kernel if use_prep_kernel(q, k_cache) else prep)(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                                                    cache_seqlens, cache_batch_idx, block_table,
                                                                    rotary_interleaved, call.bounded)
    if B * Sq * H == 0:
        return q.new_zeros(B, Sq, H, Dv), torch.full((B, H, Sq), float("inf"), device=q.device)
    wl = _UNBOUNDED if call.window_left < 0 else call.window_left
    wr = _UNBOUNDED if call.window_right < 0 else call.window_right
    s_new = 0 if k is None else k.shape[1]
    used = cache_seqlens + s_new if s_new else cache_seqlens
    leftpad = cache_leftpad
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]  # keys a sequence may have
    if paged and (leftpad is not None or not boxes_pages(k_cache.shape[1])):
        # keys that start inside a page, or pages the kernel cannot box: each sequence's pages gathered
        k_cache, v_cache, cu_k, _ = launch._gather_pages(k_cache, v_cache, block_table)
        paged = False
        starts = cu_k[:-1]
    elif not paged:
        starts = None if cache_batch_idx is None else cache_batch_idx * capacity  # None: row b, the common call
        k_cache = k_cache.reshape(-1, Hk, D)  # (a view of a contiguous cache)
        v_cache = v_cache.reshape(-1, Hk, Dv)
    # (the plan sees the capacity: the lengths are on the device, and reading them would sync)
    pack, splits = plan(q, B, Sq, H, capacity, Hk, wl, 0 if call.causal else wr) if Sq <= 16 else (1, 1)
    if num_splits >= 1:  # the caller's count (1: unsplit); 0 picks (FA2's)
        splits = num_splits
    cu_q = _arange(q.device, B, Sq)
    qp = q.reshape(B * Sq, H, D)
    if paged:
        out, lse = launch.forward_varlen(qp, k_cache, v_cache, cu_q, None, used, Sq, call.softmax_scale, call.causal,
                                         "sm_90a", wl, wr, call.softcap, sink=sink, pack=pack, splits=splits,
                                         page_table=block_table)
    else:
        if starts is None and leftpad is None:
            cu_k = _arange(q.device, B, capacity)
        else:
            if starts is None:
                starts = _arange(q.device, B, capacity)[:B]
            if leftpad is not None:
                starts = starts + leftpad
                used = used - leftpad
            # the last entry only closes the vector: the kernel reads each sequence's length from seqused_k
            cu_k = torch.cat((starts.to(torch.int32), starts.new_full((1,), k_cache.shape[0]).to(torch.int32)))
        if used.dtype != torch.int32:
            used = used.to(torch.int32)
        out, lse = launch.forward_varlen(qp, k_cache, v_cache, cu_q, cu_k, used, Sq,
                                         call.softmax_scale, call.causal, "sm_90a", wl, wr, call.softcap, sink=sink,
                                         pack=pack, splits=splits)
    return out.view(B, Sq, H, Dv), lse.view(H, B, Sq).transpose(0, 1)
