"""The CuTeDSL backward's plan-rule modes against the routes they replace, whole backward calls through
flash_attn.cute.flash_attn_func (forward outside the timing): each mode with its plan rule on (the cute kernel)
and off (the dispatcher's next backend, Triton on Hopper), interleaved per shape; do_bench medians (ms) and
TFLOP/s (bwd = 2.5 x 4 * B * S^2 * H * D, half when causal; windows count the full square). bf16, batch x seqlen =
--tokens, heads = --hidden / D. Modes: "default" (the dense backward, for reference), "deterministic"
(plan.bwd_deterministic: dQ's adds in key-block order), "window" (plan.bwd_window, window (256, 0) causal or
(256, 256)), "softcap" (plan.bwd_softcap, softcap 30), "varlen" (plan.bwd_varlen: the batch's sequences packed,
flash_attn_varlen_func with cu_seqlens).

    python -m benchmarks.attention.bench_cute_bwd_modes [--headdims 64,128] [--seqlens 1024,4096] [--causal 0,1]
"""
import argparse

import torch

from benchmarks.common import bools as _bools
from benchmarks.common import ints as _ints
from benchmarks.common import reload_settings

RULES = {"deterministic": "plan.bwd_deterministic", "window": "plan.bwd_window", "softcap": "plan.bwd_softcap",
         "varlen": "plan.bwd_varlen"}


def main(argv=None):
    import os

    import triton

    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headdims", type=_ints, default=[64, 128])
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096])
    ap.add_argument("--causal", type=_bools, default=[False, True])
    ap.add_argument("--modes", default="default,deterministic,window")
    ap.add_argument("--overrides", default="", help="more FLASH_ATTN_CUTE_OVERRIDES items for the rule-on side (a "
                    "kernel variant, e.g. bwd.dq_writer=1)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=40)
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms (TFLOP/s)")
    print("| d | seqlen | causal | mode | cute kernel (rule on) | next backend (rule off) | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for d in args.headdims:
        for s in args.seqlens:
            for causal in args.causal:
                b, h = max(1, args.tokens // s), args.hidden // d
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                                 for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
                packed = [t.detach().reshape(b * s, h, d).requires_grad_() for t in (q, k, v)]
                cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
                for mode in args.modes.split(","):
                    kw = {}
                    if mode == "deterministic":
                        kw["deterministic"] = True
                    elif mode == "window":
                        kw["window_size"] = (256, 0 if causal else 256)
                    elif mode == "softcap":
                        kw["softcap"] = 30.0
                    times = {}
                    for on in (True, False):
                        items = [f"{RULES[mode]}={int(on)}"] if mode in RULES else []
                        os.environ["FLASH_ATTN_CUTE_OVERRIDES"] = ",".join(items + ([args.overrides] if on and
                                                                                    args.overrides else []))
                        reload_settings()
                        from flash_attn import dispatch

                        dispatch._choice.clear()
                        if mode == "varlen":
                            inputs, grad_out = packed, dout.reshape(b * s, h, d)
                            out = flash_attn_varlen_func(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s,
                                                         max_seqlen_k=s, causal=causal)
                        else:
                            inputs, grad_out = (q, k, v), dout
                            out, _ = flash_attn_func(q, k, v, causal=causal, **kw)
                        out = out[0] if isinstance(out, tuple) else out
                        times[on] = triton.testing.do_bench(
                            lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True),
                            warmup=args.warmup, rep=args.rep)
                        if mode not in RULES:
                            times[False] = times[True]
                            break
                    on, off = times[True], times[False]
                    print(f"| {d} | {s} | {int(causal)} | {mode} | {on:.3f} ({flops / on / 1e9:.0f}) | "
                          f"{off:.3f} ({flops / off / 1e9:.0f}) | {off / on:.2f}x |", flush=True)
    os.environ.pop("FLASH_ATTN_CUTE_OVERRIDES", None)


if __name__ == "__main__":
    main()
