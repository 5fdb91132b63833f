"""Decoding through the dense forward APIs (one query token per sequence): GPU microseconds per call, the profiler's
summed device activity over 20 calls, and ("graph") the wall time per call of 20 calls replayed from a CUDA graph
(what a captured decoding step costs: the gaps between a call's kernels too), for the root flash_attn_func (the
dispatcher's backend), flash_attn.cute unsplit and with num_splits=0 + pack_gqa, flash_attn_with_kvcache (the Triton
kernel) and SDPA (enable_gqa), each output's max difference from SDPA's beside it. bf16, d 128.
(benchmarks/results/h200/decode_dense.md)

    python -m benchmarks.attention.bench_decode_dense [--shapes B:Sk:H:Hk,...] [--kernels]

--kernels: each call's kernels with their device us per call, below its shape's line.
"""
import argparse

from benchmarks import common

DEFAULT_SHAPES = "1:8192:32:8,1:32768:32:8,8:8192:32:8,4:2048:32:32"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated B:Sk:H:Hk")
    ap.add_argument("--kernels", action="store_true", help="each call's kernels and their device us per call")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    import flash_attn
    import flash_attn.cute as fc

    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_dense needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GPU us per call, graph us per call "
          "(max |out - sdpa|)")
    for item in filter(None, args.shapes.split(",")):
        B, Sk, H, Hk = map(int, item.split(":"))
        q = torch.randn(B, 1, H, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Sk, Hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        calls = {
            "root flash_attn_func": lambda: flash_attn.flash_attn_func(q, k, v),
            "cute unsplit": lambda: fc.flash_attn_func(q, k, v)[0],
            "cute num_splits=0 pack_gqa": lambda: fc.flash_attn_func(q, k, v, num_splits=0, pack_gqa=True)[0],
            "flash_attn_with_kvcache": lambda: flash_attn.flash_attn_with_kvcache(q, k, v),
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
        }
        row, kernels = [], []
        for name, fn in calls.items():
            out = fn()
            out = out.transpose(1, 2) if name == "sdpa" else out
            err = float((out.float() - ref.float()).abs().max())
            graph = common.graph_us(fn)
            graph = "-" if graph is None else f"{graph:.1f}"
            row.append(f"{name} {common.gpu_us(fn, 20, warmup=3):.1f}, graph {graph} ({err:.3f})")
            if args.kernels:
                rows = common.kernel_us(fn, warmup=3)
                kernels.append(f"  {name}: " + ", ".join(f"{k[:60]} {t:.1f}" for k, t in rows.items()))
        print(f"B {B}, Sk {Sk}, H {H} / Hk {Hk}: " + "; ".join(row), flush=True)
        for line in kernels:
            print(line, flush=True)


if __name__ == "__main__":
    main()
