"""The root dispatcher's view of flash_attn.cute (the contract is in flash_attn/backends/__init__.py).

Serves forward calls on Hopper (sm_90): fp16/bf16, head dim 64 or 128 (v's equal to q's), causal or
not, sliding windows, softcap, GQA/MQA, dense or varlen (cu_seqlens).

Backward (flash_bwd_sm90.py): dense calls without windows, softcap, ALiBi, dropout or determinism (its dQ
is a sum of fp32 TMA reduce-adds from the key blocks' CTAs in whatever order they finish, so it varies in
the last bits run to run, as FA2's default backward does); deterministic=True and everything else goes to
the next backend that has a backward (Triton, else the reference), which consumes this forward's out and
lse. FLASH_ATTN_CUTE_BWD=0 sends every backward call there (read when the dispatcher first sees a kind of
call: its choices are cached). On the H200 it is 1.21-1.39x the Triton backward
(benchmarks/results/h200/attention_cute_bwd.md).
"""
import os

import torch

NAME = "cute"
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128)
_ARCHS = {(9, 0): "sm_90a"}
_unavailable = []
BWD_OUT = True  # bwd() takes grads=(dq, dk, dv)
BWD_ENV_VAR = "FLASH_ATTN_CUTE_BWD"


def unavailable_reason():
    if not _unavailable:
        try:
            import cutlass.cute  # noqa: F401
        except Exception as e:  # ImportError, or a broken CUDA toolkit under it
            _unavailable.append(f"nvidia-cutlass-dsl does not import ({type(e).__name__}: {e})")
        else:
            _unavailable.append(None if torch.cuda.is_available() else "no CUDA device")
    return _unavailable[0]


def unsupported_reason(call):
    if call.device_type != "cuda":
        return f"device {call.device_type}"
    if call.arch not in _ARCHS:
        return f"compute capability {call.arch}: only Hopper (sm_90) kernels exist"
    if call.dtype not in _DTYPES:
        return f"dtype {call.dtype} (fp16/bf16 only)"
    if call.head_dim not in _HEAD_DIMS or call.head_dim_v != call.head_dim:
        return f"head dims {call.head_dim}/{call.head_dim_v} not in {_HEAD_DIMS} (equal for q/k and v)"
    for what in ("paged", "alibi", "dropout", "return_probs", "kvcache"):
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

    # unsupported_reason admitted only sm_90
    if cu_seqlens_q is not None:
        out, lse = interface.forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, None, max_seqlen_q, softmax_scale,
                                            causal, "sm_90a", window_left, window_right, softcap,
                                            fill_unused_rows=True)
    else:
        out, lse = interface.forward(q, k, v, softmax_scale, causal, "sm_90a", window_left, window_right, softcap)
    return out, lse, q.new_empty(0)


def bwd(dout, q, k, v, out, lse, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
        softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
        deterministic, grads=None):
    from flash_attn.cute import interface

    # unsupported_reason admitted only dense, unwindowed, uncapped, non-deterministic calls on sm_90; a
    # direct caller gets an error rather than a wrong gradient
    if (cu_seqlens_q is not None or block_table is not None or softcap > 0.0 or alibi_slopes is not None
            or dropout_p > 0.0 or deterministic or window_left >= 0 or (window_right >= 0 and not causal)):
        raise NotImplementedError("flash_attn.cute's backward handles dense calls without windows, softcap, "
                                  "ALiBi, dropout or determinism")
    return interface.backward(dout, q, k, v, out, lse, softmax_scale, causal, "sm_90a", grads=grads)
