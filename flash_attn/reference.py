"""The PyTorch reference backend ("torch"): exact attention by tiles with an online softmax, the
algorithm of FlashAttention (Dao et al. 2022, Algorithm 1; FlashAttention-2, Dao 2023, section 3.1 for the
forward and the recomputation of P from the logsumexp in the backward), written with plain torch ops so it
runs on any device and dtype (fp16, bf16, fp32).

Memory stays linear in the sequence length: a score tile never holds more than MAX_TILE_ELEMENTS
elements, tiles that the causal/local mask hides entirely are never computed, and the backward pass
recomputes P per tile from the saved logsumexp instead of storing it. fp16/bf16 inputs are computed in
fp32; fp32 inputs in fp64, because the accuracy yardstick for fp32 is PyTorch's own fp32 error and an
online softmax in that same precision lands at 1-2.5x of it (the lse is still returned in fp32). Loops run
in a fixed order, so results are bitwise reproducible run to run.

A learnable sink (FA4's per-head logit, an extra softmax term exp(sink) with no value) is folded into each
row's running max and sum after its last key block, so the lse includes it; the backward then needs nothing
more (P = exp(s - lse) with that lse), and the sink's gradient is the core's (flash_attn._ops.sink_grad).
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from flash_attn import dropout as _dropout

NAME = "torch"

# Upper bound on the elements of one score tile (N * H * block_q * block_k): 64 MB in fp32, 128 MB in fp64.
MAX_TILE_ELEMENTS = 1 << 24
# Preferred key block; the query block is then chosen to fill MAX_TILE_ELEMENTS.
BLOCK_K = 512
# Cap on the query block (None: only MAX_TILE_ELEMENTS bounds it): narrower query blocks let the
# causal/local skipping drop more of the key range. Tests lower both knobs so that small problems run
# through many tiles.
BLOCK_Q: Optional[int] = 1024
# Debug hook: called with the shape (N, Hk, G, block_q, block_k) of every score tile computed.
debug_tile_hook: Optional[Callable[[tuple], None]] = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float32 else torch.float32


def unavailable_reason():
    return None


def unsupported_reason(call):
    dtype = getattr(call, "dtype", None)
    if dtype is not None and dtype not in _DTYPES:
        return f"dtype {dtype} not in (float16, bfloat16, float32)"
    return None


# ----------------------------------------------------------------------------------------------------
# Tiling, masking and the per-tile scores


def _block_sizes(N, H, Sq, Sk):
    bk = max(1, min(Sk, BLOCK_K, max(1, MAX_TILE_ELEMENTS // max(1, N * H))))
    bq = max(1, min(Sq, MAX_TILE_ELEMENTS // max(1, N * H * bk)))
    if BLOCK_Q is not None:
        bq = max(1, min(bq, BLOCK_Q))
    return bq, bk


@dataclass
class _Plan:
    """One batch of N sequences of equal lengths Sq, Sk and everything that shapes a score tile."""

    N: int
    Hk: int
    G: int
    Sq: int
    Sk: int
    scale: float
    window_left: int
    window_right: int
    softcap: float
    slopes: Optional[torch.Tensor]  # (N, Hk, G, 1, 1) in acc
    acc: torch.dtype  # accumulation dtype
    dropout_p: float
    rng_state: Optional[torch.Tensor]
    b_idx: Optional[torch.Tensor]  # (N,) int64: sequence numbers in the dropout hash
    max_seqlen_q: int
    sink: Optional[torch.Tensor] = None  # (1, Hk, G, 1) in acc: the learnable sink, natural-log logits

    @property
    def offset(self):
        # Bottom-right alignment: query i sits at key position i + Sk - Sq.
        return self.Sk - self.Sq

    def blocks(self):
        return _block_sizes(self.N, self.Hk * self.G, self.Sq, self.Sk)

    def key_range(self, q0, q1):
        """Keys [lo, hi) that any query of [q0, q1) can see; lo >= hi when none."""
        lo = 0 if self.window_left < 0 else max(0, q0 + self.offset - self.window_left)
        hi = self.Sk if self.window_right < 0 else min(self.Sk, q1 - 1 + self.offset + self.window_right + 1)
        return lo, hi

    def _fully_visible(self, q0, q1, k0, k1):
        right_ok = self.window_right < 0 or q0 + self.offset + self.window_right >= k1 - 1
        left_ok = self.window_left < 0 or q1 - 1 + self.offset - self.window_left <= k0
        return right_ok and left_ok

    def scores(self, qs, kt, q0, q1, k0, k1):
        """Scores (N, Hk, G, bq, bk) in acc of the pre-scaled queries qs (N, Hk, G*bq, D) against keys
        kt (N, Hk, D, bk), -inf where masked; and tanh(raw / softcap) (or None) for the backward."""
        bq, bk = q1 - q0, k1 - k0
        s = torch.matmul(qs, kt).view(self.N, self.Hk, self.G, bq, bk)
        if debug_tile_hook is not None:
            debug_tile_hook(tuple(s.shape))
        t = None
        if self.softcap > 0:
            t = torch.tanh(s / self.softcap)
            s = t * self.softcap
        full = self._fully_visible(q0, q1, k0, k1)
        if self.slopes is not None or not full:
            i = torch.arange(q0, q1, device=s.device).view(bq, 1)
            j = torch.arange(k0, k1, device=s.device).view(1, bk)
            rel = j - (i + self.offset)
            if self.slopes is not None:
                s = s - self.slopes * rel.abs().to(self.acc)
            if not full:
                vis = torch.ones(bq, bk, dtype=torch.bool, device=s.device)
                if self.window_left >= 0:
                    vis &= rel >= -self.window_left
                if self.window_right >= 0:
                    vis &= rel <= self.window_right
                s = s.masked_fill(~vis, float("-inf"))
        return s, t

    def keep(self, q0, q1, k0, k1, device):
        """Dropout keep mask (N, Hk, G, bq, bk) bool of this tile, from the shared counter-based hash."""
        H = self.Hk * self.G
        b = self.b_idx.to(device).view(self.N, 1, 1, 1, 1)
        h = torch.arange(H, device=device, dtype=torch.int64).view(1, self.Hk, self.G, 1, 1)
        i = torch.arange(q0, q1, device=device, dtype=torch.int64).view(1, 1, 1, -1, 1)
        j = torch.arange(k0, k1, device=device, dtype=torch.int64).view(1, 1, 1, 1, -1)
        return _dropout.keep_mask(self.rng_state, b, h, i, j, H, self.max_seqlen_q, self.dropout_p)

    @property
    def dropout_scale(self):
        return 0.0 if self.dropout_p >= 1.0 else 1.0 / (1.0 - self.dropout_p)


def _make_plan(q, k, scale, window_left, window_right, softcap, slopes, dropout_p, rng_state, b_idx,
               max_seqlen_q, sink=None):
    N, Sq, H, _ = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    G = H // Hk
    if slopes is not None:
        slopes = slopes.to(device=q.device, dtype=_acc_dtype(q.dtype)).reshape(N, Hk, G, 1, 1)
    if sink is not None:
        sink = sink.to(device=q.device, dtype=_acc_dtype(q.dtype)).view(1, Hk, G, 1)
    return _Plan(N, Hk, G, Sq, Sk, float(scale), int(window_left), int(window_right), float(softcap), slopes,
                 _acc_dtype(q.dtype), float(dropout_p), rng_state, b_idx, int(max_seqlen_q), sink)


def _q_chunk(q, q0, q1, plan):
    # (N, bq, H, D) -> (N, Hk, G * bq, D) in acc: the G query heads of a KV head share one matmul, so K/V
    # are never repeated per query head (GQA/MQA).
    N, bq, D = q.shape[0], q1 - q0, q.shape[-1]
    x = q[:, q0:q1].to(plan.acc).view(N, bq, plan.Hk, plan.G, D).permute(0, 2, 3, 1, 4)
    return x.reshape(N, plan.Hk, plan.G * bq, D)


def _from_chunk(x, plan, bq):
    # (N, Hk, G * bq, Dx) -> (N, bq, H, Dx)
    N, Dx = x.shape[0], x.shape[-1]
    return x.view(N, plan.Hk, plan.G, bq, Dx).permute(0, 3, 1, 2, 4).reshape(N, bq, plan.Hk * plan.G, Dx)


def _rows(x, plan, q0, q1):
    # (N, H, Sq) -> (N, Hk, G, bq)
    return x[:, :, q0:q1].view(plan.N, plan.Hk, plan.G, q1 - q0)


# ----------------------------------------------------------------------------------------------------
# Forward and backward of one plan (N equal-length sequences)


def _fwd_plan(q, k, v, plan, return_probs):
    """q (N, Sq, H, D), k (N, Sk, Hk, D), v (N, Sk, Hk, Dv) -> out (N, Sq, H, Dv) in q's dtype,
    lse fp32 (N, H, Sq), probs fp32 (N, H, Sq, Sk) or None."""
    N, Sq, H, _ = q.shape
    Dv = v.shape[-1]
    out = torch.zeros(N, Sq, H, Dv, dtype=q.dtype, device=q.device)
    lse = torch.full((N, H, Sq), float("inf"), dtype=torch.float32, device=q.device)
    if plan.sink is not None:
        # A row that sees no key has the sink as its only term: lse = sink (+inf, no term at all, for a -inf sink).
        sink = plan.sink.view(1, H, 1)
        lse.copy_(torch.where(sink == float("-inf"), float("inf"), sink).expand(N, H, Sq))
    probs = (torch.zeros(N, H, Sq, plan.Sk, dtype=torch.float32, device=q.device) if return_probs else None)
    if Sq == 0 or plan.Sk == 0:
        return out, lse, probs
    kt = k.to(plan.acc).permute(0, 2, 3, 1)  # (N, Hk, D, Sk)
    vt = v.to(plan.acc).permute(0, 2, 1, 3)  # (N, Hk, Sk, Dv)
    bq, bk = plan.blocks()
    shape_rows = (N, plan.Hk, plan.G)
    for q0 in range(0, Sq, bq):
        q1 = min(q0 + bq, Sq)
        lo, hi = plan.key_range(q0, q1)
        if lo >= hi:
            continue
        nq = q1 - q0
        qs = _q_chunk(q, q0, q1, plan) * plan.scale
        m = torch.full((*shape_rows, nq), float("-inf"), dtype=plan.acc, device=q.device)
        l = torch.zeros((*shape_rows, nq), dtype=plan.acc, device=q.device)
        acc = torch.zeros((*shape_rows, nq, Dv), dtype=plan.acc, device=q.device)
        for k0 in range(lo, hi, bk):
            k1 = min(k0 + bk, hi)
            s, _ = plan.scores(qs, kt[..., k0:k1], q0, q1, k0, k1)
            m_new = torch.maximum(m, s.amax(-1))
            # A row that has seen only masked keys keeps max -inf; exp(-inf - 0) = 0 avoids inf - inf.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(s - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            if plan.dropout_p > 0:
                p = p * plan.keep(q0, q1, k0, k1, q.device) * plan.dropout_scale
            pv = torch.matmul(p.view(N, plan.Hk, plan.G * nq, k1 - k0), vt[:, :, k0:k1])
            acc = acc * alpha.unsqueeze(-1) + pv.view(*shape_rows, nq, Dv)
            m = m_new
        if plan.sink is not None:
            # The sink joins the sum (not acc: it has no value), both rebased to the larger of the row max and
            # the sink; a row with neither keeps reference 0 so that no difference is inf - inf.
            m_new = torch.maximum(m, plan.sink)
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = torch.exp(m - m_safe)
            l = l * alpha + torch.exp(plan.sink - m_safe)
            acc = acc * alpha.unsqueeze(-1)
            m = m_new
        empty = l == 0
        o = acc / torch.where(empty, 1.0, l).unsqueeze(-1)
        out[:, q0:q1] = _from_chunk(o.view(N, plan.Hk, plan.G * nq, Dv), plan, nq).to(q.dtype)
        row_lse = torch.where(empty, float("inf"), m + torch.log(torch.where(empty, 1.0, l)))
        lse[:, :, q0:q1] = row_lse.view(N, H, nq)
        if return_probs:
            _probs_rows(probs, qs, kt, row_lse, plan, q0, q1, lo, hi, bk)
    return out, lse, probs


def _probs_rows(probs, qs, kt, row_lse, plan, q0, q1, lo, hi, bk):
    # Second pass once the row's logsumexp is final: normalised P, negated where dropout dropped it.
    N, nq = plan.N, q1 - q0
    for k0 in range(lo, hi, bk):
        k1 = min(k0 + bk, hi)
        s, _ = plan.scores(qs, kt[..., k0:k1], q0, q1, k0, k1)
        p = torch.exp(s - row_lse.unsqueeze(-1))
        if plan.dropout_p > 0:
            p = torch.where(plan.keep(q0, q1, k0, k1, p.device), p, -p)
        probs[:, :, q0:q1, k0:k1] = p.view(N, plan.Hk * plan.G, nq, k1 - k0)


def _bwd_plan(dout, q, k, v, out, lse, plan, dlse=None):
    """Gradients in plan.acc: dq (N, Sq, H, D), dk (N, Sk, Hk, D), dv (N, Sk, Hk, Dv). dlse: None or the
    gradient flowing into lse (N, H, Sq)."""
    N, Sq, H, D = q.shape
    Dv = v.shape[-1]
    dq = torch.zeros(N, Sq, H, D, dtype=plan.acc, device=q.device)
    dk = torch.zeros(N, plan.Hk, plan.Sk, D, dtype=plan.acc, device=q.device)
    dv = torch.zeros(N, plan.Hk, plan.Sk, Dv, dtype=plan.acc, device=q.device)
    if Sq > 0 and plan.Sk > 0:
        kt = k.to(plan.acc).permute(0, 2, 3, 1)  # (N, Hk, D, Sk)
        kf = k.to(plan.acc).permute(0, 2, 1, 3)  # (N, Hk, Sk, D)
        vt = v.to(plan.acc).permute(0, 2, 3, 1)  # (N, Hk, Dv, Sk)
        bq, bk = plan.blocks()
        for q0 in range(0, Sq, bq):
            q1 = min(q0 + bq, Sq)
            lo, hi = plan.key_range(q0, q1)
            if lo >= hi:
                continue
            nq = q1 - q0
            qs = _q_chunk(q, q0, q1, plan) * plan.scale
            do = _q_chunk(dout, q0, q1, plan)  # (N, Hk, G * nq, Dv)
            o = _q_chunk(out, q0, q1, plan)
            # delta_i = sum_j P_ij dP_ij = dO_i . O_i, also under dropout (O already holds the mask).
            delta = (do * o).sum(-1).view(N, plan.Hk, plan.G, nq, 1)
            if dlse is not None:
                # d lse_i / d s_ij = P_ij: the lse's gradient adds dlse_i * P_ij to dS_ij, i.e. delta_i - dlse_i
                # takes delta_i's place in dS = P * (dP - delta).
                delta = delta - _rows(dlse, plan, q0, q1).to(plan.acc).unsqueeze(-1)
            row_lse = _rows(lse, plan, q0, q1).to(plan.acc).unsqueeze(-1)
            dqs = torch.zeros(N, plan.Hk, plan.G * nq, D, dtype=plan.acc, device=q.device)
            for k0 in range(lo, hi, bk):
                k1 = min(k0 + bk, hi)
                nk = k1 - k0
                s, t = plan.scores(qs, kt[..., k0:k1], q0, q1, k0, k1)
                # The lse arrives rounded to fp32; rounding s the same way (a no-op unless acc is fp64) keeps
                # P exactly 1 where a row's mass sits on one key, as it is in the forward. Rows with
                # lse = +inf give P = 0: no gradient flows there.
                p = torch.exp(s.float().to(plan.acc) - row_lse)
                dp = torch.matmul(do, vt[..., k0:k1]).view(N, plan.Hk, plan.G, nq, nk)
                if plan.dropout_p > 0:
                    keep = plan.keep(q0, q1, k0, k1, q.device) * plan.dropout_scale
                    p_drop = p * keep
                    dp = dp * keep
                else:
                    p_drop = p
                # Contracting over (G * nq) sums dK/dV over the query heads sharing a KV head.
                dv[:, :, k0:k1] += torch.matmul(p_drop.view(N, plan.Hk, plan.G * nq, nk).transpose(-1, -2), do)
                ds = p * (dp - delta)
                if t is not None:
                    ds = ds * (1.0 - t * t)  # d/dx [c * tanh(x / c)] = 1 - tanh^2
                ds = ds.view(N, plan.Hk, plan.G * nq, nk)
                dqs += torch.matmul(ds, kf[:, :, k0:k1])
                dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qs)
            dq[:, q0:q1] = _from_chunk(dqs * plan.scale, plan, nq)
    return dq, dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


# ----------------------------------------------------------------------------------------------------
# Varlen and paged K/V


def _seq_bounds(cu, b):
    return int(cu[b]), int(cu[b + 1])


def _paged_rows(block_table, b, n, block_size, device):
    """Flat row indices (n,) into a paged (num_blocks * block_size, ...) view for sequence b."""
    nblk = -(-n // block_size)
    blocks = block_table[b, :nblk].to(device=device, dtype=torch.int64)
    rows = (blocks.view(-1, 1) * block_size + torch.arange(block_size, device=device).view(1, -1)).flatten()
    return rows[:n]


def _seq_kv(x, b, cu_k, block_table):
    # Keys of sequence b as (1, Sk_b, Hk, Dx).
    k0, k1 = _seq_bounds(cu_k, b)
    if block_table is None:
        return x[k0:k1].unsqueeze(0)
    rows = _paged_rows(block_table, b, k1 - k0, x.shape[1], x.device)
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows).unsqueeze(0)


def _slopes_for(alibi_slopes, b_sel, N, H):
    if alibi_slopes is None:
        return None
    if alibi_slopes.dim() == 1:
        return alibi_slopes.view(1, H).expand(N, H)
    return alibi_slopes[b_sel].view(N, H)


def _host(cu):
    # Only varlen calls come here, and they always have both offset tensors.
    return cu.to("cpu", torch.int64)


def _common(call, rng_state, sink=None):
    return dict(scale=call.softmax_scale, window_left=call.window_left, window_right=call.window_right,
                softcap=call.softcap, dropout_p=call.dropout_p, rng_state=rng_state, sink=sink)


def _dense_plan(q, k, alibi_slopes, common):
    B, Sq, H, _ = q.shape
    return _make_plan(q, k, slopes=_slopes_for(alibi_slopes, slice(None), B, H),
                      b_idx=torch.arange(B, dtype=torch.int64), max_seqlen_q=Sq, **common)


def _seq_plan(qb, kb, alibi_slopes, b, max_seqlen_q, common):
    """The plan of sequence b of a varlen batch, qb (1, Sq_b, H, D), kb (1, Sk_b, Hk, D)."""
    return _make_plan(qb, kb, slopes=_slopes_for(alibi_slopes, [b], 1, qb.shape[2]),
                      b_idx=torch.tensor([b], dtype=torch.int64), max_seqlen_q=max_seqlen_q, **common)


def fwd(call, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, alibi_slopes, rng_state,
        sink=None):
    """Forward per the contract in :mod:`flash_attn.backends` -> (out, lse fp32, s_dmask or None)."""
    common = _common(call, rng_state, sink)
    return_probs = call.return_probs
    if cu_seqlens_q is None:
        plan = _dense_plan(q, k, alibi_slopes, common)
        out, lse, probs = _fwd_plan(q, k, v, plan, return_probs)
        return out, lse, (probs if return_probs else None)
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    B = cu_q.numel() - 1
    total_q, H, _ = q.shape
    out = torch.zeros(total_q, H, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((H, total_q), float("inf"), dtype=torch.float32, device=q.device)
    probs = (torch.zeros(B, H, max_seqlen_q, max_seqlen_k, dtype=torch.float32, device=q.device)
             if return_probs else None)
    for b in range(B):
        q0, q1 = _seq_bounds(cu_q, b)
        if q1 == q0:
            continue
        kb, vb = _seq_kv(k, b, cu_k, block_table), _seq_kv(v, b, cu_k, block_table)
        plan = _seq_plan(q[q0:q1].unsqueeze(0), kb, alibi_slopes, b, max_seqlen_q, common)
        ob, lb, pb = _fwd_plan(q[q0:q1].unsqueeze(0), kb, vb, plan, return_probs)
        out[q0:q1] = ob[0]
        lse[:, q0:q1] = lb[0]
        if return_probs:
            probs[b, :, : q1 - q0, : kb.shape[1]] = pb[0]
    return out, lse, probs


def bwd(call, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
        alibi_slopes, rng_state, dlse=None):
    """Backward per the contract -> (dq, dk, dv) in the input dtype. Always deterministic: every sum runs
    in a fixed sequential order (the description's ``deterministic`` changes nothing here)."""
    common = _common(call, rng_state)
    if cu_seqlens_q is None:
        plan = _dense_plan(q, k, alibi_slopes, common)
        dq, dk, dv = _bwd_plan(dout, q, k, v, out, lse, plan, dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    cu_q, cu_k = _host(cu_seqlens_q), _host(cu_seqlens_k)
    B = cu_q.numel() - 1
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    # Flat accumulators: a paged block may in principle serve several sequences.
    dk = torch.zeros(k.shape, dtype=acc, device=k.device).view(-1, *k.shape[-2:])
    dv = torch.zeros(v.shape, dtype=acc, device=v.device).view(-1, *v.shape[-2:])
    for b in range(B):
        q0, q1 = _seq_bounds(cu_q, b)
        k0, k1 = _seq_bounds(cu_k, b)
        if q1 == q0 or k1 == k0:
            continue
        kb, vb = _seq_kv(k, b, cu_k, block_table), _seq_kv(v, b, cu_k, block_table)
        qb = q[q0:q1].unsqueeze(0)
        plan = _seq_plan(qb, kb, alibi_slopes, b, max_seqlen_q, common)
        dqb, dkb, dvb = _bwd_plan(dout[q0:q1].unsqueeze(0), qb, kb, vb, out[q0:q1].unsqueeze(0),
                                  lse[:, q0:q1].unsqueeze(0), plan,
                                  None if dlse is None else dlse[:, q0:q1].unsqueeze(0))
        dq[q0:q1] = dqb[0]
        if block_table is None:
            rows = torch.arange(k0, k1, device=k.device)
        else:
            rows = _paged_rows(block_table, b, k1 - k0, k.shape[1], k.device)
        # Rows are distinct within one sequence, so gather-add-scatter is exact and deterministic.
        dk[rows] = dk[rows] + dkb[0]
        dv[rows] = dv[rows] + dvb[0]
    return dq.to(q.dtype), dk.view(k.shape).to(k.dtype), dv.view(v.shape).to(v.dtype)


# ----------------------------------------------------------------------------------------------------
# KV cache (inference)


def rotate_at(x, cos, sin, pos, interleaved):
    """Rotary embedding of the first rotary_dim = 2 * cos.shape[1] dims of x (..., Hx, D) at the positions pos (...),
    computed in fp32 (also FA3's KV-cache extras use it, flash_attn/fa3_interface.py)."""
    rd = cos.shape[-1] * 2
    if pos.numel() and int(pos.max()) >= cos.shape[0]:
        raise ValueError(f"rotary_cos/rotary_sin: position {int(pos.max())} needs at least "
                         f"{int(pos.max()) + 1} rows, got {cos.shape[0]}")
    c = cos.to(torch.float32)[pos].unsqueeze(-2)  # (..., 1, rd / 2)
    s = sin.to(torch.float32)[pos].unsqueeze(-2)
    xr = x[..., :rd].to(torch.float32)
    if interleaved:  # GPT-J: pairs (0, 1), (2, 3), ...
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:  # GPT-NeoX: pairs (i, i + rd / 2)
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def fwd_kvcache(call, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                cache_leftpad, block_table, alibi_slopes, rotary_interleaved, num_splits, sink=None):
    """FA2's flash_attn_with_kvcache: q (B, Sq, H, D); k_cache/v_cache (B_cache, S_cache, Hk, D) or paged
    (num_blocks, block_size, Hk, D) with block_table (B, max_blocks); new k/v (B, S_new, Hk, D) are
    rotated (rotary_cos/sin (seqlen_ro, rotary_dim / 2)) and written in place at cache_seqlens[b] + i.
    sink: the learnable sink, fp32 (H,), or None. Returns (out (B, Sq, H, Dv), lse fp32 (B, H, Sq)). num_splits is
    ignored (a performance hint)."""
    B, Sq, H, _ = q.shape
    device = q.device
    seqlens = cache_seqlens.to(device=device, dtype=torch.int64).view(B)
    cache_rows = (torch.arange(B, device=device) if cache_batch_idx is None
                  else cache_batch_idx.to(device=device, dtype=torch.int64))
    leftpad = (torch.zeros(B, dtype=torch.int64, device=device) if cache_leftpad is None
               else cache_leftpad.to(device=device, dtype=torch.int64))
    s_new = 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        # Positions are absolute cache rows (FA2): the new tokens sit at cache_seqlens[b] + i. Without a
        # causal/local mask all query rows sit at the last cached position, as in one decode step.
        step = torch.arange(Sq, device=device).view(1, Sq) if call.bounded else torch.zeros(1, Sq, dtype=torch.int64,
                                                                                       device=device)
        q = rotate_at(q, rotary_cos, rotary_sin, seqlens.view(B, 1) + step, rotary_interleaved)
        if k is not None:
            pos_k = seqlens.view(B, 1) + torch.arange(s_new, device=device).view(1, s_new)
            k = rotate_at(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
    if k is not None and s_new > 0:
        pos = seqlens.view(B, 1) + torch.arange(s_new, device=device).view(1, s_new)  # (B, S_new)
        if block_table is None:
            if int(pos.max()) >= k_cache.shape[1]:
                raise ValueError(f"k: appending {s_new} tokens at cache_seqlens up to {int(seqlens.max())} "
                                 f"overflows the cache of {k_cache.shape[1]} rows")
            rows = cache_rows.view(B, 1).expand(B, s_new)
            k_cache[rows, pos] = k.to(k_cache.dtype)
            v_cache[rows, pos] = v.to(v_cache.dtype)
        else:
            bs = k_cache.shape[1]
            if int(pos.max()) >= block_table.shape[1] * bs:
                raise ValueError(f"k: appending {s_new} tokens overflows block_table of "
                                 f"{block_table.shape[1]} blocks of {bs}")
            blocks = torch.gather(block_table.to(device=device, dtype=torch.int64), 1, pos // bs)
            k_cache[blocks, pos % bs] = k.to(k_cache.dtype)
            v_cache[blocks, pos % bs] = v.to(v_cache.dtype)
    out = torch.zeros(B, Sq, H, v_cache.shape[-1], dtype=q.dtype, device=device)
    lse = torch.full((B, H, Sq), float("inf"), dtype=torch.float32, device=device)
    seqlens_h, leftpad_h, rows_h = seqlens.tolist(), leftpad.tolist(), cache_rows.tolist()
    for b in range(B):
        start, end = leftpad_h[b], seqlens_h[b] + s_new
        if block_table is None:
            kb = k_cache[rows_h[b], start:end].unsqueeze(0)
            vb = v_cache[rows_h[b], start:end].unsqueeze(0)
        else:
            flat = _paged_rows(block_table, b, end, k_cache.shape[1], device)[start:]
            kb = k_cache.reshape(-1, *k_cache.shape[2:]).index_select(0, flat).unsqueeze(0)
            vb = v_cache.reshape(-1, *v_cache.shape[2:]).index_select(0, flat).unsqueeze(0)
        plan = _make_plan(q[b:b + 1], kb, scale=call.softmax_scale, window_left=call.window_left,
                          window_right=call.window_right, softcap=call.softcap,
                          slopes=_slopes_for(alibi_slopes, [b], 1, H), dropout_p=0.0, rng_state=None,
                          b_idx=None, max_seqlen_q=Sq, sink=sink)
        ob, lb, _ = _fwd_plan(q[b:b + 1], kb, vb, plan, False)
        out[b] = ob[0]
        lse[b] = lb[0]
    return out, lse
