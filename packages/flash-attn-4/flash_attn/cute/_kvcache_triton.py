"""The Triton kernel of flash_attn_with_kvcache's first step on the cute backend (kvcache.py says what it computes):
the queries rotated, the new keys rotated and both new keys and values written into the caches, in one launch. In its
own module so that importing the package does not import Triton."""
import triton
import triton.language as tl


@triton.jit
def _rotated_halves(ptr, half_cols, half_ok, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The two halves (x1, x2) of a row's rotary dims, fp32: pairs (2i, 2i + 1) when INTERLEAVED (GPT-J), else
    (i, i + HALF) (GPT-NeoX)."""
    if INTERLEAVED:
        x1 = tl.load(ptr + 2 * half_cols, mask=half_ok, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + 2 * half_cols + 1, mask=half_ok, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(ptr + half_cols, mask=half_ok, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF + half_cols, mask=half_ok, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_rotated(ptr, x1, x2, c, s, half_cols, half_ok, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Stores (x1 c - x2 s, x1 s + x2 c) where _rotated_halves read x1, x2, in ptr's dtype."""
    r1 = (x1 * c - x2 * s).to(ptr.dtype.element_ty)
    r2 = (x1 * s + x2 * c).to(ptr.dtype.element_ty)
    if INTERLEAVED:
        tl.store(ptr + 2 * half_cols, r1, mask=half_ok)
        tl.store(ptr + 2 * half_cols + 1, r2, mask=half_ok)
    else:
        tl.store(ptr + half_cols, r1, mask=half_ok)
        tl.store(ptr + HALF + half_cols, r2, mask=half_ok)


# Sequence lengths and page sizes change from call to call: not specialised (no recompile per decoding step).
@triton.jit(do_not_specialize=["seq_q", "seq_new", "page_size"])
def _prep_kernel(Q, QOut, K, V, KCache, VCache, Cos, Sin, CacheSeqlens, BatchIdx, BlockTable,
                 s_qb, s_qs, s_qh, s_ob, s_os, s_oh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
                 s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_cos, s_bt,
                 seq_q, seq_new, page_size,
                 HEADS_Q: tl.constexpr, HEADS_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, Q_STEPS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr,
                 PAGED: tl.constexpr):
    # One program per (row, batch entry, head) (rows on the grid's x: more than 65535 new rows fit): heads
    # 0 .. HEADS_Q - 1 are query heads (rotated into QOut), the next HEADS_KV key / value heads of the new rows (rotated
    # and written into the caches). A query row i of batch entry b sits at position cache_seqlens[b] + i (Q_STEPS:
    # causal / local calls) or cache_seqlens[b] (one decoding step); a new row i at cache_seqlens[b] + i, in cache
    # row batch_idx[b] (else b) or in page block_table[b, pos // page_size] at row pos % page_size. The rotary
    # columns and the others are stored apart (disjoint masks): no element is written twice.
    i = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    cols = tl.arange(0, BLOCK_D)
    d_ok = cols < HEAD_DIM
    rest_ok = d_ok & (cols >= 2 * ROT_HALF) if ROTARY else d_ok
    half_cols = tl.arange(0, BLOCK_HALF)
    half_ok = half_cols < ROT_HALF
    base = tl.load(CacheSeqlens + b).to(tl.int64)
    if h < HEADS_Q:
        if i < seq_q:
            src = Q + b * s_qb + i * s_qs + h * s_qh
            dst = QOut + b * s_ob + i * s_os + h * s_oh
            tl.store(dst + cols, tl.load(src + cols, mask=rest_ok), mask=rest_ok)
            if ROTARY:
                pos = base + i if Q_STEPS else base
                c = tl.load(Cos + pos * s_cos + half_cols, mask=half_ok, other=1.0).to(tl.float32)
                s = tl.load(Sin + pos * s_cos + half_cols, mask=half_ok, other=0.0).to(tl.float32)
                x1, x2 = _rotated_halves(src, half_cols, half_ok, ROT_HALF, INTERLEAVED)
                _store_rotated(dst, x1, x2, c, s, half_cols, half_ok, ROT_HALF, INTERLEAVED)
    else:
        hk = h - HEADS_Q
        if i < seq_new:
            pos = base + i
            if PAGED:
                page = tl.load(BlockTable + b * s_bt + pos // page_size).to(tl.int64)
                row, slot = page, pos % page_size
            else:
                row = tl.load(BatchIdx + b).to(tl.int64) if HAS_BATCH_IDX else b
                slot = pos
            src = K + b * s_kb + i * s_ks + hk * s_kh
            dst = KCache + row * s_kcb + slot * s_kcs + hk * s_kch
            tl.store(dst + cols, tl.load(src + cols, mask=rest_ok).to(KCache.dtype.element_ty), mask=rest_ok)
            if ROTARY:
                c = tl.load(Cos + pos * s_cos + half_cols, mask=half_ok, other=1.0).to(tl.float32)
                s = tl.load(Sin + pos * s_cos + half_cols, mask=half_ok, other=0.0).to(tl.float32)
                x1, x2 = _rotated_halves(src, half_cols, half_ok, ROT_HALF, INTERLEAVED)
                _store_rotated(dst, x1, x2, c, s, half_cols, half_ok, ROT_HALF, INTERLEAVED)
            vcols = tl.arange(0, BLOCK_DV)
            v_ok = vcols < HEAD_DIM_V
            vsrc = V + b * s_vb + i * s_vs + hk * s_vh
            vdst = VCache + row * s_vcb + slot * s_vcs + hk * s_vch
            tl.store(vdst + vcols, tl.load(vsrc + vcols, mask=v_ok).to(VCache.dtype.element_ty), mask=v_ok)
