"""The kernels' typed configurations and the rules that select them.

``FwdVariant`` names what a call asks of the forward kernel (dtype, head dim, mask, options, and the
length class that picks among tunings); ``select_fwd`` turns it into a ``FwdConfig``, every choice that
shapes the kernel's code. ``BwdConfig`` / ``select_bwd`` do the same for the backward, and ``PlanRules``
holds the per-call planning rules the host applies. A configuration is the disk cache's key (``key()``;
with the package sources and versions, see cache.py) and all that ``kernels.py`` builds a kernel from.
Computing one imports neither CuTeDSL nor a GPU.

The defaults below come from measurements on an H100 / H200 (the current tables are in
``benchmarks/results/``; the measuring scripts are named there). ``FLASH_ATTN_CUTE_OVERRIDES``
(settings.py) replaces any field for a tuning experiment.
"""
import dataclasses
from dataclasses import dataclass

from flash_attn.cute import settings

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SMEM_BYTES = 232448  # FlashFwdSm90.SMEM_BYTES (kept here: computing a config must not import CuTeDSL)

# K / V ring depth per head dim: the Q tile and stages x (K tile + V tile) fit the 227 KB of shared memory.
STAGES = {64: 4, 96: 4, 128: 3, 192: 2, 256: 2}
# Keys per K / V block with two consumer warpgroups. Above d128 the largest block whose two stages fit beside
# the 128 x D Q tile and whose accumulators fit the consumers' 240 registers (O: D / 2, S: BLOCK_N / 2, packed
# P: BLOCK_N / 4 per thread) without spilling: d256 80 (FA3's tile), d192 112, and 96 for windowed d192 calls
# (112 spills 48 bytes there). d96: a 64-byte swizzle and four stages of 128 keys.
BLOCK_N = {64: 128, 96: 128, 128: 128, 192: 112, 256: 80}
BLOCK_N_LOCAL = {192: 96}
# Consumer warpgroups: 2 (BLOCK_M 128, ping-pong) or 3 (BLOCK_M 192, round robin: each K / V tile serves 192
# query rows, FA3's choice at d64). Three win for d64 without a mask; with a mask the two-warpgroup tiles do.
WARPGROUPS = {64: 3, 128: 2}
WARPGROUPS_MASKED = {64: 2, 128: 2}
# Keys per block with three warpgroups, whose 160 registers hold S, P and O (BLOCK_N + BLOCK_N / 2 + D / 2
# per thread) and the loop's state: d64 128 is spill-free for dense calls but spills with softcap, causal
# varlen or a window with options, where 96 is clean in every combination; d128 takes 64 (96 serialises the
# WGMMAs, ptxas C7512).
BLOCK_N_3WG = {64: 128, 128: 64}
BLOCK_N_3WG_OPTIONS = {64: 96, 128: 64}
# Softmax exponentials per 16 computed by a polynomial on the FMA pipe instead of MUFU.EX2: off by default.
EXP2_EMU = {64: 0, 128: 0}
# The persistent forward (one CTA per SM looping over the tiles) serves dense calls without options of these
# (head dim, causal) pairs; the one-tile kernel is faster elsewhere.
PERSISTENT = frozenset({(64, True), (64, False)})
# O through shared memory and a TMA store instead of direct stores from registers, for dense calls of the
# one-tile kernel: "plain" for every call without a window, softcap or sink; "short" only for those with
# seqlen_k <= SHORT_SK (it gains at short keys only there). Not where ptxas spills with it (TMA_O_SPILLS:
# fp16 d128 non-causal keeps three values across the main loop for the epilogue).
SHORT_SK = 1024
TMA_O = {64: "short", 128: "plain", 256: "plain"}
# The options calls (a window and / or softcap, no sink) that take the TMA O store too, per head dim: 2-12% faster
# with it (benchmarks/results/h200/tma_o_options.md), but softcap at d64 (within noise either way).
TMA_O_OPTIONS = {64: frozenset({"local"}), 128: frozenset({"local", "softcap"}), 256: frozenset({"local", "softcap"})}
TMA_O_SPILLS = frozenset({("fp16", 128, False)})
# Key blocks walked from the last down (masked diagonal blocks first, so the consumer warpgroups end a tile in
# step): the persistent kernel's causal d64 only; d128 / d256 lose with it.
REVERSE = frozenset({(64, True)})
# The persistent causal kernel deals its tiles longest first in a snake over the SMs, but at these head dims,
# whose sectioned round robin is already balanced.
SNAKE_OFF = frozenset({64})
# The one-tile causal kernel runs its CTAs longest first over all (head, batch) pairs (lpt), but the short-key
# kernel of these head dims: all its tiles have one length, and their prologues then collide.
LPT_SHORT_OFF = frozenset({128})
# Plain dense calls with seqlen_k >= LONG_SK of these (head dim, causal) pairs run the one-tile kernel with
# this many consumer warpgroups instead of the persistent one.
LONG_SK = 8192
LONG = {(64, True): 3}
# The short-key kernel of these pairs is the persistent kernel with its own TMA O buffer.
SHORT_PERSISTENT = frozenset({(128, False)})
# pack_gqa: the query heads per KV head that a 128-row tile packs (128 / g rows per head, a multiple of the
# swizzle atom's 8 rows).
PACK_GROUPS = (2, 4, 8, 16)
# (head dim of q / k, head dim of v) pairs with Dv != D: DeepSeek's 192 / 128 (MLA without absorption).
HEAD_DIM_PAIRS = frozenset({(192, 128)})

# Backward: query rows per pipeline stage (the N of S^T = K Q^T; keys per CTA are 128) and Q / dO ring depth.
# d64 takes 128 rows; d96's and d128's accumulators do not fit the registers at 128. d192 / d256: 64 keys per CTA,
# D split over the warpgroups (FlashBwdSm90.split_d).
BWD_BLOCK_M = {64: 128, 96: 64, 128: 64, 192: 64, 256: 64}
BWD_STAGES = {64: 2, 96: 2, 128: 2, 192: 2, 256: 2}
# dQ added into dq_accum by one TMA reduce-add of the fp32 tile per query block (needs the dQ tile split along
# D between the two consumer warpgroups) rather than red.global from every consumer thread.
BWD_DQ_SPLIT = True
# d192 / d256: two fp32 dQ tiles (96 / 128 KB) do not fit beside two Q / dO stages and the P^T and dS^T tiles.
BWD_DQ_TMA = {64: True, 96: True, 128: True, 192: False, 256: False}
# The software-pipelined query loop gains nothing over the TMA dQ (d128 loses 3-8%): off.
BWD_OVERLAP = {64: False, 96: False, 128: False}
# CTA order: groups of about N CTAs over (head, batch) pairs, key block slowest inside a group, so the longest
# causal blocks start first while the CTAs in flight share Q, dO and dq_accum in L2; 0 keeps the plain grid.
BWD_LPT = 0
BWD_LPT_CAUSAL = {64: 128}
BWD_EXP2_EMU = {64: 0, 96: 0, 128: 0, 192: 0, 256: 0}
# dK and dV leave through the (then dead) K and V tiles in shared memory and one TMA store per warpgroup, instead of
# 2-byte stores from the accumulator registers: dense calls. Varlen calls (their key blocks that end inside the
# sequence by TMA, a sequence's last partial block by the direct stores): d64-d128 (the varlen backward 0.99-1.15x
# with it on an H100, benchmarks/results/h100/cute_bwd_ab.md); the split-D kernel's varlen calls keep the direct stores.
BWD_TMA_DKV = {64: True, 96: True, 128: True, 192: True, 256: True}
BWD_TMA_DKV_VARLEN = {64: True, 96: True, 128: True}
# The first key block's CTA to reach a query block stores its dQ tile instead of adding it (bwd_dq.DqAccumulator's
# tickets), so the preprocess does not zero dq_accum (half of its traffic): dense calls without a window or mods
# (softcap and gqa_loop's too) at the head dims whose consumers issue the dQ TMA reduce-adds; deterministic calls'
# first turn stores (the writer warp's turns). Off until it is tested and timed on a GPU (bwd.dq_first_store=1).
BWD_FIRST_STORE = {64: False, 96: False, 128: False}

_DTYPE_NAMES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "fp16": "fp16", "bf16": "bf16"}


def dtype_name(dtype):
    """"fp16" / "bf16" for torch.float16 / torch.bfloat16 (or those names); else str(dtype)."""
    return _DTYPE_NAMES.get(str(dtype), str(dtype))


def _key(cfg, kernel, always):
    """A configuration as the disk cache keys it: the kernel's name and every field, a field left out where it has
    its default and is not one of ``always`` (so adding a field keeps the existing entries' keys)."""
    out = {"kernel": kernel}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in always or value != f.default:
            out[f.name] = value
    return out


@dataclass(frozen=True)
class FwdVariant:
    """What a call asks of the forward kernel. ``short`` / ``long``: seqlen_k <= SHORT_SK / >= LONG_SK (their
    tunings may differ; the same kernel when they do not). ``pack``: query heads per KV head packed into a
    tile (1: none). ``dv``: v's head dim when it differs from head_dim. ``paged``: the page size of a paged
    varlen call (0: none). ``split``: the split-KV kernel."""
    dtype: str
    head_dim: int
    causal: bool
    arch: str = "sm_90a"
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    sink: bool = False
    short: bool = False
    long: bool = False
    pack: int = 1
    dv: int | None = None
    paged: int = 0
    split: bool = False

    def __post_init__(self):
        norm = object.__setattr__
        norm(self, "dtype", dtype_name(self.dtype))
        for name in ("head_dim", "pack", "paged"):
            norm(self, name, int(getattr(self, name)))
        for name in ("causal", "local", "softcap", "varlen", "sink", "short", "long", "split"):
            norm(self, name, bool(getattr(self, name)))
        norm(self, "dv", None if self.dv is None or int(self.dv) == self.head_dim else int(self.dv))
        if self.pack > 1 or self.dv or self.paged or self.split:
            norm(self, "short", False)  # these kernels have one tuning at any length
            norm(self, "long", False)

    @property
    def plain(self):
        """No window, softcap or sink: the dense calls that the length rules tune."""
        return not (self.local or self.softcap or self.sink)


@dataclass(frozen=True)
class FwdConfig:
    """Every choice that shapes the forward kernel's code (FlashFwdSm90's components are built from it)."""
    dtype: str
    head_dim: int
    arch: str
    abi: str
    stages: int
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    sink: bool = False
    block_n: int = 128
    warpgroups: int = 2
    wg_order: bool = True  # named-barrier ordering of the consumer warpgroups' softmax
    exp2_emu: int = 0
    exp2_emu_degree: int = 3
    persistent: bool = False
    tma_o: bool = False
    reverse: bool = False
    pin: bool = True  # the whole softmax of a masked block before the P V wait
    snake: bool = True
    lpt: bool = False
    # one-tile kernels: each head's query tiles from the last down (causal kernels always; block-sparse mod kernels,
    # whose lists mostly grow with the query block, e.g. causal / prefix-LM masks, by mods.mod_config)
    tiles_desc: bool = False
    pack_gqa: int = 1
    head_dim_v: int | None = None
    paged: int = 0  # the TMA box's rows of a paged K / V (the page, or the key block when smaller)
    split: bool = False

    def __post_init__(self):
        options = self.local or self.softcap or self.varlen or self.sink
        if self.persistent and (options or self.pack_gqa > 1 or self.head_dim_v or self.split):
            raise ValueError("FwdConfig: the persistent kernel serves dense calls without options only")
        if self.tma_o and (self.varlen or self.pack_gqa > 1 or self.head_dim_v or self.split):
            raise ValueError("FwdConfig: the TMA O store serves dense unpacked calls only")
        if self.split and self.sink:
            raise ValueError("FwdConfig: split-KV kernels are built without a sink (the host adds it)")
        # (one warpgroup: the mod kernels' 64-row tile for sparse query blocks of an odd number of 64 rows)
        if self.warpgroups not in (1, 2, 3) or self.block_n % 16 or not 16 <= self.block_n <= 256:
            raise ValueError(f"FwdConfig: warpgroups {self.warpgroups} / block_n {self.block_n} "
                             "(1, 2 or 3; a multiple of 16 up to 256)")
        if self.warpgroups == 3 and self.head_dim not in BLOCK_N_3WG:
            raise ValueError(f"FwdConfig: no three-warpgroup tile for head dim {self.head_dim}")

    def key(self):
        """The disk cache's key (see _key)."""
        return _key(self, "FlashFwdSm90", _FWD_ALWAYS)


_FWD_ALWAYS = frozenset({"dtype", "head_dim", "arch", "abi", "stages", "causal", "local", "softcap"})


# dq_accum's layout under BwdConfig.dq_perm. Within each 16 columns, accumulator column 8 g + 2 q + x (the m64nNk16 C
# layout gives a thread the columns 2 q + x of n8-groups g = 0, 1) sits at 4 q + 2 g + x (PERM16), so each thread's
# four values of a row in 16 columns are 16 contiguous bytes: one 128-bit store into the shared tile instead of two
# 64-bit ones. In rows of odd index (dq_accum's rows; varlen: the packed rows) the 16-column blocks also swap in pairs,
# so that the two rows a quarter warp stores at once fall on different banks of the unswizzled tile, which one TMA box
# adds whole (the swizzled tile takes a box per 32 columns). The host's casts read it back in order (bwd_host).
PERM16 = tuple(4 * ((l % 8) // 2) + 2 * (l // 8) + l % 2 for l in range(16))


def permuted_column(row, col):
    """Where dq_accum's column ``col`` of row ``row`` sits under dq_perm (head dims that are multiples of 32)."""
    return 16 * ((col // 16) ^ (row & 1)) + PERM16[col % 16]


@dataclass(frozen=True)
class BwdConfig:
    """Every choice that shapes the backward kernel's code."""
    dtype: str
    head_dim: int
    causal: bool
    arch: str
    abi: str
    block_m: int
    stages: int
    dq_split: bool
    dq_tma: bool
    overlap: bool = False
    lpt: int = 0
    exp2_emu: int = 0
    exp2_emu_degree: int = 3
    local: bool = False  # a sliding window (FlashBwdSm90.call_general)
    varlen: bool = False  # packed sequences (FlashBwdSm90.call_varlen)
    deterministic: bool = False  # dQ's adds in key-block order (bwd_dq.DqAccumulator)
    softcap: bool = False  # soft-capped scores (the tanh's derivative in dS)
    tma_dkv: bool = False  # dK, dV through shared memory and TMA stores (BWD_TMA_DKV, BWD_TMA_DKV_VARLEN)
    gqa_loop: bool = False  # one CTA per KV head walks its group's query heads (FlashBwdSm90 gqa_loop; the call's)
    head_dim_v: int | None = None  # V's head dim where it differs (a pair of HEAD_DIM_PAIRS; the call's)
    dq_writer: bool = False  # a producer warp issues the dQ TMA reduce-adds (bwd_dq.DqAccumulator.writer; dq_tma)
    # deterministic causal (the writer warp's turns): descending turns, key blocks from the last down
    # (bwd_dq.DqAccumulator.turn_place; 1.42-1.91x the ascending turns, whose key-block CTAs wait at their first query
    # blocks: h100/attention_cute_bwd_modes.md)
    turns_desc: bool = False
    # dq_accum in permuted_column's layout, exactly where dq_tma: the loop writes each thread's dQ values of a row in 16
    # columns with one 128-bit store (16 STS.64 -> 8 STS.128 per query block at d128) and one TMA box adds the tile (4
    # swizzled ones before; the kernel 1.02-1.13x, H100 2026-12-07, benchmarks/results/h100/cute_bwd_ab.md); the host's
    # casts read it back in order
    dq_perm: bool = False
    # the first CTA at a query block stores its dQ tile, later ones add after its store completed (a ticket per query
    # block; BWD_FIRST_STORE); without a causal mask each key block's walk starts at its own query block (rotated)
    dq_first_store: bool = False

    def __post_init__(self):
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"dtype {self.dtype} not fp16/bf16")
        if self.gqa_loop and (self.varlen or self.deterministic or self.overlap):
            raise ValueError("BwdConfig: gqa_loop takes dense calls without determinism or overlap")
        if self.dq_tma and not self.dq_split:
            raise ValueError("BwdConfig: the TMA dQ needs the split dQ tile (dq_split)")
        if self.varlen and self.lpt:
            raise ValueError("BwdConfig: lpt orders a dense grid (varlen needs lpt=0)")
        if self.deterministic and ((self.dq_tma and not self.dq_writer) or not self.dq_split or self.lpt or self.local):
            raise ValueError("BwdConfig: deterministic needs dq_split, dq_tma off (or with the writer warp), lpt 0 "
                             "and no window")
        if self.turns_desc and not (self.deterministic and self.causal):
            raise ValueError("BwdConfig: turns_desc orders the deterministic causal kernel's turns")
        if self.dq_perm != self.dq_tma or (self.dq_perm and self.head_dim % 32):
            raise ValueError("BwdConfig: dq_perm is the layout of the TMA dQ tile (dq_tma, which takes it) at head dims "
                             "that are multiples of 32 (permuted_column swaps 16-column blocks in pairs)")
        if self.softcap and self.block_m != 64:
            raise ValueError("BwdConfig: softcap needs block_m 64")
        if self.dq_first_store and (not self.dq_tma or self.dq_writer != self.deterministic or self.overlap
                                    or self.local or self.varlen):
            raise ValueError("BwdConfig: dq_first_store takes the TMA dQ (dq_tma) of dense calls without a window or "
                             "overlap: the consumers' reduce-adds, or deterministic the writer warp's turns")
        if self.head_dim_v is not None and (self.head_dim, self.head_dim_v) not in HEAD_DIM_PAIRS:
            raise ValueError(f"BwdConfig: head dims {self.head_dim} / {self.head_dim_v} not a pair of {sorted(HEAD_DIM_PAIRS)}")

    def key(self):
        """The disk cache's key (see _key)."""
        return _key(self, "FlashBwdSm90", _BWD_ALWAYS)


_BWD_ALWAYS = frozenset({"dtype", "head_dim", "causal", "arch", "abi", "block_m", "stages", "dq_split", "dq_tma"})


@dataclass(frozen=True)
class PlanRules:
    """Per-call planning rules of the host. ``pack_gqa_auto``: pack_gqa=None packs where the packed tiles
    hold more real queries (plan._pack_helps); off until a decoding benchmark decides it. ``bwd_host``:
    "triton" (Triton kernels prepare and finish the backward where they run) or "torch". ``bwd_window``: the
    CuTeDSL backward kernel serves sliding windows (sizes >= 0; else they take the next backend; on: ahead of
    Triton's windowed backward, benchmarks/results/h100/attention_cute_bwd_modes.md). ``bwd_varlen``: it serves
    varlen calls (cu_seqlens, seqused), on: 1.04-1.37x Triton's varlen backward (the same results file).
    ``bwd_deterministic``: which deterministic calls without a window the dispatcher's cute backend serves (dQ's adds
    in key-block turns; bit for bit run to run on the GPU): "off", "writer" (the head dims whose turns the dQ writer
    warp takes, those of BWD_DQ_TMA: d64-d128, 0.97-1.30x Triton's deterministic backward at 2k / 8k on an H100; the
    split-D kernel's consumer turns at d192 / d256 are not timed against it) or "on" (1 / 0 read as on / off);
    flash_attn.cute's own backward (no root package) uses the kernel for them either way.
    ``bwd_softcap``: it serves soft-capped scores, on: 1.35-1.96x Triton's soft-capped backward. ``kvcache``: the
    dispatcher's cute backend serves flash_attn_with_kvcache (kvcache.py), off until its GPU tests and a decoding
    benchmark against the Triton kernels decide it. ``mods_disk_cache``: the score_mod / mask_mod kernels of mods
    with a stable fingerprint (mod_fingerprint.py) are kept in the disk cache too, so a new process loads them instead
    of compiling; on: a fresh process's kernels loaded from disk ran on an H100 with the accuracy of the compiling
    process's (tests/cute/test_cute_mod_cache.py's GPU test). ``bwd_gqa_loop``: a GQA / MQA backward (dense, not
    deterministic, no mods) runs the kernel whose CTAs each walk one KV head's group of query heads and write its
    summed dK / dV (FlashBwdSm90 gqa_loop) instead of per-query-head dK / dV summed after the kernel; on: 0.99-1.26x
    (benchmarks/results/h100/cute_bwd_ab.md). ``bwd_wide_d``: the backward kernel serves head dim 192 and the 192 / 128
    pair (FlashBwdSm90.split_d: 64 keys per CTA, D split over the warpgroups); on: 1.20-1.64x Triton's backward.
    ``bwd_d256``: which d256 backward calls it serves, "off", "causal" or "on"; "causal": 1.07-1.18x Triton's with a
    causal mask at 1k-4k (0.98x at 16k), 0.88-0.97x without one (benchmarks/results/h100/attention_cute_bwd_wide.md)."""
    pack_gqa_auto: bool = False
    bwd_host: str = "triton"
    bwd_window: bool = True
    bwd_varlen: bool = True
    bwd_deterministic: str = "writer"
    bwd_softcap: bool = True
    kvcache: bool = False
    mods_disk_cache: bool = True
    bwd_gqa_loop: bool = True
    bwd_wide_d: bool = True
    bwd_d256: str = "causal"

    def __post_init__(self):
        if self.bwd_host not in ("triton", "torch"):
            raise ValueError(f"{settings.OVERRIDES}: plan.bwd_host={self.bwd_host!r}: expected triton or torch")
        det = {"1": "on", "true": "on", "0": "off", "false": "off"}.get(str(self.bwd_deterministic).lower(),
                                                                        self.bwd_deterministic)
        if det not in ("off", "writer", "on"):
            raise ValueError(f"{settings.OVERRIDES}: plan.bwd_deterministic={self.bwd_deterministic!r}: expected off, "
                             "writer or on")
        object.__setattr__(self, "bwd_deterministic", det)
        if self.bwd_d256 not in ("off", "causal", "on"):
            raise ValueError(f"{settings.OVERRIDES}: plan.bwd_d256={self.bwd_d256!r}: expected off, causal or on")


@dataclass(frozen=True)
class NormBwdTuning:
    """The tuning fields of the CuTeDSL norm backward (norm_bwd.py), set only through FLASH_ATTN_CUTE_OVERRIDES' ``ln``
    section: ``threads`` per CTA at most (256, 512 or 1024; 0: norm_bwd.THREADS_TABLE's), ``opts`` its "+"-separated
    variants ("none": none; "": norm_bwd.OPTS_TABLE's)."""
    threads: int = 0
    opts: str = ""


_SECTIONS = {"fwd": FwdConfig, "bwd": BwdConfig, "plan": PlanRules, "ln": NormBwdTuning}
# what the call decides, or what follows from another field (dq_perm: dq_tma's tile layout): not tunable
_FIXED = {"dtype", "head_dim", "arch", "abi", "causal", "local", "softcap", "varlen", "sink", "split", "pack_gqa",
          "head_dim_v", "paged", "gqa_loop", "dq_perm"}
_parsed = {}


def _value(section, field, raw):
    kind = {f.name: f.type for f in dataclasses.fields(_SECTIONS[section])}[field]
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    try:
        if kind == "bool":
            if raw.lower() not in ("0", "1", "true", "false"):
                raise ValueError
            return raw.lower() in ("1", "true")
        if kind == "int":
            return int(raw)
        return raw
    except ValueError:
        raise ValueError(f"{settings.OVERRIDES}: {section}.{field}={raw!r} is not a {kind}") from None


def overrides(section):
    """{field: value} of FLASH_ATTN_CUTE_OVERRIDES for ``section`` ("fwd", "bwd", "plan" or "ln"), typed and checked
    (ValueError naming an unknown section or field, or a value of the wrong type)."""
    current = settings.current
    cached = _parsed.get("table")
    if cached is None or cached[0] is not current:
        table = {name: {} for name in _SECTIONS}
        for sect, items in current.overrides.items():
            if sect and sect not in _SECTIONS:
                raise ValueError(f"{settings.OVERRIDES}: unknown section {sect!r}; expected one of {list(_SECTIONS)}")
            for field, raw in items.items():
                targets = [sect] if sect else [s for s, cls in _SECTIONS.items()
                                               if field in {f.name for f in dataclasses.fields(cls)}]
                tunable = [s for s in targets if field not in _FIXED
                           and field in {f.name for f in dataclasses.fields(_SECTIONS[s])}]
                if not tunable:
                    raise ValueError(f"{settings.OVERRIDES}: {(sect + '.') if sect else ''}{field} is not a tunable "
                                     f"field; {_tunable_fields()}")
                for s in tunable:
                    table[s][field] = _value(s, field, raw)
        cached = _parsed["table"] = (current, table)
    return cached[1][section]


def _tunable_fields():
    return "; ".join(f"{s}: " + ", ".join(f.name for f in dataclasses.fields(cls) if f.name not in _FIXED)
                     for s, cls in _SECTIONS.items())


def plan_rules():
    """The PlanRules in force (the defaults with FLASH_ATTN_CUTE_OVERRIDES' plan fields; per-call paths ask)."""
    current = settings.current
    cached = _rules.get("plan")
    if cached is None or cached[0] is not current:
        cached = _rules["plan"] = (current, PlanRules(**overrides("plan")))
    return cached[1]


_rules = {}


def paged_block_n(block_n, page_size):
    """The key block for a paged cache of page_size rows: block_n, or the largest multiple of 16 below it, that is
    a multiple of page_size or divides it, so that each TMA box is one page or part of one (page_size a multiple of
    8: boxes start on the swizzle atom's rows); None when there is none."""
    if page_size < 8 or page_size % 8:
        return None
    for n in range(block_n, 15, -16):
        if page_size % n == 0 or n % page_size == 0:
            return n
    return None


def _tma_o_rule(v, ov):
    if "tma_o" in ov:
        return ov["tma_o"]
    if v.local or v.softcap:
        takes = TMA_O_OPTIONS.get(v.head_dim, frozenset())
        return not v.sink and (not v.local or "local" in takes) and (not v.softcap or "softcap" in takes)
    rule = TMA_O.get(v.head_dim, "")
    return (rule == "plain" and v.plain) or (rule == "short" and v.short and v.plain)


def select_fwd(v, abi):
    """The FwdConfig for FwdVariant ``v`` under the calling convention ``abi`` ("tvm-ffi-env-stream" or "cute")."""
    ov = overrides("fwd")
    d, masked = v.head_dim, v.causal or v.local
    causal = v.causal and not v.local
    options = v.local or v.softcap or v.varlen or v.sink
    stages = ov.get("stages", STAGES.get(d, 2))
    # the length rules tune plain dense calls, and yield to an override of what they choose
    by_length = not (options or "persistent" in ov or "warpgroups" in ov)
    long_kernel = v.long and by_length and LONG.get((d, v.causal)) is not None
    short_persistent = v.short and by_length and (d, v.causal) in SHORT_PERSISTENT
    if "warpgroups" in ov:
        warpgroups = ov["warpgroups"]
    elif short_persistent:
        warpgroups = 2
    elif long_kernel:
        warpgroups = LONG[(d, v.causal)]
    else:
        warpgroups = (WARPGROUPS_MASKED if masked else WARPGROUPS).get(d, 2)
    if v.pack > 1 and ((64 * warpgroups) % v.pack or (64 * warpgroups // v.pack) % 8):
        warpgroups = 2  # each head's rows of the tile must start on a swizzle atom (8 rows)
    if warpgroups == 2:
        block_n = (BLOCK_N_LOCAL if v.local else BLOCK_N).get(d, BLOCK_N.get(d, 128))
    else:
        block_n = (BLOCK_N_3WG_OPTIONS if v.local or v.softcap or v.varlen else BLOCK_N_3WG).get(d, 128)
    block_n = ov.get("block_n", block_n)
    page_box = 0
    if v.paged:
        block_n = paged_block_n(block_n, v.paged)
        if block_n is None or not v.varlen:
            raise NotImplementedError(f"page size {v.paged}: a multiple of 8 that a key block of a multiple of 16 "
                                      "rows divides or is divided by (varlen calls)")
        page_box = min(v.paged, block_n)
    emu = ov.get("exp2_emu", EXP2_EMU.get(d, 0))
    degree = ov.get("exp2_emu_degree", 3) if emu else 3
    one_tile_only = options or long_kernel or v.pack > 1 or v.dv or v.split
    if "persistent" in ov:
        persistent = ov["persistent"] and not one_tile_only
    else:
        persistent = (short_persistent or (d, causal) in PERSISTENT) and not one_tile_only
    dense_one_tile = not (v.varlen or v.pack > 1 or v.dv or v.split)
    if persistent:
        # the persistent kernel's own O buffer (two warpgroups: with three ptxas spills), with as many K / V
        # stages as still fit
        tma_o = warpgroups == 2 and ov.get("tma_o", short_persistent)
        if tma_o and "stages" not in ov:
            while stages > 2 and 1024 + 2 * d * (2 * 128 + 2 * stages * block_n) > SMEM_BYTES:
                stages -= 1
    else:
        tma_o = dense_one_tile and _tma_o_rule(v, ov)
        if tma_o and "tma_o" not in ov and (v.dtype, d, causal) in TMA_O_SPILLS:
            tma_o = False
    if "reverse" in ov:
        reverse = ov["reverse"] and masked
    else:
        reverse = persistent and (d, causal) in REVERSE
    snake = not (persistent and causal and not ov.get("snake", d not in SNAKE_OFF))
    if causal and not (v.local or v.varlen or persistent):
        lpt = ov.get("lpt", not (v.short and d in LPT_SHORT_OFF))
    else:
        lpt = False
    return FwdConfig(dtype=v.dtype, head_dim=d, arch=v.arch, abi=abi, stages=stages, causal=causal, local=v.local,
                     softcap=v.softcap, varlen=v.varlen, sink=v.sink, block_n=block_n, warpgroups=warpgroups,
                     wg_order=ov.get("wg_order", True), exp2_emu=emu, exp2_emu_degree=degree, persistent=persistent,
                     tma_o=tma_o, reverse=reverse, pin=ov.get("pin", True), snake=snake, lpt=lpt, pack_gqa=v.pack,
                     head_dim_v=v.dv, paged=page_box, split=v.split)


def short_dims():
    """Head dims whose plain dense calls with seqlen_k <= SHORT_SK may take a kernel of their own (the TMA O
    "short" rule, the short-key lpt exception, the short-key persistent kernel). Calls of other head dims skip
    the length check."""
    return frozenset(d for d in SUPPORTED_HEAD_DIMS if TMA_O.get(d) == "short" or d in LPT_SHORT_OFF
                     or any((d, c) in SHORT_PERSISTENT for c in (False, True)))


def select_bwd(dtype, head_dim, causal, arch, abi, local=False, varlen=False, deterministic=False, softcap=False,
               gqa_loop=False, head_dim_v=None):
    """The BwdConfig of a backward call (local: with a sliding window; varlen: packed sequences, no lpt order;
    deterministic: dQ by red.global.add in key-block order, with the split dQ tile and no lpt order; softcap:
    soft-capped scores, 64 query rows per block; gqa_loop: one CTA per KV head over its group's query heads, no
    overlap; head_dim_v: V's head dim where it differs from head_dim)."""
    ov = overrides("bwd")
    d = int(head_dim)
    dq_split = True if deterministic else ov.get("dq_split", BWD_DQ_SPLIT)
    emu = ov.get("exp2_emu", BWD_EXP2_EMU.get(d, 0))
    # deterministic: the writer warp's TMA reduce-adds in turns where the fp32 dQ tiles fit (BWD_DQ_TMA; the consumers
    # never wait for a turn: 1.39-1.52x their red.global.add turns, bwd.dq_writer=0, on an H100,
    # benchmarks/results/h100/attention_cute_bwd_modes.md)
    if deterministic:
        dq_tma = dq_split and bool(ov.get("dq_writer", BWD_DQ_TMA.get(d, False)))
    else:
        dq_tma = dq_split and bool(ov.get("dq_tma", BWD_DQ_TMA.get(d, False)))
    block_m = 64 if softcap else ov.get("block_m", BWD_BLOCK_M.get(d, 64))
    overlap = not gqa_loop and bool(ov.get("overlap", BWD_OVERLAP.get(d, False)))
    dq_writer = dq_tma and not overlap and bool(ov.get("dq_writer", deterministic))
    first_store = (dq_tma and dq_writer == deterministic and not (overlap or local or varlen)
                   and bool(ov.get("dq_first_store", BWD_FIRST_STORE.get(d, False))))
    return BwdConfig(dtype=dtype_name(dtype), head_dim=d, causal=bool(causal), arch=arch, abi=abi,
                     block_m=block_m,
                     stages=ov.get("stages", BWD_STAGES.get(d, 2)),
                     dq_split=dq_split,
                     dq_tma=dq_tma, overlap=overlap,
                     lpt=0 if varlen or deterministic else max(0, ov.get("lpt", BWD_LPT_CAUSAL.get(d, BWD_LPT)
                                                                        if causal else BWD_LPT)),
                     exp2_emu=emu, exp2_emu_degree=ov.get("exp2_emu_degree", 3) if emu else 3, local=bool(local),
                     varlen=bool(varlen), deterministic=bool(deterministic), softcap=bool(softcap),
                     tma_dkv=bool(ov.get("tma_dkv", (BWD_TMA_DKV_VARLEN if varlen else BWD_TMA_DKV).get(d, False))),
                     gqa_loop=bool(gqa_loop), head_dim_v=None if head_dim_v in (None, d) else int(head_dim_v),
                     dq_writer=dq_writer,
                     # (descending turns where they are GPU-tested: the writer warp's; the consumers' red.global turns,
                     # bwd.dq_writer=0 and the split-D kernel's, ascend)
                     turns_desc=bool(deterministic and causal and dq_writer),
                     dq_perm=bool(dq_tma), dq_first_store=first_store)
