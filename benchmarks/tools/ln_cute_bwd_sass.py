"""No GPU: compile the CuTeDSL norm backward (flash_attn.cute.norm_bwd) for sm_90a and print, per
configuration, ptxas -v's registers and spill bytes and the row loop's SASS: instructions per row
iteration (one thread) and the opcodes that make them up. For comparing the variants of FLASH_ATTN_CUTE_OVERRIDES'
ln.opts before measuring them.

    python -m benchmarks.tools.ln_cute_bwd_sass --hidden 12288,16384 --threads 512,1024 --opts ,w16,p1,p2,w16+p1+p2
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="16384")
    p.add_argument("--norms", default="L", help="L: LayerNorm (with bias), R: RMSNorm")
    p.add_argument("--threads", default="", help="comma-separated; empty: the THREADS_TABLE default")
    p.add_argument("--opts", default=",w16,p1,p2,w16+p1+p2",
                   help="comma-separated variants, each a '+'-joined ln.opts set ('' = none)")
    p.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--residual", action="store_true")
    p.add_argument("--top", type=int, default=12, help="opcodes shown per configuration")
    return p.parse_args(argv)


def row_loop(sass):
    """Opcodes of the longest backward branch's body (the row loop)."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    if not loops:
        return []
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    out = []
    for a, t in ins:
        if lo <= a <= hi:
            t = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
            out.append(t)
    return out


def analyse(key, tool):
    from flash_attn.cute import norm_bwd as cb

    with tempfile.TemporaryDirectory() as d:
        cb.compile_kernel(key, dump_dir=d)
        ptx = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".ptx")][0]
        cubin = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")][0]
        v = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True,
                           text=True).stderr
        regs = int(re.search(r"Used (\d+) registers", v).group(1))
        spill = [int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v).groups()]
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
    return regs, spill, row_loop(sass)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from flash_attn.cute import norm_bwd as cb
    from flash_attn.testing import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        sys.exit("no cuobjdump")
    print("SASS/row and the opcode counts: the row loop's instructions per row a thread (pp: the loop's / 2)")
    print("| norm | hidden | threads | opts | regs | spill st/ld | SASS/row | LDS | STS | LDL+STL | FFMA+FMUL+FADD "
          "| top opcodes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for norm in args.norms:
        rms = norm == "R"
        for N in [int(h) for h in args.hidden.split(",") if h]:
            for mt in [int(t) for t in args.threads.split(",") if t] or [cb.max_threads(N, rms)]:
                for opt in args.opts.split(","):
                    opts = cb.options(args.weight_dtype, rms, env=opt)
                    key = ("bf16", args.weight_dtype, N, rms, not rms, args.residual, args.residual, False, mt,
                           opts)
                    regs, spill, body = analyse(key, tool)
                    per = 2 if "pp" in opts else 1  # rows a loop iteration
                    c = collections.Counter({op: n / per for op, n in collections.Counter(body).items()})
                    fp = sum(n for op, n in c.items() if op.split(".")[0] in ("FFMA", "FMUL", "FADD"))
                    loc = sum(n for op, n in c.items() if op.split(".")[0] in ("LDL", "STL"))
                    lds = sum(n for op, n in c.items() if op.startswith("LDS"))
                    sts = sum(n for op, n in c.items() if op.startswith("STS"))
                    top = ", ".join(f"{op} {n:g}" for op, n in c.most_common(args.top))
                    print(f"| {'RMSNorm' if rms else 'LayerNorm'} | {N} | {mt} | {'+'.join(opts) or '-'} | {regs} "
                          f"| {spill[0]}/{spill[1]} | {len(body) / per:g} | {lds:g} | {sts:g} | {loc:g} | {fp:g} | {top} |",
                          flush=True)


if __name__ == "__main__":
    main()
