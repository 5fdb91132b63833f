"""flash_attn.utils.benchmark (FA2's timing helpers) on CPU tensors: return values, what each one runs (forward,
backward, autocast, cleared gradients), the profiler, and the CUDA-only memory benchmark."""
import json

import pytest
import torch
from torch.utils.benchmark import Measurement, Timer

from flash_attn.utils import benchmark as bm


class Counted:
    """fn(x, w, scale=1.0) = (scale * x @ w, x.sum()), recording each call's autocast state."""

    def __init__(self):
        self.calls = 0
        self.autocast = []

    def __call__(self, x, w, scale=1.0):
        self.calls += 1
        self.autocast.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return scale * (x @ w), x.sum()


@pytest.fixture
def xw():
    torch.manual_seed(0)
    return torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)


def expected_grads(x, w, grad, scale):
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (scale * (x2 @ w2)).backward(grad)
    return x2.grad, w2.grad


def assert_pair(pair, repeats):
    timer, measurement = pair
    assert isinstance(timer, Timer) and isinstance(measurement, Measurement)
    assert measurement.number_per_run == repeats and measurement.mean > 0


def test_forward_times_repeats_calls_with_the_keyword_inputs(xw, capsys):
    fn = Counted()
    pair = bm.benchmark_forward(fn, *xw, repeats=7, desc="tiny", scale=2.0)
    assert_pair(pair, 7)
    assert fn.calls >= 7
    out = capsys.readouterr().out
    assert out.startswith("tiny - Forward pass") and "Measurement" in out


def test_verbose_false_prints_nothing(xw, capsys):
    bm.benchmark_forward(Counted(), *xw, repeats=2, verbose=False)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("amp, dtype, seen", [(False, torch.bfloat16, False), (True, torch.bfloat16, True),
                                              (True, torch.float16, True)])
def test_amp_runs_fn_under_cpu_autocast(xw, amp, dtype, seen):
    fn = Counted()
    bm.benchmark_forward(fn, *xw, repeats=2, verbose=False, amp=amp, amp_dtype=dtype)
    assert fn.autocast and all(enabled == seen for enabled, _ in fn.autocast)
    if seen:
        assert all(d == dtype for _, d in fn.autocast)


def test_amp_false_switches_off_the_callers_autocast(xw):
    fn = Counted()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bm.benchmark_forward(fn, *xw, repeats=2, verbose=False, amp=False)
    assert fn.autocast and not any(enabled for enabled, _ in fn.autocast)


def test_inputs_on_a_device_without_autocast():
    x = torch.empty(4, 4, device="meta")
    bm.benchmark_forward(torch.matmul, x, x, repeats=2, verbose=False)
    with pytest.raises(ValueError, match="device type 'meta'"):
        bm.benchmark_forward(torch.matmul, x, x, repeats=2, verbose=False, amp=True)


def test_backward_times_the_gradient_of_the_first_output(xw):
    x, w = xw
    grad = torch.randn(8, 4)
    fn = Counted()
    pair = bm.benchmark_backward(fn, x, w, grad=grad, repeats=5, verbose=False, scale=3.0)
    assert_pair(pair, 5)
    assert fn.calls == 1  # the forward runs once, outside the timing
    # the gradients are cleared before each backward, so they hold one backward's, not a sum over the repeats
    gx, gw = expected_grads(x, w, grad, 3.0)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)


def test_combined_runs_forward_and_backward_each_time(xw):
    x, w = xw
    grad = torch.randn(8, 4)
    fn = Counted()
    pair = bm.benchmark_combined(fn, x, w, grad=grad, repeats=4, verbose=False)
    assert_pair(pair, 4)
    assert fn.calls >= 1 + 4
    gx, gw = expected_grads(x, w, grad, 1.0)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)


def test_backward_default_grad_has_the_output_shape(xw):
    bm.benchmark_backward(Counted(), *xw, repeats=2, verbose=False)
    assert xw[0].grad.shape == xw[0].shape


def test_fwd_bwd_and_all_return_their_pairs_in_order(xw, capsys):
    fwd_bwd = bm.benchmark_fwd_bwd(Counted(), *xw, repeats=3, desc="d")
    assert len(fwd_bwd) == 2
    for pair in fwd_bwd:
        assert_pair(pair, 3)
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("d - ")]
    assert heads == ["d - Forward pass", "d - Backward pass"]
    everything = bm.benchmark_all(Counted(), *xw, repeats=3, desc="d")
    assert len(everything) == 3
    for pair in everything:
        assert_pair(pair, 3)
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("d - ")]
    assert heads == ["d - Forward pass", "d - Backward pass", "d - Forward + Backward pass"]


def test_grad_of_another_shape_is_an_error(xw):
    with pytest.raises(RuntimeError, match=r"grad has shape \(3,\)"):
        bm.benchmark_backward(Counted(), *xw, grad=torch.randn(3), verbose=False)
    with pytest.raises(RuntimeError, match="grad has shape"):
        bm.benchmark_combined(Counted(), *xw, grad=torch.randn(3), verbose=False)


def test_output_without_grad_is_an_error():
    x, w = torch.randn(2, 3), torch.randn(3, 2)
    with pytest.raises(ValueError, match="requires grad"):
        bm.benchmark_backward(Counted(), x, w, verbose=False)


@pytest.mark.parametrize("kwargs, match", [(dict(amp=True, amp_dtype=torch.float32), "amp_dtype"),
                                           (dict(repeats=0), "repeats")])
def test_bad_arguments_name_themselves(xw, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bm.benchmark_forward(Counted(), *xw, verbose=False, **kwargs)


def test_profiler_records_the_cpu_ops_of_forward_and_backward(xw, tmp_path, capsys):
    fn = Counted()
    trace = tmp_path / "trace.json"
    prof = bm.pytorch_profiler(fn, *xw, backward=True, trace_filename=trace, verbose=True)
    assert fn.calls == 1 + 30 + 1  # the output for the gradient's shape, the warm-up calls, the profiled call
    names = {e.key for e in prof.key_averages()}
    assert "aten::mm" in names and any("MmBackward" in n for n in names)
    assert "aten::mm" in capsys.readouterr().out
    assert any(e.get("name") == "aten::mm" for e in json.loads(trace.read_text())["traceEvents"])


def test_profiler_forward_only_runs_no_backward(xw):
    prof = bm.pytorch_profiler(Counted(), *xw, verbose=False)
    names = {e.key for e in prof.key_averages()}
    assert "aten::mm" in names and not any("Backward" in n for n in names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU error")
def test_memory_benchmark_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        bm.benchmark_memory(lambda: None)


@pytest.mark.gpu
def test_memory_benchmark_reports_the_peak_in_thousands_of_mib():
    def fn(n):
        return torch.empty(n, dtype=torch.uint8, device="cuda").sum()

    # the peak counts what the process holds already (FA2's definition): earlier tests' live tensors
    held = torch.cuda.memory_allocated() / (2**20 * 1000)
    mem = bm.benchmark_memory(fn, 300 * 2**20, verbose=False)
    assert 0.3 <= mem - held < 0.4


@pytest.mark.gpu
def test_cuda_amp_and_timing():
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    seen = []

    def fn(x):
        seen.append(torch.is_autocast_enabled("cuda"))
        return x @ x

    fwd, bwd, both = bm.benchmark_all(fn, x, repeats=3, verbose=False, amp=True, amp_dtype=torch.bfloat16)
    assert all(seen) and all(pair[1].mean > 0 for pair in (fwd, bwd, both))
