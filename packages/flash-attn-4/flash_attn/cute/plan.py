"""The per-call plan: FA4's mask arguments resolved, the padded head dim, the pack-GQA group, the split-KV part
count and the length class (short / long keys) that picks among a head dim's kernels. Host arithmetic only: no
kernel is touched here.
"""
import functools
import operator

import torch

from flash_attn.cute import config, settings
from flash_attn.cute.config import LONG, LONG_SK, PACK_GROUPS, SHORT_SK, SUPPORTED_HEAD_DIMS


_UNBOUNDED = 1 << 30  # FlashFwdSm90.UNBOUNDED: a window side with no limit


# Head dims with a short-key kernel, and (head dim, causal) pairs with a long-key one (config.short_dims, LONG): the
# per-call paths check membership only. A call of another length class, or one whose overrides make both kernels
# one configuration, runs the same compiled kernel (kernels.fwd_kernel).
_SHORT_DIMS = config.short_dims()
_FWD_LONG_ON = frozenset(LONG)


def _length_kernel(head_dim, causal, seqlen_k, plain):
    """(short, long): whether a dense call (``plain``: no window, softcap or sink) of this key length runs the
    short-key kernel (seqlen_k <= SHORT_SK, see _SHORT_DIMS) or the long-key one (seqlen_k >= LONG_SK,
    see config.LONG). flash_attn_func's fast path and launch._forward_plain inline the same choice."""
    return (plain and seqlen_k <= SHORT_SK and head_dim in _SHORT_DIMS,
            plain and seqlen_k >= LONG_SK and (head_dim, causal) in _FWD_LONG_ON)


# The query rows of the tile the pack / split rules reason with (two consumer warpgroups; the packed kernel's tile),
# the share of the unpacked tile's fill below which packing pays (_pack_helps), and the split rules' bounds
# (_choose_splits): a grid of fewer CTAs than _SPLIT_BELOW x the SM count is split, into at most _MAX_SPLITS parts,
# the fewest that reach _SPLIT_EFFICIENCY of the best wave efficiency.
_RULE_BLOCK_M = 128
_PACK_FILL = 0.9
_SPLIT_BELOW = 0.8
_MAX_SPLITS = 128
_SPLIT_EFFICIENCY = 0.85


def _pack_helps(group, seqlen_q):
    """pack_gqa=None's rule: pack the group's query heads when the packed tiles' rows hold clearly more real queries
    than the unpacked ones' (positions per tile _RULE_BLOCK_M unpacked, _RULE_BLOCK_M / group packed): a short query
    sequence (decoding: 1 to a few positions) fills 1 / 128 of an unpacked tile and group / 128 of a packed one, and
    K / V are then read once per KV head. Varlen calls give their longest sequence's length (a batch of long
    prompts stays unpacked, a decoding batch packs); seqlen_q None (unknown): pack."""
    if seqlen_q is None:
        return True
    if seqlen_q <= 0:
        return False
    rows = _RULE_BLOCK_M // group
    fill = seqlen_q / (-(-seqlen_q // _RULE_BLOCK_M) * _RULE_BLOCK_M)
    packed_fill = seqlen_q / (-(-seqlen_q // rows) * rows)
    return fill < _PACK_FILL * packed_fill


def _pack_group(pack_gqa, H, Hk, seqlen_q=None):
    """The pack_gqa group of a call: H // Hk when the group is one of PACK_GROUPS and pack_gqa is true, or None
    (FA4's "choose"), the plan rule pack_gqa_auto and _pack_helps(group, seqlen_q) (varlen: the longest sequence's);
    else 1 (unpacked: pack_gqa only changes how the work is tiled, not the result). 1 as well when
    FLASH_ATTN_CUTE_DISABLE names pack_gqa."""
    if pack_gqa is False or H == Hk or not (pack_gqa or pack_gqa is None):
        return 1
    if settings.disabled("pack_gqa") or (pack_gqa is None and not config.plan_rules().pack_gqa_auto):
        return 1
    group = H // Hk
    if group not in PACK_GROUPS or (pack_gqa is None and not _pack_helps(group, seqlen_q)):
        return 1
    return group


def _choose_splits(tiles, key_blocks, sms):
    """num_splits=0's rule (FlashAttention's split-KV idea: fill the GPU when the grid is small): 1 when the unsplit
    grid's ``tiles`` CTAs fill at least _SPLIT_BELOW of the ``sms`` SMs, or a tile sees fewer than 2 key blocks;
    else, over the part counts s <= min(key_blocks, _MAX_SPLITS) that change the blocks per part (ceil(key_blocks /
    s)), the wave efficiency of tiles x s CTAs (waves / whole waves), and the fewest parts within
    _SPLIT_EFFICIENCY of the best. Remembered per arguments (a decoding call asks every step; the search costs
    microseconds)."""
    if tiles <= 0 or tiles >= _SPLIT_BELOW * sms or key_blocks < 2:
        return 1
    return _search_splits(tiles, key_blocks, sms, _MAX_SPLITS, _SPLIT_EFFICIENCY)


@functools.lru_cache(maxsize=4096)
def _search_splits(tiles, key_blocks, sms, max_splits, split_efficiency):
    efficiency = {}
    for s in range(1, min(key_blocks, max_splits) + 1):
        if s > 1 and -(-key_blocks // s) == -(-key_blocks // (s - 1)):
            continue  # as many blocks per part as with one part fewer: more parts to merge for nothing
        waves = tiles * s / sms
        efficiency[s] = waves / -(-waves // 1)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= split_efficiency * best)


def _split_count(num_splits, tiles=0, seqlen_k=None, q=None):
    """The split-KV parts of a call: num_splits when > 1, at most one per 128-key block of the ``seqlen_k`` keys a
    tile sees (when given: more parts would be empty, and each costs its fp32 O); when <= 0 (FA4's "choose"),
    _choose_splits for the unsplit grid's ``tiles`` CTAs on the SMs of q's CUDA device (_device_sms); 1 without
    those or when num_splits is 1. 1 as well when FLASH_ATTN_CUTE_DISABLE names split. Splitting changes how the work is divided,
    not the result (beyond fp32 rounding)."""
    try:
        if isinstance(num_splits, bool):
            raise TypeError
        num_splits = operator.index(num_splits)  # ints, numpy / torch integer scalars
    except TypeError:
        raise ValueError(f"num_splits must be an int, got {type(num_splits).__name__}") from None
    if num_splits == 1 or settings.disabled("split"):
        return 1
    if num_splits <= 0:
        sms = _device_sms(q) if tiles and seqlen_k and q is not None else None
        return _choose_splits(tiles, -(-seqlen_k // 128), sms) if sms else 1
    return num_splits if seqlen_k is None else max(1, min(num_splits, -(-seqlen_k // 128)))


def _tile_splits(num_splits, pack, batch, seqlen_q, H, Hk, seqlen_k, window_left, window_right, q):
    """_split_count of a call tiled with the pack_gqa group ``pack``: its unsplit grid's query tiles (batch x heads
    (kv heads when packed) x tiles of _RULE_BLOCK_M // pack query positions) and the keys one tile sees (window
    sizes in the kernels' encoding; a causal call's right size 0)."""
    rows = _RULE_BLOCK_M // pack
    return _split_count(num_splits, batch * (Hk if pack > 1 else H) * -(-seqlen_q // rows),
                        _visible_keys(seqlen_k, rows, window_left, window_right), q)


_sm_counts: dict[int, int] = {}  # CUDA device index -> multiprocessor count


def _device_sms(t):
    """The multiprocessor count of tensor t's CUDA device (cached per device), None for a CPU tensor."""
    if not t.is_cuda:
        return None
    index = t.get_device()
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _visible_keys(seqlen_k, block_q, window_left, window_right):
    """The most keys one tile of block_q query rows sees: seqlen_k, or its window's span."""
    if window_left >= _UNBOUNDED or window_right >= _UNBOUNDED:
        return seqlen_k
    return max(0, min(seqlen_k, window_left + block_q + window_right))


def _options(window_size, softcap, causal):
    """(causal, window_left, window_right, softcap) from FA4's keyword arguments, resolved as FA4 resolves them:
    causal sets the right size to 0; None on a side is no limit (_UNBOUNDED here); other sizes are literal,
    negative ones included (query i sees key j iff j - (i + Sk - Sq) lies in [-left, right], so a negative left
    size starts the window right of the diagonal), except that two given sizes whose sum is negative (FA2's
    (-1, -1) among them) mean no window; what is left of (None, 0) is the causal mask."""
    try:
        left, right = window_size
        left, right = (None if w is None else operator.index(w) for w in (left, right))
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints or None, got {window_size!r}") from None
    softcap = float(softcap or 0.0)
    if softcap < 0.0 or softcap != softcap:
        raise ValueError(f"softcap must be >= 0 (0: off), got {softcap}")
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    if left is None and right == 0:
        return True, _UNBOUNDED, _UNBOUNDED, softcap
    if left is None and right is None:
        return bool(causal), _UNBOUNDED, _UNBOUNDED, softcap
    left = _UNBOUNDED if left is None else max(min(left, _UNBOUNDED), -_UNBOUNDED)
    right = _UNBOUNDED if right is None else max(min(right, _UNBOUNDED), -_UNBOUNDED)
    return False, left, right, softcap


def _window_args(causal, window_left, window_right):
    """(left, right, local) as the kernel takes them (literal sizes, _UNBOUNDED for no limit); local says
    whether the call needs the window variant (causal alone does not)."""
    local = window_left < _UNBOUNDED or (window_right < _UNBOUNDED and not causal)
    if not local:
        return 0, 0, False
    # the kernel's sizes are Int32: a size past _UNBOUNDED is no limit all the same
    left = max(min(window_left, _UNBOUNDED), -_UNBOUNDED)
    return left, 0 if causal else max(min(window_right, _UNBOUNDED), -_UNBOUNDED), True


class HeadDimError(AssertionError, ValueError):
    """A head dim FA4 does not take on Hopper: FA4 raises AssertionError there, so this is one (and a ValueError)."""


def _padded_dim(D, Dv):
    """The kernel head dim that q, k (D) and v (Dv) are zero-padded to when (D, Dv) is not a kernel's own pair:
    the smallest of SUPPORTED_HEAD_DIMS that holds both. Zero columns change no score q.k (the scale stays
    D ** -0.5) and give zero output columns, dropped after the call. HeadDimError for what FA4 refuses on SM90:
    sizes outside [8, 256] or not multiples of 8 (16 bytes of fp16 / bf16)."""
    if not (8 <= D <= 256 and 8 <= Dv <= 256 and D % 8 == 0 and Dv % 8 == 0):
        raise HeadDimError(f"(head_dim, head_dim_v)=({D}, {Dv}) is not supported on SM90. head_dim and head_dim_v "
                           "must be between 8 and 256 and divisible by 8.")
    return next(p for p in SUPPORTED_HEAD_DIMS if p >= max(D, Dv))


def _pad_last(t, size):
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))

