"""Launch configurations: a fixed table per (arch, head dim, causal) instead of autotuning, so the first
call does no timing runs and no host syncs, and every shape of a kind reuses one compiled kernel.

The sm_90 entries come from sweeping candidates on an H200 in bf16 (``benchmarks/attention/bench_attention.py
--tune``); other NVIDIA GPUs get the conservative sm_80 entries, or those that fit 99 KiB of shared memory
(``family``), AMD GPUs (untested) entries that fit their 64 KiB of LDS (HIP_ARCH). Under TRITON_INTERPRET small blocks keep the interpreter fast and make small test
shapes span several blocks.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from flash_attn.triton import settings


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # K/V through TMA tensor descriptors (sm_90+, Triton >= 3.4); calls whose head dims are not powers of
    # two or whose K/V are not 16-byte aligned take the pointer path of the same config.
    tma: bool = False
    # > 0: rescale the accumulator only when a row max grew by more than this (log2 units, <= 15 so the
    # 16-bit P cannot overflow); 0: rescale every block.
    rescale: float = 0.0
    # Causal/window calls: > 0 launches the row blocks longest-first across groups of this many
    # (sequence, head) pairs instead of within each pair (the tail wave; see _fwd.py).
    group: int = 0
    # Experimental forward kernel (_fwd_ws.py): 0 the default _fwd.py, 1 one tile per program under Triton's
    # automatic warp specialization, 2 the same persistent (a program per SM), 3 persistent with causal tiles
    # dealt longest-first in a snake over the programs (balanced totals; _fwd_ws._tile_coords). Served only to dense 16-bit
    # calls with power-of-two head dims, no softcap/ALiBi/dropout/probs, no window but causal; others
    # run _fwd.py with this config's variant-0 twin.
    variant: int = 0


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    block_m: int  # query rows per step of the dK/dV kernel
    block_n: int  # keys owned by one dK/dV program
    num_warps: int
    num_stages: int
    dq_block_m: int  # deterministic dQ kernel: rows owned by one program
    dq_block_n: int  # keys per step
    dq_num_warps: int
    dq_num_stages: int
    dq_atomic: bool  # non-deterministic calls: dQ by fp32 atomics inside the dK/dV kernel
    # Q/dO (dK/dV kernel) and K/V (dQ kernel) through TMA tensor descriptors instead of pointer loads: no
    # per-element address/mask registers in the loop (sm_90+ and Triton with tl.make_tensor_descriptor;
    # elsewhere, or when a call's strides/alignment do not allow it, the pointer path runs)
    tma: bool = False
    # dV and dK by two launches of the dK/dV kernel (the dK one also does the atomic dQ), each holding one
    # fp32 accumulator: at head dim 256 both (2 x 64 x 256 fp32 per warpgroup) do not fit the registers
    # with wgmma-sized tiles; one does. Costs one more recomputation of Q K^T.
    split_dkdv: bool = False


_INTERPRET_FWD = FwdConfig(16, 16, 1, 1)
_INTERPRET_BWD = BwdConfig(16, 16, 1, 1, 16, 16, 1, 1, True)
# fp32 tiles take twice the registers and shared memory of 16-bit ones, and the exact fp32 products run
# on the FMA units anyway: small tiles lose nothing.
_FP32_FWD = FwdConfig(64, 32, 4, 2)
_FP32_BWD = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, True)

# (arch major, padded head dim, causal) -> config. Padded head dim: 32, 64, 128, 256. The sm_90 entries
# are the fastest candidates of `bench_attention.py --tune` on an H200 (bf16, seqlen 4096, Triton 3.6);
# each compiles without (or with a few bytes of) register spills. With the dQ kernel separate the backward
# needs no atomics and is as fast as the atomic variant, so deterministic=True costs nothing there.
_FWD = {
    (9, 32, False): FwdConfig(64, 64, 4, 3),
    (9, 64, False): FwdConfig(64, 64, 4, 3),
    (9, 128, False): FwdConfig(128, 128, 8, 3),
    (9, 128, True): FwdConfig(128, 64, 8, 3),
    (9, 256, False): FwdConfig(128, 64, 8, 2),
    # longest-first over groups of 8 (sequence, head) pairs: 475 vs 432 TFLOP/s geometric mean over s2k/4k/16k
    # on an H200; other candidates are within run noise (the table's own config measures 4-7% apart in one run).
    # `benchmarks/tools/tune_triton_fwd.py`, table in benchmarks/results/h200/triton_fwd_tune.txt
    (9, 256, True): FwdConfig(128, 64, 8, 2, group=8),
    (8, 32, False): FwdConfig(128, 64, 4, 3),
    (8, 64, False): FwdConfig(128, 64, 4, 3),
    (8, 128, False): FwdConfig(128, 64, 8, 2),
    (8, 256, False): FwdConfig(64, 64, 4, 2),
}
_BWD = {
    (9, 32, False): BwdConfig(64, 128, 8, 3, 128, 64, 8, 2, False),
    # d64..256: the fastest candidates of `benchmarks/tools/tune_triton_bwd.py --quick` on an H200 (Triton 3.6;
    # s2048 b8 for d64 causal, s4096 b4; benchmarks/results/h200/triton_bwd_tune.txt): TMA loads, and at d256
    # dK and dV in separate launches.
    (9, 64, False): BwdConfig(64, 64, 4, 3, 128, 64, 8, 2, False, tma=True),
    (9, 64, True): BwdConfig(64, 64, 4, 3, 64, 64, 4, 2, False, tma=True),
    (9, 128, False): BwdConfig(64, 128, 8, 2, 128, 64, 8, 3, False, tma=True),
    (9, 128, True): BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, False, tma=True),
    (9, 256, False): BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
    (9, 256, True): BwdConfig(32, 128, 8, 2, 128, 32, 8, 2, False, tma=True, split_dkdv=True),
    (8, 32, False): BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, True),
    (8, 64, False): BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, True),
    (8, 128, False): BwdConfig(32, 64, 4, 2, 64, 32, 4, 2, True),
    (8, 256, False): BwdConfig(16, 32, 4, 2, 32, 32, 4, 1, False),
}


# ROCm devices (backend._arch gives them HIP_ARCH). Chosen without an AMD GPU at hand, so untimed: per padded head
# dim, tiles whose kernels compile for gfx90a and gfx942 (MI200 / MI300) within their 64 KiB of LDS per workgroup
# and without scratch (register spills) in every call of `python -m benchmarks.tools.triton_rocm_compile` (plain and
# with every feature, causal or not, deterministic or not, varlen, kvcache; tests/triton/test_triton_rocm_compile.py on every
# commit), AMD's customary 128 x 64 forward tile where it fits. The larger candidates fail some of those calls:
# the sm_80 entries (the d256 forward takes 72 KiB of LDS on gfx942, the d64-d128 backwards spill), 64 x 64
# backward steps with two stages at d64 (216-1096 bytes of scratch), 32 x 64 ones at d128 (20).
HIP_ARCH = (0, 0)
_FWD[("hip", 32, False)] = FwdConfig(128, 64, 4, 2)
_FWD[("hip", 64, False)] = FwdConfig(128, 64, 4, 1)
_FWD[("hip", 128, False)] = FwdConfig(128, 64, 4, 1)
_FWD[("hip", 256, False)] = FwdConfig(64, 64, 4, 1)
_BWD[("hip", 32, False)] = BwdConfig(32, 64, 4, 1, 64, 32, 4, 1, True)
_BWD[("hip", 64, False)] = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, True)
_BWD[("hip", 128, False)] = BwdConfig(32, 32, 4, 1, 32, 32, 4, 1, True)
_BWD[("hip", 256, False)] = BwdConfig(16, 32, 4, 1, 32, 16, 4, 1, True)


# NVIDIA GPUs with about 99 KiB of shared memory a block (sm_86 / sm_89: RTX 30 / 40, L40; sm_120: RTX 50): the sm_80
# entries where they fit (every backward), a d256 forward tile that does (the sm_80 one takes 104 KiB). Each
# compiles within that for sm_86 and sm_120 (tests/triton/test_triton_smem.py).
SMALL_SMEM = "small"
_FWD[(SMALL_SMEM, 32, False)] = _FWD[(8, 32, False)]
_FWD[(SMALL_SMEM, 64, False)] = _FWD[(8, 64, False)]
_FWD[(SMALL_SMEM, 128, False)] = _FWD[(8, 128, False)]
_FWD[(SMALL_SMEM, 256, False)] = FwdConfig(64, 32, 4, 2)
for _d in (32, 64, 128, 256):
    _BWD[(SMALL_SMEM, _d, False)] = _BWD[(8, _d, False)]
# shared memory a block may use (bytes), per table family
SMEM_BYTES = {9: 232448, 8: 166912, SMALL_SMEM: 101376, "hip": 65536}


def family(arch):
    """The table family of a device's (major, minor) capability: 9 for the 227 KiB datacenter GPUs (sm_90, sm_100,
    sm_110), 8 for sm_80 / sm_87 (163 KiB), SMALL_SMEM for the others (sm_86, sm_89, sm_120: 99 KiB), "hip" for ROCm
    (HIP_ARCH); 8 without a device (the interpreter, which takes its own small tiles)."""
    if arch == HIP_ARCH:
        return "hip"
    if arch is None:
        return 8
    if arch[0] in (9, 10, 11):
        return 9
    if arch in ((8, 0), (8, 7)):
        return 8
    return SMALL_SMEM


def padded_dim(d: int) -> int:
    return max(32, 1 << (d - 1).bit_length())


def _lookup(table, arch, d, causal):
    major = family(arch)
    for c in (causal, False):
        cfg = table.get((major, d, c))
        if cfg is not None:
            return cfg
    raise KeyError((major, d, causal))


@functools.lru_cache(maxsize=None)
def fwd_config(arch, head_dim: int, causal: bool, interpret: bool, dtype) -> FwdConfig:
    if interpret:
        return _INTERPRET_FWD
    if dtype == torch.float32:
        return _FP32_FWD
    # (the experimental forward's configs, fwd_variant_config, are chosen by backend._fwd_ws_plan for the
    # calls it serves; every other call keeps the table's entry)
    return _lookup(_FWD, arch, padded_dim(head_dim), causal)


@functools.lru_cache(maxsize=None)
def bwd_config(arch, head_dim: int, causal: bool, interpret: bool, dtype) -> BwdConfig:
    if interpret:
        return _INTERPRET_BWD
    if dtype == torch.float32:
        return _FP32_BWD
    return _lookup(_BWD, arch, padded_dim(head_dim), causal)


# The warp-specialized forward (_fwd_ws.py) on sm_90: the (head dim, causal) pairs it serves by default,
# with (variant, BLOCK_N or None). H200, bf16, 16k tokens, cuDNN SDPA in the same run (`python -m
# benchmarks.tools.tune_triton_fwd --headdims 64,128,256 --seqlens 2048,16384 --candidates ws`, geometric mean
# over the two lengths, against the table's kernel): d128 non-causal 464 -> 578 TFLOP/s persistent (0.73x ->
# 0.91x cuDNN), d256 non-causal 476 -> 600 (0.86x), d256 causal 456 -> 536 (0.92x); table in
# benchmarks/results/h200/triton_fwd_ws_tune.md. Not d64: the table's kernel is faster there (421 vs 386).
# d128 causal takes the persistent form with the balanced tile order (wsb128): 0.83 / 0.79 / 0.82 / 0.83x cuDNN
# at 2k / 4k / 8k / 16k in the same tuner (`bash benchmarks/run_gpu.sh tunetriton`), against 0.74-0.82x for the
# one-tile kernel with 128-key blocks; the plain persistent order (wsp128) drops to 0.58x at 16k. The grid with
# it: benchmarks/results/h200/attention_triton.md.
FWD_WS_DEFAULT = {(128, False): (2, None), (128, True): (3, 128), (256, False): (1, None), (256, True): (1, None)}
# FLASH_ATTN_TRITON_OVERRIDES' fwd_variant (settings.py) overrides FWD_WS_DEFAULT for every head dim: "off"
# (or "0") the table's kernels only; "ws": _fwd_ws.py with the table's BLOCK_N; "ws64" / "ws128": with that
# BLOCK_N; "wsp*": the persistent form; "wsb*": persistent, causal tiles in the balanced order. Name ->
# (variant, BLOCK_N or None).
FWD_VARIANTS = {"": (0, None), "0": (0, None), "off": (0, None), "ws": (1, None), "ws64": (1, 64),
                "ws128": (1, 128), "wsp": (2, None), "wsp64": (2, 64), "wsp128": (2, 128), "wsb": (3, None),
                "wsb64": (3, 64), "wsb128": (3, 128)}


def _fwd_variant(name):
    if name not in FWD_VARIANTS:
        raise ValueError(f"{settings.OVERRIDES}: fwd_variant={name!r}: expected one of {sorted(FWD_VARIANTS)}")
    return FWD_VARIANTS[name]


FWD_VARIANT = _fwd_variant(settings.overrides.get("fwd_variant", ""))
FWD_VARIANT_SET = bool(settings.overrides.get("fwd_variant"))


def ws_variant(head_dim: int, causal: bool):
    """(variant, BLOCK_N or None) of the warp-specialized forward for a padded head dim: the switch's when
    set, else FWD_WS_DEFAULT's entry ((0, None): the table's kernel)."""
    if FWD_VARIANT_SET:
        return FWD_VARIANT
    return FWD_WS_DEFAULT.get((head_dim, bool(causal)), (0, None))


def fwd_variant_config(arch, head_dim: int, causal: bool, variant=(0, None)) -> FwdConfig:
    """The table entry for (arch, head dim, causal) with an experimental forward switched on (variant
    (0, None): the entry itself; only sm_90 gets a variant).

    ws (1): 128 query rows per program and num_warps=4, which the Hopper warp-specialization pass turns
    into one producer and two 64-row consumer warpgroups (12 warps); Q/K/V through TMA descriptors (the
    pass hands only descriptor loads to the producer). Two K/V stages; at head dim 256 BLOCK_N stays 64
    (two stages of 64 x 256 K and V tiles plus Q take 224 KiB, 128 would not fit).
    wsp (2): the same tiles, persistent (a program per SM walks the tiles, the tile loop is the
    specialized one); Q is double-buffered too, so head dim 256 takes 32-key blocks.
    wsb (3): wsp whose causal tiles go to the programs longest-first in a snake (the order of wsp deals a
    program row blocks from one stretch of a head: at seqlen 16k, 128 row blocks per head and 132 programs,
    its longest program has 1.56x the mean work; the snake's 1.01x).
    """
    kind, block_n = variant
    cfg = _lookup(_FWD, arch, padded_dim(head_dim), causal)
    if kind == 0 or arch is None or arch[0] != 9:
        return cfg
    if kind in (1, 2, 3):
        d = padded_dim(head_dim)
        if d >= 256:
            # wsp also double-buffers Q across tiles: 64-key blocks need 288 KiB there, 32 fit in 224
            bn = 64 if kind == 1 else 32
        else:
            bn = block_n or cfg.block_n
        # Two K/V stages: with three (d64, d128 at 64-key blocks) every formulation tried computed NaN
        # on the H200 (triton 3.6), with two the same kernels match the reference.
        return FwdConfig(128, bn, 4, 2, tma=True, group=cfg.group, variant=kind)
    raise ValueError(f"unknown forward variant {variant}")


@dataclasses.dataclass(frozen=True)
class BwdWsConfig:
    """The warp-specialized backward (_bwd_ws.py, sm_90): every kernel runs with num_warps=4 and two copy
    stages, which the Hopper pass turns into a producer and two consumer warpgroups."""
    block_m: int  # dK/dV kernel: query rows per step
    block_n: int  # dK/dV kernel: keys per program (two consumers of block_n / 2 keys each)
    # dQ kernel: rows per program (two consumers of dq_block_m / 2 rows each); 0: the FA2-style dQ kernel
    # (_bwd.py) with the table's config
    dq_block_m: int
    dq_block_n: int  # dQ kernel: keys per step
    # dV and dK by two launches (dk_block_m query rows per step for the dK one): at head dim 256 both
    # accumulators (2 x 64 x 256 fp32 per consumer) do not fit the registers, nor K, V and the Q/dO stages
    # the shared memory
    split_dkdv: bool = False
    dk_block_m: int = 0
    # with split_dkdv (not fa2_dk): keys per program of the warp-specialized dK launch (0: block_n). At head
    # dim 256, 64 keys with 64-row steps keep K, V and two Q / dO stages in 192 KB (128 keys need 257 KB)
    dk_block_n: int = 0
    # with split_dkdv: the dK launch is the FA2-style dK/dV kernel (_bwd.py, the table's config, dV off) on the
    # preprocess's padded rows, the dV launch the warp-specialized one (at head dim 256 the warp-specialized
    # dK launch needs 32-row steps, which compute NaN on the H200)
    fa2_dk: bool = False
    # the FA2-style kernels' config (a BwdConfig: the dQ kernel's tiles, and with fa2_dk the dK launch's);
    # None: the _BWD table's entry for the call
    fa2: object = None
    # with fa2_dk: the dK launch also adds dS K into an fp32 dQ by atomics, and no dQ launch runs (two products
    # fewer: Q K^T and dO V^T are not recomputed for dQ). deterministic=True calls keep the dQ launch. A tuning
    # candidate, slower at d256 causal on the H200: 0.29-0.54 of cuDNN against the default's 0.68
    # (benchmarks/results/h200/triton_bwd_ws_tune.md). The dK tiles that fit beside the dQ product's staging
    # (one stage, or 64 keys) lose more than the dQ launch costs.
    dq_atomic: bool = False


# Padded head dim -> the warp-specialized backward's config. H200, bf16, 16k tokens, cuDNN SDPA's backward in
# the same run (`python -m benchmarks.tools.tune_triton_bwd_ws --seqlens 2048,16384`, geometric mean of the ratio
# to cuDNN over the two lengths; benchmarks/results/h200/triton_bwd_ws_tune.md): the warp-specialized dK/dV loop
# with the FA2-style dQ kernel is the fastest right candidate: d64 0.68 -> 0.76 (the FA2-style kernels -> it),
# d64 causal 0.72 -> 0.79, d128 0.68 -> 0.79, d128 causal 0.64 -> 0.77 (the all-warp-specialized d256 split is
# faster but wrong: below). The warp-specialized dQ kernel is right but 2-10% slower; it reads lse / delta as
# plain rows (as transposed TMA boxes they give a wrong dQ).
# (`python -m benchmarks.tools.triton_bwd_ws_compile` prints registers, spills and shared memory.)
BWD_WS = {
    # 128 query rows per step: 0.83 of cuDNN at d64 against 0.79 with 64, causal 0.77 either way; right on the
    # H200 (probe_bwd_ws_split.py with NaN-filled outputs, the GPU tests). Triton 3.9 spills 44 bytes compiling
    # it for sm_90 (not checked with 3.6, the GPU machine's).
    64: BwdWsConfig(128, 128, 0, 0),
    128: BwdWsConfig(64, 128, 0, 0),
    # the warp-specialized dV launch with the FA2-style dK launch (`tune_triton_bwd_ws.py --headdims 256
    # --seqlens 2048,4096,8192,16384`, H200, triton 3.6, cuDNN in the same run): 0.77-0.81 of cuDNN against
    # 0.66-0.69 for the FA2-style kernels, causal 0.61-0.71 against 0.51-0.61; GPU test
    # test_gpu_ws_bwd_d256_fa2_dk (NaN-filled outputs, GQA, ragged lengths). The all-warp-specialized split
    # (BWD_WS_D256_BROKEN) computes NaN dK.
    256: BwdWsConfig(64, 128, 0, 0, split_dkdv=True, fa2_dk=True),
}
# d256 causal: the FA2-style dK launch with the causal table's tiles, the dQ kernel with the non-causal ones
# (64 x 64, 4 warps): 0.64 of cuDNN against 0.62 with the causal dQ tiles (geometric mean, seqlen 2k-16k,
# `tune_triton_bwd_ws.py --headdims 256 --causal 1`)
BWD_WS_D256_CAUSAL = BwdWsConfig(64, 128, 0, 0, split_dkdv=True, fa2_dk=True, fa2=BwdConfig(
    32, 128, 8, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True))
BWD_WS_D256_BROKEN = BwdWsConfig(64, 128, 0, 0, split_dkdv=True, dk_block_m=32)
# both launches warp-specialized, the dK one on 64 keys per program with 64-row steps (K, V and two Q / dO
# stages fit; triton 3.9 compiles it for sm_90 with 231 KB of shared memory and 228 bytes spilled). Right on
# the H200 (test_gpu_ws_bwd_d256_fa2_dk[wsdk]) but not faster: causal 0.62 / 0.64 of cuDNN at 2k / 16k against
# the default's 0.63 / 0.71 (`tune_triton_bwd_ws.py --headdims 256 --causal 1`); a tuning candidate
BWD_WS_D256_WSDK = BwdWsConfig(64, 128, 0, 0, split_dkdv=True, dk_block_m=64, dk_block_n=64)
BWD_WS_D256_FA2DK = BWD_WS[256]
# (padded head dim, causal) pairs whose backward takes _bwd_ws.py by default on sm_90. Not d32 (never run on a
# GPU; BWD_WS has no entry, so not even the switch serves it). d256's all-warp-specialized split
# (BWD_WS_D256_BROKEN, kept for the probe) computes non-finite dK on the H200 (triton 3.6): its dK launch
# needs 32-row steps (at 64 rows K, V and two stages of Q / dO take 257 KB of shared memory, and with one stage
# the pass does not specialize), and `benchmarks/tools/probe_bwd_ws_split.py all` finds 32-row steps NaN at d128 too.
BWD_WS_DEFAULT: frozenset = frozenset((d, c) for d in (64, 128, 256) for c in (False, True))
# FLASH_ATTN_TRITON_OVERRIDES' bwd_variant: "off"/"0" the FA2-style kernels (_bwd.py) only, "ws" the
# warp-specialized backward for every call it serves; unset: BWD_WS_DEFAULT.
_BWD_VARIANT_NAME = settings.overrides.get("bwd_variant", "")
if _BWD_VARIANT_NAME not in ("", "0", "off", "ws"):
    raise ValueError(f"{settings.OVERRIDES}: bwd_variant={_BWD_VARIANT_NAME!r}: expected one of 'off', 'ws'")


def bwd_ws_config(arch, head_dim: int, causal: bool):
    """The warp-specialized backward's config for (arch, padded head dim, causal), or None where the
    FA2-style kernels serve the call (not sm_90, the switch off, or not a default pair)."""
    if arch is None or arch[0] != 9:
        return None
    if _BWD_VARIANT_NAME in ("0", "off"):
        return None
    if _BWD_VARIANT_NAME != "ws" and (head_dim, bool(causal)) not in BWD_WS_DEFAULT:
        return None
    if head_dim == 256 and causal:
        return BWD_WS_D256_CAUSAL
    return BWD_WS.get(head_dim)
