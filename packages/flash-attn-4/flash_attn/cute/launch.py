"""Kernel launches on validated CUDA tensors: the dense, varlen, paged and split-KV forward and the backward
(shared by the FA4 API in interface.py and the dispatcher's backend module). Layout fix-ups the compiled kernels
need, batch slicing for their 32-bit offsets and grid limits, and the host's combine of split-KV parts.
"""
import math

import torch

from flash_attn.cute.kernels import _bwd_kernels, _kernels, bwd_config, bwd_kernel, bwd_mem_key, fwd_kernel
from flash_attn.cute import combine as _combine
from flash_attn.cute.config import LONG_SK, SHORT_SK, plan_rules
from flash_attn.cute.plan import _FWD_LONG_ON, _SHORT_DIMS, _UNBOUNDED, _length_kernel, _window_args

_F32 = torch.float32
_MAX_ELEMS = 2 ** 31  # the kernels' 32-bit offsets address tensors below this many elements
_MAX_GRID_Z = 65535  # CUDA's limit on a grid's z extent: the kernels' batch entries (x split-KV parts) per launch
_ARCHS = {(9, 0): "sm_90a"}
_device_archs: dict[int, object] = {}  # CUDA device index -> arch name, or None (no kernels for it)


def _kernel_layout(t, D):
    # The kernel is compiled for a contiguous head dim, heads D apart, 16-byte aligned rows and batch /
    # sequence strides that are multiples of 8 elements (the TVM-FFI wrapper rejects anything else).
    # clone, not contiguous(): contiguous() keeps the odd stride of a size-1 dim.
    s = t.stride()
    if s[3] != 1 or s[2] != D or s[1] % 8 or s[0] % 8 or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


def _kernel_layouts(q, k, v, D, Dv):
    """_kernel_layout of q, k (head dim D) and v (Dv), the common case (all three as the kernel takes them) tested
    in one expression."""
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    if (qs[3] != 1 or qs[2] != D or qs[1] & 7 or qs[0] & 7 or q.data_ptr() & 15
            or ks[3] != 1 or ks[2] != D or ks[1] & 7 or ks[0] & 7 or k.data_ptr() & 15
            or vs[3] != 1 or vs[2] != Dv or vs[1] & 7 or vs[0] & 7 or v.data_ptr() & 15):
        return _kernel_layout(q, D), _kernel_layout(k, D), _kernel_layout(v, Dv)
    return q, k, v


def _packed_ok(t):
    # What the varlen kernels take for a (T, H, D) tensor: rows 16-byte aligned, head dim contiguous, heads D apart.
    return t.stride(1) == t.shape[2] and t.stride(2) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _packed_layout(t):
    return t if _packed_ok(t) else t.clone(memory_format=torch.contiguous_format)


def _device_arch(q, k, v):
    """The kernel architecture for the device of q, k and v (CUDA tensors on one device), cached per
    device index so that a call asks CUDA nothing."""
    index = q.get_device()
    if not q.is_cuda or k.get_device() != index or v.get_device() != index or not k.is_cuda or not v.is_cuda:
        raise ValueError("q, k, v must be CUDA tensors on one device")
    arch = _device_archs.get(index, False)
    if arch is False:
        cap = tuple(torch.cuda.get_device_capability(index))
        # (an AMD GPU answers too: an MI200 says (9, 0))
        arch = _device_archs[index] = None if torch.version.hip is not None else _ARCHS.get(cap)
    if arch is None:
        if torch.version.hip is not None:
            raise NotImplementedError("a ROCm device: the CuTeDSL kernels run on NVIDIA Hopper (sm_90) only")
        cap = tuple(torch.cuda.get_device_capability(index))
        raise NotImplementedError(f"compute capability {cap}: only Hopper (sm_90) kernels exist")
    return arch


# The lse of calls that do not return it (no return_lse, no gradient): the kernels write one, nobody reads it,
# so one buffer per (device index, stream, B, H, Sq) serves every such call instead of an allocation per call.
# Per stream: a buffer is only ever written on the stream it was allocated on, so dropping it from the table
# (past _LSE_SCRATCH_MAX_SHAPES) frees memory the caching allocator reuses in that stream's order, never under a
# kernel still running on another stream. Small shapes only, and a bounded number of them: the calls whose
# per-call cost the allocation is a part of.
_lse_scratch: dict[tuple, torch.Tensor] = {}
_LSE_SCRATCH_MAX_ELEMS = 1 << 20  # 4 MiB per buffer
_LSE_SCRATCH_MAX_SHAPES = 32


def _new_lse_scratch(key):
    index, _, B, H, Sq = key
    lse = torch.empty(B, H, Sq, dtype=_F32, device=torch.device("cuda", index) if index >= 0 else "cpu")
    if B * H * Sq <= _LSE_SCRATCH_MAX_ELEMS:
        if len(_lse_scratch) >= _LSE_SCRATCH_MAX_SHAPES:
            _lse_scratch.clear()
        _lse_scratch[key] = lse
    return lse


def _stream_id(index):
    """The current CUDA stream's handle on device ``index`` (0 for CPU tensors, index -1)."""
    return _raw_stream(index) if index >= 0 else 0


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _lse_buffer(q, B, H, Sq, scratch):
    """The (B, H, Sq) fp32 lse a forward writes: a new tensor, or where the caller drops it (scratch) the shared
    buffer of its shape on the current stream."""
    if scratch:
        index = q.get_device()
        key = (index, _stream_id(index), B, H, Sq)
        lse = _lse_scratch.get(key)
        return lse if lse is not None else _new_lse_scratch(key)
    return torch.empty(B, H, Sq, dtype=_F32, device=q.device)  # sizes as ints: parsed faster


def _lse_buffer_on(index, stream, B, H, Sq):
    """_lse_buffer's shared buffer, the device index and stream handle already read (its per-call path inlines it)."""
    key = (index, stream, B, H, Sq)
    lse = _lse_scratch.get(key)
    return lse if lse is not None else _new_lse_scratch(key)


def forward(q, k, v, softmax_scale, causal, arch="sm_90a", window_left=_UNBOUNDED, window_right=_UNBOUNDED, softcap=0.0,
            sink=None, pack=1, splits=1, lse_scratch=False):
    """The kernel launch on validated CUDA inputs (shared with the dispatcher's backend module):
    q (B, Sq, H, D), k/v (B, Sk, Hk, D) fp16/bf16, D in SUPPORTED_HEAD_DIMS, H % Hk == 0; window sizes literal
    (negative ones too), _UNBOUNDED for no limit, causal implies a right size of 0; softcap 0 is off; sink None or fp32 contiguous (H,)
    (see _check_sink); pack: the pack_gqa group (_pack_group; H == pack * Hk), 1 for none. v's head dim may differ
    from q's (a pair of HEAD_DIM_PAIRS; out has v's). splits > 1: split-KV (_forward_split). Returns (out, lse);
    lse_scratch: the caller drops lse, which may then be a shared buffer (_lse_scratch)."""
    B, Sq, H, D = q.shape
    _, Sk, Hk, _ = k.shape
    Dv = v.shape[3]
    if window_left == _UNBOUNDED and window_right == _UNBOUNDED:
        if not softcap and sink is None and pack == 1 and splits == 1 and Dv == D and Sk and B * Sq * H:
            res = _forward_plain(q, k, v, B, Sq, H, D, Sk, Hk, softmax_scale, causal, arch, lse_scratch)
            if res is not None:
                return res
        window_left = window_right = 0  # (_window_args of no window, without the call)
        local = False
    else:
        window_left, window_right, local = _window_args(causal, window_left, window_right)
    capped = softcap > 0.0
    q, k, v = _kernel_layouts(q, k, v, D, Dv)
    if splits > 1:
        splits = min(splits, _MAX_GRID_Z // max(B, 1))  # grid z = parts x batch
        if splits > 1 and Sk and B * Sq * H and splits * B * max(Sq * H, Sk * Hk) * max(D, Dv) < _MAX_ELEMS:
            # (the split path allocates its own fp32 parts and returns the merged out / lse)
            return _forward_split(q, k, v, softmax_scale, causal and not local, arch, local, window_left,
                                  window_right, softcap, sink, pack, splits)
    out = torch.empty_like(q) if Dv == D else q.new_empty(B, Sq, H, Dv)
    lse = _lse_buffer(q, B, H, Sq, lse_scratch)
    if Sk == 0:  # no key at all: every row is empty (TMA descriptors cannot map a 0-length dim)
        out.zero_()
        if sink is None:
            lse.fill_(math.inf)
        else:  # the sink is the row's only term
            lse.copy_(_sink_lse(sink).view(1, H, 1).expand(B, H, Sq))
    elif B * Sq * H > 0:
        causal = causal and not local
        short, long = _length_kernel(D, causal, Sk, not (local or capped or sink is not None or pack > 1 or Dv != D))
        fn = (_kernels.get((q.dtype, D, causal, arch, local, capped) + (("sink",) if sink is not None else ())
                           + (("short",) if short else ()) + (("long",) if long else ())
                           + (("pack", pack) if pack > 1 else ()) + (("dv", Dv) if Dv != D else ()))
              or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, sink=sink is not None,
                            short=short, long=long, pack=pack, dv=Dv))
        args = (float(softmax_scale), float(softcap), window_left, window_right)
        sink_arg = () if sink is None else (sink,)
        per_batch = max(Sq * H, Sk * Hk) * max(D, Dv)  # elements of one entry's q/out or k/v
        if B * per_batch < _MAX_ELEMS and B <= _MAX_GRID_Z:
            fn(q, k, v, out, lse, *args, *sink_arg)
        else:  # the kernel indexes with 32-bit offsets: launch on batch slices that each stay below 2^31 (and a
            # grid's z limit)
            if per_batch >= _MAX_ELEMS:
                raise NotImplementedError(
                    f"one batch entry of q/k/v holds {per_batch} elements; flash_attn.cute handles < 2^31")
            step = min((_MAX_ELEMS - 1) // per_batch, _MAX_GRID_Z)
            for b in range(0, B, step):
                fn(q[b:b + step], k[b:b + step], v[b:b + step], out[b:b + step], lse[b:b + step], *args,
                   *sink_arg)
    return out, lse


def _forward_plain(q, k, v, B, Sq, H, D, Sk, Hk, softmax_scale, causal, arch, lse_scratch):
    """forward() of a plain call (dense, no window, softcap, sink, packing or split, v's head dim q's, Sk and B * Sq * H
    > 0; shapes as read by the caller) whose kernel is in memory, with the length class of _length_kernel and the
    key of kernels.fwd_kernel spelled out; None where forward()'s general path is needed (the kernel not loaded yet,
    or 32-bit offsets / the grid's z limit exceeded)."""
    key = (q.dtype, D, causal, arch, False, False)
    if Sk <= SHORT_SK:
        fn = _kernels.get(key + ("short",) if D in _SHORT_DIMS else key)
    else:
        fn = _kernels.get(key + ("long",) if Sk >= LONG_SK and (D, causal) in _FWD_LONG_ON else key)
    if fn is None or B * max(Sq * H, Sk * Hk) * D >= _MAX_ELEMS or B > _MAX_GRID_Z:
        return None
    q, k, v = _kernel_layouts(q, k, v, D, D)
    out = torch.empty_like(q)
    lse = _lse_buffer(q, B, H, Sq, lse_scratch)
    fn(q, k, v, out, lse, float(softmax_scale), 0.0, 0, 0)
    return out, lse


# Split-KV parts: one fp32 buffer (and one bound combine launch) per (device, stream, sizes) reused by every split call
# of those sizes (_split_parts), instead of two allocations and the combine's launch planning per call; decoding calls
# that drop their lse also keep their kernel and lse buffer per kind of call (_decode_entries). The parts are written
# and read on their stream only, so a call's split kernel overwrites them after the previous call's combine has read
# them (stream order), and dropping an entry frees memory the caching allocator reuses in that order. A CUDA graph
# being captured never shares them: its calls allocate parts of their own (from the capture's pool).
_decode_entries: dict[tuple, tuple] = {}
_DECODE_MAX_ENTRIES = 16
_DECODE_MAX_PART_ELEMS = 1 << 21  # 8 MiB of fp32 parts per entry (16 entries); larger calls allocate per call


_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _capturing(index):
    """Whether a CUDA graph is being captured on the current stream (of device index; never for CPU tensors, -1)."""
    return index >= 0 and _stream_capturing()


def _forward_decode(q, k, v, B, Sq, H, D, Sk, Hk, softmax_scale, causal, arch, pack, splits):
    """forward() of a plain inference call (dense, no window, softcap or sink, v's head dim q's, its lse dropped;
    B * Sq * H and Sk > 0) on the decoding plan (pack, splits) of the dispatcher's backend: (out, lse), lse a shared
    buffer (_lse_scratch); None where forward()'s general path is needed (a kernel not in memory yet, a graph being
    captured, sizes past the kernels' offsets or the parts' budget)."""
    if splits <= 1 and pack <= 1:
        return _forward_plain(q, k, v, B, Sq, H, D, Sk, Hk, softmax_scale, causal, arch, True)
    index = q.get_device()
    if _capturing(index):
        return None
    key = (index, _stream_id(index), q.dtype, B, Sq, H, D, Sk, Hk, causal, pack, splits)
    entry = _decode_entries.get(key)
    if entry is None:
        entry = _decode_entry(key, q.device, arch)
        if entry is None:
            return None
    kernel_key, parts, lse, combine = entry
    fn = _kernels.get(kernel_key)  # (looked up per call, as _forward_plain's: tools clear the table between settings)
    if fn is None:
        return None
    q, k, v = _kernel_layouts(q, k, v, D, D)
    if combine is None:  # packed, unsplit: the kernel writes out
        out = torch.empty_like(q)
        fn(q, k, v, out, lse, float(softmax_scale), 0.0, 0, 0)
        return out, lse
    fn(q, k, v, parts[0], parts[1], float(softmax_scale), 0.0, 0, 0, splits)
    out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device)
    combine(out, lse, None)
    return out, lse


def _decode_entry(key, device, arch):
    """_decode_entries' (kernel's key in _kernels, (o parts, lse parts), lse scratch, bound combine or None) of key,
    remembered; None where the general path serves the call (see _forward_decode)."""
    index, _, dtype, B, Sq, H, D, Sk, Hk, causal, pack, splits = key
    if B * max(Sq * H, Sk * Hk) * D * max(splits, 1) >= _MAX_ELEMS or B * splits > _MAX_GRID_Z:
        return None
    kernel_key = ((dtype, D, causal, arch, False, False) + (("pack", pack) if pack > 1 else ())
                  + (("split",) if splits > 1 else ()))
    if kernel_key not in _kernels:
        return None
    lse = _lse_buffer_on(index, key[1], B, H, Sq)
    if splits > 1:
        parts = _split_parts(device, key[1], dtype, splits, B, Sq, H, D)
        if parts is None:
            return None
        o_parts, lse_parts, combine = parts
        entry = (kernel_key, (o_parts, lse_parts), lse, combine)
    else:
        entry = (kernel_key, None, lse, None)
    if len(_decode_entries) >= _DECODE_MAX_ENTRIES:
        _decode_entries.clear()
    _decode_entries[key] = entry
    return entry


_split_parts_cache: dict[tuple, tuple] = {}


def _split_parts(device, stream, dtype, splits, B, Sq, H, Dv, has_sink=False, row_limit=False):
    """(o parts (splits * B, Sq, H, Dv), lse parts (splits * B, H, Sq), combine) fp32 of a split-KV call on the
    current stream (handle ``stream``) with out in dtype, reused by every such call of these sizes (see
    _decode_entries): one buffer; combine(out, lse, sink) merges them into out (B, Sq, H, Dv) and lse (B, H, Sq),
    contiguous (a varlen call's (Tq, H, Dv) and (H, Tq) with B 1 and Sq Tq); with row_limit combine(out, lse, sink,
    limit) also gives the rows from limit (a one-element int32 tensor) on out 0 and lse +inf. None where the general
    path serves the call (parts past the budget, or no combine kernel for them: remembered)."""
    key = (device, stream, dtype, splits, B, Sq, H, Dv, has_sink, row_limit)
    parts = _split_parts_cache.get(key)
    if parts is not None:
        return parts or None
    n = splits * B * Sq * H
    if n * (Dv + 1) > _DECODE_MAX_PART_ELEMS:
        return None
    buf = torch.empty(n * (Dv + 1), dtype=_F32, device=device)
    o_parts, lse_parts = buf[:n * Dv].view(splits * B, Sq, H, Dv), buf[n * Dv:].view(splits * B, H, Sq)
    o5, l5 = o_parts.view(splits, B, Sq, H, Dv), lse_parts.view(splits, B, H, Sq).transpose(2, 3)
    parts = False  # (no combine kernel for them)
    if _combine.use_kernel(o5, l5, dtype, device):
        parts = (o_parts, lse_parts, _combine.bound_combine(o5, l5, (Sq * H * Dv, H * Dv, Dv, 1), (H * Sq, 1, Sq),
                                                             has_sink, unseen_pos_inf=True, row_limit=row_limit))
    if len(_split_parts_cache) >= _DECODE_MAX_ENTRIES:
        _split_parts_cache.clear()
    _split_parts_cache[key] = parts
    return parts or None


def _sink_lse(sink):
    """The lse of a row whose only term is the sink: the sink, or +inf (no term, as the kernel's epilogue gives) for a
    -inf one, which keeps every backward's exp(s - lse) free of -inf - -inf."""
    return torch.where(sink == -math.inf, math.inf, sink)


def _forward_split(q, k, v, softmax_scale, causal, arch, local, window_left, window_right, softcap, sink, pack,
                   splits):
    """Split-KV on validated inputs (forward's, window sizes already the kernel's): the split kernel writes each
    part's O and lse in fp32 (parts of batch entry b at s * B + b), _combine_splits merges them (and adds the sink,
    which the kernel leaves out so that it counts once)."""
    B, Sq, H, D = q.shape
    Dv = v.shape[3]
    capped = softcap > 0.0
    index = q.get_device()
    parts = None if _capturing(index) else _split_parts(q.device, _stream_id(index), q.dtype, splits, B, Sq, H, Dv,
                                                          sink is not None)
    if parts is None:
        o_parts = torch.empty(splits * B, Sq, H, Dv, dtype=torch.float32, device=q.device)
        lse_parts = torch.empty(splits * B, H, Sq, dtype=torch.float32, device=q.device)
    else:
        o_parts, lse_parts, combine = parts
    fn = (_kernels.get((q.dtype, D, causal, arch, local, capped) + (("pack", pack) if pack > 1 else ())
                       + (("dv", Dv) if Dv != D else ()) + ("split",))
          or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, pack=pack, dv=Dv, split=True))
    fn(q, k, v, o_parts, lse_parts, float(softmax_scale), float(softcap), window_left, window_right, splits)
    if parts is None:
        return _combine_splits(o_parts.view(splits, B, Sq, H, Dv), lse_parts.view(splits, B, H, Sq), sink, q.dtype)
    out = torch.empty(B, Sq, H, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    combine(out, lse, None if sink is None else sink.float())
    return out, lse


def _combine_splits(o_parts, lse_parts, sink, dtype):
    """(out, lse) from split-KV parts: o_parts (S, B, Sq, H, Dv) each divided by its own row sums, lse_parts (S, B,
    H, Sq) natural-log, +inf for a part whose rows saw no key (no contribution). lse = log(sum_s exp(lse_s) [+
    exp(sink)]), out = sum_s exp(lse_s - lse) o_s in dtype; a row no part saw gets out 0 and lse +inf (or the
    sink). One launch of combine's Triton kernel where it serves the tensors, else fp32 torch ops."""
    if _combine.use_kernel(o_parts, lse_parts, dtype, o_parts.device):
        S, B, H, Sq = lse_parts.shape
        out = torch.empty(B, Sq, H, o_parts.shape[-1], dtype=dtype, device=o_parts.device)
        lse = torch.empty(B, H, Sq, dtype=torch.float32, device=o_parts.device)
        _combine.combine_kernel(o_parts, lse_parts.transpose(2, 3), out, lse.transpose(1, 2),
                                sink=None if sink is None else sink.float(), unseen_pos_inf=True)
        return out, lse
    terms = torch.where(torch.isposinf(lse_parts), torch.full_like(lse_parts, -math.inf), lse_parts)
    if sink is not None:
        S, B, H, Sq = lse_parts.shape
        terms = torch.cat([terms, sink.float().view(1, 1, H, 1).expand(1, B, H, Sq)], 0)
    lse = torch.logsumexp(terms, 0)  # (B, H, Sq); -inf where no term
    seen = torch.isfinite(lse)
    weights = torch.where(seen, torch.exp(terms[:lse_parts.shape[0]] - lse), torch.zeros_like(lse))  # (S, B, H, Sq)
    out = (o_parts * weights.permute(0, 1, 3, 2).unsqueeze(-1)).sum(0)
    return out.to(dtype), torch.where(seen, lse, torch.full_like(lse, math.inf))


def _gather_pages(k, v, page_table):
    """Paged k / v (num_pages, page_size, Hk, D) as packed sequences: (k, v, cu_seqlens_k, capacity), sequence b the rows of
    its pages page_table[b, 0], page_table[b, 1], ... (its page-table capacity, a copy). Entries out of range are
    clamped: callers read only the keys of each sequence's used pages, which were checked."""
    batch, cap = page_table.shape[0], page_table.shape[1] * k.shape[1]
    rows = page_table.clamp(0, k.shape[0] - 1).long()
    k, v = (t[rows].reshape(batch * cap, *t.shape[2:]) for t in (k, v))
    return k, v, torch.arange(0, (batch + 1) * cap, cap, dtype=torch.int32, device=k.device)[:batch + 1], cap


def _varlen_forward(q, k, v, varlen, softmax_scale, causal, arch, window_left, window_right, softcap, sink=None):
    """forward_varlen on the API's sequence description varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, seqused_q, seqused_k): rows of q past seqused_q[b] and after the last sequence get out 0 and the
    lse of a row that sees no key."""
    cu_q, cu_k, max_q, _, used_q, used_k = varlen
    if used_q is not None:
        cu_q, cu_k, used_k = _split_unused_q(cu_q, cu_k, used_q, used_k)
    return forward_varlen(q, k, v, cu_q, cu_k, used_k, max_q, softmax_scale, causal, arch, window_left, window_right,
                          softcap, fill_unused_rows=True, sink=sink)


def _split_unused_q(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, paged=False):
    """seqused_q on the varlen kernel as it is: (cu_seqlens_q, cu_seqlens_k, seqused_k) of 2B sequences, sequence
    2b the used rows of sequence b (its first seqused_q[b] queries, with its keys), sequence 2b + 1 its unused
    query rows with no key (the kernel gives them out 0 and lse +inf, or the sink). paged: cu_seqlens_k is the
    page table (B, max_pages), returned with each row twice. Device ops only (no sync)."""
    if seqused_k is None:
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    starts = cu_seqlens_q[:-1]
    cu_q = torch.cat([torch.stack([starts, starts + seqused_q], 1).flatten(), cu_seqlens_q[-1:]])
    if paged:
        cu_k = cu_seqlens_k.repeat_interleave(2, dim=0)
    else:
        cu_k = torch.cat([torch.stack([cu_seqlens_k[:-1], cu_seqlens_k[1:]], 1).flatten(), cu_seqlens_k[-1:]])
    used_k = torch.stack([seqused_k, torch.zeros_like(seqused_k)], 1).flatten()
    return cu_q, cu_k, used_k


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, softmax_scale, causal,
                   arch="sm_90a", window_left=_UNBOUNDED, window_right=_UNBOUNDED, softcap=0.0, fill_unused_rows=False,
                   sink=None,
                   pack=1, page_table=None, splits=1):
    """The varlen kernel launch on validated inputs (shared with the dispatcher's backend module). Rows
    of q after cu_seqlens_q[-1] are left unwritten unless fill_unused_rows (then out 0, lse +inf there:
    one memset each, for callers that cannot afford a sync to find those rows). sink, pack: as forward's.
    page_table: the paged call (k / v (num_pages, page_size, Hk, D), seqused_k given, cu_seqlens_k unused).
    splits > 1: split-KV, each sequence's key blocks divided among that many parts (the split kernel writes each
    part's O and lse in fp32, _combine_splits merges them and adds the sink)."""
    Tq, H, D = q.shape
    Dv = v.shape[-1]
    if max(q.numel(), k.numel(), v.numel(), Tq * H * Dv) >= _MAX_ELEMS:
        raise NotImplementedError("flash_attn.cute's varlen kernel handles q, k, v of < 2^31 elements")
    q = _packed_layout(q)
    if page_table is not None:  # paged k / v: the dense kernel's layout
        k, v = _kernel_layout(k, D), _kernel_layout(v, Dv)
    else:
        k, v = _packed_layout(k), _packed_layout(v)
    batch = cu_seqlens_q.shape[0] - 1
    if batch:
        splits = min(splits, _MAX_GRID_Z // batch)  # grid z = parts x sequences: one launch
    split = (splits > 1 and k.shape[0] > 0 and batch > 0 and Tq > 0 and max_seqlen_q > 0
             and splits * Tq * H * max(D, Dv) < _MAX_ELEMS)
    if not split:  # (the split path makes its out and lse from the parts)
        out = (torch.zeros if fill_unused_rows else torch.empty)((Tq, H, Dv), dtype=q.dtype, device=q.device)
        lse = torch.full((H, Tq), math.inf, dtype=torch.float32, device=q.device) if fill_unused_rows else \
            torch.empty((H, Tq), dtype=torch.float32, device=q.device)
    if k.shape[0] == 0 or batch == 0:  # no key anywhere (TMA descriptors cannot map a 0-length dim)
        out.zero_()
        lse.fill_(math.inf)
        if sink is not None and batch > 0 and Tq > 0:  # rows of a sequence: the sink is their only term
            rows = torch.arange(Tq, device=q.device) < cu_seqlens_q[-1]  # no host sync
            lse.copy_(torch.where(rows, _sink_lse(sink).view(H, 1), lse))
    elif Tq > 0 and max_seqlen_q > 0:
        if seqused_k is None:
            seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        window_left, window_right, local = _window_args(causal, window_left, window_right)
        causal = causal and not local
        capped = softcap > 0.0
        sinked = sink is not None
        page_size = 0 if page_table is None else k.shape[1]
        keys = cu_seqlens_k if page_table is None else page_table  # the paged kernel takes the page table there
        if split:
            # split s's parts in entry s (rows after the last sequence are never written: their merge is undefined,
            # as those rows of the unsplit kernel's out, and replaced when fill_unused_rows)
            index = q.get_device()
            # (fill_unused_rows: the bound combine zeroes the rows after the last sequence itself)
            parts = None if _capturing(index) else _split_parts(q.device, _stream_id(index), q.dtype, splits, 1, Tq,
                                                                  H, Dv, sink is not None, fill_unused_rows)
            if parts is None:
                o_parts = torch.empty(splits, Tq, H, Dv, dtype=torch.float32, device=q.device)
                lse_parts = torch.empty(splits, H, Tq, dtype=torch.float32, device=q.device)
            else:
                o_parts, lse_parts, combine = parts
            fn = (_kernels.get((q.dtype, D, causal, arch, local, capped, True) + (("pack", pack) if pack > 1 else ())
                               + (("dv", Dv) if Dv != D else ()) + (("paged", page_size) if page_size else ())
                               + ("split",))
                  or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, varlen=True, pack=pack, dv=Dv,
                                paged=page_size, split=True))
            fn(q, k, v, o_parts, lse_parts, cu_seqlens_q, keys, seqused_k, max_seqlen_q, float(softmax_scale),
               float(softcap), window_left, window_right, splits)
            if parts is None:
                merged, merged_lse = _combine_splits(o_parts.view(splits, 1, Tq, H, Dv),
                                                     lse_parts.view(splits, 1, H, Tq), sink, q.dtype)
                out, lse = merged[0], merged_lse[0]
                if fill_unused_rows:
                    rows = torch.arange(Tq, device=q.device) < cu_seqlens_q[-1]  # no host sync
                    out, lse = torch.where(rows.view(Tq, 1, 1), out, 0.0), torch.where(rows, lse, math.inf)
            else:
                out = torch.empty((Tq, H, Dv), dtype=q.dtype, device=q.device)
                lse = torch.empty((H, Tq), dtype=torch.float32, device=q.device)
                if fill_unused_rows:
                    combine(out, lse, None if sink is None else sink.float(), cu_seqlens_q[-1:])
                else:
                    combine(out, lse, None if sink is None else sink.float())
            return out, lse
        fn = (_kernels.get((q.dtype, D, causal, arch, local, capped, True) + (("sink",) if sinked else ())
                           + (("pack", pack) if pack > 1 else ()) + (("dv", Dv) if Dv != D else ())
                           + (("paged", page_size) if page_size else ()))
              or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, varlen=True, sink=sinked,
                            pack=pack, dv=Dv, paged=page_size))
        for seq_args in _sequence_chunks(cu_seqlens_q, keys, seqused_k, page_table is not None):
            fn(q, k, v, out, lse, *seq_args, max_seqlen_q, float(softmax_scale), float(softcap), window_left,
               window_right, *(() if sink is None else (sink,)))
    return out, lse


def _sequence_chunks(cu_seqlens_q, keys, seqused_k, paged):
    """(cu_seqlens_q, keys, seqused_k) of each varlen launch, so that its grid's z extent (the sequences) stays
    within _MAX_GRID_Z: the kernels read each sequence's rows and keys at the absolute offsets of cu_seqlens (keys:
    cu_seqlens_k, or the page table, one row per sequence), so a launch on sequences [lo, hi) writes only their
    rows. One launch on the tensors as they are when they fit (and always for split-KV, whose part count is capped
    to fit instead)."""
    batch = seqused_k.shape[0]
    step = _MAX_GRID_Z
    if batch <= step:
        return [(cu_seqlens_q, keys, seqused_k)]
    return [(cu_seqlens_q[lo:lo + step + 1], keys[lo:lo + step] if paged else keys[lo:lo + step + 1],
             seqused_k[lo:lo + step]) for lo in range(0, batch, step)]


def _bwd_out_layout(t, D):
    # What the compiled kernel accepts for dk / dv: the input layout rules (see _kernel_layout).
    s = t.stride()
    return s[3] == 1 and s[2] == D and s[1] % 8 == 0 and s[0] % 8 == 0 and t.data_ptr() % 16 == 0


def backward(dout, q, k, v, out, lse, softmax_scale, causal, arch="sm_90a", grads=None, dlse=None, window=None,
             deterministic=False, softcap=0.0, mod=None):
    """Attention backward on validated CUDA inputs: q/out/dout (B, Sq, H, D), k/v (B, Sk, Hk, D) fp16/bf16,
    D in (64, 96, 128, 192, 256), H % Hk == 0, lse fp32 (B, H, Sq) natural log (+inf for rows that see no key), causal
    bottom-right aligned. Returns (dq, dk, dv) in the input dtype, written into ``grads`` = (dq, dk, dv)
    when given (tensors shaped like q, k, v with a contiguous last dim). dq is accumulated across the key
    blocks' CTAs with fp32 reduce-adds (TMA bulk, or red.global without BwdConfig.dq_tma) in
    whatever order they finish, so results vary in the last bits run to run.

    Host-side steps (bwd_host.py): one Triton launch before the kernel writes delta = rowsum(dO * O) and
    lse * log2(e), padded to a multiple of the kernel's query block with 0 / +inf (so padded rows
    contribute nothing), and zeroes dq_accum; one after it casts dq_accum (which the kernel fills with
    softmax_scale * dS K) into dq and, with GQA, sums the kernel's per-query-head dK/dV over each group
    in fp32. Without Triton (or with the plan rule bwd_host=torch) torch does the same in more launches.
    dlse: None or the gradient flowing into lse (B, H, Sq): d lse_i / d s_ij = P_ij adds dlse_i * P_ij to dS_ij,
    which the kernel gets as delta - dlse in delta's place. window: None, or (left, right) sizes >= 0 (_UNBOUNDED for
    no limit on a side; right 0 when causal) of a sliding window, the kernel built with local=True. deterministic
    (no window): the kernel built with deterministic=True adds dQ in key-block order (bwd_dq.DqAccumulator), so the
    gradients are the same bits every run; its turn counters (B, H, query blocks) are zeroed here. softcap > 0: the
    forward's soft-capped scores (the kernel built with softcap=True). mod: (kernel, aux, lists, scalars, block_m) of
    a mods backward (mods.mod_bwd_kernel; dense, no softcap or determinism; with ``window`` the kernel built with
    local=True, entry call_mods_local, which takes no lists): that kernel, aux (a tuple or None), the per-key-block
    lists of query blocks (a tuple or None) and the aux scalars (a tuple or None) its last arguments, block_m its
    query block. v (and out, dout) may have a head dim Dv of their own: a pair of config.HEAD_DIM_PAIRS (the torch host
    steps then, and GQA's dK / dV sums in torch)."""
    B, Sq, H, D = q.shape
    Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dtype = q.dtype
    dq_out, dk_out, dv_out = grads if grads is not None else (None, None, None)
    if B * Sq * H == 0 or Sk == 0:  # no query or no key: every gradient is 0
        zeros = [torch.zeros_like(t) if g is None else g.zero_() for t, g in zip((q, k, v), (dq_out, dk_out, dv_out))]
        return tuple(zeros)
    local = window is not None
    if deterministic and local:
        raise NotImplementedError("flash_attn.cute's deterministic backward has no sliding window")
    capped = softcap > 0.0
    group = H // Hk
    # GQA under the plan rule bwd_gqa_loop: one CTA per KV head walks its group's query heads and writes the summed
    # dK / dV itself (no per-query-head copies, no sum after the kernel)
    gqa = group > 1 and mod is None and not deterministic and plan_rules().bwd_gqa_loop
    dv_dim = None if Dv == D else Dv  # (the kernels' head_dim_v)
    cfg = bwd_config(dtype, D, causal, arch, local, False, deterministic, capped, gqa, dv_dim)
    block_m = cfg.block_m
    per_batch = max(Sq * H, Sk * max(H, Hk)) * max(D, Dv)
    if per_batch >= _MAX_ELEMS:
        raise NotImplementedError(
            f"one batch entry of q/k/v holds {per_batch} elements; flash_attn.cute's backward handles < 2^31")
    if mod is not None:
        fn, aux, lists, mod_scalars, block_m = mod
    else:
        fn = (_bwd_kernels.get(bwd_mem_key(dtype, D, causal, arch, local, False, deterministic, capped, gqa, dv_dim))
              or bwd_kernel(dtype, D, causal, arch, local, deterministic=deterministic, softcap=capped, gqa_loop=gqa,
                            head_dim_v=dv_dim))
    # the entries' scalars (bwd_entries.py): __call__'s (and call_mods') scale; call_deterministic's scale, softcap;
    # call_general's scale, softcap, window sizes; call_mods' aux after them, call_mods_local's after the window sizes
    # (it takes no lists)
    scalars = (float(softmax_scale),)
    if mod is not None:
        scalars += ((*(int(w) for w in window), aux, mod_scalars) if local else (aux, lists, mod_scalars))
    elif deterministic:
        scalars += (float(softcap),)
    elif local or capped:
        scalars += (float(softcap),) + (tuple(int(w) for w in window) if local else (0, 0))

    from flash_attn.cute import bwd_host  # imports Triton when installed: not at this module's import

    # out and lse are read through their strides; q, k, v, dout must suit the compiled kernel
    q, k = (_kernel_layout(t, D) for t in (q, k))
    v, dout = (_kernel_layout(t, Dv) for t in (v, dout))
    sq_pad = -(-Sq // block_m) * block_m
    host = bwd_host if bwd_host.use_triton(q) and dv_dim is None else None
    # the first_store kernel's tickets (zeroed by the Triton preprocess); dq_accum unzeroed where every query block is
    # some key block's (causal: the first Sq - Sk rows see no key, whole blocks of them no key block)
    first = cfg.dq_first_store and mod is None
    sem = None
    if deterministic or first:
        sem = (torch.empty if first and host else torch.zeros)((B, H, sq_pad // block_m), dtype=torch.int32,
                                                               device=q.device)
    if host:
        lse2, delta, dq_accum = bwd_host.prepare(out, dout, lse, sq_pad, (block_m, sem) if first else None,
                                                 not first or (causal and Sq - Sk >= block_m))
    else:
        lse2, delta, dq_accum = bwd_host.prepare_torch(out, dout, lse, sq_pad, D)
    if dlse is not None:
        delta[:, :, :Sq].sub_(dlse[:, :, :Sq])

    def new(heads, d):
        return torch.empty((B, Sk, heads, d), dtype=dtype, device=q.device)

    if (group == 1 or gqa) and (dk_out is None or (_bwd_out_layout(dk_out, D) and _bwd_out_layout(dv_out, Dv))):
        # the kernel's dK / dV are the gradients (per KV head: per query head without GQA, or summed by gqa_loop)
        dk_h = dk_out if dk_out is not None else new(Hk, D)
        dv_h = dv_out if dv_out is not None else new(Hk, Dv)
        dk, dv, sums = dk_h, dv_h, False
    elif gqa:  # the gradients' layout does not suit the kernel: its own, copied after
        dk_h, dv_h = new(Hk, D), new(Hk, Dv)
        dk, dv, sums = dk_out, dv_out, False
    else:  # per-query-head dK/dV from the kernel, summed over each group (or copied) after it
        dk_h, dv_h = new(H, D), new(H, Dv)
        dk = dk_out if dk_out is not None else new(Hk, D)
        dv = dv_out if dv_out is not None else new(Hk, Dv)
        sums = True
    step = max(1, min((_MAX_ELEMS - 1) // per_batch, _MAX_GRID_Z))
    for b in range(0, B, step):  # 32-bit offsets in the kernel: batch slices below 2^31 elements (and grid z's limit)
        sl = slice(b, b + step)
        fn(q[sl], k[sl], v[sl], dout[sl], lse2[sl], delta[sl], dq_accum[sl], dk_h[sl], dv_h[sl],
           *(() if sem is None else (sem[sl],)), *scalars)
    # dq_accum holds softmax_scale * dS K (in config.permuted_column's layout with dq_perm): a cast is left
    dq = dq_out if dq_out is not None else torch.empty((B, Sq, H, D), dtype=dtype, device=q.device)
    (bwd_host.finish if host else bwd_host.finish_torch)(dq_accum, dq, *((dk_h, dv_h, dk, dv) if sums else ()),
                                                         perm=cfg.dq_perm)
    if dk is not dk_h and not sums:  # (gqa_loop into gradients of another layout)
        dk.copy_(dk_h)
        dv.copy_(dv_h)
    return dq, dk, dv



def backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                    max_seqlen_k, softmax_scale, causal, arch="sm_90a", grads=None, dlse=None, window=None,
                    deterministic=False, softcap=0.0, mod=None):
    """The varlen backward on validated CUDA inputs: q/out/dout (Tq, H, D), k/v (Tk, Hk, D), lse (and dlse) fp32
    (H, Tq), int32 cu_seqlens (B + 1,), seqused_q / seqused_k None or int32 (B,) (the rows each sequence uses from
    its start; None: all of them), max_seqlen_q / max_seqlen_k at least every sequence's used lengths (the grid is
    sized by them). Rows outside every used range get zero gradients. Otherwise as ``backward`` (the same kernel
    built with varlen=True, FlashBwdSm90.call_varlen / call_varlen_deterministic; one launch for at most
    _MAX_GRID_Z sequences). mod: (kernel, aux, scalars, block_m) of a mods backward (mods.mod_bwd_kernel
    with varlen=True; no softcap or determinism), whose last arguments are aux and scalars (with ``window``, after
    the window sizes: call_varlen_mods_local). v (and out, dout) may have a head dim of their own, as in ``backward``."""
    Tq, H, D = q.shape
    Tk, Hk, Dv = k.shape[0], k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    dtype = q.dtype
    dq_out, dk_out, dv_out = grads if grads is not None else (None, None, None)
    if batch == 0 or Tq * H == 0 or Tk == 0 or max_seqlen_q <= 0 or max_seqlen_k <= 0:
        zeros = [torch.zeros_like(t) if g is None else g.zero_() for t, g in zip((q, k, v), (dq_out, dk_out, dv_out))]
        return tuple(zeros)
    if max(Tq, Tk) * H * max(D, Dv) >= _MAX_ELEMS or batch > _MAX_GRID_Z:
        raise NotImplementedError(f"flash_attn.cute's varlen backward handles q, k, v (and per-query-head dk, dv) of "
                                  f"< 2^31 elements and at most {_MAX_GRID_Z} sequences")
    local = window is not None
    if deterministic and local:
        raise NotImplementedError("flash_attn.cute's deterministic backward has no sliding window")
    capped = softcap > 0.0
    dv_dim = None if Dv == D else Dv  # (the kernels' head_dim_v)
    cfg = bwd_config(dtype, D, causal, arch, local, True, deterministic, capped, False, dv_dim)
    block_m = cfg.block_m
    if mod is not None:  # (kernel, aux, scalars, block_m) of a mods backward (mods.mod_bwd_kernel, varlen=True)
        fn, mod_aux, mod_scalars, block_m = mod
    else:
        fn = (_bwd_kernels.get(bwd_mem_key(dtype, D, causal, arch, local, True, deterministic, capped, False, dv_dim))
              or bwd_kernel(dtype, D, causal, arch, local, varlen=True, deterministic=deterministic, softcap=capped,
                            head_dim_v=dv_dim))
    used_q = seqused_q.contiguous() if seqused_q is not None else cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    used_k = seqused_k.contiguous() if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]

    from flash_attn.cute import bwd_host

    q, k, v, dout = (_packed_layout(t) for t in (q, k, v, dout))
    triton_host = bwd_host.use_triton(q) and dv_dim is None
    lse2, delta, dq_accum = (bwd_host.prepare_varlen if triton_host else bwd_host.prepare_varlen_torch)(
        out, dout, lse, cu_seqlens_q, used_q, max_seqlen_q, block_m, dlse, *(() if triton_host else (D,)))
    # The kernel writes the used rows of each sequence only: the others must read 0.
    if H == Hk and (dk_out is None or (_packed_ok(dk_out) and _packed_ok(dv_out))):
        dk_h = dk_out.zero_() if dk_out is not None else torch.zeros((Tk, H, D), dtype=dtype, device=q.device)
        dv_h = dv_out.zero_() if dv_out is not None else torch.zeros((Tk, H, Dv), dtype=dtype, device=q.device)
        dk, dv, sums = dk_h, dv_h, False
    else:  # per-query-head dK/dV from the kernel, summed over each group (or copied) after it
        dk_h = torch.zeros((Tk, H, D), dtype=dtype, device=q.device)
        dv_h = torch.zeros((Tk, H, Dv), dtype=dtype, device=q.device)
        dk = dk_out if dk_out is not None else torch.empty((Tk, Hk, D), dtype=dtype, device=q.device)
        dv = dv_out if dv_out is not None else torch.empty((Tk, Hk, Dv), dtype=dtype, device=q.device)
        sums = True
    window_args = tuple(int(w) for w in window) if local else (0, 0)
    sem = ((torch.zeros((batch, H, -(-int(max_seqlen_q) // block_m)), dtype=torch.int32, device=q.device),)
           if deterministic else ())
    # as dense tensors of one batch entry (the dense kernel's layouts and TMA descriptors)
    # the entries' last arguments (call_varlen_mods_local: the window sizes, then aux and scalars)
    tail = (float(softcap), *window_args) if mod is None else ((*window_args,) if local else ()) + (mod_aux,
                                                                                                    mod_scalars)
    fn(q[None], k[None], v[None], dout[None], lse2[None], delta[None], dq_accum[None], dk_h[None], dv_h[None],
       cu_seqlens_q, cu_seqlens_k, used_q, used_k, *sem, int(max_seqlen_k), float(softmax_scale), *tail)
    dq = dq_out if dq_out is not None else torch.empty((Tq, H, D), dtype=dtype, device=q.device)
    kv = (dk_h[None], dv_h[None], dk[None], dv[None]) if sums else ()
    (bwd_host.finish if triton_host else bwd_host.finish_torch)(dq_accum[None], dq[None], *kv, perm=cfg.dq_perm)
    return dq, dk, dv
