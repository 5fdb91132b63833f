"""Kernel launches with less host time per call.

``kernel[grid](*args, **meta)`` re-binds and re-specialises every argument on each call (tens of
microseconds for our ~50 arguments). Once a call has compiled (or found) the kernel for a given
specialisation, later calls with the same specialisation go straight to the compiled kernel's launcher.

The key holds everything Triton specialises on: the caller's plan (dtypes and constexprs), the values of
the integer arguments Triton specialises (strides, head counts; lengths and seeds are excluded through
``do_not_specialize``) and the 16-byte alignment of every pointer. A call the fast path cannot serve
(the interpreter, a launch hook installed by a profiler, a Triton without these internals) takes the
ordinary path.
"""
import torch

try:
    from triton import knobs as _knobs
    from triton.runtime import driver as _driver
except ImportError:  # older Triton: no fast path
    _knobs = _driver = None

_MAX_ENTRIES = 4096


def _no_launch_hooks():
    # Triton >= 3.4 keeps launch hooks in (normally empty) HookChain objects, older ones in None-or-callable
    # attributes. With a hook installed (a profiler), every launch takes Triton's own path.
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


class Launcher:
    """Wraps one @triton.jit kernel whose runtime arguments are passed positionally and whose constexprs
    (all after the runtime arguments in its signature) are passed as keywords with num_warps/num_stages."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache = {}
        params = getattr(kernel, "params", None)
        self.enabled = _knobs is not None and params is not None and hasattr(kernel, "device_caches")
        if not self.enabled:
            return
        n_args = sum(not p.is_constexpr for p in params)
        if any(p.is_constexpr for p in params[:n_args]):
            self.enabled = False  # constexprs interleaved with runtime arguments: not supported here
            return
        names = kernel.arg_names
        dns = {names[i] if isinstance(i, int) else i for i in (kernel.do_not_specialize or [])}
        self.constexpr_names = names[n_args:]
        # the integer arguments Triton specialises (== 1, % 16); lengths, windows and seeds are not
        self.ints = [i for i, n in enumerate(names[:n_args])
                     if n not in dns and (n.startswith("stride") or n in ("num_heads", "group_size"))]

    def __call__(self, grid, args, meta, plan_key):
        if self.enabled and _no_launch_hooks():
            device = _driver.active.get_current_device()
            key = (plan_key, device, tuple(args[i] for i in self.ints),
                   tuple(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor)))
            entry = self.cache.get(key)
            if entry is not None:
                compiled, tail = entry
                stream = _driver.active.get_current_stream(device)
                compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None,
                             None, None, *args, *tail)
                return
            compiled = self.kernel[grid](*args, **meta)
            if hasattr(compiled, "packed_metadata") and hasattr(compiled, "function"):
                if len(self.cache) >= _MAX_ENTRIES:
                    self.cache.clear()
                self.cache[key] = (compiled, tuple(meta[n] for n in self.constexpr_names))
            return
        self.kernel[grid](*args, **meta)
