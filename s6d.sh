source /tmp/cutedsl/env.sh; export PYTHONPATH=$PWD:$PYTHONPATH
mkdir -p $OUT
t0=$(date +%s)
(timeout 150 python -m flash_attn.cute.precompile --jobs 6 --backward 2>&1 | tail -1) &
(FLASH_ATTN_CUTE_FWD_PERSISTENT=1 timeout 150 python -m flash_attn.cute.precompile --jobs 4 2>&1 | tail -1) &
(FLASH_ATTN_CUTE_FWD_HDIMS=256 timeout 150 python -m flash_attn.cute.precompile --jobs 4 --head-dims 256 2>&1 | tail -1) &
(FLASH_ATTN_CUTE_FWD_PERSISTENT=1 FLASH_ATTN_CUTE_FWD_WARPGROUPS=64:3 timeout 150 python -m flash_attn.cute.precompile --jobs 2 --head-dims 64 --dtypes bf16 --causal true 2>&1 | tail -1) &
wait; echo "precompile $(( $(date +%s) - t0 )) s"
echo "== persistent tests"; timeout 240 python -m pytest -q -m gpu -p no:cacheprovider -rfE -x tests/test_cute_persistent.py -k "equals_one_tile or persistent_matches_reference" 2>&1 | tail -6
echo "== d256 tests"; timeout 150 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_cute_compile.py -k "wide_head_dims_match and 256" 2>&1 | tail -6
echo "== linear tests"; timeout 200 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_linear.py 2>&1 | tail -6
echo "== fwd A/B $(( $(date +%s) - t0 )) s"; timeout 200 python benchmarks/ab_cute_fwd.py --variants ";FLASH_ATTN_CUTE_FWD_PERSISTENT=1;FLASH_ATTN_CUTE_FWD_PERSISTENT=1,FLASH_ATTN_CUTE_FWD_WARPGROUPS=64:3" --headdims 64,128 --causal 1,0 2>&1 | grep -v Warn | tail -16
echo "== d256 bench $(( $(date +%s) - t0 )) s"; FLASH_ATTN_CUTE_FWD_HDIMS=256 timeout 200 python benchmarks/bench_attention.py --backends triton,cute --headdims 256 --seqlens 2048,16384 --causal 0,1 --peer-pythonpath "$PEER_PYTHONPATH" --warmup 10 --rep 40 --out $OUT/d256 2>&1 | grep -A12 "fwd TFLOP" | head -14
echo "== train A/B $(( $(date +%s) - t0 )) s"; timeout 240 python benchmarks/bench_train.py --no-hf --steps 8 --warmup 3 --out $OUT/train --ab FLASH_ATTN_FP32_WGRAD=1 --ab FLASH_ATTN_FP32_WGRAD=1,FLASH_ATTN_FP32_WGRAD_BIAS=gemm --ab FLASH_ATTN_FP32_WGRAD=1,FLASH_ATTN_WEIGHT_CAST_CACHE=1 --ab FLASH_ATTN_FP32_WGRAD=0 2>&1 | grep "|" | tail -8
echo "== triton ws tune $(( $(date +%s) - t0 )) s"; timeout 200 python benchmarks/tune_triton_fwd.py --headdims 128,256 --seqlens 2048,16384 --candidates ws --jobs 16 2>&1 | tail -40
echo "done $(( $(date +%s) - t0 )) s"
