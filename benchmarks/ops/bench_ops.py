"""Fused-op benchmark: LayerNorm / RMSNorm and cross-entropy, forward and backward, bf16, against
torch.compile of the plain PyTorch reference, plus achieved bandwidth as a fraction of a device-to-device
copy measured in the same run, and the peak memory of cross-entropy at vocab 128k.

Bandwidth counts the bytes an ideal kernel must move: LayerNorm forward reads x and writes y (plus the
fp32 per-row statistics), backward reads x and dy (and the statistics) and writes dx, forward + backward
the sum of both; cross-entropy forward reads the logits, backward reads them and writes their gradient.
The copy moves 2 x 1 GiB (read + write). Times are medians of triton.testing.do_bench (which flushes L2
between repetitions). The norm target: forward + backward at least 1.0x torch.compile and the backward at
least 0.8 of the copy bandwidth.

    python -m benchmarks.ops.bench_ops [--out DIR]          # writes DIR/ops.md (default benchmarks/results/h200)
    python -m benchmarks.ops.bench_ops --only norm          # norms only, writes DIR/ops_norm.md
    python -m benchmarks.ops.bench_ops --sweep              # also prints a launch-config sweep (tuning aid)
    python -m benchmarks.ops.bench_ops --aot                # no GPU: registers / spills of the norm backward
                                                        # kernels compiled for sm_90 as configured
"""
import argparse
import os
import sys

from benchmarks import common
from benchmarks.common import ints as _ints


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=common.results_dir())
    p.add_argument("--hidden", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--norm-elems", type=int, default=1 << 28,
                   help="rows x hidden of the norm inputs (rows = this / hidden): 512 MiB bf16 tensors keep "
                        "the GPU, not Python, the bottleneck")
    p.add_argument("--vocab", type=_ints, default=[32768, 65536, 131072, 262144])
    p.add_argument("--ce-elems", type=int, default=1 << 29, help="rows x vocab of the logits (1 GiB bf16)")
    p.add_argument("--ce-mem-rows", type=int, default=4096, help="rows of the peak-memory measurement")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--only", choices=("norm", "ce"), help="one section only (results file ops_<section>.md)")
    p.add_argument("--sweep", action="store_true",
                   help="also time alternative launch configurations: the norm backward, cross-entropy")
    p.add_argument("--sweep-fwd", action="store_true", help="also sweep the norm forward launch configurations")
    p.add_argument("--sweep-only", action="store_true", help="only the sweep (no table)")
    p.add_argument("--aot", action="store_true",
                   help="no GPU needed: compile the norm backward kernels for sm_90 as the launcher configures "
                        "them and print registers, spill bytes and shared memory")
    p.add_argument("--sms", type=int, default=132, help="SM count assumed by --aot (H200: 132)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # script check without a GPU
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.aot:
        return aot_report(args)
    import torch
    import torch.nn.functional as F
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
            sys.exit("bench_ops.py needs a CUDA GPU (--aot needs none)")
        dev, bf16, compile_ = "cuda", torch.bfloat16, torch.compile
        bench = lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")  # noqa: E731
    do_norm, do_ce = args.only in (None, "norm"), args.only in (None, "ce")
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
    src = dst = None  # frees them (not del: the lambda above refers to the names)
    print(f"copy: {copy_gbs:.0f} GB/s", flush=True)
    if args.sweep_only:
        return sweep(args, bench, copy_gbs, dev, bf16, do_norm, do_ce)

    # ---------------------------------------------------------------------------------------- norms
    def ln_ref(x, w, b):
        return F.layer_norm(x, x.shape[-1:], w, b, 1e-6)

    def rms_ref(x, w, b):
        xf = x.float()
        return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    norm_rows = []
    for is_rms in (False, True) if do_norm else ():
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
                t_fb = bench(lambda: torch.autograd.grad(ours(), params, dy))
            y_ref = compiled(x, w, b)
            r_f = bench(lambda: compiled(x, w, b))
            r_b = bench(lambda: torch.autograd.grad(y_ref, params, dy, retain_graph=True))
            r_fb = bench(lambda: torch.autograd.grad(compiled(x, w, b), params, dy))
            err = (y.float() - y_ref.float()).abs().max().item()
            # Gradients against the compiled reference's: the largest error relative to the largest entry.
            with backend("triton"):
                grads = torch.autograd.grad(y, params, dy, retain_graph=True)
            grads_ref = torch.autograd.grad(y_ref, params, dy, retain_graph=True)
            gerr = max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
                       for g, r in zip(grads, grads_ref))
            grads = grads_ref = None
            cfg = _cfg_str(ln._bwd_config(M, N, x.device, 1 if is_rms else 2), ln.num_sms(x.device))
            fwd_bytes, bwd_bytes = 4 * M * N + 8 * M, 6 * M * N + 8 * M
            norm_rows.append((name, M, N, t_f, r_f, fwd_bytes, t_b, r_b, bwd_bytes, t_fb, r_fb, cfg, gerr))
            print(f"{name} N={N}: fwd {t_f * 1e3:.0f}us (compile {r_f * 1e3:.0f}us) bwd {t_b * 1e3:.0f}us "
                  f"(compile {r_b * 1e3:.0f}us, {bwd_bytes / t_b / 1e6 / copy_gbs:.2f} of copy) fwd+bwd "
                  f"{t_fb * 1e3:.0f}us (compile {r_fb * 1e3:.0f}us, {r_fb / t_fb:.2f}x) bwd config {cfg} "
                  f"max|y - y_compile| {err:.2e} grads vs compile {gerr:.1e}", flush=True)
            x = w = b = dy = y = y_ref = params = None

    # -------------------------------------------------------------------------------- cross-entropy
    def ce_ref(logits, labels):
        return F.cross_entropy(logits.float(), labels, reduction="none")

    ce_rows = []
    mem_rows = []
    if do_ce:
        ce_compiled = compile_(ce_ref, dynamic=False)
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
            logits = labels = loss = loss_ref = None

        # --------------------------------------------------------------------- cross-entropy memory
        mem_v = 131072 if not args.cpu_smoke else args.vocab[0]
        mem_r = args.ce_mem_rows
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
            grads = [run(logits)]  # held until the peak is read
            torch.cuda.synchronize()
            out = torch.cuda.max_memory_allocated() - base
            grads.clear()
            return out

        with backend("triton"):
            mem_rows.append(("ours", peak(
                lambda l: torch.autograd.grad(ce.cross_entropy_loss(l, labels)[0].sum(), l))))
            mem_rows.append(("ours, inplace_backward", peak(
                lambda l: torch.autograd.grad(ce.cross_entropy_loss(l, labels, inplace_backward=True)[0].sum(), l))))
        mem_rows.append(("torch.compile(F.cross_entropy(logits.float()))",
                         peak(lambda l: torch.autograd.grad(ce_compiled(l, labels).sum(), l))))
        mem_rows.append(("eager F.cross_entropy(logits.float())",
                         peak(lambda l: torch.autograd.grad(ce_ref(l, labels).sum(), l))))
        logits_mib = logits0.numel() * 2 / 2**20
        logits0 = None

    # ---------------------------------------------------------------------------------------- report
    log("# Fused ops benchmark" + (f" ({args.only} only)" if args.only else ""))
    log()
    for line in common.header("benchmarks.ops.bench_ops", argv, device=dev):
        log(line + ("; CPU smoke run (not a benchmark)" if args.cpu_smoke and line.startswith("- device") else ""))
    log(f"- Device-to-device copy (1 GiB bf16, read + write): {copy_gbs:.0f} GB/s")
    log("- Times: medians of triton.testing.do_bench in microseconds; bf16 inputs; speedup = "
        "torch.compile time / our time; x copy = bytes an ideal kernel moves / time / copy bandwidth")
    log()
    if do_norm:
        log("## LayerNorm / RMSNorm (bf16 x, weight and (LayerNorm) bias; rows x hidden = "
            f"{args.norm_elems}, i.e. {args.norm_elems * 2 // 2**20} MiB per activation tensor)")
        log()
        log("Target: fwd+bwd speedup >= 1.00x and bwd x copy >= 0.80. The backward reads x and dy and writes dx "
            "(6 bytes per element); forward + backward moves 10 bytes per element. bwd config: warps, "
            "programs per SM, pass-2 columns (x sub-chunks, / programs per row), prefetch. grad err: largest "
            "difference to the compiled reference's gradients over their largest entry (dx, dweight, dbias).")
        log()
        log("| norm | rows | hidden | fwd us | compile fwd us | fwd speedup | fwd x copy | bwd us | compile bwd us | "
            "bwd speedup | bwd x copy | fwd+bwd us | compile fwd+bwd us | fwd+bwd speedup | fwd+bwd x copy | "
            "target | bwd config | grad err |")
        log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, M, N, t_f, r_f, fb, t_b, r_b, bb, t_fb, r_fb, cfg, gerr in norm_rows:
            cf, cb, cfb = (nb / t / 1e6 / copy_gbs for nb, t in ((fb, t_f), (bb, t_b), (fb + bb, t_fb)))
            met = "met" if r_fb / t_fb >= 1.0 and cb >= 0.8 else "missed"
            log(f"| {name} | {M} | {N} | {t_f * 1e3:.1f} | {r_f * 1e3:.1f} | {r_f / t_f:.2f}x | {cf:.2f} "
                f"| {t_b * 1e3:.1f} | {r_b * 1e3:.1f} | {r_b / t_b:.2f}x | {cb:.2f} "
                f"| {t_fb * 1e3:.1f} | {r_fb * 1e3:.1f} | {r_fb / t_fb:.2f}x | {cfb:.2f} | {met} | {cfg} "
                f"| {gerr:.1e} |")
        log()
    if do_ce:
        log(f"## Cross-entropy (bf16 logits, rows x vocab = {args.ce_elems}; reference: "
            "F.cross_entropy(logits.float(), reduction='none'))")
        log()
        log("| rows | vocab | fwd us | compile fwd us | fwd speedup | fwd GB/s | fwd / copy | bwd us | "
            "compile bwd us | bwd speedup | bwd GB/s | bwd / copy |")
        log("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for R, V, t_f, r_f, fb, t_b, r_b, bb, _ in ce_rows:
            gf, gb = fb / t_f / 1e6, bb / t_b / 1e6
            log(f"| {R} | {V} | {t_f * 1e3:.1f} | {r_f * 1e3:.1f} | {r_f / t_f:.2f}x | {gf:.0f} | "
                f"{gf / copy_gbs:.2f} | {t_b * 1e3:.1f} | {r_b * 1e3:.1f} | {r_b / t_b:.2f}x | {gb:.0f} | "
                f"{gb / copy_gbs:.2f} |")
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
    path = os.path.join(args.out, f"ops_{args.only}.md" if args.only else "ops.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")

    if args.sweep or args.sweep_fwd:
        sweep(args, bench, copy_gbs, dev, bf16, do_norm, do_ce)


def _cfg_str(cfg, sms):
    """Short form of a layer_norm BwdConfig: warps, programs per SM, pass-2 columns per program (x sub-chunks,
    / programs per row), prefetch."""
    own = f"{cfg.block_n}" + (f"x{cfg.sub}" if cfg.sub > 1 else "") + (f"/{cfg.split}" if cfg.split > 1 else "")
    return f"{cfg.num_warps}w {cfg.programs / sms:.2g}/SM {own}{' pf' if cfg.prefetch else ''}{' hold' if cfg.hold else ''}"


def _cpu_time(fn):
    import time

    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


# Knob variants of the norm backward sweep, each on top of the module defaults.
BWD_SWEEP = (
    {},
    {"BWD_ELEMS_PER_THREAD": 16},
    {"BWD_ELEMS_PER_THREAD": 4},
    {"BWD_ACC_REGS": 16},
    {"BWD_MAXNREG": (56, 72, 88, 128)},
    {"BWD_MAXNREG": (80, 96, 112, 128)},
    {"BWD_MIN_TILE": 2048},
    {"BWD_MAX_BLOCK_R": 8192},
    {"BWD_PREFETCH": False},
)


def sweep(args, bench, copy_gbs, dev, bf16, do_norm=True, do_ce=True):
    """Times alternative launch configurations (printed only) to choose the module defaults."""
    import torch

    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import cross_entropy as ce
    from flash_attn.ops.triton import layer_norm as ln

    knobs = ("FWD_MAX_BLOCK_N", "FWD_TILE", "FWD_ELEMS_PER_WARP", "BWD_MIN_TILE", "BWD_ELEMS_PER_THREAD",
             "BWD_MAX_BLOCK_R", "BWD_ACC_REGS", "BWD_MAXNREG", "BWD_PREFETCH")
    saved = {k: getattr(ln, k) for k in knobs}
    fwd_grid = [dict(FWD_MAX_BLOCK_N=mb, FWD_TILE=t, FWD_ELEMS_PER_WARP=e)
                for mb in (16384, 4096) for t in (2048, 8192) for e in (256, 512, 1024)]
    for is_rms in (False, True) if do_norm else ():
        name = "RMSNorm" if is_rms else "LayerNorm"
        print(f"\n== sweep: {name} -> us and fraction of copy", flush=True)
        for N in args.hidden:
            M = max(1, args.norm_elems // N)
            x = torch.randn(M, N, device=dev, dtype=bf16, requires_grad=True)
            w = torch.randn(N, device=dev, dtype=bf16, requires_grad=True)
            b = None if is_rms else torch.randn(N, device=dev, dtype=bf16, requires_grad=True)
            dy = torch.randn(M, N, device=dev, dtype=bf16)
            params = [t for t in (x, w, b) if t is not None]
            seen = set()
            for cfg in fwd_grid if args.sweep_fwd else ():
                ln.__dict__.update(saved)
                ln.__dict__.update(cfg)
                key = ln._fwd_config(N)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    with backend("triton"):
                        t = bench(lambda: ln.layer_norm_fn(x, w, b, is_rms_norm=is_rms))
                    print(f"fwd N={N} (BLOCK_M, BLOCK_N, chunks, warps)={key}: {t * 1e3:.0f}us "
                          f"({4 * M * N / t / 1e6 / copy_gbs:.2f})", flush=True)
                except Exception as e:  # a configuration the hardware cannot launch
                    print(f"fwd N={N} {key}: failed {type(e).__name__}: {e}"[:200], flush=True)
            seen = set()
            for cfg in BWD_SWEEP if args.sweep else ():
                ln.__dict__.update(saved)
                ln.__dict__.update(cfg)
                key = ln._bwd_config(M, N, x.device, 1 if is_rms else 2)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    with backend("triton"):
                        y = ln.layer_norm_fn(x, w, b, is_rms_norm=is_rms)
                        t = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True))
                    print(f"bwd N={N} {cfg or 'default'}: {t * 1e3:.0f}us ({6 * M * N / t / 1e6 / copy_gbs:.2f}) "
                          f"{key}", flush=True)
                except Exception as e:
                    print(f"bwd N={N} {cfg} {key}: failed {type(e).__name__}: {e}"[:300], flush=True)
            x = w = b = dy = params = None
    ln.__dict__.update(saved)

    if not (do_ce and args.sweep):
        return
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


# Feature sets of the --aot report: which optional inputs a layer_norm_fn call has (res: a residual with
# prenorm, so dresidual in and out; x32: the pre-norm sum kept in fp32; drop: dropout; x1/w1: the
# parallel branch).
AOT_FEATURES = {
    "plain": (),
    "residual": ("res",),
    "residual fp32": ("res", "x32"),
    "dropout+residual": ("res", "drop"),
    "parallel": ("res", "drop", "x1", "w1"),
}


def aot_report(args):
    """Compiles the norm backward kernel for sm_90 with the configuration the launcher picks for each hidden
    size and feature set (no GPU needed) and prints its registers, spill bytes (the stack frame) and
    shared memory, read back from the cubin with cuobjdump."""
    import re
    import subprocess
    import tempfile

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("--aot compiles real kernels: unset TRITON_INTERPRET")
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flash_attn.ops.triton import layer_norm as ln

    from flash_attn.testing import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        sys.exit("--aot needs cuobjdump (shipped with triton's NVIDIA backend)")
    kernel = ln._ln_bwd_kernel
    print(f"# norm backward compiled for sm_90 (triton {triton.__version__}), {args.sms} SMs, "
          f"rows = {args.norm_elems} / hidden; bf16 x/dy/dx/weights unless noted")
    print("| norm | features | hidden | warps | programs/SM | pass 1 | pass 2 own columns | prefetch | maxnreg "
          "| registers | spill bytes | shared bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    real_num_sms = ln.num_sms
    ln.num_sms = lambda device: args.sms
    try:
        for is_rms in (False, True):
            for feat_name, feat in AOT_FEATURES.items():
                for N in sorted(set(args.hidden) | {65536}):
                    M = max(1, args.norm_elems // N)
                    meta = lambda dt: torch.empty((M, N), device="meta", dtype=dt)  # noqa: E731
                    xdt = torch.float32 if "x32" in feat else torch.bfloat16
                    x, dy = meta(xdt), meta(torch.bfloat16)
                    dy1 = meta(torch.bfloat16) if "w1" in feat else None
                    dres = meta(xdt) if "res" in feat else None
                    dx1 = meta(torch.bfloat16) if "x1" in feat else None
                    p = 0.1 if "drop" in feat else 0.0
                    n_acc = (1 if is_rms else 2) * (2 if "w1" in feat else 1)
                    cfg = ln._bwd_config(M, N, "cuda", n_acc, ln._bwd_extra(x, dy, dy1, dres, dres, dx1, None, p))
                    ptr = {"X": xdt, "W": torch.bfloat16, "W1": dy1 is not None and torch.bfloat16, "DY": dy.dtype,
                           "DY1": dy1 is not None and torch.bfloat16, "DRES_OUT": dres is not None and xdt,
                           "ROWSCALE": False, "MEAN": torch.float32, "RSTD": torch.float32, "DX": torch.bfloat16,
                           "DX1": dx1 is not None and torch.bfloat16, "DRES_IN": dres is not None and xdt,
                           "DW_PART": torch.float32, "DB_PART": not is_rms and torch.float32,
                           "DW1_PART": dy1 is not None and torch.float32,
                           "DB1_PART": dy1 is not None and not is_rms and torch.float32}
                    const = dict(IS_RMS_NORM=is_rms, HAS_BIAS=not is_rms, HAS_W1=dy1 is not None,
                                 HAS_B1=dy1 is not None and not is_rms, HAS_DRES_OUT=dres is not None,
                                 STORE_DRES_IN=dres is not None, HAS_X1=dx1 is not None, HAS_ROWSCALE=False,
                                 HAS_DROPOUT=p > 0.0, ZERO_CENTERED=False, BLOCK_M=cfg.block_m,
                                 BLOCK_R=cfg.block_r, R_CHUNKS=cfg.r_chunks, BLOCK_N=cfg.block_n, SUB=cfg.sub,
                                 SPLIT=cfg.split, PREFETCH=cfg.prefetch, PAIR=cfg.pair, HOLD=cfg.hold)
                    sig, div16 = {}, []
                    for i, name in enumerate(kernel.arg_names):
                        if name in const:
                            sig[name] = "constexpr"
                        elif name in ptr:
                            if ptr[name] is False:
                                sig[name], const[name] = "constexpr", None
                            else:
                                sig[name] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32"}[ptr[name]]
                                div16.append(i)
                        elif name == "drop_scale":
                            sig[name] = "fp32"
                        else:  # strides, sizes, seeds: N and the strides are multiples of 16 here
                            sig[name] = "i64" if name in ("seed0", "seed1", "drop_threshold") and p else "i32"
                            if name.startswith("stride") or name == "N":
                                div16.append(i)
                    src = ASTSource(fn=kernel, signature=sig, constexprs=const,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in div16})
                    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                        options=dict(num_warps=cfg.num_warps, maxnreg=cfg.maxnreg))
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(ck.asm["cubin"])
                        f.flush()
                        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                                               text=True).stdout
                    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
                    own = f"{cfg.block_n}" + (f" x{cfg.sub}" if cfg.sub > 1 else "") + (
                        f" (1/{cfg.split} of a row)" if cfg.split > 1 else "")
                    pass1 = f"{cfg.block_m} x {cfg.block_r}" + (f" x{cfg.r_chunks}" if cfg.r_chunks > 1 else "")
                    print(f"| {'RMSNorm' if is_rms else 'LayerNorm'} | {feat_name} | {N} | {cfg.num_warps} | "
                          f"{cfg.programs / args.sms:.1f} | {pass1} | {own} | {'yes' if cfg.prefetch else 'no'} | "
                          f"{cfg.maxnreg} | {regs} | {stack} | {ck.metadata.shared} |", flush=True)
    finally:
        ln.num_sms = real_num_sms


if __name__ == "__main__":
    main()
