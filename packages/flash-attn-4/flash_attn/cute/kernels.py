"""Compiled kernels: built from a configuration (config.py), cached in memory and on disk (cache.py).

``compile_fwd`` / ``compile_bwd`` compile a kernel for sm_90a from fake tensors whose batch, sequence lengths, head
counts and strides are symbolic, so a new shape never recompiles; no GPU is needed. The kernels use CuTeDSL's
TVM-FFI calling convention (``--enable-tvm-ffi``): the compiled function takes torch tensors directly, checks
dtypes, shapes, strides, alignment and device in C, and launches on torch's current stream. ``fwd_kernel`` /
``bwd_kernel`` look a kernel up in memory, else load it from the disk cache (a shared library that loads without
importing the CuTeDSL compiler), else compile it and write it there.
"""
import contextlib
import dataclasses
import time

import torch

from flash_attn.cute import cache, config
from flash_attn.cute.config import FwdVariant
from flash_attn.cute.plan import _sm_counts


_kernels: dict[tuple, object] = {}  # (dtype, head dim, causal, arch, local, softcap[, True][, "sink"]...) -> fn
_origins: dict[tuple, str] = {}  # same key -> "so" / "o" (loaded from disk), "compiled" or "compiled-dlpack"
_bwd_kernels: dict[tuple, object] = {}  # bwd_mem_key(...) -> callable
_have_tvm_ffi: list = []


def _cutlass_dtype(dtype):
    import cutlass

    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


def _tvm_ffi():
    if not _have_tvm_ffi:
        import importlib.util

        _have_tvm_ffi.append(importlib.util.find_spec("tvm_ffi") is not None)
    return _have_tvm_ffi[0]


def _abi():
    """The compiled kernels' calling convention: TVM-FFI when apache-tvm-ffi is installed, else CuTe's."""
    return "tvm-ffi-env-stream" if _tvm_ffi() else "cute"


def fwd_config(dtype, head_dim, causal, arch="sm_90a", local=False, softcap=False, varlen=False, sink=False,
               short=False, long=False, pack=1, dv=None, paged=0, split=False):
    """The config.FwdConfig of a forward call (see config.FwdVariant for the arguments)."""
    if split and sink:
        raise NotImplementedError("split-KV: the sink is added by the host (the kernel is built without one)")
    return config.select_fwd(FwdVariant(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long,
                                        pack, dv, paged, split), _abi())


def bwd_config(dtype, head_dim, causal, arch="sm_90a", local=False, varlen=False, deterministic=False, softcap=False,
               gqa_loop=False, head_dim_v=None):
    """The config.BwdConfig of a backward call."""
    return config.select_bwd(dtype, head_dim, causal, arch, _abi(), local, varlen, deterministic, softcap, gqa_loop,
                             head_dim_v)


def _make_kernel(cfg):
    """The FlashFwdSm90 kernel object of a config.FwdConfig (imports CuTeDSL)."""
    import cutlass

    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    dtype = {"fp16": cutlass.Float16, "bf16": cutlass.BFloat16}[cfg.dtype]
    return FlashFwdSm90(dtype, cfg.head_dim, cfg.causal, local=cfg.local, softcap=cfg.softcap, varlen=cfg.varlen,
                        num_stages=cfg.stages, block_n=cfg.block_n, exp2_emu=cfg.exp2_emu,
                        exp2_emu_degree=cfg.exp2_emu_degree, sink=cfg.sink, num_warpgroups=cfg.warpgroups,
                        wg_order=cfg.wg_order, persistent=cfg.persistent, tma_o=cfg.tma_o, reverse=cfg.reverse,
                        pin=cfg.pin, snake=cfg.snake, lpt=cfg.lpt, pack_gqa=cfg.pack_gqa, head_dim_v=cfg.head_dim_v,
                        paged=cfg.paged, split=cfg.split)


def compile_fwd(dtype, head_dim, causal, arch="sm_90a", dump_dir=None, local=False, softcap=False,
                varlen=False, sink=False, short=False, long=False, pack=1, dv=None, paged=0, split=False):
    """Compile the forward kernel for ``dtype`` (torch.float16 / torch.bfloat16), ``head_dim`` (SUPPORTED_HEAD_DIMS),
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
    tensor. A persistent kernel (FwdConfig.persistent) takes one more argument,
    last: the most CTAs to launch (the SM count; ``fwd_kernel``'s callable adds it). ``pack`` > 1: the pack_gqa
    kernel for calls with exactly pack query heads per KV head (same call). ``dv``: v's (and out's) head dim, when
    it differs from head_dim (HEAD_DIM_PAIRS). ``paged`` (varlen): the page size of a paged K / V cache; the call
    then takes k / v (num_pages, page_size, Hk, D) and, in cu_seqlens_k's place, the int32 page table (B,
    max_pages). ``split``: the split-KV kernel, whose call takes out (num_splits * B, Sq, H, Dv) and lse (num_splits *
    B, H, Sq) in fp32 (varlen: (num_splits, total_q, H, Dv) and (num_splits, H, total_q)) and one more argument after
    window_right: num_splits."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    cfg = fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack, dv, paged, split)
    kernel = _make_kernel(cfg)
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
    tvm_ffi = cfg.abi != "cute"
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
    cfg = fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack, dv, paged, split)
    config = cfg.key()
    key = cache.entry_key(config)
    mask = "local" if cfg.local else "causal" if cfg.causal else "full"
    wg = f"-wg{cfg.warpgroups}" if cfg.warpgroups != 2 else ""  # readable names; the key decides
    name = (f"fwd-{arch}-{cfg.dtype}-d{cfg.head_dim}-{mask}{'-softcap' if softcap else ''}"
            f"{'-varlen' if varlen else ''}{'-sink' if sink else ''}{wg}"
            f"{'-persistent' if cfg.persistent else ''}{'-reverse' if cfg.reverse else ''}"
            f"{'-tmao' if cfg.tma_o else ''}{f'-pack{pack}' if cfg.pack_gqa > 1 else ''}"
            f"{f'-dv{dv}' if cfg.head_dim_v else ''}{f'-paged{paged}' if paged else ''}"
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


def load_or_build_bwd(dtype, head_dim, causal, arch="sm_90a", root=None, force=False, local=False, varlen=False,
                      deterministic=False, softcap=False, gqa_loop=False, head_dim_v=None):
    """load_or_build for the backward kernel: (callable, origin), from the disk cache ``root`` or compiled
    and written there."""
    return _load_or_build_entry(_bwd_entry(dtype, head_dim, causal, arch, local, varlen, deterministic, softcap,
                                           gqa_loop, head_dim_v),
                                lambda: compile_bwd(dtype, head_dim, causal, arch, local=local, varlen=varlen,
                                                    deterministic=deterministic, softcap=softcap, gqa_loop=gqa_loop,
                                                    head_dim_v=head_dim_v),
                                root, force)


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
        persistent = fwd_config(dtype, head_dim, causal, arch, **variant).persistent
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
    config.SHORT_SK (in-memory key ending in "short"; the same kernel as not short unless their configs
    differ). ``long``: the kernel of calls with seqlen_k >= config.LONG_SK (key ending in "long"; likewise). ``pack`` > 1: the pack_gqa kernel
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
                cfg = fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink, short, long, pack, dv,
                                 paged, split)
                if (short or long) and cfg == fwd_config(dtype, head_dim, causal, arch, local, softcap, varlen, sink):
                    fn = fwd_kernel(dtype, head_dim, causal, arch, local, softcap, varlen, sink)  # the same kernel
                else:
                    fn, _origins[mem_key] = load_or_build(dtype, head_dim, causal, arch, cache.cache_dir(),
                                                          local=local, softcap=softcap, varlen=varlen, sink=sink,
                                                          short=short, long=long, pack=pack, dv=dv, paged=paged,
                                                          split=split)
                    if cfg.persistent:
                        fn = _persistent_launcher(fn)  # the kernel's last argument, which callers do not give
                _kernels[mem_key] = fn
    return fn




def compile_bwd(dtype, head_dim, causal, arch="sm_90a", dump_dir=None, local=False, varlen=False,
                deterministic=False, softcap=False, mask_mod=None, spec=(), sparse=None, scalars=(), score_mod=None,
                score_mod_bwd=None, block_m=None, gqa_loop=False, head_dim_v=None):
    """Compile the backward kernel for ``dtype`` (torch.float16 / torch.bfloat16), ``head_dim`` (64 / 96 / 128 / 192 / 256)
    and ``causal`` for ``arch``; no GPU needed. ``dump_dir``: an existing folder that receives the PTX
    and cubin. With apache-tvm-ffi the call is ``(q, k, v, dout, lse2, delta, dq_accum, dk, dv,
    softmax_scale)`` on torch tensors (see bwd_entries.py; ``backward`` prepares them); with ``local`` (a sliding
    window) or ``softcap``, call_general's ``softmax_scale, softcap, window_left, window_right`` after the tensors.
    ``varlen``: call_varlen's ``(..., dv, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_k,
    softmax_scale, softcap, window_left, window_right)`` (``backward_varlen``). ``deterministic``: call_deterministic
    (``..., dv, counters, softmax_scale, softcap``) / call_varlen_deterministic, the turn counters (B, H, query
    blocks) int32 after the other tensors. ``mask_mod`` (dense, no softcap; with ``local`` call_mods_local, the
    window sizes after the scale and no lists): call_mods, ``(..., dv,
    softmax_scale, aux, lists, scalars)`` with aux tensors of kinds ``spec``, with ``sparse`` ((has_full, row factor,
    walk factor); with or without a mask_mod) the per-key-block lists of query blocks, and aux scalars of kinds
    ``scalars`` (mods.py; never on disk: mods.mod_bwd_kernel); with ``score_mod`` / ``score_mod_bwd`` the kernel's
    query block is 64 (mod_bwd_block_m). ``varlen`` with mods: call_varlen_mods, ``(..., dv, cu_seqlens_q,
    cu_seqlens_k, seqused_q, seqused_k, max_seqlen_k, softmax_scale, aux, scalars)``. block_m: the query block of a
    mods kernel when not the config's (64: sparse query blocks that are not whole 128-row blocks). gqa_loop: the
    kernel whose CTAs each walk a KV head's group of query heads (FlashBwdSm90); its dk, dv are (B, Sk, Hk, D).
    head_dim_v: v's (and dout's, dv's) head dim where it differs (a pair of config.HEAD_DIM_PAIRS)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from flash_attn.cute.flash_bwd_sm90 import FlashBwdSm90

    cfg = bwd_config(dtype, head_dim, causal, arch, local, varlen, deterministic, softcap, gqa_loop, head_dim_v)
    if score_mod is not None or mask_mod is not None or sparse is not None or block_m is not None:
        cfg = dataclasses.replace(cfg, block_m=block_m or mod_bwd_block_m(cfg, score_mod is not None),
                                  dq_first_store=False)
    kernel = FlashBwdSm90(_cutlass_dtype(dtype), int(head_dim), bool(causal), block_m=cfg.block_m,
                          num_stages=cfg.stages, dq_split=cfg.dq_split, dq_tma=cfg.dq_tma, overlap=cfg.overlap,
                          lpt=cfg.lpt, exp2_emu=cfg.exp2_emu, exp2_emu_degree=cfg.exp2_emu_degree, local=cfg.local,
                          varlen=cfg.varlen, deterministic=cfg.deterministic, softcap=cfg.softcap, mask_mod=mask_mod,
                          aux=bool(spec), sparse=sparse, scalars=scalars, score_mod=score_mod,
                          score_mod_bwd=score_mod_bwd, tma_dkv=cfg.tma_dkv, gqa_loop=cfg.gqa_loop,
                          head_dim_v=cfg.head_dim_v, dq_writer=cfg.dq_writer,
                          turns_desc=cfg.turns_desc, dq_first_store=cfg.dq_first_store)
    D, Dv = kernel.head_dim, kernel.head_dim_v
    # 32-bit symbolic shapes and strides, as in compile_fwd (backward() keeps tensors below 2^31 elements).
    batch, seqlen_q, seqlen_k, heads, heads_kv, seqlen_q_pad = (cute.sym_int() for _ in range(6))

    def bshd(dt, seqlen, h, d=D):  # (B, S, H, d) (varlen: B = 1, the packed rows)
        return make_fake_tensor(dt, (batch, seqlen, h, d),
                                (cute.sym_int(divisibility=8), cute.sym_int(divisibility=8), d, 1),
                                assumed_align=16)

    def rows():  # lse2 / delta (B, H, Sq_pad) fp32: TMA needs 16-byte aligned rows
        return make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q_pad),
                                (cute.sym_int(divisibility=4), cute.sym_int(divisibility=4), 1), assumed_align=16)

    dt = kernel.dtype
    tvm_ffi = cfg.abi != "cute"
    options = f"--gpu-arch {arch}" + (" --enable-tvm-ffi" if tvm_ffi else "")
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    tensors = (bshd(dt, seqlen_q, heads), bshd(dt, seqlen_k, heads_kv), bshd(dt, seqlen_k, heads_kv, Dv),
               bshd(dt, seqlen_q, heads, Dv), rows(), rows(), bshd(cutlass.Float32, seqlen_q, heads),
               *(bshd(dt, seqlen_k, heads_kv if gqa_loop else heads, d) for d in (D, Dv)))  # dk, dv
    sem = ()
    if deterministic or cfg.dq_first_store:  # (B, H, query blocks) int32, contiguous
        sem = (make_fake_tensor(cutlass.Int32, (cute.sym_int(), heads, cute.sym_int()),
                                (cute.sym_int(), cute.sym_int(), 1), assumed_align=4),)
    if varlen:
        seqs = cute.sym_int()
        cu = [make_fake_tensor(cutlass.Int32, (seqs,), (1,), assumed_align=4) for _ in range(2)]
        used = [make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4) for _ in range(2)]
        if mask_mod is not None or score_mod is not None:
            from flash_attn.cute import mods

            window = (cutlass.Int32(0), cutlass.Int32(0)) if local else ()
            return cute.compile(kernel.call_varlen_mods_local if local else kernel.call_varlen_mods, *tensors, *cu,
                                *used, cutlass.Int32(1), cutlass.Float32(1.0), *window, stream, mods.fake_aux(spec),
                                mods.fake_scalars(scalars), options=options)
        entry = kernel.call_varlen_deterministic if deterministic else kernel.call_varlen
        return cute.compile(entry, *tensors, *cu, *used, *sem, cutlass.Int32(1), cutlass.Float32(1.0),
                            cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0), stream, options=options)
    if deterministic:
        return cute.compile(kernel.call_deterministic, *tensors, *sem, cutlass.Float32(1.0), cutlass.Float32(0.0),
                            stream, options=options)
    if mask_mod is not None or sparse is not None or score_mod is not None:
        from flash_attn.cute import mods

        if local:  # (no block sparsity with a window: FlashBwdSm90 refuses it)
            return cute.compile(kernel.call_mods_local, *tensors, cutlass.Float32(1.0), cutlass.Int32(0),
                                cutlass.Int32(0), stream, mods.fake_aux(spec), mods.fake_scalars(scalars),
                                options=options)
        return cute.compile(kernel.call_mods, *tensors, cutlass.Float32(1.0), stream, mods.fake_aux(spec),
                            mods.fake_lists(None if sparse is None else sparse[0]), mods.fake_scalars(scalars),
                            options=options)
    if cfg.dq_first_store and softcap:
        return cute.compile(kernel.call_softcap_first_store, *tensors, *sem, cutlass.Float32(1.0), cutlass.Float32(0.0),
                            cutlass.Int32(0), cutlass.Int32(0), stream, options=options)
    if cfg.dq_first_store:
        return cute.compile(kernel.call_first_store, *tensors, *sem, cutlass.Float32(1.0), stream, options=options)
    if local or softcap:
        return cute.compile(kernel.call_general, *tensors, cutlass.Float32(1.0), cutlass.Float32(0.0),
                            cutlass.Int32(0), cutlass.Int32(0), stream, options=options)
    return cute.compile(kernel, *tensors, cutlass.Float32(1.0), stream, options=options)


def mod_bwd_block_m(cfg, has_score_mod):
    """The query block of a mods backward kernel: the config's, 64 with a score_mod (its fp32 copy of the scaled
    scores takes BLOCK_M / 2 registers, which the 128-row kernel does not have)."""
    return 64 if has_score_mod else cfg.block_m


def _bwd_entry(dtype, head_dim, causal, arch, local=False, varlen=False, deterministic=False, softcap=False,
               gqa_loop=False, head_dim_v=None):
    cfg = bwd_config(dtype, head_dim, causal, arch, local, varlen, deterministic, softcap, gqa_loop, head_dim_v)
    config = cfg.key()
    key = cache.entry_key(config)
    dv = f"-dv{cfg.head_dim_v}" if cfg.head_dim_v else ""
    name = (f"bwd-{arch}-{cfg.dtype}-d{cfg.head_dim}{dv}-{'causal' if causal else 'full'}{'-local' if local else ''}"
            f"{'-varlen' if varlen else ''}{'-det' if deterministic else ''}{'-softcap' if softcap else ''}"
            f"{'-gqa' if gqa_loop else ''}-{key[:16]}")
    return config, key, name, f"flash_attn_cute_{key[:16]}"


def _bwd_dlpack_launcher(compiled, varlen, plain):
    # As _dlpack_launcher, for the backward's signatures (see compile_bwd; plain: __call__'s, one fp32 scalar).
    import cutlass
    from cuda.bindings import driver
    from cutlass.cute.runtime import from_dlpack

    def as_cute(t, align):
        return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    def launch(q, k, v, dout, lse2, delta, dq_accum, dk, dv, *args):
        n = sum(isinstance(a, torch.Tensor) for a in args)  # varlen's 4 sequence tensors, the turn counters
        seqs = tuple(as_cute(t, 4) for t in args[:n])
        args = args[n:]
        if varlen:
            seqs += (cutlass.Int32(args[0]),)  # max_seqlen_k
            args = args[1:]
        n_f32 = 1 if plain else 2  # softmax_scale[, softcap], then the window sizes
        scalars = [cutlass.Float32(a) for a in args[:n_f32]] + [cutlass.Int32(a) for a in args[n_f32:]]
        with torch.cuda.device(q.device):
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            compiled(*(as_cute(t, 16) for t in (q, k, v, dout, lse2, delta, dq_accum, dk, dv)), *seqs, *scalars,
                     stream)

    return launch


def bwd_kernel(dtype, head_dim, causal, arch="sm_90a", local=False, varlen=False, deterministic=False,
               softcap=False, gqa_loop=False, head_dim_v=None):
    """The backward kernel for (dtype, head dim, causal, arch, local, varlen, deterministic, softcap, gqa_loop,
    head_dim_v): from memory, else the disk cache, else compiled and written there (as fwd_kernel)."""
    mem_key = bwd_mem_key(dtype, head_dim, causal, arch, local, varlen, deterministic, softcap, gqa_loop, head_dim_v)
    fn = _bwd_kernels.get(mem_key)
    if fn is None:
        with cache._lock:
            fn = _bwd_kernels.get(mem_key)
            if fn is None:
                if not _tvm_ffi():
                    fn = _bwd_dlpack_launcher(compile_bwd(dtype, head_dim, causal, arch, local=local, varlen=varlen,
                                                          deterministic=deterministic, softcap=softcap,
                                                          gqa_loop=gqa_loop, head_dim_v=head_dim_v), varlen,
                                              not (local or varlen or deterministic or softcap))
                else:
                    fn, _ = load_or_build_bwd(dtype, head_dim, causal, arch, cache.cache_dir(), local=local,
                                              varlen=varlen, deterministic=deterministic, softcap=softcap,
                                              gqa_loop=gqa_loop, head_dim_v=head_dim_v)
                _bwd_kernels[mem_key] = fn
    return fn


def bwd_mem_key(dtype, head_dim, causal, arch, local=False, varlen=False, deterministic=False, softcap=False,
                gqa_loop=False, head_dim_v=None):
    """_bwd_kernels' key of a backward kernel."""
    return ((dtype, int(head_dim), bool(causal), arch) + (("local",) if local else ()) + (("varlen",) if varlen else ())
            + (("det",) if deterministic else ()) + (("softcap",) if softcap else ()) + (("gqa",) if gqa_loop else ())
            + (("dv", int(head_dim_v)) if head_dim_v not in (None, head_dim) else ()))
