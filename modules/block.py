"""Transformer blocks: ``Block`` (mixer then MLP, pre- or post-norm) and ``ParallelBlock`` (mixer and MLP
side by side on the same normalized input, GPT-J / GPT-NeoX style).

Pre-norm blocks pass the residual stream separately (``(hidden_states, residual)``) so that the dropout,
residual add and normalization of the *next* sublayer can run as one fused kernel
(``fused_dropout_add_ln``), and so the residual can be kept in fp32 while the rest runs in bf16/fp16.
Stochastic depth (drop path) is Huang et al. 2016, "Deep Networks with Stochastic Depth", row mode: a whole
sample's sublayer output is dropped.

Parameter names (``mixer``, ``norm1``, ``mlp``, ``norm2``) match FlashAttention 2's ``flash_attn.modules.block``.
"""
from functools import partial

import torch
from torch import nn

from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import Mlp


class DropPath(nn.Module):
    """Zero a whole sample (row of the leading dim) with probability p, scale survivors by 1 / (1 - p)."""

    def __init__(self, p=0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"drop path probability must be in [0, 1), got {p}")
        self.p = p

    def row_scale(self, x):
        """(B, ...) -> per-row scale (B,) of 0 or 1/(1-p), in x's dtype; None when inactive."""
        if not self.training or self.p == 0.0:
            return None
        keep = torch.empty(x.shape[0], device=x.device, dtype=torch.float32).bernoulli_(1.0 - self.p)
        return (keep / (1.0 - self.p)).to(x.dtype)

    def forward(self, x):
        scale = self.row_scale(x)
        if scale is None:
            return x
        return x * scale.view(-1, *([1] * (x.dim() - 1)))

    def extra_repr(self):
        return f"p={self.p}"


def _is_rms_norm(norm):
    from flash_attn.ops.rms_norm import DropoutAddRMSNorm
    from flash_attn.ops.rms_norm import RMSNorm as FA2RMSNorm
    from flash_attn.ops.triton.layer_norm import RMSNorm

    # FA2's older RMSNorm modules (flash_attn.ops.rms_norm) as norm_cls: the fused path must not take them for
    # LayerNorms (their bias is None, which LayerNorm allows).
    return isinstance(norm, (RMSNorm, nn.RMSNorm, FA2RMSNorm, DropoutAddRMSNorm))


def _eps(norm):
    # nn.RMSNorm(eps=None) means torch.finfo(dtype).eps at run time.
    return norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps


def _fused_add_norm(x, residual, norm, dropout, drop_path, prenorm, residual_in_fp32, x1=None, norm1=None):
    """dropout(x) [* drop-path row scale] (+ dropout(x1)) + residual, then normalize, in one kernel."""
    from flash_attn.ops.triton.layer_norm import layer_norm_fn

    rowscale = drop_path.row_scale(x)
    if rowscale is not None:
        # The kernel takes one scale per token row, so the per-sample scale is broadcast over the sequence.
        rowscale = rowscale.view(-1, *([1] * (x.dim() - 2))).expand(x.shape[:-1])
    return layer_norm_fn(
        x, norm.weight, norm.bias, residual=residual, x1=x1,
        weight1=norm1.weight if norm1 is not None else None,
        bias1=norm1.bias if norm1 is not None else None,
        eps=_eps(norm), dropout_p=dropout.p if dropout.training else 0.0, rowscale=rowscale,
        prenorm=prenorm, residual_in_fp32=residual_in_fp32, is_rms_norm=_is_rms_norm(norm),
    )


class Block(nn.Module):
    """One transformer layer: mixer (attention) and MLP, each wrapped in dropout + residual + norm.

    Pre-norm (``prenorm=True``): ``forward(hidden_states, residual)`` returns ``(hidden_states, residual)``;
    the first block gets residual=None and hidden_states = the embeddings; the model applies the final
    dropout-add-norm. Post-norm: ``forward(hidden_states)`` returns hidden_states (BERT).
    Shapes: hidden_states (B, S, D) (or (total, D) with varlen mixer kwargs).

    Args:
        dim: model width D.
        mixer_cls, mlp_cls, norm_cls, dropout_cls: constructors taking dim (dropout_cls takes p).
            mlp_cls may be nn.Identity for attention-only blocks.
        resid_dropout1/2, drop_path1/2: dropout and stochastic-depth rates after the mixer / MLP.
        fused_dropout_add_ln: use the fused dropout + add + LayerNorm/RMSNorm kernel.
        return_residual: the mixer and MLP return (out, their input) (post-norm only), as FA2.
        residual_in_fp32: keep the pre-norm residual stream in fp32.
    """

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 prenorm=True, resid_dropout1=0.0, resid_dropout2=0.0, drop_path1=0.0, drop_path2=0.0,
                 fused_dropout_add_ln=False, return_residual=False, residual_in_fp32=False,
                 sequence_parallel=False, mark_shared_params=False):
        super().__init__()
        if sequence_parallel or mark_shared_params:
            raise NotImplementedError("sequence_parallel / mark_shared_params: tensor parallelism is not implemented")
        if residual_in_fp32 and not prenorm:
            raise ValueError("residual_in_fp32 is only meaningful with prenorm=True")
        if return_residual and prenorm:
            raise ValueError("return_residual is only supported with prenorm=False")
        self.prenorm = prenorm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.return_residual = return_residual
        self.residual_in_fp32 = residual_in_fp32
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=dim // 64)
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.drop_path1 = DropPath(drop_path1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        if not isinstance(self.mlp, nn.Identity):
            self.dropout2 = dropout_cls(resid_dropout2)
            self.drop_path2 = DropPath(drop_path2)
            self.norm2 = norm_cls(dim)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def _add_norm(self, x, residual, norm, dropout, drop_path):
        """Pre-norm: returns (norm(new_residual), new_residual)."""
        if self.fused_dropout_add_ln:
            return _fused_add_norm(x, residual, norm, dropout, drop_path, True, self.residual_in_fp32)
        dropped = drop_path(dropout(x))
        residual = dropped + residual if residual is not None else dropped
        out = norm(residual.to(dtype=norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return out, residual

    def _post_add_norm(self, x, residual, norm, dropout, drop_path):
        if self.fused_dropout_add_ln:
            return _fused_add_norm(x, residual, norm, dropout, drop_path, False, False)
        return norm((drop_path(dropout(x)) + residual).to(dtype=norm.weight.dtype))

    def forward(self, hidden_states, residual=None, mixer_subset=None, mixer_kwargs=None):
        """hidden_states (B, S, D); residual (B, S, D) or None (pre-norm only).

        mixer_subset: index into the sequence dim; the mixer computes queries only there (and the residual
        is sliced to match), e.g. BERT's last layer on masked tokens.
        """
        mixer_kwargs = dict(mixer_kwargs) if mixer_kwargs is not None else {}
        if mixer_subset is not None:
            mixer_kwargs["mixer_subset"] = mixer_subset
        if self.prenorm:
            hidden_states, residual = self._add_norm(hidden_states, residual, self.norm1, self.dropout1,
                                                     self.drop_path1)
            hidden_states = self.mixer(hidden_states, **mixer_kwargs)
            if mixer_subset is not None:
                residual = residual[:, mixer_subset]
            if not isinstance(self.mlp, nn.Identity):
                hidden_states, residual = self._add_norm(hidden_states, residual, self.norm2, self.dropout2,
                                                         self.drop_path2)
                hidden_states = self.mlp(hidden_states)
            return hidden_states, residual
        if residual is not None:
            raise ValueError("residual must be None for a post-norm Block")
        mixer_out = self.mixer(hidden_states, **mixer_kwargs)
        if self.return_residual:
            mixer_out, hidden_states = mixer_out
        elif mixer_subset is not None:
            hidden_states = hidden_states[:, mixer_subset]
        hidden_states = self._post_add_norm(mixer_out, hidden_states, self.norm1, self.dropout1,
                                            self.drop_path1)
        if not isinstance(self.mlp, nn.Identity):
            mlp_out = self.mlp(hidden_states)
            if self.return_residual:
                mlp_out, hidden_states = mlp_out
            hidden_states = self._post_add_norm(mlp_out, hidden_states, self.norm2, self.dropout2,
                                                self.drop_path2)
        return hidden_states


class ParallelBlock(nn.Module):
    """Attention and MLP in parallel on normalized inputs (GPT-J, GPT-NeoX): both outputs join the residual.

    ``forward(hidden_states1, hidden_states2, residual)`` returns ``(mixer_out, mlp_out, residual)``;
    the next block adds both to the residual. ``tied_norm`` feeds one normalized tensor to both branches
    (GPT-J); otherwise norm1 feeds the mixer and norm2 the MLP (GPT-NeoX). Shapes (B, S, D).
    """

    def __init__(self, dim, mixer_cls=None, mlp_cls=None, norm_cls=nn.LayerNorm, dropout_cls=nn.Dropout,
                 resid_dropout1=0.0, resid_dropout2=0.0, tied_norm=False, fused_dropout_add_ln=False,
                 residual_in_fp32=False, sequence_parallel=False, mark_shared_params=False):
        super().__init__()
        if sequence_parallel or mark_shared_params:
            raise NotImplementedError("sequence_parallel / mark_shared_params: tensor parallelism is not implemented")
        self.tied_norm = tied_norm
        self.fused_dropout_add_ln = fused_dropout_add_ln
        self.residual_in_fp32 = residual_in_fp32
        if mixer_cls is None:
            mixer_cls = partial(MHA, num_heads=dim // 64)
        if mlp_cls is None:
            mlp_cls = partial(Mlp, hidden_features=4 * dim)
        self.mixer = mixer_cls(dim)
        self.dropout1 = dropout_cls(resid_dropout1)
        self.norm1 = norm_cls(dim)
        self.mlp = mlp_cls(dim)
        self.dropout2 = dropout_cls(resid_dropout2)
        if not tied_norm:
            self.norm2 = norm_cls(dim)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, hidden_states1, hidden_states2=None, residual=None, mixer_kwargs=None):
        """hidden_states1/2 (B, S, D): previous mixer / MLP outputs (first block: embeddings, None)."""
        if self.fused_dropout_add_ln:
            norm2 = None if self.tied_norm else self.norm2
            outs = self._fused(hidden_states1, hidden_states2, residual, norm2)
            if self.tied_norm:
                hidden_states1, residual = outs
                hidden_states2 = hidden_states1
            else:
                hidden_states1, hidden_states2, residual = outs
        else:
            dropped = self.dropout1(hidden_states1)
            if hidden_states2 is not None:
                dropped = dropped + self.dropout2(hidden_states2)
            residual = dropped + residual if residual is not None else dropped
            hidden_states1 = self.norm1(residual.to(dtype=self.norm1.weight.dtype))
            hidden_states2 = (hidden_states1 if self.tied_norm
                              else self.norm2(residual.to(dtype=self.norm2.weight.dtype)))
            if self.residual_in_fp32:
                residual = residual.to(torch.float32)
        hidden_states1 = self.mixer(hidden_states1, **(mixer_kwargs or {}))
        hidden_states2 = self.mlp(hidden_states2)
        return hidden_states1, hidden_states2, residual

    def _fused(self, x, x1, residual, norm2):
        from flash_attn.ops.triton.layer_norm import layer_norm_fn

        if x1 is not None and self.dropout2.p != self.dropout1.p:
            raise ValueError("fused_dropout_add_ln needs resid_dropout1 == resid_dropout2 (one dropout rate)")
        return layer_norm_fn(
            x, self.norm1.weight, self.norm1.bias, residual=residual, x1=x1,
            weight1=norm2.weight if norm2 is not None else None,
            bias1=norm2.bias if norm2 is not None else None,
            eps=_eps(self.norm1), dropout_p=self.dropout1.p if self.training else 0.0,
            prenorm=True, residual_in_fp32=self.residual_in_fp32, is_rms_norm=_is_rms_norm(self.norm1),
        )
