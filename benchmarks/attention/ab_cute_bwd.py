"""A/B of CuTeDSL backward variants (environment settings) in one process, interleaved, so that machine
drift between device calls does not decide a comparison. For each shape and each variant: the kernel
alone (inputs prepared as launch.backward prepares them) and the whole backward call (host steps
included), do_bench medians, bf16, batch x seqlen = --tokens, heads = --hidden / head dim.

    python -m benchmarks.attention.ab_cute_bwd \\
        --variants "FLASH_ATTN_CUTE_OVERRIDES=bwd.lpt=0;FLASH_ATTN_CUTE_OVERRIDES=bwd.lpt=128"
    python -m benchmarks.attention.ab_cute_bwd --variants ";FLASH_ATTN_CUTE_OVERRIDES=bwd.block_m=128" --headdims 64
    python -m benchmarks.attention.ab_cute_bwd --variants ";FLASH_ATTN_CUTE_OVERRIDES=bwd.dq_tma=0,bwd.overlap=1"
    python -m benchmarks.attention.ab_cute_bwd --variants ";FLASH_ATTN_CUTE_OVERRIDES=plan.bwd_gqa_loop=1" --group 4

--group G: G query heads per KV head (GQA); the kernel-alone column is then nan (its stand-in inputs
are MHA-shaped), the whole call includes the per-query-head dK / dV sums a kernel leaves to the host.
--softcap CAP: the whole call with soft-capped scores (the kernel-alone column is nan).
--varlen: the whole call through flash_attn_varlen_func on the same tokens packed as batch sequences whose lengths
alternate 3/4 and 5/4 of S (the varlen kernel; the kernel-alone column is nan), e.g. the TMA dK / dV store there:

    python -m benchmarks.attention.ab_cute_bwd --varlen --variants ";FLASH_ATTN_CUTE_OVERRIDES=bwd.tma_dkv=1"

A variant is a comma-separated list of NAME=VALUE (empty: the defaults); an item that does not start with an
upper-case NAME= continues the previous value, so FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE keep their
own comma-separated lists. The settings are read again after each switch (flash_attn.cute.settings.reload()).
Kernels compile on first use (run `python -m flash_attn.cute.precompile --backward` with each variant's
variables first to fill the disk cache in parallel).
"""
import argparse
import os

from benchmarks.common import env_items, reload_settings
from benchmarks.common import ints as _ints


def parser(doc, seqlens):
    """The A/B scripts' shared arguments (ab_cute_fwd.py uses it too)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True, help="';'-separated variants, each NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--headdims", type=_ints, default=[64, 128])
    ap.add_argument("--seqlens", type=_ints, default=seqlens)
    ap.add_argument("--causal", type=_ints, default=[1, 0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the variants (interleaved; as many as "
                    "there are variants times k puts every variant first equally often)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=40)
    return ap


def variants(spec):
    """[{NAME: VALUE}] of a --variants string (an empty variant: the defaults) and every NAME in it; each variant
    is parsed by common.env_items (an item that is not NAME=VALUE with an upper-case NAME continues the previous
    value; FLASH_ATTN_TRITON_* are refused: they cannot switch inside a process)."""
    out = [env_items(v) for v in spec.split(";")]
    return out, sorted({n for v in out for n in v})


def apply(var, names):
    """The environment of one variant: its NAMEs set, the other variants' NAMEs unset, and the settings read
    again."""
    for n in names:
        os.environ.pop(n, None)
    os.environ.update(var)
    reload_settings()


def round_order(variants_, r):
    """(index, variant) pairs of round r: the variants' order rotated by r, so that over n rounds every one
    of n variants is timed first once. The first-timed variant of a shape runs right after the inputs are
    made (the GPU idle, its clocks up): identical kernels measure 0-8% apart in a fixed order, and with the
    ABBA order (reversed every other round) and the best of the rounds the first and last variants' identical
    kernels come out up to 13% above the middle ones."""
    pairs = list(enumerate(variants_))
    k = r % len(pairs) if pairs else 0
    return pairs[k:] + pairs[:k]


def summary(values):
    """One number per variant from its rounds: the median (a lucky first-timed round does not decide)."""
    import statistics

    return statistics.median(values)


def header(kind, args, variants_):
    import torch

    print(f"# {torch.cuda.get_device_name()}; bf16; tokens {args.tokens}; hidden {args.hidden}; TFLOP/s, median "
          f"of {args.rounds} interleaved rounds (order rotated per round); {kind}")
    print("| D | S | causal | " + " | ".join(" ".join(f"{k}={v}" for k, v in var.items()) or "default"
                                             for var in variants_) + " |")
    print("|---|---|---|" + "---|" * len(variants_))


def main(argv=None):
    ap = parser(__doc__, [2048, 8192])
    ap.add_argument("--group", type=int, default=1, help="query heads per KV head (GQA)")
    ap.add_argument("--varlen", action="store_true", help="the whole call on packed sequences of varied lengths")
    ap.add_argument("--softcap", type=float, default=0.0, help="the whole call with this softcap (dense)")
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from benchmarks.attention.bench_cute_bwd import kernel_call

    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func, kernels

    variants_, names = variants(args.variants)
    dtype = torch.bfloat16
    header("kernel alone / whole backward call", args, variants_)
    for d in args.headdims:
        for s in args.seqlens:
            for causal in map(bool, args.causal):
                b, h = max(1, args.tokens // s), args.hidden // d
                g = torch.Generator().manual_seed(0)
                hk = h // args.group
                q, dout = (torch.randn(b, s, h, d, generator=g).to("cuda", dtype) for _ in range(2))
                k, v = (torch.randn(b, s, hk, d, generator=g).to("cuda", dtype) for _ in range(2))
                if args.varlen:  # b sequences, lengths alternating 3/4 and 5/4 of s (the same tokens)
                    lens = varlen_lengths(b, s)
                    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
                    q, k, v, dout = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v, dout))
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    out_g, _ = flash_attn_varlen_func(qg, kg, vg, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                      max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=causal)
                    flops = 2.5 * 4 * sum(n * n for n in lens) * h * d / (2 if causal else 1)
                else:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    out_g, lse = flash_attn_func(qg, kg, vg, causal=causal, softcap=args.softcap, return_lse=True)
                    out = out_g.detach()
                    flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
                rates = [([], []) for _ in variants_]
                for r in range(args.rounds):
                    for i, var in round_order(variants_, r):
                        apply(var, names)
                        kernels._bwd_kernels.clear()  # the in-memory cache does not key on the settings
                        t_k = float("nan") if args.group > 1 or args.varlen or args.softcap else do_bench(
                            kernel_call(q, k, v, dout, out, lse, causal), warmup=args.warmup, rep=args.rep,
                            return_mode="median")
                        t_c = do_bench(lambda: torch.autograd.grad(out_g, (qg, kg, vg), dout, retain_graph=True),
                                       warmup=args.warmup, rep=args.rep, return_mode="median")
                        rates[i][0].append(flops / t_k / 1e9)
                        rates[i][1].append(flops / t_c / 1e9)
                print(f"| {d} | {s} | {causal} | " + " | ".join(f"{summary(a):.0f} / {summary(c):.0f}"
                                                               for a, c in rates) + " |",
                      flush=True)
    apply({}, names)


def varlen_lengths(b, s):
    """--varlen's sequence lengths: b of them alternating 3/4 and 5/4 of s (a last odd one s), b * s tokens in all."""
    lens = [(3 * s) // 4 if i % 2 == 0 else 2 * s - (3 * s) // 4 for i in range(b)]
    if b % 2:
        lens[-1] = s
    return lens


if __name__ == "__main__":
    main()
