"""The loops of a compiled kernel's SASS and their instruction mix, on the CPU: for comparing the cute backward's
main loop with the released FA4's (or any two kernels) without a GPU.

    python -m benchmarks.tools.sass_loops --ours --headdim 128 [--causal] [--overrides bwd.block_m=64]
    python -m benchmarks.tools.sass_loops --fa4-src /tmp/fa4src --fa4-pythonpath /tmp/qksite --headdim 128 [--causal]
    python -m benchmarks.tools.sass_loops FILE.cubin [FILE.cubin ...]

--ours compiles flash_attn.cute's backward for sm_90a (kernels.compile_bwd; FLASH_ATTN_CUTE_OVERRIDES from
--overrides). --fa4-src compiles the released FA4's SM90 backward from its source tree (a folder holding
flash_attn/cute, e.g. `git archive HEAD flash_attn/cute` of the upstream mirror; it imports `quack`, from the
quack-kernels wheel, given by --fa4-pythonpath) in a subprocess: FA4's CPU-only compilation (FLASH_ATTENTION_ARCH=sm_90,
CUTE_DSL_ARCH=sm_90a, FLASH_ATTENTION_NUM_SMS=132) of `_flash_attn_bwd` under torch's FakeTensorMode, bf16, batch 16 x
1024 x 16 heads, its cubins kept (CUTE_DSL_KEEP_CUBIN). Each cubin's SASS (cuobjdump) is split into its loops (a
backward branch and the instructions it spans) that hold WGMMAs (HGMMA); each loop's length and its commonest opcodes
are printed. A static count: a loop's branches skip some of it at run time (a causal kernel's mask, for one).
"""
import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile

_FA4_SCRIPT = r"""
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
import flash_attn.cute.interface as I
causal, d = bool(int(sys.argv[1])), int(sys.argv[2])
with FakeTensorMode():
    q, k, v, o, do = (torch.empty(16, 1024, 2048 // d, d, dtype=torch.bfloat16, device="cuda") for _ in range(5))
    lse = torch.empty(16, 2048 // d, 1024, dtype=torch.float32, device="cuda")
    I._flash_attn_bwd(q, k, v, o, do, lse, causal=causal)
"""


def sass_of(cubin):
    from flash_attn.testing import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        raise SystemExit("no cuobjdump (on PATH or in triton's NVIDIA backend)")
    return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def opcode(text):
    """The opcode of one SASS instruction's text, predicate and modifiers dropped (``@!P0 BRA ...`` -> BRA)."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def loops(sass):
    """[(first address, last address, [opcodes])] of the loops (a branch to a lower address and what it spans)
    that hold an HGMMA, innermost first."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = [opcode(t) for _, t in ins[index[int(m.group(1), 16)]:i + 1]]
            if "HGMMA" in body:
                out.append((int(m.group(1), 16), a, body))
    return sorted(out, key=lambda x: len(x[2])), len(ins)


def report(label, cubin, top=20):
    found, total = loops(sass_of(cubin))
    print(f"== {label}: {total} instructions ({os.path.basename(cubin)[:90]})")
    for first, last, body in found:
        counts = collections.Counter(body)
        print(f"  loop {first:#x}-{last:#x}: {len(body)} instructions, {counts['HGMMA']} HGMMA; "
              + ", ".join(f"{k} {v}" for k, v in counts.most_common(top)))


def ours(headdim, causal, overrides, folder):
    os.environ["FLASH_ATTN_CUTE_OVERRIDES"] = overrides
    import torch

    from flash_attn.cute import kernels, settings

    settings.reload()
    kernels.compile_bwd(torch.bfloat16, headdim, causal, arch="sm_90a", dump_dir=folder)
    return glob.glob(os.path.join(folder, "*.cubin"))


def fa4(src, pythonpath, headdim, causal, folder):
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
               CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=folder,
               PYTHONPATH=os.pathsep.join(x for x in (src, pythonpath) if x))
    r = subprocess.run([sys.executable, "-c", _FA4_SCRIPT, str(int(causal)), str(headdim)], cwd=folder, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"FA4's compile failed:\n{r.stderr[-3000:]}")
    return [p for p in glob.glob(os.path.join(folder, "*.cubin")) if "BackwardSm90" in p]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cubins", nargs="*")
    ap.add_argument("--ours", action="store_true", help="compile flash_attn.cute's backward")
    ap.add_argument("--fa4-src", default=None, help="a source tree of the released FA4 (holding flash_attn/cute)")
    ap.add_argument("--fa4-pythonpath", default="", help="where its quack package is")
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--overrides", default="", help="FLASH_ATTN_CUTE_OVERRIDES for --ours")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    for cubin in args.cubins:
        report(cubin, cubin, args.top)
    with tempfile.TemporaryDirectory() as tmp:
        if args.ours:
            os.makedirs(os.path.join(tmp, "ours"))
            for cubin in ours(args.headdim, args.causal, args.overrides, os.path.join(tmp, "ours")):
                report(f"ours d{args.headdim} causal={args.causal} {args.overrides}", cubin, args.top)
        if args.fa4_src:
            os.makedirs(os.path.join(tmp, "fa4"))
            for cubin in fa4(args.fa4_src, args.fa4_pythonpath, args.headdim, args.causal, os.path.join(tmp, "fa4")):
                report(f"fa4 d{args.headdim} causal={args.causal}", cubin, args.top)


if __name__ == "__main__":
    main()
