"""A/B of flash_attn.cute's forward on decoding shapes (few query rows, long keys, GQA): per shape, each variant's
call options (pack_gqa, num_splits) and environment, timed in one process in interleaved rounds (the order rotated
per round, the median kept), microseconds per call and the rate at which the call reads K and V. Each variant's
output is compared with the first variant's (the options change the tiling, not the result), and the kernels a
variant ran are listed (the in-memory cache's keys), so a variant that silently ran unpacked or unsplit shows.

    python -m benchmarks.attention.ab_cute_decode --variants \\
        "plain:pack_gqa=False;pack:pack_gqa=True;split:num_splits=0;both:pack_gqa=True,num_splits=0;auto:num_splits=0"
    python -m benchmarks.attention.ab_cute_decode --env FLASH_ATTN_CUTE_OVERRIDES=plan.pack_gqa_auto=1 --variants \\
        "plain:pack_gqa=False;auto:pack_gqa=None,num_splits=0;unsplit:num_splits=0,FLASH_ATTN_CUTE_DISABLE=split"

A variant is LABEL:KEY=VALUE[,KEY=VALUE] with KEY pack_gqa (True / False / None) or num_splits (an int), or an
environment variable (NAME=VALUE with an upper-case NAME, set for that variant only; an item that is neither
continues the variable's value, so FLASH_ATTN_CUTE_OVERRIDES=fwd.stages=2,fwd.block_n=96 is one variable).
--env sets variables for every variant (the same NAME=VALUE list). The settings are read again after each
switch (flash_attn.cute.settings.reload()). A shape is
B:Sq:Sk:H:Hk:D; --paged P runs each shape as flash_attn_varlen_func with B sequences of Sq queries, their keys in a
shuffled cache of P-row pages (page_table, seqused_k), as a serving engine calls it.

--compile-only (no GPU needed; FLASH_ATTN_CUTE_CACHE names the disk cache to fill, CUTE_DSL_ARCH=sm_90a): makes
every shape's calls of every variant on CPU tensors with the kernel launches recorded instead of run (an H200's 132
SMs for num_splits=0), and compiles the kernels they asked for into the cache, so that the device call loads them.
"""
import argparse
import re
import sys

# B:Sq:Sk:H:Hk:D: one-token decoding at batch 1 / 8 / 32 with 8k-32k keys and 4 or 8 query heads per KV head, a
# few queries per step (speculative decoding), d64 / d256
DEFAULT_SHAPES = ("1:1:8192:32:8:128,1:1:32768:32:8:128,8:1:8192:32:8:128,32:1:4096:32:8:128,1:4:16384:64:8:128,"
                  "4:16:8192:32:4:128,1:1:32768:16:2:64,1:1:8192:16:2:256")
_CALL_KEYS = ("pack_gqa", "num_splits")
_NAME = re.compile(r"[A-Z][A-Z0-9_]*=")


def parse_shapes(spec):
    """[(B, Sq, Sk, H, Hk, D)] of a comma-separated B:Sq:Sk:H:Hk:D list."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        fields = item.split(":")
        if len(fields) != 6:
            raise ValueError(f"shape {item!r}: expected B:Sq:Sk:H:Hk:D")
        b, sq, sk, h, hk, d = map(int, fields)
        if h % hk:
            raise ValueError(f"shape {item!r}: H ({h}) must be a multiple of Hk ({hk})")
        out.append((b, sq, sk, h, hk, d))
    return out


def _value(key, text):
    if key == "pack_gqa":
        table = {"True": True, "1": True, "False": False, "0": False, "None": None}
        if text not in table:
            raise ValueError(f"pack_gqa={text!r}: expected True, False or None")
        return table[text]
    return int(text)


def parse_variants(spec):
    """[(label, call kwargs, env)] of a ';'-separated LABEL:KEY=VALUE[,KEY=VALUE] list (no label: the items
    joined), and every environment NAME any variant sets. An item that is neither a call KEY=VALUE nor
    NAME=VALUE with an upper-case NAME continues the previous variable's value."""
    out = []
    for v in spec.split(";"):
        label, sep, items = v.partition(":")
        if not sep:
            label, items = "", label
        kw, env, last = {}, {}, None
        for item in filter(None, (x.strip() for x in items.split(","))):
            key, eq, value = item.partition("=")
            if eq and key in _CALL_KEYS:
                kw[key], last = _value(key, value), None
            elif _NAME.match(item):
                env[key], last = value, key
            elif last is not None:
                env[last] += "," + item
            else:
                raise ValueError(f"variant item {item!r}: expected KEY=VALUE")
        if any(n.startswith("FLASH_ATTN_TRITON_") for n in env):
            raise ValueError(f"variant {v!r}: flash_attn.triton reads its variables once at import")
        out.append((label.strip() or ",".join(f"{k}={x}" for k, x in {**kw, **env}.items()) or "default", kw, env))
    return out, sorted({n for _, _, env in out for n in env})


def kv_bytes(b, sk, hk, d, dv=None, elem=2):
    """Bytes of K and V one call reads at least once (each KV head's keys, whatever the query heads)."""
    return b * sk * hk * (d + (dv or d)) * elem


def _inputs(shape, paged, dtype, seed=0, device="cuda"):
    """(kind, args, kwargs) of one shape: flash_attn_func's arguments ("dense"), or (paged) flash_attn_varlen_func's
    ("paged")."""
    import torch

    from flash_attn.testing import paged_from_dense

    b, sq, sk, h, hk, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(device, dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(device, dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(device, dtype)
    if not paged:
        return "dense", (q, k, v), {}
    kp, table = paged_from_dense(k, paged, generator=g)
    vp, _ = paged_from_dense(v, paged, num_blocks=kp.shape[0], block_table=table)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=device)
    used = torch.full((b,), sk, dtype=torch.int32, device=device)
    return "paged", (q.flatten(0, 1), kp, vp), dict(cu_seqlens_q=cu_q, max_seqlen_q=sq, seqused_k=used,
                                                    page_table=table)


def kernels_asked(shapes, variants_, names, paged, causal, sms=132):
    """The forward kernels (dtype, head dim, causal, fwd_kernel keyword arguments) the calls of every shape and
    variant ask for, found on the CPU: the calls run on CPU tensors with launch.fwd_kernel recording (its kernels
    do nothing), the in-memory kernel table empty (every call asks fwd_kernel) and the device queries answered as
    an H200's. Everything replaced is put back after."""
    import torch

    from benchmarks.attention.ab_cute_bwd import apply
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func, interface, kernels, launch, plan

    asked = []

    def record(dtype, d, causal, arch="sm_90a", **kw):
        kw = {k: x for k, x in kw.items() if not (k == "dv" and x in (None, d))}
        entry = (dtype, d, causal, tuple(sorted(kw.items())))
        if entry not in asked:
            asked.append(entry)
        return lambda *a: None

    # patched where the calls look them up; kernels._kernels is one dict that launch.py and interface.py import,
    # so its contents are swapped, not the name
    saved = launch.fwd_kernel, interface._device_arch, plan._device_sms, dict(kernels._kernels)
    launch.fwd_kernel, interface._device_arch, plan._device_sms = record, (lambda q, k, v: "sm_90a"), (lambda t: sms)
    kernels._kernels.clear()
    try:
        for shape in shapes:
            kind, args, kw_ = _inputs(shape, paged, torch.bfloat16, device="cpu")
            fn = flash_attn_func if kind == "dense" else flash_attn_varlen_func
            for _, kw, env in variants_:
                apply(env, names)
                fn(*args, causal=causal, **kw_, **kw)
    finally:
        launch.fwd_kernel, interface._device_arch, plan._device_sms, table = saved
        kernels._kernels.clear()
        kernels._kernels.update(table)
        apply({}, names)
    return [(dtype, d, causal, dict(kw)) for dtype, d, causal, kw in asked]


def _compile(asked, jobs):
    """Build the kernels into the disk cache (precompile_gpu_tests' builder); returns the failures."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from benchmarks.tools import precompile_gpu_tests as pg
    from flash_attn.cute import cache

    out = cache.cache_dir()
    if out is None:
        raise SystemExit("set FLASH_ATTN_CUTE_CACHE to the folder to fill")
    names = {dtype: name for name, dtype in pg._dtypes().items()}
    args = [(out, names[dtype], d, causal, kw) for dtype, d, causal, kw in asked]
    with ProcessPoolExecutor(max(1, min(jobs, len(args))), mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(pg._build, *zip(*args))) if args else []
    failed = 0
    for (_, dt, d, causal, kw), (how, seconds, error) in zip(args, results):
        failed += error is not None
        print(f"{dt} d{d} {'causal' if causal else 'full'} {({k: v for k, v in kw.items() if v})}: "
              f"{error or how} ({seconds:.1f} s)", flush=True)
    print(f"{len(args) - failed}/{len(args)} kernels in {out}")
    return failed


def main(argv=None):
    from benchmarks.attention.ab_cute_bwd import apply, round_order, summary
    from benchmarks.common import env_items, set_environ

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated B:Sq:Sk:H:Hk:D")
    p.add_argument("--env", default="", help="NAME=VALUE[,NAME=VALUE] for every variant (e.g. "
                   "FLASH_ATTN_CUTE_OVERRIDES=plan.pack_gqa_auto=1)")
    p.add_argument("--paged", type=int, default=0, help="page size: run the varlen paged form (0: dense)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--compile-only", action="store_true", help="fill the disk cache on a CPU (see above)")
    p.add_argument("--jobs", type=int, default=2, help="--compile-only: compile in this many processes")
    args = p.parse_args(argv)
    set_environ(env_items(args.env))
    if args.compile_only:
        variants_, names = parse_variants(args.variants)
        asked = kernels_asked(parse_shapes(args.shapes), variants_, names, args.paged, args.causal)
        return 1 if _compile(asked, args.jobs) else 0

    import torch
    from triton.testing import do_bench

    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func, kernels

    variants_, names = parse_variants(args.variants)
    shapes = parse_shapes(args.shapes)
    print(f"# {torch.cuda.get_device_name()}; bf16; {'paged ' + str(args.paged) if args.paged else 'dense'}"
          f"{'; causal' if args.causal else ''}; env {args.env or '-'}; us per call (median of {args.rounds} "
          f"interleaved rounds) and K / V read GB/s; max |out - first variant's|; kernels run")
    print("| B:Sq:Sk:H:Hk:D | " + " | ".join(label for label, _, _ in variants_) + " |")
    print("|---|" + "---|" * len(variants_))
    for shape in shapes:
        kind, call_args, call_kw = _inputs(shape, args.paged, torch.bfloat16)
        fn = flash_attn_func if kind == "dense" else flash_attn_varlen_func
        times = [[] for _ in variants_]
        outs, ran = [None] * len(variants_), [set() for _ in variants_]
        for r in range(args.rounds):
            for i, (label, kw, env) in round_order(variants_, r):
                apply(env, names)
                kernels._kernels.clear()  # the in-memory cache does not key on the settings

                def call(kw=kw):
                    return fn(*call_args, causal=args.causal, **call_kw, **kw)[0]

                if outs[i] is None:
                    outs[i] = call().float()
                    ran[i] = {k[6:] for k in kernels._kernels}  # what the call ran beyond (dtype, D, causal, ...)
                times[i].append(do_bench(call, warmup=args.warmup, rep=args.rep, return_mode="median") * 1e3)
        b, sq, sk, h, hk, d = shape
        gbytes = kv_bytes(b, sk, hk, d) / 1e9
        cells = []
        for i in range(len(variants_)):
            t = summary(times[i])
            diff = (outs[i] - outs[0]).abs().max().item()
            cells.append(f"{t:.1f} us {gbytes / (t * 1e-6):.0f} GB/s d={diff:.0e} {sorted(map(str, ran[i]))}")
        print(f"| {b}:{sq}:{sk}:{h}:{hk}:{d} | " + " | ".join(cells) + " |", flush=True)
    apply({}, names)


if __name__ == "__main__":
    sys.exit(main())
