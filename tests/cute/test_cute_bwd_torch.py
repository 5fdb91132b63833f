"""flash_attn.cute.bwd_torch: the flash-attn-4 package's plain-PyTorch attention backward, on CPU, against
autograd through a naive fp64 oracle (full score matrix, the literal window rule, softcap, a sink logit per
head): dense and varlen (seqused, empty sequences, unused trailing rows), causal, windows with negative and
unbounded sides, GQA / MQA, the lse gradient (dlse), fp32 and fp64, tiles small enough that chunking and
tile skipping run, empty shapes, determinism, and that no whole score matrix is materialised."""
import math
import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import bwd_torch  # noqa: E402

UNB = bwd_torch.UNBOUNDED
F64 = torch.float64


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(bwd_torch, "BLOCK_Q", 8)
    monkeypatch.setattr(bwd_torch, "BLOCK_K", 16)


# ----------------------------------------------------------------------------------------------------
# The oracle


def _visible(Lq, Lk, causal, wl, wr):
    """(Lq, Lk) bool: query i sees key j, by the rule as written (off = Lk - Lq)."""
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    off = Lk - Lq
    mask = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        mask &= j <= i + off
    if wl < UNB:
        mask &= j - (i + off) >= -wl
    if wr < UNB:
        mask &= j - (i + off) <= wr
    return mask


def _oracle_seq(q, k, v, scale, causal, wl, wr, softcap, sink):
    """One sequence, differentiable: q (Lq, H, D), k (Lk, Hk, D), v (Lk, Hk, Dv) -> out (Lq, H, Dv),
    lse (H, Lq), with lse = +inf on rows that see nothing (no key, no sink)."""
    Lq, H, _ = q.shape
    Lk, Hk, _ = k.shape
    g = H // Hk
    kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    raw = torch.einsum("ihd,jhd->hij", q, kk) * scale
    s = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    mask = _visible(Lq, Lk, causal, wl, wr).expand(H, Lq, Lk)
    if sink is not None:
        s = torch.cat([s, sink[:, None, None].expand(H, Lq, 1)], -1)
        mask = torch.cat([mask, torch.ones(H, Lq, 1, dtype=torch.bool)], -1)
    seen = mask.any(-1)
    logits = torch.where(mask, s, -math.inf)
    logits = torch.where(seen[..., None], logits, 0.0)  # keeps empty rows' logsumexp and its gradient finite
    lse = torch.logsumexp(logits, -1)
    p = torch.where(mask, torch.exp(logits - lse[..., None]), 0.0)[..., :Lk]
    out = torch.einsum("hij,jhd->ihd", p, vv)
    return out, torch.where(seen, lse, math.inf)


def _case(dtype, *, B=2, Sq=37, Sk=53, H=4, Hk=2, D=16, Dv=None, causal=False, wl=UNB, wr=UNB, softcap=0.0,
          sink=False, dlse=True, varlen=None, trailing=(0, 0), seed=0, qscale=1.0):
    """Runs the oracle and autograd, then bwd_torch.backward on the oracle's out / lse; returns
    ((dq, dk, dv) expected in fp64, (dq, dk, dv) of backward, the backward's arguments).
    varlen: [(span_q, used_q, span_k, used_k), ...]; trailing: unused rows (q, k) after the last sequence."""
    gen = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    if varlen is None:
        qshape, kshape = (B, Sq, H), (B, Sk, Hk)
    else:
        qshape = (sum(s[0] for s in varlen) + trailing[0], H)
        kshape = (sum(s[2] for s in varlen) + trailing[1], Hk)

    def rnd(*shape, mult=1.0):  # values exactly representable in dtype, so both sides see the same inputs
        return (torch.randn(*shape, generator=gen, dtype=F64) * mult).to(dtype).to(F64)

    q = rnd(*qshape, D, mult=qscale).requires_grad_()
    k = rnd(*kshape, D).requires_grad_()
    v = rnd(*kshape, Dv).requires_grad_()
    dout = rnd(*qshape, Dv)
    sink_t = rnd(H) if sink else None
    scale = D ** -0.5
    opts = (scale, causal, wl, wr, softcap, sink_t)
    if varlen is None:
        outs = [_oracle_seq(q[b], k[b], v[b], *opts) for b in range(B)]
        out = torch.stack([o for o, _ in outs]) if B else q.new_zeros(B, Sq, H, Dv)
        lse = torch.stack([l for _, l in outs]) if B else q.new_zeros(B, H, Sq)
        wlse = rnd(*lse.shape)
        extra = {}
        out_fed, lse_fed, dout_fed, wlse_fed = out.detach().clone(), lse.detach().clone(), dout, wlse
    else:
        cu_q, cu_k = [0], [0]
        for span_q, _, span_k, _ in varlen:
            cu_q.append(cu_q[-1] + span_q)
            cu_k.append(cu_k[-1] + span_k)
        out = q.new_zeros(qshape[0], H, Dv)
        lse = q.new_zeros(H, qshape[0])
        used_rows = torch.zeros(qshape[0], dtype=torch.bool)
        for b, (_, used_q, _, used_k) in enumerate(varlen):
            rq, rk = slice(cu_q[b], cu_q[b] + used_q), slice(cu_k[b], cu_k[b] + used_k)
            out[rq], lse[:, rq] = _oracle_seq(q[rq], k[rk], v[rk], *opts)
            used_rows[rq] = True
        wlse = rnd(*lse.shape)
        # Unused rows get garbage out / lse / dout / dlse: backward must not read them.
        garbage = ~used_rows
        out_fed = torch.where(garbage[:, None, None], rnd(*out.shape), out.detach())
        lse_fed = torch.where(garbage[None, :], rnd(*lse.shape), lse.detach())
        dout_fed = torch.where(garbage[:, None, None], rnd(*dout.shape), dout)
        wlse_fed = torch.where(garbage[None, :], rnd(*lse.shape), wlse)
        dout = torch.where(garbage[:, None, None], 0.0, dout)
        extra = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
                     cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
                     seqused_q=torch.tensor([s[1] for s in varlen], dtype=torch.int32),
                     seqused_k=torch.tensor([s[3] for s in varlen], dtype=torch.int32))
    loss = (out * dout).sum()
    if dlse:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(wlse).sum()
    want = torch.autograd.grad(loss, (q, k, v), allow_unused=True, materialize_grads=True) if loss.requires_grad \
        else (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
    lse_dtype = F64 if dtype == F64 else torch.float32
    args = dict(dout=dout_fed.to(dtype), q=q.detach().to(dtype), k=k.detach().to(dtype), v=v.detach().to(dtype),
                out=out_fed.to(dtype), lse=lse_fed.to(lse_dtype), softmax_scale=scale, causal=causal,
                window_left=wl, window_right=wr, softcap=softcap,
                dlse=wlse_fed.to(lse_dtype) if dlse else None, **extra)
    got = bwd_torch.backward(**args)
    return want, got, args


def _assert_grads(want, got, dtype):
    tol = 1e-10 if dtype == F64 else 1e-4
    for name, w, g in zip("qkv", want, got):
        assert g.dtype == dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"d{name} not finite"
        torch.testing.assert_close(g.to(F64), w, atol=tol, rtol=tol, msg=lambda m: f"d{name}: {m}")


# ----------------------------------------------------------------------------------------------------
# Dense

DENSE = {
    "full": {},
    "full_sq_gt_sk": dict(Sq=53, Sk=37),
    "causal": dict(causal=True),
    "causal_sq_gt_sk": dict(causal=True, Sq=53, Sk=37),  # the first 16 rows see no key: lse = inf
    "window": dict(wl=5, wr=3),
    "window_neg_left": dict(wl=-3, wr=12),
    "window_neg_right": dict(wl=12, wr=-4, Sq=53, Sk=37),
    "window_left_only": dict(wl=7),
    "window_right_only": dict(wr=2, Sq=53, Sk=37),
    "window_beyond_unbounded": dict(wl=1 << 40, wr=3),
    "window_none_visible": dict(wl=-UNB, wr=UNB),
    "causal_window": dict(causal=True, wl=6),
    "causal_window_both": dict(causal=True, wl=9, wr=4),
    "causal_window_neg_right": dict(causal=True, wl=9, wr=-2),
    "softcap": dict(softcap=3.0, qscale=3.0),
    "softcap_causal_window": dict(softcap=2.0, qscale=3.0, causal=True, wl=10),
    "sink": dict(sink=True),
    "sink_empty_rows": dict(sink=True, wl=4, wr=-1, Sq=53, Sk=37),  # rows that see no key: lse = sink
    "mqa": dict(Hk=1, causal=True),
    "mha": dict(Hk=4, wl=3, wr=8),
    "dv_ne_d": dict(Dv=24, causal=True),
    "no_dlse": dict(dlse=False, causal=True),
    "no_dlse_sink": dict(dlse=False, sink=True, wl=3, wr=3),
    "single_batch": dict(B=1, Sq=5, Sk=70, wl=20, wr=-10),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(DENSE))
def test_dense(small_blocks, name, dtype):
    want, got, _ = _case(dtype, **DENSE[name])
    _assert_grads(want, got, dtype)


def test_dense_default_blocks():
    want, got, _ = _case(F64, Sq=37, Sk=53, causal=True, wl=11, softcap=4.0)
    _assert_grads(want, got, F64)


def test_dlse_matters(small_blocks):
    # The lse term changes the gradients, so a backward that ignored dlse would fail the dense cases.
    want, _, args = _case(F64, causal=True)
    args["dlse"] = None
    got = bwd_torch.backward(**args)
    assert not torch.allclose(got[0].to(F64), want[0], atol=1e-3)


# ----------------------------------------------------------------------------------------------------
# Varlen

SEQS = [(20, 17, 30, 25),   # seqused shorter than both spans
        (0, 0, 0, 0),       # an empty sequence
        (37, 37, 21, 21),
        (6, 6, 11, 0),      # no key used: lse = inf (or the sink)
        (9, 0, 12, 12),     # no query used: its keys get no gradient
        (11, 11, 40, 40)]
VARLEN = {
    "full": {},
    "causal": dict(causal=True),
    "window_neg_left": dict(wl=-2, wr=9),
    "window_neg_right": dict(wl=15, wr=-3),
    "causal_window": dict(causal=True, wl=5),
    "softcap_sink": dict(softcap=2.5, qscale=3.0, sink=True, wr=4),
    "mqa": dict(Hk=1, wl=UNB, wr=0),
    "no_dlse": dict(dlse=False, causal=True),
}


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen(small_blocks, name, dtype):
    want, got, _ = _case(dtype, varlen=SEQS, trailing=(5, 7), **VARLEN[name])
    _assert_grads(want, got, dtype)


def test_varlen_unused_rows_zero(small_blocks):
    _, (dq, dk, dv), args = _case(F64, varlen=SEQS, trailing=(5, 7), causal=True)
    assert dq[-5:].eq(0).all() and dk[-7:].eq(0).all() and dv[-7:].eq(0).all()
    assert dq[17:20].eq(0).all() and dk[25:30].eq(0).all()  # past seqused in sequence 0
    ks = 30 + 21 + 11
    assert dk[ks:ks + 12].eq(0).all() and dv[ks:ks + 12].eq(0).all()  # the sequence with no query used


def test_varlen_needs_both_cu_seqlens():
    _, _, args = _case(F64, varlen=SEQS[:1])
    args["cu_seqlens_k"] = None
    with pytest.raises(ValueError, match="cu_seqlens"):
        bwd_torch.backward(**args)


# ----------------------------------------------------------------------------------------------------
# Empty shapes, determinism, memory, tile ranges


@pytest.mark.parametrize("kw", [dict(Sq=0), dict(Sk=0), dict(B=0), dict(Sq=0, Sk=0)],
                         ids=["sq0", "sk0", "batch0", "both0"])
def test_dense_empty(small_blocks, kw):
    want, got, _ = _case(torch.float32, causal=True, **kw)
    _assert_grads(want, got, torch.float32)
    assert all(g.eq(0).all() for g in got)


@pytest.mark.parametrize("seqs,trailing", [([], (0, 0)), ([], (3, 4)), ([(0, 0, 0, 0), (4, 0, 5, 0)], (0, 2))],
                         ids=["batch0", "batch0_rows", "all_empty"])
def test_varlen_empty(small_blocks, seqs, trailing):
    want, got, _ = _case(torch.float32, varlen=seqs, trailing=trailing, causal=True)
    _assert_grads(want, got, torch.float32)
    assert all(g.eq(0).all() for g in got)


def test_deterministic(small_blocks):
    _, got, args = _case(torch.float32, Hk=1, wl=9, wr=-1, softcap=3.0)
    again = bwd_torch.backward(**args)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    _, got, args = _case(torch.float32, varlen=SEQS, trailing=(5, 7), causal=True)
    again = bwd_torch.backward(**args)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


class _LargestResult(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for r in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(r, torch.Tensor):
                self.largest = max(self.largest, r.numel())
        return result


def test_no_full_score_matrix(small_blocks):
    B, S, H, D = 2, 96, 4, 8
    _, _, args = _case(torch.float32, B=B, Sq=S, Sk=S, H=H, Hk=2, D=D)
    with _LargestResult() as mode:
        bwd_torch.backward(**args)
    # Tiles are B * H * 8 * 16; the whole score matrix would be B * H * S * S.
    assert mode.largest <= max(B * S * H * D, B * H * 8 * 16), mode.largest


def test_key_range_tight():
    # _key_range must cover every key a query tile sees (else gradients are lost) and no more at its ends
    # (else tiles are not skipped); _tile_mask must equal the rule, or be None only for a wholly visible tile.
    gen = torch.Generator().manual_seed(1)
    sizes = [UNB, 1 << 35, 0, 1, 3, 7, 20, -1, -3, -10, -UNB]
    for _ in range(600):
        Lq, Lk = (int(x) for x in torch.randint(0, 30, (2,), generator=gen))
        wl, wr = (sizes[int(x)] for x in torch.randint(0, len(sizes), (2,), generator=gen))
        causal = bool(torch.randint(0, 2, (1,), generator=gen))
        if Lq == 0:
            continue
        i0 = int(torch.randint(0, Lq, (1,), generator=gen))
        i1 = int(torch.randint(i0 + 1, Lq + 1, (1,), generator=gen))
        vis = _visible(Lq, Lk, causal, wl, wr)[i0:i1]
        cols = vis.any(0).nonzero().flatten()
        lo, hi = bwd_torch._key_range(i0, i1, Lq, Lk, causal, wl, wr)
        ctx = (Lq, Lk, causal, wl, wr, i0, i1, lo, hi)
        if len(cols) == 0:
            assert lo >= hi, ctx
            continue
        assert (lo, hi) == (int(cols[0]), int(cols[-1]) + 1), ctx
        j0 = int(torch.randint(lo, hi, (1,), generator=gen))
        j1 = int(torch.randint(j0 + 1, hi + 1, (1,), generator=gen))
        mask = bwd_torch._tile_mask(i0, i1, j0, j1, Lq, Lk, causal, wl, wr, "cpu")
        want = vis[:, j0:j1]
        assert (mask is None) == bool(want.all()), ctx  # no mask work on wholly visible tiles
        assert mask is None or torch.equal(mask, want), ctx


def test_shape_errors():
    _, _, args = _case(torch.float32, B=1, Sq=4, Sk=5)
    bad = [dict(k=args["k"][..., :8]), dict(v=args["v"][:, :3]), dict(lse=args["lse"][..., :3]),
           dict(dlse=args["dlse"][:, :1]), dict(out=args["out"][..., :3]), dict(dout=args["dout"][:, :2]),
           dict(q=args["q"][0]),
           dict(k=args["k"][:, :, :1].expand(1, 5, 3, 16), v=args["v"][:, :, :1].expand(1, 5, 3, 16))]
    for change in bad:
        with pytest.raises(ValueError):
            bwd_torch.backward(**{**args, **change})


def test_unbounded_value():
    assert bwd_torch.UNBOUNDED == 1 << 30


def test_empty_rows_any_convention(small_blocks):
    # Rows that see no key may carry lse = -inf as well as +inf, and any dlse there: their gradient is 0, no NaN.
    want, got, args = _case(F64, causal=True, Sq=53, Sk=38)  # rows 0..14 see nothing; tile 8..15 is mixed
    empty = torch.isinf(args["lse"])
    assert empty[..., 8:15].all() and not empty[..., 15].any()
    args["lse"] = torch.where(empty, -math.inf, args["lse"])
    args["dlse"] = torch.where(empty, math.inf, args["dlse"])
    _assert_grads(want, bwd_torch.backward(**args), F64)
