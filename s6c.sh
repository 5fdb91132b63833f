source /tmp/cutedsl/env.sh; export PYTHONPATH=$PWD:$PYTHONPATH
(timeout 120 python -m flash_attn.cute.precompile --jobs 12 --backward 2>&1 | tail -1)
echo "== LPT gpu tests"; timeout 200 python -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_cute_bwd.py -k lpt 2>&1 | tail -4
for L in 0 128 256 64; do echo "== bwd LPT=$L"; FLASH_ATTN_CUTE_BWD_LPT=$L timeout 150 python benchmarks/bench_cute_bwd.py --headdims 64,128 --seqlens 2048,8192 --warmup 10 --rep 40 2>&1 | grep "^|" ; done
echo "== overhead"; timeout 150 python benchmarks/bench_cute_overhead.py --no-cold 2>&1 | tail -12
echo "== train profile"; timeout 200 python benchmarks/profile_step.py train 2>&1 | grep -v Warn | tail -32
