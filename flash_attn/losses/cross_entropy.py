"""Cross-entropy loss module over the fused kernel of :mod:`flash_attn.ops.triton.cross_entropy`
(vocab up to 256k without fp32 copies of the logits, label smoothing, z-loss, in-place gradient, and a
vocab split across a tensor-parallel process group). API of FA2's ``flash_attn.losses.cross_entropy``."""
from torch import nn

from flash_attn.ops.triton.cross_entropy import cross_entropy_loss


class CrossEntropyLoss(nn.Module):
    """Cross-entropy of (batch, vocab) logits against (batch,) class ids.

    logit_scale multiplies the logits first; lse_square_scale adds the z-loss lse_square_scale *
    logsumexp(logits)^2 per row; inplace_backward overwrites the logits with their gradient (they must not
    be used after backward); process_group: each rank holds a consecutive, equal shard of the vocab.
    """

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, logit_scale=1.0,
                 lse_square_scale=0.0, inplace_backward=False, process_group=None, return_z_loss=False):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise NotImplementedError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.logit_scale = logit_scale
        self.lse_square_scale = lse_square_scale
        self.inplace_backward = inplace_backward
        self.process_group = process_group
        self.return_z_loss = return_z_loss

    def forward(self, input, target, precomputed_lse=None):
        """input: (batch, vocab); target: (batch,) int. Returns the loss, () for 'mean'/'sum' or
        (batch,) for 'none', fp32; and the z-loss the same way if return_z_loss."""
        loss, z_loss = cross_entropy_loss(
            input, target, precomputed_lse=precomputed_lse, label_smoothing=self.label_smoothing,
            logit_scale=self.logit_scale, lse_square_scale=self.lse_square_scale, ignore_index=self.ignore_index,
            inplace_backward=self.inplace_backward, process_group=self.process_group)
        loss, z_loss = self._reduce(loss, target), self._reduce(z_loss, target)
        return (loss, z_loss) if self.return_z_loss else loss

    def _reduce(self, x, target):
        if self.reduction == "mean":
            return x.sum() / (target != self.ignore_index).sum()
        if self.reduction == "sum":
            return x.sum()
        return x
