"""The GPT training call's fused add+norm (bf16 x, fp32 residual stream and parameters, prenorm) forward +
backward, with the bias of the Linear before it in its GEMM or moved into the norm as x_bias:

    gemm bias       layer_norm_fn, plus the bias gradient as nn.Linear's backward computes it (the output
                    gradient summed over the rows, one more read of it)
    x_bias          layer_norm_fn(..., x_bias=b): the kernel sums dx with dweight's partials (n_acc 3)
    x_bias acc x2   the same with BWD_ACC_REGS doubled, so that the third accumulator does not split the
                    rows over two programs (at N=1024: one program per row group, 96 registers, no spill)
    norm only       layer_norm_fn without any bias gradient (the floor)

    python benchmarks/bench_norm_xbias.py                         # H200: 16384 x 1024 (GPT-2 medium)
    python benchmarks/bench_norm_xbias.py --rows 16384 --hidden 1024,2048,4096 --rms

Prints, per variant, the launch configuration of the backward kernel and the forward + backward time, and
checks that every variant's bias gradient matches the "gemm bias" one.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from flash_attn.ops.triton import layer_norm as ln  # noqa: E402


def _inputs(M, N, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s, dt=torch.float32: torch.randn(*s, generator=g).to(device=device, dtype=dt)  # noqa: E731
    x = mk(M, N, dt=torch.bfloat16 if device == "cuda" else torch.float32).requires_grad_()
    residual = mk(M, N).requires_grad_()
    weight, bias, b = (1 + 0.1 * mk(N)).requires_grad_(), mk(N).requires_grad_(), mk(N).requires_grad_()
    dy = mk(M, N, dt=x.dtype)
    dres = mk(M, N)
    # What the Linear with its bias returns (the bias added in its GEMM's epilogue, at no cost here).
    x_plus_b = (x.detach().float() + b.detach()).to(x.dtype).requires_grad_()
    return x, x_plus_b, residual, weight, bias, b, dy, dres


def _step(variant, x, x_plus_b, residual, weight, bias, b, dy, dres, is_rms):
    """Forward + backward of one variant; returns the bias gradient (None for "norm only")."""
    xb = b if variant.startswith("x_bias") else None
    if xb is None:
        x = x_plus_b
    y, res = ln.layer_norm_fn(x, weight, None if is_rms else bias, residual=residual, prenorm=True,
                              is_rms_norm=is_rms, x_bias=xb)
    params = [x, residual, weight] + ([] if is_rms else [bias]) + ([xb] if xb is not None else [])
    grads = torch.autograd.grad((y, res), params, (dy, dres))
    if variant == "gemm bias":
        return grads[0].sum(0, dtype=torch.float32)  # nn.Linear: its output gradient summed over the rows
    return grads[-1] if xb is not None else None


def _cfg(M, N, device, variant, is_rms, x, dy):
    n_acc = (1 if is_rms else 2) + int(variant.startswith("x_bias"))
    cfg = ln._bwd_config(M, N, device, n_acc, ln._bwd_extra(torch.empty(0, dtype=torch.float32), dy, None,
                                                            dy, dy, None, None, 0.0))
    return f"split {cfg.split}, {cfg.num_warps} warps, {cfg.block_n}x{cfg.sub} own cols, maxnreg {cfg.maxnreg}"


VARIANTS = ("gemm bias", "x_bias", "x_bias acc x2", "norm only")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--hidden", default="1024")
    p.add_argument("--rms", action="store_true", help="RMSNorm instead of LayerNorm")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    on_gpu = args.device == "cuda"
    print(f"# {'RMSNorm' if args.rms else 'LayerNorm'} training call, {args.rows} rows, forward + backward"
          + ("" if on_gpu else " (CPU: correctness only, no timings)"))
    print("| hidden | variant | backward launch | fwd+bwd (us) |")
    print("|---|---|---|---:|")
    for N in (int(h) for h in args.hidden.split(",")):
        t = _inputs(args.rows, N, args.device)
        want = None
        for variant in VARIANTS:
            acc = ln.BWD_ACC_REGS
            if variant == "x_bias acc x2":
                ln.BWD_ACC_REGS = 2 * acc
            try:
                db = _step(variant, *t, args.rms)
                if variant == "gemm bias":
                    want = db
                elif db is not None:
                    err = (db.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                    if not err < 1e-2:
                        raise SystemExit(f"{variant} at {N}: bias gradient off by {err:.2e} (relative)")
                us = float("nan")
                if on_gpu:
                    import triton

                    us = 1000 * triton.testing.do_bench(lambda: _step(variant, *t, args.rms), rep=args.rep)
                print(f"| {N} | {variant} | {_cfg(args.rows, N, args.device, variant, args.rms, t[0], t[6])} | "
                      f"{us:.1f} |", flush=True)
            finally:
                ln.BWD_ACC_REGS = acc
    return 0


if __name__ == "__main__":
    sys.exit(main())
