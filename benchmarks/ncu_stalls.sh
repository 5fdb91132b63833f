#!/usr/bin/env bash
# Nsight Compute stall / pipe / instruction metrics of the cute forward (one-tile 3 warpgroups causal and not, the
# default causal kernel) and of the released FA4 (peer), d64 b1 s16384 h32, tabulated side by side. Needs the
# CuTeDSL bundle (source /tmp/cutedsl/env.sh) and the kernels precompiled. Session 8: attention_cute_session8.md.
#   OUT=/tmp/o bash benchmarks/ncu_stalls.sh
set -u
L=$OUT/ncu; mkdir -p $L
M="gpu__time_duration.sum,smsp__inst_executed.sum,sm__warps_active.avg.per_cycle_active,regex:^sm__pipe_tensor_op.*cycles_active\.avg\.pct_of_peak_sustained_active$,regex:^sm__inst_executed_pipe_xu\.avg\.pct_of_peak_sustained_active$,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
run() { name=$1; shift; timeout 80 ncu --section LaunchStats --metrics "$M" -k regex:cutlass_kernel -c 1 "$@" > $L/$name.txt 2>&1; echo "$name rc=$?"; }
P=benchmarks/profile_cute.py
FLASH_ATTN_CUTE_FWD_PERSISTENT=0 FLASH_ATTN_CUTE_FWD_WARPGROUPS=64:3 run c3_nc python $P --seqlen 16384 --batch 1 --headdim 64
FLASH_ATTN_CUTE_FWD_PERSISTENT=0 FLASH_ATTN_CUTE_FWD_WARPGROUPS=64:3 run c3_c python $P --seqlen 16384 --batch 1 --headdim 64 --causal
run def_c python $P --seqlen 16384 --batch 1 --headdim 64 --causal
(cd /tmp && PYTHONPATH="$PEER_PYTHONPATH" timeout 80 ncu --section LaunchStats --metrics "$M" -k regex:cutlass_kernel -c 1 python "$OLDPWD/$P" --peer --seqlen 16384 --batch 1 --headdim 64 --causal > $L/fa4_c.txt 2>&1; echo fa4_c rc=$?)
(cd /tmp && PYTHONPATH="$PEER_PYTHONPATH" timeout 80 ncu --section LaunchStats --metrics "$M" -k regex:cutlass_kernel -c 1 python "$OLDPWD/$P" --peer --seqlen 16384 --batch 1 --headdim 64 > $L/fa4_nc.txt 2>&1; echo fa4_nc rc=$?)
python - $L <<'PY'
import re, sys, glob, os
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.txt")):
    d = {}
    for line in open(f):
        m = re.match(r"\s+(\S+)\s+(\S+)?\s+([\d,.]+)\s*$", line)
        if m: d[m.group(1)] = m.group(3)
    rows[os.path.basename(f)[:-4]] = d
keys = sorted({k for d in rows.values() for k in d})
names = list(rows)
print("| metric | " + " | ".join(names) + " |")
for k in keys:
    vals = [rows[n].get(k, "") for n in names]
    if k.startswith("smsp__average_warps_issue_stalled") and all(float((v or "0").replace(",", "")) < 0.05 for v in vals):
        continue
    print(f"| {k.replace('smsp__average_warps_issue_stalled_', 'stall_').replace('_per_issue_active.ratio', '')} | " + " | ".join(vals) + " |")
PY
