"""Triton attention forward on sm_90: the current `_FWD` table against candidate configs, cuDNN as the peer.

    python -m benchmarks.tools.tune_triton_fwd [--headdims 64,128,256] [--seqlens 2048,4096,16384] [--jobs 16]

bf16, batch x seqlen = 16k tokens, H = 2048 / D. Per shape one line per variant: TFLOP/s (fwd FLOPs =
4*B*S^2*H*D, half if causal; triton.testing.do_bench median), its ratio to cuDNN SDPA, and the max abs
difference of out and lse to the current table's result; a variant past the tolerance is marked WRONG and
can never be picked. The summary ranks the variants per (head dim, causal) by the geometric mean of their
TFLOP/s over the seqlens and prints the `_FWD` line of the winner (paste it into _configs.py).
`--stats` (no GPU needed) compiles the candidates for sm_90 and prints registers,
spills and shared memory of each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

from benchmarks import common
from flash_attn.testing import backend_fwd

# Max |diff| to the current table's output / lse above which a variant is wrong rather than differently
# rounded: reordered fp32 sums and one bf16 rounding of P move out by a few bf16 ulps of |out| < 1 (~4e-3)
# and lse by fp32 noise; a broken mask or load moves them by O(0.1..1).
TOL_OUT = 2e-2
TOL_LSE = 1e-2


def ws_candidates(d, causal):
    """FwdConfig fields of the warp-specialized forward (_fwd_ws.py, variant 1, and 2 persistent):
    num_warps=4 becomes one producer and two 64-row consumer warpgroups; stages as fit in shared memory
    (see _configs.fwd_variant_config, whose entries come first)."""
    from flash_attn.triton import _configs

    c = []
    for bn in (None, 64, 128):
        f = dataclasses.astuple(_configs.fwd_variant_config((9, 0), d, causal, (1, bn)))
        if f not in c:
            c.append(f)
    extra = {64: [(128, 128, 4, 2)], 128: [(128, 64, 4, 2), (128, 32, 4, 4)], 256: [(128, 32, 4, 3)]}
    for bm, bn, w, st in extra[min(256, max(64, d))]:
        c.append((bm, bn, w, st, True, 0.0, c[0][6], 1))
    if causal:  # the other grid order of causal rows
        c += [(*f[:6], 0 if f[6] else 8, 1) for f in c[:2]]
    # the persistent form (variant 2)
    for bn in (None, 64, 128):
        f = dataclasses.astuple(_configs.fwd_variant_config((9, 0), d, causal, (2, bn)))
        if f not in c:
            c.append(f)
    if causal:
        f = c[-1]
        c.append((*f[:6], 0 if f[6] else 8, 2))
        # persistent with the balanced (snake) order of the causal tiles (variant 3)
        for bn in (None, 128):
            f = dataclasses.astuple(_configs.fwd_variant_config((9, 0), d, causal, (3, bn)))
            if f not in c:
                c.append(f)
    return c


def candidates(d, causal, which="all"):
    """FwdConfig fields (block_m, block_n, num_warps, num_stages, tma, rescale, group, variant) to time
    against the table's entry for (d, causal): "all" the default-kernel sweep and the warp-specialized
    ones, "ws" only the latter."""
    if which == "ws":
        return ws_candidates(d, causal)
    if d <= 64:
        c = [(64, 64, 4, 3, True, 0.0), (128, 64, 8, 3, False, 0.0), (128, 64, 8, 3, True, 0.0),
             (128, 128, 8, 2, True, 0.0), (64, 128, 4, 3, True, 0.0), (64, 64, 4, 3, True, 8.0),
             (128, 64, 8, 3, True, 8.0)]
    elif d <= 128:
        c = [(128, 128, 8, 3, False, 0.0), (128, 64, 8, 3, False, 0.0), (128, 128, 8, 3, True, 0.0),
             (128, 64, 8, 3, True, 0.0), (128, 128, 8, 2, True, 0.0), (64, 64, 4, 3, False, 0.0),
             (64, 64, 4, 2, True, 0.0), (64, 128, 4, 2, True, 0.0), (128, 128, 8, 3, True, 8.0),
             (128, 64, 8, 3, True, 8.0)]
    else:
        c = [(128, 64, 8, 2, False, 0.0), (128, 64, 8, 2, True, 0.0), (128, 32, 8, 3, True, 0.0),
             (64, 64, 4, 2, False, 0.0), (64, 64, 4, 2, True, 0.0), (64, 32, 4, 2, True, 0.0),
             (64, 32, 4, 3, True, 0.0), (128, 64, 8, 2, True, 8.0)]
    c = [(*f, 0, 0) for f in c]
    if causal:  # longest-first across 8 (sequence, head) pairs: only changes the order of causal grids
        c += [(*f[:6], 8, 0) for f in c[:4]]
    return c + ws_candidates(d, causal)


def _cfg(fields):
    from flash_attn.triton import _configs

    return _configs.FwdConfig(*fields)


def _label(fields):
    bm, bn, w, st, tma, rs, grp, var = (*fields, 0)[:8]
    return (f"{bm}x{bn} w{w} s{st}" + (" tma" if tma else "") + (f" rescale{rs:g}" if rs else "")
            + (f" group{grp}" if grp else "") + {0: "", 1: " WS", 2: " WS-persistent", 3: " WS-persistent-balanced"}[var])


def _kw(s, causal, d):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=s, max_seqlen_k=s, block_table=None,
                softmax_scale=d ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)


def compile_worker(spec):
    """Compile (by running once on a tiny problem) each job: Triton's disk cache serves the timing run."""
    import torch
    from flash_attn.triton import backend as tb

    for d, causal, fields in json.loads(spec):
        q, k, v = (torch.randn(1, 256, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        try:
            backend_fwd(tb, q, k, v, return_probs=False, config=_cfg(fields) if fields else None, **_kw(256, causal, d))
        except Exception as e:  # reported again (and skipped) by the timing run
            print(f"compile d={d} causal={causal} {fields}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    torch.cuda.synchronize()


def precompile(jobs, n):
    n = max(1, min(n, len(jobs)))
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.tools.tune_triton_fwd", "--_compile-worker",
                               json.dumps(jobs[i::n])], cwd=common.ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]
    for p in procs:
        _, err = p.communicate()
        if err.strip():
            print(err.strip()[-1500:], file=sys.stderr)


def stats(args):
    """Registers / spills / shared memory of every candidate compiled for sm_90 (no GPU needed)."""
    import re
    import tempfile

    import triton
    from benchmarks.tools.triton_fwd_compile import compile_fwd

    from flash_attn.triton import _configs

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for d in args.headdims:
        for causal in args.causal:
            base = _configs._lookup(_configs._FWD, (9, 0), d, causal)
            for fields in [None] + candidates(d, causal, args.candidates):
                cfg = base if fields is None else _cfg(fields)
                if cfg.variant:  # benchmarks/tools/triton_fwd_compile.py compiles and reads the ws kernel
                    continue
                label = "table " + _label(tuple(dataclasses.astuple(cfg))) if fields is None else _label(fields)
                try:
                    ck, _ = compile_fwd(d, causal, cfg)  # the backend's kernel, signature and sm_90 target
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(ck.asm["cubin"])
                        f.flush()
                        ru = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
                    reg = int(re.search(r"REG:(\d+)", ru).group(1))
                    local = int(re.search(r"LOCAL:(\d+)", ru).group(1))
                    smem = ck.metadata.shared
                    threads = 32 * cfg.num_warps
                    ctas = min(65536 // (threads * ((reg + 7) // 8 * 8)), (233472 - 1024) // (smem + 1024))
                    print(f"d={d} causal={causal} {label:32s} regs {reg:3d} local {local:4d} smem {smem // 1024:3d} KiB "
                          f"-> {ctas} CTA/SM", flush=True)
                except Exception as e:
                    print(f"d={d} causal={causal} {label:32s} error {type(e).__name__}: {str(e)[:120]}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", default="64,128,256")
    p.add_argument("--seqlens", default="2048,4096,16384")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=40, help="do_bench repetitions (ms)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--stats", action="store_true", help="compile for sm_90 here and print regs/smem (no GPU)")
    p.add_argument("--candidates", choices=("all", "ws"), default="all",
                   help="ws: only the warp-specialized forward's candidates (against the table and cuDNN)")
    p.add_argument("--_compile-worker", dest="compile_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.headdims = [int(x) for x in args.headdims.split(",")]
    args.seqlens = [int(x) for x in args.seqlens.split(",")]
    args.causal = [x.strip() in ("1", "true", "True") for x in args.causal.split(",")]
    if args.compile_worker is not None:
        return compile_worker(args.compile_worker)
    if args.stats:
        return stats(args)
    run(args)


def run(args):
    import torch
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from triton.testing import do_bench

    from flash_attn.triton import _configs, backend as tb

    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    t0 = time.time()
    jobs = [(d, c, f) for d in args.headdims for c in args.causal for f in [None] + candidates(d, c, args.candidates)]
    precompile(jobs, args.jobs)
    print(f"# compiled {len(jobs)} variants in {time.time() - t0:.0f}s", flush=True)

    def bench(fn):
        return do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    results = {}  # (d, causal) -> label -> list of TFLOP/s (None when wrong / failed)
    for d in args.headdims:
        for causal in args.causal:
            base_cfg = _configs._lookup(_configs._FWD, (9, 0), d, causal)
            for s in args.seqlens:
                b, h = max(1, args.tokens // s), max(1, args.hidden // d)
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(3))
                kw = _kw(s, causal, d)
                with torch.no_grad():
                    out0, lse0, _ = backend_fwd(tb, q, k, v, return_probs=False, config=base_cfg, **kw)
                    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                    try:
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            ref = sdpa(qt, kt, vt, is_causal=causal).transpose(1, 2)
                            ms = bench(lambda: sdpa(qt, kt, vt, is_causal=causal))
                        peer = flops / ms / 1e9
                        peer_err = (ref.float() - out0.float()).abs().max().item()
                    except Exception as e:
                        peer, peer_err = None, None
                        print(f"  cudnn failed: {type(e).__name__}: {str(e)[:100]}")
                    hdr = f"d={d} causal={int(causal)} s={s} b={b} h={h}"
                    print(f"{hdr}  cudnn {peer or 0:.0f} TFLOP/s (max|out - table| {peer_err or 0:.2g})", flush=True)
                    row = results.setdefault((d, causal), {})
                    for fields in [None] + candidates(d, causal, args.candidates):
                        cfg = base_cfg if fields is None else _cfg(fields)
                        label = "table" if fields is None else _label(fields)
                        try:
                            o, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **kw)
                            e_out = (o.float() - out0.float()).abs().max().item()
                            e_lse = (lse - lse0).abs().max().item()
                            ms = bench(lambda: backend_fwd(tb, q, k, v, return_probs=False, config=cfg, **kw))
                            tf = flops / ms / 1e9
                            ok = e_out <= TOL_OUT and e_lse <= TOL_LSE and math.isfinite(e_out + e_lse)
                            row.setdefault(label, (fields, []))[1].append(tf if ok else None)
                            ratio = f"{tf / peer:5.2f}x" if peer else "   - "
                            print(f"  {label:32s} {tf:6.0f} TFLOP/s {ratio} cudnn  err out {e_out:.2g} lse {e_lse:.2g}"
                                  + ("" if ok else "  WRONG"), flush=True)
                        except Exception as e:
                            row.setdefault(label, (fields, []))[1].append(None)
                            print(f"  {label:32s} error {type(e).__name__}: {str(e)[:100]}", flush=True)
                    results[(d, causal)].setdefault("cudnn", (None, []))[1].append(peer)
                del out0, lse0
                torch.cuda.empty_cache()

    print("\n# summary: geometric mean TFLOP/s over seqlens " + ",".join(map(str, args.seqlens)))
    for (d, causal), row in results.items():
        def gm(xs):
            return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs and all(xs) else None
        peer = gm(row.get("cudnn", (None, []))[1])
        ranked = sorted(((gm(v[1]), lab, v[0]) for lab, v in row.items() if lab != "cudnn" and gm(v[1])),
                        key=lambda r: -r[0])
        base = gm(row.get("table", (None, []))[1])
        print(f"d={d} causal={int(causal)}: cudnn {peer or 0:.0f}, table {base or 0:.0f}"
              + (f" ({base / peer:.2f}x)" if base and peer else ""))
        for tf, lab, _ in ranked[:4]:
            print(f"    {lab:32s} {tf:6.0f}" + (f"  {tf / peer:.2f}x cudnn" if peer else ""))
        if ranked:
            tf, lab, fields = ranked[0]
            if fields is None:
                print("    winner: the current table entry")
            else:
                bm, bn, w, st, tma, rs, grp, var = fields
                extra = ((", tma=True" if tma else "") + (f", rescale={rs}" if rs else "") + (f", group={grp}" if grp else "")
                         + (f", variant={var}" if var else ""))
                print(f"    winner line for _FWD: ({9}, {d}, {causal}): FwdConfig({bm}, {bn}, {w}, {st}{extra}),")


if __name__ == "__main__":
    main()
