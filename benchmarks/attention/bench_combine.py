"""flash_attn.cute.flash_attn_combine: the fused Triton kernel (one launch) against the torch expression it replaces
(combine.combine_torch, the cast to the output dtype and the heads-major lse: about six passes over memory), both
through the public call, interleaved per shape. do_bench medians (us) and the kernel's effective bandwidth (GB/s:
out_partial and lse_partial read once, out and lse written once). bf16 parts, out_partial (splits, rows, 1, H, D)
with rows = batch x seqlen.

    python -m benchmarks.attention.bench_combine [--splits 4,16,64] [--rows 1,16,256,4096] [--heads 32]
        [--headdim 128] [--output results.md]
"""
import argparse
import contextlib

from benchmarks import common
from benchmarks.common import ints as _ints


@contextlib.contextmanager
def torch_path(combine):
    """flash_attn_combine with the kernel switched off: the torch expression serves every call."""
    real = combine.use_kernel
    combine.use_kernel = lambda *a: False
    try:
        yield
    finally:
        combine.use_kernel = real


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", type=_ints, default=[4, 16, 64], help="num_splits values")
    ap.add_argument("--rows", type=_ints, default=[1, 16, 256, 4096], help="batch x seqlen values")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    ap.add_argument("--output", default=None, help="also write the table to this Markdown file")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    import torch
    import triton.testing

    from flash_attn.cute import combine

    if not torch.cuda.is_available():
        raise SystemExit("bench_combine needs a CUDA GPU")
    H, D = args.heads, args.headdim
    lines = common.header("benchmarks.attention.bench_combine", argv)
    lines += [f"- shapes: out_partial (splits, rows, 1, {H}, {D}) bf16, lse_partial fp32; out bf16", "",
              "| splits | rows | fused (us) | torch (us) | speed-up | fused GB/s | max abs diff |",
              "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for splits in args.splits:
        for rows in args.rows:
            g = torch.Generator(device="cuda").manual_seed(0)
            o = torch.randn(splits, rows, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
            lse = torch.randn(splits, rows, 1, H, device="cuda", generator=g) * 2 + 5
            if not combine.use_kernel(o, lse, o.dtype, o.device):
                raise SystemExit("the fused kernel does not serve these tensors (Triton missing?)")
            fused_out, _ = combine.flash_attn_combine(o, lse)
            with torch_path(combine):
                torch_out, _ = combine.flash_attn_combine(o, lse)
                t_torch = triton.testing.do_bench(lambda: combine.flash_attn_combine(o, lse), warmup=args.warmup,
                                                  rep=args.rep)
            t_fused = triton.testing.do_bench(lambda: combine.flash_attn_combine(o, lse), warmup=args.warmup,
                                              rep=args.rep)
            nbytes = o.numel() * o.element_size() + lse.numel() * 4 + rows * H * (D * 2 + 4)
            diff = (fused_out.float() - torch_out.float()).abs().max().item()
            line = (f"| {splits} | {rows} | {t_fused * 1e3:.1f} | {t_torch * 1e3:.1f} | {t_torch / t_fused:.2f}x | "
                    f"{nbytes / (t_fused * 1e-3) / 1e9:.0f} | {diff:.2e} |")
            lines.append(line)
            print(line, flush=True)
    if args.output:
        with open(args.output, "w") as f:
            f.write("# flash_attn_combine: fused Triton kernel vs torch ops\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
