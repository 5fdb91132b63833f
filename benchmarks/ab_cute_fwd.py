"""A/B of CuTeDSL forward variants (environment switches) in one process, interleaved, so that machine
drift between device calls does not decide a comparison: flash_attn.cute.flash_attn_func, forward
only, do_bench medians, bf16, batch x seqlen = --tokens, heads = --hidden / head dim.

    python benchmarks/ab_cute_fwd.py --variants ";FLASH_ATTN_CUTE_FWD_PERSISTENT=1"

A variant is a comma-separated list of NAME=VALUE (empty: the defaults). Kernels compile on first use
(run `python -m flash_attn.cute.precompile` with each variant's variables first to fill the disk cache in
parallel).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _ints(s):
    return [int(x) for x in s.split(",")]


def _variant(spec):
    env = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, value = item.partition("=")
        env[name] = value
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True, help="';'-separated variants, each NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--headdims", type=_ints, default=[64, 128])
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096, 16384])
    ap.add_argument("--causal", type=_ints, default=[1, 0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the variants (interleaved)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=40)
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from flash_attn.cute import flash_attn_func
    from flash_attn.cute import interface as ci

    variants = [_variant(v) for v in args.variants.split(";")]
    names = sorted({n for v in variants for n in v})
    dtype = torch.bfloat16
    print(f"# {torch.cuda.get_device_name()}; bf16; tokens {args.tokens}; hidden {args.hidden}; TFLOP/s, best of "
          f"{args.rounds} interleaved rounds; forward")
    print("| D | S | causal | " + " | ".join(" ".join(f"{k}={v}" for k, v in var.items()) or "default"
                                             for var in variants) + " |")
    print("|---|---|---|" + "---|" * len(variants))
    for d in args.headdims:
        for s in args.seqlens:
            for causal in map(bool, args.causal):
                b, h = max(1, args.tokens // s), args.hidden // d
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, generator=g).to("cuda", dtype) for _ in range(3))
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                best = [0.0 for _ in variants]
                for _ in range(args.rounds):
                    for i, var in enumerate(variants):
                        for n in names:
                            os.environ.pop(n, None)
                        os.environ.update(var)
                        ci._kernels.clear()  # the in-memory cache does not key on the variables
                        t = do_bench(lambda: flash_attn_func(q, k, v, causal=causal), warmup=args.warmup,
                                     rep=args.rep, return_mode="median")
                        best[i] = max(best[i], flops / t / 1e9)
                print(f"| {d} | {s} | {causal} | " + " | ".join(f"{x:.0f}" for x in best) + " |",
                      flush=True)
    for n in names:
        os.environ.pop(n, None)


if __name__ == "__main__":
    main()
