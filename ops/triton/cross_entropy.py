"""Cross-entropy loss over a large vocabulary with label smoothing, logit scaling and z-loss
(PaLM, Chowdhery et al. 2022, section 5: lse_square_scale * logsumexp^2), optionally with the vocab
split across a tensor-parallel process group. API of FA2's ``flash_attn.ops.triton.cross_entropy``.

Per row, with z = logit_scale * logits, eps = label_smoothing, V = total classes (all ranks):

    lse  = logsumexp(z)
    loss = lse - eps / V * sum(z) - (1 - eps) * z[label] + lse_square_scale * lse^2
    dz   = softmax(z) * (1 + 2 * lse_square_scale * lse) - eps / V - (1 - eps) * onehot(label)

(rows whose label is ignore_index get loss 0 and gradient 0). The forward pass streams each row once in
the logits' own dtype with an online logsumexp (never an fp32 copy of the logits); rows with few
programs per SM are split along the vocab and the partial (max, sum of exp) pairs merged. The backward
pass recomputes softmax from the saved lse, writing the gradient in place over the logits if asked.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from flash_attn import settings

from . import cdiv, device_ctx, launcher, next_power_of_2, num_sms, plan, tl, triton, use_triton, vec_align

# Block sizes, warps and layout from a sweep on an H200 at the GPT-2 medium shape (16384 x 50264 bf16;
# benchmarks/ops/bench_elementwise.py, results/h200/ops_elementwise.md: with the vectorised loads and the flat
# layout the forward takes 0.435 ms and the backward 0.918 ms, scalar loads 0.745 and 2.10); env
# FLASH_ATTN_OVERRIDES="ce.FWD_BLOCK=16384,ce.BWD_LAYOUT=flat" overrides them (benchmarks/ops/bench_elementwise.py).
FWD_BLOCK = 4096
FWD_WARPS = 4
# Software-pipelining depth of the forward's loop over a row (1: none, each block's load waits for the
# previous block's reductions).
FWD_STAGES = 1
BWD_BLOCK = 4096
BWD_WARPS = 4
# "row": a (rows, column blocks) grid, the last block of each row mostly masked when the vocab is not a
# multiple of BWD_BLOCK; "flat": contiguous logits and gradient as one array in full blocks, a block
# straddling at most two rows (falls back to "row" for other layouts or vocabs below BWD_BLOCK).
BWD_LAYOUT = "flat"
FIN_BLOCK_ROWS = 128
# False: scalar accesses as before VEC (the benchmark's baseline).
VECTORIZE = True
# Each vocab split streams at least this many columns; rows are split only while the grid is short of
# a few programs per SM.
MIN_SPLIT_COLS = 16384
# The PyTorch path upcasts this many logits to fp32 at a time (rows at once), bounding its extra memory.
TORCH_CHUNK_ELEMS = 1 << 22
settings.apply_knobs("ce", globals())



@triton.jit
def _ce_partial_kernel(
    LOGITS, PART_M, PART_S, PART_Z, n_cols_v, stride_row_v, cols_per_split, n_splits, logit_scale,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr, STAGES: tl.constexpr,
):
    # n_cols and the row stride arrive divided by VEC (see vec_align): multiplied back here, the compiler
    # knows both are multiples of VEC, so loads and their tail masks are VEC-wide vectors.
    n_cols = n_cols_v * VEC
    stride_row = stride_row_v * VEC
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, n_cols)
    LOGITS += row * stride_row
    m = -float("inf")
    s = 0.0
    sz = 0.0
    for c in tl.range(start, end, BLOCK, num_stages=STAGES):
        cols = c + tl.arange(0, BLOCK)
        mask = cols < end
        z = tl.load(LOGITS + cols, mask=mask, other=-float("inf")).to(tl.float32) * logit_scale
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # A block (or row) of -inf logits would give exp(-inf - -inf) = nan: rescale around 0 instead.
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), axis=0)
        if HAS_SMOOTHING:
            sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
        m = m_new
    idx = row * n_splits + split
    tl.store(PART_M + idx, m)
    tl.store(PART_S + idx, s)
    if HAS_SMOOTHING:
        tl.store(PART_Z + idx, sz)


@triton.jit
def _ce_finish_kernel(
    LOGITS, LABELS, PART_M, PART_S, PART_Z, LSE, LOSS, Z_LOSS,
    n_rows, n_cols, stride_row, n_splits, logit_scale, smoothing, lse_square_scale, ignore_index,
    total_classes, class_start,
    HAS_SMOOTHING: tl.constexpr, PRECOMPUTED_LSE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    sz = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if PRECOMPUTED_LSE:
        lse = tl.load(LSE + rows, mask=ok, other=0.0).to(tl.float32)
    else:
        m = tl.full([BLOCK_ROWS], -float("inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
        for k in range(0, n_splits):
            pm = tl.load(PART_M + rows64 * n_splits + k, mask=ok, other=-float("inf"))
            ps = tl.load(PART_S + rows64 * n_splits + k, mask=ok, other=0.0)
            m_new = tl.maximum(m, pm)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + ps * tl.exp(pm - m_safe)
            m = m_new
            if HAS_SMOOTHING:
                sz += tl.load(PART_Z + rows64 * n_splits + k, mask=ok, other=0.0)
        # Rows past the end stay finite (lse 0) so their masked-off arithmetic raises no inf * 0.
        lse = tl.where(ok, tl.log(tl.where(ok, s, 1.0)) + m, 0.0)
        tl.store(LSE + rows, lse, mask=ok)
    label = tl.load(LABELS + rows, mask=ok, other=ignore_index).to(tl.int64)
    valid = label != ignore_index
    local = label - class_start
    in_range = valid & (local >= 0) & (local < n_cols)
    z_label = tl.load(LOGITS + rows64 * stride_row + local, mask=ok & in_range, other=0.0).to(tl.float32)
    z_label = z_label * logit_scale
    # The label and smoothing terms: all each rank knows; the lse term needs every rank's vocab.
    part = (1.0 - smoothing) * z_label
    if HAS_SMOOTHING:
        part += smoothing * sz / total_classes
    if SPLIT:
        tl.store(LOSS + rows, -part, mask=ok)
    else:
        z_loss = tl.where(valid, lse_square_scale * lse * lse, 0.0)
        loss = tl.where(valid, lse - part + z_loss, 0.0)
        tl.store(LOSS + rows, loss, mask=ok)
        tl.store(Z_LOSS + rows, z_loss, mask=ok)


@triton.jit
def _ce_bwd_kernel(
    DLOGITS, LOGITS, DLOSS, LSE, LABELS, n_cols_v, stride_row_v, stride_drow_v, stride_dloss,
    logit_scale, smoothing, lse_square_scale, ignore_index, total_classes, class_start,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    # Lengths and strides divided by VEC, as in _ce_partial_kernel.
    n_cols = n_cols_v * VEC
    stride_row = stride_row_v * VEC
    stride_drow = stride_drow_v * VEC
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    label = tl.load(LABELS + row).to(tl.int64)
    dloss = tl.load(DLOSS + row * stride_dloss).to(tl.float32)
    dloss = tl.where(label != ignore_index, dloss, 0.0)
    lse = tl.load(LSE + row)
    z = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
    g = tl.exp(z - lse) * (1.0 + 2.0 * lse_square_scale * lse)
    g = tl.where(cols == label - class_start, g - (1.0 - smoothing), g)
    if HAS_SMOOTHING:
        g -= smoothing / total_classes
    tl.store(DLOGITS + row * stride_drow + cols, g * (dloss * logit_scale), mask=mask)


@triton.jit
def _ce_bwd_flat_kernel(
    DLOGITS, LOGITS, DLOSS, LSE, LABELS, n_rows, n_cols, n_elems_v, stride_dloss,
    logit_scale, smoothing, lse_square_scale, ignore_index, total_classes, class_start,
    HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    # Contiguous (n_rows, n_cols) logits and gradient, n_cols >= BLOCK: block b covers flat elements
    # [b * BLOCK, (b + 1) * BLOCK), which start in row0 at column col0 and from offset `boundary` on
    # belong to row0 + 1. Every block but the last is full and its addresses are aligned whatever n_cols
    # is; per element only two selects (lse, dloss) and the label compares differ from the row kernel.
    n_elems = n_elems_v * VEC
    start = tl.program_id(0).to(tl.int64) * BLOCK
    row0 = start // n_cols
    row1 = tl.minimum(row0 + 1, n_rows - 1)
    col0 = (start - row0 * n_cols).to(tl.int32)
    boundary = n_cols - col0
    label0 = tl.load(LABELS + row0).to(tl.int64) - class_start
    label1 = tl.load(LABELS + row1).to(tl.int64) - class_start
    # Offsets (int32, from the block's start) of the two rows' label columns, -1 when not in this shard.
    hit0 = tl.where((label0 >= 0) & (label0 < n_cols), label0 - col0, -1).to(tl.int32)
    hit1 = tl.where((label1 >= 0) & (label1 < n_cols), label1 + boundary, -1).to(tl.int32)
    d0 = tl.load(DLOSS + row0 * stride_dloss).to(tl.float32)
    d1 = tl.load(DLOSS + row1 * stride_dloss).to(tl.float32)
    d0 = tl.where(label0 + class_start != ignore_index, d0, 0.0) * logit_scale
    d1 = tl.where(label1 + class_start != ignore_index, d1, 0.0) * logit_scale
    lse0 = tl.load(LSE + row0)
    lse1 = tl.load(LSE + row1)
    offs = tl.arange(0, BLOCK)
    second = offs >= boundary
    lse = tl.where(second, lse1, lse0)
    mask = offs < tl.minimum(n_elems - start, BLOCK).to(tl.int32)
    z = tl.load(LOGITS + start + offs, mask=mask, other=0.0).to(tl.float32) * logit_scale
    g = tl.exp(z - lse) * (1.0 + 2.0 * lse_square_scale * lse)
    g = tl.where((offs == hit0) | (offs == hit1), g - (1.0 - smoothing), g)
    if HAS_SMOOTHING:
        g -= smoothing / total_classes
    tl.store(DLOGITS + start + offs, g * tl.where(second, d1, d0), mask=mask)


# Launchers (flash_attn.triton's fast relaunch where installed); each launch's plan key stands for its
# constexprs and options.
_L_PARTIAL = launcher(_ce_partial_kernel)
_L_FINISH = launcher(_ce_finish_kernel)
_L_BWD = launcher(_ce_bwd_kernel)
_L_BWD_FLAT = launcher(_ce_bwd_flat_kernel)


def _num_splits(n_rows: int, n_cols: int, device) -> int:
    want = cdiv(4 * num_sms(device), max(n_rows, 1))
    return max(1, min(cdiv(n_cols, MIN_SPLIT_COLS), want))


def _aligned(labels: Tensor) -> Tensor:
    # Triton assumes 16-byte alignment only where it sees it; a copy gives the int64 loads their usual
    # aligned address (FA2 notes wrong label loads from unaligned int64 views).
    return labels if labels.data_ptr() % 16 == 0 else labels.clone()


def _ce_fwd_launch(
    logits: Tensor, labels: Tensor, lse: Tensor, losses: Tensor, z_losses: Tensor, precomputed: bool,
    smoothing: float, logit_scale: float, lse_square_scale: float, ignore_index: int, total_classes: int,
    class_start: int, split: bool,
) -> None:
    """Fills lse (n_rows,) fp32 (unless precomputed), losses and z_losses. With split (vocab across
    ranks) losses receives only -(label and smoothing terms) and lse this rank's partial lse."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    labels = _aligned(labels)
    has_smoothing = smoothing > 0.0
    n_splits = 1
    part_m = part_s = part_z = lse
    with device_ctx(logits):
        if not precomputed:
            n_splits = _num_splits(n_rows, n_cols, logits.device)
            block = min(FWD_BLOCK, next_power_of_2(cdiv(n_cols, n_splits)))
            cols_per_split = cdiv(cdiv(n_cols, n_splits), block) * block
            n_splits = cdiv(n_cols, cols_per_split)
            part_m = torch.empty((n_rows, n_splits), device=logits.device, dtype=torch.float32)
            part_s = torch.empty_like(part_m)
            part_z = torch.empty_like(part_m) if has_smoothing else part_m
            vec = vec_align(logits.element_size(), n_cols, logits.stride(0)) if VECTORIZE else 1
            key, meta = plan("ce_partial", HAS_SMOOTHING=has_smoothing, BLOCK=block, VEC=vec, STAGES=FWD_STAGES,
                             num_warps=FWD_WARPS)
            _L_PARTIAL((n_rows, n_splits), (
                logits, part_m, part_s, part_z, n_cols // vec, logits.stride(0) // vec, cols_per_split, n_splits,
                logit_scale,
            ), meta, key)
        key, meta = plan("ce_finish", HAS_SMOOTHING=has_smoothing, PRECOMPUTED_LSE=precomputed, SPLIT=split,
                         BLOCK_ROWS=FIN_BLOCK_ROWS, num_warps=4)
        _L_FINISH((cdiv(n_rows, FIN_BLOCK_ROWS),), (
            logits, labels, part_m, part_s, part_z, lse, losses, z_losses,
            n_rows, n_cols, logits.stride(0), n_splits, logit_scale, smoothing, lse_square_scale, ignore_index,
            total_classes, class_start,
        ), meta, key)


_ce_fwd_op = torch.library.custom_op(
    "flash_attn_ops::cross_entropy_fwd", mutates_args=("lse", "losses", "z_losses"))(_ce_fwd_launch)


@_ce_fwd_op.register_fake
def _(*args):
    return None


def _ce_bwd_launch(
    dlogits: Tensor, logits: Optional[Tensor], dloss: Tensor, lse: Tensor, labels: Tensor, smoothing: float,
    logit_scale: float, lse_square_scale: float, ignore_index: int, total_classes: int, class_start: int,
) -> None:
    """Writes the logits' gradient into dlogits; logits None means they are read from dlogits (in place)."""
    src = dlogits if logits is None else logits
    n_rows, n_cols = src.shape
    if n_rows == 0:
        return
    has_smoothing = smoothing > 0.0
    labels = _aligned(labels)
    if BWD_LAYOUT == "flat" and n_cols >= BWD_BLOCK and src.is_contiguous() and dlogits.is_contiguous():
        n_elems = n_rows * n_cols
        vec = vec_align(src.element_size(), n_elems) if VECTORIZE else 1
        key, meta = plan("ce_bwd_flat", HAS_SMOOTHING=has_smoothing, BLOCK=BWD_BLOCK, VEC=vec, num_warps=BWD_WARPS)
        with device_ctx(src):
            _L_BWD_FLAT((cdiv(n_elems, BWD_BLOCK),), (
                dlogits, src, dloss, lse, labels, n_rows, n_cols, n_elems // vec, dloss.stride(0),
                logit_scale, smoothing, lse_square_scale, ignore_index, total_classes, class_start,
            ), meta, key)
        return
    block = min(BWD_BLOCK, next_power_of_2(n_cols))
    vec = vec_align(src.element_size(), n_cols, src.stride(0), dlogits.stride(0)) if VECTORIZE else 1
    key, meta = plan("ce_bwd", HAS_SMOOTHING=has_smoothing, BLOCK=block, VEC=vec, num_warps=BWD_WARPS)
    with device_ctx(src):
        _L_BWD((n_rows, cdiv(n_cols, block)), (
            dlogits, src, dloss, lse, labels, n_cols // vec, src.stride(0) // vec, dlogits.stride(0) // vec,
            dloss.stride(0), logit_scale, smoothing, lse_square_scale, ignore_index, total_classes, class_start,
        ), meta, key)


_ce_bwd_op = torch.library.custom_op("flash_attn_ops::cross_entropy_bwd", mutates_args=("dlogits",))(_ce_bwd_launch)


@_ce_bwd_op.register_fake
def _(*args):
    return None


def _pick(op, launch, torch_fn, x):
    if not use_triton(x):
        return torch_fn
    # The custom op is what torch.compile traces; eager calls skip its dispatcher overhead.
    return op if torch.compiler.is_compiling() else launch


def _row_chunks(n_rows: int, n_cols: int):
    step = max(1, TORCH_CHUNK_ELEMS // max(n_cols, 1))
    return ((r, min(r + step, n_rows)) for r in range(0, n_rows, step))


def _ce_fwd_torch(logits, labels, lse, losses, z_losses, precomputed, smoothing, logit_scale, lse_square_scale,
                  ignore_index, total_classes, class_start, split):
    n_rows, n_cols = logits.shape
    for r0, r1 in _row_chunks(n_rows, n_cols):
        z = logits[r0:r1].float() * logit_scale
        if not precomputed:
            lse[r0:r1] = torch.logsumexp(z, dim=-1)
        label = labels[r0:r1].long()
        valid = label != ignore_index
        local = label - class_start
        in_range = valid & (local >= 0) & (local < n_cols)
        z_label = z.gather(1, torch.where(in_range, local, 0)[:, None])[:, 0]
        part = (1.0 - smoothing) * torch.where(in_range, z_label, 0.0)
        if smoothing > 0.0:
            part = part + smoothing * z.sum(dim=-1) / total_classes
        if split:
            losses[r0:r1] = -part
        else:
            zl = torch.where(valid, lse_square_scale * lse[r0:r1].square(), 0.0)
            losses[r0:r1] = torch.where(valid, lse[r0:r1] - part + zl, 0.0)
            z_losses[r0:r1] = zl


def _ce_bwd_torch(dlogits, logits, dloss, lse, labels, smoothing, logit_scale, lse_square_scale, ignore_index,
                  total_classes, class_start):
    src = dlogits if logits is None else logits
    n_rows, n_cols = src.shape
    cols = torch.arange(n_cols, device=src.device)
    for r0, r1 in _row_chunks(n_rows, n_cols):
        z = src[r0:r1].float() * logit_scale
        l = lse[r0:r1, None]
        label = labels[r0:r1].long()
        g = torch.exp(z - l) * (1.0 + 2.0 * lse_square_scale * l)
        g = g - (1.0 - smoothing) * (cols[None, :] == (label - class_start)[:, None])
        if smoothing > 0.0:
            g = g - smoothing / total_classes
        d = torch.where(label != ignore_index, dloss[r0:r1].float(), 0.0) * logit_scale
        dlogits[r0:r1] = g * d[:, None]


def _check_args(logits, labels, precomputed_lse, label_smoothing, lse_square_scale, process_group):
    if not isinstance(logits, Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor (batch, vocab_size)"
                         + (f", got shape {tuple(logits.shape)} {logits.dtype}" if isinstance(logits, Tensor) else ""))
    if not isinstance(labels, Tensor) or labels.shape != logits.shape[:1] or labels.is_floating_point():
        raise ValueError(f"labels must be an integer tensor ({logits.shape[0]},) (one class per row of logits)"
                         + (f", got {labels.dtype} {tuple(labels.shape)}" if isinstance(labels, Tensor) else ""))
    if labels.device != logits.device:
        raise ValueError(f"labels must be on the logits' device {logits.device}, got {labels.device}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if lse_square_scale < 0.0:
        raise ValueError(f"lse_square_scale must be >= 0, got {lse_square_scale}")
    if precomputed_lse is not None:
        if label_smoothing > 0.0 or process_group is not None:
            raise NotImplementedError("precomputed_lse is supported without label_smoothing and process_group")
        if precomputed_lse.shape != logits.shape[:1]:
            raise ValueError(f"precomputed_lse must have shape ({logits.shape[0]},), got {tuple(precomputed_lse.shape)}")


class CrossEntropyLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, precomputed_lse=None, smoothing=0.0, logit_scale=1.0, lse_square_scale=0.0,
                ignore_index=-100, inplace_backward=False, process_group=None):
        _check_args(logits, labels, precomputed_lse, smoothing, lse_square_scale, process_group)
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        n_rows, n_cols = logits.shape
        world = 1 if process_group is None else torch.distributed.get_world_size(process_group)
        rank = 0 if process_group is None else torch.distributed.get_rank(process_group)
        split = world > 1
        dev = logits.device
        lse = (precomputed_lse.detach().float().contiguous() if precomputed_lse is not None
               else torch.empty(n_rows, device=dev, dtype=torch.float32))
        losses = torch.empty(n_rows, device=dev, dtype=torch.float32)
        z_losses = torch.empty(n_rows, device=dev, dtype=torch.float32)
        args = (logits, labels, lse, losses, z_losses, precomputed_lse is not None, float(smoothing),
                float(logit_scale), float(lse_square_scale), int(ignore_index), world * n_cols, rank * n_cols, split)
        _pick(_ce_fwd_op, _ce_fwd_launch, _ce_fwd_torch, logits)(*args)
        if split:
            # lse over the whole vocab from every rank's partial lse; the label/smoothing terms add up.
            gathered = [torch.empty_like(lse) for _ in range(world)]
            torch.distributed.all_gather(gathered, lse, group=process_group)
            torch.distributed.all_reduce(losses, op=torch.distributed.ReduceOp.SUM, group=process_group)
            lse = torch.logsumexp(torch.stack(gathered), dim=0)
            valid = labels != ignore_index
            z_losses = torch.where(valid, lse_square_scale * lse.square(), 0.0)
            losses = torch.where(valid, losses + lse + z_losses, 0.0)
        ctx.save_for_backward(logits, lse, labels)
        ctx.mark_non_differentiable(z_losses)
        ctx.args = (float(smoothing), float(logit_scale), float(lse_square_scale), int(ignore_index), world * n_cols,
                    rank * n_cols)
        ctx.inplace_backward = inplace_backward
        return losses, z_losses

    @staticmethod
    def backward(ctx, grad_losses, grad_z_losses):
        logits, lse, labels = ctx.saved_tensors
        if ctx.inplace_backward:
            dlogits, src = logits, None
        else:
            dlogits, src = torch.empty_like(logits), logits
        args = (dlogits, src, grad_losses, lse, labels, *ctx.args)
        _pick(_ce_bwd_op, _ce_bwd_launch, _ce_bwd_torch, logits)(*args)
        return dlogits, None, None, None, None, None, None, None, None


def cross_entropy_loss(logits: Tensor, labels: Tensor, precomputed_lse: Optional[Tensor] = None,
                       label_smoothing: float = 0.0, logit_scale: float = 1.0, lse_square_scale: float = 0.0,
                       ignore_index: int = -100, inplace_backward: bool = False,
                       process_group=None) -> Tuple[Tensor, Tensor]:
    """Per-row cross-entropy losses and z-losses.

    logits: (batch, vocab) any float dtype (this rank's vocab shard with process_group, whose ranks hold
    consecutive shards of equal size); labels: (batch,) int, global class ids. logit_scale multiplies the
    logits first; lse_square_scale adds lse_square_scale * logsumexp^2 (z-loss) to the loss.
    precomputed_lse: (batch,) logsumexp of the scaled logits, skipping that pass. inplace_backward writes
    the gradient over the logits. Returns (losses, z_losses), both (batch,) fp32, 0 where labels ==
    ignore_index; losses includes the z-loss, z_losses (not differentiable) is for logging.
    """
    return CrossEntropyLossFn.apply(logits, labels, precomputed_lse, label_smoothing, logit_scale,
                                    lse_square_scale, ignore_index, inplace_backward, process_group)
