"""The attention dropout mask (flash_attn/dropout.py) against an independent implementation of its documented
hash, and statistical checks that it is a mask of independent draws.

flash_attn.testing's oracle mask and the reference backend both call flash_attn.dropout.keep_mask, so the
other dropout tests cannot see a fault inside it (one mask for every head passes them all). This file does
not use keep_mask to judge keep_mask: ``_documented_keep`` re-implements the docstring's algorithm on
numpy uint32 words (wrapping multiplies, as the Triton kernels compute it), where the implementation masks
int64 products, and the statistics check independence across heads, batch entries, rows, columns, seeds
and the sequences of a varlen batch, and the keep fraction, with tolerances from the binomial standard
deviation. The reference backend and the Triton backend (the interpreter on CPU) are checked against the
independent mask end to end (the sign of their returned probabilities).
"""
import math

import numpy as np
import pytest
import torch

from flash_attn import dropout as fa_dropout
from flash_attn import reference, testing
from flash_attn.testing import backend_fwd

_MULT = np.uint32(0x45D9F3B)


def _fmix32(x):
    """The documented finaliser on uint32 words: x ^= x >> 16; x *= 0x45d9f3b (twice); x ^= x >> 16."""
    x = np.asarray(x, dtype=np.uint32)
    for _ in range(2):
        x = x ^ (x >> np.uint32(16))
        x = x * _MULT  # wraps modulo 2**32
    return x ^ (x >> np.uint32(16))


def _documented_keep(seed0, seed1, b, h, i, j, num_heads, max_seqlen_q, p):
    """keep[b, h, i, j] per flash_attn/dropout.py's docstring, broadcast over numpy index arrays."""
    b, h, i, j = (np.asarray(t, dtype=np.uint64) for t in (b, h, i, j))
    row = (b * np.uint64(num_heads) + h) * np.uint64(max_seqlen_q) + i
    lo = (row & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (row >> np.uint64(32)).astype(np.uint32)
    h1 = _fmix32(lo ^ np.uint32(seed0))
    h2 = _fmix32(h1 ^ np.uint32(seed1) ^ hi)
    u = _fmix32(h2 ^ j.astype(np.uint32))
    return u.astype(np.uint64) >= np.uint64(math.floor(p * 2**32))


def _grid(B, H, Sq, Sk):
    return (np.arange(B).reshape(-1, 1, 1, 1), np.arange(H).reshape(1, -1, 1, 1),
            np.arange(Sq).reshape(1, 1, -1, 1), np.arange(Sk).reshape(1, 1, 1, -1))


def _impl(seeds, b, h, i, j, num_heads, max_seqlen_q, p):
    t = [torch.as_tensor(np.asarray(x, dtype=np.int64)) for x in (b, h, i, j)]
    return fa_dropout.keep_mask(torch.tensor(seeds, dtype=torch.int64), *t, num_heads, max_seqlen_q, p).numpy()


def test_fmix32_known_values():
    # the finaliser on a few words, worked out by hand with Python's unbounded ints
    for x in (0, 1, 0xFFFFFFFF, 0x12345678, 2**31):
        y = x
        for _ in range(2):
            y = ((y ^ (y >> 16)) * 0x45D9F3B) % 2**32
        y ^= y >> 16
        assert int(_fmix32(np.array([x]))[0]) == y, hex(x)
    assert int(_fmix32(np.array([0]))[0]) == 0


@pytest.mark.parametrize("B,H,Sq,Sk,msq,seeds,p", [
    (2, 3, 5, 7, 5, (0, 0), 0.25),
    (1, 4, 33, 17, 33, (987654321, 123456789), 0.1),
    (3, 2, 9, 40, 16, (2**31 - 2, 1), 0.5),     # max_seqlen_q larger than the rows present (varlen)
    (2, 2, 8, 8, 8, (5, 77), 0.9),
    (2, 2, 8, 8, 8, (5, 77), 0.0),              # keeps everything
    (1, 1, 4, 300, 4, (31337, 42), 0.17),
])
def test_keep_mask_is_the_documented_hash(B, H, Sq, Sk, msq, seeds, p):
    b, h, i, j = _grid(B, H, Sq, Sk)
    want = _documented_keep(*seeds, b, h, i, j, H, msq, p)
    got = _impl(seeds, b, h, i, j, H, msq, p)
    assert got.shape == want.shape == (B, H, Sq, Sk)
    assert np.array_equal(got, want), f"{(got != want).sum()} of {want.size} elements differ"
    if p == 0.0:
        assert want.all()


def test_keep_mask_rows_beyond_32_bits():
    # row = (b * H + h) * max_seqlen_q + i passes 2**32: its high word enters h2
    H, msq = 3, 2**31
    b = np.array([0, 1, 2, 5]).reshape(-1, 1, 1, 1)
    h, i = np.arange(H).reshape(1, -1, 1, 1), np.array([0, 1, 2**31 - 1]).reshape(1, 1, -1, 1)
    j = np.arange(64).reshape(1, 1, 1, -1)
    assert ((b * H + h) * msq + i).max() >= 2**34
    want = _documented_keep(12345, 678, b, h, i, j, H, msq, 0.5)
    assert np.array_equal(_impl((12345, 678), b, h, i, j, H, msq, 0.5), want)


def test_threshold_is_floor_of_p_times_2_pow_32():
    for p in (0.0, 0.1, 0.5, 1 / 3, 0.999999):
        assert fa_dropout.threshold(p) == math.floor(p * 2**32), p


def test_oracle_mask_dense_and_varlen_is_the_documented_hash():
    seeds, p = (424242, 99), 0.3
    B, H, S = 3, 2, 12
    got = testing.dropout_keep_mask(torch.tensor(seeds), p, B, H, S, S + 3).numpy()
    assert np.array_equal(got, _documented_keep(*seeds, *_grid(B, H, S, S + 3), H, S, p))
    # varlen: positions within each sequence, rows keyed with max_seqlen_q, False outside a sequence
    lq, lk = [5, 0, 12], [7, 3, 9]
    cu_q = torch.tensor([0, *np.cumsum(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(lk)], dtype=torch.int32)
    got = testing.dropout_keep_mask(torch.tensor(seeds), p, B, H, S, 9, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                    max_seqlen_q=S).numpy()
    want = _documented_keep(*seeds, *_grid(B, H, S, 9), H, S, p)
    inside = ((np.arange(S)[None, :, None] < np.array(lq)[:, None, None])
              & (np.arange(9)[None, None, :] < np.array(lk)[:, None, None]))[:, None]
    assert np.array_equal(got, want & inside)


# ----------------------------------------------------------------------------------------------------
# The backends' masks, end to end (the sign of the returned probabilities)

def _fwd_kwargs(D, p, seeds, **kw):
    return dict(dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                     block_table=None, softmax_scale=1.0 / math.sqrt(D), causal=False, window_left=-1,
                     window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=p,
                     rng_state=torch.tensor(seeds, dtype=torch.int64)), **kw)


def _backend(name):
    if name == "torch":
        return reference
    tb = pytest.importorskip("flash_attn.triton.backend")
    if tb.unavailable_reason() is not None:
        pytest.skip(tb.unavailable_reason())
    return tb


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backend_dense_mask_is_the_documented_hash(name):
    be = _backend(name)
    device = "cuda" if torch.cuda.is_available() and name == "triton" else "cpu"
    B, Sq, Sk, H, Hk, D, p, seeds = 2, 9, 13, 4, 2, 16, 0.4, (20240607, 31)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, s, hh, D, generator=g).to(device) for s, hh in ((Sq, H), (Sk, Hk), (Sk, Hk)))
    _, _, probs = backend_fwd(be, q, k, v, return_probs=True, **_fwd_kwargs(D, p, seeds, max_seqlen_q=Sq, max_seqlen_k=Sk))
    assert probs.shape == (B, H, Sq, Sk) and (probs != 0).all()
    want = _documented_keep(*seeds, *_grid(B, H, Sq, Sk), H, Sq, p)
    assert np.array_equal((probs > 0).cpu().numpy(), want)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backend_varlen_mask_is_the_documented_hash(name):
    be = _backend(name)
    device = "cuda" if torch.cuda.is_available() and name == "triton" else "cpu"
    lens, H, D, p, seeds = [6, 0, 11, 3], 2, 16, 0.35, (77, 2**31 - 5)
    B, S = len(lens), max(lens)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32).to(device)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), H, D, generator=g).to(device) for _ in range(3))
    _, _, probs = backend_fwd(be, q, k, v, return_probs=True,
                         **_fwd_kwargs(D, p, seeds, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S))
    assert probs.shape == (B, H, S, S)
    want = _documented_keep(*seeds, *_grid(B, H, S, S), H, S, p)
    inside = ((np.arange(S)[None, :, None] < np.array(lens)[:, None, None])
              & (np.arange(S)[None, None, :] < np.array(lens)[:, None, None]))[:, None].repeat(H, 1)
    probs = probs.cpu().numpy()
    assert (probs[~inside] == 0).all() and (probs[inside] != 0).all()
    assert np.array_equal(probs[inside] > 0, want[inside])


# ----------------------------------------------------------------------------------------------------
# Statistics of the implementation's mask

SIGMAS = 5.0  # about one failure in 3.5 million per check for a correct mask


def _mask(seeds=(1234, 5678), p=0.5, B=2, H=4, Sq=64, Sk=64, msq=None):
    b, h, i, j = (torch.arange(n).view(*[-1 if d == k else 1 for d in range(4)]) for k, n in enumerate((B, H, Sq, Sk)))
    return fa_dropout.keep_mask(torch.tensor(seeds), b, h, i, j, H, Sq if msq is None else msq, p).expand(B, H, Sq, Sk)


def _assert_fraction(x, expect, what):
    n = x.numel()
    frac = x.float().mean().item()
    sigma = math.sqrt(expect * (1 - expect) / n)
    assert abs(frac - expect) <= SIGMAS * sigma + 1e-12, f"{what}: {frac:.4f} over {n}, expected {expect:.4f} " \
                                                         f"+- {SIGMAS} x {sigma:.4f}"


def _assert_independent(a, b, p, what):
    """Two masks of independent keep draws agree with probability p^2 + (1-p)^2."""
    assert a.shape == b.shape
    assert not torch.equal(a, b), f"{what}: identical masks"
    _assert_fraction(a == b, p * p + (1 - p) * (1 - p), f"{what}: agreement")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_keep_fraction(p):
    m = _mask(p=p, B=2, H=4, Sq=64, Sk=96)
    _assert_fraction(m, 1 - p, f"keep fraction at p={p}")
    for h in range(4):  # each head on its own, too
        _assert_fraction(m[:, h], 1 - p, f"keep fraction of head {h} at p={p}")


@pytest.mark.parametrize("p", [0.3, 0.5])
def test_heads_are_independent(p):
    m = _mask(p=p, B=2, H=4, Sq=48, Sk=64)
    for h0 in range(4):
        for h1 in range(h0 + 1, 4):
            _assert_independent(m[:, h0], m[:, h1], p, f"heads {h0} and {h1}")


@pytest.mark.parametrize("p", [0.3, 0.5])
def test_batch_entries_are_independent(p):
    m = _mask(p=p, B=3, H=2, Sq=48, Sk=64)
    for b0 in range(3):
        for b1 in range(b0 + 1, 3):
            _assert_independent(m[b0], m[b1], p, f"batch entries {b0} and {b1}")


def test_rows_and_columns_are_independent():
    p = 0.5
    m = _mask(p=p, B=1, H=2, Sq=64, Sk=128)
    _assert_independent(m[:, :, 1:], m[:, :, :-1], p, "adjacent rows")
    _assert_independent(m[..., 1:], m[..., :-1], p, "adjacent columns")
    _assert_independent(m[:, :, 0:32], m[:, :, 32:64], p, "rows 32 apart")
    # a row's mask is not its neighbour's shifted by a column either
    _assert_independent(m[:, :, 1:, 1:], m[:, :, :-1, :-1], p, "diagonal neighbours")


def test_seeds_change_the_mask_independently():
    p = 0.5
    base = _mask(seeds=(1234, 5678), p=p)
    assert torch.equal(base, _mask(seeds=(1234, 5678), p=p))  # a pure function of its inputs
    _assert_independent(base, _mask(seeds=(1235, 5678), p=p), p, "seed0 + 1")
    _assert_independent(base, _mask(seeds=(1234, 5679), p=p), p, "seed1 + 1")
    _assert_independent(base, _mask(seeds=(5678, 1234), p=p), p, "seeds swapped")


def test_varlen_sequences_are_independent():
    # the sequences of a varlen batch are batch entries b of the row key: equal-length ones must not share
    # a mask, and one keyed with another max_seqlen_q is a different mask
    p, lens, H = 0.5, [40, 40, 25], 2
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    m = testing.dropout_keep_mask(torch.tensor([99, 3]), p, len(lens), H, 40, 40, cu_seqlens_q=cu,
                                  cu_seqlens_k=cu, max_seqlen_q=40)
    _assert_independent(m[0], m[1], p, "sequences 0 and 1")
    _assert_independent(m[0, :, :25, :25], m[2, :, :25, :25], p, "sequences 0 and 2")
    _assert_fraction(m[1], 1 - p, "keep fraction of sequence 1")
    assert not m[2, :, 25:].any() and not m[2, :, :, 25:].any()


def test_new_rng_state_is_two_replayable_31_bit_seeds():
    """Two int64 seeds, both in [0, 2**31 - 1) so every kernel can take them as int32, drawn from torch's default
    generator: ``torch.manual_seed`` replays them and successive calls differ."""
    torch.manual_seed(123)
    draws = torch.stack([fa_dropout.new_rng_state() for _ in range(200)])
    assert draws.shape == (200, 2) and draws.dtype == torch.int64
    assert int(draws.min()) >= 0 and int(draws.max()) < 2**31 - 1
    assert int(draws.max()) > 2**30  # the full 31-bit range is used, not a narrow one
    assert len({tuple(d) for d in draws.tolist()}) == 200
    assert (draws[:, 0] != draws[:, 1]).any()
    torch.manual_seed(123)
    assert torch.equal(fa_dropout.new_rng_state(), draws[0])


def test_keep_mask_keeps_a_hash_equal_to_the_threshold():
    """keep iff u >= floor(p * 2**32): choose p so that the threshold is exactly one element's hash."""
    rng = torch.tensor([11, 22])
    b, h, i, j = (torch.tensor(0),) * 4
    seed0, seed1 = 11, 22
    row = 0
    u = int(fa_dropout.hash32(fa_dropout.hash32(fa_dropout.hash32(torch.tensor((row & 0xFFFFFFFF) ^ seed0))
                                                 ^ seed1 ^ (row >> 32)) ^ 0))
    p = u / 2**32
    assert fa_dropout.threshold(p) == u
    assert bool(fa_dropout.keep_mask(rng, b, h, i, j, 1, 1, p))
    assert not bool(fa_dropout.keep_mask(rng, b, h, i, j, 1, 1, (u + 1) / 2**32))
