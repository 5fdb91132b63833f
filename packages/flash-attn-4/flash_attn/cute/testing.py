"""Test helpers under FA4's names and signatures (FA4 ships them as ``flash_attn.cute.testing``; its test suite and
its users' tests import them): the naive reference ``attention_ref``, the masks it applies, padding helpers
(``unpad_input`` / ``pad_input`` / ``generate_random_padding_mask`` / ``generate_qkv``) and the fake-tensor helpers.
Plain PyTorch, no CuTeDSL; they run on any device.

Mask conventions (True = masked out), for query row i and key column j of a batch with Sq used query rows and Sk used
keys (from the padding masks when given, else the full lengths), aligned bottom-right (p = i + Sk - Sq):

- window (left, right), None meaning no limit on that side: with left None, j > p + right is masked; otherwise j is
  masked when j > min(p + right, Sk) (j > Sk with right None; the key padding masks the rest) or when j < p - left and
  j >= sink_token_length (the first sink_token_length keys stay visible on the left). causal is right = 0.
- attention_chunk c > 0: j outside [p - p mod c, p - p mod c + c) is masked.
- key_leftpad (B,): batch b's keys start at column key_leftpad[b]; the columns before it are masked everywhere and
  the others count from it.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch


# ----------------------------------------------------------------------------------------------------
# padding


def index_first_axis(x, indices):
    """x[indices] along the first axis (rows of a flattened (B * S, ...) tensor); differentiable."""
    return x.index_select(0, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero tensor (first_axis_dim, ...) with ``values`` at rows ``indices``; differentiable."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_copy(0, indices, values)


def is_fake_mode() -> bool:
    """Whether a FakeTensorMode is active (tensors carry shapes and dtypes, no data)."""
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def maybe_fake_tensor_mode(fake: bool = True):
    """A decorator that runs the function under torch's FakeTensorMode when ``fake`` (shapes and dtypes only: a way to
    trace calls, e.g. to fill a compile cache, without allocating device memory)."""
    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not fake:
                return fn(*args, **kwargs)
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode():
                return fn(*args, **kwargs)
        return wrapper
    return decorator


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (B, S, ...), attention_mask bool (B, S) -> (rows (total, ...), indices (total,) into B * S,
    cu_seqlens int32 (B + 1,), max_seqlen int, seqused int32 (B,)). unused_mask (B, S): rows kept in the packed
    layout (counted in cu_seqlens and max_seqlen) but not used (not in seqused). Under FakeTensorMode every row is
    kept (no data to read)."""
    keep = attention_mask if unused_mask is None else attention_mask | unused_mask.bool()
    B, S = attention_mask.shape
    seqlens = keep.sum(-1, dtype=torch.int32)
    seqused = attention_mask.sum(-1, dtype=torch.int32)
    if is_fake_mode():
        indices = torch.arange(B * S, device=hidden_states.device)
        max_seqlen = S
    else:
        indices = keep.reshape(-1).nonzero().reshape(-1)
        max_seqlen = int(seqlens.max()) if B else 0
    cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=seqlens.device)
    cu_seqlens[1:] = seqlens.cumsum(0)
    rows = index_first_axis(hidden_states.reshape(B * S, *hidden_states.shape[2:]), indices)
    return rows, indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: rows (total, ...) -> (batch, seqlen, ...), zeros where no row was."""
    full = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return full.reshape(batch, seqlen, *hidden_states.shape[1:])


def generate_random_padding_mask(max_seqlen, batch_size, device, mode="random", zero_lengths=False, min_seqlen=None):
    """Bool (batch_size, max_seqlen), True for each sequence's first ``length`` positions. mode "full": every length
    max_seqlen; "random": uniform in [max(min_seqlen, max_seqlen - 20), max_seqlen]; "third": uniform in
    [max(min_seqlen, max_seqlen // 3), max_seqlen]. min_seqlen defaults to 1 (0 with zero_lengths). zero_lengths: the
    sequences at indices 0, 5, 10, ... and the last one get length 0."""
    if mode not in ("full", "random", "third"):
        raise ValueError(f"mode must be 'full', 'random' or 'third', got {mode!r}")
    if min_seqlen is None:
        min_seqlen = 0 if zero_lengths else 1
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, dtype=torch.int32, device=device)
    else:
        low = max_seqlen - 20 if mode == "random" else max_seqlen // 3
        lengths = torch.randint(max(min_seqlen, low), max_seqlen + 1, (batch_size, 1), device=device)
    if zero_lengths:
        lengths[::5] = 0
        lengths[-1] = 0
    return torch.arange(max_seqlen, device=device)[None, :] < lengths


def generate_qkv(q, k, v, query_padding_mask=None, key_padding_mask=None, qv=None, kvpacked=False, qkvpacked=False,
                 query_unused_mask=None, key_unused_mask=None):
    """Varlen forms of batch-shaped q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) under padding masks (None:
    every position), with the functions that pad a varlen result back. Returns, as FA4's helper does:

    - default: (q_unpad, k_unpad, v_unpad, qv_unpad, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
      max_seqlen_k, q, k, v, qv, output_pad_fn, dq_pad_fn, dk_pad_fn);
    - kvpacked: (q_unpad, kv_unpad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, kv, output_pad_fn,
      dq_pad_fn, dkv_pad_fn);
    - qkvpacked (same masks, H == Hk): (qkv_unpad, cu_seqlens_q, max_seqlen_q, qkv, output_pad_fn, dqkv_pad_fn).

    The tensors are fresh leaves requiring grad (qv and qv_unpad: without grad); seqused_* are None without padding
    masks. *_unused_mask: see unpad_input (not with the packed forms)."""
    if kvpacked and qkvpacked:
        raise ValueError("kvpacked and qkvpacked are exclusive")
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    if tuple(k.shape) != (B, Sk, Hk, D) or tuple(v.shape[:3]) != (B, Sk, Hk):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if (query_unused_mask is not None or key_unused_mask is not None) and (kvpacked or qkvpacked):
        raise ValueError("the unused masks go with the unpacked form only")

    def flat(x):
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    def dense_cu(S):
        return torch.arange(B + 1, dtype=torch.int32, device=q.device) * S

    def unflat(S):
        return lambda x: x.reshape(B, S, *x.shape[1:])

    def leaf(x):
        return x.detach().requires_grad_()

    if query_padding_mask is not None:
        q_unpad, idx_q, cu_q, max_q, used_q = unpad_input(q, query_padding_mask, query_unused_mask)
        pad_q = functools.partial(_pad_with, indices=idx_q, batch=B, seqlen=Sq)
        qv_unpad = None if qv is None else flat(qv).index_select(0, idx_q)
    else:
        q_unpad, cu_q, max_q, used_q, pad_q = flat(q), dense_cu(Sq), Sq, None, unflat(Sq)
        qv_unpad = None if qv is None else flat(qv)
    if key_padding_mask is not None:
        k_unpad, idx_k, cu_k, max_k, used_k = unpad_input(k, key_padding_mask, key_unused_mask)
        v_unpad = unpad_input(v, key_padding_mask, key_unused_mask)[0]
        pad_k = functools.partial(_pad_with, indices=idx_k, batch=B, seqlen=Sk)
    else:
        k_unpad, v_unpad, cu_k, max_k, used_k, pad_k = flat(k), flat(v), dense_cu(Sk), Sk, None, unflat(Sk)

    if qkvpacked:
        same = (query_padding_mask is None and key_padding_mask is None) or (
            query_padding_mask is not None and key_padding_mask is not None
            and torch.equal(query_padding_mask, key_padding_mask))
        if not same or H != Hk:
            raise ValueError("qkvpacked needs the same padding for q and k and as many KV heads as query heads")
        return (leaf(torch.stack([q_unpad, k_unpad, v_unpad], 1)), cu_q, max_q, leaf(torch.stack([q, k, v], 2)),
                pad_q, pad_q)
    if kvpacked:
        return (leaf(q_unpad), leaf(torch.stack([k_unpad, v_unpad], 1)), cu_q, cu_k, max_q, max_k, leaf(q),
                leaf(torch.stack([k, v], 2)), pad_q, pad_q, pad_k)
    return (leaf(q_unpad), leaf(k_unpad), leaf(v_unpad), None if qv_unpad is None else qv_unpad.detach(), cu_q, cu_k,
            used_q, used_k, max_q, max_k, leaf(q), leaf(k), leaf(v), None if qv is None else qv.detach(), pad_q,
            pad_q, pad_k)


def _pad_with(x, indices, batch, seqlen):
    return pad_input(x, indices, batch, seqlen)


# ----------------------------------------------------------------------------------------------------
# masks


def _grid(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device):
    """(p, j, sk): each row's key position p = i + Sk - Sq and each column's key index j (after key_leftpad; a column
    before it gets an index past every limit), broadcastable to (Sq, Sk) or, with per-batch lengths, (B, 1, Sq, Sk),
    and Sk (int or (B, 1, 1, 1))."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    if key_leftpad is not None:
        pad = key_leftpad.to(device=device, dtype=torch.long).reshape(-1, 1, 1, 1)
        j = torch.where(j >= pad, j - pad, torch.full_like(j - pad, 2 ** 32))
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).reshape(-1, 1, 1, 1)
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1).reshape(-1, 1, 1, 1)
    return i + sk - sq, j, sk


def construct_local_mask(seqlen_q, seqlen_k, window_size=(None, None), sink_token_length=0, query_padding_mask=None,
                         key_padding_mask=None, key_leftpad=None, device=None):
    """True where the sliding window (module docstring) hides key j from query i; needs a limit on some side."""
    left, right = window_size
    p, j, sk = _grid(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    if left is None:
        if right is None:
            raise ValueError("construct_local_mask needs a window limit on at least one side")
        return j > p + right
    sk_t = torch.as_tensor(sk, device=p.device)
    beyond = j > sk_t if right is None else j > torch.minimum(p + right, sk_t)
    return beyond | ((j < p - left) & (j >= sink_token_length))


def construct_chunk_mask(seqlen_q, seqlen_k, attention_chunk, query_padding_mask=None, key_padding_mask=None,
                         key_leftpad=None, device=None):
    """True where key j lies outside query i's chunk [p - p mod c, p - p mod c + c)."""
    p, j, _ = _grid(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad, device)
    start = p - torch.remainder(p, attention_chunk)
    return (j < start) | (j >= start + attention_chunk)


# ----------------------------------------------------------------------------------------------------
# the reference


def _per_head(t, heads):
    """(B, S, Hk, d) -> (B, S, heads, d): each KV head repeated for its group of query heads."""
    return t.repeat_interleave(heads // t.shape[2], dim=2)


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, key_leftpad=None, attn_bias=None,
                  dropout_p=0.0, dropout_mask=None, causal=False, qv=None, q_descale=None, k_descale=None,
                  v_descale=None, window_size=(None, None), attention_chunk=0, sink_token_length=0,
                  learnable_sink: Optional[torch.Tensor] = None, softcap=0.0, upcast=True, reorder_ops=False,
                  intermediate_dtype=None, return_lse=False, gather_kv_indices=None):
    """Naive attention with FA4's reference semantics: q (B, Sq, H, D) or None (with qv), k (B, Sk, Hk, D), v (B, Sk,
    Hk, Dv), qv (B, Sq, H, Dv): scores q.k (+ qv.v) times (D + Dv if qv and q else D) ** -0.5, softcap, the masks
    (padding, window / causal, chunk, gather_kv_indices (B, Sq, topk) key indices with -1 for an empty slot), attn_bias,
    softmax (with learnable_sink (H,) as an extra valueless term), dropout_mask (True = kept, scaled by 1 / (1 -
    dropout_p)), and the result in v's dtype. Returns (out (B, Sq, H, Dv), attention (B, H, Sq, Sk)), plus lse (B, H,
    Sq) with return_lse. upcast: compute in fp32; reorder_ops: scale k instead of q (PyTorch's rounding at another
    place); intermediate_dtype: round the probabilities through it before P V; *_descale (B, Hk) multiply q / k / v
    (FP8's dequantisation)."""
    if q is None and qv is None:
        raise ValueError("attention_ref needs q (and k) or qv")
    dtype_out = v.dtype
    if causal:
        window_size = (window_size[0], 0)
    if upcast:
        q, k, v, qv, learnable_sink = (None if t is None else t.float() for t in (q, k, v, qv, learnable_sink))
    B, Sq, H = (q if q is not None else qv).shape[:3]
    Sk = v.shape[1]
    if q_descale is not None:
        scale_q = q_descale.repeat_interleave(H // q_descale.shape[1], dim=1)[:, None, :, None].float()
        q, qv = (None if t is None else (t.float() * scale_q).to(t.dtype) for t in (q, qv))
    if k_descale is not None:
        k = (k.float() * k_descale[:, None, :, None].float()).to(k.dtype)
    if v_descale is not None:
        v = (v.float() * v_descale[:, None, :, None].float()).to(v.dtype)
    k = None if k is None else _per_head(k, H)
    v = _per_head(v, H)
    d = (q if q is not None else qv).shape[-1]
    scale = 1.0 / math.sqrt(d + v.shape[-1] if (qv is not None and q is not None) else d)

    def product(a, b):
        return torch.einsum("bihd,bjhd->bhij", a, b * scale) if reorder_ops else \
            torch.einsum("bihd,bjhd->bhij", a * scale, b)

    scores = None if q is None else product(q, k)
    if qv is not None:
        scores = product(qv, v) if scores is None else scores + product(qv, v)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    hidden = None
    if window_size[0] is not None or window_size[1] is not None:
        hidden = construct_local_mask(Sq, Sk, window_size, sink_token_length, query_padding_mask, key_padding_mask,
                                      key_leftpad, v.device)
    if attention_chunk > 0:
        chunk = construct_chunk_mask(Sq, Sk, attention_chunk, query_padding_mask, key_padding_mask, key_leftpad,
                                     v.device)
        hidden = chunk if hidden is None else hidden | chunk
    if gather_kv_indices is not None:
        idx = gather_kv_indices.long().to(v.device)
        idx = torch.where((idx < 0) | (idx >= Sk), torch.full_like(idx, Sk), idx)  # empty slots: a spare column
        chosen = torch.zeros(B, Sq, Sk + 1, dtype=torch.bool, device=v.device).scatter(-1, idx, True)[..., :Sk]
        scores = scores.masked_fill(~chosen[:, None], float("-inf"))
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    if learnable_sink is None:
        lse = torch.logsumexp(scores, -1)
        attention = torch.softmax(scores, -1).to(v.dtype)
    else:
        sink = learnable_sink.float().reshape(1, H, 1, 1).expand(B, H, Sq, 1)
        with_sink = torch.cat([scores.float(), sink], -1)
        lse = torch.logsumexp(with_sink, -1).to(dtype_out)
        attention = torch.softmax(with_sink, -1)[..., :-1].to(v.dtype)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    if key_padding_mask is not None:
        attention = attention.masked_fill(~key_padding_mask[:, None, None, :], 0.0)
    if hidden is not None:  # rows the masks hide entirely: 0, not softmax's NaN
        attention = attention.masked_fill(hidden.all(-1, keepdim=True), 0.0)
    dropped = attention if dropout_mask is None else attention.masked_fill(~dropout_mask, 0.0)
    if intermediate_dtype is not None:
        dropped = dropped.to(intermediate_dtype).to(dropped.dtype)
    out = torch.einsum("bhij,bjhd->bihd", dropped, v * (1.0 / (1.0 - dropout_p)))
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask[:, :, None, None], 0.0)
    if return_lse:
        return out.to(dtype_out), attention.to(dtype_out), lse.to(dtype_out)
    return out.to(dtype_out), attention.to(dtype_out)


__all__ = ["attention_ref", "construct_chunk_mask", "construct_local_mask", "generate_qkv",
           "generate_random_padding_mask", "index_first_axis", "index_put_first_axis", "is_fake_mode",
           "maybe_fake_tensor_mode", "pad_input", "unpad_input"]
