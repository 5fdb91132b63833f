"""The host-side steps around flash_bwd_sm90's kernel, as two Triton launches (one before, one after).

Before (``prepare``, one launch): delta = rowsum(dO * O) in fp32 and lse2 = lse * log2(e), both
(B, H, Sq_pad) with Sq_pad a multiple of the kernel's query block, 0 / +inf in the padding; and dq_accum
(B, Sq, H, D) fp32 zeroed for the kernel's atomic adds. A row whose lse is +inf or -inf (it sees no key)
gets lse2 = +inf, which the kernel turns into P = 0 exactly (exp2(s - inf)); -inf would give exp2(+inf).

After (``finish``, one launch): dq = dq_accum (already scaled by the kernel) cast to the input dtype
into the caller's dq, whatever its strides (a slice of a packed dqkv gradient); with GQA/MQA the kernel's
per-query-head dK/dV summed over each group of query heads in fp32, in a fixed order (deterministic),
into the caller's dk/dv. The same launch also copies dK/dV (group 1) into outputs whose layout the
kernel does not accept.

The torch expressions of the same steps (``prepare_torch`` / ``finish_torch``) serve when Triton is not
installed (flash-attn-4 does not require it), and under the plan rule bwd_host=torch (config.PlanRules, to compare).
On a GPU this replaces 5-7 launches (torch.full, a sliced multiply, a padding fill, the delta kernel, a
memset, the cast copy; with GQA a float copy, a sum and a cast per gradient, then copies). The memory
traffic stays: 14 bytes per element of q (read O and dO, zero dq_accum, read it back, write dq), which
only a kernel that does not accumulate dQ in global fp32 would remove; what goes is the small ops, the
gaps between launches, and with GQA the extra passes over dK/dV.
"""
import torch

from flash_attn.cute import config, settings
from flash_attn.cute.triton_launch import launch as _launch

try:
    import triton
    import triton.language as tl
except ImportError:  # flash-attn-4 installs without Triton: the torch path
    triton = tl = None

LOG2E = 1.4426950408889634
_INTERPRET = settings.current.triton_interpret
_F32 = torch.float32
_empty = torch.empty  # prepare's allocations (tests hand it NaN-filled memory: every element must be written)


def use_triton(t):
    """Whether the Triton kernels serve tensors like ``t``: Triton installed, a CUDA tensor (or the
    interpreter on CPU tensors), and the plan rule bwd_host is "triton"."""
    return triton is not None and (t.is_cuda or _INTERPRET) and config.plan_rules().bwd_host == "triton"


if triton is not None:

    # Lengths and block counts change from call to call: not specialised (no recompiles per length).
    # Strides are, so that a unit last stride and 16-divisible row strides vectorise the accesses.
    @triton.jit(do_not_specialize=["seqlen_q", "seqlen_pad", "n_m_blocks"])
    def _bwd_prep_kernel(Out, DOut, Lse, Delta, Lse2, DQAccum, Tickets,
                         s_ob, s_os, s_oh, s_od, s_gb, s_gs, s_gh, s_gd, s_lb, s_lh, s_ls,
                         seqlen_q, seqlen_pad, heads, n_m_blocks,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         ZERO_DQ: tl.constexpr = True, TICKET_ROWS: tl.constexpr = 0):
        # heads vary fastest: programs running together cover whole (row, head, D) rows of out/dout/dq_accum
        pid = tl.program_id(0)
        bm = pid // heads
        h = pid - bm * heads
        b = bm // n_m_blocks
        m = bm - b * n_m_blocks
        bh = b * heads + h
        # 64-bit offsets: the whole batch is one launch, beyond 2^31 elements
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        in_q = rows < seqlen_q
        tile = in_q[:, None] & (cols[None, :] < HEAD_DIM)
        o = tl.load(Out + b64 * s_ob + h64 * s_oh + rows64[:, None] * s_os + cols[None, :] * s_od,
                    mask=tile, other=0.0)
        do = tl.load(DOut + b64 * s_gb + h64 * s_gh + rows64[:, None] * s_gs + cols[None, :] * s_gd,
                     mask=tile, other=0.0)
        # fp32 products and sum (as FlashAttention); rows past Sq load zeros: delta = 0 there
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        lse = tl.load(Lse + b64 * s_lb + h64 * s_lh + rows64 * s_ls, mask=in_q, other=float("inf"))
        # one fp32 multiply, as torch's lse * LOG2E: the same bits
        lse2 = tl.where(tl.abs(lse) == float("inf"), float("inf"), lse * 1.4426950408889634)
        row_off = bh.to(tl.int64) * seqlen_pad + rows64
        in_pad = rows < seqlen_pad
        tl.store(Delta + row_off, delta, mask=in_pad)
        tl.store(Lse2 + row_off, lse2, mask=in_pad)
        if ZERO_DQ:
            tl.store(DQAccum + ((b64 * seqlen_q + rows64[:, None]) * heads + h64) * HEAD_DIM + cols[None, :],
                     tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=tile)
        if TICKET_ROWS:  # the kernel's query block of TICKET_ROWS rows holding this block's rows: its ticket zeroed
            tl.store(Tickets + bh.to(tl.int64) * (seqlen_pad // TICKET_ROWS) + (m * BLOCK_M) // TICKET_ROWS, 0)

    @triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "n_dq", "n_q_blocks", "n_k_blocks"])
    def _bwd_post_kernel(DQAccum, DQ, DKh, DVh, DK, DV,
                         s_qb, s_qs, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                         seqlen_q, seqlen_k, heads, heads_kv, n_dq, n_q_blocks, n_k_blocks,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         KV: tl.constexpr, PERM: tl.constexpr = False):
        # Programs [0, n_dq): dq tiles (B * n_q_blocks * H); then, with KV, dk/dv tiles (B * n_k_blocks * Hk).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols[None, :] < HEAD_DIM
        if pid < n_dq:
            bm = pid // heads  # heads fastest, as in the preprocess
            h = pid - bm * heads
            b = bm // n_q_blocks
            m = bm - b * n_q_blocks
            b64 = b.to(tl.int64)
            h64 = h.to(tl.int64)
            rows = m * BLOCK_S + tl.arange(0, BLOCK_S)
            rows64 = rows.to(tl.int64)
            tile = (rows[:, None] < seqlen_q) & col_ok
            acc_row = DQAccum + ((b64 * seqlen_q + rows64[:, None]) * heads + h64) * HEAD_DIM
            if PERM:
                # dq_accum in config.permuted_column's layout (BwdConfig.dq_perm): row r's 16-column block b sits at
                # stored block b ^ (r & 1) (written as b + p - 2 p (b % 2), which keeps the 16-byte loads provable),
                # its position 4 q + 2 g + x holding column 8 g + 2 q + x: loaded block by block in stored order,
                # reordered in registers, stored in column order (16-byte stores of dq; its 4-byte scatters took
                # this launch 540 us against 69 at d128 1k on an H100)
                blk = cols[None, :] // 16
                par = rows[:, None] & 1
                acc = tl.load(acc_row + 16 * (blk + par - 2 * par * (blk % 2)) + cols[None, :] % 16, mask=tile,
                              other=0.0)
                acc = tl.reshape(tl.permute(tl.reshape(acc, (BLOCK_S, BLOCK_D // 16, 4, 2, 2)), (0, 1, 3, 2, 4)),
                                 (BLOCK_S, BLOCK_D))
            else:
                acc = tl.load(acc_row + cols[None, :], mask=tile, other=0.0)
            dst = DQ + b64 * s_qb + h64 * s_qh + rows64[:, None] * s_qs + cols[None, :] * s_qd
            tl.store(dst, acc.to(DQ.dtype.element_ty), mask=tile)
        else:
            if KV:
                p = pid - n_dq
                bm = p // heads_kv
                hk = p - bm * heads_kv
                b = bm // n_k_blocks
                m = bm - b * n_k_blocks
                group = heads // heads_kv
                b64 = b.to(tl.int64)
                hk64 = hk.to(tl.int64)
                rows = m * BLOCK_S + tl.arange(0, BLOCK_S)
                rows64 = rows.to(tl.int64)
                tile = (rows[:, None] < seqlen_k) & col_ok
                # the group's first query head in dk_h / dv_h (B, Sk, H, D), contiguous
                src = ((b64 * seqlen_k + rows64[:, None]) * heads + hk64 * group) * HEAD_DIM + cols[None, :]
                # dK then dV: one fp32 accumulator live at a time (two spill at D = 64)
                _group_sum(DKh + src, DK + b64 * s_kb + hk64 * s_kh + rows64[:, None] * s_ks + cols[None, :] * s_kd,
                           tile, group, HEAD_DIM, BLOCK_S, BLOCK_D)
                _group_sum(DVh + src, DV + b64 * s_vb + hk64 * s_vh + rows64[:, None] * s_vs + cols[None, :] * s_vd,
                           tile, group, HEAD_DIM, BLOCK_S, BLOCK_D)

    @triton.jit
    def _group_sum(src, dst, tile, group, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
        for j in range(group):  # fixed order: the same bits every run
            acc += tl.load(src + j * HEAD_DIM, mask=tile, other=0.0).to(tl.float32)
        tl.store(dst, acc.to(dst.dtype.element_ty), mask=tile)

    @triton.jit(do_not_specialize=["n_m_blocks", "block_pad"])
    def _bwd_prep_varlen_kernel(Out, DOut, Lse, DLse, Delta, Lse2, CuSeqlensQ, SeqUsedQ,
                                s_os, s_oh, s_od, s_gs, s_gh, s_gd, s_lh, s_ls, s_dh, s_ds, s_ph,
                                heads, n_m_blocks, block_pad,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                                HAS_DLSE: tl.constexpr):
        # Program (sequence b, row block m, head h): rows [m BLOCK_M, (m + 1) BLOCK_M) of sequence b padded to a
        # multiple of block_pad (the CuTeDSL kernel's query block), at padded row (cu_seqlens_q[b] // block_pad + b)
        # block_pad (seqlen_info.BwdSeqlens: a block-aligned start for the kernel's TMA loads).
        pid = tl.program_id(0)
        bm = pid // heads
        h = pid - bm * heads
        b = bm // n_m_blocks
        m = bm - b * n_m_blocks
        start = tl.load(CuSeqlensQ + b)
        used = tl.load(SeqUsedQ + b)
        padded = tl.cdiv(used, block_pad) * block_pad
        if m * BLOCK_M < padded:
            h64 = h.to(tl.int64)
            rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
            rows64 = (start + rows).to(tl.int64)  # rows of the packed tensors
            cols = tl.arange(0, BLOCK_D)
            in_q = rows < used
            tile = in_q[:, None] & (cols[None, :] < HEAD_DIM)
            o = tl.load(Out + h64 * s_oh + rows64[:, None] * s_os + cols[None, :] * s_od, mask=tile, other=0.0)
            do = tl.load(DOut + h64 * s_gh + rows64[:, None] * s_gs + cols[None, :] * s_gd, mask=tile, other=0.0)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
            if HAS_DLSE:  # the lse gradient enters as delta - dlse
                delta -= tl.load(DLse + h64 * s_dh + rows64 * s_ds, mask=in_q, other=0.0)
            lse = tl.load(Lse + h64 * s_lh + rows64 * s_ls, mask=in_q, other=float("inf"))
            lse2 = tl.where(tl.abs(lse) == float("inf"), float("inf"), lse * 1.4426950408889634)
            dst = h64 * s_ph + ((start // block_pad + b) * block_pad + rows).to(tl.int64)
            in_pad = rows < padded
            tl.store(Delta + dst, delta, mask=in_pad)
            tl.store(Lse2 + dst, lse2, mask=in_pad)


def _meta(head_dim, kv=None, perm=False):
    """The constexprs and launch options of the preprocess (kv None) or the postprocess (with / without
    the dK/dV sums; perm: dq_accum in config.permuted_column's layout): tiles of 64 rows x the head dim, 32 values of
    each tensor per thread."""
    meta = _metas.get((head_dim, kv, perm))
    if meta is None:
        block_d = triton.next_power_of_2(head_dim)
        rows = "BLOCK_M" if kv is None else "BLOCK_S"
        meta = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, rows: 64, "num_warps": 4 if block_d <= 64 else 8}
        if kv is not None:
            meta["KV"] = bool(kv)
            meta["PERM"] = bool(perm)
        _metas[(head_dim, kv, perm)] = meta
    return meta


_metas: dict = {}


def prepare(out, dout, lse, seqlen_pad, tickets=None, zero_dq=True):
    """(lse2, delta, dq_accum) for the kernel, in one Triton launch: out/dout (B, Sq, H, D) any strides,
    lse fp32 (B, H, >= Sq) any strides; lse2 / delta (B, H, seqlen_pad) fp32 contiguous, dq_accum
    (B, Sq, H, D) fp32 contiguous, zero where ``zero_dq``. tickets: None or (rows, (B, H, seqlen_pad // rows) int32
    contiguous), zeroed too (the first_store kernel's, whose query blocks have ``rows`` rows)."""
    B, Sq, H, D = out.shape
    dev = out.device
    lse2 = _empty((B, H, seqlen_pad), dtype=_F32, device=dev)
    delta = _empty((B, H, seqlen_pad), dtype=_F32, device=dev)
    dq_accum = _empty((B, Sq, H, D), dtype=_F32, device=dev)
    rows, tick = tickets if tickets is not None else (0, dq_accum)
    key = ("prep", D, bool(zero_dq), rows)
    meta = _metas.get(key)
    if meta is None:
        meta = _metas[key] = dict(_meta(D), ZERO_DQ=bool(zero_dq), TICKET_ROWS=rows)
    n_m = -(-seqlen_pad // meta["BLOCK_M"])
    if B * H * n_m:
        _launch(_bwd_prep_kernel, (B * H * n_m,),
                (out, dout, lse, delta, lse2, dq_accum, tick, *out.stride(), *dout.stride(), *lse.stride(),
                 Sq, seqlen_pad, H, n_m), meta, key)
    return lse2, delta, dq_accum


def varlen_rows(total_q, batch, block_pad):
    """The width of a varlen backward's lse2 / delta rows: sequence b's padded rows at (cu_seqlens_q[b] // block_pad
    + b) * block_pad (seqlen_info.BwdSeqlens; they end before total_q + batch * block_pad), a multiple of 4 (16-byte
    aligned rows for TMA), and one block more at the end (the torch path's sink for rows outside every sequence)."""
    return -(-total_q // 4) * 4 + (batch + 1) * block_pad


def prepare_varlen(out, dout, lse, cu_seqlens_q, seqused_q, max_seqlen_q, block_pad, dlse=None):
    """(lse2, delta, dq_accum) of a varlen backward (at least one sequence): out / dout (T, H, D) any strides, lse
    (and dlse) fp32 (H, T) any strides; sequence b's seqused_q[b] rows from cu_seqlens_q[b], padded with +inf / 0
    to a multiple of block_pad, at rows (cu_seqlens_q[b] // block_pad + b) * block_pad of lse2 / delta (H, varlen_rows(...))
    fp32; dq_accum (T, H, D) fp32 zero (rows outside every sequence too). One Triton launch and a memset."""
    T, H, D = out.shape
    B = cu_seqlens_q.shape[0] - 1
    dev = out.device
    lse2 = _empty((H, varlen_rows(T, B, block_pad)), dtype=_F32, device=dev)
    delta = _empty((H, varlen_rows(T, B, block_pad)), dtype=_F32, device=dev)
    dq_accum = torch.zeros((T, H, D), dtype=_F32, device=dev)
    meta = dict(_meta(D), HAS_DLSE=dlse is not None)
    n_m = -(-(-(-max_seqlen_q // block_pad) * block_pad) // meta["BLOCK_M"])
    if B * H * n_m:
        dl = dlse if dlse is not None else lse
        _launch(_bwd_prep_varlen_kernel, (B * H * n_m,),
                (out, dout, lse, dl, delta, lse2, cu_seqlens_q, seqused_q, *out.stride(), *dout.stride(),
                 *lse.stride(), *dl.stride(), lse2.stride(0), H, n_m, block_pad), meta,
                ("prep_varlen", D, dlse is not None))
    return lse2, delta, dq_accum


def prepare_varlen_torch(out, dout, lse, cu_seqlens_q, seqused_q, max_seqlen_q, block_pad, dlse=None, head_dim=None):
    """``prepare_varlen`` in torch (device ops, no host sync); head_dim as prepare_torch's."""
    T, H, D = out.shape
    B = cu_seqlens_q.shape[0] - 1
    dev = out.device
    width = varlen_rows(T, B, block_pad)
    lse2 = torch.full((H, width), torch.inf, dtype=_F32, device=dev)
    delta = torch.zeros((H, width), dtype=_F32, device=dev)
    rows = torch.arange(T, device=dev)
    cu = cu_seqlens_q.long()
    seq = (torch.searchsorted(cu, rows, right=True) - 1).clamp(0, B - 1)  # each packed row's sequence
    offset = rows - cu[seq]
    used = (offset >= 0) & (offset < seqused_q.long()[seq]) & (rows < cu[-1])
    dst = torch.where(used, (cu[seq] // block_pad + seq) * block_pad + offset, width - 1)  # the rest: a never-read column
    d = (dout.float() * out).sum(-1).transpose(0, 1)  # (H, T), fp32 products as FlashAttention
    if dlse is not None:
        d = d - dlse[:, :T]
    lse2.index_copy_(1, dst, torch.where(used, torch.where(lse[:, :T].isinf(), torch.inf, lse[:, :T] * LOG2E),
                                         torch.inf))
    delta.index_copy_(1, dst, torch.where(used, d, 0.0))
    return lse2, delta, torch.zeros((T, H, head_dim or D), dtype=_F32, device=dev)


def finish(dq_accum, dq, dk_h=None, dv_h=None, dk=None, dv=None, perm=False):
    """One Triton launch: dq (B, Sq, H, D), any strides, = dq_accum (with ``perm`` in config.permuted_column's
    layout, read back in order: unpermute) in dq's dtype; with
    dk_h / dv_h (B, Sk, H, D) contiguous, dk / dv (B, Sk, Hk, D), any strides, = their sums over each group of
    H / Hk query heads (in fp32, query heads in order)."""
    B, Sq, H, D = dq_accum.shape
    kv = dk_h is not None
    meta = _meta(D, kv, bool(perm))
    n_q = -(-Sq // meta["BLOCK_S"])
    n_dq = B * H * n_q
    if kv:
        Sk, Hk = dk.shape[1], dk.shape[2]
        n_k = -(-Sk // meta["BLOCK_S"])
        n_kv = B * Hk * n_k
        kv_args = (dk_h, dv_h, dk, dv)
        kv_strides = (*dk.stride(), *dv.stride())
    else:  # unused pointers and strides (the KV branch is compiled out)
        Sk = Hk = n_k = n_kv = 0
        kv_args = (dq_accum, dq_accum, dq, dq)
        kv_strides = (0,) * 8
    if n_dq + n_kv == 0:
        return
    _launch(_bwd_post_kernel, (n_dq + n_kv,),
            (dq_accum, dq, *kv_args, *dq.stride(), *kv_strides, Sq, Sk, H, max(Hk, 1), n_dq, n_q, max(n_k, 1)),
            meta, ("post", D, kv, bool(perm)))


def unpermute(dq_accum):
    """dq_accum (B, S, H, D) in config.permuted_column's layout (config.BwdConfig.dq_perm), in order."""
    D = dq_accum.shape[-1]
    out = dq_accum[..., [config.permuted_column(0, c) for c in range(D)]]
    out[:, 1::2] = dq_accum[:, 1::2][..., [config.permuted_column(1, c) for c in range(D)]]
    return out


def prepare_torch(out, dout, lse, seqlen_pad, head_dim=None):
    """``prepare`` in torch (several launches; fp32 copies of out and dout for delta); head_dim: dq_accum's, where it
    is not out's (a q / v head-dim pair)."""
    B, Sq, H, D = out.shape
    lse = lse[:, :, :Sq]
    lse2 = torch.full((B, H, seqlen_pad), torch.inf, dtype=_F32, device=out.device)
    lse2[:, :, :Sq] = torch.where(lse.isinf(), torch.inf, lse * LOG2E)
    delta = torch.zeros((B, H, seqlen_pad), dtype=_F32, device=out.device)
    # fp32 products as FlashAttention computes delta; out is upcast inside the multiply
    delta[:, :, :Sq] = (dout.float() * out).sum(-1).transpose(1, 2)
    dq_accum = torch.zeros((B, Sq, H, head_dim or D), dtype=_F32, device=out.device)
    return lse2, delta, dq_accum


def finish_torch(dq_accum, dq, dk_h=None, dv_h=None, dk=None, dv=None, perm=False):
    """``finish`` in torch."""
    dq.copy_(unpermute(dq_accum) if perm else dq_accum)
    if dk_h is not None:
        B, Sk, Hk = dk.shape[:3]
        group = dk_h.shape[2] // Hk
        for g, g_h in ((dk, dk_h), (dv, dv_h)):  # (D and Dv may differ)
            g.copy_(g_h.view(B, Sk, Hk, group, g.shape[3]).float().sum(3))
