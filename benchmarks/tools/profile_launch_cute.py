"""Where the per-call time of the tiny forward (b1 s128 h16 d128 bf16) goes on the cute path, from Python.

Each row is the median wall time per call over rounds of n calls (synchronised once per round), the same
way bench_attention.py's per-call column is measured:

  torch.add (1 launch)            a baseline: one small PyTorch kernel launch on this host
  2 x torch.empty (out, lse)      the allocations the forward makes per call
  trivial CuTeDSL kernel, TVM-FFI a CuTeDSL kernel with the forward's argument list (5 tensors, 4 scalars,
                                  the env stream) that does nothing: TVM-FFI's argument conversion + launch
  same + 4 TMA descriptors        a kernel that builds TMA descriptors for q, k, v and out and does nothing
  compiled forward, preallocated  the real kernel function with out/lse given (descriptors + launch + GPU)
  flash_attn.cute.flash_attn_func the package API (checks, allocations, kernel)
  flash_attn.flash_attn_func      the root API through the dispatcher

    python -m benchmarks.tools.profile_launch_cute            (needs a Hopper GPU and CuTeDSL)
"""
from benchmarks import common


def per_call_us(fn):
    return common.per_call_us(fn, n=300, rounds=7)


def trivial_kernels(tma):
    """A do-nothing CuTeDSL kernel with the forward's call signature (TVM-FFI); with ``tma`` it also
    makes TMA descriptors (tiles 128 x 128 of q, k, v and out) on the host, as the forward does."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import cpasync
    from cutlass.cute.runtime import make_fake_tensor

    from flash_attn.cute.kernels import _ffi_function

    @cute.kernel
    def noop(x: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        if tid == 1023:  # never: blocks have 32 threads
            x[0] = x[0]

    @cute.kernel
    def noop_tma(atom_q: cute.CopyAtom, tq: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        if tid == 1023:
            cute.printf("unreachable")

    @cute.jit
    def launch(q: cute.Tensor, k: cute.Tensor, v: cute.Tensor, o: cute.Tensor, lse: cute.Tensor,
               scale: cutlass.Float32, cap: cutlass.Float32, wl: cutlass.Int32, wr: cutlass.Int32, stream):
        if cutlass.const_expr(tma):
            op = cpasync.CopyBulkTensorTileG2SOp()
            sl = cute.make_layout((128, 128), stride=(128, 1))
            atoms = []
            for t in (q, k, v, o):
                t2 = cute.make_tensor(t.iterator, cute.make_layout((t.shape[1], t.shape[3]),
                                                                   stride=(t.stride[1], 1)))
                atoms.append(cpasync.make_tiled_tma_atom(op, t2, sl, (128, 128)))
            noop_tma(atoms[0][0], atoms[0][1]).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)
        else:
            noop(lse).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    dt = cutlass.BFloat16
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))

    def qkv(s, hh):
        d8 = cute.sym_int(divisibility=8)
        return make_fake_tensor(dt, (b, s, hh, 128), (cute.sym_int(divisibility=8), d8, 128, 1), assumed_align=16)

    lse = make_fake_tensor(cutlass.Float32, (b, h, sq), (cute.sym_int(), cute.sym_int(), 1), assumed_align=4)
    stream = cutlass.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    c = cute.compile(launch, qkv(sq, h), qkv(sk, hk), qkv(sk, hk), qkv(sq, h), lse, cutlass.Float32(1.0),
                     cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0), stream,
                     options="--gpu-arch sm_90a --enable-tvm-ffi")
    return _ffi_function(c)


def main():
    import torch

    import flash_attn
    from flash_attn.cute import kernels
    from flash_attn.cute import flash_attn_func as cute_func

    dev = "cuda"
    q, k, v = (torch.randn(1, 128, 16, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 16, 128, device=dev, dtype=torch.float32)
    a = torch.randn(1024, device=dev)
    fn = kernels.fwd_kernel(torch.bfloat16, 128, False)
    rows = [("torch.add (1 launch)", lambda: torch.add(a, a))]
    rows.append(("2 x torch.empty (out, lse)",
                 lambda: (torch.empty_like(q), torch.empty(1, 16, 128, dtype=torch.float32, device=q.device))))
    for label, tma in (("trivial CuTeDSL kernel, TVM-FFI", False), ("same + 4 TMA descriptors", True)):
        try:
            t = trivial_kernels(tma)
            rows.append((label, lambda t=t: t(q, k, v, out, lse, 1.0, 0.0, 0, 0)))
        except Exception as e:  # report, keep measuring the rest
            print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    rows.append(("compiled forward, preallocated", lambda: fn(q, k, v, out, lse, 0.088, 0.0, 0, 0)))
    rows.append(("flash_attn.cute.flash_attn_func", lambda: cute_func(q, k, v)))
    rows.append(("flash_attn.flash_attn_func", lambda: flash_attn.flash_attn_func(q, k, v)))
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; b1 s128 h16 d128 bf16 forward")
    print("| step | us per call |\n|---|---:|")
    for label, f in rows:
        print(f"| {label} | {per_call_us(f):.1f} |", flush=True)


if __name__ == "__main__":
    main()
