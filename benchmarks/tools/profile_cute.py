"""Run one flash_attn.cute forward shape (or with --bwd its backward) a few times, for a profiler (ncu / nsys).

    python -m benchmarks.tools.profile_cute --seqlen 8192 --batch 2 --headdim 128 [--causal] [--bwd]
    ncu --section SpeedOfLight --section WarpStateStats -k regex:cutlass_kernel -c 1 \\
        python -m benchmarks.tools.profile_cute                            # our kernel (from the repository root)
    cd /tmp && PYTHONPATH=$PEER_PYTHONPATH ncu ... python /path/to/benchmarks/tools/profile_cute.py --peer
                                                                        # the released FA4, same shape
The script imports whatever flash_attn.cute comes first on sys.path: run as a module from the repository root,
the checkout's; run by its path from a folder that has no flash_attn package, with the peer's PYTHONPATH, the
released kernel's (it imports nothing from benchmarks/, so it runs that way too). With --bwd one forward, then the
backward of it (torch.autograd.grad) --iters times: give ncu the main backward kernel's name, e.g.
``-k regex:"BwdSm90|BackwardSm90"`` (ours: FlashBwdSm90; the released FA4's: FlashAttentionBackwardSm90), or
``PROFILE_KERNEL`` to benchmarks/run_gpu.sh's ncu / ncusrc steps.
"""
import argparse
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--bwd", action="store_true", help="the backward of one forward, --iters times")
    p.add_argument("--peer", action="store_true", help="label: the flash_attn.cute found on PYTHONPATH is the peer's")
    a = p.parse_args()
    import torch
    from flash_attn.cute import flash_attn_func

    h = a.hidden // a.headdim
    q, k, v = (torch.randn(a.batch, a.seqlen, h, a.headdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    if a.bwd:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flash_attn_func(q, k, v, causal=a.causal)
        out = out[0] if isinstance(out, tuple) else out  # (the released FA4 returns (out, lse))
        dout = torch.randn_like(out)
        for _ in range(a.iters):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    else:
        for _ in range(a.iters):
            flash_attn_func(q, k, v, causal=a.causal)
    torch.cuda.synchronize()
    print("ran", a, "from", sys.modules["flash_attn.cute"].__file__)


if __name__ == "__main__":
    main()
