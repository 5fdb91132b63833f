"""FlashAttention-4's Python API over the CuTeDSL kernels: argument checks, compiled kernels cached in
memory and on disk, and the launch on CUDA tensors.

Kernels are compiled from fake tensors whose batch, sequence lengths, head counts and strides are
symbolic, so a new shape never recompiles. They use CuTeDSL's TVM-FFI calling convention
(``--enable-tvm-ffi``): the compiled function takes torch tensors directly (DLPack through TVM-FFI's C
exchange API, well under a microsecond for all arguments), checks dtypes, shapes, strides, alignment and
device in C, sets the device when it differs from the current one, and launches on torch's current
stream of the tensors' device (``make_fake_stream(use_tvm_ffi_env_stream=True)``). A kernel is looked up
in a dict by (dtype, head dim, causal, arch, local, softcap[, varlen][, "sink"]); a miss loads it from the disk
cache (``cache.py``: a shared library that loads without importing the CuTeDSL compiler), else compiles
it and writes it there. ``python -m flash_attn.cute.precompile`` fills the disk cache ahead of time,
without a GPU.
"""
import contextlib
import math
import operator
import os
import time

import torch

from flash_attn.cute import autograd as _autograd
from flash_attn.cute import cache
from flash_attn.cute.combine import SchedulerMetadataTensorsTorch, flash_attn_combine, get_scheduler_metadata  # noqa: F401

# Forward head dims of this package's API. The root dispatcher sends it all five (FLASH_ATTN_CUTE_FWD_HDIMS,
# when set, picks among 96 / 192 / 256: backend.py). The backward kernel has 64 and 128 (_BWD_BLOCK_M).
_SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
_ARCHS = {(9, 0): "sm_90a"}
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_F32 = torch.float32
_kernels: dict[tuple, object] = {}  # (dtype, head dim, causal, arch, local, softcap[, True][, "sink"]) -> fn
_origins: dict[tuple, str] = {}  # same key -> "so" / "o" (loaded from disk), "compiled" or "compiled-dlpack"
_device_archs: dict[int, object] = {}  # CUDA device index -> arch name, or None (no kernels for it)
_have_tvm_ffi: list = []
_MAX_ELEMS = 2 ** 31  # the kernels' 32-bit offsets address tensors below this many elements
_MAX_GRID_Z = 65535  # CUDA's limit on a grid's z extent: the kernels' batch entries (x split-KV parts) per launch
_UNBOUNDED = 1 << 30  # FlashFwdSm90.UNBOUNDED: a window side with no limit
# K and V ring depth per head dim (shared memory: Q tile + stages x (K tile + V tile) <= 227 KB,
# FlashFwdSm90.smem_bytes). $FLASH_ATTN_CUTE_STAGES overrides it, for every head dim or per head dim
# ("256:2,128:3"; a tuning knob; the disk cache keys on it).
_DEFAULT_STAGES = {64: 4, 96: 4, 128: 3, 192: 2, 256: 2}
# Keys per K/V block (FLASH_ATTN_CUTE_BLOCK_N overrides, as the stages). The head dims above 128 take
# the largest BLOCK_N whose 2 stages fit beside the 128 x D Q tile and whose accumulators fit the
# consumers' 240 registers (O: D / 2, S: BLOCK_N / 2, packed P: BLOCK_N / 4 per thread). ptxas 13.0
# (sm_90a, CuTeDSL 4.8.1), fp16 and bf16, causal or not, with softcap / varlen / sink / a window: d256
# BLOCK_N 80 (224 KB; FA3's tile) and d192 112 (216 KB) no spill and no C75xx message, except d192 112
# with a window alone (48 bytes spilled): windowed d192 calls take 96 (_BLOCK_N_LOCAL). d96: 64-byte
# swizzle, 4 stages of 128 keys (216 KB), at most 185 registers.
_DEFAULT_BLOCK_N = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}
_BLOCK_N_LOCAL = {192: 96}
# Softmax exponentials per 16 computed by a polynomial on the FMA pipe instead of MUFU.EX2
# (FLASH_ATTN_CUTE_EXP2_EMU overrides; FLASH_ATTN_CUTE_EXP2_EMU_DEGREE picks the polynomial's degree,
# 2..4, default 3). Both are in the cache key only when the emulation is on.
_DEFAULT_EXP2_EMU = {64: 0, 128: 0}
# Consumer warpgroups of the forward per head dim: 2 (BLOCK_M 128, ping-pong) or 3 (BLOCK_M 192, round
# robin; FA3's choice at head dim <= 64: each K/V tile serves 192 query rows). FLASH_ATTN_CUTE_FWD_WARPGROUPS
# overrides: "3" for every head dim or per head dim ("64:3"). In the cache key only when not 2.
# FLASH_ATTN_CUTE_FWD_WG_ORDER=0 (or "64:0") drops the named-barrier ordering between the consumer
# warpgroups (a measurement knob; in the key only when 0). Calls without a causal mask or window use
# _FWD_WARPGROUPS, causal / windowed ones _FWD_WARPGROUPS_CAUSAL. H200, bf16, 16k tokens, same run
# (benchmarks/results/h200/attention_cute_session5.md): d64 non-causal 3 / 2 warpgroups 364/350 TFLOP/s at
# 1k, 479/433 at 4k, 516/457 at 16k; causal 214/242 at 1k, 374/374 at 4k, 453/443 at 16k (BLOCK_N 96: 224,
# 383, 465): 3 for d64 without a mask only.
_FWD_WARPGROUPS = {64: 3, 128: 2}
_FWD_WARPGROUPS_CAUSAL = {64: 2, 128: 2}
# Keys per block with 3 warpgroups (FLASH_ATTN_CUTE_BLOCK_N overrides both tables): the consumers' 160
# registers hold the S, P and O accumulators (BLOCK_N + BLOCK_N / 2 + D / 2 per thread) plus the loop's
# state. ptxas 13.0 (sm_90a, CuTeDSL 4.8.1), d64: BLOCK_N 128 is clean (no spill, no C75xx message) for
# dense calls, causal or not, with or without a sink, but spills 28-64 bytes with softcap, causal varlen,
# or a window with softcap / varlen / sink; 112 spills 12 bytes (causal varlen sink); 96 is clean in all
# 24 combinations of mask x softcap x varlen x sink. d128: BLOCK_N 96 serialises the WGMMAs (C7512), 64 is
# clean. _FWD3_BLOCK_N: dense calls; _FWD3_BLOCK_N_EXTRA: softcap, varlen or a window.
_FWD3_BLOCK_N = {64: 128, 128: 64}
_FWD3_BLOCK_N_EXTRA = {64: 96, 128: 64}
# The persistent forward (one CTA per SM looping over the tiles, causal ones longest first; see
# FlashFwdSm90.kernel_persistent) serves dense calls (no window, softcap, varlen or sink) of these
# (head dim, causal) pairs; FLASH_ATTN_CUTE_FWD_PERSISTENT=1 / 0 turns it on / off for every head dim. H200,
# bf16, 16k tokens (benchmarks/results/h200/attention_cute_session7.md, same-process A/B), one-tile ->
# persistent TFLOP/s: d64 causal 244 -> 295 (1k), 377 -> 410 (4k), 449 -> 449 (16k); d64 non-causal 365 ->
# 398, 495 -> 490, 547 -> 522; d128 causal 352 -> 354, 560 -> 518, 640 -> 544 (why the one-tile kernel
# wins there is not profiled yet). In the cache key only when on. Session 13, same-process A/B with the harness
# that rotates the order (attention_cute_session13.md), d64 non-causal, default -> persistent: 374 -> 389, 436 ->
# 458, 467 -> 479 (471 -> 474 in a second run), 507 -> 503, 515 -> 513 at 1k / 2k / 4k / 8k / 16k; d128 non-causal
# -2..+2%; d256 non-causal +1..+5% but below the one-tile kernel with the TMA O store.
_FWD_PERSISTENT = {(64, True), (64, False)}
# O through shared memory and a TMA store (FlashFwdSm90 tma_o) instead of direct stores from registers:
# FLASH_ATTN_CUTE_FWD_TMA_O=1 (or per head dim, "64:1,128:1"). Dense calls of the one-tile kernel only (a
# box would write past a packed sequence's end; the persistent kernel loads the next tile's Q into that
# buffer under the epilogue). In the cache key only when on. H200 A/B (attention_cute_session9.md, one-tile
# kernel): +3..+12% at seqlen 1k (d128 causal 350 -> 392), -1..-9% at 4k-16k, so "short" (or "128:short")
# takes it only for calls with seqlen_k <= _TMA_O_SHORT_SK (plain dense calls: no window, softcap or sink;
# the calls select their kernel by length, a second compiled kernel). "short" was the default for d64 and d128
# from session 11 ("0" turns TMA O off everywhere): session 11's A/B on the H200
# (attention_cute_session11.md) d128 causal 350 -> 391 TFLOP/s at seqlen 1k, d128 518 -> 530, d64 360 -> 374
# (d64 causal is persistent: unchanged); longer keys run the same kernel as without it. GPU tests with it:
# tests/test_cute_tma_o.py and test_cute_compile.py's test_matches_reference_on_gpu. "plain": every plain dense
# call (no window, softcap or sink) of the one-tile kernel, whatever its length. Session 13's A/B
# (attention_cute_session13.md, with lpt; bf16, 16k tokens), direct store -> TMA O: d256 causal 377 -> 426, 501 ->
# 548, 593 -> 624, 694 -> 703 at 1k / 2k / 4k / 16k, d256 non-causal 542 -> 594, 621 -> 655, 673 -> 682, 727 ->
# 731; d128 causal 450 -> 480, 534 -> 547, 626 -> 626 at 2k / 4k / 16k, d128 non-causal 564 -> 584, 600 -> 611,
# 634 -> 642. So "plain" is the default at d128 and d256, "short" at d64 (_TMA_O_DEFAULT; whose persistent
# kernels, its default since session 13, have no TMA O).
_TMA_O_SHORT_SK = 1024
_TMA_O_DEFAULT = {64: "short", 128: "plain", 256: "plain"}
# (dtype, head dim, causal) whose TMA O kernel ptxas 13.0 (sm_90a, CuTeDSL 4.8.1) compiles with spills: the
# default rules leave them the direct store (fp16 d128 non-causal: 12 bytes, three values kept across the main
# loop for the epilogue; bf16, and fp16 causal, are clean: tests/test_cute_tma_o.py). The one-tile kernel's: the
# persistent kernel's own O buffer is clean there (tests/test_cute_persistent_tma_o.py).
_TMA_O_SPILLS = frozenset({("fp16", 128, False)})
# Key blocks walked from the last down (FlashFwdSm90 reverse, FA3's order: a causal or windowed tile's masked
# diagonal blocks first, so its consumer warpgroups end the tile in step on unmasked blocks):
# FLASH_ATTN_CUTE_FWD_REVERSE=1 (or per head dim, "64:1"; "0" off everywhere). Causal and local calls only
# (without a mask only the tail block is masked: the order is left as it is), the one-tile and the persistent
# kernel, varlen included. In the cache key only when on. Unset: on for the persistent kernel of the
# (head dim, causal) pairs in _FWD_REVERSE_DEFAULT. H200, bf16, 16k tokens, same-process A/B after the pin
# below (benchmarks/results/h200/attention_cute_session12.md; the harness then favoured the first-timed
# variant, here the default, and reverse still won): d64 causal 293 -> 299, 358 -> 373, 403 -> 425, 432 -> 455,
# 446 -> 464 TFLOP/s at 1k / 2k / 4k / 8k / 16k; d128 and d256 causal lose 2-12% with it.
_FWD_REVERSE_DEFAULT = frozenset({(64, True)})
# FLASH_ATTN_CUTE_FWD_SNAKE=0 / 1 (or per head dim, "128:1"): the persistent causal kernel's tiles in the order
# before session 12 (longest first within L2-sized sections of heads, dealt round robin: max / mean work per
# CTA 1.16 at d128, 1.42 at d256 16k) / in one longest-first order dealt in a snake (FlashFwdSm90 snake). Unset:
# the snake but at the head dims of _FWD_SNAKE_OFF. H200 A/B (attention_cute_session12.md), persistent causal,
# 1k / 2k / 4k / 8k / 16k, old order -> snake: d128 357/446/492/524/545 -> 334/421/515/564/601, d256
# 341/420/471/506/526 -> 313/468/612/663/709 TFLOP/s (neither the default: the one-tile kernel is faster at
# d128 and at d256 but 4k-8k); d64 (2 warpgroups, its default) 296/373/413/435/452 -> 285/354/405/424/447,
# where the old order was already within 3% of balance: d64 keeps it. In the key only when off.
_FWD_SNAKE_OFF = frozenset({64})
# The one-tile causal kernel's CTA order (FlashFwdSm90 lpt): FLASH_ATTN_CUTE_FWD_LPT=1 / 0 (or per head dim,
# "128:0"): block (x, y, z) runs the tile of linear index x + num_m (y + H z) in tile_coords' causal order,
# longest first over all (head, batch) pairs within L2-sized sections / longest first within each head only
# (the order before session 13). Dense causal calls of the one-tile kernel (not varlen, windowed or
# persistent). Unset: on but for the short-key kernel (seqlen_k <= _TMA_O_SHORT_SK) of the head dims of
# _FWD_LPT_SHORT_OFF. In the key only when on. ncu on the H200 (d128 causal 1k b16,
# d256 causal 2k b8) had the busiest SM at 1.07x / 1.12x the mean active cycles in the former order (FA4
# 1.02x / 1.035x); the issue model of tests/test_cute_lpt.py gives the same figures and 1.01x / 1.02x with lpt.
# Same-process A/B (attention_cute_session13.md; bf16, 16k tokens, TFLOP/s, former -> lpt) at 1k / 2k / 4k /
# 8k / 16k: d256 causal 385 -> 385, 482 -> 512, 552 -> 600, 605 -> 671, 681 -> 685; d128 causal 2k-16k 449 ->
# 450, 520 -> 547, 569 -> 591, 619 -> 621, but at 1k (the short-key kernel) 393 -> 378 (7 rounds; 354 -> 343
# without TMA O): all SMs then run tiles of one length in step, prologues at once. So not for that kernel.
_FWD_LPT_SHORT_OFF = frozenset({128})
# Plain dense calls (no window, softcap, varlen or sink) with seqlen_k >= _FWD_LONG_SK of these (head dim, causal)
# pairs run the one-tile kernel with this many consumer warpgroups (a second compiled kernel, "long" in the
# in-memory key; FLASH_ATTN_CUTE_FWD_LONG=0 turns it off, and FLASH_ATTN_CUTE_FWD_PERSISTENT or
# FLASH_ATTN_CUTE_FWD_WARPGROUPS, when set, decide instead). d64 causal, H200 same-process A/B
# (attention_cute_session13.md; bf16, 16k tokens, TFLOP/s) at 1k / 2k / 4k / 8k / 16k: the default persistent
# kernel 298 / 372 / 415 / 436 / 458, the one-tile kernel with 3 warpgroups (BLOCK_M 192, lpt order) 224 / 329 /
# 402 / 466 / 493, with 2 warpgroups 262 / 310 / 371 / 404 / 432. Not d64 non-causal (attention_cute_session14.md,
# 7 rounds): the persistent kernel (its default since session 13) and the one-tile one with 3 warpgroups tie at 8k
# (503 / 501) and 16k (508 / 508).
_FWD_LONG_SK = 8192
_FWD_LONG = {(64, True): 3}
# FLASH_ATTN_CUTE_FWD_PERSISTENT_TMA_O=1 (or per head dim, "64:1"): the persistent kernel stores O through a
# shared-memory buffer of its own and a TMA store, waited for only before the next tile's epilogue (FlashFwdSm90
# tma_o with persistent), with as many K / V stages as still fit (d128: 2 instead of 3). Two consumer warpgroups
# only (with three, d64 non-causal's default, ptxas 13.0 spills 4 bytes at their 160 registers). Bitwise equal to
# the direct store on the H200 (tests/test_cute_persistent_tma_o.py). Session 14's A/B (attention_cute_session14.md):
# d64 causal +0..+1%; d128 persistent +1..+8%, ahead of the one-tile default only at short keys (below). In the key
# (as "tma_o") only when on.
# The short-key kernel (plain dense calls with seqlen_k <= _TMA_O_SHORT_SK) of these (head dim, causal) pairs is
# the persistent kernel with its own O buffer (two warpgroups, the PERSISTENT_TMA_O config above);
# FLASH_ATTN_CUTE_FWD_SHORT_PERSISTENT=0 (or "128:0") turns it off, and FLASH_ATTN_CUTE_FWD_PERSISTENT or
# FLASH_ATTN_CUTE_FWD_WARPGROUPS, when set, decide instead. H200 same-process A/B (attention_cute_session14.md;
# bf16, 16k tokens, TFLOP/s), d128 non-causal at 1k / 4k / 16k: the one-tile kernel (TMA O) 534 / 620 / 643, the
# persistent kernel 521 / 600 / 630, with its TMA O 563 / 616 / 636. Causal at 1k: 390 / 335 / 363.
_FWD_SHORT_PERSISTENT = frozenset({(128, False)})
# pack_gqa (FlashFwdSm90's pack_gqa): the query heads per KV head that a 128-row tile packs (128 / g rows per
# head, a multiple of the swizzle atom's 8 rows). Written without a GPU at hand (session 15), GPU-tested in session 16
# (tests/test_cute_pack_gqa.py); FLASH_ATTN_CUTE_PACK_GQA=0 runs every call unpacked (the same result).
_PACK_GROUPS = (2, 4, 8, 16)
# (head dim of q / k, head dim of v) pairs with Dv != D: DeepSeek's 192 / 128 (MLA without absorption, as FA3 /
# FA4 serve it). Written without a GPU at hand as well (session 15), GPU-tested in session 16
# (tests/test_cute_hdim_v.py); FLASH_ATTN_CUTE_HDIM_V=0 refuses such calls.
_HEAD_DIM_PAIRS = frozenset({(192, 128)})
# Paged K / V (flash_attn_varlen_func's page_table): written without a GPU as well (session 15), GPU-tested in
# session 16 (tests/test_cute_paged.py); FLASH_ATTN_CUTE_PAGED=0 refuses paged calls.


def _paged_block_n(block_n, page_size):
    """The key block for a paged cache of page_size rows: the config's block_n, or the largest multiple of 16
    below it, that is a multiple of page_size or divides it, so that each TMA box is one page or part of one
    (page_size a multiple of 8: boxes start on the swizzle atom's rows); None when there is none."""
    if page_size < 8 or page_size % 8:
        return None
    for n in range(block_n, 15, -16):
        if page_size % n == 0 or n % page_size == 0:
            return n
    return None
_SMEM_BYTES = 232448  # FlashFwdSm90.SMEM_BYTES (kept here: computing a config must not import CuTeDSL)
# FLASH_ATTN_CUTE_FWD_PIN=0 (or "128:0") builds the key-block loop without flash_fwd_sm90._pin, i.e. with half of
# a masked kernel's softmax after the P V wait (the code before session 12; an A/B knob). In the key only
# when 0.


def _cutlass_dtype(dtype):
    import cutlass

    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


def _tvm_ffi():
    if not _have_tvm_ffi:
        import importlib.util

        _have_tvm_ffi.append(importlib.util.find_spec("tvm_ffi") is not None)
    return _have_tvm_ffi[0]


def _per_head_dim(name, head_dim):
    """$name's value for head_dim: the whole value, or with "D:value,D:value" the entry for head_dim ("" if
    none)."""
    value = os.environ.get(name, "").strip()
    if ":" not in value:
        return value
    table = dict(item.split(":", 1) for item in value.split(",") if item.strip())
    return table.get(str(int(head_dim)), "").strip()


def _tma_o_rule(head_dim):
    """FLASH_ATTN_CUTE_FWD_TMA_O's value for head_dim ("short", "plain", "1", "0", ...): the variable's (whole, or
    its "D:value" entry), else _TMA_O_DEFAULT's entry ("0" where it has none)."""
    value = _per_head_dim("FLASH_ATTN_CUTE_FWD_TMA_O", head_dim)
    if value:
        return value
    return _TMA_O_DEFAULT.get(int(head_dim), "0")


def _short_dims():
    """Head dims whose plain dense calls with seqlen_k <= _TMA_O_SHORT_SK take a short-key kernel of their own:
    the TMA O store with the "short" rule (FLASH_ATTN_CUTE_FWD_TMA_O=short, "D:short" per head dim, or unset and
    "short" in _TMA_O_DEFAULT), and the head dims of _FWD_LPT_SHORT_OFF (FLASH_ATTN_CUTE_FWD_LPT unset: their
    short-key kernel keeps the former CTA order). Read at import (the per-call paths check membership only)."""
    return frozenset(d for d in _SUPPORTED_HEAD_DIMS if _tma_o_rule(d) == "short"
                     or (d in _FWD_LPT_SHORT_OFF and not _per_head_dim("FLASH_ATTN_CUTE_FWD_LPT", d))
                     or any(_short_persistent_rule(d, c) for c in (False, True)))


def _short_persistent_rule(head_dim, causal):
    """Whether the short-key kernel of (head_dim, causal) is the persistent one (_FWD_SHORT_PERSISTENT;
    FLASH_ATTN_CUTE_FWD_SHORT_PERSISTENT=0, or "128:0", turns it off)."""
    value = _per_head_dim("FLASH_ATTN_CUTE_FWD_SHORT_PERSISTENT", head_dim)
    return (int(head_dim), bool(causal)) in _FWD_SHORT_PERSISTENT and value not in ("0", "false", "False")


def _fwd_config(dtype, head_dim, causal, arch, local=False, softcap=False, varlen=False, sink=False, short=False,
                long=False, pack=1, dv=None, paged=0, split=False):
    """Everything that selects the forward kernel's code: the kernel class, its constructor arguments,
    the architecture and the calling convention. It is the disk cache's key (with the package sources
    and the versions, see cache.py) and what compile_fwd builds the kernel from, so a constructor
    argument added here changes both. Plain values: computing the key must not import CuTeDSL.
    ``short``: the kernel for calls with seqlen_k <= _TMA_O_SHORT_SK (the TMA O store with the "short"
    switch, the persistent kernel of _FWD_SHORT_PERSISTENT; else the same config). ``long``: the kernel for
    calls with seqlen_k >= _FWD_LONG_SK (see _FWD_LONG; else the same config). ``pack``: pack_gqa's group (the
    query heads per KV head, one of _PACK_GROUPS) for the packed one-tile kernel, 1 for none. ``dv``: v's head dim
    when it differs from head_dim (_HEAD_DIM_PAIRS; one-tile kernel, direct O store), else None. ``paged``: the
    page size of a paged K / V cache (varlen only; see _paged_block_n), 0 for none. ``split``: the split-KV kernel
    (dense or varlen, no sink: the host combines the parts and adds a sink; see _forward_split, forward_varlen)."""
    pack = int(pack)
    dv = None if dv is None or int(dv) == int(head_dim) else int(dv)
    paged = int(paged)
    if split and sink:
        raise NotImplementedError("split-KV: the sink is added by the host (the kernel is built without one)")
    if pack > 1 or dv or paged or split:
        short = long = False  # the packed kernel is the one-tile kernel with the direct O store, at any length
    stages = int(_per_head_dim("FLASH_ATTN_CUTE_STAGES", head_dim) or _DEFAULT_STAGES.get(int(head_dim), 2))
    table = _FWD_WARPGROUPS_CAUSAL if causal or local else _FWD_WARPGROUPS
    wg_env = _per_head_dim("FLASH_ATTN_CUTE_FWD_WARPGROUPS", head_dim)
    env = os.environ.get("FLASH_ATTN_CUTE_FWD_PERSISTENT")
    # the length rules serve dense calls without options, and yield to the persistent / warpgroup variables
    by_length = not (local or softcap or varlen or sink or env or os.environ.get("FLASH_ATTN_CUTE_FWD_WARPGROUPS"))
    long_kernel = long and by_length and _long_rule(head_dim, causal)
    short_persistent = short and by_length and _short_persistent_rule(head_dim, causal)
    if short_persistent:
        wg_env = "2"
    if long_kernel:  # the one-tile kernel with _FWD_LONG's warpgroups (the variables, when set, decide instead)
        wg_env = str(_FWD_LONG[(int(head_dim), bool(causal))])
    if int(head_dim) not in _FWD3_BLOCK_N and ":" not in os.environ.get("FLASH_ATTN_CUTE_FWD_WARPGROUPS", ""):
        wg_env = ""  # a bare "3" means the head dims that have 3-warpgroup tiles (a 192 x 256 Q tile does not fit)
    warpgroups = int(wg_env or table.get(int(head_dim), 2))
    if pack > 1 and ((64 * warpgroups) % pack or (64 * warpgroups // pack) % 8):
        warpgroups = 2  # each head's rows of the tile must start on a swizzle atom (8 rows): 128 / _PACK_GROUPS do
    table = (_DEFAULT_BLOCK_N if warpgroups == 2
             else _FWD3_BLOCK_N_EXTRA if local or softcap or varlen else _FWD3_BLOCK_N)
    default_n = table.get(int(head_dim), 128)
    if warpgroups == 2 and local:
        default_n = _BLOCK_N_LOCAL.get(int(head_dim), default_n)
    block_n = int(_per_head_dim("FLASH_ATTN_CUTE_BLOCK_N", head_dim) or default_n)
    page_box = 0
    if paged:
        block_n = _paged_block_n(block_n, paged)
        if block_n is None or not varlen:
            raise NotImplementedError(f"page size {paged}: a multiple of 8 that a key block of a multiple of 16 "
                                      "rows divides or is divided by (varlen calls)")
        page_box = min(paged, block_n)
    unordered = _per_head_dim("FLASH_ATTN_CUTE_FWD_WG_ORDER", head_dim) in ("0", "false", "False")
    emu = int(os.environ.get("FLASH_ATTN_CUTE_EXP2_EMU") or _DEFAULT_EXP2_EMU.get(int(head_dim), 0))
    emu_degree = int(os.environ.get("FLASH_ATTN_CUTE_EXP2_EMU_DEGREE") or 3)
    emu_cfg = ({"exp2_emu": emu, **({"exp2_emu_degree": emu_degree} if emu_degree != 3 else {})}
               if emu else {})
    persistent = (short_persistent or ((int(head_dim), bool(causal) and not local) in _FWD_PERSISTENT) if not env
                  else env not in ("0", "false", "False")) and not (local or softcap or varlen or sink or long_kernel
                                                                    or pack > 1 or dv or split)
    tma_o_env = _tma_o_rule(head_dim)
    plain = not (local or softcap or sink)
    tma_o = ((tma_o_env not in ("", "0", "false", "False", "short", "plain")
              or (tma_o_env == "short" and short and plain) or (tma_o_env == "plain" and plain))
             and not varlen and not persistent and pack == 1 and not dv and not split)
    ptma_env = _per_head_dim("FLASH_ATTN_CUTE_FWD_PERSISTENT_TMA_O", head_dim)
    if persistent and warpgroups == 2 and (ptma_env not in ("", "0", "false", "False")
                                           or (short_persistent and not ptma_env)):
        tma_o = True  # the persistent kernel's own O buffer: fewer K / V stages where the default ones leave no room
        if not _per_head_dim("FLASH_ATTN_CUTE_STAGES", head_dim):
            block_m = 64 * warpgroups
            while stages > 2 and 1024 + 2 * int(head_dim) * (2 * block_m + 2 * stages * block_n) > _SMEM_BYTES:
                stages -= 1
    if tma_o and not persistent and not _per_head_dim("FLASH_ATTN_CUTE_FWD_TMA_O", head_dim) and (
            _DTYPE_NAMES.get(dtype), int(head_dim), bool(causal) and not local) in _TMA_O_SPILLS:
        tma_o = False  # the default rule, where the TMA O kernel spills (set the variable to have it anyway)
    reverse_env = _per_head_dim("FLASH_ATTN_CUTE_FWD_REVERSE", head_dim)
    if reverse_env:
        reverse = reverse_env not in ("0", "false", "False") and (bool(causal) or bool(local))
    else:
        reverse = persistent and (int(head_dim), bool(causal) and not local) in _FWD_REVERSE_DEFAULT
    unpinned = _per_head_dim("FLASH_ATTN_CUTE_FWD_PIN", head_dim) in ("0", "false", "False")
    snake_env = _per_head_dim("FLASH_ATTN_CUTE_FWD_SNAKE", head_dim)
    unsnaked = (persistent and bool(causal) and not local
                and (snake_env in ("0", "false", "False") if snake_env else int(head_dim) in _FWD_SNAKE_OFF))
    lpt_env = _per_head_dim("FLASH_ATTN_CUTE_FWD_LPT", head_dim)
    lpt = (bool(causal) and not (local or varlen or persistent)
           and (lpt_env not in ("0", "false", "False") if lpt_env
                else not (short and int(head_dim) in _FWD_LPT_SHORT_OFF)))
    return {"kernel": "FlashFwdSm90", "dtype": _DTYPE_NAMES.get(dtype, str(dtype)), "head_dim": int(head_dim),
            "stages": stages, **({"block_n": block_n} if block_n != 128 else {}), **emu_cfg,
            **({"warpgroups": warpgroups} if warpgroups != 2 else {}),
            **({"wg_order": False} if unordered else {}),
            "causal": bool(causal) and not local, "local": bool(local), "softcap": bool(softcap), "arch": arch,
            "abi": "tvm-ffi-env-stream" if _tvm_ffi() else "cute", **({"varlen": True} if varlen else {}),
            **({"sink": True} if sink else {}),
            **({"persistent": True} if persistent else {}),  # absent unless set: existing disk entries keep their keys
            **({"tma_o": True} if tma_o else {}),
            **({"reverse": True} if reverse else {}),
            **({"pin": False} if unpinned else {}),
            **({"snake": False} if unsnaked else {}),
            **({"lpt": True} if lpt else {}),
            **({"pack_gqa": pack} if pack > 1 else {}),
            **({"head_dim_v": dv} if dv else {}),
            **({"paged": page_box} if page_box else {}),
            **({"split": True} if split else {})}


_SHORT_DIMS = _short_dims()  # head dims with a short-key kernel (see _fwd_config)


def _long_rule(head_dim, causal):
    """Whether plain dense calls of (head_dim, causal) with seqlen_k >= _FWD_LONG_SK take their own kernel
    (_FWD_LONG; FLASH_ATTN_CUTE_FWD_LONG=0, or "64:0" per head dim, turns it off)."""
    value = _per_head_dim("FLASH_ATTN_CUTE_FWD_LONG", head_dim)
    return (int(head_dim), bool(causal)) in _FWD_LONG and value not in ("0", "false", "False")


# (head dim, causal) pairs whose calls select the long-key kernel (read at import; the per-call paths check
# membership only)
_FWD_LONG_ON = frozenset(pair for pair in _FWD_LONG if _long_rule(*pair))


def _length_kernel(head_dim, causal, seqlen_k, plain):
    """(short, long): whether a dense call (``plain``: no window, softcap or sink) of this key length runs the
    short-key kernel (seqlen_k <= _TMA_O_SHORT_SK, see _SHORT_DIMS) or the long-key one (seqlen_k >= _FWD_LONG_SK,
    see _FWD_LONG). flash_attn_func's fast path inlines the same choice."""
    return (plain and seqlen_k <= _TMA_O_SHORT_SK and head_dim in _SHORT_DIMS,
            plain and seqlen_k >= _FWD_LONG_SK and (head_dim, causal) in _FWD_LONG_ON)


def _make_kernel(config):
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    dtype = {name: dt for dt, name in _DTYPE_NAMES.items()}.get(config["dtype"], config["dtype"])
    cutlass_dtype = _cutlass_dtype(dtype) if dtype in _DTYPE_NAMES else dtype
    return FlashFwdSm90(cutlass_dtype, config["head_dim"], config["causal"], local=config["local"],
                        softcap=config["softcap"], varlen=config.get("varlen", False),
                        num_stages=config["stages"], block_n=config.get("block_n", 128),
                        exp2_emu=config.get("exp2_emu", 0), exp2_emu_degree=config.get("exp2_emu_degree", 3),
                        sink=config.get("sink", False), num_warpgroups=config.get("warpgroups", 2),
                        wg_order=config.get("wg_order", True), persistent=config.get("persistent", False),
                        tma_o=config.get("tma_o", False), reverse=config.get("reverse", False),
                        pin=config.get("pin", True), snake=config.get("snake", True),
                        lpt=config.get("lpt", False), pack_gqa=config.get("pack_gqa", 1),
                        head_dim_v=config.get("head_dim_v"), paged=config.get("paged", 0),
                        split=config.get("split", False))


def compile_fwd(dtype, head_dim, causal, arch="sm_90a", dump_dir=None, local=False, softcap=False,
                varlen=False, sink=False, short=False, long=False, pack=1, dv=None, paged=0, split=False):
    """Compile the forward kernel for ``dtype`` (torch.float16 / torch.bfloat16), ``head_dim`` (_SUPPORTED_HEAD_DIMS),
    ``causal``, ``local`` (a sliding window, sizes given per call) and ``softcap`` (soft-capped scores)
    for ``arch``. No GPU is needed. ``dump_dir``: an existing folder that receives the PTX (``*.ptx``)
    and cubin. Always compiles (``fwd_kernel`` is the cached way). Returns CuTeDSL's compiled function;
    with apache-tvm-ffi installed its call is ``(q, k, v, out, lse, softmax_scale, softcap, window_left,
    window_right)`` on torch tensors, q/out (B, Sq, H, D), k/v (B, Sk, Hk, D), lse (B, H, Sq) fp32,
    window sizes >= 0 (FlashFwdSm90.UNBOUNDED for no limit), launched on torch's current stream; without
    it the same plus a stream, on CuTe tensors. ``varlen``: the call is ``(q, k, v, out, lse, cu_seqlens_q,
    cu_seqlens_k, seqused_k, max_seqlen_q, softmax_scale, softcap, window_left, window_right)`` with
    q/out (total_q, H, D), k/v (total_k, Hk, D), lse (H, total_q), int32 cu_seqlens (B + 1,) and
    seqused_k (B,). ``sink``: the call takes one more argument, last: the learnable sink, an fp32 (H,)
    tensor. A persistent kernel (FLASH_ATTN_CUTE_FWD_PERSISTENT=1, dense calls) takes one more argument,
    last: the most CTAs to launch (the SM count; ``fwd_kernel``'s callable adds it). ``pack`` > 1: the pack_gqa
    kernel for calls with exactly pack query heads per KV head (same call). ``dv``: v's (and out's) head dim, when
    it differs from head_dim (_HEAD_DIM_PAIRS). ``paged`` (varlen): the page size of a paged K / V cache; the call
    then takes k / v (num_pages, page_size, Hk, D) and, in cu_seqlens_k's place, the int32 page table (B,
    max_pages). ``split``: the split-KV kernel, whose call takes out (num_splits * B, Sq, H, Dv) and lse (num_splits *
    B, H, Sq) in fp32 (varlen: (num_splits, total_q, H, Dv) and (num_splits, H, total_q)) and one more argument after
    window_right: num_splits."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    config = _fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack, dv, paged,
                         split)
    kernel = _make_kernel(config)
    dt, D, Dv = kernel.dtype, kernel.head_dim, kernel.head_dim_v
    # 32-bit shapes and strides: with 64-bit symbolic strides CuTeDSL 4.8 builds TMA descriptors that
    # the driver rejects (the launch fails with cudaErrorInvalidValue on an H200); forward() keeps every
    # tensor under 2^31 elements by splitting the batch.
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int() for _ in range(5))

    def qkv(seqlen, h, d=D):
        # Row strides are multiples of 8 elements (16 bytes), as TMA requires; the head dim is contiguous
        # and heads are d apart (the wrapper makes them so).
        div8 = cute.sym_int(divisibility=8)
        return make_fake_tensor(dt, (batch, seqlen, h, d), (cute.sym_int(divisibility=8), div8, d, 1),
                                assumed_align=16)

    def packed(total, h, d=D):  # varlen: (total, H, d), rows 16-byte aligned
        return make_fake_tensor(dt, (total, h, d), (cute.sym_int(divisibility=8), d, 1), assumed_align=16)

    if varlen:
        q, o = packed(seqlen_q, heads), packed(seqlen_q, heads, Dv)
        k, v = packed(seqlen_k, heads_kv), packed(seqlen_k, heads_kv, Dv)
        lse = make_fake_tensor(cutlass.Float32, (heads, seqlen_q), (cute.sym_int(), 1), assumed_align=4)
        cu_q, cu_k = (make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4) for _ in "qk")
        if paged:  # k / v (num_pages, page_size, Hk, D): the dense layout with pages for batch entries; the page table
            k, v = qkv(cute.sym_int(), heads_kv), qkv(cute.sym_int(), heads_kv, Dv)
            cu_k = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), (cute.sym_int(), 1),
                                    assumed_align=4)
        used_k = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
        seq_args = (cu_q, cu_k, used_k, cutlass.Int32(0))
        if split:  # the parts: fp32 (num_splits, total_q, H, Dv) and (num_splits, H, total_q)
            parts = cute.sym_int()
            o = make_fake_tensor(cutlass.Float32, (parts, seqlen_q, heads, Dv),
                                 (cute.sym_int(divisibility=4), cute.sym_int(divisibility=4), Dv, 1), assumed_align=16)
            lse = make_fake_tensor(cutlass.Float32, (parts, heads, seqlen_q), (cute.sym_int(), cute.sym_int(), 1),
                                   assumed_align=4)
    else:
        q, o = qkv(seqlen_q, heads), qkv(seqlen_q, heads, Dv)
        k, v = qkv(seqlen_k, heads_kv), qkv(seqlen_k, heads_kv, Dv)
        lse = make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), (cute.sym_int(), cute.sym_int(), 1),
                               assumed_align=4)
        seq_args = ()
        if split:  # the parts: fp32, num_splits * B entries
            parts = cute.sym_int()
            o = make_fake_tensor(cutlass.Float32, (parts, seqlen_q, heads, Dv),
                                 (cute.sym_int(divisibility=4), cute.sym_int(divisibility=4), Dv, 1), assumed_align=16)
            lse = make_fake_tensor(cutlass.Float32, (parts, heads, seqlen_q), (cute.sym_int(), cute.sym_int(), 1),
                                   assumed_align=4)
    tvm_ffi = config["abi"] != "cute"
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    # (H,) with q's symbolic head count: the TVM-FFI wrapper checks that the sink has one entry per head.
    sink_arg = (make_fake_tensor(cutlass.Float32, (heads,), (1,), assumed_align=4),) if sink else ()
    entry = ((kernel.call_varlen_sink if sink else kernel.call_varlen_split if split else kernel.call_varlen) if varlen
             else (kernel.call_sink if sink else kernel.call_persistent if kernel.persistent
                   else kernel.call_split if split else kernel))
    ctas_arg = (cutlass.Int32(1),) if kernel.persistent else ()
    splits_arg = (cutlass.Int32(1),) if split else ()
    return cute.compile(entry, q, k, v, o, lse, *seq_args,
                        cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0), *splits_arg,
                        stream, *sink_arg, *ctas_arg, options=options)


def _ffi_function(compiled):
    # CuTeDSL wraps the TVM-FFI function in a keyword-argument adapter when the signature has names;
    # the bare tvm_ffi.Function underneath is the cheapest to call.
    bare = getattr(compiled, "__tvm_ffi_object__", None)
    return (bare() if bare is not None else None) or compiled


def _dlpack_launcher(compiled, sink=False, persistent=False, split=False):
    # The fallback when apache-tvm-ffi (a dependency of flash-attn-4) is missing: CuTe-ABI kernels take
    # CuTe tensors and an explicit stream, so each call wraps every tensor with from_dlpack (~30 us on a
    # CPU core) under the tensors' device. Kernels are not written to disk on this path: the entries
    # hold TVM-FFI functions only.
    import cutlass
    from cuda.bindings import driver
    from cutlass.cute.runtime import from_dlpack

    def as_cute(t, align):
        return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    def launch(q, k, v, out, lse, *args):
        ctas_arg = (cutlass.Int32(args[-1]),) if persistent else ()
        if persistent:
            args = args[:-1]
        sink_arg = (as_cute(args[-1], 4),) if sink else ()
        if sink:
            args = args[:-1]
        splits_arg = (cutlass.Int32(args[-1]),) if split else ()
        if split:
            args = args[:-1]
        *seq, softmax_scale, softcap, window_left, window_right = args  # seq: varlen's 3 tensors and int
        if seq:
            seq = [as_cute(t, 4) for t in seq[:3]] + [cutlass.Int32(seq[3])]
        with torch.cuda.device(q.device):
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            compiled(as_cute(q, 16), as_cute(k, 16), as_cute(v, 16), as_cute(out, 16), as_cute(lse, 4), *seq,
                     cutlass.Float32(softmax_scale), cutlass.Float32(softcap), cutlass.Int32(window_left),
                     cutlass.Int32(window_right), *splits_arg, stream, *sink_arg, *ctas_arg)

    return launch


_sm_counts: dict[int, int] = {}  # CUDA device index -> multiprocessor count


def _persistent_launcher(fn):
    """The dense call (q, k, v, out, lse, softmax_scale, softcap, window_left, window_right) of a persistent
    kernel: appends its CTA limit, the SM count of q's device (one CTA per SM: its shared memory is
    most of an SM's)."""
    def launch(q, k, v, out, lse, *args):  # (_device_sms inlined: the per-call path)
        index = q.get_device()
        count = _sm_counts.get(index)
        if count is None:
            count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return fn(q, k, v, out, lse, *args, count)

    return launch


def _entry(dtype, head_dim, causal, arch, local=False, softcap=False, varlen=False, sink=False, short=False,
           long=False, pack=1, dv=None, paged=0, split=False):
    """(config, key, file name, exported C symbol) of a forward kernel's disk cache entry."""
    config = _fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack, dv, paged,
                         split)
    key = cache.entry_key(config)
    mask = "local" if config["local"] else "causal" if config["causal"] else "full"
    wg = f"-wg{config['warpgroups']}" if "warpgroups" in config else ""  # readable names; the key decides
    name = (f"fwd-{arch}-{config['dtype']}-d{config['head_dim']}-{mask}{'-softcap' if softcap else ''}"
            f"{'-varlen' if varlen else ''}{'-sink' if sink else ''}{wg}"
            f"{'-persistent' if config.get('persistent') else ''}{'-reverse' if config.get('reverse') else ''}"
            f"{'-tmao' if config.get('tma_o') else ''}{f'-pack{pack}' if config.get('pack_gqa') else ''}"
            f"{f'-dv{dv}' if config.get('head_dim_v') else ''}{f'-paged{paged}' if paged else ''}"
            f"{'-split' if split else ''}-{key[:16]}")
    return config, key, name, f"flash_attn_cute_{key[:16]}"  # the symbol is unique per key


def disk_entry(dtype, head_dim, causal, arch="sm_90a", root=None, local=False, softcap=False, varlen=False,
               sink=False, short=False, long=False, pack=1, dv=None, paged=0, split=False):
    """The intact files of a forward kernel's entry in the disk cache ``root`` (default: the runtime's
    folder), {"o": path, "so": path} (the shared library is absent where no C compiler was found), or
    {} when there is none. Loads nothing."""
    root = root if root is not None else cache.cache_dir()
    if root is None or not _tvm_ffi():
        return {}
    _, key, name, _ = _entry(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack, dv,
                             paged, split)
    return cache.DiskCache(root).files(name, key)


def bwd_disk_entry(dtype, head_dim, causal, arch="sm_90a", root=None):
    """disk_entry for the backward kernel."""
    root = root if root is not None else cache.cache_dir()
    if root is None or not _tvm_ffi():
        return {}
    _, key, name, _ = _bwd_entry(dtype, head_dim, causal, arch)
    return cache.DiskCache(root).files(name, key)


def load_or_build_bwd(dtype, head_dim, causal, arch="sm_90a", root=None, force=False):
    """load_or_build for the backward kernel: (callable, origin), from the disk cache ``root`` or compiled
    and written there."""
    return _load_or_build_entry(_bwd_entry(dtype, head_dim, causal, arch),
                                lambda: compile_bwd(dtype, head_dim, causal, arch), root, force)


def load_or_build(dtype, head_dim, causal, arch="sm_90a", root=None, force=False, local=False, softcap=False,
                  varlen=False, sink=False, short=False, long=False, pack=1, dv=None, paged=0, split=False):
    """The forward kernel as a callable ``(q, k, v, out, lse, softmax_scale, softcap, window_left,
    window_right)`` and where it came from
    ("so" / "o": the disk cache in ``root``; "compiled": compiled now, and written to ``root``).
    ``root=None``: no disk cache. ``force``: compile even when the disk holds the entry. Compiling
    needs no GPU; loading from disk needs neither a GPU nor the CuTeDSL compiler."""
    variant = dict(local=local, softcap=softcap, varlen=varlen, sink=sink, short=short, long=long, pack=pack, dv=dv,
                   paged=paged, split=split)
    if not _tvm_ffi():
        persistent = _fwd_config(dtype, head_dim, causal, arch, **variant).get("persistent", False)
        return (_dlpack_launcher(compile_fwd(dtype, head_dim, causal, arch, **variant), sink, persistent, split),
                "compiled-dlpack")
    return _load_or_build_entry(_entry(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long,
                                       pack, dv, paged, split),
                                lambda: compile_fwd(dtype, head_dim, causal, arch, **variant), root, force)


def _load_or_build_entry(entry, compile_fn, root, force):
    """(callable, origin) for the disk cache entry ``entry`` = (config, key, name, symbol): loaded from
    ``root``, else ``compile_fn()`` (a TVM-FFI compiled function) written there."""
    if root is None:
        return _ffi_function(compile_fn()), "compiled"
    config, key, name, symbol = entry
    disk = cache.DiskCache(root)
    if not force:
        fn, how = disk.load(name, key)
        if fn is not None:
            return fn, how
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(disk.writer(name))  # one compile per entry across processes
            writable = True
        except OSError as e:
            cache._note(f"disk cache {root} is not writable ({e}): compiling in memory only")
            writable = False
        if writable and not force:
            fn, how = disk.load(name, key, locked=True)  # a process we waited for may have written it
            if fn is not None:
                return fn, how
        t0 = time.perf_counter()
        compiled = compile_fn()
        if writable:
            info = {"config": config, "env": cache.environment(), "source": cache.source_hash(),
                    "compile_s": round(time.perf_counter() - t0, 3), "created": time.time()}
            if disk.store(name, key, symbol, lambda path: compiled.export_to_c(path, function_name=symbol), info):
                # Run what a later process will run. (Without a GPU CuTeDSL builds no execution engine,
                # so the compiled object itself cannot even be called to check its arguments.)
                fn, _ = disk.load(name, key, locked=True)
                if fn is not None:
                    return fn, "compiled"
        return _ffi_function(compiled), "compiled"


def fwd_kernel(dtype, head_dim, causal, arch="sm_90a", local=False, softcap=False, varlen=False, sink=False,
               short=False, long=False, pack=1, dv=None, paged=0, split=False):
    """The forward kernel for (dtype, head dim, causal, arch, local, softcap): from memory, else from the
    disk cache (``cache.cache_dir()``: $FLASH_ATTN_CUTE_CACHE, default ~/.cache/flash_attn_cute), else
    compiled and written there. A callable ``(q, k, v, out, lse, softmax_scale, softcap, window_left,
    window_right)`` on torch tensors (varlen, sink: see compile_fwd; a persistent kernel's callable adds
    its last argument, the SM count of q's device, itself). ``short``: the kernel of calls with seqlen_k <=
    _TMA_O_SHORT_SK (in-memory key ending in "short"; the same kernel as not short unless the TMA O
    "short" switch makes their configs differ). ``long``: the kernel of calls with seqlen_k >= _FWD_LONG_SK
    (key ending in "long"; the same kernel as not long outside _FWD_LONG). ``pack`` > 1: the pack_gqa kernel
    (key ending in ("pack", pack); short and long are then ignored). ``dv``: v's head dim when it differs from
    head_dim (key ending in ("dv", dv); short and long ignored too). ``paged``: the page size of a paged varlen
    call (key ending in ("paged", page size)). ``split``: the split-KV kernel (key ending in "split")."""
    if dv == head_dim:
        dv = None
    if pack > 1 or dv or paged or split:
        short = long = False
    mem_key = ((dtype, head_dim, bool(causal), arch, bool(local), bool(softcap)) + ((True,) if varlen else ())
               + (("sink",) if sink else ()) + (("short",) if short else ()) + (("long",) if long else ())
               + (("pack", pack) if pack > 1 else ()) + (("dv", dv) if dv else ())
               + (("paged", paged) if paged else ()) + (("split",) if split else ()))
    fn = _kernels.get(mem_key)
    if fn is None:
        with cache._lock:  # one builder per process; other threads wait, then find it in memory
            fn = _kernels.get(mem_key)
            if fn is None:
                config = _fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack,
                                     dv, paged, split)
                if (short or long) and config == _fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen,
                                                             sink):
                    fn = fwd_kernel(dtype, head_dim, causal, arch, local, softcap, varlen, sink)  # the same kernel
                else:
                    fn, _origins[mem_key] = load_or_build(dtype, head_dim, causal, arch, cache.cache_dir(),
                                                          local=local, softcap=softcap, varlen=varlen, sink=sink,
                                                          short=short, long=long, pack=pack, dv=dv, paged=paged,
                                                          split=split)
                    if config.get("persistent"):
                        fn = _persistent_launcher(fn)  # the kernel's last argument, which callers do not give
                _kernels[mem_key] = fn
    return fn


def _kernel_layout(t, D):
    # The kernel is compiled for a contiguous head dim, heads D apart, 16-byte aligned rows and batch /
    # sequence strides that are multiples of 8 elements (the TVM-FFI wrapper rejects anything else).
    # clone, not contiguous(): contiguous() keeps the odd stride of a size-1 dim.
    s = t.stride()
    if s[3] != 1 or s[2] != D or s[1] % 8 or s[0] % 8 or t.data_ptr() % 16:
        t = t.clone(memory_format=torch.contiguous_format)
    return t


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


def _check_tensors(q, k, v):
    """Raises ValueError naming the first of q, k, v that is not a 4-D tensor, or their dtypes when they are
    not one of fp16 / bf16 (the per-call path's checks, spelled out for the message)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, S, H, D)")
    if q.dtype not in _DTYPE_NAMES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, fp16 or bf16; got {q.dtype}, {k.dtype}, {v.dtype}")


# The lse of calls that do not return it (no return_lse, no gradient): the kernels write one, nobody reads it,
# so one buffer per (device index, B, H, Sq) serves every such call (concurrent calls on several streams
# write the same unread values: harmless) instead of an allocation per call. Small shapes only, and a bounded
# number of them: the calls whose per-call cost the allocation is a part of.
_lse_scratch: dict[tuple, torch.Tensor] = {}
_LSE_SCRATCH_MAX_ELEMS = 1 << 20  # 4 MiB per buffer
_LSE_SCRATCH_MAX_SHAPES = 32


def _new_lse_scratch(index, B, H, Sq):
    lse = torch.empty(B, H, Sq, dtype=_F32, device=torch.device("cuda", index) if index >= 0 else "cpu")
    if B * H * Sq <= _LSE_SCRATCH_MAX_ELEMS:
        if len(_lse_scratch) >= _LSE_SCRATCH_MAX_SHAPES:
            _lse_scratch.clear()
        _lse_scratch[(index, B, H, Sq)] = lse
    return lse


def _feature_on(feature):
    """Whether a kernel feature runs (on unless its variable FLASH_ATTN_CUTE_<feature> is 0 / false: a switch to
    tell a suspected kernel fault from a caller's). feature: PACK_GQA (off: unpacked), HDIM_V (off:
    NotImplementedError), PAGED (off: NotImplementedError) or SPLIT (off: unsplit)."""
    return os.environ.get("FLASH_ATTN_CUTE_" + feature, "1") not in ("0", "false", "False")


def _paged_on():
    """Whether paged calls (page_table) run (see _feature_on)."""
    return _feature_on("PAGED")


def _hdim_v_on():
    """Whether calls with v's head dim != q's (_HEAD_DIM_PAIRS) run (see _feature_on)."""
    return _feature_on("HDIM_V")


def _check_dims(D, Dv, H, Hk):
    if Dv != D:
        if (D, Dv) not in _HEAD_DIM_PAIRS:
            raise NotImplementedError(f"head dim of v ({Dv}) must equal that of q and k ({D}), or the pair be one "
                                      f"of {sorted(_HEAD_DIM_PAIRS)}")
        if not _hdim_v_on():
            raise NotImplementedError(f"head dim of v ({Dv}) != that of q and k ({D}): FLASH_ATTN_CUTE_HDIM_V=0 "
                                      "turned these calls off")
    if D not in _SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim {D} not in {_SUPPORTED_HEAD_DIMS}")
    if H % Hk != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k heads ({Hk})")


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


def _pack_auto():
    """Whether pack_gqa=None packs where _pack_helps says so: not yet (the rule awaits the decoding A/B of
    benchmarks/attention/ab_cute_decode.py: fewer CTAs per call may cost more than the fuller tiles save on a small grid), unless
    FLASH_ATTN_CUTE_PACK_GQA=auto."""
    return os.environ.get("FLASH_ATTN_CUTE_PACK_GQA") == "auto"


def _pack_group(pack_gqa, H, Hk, seqlen_q=None):
    """The pack_gqa group of a call: H // Hk when the group is one of _PACK_GROUPS and pack_gqa is true, or None
    (FA4's "choose"), _pack_auto() and _pack_helps(group, seqlen_q) (varlen: the longest sequence's); else 1
    (unpacked: pack_gqa only changes how the work is tiled, not the result). 1 as well with
    FLASH_ATTN_CUTE_PACK_GQA=0."""
    if pack_gqa is False or H == Hk or not (pack_gqa or pack_gqa is None):
        return 1
    if not (_pack_auto() if pack_gqa is None else _feature_on("PACK_GQA")):  # one variable read per call
        return 1
    group = H // Hk
    if group not in _PACK_GROUPS or (pack_gqa is None and not _pack_helps(group, seqlen_q)):
        return 1
    return group


def _choose_splits(tiles, key_blocks, sms):
    """num_splits=0's rule (FlashAttention's split-KV idea: fill the GPU when the grid is small): 1 when the unsplit
    grid's ``tiles`` CTAs fill at least _SPLIT_BELOW of the ``sms`` SMs, or a tile sees fewer than 2 key blocks;
    else, over the part counts s <= min(key_blocks, _MAX_SPLITS) that change the blocks per part (ceil(key_blocks /
    s)), the wave efficiency of tiles x s CTAs (waves / whole waves), and the fewest parts within
    _SPLIT_EFFICIENCY of the best."""
    if tiles <= 0 or tiles >= _SPLIT_BELOW * sms or key_blocks < 2:
        return 1
    efficiency = {}
    for s in range(1, min(key_blocks, _MAX_SPLITS) + 1):
        if s > 1 and -(-key_blocks // s) == -(-key_blocks // (s - 1)):
            continue  # as many blocks per part as with one part fewer: more parts to merge for nothing
        waves = tiles * s / sms
        efficiency[s] = waves / -(-waves // 1)
    best = max(efficiency.values())
    return min(s for s, e in efficiency.items() if e >= _SPLIT_EFFICIENCY * best)


def _split_count(num_splits, tiles=0, seqlen_k=None, q=None):
    """The split-KV parts of a call: num_splits when > 1, at most one per 128-key block of the ``seqlen_k`` keys a
    tile sees (when given: more parts would be empty, and each costs its fp32 O); when <= 0 (FA4's "choose"),
    _choose_splits for the unsplit grid's ``tiles`` CTAs on the SMs of q's CUDA device (_device_sms); 1 without
    those or when num_splits is 1. 1 as well with FLASH_ATTN_CUTE_SPLIT=0. Splitting changes how the work is divided,
    not the result (beyond fp32 rounding)."""
    try:
        if isinstance(num_splits, bool):
            raise TypeError
        num_splits = operator.index(num_splits)  # ints, numpy / torch integer scalars
    except TypeError:
        raise ValueError(f"num_splits must be an int, got {type(num_splits).__name__}") from None
    if num_splits == 1 or not _feature_on("SPLIT"):
        return 1
    if num_splits <= 0:
        sms = _device_sms(q) if tiles and seqlen_k and q is not None else None
        return _choose_splits(tiles, -(-seqlen_k // 128), sms) if sms else 1
    return num_splits if seqlen_k is None else max(1, min(num_splits, -(-seqlen_k // 128)))


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


def _check_sink(learnable_sink, H, device):
    """learnable_sink as the kernel takes it: fp32, contiguous, (H,)."""
    if not isinstance(learnable_sink, torch.Tensor):
        raise ValueError(f"learnable_sink must be a tensor of shape ({H},), got {type(learnable_sink).__name__}")
    if learnable_sink.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"learnable_sink must be fp32, bf16 or fp16, got {learnable_sink.dtype}")
    if tuple(learnable_sink.shape) != (H,):
        raise ValueError(f"learnable_sink must have shape ({H},) (one logit per query head), got "
                         f"{tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink must be on {device} (q's device), got {learnable_sink.device}")
    return learnable_sink.detach().to(_F32).contiguous()


_NO_WINDOW = (None, None)  # flash_attn_func's default window_size (identity-checked on the fast path)


class HeadDimError(AssertionError, ValueError):
    """A head dim FA4 does not take on Hopper: FA4 raises AssertionError there, so this is one (and a ValueError)."""


def _padded_dim(D, Dv):
    """The kernel head dim that q, k (D) and v (Dv) are zero-padded to when (D, Dv) is not a kernel's own pair:
    the smallest of _SUPPORTED_HEAD_DIMS that holds both. Zero columns change no score q.k (the scale stays
    D ** -0.5) and give zero output columns, dropped after the call. HeadDimError for what FA4 refuses on SM90:
    sizes outside [8, 256] or not multiples of 8 (16 bytes of fp16 / bf16)."""
    if not (8 <= D <= 256 and 8 <= Dv <= 256 and D % 8 == 0 and Dv % 8 == 0):
        raise HeadDimError(f"(head_dim, head_dim_v)=({D}, {Dv}) is not supported on SM90. head_dim and head_dim_v "
                           "must be between 8 and 256 and divisible by 8.")
    return next(p for p in _SUPPORTED_HEAD_DIMS if p >= max(D, Dv))


def _pad_last(t, size):
    return t if t.shape[-1] == size else torch.nn.functional.pad(t, (0, size - t.shape[-1]))


def _refuse_unsupported(**given):
    """NotImplementedError naming the first FA4 argument this package does not implement yet that the call set."""
    for name, value in given.items():
        if value is not None and not (name.startswith("aux") and not value):
            raise NotImplementedError(f"flash_attn.cute does not take {name} yet (FA4's {name} is not implemented "
                                      "here); leave it None")


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, window_size=_NO_WINDOW,
                    learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
                    score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
                    block_sparse_tensors_bwd=None, return_lse=False):
    """Attention forward on Hopper, with FA4's signature: q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv)
    fp16/bf16 CUDA tensors, D and Dv multiples of 8 in [8, 256] (the kernels' own head dims 64, 96, 128, 192, 256
    and the pair (192, 128); other sizes run zero-padded to the next of those, _padded_dim; others raise
    HeadDimError, an AssertionError as in FA4), H % Hk == 0 (GQA/MQA). qv, gather_kv_indices, score_mod,
    score_mod_bwd, mask_mod, aux_tensors, aux_scalars and the block-sparsity tensors raise NotImplementedError
    when given. Causal and sliding-window masks are bottom-right aligned: query i
    sees key j iff j - (i + Sk - Sq) lies in [-window_size[0], window_size[1]] (None: no limit on that side;
    negative sizes are literal, as in FA4, except that two sizes with a negative sum mean no window; causal sets
    the right size to 0; see _options; the gradients of a negative size raise NotImplementedError for now).
    softcap > 0: scores become
    softcap * tanh(scale * q.k / softcap). learnable_sink: None or (H,) fp32/bf16/fp16 logits, one per
    query head, that join every softmax row as a term exp(sink) with no value (not scaled by
    softmax_scale; lse includes it, a row that sees no key gets out 0 and lse = sink); its gradient
    is computed when it requires one (autograd.py). pack_gqa=True: the H / Hk query heads of each KV head
    share the kernel's tiles (_pack_group: groups of 2, 4, 8 or 16; other groups and FLASH_ATTN_CUTE_PACK_GQA=0 run
    unpacked, the same result); None: unpacked for now (with FLASH_ATTN_CUTE_PACK_GQA=auto packed where that fills
    the tiles better, _pack_helps: short query sequences, decoding). num_splits > 1: split-KV (_forward_split;
    FLASH_ATTN_CUTE_SPLIT=0: unsplit); num_splits <= 0: as many parts as fill the
    GPU's SMs when the grid alone does not (_choose_splits), 1 otherwise. Returns (out, lse): out
    like q, lse fp32 (B, H, Sq) natural log (+inf for a row that sees no key) when return_lse or a
    gradient needs it, else None (as FA4; the kernel still writes it). When q, k or v needs a
    gradient its backward runs on this package's backward kernel when the call is one it handles (dense, no
    window, softcap or determinism; FLASH_ATTN_CUTE_BWD=0 switches it off), else on the root package's Triton
    backward when that package is installed, else on this package's PyTorch backward (autograd.py;
    deterministic=True: a deterministic one). A loss that uses the returned lse sends its gradient back too."""
    # Every check reads attributes only (no tensor ops, no CUDA queries): this is the per-call path. What is
    # not a 4-D tensor fails the unpacking or the dtype lookup; _check_tensors then names the problem.
    try:
        dtype = q.dtype
        B, Sq, H, D = q.shape
        Bk, Sk, Hk, Dk = k.shape
        Bv, Sv, Hv, Dv = v.shape
        if dtype not in _DTYPE_NAMES or k.dtype != dtype or v.dtype != dtype:
            raise TypeError
    except (AttributeError, TypeError, ValueError):
        _check_tensors(q, k, v)
        raise
    if (qv is not None or gather_kv_indices is not None or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors or aux_scalars or block_sparse_tensors is not None
            or block_sparse_tensors_bwd is not None):
        _refuse_unsupported(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                            score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                            aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors,
                            block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    if Bk != B or Bv != Bk or Sv != Sk or Hv != Hk or Dk != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if D not in _SUPPORTED_HEAD_DIMS or (Dv != D and (D, Dv) not in _HEAD_DIM_PAIRS):
        P = _padded_dim(D, Dv)
        out, lse = flash_attn_func(_pad_last(q, P), _pad_last(k, P), _pad_last(v, P),
                                   softmax_scale=D ** -0.5 if softmax_scale is None else softmax_scale, causal=causal,
                                   window_size=window_size, learnable_sink=learnable_sink, softcap=softcap,
                                   num_splits=num_splits, pack_gqa=pack_gqa, deterministic=deterministic,
                                   return_lse=return_lse)
        return out[..., :Dv].contiguous(), lse
    _check_dims(D, Dv, H, Hk)
    pack = splits = 1
    if (window_size is _NO_WINDOW and learnable_sink is None and not softcap and num_splits == 1
            and not pack_gqa and (H == Hk or pack_gqa is False or _pack_group(None, H, Hk, Sq) == 1)):
        window_left = window_right = _UNBOUNDED  # the common call: no option to parse
        softcap = 0.0
    else:
        causal, window_left, window_right, softcap = _options(window_size, softcap, causal)
        pack = _pack_group(pack_gqa, H, Hk, Sq)
        rows = _RULE_BLOCK_M // pack  # query positions per tile
        splits = _split_count(num_splits, B * (Hk if pack > 1 else H) * -(-Sq // rows),
                              _visible_keys(Sk, rows, window_left, 0 if causal else window_right), q)
        if learnable_sink is not None:
            sink = _check_sink(learnable_sink, H, q.device)
            arch = _device_arch(q, k, v)
            args = (D ** -0.5 if softmax_scale is None else float(softmax_scale), bool(causal), window_left,
                    window_right, softcap, bool(deterministic), arch, None)
            if _autograd.needs_grad(q, k, v, learnable_sink):
                return _autograd.Attention.apply(q, k, v, learnable_sink, args)
            out, lse = forward(q, k, v, args[0], bool(causal), arch, window_left, window_right, softcap, sink,
                               pack=pack, splits=splits)
            return out, (lse if return_lse else None)
    arch = _device_arch(q, k, v)
    if softmax_scale is None:
        softmax_scale = D ** -0.5
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        res = _autograd.with_fallback_backward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                               deterministic=deterministic)
        if res is not None:
            return res
        return _autograd.Attention.apply(q, k, v, None, (float(softmax_scale), bool(causal), window_left,
                                                         window_right, softcap, bool(deterministic), arch, None))
    if (window_left == _UNBOUNDED and window_right == _UNBOUNDED and not softcap and Sk and B * Sq * H and pack == 1
            and Dv == D
            and splits == 1):
        # Dense, no window or softcap (the common call): forward() without its general-case work.
        key = (dtype, D, bool(causal), arch, False, False)
        if Sk <= _TMA_O_SHORT_SK:
            fn = _kernels.get(key + ("short",) if D in _SHORT_DIMS else key)
        else:
            fn = _kernels.get(key + ("long",) if Sk >= _FWD_LONG_SK and (D, key[2]) in _FWD_LONG_ON else key)
        if fn is not None and B * max(Sq * H, Sk * Hk) * D < _MAX_ELEMS and B <= _MAX_GRID_Z:
            qs, ks, vs = q.stride(), k.stride(), v.stride()
            if (qs[3] != 1 or qs[2] != D or qs[1] & 7 or qs[0] & 7 or q.data_ptr() & 15
                    or ks[3] != 1 or ks[2] != D or ks[1] & 7 or ks[0] & 7 or k.data_ptr() & 15
                    or vs[3] != 1 or vs[2] != D or vs[1] & 7 or vs[0] & 7 or v.data_ptr() & 15):
                q, k, v = _kernel_layout(q, D), _kernel_layout(k, D), _kernel_layout(v, D)
            out = torch.empty_like(q)
            if return_lse:
                lse = torch.empty(B, H, Sq, dtype=_F32, device=q.device)  # sizes as ints: parsed faster
            else:
                lse = _lse_scratch.get((q.get_device(), B, H, Sq))
                if lse is None:
                    lse = _new_lse_scratch(q.get_device(), B, H, Sq)
            fn(q, k, v, out, lse, float(softmax_scale), 0.0, 0, 0)
            return out, (lse if return_lse else None)
    out, lse = forward(q, k, v, softmax_scale, bool(causal), arch, window_left, window_right, softcap, pack=pack,
                       splits=splits)
    return out, (lse if return_lse else None)


def _window_args(causal, window_left, window_right):
    """(left, right, local) as the kernel takes them (literal sizes, _UNBOUNDED for no limit); local says
    whether the call needs the window variant (causal alone does not)."""
    local = window_left < _UNBOUNDED or (window_right < _UNBOUNDED and not causal)
    if not local:
        return 0, 0, False
    # the kernel's sizes are Int32: a size past _UNBOUNDED is no limit all the same
    left = max(min(window_left, _UNBOUNDED), -_UNBOUNDED)
    return left, 0 if causal else max(min(window_right, _UNBOUNDED), -_UNBOUNDED), True


def forward(q, k, v, softmax_scale, causal, arch="sm_90a", window_left=_UNBOUNDED, window_right=_UNBOUNDED, softcap=0.0,
            sink=None, pack=1, splits=1):
    """The kernel launch on validated CUDA inputs (shared with the dispatcher's backend module):
    q (B, Sq, H, D), k/v (B, Sk, Hk, D) fp16/bf16, D in _SUPPORTED_HEAD_DIMS, H % Hk == 0; window sizes literal
    (negative ones too), _UNBOUNDED for no limit, causal implies a right size of 0; softcap 0 is off; sink None or fp32 contiguous (H,)
    (see _check_sink); pack: the pack_gqa group (_pack_group; H == pack * Hk), 1 for none. v's head dim may differ
    from q's (a pair of _HEAD_DIM_PAIRS; out has v's). splits > 1: split-KV (_forward_split). Returns (out, lse)."""
    B, Sq, H, D = q.shape
    Dv = v.shape[3]
    window_left, window_right, local = _window_args(causal, window_left, window_right)
    capped = softcap > 0.0
    sink_arg = () if sink is None else (sink,)
    q, k, v = _kernel_layout(q, D), _kernel_layout(k, D), _kernel_layout(v, Dv)
    Sk = k.shape[1]
    splits = min(splits, _MAX_GRID_Z // max(B, 1))  # grid z = parts x batch
    if splits > 1 and Sk and B * Sq * H and splits * B * max(Sq * H, Sk * k.shape[2]) * max(D, Dv) < _MAX_ELEMS:
        # (the split path allocates its own fp32 parts and returns the merged out / lse)
        return _forward_split(q, k, v, softmax_scale, causal and not local, arch, local, window_left, window_right,
                              softcap, sink, pack, splits)
    out = torch.empty_like(q) if Dv == D else q.new_empty(B, Sq, H, Dv)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)  # sizes as ints: parsed faster
    if Sk == 0:  # no key at all: every row is empty (TMA descriptors cannot map a 0-length dim)
        out.zero_()
        if sink is None:
            lse.fill_(math.inf)
        else:  # the sink is the row's only term
            lse.copy_(sink.view(1, H, 1).expand(B, H, Sq))
    elif B * Sq * H > 0:
        causal = causal and not local
        short, long = _length_kernel(D, causal, k.shape[1],
                                     not (local or capped or sink is not None or pack > 1 or Dv != D))
        fn = (_kernels.get((q.dtype, D, causal, arch, local, capped) + (("sink",) if sink is not None else ())
                           + (("short",) if short else ()) + (("long",) if long else ())
                           + (("pack", pack) if pack > 1 else ()) + (("dv", Dv) if Dv != D else ()))
              or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, sink=sink is not None,
                            short=short, long=long, pack=pack, dv=Dv))
        args = (float(softmax_scale), float(softcap), window_left, window_right)
        per_batch = max(Sq * H, k.shape[1] * k.shape[2]) * max(D, Dv)  # elements of one entry's q/out or k/v
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


def _forward_split(q, k, v, softmax_scale, causal, arch, local, window_left, window_right, softcap, sink, pack,
                   splits):
    """Split-KV on validated inputs (forward's, window sizes already the kernel's): the split kernel writes each
    part's O and lse in fp32 (parts of batch entry b at s * B + b), _combine_splits merges them (and adds the sink,
    which the kernel leaves out so that it counts once)."""
    B, Sq, H, D = q.shape
    Dv = v.shape[3]
    capped = softcap > 0.0
    o_parts = torch.empty(splits * B, Sq, H, Dv, dtype=torch.float32, device=q.device)
    lse_parts = torch.empty(splits * B, H, Sq, dtype=torch.float32, device=q.device)
    fn = (_kernels.get((q.dtype, D, causal, arch, local, capped) + (("pack", pack) if pack > 1 else ())
                       + (("dv", Dv) if Dv != D else ()) + ("split",))
          or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, pack=pack, dv=Dv, split=True))
    fn(q, k, v, o_parts, lse_parts, float(softmax_scale), float(softcap), window_left, window_right, splits)
    return _combine_splits(o_parts.view(splits, B, Sq, H, Dv), lse_parts.view(splits, B, H, Sq), sink, q.dtype)


def _combine_splits(o_parts, lse_parts, sink, dtype):
    """(out, lse) from split-KV parts: o_parts (S, B, Sq, H, Dv) each divided by its own row sums, lse_parts (S, B,
    H, Sq) natural-log, +inf for a part whose rows saw no key (no contribution). lse = log(sum_s exp(lse_s) [+
    exp(sink)]), out = sum_s exp(lse_s - lse) o_s in dtype; a row no part saw gets out 0 and lse +inf (or the
    sink). fp32 torch ops."""
    terms = torch.where(torch.isposinf(lse_parts), torch.full_like(lse_parts, -math.inf), lse_parts)
    if sink is not None:
        S, B, H, Sq = lse_parts.shape
        terms = torch.cat([terms, sink.float().view(1, 1, H, 1).expand(1, B, H, Sq)], 0)
    lse = torch.logsumexp(terms, 0)  # (B, H, Sq); -inf where no term
    seen = torch.isfinite(lse)
    weights = torch.where(seen, torch.exp(terms[:lse_parts.shape[0]] - lse), torch.zeros_like(lse))  # (S, B, H, Sq)
    out = (o_parts * weights.permute(0, 1, 3, 2).unsqueeze(-1)).sum(0)
    return out.to(dtype), torch.where(seen, lse, torch.full_like(lse, math.inf))


def _check_cu_seqlens(name, cu, device, batch=None):
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype != torch.int32:
        raise ValueError(f"{name} must be a 1-D int32 tensor (batch + 1,), got "
                         f"{getattr(cu, 'dtype', type(cu).__name__)} of shape {tuple(getattr(cu, 'shape', ()))}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device}, got {cu.device}")
    if cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        raise ValueError(f"{name} must have batch + 1 entries, got {cu.shape[0]}")


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None,
                           page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                           learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                           score_mod=None, score_mod_bwd=None, mask_mod=None, block_sparse_tensors=None,
                           aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
                           seqlen_k_per_split=None, disable_scheduler_metadata=False):
    """FA4's varlen entry (see _varlen_func for the packed layout). q may also be batch-shaped (B, Sq, H, D) with
    cu_seqlens_q None (sequence b: the first seqused_q[b] of its Sq rows, all without seqused_q), and k / v
    (B, Sk, Hk, D) with cu_seqlens_k None (likewise with seqused_k); out then has q's batch shape and lse is
    (B, H, Sq). min_seqlen_k, scheduler_metadata (get_scheduler_metadata), seqlen_k_per_split and
    disable_scheduler_metadata are scheduling hints in FA4 that change no result; the kernels here need none of
    them. qv, gather_kv_indices, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars and
    block_sparse_tensors raise NotImplementedError when given."""
    if (qv is not None or gather_kv_indices is not None or score_mod is not None or score_mod_bwd is not None
            or mask_mod is not None or aux_tensors or aux_scalars or block_sparse_tensors is not None):
        _refuse_unsupported(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod,
                            score_mod_bwd=score_mod_bwd, mask_mod=mask_mod, aux_tensors=aux_tensors,
                            aux_scalars=aux_scalars, block_sparse_tensors=block_sparse_tensors)
    batch_q = isinstance(q, torch.Tensor) and q.dim() == 4 and cu_seqlens_q is None
    batch_k = (page_table is None and isinstance(k, torch.Tensor) and k.dim() == 4 and cu_seqlens_k is None)
    if batch_q:
        B, Sq = q.shape[:2]
        q = q.reshape(B * Sq, *q.shape[2:])
        cu_seqlens_q = torch.arange(0, (B + 1) * Sq, Sq, dtype=torch.int32, device=q.device)[:B + 1]
        max_seqlen_q = Sq if max_seqlen_q is None else max_seqlen_q
    if batch_k:
        if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"k and v must both be batch-shaped (B, Sk, Hk, D) like each other, got k "
                             f"{tuple(k.shape)}, v {tuple(getattr(v, 'shape', ()))}")
        Bk, Sk = k.shape[:2]
        k, v = k.reshape(Bk * Sk, *k.shape[2:]), v.reshape(Bk * Sk, *v.shape[2:])
        cu_seqlens_k = torch.arange(0, (Bk + 1) * Sk, Sk, dtype=torch.int32, device=k.device)[:Bk + 1]
        max_seqlen_k = Sk if max_seqlen_k is None else max_seqlen_k
    out, lse = _varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                            page_table, softmax_scale, causal, window_size, learnable_sink, softcap, num_splits,
                            pack_gqa, deterministic, return_lse)
    if batch_q:
        out = out.view(B, Sq, *out.shape[1:])
        lse = None if lse is None else lse.view(lse.shape[0], B, Sq).transpose(0, 1)
    return out, lse


def _varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                 window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
                 pack_gqa=None, deterministic=False, return_lse=False):
    """Attention forward over packed sequences: q (total_q, H, D), k/v (total_k, Hk, D); sequence b is, of q, the
    first seqused_q[b] rows from cu_seqlens_q[b] (all of cu_seqlens_q[b]:cu_seqlens_q[b + 1] without seqused_q)
    and, of k/v, the first seqused_k[b] rows from cu_seqlens_k[b] (all of cu_seqlens_k[b]:cu_seqlens_k[b + 1]
    without seqused_k); masks align the sequence's last used query with its last used key. Rows of q past
    seqused_q[b] get out 0 and the lse of a row that sees no key (+inf, or the sink). Masks, softcap and
    dtypes and learnable_sink as flash_attn_func. Returns (out (total_q, H, D), lse (H, total_q) fp32, or None as in
    flash_attn_func). Checks the
    cu_seqlens / seqused values (one device sync); max_seqlen_q is computed (another sync) when not given.
    page_table (paged K / V): k / v (num_pages, page_size, Hk, D), page_table int32 (B, max_pages): sequence b's
    keys are the first seqused_k[b] rows of its pages page_table[b, 0], page_table[b, 1], ... in order (give
    seqused_k, not cu_seqlens_k; page_size a multiple of 8, see _paged_block_n). Forward only. num_splits, pack_gqa:
    as flash_attn_func's (pack_gqa None with FLASH_ATTN_CUTE_PACK_GQA=auto: _pack_helps for the longest sequence's
    length; num_splits <= 0 reads the longest sequence's key count in the call's one sync)."""
    paged = page_table is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        want = 4 if paged and name != "q" else 3
        if not isinstance(t, torch.Tensor) or t.dim() != want:
            raise ValueError(f"{name} must be a {want}-D tensor "
                             + ("(num_pages, page_size, Hk, D) with page_table" if want == 4 else "(total, H, D)"))
    if paged:
        if not _paged_on():
            raise NotImplementedError("page_table: FLASH_ATTN_CUTE_PAGED=0 turned the paged kernel off")
        if cu_seqlens_k is not None or seqused_k is None:
            raise ValueError("page_table: give each sequence's key count as seqused_k (and cu_seqlens_k None)")
    if cu_seqlens_q is None or (cu_seqlens_k is None and not paged):
        raise NotImplementedError("flash_attn.cute's varlen path needs both cu_seqlens_q and cu_seqlens_k")
    dtype = q.dtype
    if dtype not in _DTYPE_NAMES or k.dtype != dtype or v.dtype != dtype:
        raise ValueError(f"q, k, v must share one dtype, fp16 or bf16; got {q.dtype}, {k.dtype}, {v.dtype}")
    Tq, H, D = q.shape
    if paged:
        num_pages, page_size, Hk, Dk = k.shape
        Tk = num_pages * page_size
        same = v.shape[:3] == k.shape[:3]
    else:
        Tk, Hk, Dk = k.shape
        same = v.shape[:2] == k.shape[:2]
    if not same or Dk != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    Dv = v.shape[-1]
    if D not in _SUPPORTED_HEAD_DIMS or (Dv != D and (D, Dv) not in _HEAD_DIM_PAIRS):
        P = _padded_dim(D, Dv)
        out, lse = _varlen_func(_pad_last(q, P), _pad_last(k, P), _pad_last(v, P), cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, page_table,
                                D ** -0.5 if softmax_scale is None else softmax_scale, causal, window_size,
                                learnable_sink, softcap, num_splits, pack_gqa, deterministic, return_lse)
        return out[..., :Dv].contiguous(), lse
    _check_dims(D, Dv, H, Hk)
    causal, window_left, window_right, softcap = _options(window_size, softcap, causal)
    splits = _split_count(num_splits)  # (num_splits <= 0: chosen below, with the sequence lengths)
    sink = None if learnable_sink is None else _check_sink(learnable_sink, H, q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got stride {t.stride(-1)}")
    arch = _device_arch(q, k, v)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if paged:
        if (not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32 or page_table.dim() != 2
                or page_table.shape[0] != batch or page_table.device != q.device or page_table.stride(-1) != 1):
            raise ValueError(f"page_table must be an int32 tensor (batch={batch}, max_pages) on {q.device} with a "
                             f"contiguous last dimension, got {getattr(page_table, 'dtype', type(page_table))} of "
                             f"shape {tuple(getattr(page_table, 'shape', ()))}")
        cu_k_check = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)  # (no cu_seqlens_k: nothing to check)
    else:
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device, batch)
        cu_k_check = cu_seqlens_k
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is not None and (not isinstance(used, torch.Tensor) or used.dtype != torch.int32
                                 or used.shape != (batch,) or used.device != q.device):
            raise ValueError(f"{name} must be an int32 tensor ({batch},) on {q.device}")
    # One device sync for every value check (and max_seqlen_q).
    lens_q, lens_k = cu_seqlens_q[1:] - cu_seqlens_q[:-1], cu_k_check[1:] - cu_k_check[:-1]
    if paged:
        lens_k = torch.full_like(lens_k, page_table.shape[1] * page_size)  # each sequence's page table's capacity
    zero = cu_seqlens_q.new_zeros(())
    used_bad = (((seqused_k < 0) | (seqused_k > lens_k)).sum() if seqused_k is not None else zero)
    used_q_bad = (((seqused_q < 0) | (seqused_q > lens_q)).sum() if seqused_q is not None else zero)
    pages_bad = zero
    if paged and batch and page_table.shape[1]:
        # the page table entries the sequences use: each a page of k / v
        used_pages = torch.arange(page_table.shape[1], device=q.device) < ((seqused_k + page_size - 1)
                                                                          // page_size).view(-1, 1)
        pages_bad = (((page_table < 0) | (page_table >= num_pages)) & used_pages).sum()
    # the split rule and the cap on num_splits need the longest sequence's key count
    choose = (splits > 1 or num_splits <= 0) and _feature_on("SPLIT")
    keys_max = ((seqused_k if seqused_k is not None else lens_k).max() if batch else zero,) if choose else ()
    first_q, down_q, last_q, max_q, first_k, down_k, last_k, used_bad, used_q_bad, pages_bad, *max_k = torch.stack([
        cu_seqlens_q[0], (lens_q < 0).sum(), cu_seqlens_q[-1], lens_q.max() if batch else zero,
        cu_k_check[0], (lens_k < 0).sum(), cu_k_check[-1], used_bad, used_q_bad, pages_bad, *keys_max]).tolist()
    for name, first, down, last, total in (("cu_seqlens_q", first_q, down_q, last_q, Tq),
                                            ("cu_seqlens_k", first_k, down_k, last_k, Tk)):
        if first != 0 or down or last > total:
            raise ValueError(f"{name} must start at 0, never decrease and end at most at {total} "
                             f"(got first {first}, last {last})")
    if used_bad:
        raise ValueError("seqused_k must lie in [0, page_table.shape[1] * page_size]" if paged else
                         "seqused_k must lie in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]]")
    if pages_bad:
        raise ValueError(f"page_table: {pages_bad} entries that sequences use are not page indices in "
                         f"[0, {num_pages})")
    if used_q_bad:
        raise ValueError("seqused_q must lie in [0, cu_seqlens_q[b + 1] - cu_seqlens_q[b]]")
    if paged and _paged_block_n(128, page_size) is None:
        # Pages of fewer than 8 rows (or not a multiple of 8) fill no TMA box: the sequences' pages are gathered into
        # contiguous keys (a copy of each sequence's page-table capacity) for the unpaged kernel.
        k, v, cu_k, cap = _gather_pages(k, v, page_table)
        return _varlen_func(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, cap, seqused_q, seqused_k, None,
                            softmax_scale, causal, window_size, learnable_sink, softcap, num_splits, pack_gqa,
                            deterministic, return_lse)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)
    if max_seqlen_q is None:
        max_seqlen_q = max_q
    elif int(max_seqlen_q) < max_q:
        raise ValueError(f"max_seqlen_q ({max_seqlen_q}) is below the longest sequence ({max_q})")
    if _autograd.needs_grad(q, k, v, learnable_sink):
        if paged:
            raise NotImplementedError("gradients with page_table (paged K / V is a forward-only path)")
        if max_seqlen_k is None:
            max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if batch else 0
        varlen = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), seqused_q, seqused_k)
        if sink is None and seqused_q is None and seqused_k is None:
            res = _autograd.with_fallback_backward(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                                                   varlen, deterministic=deterministic)
            if res is not None:
                return res
        return _autograd.Attention.apply(q, k, v, learnable_sink, (float(softmax_scale), bool(causal), window_left,
                                                                   window_right, softcap, bool(deterministic), arch,
                                                                   varlen))
    pack = _pack_group(pack_gqa, H, Hk, int(max_seqlen_q))
    if choose:
        rows = _RULE_BLOCK_M // pack
        splits = _split_count(num_splits, batch * (Hk if pack > 1 else H) * -(-int(max_seqlen_q) // rows),
                              _visible_keys(max_k[0], rows, window_left, 0 if causal else window_right), q)
    if seqused_q is not None:
        cu_seqlens_q, keys, seqused_k = _split_unused_q(cu_seqlens_q, page_table if paged else cu_seqlens_k,
                                                        seqused_q, seqused_k, paged)
        if paged:
            page_table = keys
        else:
            cu_seqlens_k = keys
    out, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, int(max_seqlen_q), softmax_scale,
                              bool(causal), arch, window_left, window_right, softcap, sink=sink,
                              pack=pack, page_table=page_table, splits=splits)
    if last_q < Tq:  # rows of q after the last sequence belong to none: out 0, lse +inf
        out[last_q:] = 0
        lse[:, last_q:] = math.inf
    return out, (lse if return_lse else None)


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
    # rows 16-byte aligned, head dim contiguous, heads D (v: Dv) apart (paged k / v: the dense kernel's layout)
    q = q if q.stride(1) == D and q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.data_ptr() % 16 == 0 else \
        q.clone(memory_format=torch.contiguous_format)
    if page_table is not None:
        k, v = _kernel_layout(k, D), _kernel_layout(v, Dv)
    else:
        k, v = (t if t.stride(1) == t.shape[2] and t.stride(2) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
                else t.clone(memory_format=torch.contiguous_format) for t in (k, v))
    out = (torch.zeros if fill_unused_rows else torch.empty)((Tq, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.full((H, Tq), math.inf, dtype=torch.float32, device=q.device) if fill_unused_rows else \
        torch.empty((H, Tq), dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if k.shape[0] == 0 or batch == 0:  # no key anywhere (TMA descriptors cannot map a 0-length dim)
        out.zero_()
        lse.fill_(math.inf)
        if sink is not None and batch > 0 and Tq > 0:  # rows of a sequence: the sink is their only term
            rows = torch.arange(Tq, device=q.device) < cu_seqlens_q[-1]  # no host sync
            lse.copy_(torch.where(rows, sink.view(H, 1), lse))
    elif Tq > 0 and max_seqlen_q > 0:
        if seqused_k is None:
            seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        window_left, window_right, local = _window_args(causal, window_left, window_right)
        causal = causal and not local
        capped = softcap > 0.0
        sinked = sink is not None
        page_size = 0 if page_table is None else k.shape[1]
        keys = cu_seqlens_k if page_table is None else page_table  # the paged kernel takes the page table there
        splits = min(splits, _MAX_GRID_Z // max(batch, 1))  # grid z = parts x sequences: one launch
        if splits > 1 and splits * Tq * H * max(D, Dv) < _MAX_ELEMS:
            # split s's parts in entry s (rows after the last sequence are never written: their merge is undefined,
            # as those rows of the unsplit kernel's out, and replaced when fill_unused_rows)
            o_parts = torch.empty(splits, Tq, H, Dv, dtype=torch.float32, device=q.device)
            lse_parts = torch.empty(splits, H, Tq, dtype=torch.float32, device=q.device)
            fn = (_kernels.get((q.dtype, D, causal, arch, local, capped, True) + (("pack", pack) if pack > 1 else ())
                               + (("dv", Dv) if Dv != D else ()) + (("paged", page_size) if page_size else ())
                               + ("split",))
                  or fwd_kernel(q.dtype, D, causal, arch, local=local, softcap=capped, varlen=True, pack=pack, dv=Dv,
                                paged=page_size, split=True))
            fn(q, k, v, o_parts, lse_parts, cu_seqlens_q, keys, seqused_k, max_seqlen_q, float(softmax_scale),
               float(softcap), window_left, window_right, splits)
            merged, merged_lse = _combine_splits(o_parts.view(splits, 1, Tq, H, Dv),
                                                 lse_parts.view(splits, 1, H, Tq), sink, q.dtype)
            out, lse = merged[0], merged_lse[0]
            if fill_unused_rows:
                rows = torch.arange(Tq, device=q.device) < cu_seqlens_q[-1]  # no host sync
                out, lse = torch.where(rows.view(Tq, 1, 1), out, 0.0), torch.where(rows, lse, math.inf)
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


# ----------------------------------------------------------------------------------------------------
# Backward (flash_bwd_sm90.py): dense, causal or not, GQA/MQA; no windows, softcap, varlen or dropout.

_bwd_kernels: dict[tuple, object] = {}  # (torch dtype, head dim, causal, arch) -> callable
_LOG2E = 1.4426950408889634
# Query rows per pipeline stage (the N of S^T = K Q^T) and Q/dO ring depth; keys per CTA are fixed at
# 128 (64 per consumer warpgroup). FLASH_ATTN_CUTE_BWD_BLOCK_M / _STAGES override them (tuning knobs;
# the disk cache keys on them). d64 takes 128 query rows (the spill-free BLOCK_M = 128 path): H200, bf16, b8
# s2048 h16 (the GPT-2 medium shape), one process (benchmarks/attention/ab_cute_bwd.py), kernel / whole call TFLOP/s,
# 64 -> 128: causal 312 / 279 -> 334 / 297, non-causal 377 / 352 -> 409 / 378; 108 GPU gradient tests
# passed. d128 has no BLOCK_M = 128 (its accumulators do not fit the registers).
_BWD_BLOCK_M = {64: 128, 128: 64}
_BWD_STAGES = {64: 2, 128: 2}
# dQ tile shared by the two consumer warpgroups (split along D; one atomic add per element per key
# block) or one per warpgroup (two adds, no cross-warpgroup barrier). FLASH_ATTN_CUTE_BWD_DQ_SPLIT=0/1.
_BWD_DQ_SPLIT = True
# dQ added into dq_accum by a TMA reduce-add of the whole fp32 tile from shared memory (one bulk
# operation per query block, issued by one warp) instead of red.global.add.v2.f32 from every consumer
# thread. Needs the dQ split. FLASH_ATTN_CUTE_BWD_DQ_TMA=0/1. H200, bf16, 16k tokens, kernel alone
# (benchmarks/results/h200/attention_cute_bwd.md, session 5): d64 causal 2k 273 -> 325 TFLOP/s, d64 8k 342 -> 429,
# d128 causal 2k 313 -> 382, d128 8k 399 -> 520: on for both head dims.
_BWD_DQ_TMA = {64: True, 128: True}  # per head dim
# Software-pipelined query loop (S^T and dP^T of the next query block issued behind dK and dQ of this
# one, overlapping this block's dQ atomics). FLASH_ATTN_CUTE_BWD_OVERLAP=0/1. Same run: +4-6% over the
# red.global dQ, but with the TMA dQ d64 within noise (2k causal 290 vs 292, 8k causal 397 vs 390) and
# d128 3-8% slower: off.
_BWD_OVERLAP = {64: False, 128: False}  # per head dim
# CTA order: 0 keeps the grid (key block fastest, then head, then batch); N > 0 launches groups of
# (head, batch) pairs of about N CTAs each with the key block slowest inside a group, so key block 0 (the
# longest under a causal mask) of every pair in the group starts first and the grid ends on short CTAs,
# while the CTAs in flight still share a few heads' Q, dO and dq_accum in L2. FLASH_ATTN_CUTE_BWD_LPT=N
# (0: the plain grid). Default: 128 for causal d64 (H200, b8 s2048 h16: kernel +4% causal, -1-3% without a
# mask, session 6's ab_cute_bwd; GPT-2 medium step with CUDA graphs 90.0 -> 89.6 ms, session 7).
_BWD_LPT = 0
_BWD_LPT_CAUSAL = {64: 128}
# Exponentials of P^T per 16 computed by softmax_exp.exp2_poly on the FMA pipe instead of MUFU.EX2
# (FLASH_ATTN_CUTE_BWD_EXP2_EMU overrides, 0..16; FLASH_ATTN_CUTE_BWD_EXP2_EMU_DEGREE the polynomial's
# degree, 2..4, default 3). In the cache key only when on. Not measured on a GPU yet: off.
_BWD_EXP2_EMU = {64: 0, 128: 0}


def _bwd_config(dtype, head_dim, causal, arch):
    """Everything that selects the backward kernel's code (the disk cache key; see _fwd_config)."""
    block_m = int(os.environ.get("FLASH_ATTN_CUTE_BWD_BLOCK_M") or _BWD_BLOCK_M.get(int(head_dim), 64))
    stages = int(os.environ.get("FLASH_ATTN_CUTE_BWD_STAGES") or _BWD_STAGES.get(int(head_dim), 2))
    split = os.environ.get("FLASH_ATTN_CUTE_BWD_DQ_SPLIT")
    dq_split = _BWD_DQ_SPLIT if not split else split not in ("0", "false", "False")
    tma = os.environ.get("FLASH_ATTN_CUTE_BWD_DQ_TMA")
    dq_tma = dq_split and (_BWD_DQ_TMA.get(int(head_dim), False) if not tma else tma not in ("0", "false", "False"))
    ov = os.environ.get("FLASH_ATTN_CUTE_BWD_OVERLAP")
    overlap = _BWD_OVERLAP.get(int(head_dim), False) if not ov else ov not in ("0", "false", "False")
    lpt = int(os.environ.get("FLASH_ATTN_CUTE_BWD_LPT")
              or (_BWD_LPT_CAUSAL.get(int(head_dim), _BWD_LPT) if causal else _BWD_LPT))
    config = {"kernel": "FlashBwdSm90", "dtype": _DTYPE_NAMES.get(dtype, str(dtype)), "head_dim": int(head_dim),
              "causal": bool(causal), "block_m": block_m, "stages": stages, "dq_split": dq_split, "dq_tma": dq_tma,
              "arch": arch,
              "abi": "tvm-ffi-env-stream" if _tvm_ffi() else "cute"}
    if overlap:  # absent when off: the default kernels keep their disk cache keys
        config["overlap"] = True
    if lpt > 0:
        config["lpt"] = lpt
    emu = int(os.environ.get("FLASH_ATTN_CUTE_BWD_EXP2_EMU") or _BWD_EXP2_EMU.get(int(head_dim), 0))
    if emu:  # likewise
        config["exp2_emu"] = emu
        degree = int(os.environ.get("FLASH_ATTN_CUTE_BWD_EXP2_EMU_DEGREE") or 3)
        if degree != 3:
            config["exp2_emu_degree"] = degree
    return config


def compile_bwd(dtype, head_dim, causal, arch="sm_90a", dump_dir=None):
    """Compile the backward kernel for ``dtype`` (torch.float16 / torch.bfloat16), ``head_dim`` (64 / 128)
    and ``causal`` for ``arch``; no GPU needed. ``dump_dir``: an existing folder that receives the PTX
    and cubin. With apache-tvm-ffi the call is ``(q, k, v, dout, lse2, delta, dq_accum, dk, dv,
    softmax_scale)`` on torch tensors (see FlashBwdSm90.__call__; ``backward`` prepares them)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    config = _bwd_config(dtype, head_dim, causal, arch)
    if config["dtype"] not in ("fp16", "bf16"):
        raise ValueError(f"dtype {dtype} not fp16/bf16")
    kernel = FlashBwdSm90(_cutlass_dtype(dtype), int(head_dim), bool(causal), block_m=config["block_m"],
                          num_stages=config["stages"], dq_split=config["dq_split"],
                          dq_tma=config["dq_tma"], overlap=config.get("overlap", False),
                          lpt=config.get("lpt", 0),
                          exp2_emu=config.get("exp2_emu", 0), exp2_emu_degree=config.get("exp2_emu_degree", 3))
    D = kernel.head_dim
    # 32-bit symbolic shapes and strides, as in compile_fwd (backward() keeps tensors below 2^31 elements).
    batch, seqlen_q, seqlen_k, heads, heads_kv, seqlen_q_pad = (cute.sym_int() for _ in range(6))

    def bshd(dt, seqlen, h):
        return make_fake_tensor(dt, (batch, seqlen, h, D),
                                (cute.sym_int(divisibility=8), cute.sym_int(divisibility=8), D, 1),
                                assumed_align=16)

    def rows():  # lse2 / delta (B, H, Sq_pad) fp32: TMA needs 16-byte aligned rows
        return make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q_pad),
                                (cute.sym_int(divisibility=4), cute.sym_int(divisibility=4), 1), assumed_align=16)

    dt = kernel.dtype
    tvm_ffi = config["abi"] != "cute"
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    return cute.compile(kernel, bshd(dt, seqlen_q, heads), bshd(dt, seqlen_k, heads_kv),
                        bshd(dt, seqlen_k, heads_kv), bshd(dt, seqlen_q, heads), rows(), rows(),
                        bshd(cutlass.Float32, seqlen_q, heads), bshd(dt, seqlen_k, heads),
                        bshd(dt, seqlen_k, heads), cutlass.Float32(1.0), stream, options=options)


def _bwd_entry(dtype, head_dim, causal, arch):
    config = _bwd_config(dtype, head_dim, causal, arch)
    key = cache.entry_key(config)
    name = (f"bwd-{arch}-{config['dtype']}-d{config['head_dim']}-{'causal' if causal else 'full'}"
            f"-{key[:16]}")
    return config, key, name, f"flash_attn_cute_{key[:16]}"


def _bwd_dlpack_launcher(compiled):
    # As _dlpack_launcher, for the backward's signature.
    import cutlass
    from cuda.bindings import driver
    from cutlass.cute.runtime import from_dlpack

    def as_cute(t, align):
        return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    def launch(q, k, v, dout, lse2, delta, dq_accum, dk, dv, softmax_scale):
        with torch.cuda.device(q.device):
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            compiled(*(as_cute(t, 16) for t in (q, k, v, dout, lse2, delta, dq_accum, dk, dv)),
                     cutlass.Float32(softmax_scale), stream)

    return launch


def bwd_kernel(dtype, head_dim, causal, arch="sm_90a"):
    """The backward kernel for (dtype, head dim, causal, arch): from memory, else the disk cache, else
    compiled and written there (as fwd_kernel)."""
    mem_key = (dtype, int(head_dim), bool(causal), arch)
    fn = _bwd_kernels.get(mem_key)
    if fn is None:
        with cache._lock:
            fn = _bwd_kernels.get(mem_key)
            if fn is None:
                if not _tvm_ffi():
                    fn = _bwd_dlpack_launcher(compile_bwd(dtype, head_dim, causal, arch))
                else:
                    fn, _ = load_or_build_bwd(dtype, head_dim, causal, arch, cache.cache_dir())
                _bwd_kernels[mem_key] = fn
    return fn


def _bwd_out_layout(t, D):
    # What the compiled kernel accepts for dk / dv: the input layout rules (see _kernel_layout).
    s = t.stride()
    return s[3] == 1 and s[2] == D and s[1] % 8 == 0 and s[0] % 8 == 0 and t.data_ptr() % 16 == 0


def backward(dout, q, k, v, out, lse, softmax_scale, causal, arch="sm_90a", grads=None, dlse=None):
    """Attention backward on validated CUDA inputs: q/out/dout (B, Sq, H, D), k/v (B, Sk, Hk, D) fp16/bf16,
    D in (64, 128), H % Hk == 0, lse fp32 (B, H, Sq) natural log (+inf for rows that see no key), causal
    bottom-right aligned. Returns (dq, dk, dv) in the input dtype, written into ``grads`` = (dq, dk, dv)
    when given (tensors shaped like q, k, v with a contiguous last dim). dq is accumulated across the key
    blocks' CTAs with fp32 reduce-adds (TMA bulk, or red.global with FLASH_ATTN_CUTE_BWD_DQ_TMA=0) in
    whatever order they finish, so results vary in the last bits run to run.

    Host-side steps (bwd_host.py): one Triton launch before the kernel writes delta = rowsum(dO * O) and
    lse * log2(e), padded to a multiple of the kernel's query block with 0 / +inf (so padded rows
    contribute nothing), and zeroes dq_accum; one after it casts dq_accum (which the kernel fills with
    softmax_scale * dS K) into dq and, with GQA, sums the kernel's per-query-head dK/dV over each group
    in fp32. Without Triton (or with FLASH_ATTN_CUTE_BWD_HOST=torch) torch does the same in more launches.
    dlse: None or the gradient flowing into lse (B, H, Sq): d lse_i / d s_ij = P_ij adds dlse_i * P_ij to dS_ij,
    which the kernel gets as delta - dlse in delta's place."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    dtype = q.dtype
    dq_out, dk_out, dv_out = grads if grads is not None else (None, None, None)
    if B * Sq * H == 0 or Sk == 0:  # no query or no key: every gradient is 0
        zeros = [torch.zeros_like(t) if g is None else g.zero_() for t, g in zip((q, k, v), (dq_out, dk_out, dv_out))]
        return tuple(zeros)
    config = _bwd_config(dtype, D, causal, arch)
    block_m = config["block_m"]
    per_batch = max(Sq * H, Sk * max(H, Hk)) * D
    if per_batch >= _MAX_ELEMS:
        raise NotImplementedError(
            f"one batch entry of q/k/v holds {per_batch} elements; flash_attn.cute's backward handles < 2^31")
    fn = _bwd_kernels.get((dtype, D, bool(causal), arch)) or bwd_kernel(dtype, D, causal, arch)

    from flash_attn.cute import bwd_host  # imports Triton when installed: not at this module's import

    # out and lse are read through their strides; q, k, v, dout must suit the compiled kernel
    q, k, v, dout = (_kernel_layout(t, D) for t in (q, k, v, dout))
    sq_pad = -(-Sq // block_m) * block_m
    host = bwd_host if bwd_host.use_triton(q) else None
    lse2, delta, dq_accum = (bwd_host.prepare if host else bwd_host.prepare_torch)(out, dout, lse, sq_pad)
    if dlse is not None:
        delta[:, :, :Sq].sub_(dlse[:, :, :Sq])
    group = H // Hk
    if group == 1 and (dk_out is None or (_bwd_out_layout(dk_out, D) and _bwd_out_layout(dv_out, D))):
        dk_h = dk_out if dk_out is not None else torch.empty((B, Sk, H, D), dtype=dtype, device=q.device)
        dv_h = dv_out if dv_out is not None else torch.empty((B, Sk, H, D), dtype=dtype, device=q.device)
        dk, dv, sums = dk_h, dv_h, False
    else:  # per-query-head dK/dV from the kernel, summed over each group (or copied) after it
        dk_h = torch.empty((B, Sk, H, D), dtype=dtype, device=q.device)
        dv_h = torch.empty((B, Sk, H, D), dtype=dtype, device=q.device)
        dk = dk_out if dk_out is not None else torch.empty((B, Sk, Hk, D), dtype=dtype, device=q.device)
        dv = dv_out if dv_out is not None else torch.empty((B, Sk, Hk, D), dtype=dtype, device=q.device)
        sums = True
    step = max(1, min((_MAX_ELEMS - 1) // per_batch, _MAX_GRID_Z))
    for b in range(0, B, step):  # 32-bit offsets in the kernel: batch slices below 2^31 elements (and grid z's limit)
        sl = slice(b, b + step)
        fn(q[sl], k[sl], v[sl], dout[sl], lse2[sl], delta[sl], dq_accum[sl], dk_h[sl], dv_h[sl],
           float(softmax_scale))
    # dq_accum holds softmax_scale * dS K: a cast is left
    dq = dq_out if dq_out is not None else torch.empty((B, Sq, H, D), dtype=dtype, device=q.device)
    (bwd_host.finish if host else bwd_host.finish_torch)(dq_accum, dq, *((dk_h, dv_h, dk, dv) if sums else ()))
    return dq, dk, dv


# FA4's low-level entry points (downstream libraries import them from here)
from flash_attn.cute.lowlevel import _flash_attn_bwd, _flash_attn_fwd  # noqa: E402, F401
