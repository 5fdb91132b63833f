"""The host entry points of the Hopper backward kernel (flash_bwd_sm90.FlashBwdSm90 inherits them): one per
calling convention the compiled kernels have, each handing FlashBwdSm90._host the kernel's views and runtime values.

Layouts, as PyTorch lays them out: mQ / mdO (B, Sq, H, D); mK / mV (B, Sk, Hk, D); mLSE2 / mDelta (B, H, Sq_pad) fp32
(lse in log2 units, +inf past Sq; delta = rowsum(dO * O) - dlse, 0 past Sq); mdQaccum (B, Sq, H, D) fp32 (zeroed by
the caller, receives softmax_scale * dS K); mdK / mdV (B, Sk, H, D) in the input dtype (per query head: GQA sums on
the host). Varlen: the packed tensors as one batch entry (B = 1), sequence b's rows from cu_seqlens_q[b] /
cu_seqlens_k[b], its lse2 / delta rows from (cu_seqlens_q[b] // block_m + b) * block_m (seqlen_info.BwdSeqlens). Deterministic:
mSem (B or sequences, H, query blocks) int32 zeros, the turn counters (bwd_dq.DqAccumulator). softcap > 0 is read by
a kernel built with softcap=True, the window sizes (>= 0) by one built with local=True."""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


class BwdEntries:

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, softmax_scale: Float32, stream):
        """Dense, no window, no softcap."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, None)

    @cute.jit
    def call_general(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                     mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                     mdV: cute.Tensor, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                     window_right: Int32, stream):
        """Dense with a sliding window (local=True) and / or softcap (softcap=True)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream,
                   (window_left, window_right) if cutlass.const_expr(self.local) else None, None, None, softcap)

    @cute.jit
    def call_deterministic(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                           mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                           mdV: cute.Tensor, mSem: cute.Tensor, softmax_scale: Float32, softcap: Float32, stream):
        """Dense, deterministic=True (no window)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, mSem,
                   softcap)

    @cute.jit
    def call_varlen(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                    mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                    mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedQ: cute.Tensor,
                    mSeqUsedK: cute.Tensor, max_seqlen_k: Int32, softmax_scale: Float32, softcap: Float32,
                    window_left: Int32, window_right: Int32, stream):
        """Varlen (varlen=True): int32 cu_seqlens (sequences + 1,), the rows each sequence uses from its start
        (sequences,), max_seqlen_k at least the longest used key count (the grid's x)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream,
                   (window_left, window_right) if cutlass.const_expr(self.local) else None,
                   (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k), None, softcap)

    @cute.jit
    def call_varlen_deterministic(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                                  mLSE2: cute.Tensor, mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                                  mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                                  mSeqUsedQ: cute.Tensor, mSeqUsedK: cute.Tensor, mSem: cute.Tensor,
                                  max_seqlen_k: Int32, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                                  window_right: Int32, stream):
        """call_varlen with deterministic=True (no window)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None,
                   (mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, max_seqlen_k), mSem, softcap)

    @cute.jit
    def call_mods(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                  mDelta: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                  softmax_scale: Float32, stream, aux, sparse, scalars):
        """Dense, built with a mask_mod (no window, no softcap): aux, the mask_mod's aux tensors (a tuple; None for a
        kernel built without); sparse, the per-key-block lists of query blocks (a tuple; None for a kernel built
        without); scalars, the mask_mod's aux scalars (a tuple; None for a kernel built without)."""
        self._host(mQ, mK, mV, mdO, mLSE2, mDelta, mdQaccum, mdK, mdV, softmax_scale, stream, None, None, None,
                   aux=aux, sparse=sparse, scalars=scalars)
