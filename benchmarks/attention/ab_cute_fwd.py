"""A/B of CuTeDSL forward variants (environment settings) in one process, interleaved, so that machine
drift between device calls does not decide a comparison: flash_attn.cute.flash_attn_func, forward
only, do_bench medians, bf16, batch x seqlen = --tokens, heads = --hidden / head dim.

    python -m benchmarks.attention.ab_cute_fwd --variants ";FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=1"
    python -m benchmarks.attention.ab_cute_fwd --headdims 64 \\
        --variants ";FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=0,fwd.warpgroups=3"
    python -m benchmarks.attention.ab_cute_fwd --softcap 30 --variants ";FLASH_ATTN_CUTE_OVERRIDES=fwd.tma_o=1"

--softcap CAP / --window LEFT: the calls with that softcap / sliding window (left size; right 0 when causal, else
LEFT too); their TFLOP/s count the dense (or causal) pairs all the same, so compare variants, not shapes.

A variant is a comma-separated list of NAME=VALUE (empty: the defaults; parsed as ab_cute_bwd's, so
FLASH_ATTN_CUTE_OVERRIDES' own comma-separated fields stay one value). The settings are read again after
each switch. Kernels compile on first use (run `python -m flash_attn.cute.precompile` with each variant's
variables first to fill the disk cache in parallel).
"""
from benchmarks.attention.ab_cute_bwd import apply, header, parser, round_order, summary, variants


def main(argv=None):
    ap = parser(__doc__, [1024, 4096, 16384])
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--window", type=int, default=-1, help="left window size (-1: none)")
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from flash_attn.cute import flash_attn_func
    from flash_attn.cute import kernels

    variants_, names = variants(args.variants)
    dtype = torch.bfloat16
    header("forward", args, variants_)
    for d in args.headdims:
        for s in args.seqlens:
            for causal in map(bool, args.causal):
                b, h = max(1, args.tokens // s), args.hidden // d
                g = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, generator=g).to("cuda", dtype) for _ in range(3))
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                rates = [[] for _ in variants_]
                for r in range(args.rounds):
                    for i, var in round_order(variants_, r):
                        apply(var, names)
                        kernels._kernels.clear()  # the in-memory cache does not key on the settings
                        window = ((None, None) if args.window < 0 else
                                  (args.window, 0 if causal else args.window))
                        t = do_bench(lambda: flash_attn_func(q, k, v, causal=causal, softcap=args.softcap,
                                                             window_size=window),
                                     warmup=args.warmup, rep=args.rep, return_mode="median")
                        rates[i].append(flops / t / 1e9)
                print(f"| {d} | {s} | {causal} | " + " | ".join(f"{summary(x):.0f}" for x in rates) + " |",
                      flush=True)
    apply({}, names)


if __name__ == "__main__":
    main()
