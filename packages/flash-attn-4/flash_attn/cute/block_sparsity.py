"""Block sparsity, host side (FA4's ``flash_attn.cute.block_sparsity`` module path and ``BlockSparseTensorsTorch``;
the device side is sparse_tiles.py).

A call's ``block_sparse_tensors`` lists, per (batch entry, head, sparse query block), the key blocks the block's
queries visit: ``mask_block_cnt`` (B, H, M) int32 counts and ``mask_block_idx`` (B, H, M, N) int32 indices of the
partially masked key blocks (the mask_mod runs on them), and optionally ``full_block_cnt`` / ``full_block_idx`` of
the fully visible ones (no mask_mod). Keys in blocks on neither list are not attended. B and H may be 1 (shared);
the index tensors' last dim may be shorter than the key block count (only the first ``cnt`` entries are read).
``block_size`` (q, kv) is the sparse block in tokens; None: q inferred from M and Sq (sparse_block_size), kv the
kernel's key block (as FA4). FlexAttention's ``BlockMask`` carries the same lists (``from_block_mask``).

The indices are trusted as FA4 and FlexAttention trust them (checking them needs a device sync per call):
``check_values`` checks them for a debugging run.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch


class BlockSparseTensorsTorch(NamedTuple):
    """FA4's block-sparsity tensors (field names and order as FA4's). Varlen calls (FA4's packed form): counts
    (H, total_m) over every sequence's query blocks, sequence b's from ``cu_total_m_blocks[b]``, and indices (H,
    total_n), query block m of sequence b at ``cu_block_idx_offsets[b] + m * N_b`` (N_b its key blocks; without
    cu_block_idx_offsets every sequence has the call's key blocks N: at (cu_total_m_blocks[b] + m) * N); see
    normalize_varlen. dq_write_order* and spt (FA4's SM100 backward) are accepted by the type and read by nothing."""
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor | None = None
    full_block_idx: torch.Tensor | None = None
    cu_total_m_blocks: torch.Tensor | None = None
    cu_block_idx_offsets: torch.Tensor | None = None
    block_size: tuple[int, int] | None = None
    dq_write_order: torch.Tensor | None = None
    dq_write_order_full: torch.Tensor | None = None
    spt: bool | None = None


@dataclasses.dataclass(frozen=True)
class SparseCall:
    """A call's checked block sparsity, as the kernel takes it: ``tensors`` (mask_cnt, mask_idx[, full_cnt,
    full_idx]) sharing leading dims (Bs, Hs) with Bs in {1, B}, Hs in {1, H}; the kernel's key block ``block_n``
    and query tile ``block_m``, and the sparse block in kernel tiles (q_factor query tiles of block_m, kv_factor
    key blocks of block_n)."""
    tensors: tuple
    block_n: int
    q_factor: int
    kv_factor: int
    block_m: int = 128

    @property
    def spec(self):
        """The kernel's compile-time facts: (has_full, q_factor, kv_factor)."""
        return (len(self.tensors) == 4, self.q_factor, self.kv_factor)


def _ceil(a, b):
    return (a + b - 1) // b


def sparse_block_size(tensors, Sq, block_m):
    """The (q, kv) sparse block size in tokens: block_size when the call states it; else kv None and q the one
    multiple of the kernel's query tile ``block_m`` that gives M query blocks for Sq rows (with M == 1 the smallest
    that covers Sq: all are the same single block). Raises ValueError when none or several do."""
    if tensors.block_size is not None:
        bq, bk = tensors.block_size
        if int(bq) < 1 or int(bk) < 1:
            raise ValueError(f"block_sparse_tensors.block_size must be positive, got {tensors.block_size}")
        return int(bq), int(bk)
    M = tensors.mask_block_idx.shape[2]
    if M < 1:
        raise ValueError("block_sparse_tensors.mask_block_idx has no query block (dim 2 is 0)")
    if M == 1:
        return max(_ceil(Sq, block_m), 1) * block_m, None
    lo, hi = _ceil(Sq, M), (Sq - 1) // (M - 1)  # the block sizes that give M blocks
    fits = [b for b in range(_ceil(lo, block_m) * block_m, hi + 1, block_m)]
    if len(fits) != 1:
        raise ValueError(f"block_sparse_tensors: {M} query blocks for seqlen_q={Sq} do not tell one query block size "
                         f"(a multiple of {block_m}: {fits or 'none'}); set BlockSparseTensorsTorch.block_size (the "
                         "BlockMask's BLOCK_SIZE)")
    return fits[0], None


def kernel_block_n(kv_block, block_n):
    """The kernel key block for sparse key blocks of ``kv_block`` tokens, given the kernel's own ``block_n``:
    block_n when it divides kv_block, else the largest multiple of 16 below it that does (None: no sparse kv block
    given). Raises ValueError when there is none."""
    if kv_block is None or kv_block % block_n == 0:
        return block_n
    for bn in range(block_n - 16, 15, -16):
        if kv_block % bn == 0:
            return bn
    raise ValueError(f"block_sparse_tensors.block_size[1] = {kv_block} must be a multiple of 16")


def kernel_block_m(q_block, block_m):
    """The kernel query tile for sparse query blocks of ``q_block`` rows, given the kernel's own ``block_m``: block_m
    when it divides q_block, else 64 (the one-warpgroup tile) when that does; block_m otherwise (normalize then
    raises)."""
    if q_block % block_m and q_block % 64 == 0:
        return 64
    return block_m


def _check_pair(name, cnt, idx, device):
    if (cnt is None) != (idx is None):
        raise ValueError(f"{name}_block_cnt and {name}_block_idx must both be given or both be None")
    if cnt is None:
        return
    for what, t in ((f"{name}_block_cnt", cnt), (f"{name}_block_idx", idx)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"block_sparse_tensors.{what} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise ValueError(f"block_sparse_tensors.{what} must be torch.int32, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"block_sparse_tensors.{what} must be on {device} (q's device), got {t.device}")
    if cnt.dim() != 3 or idx.dim() != 4:
        raise ValueError(f"block_sparse_tensors.{name}_block_cnt / _idx must have shapes (B, H, M) and (B, H, M, N), "
                         f"got {tuple(cnt.shape)} and {tuple(idx.shape)}")


def normalize(tensors, B, H, Sq, Sk, block_m, block_n, device, adjust=True, _sides=("query", "key")):
    """The SparseCall of a call's ``tensors`` (BlockSparseTensorsTorch or a tuple in its field order) for a kernel
    of tiles block_m x block_n (the kernel's own; smaller ones where the sparse blocks need them, kernel_block_m /
    kernel_block_n, unless ``adjust`` is False). Raises ValueError naming the field for inconsistent
    shapes, dtypes or devices, NotImplementedError for what the kernels do not take (varlen lists, backward
    ordering)."""
    if not isinstance(tensors, BlockSparseTensorsTorch):
        if not isinstance(tensors, tuple) or len(tensors) < 2:
            raise ValueError("block_sparse_tensors must be a BlockSparseTensorsTorch (or a tuple in its field order)")
        tensors = BlockSparseTensorsTorch(*tensors)
    if tensors.cu_total_m_blocks is not None or tensors.cu_block_idx_offsets is not None:
        raise ValueError("block_sparse_tensors with cu_total_m_blocks / cu_block_idx_offsets (FA4's varlen form) "
                         "belong to a varlen call (flash_attn_varlen_func with cu_seqlens_q)")
    if tensors.mask_block_cnt is None or tensors.mask_block_idx is None:
        raise ValueError("block_sparse_tensors needs mask_block_cnt and mask_block_idx")
    _check_pair("mask", tensors.mask_block_cnt, tensors.mask_block_idx, device)
    _check_pair("full", tensors.full_block_cnt, tensors.full_block_idx, device)
    bq, bk = sparse_block_size(tensors, Sq, block_m)
    if adjust:
        block_m = kernel_block_m(bq, block_m)
        block_n = kernel_block_n(bk, block_n)
    bk = block_n if bk is None else bk
    for side, size, tile in ((_sides[0], bq, block_m), (_sides[1], bk, block_n)):
        if size % tile:
            # FA4 takes sparse blocks of any multiple of its own (smaller) tiles: multiples of 16 that are not whole
            # tiles here are a gap of this package (NotImplementedError), the others are refused as FA4 refuses them
            gap = size % 16 == 0
            raise (NotImplementedError if gap else ValueError)(
                f"block_sparse_tensors: the {side} sparse_block_size {size} must be a multiple of {tile} (the kernel's "
                f"{side} tile{'; other multiples of 16 are not implemented yet' if gap else ''})")
    M, N = _ceil(Sq, bq), _ceil(Sk, bk)
    pairs = [(tensors.mask_block_cnt, tensors.mask_block_idx, "mask")]
    if tensors.full_block_cnt is not None:
        pairs.append((tensors.full_block_cnt, tensors.full_block_idx, "full"))
    for cnt, idx, name in pairs:
        for what, t in ((f"{name}_block_cnt", cnt), (f"{name}_block_idx", idx)):
            if t.shape[0] not in (1, B) or t.shape[1] not in (1, H):
                raise ValueError(f"block_sparse_tensors.{what}: batch / head dims {tuple(t.shape[:2])} must be "
                                 f"({B} or 1, {H} or 1)")
            if t.shape[2] != M:
                raise ValueError(f"block_sparse_tensors.{what}: {t.shape[2]} query blocks, expected {M} (seqlen_q "
                                 f"{Sq} in blocks of {bq}; set block_size to the BlockMask's BLOCK_SIZE)")
        if idx.shape[3] > N:
            raise ValueError(f"block_sparse_tensors.{name}_block_idx: {idx.shape[3]} key block entries, at most {N} "
                             f"(seqlen_k {Sk} in blocks of {bk})")
        if idx.shape[3] == 0:
            raise ValueError(f"block_sparse_tensors.{name}_block_idx has no entry (dim 3 is 0)")
    # One (Bs, Hs) for all: a dim is shared (size 1) where every tensor has size 1 or stride 0 (an expanded tensor
    # is read once); a tensor that is shared where another is not is materialised.
    # (Views only where a dim needs it: this runs per call.)
    ts = [t for pair in pairs for t in pair[:2]]
    if all(t.shape[0] == 1 or t.stride(0) == 0 for t in ts):
        ts = [t[:1] if t.shape[0] > 1 else t for t in ts]
    if all(t.shape[1] == 1 or t.stride(1) == 0 for t in ts):
        ts = [t[:, :1] if t.shape[1] > 1 else t for t in ts]
    Bs, Hs = max(t.shape[0] for t in ts), max(t.shape[1] for t in ts)
    ts = [t if t.shape[0] == Bs and t.shape[1] == Hs else t.expand(Bs, Hs, *t.shape[2:]) for t in ts]
    ts = [t.contiguous() if (Bs > 1 and t.stride(0) == 0) or (Hs > 1 and t.stride(1) == 0) else t for t in ts]
    return SparseCall(tuple(ts), block_n, bq // block_m, bk // block_n, block_m)


def normalize_varlen(tensors, batch, H, max_seqlen_q, max_seqlen_k, block_m, block_n, device):
    """The SparseCall of a varlen call's ``block_sparse_tensors`` for the varlen kernel's tiles (query blocks per
    sequence): FA4's packed form (cu_total_m_blocks set, see BlockSparseTensorsTorch) is laid out as dense lists
    (batch, Hs, M, N) for the longest sequences (M query blocks of max_seqlen_q, N key blocks of max_seqlen_k; the
    rows of shorter sequences padded with count 0), by torch ops without a device sync; the dense form (B, H, M, N)
    (FA4's for batch-shaped queries) is taken as normalize takes it. block_size None: the kernel's tiles."""
    if not isinstance(tensors, BlockSparseTensorsTorch):
        if not isinstance(tensors, tuple) or len(tensors) < 2:
            raise ValueError("block_sparse_tensors must be a BlockSparseTensorsTorch (or a tuple in its field order)")
        tensors = BlockSparseTensorsTorch(*tensors)
    if tensors.cu_total_m_blocks is None:
        if tensors.cu_block_idx_offsets is not None:
            raise ValueError("block_sparse_tensors.cu_block_idx_offsets needs cu_total_m_blocks")
        return normalize(tensors, batch, H, max_seqlen_q, max_seqlen_k, block_m, block_n, device)
    bq, bk = tensors.block_size if tensors.block_size is not None else (block_m, block_n)
    bq, bk = int(bq), int(bk)
    if bq < 1 or bk < 1:
        raise ValueError(f"block_sparse_tensors.block_size must be positive, got {tensors.block_size}")
    for name in ("cu_total_m_blocks", "cu_block_idx_offsets"):
        t = getattr(tensors, name)
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device
                              or tuple(t.shape) != (batch + 1,)):
            raise ValueError(f"block_sparse_tensors.{name} must be an int32 tensor of shape ({batch + 1},) on "
                             f"{device}, got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    pairs = [("mask", tensors.mask_block_cnt, tensors.mask_block_idx)]
    if tensors.full_block_cnt is not None or tensors.full_block_idx is not None:
        pairs.append(("full", tensors.full_block_cnt, tensors.full_block_idx))
    for name, cnt, idx in pairs:
        for what, t in ((f"{name}_block_cnt", cnt), (f"{name}_block_idx", idx)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != device or t.dim() != 2:
                raise ValueError(f"block_sparse_tensors.{what} of a varlen call must be an int32 (H, total) tensor "
                                 f"on {device} (FA4's packed form), got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        if cnt.shape[0] not in (1, H) or idx.shape[0] != cnt.shape[0]:
            raise ValueError(f"block_sparse_tensors.{name}_block_cnt / _idx: head dims {cnt.shape[0]} / "
                             f"{idx.shape[0]} must be equal, {H} or 1")
    M, N = _ceil(max_seqlen_q, bq), _ceil(max_seqlen_k, bk)
    cu_m = tensors.cu_total_m_blocks.long()
    num_m = cu_m[1:] - cu_m[:-1]
    m = torch.arange(M, device=device)
    valid_m = m < num_m[:, None]  # (batch, M)
    gm = cu_m[:-1, None] + m
    j = torch.arange(N, device=device)
    if tensors.cu_block_idx_offsets is not None:
        cu_n = tensors.cu_block_idx_offsets.long()
        num_n = (cu_n[1:] - cu_n[:-1]) // num_m.clamp(min=1)
        row = cu_n[:-1, None] + m * num_n[:, None]
        valid = valid_m[..., None] & (j < num_n[:, None, None])
    else:  # every sequence has the call's key blocks
        row = gm * N
        valid = valid_m[..., None].expand(batch, M, N)
    pos = row[..., None] + j

    def gather(t, index, keep):
        # t (Hs, total)[:, index] where keep, else 0 -> (batch, Hs, *index.shape[1:])
        if t.shape[1] == 0:
            return torch.zeros(t.shape[0], *index.shape, dtype=torch.int32, device=device).movedim(0, 1)
        got = t[:, index.clamp(0, t.shape[1] - 1)]
        return torch.where(keep, got, 0).to(torch.int32).movedim(0, 1)

    lists = []
    for _, cnt, idx in pairs:
        lists += [gather(cnt, gm, valid_m), gather(idx, pos, valid)]
    dense = BlockSparseTensorsTorch(*lists[:2], *(lists[2:] or (None, None)), block_size=(bq, bk))
    return normalize(dense, batch, H, max_seqlen_q, max_seqlen_k, block_m, block_n, device)


def normalize_bwd(tensors, B, H, Sq, Sk, block_m, block_n, device):
    """The SparseCall of a call's ``block_sparse_tensors_bwd`` for the backward kernel's block_m x block_n tiles: per
    (batch, head, sparse key block) the partial and full query blocks (FlexAttention's q_num_blocks / q_indices),
    ``block_size`` still (q, kv). Its factors: q_factor the sparse key block in kernel key blocks (the lists' rows),
    kv_factor the sparse query block in kernel query blocks (the walk). Raises as normalize (the names in its
    messages: M counts the key blocks here)."""
    if not isinstance(tensors, BlockSparseTensorsTorch):
        if not isinstance(tensors, tuple) or len(tensors) < 2:
            raise ValueError("block_sparse_tensors_bwd must be a BlockSparseTensorsTorch (or a tuple in its field order)")
        tensors = BlockSparseTensorsTorch(*tensors)
    if tensors.block_size is not None:  # the lists' rows are key blocks: (kv, q) for normalize's (rows, entries)
        tensors = tensors._replace(block_size=(tensors.block_size[1], tensors.block_size[0]))
    return normalize(tensors, B, H, Sk, Sq, block_n, block_m, device, adjust=False, _sides=("key", "query"))


def fast_sampling(mask_mod):
    """Marks ``mask_mod`` (FA4's decorator, put above ``@cute.jit``) as one whose value on a tile's four corners and
    centre decides the tile: compute_block_sparsity then evaluates those five pairs per tile instead of all."""
    mask_mod.use_fast_sampling = True
    return mask_mod


def from_block_mask(block_mask):
    """BlockSparseTensorsTorch of FlexAttention's ``BlockMask`` (torch.nn.attention.flex_attention.create_block_mask):
    its partial (kv_num_blocks / kv_indices) and full (full_kv_num_blocks / full_kv_indices) lists and its
    BLOCK_SIZE, the same lists as FA4's."""
    seq_q, seq_k, kv_num, kv_idx, full_num, full_idx, *_ = block_mask.as_tuple()
    del seq_q, seq_k
    bs = block_mask.BLOCK_SIZE
    return BlockSparseTensorsTorch(mask_block_cnt=kv_num, mask_block_idx=kv_idx, full_block_cnt=full_num,
                                   full_block_idx=full_idx, block_size=(int(bs[0]), int(bs[1])))


def from_block_mask_bwd(block_mask):
    """The backward's BlockSparseTensorsTorch (``block_sparse_tensors_bwd``) of FlexAttention's ``BlockMask``: per key
    block its partial (q_num_blocks / q_indices) and full (full_q_num_blocks / full_q_indices) query blocks."""
    q_num, q_idx, full_num, full_idx = block_mask.as_tuple()[6:10]
    bs = block_mask.BLOCK_SIZE
    return BlockSparseTensorsTorch(mask_block_cnt=q_num, mask_block_idx=q_idx, full_block_cnt=full_num,
                                   full_block_idx=full_idx, block_size=(int(bs[0]), int(bs[1])))


def visited(tensors, B, H, Sq, Sk, block_size):
    """(visited, partial): bool (B, H, Sq, Sk) of the keys each query's lists visit, and of those in a partial block
    (the mask_mod's), for references and tests. block_size: the sparse block (q, kv) in tokens."""
    t = tensors if isinstance(tensors, BlockSparseTensorsTorch) else BlockSparseTensorsTorch(*tensors)
    bq, bk = block_size
    M, N = _ceil(Sq, bq), _ceil(Sk, bk)
    dev = t.mask_block_cnt.device

    def blocks(cnt, idx):
        cnt = cnt.expand(B, H, M).long()
        idx = idx.expand(B, H, M, idx.shape[3]).long()
        take = torch.arange(idx.shape[3], device=dev) < cnt[..., None]
        dense = torch.zeros(B, H, M, N + 1, dtype=torch.bool, device=dev)
        dense.scatter_(3, torch.where(take, idx.clamp(0, N), N), True)
        dense = dense[..., :N]
        return dense.repeat_interleave(bq, 2)[:, :, :Sq].repeat_interleave(bk, 3)[..., :Sk]

    partial = blocks(t.mask_block_cnt, t.mask_block_idx)
    full = blocks(t.full_block_cnt, t.full_block_idx) if t.full_block_cnt is not None else torch.zeros_like(partial)
    return partial | full, partial


def check_values(tensors, Sk, block_size=None):
    """Raises ValueError when a count exceeds the key blocks, an index is out of [0, key blocks), or a key block is
    listed twice for one query block (which the kernel would visit twice). One device sync; for debugging runs."""
    t = tensors if isinstance(tensors, BlockSparseTensorsTorch) else BlockSparseTensorsTorch(*tensors)
    _, bk = block_size or t.block_size or (None, None)
    if bk is None:
        raise ValueError("check_values needs the sparse block size (block_size)")
    N = _ceil(Sk, bk)
    lists = [("mask", t.mask_block_cnt, t.mask_block_idx)]
    if t.full_block_cnt is not None:
        lists.append(("full", t.full_block_cnt, t.full_block_idx))
    lead = torch.broadcast_shapes(*(u.shape for _, c, i in lists for u in (c, i[..., 0])))
    seen = torch.zeros(*lead, N, dtype=torch.int32, device=t.mask_block_idx.device)
    for name, cnt, idx in lists:
        if bool((cnt < 0).any()) or bool((cnt > idx.shape[3]).any()):
            raise ValueError(f"{name}_block_cnt: counts must lie in [0, {idx.shape[3]}]")
        take = torch.arange(idx.shape[3], device=idx.device) < cnt[..., None].long()
        bad = take & ((idx < 0) | (idx >= N))
        if bool(bad.any()):
            raise ValueError(f"{name}_block_idx: indices must lie in [0, {N}) (seqlen_k {Sk} in blocks of {bk})")
        hits = torch.zeros(*lead, N + 1, dtype=torch.int32, device=idx.device)
        hits.scatter_add_(-1, torch.where(take, idx.long(), N).expand(*lead, idx.shape[3]),
                          take.to(torch.int32).expand(*lead, idx.shape[3]))
        seen += hits[..., :N]
    if bool((seen > 1).any()):
        raise ValueError("block_sparse_tensors: a key block is listed twice for one query block")
