"""Block-sparsity lists from a mask_mod, on the GPU (FA4's ``compute_block_sparsity``; FlexAttention's
``create_block_mask`` idea): a CuTeDSL kernel evaluates the mask_mod over every (query, key) pair of each tile (or
over five sampled pairs with ``use_fast_sampling``) and classifies the tile as skipped (no pair kept), full (every
in-bounds pair kept) or partial; torch then packs each query block's partial and full key blocks into
BlockSparseTensorsTorch (ascending block indices, packed left), ready for ``block_sparse_tensors``.

The classification counts in-bounds pairs only (rows < seqlen_q, keys < seqlen_k), so a boundary tile whose in-bounds
pairs are all kept is full (the attention kernel masks the keys past seqlen_k itself). The kernel is compiled once
per (mask_mod, tile, aux tensor kinds, sampling) and kept in memory (the mask_mod keyed as the attention's mod
kernels key it: mods.fn_key); the lists themselves depend on the aux tensors' values, so they are computed per call.
"""
import torch

from flash_attn.cute import mods
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

THREADS = 128
_kernels: dict[tuple, object] = {}


class BlockKinds:
    """The classifying kernel: grid (query blocks, heads, batch), THREADS threads, thread t classifying key blocks t,
    t + THREADS, ... of its query block into mKind (B, H, M, N) int32: 0 skipped, 1 partial, 2 full. varlen: which
    of (cu_seqlens_q, cu_seqlens_k, seqused_k) the kernel takes (sequence b's lengths and first rows from them; M /
    N then cover the longest; blocks past a sequence's end are skipped)."""

    def __init__(self, mask_mod, tile_m, tile_n, has_aux, fast, scalars=(), varlen=(False, False, False)):
        self.mask_mod = mask_mod
        self.tile_m = int(tile_m)
        self.tile_n = int(tile_n)
        self.has_aux = bool(has_aux)
        self.fast = bool(fast)
        self.scalars = tuple(scalars)
        self.varlen = tuple(bool(x) for x in varlen)

    def _jit(self):
        import cutlass
        import cutlass.cute as cute
        from cutlass import Int32

        from flash_attn.cute.score_mod import ModSeqlens, ScoreMods, takes_scalars

        kinds = self
        ssa = ScoreMods._ssa
        with_scalars = takes_scalars(self.mask_mod)

        @cute.jit
        def keep(b, h, q, k, seqlens, aux, scalars):
            res = kinds.mask_mod(ssa([b], Int32), ssa([h], Int32), ssa([q], Int32), ssa([k], Int32), seqlens, aux,
                                 *((() if scalars is None else scalars,) if cutlass.const_expr(with_scalars) else ()))
            if cutlass.const_expr(isinstance(res, cute.TensorSSA)):
                flag = cute.make_rmem_tensor(1, cutlass.Boolean)
                flag.store(res)
                res = flag[0]
            n = Int32(0)
            if res:
                n = Int32(1)
            return n

        @cute.kernel
        def kernel(mKind: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, mCuQ, mCuK, mUsedK, aux, scalars):
            tidx, _, _ = cute.arch.thread_idx()
            m, h, b = cute.arch.block_idx()
            q_start, k_start, sq, sk = Int32(0), Int32(0), seqlen_q, seqlen_k
            if cutlass.const_expr(mCuQ is not None):
                q_start = mCuQ[b]
                sq = mCuQ[b + 1] - q_start
            if cutlass.const_expr(mCuK is not None):
                k_start = mCuK[b]
                sk = mCuK[b + 1] - k_start
            if cutlass.const_expr(mUsedK is not None):
                sk = mUsedK[b]
            seqlens = ModSeqlens(q_start, k_start, sq, sk, cutlass.const_expr(any(kinds.varlen)))
            q0 = m * kinds.tile_m
            rows = cutlass.min(sq - q0, kinds.tile_m)
            for j in cutlass.range(tidx, cute.size(mKind, mode=[3]), THREADS, unroll=1):
                k0 = j * kinds.tile_n
                cols = cutlass.min(sk - k0, kinds.tile_n)
                kind = Int32(0)  # a block past the sequence's end (varlen) has no pair: skipped
                if rows > 0:
                    if cols > 0:
                        kept = Int32(0)
                        total = Int32(0)
                        if cutlass.const_expr(kinds.fast):
                            # the four corners and the centre of the tile's in-bounds part
                            for qq, kk in ((0, 0), (0, -1), (-1, 0), (-1, -1), (2, 2)):
                                r = Int32(0) if qq == 0 else (rows - 1 if qq == -1 else (rows - 1) // 2)
                                c = Int32(0) if kk == 0 else (cols - 1 if kk == -1 else (cols - 1) // 2)
                                kept += keep(b, h, q0 + r, k0 + c, seqlens, aux, scalars)
                            total = Int32(5)
                        else:
                            for r in cutlass.range(rows, unroll=1):
                                for c in cutlass.range(cols, unroll=1):
                                    kept += keep(b, h, q0 + r, k0 + c, seqlens, aux, scalars)
                            total = rows * cols
                        kind = Int32(1)
                        if kept == 0:
                            kind = Int32(0)
                        if kept == total:
                            kind = Int32(2)
                mKind[b, h, m, j] = kind

        @cute.jit
        def launch(mKind: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, mCuQ, mCuK, mUsedK, stream, aux, scalars):
            grid = (cute.size(mKind, mode=[2]), cute.size(mKind, mode=[1]), cute.size(mKind, mode=[0]))
            kernel(mKind, seqlen_q, seqlen_k, mCuQ, mCuK, mUsedK, aux, scalars).launch(
                grid=grid, block=(THREADS, 1, 1), stream=stream)

        return launch

    def compile(self, spec, arch="sm_90a", dump_dir=None):
        """Compile for ``arch`` (no GPU needed) with aux tensors of kinds ``spec`` ((torch dtype, rank), ...)."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor

        from flash_attn.cute import kernels

        aux = mods.fake_aux(spec)
        kind = make_fake_tensor(cutlass.Int32, tuple(cute.sym_int() for _ in range(4)),
                                (cute.sym_int(), cute.sym_int(), cute.sym_int(), 1), assumed_align=4)
        tvm_ffi = kernels._abi() != "cute"
        options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
        if dump_dir is not None:
            options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
        stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
        seqs = [make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4) if given else None
                for given in self.varlen]
        return cute.compile(self._jit(), kind, cutlass.Int32(0), cutlass.Int32(0), *seqs, stream, aux,
                            mods.fake_scalars(self.scalars), options=options)


def _kernel(mask_mod, tile_m, tile_n, spec, fast, scalars=(), varlen=(False, False, False)):
    from flash_attn.cute import cache, kernels

    key = (mods.fn_key(mask_mod), tile_m, tile_n, spec, fast, scalars, varlen)  # (mods.fn_key: closures by value)
    fn = _kernels.get(key)
    if fn is None:
        with cache._lock:
            fn = _kernels.get(key)
            if fn is None:
                if not kernels._tvm_ffi():
                    raise NotImplementedError("compute_block_sparsity needs apache-tvm-ffi")
                fn = _kernels[key] = kernels._ffi_function(
                    BlockKinds(mask_mod, tile_m, tile_n, bool(spec), fast, scalars, varlen).compile(spec))
    return fn


def pack_kinds(kind, compute_full_blocks=True):
    """BlockSparseTensorsTorch lists (without block_size) of a (B, H, M, N) tile classification (0 skipped,
    1 partial, 2 full): per query block the partial blocks' indices ascending, packed left, and the full ones'
    (with compute_full_blocks=False the full blocks join the partial list)."""
    partial = kind == 1
    full = kind == 2
    if not compute_full_blocks:
        partial = partial | full

    def pack(sel):
        cnt = sel.sum(-1, dtype=torch.int32)
        idx = torch.sort((~sel).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
        return cnt, idx

    mc, mi = pack(partial)
    fc = fi = None
    if compute_full_blocks:
        fc, fi = pack(full)
    return BlockSparseTensorsTorch(mc, mi, fc, fi)


def compute_block_sparsity(tile_m, tile_n, batch_size, num_heads, seqlen_q, seqlen_k, mask_mod, aux_tensors, device,
                           aux_scalars=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                           cu_total_m_blocks=None, cu_block_idx_offsets=None, compute_full_blocks=True,
                           use_fast_sampling=False):
    """FA4's signature: the BlockSparseTensorsTorch of ``mask_mod`` (FA4's convention: (batch, head, q_idx, kv_idx,
    seqlen_info, aux_tensors) -> keep) for blocks of tile_m queries x tile_n keys (block_size = (tile_m, tile_n)).
    ``use_fast_sampling`` (or the mask_mod's own ``use_fast_sampling`` attribute) evaluates five pairs per tile
    (corners and centre) instead of all: for masks where those decide the tile (FA4's option). aux_scalars: FA4's,
    for a mask_mod with an aux_scalars parameter.

    Varlen (FA4's): seqlen_q / seqlen_k are the longest sequences'; each sequence's own lengths come from
    cu_seqlens_q (else seqlen_q), cu_seqlens_k or seqused_k (else seqlen_k), its mask_mod indices from its first
    row. With cu_seqlens_q the lists come in FA4's packed form (BlockSparseTensorsTorch): cu_total_m_blocks (each
    sequence's query blocks, cumulated; required) and cu_block_idx_offsets (derived from the key lengths when not
    given; None when every sequence has seqlen_k's keys); without, (B, H, M, N) lists as for dense calls. One
    device sync (the packed sizes). seqused_q raises NotImplementedError."""
    if seqused_q is not None:
        raise NotImplementedError("compute_block_sparsity: seqused_q is not implemented yet in flash_attn.cute")
    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be a CuTeDSL function (@cute.jit), got {type(mask_mod).__name__}")
    mods.check_signature("mask_mod", mask_mod)
    for name, value in (("tile_m", tile_m), ("tile_n", tile_n), ("batch_size", batch_size), ("num_heads", num_heads)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if int(seqlen_q) < 0 or int(seqlen_k) < 0:
        raise ValueError(f"seqlen_q / seqlen_k must be >= 0, got {seqlen_q} / {seqlen_k}")
    if cu_seqlens_k is not None and seqused_k is not None:
        raise ValueError("compute_block_sparsity: give cu_seqlens_k or seqused_k, not both")
    if cu_seqlens_q is None and (cu_total_m_blocks is not None or cu_block_idx_offsets is not None):
        raise ValueError("compute_block_sparsity: cu_total_m_blocks / cu_block_idx_offsets belong to packed queries "
                         "(cu_seqlens_q)")
    if cu_seqlens_q is not None and cu_total_m_blocks is None:
        raise ValueError("compute_block_sparsity: cu_total_m_blocks must be given with cu_seqlens_q (FA4's)")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"compute_block_sparsity runs on a CUDA device, got {device}")
    if device.index is None:  # "cuda": the current device, as torch places tensors there
        device = torch.device("cuda", torch.cuda.current_device())
    batch = int(batch_size)
    for name, t, n in (("cu_seqlens_q", cu_seqlens_q, batch + 1), ("cu_seqlens_k", cu_seqlens_k, batch + 1),
                       ("seqused_k", seqused_k, batch), ("cu_total_m_blocks", cu_total_m_blocks, batch + 1),
                       ("cu_block_idx_offsets", cu_block_idx_offsets, batch + 1)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (n,)
                              or t.device != device):
            raise ValueError(f"{name} must be an int32 tensor of shape ({n},) on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    fast = bool(getattr(mask_mod, "use_fast_sampling", use_fast_sampling))
    kind = block_kinds(tile_m, tile_n, batch_size, num_heads, seqlen_q, seqlen_k, mask_mod, aux_tensors, device, fast,
                       mods.scalar_spec(aux_scalars), (cu_seqlens_q, cu_seqlens_k, seqused_k))
    lists = pack_kinds(kind, compute_full_blocks)._replace(block_size=(int(tile_m), int(tile_n)))
    if cu_seqlens_q is None:
        return lists
    if cu_block_idx_offsets is None and (cu_seqlens_k is not None or seqused_k is not None):
        lens_k = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        num_m = cu_total_m_blocks[1:] - cu_total_m_blocks[:-1]
        per = num_m.long() * ((lens_k.long() + int(tile_n) - 1) // int(tile_n))
        cu_block_idx_offsets = torch.nn.functional.pad(per.cumsum(0), (1, 0)).to(torch.int32)
    return _packed(lists, cu_total_m_blocks, cu_block_idx_offsets, kind.shape[3])


def _packed(lists, cu_total_m_blocks, cu_block_idx_offsets, N):
    """FA4's packed varlen form of (B, H, M, N) lists: counts (H, total_m) at cu_total_m_blocks[b] + m, indices (H,
    total_n) at cu_block_idx_offsets[b] + m * N_b (without offsets at (cu_total_m_blocks[b] + m) * N)."""
    B, H, M = lists.mask_block_cnt.shape
    device = lists.mask_block_cnt.device
    cu_m = cu_total_m_blocks.long()
    sizes = [int(cu_m[-1])] + ([int(cu_block_idx_offsets[-1])] if cu_block_idx_offsets is not None else [])
    total_m = sizes[0]
    num_m = cu_m[1:] - cu_m[:-1]
    m = torch.arange(M, device=device)
    valid_m = m < num_m[:, None]
    gm = cu_m[:-1, None] + m
    j = torch.arange(N, device=device)
    if cu_block_idx_offsets is not None:
        total_n = sizes[1]
        cu_n = cu_block_idx_offsets.long()
        num_n = (cu_n[1:] - cu_n[:-1]) // num_m.clamp(min=1)
        pos = (cu_n[:-1, None] + m * num_n[:, None])[..., None] + j
        valid = valid_m[..., None] & (j < num_n[:, None, None])
    else:
        total_n = total_m * N
        pos = (gm * N)[..., None] + j
        valid = valid_m[..., None].expand(B, M, N)
    gm_v, pos_v = gm[valid_m], pos[valid]

    def pack(cnt, idx):
        c = torch.zeros(H, total_m, dtype=torch.int32, device=device)
        i = torch.zeros(H, total_n, dtype=torch.int32, device=device)
        c[:, gm_v] = cnt.movedim(1, 0)[:, valid_m]
        i[:, pos_v] = idx.movedim(1, 0)[:, valid]
        return c, i

    mc, mi = pack(lists.mask_block_cnt, lists.mask_block_idx)
    fc = fi = None
    if lists.full_block_cnt is not None:
        fc, fi = pack(lists.full_block_cnt, lists.full_block_idx)
    return BlockSparseTensorsTorch(mc, mi, fc, fi, cu_total_m_blocks=cu_total_m_blocks,
                                   cu_block_idx_offsets=cu_block_idx_offsets, block_size=lists.block_size)


def block_kinds(tile_m, tile_n, batch_size, num_heads, seqlen_q, seqlen_k, mask_mod, aux_tensors, device, fast=False,
                scalars=((), ()), varlen=(None, None, None)):
    """The (B, H, M, N) int32 tile classification of mask_mod (0 skipped, 1 partial, 2 full) on the GPU (BlockKinds);
    arguments as compute_block_sparsity's, checked there; scalars: mods.scalar_spec's (kinds, values); varlen:
    (cu_seqlens_q, cu_seqlens_k, seqused_k), each None or an int32 tensor."""
    device = torch.device(device)
    spec = mods.aux_spec(aux_tensors, device)
    M, N = -(-int(seqlen_q) // int(tile_m)), -(-int(seqlen_k) // int(tile_n))
    kind = torch.zeros(int(batch_size), int(num_heads), M, N, dtype=torch.int32, device=device)
    if kind.numel():
        fn = _kernel(mask_mod, int(tile_m), int(tile_n), spec, bool(fast), scalars[0],
                     tuple(t is not None for t in varlen))
        fn(kind, int(seqlen_q), int(seqlen_k), *varlen, tuple(aux_tensors) if spec else None, scalars[1] or None)
    return kind
