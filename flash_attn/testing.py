"""Test oracle shared by every backend's tests: a naive, fully materialised attention and the project's
accuracy criterion (error relative to PyTorch's own error at the input dtype, as in FlashAttention's
test suite, Dao et al. 2022, section 4).

Conventions (the backend contract, :mod:`flash_attn.backends`): dense tensors are (B, S, H, D); padding
masks are bool (B, S), True = valid, with the valid tokens of a sequence contiguous (from position 0, or
from ``key_leftpad[b]`` for keys); masking is bottom-right aligned using each sequence's own lengths.
"""
import math

import torch

from flash_attn import dropout as _dropout

__all__ = [
    "attention_ref",
    "attention_lse_ref",
    "assert_close_to_ref",
    "rounding_error",
    "dropout_keep_mask",
    "random_seqlens",
    "random_cu_seqlens",
    "random_padding_mask",
    "padding_mask_from_seqlens",
    "unpad",
    "pad",
    "varlen_to_padded",
    "padded_to_varlen",
    "paged_from_dense",
    "backend_fwd",
    "backend_bwd",
    "backend_fwd_kvcache",
]


# ----------------------------------------------------------------------------------------------------
# The oracle


def _ref_compute_dtype(dtype, upcast):
    if not upcast:
        return dtype
    # fp32 inputs are checked against fp64 so the reference is strictly more precise than any backend.
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _visible_mask(B, Sq, Sk, device, query_padding_mask, key_padding_mask, causal, window_size,
                  key_leftpad):
    """(B, 1, Sq, Sk) bool visibility and the (B, 1, Sq, Sk) signed offset kpos - (i + sk - sq)."""
    row = torch.arange(Sq, device=device).view(1, Sq, 1)
    col = torch.arange(Sk, device=device).view(1, 1, Sk)
    kvalid = torch.ones(B, Sk, dtype=torch.bool, device=device)
    if key_padding_mask is not None:
        kvalid = kvalid & key_padding_mask.to(device=device, dtype=torch.bool)
    if key_leftpad is not None:
        lp = key_leftpad.to(device=device, dtype=torch.long).view(B, 1, 1)
        kvalid = kvalid & (col.view(1, Sk) >= lp.view(B, 1))
        kpos = col - lp
    else:
        kpos = col.expand(B, 1, Sk)
    qvalid = (torch.ones(B, Sq, dtype=torch.bool, device=device) if query_padding_mask is None
              else query_padding_mask.to(device=device, dtype=torch.bool))
    sk = kvalid.sum(-1).view(B, 1, 1)
    sq = qvalid.sum(-1).view(B, 1, 1)
    rel = kpos - (row + sk - sq)  # (B, Sq, Sk)
    wl, wr = window_size
    if causal:
        wr = 0
    vis = kvalid.view(B, 1, Sk) & qvalid.view(B, Sq, 1)
    if wl >= 0:
        vis = vis & (rel >= -wl)
    if wr >= 0:
        vis = vis & (rel <= wr)
    return vis.unsqueeze(1), rel.unsqueeze(1)


def _ref_scores(q, k, query_padding_mask, key_padding_mask, attn_bias, causal, window_size, softcap,
                alibi_slopes, softmax_scale, upcast, reorder_ops, key_leftpad):
    """Masked scores (B, H, Sq, Sk) in the compute dtype (-inf where invisible) and the visibility."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    if H % Hk != 0:
        raise ValueError(f"attention_ref: q heads ({H}) must be a multiple of k heads ({Hk})")
    cdt = _ref_compute_dtype(q.dtype, upcast)
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    qc = q.to(cdt)
    kc = k.to(cdt).repeat_interleave(H // Hk, dim=2)
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", qc * scale, kc)
    else:
        scores = torch.einsum("bthd,bshd->bhts", qc, kc) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    vis, rel = _visible_mask(B, Sq, Sk, q.device, query_padding_mask, key_padding_mask, causal,
                             window_size, key_leftpad)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=cdt)
        slopes = slopes.view(1, H, 1, 1) if slopes.dim() == 1 else slopes.view(B, H, 1, 1)
        scores = scores - slopes * rel.abs().to(cdt)
    if attn_bias is not None:
        scores = scores + attn_bias.to(cdt)
    scores = scores.masked_fill(~vis, float("-inf"))
    return scores, vis


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, attn_bias=None, dropout_p=0.0,
                  dropout_mask=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  softmax_scale=None, upcast=True, reorder_ops=False, key_leftpad=None, learnable_sink=None):
    """Naive attention: q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv) -> (out, attn_probs).

    out (B, Sq, H, Dv) and attn_probs (B, H, Sq, Sk) (before dropout) in the input dtype; rows with no
    visible key and padded query rows are 0. dropout_mask: bool keep mask (B, H, Sq, Sk) (see
    :func:`dropout_keep_mask`), kept elements scaled by 1 / (1 - dropout_p). attn_bias: additive, any
    shape broadcastable to (B, H, Sq, Sk). upcast=True computes in fp32 (fp64 for fp32 inputs);
    reorder_ops=True scales the scores instead of q, to measure PyTorch's own low-precision error.
    learnable_sink: (H,) logits (not scaled by softmax_scale), one per query head, appended to every
    row as an extra score with no value: the row's probabilities sum to 1 - exp(sink - lse), and a
    row with no visible key gets out 0. Differentiable (use it for reference gradients; the sink too).
    """
    dtype = q.dtype
    scores, vis = _ref_scores(q, k, query_padding_mask, key_padding_mask, attn_bias, causal, window_size,
                              softcap, alibi_slopes, softmax_scale, upcast, reorder_ops, key_leftpad)
    H, Hk = q.shape[2], k.shape[2]
    vc = v.to(scores.dtype).repeat_interleave(H // Hk, dim=2)
    if learnable_sink is not None:
        attn = torch.softmax(_with_sink_column(scores, learnable_sink), dim=-1)[..., :-1]
    else:
        attn = torch.softmax(scores, dim=-1)
    # A row with no visible key is all -inf: softmax gives NaN there, the contract says 0.
    attn = attn.masked_fill(~vis.any(-1, keepdim=True), 0.0)
    if dropout_mask is not None and dropout_p > 0:
        attn_drop = attn.masked_fill(~dropout_mask.to(attn.device), 0.0) * (1.0 / (1.0 - dropout_p))
    elif dropout_p > 0:
        raise ValueError("attention_ref: dropout_p > 0 needs dropout_mask (see dropout_keep_mask)")
    else:
        attn_drop = attn
    out = torch.einsum("bhts,bshd->bthd", attn_drop, vc)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask.to(out.device).view(*query_padding_mask.shape, 1, 1), 0.0)
    return out.to(dtype), attn.to(dtype)


def assert_lse_close(lse, lse_ref, atol=1e-2, name="lse"):
    """A kernel's lse against attention_lse_ref's: +inf exactly where the reference's is (rows that see no key and
    no sink), within atol elsewhere (fp32 logsumexp of bf16 / fp16 scores)."""
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: rows with no visible key differ"
    if finite.any():
        err = (lse[finite] - lse_ref[finite]).abs().max().item()
        assert err < atol, f"{name}: max error {err} >= {atol}"


def attention_lse_ref(q, k, query_padding_mask=None, key_padding_mask=None, attn_bias=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, alibi_slopes=None, softmax_scale=None,
                      key_leftpad=None, learnable_sink=None):
    """Natural-log logsumexp of the scores, fp32 (B, H, Sq); +inf for rows with no visible key. With
    learnable_sink (see attention_ref) the sum includes exp(sink): a row with no visible key gets
    lse = sink (padded query rows stay +inf)."""
    scores, vis = _ref_scores(q, k, query_padding_mask, key_padding_mask, attn_bias, causal, window_size,
                              softcap, alibi_slopes, softmax_scale, True, False, key_leftpad)
    if learnable_sink is not None:
        lse = torch.logsumexp(_with_sink_column(scores, learnable_sink), dim=-1)
        if query_padding_mask is not None:
            B, Sq = query_padding_mask.shape
            qvalid = query_padding_mask.to(device=lse.device, dtype=torch.bool).view(B, 1, Sq)
            lse = lse.masked_fill(~qvalid, float("inf"))
        return lse.float()
    lse = torch.logsumexp(scores, dim=-1)
    lse = lse.masked_fill(~vis.any(-1), float("inf"))
    return lse.float()


def _with_sink_column(scores, learnable_sink):
    """scores (B, H, Sq, Sk) with the head's sink logit appended as column Sk (compute dtype)."""
    B, H, Sq, _ = scores.shape
    if tuple(learnable_sink.shape) != (H,):
        raise ValueError(f"attention_ref: learnable_sink must have shape ({H},), got {tuple(learnable_sink.shape)}")
    sink = learnable_sink.to(device=scores.device, dtype=scores.dtype).view(1, H, 1, 1).expand(B, H, Sq, 1)
    return torch.cat([scores, sink], dim=-1)


# ----------------------------------------------------------------------------------------------------
# The accuracy criterion


def fa4_window(window_size):
    """FA2's window spelling (-1: no limit on that side) in FA4's (None), where negative sizes are literal."""
    return tuple(None if w is None or w == -1 else w for w in window_size)


def rounding_error(x: torch.Tensor) -> float:
    """The dtype's rounding error at x's magnitudes: max |(x + 0.3 - 0.3) - x| computed in x's dtype."""
    if x.numel() == 0:
        return 0.0
    return ((x + 0.3 - 0.3) - x).abs().max().item()


def _max_abs_diff(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_close_to_ref(out, out_ref, out_pt, name="out", fp32_ulps=None):
    """Assert max|out - out_ref| <= 2 * max|out_pt - out_ref| + rounding(out.dtype).

    out: the backend's result; out_ref: the upcast reference (attention_ref(upcast=True)); out_pt: the
    same computation by PyTorch at the input dtype (attention_ref(upcast=False, reorder_ops=True)).
    Works for outputs and gradients alike. NaN anywhere in out fails. fp32_ulps: for fp32 results, allow
    that many ulps of max|out_ref| as the rounding term instead (the 0.3-offset proxy can be 0 in fp32,
    while a fused fp32 chain, or a GPU's approximate sqrt/division, rounds a few times).
    """
    if out.shape != out_ref.shape or out_pt.shape != out_ref.shape:
        raise AssertionError(f"{name}: shape mismatch: out {tuple(out.shape)}, ref {tuple(out_ref.shape)},"
                             f" pt {tuple(out_pt.shape)}")
    if not bool(torch.isfinite(out).all()) and bool(torch.isfinite(out_ref).all()):
        raise AssertionError(f"{name}: non-finite values where the reference is finite")
    err = _max_abs_diff(out, out_ref)
    err_pt = _max_abs_diff(out_pt, out_ref)
    if fp32_ulps is not None and out.dtype == torch.float32:
        rnd = fp32_ulps * torch.finfo(torch.float32).eps * (out_ref.abs().max().item() if out.numel() else 0.0)
    else:
        rnd = rounding_error(out_ref.to(out.dtype))
    bound = 2 * err_pt + rnd
    if not err <= bound:
        raise AssertionError(f"{name}: max error {err:.3e} > bound {bound:.3e} "
                             f"(2 x PyTorch error {err_pt:.3e} + rounding {rnd:.3e}), dtype {out.dtype}")


# ----------------------------------------------------------------------------------------------------
# Dropout


def dropout_keep_mask(rng_state, p, batch_size, nheads, seqlen_q, seqlen_k, cu_seqlens_q=None,
                      cu_seqlens_k=None, max_seqlen_q=None, device=None):
    """The keep mask of flash_attn.dropout as a bool (B, H, Sq, Sk) tensor.

    Dense: (B, H, seqlen_q, seqlen_k). Varlen (cu_seqlens_q/k given, int32 (B+1,)): (B, H, seqlen_q,
    seqlen_k) padded with seqlen_q/seqlen_k >= every sequence's length, indices (i, j) within sequence b,
    row key using max_seqlen_q (defaults to seqlen_q) as the backends do; elements outside a sequence are
    False.
    """
    msq = seqlen_q if max_seqlen_q is None else max_seqlen_q
    b = torch.arange(batch_size, dtype=torch.int64, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nheads, dtype=torch.int64, device=device).view(1, -1, 1, 1)
    i = torch.arange(seqlen_q, dtype=torch.int64, device=device).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, dtype=torch.int64, device=device).view(1, 1, 1, -1)
    keep = _dropout.keep_mask(rng_state, b, h, i, j, nheads, msq, p)
    keep = keep.expand(batch_size, nheads, seqlen_q, seqlen_k)
    if cu_seqlens_q is not None:
        lq = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
        lk = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(device=device, dtype=torch.int64).view(-1, 1, 1, 1)
        keep = keep & (i < lq) & (j < lk)
    return keep.contiguous()


# ----------------------------------------------------------------------------------------------------
# Varlen and padding helpers


def random_seqlens(batch_size, max_seqlen, min_seqlen=0, generator=None, device=None):
    """int32 (B,) lengths uniform in [min_seqlen, max_seqlen]; min_seqlen=0 allows empty sequences."""
    return torch.randint(min_seqlen, max_seqlen + 1, (batch_size,), generator=generator,
                         dtype=torch.int32).to(device)


def cu_seqlens_from_seqlens(seqlens):
    """int32 (B+1,) cumulative offsets starting at 0."""
    cu = torch.zeros(seqlens.numel() + 1, dtype=torch.int32, device=seqlens.device)
    cu[1:] = torch.cumsum(seqlens.to(torch.int32), 0)
    return cu


def random_cu_seqlens(batch_size, max_seqlen, min_seqlen=0, generator=None, device=None):
    """(cu_seqlens int32 (B+1,), max_seqlen int) of random lengths in [min_seqlen, max_seqlen]."""
    seqlens = random_seqlens(batch_size, max_seqlen, min_seqlen, generator, device)
    return cu_seqlens_from_seqlens(seqlens), int(seqlens.max().item()) if batch_size > 0 else 0


def padding_mask_from_seqlens(seqlens, max_seqlen):
    """bool (B, max_seqlen), True for the first seqlens[b] positions of row b."""
    ar = torch.arange(max_seqlen, device=seqlens.device)
    return ar.view(1, -1) < seqlens.view(-1, 1).to(ar.dtype)


def random_padding_mask(batch_size, max_seqlen, min_seqlen=0, generator=None, device=None):
    """bool (B, max_seqlen) mask of random lengths in [min_seqlen, max_seqlen] (valid tokens first)."""
    seqlens = random_seqlens(batch_size, max_seqlen, min_seqlen, generator, device)
    return padding_mask_from_seqlens(seqlens, max_seqlen)


def unpad(x, padding_mask):
    """x (B, S, ...) and mask (B, S) -> (x_unpad (total, ...), indices (total,), cu_seqlens int32
    (B+1,), max_seqlen int)."""
    seqlens = padding_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(padding_mask.flatten(), as_tuple=False).flatten()
    x_unpad = x.reshape(-1, *x.shape[2:]).index_select(0, indices)
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    return x_unpad, indices, cu_seqlens_from_seqlens(seqlens), max_seqlen


def pad(x_unpad, indices, batch_size, seqlen):
    """Inverse of :func:`unpad`: (total, ...) -> (B, S, ...) with zeros at padded positions."""
    out = x_unpad.new_zeros(batch_size * seqlen, *x_unpad.shape[1:])
    out[indices] = x_unpad
    return out.view(batch_size, seqlen, *x_unpad.shape[1:])


def varlen_to_padded(x, cu_seqlens, max_seqlen):
    """Packed (total, ...) with cu_seqlens (B+1,) -> (padded (B, max_seqlen, ...), mask bool (B, S))."""
    seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
    mask = padding_mask_from_seqlens(seqlens.to(x.device), max_seqlen)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    return pad(x, indices, seqlens.numel(), max_seqlen), mask


def padded_to_varlen(x, padding_mask):
    """Padded (B, S, ...) with mask (B, S) -> (packed (total, ...), cu_seqlens int32 (B+1,), max_seqlen)."""
    x_unpad, _, cu, max_seqlen = unpad(x, padding_mask)
    return x_unpad, cu, max_seqlen


def paged_from_dense(k, block_size, num_blocks=None, generator=None, block_table=None):
    """Scatter dense k (B, S, Hk, D) into a randomly permuted paged cache.

    Returns (k_paged (num_blocks, block_size, Hk, D), block_table int32 (B, ceil(S / block_size))) such
    that k_paged[block_table[b, p // block_size], p % block_size] == k[b, p]. Unused blocks hold noise.
    Pass the block_table returned for k to page v the same way.
    """
    B, S = k.shape[:2]
    nb = max(1, -(-S // block_size))
    if block_table is not None:
        perm = block_table.to(device="cpu", dtype=torch.long)
        nb = perm.shape[1]
        total = int(perm.max().item()) + 1 if num_blocks is None else num_blocks
    else:
        total = B * nb if num_blocks is None else num_blocks
        if total < B * nb:
            raise ValueError(f"paged_from_dense: num_blocks={total} < {B * nb} needed")
        perm = torch.randperm(total, generator=generator)[: B * nb].view(B, nb)
    k_paged = torch.randn(total, block_size, *k.shape[2:], generator=generator).to(k.dtype).to(k.device)
    padded = k.new_zeros(B, nb * block_size, *k.shape[2:])
    padded[:, :S] = k
    k_paged[perm.flatten().to(k.device)] = padded.view(B * nb, block_size, *k.shape[2:])
    return k_paged, perm.to(device=k.device, dtype=torch.int32)


def assert_ptxas_clean(ptx_path, arch="sm_90a"):
    """Run ``ptxas -v`` on a PTX file and assert that it spilled nothing (stores or loads) and printed no
    C75xx message (C7508 setmaxnreg ignored, C7510-C7520 WGMMAs serialised or warpgroup.arrive injected).
    Returns the log."""
    import os
    import re
    import subprocess

    out = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(ptx_path), "-o", os.devnull], capture_output=True,
                         text=True, check=True)
    log = out.stdout + out.stderr
    assert not re.findall(r"\((C75\d\d)\)", log), log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    loads = [int(x) for x in re.findall(r"(\d+) bytes spill loads", log)]
    assert spills and not any(spills) and not any(loads), log
    return log


def triton_sm90_compile(fn, signature, constexprs, divisible=(), num_warps=4, num_stages=None):
    """Compile the Triton kernel ``fn`` for sm_90 ahead of time, without a GPU (the interpreter never runs Triton's code
    generator: call this in a process without TRITON_INTERPRET). signature: {argument: Triton type} of the runtime
    arguments ("*bf16", "i32", ...); constexprs: {name: value}; divisible: the arguments Triton may assume divisible
    by 16 (what it specialises for contiguous tensors). Returns {"ptx": the PTX, "spills": ptxas's spilled bytes or
    None (a Triton without the ptxas log knob), "regs": registers per thread or None}."""
    import contextlib
    import io
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    try:
        triton.knobs.nvidia.dump_ptxas_log = True
    except AttributeError:
        pass
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else signature[n] for n in names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages})
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        ptx = triton.compile(src, target=target, options=backend.parse_options(options).__dict__).asm["ptx"]
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    regs = re.search(r"Used (\d+) registers", log.getvalue())
    return {"ptx": ptx, "spills": int(spills.group(1)) if spills else None,
            "regs": int(regs.group(1)) if regs else None}


def cuobjdump_path():
    """The cuobjdump to read compiled SASS with: the one on PATH, else the copy in triton's NVIDIA backend
    (CPU machines and CI have only that one); None when neither exists."""
    import os
    import shutil

    path = shutil.which("cuobjdump")
    if path is None:
        try:
            import triton
        except ImportError:
            return None
        cand = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        path = cand if os.path.exists(cand) else None
    return path


# ----------------------------------------------------------------------------------------------------
# One backend, called directly (tests, tuning tools)


def backend_fwd(backend, q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                block_table=None, softmax_scale=None, causal=False, window_left=-1, window_right=-1, softcap=0.0,
                alibi_slopes=None, dropout_p=0.0, rng_state=None, return_probs=False, learnable_sink=None, **extra):
    """``backend.fwd`` (the contract of flash_attn.backends) of a call given by the API's keywords (the window in the
    core's encoding, -1 unbounded), described by flash_attn.call.describe as the API describes it; ``extra``: the
    backend's own keywords (a tuning config). Dense calls default max_seqlen_* to the tensors' lengths.
    learnable_sink (H,): goes to the backend as the core sends it (``sink=``, fp32)."""
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    from flash_attn._ops import _flat_call, _fp32_sink

    call = _flat_call(q, v, cu_seqlens_q, block_table, softmax_scale, causal, window_left, window_right, softcap,
                      alibi_slopes, dropout_p, return_probs, False, learnable_sink is not None)
    if learnable_sink is not None:
        extra["sink"] = _fp32_sink(learnable_sink)
    return backend.fwd(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                       alibi_slopes, rng_state, **extra)


def backend_bwd(backend, dout, q, k, v, out, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                max_seqlen_k=None, block_table=None, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None, deterministic=False, learnable_sink=None,
                **extra):
    """``backend.bwd`` of a call given by the API's keywords (see backend_fwd); ``extra``: grads, dlse, a config.
    With learnable_sink (the forward's; its out and lse include it): (dq, dk, dv, d sink), the sink's gradient the
    core's (flash_attn._ops.sink_grad, from out, lse, dout and dlse: backends compute dq, dk, dv only)."""
    if cu_seqlens_q is None:
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    from flash_attn._ops import _flat_call, sink_grad
    from flash_attn.call import for_backward

    call = for_backward(_flat_call(q, v, cu_seqlens_q, block_table, softmax_scale, causal, window_left, window_right,
                                   softcap, alibi_slopes, dropout_p, False, deterministic, learnable_sink is not None))
    grads = backend.bwd(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        block_table, alibi_slopes, rng_state, **extra)
    if learnable_sink is None:
        return grads
    return (*grads, sink_grad(dout, out, lse, learnable_sink, extra.get("dlse")).to(learnable_sink.dtype))


def backend_fwd_kvcache(backend, q, k_cache, v_cache, *, k=None, v=None, rotary_cos=None, rotary_sin=None,
                        cache_seqlens, cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                        causal=False, window_left=-1, window_right=-1, softcap=0.0, rotary_interleaved=True,
                        alibi_slopes=None, num_splits=0, learnable_sink=None):
    """``backend.fwd_kvcache`` of a call given by flash_attn_with_kvcache's keywords (see backend_fwd)."""
    from flash_attn._ops import _fp32_sink
    from flash_attn.call import describe

    call = describe(q, v_cache, paged=block_table is not None, causal=causal, window_left=window_left,
                    window_right=window_right, softcap=softcap, alibi=alibi_slopes is not None, kvcache=True,
                    scale=softmax_scale, sink=learnable_sink is not None)
    extra = {} if learnable_sink is None else {"sink": _fp32_sink(learnable_sink)}
    return backend.fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                               cache_leftpad, block_table, alibi_slopes, rotary_interleaved, num_splits, **extra)
