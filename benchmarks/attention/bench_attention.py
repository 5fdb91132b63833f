"""Attention benchmark: our backends against PyTorch SDPA (cuDNN and flash) and, optionally, the released
flash-attn-4, all measured in the same run.

Grid (FlashAttention's standard one): bf16, batch x seqlen = 16k tokens, hidden 2048 (heads = 2048 /
head dim), head dims 64/128/256, seqlen 512..16k, causal and not. Times are medians of
triton.testing.do_bench; FLOPs are counted as FlashAttention counts them: fwd = 4 * B * S^2 * H * D
(half if causal), bwd = 2.5 x fwd, fwd+bwd = 3.5 x fwd. Also reports the per-call time of a tiny problem
(b1 s128 h16 d128 forward) from Python, which is launch overhead.

    python -m benchmarks.attention.bench_attention                                   # full grid
    python -m benchmarks.attention.bench_attention --headdims 128 --seqlens 2048,8192 --causal 0   # quick
    python -m benchmarks.attention.bench_attention --peer-pythonpath "$PEER_PYTHONPATH"   # + released FA4
    python -m benchmarks.attention.bench_attention --tune --headdims 128 --seqlens 4096  # Triton config sweep

Writes <out>/attention.md (table with GPU, versions, date, command) and <out>/attention.png.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time

from benchmarks import common
from flash_attn.testing import backend_bwd, backend_fwd

MODULE = "benchmarks.attention.bench_attention"
TINY = dict(batch=1, seqlen=128, heads=16, head_dim=128)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="triton,cute", help="our backends to measure (flash_attn.use_backend)")
    p.add_argument("--headdims", type=common.ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=common.ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", type=common.bools, default=[False, True], help="e.g. 0,1 or true")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head dim")
    p.add_argument("--no-sdpa", action="store_true", help="skip the PyTorch SDPA peers")
    p.add_argument("--peer-pythonpath", default=None,
                   help="PYTHONPATH of the released flash-attn-4, measured in a separate process")
    p.add_argument("--out", default=common.results_dir())
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--tune", action="store_true", help="sweep Triton launch configs instead of the grid")
    p.add_argument("--configs", default=None,
                   help="JSON of Triton launch configs (as written by --tune) to use instead of the built-in table")
    p.add_argument("--launch-breakdown", action="store_true",
                   help="only time the pieces of the Triton launch path on the tiny problem")
    p.add_argument("--compile-only", action="store_true",
                   help="with --tune: only compile the candidates (fills Triton's cache; no timing)")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes compiling Triton kernels ahead of timing")
    p.add_argument("--_peer-worker", dest="peer_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_compile-worker", dest="compile_worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def shapes(args):
    for d in args.headdims:
        for causal in args.causal:
            for s in args.seqlens:
                yield d, s, causal, max(1, args.tokens // s), max(1, args.hidden // d)


def flops(kind, b, s, h, d, causal):
    f = 4 * b * s * s * h * d / (2 if causal else 1)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[kind]


# ----------------------------------------------------------------------------------------------------
# Providers: each is make(causal) -> attention(q, k, v) on (B, S, H, D) tensors, differentiable, plus a
# context manager that the backward must also run in.


def _ours(name):
    import flash_attn

    if hasattr(flash_attn, "use_backend") or "use_backend" in dir(flash_attn):
        try:
            from flash_attn import dispatch
            why = dispatch.unavailable_reason(name)
        except Exception as e:  # the dispatcher itself failed to import
            why = f"dispatcher unavailable: {e}"
        if why is not None:
            return None, why

        def make(causal):
            return lambda q, k, v: flash_attn.flash_attn_func(q, k, v, causal=causal)
        return (make, lambda: flash_attn.use_backend(name)), None
    # Fallback before flash_attn.use_backend existed: drive the backend module directly.
    if name != "triton":
        return None, "flash_attn.use_backend missing; only the triton fallback path exists"
    from flash_attn.triton import backend as tb

    class _Fn(__import__("torch").autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal):
            kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
                      block_table=None, softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_left=-1,
                      window_right=0 if causal else -1, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                      rng_state=None)
            out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.kw = kw
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            return (*backend_bwd(tb, dout.contiguous(), q, k, v, out, lse, deterministic=False, **ctx.kw), None)

    def make(causal):
        return lambda q, k, v: _Fn.apply(q, k, v, causal)
    return (make, contextlib.nullcontext), None


def _sdpa(backend_name):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = getattr(SDPBackend, backend_name)

    def make(causal):
        # (B, S, H, D) -> (B, H, S, D) views, as a model calling SDPA on the same activations would
        def fn(q, k, v):
            return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
        return fn
    return (make, lambda: sdpa_kernel(backend)), None


def providers(args):
    found, notes = [], []
    for name in [b for b in args.backends.split(",") if b]:
        prov, why = _ours(name)
        if prov is None:
            notes.append(f"{name}: skipped ({why})")
        else:
            found.append((f"ours:{name}", *prov))
    if not args.no_sdpa:
        for label, be in (("sdpa:cudnn", "CUDNN_ATTENTION"), ("sdpa:flash", "FLASH_ATTENTION")):
            prov, _ = _sdpa(be)
            found.append((label, *prov))
    return found, notes


# ----------------------------------------------------------------------------------------------------
# Timing


def _inputs(b, s, h, d, dtype=None, seed=0):
    import torch

    dtype = dtype or torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    return q, k, v


def time_fwd_bwd(fn, ctx, q, k, v, warmup, rep):
    """Median ms of forward, backward and forward+backward (None where the provider raised)."""
    import torch
    from triton.testing import do_bench

    res = {}
    with ctx():
        try:
            fn(q, k, v)
            res["fwd"] = do_bench(lambda: fn(q, k, v), warmup=warmup, rep=rep, return_mode="median")
            out = fn(q, k, v)
            g = torch.randn_like(out)
            out.backward(g, retain_graph=True)
            res["bwd"] = do_bench(lambda: out.backward(g, retain_graph=True), warmup=warmup, rep=rep,
                                  grad_to_none=[q, k, v], return_mode="median")
            res["fwd_bwd"] = do_bench(lambda: fn(q, k, v).backward(g), warmup=warmup, rep=rep,
                                      grad_to_none=[q, k, v], return_mode="median")
        except Exception as e:  # a peer that does not support a shape must not stop the run
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        finally:
            q.grad = k.grad = v.grad = None
    return res


def per_call_us(fn, ctx, requires_grad=False, n=200, rounds=5):
    """Median over rounds of the wall time per forward call of the tiny problem, from Python (the GPU
    work is a few microseconds, so this is the launch path's cost)."""
    q, k, v = (t.detach().requires_grad_(requires_grad)
               for t in _inputs(TINY["batch"], TINY["seqlen"], TINY["heads"], TINY["head_dim"]))
    with ctx():
        return common.per_call_us(lambda: fn(q, k, v), n=n, rounds=rounds, warmup=20)


def launch_breakdown(args):
    """Where the per-call time of the tiny problem goes on the Triton path: public API (with and without
    autograd), the backend's fwd, the bare kernel launch, and Triton's argument binder alone."""
    import torch

    import flash_attn
    from flash_attn.triton import _fwd, backend as tb

    q, k, v = _inputs(TINY["batch"], TINY["seqlen"], TINY["heads"], TINY["head_dim"])
    q, k, v = (t.detach() for t in (q, k, v))
    kw = _triton_kwargs(q, k, False)
    out, lse, probs = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    block_m, _, meta = next(iter(tb._FWD_PLANS.values()))
    B, S, H, D = q.shape
    launch_args = (q, k, v, out, lse, probs, lse, lse, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                   *out.stride()[:3], lse.stride(0), lse.stride(1), 0, 0, 0, 0, 0, S, S, H, 1,
                   kw["softmax_scale"] * 1.4426950408889634, 0.0, 0.0, 1 << 30, 1 << 30, 0, 0, 0, 1.0)
    grid = (-(-S // block_m), B * H)
    kern = _fwd._attn_fwd_kernel
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    launcher = tb._L_FWD
    plan_key = next(iter(tb._FWD_PLANS.values()))[1]
    cases = {
        "flash_attn_func, inputs requiring grad": lambda: flash_attn.flash_attn_func(qg, kg, vg),
        "flash_attn_func, no grad": lambda: flash_attn.flash_attn_func(q, k, v),
        "backend.fwd": lambda: backend_fwd(tb, q, k, v, return_probs=False, **kw),
        "Launcher (cached compiled kernel)": lambda: launcher(grid, launch_args, meta, plan_key),
        "kernel[grid](...) only (Triton's own path)": lambda: kern[grid](*launch_args, **meta),
        "out/lse/probs allocations": lambda: (q.new_empty(B, S, H, D), torch.empty(B, H, S, device=q.device,
                                                                                   dtype=torch.float32),
                                              lse.new_empty(0)),
    }
    launcher(grid, launch_args, meta, plan_key)
    layout = launcher.layouts.get(plan_key) if launcher.enabled else None
    entry = None
    if layout is not None:
        from flash_attn.triton import _launch
        ptrs, key = _launch.spec_key(layout, launch_args)
        entry = launcher.cache.get((plan_key, torch.cuda.current_device(), key))
        cases["  of which the cache key"] = lambda: _launch.spec_key(layout, launch_args)
    if entry is not None:
        run, function, packed, tail = entry
        stream = _launch._current_stream
        scalars = launch_args[layout.n_ptr:]
        cases["  of which CompiledKernel.run (Triton's C launcher)"] = lambda: run(
            grid[0], grid[1], 1, stream(torch.cuda.current_device()), function, packed, None, None, None, *ptrs,
            *scalars, *tail)
    print(f"fast relaunch: {'on' if entry is not None else 'OFF (Triton path on every call)'}; "
          f"triton {__import__('triton').__version__}, torch {torch.__version__}", flush=True)
    if hasattr(kern, "device_caches"):
        binder = kern.device_caches[torch.cuda.current_device()][-1]
        cases["Triton binder alone"] = lambda: binder(*launch_args, **meta)
    res = {}
    with flash_attn.use_backend("triton"):
        for name, fn in cases.items():
            slow0 = launcher.slow_launches
            res[name] = common.per_call_us(fn, n=200, rounds=5, warmup=50)
            slow = launcher.slow_launches - slow0
            print(f"{name}: {res[name]:.1f} us" + (f" ({slow} of 1000 forward launches took Triton's path)"
                                                   if slow else ""), flush=True)
        # A mid-size problem where per-call host time and GPU time are of the same order.
        from triton.testing import do_bench
        q, k, v = _inputs(8, 2048, 32, 64)
        kw = _triton_kwargs(q, k, True)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        for name, fn in {"b8 s2048 h32 d64 causal: backend.fwd": lambda: backend_fwd(tb, qd, kd, vd, return_probs=False, **kw),
                         "... flash_attn_func, no grad": lambda: flash_attn.flash_attn_func(qd, kd, vd, causal=True),
                         "... flash_attn_func, requiring grad": lambda: flash_attn.flash_attn_func(q, k, v, causal=True)
                         }.items():
            fn()
            ms = do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")
            res[name] = ms * 1e3
            print(f"{name}: {ms * 1e3:.1f} us", flush=True)
    return res


def _backend_direct(name):
    """The backend module's fwd called directly: the launcher's own share of the per-call time."""
    import importlib

    mod = importlib.import_module(f"flash_attn.{name}.backend")
    kwargs = {}

    def fn(q, k, v):
        kw = kwargs.get((q.shape, k.shape))  # built once: the dict is not the backend's cost
        if kw is None:
            kw = kwargs[(q.shape, k.shape)] = _triton_kwargs(q, k, False)
        return backend_fwd(mod, q, k, v, return_probs=False, **kw)[0]
    return fn


# ----------------------------------------------------------------------------------------------------
# Compiling Triton kernels ahead of timing, in parallel processes (they land in Triton's disk cache)


def precompile(args, jobs_spec):
    """Run compile workers over jobs_spec (a list of JSON-able dicts) in args.jobs processes."""
    if not jobs_spec or args.jobs <= 1:
        return
    n = min(args.jobs, len(jobs_spec))
    procs = []
    for i in range(n):
        part = jobs_spec[i::n]
        cmd = [sys.executable, "-m", MODULE, "--_compile-worker", json.dumps(part)]
        procs.append(subprocess.Popen(cmd, cwd=common.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            print(f"[precompile worker failed]\n{err[-2000:]}", file=sys.stderr)


def compile_worker(spec):
    """Run each (head dim, causal, fwd config, bwd config) once on a small problem."""
    import torch
    from flash_attn.triton import _configs, backend as tb

    for job in json.loads(spec):
        d, causal = job["d"], job["causal"]
        q, k, v = _inputs(1, 256, 2, d)
        kw = _triton_kwargs(q, k, causal)
        fc = _configs.FwdConfig(*job["fwd"]) if job.get("fwd") else None
        bc = _configs.BwdConfig(*job["bwd"]) if job.get("bwd") else None
        with torch.no_grad():
            out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, config=fc, **kw)
            if job.get("with_bwd", True):
                for det in job.get("det", [False]):
                    backend_bwd(tb, torch.ones_like(out), q, k, v, out, lse, deterministic=det, config=bc, **kw)
    torch.cuda.synchronize()


def _triton_kwargs(q, k, causal):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
                block_table=None, softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_left=-1,
                window_right=0 if causal else -1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)


# ----------------------------------------------------------------------------------------------------
# Peer: the released flash-attn-4, in its own process (its import name is also flash_attn.cute)


def peer_worker(args):
    import torch
    from flash_attn.cute import flash_attn_func

    def make(causal):
        return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)[0]

    for d, s, causal, b, h in shapes(args):
        q, k, v = _inputs(b, s, h, d)
        res = time_fwd_bwd(make(causal), contextlib.nullcontext, q, k, v, args.warmup, args.rep)
        print(json.dumps(dict(d=d, s=s, causal=causal, **res)), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    lat = per_call_us(make(False), contextlib.nullcontext)
    print(json.dumps(dict(latency_us=lat)), flush=True)


def run_peer(args, argv):
    env = dict(os.environ)
    env["PYTHONPATH"] = args.peer_pythonpath
    cmd = [sys.executable, "-m", MODULE, "--_peer-worker", "--headdims",
           ",".join(map(str, args.headdims)), "--seqlens", ",".join(map(str, args.seqlens)), "--causal",
           ",".join("1" if c else "0" for c in args.causal), "--tokens", str(args.tokens), "--hidden",
           str(args.hidden), "--warmup", str(args.warmup), "--rep", str(args.rep)]
    # run from a folder without a flash_attn package so the peer's is the one imported
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=common.peer_cwd())
    results, latency = {}, None
    for line in r.stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "latency_us" in rec:
            latency = rec["latency_us"]
        else:
            results[(rec.pop("d"), rec.pop("s"), rec.pop("causal"))] = rec
    note = None
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else ""
        note = f"fa4 peer process failed (rc {r.returncode}): {last}"
    return results, latency, note


# ----------------------------------------------------------------------------------------------------
# Report


def _tflops(ms, kind, b, s, h, d, causal):
    return flops(kind, b, s, h, d, causal) / (ms * 1e-3) / 1e12 if ms else None


def write_report(args, argv, labels, results, latency, notes):
    os.makedirs(args.out, exist_ok=True)
    lines = [
        "# Attention benchmark",
        "",
        *common.header(MODULE, argv, dists=("nvidia-cutlass-dsl",),
                       hide={args.peer_pythonpath: "$PEER_PYTHONPATH"}),
        f"- bf16, batch x seqlen = {args.tokens} tokens, hidden {args.hidden}; TFLOP/s from do_bench medians; "
        "fwd = 4·B·S²·H·D (half if causal), bwd = 2.5 × fwd",
        "",
    ]
    for note in notes:
        lines.append(f"- note: {note}")
    if notes:
        lines.append("")
    for kind in ("fwd", "bwd", "fwd_bwd"):
        lines += [f"## {kind} TFLOP/s", "", "| head dim | causal | seqlen | batch | " + " | ".join(labels) + " |",
                  "|---|---|---|---|" + "---|" * len(labels)]
        for d, s, causal, b, h in shapes(args):
            row = []
            for lab in labels:
                r = results.get((lab, d, s, causal), {})
                t = _tflops(r.get(kind), kind, b, s, h, d, causal)
                row.append(f"{t:.0f}" if t else ("err" if "error" in r else "-"))
            lines.append(f"| {d} | {causal} | {s} | {b} | " + " | ".join(row) + " |")
        lines.append("")
    ours = [lab for lab in labels if lab.startswith("ours:")]
    if ours and "sdpa:cudnn" in labels:
        lines += ["## Ratio to cuDNN SDPA (targets: fwd >= 0.85, bwd >= 0.75 at seqlen >= 2k)", "",
                  "| head dim | causal | seqlen | " + " | ".join(f"{lab} fwd | {lab} bwd" for lab in ours) + " |",
                  "|---|---|---|" + "---|---|" * len(ours)]
        for d, s, causal, b, h in shapes(args):
            ref = results.get(("sdpa:cudnn", d, s, causal), {})
            row = []
            for lab in ours:
                r = results.get((lab, d, s, causal), {})
                for kind in ("fwd", "bwd"):
                    row.append(f"{ref[kind] / r[kind]:.2f}" if r.get(kind) and ref.get(kind) else "-")
            lines.append(f"| {d} | {causal} | {s} | " + " | ".join(row) + " |")
        lines.append("")
    if latency:
        lines += ["## Per-call time of a tiny problem (b1 s128 h16 d128 forward, from Python)", "",
                  "| provider | us per call | us per call, inputs requiring grad |", "|---|---|---|"]
        lines += [f"| {lab} | {a:.1f} | {'-' if b is None else f'{b:.1f}'} |" for lab, (a, b) in latency.items()]
        lines.append("")
    errors = [(k, r["error"]) for k, r in results.items() if "error" in r]
    if errors:
        lines += ["## Errors", ""] + [f"- {k}: {e}" for k, e in errors[:20]] + [""]
    path = os.path.join(args.out, "attention.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {path}")
    plot(args, labels, results)


def plot(args, labels, results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    combos = [(d, c) for d in args.headdims for c in args.causal]
    fig, axes = plt.subplots(2, len(combos), figsize=(4.2 * len(combos), 7), squeeze=False)
    for col, (d, causal) in enumerate(combos):
        for row, kind in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            for lab in labels:
                xs, ys = [], []
                for s in args.seqlens:
                    r = results.get((lab, d, s, causal), {})
                    b, h = max(1, args.tokens // s), max(1, args.hidden // d)
                    t = _tflops(r.get(kind), kind, b, s, h, d, causal)
                    if t:
                        xs.append(s)
                        ys.append(t)
                if xs:
                    ax.plot(xs, ys, marker="o", label=lab)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{kind} d{d} {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(args.out, "attention.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------------
# Triton config sweep


# Candidates kept to those that compile without register spills on sm_90 (checked ahead of time with
# triton.compile(..., target=GPUTarget("cuda", 90, 32)) and cuobjdump --dump-resource-usage).
def _fwd_candidates(d):
    if d <= 64:
        return [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3)]
    if d <= 128:
        return [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4)]
    return [(128, 64, 8, 2), (128, 32, 8, 3)]


def _dkdv_candidates(d):
    # (block_m, block_n, warps, stages) of the dK/dV kernel
    if d <= 64:
        return [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 3)]
    if d <= 128:
        return [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 2)]
    return [(32, 32, 4, 2), (32, 64, 8, 2), (64, 64, 8, 2), (32, 64, 8, 1)]


def _dq_candidates(d):
    # (block_m, block_n, warps, stages) of the deterministic dQ kernel
    if d <= 64:
        return [(64, 64, 4, 2), (128, 64, 8, 2)]
    if d <= 128:
        return [(128, 64, 8, 2), (128, 64, 8, 3)]
    return [(128, 32, 8, 2), (64, 64, 8, 2)]


def _bwd_candidates(d):
    """(kind, BwdConfig fields): atomic-dQ variants over dK/dV configs, then separate-dQ variants."""
    dq0 = _dq_candidates(d)[0]
    out = [("bwd-atomic", (*kv, *dq0, True)) for kv in _dkdv_candidates(d)]
    for kv in _dkdv_candidates(d)[:2]:
        for dq in _dq_candidates(d):
            out.append(("bwd-split", (*kv, *dq, False)))
    return out


def best_configs(rows_by_shape):
    """{"d,causal": {"fwd": FwdConfig fields, "bwd": BwdConfig fields}} from the fastest candidates; the
    deterministic dQ kernel takes the dQ config of the fastest separate-dQ candidate."""
    best = {}
    for (d, causal), rows in rows_by_shape.items():
        timed = [r for r in rows if isinstance(r[2], float)]
        fwd = max((r for r in timed if r[0] == "fwd"), key=lambda r: r[2], default=None)
        bwd = max((r for r in timed if r[0] != "fwd"), key=lambda r: r[2], default=None)
        split = max((r for r in timed if r[0] == "bwd-split"), key=lambda r: r[2], default=None)
        if fwd is None or bwd is None or split is None:
            continue
        best[f"{d},{int(causal)}"] = dict(fwd=list(fwd[1]), bwd=[*bwd[1][:4], *split[1][4:8], bwd[1][8]])
    return best


def apply_configs(path):
    """Install configs from a --tune JSON into the Triton backend's tables (this process)."""
    import torch

    from flash_attn.triton import _configs, backend as tb

    with open(path) as f:
        table = json.load(f)
    major = torch.cuda.get_device_capability()[0]
    for key, cfg in table.items():
        d, causal = (int(x) for x in key.split(","))
        _configs._FWD[(major, d, bool(causal))] = _configs.FwdConfig(*cfg["fwd"])
        _configs._BWD[(major, d, bool(causal))] = _configs.BwdConfig(*cfg["bwd"])
    _configs.fwd_config.cache_clear()
    _configs.bwd_config.cache_clear()
    tb._FWD_PLANS.clear()


def tune(args):
    """Time every candidate config of the Triton kernels; results (and max |diff| to cuDNN SDPA, a sanity
    check that each variant computes the same thing) go to <out>/tune.txt."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from triton.testing import do_bench

    from flash_attn.triton import _configs, backend as tb

    jobs = []
    for d in args.headdims:
        for causal in args.causal:
            jobs += [dict(d=d, causal=causal, fwd=fc, with_bwd=False) for fc in _fwd_candidates(d)]
            jobs += [dict(d=d, causal=causal, fwd=None, bwd=bc, det=[not bc[-1]]) for _, bc in _bwd_candidates(d)]
    t0 = time.time()
    precompile(args, jobs)
    print(f"precompiled {len(jobs)} variants in {time.time() - t0:.0f}s", flush=True)
    if args.compile_only:
        return
    lines = []
    rows_by_shape = {}
    for d, s, causal, b, h in shapes(args):
        q, k, v = _inputs(b, s, h, d)
        kw = _triton_kwargs(q, k, causal)
        g = torch.randn_like(q)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = sdpa(qt, kt, vt, is_causal=causal)
            ref_dq = torch.autograd.grad(ref, qt, g.transpose(1, 2))[0].transpose(1, 2)
        ref = ref.transpose(1, 2)
        out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
        rows = []
        for fc in _fwd_candidates(d):
            cfg = _configs.FwdConfig(*fc)
            try:
                o = backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **kw)[0]
                err = (o.float() - ref.float()).abs().max().item()
                ms = do_bench(lambda: backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **kw), warmup=args.warmup,
                              rep=args.rep, return_mode="median")
                rows.append(("fwd", fc, _tflops(ms, "fwd", b, s, h, d, causal), err))
            except Exception as e:
                rows.append(("fwd", fc, f"error {type(e).__name__}: {str(e)[:80]}", None))
        for kind, bc in _bwd_candidates(d):
            cfg = _configs.BwdConfig(*bc)
            det = not cfg.dq_atomic
            try:
                dq = backend_bwd(tb, g, q, k, v, out, lse, deterministic=det, config=cfg, **kw)[0]
                err = (dq.float() - ref_dq.float()).abs().max().item()
                ms = do_bench(lambda: backend_bwd(tb, g, q, k, v, out, lse, deterministic=det, config=cfg, **kw),
                              warmup=args.warmup, rep=args.rep, return_mode="median")
                rows.append((kind, bc, _tflops(ms, "bwd", b, s, h, d, causal), err))
            except Exception as e:
                rows.append((kind, bc, f"error {type(e).__name__}: {str(e)[:80]}", None))
        rows_by_shape.setdefault((d, causal), []).extend(rows)
        for kind, cfg, t, err in rows:
            line = (f"d={d} s={s} causal={causal} {kind} {cfg}: "
                    + (f"{t:.0f} TFLOP/s  maxdiff {err:.3g}" if isinstance(t, float) else t))
            print(line, flush=True)
            lines.append(line)
        del q, k, v, out, lse, g, qt, kt, vt, ref, ref_dq
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune.txt"), "a") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "best_configs.json"), "w") as f:
        json.dump(best_configs(rows_by_shape), f, indent=1)


# ----------------------------------------------------------------------------------------------------


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.compile_worker is not None:
        return compile_worker(args.compile_worker)
    if args.peer_worker:
        return peer_worker(args)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    if args.tune:
        return tune(args)
    if args.launch_breakdown:
        return launch_breakdown(args)
    if args.configs:
        apply_configs(args.configs)

    provs, notes = providers(args)
    if any(lab == "ours:triton" for lab, *_ in provs):
        from flash_attn.triton import _configs
        arch = torch.cuda.get_device_capability()
        jobs = [dict(d=d, causal=c, fwd=dataclasses.astuple(_configs.fwd_config(arch, d, c, False, torch.bfloat16)),
                     bwd=dataclasses.astuple(_configs.bwd_config(arch, d, c, False, torch.bfloat16)))
                for d in args.headdims for c in args.causal]
        precompile(args, jobs)
    results = {}
    for d, s, causal, b, h in shapes(args):
        q, k, v = _inputs(b, s, h, d)
        for lab, make, ctx in provs:
            results[(lab, d, s, causal)] = time_fwd_bwd(make(causal), ctx, q, k, v, args.warmup, args.rep)
            r = results[(lab, d, s, causal)]
            print(f"d={d} s={s} causal={causal} {lab}: " + ", ".join(
                f"{kind} {_tflops(r[kind], kind, b, s, h, d, causal):.0f}" for kind in ("fwd", "bwd", "fwd_bwd")
                if kind in r) + (f" {r['error']}" if "error" in r else ""), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    latency = {}
    for lab, make, ctx in provs:
        launcher = getattr(sys.modules.get("flash_attn.triton.backend"), "_L_FWD", None) if lab == "ours:triton" \
            else None
        slow0 = launcher.slow_launches if launcher is not None else 0
        try:
            latency[lab] = (per_call_us(make(False), ctx), per_call_us(make(False), ctx, requires_grad=True))
        except Exception as e:
            notes.append(f"{lab} latency: {type(e).__name__}: {e}")
        if launcher is not None and launcher.slow_launches - slow0 > 2:
            notes.append(f"{lab} latency: {launcher.slow_launches - slow0} forward launches took Triton's own "
                         "path instead of the cached compiled kernel")
        if lab.startswith("ours:"):
            try:
                direct = _backend_direct(lab.split(":", 1)[1])
                latency[lab + " (backend.fwd only)"] = (per_call_us(direct, contextlib.nullcontext), None)
            except Exception as e:
                notes.append(f"{lab} direct latency: {type(e).__name__}: {e}")
    labels = [lab for lab, *_ in provs]
    if args.peer_pythonpath:
        peer, peer_lat, note = run_peer(args, argv)
        if note:
            notes.append(note)
        for (d, s, causal), rec in peer.items():
            results[("fa4", d, s, causal)] = rec
        if peer:
            labels.append("fa4")
        if peer_lat is not None:
            latency["fa4"] = (peer_lat, None)
    write_report(args, argv, labels, results, latency, notes)


if __name__ == "__main__":
    main()
