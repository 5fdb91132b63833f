"""Multi-head attention module (drop-in for FlashAttention 2's ``flash_attn.modules.mha``).

``MHA`` projects to q/k/v, applies rotary embeddings (Su et al. 2021, RoFormer), and attends with either the
FlashAttention kernels (``use_flash_attn=True``: dense, varlen, padding masks through unpad -> varlen -> pad,
and ``flash_attn_with_kvcache`` for inference) or a plain-PyTorch softmax attention that materialises the
scores (``use_flash_attn=False``). Both paths share one masking convention: causal and sliding-window masks are
aligned to the bottom-right corner of each (unpadded) sequence, and ALiBi (Press et al. 2022) adds
``-slope * |i + Sk - Sq - j|`` to the scores.

Multi-query and grouped-query attention (``num_heads_kv < num_heads``) share each k/v head among
``num_heads // num_heads_kv`` query heads. Parameter names (``Wqkv``, ``Wq``, ``Wkv``, ``out_proj``,
``dwconv_qkv``, ``rotary_emb``) match FA2 so its checkpoints and state-dict remaps load unchanged. The
projections are ``flash_attn.ops.linear.Linear`` (fp32 weight gradients from the GEMM on CUDA; nn.Linear
on a CPU or with FLASH_ATTN_FP32_WGRAD=0; see that module), or its subclass ``FusedDense`` with fused_bias_fc.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flash_attn.call import window
from flash_attn.ops.linear import Linear


def get_alibi_slopes(nheads):
    """ALiBi head slopes (nheads,) as a list of floats: for n a power of two, 2^(-8k/n) for k = 1..n; else the
    n' = 2^floor(log2 n) slopes followed by every other slope of 2n' (the paper's recipe)."""
    if nheads < 1:
        raise ValueError(f"nheads must be >= 1, got {nheads}")
    def geometric(n):
        return [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)]
    if nheads & (nheads - 1) == 0:
        return geometric(nheads)
    lower = 1 << (nheads.bit_length() - 1)
    return geometric(lower) + geometric(2 * lower)[0::2][: nheads - lower]


def _window(window_size):
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints >= -1 (-1 = unbounded), got {window_size!r}")
    return tuple(window_size)


def _ranks(mask, length, device):
    """Position of each token among its sequence's real tokens (B, L) and the real-token counts (B,)."""
    if mask is None:
        return torch.arange(length, device=device)[None], torch.full((1,), length, device=device)
    mask = mask.bool()
    return mask.long().cumsum(-1) - 1, mask.sum(-1)


def attention_torch(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                    query_padding_mask=None, key_padding_mask=None, dropout_p=0.0):
    """Softmax attention in plain PyTorch, with the masking convention of the varlen FlashAttention kernels.

    q (B, Sq, H, D); k, v (B, Sk, Hk, D) with H % Hk == 0; padding masks (B, Sq) / (B, Sk) bool, True = real
    token. Each sequence behaves as if unpadded: query i sees key j iff their positions among the real tokens
    satisfy the (bottom-right aligned) causal/window constraint. Query rows with no visible key, and padded
    query rows, are 0. alibi_slopes: (H,) or (B, H) fp32. Returns (B, Sq, H, D) in q's dtype.
    """
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if nheads % nheads_k != 0:
        raise ValueError(f"query heads ({nheads}) must be a multiple of key/value heads ({nheads_k})")
    if nheads_k != nheads:
        k = k.repeat_interleave(nheads // nheads_k, dim=2)
        v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    compute_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 softmax for half inputs, fp64 stays
    scores = torch.einsum("bthd,bshd->bhts", q.to(compute_dtype), k.to(compute_dtype)) * scale
    q_rank, q_count = _ranks(query_padding_mask, seqlen_q, q.device)
    k_rank, k_count = _ranks(key_padding_mask, seqlen_k, q.device)
    q_pos = q_rank + (k_count - q_count)[:, None]  # bottom-right alignment per sequence
    rel = k_rank[:, None, :] - q_pos[:, :, None]  # (B or 1, Sq, Sk): key pos - query pos
    visible = torch.ones_like(rel, dtype=torch.bool)
    window_left, window_right = window(window_size, causal)
    if window_left >= 0:
        visible &= rel >= -window_left
    if window_right >= 0:
        visible &= rel <= window_right
    if key_padding_mask is not None:
        visible &= key_padding_mask.bool()[:, None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, nheads)
        scores = scores - slopes[:, :, None, None] * rel.abs()[:, None].to(compute_dtype)
    visible = visible[:, None]  # (B or 1, 1, Sq, Sk)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A fully masked row is NaN after softmax; FlashAttention defines its output as 0.
    probs = probs.masked_fill(~visible.any(-1, keepdim=True), 0.0)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    out = torch.einsum("bhts,bshd->bthd", probs, v.to(compute_dtype))
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask.bool()[:, :, None, None], 0.0)
    return out.to(q.dtype)


class _AttentionBase(nn.Module):
    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False):
        super().__init__()
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)
        self.window_size = _window(window_size)
        self.deterministic = deterministic
        self.register_buffer("alibi_slopes", alibi_slopes, persistent=False)

    def _apply(self, fn, *args, **kwargs):
        # model.to(bf16) would round the slopes; the kernels take them in fp32, so keep them exact.
        super()._apply(fn, *args, **kwargs)
        if self.alibi_slopes is not None and self.alibi_slopes.dtype != torch.float32:
            self.alibi_slopes = torch.tensor(get_alibi_slopes(self.alibi_slopes.shape[-1]),
                                             dtype=torch.float32, device=self.alibi_slopes.device)
        return self

    def _dropout_p(self):
        return self.drop.p if self.training else 0.0


class FlashSelfAttention(_AttentionBase):
    """Self-attention through the FlashAttention kernels.

    forward(qkv, causal=None, cu_seqlens=None, max_seqlen=None): qkv (B, S, 3, H, D), or (total, 3, H, D)
    with cu_seqlens int32 (B + 1,) and max_seqlen int -> (B, S, H, D) / (total, H, D).
    """

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        from flash_attn import flash_attn_qkvpacked_func, flash_attn_varlen_qkvpacked_func

        causal = self.causal if causal is None else causal
        kwargs = dict(dropout_p=self._dropout_p(), softmax_scale=self.softmax_scale, causal=causal,
                      window_size=self.window_size, alibi_slopes=self.alibi_slopes,
                      deterministic=self.deterministic)
        if cu_seqlens is None:
            return flash_attn_qkvpacked_func(qkv, **kwargs)
        if max_seqlen is None:
            raise ValueError("max_seqlen is required with cu_seqlens")
        return flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, **kwargs)


class FlashCrossAttention(_AttentionBase):
    """Attention of q over packed kv through the FlashAttention kernels (also used for GQA self-attention).

    forward(q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
    q (B, Sq, H, D), kv (B, Sk, 2, Hk, D); or varlen q (total_q, H, D), kv (total_k, 2, Hk, D) with
    cu_seqlens (for q) and cu_seqlens_k int32 (B + 1,) -> like q.
    """

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None,
                max_seqlen_k=None):
        from flash_attn import flash_attn_kvpacked_func, flash_attn_varlen_kvpacked_func

        causal = self.causal if causal is None else causal
        kwargs = dict(dropout_p=self._dropout_p(), softmax_scale=self.softmax_scale, causal=causal,
                      window_size=self.window_size, alibi_slopes=self.alibi_slopes,
                      deterministic=self.deterministic)
        if cu_seqlens is None:
            return flash_attn_kvpacked_func(q, kv, **kwargs)
        if cu_seqlens_k is None or max_seqlen is None or max_seqlen_k is None:
            raise ValueError("varlen cross-attention needs cu_seqlens, max_seqlen, cu_seqlens_k and max_seqlen_k")
        return flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                               **kwargs)


class SelfAttention(_AttentionBase):
    """Self-attention in plain PyTorch (materialises the (S, S) scores).

    forward(qkv, causal=None, key_padding_mask=None): qkv (B, S, 3, H, D), key_padding_mask (B, S) bool with
    True for real tokens -> (B, S, H, D); padded query rows are 0.
    """

    def forward(self, qkv, causal=None, key_padding_mask=None):
        q, k, v = qkv.unbind(dim=2)
        return attention_torch(q, k, v, self.softmax_scale, self.causal if causal is None else causal,
                               self.window_size, self.alibi_slopes, key_padding_mask, key_padding_mask,
                               self._dropout_p())


class CrossAttention(_AttentionBase):
    """Attention of q over packed kv in plain PyTorch.

    forward(q, kv, causal=None, key_padding_mask=None): q (B, Sq, H, D), kv (B, Sk, 2, Hk, D),
    key_padding_mask (B, Sk) bool -> (B, Sq, H, D). Causal is bottom-right aligned to the real keys.
    """

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        k, v = kv.unbind(dim=2)
        return attention_torch(q, k, v, self.softmax_scale, self.causal if causal is None else causal,
                               self.window_size, self.alibi_slopes, None, key_padding_mask, self._dropout_p())


class LinearResidual(Linear):
    """nn.Linear whose forward returns (output, input), for return_residual."""

    def forward(self, x):
        return super().forward(x), x


def _causal_dwconv(conv, x):
    # (B, S, C): depthwise conv over the sequence, padded on both sides and cropped at the end so position
    # s only sees s-2..s (no leak from the future).
    return conv(x.transpose(1, 2))[..., :-2].transpose(1, 2).contiguous()


class MHA(nn.Module):
    """Multi-head self- or cross-attention with optional GQA/MQA, rotary, ALiBi, sliding window, KV cache.

    Args:
        embed_dim: model width D = num_heads * head_dim.
        num_heads: query heads H; num_heads_kv: key/value heads Hk (default H; H % Hk == 0).
        cross_attn: separate ``Wq`` and ``Wkv`` projections, keys/values from ``x_kv``.
        qkv_proj_bias, out_proj_bias: biases of the input / output projections.
        dropout: attention-probability dropout (training only).
        softmax_scale: default 1 / sqrt(head_dim). causal: causal mask.
        layer_idx: key into ``inference_params.key_value_memory_dict`` (required for KV-cache inference).
        dwconv: depthwise causal conv (kernel 3) on q/k/v after the projection (Primer, So et al. 2021).
        rotary_emb_dim: rotate the first rotary_emb_dim dims of q and k (0 = no rotary);
            rotary_emb_base, rotary_emb_scale_base (xPos), rotary_emb_interleaved as in RotaryEmbedding.
        use_alibi: ALiBi slopes from get_alibi_slopes(num_heads). window_size: (left, right) sliding window.
        fused_bias_fc: the projections are ``flash_attn.ops.fused_dense.FusedDense`` (FA2's layers: same
            parameters and numerics as the default Linear, plus FusedDense's ``process_group`` argument).
        use_flash_attn: FlashAttention kernels (else the plain-PyTorch attention).
        return_residual: forward returns (out, x) for a following fused add-norm.
        checkpointing: recompute the attention in the backward pass instead of storing it.
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, dwconv=False,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None,
                 rotary_emb_interleaved=False, use_alibi=False, window_size=(-1, -1), fused_bias_fc=False,
                 use_flash_attn=False, return_residual=False, checkpointing=False, device=None, dtype=None):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if num_heads < 1 or embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        if num_heads_kv < 1 or num_heads % num_heads_kv != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_heads_kv ({num_heads_kv})")
        head_dim = embed_dim // num_heads
        if not 0 <= rotary_emb_dim <= head_dim or rotary_emb_dim % 2 != 0:
            raise ValueError(f"rotary_emb_dim must be an even number in [0, head_dim={head_dim}], got {rotary_emb_dim}")
        if cross_attn and rotary_emb_dim > 0:
            raise NotImplementedError("rotary embeddings with cross_attn=True (queries and keys have "
                                      "unrelated positions)")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_heads_kv = num_heads_kv
        self.head_dim = head_dim
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dwconv = dwconv
        self.rotary_emb_dim = rotary_emb_dim
        self.use_flash_attn = use_flash_attn
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        window_size = _window(window_size)

        if rotary_emb_dim > 0:
            from flash_attn.layers.rotary import RotaryEmbedding

            self.rotary_emb = RotaryEmbedding(rotary_emb_dim, base=rotary_emb_base,
                                              scale_base=rotary_emb_scale_base,
                                              interleaved=rotary_emb_interleaved, device=device)

        q_dim = head_dim * num_heads
        kv_dim = 2 * head_dim * num_heads_kv
        if fused_bias_fc:
            from flash_attn.ops.fused_dense import FusedDense

            linear_cls, residual_cls = FusedDense, partial(FusedDense, return_residual=True)
        else:
            linear_cls, residual_cls = Linear, LinearResidual
        in_cls = residual_cls if return_residual else linear_cls
        if not cross_attn:
            self.Wqkv = in_cls(embed_dim, q_dim + kv_dim, bias=qkv_proj_bias, **factory_kwargs)
        else:
            self.Wq = in_cls(embed_dim, q_dim, bias=qkv_proj_bias, **factory_kwargs)
            self.Wkv = linear_cls(embed_dim, kv_dim, bias=qkv_proj_bias, **factory_kwargs)
        if dwconv:
            def conv(channels):
                return nn.Conv1d(channels, channels, kernel_size=3, padding=2, groups=channels, **factory_kwargs)
            if not cross_attn:
                self.dwconv_qkv = conv(q_dim + kv_dim)
            else:
                self.dwconv_q = conv(q_dim)
                self.dwconv_kv = conv(kv_dim)

        alibi = (torch.tensor(get_alibi_slopes(num_heads), dtype=torch.float32, device=device)
                 if use_alibi else None)
        self_cls, cross_cls = ((FlashSelfAttention, FlashCrossAttention) if use_flash_attn
                               else (SelfAttention, CrossAttention))
        attn_kwargs = dict(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout,
                           window_size=window_size)
        self.inner_attn = self_cls(alibi_slopes=alibi, **attn_kwargs)
        self.inner_cross_attn = cross_cls(alibi_slopes=None if alibi is None else alibi.clone(), **attn_kwargs)
        self.out_proj = linear_cls(embed_dim, embed_dim, bias=out_proj_bias, **factory_kwargs)

    # ------------------------------------------------------------------------------------------------ cache
    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """KV cache (batch_size, max_seqlen, 2, num_heads_kv, head_dim), zero-filled, on the weights' device."""
        weight = self.out_proj.weight
        return torch.zeros(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                           dtype=weight.dtype if dtype is None else dtype, device=weight.device)

    def _kv_cache(self, inference_params, like):
        if self.layer_idx is None:
            raise ValueError("MHA needs layer_idx to use inference_params (it keys the KV cache)")
        caches = inference_params.key_value_memory_dict
        if self.layer_idx not in caches:
            caches[self.layer_idx] = self.allocate_inference_cache(
                inference_params.max_batch_size, inference_params.max_seqlen, dtype=like.dtype)
        cache = caches[self.layer_idx]
        start = inference_params.batch_size_offset
        return cache[start:start + like.shape[0]]

    @staticmethod
    def _cache_seqlens(inference_params, batch):
        lengths = inference_params.lengths_per_sample
        if lengths is None:
            return inference_params.seqlen_offset
        start = inference_params.batch_size_offset
        return lengths[start:start + batch]

    def _attend_with_cache(self, q, kv, inference_params):
        """q (B, S, H, D), kv (B, S, 2, Hk, D) already rotated: append kv to the cache, attend over it."""
        cache = self._kv_cache(inference_params, kv)
        seqlens = self._cache_seqlens(inference_params, q.shape[0])
        inner = self.inner_cross_attn
        if self.use_flash_attn:
            from flash_attn import flash_attn_with_kvcache

            return flash_attn_with_kvcache(
                q, cache[:, :, 0], cache[:, :, 1], k=kv[:, :, 0], v=kv[:, :, 1], cache_seqlens=seqlens,
                softmax_scale=inner.softmax_scale, causal=inner.causal, window_size=inner.window_size,
                alibi_slopes=inner.alibi_slopes)
        batch, seqlen = q.shape[:2]
        if isinstance(seqlens, int):
            if seqlens + seqlen > cache.shape[1]:
                raise ValueError(f"KV cache of {cache.shape[1]} positions cannot hold {seqlens} + {seqlen} tokens")
            cache[:, seqlens:seqlens + seqlen] = kv
            k, v = cache[:, :seqlens + seqlen].unbind(dim=2)
            return attention_torch(q, k, v, inner.softmax_scale, inner.causal, inner.window_size,
                                   inner.alibi_slopes)
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError("CUDA-graph capture of KV-cache attention needs use_flash_attn=True (the "
                                      "PyTorch path reads the cache lengths on the host)")
        ends = seqlens.long() + seqlen
        total = int(ends.max())
        if total > cache.shape[1]:
            raise ValueError(f"KV cache of {cache.shape[1]} positions cannot hold {total} tokens")
        positions = seqlens.long()[:, None] + torch.arange(seqlen, device=q.device)
        cache[torch.arange(batch, device=q.device)[:, None], positions] = kv
        key_mask = torch.arange(total, device=q.device)[None] < ends[:, None]
        k, v = cache[:, :total].unbind(dim=2)
        return attention_torch(q, k, v, inner.softmax_scale, inner.causal, inner.window_size,
                               inner.alibi_slopes, key_padding_mask=key_mask)

    # ---------------------------------------------------------------------------------------------- forward
    def _check_forward(self, x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset, inference_params,
                       extra):
        unknown = set(extra) - {"cu_seqlens_k", "max_seqlen_k"}
        if unknown:
            raise TypeError(f"MHA.forward got unexpected keyword arguments {sorted(unknown)}")
        if x_kv is not None and not self.cross_attn:
            raise ValueError("x_kv is only accepted with cross_attn=True")
        if cu_seqlens is not None:
            if not self.use_flash_attn:
                raise NotImplementedError("cu_seqlens (varlen input) needs use_flash_attn=True")
            if max_seqlen is None:
                raise ValueError("max_seqlen is required with cu_seqlens")
            if key_padding_mask is not None or inference_params is not None:
                raise ValueError("cu_seqlens cannot be combined with key_padding_mask or inference_params")
            if self.dwconv or self.rotary_emb_dim > 0:
                raise NotImplementedError("varlen input (cu_seqlens) with dwconv or rotary embeddings")
            if x.dim() != 2:
                raise ValueError(f"with cu_seqlens x must be (total, D), got shape {tuple(x.shape)}")
        elif x.dim() != 3:
            raise ValueError(f"x must be (B, S, D), got shape {tuple(x.shape)}")
        if extra and (cu_seqlens is None or not self.cross_attn):
            raise ValueError("cu_seqlens_k / max_seqlen_k are only accepted with cu_seqlens and cross_attn=True")
        if x.shape[-1] != self.embed_dim:
            raise ValueError(f"x has width {x.shape[-1]}, expected embed_dim={self.embed_dim}")
        if mixer_subset is not None and (self.causal or cu_seqlens is not None):
            raise ValueError("mixer_subset needs non-causal attention on padded (B, S, D) input")
        if inference_params is not None:
            if self.cross_attn or self.dwconv:
                raise NotImplementedError("KV-cache inference with cross_attn or dwconv")
            if key_padding_mask is not None or mixer_subset is not None:
                raise NotImplementedError("KV-cache inference with key_padding_mask or mixer_subset")

    def _project(self, x, x_kv, mixer_subset):
        """-> (qkv, q, kv, residual): for self-attention packed qkv (q, kv None), (..., S, 3, H, D) when Hk == H
        else (..., S, H + 2 Hk, D); for cross-attention q (..., Sq, H, D) and kv (..., Sk, 2, Hk, D)."""
        head = self.head_dim
        if not self.cross_attn:
            qkv = self.Wqkv(x)
            if self.return_residual:
                qkv, x = qkv
            if self.dwconv:
                qkv = _causal_dwconv(self.dwconv_qkv, qkv)
            if self.num_heads_kv == self.num_heads:
                return qkv.unflatten(-1, (3, self.num_heads, head)), None, None, x
            # GQA: one (..., H + 2 Hk, D) tensor, so rotary rotates q and k in one in-place op on one tensor
            # (in-place ops on two views of one base break torch.compile's autograd tracing).
            return qkv.unflatten(-1, (self.num_heads + 2 * self.num_heads_kv, head)), None, None, x
        x_q = x if mixer_subset is None else x[:, mixer_subset]
        q = self.Wq(x_q)
        if self.return_residual:
            q, x_q = q
        kv = self.Wkv(x_kv if x_kv is not None else x)
        if self.dwconv:
            q = _causal_dwconv(self.dwconv_q, q)
            kv = _causal_dwconv(self.dwconv_kv, kv)
        return None, q.unflatten(-1, (self.num_heads, head)), kv.unflatten(-1, (2, self.num_heads_kv, head)), x_q

    def _attend(self, qkv, q, kv, key_padding_mask, cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k,
                same_tokens):
        """same_tokens: queries and keys are the same tokens (self-attention, possibly through Wq/Wkv), so the
        key padding mask and cu_seqlens also describe the queries."""
        if not self.use_flash_attn:
            if qkv is not None:
                return self.inner_attn(qkv, key_padding_mask=key_padding_mask)
            if not same_tokens:
                return self.inner_cross_attn(q, kv, key_padding_mask=key_padding_mask)
            inner = self.inner_cross_attn
            return attention_torch(q, *kv.unbind(dim=2), inner.softmax_scale, inner.causal, inner.window_size,
                                   inner.alibi_slopes, key_padding_mask, key_padding_mask, inner._dropout_p())
        if key_padding_mask is not None:
            return self._attend_padded(qkv, q, kv, key_padding_mask, same_tokens)
        if qkv is not None:
            return self.inner_attn(qkv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if same_tokens and cu_seqlens_k is None:
            cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
        return self.inner_cross_attn(q, kv, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_k=cu_seqlens_k,
                                     max_seqlen_k=max_seqlen_k)

    def _attend_padded(self, qkv, q, kv, key_padding_mask, same_tokens):
        """Flash path for a padded batch: unpad -> varlen kernel -> pad (padded query rows come back 0)."""
        from flash_attn.bert_padding import pad_input, unpad_input

        if qkv is not None:
            batch, seqlen = qkv.shape[:2]
            qkv_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(qkv, key_padding_mask)
            out = self.inner_attn(qkv_unpad, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            return pad_input(out, indices, batch, seqlen)
        batch, seqlen_q = q.shape[:2]
        kv_unpad, _, cu_seqlens_k, max_seqlen_k, _ = unpad_input(kv, key_padding_mask)
        if same_tokens:
            q_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(q, key_padding_mask)
        else:  # every query is real; only the keys are padded
            q_unpad, indices, max_seqlen = q.flatten(0, 1), None, seqlen_q
            cu_seqlens = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        out = self.inner_cross_attn(q_unpad, kv_unpad, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k)
        if indices is None:
            return out.unflatten(0, (batch, seqlen_q))
        return pad_input(out, indices, batch, seqlen_q)

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
                inference_params=None, **kwargs):
        """
        x: (B, S, D), or (total, D) packed with cu_seqlens int32 (B + 1,) and max_seqlen (flash path only).
        x_kv: (B, Sk, D) keys/values source for cross-attention (default x).
        key_padding_mask: (B, S) (self) or (B, Sk) (cross) bool, True for real tokens.
        mixer_subset: index into the sequence dim; only those queries are computed (non-causal).
        inference_params: an InferenceParams; appends this call's keys/values to the KV cache at
            ``seqlen_offset`` (or per-sample ``lengths_per_sample``) and attends over the cache.
        kwargs: cu_seqlens_k, max_seqlen_k for varlen cross-attention.
        Returns (B, S, D) (or (total, D)); with return_residual, (out, x).
        """
        self._check_forward(x, x_kv, key_padding_mask, cu_seqlens, max_seqlen, mixer_subset, inference_params,
                            kwargs)
        qkv, q, kv, residual = self._project(x, x_kv, mixer_subset)
        if self.rotary_emb_dim > 0:
            offset, max_len = 0, None
            if inference_params is not None:
                offset = self._cache_seqlens(inference_params, x.shape[0])
                max_len = inference_params.max_seqlen
            # Rotary is self-attention only (checked in __init__), so q and k live in the packed qkv.
            qkv = self.rotary_emb(qkv, seqlen_offset=offset, max_seqlen=max_len,
                                  num_heads_q=self.num_heads if self.num_heads_kv != self.num_heads else None)
        if qkv is not None and self.num_heads_kv != self.num_heads:
            q = qkv[..., :self.num_heads, :]
            kv = qkv[..., self.num_heads:, :].unflatten(-2, (2, self.num_heads_kv))
            qkv = None
        if mixer_subset is not None and not self.cross_attn:
            if qkv is not None:
                q, kv, qkv = qkv[:, :, 0], qkv[:, :, 1:], None
            q = q[:, mixer_subset]
            if self.return_residual:
                residual = residual[:, mixer_subset]
        if inference_params is not None:
            if qkv is not None:
                q, kv = qkv[:, :, 0], qkv[:, :, 1:]
            out = self._attend_with_cache(q, kv, inference_params)
        else:
            same_tokens = x_kv is None and mixer_subset is None
            args = (qkv, q, kv, key_padding_mask, cu_seqlens, max_seqlen, kwargs.get("cu_seqlens_k"),
                    kwargs.get("max_seqlen_k"), same_tokens)
            if self.checkpointing and torch.is_grad_enabled():
                out = checkpoint(self._attend, *args, use_reentrant=False)
            else:
                out = self._attend(*args)
        out = self.out_proj(out.flatten(-2))
        return out if not self.return_residual else (out, residual)
