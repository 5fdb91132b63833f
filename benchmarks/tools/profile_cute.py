"""Run one flash_attn.cute forward shape a few times, for a profiler (ncu / nsys) to look at.

    python -m benchmarks.tools.profile_cute --seqlen 8192 --batch 2 --headdim 128 [--causal]
    ncu --section SpeedOfLight --section WarpStateStats -k regex:cutlass_kernel -c 1 \\
        python -m benchmarks.tools.profile_cute                            # our kernel (from the repository root)
    cd /tmp && PYTHONPATH=$PEER_PYTHONPATH ncu ... python /path/to/benchmarks/tools/profile_cute.py --peer
                                                                        # the released FA4, same shape
The script imports whatever flash_attn.cute comes first on sys.path: run as a module from the repository root,
the checkout's; run by its path from a folder that has no flash_attn package, with the peer's PYTHONPATH, the
released kernel's (it imports nothing from benchmarks/, so it runs that way too).
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
    p.add_argument("--peer", action="store_true", help="label: the flash_attn.cute found on PYTHONPATH is the peer's")
    a = p.parse_args()
    import torch
    from flash_attn.cute import flash_attn_func

    h = a.hidden // a.headdim
    q, k, v = (torch.randn(a.batch, a.seqlen, h, a.headdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for _ in range(a.iters):
        flash_attn_func(q, k, v, causal=a.causal)
    torch.cuda.synchronize()
    print("ran", a, "from", sys.modules["flash_attn.cute"].__file__)


if __name__ == "__main__":
    main()
