"""FlashAttention-3's custom operators, ``torch.ops.flash_attn_3.{fwd, bwd, fwd_combine, get_scheduler_metadata}``,
with FA3's schemas (FA3's extension registers them; code written for FA3 calls them directly, and FA3's own tests
check that their schemas stay backward compatible). Each runs the matching function of fa3_interface, so the same
kernels serve them as the Python API. Registered when the top-level ``flash_attn_interface`` module is imported, unless
an ``flash_attn_3`` operator namespace already has them (FA3 itself installed).

Eager calls only: the operators have no autograd formula (FA3's Python API wraps them in autograd Functions, as
fa3_interface does its own), and FA3's schemas return outputs with alias annotations (``Tensor(out!)``), which
torch.compile's functionalization refuses for custom operators whatever fake kernel they have; the Python API's
functions are the ones torch.compile traces.
"""
import torch

from flash_attn import fa3_interface as _f3

# FA3's schemas, argument for argument (names, defaults and alias annotations are its).
_SCHEMAS = {
    "fwd": (
        "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
        "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
        "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
        "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
        "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
        "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0., "
        "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, bool? pack_gqa=None, "
        "int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)"),
    "bwd": (
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
        "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
        "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
        "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
        "float softcap=0., bool deterministic=False, int sm_margin=0) "
        "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)"),
    "fwd_combine": (
        "fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, ScalarType? out_dtype=None) "
        "-> (Tensor(out!), Tensor)"),
    "get_scheduler_metadata": (
        "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, int num_heads, "
        "int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, Tensor seqused_k, "
        "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, "
        "Tensor? seqused_q=None, Tensor? leftpad_k=None, int? page_size=None, int max_seqlen_k_new=0, "
        "bool is_causal=False, int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, "
        "bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) -> Tensor"),
}


def fwd(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
        cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
        kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
        k_descale=None, v_descale=None, softmax_scale=None, is_causal=False, window_size_left=-1,
        window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, scheduler_metadata=None,
        num_splits=0, pack_gqa=None, sm_margin=0):
    """(out, softmax_lse, out_accum, softmax_lse_accum): fa3_interface._flash_attn_forward (out_accum and
    softmax_lse_accum empty: split-KV parts are combined inside the call)."""
    return _f3._flash_attn_forward(
        q, k, v, k_new, v_new, q_v, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k,
        max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
        q_descale, k_descale, v_descale, softmax_scale, is_causal, window_size_left, window_size_right,
        attention_chunk, softcap, is_rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin)


def bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, is_causal=False,
        window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    """(dq, dk, dv, softmax_d, softmax_lse_log2, dq_accum, dk_accum, dv_accum): the gradients (written into dq, dk, dv
    when given) and softmax_d = rowsum(dout * out) from fa3_interface._flash_attn_backward; FA3's kernel scratch
    (the last three, and the log2 lse) is internal here: empty tensors."""
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    softmax_d = _f3._flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                                         seqused_k, max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, is_causal,
                                         window_size_left, window_size_right, softcap, deterministic, sm_margin)
    empty = torch.empty(0, device=q.device)
    return dq, dk, dv, softmax_d, empty, empty, empty, empty


def fwd_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """(out, lse) of fa3_interface.flash_attn_combine."""
    return _f3.flash_attn_combine(out_partial, lse_partial, out, out_dtype)


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                           qkv_dtype, seqused_k, cu_seqlens_q=None, cu_seqlens_k=None, cu_seqlens_k_new=None,
                           seqused_q=None, leftpad_k=None, page_size=None, max_seqlen_k_new=0, is_causal=False,
                           window_size_left=-1, window_size_right=-1, attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """fa3_interface.get_scheduler_metadata (its argument checks; an empty int32 tensor: the kernels here schedule
    without FA3's metadata). cu_seqlens_k and seqused_q change nothing there either."""
    return _f3.get_scheduler_metadata(
        batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, seqused_k, qkv_dtype, headdim_v,
        cu_seqlens_q, cu_seqlens_k_new, leftpad_k, page_size, max_seqlen_k_new, is_causal,
        (window_size_left, window_size_right), attention_chunk, has_softcap, num_splits, pack_gqa, sm_margin)


_IMPLS = {"fwd": fwd, "bwd": bwd, "fwd_combine": fwd_combine, "get_scheduler_metadata": get_scheduler_metadata}
_library = []  # the torch.library.Library that holds the definitions (alive as long as the process)


def register():
    """Defines the operators once per process; a namespace that already has them (FA3's extension) is left alone.
    Returns whether this call defined them."""
    if _library:
        return False
    try:
        torch.ops.flash_attn_3.fwd  # noqa: B018 (FA3 installed: its operators stay)
        return False
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("flash_attn_3", "DEF")
    for name, schema in _SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _IMPLS[name], "CompositeExplicitAutograd")
    _library.append(lib)
    return True
