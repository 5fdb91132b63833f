"""The Triton attention backend (contract: flash_attn/backends/__init__.py).

Forward and backward for dense and varlen q/k/v: causal and sliding-window masks (bottom-right aligned),
softcap, ALiBi, GQA/MQA, dropout with the shared counter-based hash, FA4's learnable sink, head dims 1..256
(padded to a power of two inside the kernel), fp16/bf16 (and fp32, with exact fp32 products). Runs on CUDA
(and, by Triton's design, ROCm) devices, and on CPU tensors under TRITON_INTERPRET=1.

The learnable sink is a forward feature only (_fwd.py's HAS_SINK; the kvcache kernels' too): its lse includes the
sink, from which every backward kernel here, the warp-specialized one included, computes the sink-aware P, and the
sink's own gradient is the core's (flash_attn._ops.sink_grad). The warp-specialized forward has no sink, so such
calls take _fwd.py.

The launchers are kept lean for small problems: configs come from an lru-cached table, sequence lengths
and seeds are runtime (unspecialised) kernel arguments so no shape triggers a recompile, and nothing
reads a device tensor on the host.
"""
from __future__ import annotations

import torch

from flash_attn.triton import settings

NAME = "triton"

_INTERPRET = settings.interpret
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
# CUDA's limit on a grid's y extent, where the kernels put their (sequence, head) pairs: calls with more run as
# launches on chunks of the batch (_batch_chunks)
_MAX_GRID_Y = 65535
# fwd() takes lse_scratch=True (lse dropped: no backward follows); a dense decoding call (<= _DECODE_ROWS query rows)
# then runs on the KV-cache kernels, which split the keys over the SMs (kvcache.fwd_dense_decode)
LSE_SCRATCH = True
_DECODE_ROWS = 16


def unavailable_reason():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        # triton itself absent, or present but one of its own imports failing (numpy, a CUDA library): say which
        return "triton is not installed" if e.name == "triton" else f"triton does not import ({type(e).__name__}: {e})"
    if _INTERPRET:
        return None
    if not torch.cuda.is_available():
        return "no CUDA/ROCm device (set TRITON_INTERPRET=1 to run kernels on CPU tensors)"
    return None


def launcher(kernel):
    """A low-overhead launcher for any @triton.jit kernel (the core's ``flash_attn.backends.triton_launcher``)."""
    from ._launch import Launcher
    return Launcher(kernel)


def unsupported_reason(call):
    if call.device_type == "cpu":
        if not _INTERPRET:
            return "device cpu (needs TRITON_INTERPRET=1)"
        if call.dtype == torch.bfloat16:
            return "bf16 on cpu (the Triton interpreter computes bf16 wrongly)"
    elif call.device_type != "cuda":
        return f"device {call.device_type}"
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype}"
    if not (1 <= call.head_dim <= 256 and 1 <= call.head_dim_v <= 256):
        return f"head dims {call.head_dim}/{call.head_dim_v} not in 1..256"
    if call.kvcache:
        return None  # flash_attn_with_kvcache, dense or paged caches: kvcache.py
    if call.paged:
        return "paged KV"
    return None


def _kernels():
    # Imported on first use so that importing the backend (dispatch, unavailable_reason) stays cheap.
    global _fwd_mod, _bwd_mod, _configs, _NO_WINDOW, _L_FWD, _L_PRE, _L_DKDV, _L_DQ, _FWD_VARIANT_ON, _L_FWD_WS
    global _L_PRE_WS, _L_DKDV_WS, _L_DQ_WS, _BWD_WS_ON, set_tma_allocator

    from . import _bwd as _bwd_mod
    from . import _bwd_ws
    from . import _configs
    from . import _fwd as _fwd_mod
    from . import _fwd_ws
    from ._common import NO_WINDOW as _NO_WINDOW
    from ._launch import Launcher, set_tma_allocator

    _L_FWD = Launcher(_fwd_mod._attn_fwd_kernel)
    _L_PRE = Launcher(_bwd_mod._bwd_preprocess_kernel)
    _L_DKDV = Launcher(_bwd_mod._bwd_dkdv_kernel)
    _L_DQ = Launcher(_bwd_mod._bwd_dq_kernel)
    _L_FWD_WS = Launcher(_fwd_ws._attn_fwd_ws_kernel)
    _L_PRE_WS = Launcher(_bwd_ws._bwd_ws_preprocess_kernel)
    _L_DKDV_WS = Launcher(_bwd_ws._bwd_dkdv_ws_kernel)
    _L_DQ_WS = Launcher(_bwd_ws._bwd_dq_ws_kernel)
    # calls may take the warp-specialized forward (by default some head dims on sm_90; checked per call)
    _FWD_VARIANT_ON = (_configs.FWD_VARIANT[0] != 0 if _configs.FWD_VARIANT_SET
                       else bool(_configs.FWD_WS_DEFAULT))
    # calls may take the warp-specialized backward
    _BWD_WS_ON = _configs._BWD_VARIANT_NAME == "ws" or (
        _configs._BWD_VARIANT_NAME not in ("0", "off") and bool(_configs.BWD_WS_DEFAULT))
    return _fwd_mod, _bwd_mod, _configs


_fwd_mod = _bwd_mod = _configs = None
_L_FWD = _L_PRE = _L_DKDV = _L_DQ = None
_FWD_VARIANT_ON = False
_L_FWD_WS = _L_PRE_WS = _L_DKDV_WS = _L_DQ_WS = None
_BWD_WS_ON = False
set_tma_allocator = None  # _launch.set_tma_allocator; bound by _kernels()
_NO_WINDOW = None  # _common.NO_WINDOW, the kernels' unbounded window side; bound by _kernels()


def _arch(device):
    # ROCm reports gfx versions through the same call (MI300: (9, 4)); they must not pick the sm_90 table, and
    # take the entries that fit AMD's 64 KiB of LDS (_configs.HIP_ARCH).
    if device.type != "cuda":
        return None
    if torch.version.hip is not None:
        from ._configs import HIP_ARCH

        return HIP_ARCH
    return _ARCH.get(device.index) or _ARCH.setdefault(device.index, torch.cuda.get_device_capability(device))


_ARCH: dict = {}


def _geometry(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    """(B, H, Hk, D, Dv, Sq, Sk, q-like strides (batch, seq, head) of q, k, v)."""
    if cu_seqlens_q is not None:
        _, H, D = q.shape
        Hk = k.shape[1]
        B = cu_seqlens_q.shape[0] - 1
        return (B, H, Hk, D, v.shape[-1], max_seqlen_q, max_seqlen_k,
                (0, q.stride(0), q.stride(1)), (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1)))
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    return (B, H, Hk, D, v.shape[-1], Sq, Sk, q.stride()[:3], k.stride()[:3], v.stride()[:3])


def _row_strides(t, varlen):
    # (batch, seq, head) strides of an out/dout/dq-like tensor
    return (0, t.stride(0), t.stride(1)) if varlen else t.stride()[:3]


def _lse_strides(lse, varlen):
    # (batch, head) strides; rows are contiguous in both layouts ((B, H, Sq) and (H, total_q))
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _alibi_strides(alibi_slopes):
    if alibi_slopes is None:
        return 0, 0
    return (0, alibi_slopes.stride(0)) if alibi_slopes.dim() == 1 else tuple(alibi_slopes.stride())


def _scalars(softmax_scale, softcap, window_left, window_right, causal, dropout_p, rng_state):
    if softcap > 0.0:
        softcap_scale, softcap_log2 = softmax_scale / softcap, softcap * _LOG2E
    else:
        softcap_scale, softcap_log2 = 0.0, 0.0
    # (left bounded, right bounded) are constexpr flags: each bound adds a masked loop to a kernel.
    window = (window_left >= 0, window_right >= 0)
    wl = window_left if window_left >= 0 else _NO_WINDOW
    wr = window_right if window_right >= 0 else _NO_WINDOW
    if dropout_p > 0.0:
        seed0, seed1 = (int(s) for s in rng_state.tolist())
        threshold = min(int(dropout_p * 2**32), 2**32)
        dropout = (seed0, seed1, threshold - 2**31, 1.0 / (1.0 - dropout_p))
    else:
        dropout = (0, 0, 0, 1.0)
    return softcap_scale, softcap_log2, window, wl, wr, dropout


_FWD_PLANS: dict = {}


def _tma_ok(k, v, D, Dv):
    """Whether K/V meet the TMA descriptor rules of the forward: power-of-two head dims (no column
    padding) and the copy engine's alignment (_tma_aligned)."""
    return D == _configs.padded_dim(D) and Dv == _configs.padded_dim(Dv) and _tma_aligned(k, v)


def _fwd_plan(q, D, Dv, varlen, window, softcap, alibi, dropout, return_probs, config, tma_ok=True, sink=False):
    """(block_m, plan key, constexpr/launch kwargs, uses TMA) for one kind of call, cached: the per-call
    path does one dict lookup on a small tuple. The plan key is a fresh object, so the launcher hashes it
    by identity."""
    key = (q.device, q.dtype, D, Dv, varlen, window, softcap, alibi, dropout, return_probs, sink, config, tma_ok)
    plan = _FWD_PLANS.get(key)
    if plan is None:
        if config is None:
            config = _configs.fwd_config(_arch(q.device), max(D, Dv), window[1], _INTERPRET, q.dtype)
        tma = bool(config.tma) and tma_ok and _tma_supported(q.device, q.dtype, D, Dv)
        plan = (config.block_m, _PlanKey(key), dict(
            IS_FP32=q.dtype == torch.float32, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_configs.padded_dim(D),
            BLOCK_DV=_configs.padded_dim(Dv), BLOCK_M=config.block_m, BLOCK_N=config.block_n, IS_VARLEN=varlen,
            WINDOW_LEFT=window[0], WINDOW_RIGHT=window[1], HAS_SOFTCAP=softcap, HAS_ALIBI=alibi,
            HAS_DROPOUT=dropout, RETURN_PROBS=return_probs, USE_TMA=tma, RESCALE_THRESHOLD=float(config.rescale),
            GROUP_HEADS=config.group, HAS_SINK=sink,
            num_warps=config.num_warps, num_stages=config.num_stages), tma)
        _FWD_PLANS[key] = plan
    return plan


_FWD_WS_PLANS: dict = {}
_FWD_WS_KINDS: dict = {}  # (device, dtype, D, Dv, causal, variant or config) -> FwdConfig or None


_NUM_SMS: dict = {}


def _num_sms(device):
    """Streaming multiprocessors of a device (the persistent grid); 4 under the interpreter, so that small
    test problems give each program several tiles."""
    if device.type != "cuda":
        return 4
    n = _NUM_SMS.get(device.index)
    if n is None:
        n = _NUM_SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def _fwd_ws_plan(q, k, v, D, Dv, Sq, Sk, window, wl, wr, softmax_scale, config):
    """(block_m, plan key, kwargs) of the warp-specialized forward (_fwd_ws.py) for a dense call with no
    softcap/ALiBi/dropout/probs, or None when the call is outside what it serves: another window than
    none or causal, seqlen_q > seqlen_k when causal (rows that see no key), no keys, fp32, head dims
    that are not 32..256 powers of two, tensors the copy engine cannot address or whose sequences are
    not one row range (batch stride != seqlen x row stride), or no variant for this GPU and head dim
    (then the table's config runs as usual). The per-call checks come first; what depends only on the
    kind of call is cached (_FWD_WS_KINDS, _FWD_WS_PLANS)."""
    causal = window == (False, True)
    if (window != (False, False) and not (causal and wr == 0)) or (causal and Sq > Sk) or Sk == 0:
        return None
    if config is None:
        variant = _configs.ws_variant(max(D, Dv), causal)
        if variant[0] == 0:
            return None
        if not _configs.FWD_VARIANT_SET and _tiny(q.device, q.shape[0] * q.shape[2], Sq, Sk):
            return None
    else:
        variant = config
    if softmax_scale <= 0.0 or not _tma_aligned(q, k, v):
        return None
    # The kernel's descriptors view each tensor as B * S rows (_fwd_ws._attn_fwd_ws_kernel).
    if q.shape[0] > 1 and (q.stride(0) != Sq * q.stride(1) or k.stride(0) != Sk * k.stride(1)
                           or v.stride(0) != Sk * v.stride(1)):
        return None
    kind = (q.device, q.dtype, D, Dv, causal, variant)
    cfg = _FWD_WS_KINDS.get(kind, _FWD_WS_KINDS)
    if cfg is _FWD_WS_KINDS:  # first call of this kind
        cfg = None
        if (q.dtype != torch.float32 and D == _configs.padded_dim(D) and Dv == _configs.padded_dim(Dv)
                and _tma_supported(q.device, q.dtype, D, Dv)):
            cfg = (config if config is not None
                   else _configs.fwd_variant_config(_arch(q.device), max(D, Dv), causal, variant))
            if cfg.variant not in (1, 2, 3):
                cfg = None
        _FWD_WS_KINDS[kind] = cfg
    if cfg is None:
        return None
    even_k = Sk % cfg.block_n == 0
    key = (kind, even_k)
    plan = _FWD_WS_PLANS.get(key)
    if plan is None:
        plan = (cfg.block_m, _PlanKey((q.device, q.dtype, D, Dv, causal, even_k, cfg)), dict(
            HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
            EVEN_K=even_k, GROUP_HEADS=cfg.group if causal else 0, PERSISTENT=cfg.variant in (2, 3),
            BALANCED=cfg.variant == 3 and causal,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        _FWD_WS_PLANS[key] = plan
    return plan


def _tiny(device, BH, Sq, Sk):
    """Whether a forward is less work than one 128 x 128 block per streaming multiprocessor: its GPU time is
    a few microseconds whichever kernel runs, and the table's kernel launches with less host work than the
    warp-specialized one (no plan checks, no descriptor scratch to allocate)."""
    return BH * -(-Sq // 128) * -(-Sk // 128) < _num_sms(device)


class _PlanKey:
    """A launcher cache key for one plan: hashed by identity (cheap), printed as the plan it stands for."""

    __slots__ = ("what",)

    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return f"_PlanKey{self.what!r}"


def fwd(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state,
        config=None, sink=None, lse_scratch=False):
    """Attention forward; see the contract. Dense q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv);
    varlen q (total_q, H, D) with cu_seqlens int32 (B+1,). Returns (out, lse fp32, probs or None).

    ``config`` (a _configs.FwdConfig) overrides the table, for tuning. ``sink``: the learnable sink, fp32 (H,).
    ``lse_scratch``: no backward follows (see LSE_SCRATCH): a dense decoding call runs kvcache.fwd_dense_decode.
    """
    if (lse_scratch and cu_seqlens_q is None and config is None and q.shape[1] <= _DECODE_ROWS and k.shape[1]
            and not call.dropout and not call.return_probs):
        from . import kvcache
        out, lse = kvcache.fwd_dense_decode(q, k, v, call.softmax_scale, call.causal, call.window_left,
                                            call.window_right, call.softcap, alibi_slopes, sink, _INTERPRET,
                                            _arch(q.device))
        return out, lse, None
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, call.softmax_scale, call.causal,
            call.window_left, call.window_right, call.softcap, alibi_slopes, call.dropout_p, rng_state,
            True if call.return_probs else None, config, sink)
    if _num_seqs(q, cu_seqlens_q) * q.shape[-2] > _MAX_GRID_Y:
        return _fwd_chunked(*args)
    return _fwd(*args)


def _num_seqs(q, cu_seqlens_q):
    return q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1


def _batch_chunks(n, heads):
    """[lo, hi) ranges of the batch entries (or sequences) of each launch of a call whose n x heads (sequence, head)
    pairs exceed a grid's y extent (_MAX_GRID_Y)."""
    step = max(1, _MAX_GRID_Y // max(heads, 1))
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _chunk_rng(rng_state, c):
    """Chunk c's dropout seeds: the call's with c added to the first, so that the chunks' masks differ (the mask's
    hash keys on the (sequence, head) index within a launch) and the backward, chunked alike, finds each again."""
    if rng_state is None or c == 0:
        return rng_state
    return rng_state + torch.tensor([c, 0], dtype=rng_state.dtype, device=rng_state.device)


def _rows_in(cu, lo, hi, total):
    """Whether each of total packed rows belongs to sequences [lo, hi) of cu (device ops, no sync)."""
    rows = torch.arange(total, device=cu.device)
    return (rows >= cu[lo]) & (rows < cu[hi])


def _chunk_alibi(alibi_slopes, lo, hi):
    return alibi_slopes[lo:hi] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes


def _fwd_chunked(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                 window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, return_probs, config,
                 sink=None):
    """_fwd as launches on chunks of the batch (dense: batch slices, concatenated) or of the sequences (varlen:
    slices of cu_seqlens, whose absolute offsets the kernels read; each launch's rows taken from its out / lse),
    each within the grid's y limit."""
    opts = (softmax_scale, causal, window_left, window_right, softcap)
    parts = []
    for c, (lo, hi) in enumerate(_batch_chunks(_num_seqs(q, cu_seqlens_q), q.shape[-2])):
        tail = (_chunk_alibi(alibi_slopes, lo, hi), dropout_p, _chunk_rng(rng_state, c), return_probs, config, sink)
        if cu_seqlens_q is None:
            parts.append(_fwd(q[lo:hi], k[lo:hi], v[lo:hi], None, None, max_seqlen_q, max_seqlen_k, *opts, *tail))
        else:
            parts.append(_fwd(q, k, v, cu_seqlens_q[lo:hi + 1], cu_seqlens_k[lo:hi + 1], max_seqlen_q, max_seqlen_k,
                              *opts, *tail) + ((lo, hi),))
    probs = None if return_probs is None else parts[0][2]
    if return_probs:
        probs = torch.cat([p[2] for p in parts])
    if cu_seqlens_q is None:
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), probs
    out, lse = parts[0][0], parts[0][1]
    for o, l_, _, (lo, hi) in parts[1:]:
        rows = _rows_in(cu_seqlens_q, lo, hi, q.shape[0])
        out = torch.where(rows.view(-1, 1, 1), o, out)
        lse = torch.where(rows, l_, lse)
    return out, lse, probs


def _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
         window_right, softcap, alibi_slopes, dropout_p, rng_state, return_probs, config, sink=None):
    # fwd's body; return_probs None: the caller discards the probabilities (their result is None)
    if _fwd_mod is None:
        _kernels()
    varlen = cu_seqlens_q is not None
    if varlen:
        B, H, Hk, D, Dv, Sq, Sk, sq_, sk_, sv_ = _geometry(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
        out = q.new_empty((*q.shape[:-1], Dv))
        lse = torch.empty((H, q.shape[0]), device=q.device, dtype=torch.float32)
        so_ = (0, out.stride(0), out.stride(1))
        sl_ = (0, lse.stride(0))
    else:
        B, Sq, H, D = q.shape
        _, Sk, Hk, _ = k.shape
        Dv = v.shape[3]
        sq_, sk_, sv_ = q.stride()[:3], k.stride()[:3], v.stride()[:3]
        # sizes as separate ints: torch parses them faster than a tuple
        out = q.new_empty(B, Sq, H, Dv)
        lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
        so_ = (Sq * H * Dv, H * Dv, Dv)  # both contiguous (only read when no size is 0)
        sl_ = (H * Sq, Sq)
    if return_probs:
        probs = torch.zeros((B, H, Sq, Sk), device=q.device, dtype=torch.float32)
        sp_ = probs.stride()[:3]
    else:
        probs = None if return_probs is None else lse.new_empty(0)
        sp_ = (0, 0, 0)
    if Sq == 0 or B * H == 0 or out.numel() == 0:
        return out, lse, probs
    if softcap > 0.0 or dropout_p > 0.0 or alibi_slopes is not None:
        softcap_scale, softcap_log2, window, wl, wr, (seed0, seed1, thr, dscale) = _scalars(
            softmax_scale, softcap, window_left, window_right, causal, dropout_p, rng_state)
        sa_ = _alibi_strides(alibi_slopes)
    else:  # the common call, without the general helper's work
        softcap_scale = softcap_log2 = 0.0
        seed0 = seed1 = thr = 0
        dscale = 1.0
        sa_ = (0, 0)
        window = (window_left >= 0, window_right >= 0)
        wl = window_left if window_left >= 0 else _NO_WINDOW
        wr = window_right if window_right >= 0 else _NO_WINDOW
    if ((_FWD_VARIANT_ON if config is None else config.variant) and not varlen and not return_probs
            and softcap <= 0.0 and dropout_p <= 0.0 and alibi_slopes is None and sink is None):
        ws = _fwd_ws_plan(q, k, v, D, Dv, Sq, Sk, window, wl, wr, softmax_scale, config)
        if ws is not None:
            block_m, plan_key, meta = ws
            if not _INTERPRET:
                set_tma_allocator()
            n_m = -(-Sq // block_m)
            grid = (min(n_m * B * H, _num_sms(q.device)),) if meta["PERSISTENT"] else (n_m, B * H)
            # (row and head strides only: the descriptors cover all sequences, see _fwd_ws_plan)
            _L_FWD_WS(grid, (q, k, v, out, lse, *sq_[1:], *sk_[1:], *sv_[1:], *so_, *sl_, Sq, Sk, H, H // Hk,
                             B * H, softmax_scale * _LOG2E), meta, plan_key)
            return out, lse, probs
        if config is not None:  # an explicit variant config on an ineligible call: its default-loop twin
            import dataclasses

            config = dataclasses.replace(config, variant=0)
    block_m, plan_key, meta, tma = _fwd_plan(q, D, Dv, varlen, window, softcap > 0.0, alibi_slopes is not None,
                                             dropout_p > 0.0, bool(return_probs), config, True, sink is not None)
    if tma:
        if _tma_ok(k, v, D, Dv):
            if not _INTERPRET:
                set_tma_allocator()
        else:  # the same config on the pointer path
            block_m, plan_key, meta, tma = _fwd_plan(q, D, Dv, varlen, window, softcap > 0.0,
                                                     alibi_slopes is not None, dropout_p > 0.0,
                                                     bool(return_probs), config, False, sink is not None)
    dummy = lse
    _L_FWD((-(-Sq // block_m), B * H), (
        # (without probs, a tensor in their place all the same: a None would compile another kernel, and a None
        # among the pointers moves every launch of the plan onto the launcher's slower None-aware key; so for an
        # absent sink too)
        q, k, v, out, lse, dummy if probs is None else probs, dummy if alibi_slopes is None else alibi_slopes,
        cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy, dummy if sink is None else sink,
        *sq_, *sk_, *sv_, *so_, *sl_, *sa_, *sp_, Sq, Sk, H, H // Hk, softmax_scale * _LOG2E, softcap_scale,
        softcap_log2, wl, wr, seed0, seed1, thr, dscale), meta, plan_key)
    return out, lse, probs


def fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                block_table, alibi_slopes, rotary_interleaved, num_splits, sink=None):
    """FA2's flash_attn_with_kvcache (see the contract); no host sync, so CUDA graphs can capture it. sink: the
    learnable sink, fp32 (H,), or None."""
    from . import kvcache
    return kvcache.fwd_kvcache(
        q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table, softmax_scale=call.softmax_scale, causal=call.causal, window_left=call.window_left,
        window_right=call.window_right, softcap=call.softcap, rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes, num_splits=num_splits, interpret=_INTERPRET, arch=_arch(q.device), sink=sink)


_BWD_PLANS: dict = {}


_TMA_SUPPORTED: dict = {}


def _tma_supported(device, dtype, D, Dv):
    """Whether TMA descriptor loads can serve this kind of call (the per-call alignment is _tma_aligned's);
    cached per kind (the answer depends on the device and the installed Triton only)."""
    key = (device, dtype, D, Dv)
    ok = _TMA_SUPPORTED.get(key)
    if ok is None:
        ok = _TMA_SUPPORTED[key] = _tma_supported_uncached(device, dtype, D, Dv)
    return ok


def _tma_supported_uncached(device, dtype, D, Dv):
    if dtype == torch.float32 or D % 8 or Dv % 8:
        return False  # fp32 tiles keep the pointer path; 16-byte row strides need head dims of 8k
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False
    if not (hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")):
        return False
    if _INTERPRET:
        return True
    arch = _arch(device)
    return arch is not None and arch[0] >= 9


def _tma_aligned(*tensors):
    # The copy engine needs 16-byte aligned bases and 16-byte multiples for every stride but the last
    # (a plain loop: this runs on every call that may take a descriptor path).
    for t in tensors:
        st = t.stride()
        if t.data_ptr() & 15 or st[-1] != 1:
            return False
        m = 16 // t.element_size()
        for s in st[:-1]:
            if s % m:
                return False
    return True


def _bwd_plan(q, D, Dv, varlen, window, softcap, alibi, dropout, deterministic, config, no_tma=False):
    """(config, dq_atomic, plan key, preprocess / dK-dV / dQ kernel kwargs) for one kind of backward call,
    cached like _fwd_plan. The dK/dV entry is a list of (kwargs, launcher key): one launch, or two with
    config.split_dkdv (each with its own key: a launcher key must determine the kwargs).
    ``no_tma``: the plan for calls whose tensors the copy engine cannot address."""
    key = (q.device, q.dtype, D, Dv, varlen, window, softcap, alibi, dropout, bool(deterministic), config, no_tma)
    plan = _BWD_PLANS.get(key)
    if plan is None:
        if config is None:
            config = _configs.bwd_config(_arch(q.device), max(D, Dv), window[1], _INTERPRET, q.dtype)
        dq_atomic = config.dq_atomic and not deterministic
        use_tma = bool(config.tma) and not no_tma and _tma_supported(q.device, q.dtype, D, Dv)
        block_d, block_dv = _configs.padded_dim(D), _configs.padded_dim(Dv)
        flags = dict(IS_FP32=q.dtype == torch.float32, HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=block_d,
                     BLOCK_DV=block_dv, IS_VARLEN=varlen, WINDOW_LEFT=window[0], WINDOW_RIGHT=window[1],
                     HAS_SOFTCAP=softcap, HAS_ALIBI=alibi, HAS_DROPOUT=dropout)
        pre = dict(HEAD_DIM_V=Dv, BLOCK_DV=block_dv, BLOCK_M=64 if block_dv <= 128 else 32, IS_VARLEN=varlen,
                   num_warps=4)
        dkdv = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, DQ_ATOMIC=dq_atomic, **flags,
                    num_warps=config.num_warps, num_stages=config.num_stages, USE_TMA=use_tma)
        if config.split_dkdv:
            dkdv = [(dict(dkdv, DQ_ATOMIC=False, COMPUTE_DK=False), _PlanKey(key + ("dv",))),
                    (dict(dkdv, COMPUTE_DV=False), _PlanKey(key + ("dk",)))]
        else:
            dkdv = [(dkdv, None)]
        dq = dict(BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n, **flags,
                  num_warps=config.dq_num_warps, num_stages=config.dq_num_stages, USE_TMA=use_tma)
        plan = (config, dq_atomic, _PlanKey(key), pre, dkdv, dq)
        _BWD_PLANS[key] = plan
    return plan


_BWD_WS_PLANS: dict = {}
_BWD_WS_KINDS: dict = {}  # (device, dtype, D, Dv, causal, config) -> BwdWsConfig or None


def _bwd_ws_plan(q, k, v, dout, D, Dv, Sq, Sk, window, wr, config, deterministic=False):
    """(config, launches) of the warp-specialized backward (_bwd_ws.py) for a dense call with no softcap,
    ALiBi or dropout, or None when the call is outside what it serves (see _fwd_ws_plan: the same rules,
    with dO among the tensors the copy engine must address). ``config``: a _configs.BwdWsConfig forces it
    (tuning, the interpreter's tests); None: _configs.bwd_ws_config's choice for this GPU. ``launches``:
    (preprocess kwargs, [(dK/dV kwargs, key)], dQ kwargs, key); dQ kwargs None: the FA2-style dK launch adds
    dQ by atomics (config.dq_atomic, not ``deterministic``)."""
    causal = window == (False, True)
    if (window != (False, False) and not (causal and wr == 0)) or (causal and Sq > Sk) or Sk == 0 or Sq == 0:
        return None
    # What depends only on the kind of call first (cached; None on other GPUs), then the per-call checks.
    kind = (q.device, q.dtype, D, Dv, causal, config)
    cfg = _BWD_WS_KINDS.get(kind, _BWD_WS_KINDS)
    if cfg is _BWD_WS_KINDS:  # first call of this kind
        cfg = None
        if (q.dtype != torch.float32 and D == _configs.padded_dim(D) and Dv == _configs.padded_dim(Dv)
                and _tma_supported(q.device, q.dtype, D, Dv)):
            cfg = config if config is not None else _configs.bwd_ws_config(_arch(q.device), max(D, Dv), causal)
        _BWD_WS_KINDS[kind] = cfg
    if cfg is None:
        return None
    if not _tma_aligned(q, k, v, dout):
        return None
    if q.shape[0] > 1 and (q.stride(0) != Sq * q.stride(1) or dout.stride(0) != Sq * dout.stride(1)
                           or k.stride(0) != Sk * k.stride(1) or v.stride(0) != Sk * v.stride(1)):
        return None
    even_k = cfg.dq_block_n == 0 or Sk % cfg.dq_block_n == 0
    dq_atomic = bool(cfg.dq_atomic and cfg.split_dkdv and cfg.fa2_dk and not deterministic)
    key = (kind, even_k, dq_atomic)
    plan = _BWD_WS_PLANS.get(key)
    if plan is None:
        ws = dict(num_warps=4, num_stages=2)
        pre = dict(HEAD_DIM_V=Dv, BLOCK_M=64 if Dv <= 128 else 32, WRITE_LD=cfg.dq_block_m > 0, num_warps=4)
        dkdv = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, **ws)
        pk = (q.device, q.dtype, D, Dv, causal, cfg)
        if cfg.split_dkdv and cfg.fa2_dk:  # dV warp-specialized, dK by the FA2-style kernel (cfg.fa2 or the table)
            fa2_cfg, _, _, _, fa2_dkdv, _ = _bwd_plan(q, D, Dv, False, window, False, False, False, True, cfg.fa2)
            dk_meta = next((m for m, _ in fa2_dkdv if m.get("COMPUTE_DV", True) is False), None)
            dk_meta = dict(dk_meta or fa2_dkdv[0][0], COMPUTE_DV=False, DQ_ATOMIC=dq_atomic)
            dkdv = [(dict(dkdv, COMPUTE_DK=False), _PlanKey(pk + ("dv",)), None),
                    (dk_meta, _PlanKey(pk + ("dk", "fa2") + (("atomic",) if dq_atomic else ())), fa2_cfg)]
        elif cfg.split_dkdv:
            dkdv = [(dict(dkdv, COMPUTE_DK=False), _PlanKey(pk + ("dv",)), None),
                    (dict(dkdv, BLOCK_M=cfg.dk_block_m or cfg.block_m, BLOCK_N=cfg.dk_block_n or cfg.block_n,
                          COMPUTE_DV=False), _PlanKey(pk + ("dk",)), None)]
        else:
            dkdv = [(dkdv, _PlanKey(pk + ("dkdv",)), None)]
        if dq_atomic:
            dq = None
        elif cfg.dq_block_m == 0:  # the FA2-style dQ kernel: cfg.fa2 or its table entry, and plan (TMA for K/V)
            fa2_cfg, _, dq_key, _, _, fa2_dq = _bwd_plan(q, D, Dv, False, window, False, False, False, True, cfg.fa2)
            dq = (fa2_cfg, dq_key, fa2_dq)
        else:
            dq = dict(HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, CAUSAL=causal,
                      EVEN_K=even_k, **ws)
        plan = _BWD_WS_PLANS[key] = (cfg, (pre, dkdv, dq, _PlanKey(pk + (even_k,))))
    return plan


def _bwd_ws(ws, dout, q, k, v, out, lse, dq, dk, dv, B, H, Hk, Sq, Sk, softmax_scale):
    """The warp-specialized backward's launches (see _bwd_ws.py); dq may be None (allocated)."""
    cfg, (pre, dkdv_metas, dq_meta, key) = ws
    if not _INTERPRET:
        set_tma_allocator()
    sq_pad = -(-Sq // 128) * 128
    rows = torch.empty(3, B * H, sq_pad, device=q.device, dtype=torch.float32)
    lse2, delta, lse_n = rows.unbind(0)
    # the warp-specialized dQ kernel's row terms (the FA2-style one reads lse_n; then the kernel ignores LD)
    ld = torch.empty(B * H * sq_pad, 16, device=q.device, dtype=torch.bfloat16) if pre["WRITE_LD"] else rows
    qk_scale = softmax_scale * _LOG2E
    _L_PRE_WS((sq_pad // pre["BLOCK_M"], B * H),
              (out, dout, lse, delta, lse2, lse_n, ld, *out.stride()[:3], *dout.stride()[:3], lse.stride(0),
               lse.stride(1), sq_pad, Sq, H, qk_scale), pre, key)
    qs, ks, vs, dos = q.stride(), k.stride(), v.stride(), dout.stride()
    dq_acc = lse  # (unused unless the dK launch adds dQ by atomics)
    if dq_meta is None:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for meta, dkdv_key, fa2_cfg in dkdv_metas:
        if fa2_cfg is None:
            _L_DKDV_WS((-(-Sk // meta["BLOCK_N"]), B * Hk),
                       (q, k, v, dout, lse2, delta, dk, dv, qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], dos[1],
                        dos[2], *dk.stride()[:3], *dv.stride()[:3], sq_pad, Sq, Sk, H, H // Hk, B, softmax_scale,
                        qk_scale), meta, dkdv_key)
        else:  # the FA2-style kernel's dK (dV off; dQ only by its atomics, else its DQ arguments are unused) on the
            # padded rows
            _L_DKDV((-(-Sk // fa2_cfg.block_n), B * Hk),
                    (q, k, v, dout, lse_n, delta, dq_acc, dk, dv, lse, lse, lse, *qs[:3], *ks[:3], *vs[:3],
                     *dos[:3], *(dq_acc.stride()[:3] if dq_meta is None else (0, 0, 0)), *dk.stride()[:3],
                     *dv.stride()[:3], H * sq_pad, sq_pad, 0, 0, Sq, Sk, H, H // Hk,
                     softmax_scale, qk_scale, 0.0, 0.0, _NO_WINDOW, 0 if meta["WINDOW_RIGHT"] else _NO_WINDOW,
                     0, 0, 0, 1.0), meta, dkdv_key)
    if dq_meta is None:  # dQ summed by the dK launch's atomics
        return (dq.copy_(dq_acc) if dq is not None else dq_acc.to(q.dtype)), dk, dv
    if dq is None:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if cfg.dq_block_m == 0:  # the FA2-style dQ kernel (_bwd.py) (cfg.fa2 or the table's config) on the padded rows
        fcfg, dq_key, dq_meta = dq_meta
        dummy = lse
        _L_DQ((-(-Sq // fcfg.dq_block_m), B * H),
              (q, k, v, dout, lse_n, delta, dq, dummy, dummy, dummy, *qs[:3], *ks[:3], *vs[:3], *dos[:3],
               *dq.stride()[:3], H * sq_pad, sq_pad, 0, 0, Sq, Sk, H, H // Hk, softmax_scale, qk_scale, 0.0, 0.0,
               _NO_WINDOW, 0 if dq_meta["WINDOW_RIGHT"] else _NO_WINDOW, 0, 0, 0, 1.0), dq_meta, dq_key)
        return dq, dk, dv
    _L_DQ_WS((-(-Sq // cfg.dq_block_m), B * H),
             (q, k, v, dout, ld, dq, qs[1], qs[2], ks[1], ks[2], vs[1], vs[2], dos[1], dos[2],
              *dq.stride()[:3], sq_pad, Sq, Sk, H, H // Hk, B, softmax_scale, qk_scale), dq_meta, key)
    return dq, dk, dv


# bwd writes into caller-given gradient tensors (its ``grads`` argument; see bwd).
BWD_OUT = True


def bwd(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
        alibi_slopes, rng_state, config=None, grads=None, dlse=None):
    """Attention backward; see the contract. Returns (dq, dk, dv) shaped like q, k, v in their dtype.

    A deterministic call computes dQ in its own kernel (no atomics), so results are bitwise reproducible.
    ``config`` (a _configs.BwdConfig) overrides the table, for tuning. ``grads``: optional (dq, dk, dv)
    tensors shaped and typed like q, k, v with a contiguous last dim (e.g. views of one packed gradient)
    that receive the gradients; they are then what is returned.
    """
    return _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, call.softmax_scale,
                call.causal, call.window_left, call.window_right, call.softcap, alibi_slopes, call.dropout_p,
                rng_state, call.deterministic, config, grads, dlse)


def _bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
         window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic, config, grads, dlse):
    if _fwd_mod is None:
        _kernels()
    if _num_seqs(q, cu_seqlens_q) * q.shape[-2] > _MAX_GRID_Y:
        return _bwd_chunked(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p,
                            rng_state, deterministic, config, grads, dlse)
    varlen = cu_seqlens_q is not None
    B, H, Hk, D, Dv, Sq, Sk, sq_, sk_, sv_ = _geometry(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    if grads is not None:
        dq_out, dk, dv = grads
    else:
        dq_out = None
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if B * Hk == 0 or dk.numel() == 0 and dv.numel() == 0:
        if dq_out is not None:
            return dq_out.zero_(), dk, dv
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device), dk, dv
    softcap_scale, softcap_log2, window, wl, wr, (seed0, seed1, thr, dscale) = _scalars(
        softmax_scale, softcap, window_left, window_right, causal, dropout_p, rng_state)
    if _BWD_WS_ON if config is None else isinstance(config, _configs.BwdWsConfig):
        # (its preprocessing packs lse and delta for the dQ kernel: no place for the lse's own gradient)
        if (not varlen and softcap <= 0.0 and dropout_p <= 0.0 and alibi_slopes is None and lse.dim() == 3
                and dlse is None):
            ws = _bwd_ws_plan(q, k, v, dout, D, Dv, Sq, Sk, window, wr, config, deterministic)
            if ws is not None:
                return _bwd_ws(ws, dout, q, k, v, out, lse, dq_out, dk, dv, B, H, Hk, Sq, Sk, softmax_scale)
        config = None  # (an explicit ws config on an ineligible call: the table's kernels)
    plan_args = (q, D, Dv, varlen, window, softcap > 0.0, alibi_slopes is not None, dropout_p > 0.0,
                 deterministic, config)
    config, dq_atomic, plan_key, pre_meta, dkdv_metas, dq_meta = _bwd_plan(*plan_args)
    if dq_meta["USE_TMA"]:
        if _tma_aligned(q, k, v, dout):
            if not _INTERPRET:
                set_tma_allocator()
        else:
            config, dq_atomic, plan_key, pre_meta, dkdv_metas, dq_meta = _bwd_plan(*plan_args, no_tma=True)
    if dq_atomic:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    elif dq_out is not None:
        dq_acc = dq_out
    else:
        dq_acc = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    sdo_ = _row_strides(dout, varlen)
    sdq_ = _row_strides(dq_acc, varlen)
    sdk_ = _row_strides(dk, varlen)
    sdv_ = _row_strides(dv, varlen)
    sl_ = _lse_strides(lse, varlen)
    sa_ = _alibi_strides(alibi_slopes)
    dummy = lse
    alibi = alibi_slopes if alibi_slopes is not None else dummy
    cu_q = cu_seqlens_q if varlen else dummy
    cu_k = cu_seqlens_k if varlen else dummy
    scalars = (Sq, Sk, H, H // Hk, softmax_scale, softmax_scale * _LOG2E, softcap_scale, softcap_log2, wl, wr,
               seed0, seed1, thr, dscale)

    delta = torch.empty_like(lse)
    if Sq > 0:
        _L_PRE((-(-Sq // pre_meta["BLOCK_M"]), B * H),
               (out, dout, delta, cu_q, *_row_strides(out, varlen), *sdo_, *sl_, Sq, H), pre_meta, plan_key)
        if dlse is not None:
            # d lse_i / d s_ij = P_ij: the lse's gradient adds dlse_i * P_ij to dS_ij, which is dS = P * (dP -
            # delta) with delta - dlse in delta's place.
            delta.sub_(dlse)
    if Sk > 0:
        for dkdv_meta, dkdv_key in dkdv_metas:
            _L_DKDV((-(-Sk // config.block_n), B * Hk),
                    (q, k, v, dout, lse, delta, dq_acc, dk, dv, alibi, cu_q, cu_k,
                     *sq_, *sk_, *sv_, *sdo_, *sdq_, *sdk_, *sdv_, *sl_, *sa_, *scalars), dkdv_meta,
                    dkdv_key or plan_key)
    if dq_atomic:
        if dq_out is not None:
            dq = dq_out.copy_(dq_acc)
        else:
            dq = dq_acc if q.dtype == torch.float32 else dq_acc.to(q.dtype)
    else:
        dq = dq_acc
        if Sq > 0:
            _L_DQ((-(-Sq // config.dq_block_m), B * H),
                  (q, k, v, dout, lse, delta, dq, alibi, cu_q, cu_k,
                   *sq_, *sk_, *sv_, *sdo_, *sdq_, *sl_, *sa_, *scalars), dq_meta, plan_key)
    return dq, dk, dv


def _bwd_chunked(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                 causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, deterministic, config,
                 grads, dlse=None):
    """bwd as launches on the forward's chunks (_fwd_chunked: the same chunks and dropout seeds): dense, batch
    slices (into grads' slices when given); varlen, slices of cu_seqlens, each chunk's dq / dk / dv rows taken from
    its launch."""
    opts = (softmax_scale, causal, window_left, window_right, softcap)
    chunks = _batch_chunks(_num_seqs(q, cu_seqlens_q), q.shape[-2])
    if cu_seqlens_q is None:
        if grads is None:
            grads = (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                     device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device))
        for c, (lo, hi) in enumerate(chunks):
            sl = slice(lo, hi)
            _bwd(dout[sl], q[sl], k[sl], v[sl], out[sl], lse[sl], None, None, max_seqlen_q, max_seqlen_k, *opts,
                 _chunk_alibi(alibi_slopes, lo, hi), dropout_p, _chunk_rng(rng_state, c), deterministic, config,
                 tuple(g[sl] for g in grads), None if dlse is None else dlse[sl])
        return grads
    dq = dk = dv = None
    for c, (lo, hi) in enumerate(chunks):
        g = _bwd(dout, q, k, v, out, lse, cu_seqlens_q[lo:hi + 1], cu_seqlens_k[lo:hi + 1], max_seqlen_q,
                 max_seqlen_k, *opts, _chunk_alibi(alibi_slopes, lo, hi), dropout_p, _chunk_rng(rng_state, c),
                 deterministic, config, None, dlse)
        if dq is None:
            dq, dk, dv = g
            continue
        rows_q = _rows_in(cu_seqlens_q, lo, hi, q.shape[0]).view(-1, 1, 1)
        rows_k = _rows_in(cu_seqlens_k, lo, hi, k.shape[0]).view(-1, 1, 1)
        dq, dk, dv = torch.where(rows_q, g[0], dq), torch.where(rows_k, g[1], dk), torch.where(rows_k, g[2], dv)
    if grads is not None:
        for t, g in zip(grads, (dq, dk, dv)):
            t.copy_(g)
        return grads
    return dq, dk, dv
