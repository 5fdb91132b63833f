"""Time the Triton attention backward of the current plan against candidate configs/code paths, with cuDNN
(torch SDPA) as the peer, in one run (one device call, a few minutes on an H200).

    python -m benchmarks.tools.tune_triton_bwd [--headdims 64,128,256] [--quick] [--jobs 14] [--out DIR]

Shapes (bf16, hidden H*D = 2048): d64 causal s2048 b8 h16 (the GPT-2 medium training shape), then for each
head dim, causal and not, s4096 b4 and s16384 b1. Every candidate runs the same backward call
(deterministic=False, as training calls it) on the same q/k/v/out/lse/dout; its dq/dk/dv are compared
with the current plan's (max abs error), and a candidate whose error exceeds 4x the plan's own error
against cuDNN (plus 1e-3) is marked WRONG and never wins.

Output: one line per (shape, candidate): TFLOP/s (bwd FLOPs = 2.5 x 4*B*S^2*H*D, half if causal; median of
triton.testing.do_bench), the ratio to cuDNN, the errors. At the end, per (head dim, causal): the candidate
with the best geometric-mean TFLOP/s over its shapes, and the _configs._BWD line that installs it.
Kernels are compiled first in parallel worker processes (Triton's disk cache), so timing starts warm.
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
from flash_attn.testing import backend_bwd, backend_fwd


def candidates(d, causal):
    """[(name, BwdConfig fields as a dict)]: the current plan first, then the variants for this head dim."""
    from flash_attn.triton import _configs

    plan = dataclasses.asdict(_configs._lookup(_configs._BWD, (9, 0), _configs.padded_dim(d), causal))
    out = [("plan", plan)]

    def add(name, **ch):
        out.append((name, dict(plan, **ch)))

    add("tma", tma=True)
    add("atomic", dq_atomic=True)
    add("atomic+tma", dq_atomic=True, tma=True)
    if d == 64:
        add("dq128x64w8+tma", dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=2, tma=True)
        add("dq128x128w8+tma", dq_block_m=128, dq_block_n=128, dq_num_warps=8, dq_num_stages=2, tma=True)
        add("dkdv64x128s2+tma", num_stages=2, tma=True)
        add("dkdv64x64w4+tma", block_m=64, block_n=64, num_warps=4, num_stages=3, tma=True)
    elif d == 128:
        add("dq128x128w8+tma", dq_block_m=128, dq_block_n=128, dq_num_warps=8, dq_num_stages=2, tma=True)
        add("dq64x128w4+tma", dq_block_m=64, dq_block_n=128, dq_num_warps=4, dq_num_stages=2, tma=True)
        add("dkdv64x128s3+tma", num_stages=3, tma=True)
        add("dkdv64x128s2+tma", num_stages=2, tma=True)
        add("split+tma", split_dkdv=True, tma=True)
    elif d == 256:
        add("split64x64w4+tma", block_m=64, block_n=64, num_warps=4, num_stages=2, split_dkdv=True, tma=True)
        add("split64x64w4", block_m=64, block_n=64, num_warps=4, num_stages=2, split_dkdv=True)
        add("split32x128w8+tma", block_m=32, block_n=128, num_warps=8, num_stages=2, split_dkdv=True, tma=True)
        add("split64x64w4+tma+dq64x64", block_m=64, block_n=64, num_warps=4, num_stages=2, split_dkdv=True,
            tma=True, dq_block_m=64, dq_block_n=64, dq_num_warps=4, dq_num_stages=2)
        add("dkdv32x64w8+tma", block_m=32, block_n=64, num_warps=8, num_stages=2, tma=True)
    return out


def shapes(headdims, quick):
    """[(d, causal, S, B, H)]"""
    out = []
    if 64 in headdims:
        out.append((64, True, 2048, 8, 16))
    for d in headdims:
        for causal in (True, False):
            for s, b in ((4096, 4),) if quick else ((4096, 4), (16384, 1)):
                out.append((d, causal, s, b, 2048 // d))
    return out


def _kw(S, d, causal):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=S, max_seqlen_k=S, block_table=None,
                softmax_scale=d ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)


def _inputs(b, s, h, d, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def compile_worker(spec):
    """Run each (d, causal, H, config) backward once on a small problem with the same specialisation."""
    import torch
    from flash_attn.triton import _configs, backend as tb

    for job in json.loads(spec):
        d, causal, h = job["d"], job["causal"], job["h"]
        q, k, v, g = _inputs(1, 256, h, d)
        kw = _kw(256, d, causal)
        try:
            out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
            backend_bwd(tb, g, q, k, v, out, lse, deterministic=False, config=_configs.BwdConfig(**job["cfg"]), **kw)
            torch.cuda.synchronize()
        except Exception as e:  # the timing pass skips it (a device fault would poison its CUDA context)
            print(f"compile {job}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        else:
            print("OK " + json.dumps(job, sort_keys=True), flush=True)


def precompile(jobs_spec, jobs):
    """Compile (and run once, small) every job in worker processes; returns the set of jobs that ran."""
    n = max(1, min(jobs, len(jobs_spec)))
    procs = []
    for i in range(n):
        part = jobs_spec[i::n]
        cmd = [sys.executable, "-m", "benchmarks.tools.tune_triton_bwd", "--_compile-worker", json.dumps(part)]
        procs.append(subprocess.Popen(cmd, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ok = set()
    for p in procs:
        out, err = p.communicate()
        ok.update(line[3:] for line in out.splitlines() if line.startswith("OK "))
        if err.strip():
            print(err.strip()[-1500:], file=sys.stderr)
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdims", default="64,128,256")
    ap.add_argument("--quick", action="store_true", help="s4096 only (plus the training shape)")
    ap.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=None, help="also write the lines to DIR/tune_triton_bwd.txt")
    ap.add_argument("--_compile-worker", dest="compile_worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_worker:
        return compile_worker(args.compile_worker)

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from triton.testing import do_bench

    from flash_attn.triton import _configs, backend as tb

    headdims = [int(x) for x in args.headdims.split(",")]
    shp = shapes(headdims, args.quick)
    lines = []

    def emit(s):
        print(s, flush=True)
        lines.append(s)

    import triton
    emit(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    jobs = []
    for d, causal, S, B, H in shp:
        for name, cfg in candidates(d, causal):
            job = dict(d=d, causal=causal, h=H, cfg=cfg)
            if job not in jobs:
                jobs.append(job)
    ok = precompile(jobs, args.jobs)
    emit(f"# compiled {len(jobs)} (shape kind, config) pairs in {time.time() - t0:.0f} s, {len(ok)} ran")

    per_kind = {}  # (d, causal) -> {name: [tflops...]}, names with an error/WRONG are dropped
    cfg_of = {}
    for d, causal, S, B, H in shp:
        q, k, v, g = _inputs(B, S, H, d, seed=1)
        kw = _kw(S, d, causal)
        out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
        flops = 2.5 * 4 * B * S * S * H * d / (2 if causal else 1)

        # peer: cuDNN through SDPA, on (B, H, S, D) views of the same tensors
        qs, ks, vs = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = sdpa(qs, ks, vs, is_causal=causal)
                o.backward(g.transpose(1, 2), retain_graph=True)
                peer_grads = [t.grad.transpose(1, 2).clone() for t in (qs, ks, vs)]
                ms = do_bench(lambda: o.backward(g.transpose(1, 2), retain_graph=True), warmup=args.warmup,
                              rep=args.rep, grad_to_none=[qs, ks, vs], return_mode="median")
            peer = flops / ms * 1e-9
        except Exception as e:
            peer, peer_grads = None, None
            emit(f"d={d} causal={int(causal)} s={S} b={B} h={H} | cudnn | error {type(e).__name__}: {e}"[:200])
        del qs, ks, vs

        ref = None
        tol = None
        tag = f"d={d} causal={int(causal)} s={S} b={B} h={H}"
        if peer:
            emit(f"{tag} | {'cudnn':28s} | {peer:6.1f} TFLOP/s |")
        kind = per_kind.setdefault((d, causal), {})
        for name, cfg_d in candidates(d, causal):
            cfg = _configs.BwdConfig(**cfg_d)
            cfg_of[(d, causal, name)] = cfg
            if name != "plan" and json.dumps(dict(d=d, causal=causal, h=H, cfg=cfg_d), sort_keys=True) not in ok:
                emit(f"{tag} | {name:28s} | skipped: failed in the compile worker (see stderr)")
                kind.setdefault(name, []).append(None)
                continue
            try:
                grads = backend_bwd(tb, g, q, k, v, out, lse, deterministic=False, config=cfg, **kw)
                torch.cuda.synchronize()
                ms = do_bench(lambda: backend_bwd(tb, g, q, k, v, out, lse, deterministic=False, config=cfg, **kw),
                              warmup=args.warmup, rep=args.rep, return_mode="median")
            except Exception as e:
                emit(f"{tag} | {name:28s} | error {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
                kind.setdefault(name, []).append(None)
                continue
            tf = flops / ms * 1e-9
            if ref is None:  # the plan: reference for the candidates, checked against cuDNN
                ref = [t.float() for t in grads]
                errs_peer = ([(a.float() - b.float()).abs().max().item() for a, b in zip(grads, peer_grads)]
                             if peer_grads is not None else [0.0] * 3)
                tol = [4 * e + 1e-3 for e in errs_peer]
                errs = errs_peer
                err_s = "vs cudnn " + " ".join(f"{n} {e:.2e}" for n, e in zip(("dq", "dk", "dv"), errs))
                wrong = False
            else:
                errs = [(a.float() - r).abs().max().item() for a, r in zip(grads, ref)]
                wrong = any(not math.isfinite(e) or e > t for e, t in zip(errs, tol))
                err_s = "vs plan  " + " ".join(f"{n} {e:.2e}" for n, e in zip(("dq", "dk", "dv"), errs))
            ratio = f"{tf / peer:5.2f}x" if peer else "  -  "
            emit(f"{tag} | {name:28s} | {tf:6.1f} TFLOP/s | {ratio} cudnn | {err_s}{'  WRONG' if wrong else ''}")
            kind.setdefault(name, []).append(None if wrong else tf)
            del grads
        torch.cuda.empty_cache()

    emit("# best per (head dim, causal): geometric mean TFLOP/s over the shapes above (candidates that failed "
         "or were WRONG on any shape are out)")
    for (d, causal), by_name in per_kind.items():
        scores = {n: math.exp(sum(math.log(x) for x in v) / len(v)) for n, v in by_name.items()
                  if v and all(x is not None for x in v)}
        if not scores:
            continue
        best = max(scores, key=scores.get)
        plan = scores.get("plan")
        gain = f" ({scores[best] / plan:.2f}x the plan)" if plan else ""
        emit(f"d={d} causal={int(causal)}: best {best} {scores[best]:.1f}{gain}; plan {plan and round(plan, 1)}")
        cfg = cfg_of[(d, causal, best)]
        emit(f"    (9, {d}, {causal}): {cfg!r},")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_triton_bwd.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
