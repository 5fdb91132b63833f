"""Kernel launches with little host time per call.

``kernel[grid](*args, **meta)`` runs Triton's argument binder on every call: it types and specialises each
of our ~50 arguments, hashes the result to find the compiled kernel, builds launch metadata and lets the
C launcher query the driver about every tensor. On the second and later calls of the same kind,
:class:`Launcher` skips all of it: it keeps the ``CompiledKernel`` that Triton's own path returned, under a
key that holds everything Triton specialises on, and calls the kernel's launcher (``CompiledKernel.run``,
the same object and argument layout Triton's ``JITFunction.run`` uses; checked against Triton 3.6 and 3.9)
with the tensors' device addresses as plain integers (the C launcher then skips its data_ptr() call and
driver query per tensor) and no launch metadata or hooks.

The key (:func:`spec_key`) is a superset of Triton's specialisation (``native_specialize_impl``: a tensor
is typed by its dtype and marked when ``data_ptr() % 16 == 0``; an int is typed i32/i64/u64 by its range
and, unless listed in ``do_not_specialize``, becomes the constant 1 when it equals 1 and is marked when
divisible by 16; a float is always fp32):

* the caller's ``plan_key``, which must determine the constexprs and launch options (``meta``);
* the current device (compiled kernels are loaded per device);
* the dtype of every tensor argument and their 16-byte alignment;
* the exact value of every specialised int argument (a strict superset of == 1 / % 16 / range);
* the i32/i64/u64 range of every unspecialised int argument.

Which argument positions hold tensors, specialised ints, unspecialised ints and floats is learnt per
``plan_key`` on the first call; a call whose arguments do not fit that layout (or any first call with
arguments of another kind, such as a bool) takes Triton's own path. So does every call under the
interpreter, on ROCm (``_HIP``: the AMD backend also specialises on a tensor's storage size), with a launch
hook installed (a profiler), with pre-run hooks on the kernel, or on a Triton without these internals. Knobs
that change compile options (TRITON_DEBUG, instrumentation modes) are seen by Triton's own path only: set them
before a kernel's first launch.

Pointer arguments may be None (optional inputs and outputs), where the kernel's parameter has no type
annotation: Triton then types the argument as a constexpr (``native_specialize_impl(None)`` is
``("constexpr", None)`` with or without specialisation, 3.6 and 3.9), compiles a kernel for that None, and
passes the None to the launcher, which skips constexpr positions (3.6: format "O", left out of the kernel
parameters; 3.9: ARG_CONSTEXPR). A layout learnt from a call with Nones keys every call on its None
pattern as well (the dtype tuple holds None there) and passes None at those positions, as Triton does. An
all-tensor layout keeps the leaner key; a later call of the same plan with Nones (a TypeError there) takes
Triton's path once and turns the plan's layout into a None-aware one, whose key for all-tensor calls is
the same, so the entries cached so far stay valid.
"""
from __future__ import annotations

import operator
import warnings

import torch

from flash_attn.triton import settings

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton: nothing raises it
    class OutOfResources(Exception):
        pass

try:
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # older Triton: no fast path
    _knobs = _driver = None

_MAX_ENTRIES = 4096
_INTERPRET = settings.interpret
# ROCm builds of torch: Triton's AMD backend specialises a tensor on more than the key holds (a storage of at most
# 2 GiB is marked for 32-bit buffer offsets, "tt.pointer_range"), so a kernel compiled for small tensors must not be
# relaunched on a larger one: there every launch takes Triton's own path.
_HIP = getattr(torch.version, "hip", None) is not None
_I32_LO, _I32_HI = -(1 << 31), 1 << 31
_I64_LO, _I64_HI = -(1 << 63), 1 << 63

_data_ptr = torch.Tensor.data_ptr
_dtype_of = operator.attrgetter("dtype")
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
_current_stream = None  # Triton's driver.active.get_current_stream, looked up on the first fast launch


def int_type(v):
    """The Triton type of a Python int argument, by range (Triton raises above the u64 range)."""
    if _I32_LO <= v < _I32_HI:
        return "i32"
    if _I64_LO <= v < _I64_HI:
        return "i64"
    return "u64"


def _getter(idx):
    """idx -> a function mapping a sequence to the tuple of its items at idx (itemgetter returns a bare
    item for one index)."""
    idx = tuple(idx)
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*idx)


class Layout:
    """Where the kinds of runtime arguments sit, for one plan: pointers first (n_ptr of them, tensors or,
    with ``nulls``, tensors and Nones), then ints (specialised ones read through ``spec``, unspecialised
    ones through ``plain``) and floats. ``key`` is the spec_key function for such calls."""

    __slots__ = ("n_args", "n_ptr", "spec", "plain", "kinds", "base", "nulls", "key")

    def __init__(self, kinds, n_ptr, dns, nulls=None):
        self.kinds = tuple(kinds)
        self.n_args = len(kinds)
        self.n_ptr = n_ptr
        self.spec = _getter(i for i, kd in enumerate(kinds) if kd == "i" and not dns[i])
        self.plain = _getter(i for i, kd in enumerate(kinds) if kd == "i" and dns[i])
        # the kinds with None as a pointer: layouts of one plan must agree on it
        self.base = tuple("p" if kd == "n" else kd for kd in self.kinds)
        self.nulls = "n" in self.kinds if nulls is None else bool(nulls)
        self.key = spec_key_nulls if self.nulls else spec_key


def learn_layout(args, dns, nullable=None):
    """The Layout of a call's runtime arguments, or None when the fast path cannot serve such calls
    (an argument that is neither a tensor, an int nor a float, nor a None among the leading pointers;
    tensors not all before the scalars). ``dns[i]``: whether runtime argument i is listed in the kernel's
    ``do_not_specialize``; ``nullable[i]`` (default: all): whether it may be None (Triton makes a None a
    constexpr only for a parameter without a type annotation)."""
    kinds = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            kinds.append("p")
        elif type(a) is int:
            kinds.append("i")
        elif type(a) is float:
            kinds.append("f")
        elif a is None and (nullable is None or nullable[i]):
            kinds.append("n")
        else:
            return None
    n_ptr = 0
    while n_ptr < len(kinds) and kinds[n_ptr] in "pn":
        n_ptr += 1
    if "p" in kinds[n_ptr:] or "n" in kinds[n_ptr:]:
        return None
    return Layout(kinds, n_ptr, dns)


def spec_key(layout, args):
    """(device addresses of the pointer arguments, the part of the cache key that depends on the
    arguments), for a layout without None pointers. Raises TypeError/AttributeError when an argument does
    not fit the layout."""
    n = layout.n_ptr
    tensors = args[:n]
    ptrs = tuple(map(_data_ptr, tensors))
    acc = 0
    for p in ptrs:
        acc |= p
    aligned = True if not acc & 15 else tuple(not p & 15 for p in ptrs)
    plain = layout.plain(args)
    if plain and (min(plain) < _I32_LO or max(plain) >= _I32_HI):
        ranges = tuple(map(int_type, plain))
    else:
        ranges = None  # all i32
    return ptrs, (tuple(map(_dtype_of, tensors)), aligned, layout.spec(args), ranges)


def spec_key_nulls(layout, args):
    """:func:`spec_key` for a layout whose pointers may be None: the addresses hold None there, and so
    does the key's dtype tuple (a tensor's dtype is never None), which makes the None pattern part of the
    key. For an all-tensor call the key equals spec_key's."""
    n = layout.n_ptr
    tensors = args[:n]
    ptrs = tuple([None if t is None else _data_ptr(t) for t in tensors])
    acc = 0
    for p in ptrs:
        if p is not None:
            acc |= p
    aligned = True if not acc & 15 else tuple(p is None or not p & 15 for p in ptrs)
    plain = layout.plain(args)
    if plain and (min(plain) < _I32_LO or max(plain) >= _I32_HI):
        ranges = tuple(map(int_type, plain))
    else:
        ranges = None  # all i32
    return ptrs, (tuple([None if t is None else t.dtype for t in tensors]), aligned, layout.spec(args), ranges)


def _hooks_idle():
    # Triton >= 3.4 keeps launch hooks in (normally empty) HookChain objects, older ones in None-or-callable
    # attributes. With a hook installed (a profiler), every launch takes Triton's own path.
    rt = _knobs.runtime
    h = rt.launch_enter_hook
    if h is not None and getattr(h, "calls", True):
        return False
    h = rt.launch_exit_hook
    if h is not None and getattr(h, "calls", True):
        return False
    return getattr(rt, "add_stages_inspection_hook", None) is None


class Launcher:
    """Wraps one @triton.jit kernel whose runtime arguments are passed positionally and whose constexprs
    (all after the runtime arguments in its signature) are passed as keywords with num_warps/num_stages.

    ``launcher(grid, args, meta, plan_key)``: ``plan_key`` (hashable) must determine ``meta``, and each
    argument position must hold the same kind of value (tensor or None / int / float) on every call with
    that ``plan_key``; everything else Triton specialises on (the None pattern of the pointers included)
    is read from ``args`` (see the module docstring).

    A launch whose kernel needs more shared memory than the GPU has (``OutOfResources``: a config chosen for
    a larger GPU of the family, or a Triton that pipelines more than the table assumed) runs again with one
    pipeline stage fewer at a time, down to one; the plan keeps the stage count that fit, with one warning.
    The grid does not depend on the stage count, so the retry computes the same result.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.slow_launches = 0  # calls that took Triton's own path (benchmarks report it)
        self.cache = {}  # (plan_key, device, spec_key part) -> (launcher, function, packed metadata, tail)
        self.layouts = {}  # plan_key -> Layout, or None when the fast path cannot serve the plan
        self.stages = {}  # plan_key -> the num_stages that fit this GPU, where meta's did not
        params = getattr(kernel, "params", None)
        self.enabled = (not _INTERPRET and not _HIP and _knobs is not None and params is not None
                        and hasattr(kernel, "device_caches"))
        if not self.enabled:
            return
        self.n_args = sum(not p.is_constexpr for p in params)
        if any(p.is_constexpr for p in params[:self.n_args]):
            self.enabled = False  # constexprs interleaved with runtime arguments: not supported here
            return
        self.dns = [bool(p.do_not_specialize) for p in params[:self.n_args]]
        # None is a constexpr for Triton only where the parameter has no type annotation (else the
        # annotation types it); where this Triton does not say, None takes Triton's own path.
        self.nullable = [getattr(p, "annotation_type", None) == "" for p in params[:self.n_args]]
        self.constexprs = [(p.name, p.default if p.has_default else self) for p in params[self.n_args:]]

    def _slow(self, grid, args, meta, plan_key):
        """Triton's own launch, with the stage fallback; returns (compiled kernel, the meta it ran with)."""
        self.slow_launches += 1
        stages = self.stages.get(plan_key)
        if stages is not None:
            meta = {**meta, "num_stages": stages}
        while True:
            try:
                return self.kernel[grid](*args, **meta), meta
            except OutOfResources as e:
                n = meta.get("num_stages")
                if n is None or n <= 1 or getattr(e, "name", "shared memory") != "shared memory":
                    raise
                name = getattr(self.kernel, "__name__", None) or getattr(getattr(self.kernel, "fn", None),
                                                                         "__name__", "a Triton kernel")
                warnings.warn(f"{name}: {e}; running it with num_stages={n - 1} instead of {n} on this GPU",
                              RuntimeWarning, stacklevel=3)
                meta = {**meta, "num_stages": n - 1}
                self.stages[plan_key] = n - 1

    def __call__(self, grid, args, meta, plan_key):
        if not self.enabled:
            self._slow(grid, args, meta, plan_key)
            return
        layout = self.layouts.get(plan_key)
        if layout is not None and _hooks_idle() and not self.kernel.pre_run_hooks:
            try:
                ptrs, k = layout.key(layout, args)
            except (TypeError, AttributeError):
                pass
            else:
                device = _current_device()
                entry = self.cache.get((plan_key, device, k))
                if entry is not None:
                    run, function, packed, tail = entry
                    run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                        _current_stream(device), function, packed, None, None, None,
                        *ptrs, *args[layout.n_ptr:], *tail)
                    return
        compiled, meta = self._slow(grid, args, meta, plan_key)
        self._remember(compiled, args, meta, plan_key)

    def _remember(self, compiled, args, meta, plan_key):
        """After Triton's own launch: keep the compiled kernel for the next calls of this kind."""
        global _current_stream
        if plan_key not in self.layouts:
            if len(self.layouts) >= _MAX_ENTRIES:
                self.layouts.clear()
            self.layouts[plan_key] = (learn_layout(args, self.dns, self.nullable) if len(args) == self.n_args
                                      else None)
        layout = self.layouts[plan_key]
        if (layout is None or not _hooks_idle() or self.kernel.pre_run_hooks
                or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))):
            return
        tail = tuple(meta.get(name, default) for name, default in self.constexprs)
        if any(t is self for t in tail):
            return  # a constexpr with neither a value nor a default: Triton raised already; be safe
        if len(args) != self.n_args:
            return
        own = learn_layout(args, self.dns, self.nullable)
        if own is None or own.base != layout.base:
            return  # this call does not fit the plan's layout
        if own.nulls and not layout.nulls:
            # Nones where the plan's first call had tensors: key the plan's calls on their None pattern
            # from now on (the entries cached so far have the same key under the None-aware layout).
            layout = self.layouts[plan_key] = Layout(layout.kinds, layout.n_ptr, self.dns, nulls=True)
        try:
            _, k = layout.key(layout, args)
        except (TypeError, AttributeError):
            return
        run = compiled.run  # the launcher (loads the module on first use; Triton's launch did already)
        if _current_stream is None:
            _current_stream = _driver.active.get_current_stream
        if len(self.cache) >= _MAX_ENTRIES:
            self.cache.clear()
        self.cache[(plan_key, _current_device(), k)] = (run, compiled.function, compiled.packed_metadata, tail)


def _tma_alloc(size, alignment, stream):
    # Global scratch for the descriptors a kernel builds on the device (128 bytes each, per program).
    return torch.empty(size, dtype=torch.int8, device="cuda")


def set_tma_allocator():
    # A context variable in Triton: autograd runs the backward on its own thread, so set it per call (only
    # when nobody set one).
    import triton
    try:
        from triton.runtime import _allocation
        current = _allocation._allocator.get()
        if not isinstance(current, _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(_tma_alloc)
