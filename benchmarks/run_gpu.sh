#!/usr/bin/env bash
# Everything the GPU tier needs in ONE device call: environment report, the GPU-marked tests, then the
# benchmarks. Logs and result tables go under $OUT.
#   run command="bash benchmarks/run_gpu.sh [STEP ...]"      (device tool; $OUT is set there)
# STEPs (default: tests attention norm models train): tests rest attention cute cutebwd norm ops models train ncu
#   ncusrc profile tunetriton abfwd abdecode overhead vsfa4 vsfa4bwd vsfa4decode sanitize dqerr vsmods modab
#   fa3peer modpeer widebwd bwdloop bwdab firststore
#   tests      the GPU-marked tests (bf16, real sizes; GPU_TESTS, GPU_TEST_TIMEOUT)   rest   the rest on CUDA
#   attention  bench_attention, full grid                  cute   bench_attention, cute only, short grid
#   cutebwd    bench_cute_bwd: the cute backward (flash_bwd_sm90) vs Triton's, bf16 d64/d128, S 2k/8k
#   widebwd    the split-D backward kernel (d192 / d256 / the 192 / 128 pair, plan rule bwd_wide_d): its GPU tests,
#              then (if they pass) bench_cute_bwd against Triton's backward and the bwd.overlap=1 A/B
#   norm       bench_ops --only norm                       ops    bench_ops (norms and cross-entropy)
#   models     bench_models decode (cg=True)               train  bench_train (GPT-2 medium step)
#   profile    profile_step.py: per-kernel GPU time of a GPT-2 training step and of the norms
#   tunetriton the Triton tuners on the open cells: d128 causal forward (ws / wsp / wsb orders), d256 causal
#              backward with the GPU time per launch (--kernels)
#   ncu        Nsight Compute sections of the cute kernel and of the released FA4 (peer) on one shape
#   ncusrc     per-SASS-instruction stall samples of the cute kernel (and FA4's), CSV under $OUT
#              (PROFILE_ARGS: profile_cute.py arguments for ncu and ncusrc, e.g. "--headdim 64 --causal"; the backward:
#              PROFILE_ARGS="--bwd --seqlen 1024 --batch 16" PROFILE_KERNEL="BwdSm90|BackwardSm90")
#   abfwd      ab_cute_fwd.py with $AB_ARGS (e.g. '--headdims 128 --causal 1 --variants ";FLASH_ATTN_CUTE_OVERRIDES=fwd.pin=0"')
#   abdecode   ab_cute_decode.py: decoding shapes, unpacked / pack_gqa / num_splits=0 / both / the defaults' rules,
#              dense and paged (64-row pages), nothing in FLASH_ATTN_CUTE_DISABLE and plan.pack_gqa_auto=1 (the rules
#              for pack_gqa=None) (DECODE_ARGS: more arguments)
#   overhead   bench_cute_overhead.py --no-cold: per-call time of the tiny cute forward, SDPA beside it
#   sanitize   compute-sanitizer racecheck, memcheck and synccheck (SANITIZE_TOOLS; each bounded by SANITIZE_TIMEOUT s,
#              default 900) (every kernel of the process) over the cases of
#              sanitize_cute.py: one small call of every kind of cute forward kernel, each checked against the
#              reference too
#   vsfa4      vs_fa4.py --control: the cute forward against the released FA4 with both sides timed per cell in
#              alternating rounds, a second worker of ours as the noise floor (VS_ARGS: more arguments)
#   vsfa4bwd   vs_fa4.py --bwd: the backward on issue 31's 18-cell grid (d 64/128/256, S 1k/4k/16k, causal or not)
#              against the released FA4, alternating rounds (VS_BWD_ARGS: more arguments)
#   vsfa4decode vs_fa4.py --decode: the same on decoding shapes, both sides called with num_splits=0 (FA4's
#              "choose"; ours with plan.pack_gqa_auto=1 and nothing disabled; VS_DECODE_ARGS: more arguments)
#   dqerr      dq_error_map.py: each backend's dQ / dK / dV error against fp64, the released FA4 beside ours
#   vsmods     vs_fa4.py --mods: the mod kernels against the released FA4 with the same CuTeDSL mods (VS_MODS_ARGS)
#   modab      bench_flex.py on the mod kernels' tile order / O store experiments, alternating (MODAB_VARIANTS)
#   bwdloop    the backward GPU test files (about 2400 cases)
#   bwdab      ab_cute_bwd.py on backward loop experiments, alternating (BWD_AB_VARIANTS, BWD_AB_HEADDIMS)
#   fa3peer    FA3's own hopper tests against flash_attn_interface (.peer/fa3 carried; benchmarks/peer_mods)
#   modpeer    FA4's mod tests against flash_attn.cute (.peer/fa4mods carried; PEER_SEED, PEER_CONTROL)
#   firststore the first-store dQ (bwd.dq_first_store, off by default): its GPU tests, then (if they pass) its A/B
#              against the default beside the released FA4 at d64 / d128, 1k / 4k (vs_fa4 --control-overrides), and
#              the per-kernel view at 1k with it on (FIRSTSTORE_ROUNDS, default 3)
# With CuTeDSL brought over (see ../shared/device/README.md: two bundle calls) /tmp/cutedsl/env.sh is
# sourced, the cute backend is available and the released flash-attn-4 is benchmarked as a peer.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flash_attn_gpu_out}
mkdir -p "$OUT/results"
[ -f /tmp/cutedsl/env.sh ] && source /tmp/cutedsl/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
STEPS=${*:-tests attention norm models train}
status=0

python -m flash_attn.cli info 2>&1 | tee "$OUT/info.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/info.txt"

peer=()
[ -n "${PEER_PYTHONPATH:-}" ] && peer=(--peer-pythonpath "$PEER_PYTHONPATH")
bench() {  # bench GROUP.SCRIPT ARGS...: benchmarks.GROUP.SCRIPT, its log under $OUT, its tables under $OUT/results
    local module=benchmarks.$1 name=${1##*.}; shift
    echo "== $module $*"
    python -m "$module" --out "$OUT/results" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 40
}
for step in $STEPS; do
    case $step in
    tests)  # one process per file: a device-side assert poisons its CUDA context for every later test.
        # GPU_TESTS="cute_bwd layer_norm" limits the files (test_<name>.py); GPU_TEST_TIMEOUT (s, default
        # 300) bounds each file, so one slow or hung file is reported and the others still run.
        for f in tests/*/test_*.py; do
            grep -q "mark.gpu" "$f" || continue
            name=$(basename "$f" .py)
            if [ -n "${GPU_TESTS:-}" ] && ! [[ " $GPU_TESTS " == *" ${name#test_} "* ]]; then continue; fi
            timeout "${GPU_TEST_TIMEOUT:-300}" python -m pytest -q -m gpu -p no:cacheprovider -rfE "$f" \
                > "$OUT/pytest_gpu_$name.log" 2>&1
            rc=$?
            [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
            if [ $rc -eq 124 ]; then
                echo "$f: TIMED OUT after ${GPU_TEST_TIMEOUT:-300} s (progress in $OUT/pytest_gpu_$name.log)"
            else
                echo "$f: $(tail -n 1 "$OUT/pytest_gpu_$name.log")"
            fi
        done 2>&1 | tee "$OUT/pytest_gpu.log"
        grep -h "^FAILED\|^ERROR" "$OUT"/pytest_gpu_*.log | head -n 40
        grep -q "failed\|error\|TIMED OUT" "$OUT/pytest_gpu.log" && status=1 ;;
    rest)
        python -m pytest -q -m "not gpu" -p no:cacheprovider 2>&1 | tee "$OUT/pytest_rest.log" | tail -n 15 ;;
    attention) bench attention.bench_attention "${peer[@]}" ;;
    sanitize)
        for tool in ${SANITIZE_TOOLS:-racecheck memcheck synccheck}; do
            # the default selection with every kernel on, as the cases predict it
            FLASH_ATTN_CUTE_DISABLE= FLASH_ATTN_CUTE_OVERRIDES= \
                timeout "${SANITIZE_TIMEOUT:-900}" compute-sanitizer --tool "$tool" --error-exitcode 1 \
                python -m benchmarks.tools.sanitize_cute > "$OUT/sanitize_$tool.log" 2>&1
            rc=$?
            [ $rc -eq 0 ] || status=1
            echo "compute-sanitizer $tool: rc $rc; $(grep -c ': ok$' "$OUT/sanitize_$tool.log") cases ok"
            grep -E "FAILED|ERROR SUMMARY|========= (Error|Race|Barrier|Invalid)" "$OUT/sanitize_$tool.log" | head -n 12
        done ;;
    vsfa4) python -m benchmarks.attention.vs_fa4 --peer-pythonpath "${PEER_PYTHONPATH:?the released flash-attn-4 (bundle)}" \
               --control ${VS_ARGS:-} --out "$OUT/results" 2>&1 | tee "$OUT/vs_fa4.log" | tail -n 45 ;;
    firststore)
        timeout 240 python -m pytest -q -m gpu -n 14 -p no:cacheprovider tests/cute/test_cute_bwd_first_store.py \
            2>&1 | tee "$OUT/firststore_tests.log" | tail -n 8
        if [ "${PIPESTATUS[0]}" -ne 0 ]; then
            status=1
        else
            timeout 300 python -m benchmarks.attention.vs_fa4 --bwd "${peer[@]}" --headdims 64,128 --seqlens 1024,4096 \
                --rounds "${FIRSTSTORE_ROUNDS:-3}" --control-overrides bwd.dq_first_store=1 --out "$OUT/results" 2>&1 \
                | tee "$OUT/firststore_ab.log" | tail -n 16
            FLASH_ATTN_CUTE_OVERRIDES=bwd.dq_first_store=1 timeout 120 python -m benchmarks.attention.vs_fa4 --bwd \
                "${peer[@]}" --kernels --headdims 64,128 --seqlens 1024 --rounds 1 --out "$OUT/results_kernels" 2>&1 \
                | tee "$OUT/firststore_kernels.log" | tail -n 30
        fi ;;
    vsfa4bwd) timeout 590 python -m benchmarks.attention.vs_fa4 --bwd --peer-pythonpath \
               "${PEER_PYTHONPATH:?the released flash-attn-4 (bundle)}" --seqlens 1024,4096,16384 --rounds 3 \
               ${VS_BWD_ARGS:-} --out "$OUT/results" 2>&1 | tee "$OUT/vs_fa4_bwd.log" | tail -n 30 ;;
    vsfa4decode) FLASH_ATTN_CUTE_OVERRIDES=plan.pack_gqa_auto=1 FLASH_ATTN_CUTE_DISABLE= python -m benchmarks.attention.vs_fa4 --decode \
               --peer-pythonpath "${PEER_PYTHONPATH:?the released flash-attn-4 (bundle)}" --call num_splits=0 \
               --causal 0 ${VS_DECODE_ARGS:-} --out "$OUT/results" 2>&1 | tee "$OUT/vs_fa4_decode.log" | tail -n 20 ;;
    cute) bench attention.bench_attention --backends cute --headdims 64,128 --seqlens 1024,4096,16384 "${peer[@]}" ;;
    bwdloop)  # the backward's GPU test files
        timeout "${BWD_TEST_TIMEOUT:-560}" python -m pytest -q -m gpu -n 12 -p no:cacheprovider tests/cute/test_cute_bwd.py \
            tests/cute/test_cute_bwd_det.py tests/cute/test_cute_bwd_varlen.py tests/cute/test_cute_bwd_softcap.py \
            tests/cute/test_cute_score_mod.py tests/cute/test_cute_block_sparse.py > "$OUT/bwdloop_tests.log" 2>&1
        rc=$?
        echo "backward GPU tests: rc $rc"; grep -E "passed|failed" "$OUT/bwdloop_tests.log" | tail -n 3
        grep -E "^FAILED" "$OUT/bwdloop_tests.log" | head -n 20
        if [ $rc -ne 0 ]; then status=1; fi ;;
    bwdab)  # an A/B of backward loop experiments (e.g. BWD_AB_VARIANTS=";FLASH_ATTN_CUTE_OVERRIDES=bwd.stages=3")
        timeout 480 python -m benchmarks.attention.ab_cute_bwd --headdims "${BWD_AB_HEADDIMS:-64,128}" \
            --seqlens 1024,4096,16384 --rounds 4 --variants "${BWD_AB_VARIANTS:?the variants to compare}" \
            2>&1 | tee "$OUT/ab_bwd_loop.log" | tail -n 30 ;;
    widebwd)
        timeout "${WIDE_TEST_TIMEOUT:-420}" python -m pytest -q -m gpu -n 12 -p no:cacheprovider \
            tests/cute/test_cute_bwd_wide.py > "$OUT/wide_tests.log" 2>&1
        rc=$?
        echo "wide backward tests: rc $rc"; grep -E "passed|failed" "$OUT/wide_tests.log" | tail -n 3
        grep -E "^FAILED" "$OUT/wide_tests.log" | head -n 20
        if [ $rc -ne 0 ]; then status=1; continue; fi
        FLASH_ATTN_CUTE_OVERRIDES=plan.bwd_wide_d=1 timeout 300 python -m benchmarks.attention.bench_cute_bwd \
            --headdims 192,256 --seqlens 1024,4096,16384 --warmup 10 --rep 40 --out "$OUT/results" 2>&1 \
            | tee "$OUT/bench_cute_bwd_wide.log"
        timeout 300 python -m benchmarks.attention.ab_cute_bwd --headdims 192,256 --seqlens 1024,4096 --variants \
            "FLASH_ATTN_CUTE_OVERRIDES=plan.bwd_wide_d=1;FLASH_ATTN_CUTE_OVERRIDES=plan.bwd_wide_d=1,bwd.overlap=1" \
            2>&1 | tee "$OUT/ab_cute_bwd_wide.log" ;;
    cutebwd) timeout 600 python -m benchmarks.attention.bench_cute_bwd --out "$OUT/results" 2>&1 | tee "$OUT/bench_cute_bwd.log" ;;
    norm) bench ops.bench_ops --only norm ;;
    ops) bench ops.bench_ops ;;
    models) bench models.bench_models --skip-train ;;   # the training-step target is measured by bench_train
    train) bench training.bench_train ;;
    ncu)
        sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
                  --section InstructionStats --section WarpStateStats --section SchedulerStats)
        ncu "${sections[@]}" -k regex:"${PROFILE_KERNEL:-cutlass_kernel}" -c 1 python -m benchmarks.tools.profile_cute ${PROFILE_ARGS:-} 2>&1 \
            | tee "$OUT/ncu_cute.txt" | grep -E "Throughput|Pipe|Stall|Issue|Warp Cycles|L2|Eligible|Executed Instructions" | head -n 60
        if [ -n "${PEER_PYTHONPATH:-}" ]; then
            (cd /tmp && PYTHONPATH="$PEER_PYTHONPATH" ncu "${sections[@]}" -k regex:"${PROFILE_KERNEL:-cutlass_kernel}" -c 1 \
                python "$OLDPWD/benchmarks/tools/profile_cute.py" --peer ${PROFILE_ARGS:-}) 2>&1 | tee "$OUT/ncu_fa4.txt" \
                | grep -E "Throughput|Pipe|Stall|Issue|Warp Cycles|L2|Eligible|Executed Instructions" | head -n 60
        fi ;;
    ncusrc)
        src=(--section SourceCounters --section WarpStateStats --page source --print-source sass --csv)
        ncu "${src[@]}" -k regex:"${PROFILE_KERNEL:-cutlass_kernel}" -c 1 python -m benchmarks.tools.profile_cute ${PROFILE_ARGS:-} > "$OUT/ncusrc_cute.csv" 2>&1
        echo "ncusrc cute: $(wc -l < "$OUT/ncusrc_cute.csv") lines"
        if [ -n "${PEER_PYTHONPATH:-}" ]; then
            (cd /tmp && PYTHONPATH="$PEER_PYTHONPATH" ncu "${src[@]}" -k regex:"${PROFILE_KERNEL:-cutlass_kernel}" -c 1 \
                python "$OLDPWD/benchmarks/tools/profile_cute.py" --peer ${PROFILE_ARGS:-}) > "$OUT/ncusrc_fa4.csv" 2>&1
            echo "ncusrc fa4: $(wc -l < "$OUT/ncusrc_fa4.csv") lines"
        fi
        python -m benchmarks.tools.ncu_summary "$OUT"/ncusrc_*.csv 2>&1 | tee "$OUT/ncusrc_summary.txt" ;;
    tunetriton)  # the open Triton questions (docs/STATUS.md): d128 causal forward orders, d256 causal backward launches
        timeout 300 python -m benchmarks.tools.tune_triton_fwd --headdims 128 --causal 1 --seqlens 2048,4096,8192,16384 \
            --candidates ws 2>&1 | tee "$OUT/tune_triton_fwd.log" | tail -n 12
        timeout 300 python -m benchmarks.tools.tune_triton_bwd_ws --headdims 256 --causal 1 --seqlens 2048,16384 --kernels \
            2>&1 | tee "$OUT/tune_triton_bwd_ws.log" | tail -n 30 ;;
    abfwd)  # A/B of cute forward variants in one process (AB_ARGS: ab_cute_fwd.py arguments, --variants among them)
        timeout "${AB_TIMEOUT:-300}" python -m benchmarks.attention.ab_cute_fwd ${AB_ARGS:---variants ";"} 2>&1 \
            | tee "$OUT/ab_cute_fwd.log" | tail -n 40 ;;
    abdecode)  # pack_gqa / split-KV on decoding shapes (docs/STATUS.md: the rules for pack_gqa=None, num_splits=0)
        variants="plain:pack_gqa=False;pack:pack_gqa=True;split:pack_gqa=False,num_splits=0"
        variants+=";both:pack_gqa=True,num_splits=0;rules:num_splits=0"
        for paged in 0 64; do
            FLASH_ATTN_CUTE_DISABLE= timeout "${AB_TIMEOUT:-300}" python -m benchmarks.attention.ab_cute_decode --paged $paged \
                --env FLASH_ATTN_CUTE_OVERRIDES=plan.pack_gqa_auto=1 --variants "$variants" \
                ${DECODE_ARGS:-} 2>&1 | tee "$OUT/ab_cute_decode_paged$paged.log" | tail -n 14
        done ;;
    dqerr) timeout 300 python -m benchmarks.tools.dq_error_map --headdims 64,128 --seqlen 1024 --backends cute,triton${PEER_PYTHONPATH:+,fa4} \
        "${peer[@]}" 2>&1 | tee "$OUT/dq_error_map.log" ;;
    vsmods) timeout 500 python -m benchmarks.attention.vs_fa4 --peer-pythonpath "${PEER_PYTHONPATH:?the released flash-attn-4 (bundle)}" \
        --mods --seqlens 4096,16384 --headdims 128 --rounds 3 --out "$OUT/results" ${VS_MODS_ARGS:-} 2>&1 | tee "$OUT/vs_fa4_mods.log" ;;
    modab)  # alternating runs, one process each; a variant is a FLASH_ATTN_CUTE_OVERRIDES value ("-": none)
        for v in ${MODAB_VARIANTS:-- fwd.lpt=1 fwd.tma_o=1 - fwd.lpt=1 fwd.tma_o=1}; do
            [ "$v" = - ] && v=
            echo "== modab variant [$v]" | tee -a "$OUT/modab.log"
            FLASH_ATTN_CUTE_OVERRIDES=$v timeout 150 python -m benchmarks.attention.bench_flex --seqlens 4096,16384 \
                --cases causal,softcap_causal --warmup 5 --rep 20 2>&1 | tee -a "$OUT/modab.log" | grep "^| [0-9]"
        done ;;
    fa3peer) PEER_SUITE=fa3 PEER_BUDGET=${PEER_BUDGET:-400} bash benchmarks/peer_mods/run.sh ;;
    modpeer) PEER_BUDGET=${PEER_BUDGET:-400} bash benchmarks/peer_mods/run.sh ;;
    overhead) timeout 300 python -m benchmarks.attention.bench_cute_overhead --no-cold 2>&1 | tee "$OUT/bench_cute_overhead.log" ;;
    profile) python -m benchmarks.tools.profile_step train 2>&1 | tee "$OUT/profile_train.txt"
        python -m benchmarks.tools.profile_step norm --hidden 4096 2>&1 | tee "$OUT/profile_norm.txt" ;;
    *) echo "unknown step $step"; status=1 ;;
    esac
done
exit $status
