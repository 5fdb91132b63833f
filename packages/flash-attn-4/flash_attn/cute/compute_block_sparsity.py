"""Block-sparsity lists from a mask_mod, on the GPU (FA4's ``compute_block_sparsity``; FlexAttention's
``create_block_mask`` idea): a CuTeDSL kernel evaluates the mask_mod over every (query, key) pair of each tile (or
over five sampled pairs with ``use_fast_sampling``) and classifies the tile as skipped (no pair kept), full (every
in-bounds pair kept) or partial; torch then packs each query block's partial and full key blocks into
BlockSparseTensorsTorch (ascending block indices, packed left), ready for ``block_sparse_tensors``.

The classification counts in-bounds pairs only (rows < seqlen_q, keys < seqlen_k), so a boundary tile whose in-bounds
pairs are all kept is full (the attention kernel masks the keys past seqlen_k itself). The kernel is compiled once
per (mask_mod, tile, aux tensor kinds, sampling) and kept in memory (keyed by the function object, as the attention's
mod kernels are: mods.py); the lists themselves depend on the aux tensors' values, so they are computed per call.
"""
import torch

from flash_attn.cute import mods
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

THREADS = 128
_kernels: dict[tuple, object] = {}


class BlockKinds:
    """The classifying kernel: grid (query blocks, heads, batch), THREADS threads, thread t classifying key blocks t,
    t + THREADS, ... of its query block into mKind (B, H, M, N) int32: 0 skipped, 1 partial, 2 full."""

    def __init__(self, mask_mod, tile_m, tile_n, has_aux, fast, scalars=()):
        self.mask_mod = mask_mod
        self.tile_m = int(tile_m)
        self.tile_n = int(tile_n)
        self.has_aux = bool(has_aux)
        self.fast = bool(fast)
        self.scalars = tuple(scalars)

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
        def kernel(mKind: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, aux, scalars):
            tidx, _, _ = cute.arch.thread_idx()
            m, h, b = cute.arch.block_idx()
            seqlens = ModSeqlens(Int32(0), Int32(0), seqlen_q, seqlen_k, False)
            q0 = m * kinds.tile_m
            rows = cutlass.min(seqlen_q - q0, kinds.tile_m)
            for j in cutlass.range(tidx, cute.size(mKind, mode=[3]), THREADS, unroll=1):
                k0 = j * kinds.tile_n
                cols = cutlass.min(seqlen_k - k0, kinds.tile_n)
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
        def launch(mKind: cute.Tensor, seqlen_q: Int32, seqlen_k: Int32, stream, aux, scalars):
            grid = (cute.size(mKind, mode=[2]), cute.size(mKind, mode=[1]), cute.size(mKind, mode=[0]))
            kernel(mKind, seqlen_q, seqlen_k, aux, scalars).launch(grid=grid, block=(THREADS, 1, 1), stream=stream)

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
        return cute.compile(self._jit(), kind, cutlass.Int32(0), cutlass.Int32(0), stream, aux,
                            mods.fake_scalars(self.scalars), options=options)


def _kernel(mask_mod, tile_m, tile_n, spec, fast, scalars=()):
    from flash_attn.cute import cache, kernels

    key = (mask_mod, tile_m, tile_n, spec, fast, scalars)
    fn = _kernels.get(key)
    if fn is None:
        with cache._lock:
            fn = _kernels.get(key)
            if fn is None:
                if not kernels._tvm_ffi():
                    raise NotImplementedError("compute_block_sparsity needs apache-tvm-ffi")
                fn = _kernels[key] = kernels._ffi_function(
                    BlockKinds(mask_mod, tile_m, tile_n, bool(spec), fast, scalars).compile(spec))
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
    (corners and centre) instead of all: for masks where those decide the tile (FA4's option). The varlen
    arguments (cu_seqlens_*, seqused_*, cu_total_m_blocks, cu_block_idx_offsets) raise NotImplementedError when given
    (the varlen attention takes no block sparsity yet). aux_scalars: FA4's, for a mask_mod with an aux_scalars
    parameter."""
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                        ("seqused_q", seqused_q), ("seqused_k", seqused_k), ("cu_total_m_blocks", cu_total_m_blocks),
                        ("cu_block_idx_offsets", cu_block_idx_offsets)):
        if value is not None:
            raise NotImplementedError(f"compute_block_sparsity: {name} is not implemented yet in flash_attn.cute")
    if not callable(mask_mod):
        raise ValueError(f"mask_mod must be a CuTeDSL function (@cute.jit), got {type(mask_mod).__name__}")
    for name, value in (("tile_m", tile_m), ("tile_n", tile_n), ("batch_size", batch_size), ("num_heads", num_heads)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if int(seqlen_q) < 0 or int(seqlen_k) < 0:
        raise ValueError(f"seqlen_q / seqlen_k must be >= 0, got {seqlen_q} / {seqlen_k}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"compute_block_sparsity runs on a CUDA device, got {device}")
    if device.index is None:  # "cuda": the current device, as torch places tensors there
        device = torch.device("cuda", torch.cuda.current_device())
    fast = bool(getattr(mask_mod, "use_fast_sampling", use_fast_sampling))
    kind = block_kinds(tile_m, tile_n, batch_size, num_heads, seqlen_q, seqlen_k, mask_mod, aux_tensors, device, fast,
                       mods.scalar_spec(aux_scalars))
    return pack_kinds(kind, compute_full_blocks)._replace(block_size=(int(tile_m), int(tile_n)))


def block_kinds(tile_m, tile_n, batch_size, num_heads, seqlen_q, seqlen_k, mask_mod, aux_tensors, device, fast=False,
                scalars=((), ())):
    """The (B, H, M, N) int32 tile classification of mask_mod (0 skipped, 1 partial, 2 full) on the GPU (BlockKinds);
    arguments as compute_block_sparsity's, checked there; scalars: mods.scalar_spec's (kinds, values)."""
    device = torch.device(device)
    spec = mods.aux_spec(aux_tensors, device)
    M, N = -(-int(seqlen_q) // int(tile_m)), -(-int(seqlen_k) // int(tile_n))
    kind = torch.zeros(int(batch_size), int(num_heads), M, N, dtype=torch.int32, device=device)
    if kind.numel():
        fn = _kernel(mask_mod, int(tile_m), int(tile_n), spec, bool(fast), scalars[0])
        fn(kind, int(seqlen_q), int(seqlen_k), tuple(aux_tensors) if spec else None, scalars[1] or None)
    return kind
