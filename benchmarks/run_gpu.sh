#!/usr/bin/env bash
# Everything the GPU tier needs in ONE device call: environment report, the GPU-marked tests (and the
# rest of the suite on CUDA), then the benchmarks. Logs and result tables go under $OUT.
#   run command="bash benchmarks/run_gpu.sh [quick]"      (device tool; $OUT is set there)
# With CuTeDSL brought over (see ../shared/device/README.md) source /tmp/cutedsl/env.sh first, and the
# released flash-attn-4 is benchmarked as a peer through $PEER_PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_attn_gpu_out}
mkdir -p "$OUT/results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
MODE=${1:-full}
status=0

python -m flash_attn.cli info 2>&1 | tee "$OUT/info.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$OUT/info.txt"

# GPU-marked tests first (bf16, real sizes), then the whole suite on CUDA.
python -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$MODE" = full ]; then
    python -m pytest -q -m "not gpu" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_rest.log" | tail -n 15
fi

peer=()
[ -n "${PEER_PYTHONPATH:-}" ] && peer=(--peer-pythonpath "$PEER_PYTHONPATH")
bench() {  # bench NAME ARGS...: one benchmark, its log under $OUT, its tables under $OUT/results
    local name=$1; shift
    echo "== $name $*"
    python "benchmarks/$name.py" --out "$OUT/results" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
}
if [ "$MODE" = quick ]; then
    bench bench_attention --headdims 128 --seqlens 2048,8192 "${peer[@]}"
    bench bench_train --quick
else
    bench bench_attention "${peer[@]}"
    bench bench_ops
    bench bench_models --skip-train   # the training-step target is measured by bench_train
    bench bench_train
fi
exit $status
