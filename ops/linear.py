"""Linear layers for mixed-precision training whose weight and bias gradients come out in the master
weights' dtype from the kernels that compute them: ``linear(x, weight, bias)`` and ``Linear`` (an
nn.Linear: same parameters, init and state dict; its forward calls ``linear``).

Why. With fp32 weights under bf16/fp16 autocast, nn.Linear costs these kernels besides its three GEMMs:
forward, autocast's cast of the weight and of the bias to bf16 (one copy kernel each); backward, the
weight-gradient GEMM writes bf16, the bias gradient is torch's dim-0 reduction of the bf16 output gradient
into bf16, and autograd casts both to fp32 before they reach ``.grad`` (one copy kernel each). In a GPT-2
medium step (24 layers of Wqkv, out_proj, fc1, fc2, plus the LM head) that is 169 fp32 -> bf16 parameter
copies, 169 bf16 -> fp32 gradient copies (each count one more with the first layer's fp32 input and its
gradient) and 72 bf16 reductions of (16384, N) gradients: ~4.7 ms of a 95 ms step on an H200.

What the switches change (environment variables, read on every call; all default off, except
FLASH_ATTN_FP32_WGRAD, which is on for CUDA inputs unless set to 0):

    FLASH_ATTN_FP32_WGRAD=1      ``linear`` runs one autograd Function: the weight gradient is written in
                                 fp32 by the GEMM itself (``torch.mm(..., out_dtype=torch.float32)``, CUDA
                                 with bf16/fp16 inputs, torch >= 2.8; elsewhere, or if that op is missing,
                                 the GEMM in the compute dtype and a cast, as before), the bias gradient is
                                 a fp32 column sum of the output gradient (ops/triton/colsum.py: per-program
                                 partial sums plus a fixed-order reduction, bitwise reproducible), returned
                                 in the bias' dtype. Gradients differ from nn.Linear's only by the bf16
                                 rounding nn.Linear applies before its cast (they are more accurate).
    FLASH_ATTN_OVERRIDES=linear.wgrad_bias=torch | gemm
                                 with the above, the bias gradient by torch (``sum(0, dtype=float32)``, one
                                 reduction, no cast) or by cuBLAS (``ones (1, M) @ dout`` with fp32 output,
                                 where that GEMM exists; else torch) instead of the Triton column sum (the
                                 default, ``triton``), for A/B runs.
    FLASH_ATTN_WEIGHT_CAST_CACHE=1
                                 with FLASH_ATTN_FP32_WGRAD=1, the low-precision copies of weights and
                                 biases are kept between forwards and refreshed all at once, by one
                                 ``torch._foreach_copy_`` into a single new buffer, the first time a stale
                                 one is asked for (so once per optimizer step, and not at all on the later
                                 micro-steps of a gradient accumulation). A copy is stale when any
                                 torch.optim optimizer stepped since it was made (a global step hook; fused
                                 AdamW does not bump parameters' version counters), or the parameter's
                                 version counter or storage changed. Blind spot: writes through ``p.data``
                                 outside an optimizer step (``p.data.copy_(...)``) are not seen; do not use
                                 the cache with code that does that. Costs one low-precision copy of the
                                 weights kept alive between steps.

Outside autocast the Function computes in the input dtype (fp32 on CPU: what the CPU tests compare); it
needs weight, bias and input on one device. ``torch.compile`` traces the plain ``F.linear`` path.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from flash_attn import settings

from .triton import use_triton

_HALF = (torch.float16, torch.bfloat16)
_unsafe_view = torch.ops.aten._unsafe_view.default
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def fp32_wgrad_enabled(device_type: str = "cuda") -> bool:
    """Whether ``linear`` / ``Linear`` on ``device_type`` inputs go through :class:`LinearFn`:
    FLASH_ATTN_FP32_WGRAD=1 / 0 for every device; unset, on CUDA only (H200, GPT-2 medium step with CUDA
    graphs: 90.0 ms, 90.6 ms with FLASH_ATTN_FP32_WGRAD=0; benchmarks/results/h200/train_gpt2_medium.md)."""
    value = settings.current.fp32_wgrad
    return value if value is not None else device_type == "cuda"


def cast_cache_enabled() -> bool:
    """FLASH_ATTN_WEIGHT_CAST_CACHE=1 keeps low-precision weight copies between forwards (default off)."""
    return settings.current.weight_cast_cache


def _bias_grad_method() -> str:
    return settings.override("linear", "wgrad_bias", "triton")


# ------------------------------------------------------------------------------------------- kernels
# None: not tried yet; False: torch has no fp32-output GEMM for half inputs here (then GEMM + cast).
_mm_out_dtype_ok: Optional[bool] = None


def _wants_fp32_gemm(a: Tensor, dtype: torch.dtype) -> bool:
    # aten::mm.dtype exists for CUDA only (CPU raises NotImplementedError), for fp16/bf16 -> fp32.
    return dtype == torch.float32 and a.dtype in _HALF and a.is_cuda


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


def _try_mm_fp32(a: Tensor, b: Tensor) -> Optional[Tensor]:
    """a @ b with fp32 output from the GEMM, or None where torch cannot (decided by the first call; later
    errors, such as running out of memory, propagate)."""
    global _mm_out_dtype_ok
    if _mm_out_dtype_ok is False or not _wants_fp32_gemm(a, torch.float32):
        return None
    if _mm_out_dtype_ok:
        return _mm_fp32(a, b)
    try:
        out = _mm_fp32(a, b)
    except torch.OutOfMemoryError:
        raise
    except (TypeError, RuntimeError, NotImplementedError):
        # torch < 2.8 (no out_dtype keyword: TypeError) or a build without aten::mm.dtype for CUDA.
        _mm_out_dtype_ok = False
        return None
    _mm_out_dtype_ok = True
    return out


def weight_grad(dout2: Tensor, x2: Tensor, dtype: torch.dtype) -> Tensor:
    """dout2^T @ x2 (dout2 (M, N), x2 (M, K) in one compute dtype) as an (N, K) tensor of ``dtype``; for
    half inputs and fp32 on CUDA the GEMM writes fp32 itself (no bf16 rounding, no cast kernel)."""
    if dtype == dout2.dtype:
        return torch.mm(dout2.t(), x2)
    if dtype == torch.float32:
        out = _try_mm_fp32(dout2.t(), x2)
        if out is not None:
            return out
    return torch.mm(dout2.t(), x2).to(dtype)


_ONES: dict = {}  # (device, dtype, M) -> ones (1, M), the left operand of the bias-gradient GEMM


def _bias_grad_gemm(dout2: Tensor) -> Optional[Tensor]:
    # ones (1, M) @ dout2 (M, N) with fp32 output: one memory-bound GEMM (cuBLAS picks a GEMV / split-K
    # kernel); None where the fp32-output GEMM is not available.
    if _mm_out_dtype_ok is False or not _wants_fp32_gemm(dout2, torch.float32):
        return None
    M = dout2.shape[0]
    key = (dout2.device, dout2.dtype, M)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) > 64:
            _ONES.clear()
        ones = _ONES[key] = torch.ones((1, M), device=dout2.device, dtype=dout2.dtype)
    out = _try_mm_fp32(ones, dout2)
    return None if out is None else out.view(-1)


def bias_grad(dout2: Tensor, dtype: torch.dtype) -> Tensor:
    """dout2 (M, N) summed over its rows, accumulated in fp32 and returned as ``dtype`` (N,)."""
    method = _bias_grad_method()
    if method == "gemm":
        db = _bias_grad_gemm(dout2)
        if db is not None:
            return db.to(dtype)
    if use_triton(dout2) and method == "triton":
        from .triton import colsum as _cs

        if dout2.stride(-1) != 1:
            dout2 = dout2.contiguous()
        M, N = dout2.shape
        part = torch.empty((_cs.partial_programs(M, N, dout2.device), N), device=dout2.device, dtype=torch.float32)
        out = torch.empty((N,), device=dout2.device, dtype=dtype)
        _cs.colsum(dout2, part, out)
        return out
    return dout2.sum(0, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------------------------------- cast cache
class _Entry:
    __slots__ = ("copy", "generation", "version", "data_ptr")

    def __init__(self, copy, generation, version, data_ptr):
        self.copy, self.generation, self.version, self.data_ptr = copy, generation, version, data_ptr


class _CastCache:
    """Low-precision copies of leaf tensors (parameters), refreshed in batches; see the module docstring."""

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        self.entries = WeakIdKeyDictionary()
        self.generation = 0
        self.hook = None
        self.refreshes = 0  # batched refreshes so far (tests count them)

    def _on_optimizer_step(self, optimizer, args, kwargs):
        self.generation += 1

    def _fresh(self, t: Tensor, e: Optional[_Entry], dtype: torch.dtype) -> bool:
        return (e is not None and e.generation == self.generation and e.copy.dtype == dtype
                and e.version == t._version and e.data_ptr == t.data_ptr() and e.copy.device == t.device)

    def get(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        if self.hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self.hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        e = self.entries.get(t)
        if self._fresh(t, e, dtype):
            return e.copy
        self._refresh(t, dtype)
        return self.entries[t].copy

    def _refresh(self, t: Tensor, dtype: torch.dtype) -> None:
        # Every stale copy of this device, source and target dtype in one go: after an optimizer step the
        # first layer's call recasts the whole model, one foreach launch sequence instead of a copy kernel
        # per tensor (most are small: biases of 1-3K elements cost a launch each).
        stale = [t]
        for p, e in list(self.entries.items()):
            if (p is not t and e.copy.dtype == dtype and p.device == t.device and p.dtype == t.dtype
                    and not self._fresh(p, e, dtype)):
                stale.append(p)
        # A new buffer each time (not an in-place refresh): graphs still holding the previous copies keep
        # the values their forward used, as with autocast's own casts.
        # Each copy starts on a 128-byte boundary (cuBLAS and Triton pick their fast paths by alignment).
        align = max(1, 128 // dtype.itemsize)
        sizes = [-(-p.numel() // align) * align for p in stale]
        flat = torch.empty(sum(sizes), device=t.device, dtype=dtype)
        copies = [c[:p.numel()].view(p.shape) for c, p in zip(flat.split(sizes), stale)]
        with torch.no_grad():
            torch._foreach_copy_(copies, [p.detach() for p in stale])
        for p, c in zip(stale, copies):
            self.entries[p] = _Entry(c, self.generation, p._version, p.data_ptr())
        self.refreshes += 1

    def clear(self) -> None:
        self.entries.clear()


_cast_cache = _CastCache()


def _to_compute(t: Optional[Tensor], dtype: torch.dtype, use_cache: bool) -> Optional[Tensor]:
    if t is None or t.dtype == dtype:
        return t
    # Copies made under inference_mode would be inference tensors, which a later training forward cannot
    # save for backward.
    if use_cache and t.is_leaf and t.requires_grad and not torch.is_inference_mode_enabled():
        return _cast_cache.get(t, dtype)
    return t.detach().to(dtype)


# ------------------------------------------------------------------------------------------ autograd
class LinearFn(torch.autograd.Function):
    """y = x @ w_c^T + b_c with gradients for x, weight and bias in their own dtypes. w_c / b_c are weight /
    bias already in the compute dtype (the same tensors when no cast is needed); they get no gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_c, b_c):
        x_c = x if x.dtype == w_c.dtype else x.to(w_c.dtype)
        x2 = x_c.reshape(-1, x.shape[-1])
        out = F.linear(x2, w_c, b_c)
        ctx.save_for_backward(x2, w_c)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        if x.dim() == 2:
            return out
        # Not a tracked view: the caller may modify the output in place (rotary on qkv), which autograd
        # forbids on views made inside a custom Function.
        return _unsafe_view(out, (*x.shape[:-1], out.shape[-1]))

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x2, w_c = ctx.saved_tensors
        dout2 = dout.reshape(-1, dout.shape[-1])
        if dout2.dtype != w_c.dtype:
            dout2 = dout2.to(w_c.dtype)
        device_type = dout2.device.type
        if torch.is_autocast_enabled(device_type):
            # Backward run inside an autocast region: these GEMMs stay in the forward's compute dtype.
            with torch.autocast(device_type, enabled=False):
                return LinearFn._grads(ctx, dout2, x2, w_c)
        return LinearFn._grads(ctx, dout2, x2, w_c)

    @staticmethod
    def _grads(ctx, dout2, x2, w_c):
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dout2.mm(w_c).view(ctx.x_shape)
            if dx.dtype != ctx.x_dtype:
                dx = dx.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dout2, x2, ctx.w_dtype)
        if ctx.needs_input_grad[2]:
            db = bias_grad(dout2, ctx.b_dtype)
        return dx, dw, db, None, None


def _compute_dtype(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Optional[torch.dtype]:
    """The dtype F.linear would compute in here, or None where LinearFn does not apply (F.linear decides,
    and raises as it would)."""
    if (x.dtype not in _FLOATS or weight.dtype not in _FLOATS or x.device != weight.device
            or (bias is not None and (bias.dtype not in _FLOATS or bias.device != weight.device))):
        return None
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return None
    return x.dtype


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, weight, bias); on CUDA (or with FLASH_ATTN_FP32_WGRAD=1) through :class:`LinearFn`
    (fp32 weight and bias gradients from the GEMM and the column-sum kernel; module docstring)."""
    # Without autograd (inference, generation) the Function would add its own cost and change nothing.
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not fp32_wgrad_enabled(x.device.type):
        return F.linear(x, weight, bias)
    dtype = _compute_dtype(x, weight, bias)
    if dtype is None:
        return F.linear(x, weight, bias)
    use_cache = cast_cache_enabled()
    return LinearFn.apply(x, weight, bias, _to_compute(weight, dtype, use_cache), _to_compute(bias, dtype, use_cache))


class Linear(nn.Linear):
    """nn.Linear (same parameters, init, state dict) whose forward is :func:`linear`: identical to
    nn.Linear on a CPU (unless FLASH_ATTN_FP32_WGRAD=1) and with FLASH_ATTN_FP32_WGRAD=0."""

    def forward(self, input: Tensor) -> Tensor:
        return linear(input, self.weight, self.bias)
