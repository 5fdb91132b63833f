"""flash_attn_with_kvcache on decoding shapes: the default split choice against fixed num_splits values and PyTorch's
SDPA (enable_gqa) on the same cache, to settle the split-KV heuristic (kvcache.choose_num_splits); with --cute, the
CuTeDSL forward on the same cache (flash_attn.cute's batch-shaped varlen call with seqused_k, the form a KV-cache
call takes there: num_splits=0 (its own split choice) with pack_gqa, and unsplit with pack_gqa); with --root, the
root flash_attn_func on the full cache (what Hugging Face's flash_attention_2 decoding calls); with --cute-kvcache,
flash_attn_with_kvcache on the cute backend (plan.kvcache=1, the backend forced); with --append, every
flash_attn_with_kvcache call appends one new token (cache_seqlens Sk - 1, the decoding step). Per shape, every
variant runs in interleaved rounds (CUDA-event timing of a burst of calls, the median of the rounds kept);
microseconds per call (wall time of a burst; then the GPU time per call from the profiler) and the rate at which
the call reads K and V at its GPU time (GB/s = cache bytes read / time). Every variant's output is compared with
SDPA's (bf16 rounding), so a variant that computes something else shows.

    python -m benchmarks.attention.bench_kvcache_decode [--shapes B:Sk:H:Hk:D,...] [--splits 0,1,8,16,32,64,128]
        [--cute] [--root] [--cute-kvcache] [--append]

Shapes default to issue 32's table (one query token, H 32, Hk 8, d 128, bf16, full caches): 1x8k, 1x64k, 8x8k,
8x32k, 32x8k, 64x4k. num_splits 0 is the default heuristic; the kernel caps larger values at its MAX_SPLITS.
"""
import argparse
import statistics

from benchmarks import common

DEFAULT_SHAPES = "1:8192:32:8:128,1:65536:32:8:128,8:8192:32:8:128,8:32768:32:8:128,32:8192:32:8:128,64:4096:32:8:128"


def parse_shapes(spec):
    """[(B, Sk, H, Hk, D)] of a comma-separated B:Sk:H:Hk:D list."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        fields = item.split(":")
        if len(fields) != 5:
            raise ValueError(f"shape {item!r}: expected B:Sk:H:Hk:D")
        b, sk, h, hk, d = map(int, fields)
        if h % hk:
            raise ValueError(f"shape {item!r}: H ({h}) must be a multiple of Hk ({hk})")
        out.append((b, sk, h, hk, d))
    return out


def _time_us(fn, reps):
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def _out(result):
    return result[0] if isinstance(result, tuple) else result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--splits", default="0,1,8,16,32,64,128", help="num_splits values (0: the default heuristic)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cute", action="store_true", help="also time flash_attn.cute on the same cache")
    ap.add_argument("--root", action="store_true",
                    help="also time the root flash_attn_func on the same (full) cache: the dispatcher's dense path")
    ap.add_argument("--cute-kvcache", action="store_true",
                    help="also time flash_attn_with_kvcache on the cute backend (plan rule kvcache on)")
    ap.add_argument("--append", action="store_true", help="flash_attn_with_kvcache calls append one token")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    splits = [int(x) for x in args.splits.split(",") if x.strip()]

    import torch
    import torch.nn.functional as F

    import flash_attn
    from flash_attn import flash_attn_with_kvcache

    if not torch.cuda.is_available():
        raise SystemExit("bench_kvcache_decode needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, flash_attn {flash_attn.__version__}; "
          f"wall us per call / GPU us per call (GB/s of K + V read at the GPU time); max |out - sdpa| per shape")
    names = [f"splits={s}" if s else "default" for s in splits]
    if args.cute:
        from flash_attn import cute

        names += ["cute", "cute unsplit"]
    if args.root:
        names += ["root flash_attn_func"]
    if args.cute_kvcache:
        import os

        from flash_attn import dispatch
        from flash_attn.cute import settings as cute_settings

        os.environ["FLASH_ATTN_CUTE_OVERRIDES"] = ",".join(
            filter(None, [os.environ.get("FLASH_ATTN_CUTE_OVERRIDES"), "plan.kvcache=1"]))
        cute_settings.reload()
        names += ["kvcache on cute"]
    names += ["sdpa"]
    print("| B x Sk | " + " | ".join(names) + " | max err |")
    print("|---" * (len(names) + 2) + "|")
    for b, sk, h, hk, d in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((b,), sk - 1 if args.append else sk, dtype=torch.int32, device="cuda")
        new = {}
        if args.append:  # the decoding step's token, appended at row Sk - 1 (the same row every call)
            new = dict(k=torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16, generator=g),
                       v=torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16, generator=g))
        def triton_call(s):
            if not args.cute_kvcache:  # (the dispatcher's choice: the Triton kernels on Hopper)
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s, **new)
            with dispatch.use_backend("triton"):  # plan.kvcache is on for the process: name the Triton kernels
                return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=s, **new)

        calls = {name: (lambda s=s: triton_call(s)) for name, s in zip(names, splits)}
        if args.cute_kvcache:
            def on_cute():
                with dispatch.use_backend("cute"):
                    return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, **new)
            calls["kvcache on cute"] = on_cute
        if args.cute:
            calls["cute"] = lambda: cute.flash_attn_varlen_func(q, kc, vc, seqused_k=lens, num_splits=0, pack_gqa=True)
            calls["cute unsplit"] = lambda: cute.flash_attn_varlen_func(q, kc, vc, seqused_k=lens, num_splits=1,
                                                                        pack_gqa=True)
        if args.root:
            calls["root flash_attn_func"] = lambda: flash_attn.flash_attn_func(q, kc, vc)
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        if args.append:  # the cache as every call leaves it (the token at row Sk - 1) before SDPA copies it
            calls[names[0]]()
        # SDPA in its own (B, H, S, D) layout, contiguous (the layout it is fastest in)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
        ref = calls["sdpa"]().transpose(1, 2).float()
        err = max(float((_out(calls[n]()).float() - ref).abs().max()) for n in names[:-1])
        samples = {n: [] for n in names}
        for fn in calls.values():  # warm-up: compile and settle clocks
            _time_us(fn, 5)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                samples[n].append(_time_us(calls[n], args.reps))
        kv_bytes = 2 * b * sk * hk * d * 2
        cells = []
        for n in names:
            us = statistics.median(samples[n])
            gpu = common.gpu_us(calls[n], 20)
            cells.append(f"{us:.1f} / {gpu:.1f} ({kv_bytes / gpu / 1e3:.0f})")
        print(f"| {b} x {sk // 1024}k | " + " | ".join(cells) + f" | {err:.4f} |", flush=True)


if __name__ == "__main__":
    main()
