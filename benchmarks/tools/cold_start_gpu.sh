#!/usr/bin/env bash
# Cold start of flash_attn.cute on a GPU machine (benchmarks/results/h100/cold_start.md): a copy of
# packages/flash-attn-4 stands for the installed package; its shipped folder is filled here (this machine's CuTeDSL
# runtime flavour), then fresh processes with an empty user cache time the kernel lookup and the first calls, with
# the shipped entries and without them (a compile), then once more on the compiled entry (a warm user cache).
#   bash benchmarks/tools/cold_start_gpu.sh        (from the project root, CuTeDSL importable)
set -u
BASE=${PYTHONPATH:-}
PKG=$(mktemp -d)/fa4
cp -r packages/flash-attn-4 "$PKG"
rm -rf "$PKG"/flash_attn/cute/_prebuilt
(cd "$PKG" && PYTHONPATH=$PKG${BASE:+:$BASE} python -m flash_attn.cute.precompile --prebuilt --dtypes bf16 \
    --head-dims 128 --causal false --no-backward 2>&1 | tail -1)
PROBE=$(mktemp -d)/probe.py
cat > "$PROBE" <<'PY'
import sys, time
import torch
from flash_attn.cute import kernels
x = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t0 = time.perf_counter()
kernels.fwd_kernel(torch.bfloat16, 128, False, "sm_90a", short=True)
t1 = time.perf_counter()
import flash_attn.cute as fc
out = fc.flash_attn_func(x, x, x)[0]
torch.cuda.synchronize()
t2 = time.perf_counter()
out = fc.flash_attn_func(x, x, x)[0]
torch.cuda.synchronize()
t3 = time.perf_counter()
ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (x, x, x))).transpose(1, 2)
print(f"{sys.argv[1]}: origin {list(kernels._origins.values())}, load {1e3 * (t1 - t0):.0f} ms, first call "
      f"{1e3 * (t2 - t1):.0f} ms, second {1e3 * (t3 - t2):.2f} ms, modules "
      f"{[m for m in ('cutlass', 'cutlass.cute', 'tvm_ffi', 'triton') if m in sys.modules]}, "
      f"max |out - sdpa| {float((out - ref).abs().max()):.4f}")
PY
probe() {  # probe LABEL CACHE_DIR
    (cd /tmp && FLASH_ATTN_CUTE_CACHE=$2 PYTHONPATH=$PKG${BASE:+:$BASE} python "$PROBE" "$1" 2>&1 | tail -1)
}
probe "shipped entries, empty user cache" "$(mktemp -d)"
probe "shipped entries, empty user cache, again" "$(mktemp -d)"
rm -rf "$PKG"/flash_attn/cute/_prebuilt/*
WARM=$(mktemp -d)
probe "no shipped entries, empty user cache (compiles)" "$WARM"
probe "no shipped entries, warm user cache" "$WARM"
