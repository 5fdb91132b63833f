"""Run one flash_attn.cute forward shape a few times, for a profiler (ncu / nsys) to look at.

    python benchmarks/profile_cute.py --seqlen 8192 --batch 2 --headdim 128 [--causal]
    ncu --section SpeedOfLight --section WarpStateStats -k regex:cutlass_kernel -c 1 \\
        python benchmarks/profile_cute.py                                  # our kernel
    cd /tmp && PYTHONPATH=$PEER_PYTHONPATH ncu ... python /path/to/benchmarks/profile_cute.py --peer
                                                                        # the released FA4, same shape
With --peer the script imports whatever flash_attn.cute comes first on PYTHONPATH (run it from a folder
that has no flash_attn package, with the peer's path), so the same shape runs on the released kernel.
"""
import argparse
import os
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--peer", action="store_true", help="use the flash_attn.cute found on PYTHONPATH as is")
    a = p.parse_args()
    if not a.peer:  # the project's package, whatever the current folder
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path[:0] = [root, os.path.join(root, "packages", "flash-attn-4")]
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
