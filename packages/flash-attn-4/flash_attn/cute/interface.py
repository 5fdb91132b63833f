"""FlashAttention-4's Python API over the CuTeDSL kernels: argument checks, an in-memory cache of compiled
kernels keyed by (dtype, head dim, causal, arch), and the launch on CUDA tensors.

Kernels are compiled from fake tensors whose batch, sequence lengths, head counts and strides are
symbolic, so a new shape never recompiles. Not yet run on a GPU (see the package README).
"""
import math

import torch

_SUPPORTED_HEAD_DIMS = (64, 128)
_ARCHS = {(9, 0): "sm_90a"}
_cache: dict[tuple, object] = {}


def _cutlass_dtype(dtype):
    import cutlass

    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dtype]


def compile_fwd(dtype, head_dim, causal, arch="sm_90a", dump_dir=None):
    """Compile the forward kernel for ``dtype`` (torch.float16 / torch.bfloat16), ``head_dim`` (64 / 128)
    and ``causal`` for ``arch``. No GPU is needed. ``dump_dir``: an existing folder that receives the
    PTX (``*.ptx``) and cubin. Returns the compiled callable
    ``(q, k, v, out, lse, softmax_scale, stream)``, q/out (B, Sq, H, D), k/v (B, Sk, Hk, D), lse (B, H, Sq)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    dt = _cutlass_dtype(dtype)
    D = head_dim
    batch, seqlen_q, seqlen_k, heads, heads_kv = (cute.sym_int64() for _ in range(5))

    def qkv(seqlen, h):
        # Row strides are multiples of 8 elements (16 bytes), as TMA requires; the head dim is contiguous
        # and heads are D apart (the wrapper makes them so).
        div8 = cute.sym_int64(divisibility=8)
        return make_fake_tensor(dt, (batch, seqlen, h, D), (cute.sym_int64(divisibility=8), div8, D, 1),
                                assumed_align=16)

    q, o = qkv(seqlen_q, heads), qkv(seqlen_q, heads)
    k, v = qkv(seqlen_k, heads_kv), qkv(seqlen_k, heads_kv)
    lse = make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), (cute.sym_int64(), cute.sym_int64(), 1),
                           assumed_align=4)
    options = f"--gpu-arch {arch}"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    kernel = FlashFwdSm90(dt, D, bool(causal))
    return cute.compile(kernel, q, k, v, o, lse, cutlass.Float32(1.0), cutlass.runtime.make_fake_stream(),
                        options=options)


def _compiled(dtype, head_dim, causal, arch):
    key = (dtype, head_dim, causal, arch)
    fn = _cache.get(key)
    if fn is None:
        fn = _cache[key] = compile_fwd(dtype, head_dim, causal, arch)
    return fn


def _as_cute(t, align):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def _kernel_layout(t):
    # The kernel is compiled for a contiguous head dim, heads D apart and 16-byte aligned rows.
    if (t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or t.stride(0) % 8 or t.stride(1) % 8
            or t.data_ptr() % 16):
        t = t.contiguous()
    return t


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, return_lse=False):
    """Attention forward on Hopper: q (B, Sq, H, D), k/v (B, Sk, Hk, D) fp16/bf16 CUDA tensors, D in
    (64, 128), H % Hk == 0 (GQA/MQA). Causal masking is bottom-right aligned. Returns (out, lse): out
    like q, lse fp32 (B, H, Sq) natural log (+inf for a row that sees no key). Forward only."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, S, H, D)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"q, k, v must share one dtype, fp16 or bf16; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, Sq, H, D = q.shape
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if v.shape[3] != D:
        raise NotImplementedError("head dim of v must equal that of q and k")
    if D not in _SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(f"head dim {D} not in {_SUPPORTED_HEAD_DIMS}")
    if H % k.shape[2] != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k heads ({k.shape[2]})")
    if tuple(window_size) not in ((None, None), (-1, -1)):
        raise NotImplementedError("sliding window")
    if learnable_sink is not None:
        raise NotImplementedError("learnable_sink")
    if softcap:
        raise NotImplementedError("softcap")
    if num_splits != 1:
        raise NotImplementedError("num_splits != 1")
    if pack_gqa:
        raise NotImplementedError("pack_gqa")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("backward (flash_attn.cute is forward only for now)")
    if not (q.is_cuda and k.device == q.device and v.device == q.device):
        raise ValueError("q, k, v must be CUDA tensors on one device")
    cap = torch.cuda.get_device_capability(q.device)
    arch = _ARCHS.get(tuple(cap))
    if arch is None:
        raise NotImplementedError(f"compute capability {cap}: only Hopper (sm_90) kernels exist")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(D)

    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    if k.shape[1] == 0:  # no key at all: every row is empty (TMA descriptors cannot map a 0-length dim)
        out.zero_()
        lse.fill_(math.inf)
    elif B * Sq * H > 0:
        import cutlass
        from cuda.bindings import driver

        fn = _compiled(q.dtype, D, bool(causal), arch)
        with torch.cuda.device(q.device):
            stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
            fn(_as_cute(q, 16), _as_cute(k, 16), _as_cute(v, 16), _as_cute(out, 16), _as_cute(lse, 4),
               cutlass.Float32(softmax_scale), stream)
    return out, lse
