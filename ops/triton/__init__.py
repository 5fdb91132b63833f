"""Triton kernels for flash_attn.ops, each with a plain-PyTorch path.

Which path runs is decided per call by :func:`use_triton`:

* CUDA tensors run the Triton kernel (when triton is installed);
* CPU tensors run the Triton kernel only when ``TRITON_INTERPRET=1`` was set before the kernels were
  defined (the interpreter executes them with numpy), else the PyTorch path;
* without triton everything runs the PyTorch path, and importing these modules still works.

The one backend switch of the package steers these ops as it steers attention: ``flash_attn.use_backend("torch")``
(or ``FLASH_ATTN_BACKEND=torch``) takes the PyTorch paths, ``"triton"`` forces the Triton kernels (an error where they
cannot run), ``"cute"`` or none decides by device; tests use it to cover both paths on the same inputs.
"""
import contextlib
import functools

import torch

from flash_attn import settings
# launcher(kernel): the core's (the Triton backend's low-overhead relaunch where that backend runs)
from flash_attn.backends import TritonLaunch, triton_launcher as launcher  # noqa: F401
from flash_attn.dispatch import forced_backend, use_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the kernels below still parse, the PyTorch paths run.
    triton = None
    tl = None

HAS_TRITON = triton is not None
# Triton picks interpreter or compiler when a kernel is defined (module import), so the flag is read
# once here, before any kernel module of this package imports it.
INTERPRET = settings.current.triton_interpret


class _MissingTriton:
    """Stands in for ``triton`` / ``triton.language`` when triton is absent: ``@triton.jit`` and
    ``tl.constexpr`` annotations still evaluate, so kernel modules import; nothing launches them."""

    constexpr = None

    def jit(self, fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)

    def __getattr__(self, name):
        raise AttributeError(f"triton is not installed (needed for triton.{name})")


if triton is None:
    triton = tl = _MissingTriton()


def backend(name: str):
    """``flash_attn.use_backend`` (the one switch of attention and the ops) spelled for the ops: ``"torch"``,
    ``"triton"``, or ``"auto"`` (nothing forced: by device). A context manager."""
    return use_backend(None if name == "auto" else name)


def triton_runs_on(device) -> bool:
    """Whether a Triton kernel can run on tensors of this device in this process."""
    if not HAS_TRITON:
        return False
    device = getattr(device, "type", device)
    return device == "cuda" or (device == "cpu" and INTERPRET)


@torch.compiler.assume_constant_result
def _forced():
    # (torch.compile cannot trace the switch's ContextVar: a traced graph keeps the choice made when it was traced)
    return forced_backend()


def use_triton(x) -> bool:
    """Whether an op on tensor ``x`` takes the Triton path (see the module docstring)."""
    forced = _forced()
    if forced == "torch":
        return False
    ok = triton_runs_on(x.device)
    if forced == "triton" and not ok:
        why = ("triton is not installed" if not HAS_TRITON
               else f"device {x.device.type} needs CUDA, or TRITON_INTERPRET=1 set before import")
        raise RuntimeError(f"backend 'triton' was forced but cannot run here: {why}")
    return ok


def vec_align(elem_size: int, *ints: int) -> int:
    """The largest power of two <= one 16-byte vector of elements that divides every int: Triton sees an
    int argument's divisibility only by 16, so a row stride or length that is a multiple of 8 bf16
    elements (50264, a padded GPT-2 vocab) must be passed divided by this and multiplied back in the
    kernel, or every load and store of the row is a scalar 2-byte access."""
    a = max(1, 16 // elem_size)
    while a > 1 and any(v % a for v in ints):
        a //= 2
    return a


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_SM_COUNTS: dict = {}  # device (as given, when it names one) or CUDA index -> multiprocessor count


def num_sms(device) -> int:
    """Streaming multiprocessors of a CUDA device (a fixed small number elsewhere, for grid sizing); cached
    per device (launchers call this on every call)."""
    n = _SM_COUNTS.get(device)
    if n is not None:
        return n
    d = device if isinstance(device, torch.device) else torch.device(device)
    # torch.compile traces this inside autograd.Functions, where writing a global dict is an unsupported side effect:
    # the count is computed there, and cached by the next eager call
    cache = not torch.compiler.is_compiling()
    if d.type != "cuda":
        n = 4
    else:
        index = d.index if d.index is not None else torch.cuda.current_device()
        n = _SM_COUNTS.get(index)
        if n is None:
            n = torch.cuda.get_device_properties(index).multi_processor_count
            if cache:
                _SM_COUNTS[index] = n
        if d.index is None:
            return n  # "cuda": whichever device is current, so not cached under this name
    if cache:
        _SM_COUNTS[device] = n
    return n


_NO_CTX = contextlib.nullcontext()
_cuda_current_device = None


def device_ctx(x):
    """Triton launches on the current CUDA device; make it the tensor's own (a no-op context when it is
    already current, the common case, which saves the two device switches)."""
    global _cuda_current_device
    device = x.device
    if device.type != "cuda":
        return _NO_CTX
    if _cuda_current_device is None:
        # The tensor exists, so CUDA is initialised: the raw getter skips torch.cuda's lazy-init check.
        _cuda_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    if device.index == _cuda_current_device():
        return _NO_CTX
    return torch.cuda.device(device)


class Plan:
    """A launcher cache key standing for one kind of launch (its constexprs and launch options): hashed
    by identity (cheap), printed as what it stands for."""

    __slots__ = ("what",)

    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return f"Plan{self.what!r}"


@functools.lru_cache(maxsize=4096)
def _plan(name, items):
    return Plan((name, *items)), dict(items)


def plan(name, **meta):
    """(plan key, meta) for a launch of kernel ``name`` with these constexpr and launch keywords: the same
    key object for the same keywords (their order included), as a launcher's ``plan_key``."""
    return _plan(name, tuple(meta.items()))


