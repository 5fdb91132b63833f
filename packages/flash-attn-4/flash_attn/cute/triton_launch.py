"""The launch of this package's Triton kernels (the backward's prepare / finish, the split combine): the root
package's launcher service where it is installed (the Triton backend's low-overhead relaunch), else Triton's own
``kernel[grid](...)`` (flash-attn-4 alone). One launcher per kernel, made at its first launch."""
try:  # the root package's launcher service
    from flash_attn.backends import triton_launcher
except ImportError:  # flash-attn-4 alone: Triton's own launch
    triton_launcher = None

_launchers: dict = {}


def launch(kernel, grid, args, meta, plan_key):
    """kernel over ``grid`` with positional ``args`` and the constexprs / options ``meta``; ``plan_key``: what
    identifies (kernel, meta) for the launcher service's cache of compiled variants."""
    fn = _launchers.get(kernel)
    if fn is None:
        if triton_launcher is not None:
            fn = triton_launcher(kernel)
        else:
            def fn(grid_, args_, meta_, _key, _kernel=kernel):
                _kernel[grid_](*args_, **meta_)
        fn = _launchers[kernel] = fn
    fn(grid, args, meta, plan_key)
