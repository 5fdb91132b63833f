"""Where the GPU time of a step goes: torch.profiler's per-kernel table (self CUDA time, sorted) for

  train   one GPT-2-medium training step of bench_train.py (ours: GPTLMHeadModel through the Trainer)
  norm    LayerNorm / RMSNorm forward, backward and forward+backward as bench_ops.py times them

    python benchmarks/profile_step.py train [--compile] [bench_train.py shape flags]
    python benchmarks/profile_step.py norm --hidden 4096

Prints the tables (no files): the GPU-busy total against the wall time of the profiled region shows how
much of a step is host-bound, the kernel rows show which kernels a speed-up has to come from.
"""
import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def report(prof, wall_s, label, steps, rows=35):
    # Only the GPU-side rows (kernels, memcpy/memset): CPU ops carry their kernels' time too.
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    busy_us = sum(e.self_device_time_total for e in events)
    print(f"\n## {label}: wall {1e3 * wall_s / steps:.2f} ms per step, GPU kernels {busy_us / 1e3 / steps:.2f} ms "
          f"per step ({100 * busy_us / 1e6 / wall_s:.0f}% busy)")
    events.sort(key=lambda e: -e.self_device_time_total)
    print("| kernel | calls/step | ms/step | share |\n|---|---:|---:|---:|")
    for e in events[:rows]:
        print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.self_device_time_total / 1e3 / steps:.3f} | "
              f"{100 * e.self_device_time_total / busy_us:.1f}% |")


def host_us(fn, calls=200):
    """Microseconds per call of fn back to back (after 20 warm-up calls), one synchronize at the end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profiled(fn, steps, label):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    report(prof, wall, label, steps)


def train(argv):
    import bench_train as bt
    from flash_attn.training.trainer import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    args, rest = p.parse_known_args(argv)
    shape = argparse.Namespace(device="cuda", layers=24, hidden=1024, heads=16, seq=2048, batch=8, vocab=50257,
                               steps=args.steps, warmup=3, activation_checkpointing=False)
    for flag in rest:  # --name=value shape overrides, e.g. --batch=4
        name, value = flag.lstrip("-").split("=")
        setattr(shape, name.replace("-", "_"), type(getattr(shape, name.replace("-", "_")))(value))
    with tempfile.TemporaryDirectory() as out:
        cfg = bt.make_config(shape, out, ours=True, compile=args.compile)
        trainer = Trainer(cfg)
        for _ in range(3):
            trainer.train_step()
        profiled(lambda: float(trainer.train_step()[0]), args.steps,
                 f"GPT-2 train step ({'compiled' if args.compile else 'eager'})")


def norm(argv):
    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import layer_norm as ln

    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--elems", type=int, default=1 << 28)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    N, M = args.hidden, args.elems // args.hidden
    for is_rms in (False, True):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = None if is_rms else torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        params = [t for t in (x, w, b) if t is not None]
        name = "RMSNorm" if is_rms else "LayerNorm"
        with backend("triton"):
            y = ln.layer_norm_fn(x, w, b, eps=1e-6, is_rms_norm=is_rms)
            profiled(lambda: ln.layer_norm_fn(x, w, b, eps=1e-6, is_rms_norm=is_rms), args.steps, f"{name} {N} fwd")
            profiled(lambda: torch.autograd.grad(y, params, dy, retain_graph=True), args.steps, f"{name} {N} bwd")
            profiled(lambda: torch.autograd.grad(ln.layer_norm_fn(x, w, b, eps=1e-6, is_rms_norm=is_rms), params, dy),
                     args.steps, f"{name} {N} fwd+bwd")
        # Host cost: the same calls on 8 rows (GPU work ~nothing), back to back; if it exceeds the kernels'
        # time at full size, the GPU waits for Python.
        xs, dys = x[:8].detach().requires_grad_(), dy[:8]
        ps = [xs] + params[1:]
        for label, fn in (("fwd", lambda: ln.layer_norm_fn(xs, w, b, eps=1e-6, is_rms_norm=is_rms)),
                          ("fwd+bwd", lambda: torch.autograd.grad(
                              ln.layer_norm_fn(xs, w, b, eps=1e-6, is_rms_norm=is_rms), ps, dys))):
            with backend("triton"):
                print(f"{name} host time per {label} call (8 rows): {host_us(fn):.1f} us")
        x = w = b = dy = y = params = xs = dys = ps = None


def host(argv):
    """cProfile of 200 LayerNorm forward+backward calls on 8 rows (host time only; no torch.profiler in
    this process, which would add its own hooks)."""
    import cProfile
    import pstats

    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import layer_norm as ln

    N = int(argv[0]) if argv else 4096
    x = torch.randn(8, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def fwd_bwd():
        return torch.autograd.grad(ln.layer_norm_fn(x, w, b, eps=1e-6), (x, w, b), dy)

    with backend("triton"):
        print(f"host time per LayerNorm fwd+bwd call (8 rows, N={N}): {host_us(fwd_bwd):.1f} us")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fwd_bwd()
        torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    {"train": train, "norm": norm, "host": host}[mode](rest)
