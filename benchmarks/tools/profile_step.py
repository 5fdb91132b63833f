"""Where the GPU time of a step goes: torch.profiler's per-kernel table (self CUDA time, sorted) for

  train   one GPT-2-medium training step of bench_train.py (ours: GPTLMHeadModel through the Trainer)
  norm    LayerNorm / RMSNorm forward, backward and forward+backward as bench_ops.py times them

    python -m benchmarks.tools.profile_step train [--compile] [bench_train.py shape flags]
    python -m benchmarks.tools.profile_step norm --hidden 4096

Prints the tables (no files): the GPU-busy total against the wall time of the profiled region shows how
much of a step is host-bound, the kernel rows show which kernels a speed-up has to come from.
"""
import argparse
import sys
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def report(prof, wall_s, label, steps, rows=35, plain_ms=None):
    # GPU-side rows only (kernels, memcpy/memset): CPU ops carry their kernels' time too, and user
    # annotations (e.g. "Optimizer.step#AdamW.step") span kernels that are already counted.
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA
              and not getattr(e, "is_user_annotation", False) and e.time_range.end > e.time_range.start]
    busy_us = sum(e.time_range.end - e.time_range.start for e in events)
    # Kernels of one stream do not overlap, so the union of their intervals against the span from the
    # first kernel's start to the last one's end is the time the GPU sat idle waiting for the host.
    span_us = idle_us = 0.0
    if events:
        events.sort(key=lambda e: e.time_range.start)
        end = events[0].time_range.start
        for e in events:
            if e.time_range.start > end:
                idle_us += e.time_range.start - end
            end = max(end, e.time_range.end)
        span_us = end - events[0].time_range.start
    plain = f"; unprofiled {plain_ms:.2f} ms per step" if plain_ms is not None else ""
    print(f"\n## {label}: wall {1e3 * wall_s / steps:.2f} ms per step (profiled){plain}, GPU kernels "
          f"{busy_us / 1e3 / steps:.2f} ms per step, GPU idle between kernels {idle_us / 1e3 / steps:.2f} ms per "
          f"step of a {span_us / 1e3 / steps:.2f} ms span")
    by_key = {}
    for e in events:
        n, t = by_key.get(e.name, (0, 0.0))
        by_key[e.name] = (n + 1, t + e.time_range.end - e.time_range.start)
    print("| kernel | calls/step | ms/step | share |\n|---|---:|---:|---:|")
    for name, (n, t) in sorted(by_key.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"| {name[:90]} | {n / steps:.0f} | {t / 1e3 / steps:.3f} | {100 * t / busy_us:.1f}% |")


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
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    report(prof, wall, label, steps, plain_ms=plain_ms)


def train(argv):
    from benchmarks.training import bench_train as bt
    from flash_attn.training.trainer import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true")
    p.add_argument("--cuda-graph", action="store_true", help="the step as CUDA graphs (train.cuda_graph)")
    p.add_argument("--steps", type=int, default=3)
    args, rest = p.parse_known_args(argv)
    shape = argparse.Namespace(device="cuda", layers=24, hidden=1024, heads=16, seq=2048, batch=8, vocab=50257,
                               steps=args.steps, warmup=3, activation_checkpointing=False)
    for flag in rest:  # --name=value shape overrides, e.g. --batch=4
        name, value = flag.lstrip("-").split("=")
        setattr(shape, name.replace("-", "_"), type(getattr(shape, name.replace("-", "_")))(value))
    with tempfile.TemporaryDirectory() as out:
        cfg = bt.make_config(shape, out, ours=True, compile=args.compile, graph=args.cuda_graph)
        trainer = Trainer(cfg)
        for _ in range(3):
            trainer.train_step()
        profiled(lambda: float(trainer.train_step()[0]), args.steps,
                 f"GPT-2 train step ({'compiled' if args.compile else 'CUDA graphs' if args.cuda_graph else 'eager'})")


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
