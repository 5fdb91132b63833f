"""User score and mask modifications in the Hopper forward (FlashAttention-4's ``score_mod`` / ``mask_mod``, the
FlexAttention idea of Dong et al. 2024): after S = Q K^T of a key block, each score becomes
``score_mod(scale * s, batch, head, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` and is set to -inf where
``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)`` is False, before the online softmax.

The calling convention (FA4's, docs/ARCHITECTURE.md section 4):
- every index argument is a TensorSSA of Int32: ``vec`` (1 or 2; a score_mod's ``__vec_size__``, default 2 without
  aux tensors, 1 with them) adjacent keys of one query row for a score_mod, one element for a mask_mod;
- ``q_idx`` / ``kv_idx`` are positions within the sequence (0-based, not bottom-right aligned; varlen: from the
  sequence's first row), ``batch`` is the batch entry (varlen: the sequence's index), ``head`` the query head;
- ``seqlen_info`` (ModSeqlens) has ``offset_q`` / ``offset_k`` (the sequence's first row in the packed tensors,
  0 for dense calls: q_idx + offset_q is the global row) and ``seqlen_q`` / ``seqlen_k``;
- ``aux_tensors`` is the list of CuTe tensors the call passed (a score_mod gets () without any);
- the score a score_mod sees is already multiplied by softmax_scale; the softmax then adds no scale;
- ``aux_scalars`` (FA4's): a tuple of Int32 / Float32 runtime values, passed to a mod whose signature has an
  ``aux_scalars`` parameter (a score_mod's keyword, a mask_mod's seventh positional argument), never to others;
- with aux tensors, q_idx / kv_idx of tile positions past the sequence are clamped to its last row / key, so a
  mod that indexes an aux tensor by them never reads out of bounds (those scores are discarded: rows past Sq are
  not stored, keys past Sk are masked afterwards).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn.cute.pack_gqa import packed_row
from flash_attn.cute.sparse_tiles import SparseTiles


class ModSeqlens:
    """The ``seqlen_info`` a mod receives: one CTA's sequence (trace-time object of Int32 values)."""

    def __init__(self, offset_q, offset_k, seqlen_q, seqlen_k, varlen):
        self.offset_q = offset_q
        self.offset_k = offset_k
        self.seqlen_q = seqlen_q
        self.seqlen_k = seqlen_k
        self.has_cu_seqlens_q = varlen
        self.has_cu_seqlens_k = varlen


class ModContext:
    """What one CTA's mods read besides the scores: batch entry (varlen: sequence), query head, the sequence's
    ModSeqlens, the aux tensors (a tuple of CuTe tensors, or None) and the softmax scale applied before score_mod."""

    def __init__(self, batch, head, seqlens, aux, softmax_scale, scalars=None):
        self.batch = batch
        self.head = head
        self.seqlens = seqlens
        self.aux = aux
        self.softmax_scale = softmax_scale
        self.scalars = () if scalars is None else scalars


def takes_scalars(fn):
    """Whether a mod's signature has an ``aux_scalars`` parameter (FA4's convention since aux scalars: older mods
    have none and are called without them)."""
    import inspect

    try:
        return "aux_scalars" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def score_vec_size(score_mod, has_aux):
    """Keys per score_mod call: the function's ``__vec_size__``, default 2 (1 with aux tensors), as FA4 on sm_90."""
    vec = getattr(score_mod, "__vec_size__", 1 if has_aux else 2)
    if vec not in (1, 2):
        raise ValueError(f"score_mod __vec_size__ {vec} not supported on sm_90 (1 or 2)")
    return vec


class ModEntries:
    """FlashFwdSm90's entry points for kernels built with score_mod / mask_mod (a base class, so the kernel's
    module keeps to the pipeline)."""

    @cute.jit
    def call_mods(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32, stream, aux,
                  sparse, scalars):
        """__call__ for a kernel built with score_mod / mask_mod / sparse: aux, a tuple of the mods' aux tensors
        (None for a kernel built without aux); sparse, the block-sparsity lists (sparse_tiles; None for a kernel
        built without); scalars, the aux scalars (a tuple of Int32 / Float32; None for a kernel built without)."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None, aux=aux,
                    sparse=sparse, scalars=scalars)

    @cute.jit
    def call_mods_sink(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                       softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32, stream, aux,
                       sparse, scalars, mSink: cute.Tensor):
        """call_mods for a kernel built with sink=True too: mSink (H,) fp32 as in call_sink (the learnable sink joins
        the modified scores' softmax)."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, mSink, aux=aux,
                    sparse=sparse, scalars=scalars)

    @cute.jit
    def call_varlen_mods_sink(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                              mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                              mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                              window_left: Int32, window_right: Int32, stream, aux, sparse, scalars,
                              mSink: cute.Tensor):
        """call_varlen_mods for a kernel built with sink=True too (mSink as in call_mods_sink)."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, mSink, aux=aux, sparse=sparse, scalars=scalars)

    @cute.jit
    def call_varlen_mods(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                         mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                         mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                         window_left: Int32, window_right: Int32, stream, aux, sparse, scalars):
        """call_varlen for a kernel built with varlen=True and score_mod / mask_mod / sparse; aux, sparse and scalars
        as in call_mods (sparse: lists (batch, Hs, M, N) per sequence and its query blocks,
        block_sparsity.normalize_varlen)."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, None, aux=aux, sparse=sparse, scalars=scalars)


class ScoreMods:
    """Owns a kernel's user modifications of a score tile (compile-time: the functions are part of the kernel):
    ``score_mod`` and / or ``mask_mod`` (None: absent), whether aux tensors are passed, block_q / block_n the
    tile's query positions and keys, and block sparsity (``sparse``: a SparseTiles or None). Applied to every
    visited key block (the mask_mod, with block sparsity, to the partial ones only), before AttentionMask.apply
    (which still masks keys past Sk and the causal / window edges)."""

    def __init__(self, score_mod, mask_mod, has_aux, block_q, block_n, sparse=None, scalars=(), score_mod_bwd=None):
        if score_mod is None and mask_mod is None and sparse is None:
            raise ValueError("ScoreMods needs a score_mod, a mask_mod or block sparsity")
        self.sparse = sparse
        self.scalars = tuple(scalars)  # the aux scalars' kinds ("i" Int32, "f" Float32)
        self.score_scalars = score_mod is not None and takes_scalars(score_mod)
        self.score_mod_bwd = score_mod_bwd  # the backward kernel's: the gradient through score_mod
        self.bwd_scalars = score_mod_bwd is not None and takes_scalars(score_mod_bwd)
        self.mask_scalars = mask_mod is not None and takes_scalars(mask_mod)
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.has_aux = bool(has_aux)
        self.block_q = block_q
        self.block_n = block_n
        self.vec = score_vec_size(score_mod, has_aux) if score_mod is not None else 1

    @classmethod
    def build(cls, kernel, score_mod, mask_mod, aux, sparse=None, scalars=()):
        """The component of FlashFwdSm90 ``kernel`` (None without mods or sparsity): the one-tile kernel without
        softcap, pack_gqa, paged K / V or split (a learnable sink composes: the epilogue adds it to the modified
        scores' softmax); sparse (has_full, q_factor, kv_factor) or None."""
        if score_mod is None and mask_mod is None and sparse is None:
            return None
        if kernel.persistent or kernel.softcap or kernel.pack_gqa > 1 or kernel.paged or kernel.split:
            raise ValueError("score_mod / mask_mod: the one-tile kernel without softcap, pack_gqa, paged K / V or "
                             "split")
        return cls(score_mod, mask_mod, aux, kernel.block_q, kernel.block_n,
                   None if sparse is None else SparseTiles(*sparse), scalars)

    def scales(self, scale_log2, score_scale, softmax_scale):
        """(scale_log2, score_scale) of the kernel (trace time): with a score_mod FA4's convention, the mod sees
        scale * s (score_scale = softmax_scale) and the softmax then adds log2(e) only."""
        if cutlass.const_expr(self.score_mod is not None):
            return Float32(1.4426950408889634), softmax_scale
        return scale_log2, score_scale

    def context(self, seqlen, head, aux, softmax_scale, scalars=None):
        """The ModContext of a CTA's sequence (seqlen_info.TileSeqlens; FA4's batch index of a varlen call is the
        sequence's)."""
        batch = seqlen.batch if seqlen.sequence is None else seqlen.sequence
        return ModContext(batch, head, ModSeqlens(seqlen.q_start, seqlen.k_start, seqlen.seqlen_q, seqlen.seqlen_k,
                                                  seqlen.sequence is not None), aux, softmax_scale, scalars)

    def _index(self, idx, seqlen):
        # In-bounds indices for aux reads (see the module docstring).
        if cutlass.const_expr(self.has_aux):
            idx = cutlass.min(idx, cutlass.max(seqlen - 1, 0))
        return idx

    @staticmethod
    def _ssa(values, dtype):
        frag = cute.make_rmem_tensor(len(values), dtype)
        for j in range(len(values)):
            frag[j] = values[j]
        return frag.load()

    @cute.jit
    def _score_group(self, acc_S, i0, scores, qs, ks, ctx):
        """acc_S[i0 .. i0 + vec) = score_mod of the group's (scaled) scores at query / key positions qs / ks."""
        vec = self.vec
        aux = ctx.aux
        extra = {"aux_scalars": ctx.scalars} if cutlass.const_expr(self.score_scalars) else {}
        out = self.score_mod(self._ssa(scores, Float32), self._ssa([ctx.batch] * vec, Int32),
                             self._ssa([ctx.head] * vec, Int32), q_idx=self._ssa(qs, Int32),
                             kv_idx=self._ssa(ks, Int32), seqlen_info=ctx.seqlens,
                             aux_tensors=aux if cutlass.const_expr(aux is not None) else (), **extra)
        res = cute.make_rmem_tensor(vec, Float32)
        res.store(out.to(Float32))
        for j in cutlass.range_constexpr(vec):
            acc_S[i0 + j] = res[j]

    @cute.jit
    def _keep(self, row, col, ctx):
        """mask_mod at query position ``row`` and key ``col`` (clamped as _index does), as a Boolean."""
        sl = ctx.seqlens
        keep = self.mask_mod(self._ssa([ctx.batch], Int32), self._ssa([ctx.head], Int32),
                             self._ssa([self._index(row, sl.seqlen_q)], Int32),
                             self._ssa([self._index(col, sl.seqlen_k)], Int32), sl, ctx.aux,
                             *((ctx.scalars,) if cutlass.const_expr(self.mask_scalars) else ()))
        if cutlass.const_expr(isinstance(keep, cute.TensorSSA)):
            flag = cute.make_rmem_tensor(1, cutlass.Boolean)
            flag.store(keep)
            keep = flag[0]
        return keep

    @cute.jit
    def apply(self, acc_S, tScS, m_block, n_block, ctx, partial=None):
        """acc_S (an m64nNk16 accumulator, tile coordinates tScS) of key block n_block of query tile m_block, in
        place: score_mod's result (scores scaled by ctx.softmax_scale first), -inf where mask_mod is False.
        partial (block sparsity): whether the block is a partial one, the only kind the mask_mod runs on; None:
        it runs on every block."""
        sl = ctx.seqlens
        if cutlass.const_expr(self.score_mod is not None):
            vec = self.vec
            for i0 in cutlass.range_constexpr(0, cute.size(acc_S), vec):
                scores, qs, ks = [], [], []
                for j in cutlass.range_constexpr(vec):
                    row, _ = packed_row(tScS[i0 + j][0], m_block, self.block_q, 1)
                    scores.append(acc_S[i0 + j] * ctx.softmax_scale)
                    qs.append(self._index(row, sl.seqlen_q))
                    ks.append(self._index(n_block * self.block_n + tScS[i0 + j][1], sl.seqlen_k))
                self._score_group(acc_S, i0, scores, qs, ks, ctx)
        if cutlass.const_expr(self.mask_mod is not None):
            if cutlass.const_expr(partial is None):
                self._mask(acc_S, tScS, m_block, n_block, ctx)
            else:
                if partial:
                    self._mask(acc_S, tScS, m_block, n_block, ctx)

    @cute.jit
    def _mask(self, acc_S, tScS, m_block, n_block, ctx):
        """-inf in acc_S where mask_mod is False."""
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            row, _ = packed_row(tScS[i][0], m_block, self.block_q, 1)
            if not self._keep(row, n_block * self.block_n + tScS[i][1], ctx):
                acc_S[i] = -Float32.inf

    @cute.jit
    def mask_transposed(self, acc_S, tScS, m_block, n_block, ctx):
        """The backward's S^T (tScS: (key, query) coordinates; block_q query rows per block m_block, block_n keys
        per key block n_block): -inf where mask_mod is False."""
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            if not self._keep(m_block * self.block_q + tScS[i][1], n_block * self.block_n + tScS[i][0], ctx):
                acc_S[i] = -Float32.inf

    def _transposed_indices(self, tScS, i, m_block, n_block, sl):
        """(query, key) positions of S^T's element i (tScS: (key, query) coordinates), clamped as _index does."""
        row = m_block * self.block_q + tScS[i][1]
        col = n_block * self.block_n + tScS[i][0]
        return self._index(row, sl.seqlen_q), self._index(col, sl.seqlen_k)

    @cute.jit
    def score_transposed(self, acc_S, rZ, tScS, m_block, n_block, ctx):
        """The backward's S^T: rZ = the scaled scores (softmax_scale * s, what score_mod sees; kept for
        score_mod_bwd), acc_S = score_mod's result, in vec-sized groups of adjacent elements (queries of one key)."""
        sl = ctx.seqlens
        vec = self.vec
        for i0 in cutlass.range_constexpr(0, cute.size(acc_S), vec):
            scores, qs, ks = [], [], []
            for j in cutlass.range_constexpr(vec):
                z = acc_S[i0 + j] * ctx.softmax_scale
                rZ[i0 + j] = z
                qi, ki = self._transposed_indices(tScS, i0 + j, m_block, n_block, sl)
                scores.append(z)
                qs.append(qi)
                ks.append(ki)
            self._score_group(acc_S, i0, scores, qs, ks, ctx)

    @cute.jit
    def grad_transposed(self, acc_dS, rZ, tScS, m_block, n_block, ctx):
        """The backward's dS^T, in place: score_mod_bwd(grad = dS^T, score = rZ, ...), the gradient with respect to the
        scaled score (the kernel's softmax_scale on dK and dQ then makes it the raw score's)."""
        sl = ctx.seqlens
        aux = ctx.aux
        vec = self.vec
        for i0 in cutlass.range_constexpr(0, cute.size(acc_dS), vec):
            grads, scores, qs, ks = [], [], [], []
            for j in cutlass.range_constexpr(vec):
                qi, ki = self._transposed_indices(tScS, i0 + j, m_block, n_block, sl)
                grads.append(acc_dS[i0 + j])
                scores.append(rZ[i0 + j])
                qs.append(qi)
                ks.append(ki)
            extra = (ctx.scalars,) if cutlass.const_expr(self.bwd_scalars) else ()
            out = self.score_mod_bwd(self._ssa(grads, Float32), self._ssa(scores, Float32),
                                     self._ssa([ctx.batch] * vec, Int32), self._ssa([ctx.head] * vec, Int32),
                                     self._ssa(qs, Int32), self._ssa(ks, Int32), sl,
                                     aux if cutlass.const_expr(aux is not None) else (), *extra)
            res = cute.make_rmem_tensor(vec, Float32)
            res.store(out.to(Float32))
            for j in cutlass.range_constexpr(vec):
                acc_dS[i0 + j] = res[j]
