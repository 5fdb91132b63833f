"""Triton attention backward on sm_90: the FA2-style kernels (_bwd.py, the `_BWD` table) against the
warp-specialized ones (_bwd_ws.py) with candidate tiles, cuDNN SDPA's backward as the peer, same run.

    python -m benchmarks.tools.tune_triton_bwd_ws [--headdims 64,128,256] [--seqlens 2048,4096,16384] [--jobs 16]
                                            [--kernels]   # + GPU time per kernel of each candidate

bf16, batch x seqlen = 16k tokens, H = 2048 / D. Per shape one line per variant: backward TFLOP/s (2.5 x the
forward's 4*B*S^2*H*D, half if causal; triton.testing.do_bench median of the backward call alone, given
out and lse: flash_attn.triton.backend.bwd for ours, torch.autograd.grad on a kept SDPA graph for cuDNN),
the ratio to cuDNN, and the max |diff| of dq, dk, dv to the FA2-style kernels' result relative to its max
(a variant past TOL is marked WRONG and never picked). The summary ranks the variants per (head dim,
causal) by the geometric mean over the seqlens.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import time

from benchmarks import common
from flash_attn.testing import backend_bwd, backend_fwd

# Relative max |diff| of a gradient to the FA2-style kernels' above which a variant is wrong, not
# differently rounded (bf16 gradients of reordered fp32 sums differ by a few ulps, ~1e-2 of the max).
TOL = 5e-2


def candidates(d):
    """(label, BwdWsConfig) per candidate; the _configs.BWD_WS entry first."""
    from flash_attn.triton import _configs as c

    W = c.BwdWsConfig
    extra = {
        # (no 32-row steps: they give NaN dK on the H200, probe_bwd_ws_split.py)
        64: [W(64, 128, 0, 0), W(64, 128, 128, 64)],
        128: [W(64, 128, 128, 64), W(64, 128, 128, 128)],
        # dV warp-specialized, dK by the FA2-style kernel (the ws dK launch at d256 needs 32-row steps)
        256: [c.BWD_WS_D256_FA2DK] + [dataclasses.replace(c.BWD_WS_D256_FA2DK, fa2=f) for f in (
            c.BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
            c.BwdConfig(32, 128, 8, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
            c.BwdConfig(64, 64, 4, 2, 128, 32, 8, 2, False, tma=True, split_dkdv=True),
            c.BwdConfig(64, 128, 8, 2, 128, 32, 8, 2, False, tma=True, split_dkdv=True))] + [
            # both launches warp-specialized, the dK one on 64 keys per program with 64-row steps (fits
            # the shared memory; 32-row steps gave NaN); dQ by the FA2-style kernel (table / 64 x 64 tiles)
            c.BWD_WS_D256_WSDK,
            dataclasses.replace(c.BWD_WS_D256_WSDK, fa2=c.BwdConfig(
                32, 128, 8, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True))] + [
            # the FA2-style dK launch adds dQ by atomics: no dQ launch. With the dK tiles above
            # (two stages) it needs 263-328 KB of shared memory; one stage or 64 keys per program
            dataclasses.replace(c.BWD_WS_D256_FA2DK, dq_atomic=True, fa2=f) for f in (
                c.BwdConfig(64, 64, 4, 1, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
                c.BwdConfig(32, 64, 4, 1, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
                c.BwdConfig(32, 64, 4, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
                c.BwdConfig(32, 128, 8, 1, 64, 64, 4, 2, False, tma=True, split_dkdv=True),
                c.BwdConfig(16, 128, 8, 2, 64, 64, 4, 2, False, tma=True, split_dkdv=True))],
    }[d]
    first = c.BWD_WS.get(d, c.BWD_WS_D256_FA2DK)
    out = [first] + [e for e in extra if e != first]
    return [(_label(x), x) for x in out]


def _fa2(d, causal):
    """The FA2-style kernels' config (the _BWD table's entry; config=None may take _bwd_ws.py)."""
    from flash_attn.triton import _configs as c

    return c._lookup(c._BWD, (9, 0), d, causal)


def _label(cfg):
    dq = f"dq {cfg.dq_block_m}x{cfg.dq_block_n}" if cfg.dq_block_m else "dq fa2"
    s = f"ws dkdv {cfg.block_m}x{cfg.block_n} {dq}"
    dk = f" split dk {cfg.dk_block_m or cfg.block_m}x{cfg.dk_block_n or cfg.block_n}"
    s += (" split dk fa2" if cfg.fa2_dk else dk) if cfg.split_dkdv else ""
    s += " dq atomic" if cfg.dq_atomic else ""
    f = cfg.fa2
    return s + (f" fa2 dk {f.block_m}x{f.block_n}w{f.num_warps}{'' if f.num_stages == 2 else f's{f.num_stages}'}"
                f" dq {f.dq_block_m}x{f.dq_block_n}w{f.dq_num_warps}"
                if f is not None else "")


def _inputs(d, s, tokens, hidden, causal):
    import torch

    B, H = max(1, tokens // s), hidden // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, s, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    return B, H, q, k, v, do


def _kw(s, causal, d):
    return dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=s, max_seqlen_k=s, block_table=None,
                softmax_scale=d ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)


def compile_worker(spec):
    """Compile one (head dim, causal, candidate) by running it on a small problem with the grid's strides
    (the disk cache then serves the timing process)."""
    from flash_attn.triton import backend as tb

    d, causal, i = (int(x) for x in spec.split(","))
    cfg = _fa2(d, bool(causal)) if i < 0 else candidates(d)[i][1]
    _, _, q, k, v, do = _inputs(d, 512, 512, 2048, bool(causal))
    kw = _kw(512, bool(causal), d)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    backend_bwd(tb, do, q, k, v, out, lse, deterministic=False, config=cfg, **kw)


def precompile(args, specs):
    t0 = time.time()
    procs, pending = [], list(specs)
    while pending or procs:
        while pending and len(procs) < args.jobs:
            cmd = [sys.executable, "-m", "benchmarks.tools.tune_triton_bwd_ws", "--_compile-worker", pending.pop()]
            procs.append(subprocess.Popen(cmd, cwd=common.ROOT))
        procs[0].wait()
        procs = [p for p in procs if p.poll() is None]
    print(f"# precompiled {len(specs)} kernel sets in {time.time() - t0:.0f} s", flush=True)


def kernel_times(call, n=10):
    """'name us (share) ...' of the GPU kernels one call(), averaged over n calls, from torch.profiler's
    device events (which of a backward's launches costs what)."""
    per = common.kernel_us(call, reps=n, warmup=1)
    total = sum(per.values()) or 1.0
    return "  ".join(f"{k[:28]} {v:.0f} us ({v / total:.0%})" for k, v in per.items())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", default="64,128,256")
    p.add_argument("--seqlens", default="2048,4096,16384")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--kernels", action="store_true",
                   help="also print each candidate's GPU time per kernel (torch.profiler, 10 backward calls)")
    p.add_argument("--_compile-worker", dest="compile_worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_worker:
        return compile_worker(args.compile_worker)
    import torch
    import triton
    from triton.testing import do_bench

    from flash_attn.triton import backend as tb

    dims = [int(x) for x in args.headdims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    causals = [c == "1" for c in args.causal.split(",")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    precompile(args, [f"{d},{int(c)},{i}" for d in dims for c in causals
                      for i in range(-1, len(candidates(d)))])
    summary = {}
    for d in dims:
        for causal in causals:
            for s in seqlens:
                B, H, q, k, v, do = _inputs(d, s, args.tokens, args.hidden, causal)
                kw = _kw(s, causal, d)
                flops = 2.5 * 4 * B * s * s * H * d / (2 if causal else 1)
                out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
                base = backend_bwd(tb, do, q, k, v, out, lse, deterministic=False, config=_fa2(d, causal), **kw)
                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                dot_ = do.transpose(1, 2)
                ms = do_bench(lambda: torch.autograd.grad(o, (qt, kt, vt), dot_, retain_graph=True),
                              warmup=args.warmup, rep=args.rep, return_mode="median")
                cudnn = flops / ms * 1e-9
                print(f"d{d} causal={int(causal)} s{s} b{B}: cudnn {cudnn:.0f}", flush=True)
                rows = [("fa2 table", _fa2(d, causal))] + candidates(d)
                for label, cfg in rows:
                    # outputs pre-filled with NaN: a launch that leaves rows unwritten must not pass the
                    # check on what an earlier candidate left in the same memory
                    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))

                    def call():
                        return backend_bwd(tb, do, q, k, v, out, lse, deterministic=False, config=cfg, grads=grads, **kw)
                    try:
                        got = call()
                        errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                for a, b in zip(got, base)]
                        # (a NaN must win: Python's max() drops it unless it comes first)
                        err = float("nan") if any(e != e for e in errs) else max(errs)
                        ms = do_bench(call, warmup=args.warmup, rep=args.rep, return_mode="median")
                    except Exception as e:  # a candidate that fails to compile or launch
                        print(f"  {label:40s} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    tf = flops / ms * 1e-9
                    wrong = not (err <= TOL)
                    print(f"  {label:40s} {tf:6.0f} TFLOP/s  {tf / cudnn:5.2f}x cudnn  rel diff {err:.1e}"
                          f"{'  WRONG' if wrong else ''}", flush=True)
                    if not wrong:
                        summary.setdefault((d, causal, label), []).append(tf / cudnn)
                    if args.kernels:
                        print("    " + kernel_times(call), flush=True)
                del q, k, v, do, out, lse, base, o
                torch.cuda.empty_cache()
    print("# geometric mean of the ratio to cuDNN over the seqlens (complete rows only)")
    for (d, causal, label), xs in summary.items():
        if len(xs) == len(seqlens):
            print(f"d{d} causal={int(causal)} {label:40s} {math.exp(sum(map(math.log, xs)) / len(xs)):.3f}")


if __name__ == "__main__":
    main()
