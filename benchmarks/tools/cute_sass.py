"""Compile the flash_attn.cute forward for sm_90a (no GPU needed), run ptxas on its PTX and print the
order of the instructions that matter for overlap (HGMMA, WARPGROUP.DEPBAR, MUFU.EX2, F2FP, barriers,
branches), run-length encoded. Used to check that ptxas keeps the P V wait after the softmax.

Then the steady-state mainloop: the loop (backward branch) holding the most HGMMAs, and in it the
shortest path from its head to its back-edge (spin-wait retries and the masked softmax are off that
path): what one consumer warp executes per key block when no block needs a mask. Printed as an opcode
histogram (opcode without modifiers), with the kernel's total SASS size, so before/after is one command.

    python -m benchmarks.tools.cute_sass 128 [causal|local] [softcap] [--hist]   # head dim, mask, softcap;
                                                                           # needs ptxas (CUDA toolkit)
    python -m benchmarks.tools.cute_sass 64 causal bwd [--hist]   # the backward (flash_bwd_sm90.py) instead,
                                                            # with FLASH_ATTN_CUTE_OVERRIDES' bwd. fields
    FLASH_ATTN_CUTE_OVERRIDES=fwd.persistent=1 python -m benchmarks.tools.cute_sass 128 --hist   # persistent
    FLASH_ATTN_CUTE_OVERRIDES=fwd.reverse=1 python -m benchmarks.tools.cute_sass 64 causal --hist   # key blocks
                                                            # from the last down (FlashFwdSm90 reverse)
    --hist: histogram and sizes only (no instruction order); --sass FILE: also write the SASS there;
    --path: also list the steady-state path's instructions
"""
import glob, heapq, os, re, subprocess, sys, tempfile
import torch, triton
from flash_attn.cute.kernels import compile_bwd, compile_fwd

args = [a for a in sys.argv[1:] if not a.startswith("--")]
hist_only = "--hist" in sys.argv
sass_out = sys.argv[sys.argv.index("--sass") + 1] if "--sass" in sys.argv else None
if sass_out in args:
    args.remove(sass_out)
d = tempfile.mkdtemp()
D = int(args[0]) if args else 128
causal, local, softcap = ("causal" in args[1:]), ("local" in args[1:]), ("softcap" in args[1:])
if "bwd" in args[1:]:
    compile_bwd(torch.bfloat16, D, causal, dump_dir=d)
else:
    compile_fwd(torch.bfloat16, D, causal, dump_dir=d, local=local, softcap=softcap)
ptx = glob.glob(d + "/*.ptx")[0]
r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", d + "/k.cubin"], capture_output=True, text=True)
print([l for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "arn" in l])
cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
sass = subprocess.run([cuobj, "-sass", d + "/k.cubin"], capture_output=True, text=True).stdout.splitlines()
if sass_out:
    open(sass_out, "w").write("\n".join(sass) + "\n")

# (address, instruction text without the trailing ';')
code = []
for line in sass:
    m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
    if m:
        code.append((int(m.group(1), 16), m.group(2)))

if not hist_only:
    out, last = [], None
    for a, ins in code:
        for key in ("HGMMA", "DEPBAR", "MUFU.EX2", "F2FP", "BAR.SYNC", "BAR.ARV", "SYNCS.PHASECHK",
                    "SYNCS.ARRIVE", "BRA", "SHFL", "FMUL", "RED", "UBLKRED", "UTMA"):
            if key in ins:
                tag = key
                if key == "HGMMA":
                    tag = "HGMMA(" + ("RS" if "tnspB" in ins else "SS") + ")"
                if key == "BRA":
                    tag = ins
                if key == "DEPBAR":
                    tag = "DEPBAR " + ins.split(",")[-1].strip()
                if tag != last:
                    out.append(["%04x" % a, tag, 1])
                else:
                    out[-1][2] += 1
                last = tag
                break
    for addr, tag, n in out:
        print(addr, tag, "x%d" % n if n > 1 else "")


def opcode(ins):
    """'@!P0 IMAD.MOV.U32 R1, ...' -> 'IMAD'."""
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    return ins.split()[0].split(".")[0]


def branch_target(ins):
    m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins)
    return int(m.group(1), 16) if m else None


# The steady-state loop: the conditional backward BRA whose range [target, branch] holds the most HGMMAs
# (unconditional backward BRAs are the returns from out-of-line spin-wait retries), among the innermost
# such loops (the persistent kernel's tile loop holds the key-block loop).
index = {a: i for i, (a, _) in enumerate(code)}
loops = []
for i, (a, ins) in enumerate(code):
    t = branch_target(ins)
    if t is not None and t <= a and t in index and ins.startswith("@"):
        n = sum("HGMMA" in code[j][1] for j in range(index[t], i + 1))
        if n:
            loops.append((n, index[t], i))
best = None
for n, lo_, hi_ in loops:
    if any((l2, h2) != (lo_, hi_) and lo_ <= l2 and h2 <= hi_ for _, l2, h2 in loops):
        continue  # holds another HGMMA loop
    if best is None or n > best[0] or (n == best[0] and hi_ - lo_ < best[2] - best[1]):
        best = (n, lo_, hi_)
print("kernel: %d SASS instructions (%d without NOP)" % (len(code), sum(opcode(c[1]) != "NOP" for c in code)))
if best is None:
    print("no loop with HGMMA found")
    sys.exit(0)
_, lo, hi = best

# Shortest path (in instructions) from the loop head to the back-edge, within the loop's range: per
# instruction i, edges to i + 1 (unless an unconditional BRA / EXIT) and to a BRA's target.
def succ(i):
    ins = code[i][1]
    pred = ins.startswith("@")
    t = branch_target(ins)
    op = opcode(ins)
    out = []
    if t is not None and t in index and lo <= index[t] <= hi and i != hi:
        out.append(index[t])
    if (pred or (t is None and op not in ("EXIT", "RET", "BRX", "JMX"))) and i + 1 <= hi:
        out.append(i + 1)
    return out


dist, prev, heap = {lo: 1}, {}, [(1, lo)]
while heap:
    dd, i = heapq.heappop(heap)
    if dd > dist.get(i, 1 << 30):
        continue
    for j in succ(i):
        nd = dd + (opcode(code[j][1]) != "NOP")
        if nd < dist.get(j, 1 << 30):
            dist[j], prev[j] = nd, i
            heapq.heappush(heap, (nd, j))
path, i = [hi], hi
while i != lo:
    i = prev[i]
    path.append(i)
path.reverse()
hist = {}
for i in path:
    op = opcode(code[i][1])
    if op != "NOP":
        hist[op] = hist.get(op, 0) + 1
print("mainloop 0x%04x..0x%04x (%d instructions in range); steady-state path: %d instructions"
      % (code[lo][0], code[hi][0], hi - lo + 1, sum(hist.values())))
print("  " + "  ".join("%s %d" % kv for kv in sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))))
# The overlap of P V with the softmax: the exp2s issued after the path's last P V HGMMA (register A,
# "tnspB") and before the wait for all groups (DEPBAR ... 0x0), going round the loop if the wait comes
# first in the iteration (the wait at the loop head follows the previous iteration's softmax).
ex2 = [k for k, i in enumerate(path) if "MUFU.EX2" in code[i][1]]
pv = [k for k, i in enumerate(path) if "HGMMA" in code[i][1] and "tnspB" in code[i][1]]
waits = [k for k, i in enumerate(path) if "DEPBAR" in code[i][1] and code[i][1].rstrip().endswith("0x0")]
if pv and waits:
    w, last_pv = waits[0], pv[-1]
    overlap = (sum(last_pv < k < w for k in ex2) if w > last_pv
               else sum(k > last_pv for k in ex2) + sum(k < w for k in ex2))
    print("  P V wait at 0x%04x (%s the P V HGMMAs in the iteration): %d of the path's %d MUFU.EX2 "
          "between the last P V HGMMA and it" % (code[path[w]][0], "after" if w > last_pv else "before",
                                                 overlap, len(ex2)))
if "--path" in sys.argv:
    for i in path:
        print("  %04x  %s" % code[i])
