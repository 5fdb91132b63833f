"""Compile the Triton attention forward for sm_90 without a GPU and print, per (head dim, causal, variant),
registers, spill bytes, shared memory, the PTX instruction counts that show the schedule (wgmma and its
waits, TMA copies, ex2, setmaxnreg) and whether the TTGIR holds warp-specialized partitions.

    TRITON_DEFAULT_FP_FUSION=1 python -m benchmarks.tools.triton_fwd_compile --headdims 128,256 --causal 0,1 \
        --variants ,ws,ws64 [--dump DIR]

Shapes: bf16, contiguous q/k/v with hidden 2048 (the strides Triton specialises on match those runs).
Runs with whichever Triton is importable (PYTHONPATH=<a triton 3.6 install> to check the GPU machine's).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re


_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32", "Probs": "*fp32",
         "Alibi": "*fp32", "CuSeqlensQ": "*i32", "CuSeqlensK": "*i32", "Sink": "*fp32"}
_FLOATS = {"qk_scale", "softcap_scale", "softcap_log2", "dropout_scale"}


def compile_fwd(d, causal, cfg, dtype="bf16", even_k=True, arch=90):
    """triton.compile for sm_<arch> (default 90) of the kernel the backend launches for cfg (_fwd_ws's when
    cfg.variant is 1 or 2 (persistent), else _fwd's) on a dense call (even_k: seqlen_k a multiple of BLOCK_N);
    returns (compiled kernel, ptxas log)."""
    from flash_attn.triton import _fwd, _fwd_ws

    if cfg.variant in (1, 2, 3):
        kern = _fwd_ws._attn_fwd_ws_kernel
        meta = dict(HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
                    EVEN_K=even_k, GROUP_HEADS=cfg.group, PERSISTENT=cfg.variant in (2, 3),
                    BALANCED=cfg.variant == 3 and bool(causal))
    else:
        kern = _fwd._attn_fwd_kernel
        meta = dict(IS_FP32=False, HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_D=d, BLOCK_DV=d, BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, IS_VARLEN=False, WINDOW_LEFT=False, WINDOW_RIGHT=bool(causal),
                    HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False, RETURN_PROBS=False, USE_TMA=cfg.tma,
                    RESCALE_THRESHOLD=float(cfg.rescale), GROUP_HEADS=cfg.group)
    ptrs = {k: (f"*{dtype}" if v == "*bf16" else v) for k, v in _PTRS.items()}
    return aot_compile(kern, meta, ptrs, _FLOATS,
                       lambda p: p.name.startswith("stride_") and p.name[-1] in "bmnh" and not p.do_not_specialize,
                       cfg.num_warps, cfg.num_stages, arch)


def aot_compile(kern, meta, ptrs, floats, divisible, num_warps, num_stages, arch=90):
    """triton.compile of @triton.jit ``kern`` for sm_<arch> (default 90; no GPU needed): ``meta`` the constexprs (missing
    ones take their defaults), ``ptrs`` {name: "*dtype"} the pointer parameters (16-byte aligned), ``floats``
    the fp32 parameters, the other parameters i32, marked divisible by 16 where ``divisible(param)``.
    Returns (compiled kernel, ptxas log)."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, attrs, consts = {}, {}, {}
    for i, p in enumerate(kern.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = meta.get(p.name, p.default)
        elif p.name in ptrs:
            sig[p.name] = ptrs[p.name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif p.name in floats:
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
            if divisible(p):
                attrs[(i,)] = [["tt.divisibility", 16]]
    target = GPUTarget("cuda", arch, 32)
    opts = triton.compiler.make_backend(target).parse_options({"num_warps": num_warps, "num_stages": num_stages})
    try:
        triton.knobs.nvidia.dump_ptxas_log = True
    except AttributeError:
        pass
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        ck = triton.compile(triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                            target=target, options=opts.__dict__)
    return ck, log.getvalue()


def summary(ck, log):
    """Counts that show what the compiler did with the loop."""
    ptx = ck.asm["ptx"]
    ttgir = ck.asm["ttgir"]
    spill = re.search(r"(\d+) bytes spill stores", log)
    regs = re.search(r"Used (\d+) registers", log)
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)
    return dict(
        regs=int(regs.group(1)) if regs else None,
        spill_stores=int(spill.group(1)) if spill else None,
        smem=ck.metadata.shared,
        num_warps=ck.metadata.num_warps,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        wgmma_waits={w: waits.count(w) for w in sorted(set(waits))},
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        cp_async=len(re.findall(r"cp\.async\.cg|cp\.async\.ca", ptx)),
        ex2=len(re.findall(r"ex2\.approx", ptx)),
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
        warp_specialize="ttg.warp_specialize" in ttgir,
        partitions=len(re.findall(r"partition\d+\(", ttgir)),
    )


def main(argv=None):
    import triton

    from flash_attn.triton import _configs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", default="128,256")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--variants", default=",ws", help="FLASH_ATTN_TRITON_OVERRIDES fwd_variant names ('' = default)")
    p.add_argument("--dump", default=None, help="write ttgir/ptx per kernel here")
    args = p.parse_args(argv)
    print(f"# triton {triton.__version__}")
    for d in [int(x) for x in args.headdims.split(",")]:
        for causal in [x.strip() in ("1", "true") for x in args.causal.split(",")]:
            for name in args.variants.split(","):
                cfg = _configs.fwd_variant_config((9, 0), d, causal, _configs.FWD_VARIANTS[name.strip()])
                label = f"d{d} causal={int(causal)} variant={name or 'default'} {cfg}"
                try:
                    ck, log = compile_fwd(d, causal, cfg)
                except Exception as e:  # a variant this Triton cannot compile: say so, go on
                    print(f"{label}: error {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                print(f"{label}: {json.dumps(summary(ck, log))}", flush=True)
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    for ext in ("ttgir", "ptx"):
                        with open(os.path.join(args.dump, f"d{d}_c{int(causal)}_{name or 'default'}.{ext}"), "w") as f:
                            f.write(ck.asm[ext])


if __name__ == "__main__":
    main()
