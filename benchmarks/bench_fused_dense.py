"""Bias gradients of dense layers: torch's dim-0 sum vs flash_attn.ops.fused_dense's Triton column sum,
and a GPT-2-medium-shaped Linear forward + backward under bf16 autocast (nn.Linear vs FusedDense).

    python benchmarks/bench_fused_dense.py [--out benchmarks/results/h200]
Writes ops_fused_dense.md (GPU, versions, date, command) there.
"""
import argparse
import datetime
import os
import sys

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flash_attn.ops.fused_dense import FusedDense, bias_grad  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/h200")
    ap.add_argument("--rows", type=int, default=16384)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    M = args.rows
    lines = [f"# Dense-layer bias gradients ({torch.cuda.get_device_name()})", "",
             f"- torch {torch.__version__}, triton {triton.__version__}; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- command: `python benchmarks/bench_fused_dense.py {' '.join(argv or sys.argv[1:])}`",
             "- bf16, do_bench medians (us); GB/s = bytes of the gradient read / time", "",
             "| rows | cols | torch sum(0) us | GB/s | col_sum us | GB/s | speedup |", "|---|---|---|---|---|---|---|"]
    for N in (1024, 3072, 4096):
        g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        ref = g.float().sum(0)
        err = (bias_grad(g, torch.float32) - ref).abs().max().item()
        t_torch = do_bench(lambda: g.sum(0), rep=50) * 1e3
        t_ours = do_bench(lambda: bias_grad(g, torch.float32), rep=50) * 1e3
        gb = M * N * 2 / 1e3
        lines.append(f"| {M} | {N} | {t_torch:.1f} | {gb / t_torch:.0f} | {t_ours:.1f} | {gb / t_ours:.0f} | "
                     f"{t_torch / t_ours:.2f}x |")
        print(lines[-1], f"max err vs fp32 sum {err:.3g}", flush=True)
    lines += ["", "| layer (in -> out) | nn.Linear fwd+bwd us | FusedDense fwd+bwd us | speedup |", "|---|---|---|---|"]
    for k, n in ((1024, 3072), (1024, 1024), (4096, 1024)):
        x = torch.randn(M, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, n, device=dev, dtype=torch.bfloat16)
        plain = torch.nn.Linear(k, n, device=dev)
        fused = FusedDense(k, n, device=dev)

        def step(layer):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(x)
            y.backward(dy)

        t_p = do_bench(lambda: step(plain), rep=50, grad_to_none=[x, plain.weight, plain.bias]) * 1e3
        t_f = do_bench(lambda: step(fused), rep=50, grad_to_none=[x, fused.weight, fused.bias]) * 1e3
        lines.append(f"| {k} -> {n} | {t_p:.1f} | {t_f:.1f} | {t_p / t_f:.2f}x |")
        print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ops_fused_dense.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
