"""Probe: which formulation of a warp-specialized (tl.range(..., warp_specialize=True)) attention forward
gives correct results on Hopper with this Triton, and how fast each is. On the H200 (triton 3.6) the forms with
per-(b,h) descriptors on offset base pointers (F0own, F1) compute wrong results (NaN with 3 stages); F2-F5 match
the reference at 2 stages and every form gives NaN at 3: _fwd_ws.py uses the F2 form (one descriptor per tensor).

Forms (all non-causal, seqlen a multiple of BLOCK_N, num_warps=4, BLOCK_M=128, key loop warp-specialized):
  F0     the real kernel flash_attn.triton._fwd_ws._attn_fwd_ws_kernel, launched like backend.py does
         (the F2 form)
  F0own  this file's kernel with per-(b,h) descriptors on offset base pointers (the form that fails)
  F1     per-(b,h) descriptors, `acc = acc * alpha[:, None]` as its own statement, then the dot
  F2     F1 + one descriptor per tensor over the flattened 2-D view [B*S, H*D] made once at kernel start,
         loaded at [b*S + row, h*D]; Q through its descriptor; O by a plain masked tl.store
  F3     F2, O stored through a descriptor
  F4     F2 with the state updated in the tutorial's order (l_ij = rowsum(p) before, acc scaled, V loaded,
         dot, then l_i = l_i * alpha + l_ij, m_i = m_ij)
  F5     F4 + key offsets carried through the loop (off += BLOCK_N) + O through a descriptor
  F6     F5 + tl.range(disallow_acc_multi_buffer=True) (not run by default: on triton 3.6 for sm_90 its PTX
         is byte-identical to F5's, so the flag does nothing here)
  F4nows F4 without warp specialization (control: same math, the ordinary pipeliner)

Configs: d128 BLOCK_N 128 2 stages, d128 BLOCK_N 64 3 stages, d256 BLOCK_N 64 2 stages.
O through a descriptor (F3, F5, F6) at d256 needs 262560 B of shared memory (> 232448 on H100/H200): those
three report an OutOfResources error at launch, by design of the probe (compiles fine).

    python -m benchmarks.tools.triton_ws_probe                   # GPU: correctness + timing, one line per result
    python -m benchmarks.tools.triton_ws_probe --compile-only    # CPU or GPU: AOT compile for sm_90, WS applied?
    python -m benchmarks.tools.triton_ws_probe --interpret       # CPU: math of every form in Triton's interpreter
    options: --forms F0,F2 --configs d128n128s2,d256n64s2 --no-bench --no-check
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import sys
import time
import traceback

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9 warns when unset; 3.6 fuses by default
if "--interpret" in sys.argv:  # must precede the first import of triton
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


LOG2E = 1.4426950408889634
LN2_C = tl.constexpr(0.6931471805599453)
BLOCK_M = 128

# name -> kernel flags (None: the real _fwd_ws kernel)
FORMS = {
    "F0": None,
    "F0own": dict(FLAT=False, SEP_ALPHA=False, TUT_ORDER=False, O_DESC=False, CARRY=False, NO_ACC_MB=False,
                  WS=True),
    "F1": dict(FLAT=False, SEP_ALPHA=True, TUT_ORDER=False, O_DESC=False, CARRY=False, NO_ACC_MB=False, WS=True),
    "F2": dict(FLAT=True, SEP_ALPHA=True, TUT_ORDER=False, O_DESC=False, CARRY=False, NO_ACC_MB=False, WS=True),
    "F3": dict(FLAT=True, SEP_ALPHA=True, TUT_ORDER=False, O_DESC=True, CARRY=False, NO_ACC_MB=False, WS=True),
    "F4": dict(FLAT=True, SEP_ALPHA=True, TUT_ORDER=True, O_DESC=False, CARRY=False, NO_ACC_MB=False, WS=True),
    "F5": dict(FLAT=True, SEP_ALPHA=True, TUT_ORDER=True, O_DESC=True, CARRY=True, NO_ACC_MB=False, WS=True),
    "F6": dict(FLAT=True, SEP_ALPHA=True, TUT_ORDER=True, O_DESC=True, CARRY=True, NO_ACC_MB=True, WS=True),
    "F4nows": dict(FLAT=True, SEP_ALPHA=True, TUT_ORDER=True, O_DESC=False, CARRY=False, NO_ACC_MB=False,
                   WS=False),
}
# name -> (head dim, BLOCK_N, num_stages)
CONFIGS = {"d128n128s2": (128, 128, 2), "d128n64s3": (128, 64, 3), "d256n64s2": (256, 64, 2)}


@triton.jit(do_not_specialize=["S", "H", "ROWS"])
def _probe_fwd(Q, K, V, Out, Lse, S, H, ROWS, ROW_STRIDE, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               FLAT: tl.constexpr, SEP_ALPHA: tl.constexpr, TUT_ORDER: tl.constexpr, O_DESC: tl.constexpr,
               CARRY: tl.constexpr, NO_ACC_MB: tl.constexpr, WS: tl.constexpr):
    """q, k, v, out contiguous (B, S, H, HEAD_DIM) (ROW_STRIDE = H * HEAD_DIM, ROWS = B * S), lse (B, H, S)
    fp32 natural log. Grid (S / BLOCK_M, B * H). No masking: S is a multiple of BLOCK_M and BLOCK_N."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    dtype = Q.dtype.element_ty
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if FLAT:
        # One descriptor per tensor over the (B*S, H*D) view; the tile's rows start at b*S, columns at h*D.
        q_desc = tl.make_tensor_descriptor(Q, shape=[ROWS, ROW_STRIDE], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(K, shape=[ROWS, ROW_STRIDE], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V, shape=[ROWS, ROW_STRIDE], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        o_desc = tl.make_tensor_descriptor(Out, shape=[ROWS, ROW_STRIDE], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        row0 = b * S
        col0 = h * HEAD_DIM
    else:
        # Per-(b, h) descriptors on offset base pointers (the _fwd_ws.py way).
        base = b.to(tl.int64) * S * ROW_STRIDE + h.to(tl.int64) * HEAD_DIM
        q_desc = tl.make_tensor_descriptor(Q + base, shape=[S, HEAD_DIM], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(K + base, shape=[S, HEAD_DIM], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V + base, shape=[S, HEAD_DIM], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        o_desc = tl.make_tensor_descriptor(Out + base, shape=[S, HEAD_DIM], strides=[ROW_STRIDE, 1],
                                           block_shape=[BLOCK_M, HEAD_DIM])
        row0 = 0
        col0 = 0
    q = q_desc.load([row0 + m0, col0])

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    off_kv = row0
    for start_n in tl.range(0, S, BLOCK_N, warp_specialize=WS, disallow_acc_multi_buffer=NO_ACC_MB):
        if CARRY:
            kr = off_kv
        else:
            kr = row0 + start_n
        k = k_desc.load([kr, col0])
        qk = tl.dot(q, tl.trans(k))
        if TUT_ORDER:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]
            p = tl.math.exp2(qk)
            alpha = tl.math.exp2(m_i - m_ij)
            l_ij = tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = v_desc.load([kr, col0])
            acc = tl.dot(p.to(dtype), v, acc)
            l_i = l_i * alpha + l_ij
            m_i = m_ij
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = v_desc.load([kr, col0])
            if SEP_ALPHA:
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(dtype), v, acc)
            else:
                acc = tl.dot(p.to(dtype), v, acc * alpha[:, None])
            m_i = m_new
        off_kv += BLOCK_N

    out = acc * (1.0 / l_i)[:, None]
    if O_DESC:
        o_desc.store([row0 + m0, col0], out.to(dtype))
    else:
        row_ok = offs_m < S
        o_ptrs = (Out + (b.to(tl.int64) * S + offs_m)[:, None] * ROW_STRIDE + h.to(tl.int64) * HEAD_DIM
                  + offs_d[None, :])
        tl.store(o_ptrs, out.to(dtype), mask=row_ok[:, None])
    tl.store(Lse + bh.to(tl.int64) * S + offs_m, (m_i + tl.log2(l_i)) * LN2_C, mask=offs_m < S)


# ----------------------------------------------------------------------------------------------- launch
def _alloc(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def attn(form, cfg, q, k, v):
    """(out, lse) of form on q, k, v (B, S, H, D) contiguous."""
    D, BN, stages = CONFIGS[cfg]
    B, S, H, _ = q.shape
    assert q.shape[-1] == D and S % BLOCK_M == 0 and S % BN == 0
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(D)
    grid = (S // BLOCK_M, B * H)
    flags = FORMS[form]
    if flags is None:
        from flash_attn.triton import _fwd_ws
        _fwd_ws._attn_fwd_ws_kernel[grid](
            q, k, v, out, lse, *q.stride()[1:3], *k.stride()[1:3], *v.stride()[1:3], *out.stride()[:3],
            H * S, S, S, S, H, 1, B * H, scale * LOG2E,
            HEAD_DIM=D, HEAD_DIM_V=D, BLOCK_M=BLOCK_M, BLOCK_N=BN, CAUSAL=False, EVEN_K=True,
            GROUP_HEADS=0, PERSISTENT=False, num_warps=4, num_stages=stages)
    else:
        _probe_fwd[grid](q, k, v, out, lse, S, H, B * S, H * D, scale * LOG2E,
                         HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BN, **flags, num_warps=4, num_stages=stages)
    return out, lse


def reference(q, k, v):
    """fp32 softmax(q k^T * scale) v and its lse; (B, S, H, D) in, out (B, S, H, D), lse (B, H, S)."""
    D = q.shape[-1]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    s = (qf @ kf.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vf
    return o.transpose(1, 2), lse


def check(form, cfg, B, S, H, dtype, device):
    D = CONFIGS[cfg][0]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    out, lse = attn(form, cfg, q, k, v)
    if device == "cuda":
        torch.cuda.synchronize()
    ro, rl = reference(q, k, v)
    nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    eo = (out.float() - ro).abs().nan_to_num(float("inf")).max().item()
    el = (lse - rl).abs().nan_to_num(float("inf")).max().item()
    tol_o, tol_l = (2e-2, 1e-2) if dtype in (torch.bfloat16, torch.float16) else (1e-4, 1e-4)
    ok = (not nan) and eo < tol_o and el < tol_l
    return f"max|out-ref| {eo:.3e} max|lse-ref| {el:.3e} nan={nan} {'OK' if ok else 'BAD'}"


def tflops(ms, B, S, H, D):
    return 4 * B * S * S * H * D / (ms * 1e-3) / 1e12


def bench(form, cfg, S):
    D = CONFIGS[cfg][0]
    H = 2048 // D
    B = 16384 // S
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ms = triton.testing.do_bench(lambda: attn(form, cfg, q, k, v), warmup=5, rep=20)
    return f"{ms:.3f} ms {tflops(ms, B, S, H, D):.0f} TFLOP/s (B={B} S={S} H={H} D={D})"


def bench_cudnn(D, S):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    H = 2048 // D
    B = 16384 // S
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        f(q, k, v)
        ms = triton.testing.do_bench(lambda: f(q, k, v), warmup=5, rep=20)
    return f"{ms:.3f} ms {tflops(ms, B, S, H, D):.0f} TFLOP/s (B={B} S={S} H={H} D={D})"


# ------------------------------------------------------------------------------------------ AOT compile
def compile_sm90(form, cfg):
    """triton.compile for sm_90 (no GPU needed), as benchmarks/tools/triton_fwd_compile.py does; returns
    (compiled, ptxas log)."""
    D, BN, stages = CONFIGS[cfg]
    flags = FORMS[form]
    from benchmarks.tools import triton_fwd_compile
    if flags is None:
        import types

        c = types.SimpleNamespace(variant=1, block_m=BLOCK_M, block_n=BN, group=0, num_warps=4,
                                  num_stages=stages)
        return triton_fwd_compile.compile_fwd(D, False, c)
    ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32"}
    return triton_fwd_compile.aot_compile(_probe_fwd, dict(HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BN, **flags), ptrs,
                                          {"qk_scale"}, lambda p: p.name == "ROW_STRIDE", 4, stages)


def compile_summary(ck, log):
    ptx, ttgir = ck.asm["ptx"], ck.asm["ttgir"]
    spill = re.search(r"(\d+) bytes spill stores", log)
    regs = re.search(r"Used (\d+) registers", log)
    nreg = sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    return (f"setmaxnreg={['.'.join(x) for x in nreg] or 'NONE'} ws_in_ttgir={'ttg.warp_specialize' in ttgir} "
            f"partitions={len(re.findall(r'partition[0-9]+[(]', ttgir))} "
            f"wgmma={len(re.findall(r'wgmma[.]mma_async', ptx))} tma={len(re.findall(r'cp[.]async[.]bulk[.]tensor', ptx))} "
            f"regs={regs.group(1) if regs else '?'} spill={spill.group(1) if spill else '?'} smem={ck.metadata.shared}")


# ------------------------------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--forms", default=",".join(f for f in FORMS if f != "F6"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    cfgs = [c.strip() for c in args.configs.split(",") if c.strip()]
    print(f"# triton {triton.__version__} torch {torch.__version__}"
          + (f" {torch.cuda.get_device_name()}" if torch.cuda.is_available() else " (no cuda)"), flush=True)

    def run(label, fn):
        t0 = time.time()
        try:
            res = fn()
        except Exception as e:  # one failure must not stop the others
            msg = str(e).strip().splitlines()
            res = f"ERROR {type(e).__name__}: {' | '.join(msg[:3])[:400]}"
            if os.environ.get("WS_PROBE_TRACE"):
                traceback.print_exc()
        print(f"{label}: {res} [{time.time() - t0:.1f}s]", flush=True)

    if args.compile_only:
        for cfg in cfgs:
            for form in forms:
                run(f"compile sm_90 {form:6s} {cfg}", lambda: compile_summary(*compile_sm90(form, cfg)))
        return

    if args.interpret:
        # Triton's interpreter on the CPU: warp specialization is ignored, this checks the math only.
        for cfg in cfgs:
            for form in forms:
                for dtype in (torch.float16, torch.float32):
                    run(f"interp {form:6s} {cfg} {str(dtype)[6:]} b2 s256 h2",
                        lambda: check(form, cfg, 2, 256, 2, dtype, "cpu"))
        return

    assert torch.cuda.is_available(), "needs a GPU (or --compile-only / --interpret)"
    triton.set_allocator(_alloc)
    t_start = time.time()
    cudnn_done = set()
    for cfg in cfgs:
        D = CONFIGS[cfg][0]
        for form in forms:
            if not args.no_check:
                for S in (1024, 4096):
                    run(f"check {form:6s} {cfg} b2 s{S} h4", lambda: check(form, cfg, 2, S, 4, torch.bfloat16, "cuda"))
            if not args.no_bench:
                for S in (2048, 16384):
                    run(f"bench {form:6s} {cfg} s{S}", lambda: bench(form, cfg, S))
        if not args.no_bench and D not in cudnn_done:
            cudnn_done.add(D)
            for S in (2048, 16384):
                run(f"bench cudnn  d{D} s{S}", lambda: bench_cudnn(D, S))
    print(f"# total {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
