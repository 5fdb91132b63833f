"""LayerNorm / RMSNorm backward: the Triton plan against the CuTeDSL wide-row kernel
(flash_attn.cute.norm_bwd, the default; FLASH_ATTN_DISABLE=ln_cute_bwd is the Triton plan), bf16, rows x hidden =
--elems. Same columns as benchmarks/ops/sweep_norm_bwd.py: backward time, its fraction of the device-to-device
copy bandwidth (6 bytes per element: read x and dy, write dx), and the largest gradient error against an
fp32 PyTorch reference (over dx, dweight, dbias, relative to the largest reference entry). "bwd x copy"
counts 6 bytes per element also with --residual (which moves 10: dresidual_out read, dresidual_in written).
"served": the compile key's threads and variants when the CuTeDSL kernel ran, else False (the call fell
back to Triton: see norm_bwd.plan).

--variants measures several CuTeDSL configurations in one process (Triton once): ';'-separated
THREADS:OPTS items, each FLASH_ATTN_CUTE_OVERRIDES' ln.threads=THREADS,ln.opts=OPTS added to the environment's
FLASH_ATTN_CUTE_OVERRIDES: THREADS empty for the environment's ln.threads or the THREADS_TABLE default, OPTS
'+'-joined ln.opts names, empty for the environment's ln.opts or the OPTS_TABLE default. Without it the
environment's FLASH_ATTN_CUTE_OVERRIDES applies as it is. The settings are read again for each path.

    python -m benchmarks.ops.bench_ln_cute_bwd                       # H200: 12288 and 16384, both norms
    python -m benchmarks.ops.bench_ln_cute_bwd --hidden 4096,8192,12288,16384 --weight-dtype fp32 --residual
    python -m benchmarks.ops.bench_ln_cute_bwd --norms L --hidden 16384 --variants "512:;1024:;1024:p1+p2;1024:vld"
"""
import argparse
import os
import sys

from benchmarks.common import set_environ

# (flash_attn/settings.py: the root package's switch; flash_attn/cute/settings.py: the kernel's tuning fields)
_DISABLE, _OVERRIDES = "FLASH_ATTN_DISABLE", "FLASH_ATTN_CUTE_OVERRIDES"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="12288,16384")
    p.add_argument("--norms", default="LR", help="L: LayerNorm, R: RMSNorm")
    p.add_argument("--elems", type=int, default=1 << 28, help="rows x hidden")
    p.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--residual", action="store_true", help="prenorm with a residual (dresidual in and out)")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetitions (ms)")
    p.add_argument("--variants", default=None, help="';'-separated THREADS:OPTS (see above)")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton plan")
    return p.parse_args(argv)


def variant_envs(spec):
    """[(label, {env var: value})] for --variants: FLASH_ATTN_CUTE_OVERRIDES' ln.threads / ln.opts items of each
    variant (absent: the environment as it is)."""
    if spec is None:
        return [("cute", {})]
    out = []
    for item in spec.split(";"):
        threads, _, opts = (x.strip() for x in item.strip().partition(":"))
        label = f"cute t{threads or 'table'} {opts or '-'}"
        fields = ",".join(f"ln.{name}={value}" for name, value in (("threads", threads), ("opts", opts)) if value)
        out.append((label, {_OVERRIDES: fields} if fields else {}))
    return out


def path_env(caller, cute, env):
    """The environment of one path, from the caller's {FLASH_ATTN_DISABLE: ..., FLASH_ATTN_CUTE_OVERRIDES: ...}:
    ln_cute_bwd disabled for the Triton plan, enabled for a CuTeDSL one (the other features as the caller set
    them), and a variant's overrides after the caller's (the later item of a field wins)."""
    disabled = [x.strip() for x in (caller.get(_DISABLE) or "").split(",") if x.strip() not in ("", "ln_cute_bwd")]
    overrides = ",".join(filter(None, (caller.get(_OVERRIDES), env.get(_OVERRIDES))))
    return {_DISABLE: ",".join(disabled + ([] if cute else ["ln_cute_bwd"])) or None, _OVERRIDES: overrides or None}


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from flash_attn.cute import norm_bwd as cb
    from flash_attn.ops.triton import backend
    from flash_attn.ops.triton import layer_norm as ln

    if not torch.cuda.is_available():
        sys.exit("bench_ln_cute_bwd.py needs a CUDA GPU")
    dev, dt = "cuda", torch.bfloat16
    wdt = torch.float32 if args.weight_dtype == "fp32" else dt
    bench = lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")  # noqa: E731
    src = torch.empty(1 << 29, device=dev, dtype=dt).normal_()
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / copy_ms / 1e6
    src = dst = None
    print(f"# copy: {copy_gbs:.0f} GB/s; {torch.cuda.get_device_name()}; torch {torch.__version__}; weights "
          f"{args.weight_dtype}; residual {args.residual}", flush=True)
    print("| norm | hidden | path | bwd us | bwd x copy | grad err | served |")
    print("|---|---|---|---|---|---|---|", flush=True)
    calls, launch = [], cb.launch

    def counted(*a):
        calls.append(a[0])
        return launch(*a)

    cb.launch = counted
    saved = {k: os.environ.get(k) for k in (_DISABLE, _OVERRIDES)}
    paths = ([] if args.no_triton else [("triton plan", path_env(saved, False, {}))])
    paths += [(label, path_env(saved, True, env)) for label, env in variant_envs(args.variants)]
    try:
        for norm in args.norms:
            is_rms = norm == "R"
            for N in [int(h) for h in args.hidden.split(",") if h]:
                M = max(1, args.elems // N)
                g = torch.Generator(device=dev).manual_seed(N)
                x = torch.randn(M, N, device=dev, dtype=dt, generator=g).requires_grad_()
                w = (1 + 0.5 * torch.randn(N, device=dev, generator=g)).to(wdt).requires_grad_()
                b = None if is_rms else torch.randn(N, device=dev, generator=g).to(wdt).requires_grad_()
                res = torch.randn(M, N, device=dev, dtype=dt, generator=g) if args.residual else None
                dy = torch.randn(M, N, device=dev, dtype=dt, generator=g)
                params = [t for t in (x, w, b) if t is not None]
                xf = x.detach().float().requires_grad_()
                wf = w.detach().float().requires_grad_()
                bf = b.detach().float().requires_grad_() if b is not None else None
                pre = xf + res.float() if res is not None else xf
                if is_rms:
                    yf = pre * torch.rsqrt(pre.square().mean(-1, keepdim=True) + 1e-6) * wf
                else:
                    yf = F.layer_norm(pre, (N,), wf, bf, 1e-6)
                refs = torch.autograd.grad(yf, [t for t in (xf, wf, bf) if t is not None], dy.float())
                yf = xf = wf = bf = pre = None
                scale = [r.abs().max().clamp_min(1e-30) for r in refs]
                for path, env in paths:
                    set_environ(env)  # (and both settings readers reloaded)
                    with backend("triton"):
                        out = ln.layer_norm_fn(x, w, b, residual=res, eps=1e-6, is_rms_norm=is_rms,
                                               prenorm=args.residual)
                        outs = list(out) if isinstance(out, tuple) else [out]
                        gouts = [dy] + ([torch.zeros_like(dy)] if args.residual else [])
                        calls.clear()
                        grads = torch.autograd.grad(outs, params, gouts, retain_graph=True)
                        served = f"t{calls[0][8]} {'+'.join(calls[0][9]) or '-'}" if calls else False
                        err = max(((a.float() - r).abs().max() / s).item() for a, r, s in zip(grads, refs, scale))
                        grads = None
                        t_b = bench(lambda: torch.autograd.grad(outs, params, gouts, retain_graph=True))
                    outs = out = None
                    print(f"| {'RMSNorm' if is_rms else 'LayerNorm'} | {N} | {path} | {t_b * 1e3:.1f} | "
                          f"{6 * M * N / t_b / 1e6 / copy_gbs:.3f} | {err:.1e} | {served} |", flush=True)
                x = w = b = dy = res = params = refs = None
                torch.cuda.empty_cache()
    finally:
        cb.launch = launch
        set_environ(saved)


if __name__ == "__main__":
    main()
