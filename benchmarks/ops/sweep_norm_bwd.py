"""Sweep of the LayerNorm / RMSNorm backward launch configurations (bf16, rows x hidden = --elems): for every
candidate of CANDIDATES, the backward time, its fraction of the device-to-device copy bandwidth (6 bytes per
element: read x and dy, write dx), forward + backward time, and the largest gradient error against an fp32
PyTorch reference (over dx, dweight, dbias, relative to the largest reference entry). A candidate whose
error exceeds --max-err is marked WRONG and must not be picked.

    python -m benchmarks.ops.sweep_norm_bwd                 # H200: all hidden sizes, both norms (< 4 minutes)
    python -m benchmarks.ops.sweep_norm_bwd --aot           # no GPU: registers and spill bytes of each candidate
                                                        # compiled for sm_90 (132 SMs assumed)

Candidates are entries of layer_norm.BWD_TUNED (BwdConfig fields, plus per_sm) on top of the plan; the
winner of a (norm, hidden) goes into BWD_TUNED as printed on its line (n_acc: RMSNorm 1, LayerNorm 2), or,
where "plan" wins, nothing changes.
"""
import argparse
import os
import sys
import time

from benchmarks.common import environ

# (label, norms, hidden sizes (None: all), BWD_TUNED fields). "plan" is the module's own configuration.
CANDIDATES = (
    ("plan", "LR", None, {}),
    ("pair=0", "L", None, {"pair": False}),  # the row sums in two exchanges, 4 barriers
    ("hold=0", "R", (1024, 2048, 4096, 8192), {"hold": False}),
    ("hold=1", "L", (1024, 2048, 4096, 8192), {"hold": True}),  # 16 bytes of spill at 64 registers
    ("hold=1 mr72", "L", (1024,), {"hold": True, "maxnreg": 72}),  # 7 programs/SM, no spill
    ("mr80", "LR", (1024,), {"maxnreg": 80}),  # 6 programs/SM
    ("hold=1 mr80", "L", (1024,), {"hold": True, "maxnreg": 80}),
    ("4w 6/SM", "LR", (1024,), {"per_sm": 6}),
    ("8w 4/SM", "LR", (1024,), {"num_warps": 8}),  # 4 elements a thread: 64-bit loads
    ("16w 2/SM", "LR", (2048,), {"num_warps": 16}),
    ("32w 1/SM", "LR", (4096,), {"num_warps": 32}),
    ("8192x2", "L", (16384,), {"block_n": 8192, "sub": 2}),  # RMSNorm's scheme: 64 bytes of spill
    ("8192x2 pass1 8192x2", "LR", (16384,), {"block_n": 8192, "sub": 2, "block_r": 8192}),  # LN: 40 bytes
    ("8192/2", "R", (16384,), {"block_n": 8192, "sub": 1}),  # LayerNorm's scheme
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="1024,2048,4096,8192,16384")
    p.add_argument("--norms", default="LR", help="L: LayerNorm, R: RMSNorm")
    p.add_argument("--elems", type=int, default=1 << 28, help="rows x hidden")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetitions (ms)")
    p.add_argument("--max-err", type=float, default=1e-2, help="gradient error above which a candidate is WRONG")
    p.add_argument("--only", default="", help="comma-separated candidate labels (default: all)")
    p.add_argument("--aot", action="store_true", help="no GPU: compile each candidate for sm_90, print registers")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # script check without a GPU
    return p.parse_args(argv)


def candidates(args, norm, N):
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for label, norms, hiddens, fields in CANDIDATES:
        if norm in norms and (hiddens is None or N in hiddens or args.cpu_smoke) and (not only or label in only):
            yield label, fields


def tuned_line(n_acc, N, fields):
    return f"BWD_TUNED[({n_acc}, {N})] = {fields!r}" if fields else "(plan: no change)"


def main(argv=None):
    # The Triton backward's configurations are swept: the CuTeDSL backward (the default at hidden >= 4096
    # on sm_90, flash_attn.cute.norm_bwd; benchmarks/ops/bench_ln_cute_bwd.py measures it) stays off.
    disabled = [x for x in os.environ.get("FLASH_ATTN_DISABLE", "").split(",") if x.strip()]
    with environ({"FLASH_ATTN_DISABLE": ",".join(disabled + ["ln_cute_bwd"])}):  # (and the settings read again)
        return _main(argv)


def _main(argv=None):
    args = parse_args(argv)
    hidden = [int(h) for h in args.hidden.split(",") if h]
    if args.aot:
        return aot(args, hidden)
    import torch
    import torch.nn.functional as F

    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import layer_norm as ln

    if args.cpu_smoke:
        dev, dt = "cpu", torch.float32

        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        copy_gbs = 1.0
    else:
        from triton.testing import do_bench

        if not torch.cuda.is_available():
            sys.exit("sweep_norm_bwd.py needs a CUDA GPU (--aot needs none)")
        dev, dt = "cuda", torch.bfloat16
        bench = lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")  # noqa: E731
        src = torch.empty(1 << 29, device=dev, dtype=dt).normal_()
        dst = torch.empty_like(src)
        copy_ms = bench(lambda: dst.copy_(src))
        copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
        src = dst = None
        print(f"# copy: {copy_gbs:.0f} GB/s; {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    print("| norm | hidden | candidate | bwd us | bwd x copy | fwd+bwd us | grad err | config | BWD_TUNED line |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    saved = dict(ln.BWD_TUNED)
    try:
        for norm in args.norms:
            is_rms = norm == "R"
            n_acc = 1 if is_rms else 2
            for N in hidden:
                M = max(1, args.elems // N)
                g = torch.Generator(device=dev).manual_seed(N)
                x = torch.randn(M, N, device=dev, dtype=dt, generator=g).requires_grad_()
                w = (1 + 0.5 * torch.randn(N, device=dev, dtype=dt, generator=g)).requires_grad_()
                b = None if is_rms else torch.randn(N, device=dev, dtype=dt, generator=g).requires_grad_()
                dy = torch.randn(M, N, device=dev, dtype=dt, generator=g)
                params = [t for t in (x, w, b) if t is not None]
                # fp32 reference gradients (dweight/dbias sums over M rows carry the most rounding)
                xf = x.detach().float().requires_grad_()
                wf, bf = w.detach().float().requires_grad_(), b.detach().float().requires_grad_() if b is not None else None
                if is_rms:
                    yf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * wf
                else:
                    yf = F.layer_norm(xf, (N,), wf, bf, 1e-6)
                refs = torch.autograd.grad(yf, [t for t in (xf, wf, bf) if t is not None], dy.float())
                yf = xf = wf = bf = None
                scale = [r.abs().max().clamp_min(1e-30) for r in refs]
                for label, fields in candidates(args, norm, N):
                    ln.BWD_TUNED = dict(saved)
                    if fields:
                        ln.BWD_TUNED[(n_acc, N)] = dict(fields)
                    try:
                        cfg = ln._bwd_config(M, N, x.device, n_acc)
                        with backend("triton"):
                            y = ln.layer_norm_fn(x, w, b, eps=1e-6, is_rms_norm=is_rms)
                            grads = torch.autograd.grad(y, params, dy, retain_graph=True)
                            err = max(((a.float() - r).abs().max() / s).item() for a, r, s in zip(grads, refs, scale))
                            grads = None
                            t_b = bench(lambda: torch.autograd.grad(y, params, dy, retain_graph=True))
                            t_fb = bench(lambda: torch.autograd.grad(ln.layer_norm_fn(x, w, b, eps=1e-6,
                                                                                      is_rms_norm=is_rms), params, dy))
                        y = None
                        flag = " WRONG" if not err <= args.max_err else ""
                        print(f"| {'RMSNorm' if is_rms else 'LayerNorm'} | {N} | {label} | {t_b * 1e3:.1f} | "
                              f"{6 * M * N / t_b / 1e6 / copy_gbs:.3f} | {t_fb * 1e3:.1f} | {err:.1e}{flag} | "
                              f"{cfg_str(cfg, ln.num_sms(x.device))} | {tuned_line(n_acc, N, fields)} |", flush=True)
                    except Exception as e:  # a candidate the hardware cannot launch
                        print(f"| {'RMSNorm' if is_rms else 'LayerNorm'} | {N} | {label} | failed: "
                              f"{type(e).__name__}: {str(e)[:150]} | | | | | |", flush=True)
                x = w = b = dy = params = refs = None
                if dev == "cuda":
                    torch.cuda.empty_cache()
    finally:
        ln.BWD_TUNED = saved


def cfg_str(cfg, sms):
    own = f"{cfg.block_n}" + (f"x{cfg.sub}" if cfg.sub > 1 else "") + (f"/{cfg.split}" if cfg.split > 1 else "")
    pass1 = f"{cfg.block_m}x{cfg.block_r}" + (f"x{cfg.r_chunks}" if cfg.r_chunks > 1 else "")
    flags = "".join(f" {k}" for k in ("prefetch", "pair", "hold") if getattr(cfg, k))
    return f"{cfg.num_warps}w {cfg.programs / sms:.2g}/SM mr{cfg.maxnreg} p1 {pass1} own {own}{flags}"


def aot(args, hidden):
    """Registers and spill bytes of every candidate's plain bf16 backward compiled for sm_90."""
    import re
    import subprocess
    import tempfile

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("--aot compiles real kernels: unset TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flash_attn.ops.triton import layer_norm as ln

    from flash_attn.testing import cuobjdump_path

    tool = cuobjdump_path()
    kernel = ln._ln_bwd_kernel
    print(f"# sm_90, triton {triton.__version__}, {args.sms} SMs")
    print("| norm | hidden | candidate | config | registers | spill bytes | main-loop instructions | barriers |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    saved, real_num_sms = dict(ln.BWD_TUNED), ln.num_sms
    ln.num_sms = lambda device: args.sms
    try:
        for norm in args.norms:
            is_rms = norm == "R"
            n_acc = 1 if is_rms else 2
            for N in hidden:
                M = max(1, args.elems // N)
                for label, fields in candidates(args, norm, N):
                    ln.BWD_TUNED = dict(saved)
                    if fields:
                        ln.BWD_TUNED[(n_acc, N)] = dict(fields)
                    try:
                        cfg = ln._bwd_config(M, N, "cuda", n_acc)
                    except ValueError as e:
                        print(f"| {norm} | {N} | {label} | {e} | | | | |")
                        continue
                    absent = ("W1", "DY1", "DRES_OUT", "ROWSCALE", "DX1", "DRES_IN", "DW1_PART", "DB1_PART")
                    const = dict(IS_RMS_NORM=is_rms, HAS_BIAS=not is_rms, HAS_W1=False, HAS_B1=False,
                                 HAS_DRES_OUT=False, STORE_DRES_IN=False, HAS_X1=False, HAS_ROWSCALE=False,
                                 HAS_DROPOUT=False, ZERO_CENTERED=False, BLOCK_M=cfg.block_m, BLOCK_R=cfg.block_r,
                                 R_CHUNKS=cfg.r_chunks, BLOCK_N=cfg.block_n, SUB=cfg.sub, SPLIT=cfg.split,
                                 PREFETCH=cfg.prefetch, PAIR=cfg.pair, HOLD=cfg.hold,
                                 **{k: None for k in absent + (("DB_PART",) if is_rms else ())})
                    sig, div16 = {}, []
                    for i, name in enumerate(kernel.arg_names):
                        if name in const:
                            sig[name] = "constexpr"
                        elif name in ("X", "W", "DY", "DX"):
                            sig[name] = "*bf16"
                            div16.append(i)
                        elif name in ("MEAN", "RSTD", "DW_PART", "DB_PART"):
                            sig[name] = "*fp32"
                            div16.append(i)
                        elif name == "drop_scale":
                            sig[name] = "fp32"
                        else:
                            sig[name] = "i32"
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
                        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
                    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
                    n_ins, n_bar = _main_loop(sass)
                    print(f"| {'RMSNorm' if is_rms else 'LayerNorm'} | {N} | {label} | {cfg_str(cfg, args.sms)} | "
                          f"{regs} | {stack} | {n_ins} | {n_bar} |", flush=True)
    finally:
        ln.BWD_TUNED = saved
        ln.num_sms = real_num_sms


def _main_loop(sass):
    """(instructions, barriers) of the longest backward branch's body: the row loop."""
    import re

    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best = (0, -1)
    for addr, op, rest in ins:
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > best[1] - best[0]:
            best = (int(m.group(1), 16), addr)
    body = [op for addr, op, _ in ins if best[0] <= addr <= best[1]]
    return len(body), sum(op.startswith("BAR") for op in body)


if __name__ == "__main__":
    main()
