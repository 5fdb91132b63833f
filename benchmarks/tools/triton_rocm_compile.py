"""Compile every Triton kernel the attention backend and the fused ops launch on an AMD GPU, for a ROCm target, on
a machine without one: LDS (shared memory), registers and scratch (spills) per kernel.

A stand-in for Triton's active driver reports the target (gfx942 = MI300, gfx90a = MI200), and every launch
compiles instead of running (Triton's own ``warmup`` path), so the calls below take the backend's real host code
with the configs a ROCm device gets (``backend._arch`` -> ``_configs.HIP_ARCH``) on CPU tensors. Their outputs are
never computed: this checks what the hardware would be asked to run, not the numbers (no AMD GPU here). The
fused ops' kernels (LayerNorm / RMSNorm, rotary, cross entropy, activations, the bias gradient's column
sum) are compiled the same way.

    python -m benchmarks.tools.triton_rocm_compile [--arch gfx942] [--json]

Prints one row per (case, kernel): VGPRs, AGPRs, scratch bytes per lane, occupancy (waves per SIMD) and LDS
bytes; the exit status is 1 when a kernel needs more LDS than the target has (64 KiB), spills, or has more than
16 warps (a workgroup holds 1024 lanes: 16 warps of 64).
"""
import argparse
import json
import re
import sys

import torch
from flash_attn.testing import backend_bwd, backend_fwd, backend_fwd_kvcache

LDS_BYTES = {"gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}


class _Driver:
    """What Triton's JIT asks its active driver for when it compiles (a ROCm device's answers)."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("hip", arch, 64)

    def is_active(self):
        return True

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _stat(asm, key):
    m = re.search(r";\s*%s:\s*(\d+)" % key, asm)
    return int(m.group(1)) if m else None


def compile_all(arch):
    """Run the cases with every launch compiled for ``arch``; returns the rows (dicts)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Driver(arch))
    rows, case = [], [None]
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        asm = kernel.asm["amdgcn"]
        rows.append(dict(arch=arch, case=case[0], kernel=self.fn.__name__, vgpr=_stat(asm, "NumVgprs"),
                         agpr=_stat(asm, "NumAgprs"), scratch=_stat(asm, "ScratchSize"),
                         occupancy=_stat(asm, "Occupancy"), lds=kernel.metadata.shared,
                         warps=kernel.metadata.num_warps))
        return kernel

    JITFunction.run = compile_only
    from flash_attn.triton import _configs, _launch, backend

    _launch._HIP = True  # as on a ROCm torch: every launch through Triton's own path (no fast relaunch)
    backend._arch = lambda device: _configs.HIP_ARCH  # what a ROCm device gets (CPU tensors give None)
    g = torch.Generator().manual_seed(0)

    def attention(name, D, dtype, causal=False, varlen=False, deterministic=False, features=False, probs=False):
        case[0] = name
        B, S, H, Hk = 2, 200, 4, 2
        q, k, v = (torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, Hk, Hk))
        kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=S, max_seqlen_k=S, block_table=None,
                  softmax_scale=D ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                  softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)
        if varlen:
            q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
            cu = torch.tensor([0, 77, 2 * S], dtype=torch.int32)
            kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2 * S - 77, max_seqlen_k=2 * S - 77)
        if features:
            kw.update(window_left=40, window_right=0 if causal else 9, softcap=30.0, alibi_slopes=torch.rand(H),
                      dropout_p=0.1, rng_state=torch.tensor([1, 2], dtype=torch.int64))
        sink = dict(learnable_sink=torch.randn(H, generator=g)) if features else {}
        out, lse, _ = backend_fwd(backend, q, k, v, return_probs=probs, **kw, **sink)
        backend_bwd(backend, torch.randn_like(out), q, k, v, out, lse, deterministic=deterministic, **kw, **sink)

    def kvcache(name, D, rows_q, paged, splits, sink=False):
        case[0] = name
        B, Hk, G, S = 2, 2, 4, 512
        q = torch.randn(B, rows_q, Hk * G, D, generator=g).to(torch.bfloat16)
        table = None
        if paged:
            kc = torch.randn(8, 256, Hk, D, generator=g).to(torch.bfloat16)
            table = torch.arange(8, dtype=torch.int32).reshape(B, 4)
        else:
            kc = torch.randn(B, 1024, Hk, D, generator=g).to(torch.bfloat16)
        knew = torch.randn(B, 3, Hk, D, generator=g).to(torch.bfloat16)
        cos, sin = torch.randn(2, S + 8, D // 2, generator=g).unbind(0)
        backend_fwd_kvcache(backend, q, kc, kc.clone(), k=knew, v=knew.clone(), rotary_cos=cos, rotary_sin=sin,
                            cache_seqlens=torch.tensor([300, 17], dtype=torch.int32), cache_batch_idx=None,
                            cache_leftpad=None, block_table=table, softmax_scale=D ** -0.5, causal=True,
                            window_left=-1, window_right=0, softcap=0.0, rotary_interleaved=False,
                            alibi_slopes=None, num_splits=splits,
                            learnable_sink=torch.randn(Hk * G, generator=g) if sink else None)

    bf, fp = torch.bfloat16, torch.float16
    attention("d32 plain", 32, bf)
    attention("d40 varlen, every feature, probs", 40, fp, varlen=True, features=True, probs=True)
    attention("d64 causal", 64, bf, causal=True)
    attention("d64 deterministic, every feature", 64, bf, deterministic=True, features=True)
    attention("d96 causal varlen, every feature", 96, bf, causal=True, varlen=True, features=True)
    attention("d128 causal", 128, bf, causal=True)
    attention("d128 deterministic", 128, fp, deterministic=True)
    attention("d128 causal deterministic, every feature", 128, bf, causal=True, deterministic=True, features=True)
    attention("d256 causal", 256, bf, causal=True)
    attention("d256 varlen deterministic, every feature", 256, bf, varlen=True, deterministic=True, features=True)
    kvcache("kvcache d128 decode, paged, split, sink", 128, 1, True, 4, sink=True)
    kvcache("kvcache d256 decode", 256, 2, False, 1)
    kvcache("kvcache d128 prompt", 128, 40, False, 1)
    kvcache("kvcache d256 prompt, paged", 256, 40, True, 1)

    # the fused ops' kernels (flash_attn.ops.triton), on their Triton paths as on a ROCm device
    import flash_attn.ops.triton as ops_triton
    from flash_attn.ops.activations import bias_act, gated_act
    from flash_attn.ops.triton import colsum, layer_norm as ln
    from flash_attn.ops.triton.cross_entropy import cross_entropy_loss
    from flash_attn.ops.triton.rotary import apply_rotary

    ops_triton.triton_runs_on = lambda device: True
    ln._HIP = True

    def op(name, fn, *shape):
        case[0] = name
        x = torch.randn(*shape, generator=g).to(bf).requires_grad_()
        fn(x).float().sum().backward()

    for n in (1024, 8192, 16384):
        op(f"LayerNorm {n}", lambda x: ln.layer_norm_fn(x, torch.ones(x.shape[1], requires_grad=True),
                                                          torch.zeros(x.shape[1], requires_grad=True)), 64, n)
        op(f"RMSNorm {n}, residual, dropout", lambda x: ln.rms_norm_fn(
            x, torch.ones(x.shape[1], requires_grad=True), None, residual=torch.randn_like(x), dropout_p=0.1),
           64, n)
    op("rotary", lambda x: apply_rotary(x.detach(), *torch.randn(2, 128, 32, generator=g).unbind(0)).requires_grad_(),
       2, 100, 4, 128)
    op("cross entropy, smoothing, z-loss", lambda x: cross_entropy_loss(
        x, torch.randint(0, x.shape[1], (x.shape[0],), generator=g), label_smoothing=0.1,
        lse_square_scale=1e-4)[0], 16, 50264)
    op("bias GELU", lambda x: bias_act(x, torch.zeros(x.shape[1], dtype=bf, requires_grad=True)), 64, 4096)
    op("SwiGLU", lambda x: gated_act(x, torch.randn_like(x), "silu"), 64, 4096)
    case[0] = "bias gradient (column sum)"
    x = torch.randn(4096, 1024, generator=g).to(bf)
    colsum.colsum(x, torch.empty(colsum.partial_programs(*x.shape, x.device), x.shape[1]), torch.empty(x.shape[1]))
    JITFunction.run = run
    return rows


def problems(rows):
    """The rows' faults: more LDS than the target has, scratch (spills), more than 16 warps."""
    out = []
    for r in rows:
        if r["lds"] > LDS_BYTES.get(r["arch"], 65536):
            out.append(f"{r['case']}: {r['kernel']} needs {r['lds']} bytes of LDS on {r['arch']}")
        if r["scratch"]:
            out.append(f"{r['case']}: {r['kernel']} spills ({r['scratch']} bytes of scratch a lane) on {r['arch']}")
        if r["warps"] > 16:
            out.append(f"{r['case']}: {r['kernel']} has {r['warps']} warps of 64 lanes (at most 16)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gfx942")
    ap.add_argument("--json", action="store_true", help="one JSON list on stdout instead of the table")
    a = ap.parse_args()
    rows = compile_all(a.arch)
    if a.json:
        print(json.dumps(rows))
    else:
        print("| case | kernel | VGPRs | AGPRs | scratch | waves/SIMD | LDS |\n|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['case']} | {r['kernel']} | {r['vgpr']} | {r['agpr']} | {r['scratch']} | {r['occupancy']} "
                  f"| {r['lds']} |")
    bad = problems(rows)
    for p in bad:
        print(p, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
