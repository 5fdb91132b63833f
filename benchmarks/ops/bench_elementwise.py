"""The elementwise kernels of a GPT-2 medium training step (batch 8 x seq 2048 = 16384 tokens, hidden 1024,
MLP 4096, vocab 50257 padded to 50264, bf16) at exactly those shapes, in each launch configuration the
modules' tuning knobs offer: the current defaults, the plain kernels the knobs improve on ("before": scalar
loads, a GELU derivative with two sigmoids) and candidates. Each row: median time (triton.testing.do_bench),
the bandwidth of the bytes an ideal kernel moves, its fraction of a torch copy's bandwidth measured in the same run, the speed-up over "before", and
whether the outputs match the default's (CE backward and activation dx within one bf16 rounding, losses
and bias gradients within fp32 summation-order rounding). Exits 1 on any mismatch.

    PYTHONPATH=$PWD python -m benchmarks.ops.bench_elementwise [--only ce_fwd,ce_bwd,act_bwd,act_fwd] [--out FILE]

Bytes: CE forward reads the logits (n x 50264 bf16); CE backward reads them and writes the gradient (in
place, as the trainer calls it); bias_act backward reads x and dout and writes dx (bf16, fp32 bias partials
not counted); bias_act forward reads x and writes the activation.
"""
import argparse
import sys

import torch

from benchmarks import common

ROWS, HIDDEN, FFN, VOCAB = 16384, 1024, 4096, 50264

# (label, knob overrides) per kernel; the first entry is the plain-kernel baseline ("before"), the second
# the defaults every other row is checked against.
CE_FWD = [
    ("before (scalar)", dict(VECTORIZE=False)),
    ("default", {}),
] + [(f"block {b} warps {w} stages {s}", dict(FWD_BLOCK=b, FWD_WARPS=w, FWD_STAGES=s)) for b, w, s in [
    (4096, 4, 1), (8192, 8, 1), (16384, 8, 1), (16384, 16, 1), (4096, 4, 3), (8192, 4, 2), (8192, 4, 3),
    (16384, 8, 2)]]
CE_BWD = [
    ("before (scalar)", dict(VECTORIZE=False)),
    ("default", {}),
] + [(f"{lay} block {b} warps {w}", dict(BWD_LAYOUT=lay, BWD_BLOCK=b, BWD_WARPS=w)) for lay, b, w in [
    ("row", 2048, 4), ("row", 4096, 4), ("row", 8192, 8), ("row", 8192, 16), ("row", 16384, 16),
    ("flat", 2048, 4), ("flat", 4096, 4), ("flat", 4096, 8), ("flat", 8192, 8), ("flat", 8192, 16),
    ("flat", 16384, 16)]]
ACT_BWD = [
    ("before (2 sigmoids)", dict(GELU_ONE_EXP=False)),
    ("default", {}),
] + [(f"tile {t} warps {w} ppsm {p} stages {s}",
      dict(BWD_TILE=t, BWD_WARPS=w, BWD_PROGRAMS_PER_SM=p, BWD_STAGES=s)) for t, w, p, s in [
    (4096, 8, 8, 1), (2048, 4, 8, 1), (8192, 8, 8, 1), (4096, 4, 16, 1), (4096, 8, 16, 1), (2048, 4, 16, 1),
    (4096, 4, 8, 2), (4096, 4, 8, 3), (4096, 8, 8, 2), (8192, 8, 8, 2), (4096, 8, 4, 1)]]
ACT_FWD = [
    ("default", {}),
] + [(f"tile {t} warps {w}", dict(FWD_TILE=t, FWD_WARPS=w)) for t, w in [
    (2048, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 16)]]


class knobs:
    """Set module globals for the duration of a with block."""

    def __init__(self, module, values):
        self.module, self.values, self.saved = module, values, {}

    def __enter__(self):
        for k, v in self.values.items():
            if not hasattr(self.module, k):
                raise AttributeError(f"{self.module.__name__} has no knob {k}")
            self.saved[k] = getattr(self.module, k)
            setattr(self.module, k, v)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(self.module, k, v)


def bench(fn, args):
    if args.cpu_smoke:
        import time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def close(a, b, rtol, atol):
    """(ok, max abs diff) of a against b in fp32."""
    if torch.equal(a, b):
        return True, 0.0
    d = (a.float() - b.float()).abs()
    return bool((d <= atol + rtol * b.float().abs()).all()), float(d.max())


def sweep(rows, args, kernel, module, configs, run, timed, compare, n_bytes):
    """One table row per configuration: its output against the default's, then its time."""
    if kernel not in args.only:
        return
    ref = run()
    for label, kv in configs:
        with knobs(module, kv):
            ok, diff = compare(run(), ref)
            ms = bench(timed, args)
        rows.append((kernel, label, ms, n_bytes, ok, diff))
        print(f"{kernel:8s} {label:40s} {ms:.4f} ms  {'ok' if ok else 'MISMATCH'} {diff:.2e}", file=sys.stderr,
              flush=True)


def run_ce(args, rows, dev, n_rows, vocab):
    from flash_attn.ops.triton import cross_entropy as ce

    g = torch.Generator(device=dev).manual_seed(0)
    logits = 3 * torch.randn(n_rows, vocab, device=dev, dtype=torch.bfloat16, generator=g)
    labels = torch.randint(0, vocab - 7, (n_rows,), device=dev, generator=g)
    labels[::97] = -100
    n_bytes = n_rows * vocab * 2

    def fwd():
        lse = torch.empty(n_rows, device=dev, dtype=torch.float32)
        losses, z = torch.empty_like(lse), torch.empty_like(lse)
        ce._ce_fwd_launch(logits, labels, lse, losses, z, False, 0.0, 1.0, 0.0, -100, vocab, 0, False)
        return lse, losses

    def cmp_fwd(out, ref):  # fp32 partial sums in another order: a few ulps of lse (~11)
        ok1, d1 = close(out[0], ref[0], 1e-6, 1e-5)
        ok2, d2 = close(out[1], ref[1], 1e-6, 1e-4)
        return ok1 and ok2, max(d1, d2)

    sweep(rows, args, "ce_fwd", ce, CE_FWD, fwd, fwd, cmp_fwd, n_bytes)
    lse = fwd()[0]
    dloss = torch.full((n_rows,), 1.0 / n_rows, device=dev)
    scratch = torch.empty_like(logits)

    def bwd_out():
        d = torch.empty_like(logits)
        ce._ce_bwd_launch(d, logits, dloss, lse, labels, 0.0, 1.0, 0.0, -100, vocab, 0)
        return d

    def bwd_inplace():  # the trainer's call: the gradient overwrites the logits (here a scratch copy)
        ce._ce_bwd_launch(scratch, None, dloss, lse, labels, 0.0, 1.0, 0.0, -100, vocab, 0)

    scratch.copy_(logits)
    sweep(rows, args, "ce_bwd", ce, CE_BWD, bwd_out, bwd_inplace, lambda a, b: close(a, b, 2 ** -8, 1e-12),
          2 * n_bytes)


def run_act(args, rows, dev, n_rows, ffn):
    from flash_attn.ops.triton import activations as K

    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(n_rows, ffn, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(n_rows, ffn, device=dev, dtype=torch.bfloat16, generator=g) * 0.01
    bias = torch.randn(ffn, device=dev, dtype=torch.float32, generator=g) * 0.1
    n = n_rows * ffn * 2

    def bwd():  # the kernel plus the partials' allocation, as the op runs it
        programs = K.bwd_row_programs(n_rows, ffn, x.device, True)[0]
        db_part = torch.empty((programs, ffn), device=dev, dtype=torch.float32)
        dx = torch.empty_like(x)
        K.bias_act_bwd(dout, x, bias, dx, db_part, "gelu_tanh")
        return dx, db_part

    def bwd_sum():
        dx, part = bwd()
        return dx, part.sum(0), dx.float().abs().sum(0)

    def cmp_bwd(out, ref):  # the bias gradient sums n_rows terms in an order set by the grid
        # dx within one bf16 rounding of its own value or, where another formula ("before") lands on either
        # side of a rounding near gelu's zero of the derivative, of the tensor's largest value
        ok1, d1 = close(out[0], ref[0], 2 ** -8, 2 ** -8 * float(ref[0].float().abs().max()))
        d2 = float(((out[1] - ref[1]).abs() / ref[2].clamp_min(1e-30)).max())
        return ok1 and d2 <= 1e-5, max(d1, d2)

    def fwd():
        out = torch.empty_like(x)
        K.bias_act_fwd(x, bias, out, "gelu_tanh")
        return out

    sweep(rows, args, "act_bwd", K, ACT_BWD, bwd_sum, bwd, cmp_bwd, 3 * n)
    sweep(rows, args, "act_fwd", K, ACT_FWD, fwd, fwd, lambda a, b: close(a, b, 0.0, 0.0), 2 * n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="ce_fwd,ce_bwd,act_bwd,act_fwd")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetitions (ms)")
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # script check, interpreter
    args = p.parse_args(argv)
    args.only = set(args.only.split(","))
    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("needs a CUDA GPU", file=sys.stderr)
        return 2

    dev = "cpu" if args.cpu_smoke else "cuda"
    # Smoke shapes: 4 rows of a vocab of 8 * 1031, so the CE row and flat layouts and VEC 8 all run.
    n_rows, vocab, ffn = (4, 8248, 300) if args.cpu_smoke else (ROWS, VOCAB, FFN)
    src = torch.empty(1 << (14 if args.cpu_smoke else 29), device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src), args)
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    del src, dst
    if dev == "cuda":
        torch.cuda.empty_cache()

    rows = []
    run_ce(args, rows, dev, n_rows, vocab)
    if dev == "cuda":
        torch.cuda.empty_cache()
    run_act(args, rows, dev, n_rows, ffn)

    lines = ["# GPT-2 medium step elementwise kernels" + (" (CPU interpreter smoke run)" if dev == "cpu" else ""),
             "", *common.header("benchmarks.ops.bench_elementwise", argv, device=dev), "",
             f"torch copy: {copy_gbs:.0f} GB/s (2 x 1 GiB). Shapes: CE ({n_rows}, {vocab}) bf16; bias_act "
             f"({n_rows}, {ffn}) bf16 gelu_tanh, fp32 bias.", "",
             "| kernel | config | ms | GB/s | of copy | vs before | matches default (max diff) |",
             "|---|---|---:|---:|---:|---:|---|"]
    bad = 0
    for kernel in ("ce_fwd", "ce_bwd", "act_bwd", "act_fwd"):
        group = [r for r in rows if r[0] == kernel]
        if not group:
            continue
        base = group[0][2]
        best = min(group, key=lambda r: r[2])
        for name, label, ms, nbytes, ok, diff in group:
            gbs = nbytes / ms / 1e6
            bad += not ok
            mark = " **best**" if ms == best[2] else ""
            lines.append(f"| {name} | {label}{mark} | {ms:.4f} | {gbs:.0f} | {gbs / copy_gbs:.2f} | "
                         f"{base / ms:.2f}x | {'yes' if ok else 'NO'} ({diff:.2e}) |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if bad:
        print(f"\n{bad} configuration(s) do not match the default's output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
