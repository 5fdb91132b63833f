"""The root dispatcher's view of flash_attn.cute (the contract is in flash_attn/backends/__init__.py).

Serves forward calls on Hopper (sm_90): fp16/bf16, head dim 64 or 128 (v's equal to q's), causal or
not, sliding windows, softcap, GQA/MQA, dense or varlen (cu_seqlens). It has no backward kernel yet:
the dispatcher sends the backward of a call this backend served forward to the next backend that has
one (Triton, else the reference), which consumes this forward's out and lse. (No ``bwd``:
``unsupported_reason`` refuses every backward call.)
"""
import torch

NAME = "cute"
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128)
_ARCHS = {(9, 0): "sm_90a"}
_unavailable = []


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
    for what in ("backward", "paged", "alibi", "dropout", "return_probs", "kvcache"):
        if getattr(call, what):
            return what
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

