"""The host entry points of the Hopper forward kernel (flash_fwd_sm90.FlashFwdSm90 inherits them): one per calling
convention the compiled kernels have (dense, sink, split-KV, persistent, varlen and their combinations), each building
the kernel's views and grid and handing them to FlashFwdSm90._launch. score_mod.ModEntries holds the mods' entries.

Layouts, as PyTorch lays them out: mQ / mO (B, Sq, H, D), mK / mV (B, Sk, Hk, D), mLSE (B, H, Sq) fp32; varlen: the
packed (total, H, D) tensors and (H, total_q) lse, with cu_seqlens and seqused_k."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_attn.cute.tile_scheduler import l2_group


class FwdEntries:
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, stream):
        """Dense: mQ/mO (B, Sq, H, D), mK/mV (B, Sk, Hk, D), mLSE (B, H, Sq) fp32, as PyTorch lays them
        out. softcap is read when the kernel was built with softcap=True, window_left/right (>= 0,
        UNBOUNDED for no limit) when built with local=True."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None)

    @cute.jit
    def call_sink(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32, stream,
                  mSink: cute.Tensor):
        """__call__ for a kernel built with sink=True: mSink (H,) fp32, natural-log logits (not scaled by
        softmax_scale). A separate entry point, so that __call__'s compiled signature has no sink
        argument at all."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, mSink)

    @cute.jit
    def call_split(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                   softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                   num_splits: Int32, stream):
        """__call__ for a kernel built with split=True: mO (num_splits * B, Sq, H, Dv) and mLSE (num_splits * B, H,
        Sq) fp32, the parts of split s of batch entry b at s * B + b; num_splits >= 1."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None,
                    num_splits=num_splits)

    @cute.jit
    def call_persistent(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                        mLSE: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                        window_right: Int32, stream, max_ctas: Int32):
        """__call__ for a kernel built with persistent=True: min(tiles, max_ctas) CTAs loop over the
        tiles (max_ctas >= 1: the SM count, as one CTA fills an SM's shared memory)."""
        self._dense(mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, None,
                    max_ctas)

    @cute.jit
    def _dense(self, mQ, mK, mV, mO, mLSE, softmax_scale, softcap, window_left, window_right, stream, mSink,
               max_ctas=None, num_splits=None, aux=None, sparse=None, scalars=None):
        mQ, mK, mVt, mO, mLSE = self.seqlens.dense_views(mQ, mK, mV, mO, mLSE)
        grid = (cute.ceil_div(cute.size(mQ, mode=[0]), self.block_q), self.pack.grid_heads(mQ, mK),
                cute.size(mQ, mode=[3]))
        if cutlass.const_expr(num_splits is not None):
            grid = (grid[0], grid[1], grid[2] * num_splits)  # z: split * B + batch entry
        sched = None  # the persistent schedule's numbers, or lpt's section size
        if cutlass.const_expr(max_ctas is not None):
            sched, grid = self.scheduler.params(grid, self._l2_group(mK, grid[1]), max_ctas)
        elif cutlass.const_expr(self.lpt):
            sched = self._l2_group(mK, grid[1])
        self._launch(mQ, mK, mVt, mO, mLSE, None, None, None, softmax_scale, softcap, window_left,
                     window_right, grid, stream, mSink, sched, num_splits, aux, sparse, scalars)

    def _l2_group(self, mK, heads):
        """tile_scheduler.l2_group for this kernel's K and V rows (trace time)."""
        return l2_group(self.L2_KV_BYTES, (self.head_dim + self.head_dim_v) * self.dtype.width // 8, mK, heads)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                    mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                    mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                    window_left: Int32, window_right: Int32, stream):
        """Varlen (kernel built with varlen=True): mQ/mO (total_q, H, D), mK/mV (total_k, Hk, D), mLSE
        (H, total_q) fp32, cu_seqlens int32 (B + 1,), mSeqUsedK int32 (B,): the keys each sequence uses
        from its start (cu_seqlens_k's differences when the caller has none to give)."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, None)

    @cute.jit
    def call_varlen_sink(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                         mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                         mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                         window_left: Int32, window_right: Int32, stream, mSink: cute.Tensor):
        """call_varlen for a kernel built with varlen=True and sink=True; mSink as in call_sink."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, mSink)

    @cute.jit
    def call_varlen_split(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                          mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                          mSeqUsedK: cute.Tensor, max_seqlen_q: Int32, softmax_scale: Float32, softcap: Float32,
                          window_left: Int32, window_right: Int32, num_splits: Int32, stream):
        """call_varlen for a kernel built with varlen=True and split=True: mO (num_splits, total_q, H, Dv) and mLSE
        (num_splits, H, total_q) fp32, split s's part of every sequence's rows in entry s; num_splits >= 1."""
        self._varlen(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                     softcap, window_left, window_right, stream, None, num_splits=num_splits)

    @cute.jit
    def _varlen(self, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, max_seqlen_q, softmax_scale,
                softcap, window_left, window_right, stream, mSink, num_splits=None, aux=None, sparse=None,
                scalars=None):
        mQ, mK, mVt, mO, mLSE = self.seqlens.varlen_views(mQ, mK, mV, mO, mLSE, self.paged_kv, num_splits is not None)
        grid = (cute.ceil_div(max_seqlen_q, self.block_q), self.pack.grid_heads(mQ, mK),
                cute.size(mCuSeqlensQ, mode=[0]) - 1)
        if cutlass.const_expr(num_splits is not None):
            grid = (grid[0], grid[1], grid[2] * num_splits)  # z: split * sequences + sequence
        self._launch(mQ, mK, mVt, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, softmax_scale, softcap,
                     window_left, window_right, grid, stream, mSink, num_splits=num_splits, aux=aux, sparse=sparse,
                     scalars=scalars)
