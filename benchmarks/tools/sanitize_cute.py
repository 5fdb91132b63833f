"""Small calls of every kind of flash_attn.cute forward kernel the default selection runs, for compute-sanitizer
(the issue asks for racecheck and memcheck clean on a few small cases, for every kernel kind: one-tile, persistent,
TMA O, lpt, long-key, 3-warpgroup, pack_gqa, paged, split-KV):

    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python -m benchmarks.tools.sanitize_cute [--only NAME,NAME] [--list]

(`bash benchmarks/run_gpu.sh sanitize` runs racecheck, memcheck and synccheck over all of them;
`CUTE_DSL_ARCH=sm_90a FLASH_ATTN_CUTE_CACHE=DIR python -m benchmarks.tools.sanitize_cute --compile-only` builds their
kernels on a CPU first.) Each case runs
one call, checks that the kernel the selection predicts for it (``expected_config``: short-key, long-key,
persistent, TMA O ...) is the one that ran, and compares out with the reference by the project's criterion, so a
race that the sanitizer does not see (TMA and WGMMA use the async proxy) can still show as a wrong answer.
Exit status 1 when a case fails.
"""
import argparse
import sys


# name -> (dtype name, head dim, batch, seqlen_q, seqlen_k, heads, kv heads, options): options as flash_attn_func
# takes them (causal, window_size, softcap, sink, pack_gqa, num_splits) plus "varlen" (a list of (seqlen_q,
# seqlen_k) per sequence, the batch / lengths above unused), "paged" (varlen: k / v in a shuffled cache of pages of
# this many rows) and "dv" (v's head dim, when not the head dim). Sizes: more tiles than a persistent kernel has
# CTAs (132 on an H200) where the case is about the persistent loop, otherwise small.
CASES = {
    "d128_causal_tma_o_lpt": ("bf16", 128, 2, 1500, 1500, 4, 2, dict(causal=True)),
    "d128_causal_short": ("bf16", 128, 2, 1000, 1000, 4, 4, dict(causal=True)),
    "d128_short_persistent_tma_o": ("bf16", 128, 4, 900, 1000, 8, 2, dict()),
    "d128_fp16_direct_store": ("fp16", 128, 2, 1500, 1500, 4, 4, dict()),
    "d64_causal_persistent": ("bf16", 64, 4, 600, 600, 8, 8, dict(causal=True)),
    "d64_persistent_3wg": ("bf16", 64, 4, 600, 700, 8, 4, dict()),
    "d64_causal_long_3wg": ("bf16", 64, 1, 300, 8192, 2, 1, dict(causal=True, pack_gqa=False)),  # (None would pack)
    "d256_causal_tma_o": ("bf16", 256, 2, 700, 700, 2, 1, dict(causal=True)),
    "d96_window": ("bf16", 96, 2, 500, 800, 4, 2, dict(window_size=(128, 32))),
    "d192_softcap": ("fp16", 192, 1, 400, 400, 4, 4, dict(softcap=30.0)),
    "d128_sink": ("bf16", 128, 2, 300, 300, 4, 2, dict(causal=True, sink=True)),
    "d128_varlen_causal": ("bf16", 128, 0, 0, 0, 4, 2, dict(causal=True, varlen=[(300, 300), (0, 0), (129, 500),
                                                                                 (1, 77)])),
    # pack_gqa: 8 and 4 query heads per KV head, v's head dim 128 with q's 192, paged K / V, split-KV (with
    # FLASH_ATTN_CUTE_DISABLE=pack_gqa,split the pack_gqa and split cases expect and run the unpacked / unsplit
    # kernels; with FLASH_ATTN_CUTE_DISABLE=hdim_v,paged the others are refused)
    "d128_causal_pack8": ("bf16", 128, 2, 37, 700, 16, 2, dict(causal=True, pack_gqa=True)),
    "d64_varlen_pack4_sink_window": ("bf16", 64, 0, 0, 0, 8, 2, dict(window_size=(100, 0), sink=True, pack_gqa=True,
                                                                    varlen=[(1, 300), (45, 45), (0, 9), (200, 260)])),
    "d192_v128_causal": ("bf16", 192, 2, 333, 700, 4, 2, dict(causal=True, dv=128)),
    "d128_paged16_causal": ("bf16", 128, 0, 0, 0, 8, 2, dict(causal=True, paged=16, varlen=[(1, 500), (77, 77),
                                                                                         (5, 0), (130, 1000)])),
    "d128_causal_split3_sink": ("bf16", 128, 2, 5, 3000, 16, 2, dict(causal=True, sink=True, num_splits=3)),
    "d256_paged256_pack4": ("bf16", 256, 0, 0, 0, 8, 2, dict(pack_gqa=True, paged=256, varlen=[(3, 700), (64, 300)])),
    "d64_paged64_split4_sink": ("bf16", 64, 0, 0, 0, 8, 2, dict(causal=True, sink=True, paged=64, num_splits=4,
                                                                 varlen=[(1, 2000), (0, 9), (40, 40), (3, 0)])),
}


def expected_config(case, flags=False):
    """The forward config flash_attn.cute's selection gives this case (kernels.fwd_config with the short /
    long choice launch.forward() makes from the key length, as FwdConfig.key()'s dict), and the in-memory key
    of its kernel (``flags``: and the (dtype, head dim, causal, options) that fwd_kernel / load_or_build take)."""
    import torch

    from flash_attn.cute import kernels, plan

    dt, d, b, sq, sk, h, hk, opt = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    varlen = "varlen" in opt
    if varlen:
        sk = max(k for _, k in opt["varlen"])
    window = opt.get("window_size", (-1, -1))
    local = window != (-1, -1)
    causal = bool(opt.get("causal")) and not local
    softcap, sink = bool(opt.get("softcap")), bool(opt.get("sink"))
    pack = plan._pack_group(opt.get("pack_gqa"), h, hk, max(a for a, _ in opt["varlen"]) if varlen else sq)
    dv, paged = opt.get("dv"), opt.get("paged", 0)
    split = plan._split_count(opt.get("num_splits", 1)) > 1
    sink = sink and not split  # the split kernel leaves the sink to the host's merge
    plain = not (varlen or local or softcap or sink or pack > 1 or dv or split)
    short, long = plan._length_kernel(d, causal, sk, plain)
    config = kernels.fwd_config(dtype, d, causal, "sm_90a", local, softcap, varlen, sink, short, long, pack, dv,
                                paged, split).key()
    key = ((dtype, d, causal, "sm_90a", local, softcap) + ((True,) if varlen else ()) + (("sink",) if sink else ())
           + (("short",) if short else ()) + (("long",) if long else ()) + (("pack", pack) if pack > 1 else ())
           + (("dv", dv) if dv else ()) + (("paged", paged) if paged else ()) + (("split",) if split else ()))
    if flags:
        return config, key, (dtype, d, causal, dict(local=local, softcap=softcap, varlen=varlen, sink=sink,
                                                     short=short, long=long, pack=pack, dv=dv, paged=paged,
                                                     split=split))
    return config, key


def run_case(name, case):
    import torch

    from flash_attn import testing
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func, kernels

    dt, d, b, sq, sk, h, hk, opt = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    g = torch.Generator().manual_seed(len(name))
    kw = {k: v for k, v in opt.items() if k in ("causal", "window_size", "softcap", "pack_gqa", "num_splits")}
    sink = torch.randn(h, generator=g).cuda() if opt.get("sink") else None
    _, key = expected_config(case)
    if "varlen" in opt:
        lens = opt["varlen"]
        qs = [torch.randn(1, a, h, d, generator=g).to("cuda", dtype) for a, _ in lens]
        ks = [torch.randn(1, c, hk, d, generator=g).to("cuda", dtype) for _, c in lens]
        vs = [torch.randn(1, c, hk, opt.get("dv", d), generator=g).to("cuda", dtype) for _, c in lens]
        cu = lambda n: torch.tensor([0] + [sum(n[:i + 1]) for i in range(len(n))], dtype=torch.int32,  # noqa: E731
                                    device="cuda")
        if opt.get("paged"):  # each sequence's keys in its own shuffled pages of one cache
            page, s_max = opt["paged"], max(c for _, c in lens)
            pad = lambda t: torch.cat([t, t.new_zeros(1, s_max - t.shape[1], *t.shape[2:])], 1)  # noqa: E731
            k_cache, table = testing.paged_from_dense(torch.cat([pad(t) for t in ks]), page, generator=g)
            v_cache, _ = testing.paged_from_dense(torch.cat([pad(t) for t in vs]), page, block_table=table)
            out, _ = flash_attn_varlen_func(torch.cat(qs, 1)[0], k_cache, v_cache, cu_seqlens_q=cu([a for a, _ in lens]), cu_seqlens_k=None,
                                            seqused_k=torch.tensor([c for _, c in lens], dtype=torch.int32,
                                                                   device="cuda"),
                                            page_table=table, learnable_sink=sink, **kw)
        else:
            out, _ = flash_attn_varlen_func(torch.cat(qs, 1)[0], torch.cat(ks, 1)[0], torch.cat(vs, 1)[0],
                                            cu_seqlens_q=cu([a for a, _ in lens]), cu_seqlens_k=cu([c for _, c in lens]), learnable_sink=sink,
                                            **kw)
        torch.cuda.synchronize()
        pieces = list(torch.split(out, [a for a, _ in lens]))
        pairs = [(pieces[i][None], qs[i], ks[i], vs[i]) for i in range(len(lens)) if lens[i][0] and lens[i][1]]
    else:
        q = torch.randn(b, sq, h, d, generator=g).to("cuda", dtype)
        k = torch.randn(b, sk, hk, d, generator=g).to("cuda", dtype)
        v = torch.randn(b, sk, hk, opt.get("dv", d), generator=g).to("cuda", dtype)
        out, _ = flash_attn_func(q, k, v, learnable_sink=sink, **kw)
        torch.cuda.synchronize()
        pairs = [(out, q, k, v)]
    if key not in kernels._kernels:
        raise AssertionError(f"{name}: the kernel {key} did not run (ran: {sorted(map(str, kernels._kernels))})")
    ref_kw = dict(causal=bool(opt.get("causal")), window_size=opt.get("window_size", (-1, -1)),
                  softcap=opt.get("softcap", 0.0), learnable_sink=sink)
    for o, q, k, v in pairs:
        o_ref, _ = testing.attention_ref(q, k, v, **ref_kw)
        o_pt, _ = testing.attention_ref(q, k, v, upcast=False, reorder_ops=True, **ref_kw)
        testing.assert_close_to_ref(o, o_ref, o_pt, f"{name} out")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated case names (default: all)")
    p.add_argument("--list", action="store_true", help="print each case's expected kernel config and exit")
    p.add_argument("--compile-only", action="store_true",
                   help="build the cases' kernels into the disk cache ($FLASH_ATTN_CUTE_CACHE; no GPU needed: "
                        "CUTE_DSL_ARCH=sm_90a) and exit")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if args.list:
        for n in names:
            print(n, expected_config(CASES[n])[0])
        return 0
    if args.compile_only:
        from flash_attn.cute import cache, kernels

        if cache.cache_dir() is None:
            p.error("--compile-only writes the disk cache: set FLASH_ATTN_CUTE_CACHE")
        for n in names:
            _, _, (dtype, d, causal, opts) = expected_config(CASES[n], flags=True)
            _, how = kernels.load_or_build(dtype, d, causal, "sm_90a", cache.cache_dir(), **opts)
            print(f"{n}: {how}", flush=True)
        return 0
    failed = 0
    for n in names:
        try:
            run_case(n, CASES[n])
            print(f"{n}: ok", flush=True)
        except Exception as e:  # every case runs; the exit status says whether one failed
            failed += 1
            print(f"{n}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
