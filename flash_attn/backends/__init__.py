"""The contract every attention backend implements (reference, Triton, CuTeDSL).

A backend is a module (imported lazily by :mod:`flash_attn.dispatch`) that defines:

``NAME``: str, ``"torch"``, ``"triton"`` or ``"cute"``.

``unavailable_reason() -> str | None``
    None when the backend can run at all in this process (its package imports, a device it needs exists),
    else a one-line reason ("triton is not installed", "no CUDA device", ...). Cheap; may be cached.

``unsupported_reason(call: flash_attn.call.AttnCall) -> str | None``
    None when the backend serves this call, else a one-line reason naming what it lacks
    ("head dim 72 not in (64, 128)", "dropout", "device cpu"). Called once per distinct description (cached).

Every entry point below takes the call's description first: ``call``, a :class:`flash_attn.call.AttnCall` built once
at the API (dtype, head dims, the mask in the core's one encoding, softcap, scale, dropout_p, varlen / paged /
return_probs / deterministic facts; see flash_attn/call.py). A backend reads the mask from it (``window_left``,
``window_right``, ``causal``, ``local``, ``bounded``) and never re-derives it; the tensors and the per-call sizes
travel beside it. All arguments arrive validated (flash_attn._checks): dtypes match, H % Hk == 0, last dims
contiguous.

``fwd(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state[,
      sink=...]) -> (out, lse, s_dmask or None)``
    Dense: q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv), cu_seqlens_* None.
    Varlen: q (total_q, H, D), k/v (total_k, Hk, D), cu_seqlens_q/k int32 (B+1,), max_seqlen_* ints.
    Paged (varlen only): block_table int32 (B, max_blocks), k/v (num_blocks, block_size, Hk, D);
    then cu_seqlens_k still gives each sequence's key count (its offsets into k are not used).
    Masking is bottom-right aligned: query i of a sequence sees key j iff
    j - (i + Sk - Sq) in [-window_left, window_right] (unbounded side for -1).
    softcap > 0: score = softcap * tanh(score / softcap), applied to scale * q.k before ALiBi and mask.
    alibi_slopes: fp32 (H,) or (B, H); adds -slope * |i + Sk - Sq - j| to the (capped) score.
    dropout_p > 0: element (b, h, i, j) is kept iff flash_attn.dropout.keep_mask(...) says so (the
    counter-based hash shared by every backend, keyed by rng_state, an int64 CPU tensor (2,));
    kept elements are scaled by 1 / (1 - p).
    Returns out like q with last dim Dv (input dtype); lse fp32 (B, H, Sq) dense or (H, total_q) varlen,
    natural log, +inf for a row with no visible key (whose out is 0); s_dmask, when call.return_probs, the
    softmax probabilities fp32 (B, H, max_seqlen_q, max_seqlen_k) (dense: Sq, Sk), zero outside a
    sequence, negated where dropout dropped the element; else None.
    ``sink`` (passed only when ``call.sink``): FA4's learnable sink, fp32 contiguous (H,), natural-log logits not
    scaled by softmax_scale; each joins its head's softmax rows as an extra term exp(sink) with no value: out_i =
    sum_j exp(s_ij - lse_i) v_j with lse_i = log(sum_j exp(s_ij) + exp(sink)), and probabilities (s_dmask) from
    that lse. A row that sees no key gets out 0 and lse = sink (+inf for a -inf sink, which equals no sink).
    Optional: a backend whose module sets ``LSE_SCRATCH = True`` also takes ``lse_scratch=True``, passed only for a
    call whose lse the caller drops (no gradient, no lse returned): the returned lse may then be a buffer shared
    with other such calls, its values undefined once the call returns (it saves an allocation per call), and the
    backend may divide the work in ways only a forward allows (split-KV for decoding).

``bwd(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes,
      rng_state[, dlse=...]) -> (dq, dk, dv)``
    ``call`` is the forward's description with ``backward`` set (flash_attn.call.for_backward). Gradients in the
    input dtype, shaped like q, k, v. dk/dv are summed over the query heads of a group (GQA/MQA). A deterministic
    call must give bitwise-identical results run to run. ``dlse`` (passed only when a loss uses the returned lse):
    the gradient flowing into lse, lse's shape; as d lse_i / d s_ij = P_ij it adds dlse_i * P_ij to dS_ij, i.e.
    the backward uses delta_i - dlse_i where it uses delta_i = rowsum(dO_i * O_i). A call with ``call.sink`` brings
    no sink: its lse includes the sink, so P = exp(s - lse) and delta are the sink-aware ones as they stand (the
    sink's own gradient is the core's, flash_attn._ops.sink_grad); ``call.sink`` only lets a backend refuse.
    Optional: a backend whose module sets ``BWD_OUT = True`` also takes ``grads=(dq, dk, dv)``, tensors
    shaped and typed like q, k, v with a contiguous last dim (e.g. the slices of one packed gradient),
    writes the gradients there and returns them.

``fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
      block_table, alibi_slopes, rotary_interleaved, num_splits[, sink=...]) -> (out, lse)``   (optional; no backward)
    Semantics of FA2's flash_attn_with_kvcache (``call.kvcache`` set); cache_seqlens arrives as an int32 tensor (B,).
    ``sink``: as fwd's.

Optional services for the core's fused ops, reached through the registry like the rest (never by importing a backend's
modules): ``launcher(kernel)`` (Triton) returns a low-overhead launcher for any @triton.jit kernel (see
:func:`triton_launcher`); ``norm_backward()`` (cute) returns the CuTeDSL LayerNorm / RMSNorm backward module that
``flash_attn.ops.triton.layer_norm`` uses for wide rows.
"""


# The core's services to a backend's own API (flash_attn.cute's FA4 functions): a backend depends on these, never on
# the front door's private modules. Imported lazily: the contract above stays a plain module.

_CORE = []


def _core():
    """(flash_attn._ops, dispatch.use_backend), imported on the first call and kept (a function-level import costs
    about a microsecond per call, and these run once per attention call that records gradients)."""
    if not _CORE:
        from flash_attn import _ops
        from flash_attn.dispatch import use_backend

        _CORE.append((_ops, use_backend))
    return _CORE[0]


def core_attention(backend, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                   window_left, window_right, softcap, deterministic):
    """(out, lse) of the core's differentiable attention (flash_attn::fwd; the window in the core's encoding, -1
    unbounded) with its forward forced onto ``backend`` and its backward on the dispatcher's choice; lse is exposed,
    so a loss's gradient through it flows back."""
    _ops, use_backend = _core()
    call = _ops._flat_call(q, v, cu_seqlens_q, None, softmax_scale, causal, window_left, window_right, softcap, None,
                           0.0, False, deterministic)
    with use_backend(backend):
        out, lse, _ = _ops.attention(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None,
                                     None, None, True)
    return out, lse


def core_backward(backend, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left, window_right, softcap, deterministic, dlse=None):
    """(dq, dk, dv) of the dispatcher's backward for a forward that ``backend`` ran (flash_attn::bwd's choice)."""
    _ops, use_backend = _core()
    call = _ops._flat_call(q, v, cu_seqlens_q, None, softmax_scale, causal, window_left, window_right, softcap, None,
                           0.0, False, deterministic)
    with use_backend(backend):
        return _ops._backward(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              None, None, None, dlse)


class TritonLaunch:
    """``kernel[grid](*args, **meta)`` behind a launcher's call signature ``(grid, args, meta, plan_key)``: Triton's own
    launch, for when the Triton backend is not installed or cannot run here."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, grid, args, meta, plan_key):
        self.kernel[grid](*args, **meta)


def triton_launcher(kernel):
    """A launcher for a @triton.jit kernel outside the Triton backend (the fused ops, the cute backward's host steps):
    the Triton backend's low-overhead one (its optional contract entry ``launcher``) when the registry has that backend
    available, else :class:`TritonLaunch`. Runtime arguments go positionally, pointers (tensors or None) first; a plan
    key must determine every constexpr and launch option, and each position must keep its kind (tensor or None / int
    / float)."""
    from flash_attn import dispatch

    make = getattr(dispatch.load("triton"), "launcher", None)
    return make(kernel) if make is not None else TritonLaunch(kernel)
