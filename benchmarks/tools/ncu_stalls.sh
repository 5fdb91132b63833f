#!/usr/bin/env bash
# Nsight Compute stall / pipe / instruction metrics of cute forward kernels and of the released FA4 (peer),
# tabulated side by side. Needs the CuTeDSL bundle (source /tmp/cutedsl/env.sh; $PEER_PYTHONPATH for the peer).
#   OUT=/tmp/o bash benchmarks/tools/ncu_stalls.sh
#   NCU_CASES="one:FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=0:--seqlen 1024 --batch 16 --causal;fa4:peer:--seqlen 1024 --batch 16 --causal" \
#       OUT=/tmp/o bash benchmarks/tools/ncu_stalls.sh
# NCU_CASES: cases separated by ";", each "name:ENV:profile_cute.py arguments", ENV a space-separated list of
# VAR=value settings (e.g. FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=0,fwd.warpgroups=3), "-" for none, or "peer" for the released FA4 on the same shape. Unset: d64 b1 s16384, the
# one-tile kernel with 3 warpgroups causal and not, the default causal kernel, FA4 causal and not.
set -u
L=$OUT/ncu; mkdir -p $L
M="gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.avg,sm__cycles_active.max,sm__warps_active.avg.per_cycle_active,regex:^sm__pipe_tensor_op.*cycles_active\.avg\.pct_of_peak_sustained_active$,regex:^sm__inst_executed_pipe_xu\.avg\.pct_of_peak_sustained_active$,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
P=$PWD/benchmarks/tools/profile_cute.py  # the peer runs it by path from /tmp (no flash_attn there)
S8="--seqlen 16384 --batch 1 --headdim 64"
W3="FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=0,fwd.warpgroups=3"  # the one-tile kernel, 3 warpgroups (d64)
CASES=${NCU_CASES:-"c3_nc:$W3:$S8;c3_c:$W3:$S8 --causal;def_c:-:$S8 --causal;fa4_c:peer:$S8 --causal;fa4_nc:peer:$S8"}
IFS=';' read -ra list <<< "$CASES"
for case in "${list[@]}"; do
    IFS=':' read -r name envs args <<< "$case"
    if [ "$envs" = "peer" ]; then
        (cd /tmp && PYTHONPATH="$PEER_PYTHONPATH" timeout 120 ncu --section LaunchStats --metrics "$M" \
            -k regex:cutlass_kernel -c 1 python "$P" --peer $args > $L/$name.txt 2>&1; echo "$name rc=$?")
    else
        [ "$envs" = "-" ] && envs=""
        env $envs timeout 120 ncu --section LaunchStats --metrics "$M" -k regex:cutlass_kernel -c 1 \
            python -m benchmarks.tools.profile_cute $args > $L/$name.txt 2>&1; echo "$name rc=$?"
    fi
done
python - $L "$CASES" <<'PY'
import re, sys, os
rows = {}
for case in sys.argv[2].split(";"):
    name = case.split(":")[0]
    d = {}
    for line in open(os.path.join(sys.argv[1], name + ".txt")):
        m = re.match(r"\s+(\S+)\s+(\S+)?\s+([\d,.]+)\s*$", line)
        if m: d[m.group(1)] = m.group(3)
    rows[name] = d
keys = sorted({k for d in rows.values() for k in d})
names = list(rows)
print("| metric | " + " | ".join(names) + " |")
print("|---" * (len(names) + 1) + "|")
for k in keys:
    vals = [rows[n].get(k, "") for n in names]
    if k.startswith("smsp__average_warps_issue_stalled") and all(float((v or "0").replace(",", "")) < 0.05 for v in vals):
        continue
    print(f"| {k.replace('smsp__average_warps_issue_stalled_', 'stall_').replace('_per_issue_active.ratio', '')} | " + " | ".join(vals) + " |")
PY
