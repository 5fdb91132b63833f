"""Host-path cost per call of flash_attn.cute.flash_attn_func on the CPU: the Python work of a call with the kernel
replaced by a Python no-op (CPU tensors, the device check bypassed), b1 s128 h16 d128 bf16. For comparing the
per-call path before and after a change to the package (run it on both checkouts, alternating, on a quiet machine;
the GPU per-call figure is bench_cute_overhead's).

    python -m benchmarks.tools.percall_host_cpu [--rounds 15] [--calls 2000]
"""
import argparse
import time

import torch


def _stub_kernels():
    from flash_attn.cute import interface, kernels, launch

    def nop(*args):
        return None

    for causal in (False, True):
        for local in (False, True):
            for extra in ((), ("short",), ("long",)):
                kernels._kernels[(torch.bfloat16, 128, causal, "sm_90a", local, False) + extra] = nop
    interface._device_arch = launch._device_arch = lambda q, k, v: "sm_90a"
    return interface.flash_attn_func


def measure(rounds=15, calls=2000):
    """{"common": us, "windowed": us}: the fastest round's time per call of the common call and of a windowed one."""
    f = _stub_kernels()
    q, k, v = (torch.randn(1, 128, 16, 128, dtype=torch.bfloat16) for _ in range(3))
    cases = {"common": {}, "windowed": {"causal": True, "window_size": (64, 0)}}
    out = {}
    for name, kw in cases.items():
        for _ in range(calls):  # warm: the plan's caches
            f(q, k, v, **kw)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                f(q, k, v, **kw)
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        out[name] = best
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args(argv)
    res = measure(a.rounds, a.calls)
    print(" ".join(f"{k} call {v:.2f} us" for k, v in res.items()))


if __name__ == "__main__":
    main()
