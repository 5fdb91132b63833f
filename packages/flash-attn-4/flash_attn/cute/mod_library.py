"""Ready score_mod / mask_mod functions (FA4's convention, score_mod.py) for the masks and biases users ask for most:
causal, sliding window, document (packed-sequence) masking, prefix-LM, ALiBi, relative position bias, T5's bucketed
relative bias and softcap. Each factory returns a ``Mods``: the functions and aux tensors to pass to
``flash_attn_func`` / ``flash_attn_varlen_func`` (``mods.kwargs()``) and ``reference``, the same modification in plain
PyTorch, for checks.

Positions are bottom-right aligned, as the native masks are: query i of Sq sits at key position i + Sk - Sq (for
Sq == Sk simply i). The functions are built once per set of compile-time constants (functools.lru_cache), so the
kernel compiled for them is reused by later calls (mods.py keys kernels by the function object); values that vary
call to call (ALiBi slopes, bias tables, document ids) travel as aux tensors. Score mods come with their
``score_mod_bwd``, so they train.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Mods:
    """A ready modification: ``score_mod`` / ``score_mod_bwd`` / ``mask_mod`` (CuTeDSL functions or None) and
    ``aux_tensors`` (a list or None), and ``reference(scores)``: fp32 scaled scores (B, H, Sq, Sk) -> the modified
    scores, -inf where the mask drops a key (for tests and comparisons)."""
    score_mod: Optional[Callable] = None
    score_mod_bwd: Optional[Callable] = None
    mask_mod: Optional[Callable] = None
    aux_tensors: Optional[list] = None
    reference: Optional[Callable] = None

    def kwargs(self):
        """The keyword arguments of flash_attn_func / flash_attn_varlen_func for this modification."""
        out = {"score_mod": self.score_mod, "mask_mod": self.mask_mod, "aux_tensors": self.aux_tensors}
        if self.score_mod is not None:
            out["score_mod_bwd"] = self.score_mod_bwd
        return out


def _positions(Sq, Sk, device):
    """(query positions (Sq, 1), key positions (1, Sk)), bottom-right aligned."""
    q = torch.arange(Sq, device=device).view(-1, 1) + (Sk - Sq)
    k = torch.arange(Sk, device=device).view(1, -1)
    return q, k


def _masked(keep):
    def reference(s):
        return s.masked_fill(~keep(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return reference


# --- masks ------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _causal_fn():
    import cutlass.cute as cute

    @cute.jit
    def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx[0] <= q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q

    return causal


def causal():
    """Key j visible to query i iff j <= i + Sk - Sq (the native causal=True, as a mask_mod)."""
    return Mods(mask_mod=_causal_fn(), reference=_masked(lambda Sq, Sk, dev: _keep_window(Sq, Sk, dev, None, 0)))


def _keep_window(Sq, Sk, device, left, right):
    q, k = _positions(Sq, Sk, device)
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=device)
    if left is not None:
        keep &= k >= q - left
    if right is not None:
        keep &= k <= q + right
    return keep


@functools.lru_cache(maxsize=None)
def _window_fn(left, right):
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def sliding_window(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        pos = q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q
        return (kv_idx[0] >= pos - cutlass.Int32(left)) & (kv_idx[0] <= pos + cutlass.Int32(right))

    return sliding_window


def sliding_window(left, right=0):
    """Key j visible to query i iff i' - left <= j <= i' + right, i' = i + Sk - Sq (right=0: causal sliding window;
    the native window_size=(left, right), as a mask_mod). left, right >= 0."""
    left, right = int(left), int(right)
    if left < 0 or right < 0:
        raise ValueError(f"sliding_window: left / right must be >= 0, got {left} / {right}")
    return Mods(mask_mod=_window_fn(left, right),
                reference=_masked(lambda Sq, Sk, dev: _keep_window(Sq, Sk, dev, left, right)))


@functools.lru_cache(maxsize=None)
def _prefix_fn(prefix):
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def prefix_lm(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        pos = q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q
        return (kv_idx[0] <= pos) | (kv_idx[0] < cutlass.Int32(prefix))

    return prefix_lm


def prefix_lm(prefix):
    """Prefix-LM: the first ``prefix`` keys are visible to every query (bidirectional), the rest causally."""
    prefix = int(prefix)
    if prefix < 0:
        raise ValueError(f"prefix_lm: prefix must be >= 0, got {prefix}")

    def keep(Sq, Sk, dev):
        _, k = _positions(Sq, Sk, dev)
        return _keep_window(Sq, Sk, dev, None, 0) | (k < prefix)
    return Mods(mask_mod=_prefix_fn(prefix), reference=_masked(keep))


@functools.lru_cache(maxsize=None)
def _document_fn(with_causal):
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def document(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        docs = aux_tensors[0]
        same = docs[b_idx[0], q_idx[0]] == docs[b_idx[0], kv_idx[0]]
        if cutlass.const_expr(with_causal):
            same = same & (kv_idx[0] <= q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q)
        return same

    return document


def document(doc_ids, causal=False):
    """Packed sequences in one row: query i sees key j iff doc_ids[b, i] == doc_ids[b, j] (and j <= i with causal);
    doc_ids (B, S) int32 on the GPU, one id per position, for self-attention (Sq == Sk == S)."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.dtype != torch.int32:
        raise ValueError(f"document: doc_ids must be an int32 (B, S) tensor, got "
                         f"{getattr(doc_ids, 'dtype', type(doc_ids).__name__)} {tuple(getattr(doc_ids, 'shape', ()))}")

    def keep(Sq, Sk, dev):
        if Sq != Sk or Sq != doc_ids.shape[1]:
            raise ValueError(f"document: {Sq} queries / {Sk} keys, doc_ids has {doc_ids.shape[1]} positions")
        ids = doc_ids.to(dev)
        same = (ids[:, :, None] == ids[:, None, :])[:, None]  # (B, 1, S, S)
        return same & _keep_window(Sq, Sk, dev, None, 0) if causal else same
    return Mods(mask_mod=_document_fn(bool(causal)), aux_tensors=[doc_ids], reference=_masked(keep))


# --- score mods ---------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _additive_bwd_fn():
    import cutlass.cute as cute

    @cute.jit
    def additive_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad  # score + a term that does not depend on it

    return additive_bwd


@functools.lru_cache(maxsize=None)
def _alibi_fn():
    import cutlass.cute as cute
    from cutlass import Float32

    @cute.jit
    def alibi(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slopes = aux_tensors[0]
        slope = cute.full_like(score, 0.0) + Float32(slopes[h_idx[0]])
        dist = (q_idx - kv_idx).to(Float32) + cute.full_like(score, 0.0) + Float32(
            seqlen_info.seqlen_k - seqlen_info.seqlen_q)
        zero = cute.full_like(dist, 0.0)
        return score - slope * cute.where(dist < zero, zero - dist, dist)

    return alibi


def alibi(slopes):
    """ALiBi (FA2's alibi_slopes): score - slopes[h] * |i + Sk - Sq - j|; slopes (H,) fp32 on the GPU (alibi_slopes()
    gives the paper's geometric ones)."""
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1 or slopes.dtype != torch.float32:
        raise ValueError(f"alibi: slopes must be an fp32 (H,) tensor, got {getattr(slopes, 'dtype', None)} "
                         f"{tuple(getattr(slopes, 'shape', ()))}")

    def reference(s):
        q, k = _positions(s.shape[-2], s.shape[-1], s.device)
        return s - slopes.to(s.device).view(-1, 1, 1) * (q - k).abs().to(s.dtype)
    return Mods(score_mod=_alibi_fn(), score_mod_bwd=_additive_bwd_fn(), aux_tensors=[slopes], reference=reference)


def alibi_slopes(nheads):
    """The ALiBi paper's slopes for ``nheads`` heads: 2^(-8 i / n) for the nearest power of two n, interleaved with
    the next power's odd ones when nheads is not a power of two (Press et al. 2022), fp32 (H,) on the CPU."""
    def power(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    n = 2 ** math.floor(math.log2(nheads))
    values = power(n)
    if n < nheads:
        values += power(2 * n)[0::2][:nheads - n]
    return torch.tensor(values, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _relative_fn(radius):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    @cute.jit
    def relative_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        table = aux_tensors[0]
        rel = kv_idx[0] - (q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q)
        rel = cutlass.max(cutlass.min(rel, cutlass.Int32(radius)), cutlass.Int32(-radius))
        bias = Float32(table[h_idx[0], rel + cutlass.Int32(radius)])
        return score + cute.full_like(score, 0.0) + bias

    return relative_bias


def _relative_index(Sq, Sk, device, radius):
    q, k = _positions(Sq, Sk, device)
    return (k - q).clamp(-radius, radius) + radius


def relative_position_bias(table):
    """score + table[h, clamp(j - i', -R, R) + R] (i' = i + Sk - Sq): a learned bias per head and relative distance,
    distances beyond R sharing the edge entries; table (H, 2R + 1) fp32 on the GPU."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.float32 or table.shape[1] % 2 == 0:
        raise ValueError(f"relative_position_bias: table must be an fp32 (H, 2R + 1) tensor, got "
                         f"{getattr(table, 'dtype', None)} {tuple(getattr(table, 'shape', ()))}")
    radius = table.shape[1] // 2

    def reference(s):
        idx = _relative_index(s.shape[-2], s.shape[-1], s.device, radius)
        return s + table.to(s.device)[:, idx][None]
    return Mods(score_mod=_relative_fn(radius), score_mod_bwd=_additive_bwd_fn(), aux_tensors=[table],
                reference=reference)


def t5_bucket(relative, num_buckets=32, max_distance=128, bidirectional=True):
    """T5's bucket of each relative distance (key - query), int64 like ``relative`` (Raffel et al. 2020): exact
    buckets for small distances, logarithmic ones up to max_distance, the last bucket beyond; bidirectional splits the
    buckets between the two signs."""
    relative = torch.as_tensor(relative)
    buckets = torch.zeros_like(relative, dtype=torch.long)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets += (relative > 0).long() * n
        dist = relative.abs()
    else:
        dist = (-relative).clamp(min=0)
    exact = n // 2
    log_ratio = torch.log(dist.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (n - exact)).long()
    large = large.clamp(max=n - 1)
    return buckets + torch.where(dist < exact, dist, large)


def t5_relative_bias(bucket_bias, max_len, max_distance=128, bidirectional=True):
    """T5's relative attention bias: score + bucket_bias[h, t5_bucket(j - i')] with bucket_bias (H, num_buckets)
    fp32 on the GPU; max_len: the longest Sq / Sk of the calls (the per-distance table covers distances up to it).
    A relative_position_bias whose table the buckets fill."""
    if not isinstance(bucket_bias, torch.Tensor) or bucket_bias.dim() != 2 or bucket_bias.dtype != torch.float32:
        raise ValueError(f"t5_relative_bias: bucket_bias must be an fp32 (H, num_buckets) tensor, got "
                         f"{getattr(bucket_bias, 'dtype', None)} {tuple(getattr(bucket_bias, 'shape', ()))}")
    rel = torch.arange(-int(max_len), int(max_len) + 1, device=bucket_bias.device)
    index = t5_bucket(rel, bucket_bias.shape[1], max_distance, bidirectional)
    return relative_position_bias(bucket_bias[:, index].contiguous())


@functools.lru_cache(maxsize=None)
def _softcap_fns(cap):
    import cutlass.cute as cute

    @cute.jit
    def softcap(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return cute.math.tanh(score * cute.full_like(score, 1.0 / cap), fastmath=True) * cute.full_like(score, cap)

    @cute.jit
    def softcap_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = cute.math.tanh(score * cute.full_like(score, 1.0 / cap), fastmath=True)
        return grad * (cute.full_like(t, 1.0) - t * t)

    return softcap, softcap_bwd


def softcap(cap):
    """cap * tanh(score / cap) (Gemma 2's logit softcap; the native softcap= as a score_mod, to combine with masks)."""
    cap = float(cap)
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap}")
    fwd, bwd = _softcap_fns(cap)
    return Mods(score_mod=fwd, score_mod_bwd=bwd, reference=lambda s: cap * torch.tanh(s / cap))


def combine(score, mask):
    """One call's modification from a score Mods and a mask Mods (e.g. combine(alibi(slopes), causal())): both
    functions, their aux tensors in one list (the mask's read aux_tensors[0]: so only a mask without aux tensors
    combines with a score mod that has them, and the other way round)."""
    if score.score_mod is None or mask.mask_mod is None or score.mask_mod is not None or mask.score_mod is not None:
        raise ValueError("combine: a Mods with a score_mod and one with a mask_mod")
    if score.aux_tensors and mask.aux_tensors:
        raise ValueError("combine: both read aux_tensors[0]; give one of them its aux tensors")

    def reference(s):
        return mask.reference(score.reference(s))
    return Mods(score_mod=score.score_mod, score_mod_bwd=score.score_mod_bwd, mask_mod=mask.mask_mod,
                aux_tensors=score.aux_tensors or mask.aux_tensors, reference=reference)
