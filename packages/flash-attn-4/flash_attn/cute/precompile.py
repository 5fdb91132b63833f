"""Compile the standard flash_attn.cute kernels ahead of time into a disk cache. No GPU is needed
(CuTeDSL compiles for the named architecture on any Linux machine), so a build or CI machine can fill
the cache a deployment then only loads:

    python -m flash_attn.cute.precompile --arch sm_90a --out DIR     # bf16/fp16 x d64..d256 x causal/not
    python -m flash_attn.cute.precompile --backward ...              # the backward kernels as well
    FLASH_ATTN_CUTE_DISABLE=d96,d192 python -m flash_attn.cute.precompile ...  # d64, d128, d256 only (the
                                                                     # head dims the dispatcher sends)
    FLASH_ATTN_CUTE_CACHE=DIR python serve.py                        # first calls load, never compile
    python -m flash_attn.cute.precompile --prebuilt                  # the entries a wheel ships (release job)

--prebuilt fills the package's own read-only folder (cache.PREBUILT_DIR, flash_attn/cute/_prebuilt) with the
kernels first calls use: bf16/fp16 x d64/d128 x causal/not, forward (with its short- and long-key kernels) and
backward, default configurations. It needs a C compiler (the entries must load without the CuTeDSL compiler) and
removes every other file from that folder (entries of older sources, locks) but the entries of these sources built
under another CUDA flavour of CuTeDSL's runtime (cu12 / cu13), so that `hatch build` of packages/flash-attn-4 then
packs exactly these: a release runs --prebuilt once in an environment of each flavour, then builds the wheel. An installed package consults them after a miss in the user's
cache and before compiling.

The deployment must have the same flash-attn-4 sources and the same nvidia-cutlass-dsl and
apache-tvm-ffi versions (and CUDA flavour, cu12 / cu13, of CuTeDSL's runtime): they are part of each
entry's key, and an entry whose key differs is never loaded (that configuration is compiled at first
use instead). Entries already in DIR are kept unless --force. Exit status 1 when any configuration
could not be compiled and written.
"""
import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128)  # precompile()'s default argument; the command line's default is default_head_dims()
BWD_HEAD_DIMS = (64, 96, 128)  # flash_bwd_sm90.FlashBwdSm90.HEAD_DIMS
CAUSAL = (False, True)


def default_head_dims():
    """The forward head dims the root dispatcher sends to this package (backend.forward_head_dims)."""
    from flash_attn.cute import backend

    return backend.forward_head_dims()


def _torch_dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _build(out, arch, dtype, head_dim, causal, force, kind="fwd"):
    """One configuration of one kernel ("fwd" / "bwd", or "fwd-short" / "fwd-long": the forward of short / long
    key lengths, see config.SHORT_SK and config.LONG), run in a worker process when --jobs > 1. Returns (how, seconds, error)."""
    from flash_attn.cute import cache, kernels

    fwd = kind in ("fwd", "fwd-short", "fwd-long")
    extra = {"short": True} if kind == "fwd-short" else {"long": True} if kind == "fwd-long" else {}
    load = kernels.load_or_build if fwd else kernels.load_or_build_bwd
    entry = kernels.disk_entry if fwd else kernels.bwd_disk_entry
    t0 = time.perf_counter()
    shipped, cache.PREBUILT_DIR = cache.PREBUILT_DIR, None  # a shipped entry is no entry of ``out``
    try:
        _, how = load(_torch_dtype(dtype), head_dim, causal, arch, root=out, force=force, **extra)
    except Exception as e:  # a compile error of one configuration must not hide the others
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    finally:
        cache.PREBUILT_DIR = shipped
    seconds = time.perf_counter() - t0
    files = entry(_torch_dtype(dtype), head_dim, causal, arch, out, **extra)
    if not files:
        problems = "; ".join(cache.notes()[-3:]) or "entry missing after the build"
        return how, seconds, f"not written to {out}: {problems}"
    return how, seconds, None


def _entry_name(kind, dtype, head_dim, causal, arch):
    from flash_attn.cute import kernels

    if kind == "bwd":
        return kernels._bwd_entry(_torch_dtype(dtype), head_dim, causal, arch)[2]
    extra = {"short": True} if kind == "fwd-short" else {"long": True} if kind == "fwd-long" else {}
    return kernels._entry(_torch_dtype(dtype), head_dim, causal, arch, **extra)[2]


def _other_flavour(out, stem):
    """Whether ``stem`` is an entry of these sources and settings built under another CUDA flavour of CuTeDSL's
    runtime (its manifest says so): the shipped folder keeps one set of entries per flavour."""
    import json

    from flash_attn.cute import cache

    try:
        with open(os.path.join(out, stem + ".json")) as f:
            manifest = json.load(f)
        env = dict(manifest["env"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    here = dict(cache.environment())
    flavour, here_flavour = env.pop("cute-runtime", None), here.pop("cute-runtime")
    return manifest.get("source") == cache.source_hash() and env == here and flavour != here_flavour and bool(flavour)


def prune(out, report, arch, log=print):
    """Remove from ``out`` every file that is not part of an entry in ``report`` or of the same entries under another
    runtime flavour (_other_flavour): entries of other sources or settings, locks and temporary files go, so the
    shipped folder holds exactly the entries just checked, per flavour."""
    keep = {_entry_name(r["kind"], r["dtype"], r["head_dim"], r["causal"], arch) for r in report if not r["error"]}
    keep |= {os.path.splitext(e.name)[0] for e in os.scandir(out)
             if e.name.endswith(".json") and _other_flavour(out, os.path.splitext(e.name)[0])}
    removed = 0
    for path in sorted(os.scandir(out), key=lambda e: e.name):
        stem, ext = os.path.splitext(path.name)
        if path.is_file() and not (stem in keep and ext in (".o", ".so", ".json")):
            os.unlink(path.path)
            removed += 1
    if removed:
        log(f"removed {removed} other file(s) from {out}")


def precompile(out, arch="sm_90a", dtypes=DTYPES, head_dims=HEAD_DIMS, causals=CAUSAL, force=False, jobs=1,
               log=print, kinds=("fwd",)):
    """Compile every (kernel kind, dtype, head dim, causal) for ``arch`` into the disk cache folder ``out``
    (kinds: "fwd", "bwd"). Returns one dict per configuration: kind, dtype, head_dim, causal, how
    ("compiled", or "so" / "o" when it was already there), seconds, error (None when the entry is on
    disk)."""
    from flash_attn.cute import kernels

    if not kernels._tvm_ffi():
        raise RuntimeError("precompiling needs apache-tvm-ffi (pip install apache-tvm-ffi): the disk cache "
                           "holds TVM-FFI functions")
    os.makedirs(out, exist_ok=True)
    todo = [(kind, dt, d, c) for kind in kinds for dt in dtypes for d in head_dims for c in causals
            if kind == "fwd" or d in BWD_HEAD_DIMS]  # the backward kernel has d64, d96 and d128 only
    # the forward of short and of long key lengths where it is another kernel (config.SHORT_SK, config.LONG)
    todo += [("fwd-short", dt, d, c) for kind, dt, d, c in list(todo) if kind == "fwd"
             and kernels.fwd_config(_torch_dtype(dt), d, c, arch, short=True)
             != kernels.fwd_config(_torch_dtype(dt), d, c, arch)]
    todo += [("fwd-long", dt, d, c) for kind, dt, d, c in list(todo) if kind == "fwd"
             and kernels.fwd_config(_torch_dtype(dt), d, c, arch, long=True)
             != kernels.fwd_config(_torch_dtype(dt), d, c, arch)]
    args = [(str(out), arch, dt, d, c, force, kind) for kind, dt, d, c in todo]
    if jobs > 1 and len(todo) > 1:
        import multiprocessing

        with ProcessPoolExecutor(min(jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_build, *zip(*args)))
    else:
        results = [_build(*a) for a in args]
    report = []
    for (kind, dt, d, c), (how, seconds, error) in zip(todo, results):
        row = {"kind": kind, "dtype": dt, "head_dim": d, "causal": c, "how": how, "seconds": round(seconds, 2),
               "error": error}
        report.append(row)
        what = "already cached" if how in ("so", "o") else how
        prefix = {"fwd": "", "fwd-short": "short-key ", "fwd-long": "long-key ", "bwd": "bwd "}[kind]
        log(f"{prefix}{dt} d{d} {'causal' if c else 'full  '}: {error or what} ({seconds:.1f} s)")
    return report


def main(argv=None):
    from flash_attn.cute import cache, config, launch, settings

    archs = sorted(set(launch._ARCHS.values()))
    p = argparse.ArgumentParser(prog="python -m flash_attn.cute.precompile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=archs[0], choices=archs, help="GPU architecture (default %(default)s)")
    p.add_argument("--out", default=None,
                   help=f"cache folder (default: ${cache.ENV_VAR}, else {cache.default_dir()})")
    p.add_argument("--prebuilt", action="store_true",
                   help=f"fill the package's shipped folder ({cache.PREBUILT_DIR}) instead: head dims "
                        f"{','.join(map(str, HEAD_DIMS))} and the backward unless given, other files removed")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated, of bf16,fp16")
    supported = config.SUPPORTED_HEAD_DIMS
    p.add_argument("--head-dims", default=None,
                   help=f"comma-separated, of {','.join(map(str, supported))} (default: those the dispatcher sends, "
                        "all but those $FLASH_ATTN_CUTE_DISABLE names; backward kernels exist for 64,96,128)")
    p.add_argument("--causal", default="both", choices=("both", "true", "false"))
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--force", action="store_true", help="recompile entries already in the folder")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=None,
                   help="also the backward kernels (the dispatcher's backward on Hopper; default: with --prebuilt)")
    a = p.parse_args(argv)
    if a.prebuilt:
        if a.out is not None:
            p.error("--prebuilt writes the package's own folder: give --out or --prebuilt, not both")
        if cache.PREBUILT_DIR is None:
            p.error("no shipped folder (cache.PREBUILT_DIR is None)")
        if not cache._c_compiler():
            p.error("--prebuilt needs a C compiler (cc, gcc or clang; $CC): shipped entries are shared libraries, "
                    "which load without the CuTeDSL compiler")
        if settings.current.overrides:
            print(f"note: ${settings.OVERRIDES} is set: the shipped entries are those of the overridden "
                  "configurations, which default calls never look up")
        out = str(cache.PREBUILT_DIR)
    else:
        out = a.out if a.out is not None else cache.cache_dir()
    if out is None:
        p.error(f"no folder: ${cache.ENV_VAR} disables the cache and --out is not given")
    dtypes = [x for x in a.dtypes.split(",") if x]
    head_dims = ([int(x) for x in a.head_dims.split(",") if x] if a.head_dims is not None
                 else list(HEAD_DIMS) if a.prebuilt else list(default_head_dims()))
    backward = a.backward if a.backward is not None else a.prebuilt
    if set(dtypes) - set(DTYPES) or set(head_dims) - set(supported):
        p.error(f"dtypes must be among {DTYPES}, head dims among {supported}")
    causals = {"both": CAUSAL, "true": (True,), "false": (False,)}[a.causal]
    t0 = time.perf_counter()
    report = precompile(out, a.arch, dtypes, head_dims, causals, a.force, a.jobs,
                        kinds=("fwd", "bwd") if backward else ("fwd",))
    failed = [r for r in report if r["error"]]
    if a.prebuilt:
        prune(out, report, a.arch)
    use = ("An installed wheel built from this tree loads them when its user cache misses" if a.prebuilt
           else f"Use them with {cache.ENV_VAR}={os.path.abspath(out)}")
    print(f"{len(report) - len(failed)}/{len(report)} kernels in {os.path.abspath(out)} "
          f"({time.perf_counter() - t0:.1f} s). {use}")
    if not cache._c_compiler():
        print("note: no C compiler here, so the entries hold objects only; a process loading one imports "
              "CuTeDSL (~0.5 s) unless a C compiler there can link it (done once, in place)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
