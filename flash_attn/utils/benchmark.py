"""Timing helpers for tests and benchmark scripts (FlashAttention-2's ``flash_attn.utils.benchmark``).

Each ``benchmark_*`` function times ``fn(*inputs, **kwinputs)`` with ``torch.utils.benchmark.Timer`` and returns
``(timer, measurement)`` pairs (``measurement.mean`` is seconds per call). ``amp=True`` runs ``fn`` under
``torch.autocast`` with ``amp_dtype`` on the device of the first tensor argument (CUDA when no argument is a tensor
and CUDA is present, else the CPU), so the helpers work on CPU tensors too (CPU autocast takes bfloat16 or float16).
"""
import contextlib

import torch
import torch.utils.benchmark as benchmark

_AMP_DTYPES = (torch.float16, torch.bfloat16)


def _device_type(inputs, kwinputs):
    for x in (*inputs, *kwinputs.values()):
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def _autocast(inputs, kwinputs, amp, amp_dtype):
    """The autocast context every call of ``fn`` runs in (a disabled one without amp)."""
    device_type = _device_type(inputs, kwinputs)
    if amp:
        # torch warns and runs in full precision for a dtype or device autocast does not take: that would time
        # something other than what was asked, so it is an error here
        if amp_dtype not in _AMP_DTYPES:
            raise ValueError(f"amp_dtype must be torch.float16 or torch.bfloat16 with amp=True, got {amp_dtype!r}")
        if not torch.amp.is_autocast_available(device_type):
            raise ValueError(f"amp=True: torch.autocast does not run on device type {device_type!r} (the inputs')")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("amp=True on CUDA, but CUDA is not available")
    elif not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext  # nothing to switch off on a device autocast does not know
    # amp=False is an autocast switched off (as in FA2): an autocast the caller opened does not reach fn either
    return lambda: torch.autocast(device_type=device_type, dtype=amp_dtype, enabled=amp)


def _first(y):
    # FA2's convention: of a tuple output (out, lse, ...) the first element is timed and differentiated
    return y[0] if isinstance(y, tuple) else y


def _grad_for(y, grad):
    if not isinstance(y, torch.Tensor) or not y.requires_grad:
        raise ValueError("fn's output (its first element, for a tuple) must be a tensor that requires grad: pass "
                         "inputs with requires_grad=True")
    if grad is None:
        return torch.randn_like(y)
    if grad.shape != y.shape:
        # RuntimeError, as FA2 raises
        raise RuntimeError(f"grad has shape {tuple(grad.shape)}, fn's output has {tuple(y.shape)}")
    return grad


def _clear_grads(inputs):
    # .grad = None: backward then writes the gradient instead of adding to it, which is the cost worth timing
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.grad = None


def _time(run, repeats, verbose):
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    timer = benchmark.Timer(stmt="run()", globals={"run": run}, num_threads=torch.get_num_threads())
    measurement = timer.timeit(repeats)
    if verbose:
        print(measurement)
    return timer, measurement


def benchmark_forward(fn, *inputs, repeats=10, desc="", verbose=True, amp=False, amp_dtype=torch.float16,
                      **kwinputs):
    """Time ``fn(*inputs, **kwinputs)``: ``repeats`` calls. Returns ``(Timer, Measurement)``."""
    if verbose:
        print(desc, "- Forward pass")
    autocast = _autocast(inputs, kwinputs, amp, amp_dtype)

    def run():
        with autocast():
            fn(*inputs, **kwinputs)

    return _time(run, repeats, verbose)


def benchmark_backward(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                       amp_dtype=torch.float16, **kwinputs):
    """Time the backward of ``fn``'s output (run once, graph retained) with ``grad`` (default: random normal of
    its shape). Returns ``(Timer, Measurement)``."""
    if verbose:
        print(desc, "- Backward pass")
    autocast = _autocast(inputs, kwinputs, amp, amp_dtype)
    with autocast():
        y = _first(fn(*inputs, **kwinputs))
    grad = _grad_for(y, grad)

    def run():
        _clear_grads(inputs)
        y.backward(grad, retain_graph=True)

    return _time(run, repeats, verbose)


def benchmark_combined(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                       amp_dtype=torch.float16, **kwinputs):
    """Time forward then backward of ``fn`` together, per call. Returns ``(Timer, Measurement)``."""
    if verbose:
        print(desc, "- Forward + Backward pass")
    autocast = _autocast(inputs, kwinputs, amp, amp_dtype)
    with autocast():
        y = _first(fn(*inputs, **kwinputs))
    grad = _grad_for(y, grad)

    def run():
        _clear_grads(inputs)
        with autocast():
            out = _first(fn(*inputs, **kwinputs))
        out.backward(grad)

    return _time(run, repeats, verbose)


def benchmark_fwd_bwd(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False,
                      amp_dtype=torch.float16, **kwinputs):
    """``(benchmark_forward(...), benchmark_backward(...))``: two ``(Timer, Measurement)`` pairs."""
    common = dict(repeats=repeats, desc=desc, verbose=verbose, amp=amp, amp_dtype=amp_dtype)
    return (benchmark_forward(fn, *inputs, **common, **kwinputs),
            benchmark_backward(fn, *inputs, grad=grad, **common, **kwinputs))


def benchmark_all(fn, *inputs, grad=None, repeats=10, desc="", verbose=True, amp=False, amp_dtype=torch.float16,
                  **kwinputs):
    """``(forward, backward, combined)``: three ``(Timer, Measurement)`` pairs."""
    common = dict(repeats=repeats, desc=desc, verbose=verbose, amp=amp, amp_dtype=amp_dtype)
    return (benchmark_forward(fn, *inputs, **common, **kwinputs),
            benchmark_backward(fn, *inputs, grad=grad, **common, **kwinputs),
            benchmark_combined(fn, *inputs, grad=grad, **common, **kwinputs))


def pytorch_profiler(fn, *inputs, trace_filename=None, backward=False, amp=False, amp_dtype=torch.float16,
                     cpu=False, verbose=True, **kwinputs):
    """Profile one call of ``fn`` (with its backward when ``backward``) after 30 warm-up calls.

    Records CUDA activity for CUDA inputs, CPU activity when ``cpu`` or when the inputs are not on CUDA (where
    there would be nothing else to record). ``verbose`` prints the 50 operators of most self time;
    ``trace_filename`` writes a Chrome trace. Returns the ``torch.profiler.profile`` (FA2 returns None).
    """
    autocast = _autocast(inputs, kwinputs, amp, amp_dtype)
    on_cuda = _device_type(inputs, kwinputs) == "cuda"
    grad = None
    if backward:
        with autocast():
            grad = _grad_for(_first(fn(*inputs, **kwinputs)), None)

    def step():
        if backward:
            _clear_grads(inputs)
        with autocast():
            out = _first(fn(*inputs, **kwinputs))
        # the backward runs outside autocast, as a training step runs it
        if backward:
            out.backward(grad)

    for _ in range(30):
        step()
    activities = [torch.profiler.ProfilerActivity.CUDA] if on_cuda else []
    if cpu or not on_cuda:
        activities.insert(0, torch.profiler.ProfilerActivity.CPU)
    with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step()
    if verbose:
        # most expensive first: with_stack also records Python frames, which would otherwise fill the rows
        sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=50))
    if trace_filename is not None:
        prof.export_chrome_trace(str(trace_filename))
    return prof


def benchmark_memory(fn, *inputs, desc="", verbose=True, **kwinputs):
    """Peak CUDA memory allocated during one call of ``fn``, in units of 1000 MiB (FA2's "GB"). Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmark_memory measures the CUDA caching allocator's peak: it needs a CUDA device "
                           "(torch.cuda.is_available() is False)")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    fn(*inputs, **kwinputs)
    torch.cuda.synchronize()
    mem = torch.cuda.max_memory_allocated() / (2**20 * 1000)
    if verbose:
        print(f"{desc} max memory: {mem}GB")
    torch.cuda.empty_cache()
    return mem
