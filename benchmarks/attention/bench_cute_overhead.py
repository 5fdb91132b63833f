"""Dispatch cost of flash_attn.cute (the CuTeDSL backend), three numbers:

1. per call: flash_attn.cute.flash_attn_func on the tiny problem (b1 s128 h16 d128 bf16, non-causal),
   median over rounds of the wall time per call from Python, calls back to back with one synchronize
   per round (the project's per-call metric, as in bench_attention.py); also with a synchronize after
   every call (latency to the result), the Python path alone (the kernel swapped for a TVM-FFI no-op
   that takes the same arguments), and SDPA as a peer;
2. cold compile: the first call in a new process with an empty disk cache (CuTeDSL's own cache off);
3. warm disk: the first call in a new process whose disk cache holds the kernel.

    python -m benchmarks.attention.bench_cute_overhead          # on a Hopper GPU
    python -m benchmarks.attention.bench_cute_overhead --cpu    # no GPU: the Python path, compile and disk-load times

With --cpu, tensors live on the CPU, the device check is bypassed and the kernel is the TVM-FFI no-op,
so (1) is the Python-side cost without any launch, and (2)/(3) time getting the kernel (compile, or
load from disk) without running it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import common

B, S, H, D = 1, 128, 16, 128


def _inputs(device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(B, S, H, D, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3)]


def _sync(device):
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _per_call_us(fn, device, n, rounds, sync_each=False):
    return common.per_call_us(fn, n=n, rounds=rounds, warmup=20, device=device, sync_each=sync_each)


def _nop_kernel():
    """Swap every kernel of the in-memory table (kernels._kernels, the one dict the call paths read) for
    TVM-FFI's no-op: the call marshals the same torch tensors and float through TVM-FFI and returns without
    launching anything."""
    import tvm_ffi

    from flash_attn.cute import kernels

    nop = tvm_ffi.get_global_func("testing.nop")
    for key in list(kernels._kernels):
        kernels._kernels[key] = nop
    return nop


def _child(mode, device):
    """Runs in a fresh process (FLASH_ATTN_CUTE_CACHE set by the parent): time the first call."""
    t_start = time.perf_counter()
    import torch

    from flash_attn.cute import interface, kernels
    q, k, v = _inputs(device)
    _sync(device)  # CUDA context and inputs ready: not part of the first call
    t0 = time.perf_counter()
    if device == "cuda":
        interface.flash_attn_func(q, k, v)
    else:
        kernels.fwd_kernel(torch.bfloat16, D, False, "sm_90a")
    _sync(device)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    if device == "cuda":
        interface.flash_attn_func(q, k, v)
        _sync(device)
    second = time.perf_counter() - t1
    print(json.dumps({"first_s": first, "second_s": second, "process_s": time.perf_counter() - t_start,
                      "origin": kernels._origins.get((torch.bfloat16, D, False, "sm_90a")),
                      "cutlass_imported": "cutlass" in sys.modules}))


def _spawn(mode, device, cache, extra_env=None):
    env = dict(os.environ, FLASH_ATTN_CUTE_CACHE=cache, **(extra_env or {}))
    cmd = [sys.executable, "-m", "benchmarks.attention.bench_cute_overhead", "--child", mode] + (
        ["--cpu"] if device == "cpu" else [])
    proc = subprocess.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _old_path_us(n, rounds):
    """The launch arguments as flash_attn.cute built them before TVM-FFI: five from_dlpack wraps, a
    Float32 and a CUstream per call (CPU tensors; no launch)."""
    import cutlass
    from cuda.bindings import driver
    from cutlass.cute.runtime import from_dlpack

    import torch

    q, k, v = _inputs("cpu")
    lse = torch.empty(B, H, S)

    def build():
        [from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1) for t in (q, k, v, q, lse)]
        cutlass.Float32(0.1), driver.CUstream(0)

    return _per_call_us(build, "cpu", n, rounds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="no GPU: Python path, compile and load times only")
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-cold", action="store_true", help="skip the cold compile (the warm-disk run then "
                   "uses the default cache folder as it is)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    device = "cpu" if a.cpu else "cuda"
    if a.child:
        return _child(a.child, device)

    import torch

    from flash_attn.cute import cache, interface, kernels, launch
    print(f"torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU (--cpu: no launch)'}, "
          f"versions {json.dumps(cache.environment())}")
    print(f"problem: b{B} s{S} h{H} d{D} bf16 non-causal; {a.rounds} rounds x {a.calls} calls, median")

    # 2 and 3: new processes against a fresh cache folder (cold), then the same folder (warm).
    with tempfile.TemporaryDirectory(prefix="fa4_cache_") as tmp:
        folder = tmp if not a.no_cold else str(cache.cache_dir() or tmp)
        if not a.no_cold:
            cold = _spawn("cold", device, folder, {"CUTE_DSL_NO_CACHE": "1"})
            print(f"cold compile, first call in a new process: {cold['first_s']:.2f} s "
                  f"(kernel from: {cold['origin']})")
        warm = _spawn("warm", device, folder)
        print(f"warm disk cache, first call in a new process: {warm['first_s'] * 1e3:.1f} ms "
              f"(kernel from: {warm['origin']}, CuTeDSL compiler imported: {warm['cutlass_imported']})"
              + (f"; second call {warm['second_s'] * 1e6:.0f} us" if device == "cuda" else ""))
        common.set_environ({cache.ENV_VAR: folder})  # (flash_attn.cute reads its settings again)

        # 1: per call, in this process (the kernel is in memory after the first call)
        q, k, v = _inputs(device)
        if device == "cuda":
            f = interface.flash_attn_func
            kernels.fwd_kernel(torch.bfloat16, D, False, launch._device_arch(q, k, v))
            us = _per_call_us(lambda: f(q, k, v), device, a.calls, a.rounds)
            print(f"flash_attn.cute.flash_attn_func per call: {us:.1f} us (back to back)")
            us_sync = _per_call_us(lambda: f(q, k, v), device, max(a.calls // 10, 50), a.rounds, sync_each=True)
            print(f"  with a synchronize after each call: {us_sync:.1f} us")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            print(f"  peer, SDPA per call: {_per_call_us(lambda: sdpa(qt, kt, vt), device, a.calls, a.rounds):.1f} us")
        else:
            # CPU tensors pass the device check (the name flash_attn_func looks up)
            interface._device_arch = lambda q, k, v: "sm_90a"
            kernels.fwd_kernel(torch.bfloat16, D, False, "sm_90a")  # loads from the warm folder
            # the tiny call's key length takes the short-key kernel's entry (seqlen_k <= config.SHORT_SK)
            kernels.fwd_kernel(torch.bfloat16, D, False, "sm_90a", short=True)
            f = interface.flash_attn_func
        _nop_kernel()
        us_py = _per_call_us(lambda: f(q, k, v), device, a.calls, a.rounds)
        print(f"Python path alone (kernel = TVM-FFI no-op, {device} tensors): {us_py:.2f} us per call")
        if device == "cpu":
            print(f"  for comparison, the former launch arguments (from_dlpack x5, Float32, CUstream): "
                  f"{_old_path_us(max(a.calls // 10, 50), a.rounds):.1f} us per call")


if __name__ == "__main__":
    main()
