"""Padding helpers for variable-length batches (drop-in for FlashAttention-2's ``flash_attn.bert_padding``):
turn a padded (B, S, ...) batch and its attention mask into the packed (total_tokens, ...) layout with
cu_seqlens that the varlen attention functions take, and back.
"""
import math

import torch
import torch.nn.functional as F


def _rows(t):
    # (N, ...) -> (N, prod(...)); an explicit width so that N = 0 (an empty batch) reshapes too
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def index_first_axis(input, indices):
    """input (N, ...) -> input[indices] (len(indices), ...); differentiable (scatter in backward)."""
    return _rows(input)[indices].reshape(indices.shape[0], *input.shape[1:])


def index_put_first_axis(values, indices, first_axis_dim):
    """Inverse of index_first_axis: a zero (first_axis_dim, ...) tensor with values at rows indices."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


class IndexFirstAxis(torch.autograd.Function):
    """index_first_axis as FA2's autograd class (``IndexFirstAxis.apply(input, indices)``)."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return index_first_axis(input, indices)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return index_put_first_axis(grad_output, indices, ctx.first_axis_dim), None


class IndexPutFirstAxis(torch.autograd.Function):
    """index_put_first_axis as FA2's autograd class (``IndexPutFirstAxis.apply(values, indices, first_axis_dim)``)."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        ctx.save_for_backward(indices)
        return index_put_first_axis(values, indices, first_axis_dim)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return index_first_axis(grad_output, indices), None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """(input[indices], input): the gathered rows and the whole input, for a residual that keeps every row; the
    gradient of both reaches input (FA2's ``index_first_axis_residual``)."""

    @staticmethod
    def forward(ctx, input, indices):
        ctx.save_for_backward(indices)
        return index_first_axis(input, indices), input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        # autograd materialises an unused output's gradient as zeros, so grad_residual is always a tensor; a
        # contiguous copy, because the rows are added into it through a reshaped view
        grad_input = grad_residual.clone(memory_format=torch.contiguous_format)
        _rows(grad_input).index_add_(0, indices, _rows(grad_output))
        return grad_input, None


index_first_axis_residual = IndexFirstAxisResidual.apply


def _cu_seqlens(seqlens):
    return F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (B, S, ...), attention_mask (B, S) bool/int with 1 for real tokens.

    unused_mask (B, S), optional: tokens that are allocated but unused; they are kept in the packed
    output (so a kernel may read them) but not counted in ``seqused``.
    Returns (hidden (total, ...), indices (total,) into the flattened B*S, cu_seqlens int32 (B + 1,),
    max_seqlen_in_batch int, seqused int32 (B,)).
    """
    all_masks = attention_mask if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen, used_seqlens


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden_states (total, ...) packed by unpad_input -> (batch, seqlen, ...) with zeros at padding."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Packed-sequence batches: row b of attention_mask_in_length (B, S) lists the lengths of the
    sequences concatenated in row b, then zeros (e.g. [2, 3, 0, 0] for two sequences of 2 and 3 tokens).

    Returns (hidden (total, ...), indices, cu_seqlens int32 (num_sequences + 1,), max_seqlen).
    """
    B, S = attention_mask_in_length.shape
    lengths = attention_mask_in_length.to(torch.int64)
    row_tokens = lengths.sum(dim=-1)
    # position p of row b is a real token iff p < total tokens of row b (sequences are left-packed)
    real = torch.arange(S, device=lengths.device)[None, :] < row_tokens[:, None]
    indices = torch.nonzero(real.flatten(), as_tuple=False).flatten()
    seqlens = lengths.flatten()
    seqlens = seqlens[seqlens > 0].to(torch.int32)
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, _cu_seqlens(seqlens), max_seqlen
