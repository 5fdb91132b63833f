"""The CuTeDSL Hopper backward (flash_bwd_sm90.py) against the Triton backward, on the same forward
results (the cute forward's out and lse): median time of the backend's bwd() call (triton.testing.do_bench),
TFLOP/s with FlashAttention's count (bwd = 2.5 x 4 * B * S^2 * H * D, half when causal) and the max
|difference| of dq, dk, dv from Triton's. bf16, batch x seqlen = --tokens, heads = --hidden / D.

    python -m benchmarks.attention.bench_cute_bwd                      # d64/d128 x causal x seqlen 2048, 8192
    python -m benchmarks.attention.bench_cute_bwd --headdims 64 --seqlens 2048 --causal 1

The cute time includes its host-side steps (flash_attn/cute/bwd_host.py: one Triton launch before the
kernel for delta = rowsum(dO * O), lse in log2 units and the dq_accum zeroing, one after it for dq's
fp32 -> bf16 cast and the GQA sums); "torch host" is the same call with
FLASH_ATTN_CUTE_OVERRIDES=plan.bwd_host=torch (the torch fallback's launches); the Triton time includes its own
preprocessing. "kernel" is flash_bwd_sm90 alone on prepared inputs. The cute column cannot reach it
however few the launches: per element of q the host steps move 14 bytes (read O and dO, zero the fp32
dq_accum, read it back, write dq), 0.47 GB at 16k tokens x hidden 2048, about 0.1 ms at H200 bandwidth.
"""
import argparse
import os

import torch

from benchmarks.common import bools as _bools
from benchmarks.common import environ
from benchmarks.common import ints as _ints
from flash_attn.testing import backend_bwd, backend_fwd


def kernel_call(q, k, v, dout, out, lse, causal):
    """A no-argument call of the backward kernel alone (the current configuration's), on inputs prepared
    as launch.backward prepares them (lse2 and delta padded to the query block, a zeroed dq_accum)."""
    from flash_attn.cute import kernels

    b, s, h, d = q.shape
    fn = kernels.bwd_kernel(q.dtype, d, causal)
    bm = kernels.bwd_config(q.dtype, d, causal, "sm_90a").block_m
    pad = -(-s // bm) * bm
    lse2 = torch.full((b, h, pad), float("inf"), dtype=torch.float32, device=q.device)
    lse2[:, :, :s] = lse * 1.4426950408889634
    delta = torch.zeros((b, h, pad), dtype=torch.float32, device=q.device)
    delta[:, :, :s] = (dout.float() * out).sum(-1).transpose(1, 2)
    dq_acc = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device)
    dk_h, dv_h = torch.empty_like(k), torch.empty_like(v)
    return lambda: fn(q, k, v, dout, lse2, delta, dq_acc, dk_h, dv_h, d ** -0.5)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdims", type=_ints, default=[64, 128])
    ap.add_argument("--seqlens", type=_ints, default=[2048, 8192])
    ap.add_argument("--causal", type=_bools, default=[False, True])
    ap.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    ap.add_argument("--hidden", type=int, default=2048, help="heads x head dim")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    ap.add_argument("--out", default=None, help="a folder that also receives the table (cute_bwd.txt)")
    args = ap.parse_args(argv)
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    from triton.testing import do_bench

    from flash_attn.cute import backend as cb
    from flash_attn.cute import settings as cute_settings
    from flash_attn.triton import backend as tb

    dtype = torch.bfloat16
    emit(f"{'D':>4} {'S':>6} {'B':>3} {'H':>3} {'causal':>6} | {'triton ms':>9} {'TFLOP/s':>8} | "
         f"{'cute ms':>8} {'TFLOP/s':>8} {'speedup':>7} | {'torch host':>10} | {'kernel':>7} {'TFLOP/s':>8} | "
         f"max|cute - triton| dq dk dv")
    for d in args.headdims:
        for s in args.seqlens:
            for causal in args.causal:
                b, h = max(1, args.tokens // s), args.hidden // d
                g = torch.Generator().manual_seed(0)
                q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to("cuda", dtype) for _ in range(4))
                kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=s, max_seqlen_k=s, block_table=None,
                          softmax_scale=d ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                          softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)
                out, lse, _ = backend_fwd(cb, q, k, v, return_probs=False, **kw)

                def run_cute():
                    return backend_bwd(cb, dout, q, k, v, out, lse, deterministic=False, **kw)

                def run_triton():
                    return backend_bwd(tb, dout, q, k, v, out, lse, deterministic=False, **kw)

                ref = run_triton()
                got = run_cute()
                torch.cuda.synchronize()
                errs = [(a.float() - r.float()).abs().max().item() for a, r in zip(got, ref)]
                flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
                t_tri = do_bench(run_triton, warmup=args.warmup, rep=args.rep, return_mode="median")
                t_cute = do_bench(run_cute, warmup=args.warmup, rep=args.rep, return_mode="median")
                # the torch host steps: plan.bwd_host added to whatever overrides the run has
                overrides = ",".join(filter(None, (os.environ.get(cute_settings.OVERRIDES), "plan.bwd_host=torch")))
                with environ({cute_settings.OVERRIDES: overrides}):
                    t_host = do_bench(run_cute, warmup=args.warmup, rep=args.rep, return_mode="median")
                t_kern = do_bench(kernel_call(q, k, v, dout, out, lse, causal), warmup=args.warmup, rep=args.rep,
                                  return_mode="median")
                emit(f"{d:>4} {s:>6} {b:>3} {h:>3} {str(causal):>6} | {t_tri:9.3f} {flops / t_tri / 1e9:8.1f} | "
                     f"{t_cute:8.3f} {flops / t_cute / 1e9:8.1f} {t_tri / t_cute:7.2f} | {t_host:10.3f} | "
                     f"{t_kern:7.3f} {flops / t_kern / 1e9:8.1f} | "
                     + " ".join(f"{e:.2e}" for e in errs))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cute_bwd.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
