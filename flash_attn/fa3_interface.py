"""FlashAttention-3's API: the functions of the top-level module ``flash_attn_interface`` that FA3 installs (this
package installs that module too; it re-exports these). They run on the same backends and call description as FA2's
API (flash_attn.flash_attn_interface), forward and backward.

FA3's arguments map onto the core's call:

- ``qv`` (.., H, Dv): the scores gain qv . v (FA3's form for multi-head latent attention). Served exactly as attention
  of cat(q, qv) over cat(k, v) with values v: head dim D + Dv, whose limit is the backends' (256), and FA3's default
  scale (D + Dv) ** -0.5. Differentiable in qv too.
- ``attention_chunk`` c > 0: query i of a sequence, at key position p = i + Sk - Sq, sees only the keys of its own
  chunk, [p - p mod c, p - p mod c + c), on top of its causal / window mask (chunked attention as in Llama 4; a
  query before the first key, p < 0, sees none). Served as varlen attention over sub-sequences, one per chunk
  (:func:`_segments`): within a chunk the bottom-right alignment and every window offset are the whole sequence's,
  so the result is exact, and the backward exists (FA3 has none for it).
- ``seqused_q`` / ``seqused_k`` (varlen, int32 (B,)): sequence b uses the first seqused_q[b] query rows and
  seqused_k[b] keys of its cu_seqlens ranges (values past a range's length act as the length); the causal / window
  alignment is that of the used lengths. The other rows go into sub-sequences of their own: a row past seqused_q
  gets out 0 and lse +inf, a key past seqused_k is seen by no query and gets zero gradients.
- ``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata``: scheduling hints. Validated; they change no
  result (the backends choose their own schedules).
- ``q_descale`` / ``k_descale`` / ``v_descale``: FP8 attention is not implemented; given, they raise
  NotImplementedError.
- ``return_attn_probs``: FA3 returns (out, softmax_lse) then (no probabilities), and so do these.

``_flash_attn_forward`` / ``_flash_attn_backward``: FA3's lower-level ops with their arguments, routed to the calls
above and to FA2's lower-level backward.

``flash_attn_with_kvcache``: a call with FA2's arguments only (``page_table`` is FA2's ``block_table``) runs FA2's
KV-cache op; varlen queries and new keys (``cu_seqlens_q``, ``cu_seqlens_k_new``), ``rotary_seqlens`` and
``attention_chunk`` append and rotate with tensor ops and run the attention as a paged varlen call over one-row pages
(:func:`_kvcache_extras`); ``qv`` there raises NotImplementedError.
"""
from __future__ import annotations

import operator

import torch

from . import _checks
from . import flash_attn_interface as _fa2
from .call import window

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "flash_attn_combine", "get_scheduler_metadata", "_flash_attn_forward", "_flash_attn_backward"]


_FP8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                 if hasattr(torch, n))
# FA3's kernels take head dims up to 256, and V's up to 512 (with qv, the scores' D + Dv beyond 256): shapes FA3 serves
# that this package's kernels do not (yet) raise NotImplementedError rather than a ValueError for a bad input.
_FA3_MAX_HEAD_DIM = 512


def _refuse_fp8(q_descale, k_descale, v_descale, **tensors):
    """NotImplementedError for FP8: a descale argument, or an FP8 tensor among ``tensors`` (name=tensor or None)."""
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            raise NotImplementedError(f"{name}: FP8 attention is not implemented in this package; pass None "
                                      "(and fp16 / bf16 inputs)")
    for name, t in tensors.items():
        if getattr(t, "dtype", None) in _FP8:
            raise NotImplementedError(f"{name} is {str(t.dtype).replace('torch.', '')}: FP8 attention is not "
                                      "implemented in this package (fp16 / bf16 inputs)")


def _refuse_wide(qk, v):
    """NotImplementedError for the head dims FA3 serves beyond this package's 256: qk's (q's, with qv D + Dv) or v's."""
    for name, t in (("head dim", qk), ("v head dim", v)):
        d = t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() else 0
        if _checks.MAX_HEAD_DIM < d <= _FA3_MAX_HEAD_DIM:
            raise NotImplementedError(f"{name} {d}" + (" (q's with qv's)" if name == "head dim" else "")
                                      + f": FA3 serves it, this package's kernels take head dims up to "
                                      f"{_checks.MAX_HEAD_DIM}")


def _hints(num_splits, pack_gqa, sm_margin):
    """Validate the scheduling hints (they change no result here)."""
    for name, val in (("num_splits", num_splits), ("sm_margin", sm_margin)):
        try:
            operator.index(val)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(val).__name__}") from None
    if sm_margin < 0:
        raise ValueError(f"sm_margin must be >= 0, got {sm_margin}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None, True or False, got {pack_gqa!r}")


def _chunk(attention_chunk):
    try:
        chunk = operator.index(attention_chunk)
    except TypeError:
        raise TypeError(f"attention_chunk must be an int, got {type(attention_chunk).__name__}") from None
    if chunk < 0:
        raise ValueError(f"attention_chunk must be >= 0 (0: no chunking), got {chunk}")
    return chunk


def _with_qv(q, k, v, qv):
    """(q, k) of the call: cat(q, qv) and cat(k, v) along the head dim when qv is given."""
    if qv is None:
        return q, k
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, t)
    _checks.tensor("qv", qv, q.dim(), device=q.device)
    if qv.dtype != q.dtype:
        raise TypeError(f"qv must have q's dtype {q.dtype}, got {qv.dtype}")
    if k.dim() != v.dim() or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must match but for the head dim, got {tuple(k.shape)} and {tuple(v.shape)}")
    want = (*q.shape[:-1], v.shape[-1])
    if tuple(qv.shape) != want:
        raise ValueError(f"qv must have shape {want} (q's with v's head dim), got {tuple(qv.shape)}")
    return torch.cat([q, qv], -1), torch.cat([k, v], -1)


def _segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, chunk, max_seqlen_k):
    """(cu_seqlens_q, cu_seqlens_k) of the sub-sequences that make FA3's seqused_* and attention_chunk plain varlen
    attention, computed on the device (no host sync). Per sequence, with used lengths Lq, Lk and a = Lk - Lq, the
    boundaries (relative query row, relative key) are: (0, 0); with a chunk c, (clamp(t c - a, 0, Lq), clamp(t c, 0,
    Lk)) for t = 0 .. ceil(max_seqlen_k / c) (the first pair closes the rows before the first key, the others each
    chunk), else (Lq, Lk); then (len_q, Lk), closing the unused rows, and (len_q, len_k), closing the unused keys.
    Each sequence's last boundary is the next one's first, so the offsets chain; empty sub-sequences are allowed."""
    cq, ck = cu_seqlens_q.long(), cu_seqlens_k.long()
    len_q, len_k = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    used_q = len_q if seqused_q is None else torch.minimum(seqused_q.long().clamp_min(0), len_q)
    used_k = len_k if seqused_k is None else torch.minimum(seqused_k.long().clamp_min(0), len_k)
    zero = torch.zeros_like(len_q)[:, None]
    if chunk:
        starts = torch.arange(-(-max_seqlen_k // chunk) + 1, device=cq.device) * chunk  # t c, t = 0 .. M
        bq = torch.minimum((starts[None, :] - (used_k - used_q)[:, None]).clamp_min(0), used_q[:, None])
        bk = torch.minimum(starts[None, :], used_k[:, None])
    else:
        bq, bk = used_q[:, None], used_k[:, None]
    rel_q = torch.cat([zero, bq, len_q[:, None], len_q[:, None]], 1)
    rel_k = torch.cat([zero, bk, used_k[:, None], len_k[:, None]], 1)
    out = []
    for cu, rel in ((cq, rel_q), (ck, rel_k)):
        inner = (cu[:-1, None] + rel[:, :-1]).flatten()
        out.append(torch.cat([inner, cu[-1:]]).to(torch.int32))
    return out[0], out[1]


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, chunk,
            softmax_scale, causal, window_size, softcap, deterministic, return_lse):
    """A varlen call, through sub-sequences when seqused_* or a chunk asks for them."""
    if seqused_q is None and seqused_k is None and not chunk:
        return _fa2._attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, 0.0, softmax_scale,
                          causal, window_size, softcap, None, deterministic, False, return_lse=return_lse)
    _checks.tensor("q", q, 3)
    _checks.tensor("k", k, 3, device=q.device)
    _checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if cu_seqlens_k.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have length {batch + 1} like cu_seqlens_q, got {cu_seqlens_k.shape[0]}")
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError("max_seqlen_q and max_seqlen_k must be >= 0")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _checks.int32_vector(name, t, batch, q.device)
    # the caller's offsets are checked here; the sub-sequences built from them are valid by construction
    _checks.cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    _checks.cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    cu_q, cu_k = _segments(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, chunk, max_seqlen_k)
    # a chunk holds at most `chunk` keys, but a sub-sequence of unused keys may be as long as the sequence
    max_k = min(chunk, max_seqlen_k) if chunk and seqused_k is None else max_seqlen_k
    return _fa2._attn(q, k, v, _checks.trust(cu_q), _checks.trust(cu_k), max_seqlen_q, max_k, None, 0.0,
                      softmax_scale, causal, window_size, softcap, None, deterministic, False, return_lse=return_lse)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's flash_attn_func: q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> out (B, Sq, H, Dv), and
    softmax_lse fp32 (B, H, Sq) with return_attn_probs. See the module's docstring for qv, attention_chunk and the
    hints; the rest is FA2's flash_attn_func (bottom-right causal, window_size (-1: unbounded), softcap)."""
    _refuse_fp8(q_descale, k_descale, v_descale, q=q, k=k, v=v, qv=qv)
    _hints(num_splits, pack_gqa, sm_margin)
    chunk = _chunk(attention_chunk)
    qc, kc = _with_qv(q, k, v, qv)
    _refuse_wide(qc, v)
    if not chunk:
        if return_attn_probs:
            return _fa2._attn(qc, kc, v, None, None, None, None, None, 0.0, softmax_scale, causal, window_size,
                              softcap, None, deterministic, False, return_lse=True)
        return _fa2.flash_attn_func(qc, kc, v, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic)
    _checks.qkv(qc, kc, v, False)
    (B, Sq, H), Sk = q.shape[:3], k.shape[1]
    rows = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    cu_q, cu_k = _segments(rows * Sq, rows * Sk, None, None, chunk, Sk)
    res = _fa2._attn(qc.reshape(B * Sq, H, qc.shape[-1]), kc.reshape(B * Sk, *kc.shape[2:]),
                     v.reshape(B * Sk, *v.shape[2:]), _checks.trust(cu_q), _checks.trust(cu_k), Sq, min(chunk, Sk),
                     None, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic, False,
                     return_lse=return_attn_probs)
    out = (res[0] if return_attn_probs else res).reshape(B, Sq, H, v.shape[-1])
    if not return_attn_probs:
        return out
    return out, res[1].reshape(H, B, Sq).transpose(0, 1)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FA3's packed form: qkv (B, S, 3, H, D), or (B, S, H + 2 Hk, D) with num_heads_q = H (GQA packed)."""
    _checks.tensor("qkv", qkv)
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must have shape (B, S, 3, H, D), got {tuple(qkv.shape)}")
        q, k, v = qkv.unbind(2)
    elif qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("a 4-D qkv (B, S, H + 2 Hk, D) needs num_heads_q")
        heads_k, rest = divmod(qkv.shape[2] - int(num_heads_q), 2)
        if rest or heads_k <= 0 or num_heads_q <= 0:
            raise ValueError(f"qkv's {qkv.shape[2]} heads are not num_heads_q ({num_heads_q}) + 2 x the KV heads")
        q, k, v = qkv.split([int(num_heads_q), heads_k, heads_k], dim=2)
    else:
        raise ValueError(f"qkv must be 5-D (B, S, 3, H, D) or 4-D (B, S, H + 2 Hk, D), got {qkv.dim()}-D")
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3's varlen form: q (total_q, H, D), k (total_k, Hk, D), v (total_k, Hk, Dv), cu_seqlens_q / _k int32 (B + 1,)
    -> out (total_q, H, Dv), and softmax_lse fp32 (H, total_q) with return_attn_probs. seqused_q / seqused_k: see the
    module's docstring."""
    _refuse_fp8(q_descale, k_descale, v_descale, q=q, k=k, v=v, qv=qv)
    _hints(num_splits, pack_gqa, sm_margin)
    chunk = _chunk(attention_chunk)
    qc, kc = _with_qv(q, k, v, qv)
    _refuse_wide(qc, v)
    return _varlen(qc, kc, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, chunk,
                   softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3's KV-cache call: q (B, Sq, H, D), or varlen (total_q, H, D) with cu_seqlens_q (B + 1,) and max_seqlen_q;
    k_cache / v_cache (B_cache, S_cache, Hk, D / Dv), or paged (num_pages, page_size, Hk, D / Dv) with page_table
    (B, max_pages); new k / v (B, S_new, Hk, D / Dv), or varlen (total_new, Hk, ..) with cu_seqlens_k_new, written
    into the caches in place at cache_seqlens[b] + i after rotary (rotary_cos / rotary_sin (seqlen_ro, rotary_dim /
    2); positions from rotary_seqlens when given, else cache_seqlens; q's rows at the base position + i when causal or
    local, else all at the base). Each sequence attends to cache rows [cache_leftpad[b], cache_seqlens[b] + new keys)
    of cache_batch_idx[b] (or b), aligned bottom-right, with causal / window / attention_chunk (chunks count from
    cache_leftpad) and softcap. Returns out like q with head dim Dv, and softmax_lse fp32 ((B, H, Sq), or (H,
    total_q)) with return_softmax_lse. No backward.

    Calls with FA2's arguments only run FA2's KV-cache op (one kernel: append, rotary, attention); varlen queries or
    new keys, rotary_seqlens and attention_chunk append and rotate with tensor ops and run the attention as a paged
    varlen call (:func:`_kvcache_extras`)."""
    _refuse_fp8(q_descale, k_descale, v_descale, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, qv=qv)
    _hints(num_splits, pack_gqa, sm_margin)
    if qv is not None:
        raise NotImplementedError("flash_attn_with_kvcache: qv is not implemented in this package yet; pass None")
    _refuse_wide(q, v_cache)
    if page_table is not None and cache_batch_idx is not None:
        # FA3: sequence b reads (and appends to) the pages of page_table row cache_batch_idx[b]
        _checks.tensor("page_table", page_table, 2, dtypes=(torch.int32,), device=q.device)
        _checks.int32_vector("cache_batch_idx", cache_batch_idx, None, q.device)
        _checks.range_values("cache_batch_idx", cache_batch_idx, 0, page_table.shape[0],
                             why=f" (rows of page_table, {page_table.shape[0]})")
        page_table, cache_batch_idx = page_table.index_select(0, cache_batch_idx), None
    if scheduler_metadata is not None and not isinstance(scheduler_metadata, torch.Tensor):
        raise TypeError(f"scheduler_metadata must be None or get_scheduler_metadata's tensor, got "
                        f"{type(scheduler_metadata).__name__}")
    chunk = _chunk(attention_chunk)
    if cu_seqlens_q is None and cu_seqlens_k_new is None and rotary_seqlens is None and not chunk:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q goes with cu_seqlens_q (varlen queries)")
        return _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                            cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                            window_size, softcap, rotary_interleaved, None, num_splits,
                                            return_softmax_lse)
    out, lse = _kvcache_extras(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                               rotary_seqlens, softmax_scale, causal, window_size, chunk, softcap,
                               rotary_interleaved)
    return (out, lse) if return_softmax_lse else out


def _kvcache_extras(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                    page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens, softmax_scale, causal,
                    window_size, chunk, softcap, rotary_interleaved):
    """The KV-cache call with FA3's extras: append (with rotary) by tensor ops, then attention as a paged varlen call
    whose pages are single cache rows. Each sub-sequence (:func:`_segments`, chunks counted from the left pad) gets a
    row of the page table listing its keys' rows of the cache seen as (rows, 1, Hk, D), so any layout (batch_idx,
    left pad, pages of any size) reads the keys in place."""
    from .reference import rotate_at

    with torch.no_grad():
        dev = q.device
        _checks.tensor("k_cache", k_cache, 4, device=dev)
        _checks.tensor("v_cache", v_cache, 4, device=dev)
        varlen = cu_seqlens_q is not None
        if varlen:
            _checks.tensor("q", q, 3, device=dev)
            _checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, dev)
            if max_seqlen_q is None:
                raise ValueError("cu_seqlens_q needs max_seqlen_q")
            B, max_q = cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)
            _checks.cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_q)
            cu_q, rows_q = cu_seqlens_q.long(), q
        else:
            _checks.tensor("q", q, 4, device=dev)
            if max_seqlen_q is not None:
                raise ValueError("max_seqlen_q goes with cu_seqlens_q (varlen queries)")
            B, max_q = q.shape[0], q.shape[1]
            cu_q, rows_q = torch.arange(B + 1, device=dev) * max_q, q.reshape(B * max_q, *q.shape[2:])
        H, D = rows_q.shape[1], rows_q.shape[2]
        Hk, Dv = k_cache.shape[2], v_cache.shape[-1]
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
        if k_cache.shape[-1] != D or v_cache.shape[:-1] != k_cache.shape[:-1] or H % Hk:
            raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q's {H} heads of "
                             f"dim {D}")
        paged = page_table is not None
        if paged:
            _checks.tensor("page_table", page_table, 2, dtypes=(torch.int32,), device=dev)
            if page_table.shape[0] != B or cache_batch_idx is not None:
                raise ValueError(f"page_table must have {B} rows (and no cache_batch_idx beside it)")
            _checks.range_values("page_table", page_table, 0, k_cache.shape[0])
        capacity = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
        cache_row = torch.arange(B, device=dev) if cache_batch_idx is None else cache_batch_idx.long()
        if cache_batch_idx is not None:
            _checks.int32_vector("cache_batch_idx", cache_batch_idx, B, dev)
            _checks.range_values("cache_batch_idx", cache_batch_idx, 0, k_cache.shape[0])
        if cache_seqlens is None or isinstance(cache_seqlens, int):
            fill = capacity if cache_seqlens is None else cache_seqlens
            seqlens = torch.full((B,), fill, dtype=torch.long, device=dev)
        else:
            _checks.int32_vector("cache_seqlens", cache_seqlens, B, dev)
            seqlens = cache_seqlens.long()
        leftpad = torch.zeros(B, dtype=torch.long, device=dev)
        if cache_leftpad is not None:
            _checks.int32_vector("cache_leftpad", cache_leftpad, B, dev)
            leftpad = cache_leftpad.long()

        # the new keys, as rows (total_new, Hk, ..) with their sequence and position
        if (k is None) != (v is None):
            raise ValueError("k and v must be given together (or both None)")
        if k is None:
            if cu_seqlens_k_new is not None:
                raise ValueError("cu_seqlens_k_new goes with new k / v")
            cu_new = torch.zeros(B + 1, dtype=torch.long, device=dev)
            k_rows = v_rows = None
        elif cu_seqlens_k_new is not None:
            _checks.tensor("k", k, 3, device=dev)
            _checks.tensor("v", v, 3, device=dev)
            _checks.cu_seqlens("cu_seqlens_k_new", cu_seqlens_k_new, dev)
            if cu_seqlens_k_new.shape[0] != B + 1:
                raise ValueError(f"cu_seqlens_k_new must have length {B + 1}, got {cu_seqlens_k_new.shape[0]}")
            _checks.cu_seqlens_values("cu_seqlens_k_new", cu_seqlens_k_new, k.shape[0], capacity)
            cu_new, k_rows, v_rows = cu_seqlens_k_new.long(), k, v
        else:
            _checks.tensor("k", k, 4, device=dev)
            _checks.tensor("v", v, 4, device=dev)
            if k.shape[0] != B:
                raise ValueError(f"k must have batch {B}, got {k.shape[0]}")
            cu_new = torch.arange(B + 1, device=dev) * k.shape[1]
            k_rows, v_rows = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        if k_rows is not None and (k_rows.shape[1:] != (Hk, D) or v_rows.shape[1:] != (Hk, Dv)
                                   or k_rows.dtype != q.dtype or v_rows.dtype != q.dtype):
            raise ValueError(f"k / v must have the caches' heads and dims (Hk {Hk}, D {D}, Dv {Dv}) and q's dtype")
        n_new = cu_new[1:] - cu_new[:-1]
        ends = seqlens + n_new
        _checks.range_values("cache_seqlens + new keys", ends, 0, capacity + 1, why=" (the cache's capacity)")

        def cache_index(b, pos):
            """(first index, second index) into the caches of position pos of sequence b."""
            if not paged:
                return cache_row[b], pos
            size = k_cache.shape[1]
            return page_table.long()[b, pos // size], pos % size

        base = seqlens if rotary_seqlens is None else rotary_seqlens.long()
        if rotary_seqlens is not None:
            _checks.int32_vector("rotary_seqlens", rotary_seqlens, B, dev)
        if (rotary_cos is None) != (rotary_sin is None):
            raise ValueError("rotary_cos and rotary_sin must be given together")
        if k_rows is not None and k_rows.shape[0]:
            seq_new = torch.searchsorted(cu_new[1:], torch.arange(k_rows.shape[0], device=dev), right=True)
            step = torch.arange(k_rows.shape[0], device=dev) - cu_new[seq_new]
            if rotary_cos is not None:
                k_rows = rotate_at(k_rows, rotary_cos, rotary_sin, base[seq_new] + step, rotary_interleaved)
            first, second = cache_index(seq_new, seqlens[seq_new] + step)
            k_cache[first, second] = k_rows
            v_cache[first, second] = v_rows
        left, right = window(window_size, causal)
        if rotary_cos is not None:
            seq_q = torch.searchsorted(cu_q[1:], torch.arange(rows_q.shape[0], device=dev), right=True)
            at = base[seq_q] + ((torch.arange(rows_q.shape[0], device=dev) - cu_q[seq_q]) if (left, right) != (-1, -1)
                                else 0)
            rows_q = rotate_at(rows_q, rotary_cos, rotary_sin, at, rotary_interleaved)

        # attention: sub-sequences over each sequence's keys [leftpad, end), keys listed row by row
        cu_k = torch.zeros(B + 1, dtype=torch.long, device=dev)
        cu_k[1:] = (ends - leftpad).clamp_min(0).cumsum(0)
        seg_q, seg_k = _segments(cu_q, cu_k, None, None, chunk, capacity)
        per_seq = (seg_q.shape[0] - 1) // B if B else 0
        n_k = seg_k[1:] - seg_k[:-1]
        width = min(chunk, capacity) if chunk else capacity
        seg_seq = torch.arange(B, device=dev).repeat_interleave(per_seq)
        key = seg_k[:-1, None] - cu_k[seg_seq, None] + torch.arange(width, device=dev)  # relative key of each slot
        valid = key < (seg_k[1:, None] - cu_k[seg_seq, None])
        pos = (leftpad[seg_seq, None] + key).clamp(0, capacity - 1)
        first, second = cache_index(seg_seq[:, None], pos)
        table = torch.where(valid, first * k_cache.shape[1] + second, torch.zeros_like(pos)).to(torch.int32)
        rows_k = k_cache.reshape(-1, 1, Hk, D)
        rows_v = v_cache.reshape(-1, 1, Hk, Dv)
        cu_k_seg = torch.zeros(n_k.shape[0] + 1, dtype=torch.int32, device=dev)
        cu_k_seg[1:] = n_k.cumsum(0)
        out, lse = _fa2._attn(rows_q, rows_k, rows_v, _checks.trust(seg_q), _checks.trust(cu_k_seg), max_q, width,
                              _checks.trust(table), 0.0, softmax_scale, causal, window_size, softcap, None, False,
                              False, return_lse=True)
    if varlen:
        return out, lse
    return out.reshape(B, max_q, H, Dv), lse.reshape(H, B, max_q).transpose(0, 1)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges split-KV parts (FA3's): out_partial (num_splits, B, S, H, D) or (num_splits, total_q, H, D),
    lse_partial fp32 (num_splits, B, S, H) / (num_splits, total_q, H), each part normalised by its own row sum with
    lse its natural-log row sum. Returns (out, lse): out = sum_s exp(lse_s - lse) out_s in out_dtype (default
    out_partial's; written into ``out`` when given), lse = log sum_s exp(lse_s) fp32. A part with an infinite lse
    (it saw no key) adds nothing; a row no part saw gets out 0 and lse -inf."""
    _checks.tensor("out_partial", out_partial, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if out_partial.dim() not in (4, 5):
        raise ValueError(f"out_partial must be (num_splits, B, S, H, D) or (num_splits, total_q, H, D), got shape "
                         f"{tuple(out_partial.shape)}")
    _checks.tensor("lse_partial", lse_partial, dtypes=(torch.float32,), device=out_partial.device)
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        raise ValueError(f"lse_partial must have shape {tuple(out_partial.shape[:-1])}, got "
                         f"{tuple(lse_partial.shape)}")
    logits = lse_partial.masked_fill(~torch.isfinite(lse_partial), float("-inf"))
    lse = torch.logsumexp(logits, 0)
    weights = torch.softmax(logits, 0).nan_to_num(0.0)  # all parts empty: 0 / 0
    merged = torch.einsum("s...,s...d->...d", weights, out_partial.float())
    if out is None:
        return merged.to(out_dtype or out_partial.dtype), lse
    _checks.tensor("out", out, device=out_partial.device)
    if tuple(out.shape) != tuple(merged.shape):
        raise ValueError(f"out must have shape {tuple(merged.shape)}, got {tuple(out.shape)}")
    out.copy_(merged)
    return out, lse


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """FA3's signature. FA3 precomputes its split scheduler's state here; this package's kernels schedule without
    one, so the result is an empty int32 tensor on cache_seqlens' device, which flash_attn_with_kvcache accepts."""
    _checks.tensor("cache_seqlens", cache_seqlens, 1, dtypes=(torch.int32,))
    if num_heads_kv <= 0 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_q ({num_heads_q}) must be a multiple of num_heads_kv ({num_heads_kv})")
    _hints(num_splits, pack_gqa, sm_margin)
    _chunk(attention_chunk)
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)


# ----------------------------------------------------------------------------------------------------
# FA3's lower-level functions (libraries import them from flash_attn_interface)


def _flash_attn_forward(q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                        page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                        seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                        causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                        rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
    """FA3's forward op with its arguments -> (out, softmax_lse, out_accum, softmax_lse_accum); the last two are
    empty tensors (this package combines split-KV parts inside its calls). A call with new keys, a page table,
    kv_batch_idx, leftpad_k or rotary tables is a KV-cache call (k / v the caches, seqused_k their lengths, as FA3
    passes cache_seqlens); else varlen with cu_seqlens_q, else dense. ``out_``: written in place and returned."""
    window_size = (window_size_left, window_size_right)
    kvcache = any(t is not None for t in (k_new, page_table, kv_batch_idx, leftpad_k, rotary_cos))
    if kvcache:
        out, lse = flash_attn_with_kvcache(
            q, k, v, k_new, v_new, qv, rotary_cos, rotary_sin, seqused_k, kv_batch_idx, leftpad_k, page_table,
            cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, seqlens_rotary, q_descale, k_descale, v_descale,
            softmax_scale, causal, window_size, attention_chunk, softcap, rotary_interleaved, scheduler_metadata,
            num_splits, pack_gqa, sm_margin, return_softmax_lse=True)
    elif cu_seqlens_q is not None or cu_seqlens_k is not None:
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                          seqused_k, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
                                          window_size, attention_chunk, softcap, num_splits, pack_gqa, False,
                                          sm_margin, return_attn_probs=True)
    else:
        for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if t is not None:
                raise ValueError(f"{name} goes with cu_seqlens_q / cu_seqlens_k (varlen) or a KV cache")
        out, lse = flash_attn_func(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale, window_size,
                                   attention_chunk, softcap, num_splits, pack_gqa, False, sm_margin,
                                   return_attn_probs=True)
    if out_ is not None:
        _checks.tensor("out_", out_, device=q.device)
        if out_.shape != out.shape:
            raise ValueError(f"out_ must have shape {tuple(out.shape)}, got {tuple(out_.shape)}")
        out = out_.copy_(out)
    empty = torch.empty(0, device=q.device)
    return out, lse, empty, empty


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                         sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                         softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                         deterministic=False, sm_margin=0):
    """FA3's backward op (its argument names, ``sequed_*`` included): the gradients of a forward's (out,
    softmax_lse) go into dq, dk, dv (allocated when None); returns softmax_d = rowsum(dout * out), fp32 (B, H, Sq)
    or (H, total_q), unpadded. seqused_* as in flash_attn_varlen_func."""
    _hints(0, None, sm_margin)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if sequed_q is not None or sequed_k is not None:
            raise ValueError("sequed_q / sequed_k go with cu_seqlens_q / cu_seqlens_k (varlen)")
        return _fa2._flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, 0.0, softmax_scale, is_causal,
                                         window_size_left, window_size_right, softcap, None, deterministic)
    _checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    _checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if sequed_q is not None or sequed_k is not None:
        batch = cu_seqlens_q.shape[0] - 1
        for name, t in (("sequed_q", sequed_q), ("sequed_k", sequed_k)):
            if t is not None:
                _checks.int32_vector(name, t, batch, q.device)
        _checks.cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], int(max_seqlen_q))
        _checks.cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], int(max_seqlen_k))
        cu_q, cu_k = _segments(cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, 0, int(max_seqlen_k))
        cu_seqlens_q, cu_seqlens_k = _checks.trust(cu_q), _checks.trust(cu_k)
    return _fa2._flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, 0.0, softmax_scale, is_causal,
                                            window_size_left, window_size_right, softcap, None, deterministic)
