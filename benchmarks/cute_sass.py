"""Compile the flash_attn.cute forward for sm_90a (no GPU needed), run ptxas on its PTX and print the
order of the instructions that matter for overlap (HGMMA, WARPGROUP.DEPBAR, MUFU.EX2, F2FP, barriers,
branches), run-length encoded. Used to check that ptxas keeps the P V wait after the softmax.

    python benchmarks/cute_sass.py 128 [causal]       # head dim, mask; needs ptxas (CUDA toolkit)
"""
import glob, os, re, subprocess, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "packages", "flash-attn-4"))
import torch, triton
from flash_attn.cute.interface import compile_fwd
d = tempfile.mkdtemp()
D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
compile_fwd(torch.bfloat16, D, causal, dump_dir=d)
ptx = glob.glob(d + "/*.ptx")[0]
r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", d + "/k.cubin"], capture_output=True, text=True)
print([l for l in r.stderr.splitlines() if "registers" in l or "spill" in l or "arn" in l])
cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
sass = subprocess.run([cuobj, "-sass", d + "/k.cubin"], capture_output=True, text=True).stdout.splitlines()
out, last = [], None
for line in sass:
    m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if not m:
        continue
    ins = m.group(2)
    for key in ("HGMMA", "DEPBAR", "MUFU.EX2", "F2FP", "BAR.SYNC", "BAR.ARV", "SYNCS.PHASECHK", "SYNCS.ARRIVE", "BRA", "SHFL", "FMUL"):
        if key in ins:
            tag = key
            if key == "HGMMA":
                tag = "HGMMA(" + ("RS" if "tnspB" in ins else "SS") + ")"
            if key == "BRA":
                tag = ins
            if key == "DEPBAR":
                tag = "DEPBAR " + ins.split(",")[-1].strip()
            if tag != last:
                out.append([m.group(1), tag, 1])
            else:
                out[-1][2] += 1
            last = tag
            break
for addr, tag, n in out:
    print(addr, tag, "x%d" % n if n > 1 else "")
