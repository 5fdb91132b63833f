"""The root dispatcher's view of flash_attn.cute (the contract is in flash_attn/backends/__init__.py).

Serves forward calls on Hopper (sm_90): fp16/bf16, head dim 64 or 128 (v's equal to q's; forward only: 192 with
v's 128 unless FLASH_ATTN_CUTE_HDIM_V=0, interface._HEAD_DIM_PAIRS), causal or not, sliding windows, softcap,
GQA/MQA, dense or varlen (cu_seqlens). Head dims 96, 192 and 256 have forward kernels only (GPU-tested on the
H200 in session 11: tests/test_cute_compile.py -k wide_head_dims, tests/test_cute_sink.py): the dispatcher sends
their forward here and their backward to the next backend.
FLASH_ATTN_CUTE_FWD_HDIMS (read when the dispatcher first sees a kind of call) names the ones of them it
sends here ("256", "96,192,256"; "0" or "none": none of them); unset: all three. H200, bf16, 16k tokens,
same run (benchmarks/results/h200/attention_cute_session11.md): d256 forward 395-733 TFLOP/s against the
Triton backend's 383-601.

Backward (flash_bwd_sm90.py): dense calls without windows, softcap, ALiBi, dropout or determinism (its dQ
is a sum of fp32 TMA reduce-adds from the key blocks' CTAs in whatever order they finish, so it varies in
the last bits run to run, as FA2's default backward does); deterministic=True and everything else goes to
the next backend that has a backward (Triton, else the reference), which consumes this forward's out and
lse. FLASH_ATTN_CUTE_BWD=0 sends every backward call there (read when the dispatcher first sees a kind of
call: its choices are cached). On the H200 it is 1.21-1.39x the Triton backward
(benchmarks/results/h200/attention_cute_bwd.md).

Paged varlen forward calls (flash_attn_varlen_func's block_table; cu_seqlens_k then counts each sequence's keys)
run the paged kernel (interface.forward_varlen with the page table, each sequence's key count as seqused_k) unless
FLASH_ATTN_CUTE_PAGED=0 (read when the dispatcher first sees a kind of call); a page size the kernel cannot box
(see interface._paged_block_n) runs on the reference backend, the one that serves paged calls without it.
"""
import os

import torch

NAME = "cute"
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128)  # forward and backward
_GATED_FWD_HEAD_DIMS = (96, 192, 256)  # forward only; FLASH_ATTN_CUTE_FWD_HDIMS, when set, picks among them
FWD_HDIMS_ENV_VAR = "FLASH_ATTN_CUTE_FWD_HDIMS"
_ARCHS = {(9, 0): "sm_90a"}
_unavailable = []
BWD_OUT = True  # bwd() takes grads=(dq, dk, dv)
BWD_ENV_VAR = "FLASH_ATTN_CUTE_BWD"


def unavailable_reason():
    if not _unavailable and getattr(torch.version, "hip", None) is not None:
        # AMD GPUs answer the same capability query, and an MI200 (gfx90a) says (9, 0), Hopper's
        _unavailable.append("a ROCm build of torch: the CuTeDSL kernels run on NVIDIA GPUs only")
    if not _unavailable:
        try:
            import cutlass.cute  # noqa: F401
        except Exception as e:  # ImportError, or a broken CUDA toolkit under it
            _unavailable.append(f"nvidia-cutlass-dsl does not import ({type(e).__name__}: {e})")
        else:
            _unavailable.append(None if torch.cuda.is_available() else "no CUDA device")
    return _unavailable[0]


def forward_head_dims():
    """The head dims whose forward the dispatcher may send here: 64, 128 and 96 / 192 / 256, or when
    $FLASH_ATTN_CUTE_FWD_HDIMS is set, those of 96 / 192 / 256 it names (comma-separated; "0" / "none": none)."""
    value = os.environ.get(FWD_HDIMS_ENV_VAR)
    if value is None or not value.strip():
        return tuple(sorted(_HEAD_DIMS + _GATED_FWD_HEAD_DIMS))
    if value.strip().lower() == "none":
        return _HEAD_DIMS
    try:
        named = {int(x) for x in value.replace(" ", "").split(",") if x}
    except ValueError:
        raise ValueError(f"{FWD_HDIMS_ENV_VAR}={value!r}: expected comma-separated head dims, e.g. 96,192,256")
    return tuple(sorted(set(_HEAD_DIMS) | (named & set(_GATED_FWD_HEAD_DIMS))))


def unsupported_reason(call):
    if call.device_type != "cuda":
        return f"device {call.device_type}"
    if call.arch not in _ARCHS:
        return f"compute capability {call.arch}: only Hopper (sm_90) kernels exist"
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} (fp16/bf16 only)"
    head_dims = _HEAD_DIMS if call.backward else forward_head_dims()
    pair = False  # v's head dim != q's: a pair of interface._HEAD_DIM_PAIRS, forward only (backward: the next one)
    if call.head_dim_v != call.head_dim and not call.backward and call.head_dim in head_dims:
        from flash_attn.cute.interface import _HEAD_DIM_PAIRS, _hdim_v_on

        pair = (call.head_dim, call.head_dim_v) in _HEAD_DIM_PAIRS
        if pair and not _hdim_v_on():
            return f"head dims {call.head_dim}/{call.head_dim_v}: FLASH_ATTN_CUTE_HDIM_V=0 turned them off"
    if not pair and (call.head_dim not in head_dims or call.head_dim_v != call.head_dim):
        why = f"head dims {call.head_dim}/{call.head_dim_v} not in {head_dims} (equal for q/k and v)"
        if not call.backward and call.head_dim in _GATED_FWD_HEAD_DIMS and call.head_dim_v == call.head_dim:
            why += f"; {FWD_HDIMS_ENV_VAR} (set, without {call.head_dim}) turned its forward off"
        return why
    if call.paged:
        from flash_attn.cute.interface import _paged_on

        if call.backward:
            return "backward with paged KV"
        if not _paged_on():
            return "paged KV: FLASH_ATTN_CUTE_PAGED=0 turned the paged kernel off"
    for what in ("alibi", "dropout", "return_probs", "kvcache"):
        if getattr(call, what):
            return what
    if call.backward:
        if os.environ.get(BWD_ENV_VAR, "1").strip() == "0":
            return f"backward (switched off by {BWD_ENV_VAR}=0)"
        for what in ("varlen", "local", "softcap", "deterministic"):
            if getattr(call, what):
                return f"backward with {what}"
    return None


def fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, softmax_scale,
        causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state, return_probs):
    from flash_attn.cute import interface

    # the contract's -1 (no limit) is the kernels' UNBOUNDED; reference.fwd below takes the contract's encoding
    wl = interface._UNBOUNDED if window_left < 0 else window_left
    wr = interface._UNBOUNDED if window_right < 0 else window_right
    # unsupported_reason admitted only sm_90
    if block_table is not None:
        if not _boxes_pages(q, v, k.shape[1], causal, wl, wr, softcap):
            # pages that fill no TMA box: gathered into contiguous keys for the unpaged kernel (as the FA4 API does)
            kc, vc, cu_k, _ = interface._gather_pages(k, v, block_table)
            out, lse = interface.forward_varlen(q, kc, vc, cu_seqlens_q, cu_k, cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                                                max_seqlen_q, softmax_scale, causal, "sm_90a", wl, wr, softcap,
                                                fill_unused_rows=True)
            return out, lse, q.new_empty(0)
        # (block_table's entries were checked to be pages: flash_attn._ops._check_values)
        out, lse = interface.forward_varlen(q, k, v, cu_seqlens_q, None, cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                                            max_seqlen_q, softmax_scale, causal, "sm_90a", wl, wr, softcap,
                                            fill_unused_rows=True, page_table=block_table)
    elif cu_seqlens_q is not None:
        out, lse = interface.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, softmax_scale,
                                            causal, "sm_90a", wl, wr, softcap, fill_unused_rows=True)
    else:
        out, lse = interface.forward(q, k, v, softmax_scale, causal, "sm_90a", wl, wr, softcap)
    return out, lse, q.new_empty(0)


_BOXED = {}  # (dtype, D, Dv, causal, local, softcap, page size) -> whether the paged kernel takes those pages


def _boxes_pages(q, v, page_size, causal, window_left, window_right, softcap):
    """Whether the paged kernel of this call has a key block that pages of page_size rows fill in whole TMA boxes
    (its config exists: interface._paged_block_n of the config's block_n)."""
    from flash_attn.cute import interface

    _, _, local = interface._window_args(causal, window_left, window_right)
    key = (q.dtype, q.shape[-1], v.shape[-1], bool(causal) and not local, local, softcap > 0.0, page_size)
    ok = _BOXED.get(key)
    if ok is None:
        try:
            interface._fwd_config(q.dtype, key[1], key[3], "sm_90a", local=local, softcap=key[5], varlen=True,
                                  dv=key[2], paged=page_size)
            ok = True
        except NotImplementedError:
            ok = False
        _BOXED[key] = ok
    return ok


def bwd(dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
        deterministic, grads=None, dlse=None):
    from flash_attn.cute import interface

    # unsupported_reason admitted only dense, unwindowed, uncapped, non-deterministic calls on sm_90; a
    # direct caller gets an error rather than a wrong gradient
    if (cu_seqlens_q is not None or block_table is not None or softcap > 0.0 or alibi_slopes is not None
            or dropout_p > 0.0 or deterministic or window_left >= 0 or (window_right >= 0 and not causal)):
        raise NotImplementedError("flash_attn.cute's backward handles dense calls without windows, softcap, "
                                  "ALiBi, dropout or determinism")
    return interface.backward(dout, q, k, v, out, lse, softmax_scale, causal, "sm_90a", grads=grads, dlse=dlse)
