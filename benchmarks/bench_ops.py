"""Fused-op benchmark: LayerNorm / RMSNorm and cross-entropy, forward and backward, bf16, against
torch.compile of the plain PyTorch reference, plus achieved bandwidth as a fraction of a device-to-device
copy measured in the same run, and the peak memory of cross-entropy at vocab 128k.

Bandwidth counts the bytes an ideal kernel must move: LayerNorm forward reads x and writes y (plus the
fp32 per-row statistics), backward reads x and dy and writes dx; cross-entropy forward reads the logits,
backward reads them and writes their gradient. The copy moves 2 x 1 GiB (read + write). Times are
medians of triton.testing.do_bench (which flushes L2 between repetitions).

    python benchmarks/bench_ops.py [--out DIR]          # writes DIR/ops.md (default benchmarks/results/h200)
    python benchmarks/bench_ops.py --sweep              # also prints a launch-config sweep (tuning aid)
"""
import argparse
import datetime
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _ints(s):
    return [int(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "h200"))
    p.add_argument("--hidden", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--norm-elems", type=int, default=1 << 28,
                   help="rows x hidden of the norm inputs (rows = this / hidden): 512 MiB bf16 tensors keep "
                        "the GPU, not Python, the bottleneck")
    p.add_argument("--vocab", type=_ints, default=[32768, 65536, 131072, 262144])
    p.add_argument("--ce-elems", type=int, default=1 << 29, help="rows x vocab of the logits (1 GiB bf16)")
    p.add_argument("--ce-mem-rows", type=int, default=4096, help="rows of the peak-memory measurement")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--sweep", action="store_true", help="also time alternative launch configurations")
    p.add_argument("--sweep-only", action="store_true", help="only the sweep (no table)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # script check without a GPU
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    import triton
    from triton.testing import do_bench

    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import cross_entropy as ce
    from flash_attn.ops.triton import layer_norm as ln

    if args.cpu_smoke:
        # Exercises the script on CPU (Triton interpreter, eager reference): numbers are meaningless.
        dev, bf16, compile_ = "cpu", torch.float16, (lambda fn, **kw: fn)
        bench = _cpu_time
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_ops.py needs a CUDA GPU")
        dev, bf16, compile_ = "cuda", torch.bfloat16, torch.compile
        bench = lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")  # noqa: E731
    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    # ---------------------------------------------------------------------------------------- copy
    src = torch.empty(1 << 29 if not args.cpu_smoke else 1 << 20, device=dev, dtype=bf16).normal_()
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    del src, dst
    if args.sweep_only:
        print(f"copy: {copy_gbs:.0f} GB/s", flush=True)
        return sweep(args, bench, copy_gbs, dev, bf16)

    # ---------------------------------------------------------------------------------------- norms
    def ln_ref(x, w, b):
        return F.layer_norm(x, x.shape[-1:], w, b, 1e-6)

    def rms_ref(x, w, b):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    norm_rows = []
    for is_rms in (False, True):
        name = "RMSNorm" if is_rms else "LayerNorm"
        # dynamic=False: a kernel specialised to each hidden size, the reference's best case.
        compiled = compile_(rms_ref if is_rms else ln_ref, dynamic=False)
        for N in args.hidden:
            torch.manual_seed(0)
            M = max(1, args.norm_elems // N)
            x = torch.randn(M, N, device=dev, dtype=bf16, requires_grad=True)
            w = torch.randn(N, device=dev, dtype=bf16, requires_grad=True)
            b = None if is_rms else torch.randn(N, device=dev, dtype=bf16, requires_grad=True)
            dy = torch.randn(M, N, device=dev, dtype=bf16)
            params = [t for t in (x, w, b) if t is not None]
            with backend("triton"):
                ours = lambda: ln.layer_norm_fn(x, w, b, eps=1e-6, is_rms_norm=is_rms)  # noqa: E731
                y = ours()
                t_f = bench(ours)
                t_b = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True))
            y_ref = compiled(x, w, b)
            r_f = bench(lambda: compiled(x, w, b))
            r_b = bench(lambda: torch.autograd.grad(y_ref, params, dy, retain_graph=True))
            err = (y.float() - y_ref.float()).abs().max().item()
            fwd_bytes, bwd_bytes = 4 * M * N + 8 * M, 6 * M * N + 8 * M
            norm_rows.append((name, M, N, t_f, r_f, fwd_bytes, t_b, r_b, bwd_bytes, err))
            print(f"{name} N={N}: fwd {t_f * 1e3:.0f}us (compile {r_f * 1e3:.0f}us) bwd {t_b * 1e3:.0f}us "
                  f"(compile {r_b * 1e3:.0f}us) max|y - y_compile| {err:.2e}", flush=True)
            del x, w, b, dy, y, y_ref, params

    # -------------------------------------------------------------------------------- cross-entropy
    def ce_ref(logits, labels):
        return F.cross_entropy(logits.float(), labels, reduction="none")

    ce_compiled = compile_(ce_ref, dynamic=False)
    ce_rows = []
    for V in args.vocab:
        torch.manual_seed(0)
        R = max(1, args.ce_elems // V)
        logits = torch.randn(R, V, device=dev, dtype=bf16, requires_grad=True)
        labels = torch.randint(0, V, (R,), device=dev)
        g = torch.ones(R, device=dev)
        with backend("triton"):
            ours = lambda: ce.cross_entropy_loss(logits, labels)[0]  # noqa: E731
            loss = ours()
            t_f = bench(ours)
            t_b = bench(lambda: torch.autograd.grad(loss, logits, g, retain_graph=True))
        loss_ref = ce_compiled(logits, labels)
        r_f = bench(lambda: ce_compiled(logits, labels))
        r_b = bench(lambda: torch.autograd.grad(loss_ref, logits, g, retain_graph=True))
        err = (loss - loss_ref).abs().max().item()
        ce_rows.append((R, V, t_f, r_f, 2 * R * V, t_b, r_b, 4 * R * V, err))
        print(f"CE V={V}: fwd {t_f * 1e3:.0f}us (compile {r_f * 1e3:.0f}us) bwd {t_b * 1e3:.0f}us "
              f"(compile {r_b * 1e3:.0f}us) max|loss - loss_compile| {err:.2e}", flush=True)
        del logits, labels, loss, loss_ref

    # ------------------------------------------------------------------------- cross-entropy memory
    mem_v = 131072 if not args.cpu_smoke else args.vocab[0]
    mem_r = args.ce_mem_rows
    mem_rows = []
    logits0 = torch.randn(mem_r, mem_v, device=dev, dtype=bf16)
    labels = torch.randint(0, mem_v, (mem_r,), device=dev)

    def peak(run):
        logits = logits0.clone().requires_grad_()
        if args.cpu_smoke:
            run(logits)
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grad = run(logits)
        torch.cuda.synchronize()
        out = torch.cuda.max_memory_allocated() - base
        del grad, logits
        return out

    with backend("triton"):
        mem_rows.append(("ours", peak(lambda l: torch.autograd.grad(ce.cross_entropy_loss(l, labels)[0].sum(), l))))
        mem_rows.append(("ours, inplace_backward", peak(
            lambda l: torch.autograd.grad(ce.cross_entropy_loss(l, labels, inplace_backward=True)[0].sum(), l))))
    mem_rows.append(("torch.compile(F.cross_entropy(logits.float()))",
                     peak(lambda l: torch.autograd.grad(ce_compiled(l, labels).sum(), l))))
    mem_rows.append(("eager F.cross_entropy(logits.float())",
                     peak(lambda l: torch.autograd.grad(ce_ref(l, labels).sum(), l))))
    logits_mib = logits0.numel() * 2 / 2**20
    del logits0

    # ---------------------------------------------------------------------------------------- report
    gpu = torch.cuda.get_device_name() if not args.cpu_smoke else "CPU smoke run (not a benchmark)"
    log("# Fused ops benchmark")
    log()
    log(f"- GPU: {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}); triton {triton.__version__}; "
        f"Python {platform.python_version()}")
    log(f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    log(f"- Command: `python {' '.join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])}`")
    log(f"- Device-to-device copy (1 GiB bf16, read + write): {copy_gbs:.0f} GB/s; targets: >= 1.0x "
        f"torch.compile and >= 0.8 of copy bandwidth")
    log(f"- Times: medians of triton.testing.do_bench in microseconds; bf16 inputs; speedup = "
        f"torch.compile time / our time")
    log()
    log("## LayerNorm / RMSNorm (bf16 x, weight and (LayerNorm) bias; rows x hidden = "
        f"{args.norm_elems}, i.e. {args.norm_elems * 2 // 2**20} MiB per activation tensor)")
    log()
    log("| norm | rows | hidden | fwd us | compile fwd us | fwd speedup | fwd GB/s | fwd / copy | bwd us | "
        "compile bwd us | bwd speedup | bwd GB/s | bwd / copy |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, M, N, t_f, r_f, fb, t_b, r_b, bb, _ in norm_rows:
        gf, gb = fb / t_f / 1e6, bb / t_b / 1e6
        log(f"| {name} | {M} | {N} | {t_f * 1e3:.1f} | {r_f * 1e3:.1f} | {r_f / t_f:.2f}x | {gf:.0f} | {gf / copy_gbs:.2f} "
            f"| {t_b * 1e3:.1f} | {r_b * 1e3:.1f} | {r_b / t_b:.2f}x | {gb:.0f} | {gb / copy_gbs:.2f} |")
    log()
    log(f"## Cross-entropy (bf16 logits, rows x vocab = {args.ce_elems}; reference: "
        "F.cross_entropy(logits.float(), reduction='none'))")
    log()
    log("| rows | vocab | fwd us | compile fwd us | fwd speedup | fwd GB/s | fwd / copy | bwd us | compile bwd us | "
        "bwd speedup | bwd GB/s | bwd / copy |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for R, V, t_f, r_f, fb, t_b, r_b, bb, _ in ce_rows:
        gf, gb = fb / t_f / 1e6, bb / t_b / 1e6
        log(f"| {R} | {V} | {t_f * 1e3:.1f} | {r_f * 1e3:.1f} | {r_f / t_f:.2f}x | {gf:.0f} | {gf / copy_gbs:.2f} | "
            f"{t_b * 1e3:.1f} | {r_b * 1e3:.1f} | {r_b / t_b:.2f}x | {gb:.0f} | {gb / copy_gbs:.2f} |")
    log()
    log(f"## Cross-entropy peak memory, vocab {mem_v}, {mem_r} rows (logits: {logits_mib:.0f} MiB bf16)")
    log()
    log("Peak allocated during forward + backward beyond the logits themselves.")
    log()
    log("| implementation | peak extra MiB | x logits size |")
    log("|---|---|---|")
    for name, b in mem_rows:
        log(f"| {name} | {b / 2**20:.0f} | {b / 2**20 / logits_mib:.2f} |")
    log()
    with open(os.path.join(args.out, "ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {os.path.join(args.out, 'ops.md')}")

    if args.sweep:
        sweep(args, bench, copy_gbs, dev, bf16)


def _cpu_time(fn):
    import time

    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def sweep(args, bench, copy_gbs, dev, bf16):
    """Times alternative launch configurations (printed only) to choose the module defaults."""
    import torch

    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import cross_entropy as ce
    from flash_attn.ops.triton import layer_norm as ln

    knobs = ("FWD_MAX_BLOCK_N", "FWD_TILE", "FWD_ELEMS_PER_WARP", "BWD_MAX_BLOCK_N", "BWD_TILE", "BWD_MIN_TILE",
             "BWD_ELEMS_PER_WARP", "BWD_WARPS_PER_SM")
    saved = {k: getattr(ln, k) for k in knobs}
    fwd_grid = [dict(FWD_MAX_BLOCK_N=mb, FWD_TILE=t, FWD_ELEMS_PER_WARP=e)
                for mb in (16384, 4096) for t in (2048, 8192) for e in (256, 512, 1024)]
    bwd_grid = [dict(BWD_MAX_BLOCK_N=mb, BWD_TILE=t, BWD_MIN_TILE=mt, BWD_ELEMS_PER_WARP=512, BWD_WARPS_PER_SM=p)
                for mb in (4096, 2048) for t in (4096, 8192) for mt in (1024, 4096) for p in (8, 16)]
    print("\n== sweep: norms (LayerNorm) -> us and fraction of copy", flush=True)
    for N in args.hidden:
        M = max(1, args.norm_elems // N)
        x = torch.randn(M, N, device=dev, dtype=bf16, requires_grad=True)
        w = torch.randn(N, device=dev, dtype=bf16, requires_grad=True)
        b = torch.randn(N, device=dev, dtype=bf16, requires_grad=True)
        dy = torch.randn(M, N, device=dev, dtype=bf16)
        seen = set()
        for cfg in fwd_grid:
            ln.__dict__.update(saved)
            ln.__dict__.update(cfg)
            key = ln._fwd_config(N)
            if key in seen:
                continue
            seen.add(key)
            try:
                with backend("triton"):
                    t = bench(lambda: ln.layer_norm_fn(x, w, b))
                print(f"fwd N={N} (BLOCK_M, BLOCK_N, chunks, warps)={key}: {t * 1e3:.0f}us "
                      f"({4 * M * N / t / 1e6 / copy_gbs:.2f})", flush=True)
            except Exception as e:  # a configuration the hardware cannot launch
                print(f"fwd N={N} {key}: failed {type(e).__name__}: {e}"[:200], flush=True)
        seen = set()
        for cfg in bwd_grid:
            ln.__dict__.update(saved)
            ln.__dict__.update(cfg)
            key = ln._bwd_config(M, N, x.device)
            if key in seen:
                continue
            seen.add(key)
            try:
                with backend("triton"):
                    y = ln.layer_norm_fn(x, w, b)
                    t = bench(lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True))
                print(f"bwd N={N} (programs, rows/program, BLOCK_M, BLOCK_N, chunks, warps)={key}: {t * 1e3:.0f}us "
                      f"({6 * M * N / t / 1e6 / copy_gbs:.2f})", flush=True)
            except Exception as e:
                print(f"bwd N={N} {key}: failed {type(e).__name__}: {e}"[:200], flush=True)
        del x, w, b, dy
    ln.__dict__.update(saved)

    print("\n== sweep: cross-entropy (block, warps)", flush=True)
    orig = ce.FWD_BLOCK, ce.BWD_BLOCK, ce.FWD_WARPS, ce.BWD_WARPS
    V = args.vocab[-1]
    R = max(1, args.ce_elems // V)
    logits = torch.randn(R, V, device=dev, dtype=bf16, requires_grad=True)
    labels = torch.randint(0, V, (R,), device=dev)
    g = torch.ones(R, device=dev)
    for block in (4096, 8192, 16384):
        for warps in (4, 8):
            ce.FWD_BLOCK, ce.BWD_BLOCK, ce.FWD_WARPS, ce.BWD_WARPS = block, block, warps, warps
            with backend("triton"):
                loss = ce.cross_entropy_loss(logits, labels)[0]
                t_f = bench(lambda: ce.cross_entropy_loss(logits, labels)[0])
                t_b = bench(lambda: torch.autograd.grad(loss, logits, g, retain_graph=True))
            print(f"CE V={V} block={block} warps={warps}: fwd {t_f * 1e3:.0f}us "
                  f"({2 * R * V / t_f / 1e6 / copy_gbs:.2f}) bwd {t_b * 1e3:.0f}us "
                  f"({4 * R * V / t_b / 1e6 / copy_gbs:.2f})", flush=True)
    ce.FWD_BLOCK, ce.BWD_BLOCK, ce.FWD_WARPS, ce.BWD_WARPS = orig


if __name__ == "__main__":
    main()
