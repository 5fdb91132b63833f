"""Summarise Nsight Compute source-page CSVs (`bash benchmarks/run_gpu.sh ncusrc` writes ncusrc_cute.csv and
ncusrc_fa4.csv under $OUT): per kernel, the warp instructions executed and the average active threads per
instruction, the stall reasons summed over all instructions, the opcode histogram of the steady-state loop
body (the instructions executed exactly as often as the most executed HGMMA), and the instructions with the
most stall samples.

    python -m benchmarks.tools.ncu_summary OUT/ncusrc_cute.csv [OUT/ncusrc_fa4.csv ...]
"""
import collections
import csv
import re
import sys


def read_rows(path):
    """The per-instruction rows of one ncu --page source --csv file (its header starts with "Address")."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no source-page table (a line starting with \"Address\")")
    return list(csv.DictReader(lines[start:]))


def _int(value):
    try:
        return int(float(value or 0))
    except ValueError:
        return 0


def opcode(source):
    """'@!P0 IMAD.MOV.U32 R1, ...' -> 'IMAD'."""
    source = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return source.split()[0].split(".")[0] if source else ""


def summarise(rows, top=15):
    executed = sum(_int(r.get("Instructions Executed")) for r in rows)
    threads = sum(_int(r.get("Thread Instructions Executed")) for r in rows)
    stalls = collections.Counter()
    for r in rows:
        for name, value in r.items():
            if name.startswith("stall_") and "(Not Issued)" not in name:
                stalls[name[len("stall_"):]] += _int(value)
    # the loop body: instructions executed as often as the most executed HGMMA (the mainloop's)
    body_count = max((_int(r.get("Instructions Executed")) for r in rows if opcode(r.get("Source", "")) == "HGMMA"),
                     default=None)
    body = collections.Counter(opcode(r.get("Source", "")) for r in rows
                               if body_count and _int(r.get("Instructions Executed")) == body_count)
    hot = sorted(rows, key=lambda r: -_int(r.get("Warp Stall Sampling (All Samples)")))[:top]
    return {"instructions": len(rows), "warp_instructions_executed": executed,
            "avg_threads": threads / executed if executed else 0.0, "stalls": stalls.most_common(10),
            "loop_executions": body_count, "loop_body": sum(body.values()), "loop_histogram": body.most_common(),
            "hot": [(r.get("Address"), _int(r.get("Warp Stall Sampling (All Samples)")), r.get("Source", "").strip())
                    for r in hot]}


def main(paths):
    for path in paths:
        s = summarise(read_rows(path))
        print(f"== {path}: {s['instructions']} SASS instructions, {s['warp_instructions_executed'] / 1e6:.1f}M warp "
              f"instructions executed, {s['avg_threads']:.2f} active threads per instruction")
        print("stall samples:", ", ".join(f"{k} {v}" for k, v in s["stalls"]))
        print(f"loop body (executed {s['loop_executions']}x each): {s['loop_body']} instructions:",
              " ".join(f"{k} {v}" for k, v in s["loop_histogram"]))
        print("most stall samples:")
        for addr, n, src in s["hot"]:
            print(f"  {addr} {n:7d} {src[:90]}")


if __name__ == "__main__":
    main(sys.argv[1:])
