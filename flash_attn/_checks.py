"""Input validation for the public API: every check raises an exception that names the argument.

Shape, dtype and device checks run in Python before the op (they also run on fake tensors under
torch.compile). Checks that read tensor values (cu_seqlens monotone, block_table and cache_seqlens in
range) run inside the op's real implementation; on CUDA they cost a host sync, so a result is cached
per tensor object and version counter: the same cu_seqlens reused by every layer is read once.
"""
from __future__ import annotations

import weakref

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def tensor(name, t, ndim=None, dtypes=_FLOAT_DTYPES, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}; got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; all tensors must share a device")
    return t


def last_dim_contiguous(name, t):
    if t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride(-1) == 1); "
                         f"got strides {tuple(t.stride())}; call .contiguous()")


def qkv(q, k, v, varlen):
    """Shapes and dtypes of q (.., H, D), k (.., Hk, D), v (.., Hk, Dv); returns (H, Hk, D, Dv)."""
    qs, ks, vs = qkv_shapes(q, k, v, varlen)
    return qs[-2], ks[-2], qs[-1], vs[-1]


def qkv_shapes(q, k, v, varlen):
    """qkv's checks; returns the shapes (q.shape, k.shape, v.shape), read once (the common call's lengths come from
    them)."""
    nd = 3 if varlen else 4
    # The common call, accepted in one pass (a few us less per call); anything else takes the checks
    # below, which name what is wrong (or accept what this pass does not cover, like paged caches).
    if not varlen:
        # dense: the shapes unpacked (what is not three 4-D tensors fails here and gets the named checks below)
        try:
            qs, ks, vs = q.shape, k.shape, v.shape
            B, Sq, H, D = qs
            Bk, Sk, Hk, Dk = ks
            Bv, Sv, Hv, Dv = vs
            dt = q.dtype
        except (AttributeError, TypeError, ValueError):
            dt = None
        if (dt in _FLOAT_DTYPES and k.dtype is dt and v.dtype is dt and Dk == D and Bk == B and Bv == B
                and Sv == Sk and Hv == Hk and Hk and not H % Hk and 0 < D <= MAX_HEAD_DIM and 0 < Dv <= MAX_HEAD_DIM
                and (q.is_contiguous() or q.stride()[-1] == 1) and (k.is_contiguous() or k.stride()[-1] == 1)
                and (v.is_contiguous() or v.stride()[-1] == 1)):
            device = q.device
            if k.device == device and v.device == device:
                return qs, ks, vs
    elif isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        qs, ks, vs = q.shape, k.shape, v.shape
        dt = q.dtype
        # (element by element: slicing a torch.Size costs more than the whole comparison; stride()[-1] less than
        # stride(-1))
        if (len(qs) == nd and len(ks) == nd and len(vs) == nd and dt in _FLOAT_DTYPES and k.dtype == dt
                and v.dtype == dt and ks[-1] == qs[-1] and ks[0] == vs[0] and ks[1] == vs[1]
                and (varlen or (ks[2] == vs[2] and ks[0] == qs[0]))):
            H, D, Hk, Dv = qs[-2], qs[-1], ks[-2], vs[-1]
            # (is_contiguous() reads a flag, stride() builds a tuple: a contiguous tensor's last stride is 1 or its
            # last size 1)
            if (Hk and not H % Hk and 0 < D <= MAX_HEAD_DIM and 0 < Dv <= MAX_HEAD_DIM
                    and (q.is_contiguous() or q.stride()[-1] == 1 or D == 1)
                    and (k.is_contiguous() or k.stride()[-1] == 1 or D == 1)
                    and (v.is_contiguous() or v.stride()[-1] == 1 or Dv == 1)):
                device = q.device
                if k.device == device and v.device == device:
                    return qs, ks, vs
    tensor("q", q, nd)
    tensor("k", k, None, device=q.device)
    tensor("v", v, None, device=q.device)
    if k.dim() != q.dim() and not (varlen and k.dim() == 4):  # varlen paged caches are 4-D
        raise ValueError(f"k must have {nd} dims, got shape {tuple(k.shape)}")
    if v.dim() != k.dim():
        raise ValueError(f"v must have as many dims as k ({k.dim()}), got shape {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        last_dim_contiguous(name, t)
    H, D = q.shape[-2], q.shape[-1]
    Hk, Dk, Dv = k.shape[-2], k.shape[-1], v.shape[-1]
    if Dk != D:
        raise ValueError(f"k head dim {Dk} must equal q head dim {D}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v shape {tuple(v.shape)} must match k shape {tuple(k.shape)} except the last dim")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"batch size of k ({k.shape[0]}) must equal batch size of q ({q.shape[0]})")
    if Hk == 0 or H % Hk != 0:
        raise ValueError(f"number of query heads ({H}) must be a multiple of key/value heads ({Hk})")
    for name, d in (("head dim", D), ("v head dim", Dv)):
        if d > MAX_HEAD_DIM or d < 1:
            raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM}, got {d}")
    return q.shape, k.shape, v.shape


def scalars(dropout_p, softcap, softmax_scale, head_dim):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if softcap < 0.0:
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap}")
    if softcap > 0.0 and dropout_p > 0.0:
        raise ValueError("softcap and dropout_p > 0 cannot be combined")
    if softmax_scale is None:
        return head_dim ** -0.5
    return float(softmax_scale)


def alibi(alibi_slopes, batch, nheads, device):
    if alibi_slopes is None:
        return None
    tensor("alibi_slopes", alibi_slopes, None, dtypes=(torch.float32,), device=device)
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    return alibi_slopes


def sink(learnable_sink, nheads, device):
    """FA4's learnable sink: None, or one logit per query head, (H,) fp32/bf16/fp16 on q's device."""
    if learnable_sink is None:
        return None
    tensor("learnable_sink", learnable_sink, None, device=device)
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape ({nheads},) (one logit per query head), "
                         f"got {tuple(learnable_sink.shape)}")
    return learnable_sink


def int32_vector(name, t, length, device):
    tensor(name, t, 1, dtypes=(torch.int32,), device=device)
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} must have length {length}, got {t.shape[0]}")
    return t


def cu_seqlens(name, t, device):
    tensor(name, t, 1, dtypes=(torch.int32,), device=device)
    if t.shape[0] < 1:
        raise ValueError(f"{name} must have length batch + 1 >= 1, got 0")
    return t


# ---- value checks (inside the op, on real tensors) ----

_seen: dict[int, tuple] = {}
_TRUSTED = object()


def _cached(t, key, check):
    """Run check() once per (tensor object, version, key). Inference tensors have no version counter,
    so they are checked on every call."""
    if t.is_inference():
        check()
        return
    ident = id(t)
    hit = _seen.get(ident)
    stamp = (t._version, key)
    if hit is not None and (hit[0] is _TRUSTED or hit[0] == stamp):
        return
    check()
    ref = weakref.ref(t, lambda _, ident=ident: _seen.pop(ident, None))
    _seen[ident] = (stamp, ref)


def trust(t):
    """Skip the value checks of a tensor the API built itself from validated host values."""
    if not t.is_inference():
        ident = id(t)
        _seen[ident] = (_TRUSTED, weakref.ref(t, lambda _, ident=ident: _seen.pop(ident, None)))
    return t


_cuda_available: list = []  # [torch.cuda.is_available()], asked once: it does not change within a process


def _capturing():
    """Whether a CUDA graph is being captured on the current stream (the value checks, which read values back, are
    skipped then)."""
    if not _cuda_available:
        _cuda_available.append(torch.cuda.is_available())
    return _cuda_available[0] and torch.cuda.is_current_stream_capturing()


# A value check of a tensor of up to this many elements reads it whole into a Python list (one copy, no reduction
# launches: a decoding step's vectors); larger ones are reduced on their device and only the results travel.
_LIST_VALUES = 256


def cu_seqlens_values(name, cu, total, max_seqlen):
    def check():
        if cu.numel() <= _LIST_VALUES:
            c = cu.tolist()
            lens = [b - a for a, b in zip(c, c[1:])]
            first, last, min_len, max_len = c[0], c[-1], min(lens, default=0), max(lens, default=0)
        else:
            c = cu.to(torch.int64)
            lens = c[1:] - c[:-1]
            none = c[0] * 0  # (no sequence: no lengths)
            first, last, min_len, max_len = torch.stack([c[0], c[-1], lens.min() if lens.numel() else none,
                                                         lens.max() if lens.numel() else none]).tolist()
        if first != 0:
            raise ValueError(f"{name} must start at 0, got {first}")
        if min_len < 0:
            raise ValueError(f"{name} must be non-decreasing (int32 offsets of each sequence)")
        if total is not None and last > total:
            raise ValueError(f"{name}[-1] = {last} exceeds the number of tokens ({total})")
        if max_len > max_seqlen:
            raise ValueError(f"max_seqlen ({max_seqlen}) is smaller than the longest sequence in {name} "
                             f"({max_len})")

    if not _capturing():
        _cached(cu, (total, max_seqlen), check)


class PagedCapacityError(ValueError, RuntimeError):
    """cache_seqlens (with the appended keys) beyond the pages a block_table holds. FA2 raises RuntimeError there (its
    kernels would read block_table out of bounds), so this is one (and a ValueError, as the other value checks)."""


def range_values(name, t, lo, hi, error=ValueError, why=""):
    """All values of t in [lo, hi); else ``error`` naming them (``why``: what the bound is)."""
    def check():
        if t.numel() == 0:
            return
        if t.numel() <= _LIST_VALUES:
            values = t.reshape(-1).tolist()
            mn, mx = min(values), max(values)
        else:
            mn, mx = torch.stack([t.min(), t.max()]).tolist()
        if mn < lo or mx >= hi:
            raise error(f"{name} values must be in [{lo}, {hi}){why}, got min {mn}, max {mx}")

    if not _capturing():
        _cached(t, (lo, hi), check)
