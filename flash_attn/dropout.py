"""The dropout mask every backend draws: a counter-based hash, so a mask is a pure function of
(rng_state, sequence b, head h, query i, key j) and the backward pass (or another backend, or a chunk
processed in any order) regenerates exactly the mask of the forward pass without storing it.

hash32 is the 32-bit integer finaliser x ^= x >> 16; x *= 0x45d9f3b; (twice); x ^= x >> 16, on unsigned
32-bit words. Here it runs on int64 tensors, masking to 32 bits after each multiply (the multiplier is
below 2**27, so no product overflows int64). A Triton kernel computes the same on uint32.

    row  = (b * H + h) * max_seqlen_q + i          (i, j positions within sequence b)
    h1   = hash32(seed0 ^ (row & 0xFFFFFFFF))
    h2   = hash32(h1 ^ seed1 ^ (row >> 32))
    u    = hash32(h2 ^ j)
    keep = u >= floor(p * 2**32)
"""
import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B


def hash32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def new_rng_state(device=None) -> torch.Tensor:
    """Two 31-bit seeds drawn from torch's default CPU generator (so ``torch.manual_seed`` replays them)."""
    return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64)


def threshold(p: float) -> int:
    return min(int(p * 2**32), 2**32)


def keep_mask(rng_state, b, h, i, j, num_heads, max_seqlen_q, p):
    """Boolean keep mask broadcast over int64 index tensors b, h, i, j (any broadcastable shapes)."""
    seed0, seed1 = (int(s) for s in rng_state.tolist())
    row = (b * num_heads + h) * max_seqlen_q + i
    h1 = hash32((row & _MASK32) ^ seed0)
    h2 = hash32(h1 ^ seed1 ^ (row >> 32))
    u = hash32(h2 ^ j)
    return u >= threshold(p)
