"""Host side of score_mod / mask_mod / aux_tensors (FA4's API; the device side is score_mod.py): the kernel of a
call with user mods, compiled per distinct (mods, aux tensor kinds), and its launch.

Keying in memory: the user's functions are compile-time parts of the kernel. A closure is keyed by what tracing it
reads that can differ between closures of one ``def``: its code object and its cells' values (simple values: None,
bool, int, float (by repr: 0.0 and -0.0 differ), str, bytes, tuples of them; functions: keyed the same way, as a
``cute.jit`` wrapper's cell holds the user's function), so a closure made anew per call with the same constants
reuses the kernel; the globals its code names enter the key the same way (so closures made while a global differs
are different kernels); anything else in a cell or such a global (a tensor, an object) keys the function object
itself (the key keeps it alive, so an identity is never reused). A key is taken once per function object: as an
identity key, it does not follow a value rebound after that function's first call. Aux tensors are keyed by (dtype,
rank): their shapes and strides are runtime values.

On disk (the plan rule ``mods_disk_cache``): source text alone would miss closures and globals, and a stale kernel
would be a silent wrong answer, so the key is each function's fingerprint (mod_fingerprint.py: its source and the
values of the closure cells, globals and defaults it reads, recursively through the functions it calls) where one
exists; those kernels go to the disk cache like the forward's (kernels._load_or_build_entry), keyed by the
fingerprints and the kernel's facts. A mod without a fingerprint (something it reads has no stable description)
stays in memory only.
"""
import dataclasses
import types
import weakref

import torch

from flash_attn.cute import block_sparsity, cache_utils, config, settings
from flash_attn.cute.launch import _MAX_ELEMS, _MAX_GRID_Z, _kernel_layouts, _sink_lse
from flash_attn.cute.plan import _UNBOUNDED, _window_args

_mod_kernels = cache_utils.get_jit_cache("mods_fwd")  # mod_key(...) -> callable

_AUX_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8, torch.uint8,
               torch.bool)


def aux_spec(aux_tensors, device):
    """((dtype, rank), ...) of the aux tensors, checked: tensors on ``device`` of a dtype CuTe takes; () for
    None or empty."""
    if aux_tensors is None:
        return ()
    if not isinstance(aux_tensors, (list, tuple)):
        raise ValueError(f"aux_tensors must be a list of tensors, got {type(aux_tensors).__name__}")
    spec = []
    for i, t in enumerate(aux_tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"aux_tensors[{i}] must be a tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"aux_tensors[{i}] must be on {device} (q's device), got {t.device}")
        if t.dtype not in _AUX_DTYPES:
            raise ValueError(f"aux_tensors[{i}]: dtype {t.dtype} not one of {[str(d) for d in _AUX_DTYPES]}")
        if t.dim() == 0:
            raise ValueError(f"aux_tensors[{i}] must have at least one dimension")
        spec.append((t.dtype, t.dim()))
    return tuple(spec)


def mod_config(dtype, head_dim, causal, arch, local, varlen, abi, block_n=None, block_m=None, sparse=False):
    """The FwdConfig a mod kernel is built from: the call's default selection, then the one-tile kernel with two
    consumer warpgroups and the masked calls' block_n (the mods' registers come on top of a masked call's; a
    block-sparse call's may be smaller, ``block_n``: block_sparsity.kernel_block_n; ``block_m`` 64: one consumer
    warpgroup, for sparse query blocks of an odd number of 64 rows, block_sparsity.kernel_block_m), the direct O
    store. A block-sparse (``sparse``) kernel runs each head's query tiles from the last down (tiles_desc): the
    usual masks (causal, prefix-LM, ALiBi + causal) give the last query tiles the longest lists, so the longest
    tiles start first and the shortest fill the last wave's tail; for masks of even lists the order is neutral."""
    from flash_attn.cute.config import FwdVariant

    cfg = config.select_fwd(FwdVariant(dtype, head_dim, causal, arch, local, False, varlen, False), abi)
    if block_n is None:
        block_n = mod_block_n(head_dim, local)
    ov = config.overrides("fwd")
    tiles_desc = bool(sparse) and ov.get("tiles_desc", True)
    # O leaves through shared memory and a TMA store (dense calls; H100: causal mask_mod 3-6% faster, softcap
    # score_mod 0-2.5%, benchmarks/results/h100/flex_attention.md); lpt's L2-sectioned longest-first order stays an
    # experiment (fwd.lpt=1: within noise of the plain order on the same runs)
    tma_o = ov.get("tma_o", True) and not varlen
    lpt = cfg.lpt or (tiles_desc and not varlen and ov.get("lpt", False))  # (a causal call's own lpt stays)
    return dataclasses.replace(cfg, persistent=False, warpgroups=(block_m or MOD_BLOCK_M) // 64, block_n=block_n,
                               tma_o=tma_o, snake=False, tiles_desc=tiles_desc, lpt=lpt)


def mod_block_n(head_dim, local):
    """The mod kernels' key block (before a block-sparse call's adjustment)."""
    return config.BLOCK_N_LOCAL.get(head_dim, config.BLOCK_N[head_dim]) if local else config.BLOCK_N[head_dim]


MOD_BLOCK_M = 128  # the mod kernels' query tile (two consumer warpgroups, mod_config)
BWD_HEAD_DIMS = (64, 96, 128)  # flash_bwd_sm90.FlashBwdSm90.HEAD_DIMS (kept here: checking a call imports no CuTeDSL)
BWD_BLOCK_N = 128  # the backward kernel's key block (FlashBwdSm90: 64 per consumer warpgroup)
WIDE_BWD_HEAD_DIMS = (192, 256)  # the split-D kernel's, whose key block is 64


def bwd_head_dims():
    """The head dims whose mods backward this package serves (192 and 256 on the split-D kernel: GPU-tested, dense
    and varlen, on an H100 2026-12-07)."""
    return BWD_HEAD_DIMS + WIDE_BWD_HEAD_DIMS


def bwd_block_n(head_dim):
    """The backward kernel's key block at ``head_dim``: 128, or 64 on the split-D kernel (head dims past 128)."""
    return 64 if head_dim > 128 else BWD_BLOCK_N


_SIMPLE = (type(None), bool, int, str, bytes)


class _ByIdentity(Exception):
    """A cell value without a value key: the function object keys itself."""


def _cell_key(v, depth):
    if isinstance(v, _SIMPLE):
        return (type(v).__name__, v)
    if isinstance(v, float):
        return ("float", repr(v))
    if isinstance(v, tuple):
        return ("tuple",) + tuple(_cell_key(x, depth) for x in v)
    if isinstance(v, types.FunctionType):
        if "<locals>" not in v.__qualname__ and _library(v.__module__):
            return ("object", v)  # (a library's module-level function, e.g. CuTeDSL's own that its jit wrapper names)
        return _closure_key(v, depth + 1)
    if isinstance(v, (type, types.ModuleType)) and _library(v.__module__ if isinstance(v, type) else v.__name__):
        return ("object", v)  # (a library's class or module: versioned with the library; the key keeps it alive)
    raise _ByIdentity


def _library(module):
    from flash_attn.cute import mod_fingerprint  # (the libraries whose versions key the disk cache too)

    return mod_fingerprint._library(module or "")


def _global_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # (nested functions, comprehensions)
            names |= _global_names(const)
    return names


def _closure_key(f, depth):
    if depth > 8:
        raise _ByIdentity
    cells = tuple(_cell_key(c.cell_contents, depth) for c in (f.__closure__ or ()))
    defaults = _cell_key(f.__defaults__ or (), depth)
    kwdefaults = tuple(sorted((k, _cell_key(v, depth)) for k, v in (f.__kwdefaults__ or {}).items()))
    # the globals it may read, by value too: closures of one def made while a global differs are different kernels
    names = sorted(n for n in _global_names(f.__code__) if n in f.__globals__)
    glob = tuple((n, _cell_key(f.__globals__[n], depth)) for n in names)
    return ("closure", f.__module__, f.__code__, cells, defaults, kwdefaults, glob)


_fn_keys = weakref.WeakKeyDictionary()  # function -> fn_key's answer, computed once per function object
_BY_IDENTITY = object()


def fn_key(fn):
    """The in-memory key of a mod function (see the module docstring): by code and closure values, else itself.
    Computed once per function object (as an identity key, it does not follow a cell rebound after the first call)."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn  # (a plain module-level function: one object per definition)
    key = _fn_keys.get(fn)
    if key is None:
        try:
            key = _closure_key(fn, 0)
        except (_ByIdentity, ValueError):  # (ValueError: a cell never filled)
            key = _BY_IDENTITY
        _fn_keys[fn] = key  # (never the function itself: the entry would keep its own key alive)
    return fn if key is _BY_IDENTITY else key


def mod_key(dtype, head_dim, causal, arch, local, varlen, score_mod, mask_mod, spec, sparse=None, block_n=None,
            scalars=(), block_m=None, sink=False):
    """_mod_kernels' key: the call's kernel facts, the functions themselves, the aux tensors' kinds, block
    sparsity's compile-time facts (SparseCall.spec or None), the key block (None: mod_block_n's), the aux
    scalars' kinds, the query tile (None: MOD_BLOCK_M) and whether a learnable sink comes with the call."""
    return ((dtype, int(head_dim), bool(causal), arch, bool(local), bool(varlen), fn_key(score_mod), fn_key(mask_mod),
             spec, sparse, block_n) + ((tuple(scalars),) if scalars else ())
            + ((block_m,) if block_m not in (None, MOD_BLOCK_M) else ()) + (("sink",) if sink else ()))


def scalar_spec(aux_scalars):
    """(kinds, values) of FA4's aux_scalars: "i" for ints (Python or cutlass.Int32), "f" for floats (Python or
    cutlass.Float32); ((), ()) for None or empty. Raises ValueError for other values."""
    if not aux_scalars:
        return (), ()
    if not isinstance(aux_scalars, (list, tuple)):
        raise ValueError(f"aux_scalars must be a list of ints / floats, got {type(aux_scalars).__name__}")
    kinds, values = [], []
    for i, x in enumerate(aux_scalars):
        name = type(x).__name__
        if name in ("Int32", "Int64", "Uint32") or (isinstance(x, int) and not isinstance(x, bool)):
            kinds.append("i")
            values.append(int(getattr(x, "value", x)))
        elif name in ("Float32", "Float64") or isinstance(x, float):
            kinds.append("f")
            values.append(float(getattr(x, "value", x)))
        else:
            raise ValueError(f"aux_scalars[{i}] must be an int or a float (or cutlass.Int32 / Float32), got {name}")
    return tuple(kinds), tuple(values)


def fake_scalars(kinds):
    """Compile-time stand-ins of aux scalars of ``kinds`` (None for none: the kernels take None then)."""
    import cutlass

    return tuple(cutlass.Int32(0) if k == "i" else cutlass.Float32(0.0) for k in kinds) or None


def compile_fwd_mods(dtype, head_dim, causal, arch="sm_90a", dump_dir=None, local=False, varlen=False,
                     score_mod=None, mask_mod=None, spec=(), sparse=None, block_n=None, scalars=(), block_m=None,
                     sink=False):
    """Compile the forward kernel with ``score_mod`` / ``mask_mod`` (CuTeDSL functions, FA4's convention: see
    score_mod.py), aux tensors of kinds ``spec`` ((torch dtype, rank), ...) and block sparsity ``sparse``
    ((has_full, q_factor, kv_factor); None: without) for ``arch``; no GPU needed. The call is
    kernels.compile_fwd's (dense or varlen) with the aux tensors as one more argument, a tuple (None when spec is
    empty), then the sparsity tensors (a tuple, None without) and the aux scalars; ``sink``: then the learnable
    sink, an fp32 (H,) tensor (entries call_mods_sink / call_varlen_mods_sink)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from flash_attn.cute import kernels
    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    cfg = mod_config(dtype, head_dim, causal, arch, local, varlen, kernels._abi(), block_n, block_m, sparse is not None)
    kernel = FlashFwdSm90(kernels._cutlass_dtype(dtype), cfg.head_dim, cfg.causal, local=cfg.local, varlen=varlen,
                          num_stages=cfg.stages, block_n=cfg.block_n, num_warpgroups=cfg.warpgroups,
                          wg_order=cfg.wg_order, reverse=cfg.reverse, pin=cfg.pin, lpt=cfg.lpt,
                          exp2_emu=cfg.exp2_emu, exp2_emu_degree=cfg.exp2_emu_degree, tiles_desc=cfg.tiles_desc,
                          tma_o=cfg.tma_o,
                          score_mod=score_mod, mask_mod=mask_mod, aux=bool(spec), sparse=sparse, scalars=scalars,
                          sink=sink)
    dt, D = kernel.dtype, kernel.head_dim
    aux = fake_aux(spec)
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int() for _ in range(5))

    def qkv(seqlen, h):
        div8 = cute.sym_int(divisibility=8)
        return make_fake_tensor(dt, (batch, seqlen, h, D), (cute.sym_int(divisibility=8), div8, D, 1),
                                assumed_align=16)

    def packed(total, h):
        return make_fake_tensor(dt, (total, h, D), (cute.sym_int(divisibility=8), D, 1), assumed_align=16)

    lists = fake_lists(None if sparse is None else sparse[0])
    tvm_ffi = cfg.abi != "cute"
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    runtime = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0))  # scale, cap, window
    sink_arg = (make_fake_tensor(cutlass.Float32, (heads,), (1,), assumed_align=4),) if sink else ()
    if varlen:
        q, o, k, v = packed(seqlen_q, heads), packed(seqlen_q, heads), packed(seqlen_k, heads_kv), packed(seqlen_k,
                                                                                                          heads_kv)
        lse = make_fake_tensor(cutlass.Float32, (heads, seqlen_q), (cute.sym_int(), 1), assumed_align=4)
        seqs = [make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4) for _ in range(3)]
        entry = kernel.call_varlen_mods_sink if sink else kernel.call_varlen_mods
        return cute.compile(entry, q, k, v, o, lse, *seqs, cutlass.Int32(0), *runtime, stream, aux, lists,
                            fake_scalars(scalars), *sink_arg, options=options)
    q, o, k, v = qkv(seqlen_q, heads), qkv(seqlen_q, heads), qkv(seqlen_k, heads_kv), qkv(seqlen_k, heads_kv)
    lse = make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), (cute.sym_int(), cute.sym_int(), 1),
                           assumed_align=4)
    return cute.compile(kernel.call_mods_sink if sink else kernel.call_mods, q, k, v, o, lse, *runtime, stream, aux,
                        lists, fake_scalars(scalars), *sink_arg, options=options)


def fake_aux(spec):
    """Compile-time stand-ins of aux tensors of kinds ``spec``: any shape and strides (runtime values),
    element-aligned; None for an empty spec (the kernel takes None then)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    cdt = {torch.float32: cutlass.Float32, torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16,
           torch.int32: cutlass.Int32, torch.int64: cutlass.Int64, torch.int8: cutlass.Int8,
           torch.uint8: cutlass.Uint8, torch.bool: cutlass.Boolean}
    return tuple(make_fake_tensor(cdt[t], tuple(cute.sym_int() for _ in range(rank)),
                                  tuple(cute.sym_int() for _ in range(rank)),
                                  assumed_align=max(1, torch.empty((), dtype=t).element_size()))
                 for t, rank in spec) or None


def fake_lists(has_full):
    """Compile-time stand-ins of block sparsity's lists: (counts (Bs, Hs, M), indices (Bs, Hs, M, N)) per list (the
    partial one, and the full one when has_full), any strides; None for has_full None (built without)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if has_full is None:
        return None

    def ints(rank):
        return make_fake_tensor(cutlass.Int32, tuple(cute.sym_int() for _ in range(rank)),
                                tuple(cute.sym_int() for _ in range(rank)), assumed_align=4)
    return tuple(ints(r) for r in ((3, 4, 3, 4) if has_full else (3, 4)))


def _takes_scalars(fn):
    from flash_attn.cute.score_mod import takes_scalars  # (imports CuTeDSL: only calls with aux scalars get here)

    return takes_scalars(fn)


def disk_entry(kind, facts, score_mod=None, mask_mod=None, score_mod_bwd=None):
    """(config, key, name, symbol) of a mod kernel's disk-cache entry (kernels._load_or_build_entry), or None: the
    kernel stays in memory (the plan rule mods_disk_cache off, or a mod without a fingerprint). kind: "mods-fwd" /
    "mods-bwd"; facts: the kernel's compile-time facts (JSON-able), arch and dtype among them."""
    from flash_attn.cute import cache, mod_fingerprint

    if not config.plan_rules().mods_disk_cache:
        return None
    cfg = {"kind": kind, **facts}
    # the kernel's settings from FLASH_ATTN_CUTE_OVERRIDES (an A/B's variants must not share an entry)
    ov = config.overrides("fwd" if kind == "mods-fwd" else "bwd")
    if ov:
        cfg["overrides"] = sorted(ov.items())
    for label, fn in (("score_mod", score_mod), ("mask_mod", mask_mod), ("score_mod_bwd", score_mod_bwd)):
        if fn is not None:
            cfg[label] = mod_fingerprint.fingerprint(fn)
            if cfg[label] is None:
                return None
    key = cache.entry_key(cfg)
    name = f"{kind}-{facts['arch']}-{facts['dtype']}-d{facts['head_dim']}-{key[:16]}"
    return cfg, key, name, f"flash_attn_cute_{key[:16]}"


def _facts(dtype, head_dim, arch, spec, **more):
    """The JSON-able compile-time facts of a mod kernel for disk_entry (torch dtypes as names)."""
    return {"dtype": str(dtype).replace("torch.", ""), "head_dim": int(head_dim), "arch": arch,
            "aux": [[str(t).replace("torch.", ""), int(rank)] for t, rank in spec],
            **{k: (list(v) if isinstance(v, tuple) else v) for k, v in more.items()}}


def _build(entry, compile_fn):
    """The callable of a mod kernel: from the disk cache entry (loaded, else compiled and written), or compiled."""
    from flash_attn.cute import cache, kernels

    if entry is None:
        return kernels._ffi_function(compile_fn())
    return kernels._load_or_build_entry(entry, compile_fn, cache.cache_dir(), False)[0]


def mod_kernel(dtype, head_dim, causal, arch, local, varlen, score_mod, mask_mod, spec, sparse=None, block_n=None,
               scalars=(), block_m=None, sink=False):
    """The mod kernel from memory, else from the disk cache or compiled (see the module docstring's keying)."""
    from flash_attn.cute import cache, kernels

    key = mod_key(dtype, head_dim, causal, arch, local, varlen, score_mod, mask_mod, spec, sparse, block_n, scalars,
                  block_m, sink)
    fn = _mod_kernels.get(key)
    if fn is None:
        with cache._lock:
            fn = _mod_kernels.get(key)
            if fn is None:
                if not kernels._tvm_ffi():
                    raise NotImplementedError("score_mod / mask_mod kernels need apache-tvm-ffi")
                facts = _facts(dtype, head_dim, arch, spec, causal=bool(causal), local=bool(local),
                               varlen=bool(varlen), sparse=sparse, block_n=block_n, scalars=tuple(scalars),
                               block_m=block_m, sink=bool(sink))
                fn = _mod_kernels[key] = _build(
                    disk_entry("mods-fwd", facts, score_mod, mask_mod),
                    lambda: compile_fwd_mods(dtype, head_dim, causal, arch, local=local, varlen=varlen,
                                             score_mod=score_mod, mask_mod=mask_mod, spec=spec, sparse=sparse,
                                             block_n=block_n, scalars=scalars, block_m=block_m, sink=sink))
    return fn


# ---------------------------------------------------------------------------------------------------------------
# The API's side: which calls take mods, and their launches (interface.flash_attn_func / _varlen_func call these)

def requested(score_mod, mask_mod, aux_tensors, block_sparse=None):
    """Whether a call asks for mods (a score_mod, a mask_mod, aux tensors or block sparsity)."""
    return score_mod is not None or mask_mod is not None or bool(aux_tensors) or block_sparse is not None


def check_call(score_mod, mask_mod, aux_tensors, causal, window_left, window_right, softcap, needs_grad, D, Dv,
               block_sparse=None, block_sparse_bwd=None, aux_scalars=None, score_mod_bwd=None):
    """Raises for a mod call this package does not serve (NotImplementedError: the backward, ...) or that FA4
    rejects (ValueError). Block sparsity alone (no mod) is a mod call: its kernel is a mod kernel. A learnable sink
    composes with every mod call (the API checks it: interface._check_sink)."""
    if score_mod is None and mask_mod is None and aux_tensors:
        raise ValueError("aux_tensors without a score_mod or mask_mod: nothing reads them")
    if score_mod_bwd is not None and score_mod is None:
        raise ValueError("score_mod_bwd without a score_mod: nothing to differentiate")
    if aux_scalars and not any(f is not None and _takes_scalars(f) for f in (score_mod, mask_mod, score_mod_bwd)):
        raise ValueError("aux_scalars without a score_mod or mask_mod that has an aux_scalars parameter: nothing "
                         "reads them")
    scalar_spec(aux_scalars)
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod), ("score_mod_bwd", score_mod_bwd)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a CuTeDSL function (@cute.jit), got {type(fn).__name__}")
        if fn is not None:
            check_signature(name, fn)
    if block_sparse_bwd is not None and block_sparse is None:
        raise ValueError("block_sparse_tensors_bwd without block_sparse_tensors: give the forward's lists too")
    if needs_grad:
        if score_mod is not None and score_mod_bwd is None:
            raise ValueError("score_mod with gradients needs score_mod_bwd (FA4's: the gradient with respect to the "
                             "score the score_mod saw), or call it without gradients")
        if block_sparse is not None and block_sparse_bwd is None:
            raise ValueError("block sparsity with gradients needs block_sparse_tensors_bwd as well (FA4's: per key "
                             "block the query blocks, e.g. block_sparsity.from_block_mask_bwd of the BlockMask)")
        if window_left < _UNBOUNDED or (window_right < _UNBOUNDED and not causal):
            # (a mask_mod with a window is refused below; a score_mod's backward kernel takes the window)
            if block_sparse is not None:
                raise NotImplementedError("flash_attn.cute: the backward of block sparsity with a window_size is not "
                                          "implemented yet (a mask_mod can hold the condition)")
            if window_left < 0 or (window_right < 0 and not causal):
                raise NotImplementedError("flash_attn.cute: the backward of mods with a negative window size is not "
                                          "implemented yet")
        if D != Dv or D not in bwd_head_dims():
            raise NotImplementedError(f"flash_attn.cute: the backward of mods / block sparsity takes head dims "
                                      f"{bwd_head_dims()} (q's and v's alike), got {D} / {Dv}")
        if block_sparse_bwd is not None and D > 128:
            raise NotImplementedError("flash_attn.cute: block_sparse_tensors_bwd at head dims past 128 is not "
                                      "implemented yet (a mask_mod's own lists are)")
    if softcap and score_mod is not None:
        raise ValueError("softcap and score_mod cannot be used together (as in FA4; write the cap into the score_mod)")
    if mask_mod is not None and (causal or window_left < _UNBOUNDED or window_right < _UNBOUNDED):
        # FA4 drops causal and window_size when a mask_mod is given; a silent drop here would be a wrong answer for
        # whoever meant both, so the combination is refused: the mask_mod says which keys a query sees.
        raise ValueError("mask_mod with causal=True or a window_size: FA4 ignores causal / window_size when a "
                         "mask_mod is given; put the causal or window condition into the mask_mod instead")
    if D != Dv or D not in config.SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"score_mod / mask_mod / block sparsity: head dims {D} / {Dv}; the kernels' own "
                                  f"head dims {config.SUPPORTED_HEAD_DIMS} with equal q / v head dims only, for now")


# How the kernels call each mod (score_mod.ScoreMods, compute_block_sparsity): the positional arguments, the keyword
# ones, and the signature FA4's convention gives it (for the error message). A mod with an ``aux_scalars`` parameter
# gets them as one more argument (a keyword for score_mod, the last positional one for the others).
_CALLS = {
    "score_mod": (3, ("q_idx", "kv_idx", "seqlen_info", "aux_tensors"),
                  "(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors[, aux_scalars])"),
    "mask_mod": (6, (), "(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors[, aux_scalars])"),
    "score_mod_bwd": (8, (), "(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors[, aux_scalars])"),
}


_signatures_ok: set = set()  # (name, fn) pairs check_signature accepted: a mods call checks each function once


def check_signature(name, fn):
    """ValueError naming the mod when ``fn`` cannot take the arguments the kernels pass it (_CALLS), before anything
    is traced or launched (a wrong arity would otherwise surface as an error deep in the kernel's trace). A function
    whose signature Python cannot read is left to the trace. Accepted functions are remembered (inspect's signature
    costs tens of microseconds, every mods call comes here)."""
    import inspect

    if (name, fn) in _signatures_ok:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    n, keywords, want = _CALLS[name]
    scalars = "aux_scalars" in sig.parameters
    args = [None] * n + ([None] if scalars and name != "score_mod" else [])
    kwargs = dict.fromkeys(keywords) | ({"aux_scalars": None} if scalars and name == "score_mod" else {})
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"{name} must take {want} (FA4's convention); {getattr(fn, '__name__', fn)}{sig} cannot: "
                         f"{e}") from None
    if len(_signatures_ok) >= 256:
        _signatures_ok.clear()
    _signatures_ok.add((name, fn))


def with_softcap(softcap, score_mod, score_mod_bwd):
    """(score_mod, score_mod_bwd) of a checked mods call (check_call: a softcap never comes with a score_mod): a softcap
    > 0 becomes the score_mod cap * tanh(score / cap) and its gradient (mod_library.softcap, one function pair per cap,
    so one kernel), as FA4 turns softcap into a score_mod; it then combines with a mask_mod and block sparsity."""
    if not softcap:
        return score_mod, score_mod_bwd
    from flash_attn.cute import mod_library

    capped = mod_library.softcap(softcap)
    return capped.score_mod, capped.score_mod_bwd


_mask_lists: dict[tuple, object] = {}  # mask_lists' answers


def mask_lists(mask_mod, B, H, Sq, Sk, block_n, device, scalars=((), ())):
    """The block-sparsity lists of a mask_mod that reads no aux tensor, for the mod kernel's tiles
    (compute_block_sparsity, exhaustive), remembered per (function, shape): such a mask_mod is a pure function of
    the indices, as fixed as the kernel compiled from it (keyed by the same function object). A call then visits
    only the tiles the mask keeps, and runs the mask_mod on the partial ones only. scalars: scalar_spec's (kinds,
    values) of the call's aux scalars (the values are part of the key: the mask depends on them). Returns the
    lists checked for the kernel (block_sparsity.SparseCall), so that a call repeats neither step."""
    key = (fn_key(mask_mod), B, H, Sq, Sk, block_n, device, scalars)
    call = _mask_lists.get(key)
    if call is None:
        from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

        lists = compute_block_sparsity(MOD_BLOCK_M, block_n, B, H, Sq, Sk, mask_mod, None, device,
                                       aux_scalars=list(scalars[1]) or None)
        call = block_sparsity.normalize(lists, B, H, Sq, Sk, MOD_BLOCK_M, block_n, device)
        if len(_mask_lists) >= 64:
            _mask_lists.clear()
        _mask_lists[key] = call
    return call


def forward(q, k, v, softmax_scale, causal, arch, window_left, window_right, score_mod, mask_mod, aux_tensors,
            block_sparse=None, aux_scalars=None, sink=None):
    """Dense forward with mods: q (B, Sq, H, D), k / v (B, Sk, Hk, D) -> (out like q, lse (B, H, Sq) fp32).
    block_sparse: FA4's block_sparse_tensors (block_sparsity.py) or None; None with a mask_mod that reads no aux
    tensor: the lists of mask_lists (FLASH_ATTN_CUTE_DISABLE=mask_sparsity: none). aux_scalars: FA4's (scalar_spec).
    sink: the learnable sink, fp32 contiguous (H,) (interface._check_sink), or None."""
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    spec = aux_spec(aux_tensors, q.device)
    left, right, local = _window_args(causal, window_left, window_right)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if Sk == 0 or B * Sq * H == 0:  # no key: a row's only term is the sink, if any
        if sink is None:
            lse.fill_(float("inf"))
        else:
            lse.copy_(_sink_lse(sink).view(1, H, 1).expand(B, H, Sq))
        return torch.zeros_like(q), lse
    if B * max(Sq * H, Sk * Hk) * D >= _MAX_ELEMS or B > _MAX_GRID_Z:
        raise NotImplementedError("score_mod / mask_mod: tensors of 2^31 elements or more, or a batch over 65535, "
                                  "are not split into launches yet")
    sparse = None
    if block_sparse is not None:
        sparse = block_sparsity.normalize(block_sparse, B, H, Sq, Sk, MOD_BLOCK_M, mod_block_n(D, local), q.device)
    elif mask_mod is not None and not spec and not settings.disabled("mask_sparsity"):
        sparse = mask_lists(mask_mod, B, H, Sq, Sk, mod_block_n(D, local), q.device,
                            scalar_spec(aux_scalars) if aux_scalars else ((), ()))
    q, k, v = _kernel_layouts(q, k, v, D, D)
    out = torch.empty_like(q)
    kinds, values = scalar_spec(aux_scalars) if aux_scalars else ((), ())
    if sparse is None:
        fn = mod_kernel(q.dtype, D, causal and not local, arch, local, False, score_mod, mask_mod, spec,
                        scalars=kinds, sink=sink is not None)
    else:
        fn = mod_kernel(q.dtype, D, causal and not local, arch, local, False, score_mod, mask_mod, spec, sparse.spec,
                        sparse.block_n, scalars=kinds, block_m=sparse.block_m, sink=sink is not None)
    aux = tuple(aux_tensors) if spec else None  # (None: the kernel is built without aux / sparsity / scalars)
    fn(q, k, v, out, lse, float(softmax_scale), 0.0, left, right, aux, None if sparse is None else sparse.tensors,
       values or None, *(() if sink is None else (sink,)))
    return out, lse


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, softmax_scale, causal, arch,
                   window_left, window_right, score_mod, mask_mod, aux_tensors, aux_scalars=None, block_sparse=None,
                   max_seqlen_k=None, sink=None):
    """Varlen forward with mods: q (total_q, H, D), k / v (total_k, Hk, D), int32 cu_seqlens (B + 1,), seqused_k
    (B,) or None -> (out like q, lse (H, total_q) fp32). Values are checked by the caller (_varlen_func).
    block_sparse: FA4's block_sparse_tensors of a varlen call (block_sparsity.normalize_varlen), with max_seqlen_k
    (at least the longest used key count). sink: as forward's. Rows after the last sequence: out 0, lse +inf."""
    Tq, H, D = q.shape
    Tk, Hk = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    spec = aux_spec(aux_tensors, q.device)
    left, right, local = _window_args(causal, window_left, window_right)
    out = torch.zeros_like(q)
    lse = torch.full((H, Tq), float("inf"), dtype=torch.float32, device=q.device)
    if batch == 0 or Tq == 0 or max_seqlen_q == 0:
        return out, lse
    if Tk == 0:  # no key anywhere: the sequences' rows see only the sink, if any
        if sink is not None:
            lse[:, :int(cu_seqlens_q[-1])] = _sink_lse(sink).view(H, 1)
        return out, lse
    if max(Tq * H, Tk * Hk) * D >= _MAX_ELEMS or batch > _MAX_GRID_Z:
        raise NotImplementedError("score_mod / mask_mod: tensors of 2^31 elements or more, or over 65535 sequences, "
                                  "are not split into launches yet")
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == D and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
               else t.contiguous() for t in (q, k, v))
    used_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32) if seqused_k is None else seqused_k
    kinds, values = scalar_spec(aux_scalars)
    sparse = None
    if block_sparse is not None:
        sparse = block_sparsity.normalize_varlen(block_sparse, batch, H, int(max_seqlen_q), int(max_seqlen_k),
                                                 MOD_BLOCK_M, mod_block_n(D, local), q.device)
    if sparse is None:
        fn = mod_kernel(q.dtype, D, causal and not local, arch, local, True, score_mod, mask_mod, spec, scalars=kinds,
                        sink=sink is not None)
    else:
        fn = mod_kernel(q.dtype, D, causal and not local, arch, local, True, score_mod, mask_mod, spec, sparse.spec,
                        sparse.block_n, scalars=kinds, block_m=sparse.block_m, sink=sink is not None)
    aux = tuple(aux_tensors) if spec else None  # (None when the kernel is built without aux / scalars)
    fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, used_k, int(max_seqlen_q), float(softmax_scale), 0.0,
       left, right, aux, None if sparse is None else sparse.tensors, values or None,
       *(() if sink is None else (sink,)))
    return out, lse


# ---------------------------------------------------------------------------------------------------------------
# The backward of a call with mods / block sparsity: the Hopper backward kernel with the same mods (flash_bwd_sm90,
# entry call_mods), walking per-key-block lists of query blocks where it has them

_mod_bwd_kernels = cache_utils.get_jit_cache("mods_bwd")


def mod_bwd_kernel(dtype, head_dim, arch, mask_mod, spec, sparse=None, scalars=(), score_mod=None,
                   score_mod_bwd=None, causal=False, varlen=False, block_m=None, local=False):
    """The mods' (or block sparsity's) backward kernel from memory, else from the disk cache or compiled (as the
    forward's, mod_kernel); sparse: None, or (has_full, row factor, walk factor) of the per-key-block lists it walks; causal: the
    native causal mask too (bottom-right); varlen: the packed sequences' kernel (entry call_varlen_mods); local: a
    sliding window's (entries call_mods_local / call_varlen_mods_local, sizes per call; no block sparsity)."""
    from flash_attn.cute import cache, kernels

    key = ((dtype, int(head_dim), arch, fn_key(mask_mod), spec, sparse) + ((tuple(scalars),) if scalars else ())
           + ((fn_key(score_mod), fn_key(score_mod_bwd)) if score_mod is not None else ()) + (("causal",) if causal else ())
           + (("varlen",) if varlen else ()) + ((("block_m", block_m),) if block_m else ())
           + (("local",) if local else ()))
    fn = _mod_bwd_kernels.get(key)
    if fn is None:
        with cache._lock:
            fn = _mod_bwd_kernels.get(key)
            if fn is None:
                if not kernels._tvm_ffi():
                    raise NotImplementedError("score_mod / mask_mod kernels need apache-tvm-ffi")
                facts = _facts(dtype, head_dim, arch, spec, causal=bool(causal), local=bool(local),
                               varlen=bool(varlen), sparse=sparse, scalars=tuple(scalars), block_m=block_m)
                fn = _mod_bwd_kernels[key] = _build(
                    disk_entry("mods-bwd", facts, score_mod, mask_mod, score_mod_bwd),
                    lambda: kernels.compile_bwd(dtype, head_dim, bool(causal), arch, local=local, varlen=varlen,
                                                mask_mod=mask_mod, spec=spec, sparse=sparse, scalars=scalars,
                                                score_mod=score_mod, score_mod_bwd=score_mod_bwd, block_m=block_m))
    return fn


_mask_lists_bwd: dict[tuple, tuple] = {}


def mask_lists_bwd(mask_mod, B, H, Sq, Sk, block_m, block_n, device, scalars=((), ())):
    """The backward's lists of a mask_mod that reads no aux tensor (as mask_lists, per key block: the partial and full
    query blocks of block_m x block_n tiles), remembered per (function, shape): (mask_cnt, mask_idx, full_cnt,
    full_idx) as the kernel takes them."""
    key = (fn_key(mask_mod), B, H, Sq, Sk, block_m, block_n, device, scalars)
    lists = _mask_lists_bwd.get(key)
    if lists is None:
        from flash_attn.cute.compute_block_sparsity import block_kinds, pack_kinds

        kind = block_kinds(block_m, block_n, B, H, Sq, Sk, mask_mod, None, device, scalars=scalars)
        lists = tuple(pack_kinds(kind.transpose(2, 3).contiguous())[:4])
        if len(_mask_lists_bwd) >= 64:
            _mask_lists_bwd.clear()
        _mask_lists_bwd[key] = lists
    return lists


def backward(dout, q, k, v, out, lse, dlse, softmax_scale, arch, score_mod, score_mod_bwd, mask_mod, aux_tensors,
             block_sparse_bwd, aux_scalars, causal, window_left=_UNBOUNDED, window_right=_UNBOUNDED):
    """The dense backward of a call with mods (checked by check_call): q / out / dout (B, Sq, H, D), k / v (B, Sk,
    Hk, D), lse (B, H, Sq) fp32, dlse like lse or None -> (dq, dk, dv). Walks block_sparse_bwd (FA4's
    block_sparse_tensors_bwd: per key block the query blocks) when given, else the lists of a mask_mod that reads
    no aux tensor (mask_lists_bwd), else every block. window_left / window_right: the forward's (literal sizes,
    _UNBOUNDED for none; a window comes with a score_mod only, check_call)."""
    from flash_attn.cute import kernels, launch

    scalars = scalar_spec(aux_scalars)
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    spec = aux_spec(aux_tensors, q.device)
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    left, right, local = _window_args(causal, window_left, window_right)
    causal = causal and not local
    block_m = kernels.mod_bwd_block_m(kernels.bwd_config(q.dtype, D, causal, arch, local), score_mod is not None)
    own = None  # a query block other than the config's, for sparse query blocks of an odd number of 64 rows
    size = getattr(block_sparse_bwd, "block_size", None)
    if size is not None and int(size[0]) % block_m and int(size[0]) % 64 == 0:
        block_m = own = 64
    lists = sparse = None
    if block_sparse_bwd is not None and Sq and Sk:
        call = block_sparsity.normalize_bwd(block_sparse_bwd, B, H, Sq, Sk, block_m, bwd_block_n(D), q.device)
        lists, sparse = call.tensors, call.spec
    elif (mask_mod is not None and not spec and not settings.disabled("mask_sparsity") and Sq and Sk):
        # the forward's rule: lists where the mask_mod reads no aux tensor (mask_lists)
        lists = mask_lists_bwd(mask_mod, B, H, Sq, Sk, block_m, bwd_block_n(D), q.device, scalars)
        sparse = (True, 1, 1)
    fn = mod_bwd_kernel(q.dtype, D, arch, mask_mod, spec, sparse, scalars[0], score_mod, score_mod_bwd, causal,
                        block_m=own, local=local)
    return launch.backward(dout, q, k, v, out, lse, softmax_scale, causal, arch, dlse=dlse,
                           window=(left, right) if local else None,
                           mod=(fn, tuple(aux_tensors) if spec else None, lists, scalars[1] or None, block_m))


def backward_varlen(dout, q, k, v, out, lse, dlse, softmax_scale, arch, score_mod, score_mod_bwd, mask_mod,
                    aux_tensors, aux_scalars, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                    causal, window_left=_UNBOUNDED, window_right=_UNBOUNDED):
    """The varlen backward of a call with mods (no block sparsity): q / out / dout (total_q, H, D), k / v (total_k,
    Hk, D), lse (H, total_q) fp32, int32 cu_seqlens, seqused_k (B,) or None, max_seqlen_k at least the longest used
    key count -> (dq, dk, dv). Window sizes as backward's."""
    from flash_attn.cute import kernels, launch

    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    spec = aux_spec(aux_tensors, q.device)
    kinds, values = scalar_spec(aux_scalars)
    D = q.shape[-1]
    left, right, local = _window_args(causal, window_left, window_right)
    causal = causal and not local
    used_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32) if seqused_k is None else seqused_k
    block_m = kernels.mod_bwd_block_m(kernels.bwd_config(q.dtype, D, causal, arch, local, varlen=True),
                                      score_mod is not None)
    fn = mod_bwd_kernel(q.dtype, D, arch, mask_mod, spec, None, kinds, score_mod, score_mod_bwd, causal, True,
                        local=local)
    return launch.backward_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, None, used_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, arch, dlse=dlse,
                                  window=(left, right) if local else None,
                                  mod=(fn, tuple(aux_tensors) if spec else None, values or None, block_m))


class ModAttention(torch.autograd.Function):
    """forward() of a call with mods and / or block sparsity (lists built from a mask_mod that reads no aux tensor
    when none are given), backward by the backward kernel with the same mask_mod and score_mod (its gradient from
    score_mod_bwd), walking the backward's lists (the caller's block_sparse_tensors_bwd, or built from the mask_mod as
    the forward's). sink: the learnable sink (H,) or None (its gradient: _sink_grad). args: (softmax_scale, arch,
    score_mod, score_mod_bwd, mask_mod, aux_tensors, block_sparse, block_sparse_bwd, aux_scalars, causal, window_left,
    window_right); dense, a window with a score_mod only, no softcap (check_call; with_softcap)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, args):
        (softmax_scale, arch, score_mod, _, mask_mod, aux_tensors, block_sparse, _, aux_scalars, causal, window_left,
         window_right) = args

        out, lse = forward(q, k, v, softmax_scale, causal, arch, window_left, window_right, score_mod, mask_mod,
                           aux_tensors, block_sparse, aux_scalars, _kernel_sink(sink))
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        (softmax_scale, arch, score_mod, score_mod_bwd, mask_mod, aux_tensors, _, block_sparse_bwd, aux_scalars,
         causal, window_left, window_right) = ctx.args
        dq, dk, dv = backward(dout, q, k, v, out, lse, dlse, softmax_scale, arch, score_mod, score_mod_bwd, mask_mod,
                              aux_tensors, block_sparse_bwd, aux_scalars, causal, window_left, window_right)
        return dq, dk, dv, _sink_grad(ctx, dout, out, lse, sink, dlse), None


def _kernel_sink(sink):
    """The learnable sink as the kernels take it (fp32, contiguous; the API checked its shape and device), or None."""
    return None if sink is None else sink.detach().to(torch.float32).contiguous()


def _sink_grad(ctx, dout, out, lse, sink, dlse):
    """The learnable sink's gradient when autograd asks for it (input 3 of the Functions below), else None. The
    backward kernels need no sink: P = exp(S - lse) with the forward's lse, which includes it."""
    if sink is None or not ctx.needs_input_grad[3]:
        return None
    from flash_attn.cute.autograd import sink_grad

    return sink_grad(torch.zeros_like(out) if dout is None else dout, out, lse, sink, dlse).to(sink.dtype)


class VarlenModAttention(torch.autograd.Function):
    """forward_varlen() with mods, backward by the varlen backward kernel with the same mods (no block sparsity);
    sink as ModAttention's. args: (softmax_scale, arch, (score_mod, mask_mod, aux_tensors, aux_scalars, score_mod_bwd,
    None), cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k (at least the longest used key count),
    causal, window_left, window_right); a window with a score_mod only, no softcap (check_call; with_softcap)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, args):
        softmax_scale, arch, mods, cu_q, cu_k, used_k, max_q, _, causal, window_left, window_right = args

        out, lse = forward_varlen(q, k, v, cu_q, cu_k, used_k, max_q, softmax_scale, causal, arch, window_left,
                                  window_right, *mods[:4], sink=_kernel_sink(sink))
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = args
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sink = ctx.saved_tensors
        softmax_scale, arch, (score_mod, mask_mod, aux_tensors, aux_scalars, score_mod_bwd, _), cu_q, cu_k, used_k, \
            max_q, max_k, causal, window_left, window_right = ctx.args
        dq, dk, dv = backward_varlen(dout, q, k, v, out, lse, dlse, softmax_scale, arch, score_mod, score_mod_bwd,
                                     mask_mod, aux_tensors, aux_scalars, cu_q, cu_k, used_k, max_q, max_k, causal,
                                     window_left, window_right)
        return dq, dk, dv, _sink_grad(ctx, dout, out, lse, sink, dlse), None
