"""Compile the Triton attention backward kernels for sm_90 (or another arch: the functions' ``arch``) without a GPU and print, per kernel, registers,
stack (spill) bytes, shared memory, the PTX MMA/copy instruction counts and a SASS opcode histogram, for
the current plan and every candidate of tune_triton_bwd.py.

    TRITON_DEFAULT_FP_FUSION=1 python -m benchmarks.tools.triton_bwd_compile

Shapes: bf16, B=4, S=4096, H=2048/D, contiguous (the strides Triton specialises on match those runs).
"""
import collections, os, re, subprocess, tempfile
import torch, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from flash_attn.triton import _bwd, _configs

def sig_for(kernel, ptr_types, ints_div16, dns_vals, consts):
    sig, attrs, cx = {}, {}, dict(consts)
    for i, p in enumerate(kernel.params):
        n = p.name
        if n in consts:
            sig[n] = "constexpr"; continue
        if p.is_constexpr:
            sig[n] = "constexpr"; cx[n] = p.default; continue
        if n in ptr_types:
            sig[n] = ptr_types[n]; attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in ints_div16:
            v = ints_div16[n]
            if v == 1 and not p.do_not_specialize:
                sig[n] = "constexpr"; cx[n] = 1
            else:
                sig[n] = "i32"
                if v % 16 == 0 and not p.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    return sig, cx, attrs

def compile_kernel(kernel, sig, cx, attrs, num_warps, num_stages, arch=90):
    src = ASTSource(fn=kernel, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))

def dkdv(D, causal, cfg, B=4, S=4096, H=None, atomic=None, extra=None, arch=90):
    H = H or 2048 // D
    if atomic is None: atomic = cfg.dq_atomic
    ptr = {n: "*bf16" for n in ["Q","K","V","DO","DK","DV"]}
    ptr.update(Lse="*fp32", Delta="*fp32", DQ="*fp32" if atomic else "*bf16", Alibi="*fp32", CuSeqlensQ="*fp32", CuSeqlensK="*fp32")
    ints = {}
    for t in ["q","k","v","do","dq","dk","dv"]:
        ints.update({f"stride_{t}b": S*H*D, f"stride_{t}m": H*D, f"stride_{t}n": H*D, f"stride_{t}h": D})
    ints.update(stride_lb=H*S, stride_lh=S, stride_ab=0, stride_ah=0, seqlen_q=S, seqlen_k=S, num_heads=H, group_size=1,
                window_left=1<<30, window_right=0 if causal else 1<<30, seed0=0, seed1=0, dropout_threshold=0)
    consts = dict(IS_FP32=False, HEAD_DIM=D, HEAD_DIM_V=D, BLOCK_D=D, BLOCK_DV=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  IS_VARLEN=False, WINDOW_LEFT=False, WINDOW_RIGHT=causal, HAS_SOFTCAP=False, HAS_ALIBI=False,
                  HAS_DROPOUT=False, DQ_ATOMIC=atomic)
    consts.update(extra or {})
    consts = {k: v for k, v in consts.items() if k in [p.name for p in _bwd._bwd_dkdv_kernel.params]}
    s, c, a = sig_for(_bwd._bwd_dkdv_kernel, ptr, ints, {}, consts)
    return compile_kernel(_bwd._bwd_dkdv_kernel, s, c, a, cfg.num_warps, cfg.num_stages, arch)

def dq(D, causal, cfg, B=4, S=4096, H=None, extra=None, arch=90):
    H = H or 2048 // D
    ptr = {n: "*bf16" for n in ["Q","K","V","DO","DQ"]}
    ptr.update(Lse="*fp32", Delta="*fp32", Alibi="*fp32", CuSeqlensQ="*fp32", CuSeqlensK="*fp32")
    ints = {}
    for t in ["q","k","v","do","dq"]:
        ints.update({f"stride_{t}b": S*H*D, f"stride_{t}m": H*D, f"stride_{t}n": H*D, f"stride_{t}h": D})
    ints.update(stride_lb=H*S, stride_lh=S, stride_ab=0, stride_ah=0, seqlen_q=S, seqlen_k=S, num_heads=H, group_size=1,
                window_left=1<<30, window_right=0 if causal else 1<<30, seed0=0, seed1=0, dropout_threshold=0)
    consts = dict(IS_FP32=False, HEAD_DIM=D, HEAD_DIM_V=D, BLOCK_D=D, BLOCK_DV=D, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
                  IS_VARLEN=False, WINDOW_LEFT=False, WINDOW_RIGHT=causal, HAS_SOFTCAP=False, HAS_ALIBI=False, HAS_DROPOUT=False)
    consts.update(extra or {})
    consts = {k: v for k, v in consts.items() if k in [p.name for p in _bwd._bwd_dq_kernel.params]}
    s, c, a = sig_for(_bwd._bwd_dq_kernel, ptr, ints, {}, consts)
    return compile_kernel(_bwd._bwd_dq_kernel, s, c, a, cfg.dq_num_warps, cfg.dq_num_stages, arch)

CUOBJ = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
def sass(k):
    d = tempfile.mkdtemp(); p = d + "/k.cubin"; open(p, "wb").write(k.asm["cubin"])
    return subprocess.run([CUOBJ, "-sass", p], capture_output=True, text=True).stdout

def summary(name, k):
    md = k.metadata
    ptx = k.asm["ptx"]; s = sass(k)
    ops = collections.Counter(re.findall(r"^\s+(wgmma\.\S+|cp\.async\.bulk\.tensor\S*|cp\.async\.\S+|mma\.\S+|ld\.global\S*|st\.global\S*|red\.\S+|atom\.\S+|ldmatrix\S*|stmatrix\S*|ex2\S*|mbarrier\S*)", ptx, re.M))
    sops = collections.Counter(m.split(".")[0] for m in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", s))
    d = tempfile.mkdtemp(); p = d + "/k.cubin"; open(p, "wb").write(k.asm["cubin"])
    res = subprocess.run([CUOBJ, "-res-usage", p], capture_output=True, text=True).stdout
    r = re.search(r"REG:(\d+) STACK:(\d+)", res)
    print(f"== {name}: regs {r.group(1)} stack {r.group(2)} smem {md.shared} warps {md.num_warps} stages {md.num_stages}")
    print("  PTX:", dict(sorted(ops.items())))
    print("  SASS total", sum(sops.values()), "top:", sops.most_common(25))
    return s

if __name__ == "__main__":
    from benchmarks.tools import tune_triton_bwd as T

    seen = set()
    for D in (64, 128, 256):
        for causal in (True, False):
            for name, cd in T.candidates(D, causal):
                c = _configs.BwdConfig(**cd)
                for ex in ([dict(COMPUTE_DK=False), dict(COMPUTE_DV=False)] if c.split_dkdv else [{}]):
                    ex = dict(ex, USE_TMA=c.tma)
                    key = ("dkdv", D, causal, c.block_m, c.block_n, c.num_warps, c.num_stages, c.dq_atomic,
                           tuple(sorted(ex.items())))
                    if key not in seen:
                        seen.add(key)
                        try:
                            summary(f"dkdv d{D} c{int(causal)} {name} {ex} atomic={c.dq_atomic}",
                                    dkdv(D, causal, c, extra=ex))
                        except Exception as e:
                            print("ERR dkdv", D, causal, name, ex, str(e)[:150])
                key = ("dq", D, causal, c.dq_block_m, c.dq_block_n, c.dq_num_warps, c.dq_num_stages, c.tma)
                if key not in seen and not c.dq_atomic:
                    seen.add(key)
                    try:
                        summary(f"dq d{D} c{int(causal)} {name}", dq(D, causal, c, extra=dict(USE_TMA=c.tma)))
                    except Exception as e:
                        print("ERR dq", D, causal, name, str(e)[:150])
