"""Run the flash_attn.cute backward kernel (flash_bwd_sm90) alone on one shape, for a profiler (ncu) or to
see whether a kernel variant finishes at all (a watchdog prints every thread's stack and exits).

    python -m benchmarks.tools.profile_cute_bwd --seqlen 2048 --batch 8 --headdim 64 --causal
    ncu --section WarpStateStats -k regex:cutlass -c 1 python -m benchmarks.tools.profile_cute_bwd ...
    FLASH_ATTN_CUTE_OVERRIDES=bwd.dq_tma=0 \\
        python -m benchmarks.tools.profile_cute_bwd --seqlen 128 --batch 1 --timeout 40

The forward (out, lse) and the reference gradients come from the Triton backend, so the only CuTeDSL
kernel launched is the backward. Prints the load/compile time, each iteration's time and the max
|difference| of dq, dk, dv from Triton's backward (MHA only: the kernel writes per-query-head dk/dv).
"""
import argparse
import faulthandler
import time
from flash_attn.testing import backend_bwd, backend_fwd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048, help="heads x head dim")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--timeout", type=float, default=0, help="watchdog (s): dump stacks and exit when exceeded")
    a = p.parse_args()
    if a.timeout > 0:
        faulthandler.dump_traceback_later(a.timeout, exit=True)
    import torch

    from flash_attn.cute import kernels
    from flash_attn.triton import backend as tb

    b, s, d, dtype = a.batch, a.seqlen, a.headdim, torch.bfloat16
    h = a.hidden // d
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to("cuda", dtype) for _ in range(4))
    kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=s, max_seqlen_k=s, block_table=None,
              softmax_scale=d ** -0.5, causal=a.causal, window_left=-1, window_right=0 if a.causal else -1,
              softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)
    out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
    ref = backend_bwd(tb, dout, q, k, v, out, lse, deterministic=False, **kw)
    torch.cuda.synchronize()
    config = kernels.bwd_config(dtype, d, a.causal, "sm_90a").key()  # with FLASH_ATTN_CUTE_OVERRIDES' bwd. fields
    print("config", config, flush=True)
    t0 = time.perf_counter()
    fn = kernels.bwd_kernel(dtype, d, a.causal)
    print(f"kernel ready in {time.perf_counter() - t0:.1f} s", flush=True)
    bm = config["block_m"]
    pad = -(-s // bm) * bm
    lse2 = torch.full((b, h, pad), float("inf"), dtype=torch.float32, device="cuda")
    lse2[:, :, :s] = lse * 1.4426950408889634
    delta = torch.zeros((b, h, pad), dtype=torch.float32, device="cuda")
    delta[:, :, :s] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for i in range(a.iters):
        dq_acc = torch.zeros((b, s, h, d), dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(q, k, v, dout, lse2, delta, dq_acc, dk, dv, d ** -0.5)
        torch.cuda.synchronize()
        print(f"iteration {i}: {1e3 * (time.perf_counter() - t0):.3f} ms", flush=True)
    errs = [(x.float() - r.float()).abs().max().item() for x, r in zip((dq_acc, dk, dv), ref)]
    print("max |cute - triton| dq dk dv: " + " ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
