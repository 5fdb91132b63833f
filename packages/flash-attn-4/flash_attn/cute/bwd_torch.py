"""Exact, memory-efficient attention backward in plain PyTorch: the flash-attn-4 package's own backward for the
calls its CuTeDSL backward kernel does not take, so the package trains when installed alone (it imports only
torch and the standard library).

``backward(dout, q, k, v, out, lse, softmax_scale, ...) -> (dq, dk, dv)`` takes the forward's out and lse and
computes, per sequence and query head h (kv head h // (H // Hk)), with off = Lk - Lq (masks align the last
query with the last key):

- visible keys: 0 <= j < Lk and, when causal, j <= i + off, and -window_left <= j - (i + off) <= window_right;
  window sizes are literal (negative ones included), a size >= UNBOUNDED is no limit on its side;
- s_ij = scale * q_i.k_j, or softcap * tanh(scale * q_i.k_j / softcap) when softcap > 0;
- P_ij = exp(s_ij - lse_i) with the given lse (which may hold a sink's term); P = 0 off the mask and on rows
  whose lse is not finite (no visible key);
- dV = P^T dO, dP = dO V^T, delta_i = rowsum(dO_i * O_i) (- dlse_i when dlse is given, as d lse_i / d s_ij =
  P_ij), dS = P * (dP - delta) (times 1 - tanh^2 of the capped argument with softcap),
  dQ = scale * dS K, dK = scale * dS^T Q; dk and dv sum over the query heads of a group.

It computes in fp32 (fp64 for fp64 inputs) over BLOCK_Q x BLOCK_K tiles, never holding a whole score matrix,
skips the key tiles that a query tile's mask hides, and sums in a fixed order (deterministic). Dense layout:
q / out / dout (B, Sq, H, D or Dv), k / v (B, Sk, Hk, D or Dv), lse (B, H, Sq). Varlen (cu_seqlens_q and
cu_seqlens_k, int32 (B + 1,)): q / out / dout (total_q, H, .), k / v (total_k, Hk, .), lse (H, total_q);
sequence b uses seqused_q[b] (else all) rows from cu_seqlens_q[b] and seqused_k[b] (else all) keys from
cu_seqlens_k[b]; the rows and keys no sequence uses get zero gradients.
"""
import torch

UNBOUNDED = 1 << 30  # a window side with no limit (flash_attn.cute.plan._UNBOUNDED)
BLOCK_Q = 128
BLOCK_K = 1024


def _key_range(i0, i1, seqlen_q, seqlen_k, causal, window_left, window_right):
    """[lo, hi): the keys that any of the query rows i0 .. i1 - 1 can see (lo >= hi: none)."""
    off = seqlen_k - seqlen_q
    right = _right_limit(causal, window_right)
    if right is not None and window_left < UNBOUNDED and -window_left > right:
        return 0, 0  # the window is empty on every row
    lo = 0 if window_left >= UNBOUNDED else max(0, i0 + off - window_left)
    hi = seqlen_k if right is None else min(seqlen_k, i1 - 1 + off + right + 1)
    return lo, hi


def _right_limit(causal, window_right):
    """The largest j - (i + off) a query sees, or None for no limit."""
    limits = ([0] if causal else []) + ([window_right] if window_right < UNBOUNDED else [])
    return min(limits) if limits else None


def _tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k, causal, window_left, window_right, device):
    """(i1 - i0, j1 - j0) bool mask of the tile, or None where the tile is wholly visible."""
    off = seqlen_k - seqlen_q
    right = _right_limit(causal, window_right)
    left = None if window_left >= UNBOUNDED else window_left
    # Both bounds are monotone in i, so the tile's corners decide whether any entry is hidden.
    if (left is None or j0 >= i1 - 1 + off - left) and (right is None or j1 - 1 <= i0 + off + right):
        return None
    rel = (torch.arange(j0, j1, device=device)[None, :]
           - torch.arange(i0 + off, i1 + off, device=device)[:, None])  # j - (i + off)
    mask = torch.ones_like(rel, dtype=torch.bool)
    if left is not None:
        mask &= rel >= -left
    if right is not None:
        mask &= rel <= right
    return mask


def _backward_batch(dq, dout, q, k, v, out, lse, dlse, scale, causal, window_left, window_right, softcap, acc):
    """One batch of equal-length sequences: q / out / dout (B, Lq, H, .), k / v (B, Lk, Hk, .), lse / dlse
    (B, H, Lq). Writes dq (in place, q's dtype) and returns dk, dv (B, Lk, Hk, .) in acc."""
    B, Lq, H, D = q.shape
    Lk, Hk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    g = H // Hk
    dk = torch.zeros(B, Hk, Lk, D, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hk, Lk, Dv, dtype=acc, device=q.device)
    block_q, block_k = max(1, int(BLOCK_Q)), max(1, int(BLOCK_K))

    def rows(x, i0, i1):
        # (B, bq, H, X) -> (B, Hk, g * bq, X): one matmul per kv head covers its whole query group, so the group
        # sum of dk / dv is the matmul's own reduction.
        bq = i1 - i0
        x = x[:, i0:i1].to(acc).reshape(B, bq, Hk, g, x.shape[-1]).permute(0, 2, 3, 1, 4)
        return x.reshape(B, Hk, g * bq, x.shape[-1])

    for i0 in range(0, Lq, block_q):
        i1 = min(Lq, i0 + block_q)
        lo, hi = _key_range(i0, i1, Lq, Lk, causal, window_left, window_right)
        if lo >= hi:
            continue  # no visible key: dq stays 0
        bq = i1 - i0
        qc, doc = rows(q, i0, i1), rows(dout, i0, i1)
        lse_c = lse[:, :, i0:i1].to(acc).reshape(B, Hk, g * bq, 1)
        delta = (doc * rows(out, i0, i1)).sum(-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[:, :, i0:i1].to(acc).reshape(B, Hk, g * bq, 1)
        # A row with no visible key (lse = +-inf) has P = 0 from the mask; zeroing its delta keeps a non-finite
        # dlse there from turning 0 * inf into NaN.
        delta = torch.where(torch.isfinite(lse_c), delta, torch.zeros_like(delta))
        dqc = torch.zeros(B, Hk, g * bq, D, dtype=acc, device=q.device)
        for j0 in range(lo, hi, block_k):
            j1 = min(hi, j0 + block_k)
            kc = k[:, j0:j1].to(acc).transpose(1, 2)  # (B, Hk, bk, D)
            vc = v[:, j0:j1].to(acc).transpose(1, 2)
            # In-place steps keep about three (B, Hk, g * bq, bk) tiles alive at once.
            qk = qc @ kc.transpose(-1, -2)  # (B, Hk, g * bq, bk)
            if softcap > 0:
                t = qk.mul_(scale / softcap).tanh_()
                p = (t * softcap).sub_(lse_c).exp_()
            else:
                p = qk.mul_(scale).sub_(lse_c).exp_()
            mask = _tile_mask(i0, i1, j0, j1, Lq, Lk, causal, window_left, window_right, q.device)
            if mask is not None:  # hidden entries may have overflowed to inf: fill, do not multiply
                p.view(B, Hk, g, bq, j1 - j0).masked_fill_(~mask, 0.0)
            dv[:, :, j0:j1] += p.transpose(-1, -2) @ doc
            ds = (doc @ vc.transpose(-1, -2)).sub_(delta).mul_(p)
            if softcap > 0:
                ds.mul_(t.mul_(t).neg_().add_(1.0))
            ds.mul_(scale)
            dqc += ds @ kc
            dk[:, :, j0:j1] += ds.transpose(-1, -2) @ qc
        dq[:, i0:i1] = dqc.reshape(B, Hk, g, bq, D).permute(0, 3, 1, 2, 4).reshape(B, bq, H, D).to(dq.dtype)
    return dk.transpose(1, 2), dv.transpose(1, 2)


def _check(cond, msg):
    if not cond:
        raise ValueError(msg)


def backward(dout, q, k, v, out, lse, softmax_scale, causal=False, window_left=UNBOUNDED, window_right=UNBOUNDED,
             softcap=0.0, dlse=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None):
    """(dq, dk, dv) of attention, in the dtypes of q, k, v; see the module docstring for layouts and formulas."""
    varlen = cu_seqlens_q is not None
    _check(varlen == (cu_seqlens_k is not None), "give both cu_seqlens_q and cu_seqlens_k, or neither")
    nd = 3 if varlen else 4
    layout = "varlen (total, heads, dim)" if varlen else "dense (batch, seqlen, heads, dim)"
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        _check(t.dim() == nd, f"{name} must be {nd}-D for the {layout} layout, got shape {tuple(t.shape)}")
    H, D, Hk, Dv = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    _check(k.shape[-1] == D, f"k's head dim {k.shape[-1]} differs from q's {D}")
    _check(v.shape[:-1] == k.shape[:-1], f"v's shape {tuple(v.shape)} does not match k's {tuple(k.shape)}")
    _check(Hk > 0 and H % Hk == 0, f"q's {H} heads must be a multiple of k / v's {Hk} heads")
    _check(varlen or k.shape[0] == q.shape[0], f"k's batch {k.shape[0]} differs from q's {q.shape[0]}")
    want_out = tuple(q.shape[:-1]) + (Dv,)
    for name, t in (("out", out), ("dout", dout)):
        _check(tuple(t.shape) == want_out, f"{name} must have shape {want_out}, got {tuple(t.shape)}")
    want_lse = (H, q.shape[0]) if varlen else (q.shape[0], H, q.shape[1])
    for name, t in (("lse", lse), ("dlse", dlse)):
        _check(t is None or tuple(t.shape) == want_lse, f"{name} must have shape {want_lse}, got "
               f"{None if t is None else tuple(t.shape)}")
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    softcap = float(softcap or 0.0)
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    opts = (scale, bool(causal), int(window_left), int(window_right), softcap, acc)
    dq = torch.zeros_like(q)
    if not varlen:
        dk, dv = _backward_batch(dq, dout, q, k, v, out, lse, dlse, *opts)
        return dq, torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv)

    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    _check(len(starts_q) == len(starts_k), f"cu_seqlens_q ({len(starts_q)}) and cu_seqlens_k ({len(starts_k)}) "
           "must have the same length")
    batch = max(0, len(starts_q) - 1)
    used = []
    for name, t, starts in (("seqused_q", seqused_q, starts_q), ("seqused_k", seqused_k, starts_k)):
        if t is None:
            used.append([starts[b + 1] - starts[b] for b in range(batch)])
        else:
            _check(tuple(t.shape) == (batch,), f"{name} must have shape ({batch},), got {tuple(t.shape)}")
            used.append(t.tolist())
    for b in range(batch):
        qs, ks, lq, lk = starts_q[b], starts_k[b], used[0][b], used[1][b]
        if lq <= 0:
            continue
        rq, rk = slice(qs, qs + lq), slice(ks, ks + lk)
        dk_b, dv_b = _backward_batch(
            dq[rq].unsqueeze(0), dout[rq].unsqueeze(0), q[rq].unsqueeze(0), k[rk].unsqueeze(0),
            v[rk].unsqueeze(0), out[rq].unsqueeze(0), lse[:, rq].unsqueeze(0),
            None if dlse is None else dlse[:, rq].unsqueeze(0), *opts)  # dq[rq]: a view, written in place
        dk[ks:ks + lk] = dk_b[0].to(dk.dtype)
        dv[ks:ks + lk] = dv_b[0].to(dv.dtype)
    return dq, dk, dv
