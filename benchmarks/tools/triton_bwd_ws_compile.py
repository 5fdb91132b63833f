"""Compile the warp-specialized Triton backward (_bwd_ws.py) for sm_90 without a GPU and print, per kernel,
registers, spill bytes, shared memory and what the Hopper warp-specialization pass built (warps,
partitions, setmaxnreg, TMA copies, wgmma):

    python -m benchmarks.tools.triton_bwd_ws_compile [--headdims 64,128,256] [--causal 0,1] [--config BM,BN,DQBM,DQBN]

(unset TRITON_INTERPRET). tests/triton/test_triton_bwd_ws.py runs compile_all in CI.
"""
import argparse
import json
import os

from benchmarks.tools.triton_fwd_compile import aot_compile, summary  # noqa: F401  (summary: re-exported for the test)


def _divisible(p):
    # Row and head strides are multiples of 8 elements (the plan's TMA alignment rule); the padded
    # lse/delta row stride is a multiple of 128 but not specialised (do_not_specialize).
    return p.name.startswith("stride") and p.name != "stride_p"


def compile_all(d, causal, cfg=None, dtype="bf16"):
    """[(name, compiled kernel, ptxas log)] of the dK/dV launch(es) ("dkdv", or "dv" and "dk" when the
    config splits them) and the dQ launch of head dim d's config (_configs.BWD_WS)."""
    from flash_attn.triton import _bwd_ws, _configs

    cfg = cfg or _configs.BWD_WS.get(d, _configs.BWD_WS_D256_BROKEN)
    ptr = "*" + dtype
    floats = {"sm_scale", "qk_scale"}
    base = dict(HEAD_DIM=d, HEAD_DIM_V=d, CAUSAL=causal)
    dkdv_ptrs = dict(Q=ptr, K=ptr, V=ptr, DO=ptr, Lse2="*fp32", Delta="*fp32", DK=ptr, DV=ptr)
    if cfg.split_dkdv:
        launches = [("dv", dict(base, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, COMPUTE_DK=False)),
                    ("dk", dict(base, BLOCK_M=cfg.dk_block_m or cfg.block_m, BLOCK_N=cfg.dk_block_n or cfg.block_n,
                                COMPUTE_DV=False))]
    else:
        launches = [("dkdv", dict(base, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n))]
    res = []
    for name, meta in launches:
        ck, log = aot_compile(_bwd_ws._bwd_dkdv_ws_kernel, meta, dkdv_ptrs, floats, _divisible, 4, 2)
        res.append((name, ck, log))
    if cfg.dq_block_m:  # (0: the FA2-style dQ kernel, triton_bwd_compile.py's)
        ck, log = aot_compile(_bwd_ws._bwd_dq_ws_kernel,
                              dict(base, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, EVEN_K=True),
                              dict(Q=ptr, K=ptr, V=ptr, DO=ptr, LD="*bf16", DQ=ptr),
                              floats, _divisible, 4, 2)
        res.append(("dq", ck, log))
    return res


def main(argv=None):
    import triton

    from flash_attn.triton import _configs

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", default="64,128,256")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--config", default=None, help="BM,BN,DQBM,DQBN[,DKBM[,DKBN]] (DKBM: split dV / dK launches)")
    args = p.parse_args(argv)
    print(f"# triton {triton.__version__}")
    cfg = None
    if args.config:
        f = [int(x) for x in args.config.split(",")]
        cfg = _configs.BwdWsConfig(*f[:4], split_dkdv=len(f) > 4, dk_block_m=f[4] if len(f) > 4 else 0,
                                   dk_block_n=f[5] if len(f) > 5 else 0)
    for d in (int(x) for x in args.headdims.split(",")):
        for causal in (c == "1" for c in args.causal.split(",")):
            for name, ck, log in compile_all(d, causal, cfg):
                print(json.dumps(dict(d=d, causal=causal, kernel=name, **summary(ck, log))))


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main()
