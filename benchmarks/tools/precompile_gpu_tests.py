"""Build the forward kernels that the GPU tests of the kernels written without a GPU will ask for (pack_gqa, v's head
dim != q's, paged K / V, seqused_q, split-KV) into a disk cache, on a CPU, so that the device call loads them instead of
compiling each one at its first use (~7 s each, one at a time, in device time):

    pip uninstall -y nvidia-cutlass-dsl-libs-cu12; pip install nvidia-cutlass-dsl-libs-cu13==4.8.1  # the device's
    CUTE_DSL_ARCH=sm_90a FLASH_ATTN_CUTE_CACHE=.scratch/cutecache \\
        python -m benchmarks.tools.precompile_gpu_tests --jobs 2

Each test file lists its calls' kernel choices (``gpu_kernel_requests()``, from the same constants as its
parametrizations); kernel_args() turns one into fwd_kernel's arguments as forward() / forward_varlen() choose them.
Any later edit of a source under packages/flash-attn-4/flash_attn/cute/ changes every key (the source hash): build
after the last edit. Exit status 1 when a kernel could not be built.
"""
import argparse
import glob
import importlib.util
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.common import ROOT

MODULES = ("test_cute_pack_gqa", "test_cute_hdim_v", "test_cute_paged", "test_cute_seqused_q", "test_cute_split",
           "test_cute_grid_limits")


def kernel_args(dtype, d, causal, window=(-1, -1), softcap=0.0, sink=False, varlen=False, pack=1, dv=None, paged=0,
                seqlen_k=0, split=False):
    """(dtype, head dim, causal, fwd_kernel's keyword arguments) of a call, chosen as forward() / forward_varlen()
    choose them (window sizes < 0: no limit; pack: the group _pack_group gives; seqlen_k: a dense call's key
    length, for the short / long-key kernels; split: a split-KV call, whose kernel leaves the sink to the host);
    None for a dense call without keys (no kernel runs)."""
    from flash_attn.cute import plan

    if not varlen and seqlen_k == 0:
        return None
    _, _, local = plan._window_args(causal, *(plan._UNBOUNDED if w < 0 else w for w in window))
    causal = causal and not local
    capped = softcap > 0.0
    dv = None if dv in (None, d) else dv
    short = long = False
    if not varlen and not split:
        short, long = plan._length_kernel(d, causal, seqlen_k, not (local or capped or sink or pack > 1 or dv))
    return dtype, d, causal, dict(local=local, softcap=capped, varlen=varlen, sink=sink and not split, short=short,
                                  long=long, pack=pack, dv=dv, paged=paged, split=split)


def test_module(name):
    """tests/<folder>/<name>.py as a module: the one pytest imported when it runs (it imports test files by their
    base name), else loaded from its path (tests/ is a tree of folders of files, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    (path,) = glob.glob(os.path.join(ROOT, "tests", "*", name + ".py"))
    if os.path.dirname(path) not in sys.path:  # (its helpers sit beside it: _cute_table, the files it imports)
        sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def requests(modules=MODULES):
    """Every distinct kernel the named test modules' GPU tests ask for, as (dtype, d, causal, kwargs), in order."""
    seen, out = set(), []
    for name in modules:
        for req in test_module(name).gpu_kernel_requests():
            args = kernel_args(**req)
            if args is None:
                continue
            key = (args[:3], tuple(sorted(args[3].items())))
            if key not in seen:
                seen.add(key)
                out.append(args)
    return out


def _build(out, dtype_name, d, causal, kwargs):
    import torch

    from flash_attn.cute import kernels

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    t0 = time.perf_counter()
    try:
        _, how = kernels.load_or_build(dtype, d, causal, "sm_90a", root=out, **kwargs)
    except Exception as e:  # one kernel's failure must not hide the others
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return how, time.perf_counter() - t0, None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--modules", default=",".join(MODULES), help="comma-separated test modules")
    p.add_argument("--list", action="store_true", help="print the kernels and exit")
    a = p.parse_args(argv)
    from flash_attn.cute import cache

    todo = requests([m for m in a.modules.split(",") if m])
    names = {torch_dtype: name for name, torch_dtype in _dtypes().items()}
    if a.list:
        for dtype, d, causal, kw in todo:
            print(names[dtype], d, "causal" if causal else "full", {k: v for k, v in kw.items() if v})
        print(f"{len(todo)} kernels")
        return 0
    out = cache.cache_dir()
    if out is None:
        p.error("set FLASH_ATTN_CUTE_CACHE to the folder to fill")
    args = [(out, names[dtype], d, causal, kw) for dtype, d, causal, kw in todo]
    t0 = time.perf_counter()
    if a.jobs > 1 and len(args) > 1:
        import multiprocessing

        with ProcessPoolExecutor(min(a.jobs, len(args)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_build, *zip(*args)))
    else:
        results = [_build(*x) for x in args]
    failed = 0
    for (_, dt, d, causal, kw), (how, seconds, error) in zip(args, results):
        failed += error is not None
        print(f"{dt} d{d} {'causal' if causal else 'full'} {({k: v for k, v in kw.items() if v})}: "
              f"{error or how} ({seconds:.1f} s)")
    print(f"{len(args) - failed}/{len(args)} kernels in {out} ({time.perf_counter() - t0:.0f} s)")
    return 1 if failed else 0


def _dtypes():
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}


if __name__ == "__main__":
    sys.exit(main())
