"""flash_attn.ops.linear (Linear / linear behind FLASH_ATTN_FP32_WGRAD, the weight-cast cache behind
FLASH_ATTN_WEIGHT_CAST_CACHE) and its column-sum kernel (ops/triton/colsum.py): the same values and
gradients as nn.Linear up to rounding, on CPU (fp32, and bf16 autocast on the fallback GEMM + cast), in the
Triton interpreter (fp32/fp16 kernel) and on the GPU (bf16 autocast, fp32-output GEMM)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flash_attn.ops.linear as L
from flash_attn.ops.triton import backend, triton_runs_on
from flash_attn.testing import assert_close_to_ref

CUDA = torch.cuda.is_available()


@pytest.fixture
def switch_on(fa_env):
    """The fa_env setter, with FLASH_ATTN_FP32_WGRAD=1 and neither the cast cache nor overrides."""
    fa_env(FP32_WGRAD="1", WEIGHT_CAST_CACHE=None, OVERRIDES=None)
    L._cast_cache.clear()
    yield fa_env
    L._cast_cache.clear()


@pytest.fixture
def switch_off(fa_env):
    fa_env(FP32_WGRAD="0", WEIGHT_CAST_CACHE=None)
    yield fa_env


def test_switch_defaults_on_for_cuda_only(fa_env):
    fa_env(FP32_WGRAD=None)
    assert L.fp32_wgrad_enabled("cuda") and not L.fp32_wgrad_enabled("cpu")
    for value, on in (("0", False), ("1", True)):
        fa_env(FP32_WGRAD=value)
        assert L.fp32_wgrad_enabled("cuda") is on and L.fp32_wgrad_enabled("cpu") is on
    with pytest.raises(ValueError, match="FLASH_ATTN_FP32_WGRAD"):
        fa_env(FP32_WGRAD="yes")


def _randn(shape, seed, device="cpu", dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


def _pair(in_f, out_f, bias, device="cpu", seed=0):
    """A Linear and an nn.Linear with the same (non-trivial) fp32 parameters."""
    torch.manual_seed(seed)
    ours = L.Linear(in_f, out_f, bias=bias, device=device)
    ref = torch.nn.Linear(in_f, out_f, bias=bias, device=device)
    with torch.no_grad():
        if bias:
            ours.bias.normal_()
        ref.load_state_dict(ours.state_dict())
    return ours, ref


def _grads(module, x, g, autocast_dtype=None):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    device = x.device.type
    with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        y = module(x)
    y.backward(g.to(y.dtype))
    return y, [x.grad] + [p.grad for p in module.parameters()]


def _linear_nodes(t):
    """How many LinearFn backward nodes the autograd graph of t holds."""
    seen, stack, n = set(), [t.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        n += type(node).__name__ == "LinearFnBackward"
        stack.extend(f for f, _ in node.next_functions)
    return n


# ------------------------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16), (16,)])
def test_fp32_matches_nn_linear(switch_on, bias, shape):
    ours, ref = _pair(16, 24, bias)
    x = _randn(shape, 1)
    g = _randn(shape[:-1] + (24,), 2)
    with backend("torch"):
        y, grads = _grads(ours, x, g)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "LinearFnBackward"
    y_ref, grads_ref = _grads(ref, x, g)
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)  # the same F.linear on the same inputs
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fp32_gradients_within_reference_error(switch_on):
    # Against an fp64 nn.Linear, with the project's bound (2x PyTorch's fp32 error + rounding), the bias
    # gradient through the Triton column sum where it runs (interpreter on CPU).
    ours, ref = _pair(48, 40, True)
    ref64 = torch.nn.Linear(48, 40).double()
    ref64.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x, g = _randn((3, 77, 48), 3), _randn((3, 77, 40), 4)
    _, grads = _grads(ours, x, g)
    _, grads_pt = _grads(ref, x, g)
    _, grads64 = _grads(ref64, x.double(), g.double())
    for name, a, b, c in zip(("x", "weight", "bias"), grads, grads64, grads_pt):
        assert_close_to_ref(a, b, c, name=name, fp32_ulps=8)


def test_frozen_weight_and_no_input_grad(switch_on):
    ours, ref = _pair(8, 12, True)
    ours.weight.requires_grad_(False)
    ref.weight.requires_grad_(False)
    x, g = _randn((5, 8), 5), _randn((5, 12), 6)
    with backend("torch"):
        y = ours(x)  # x needs no gradient either: only the bias gets one
    y.backward(g)
    ref(x).backward(g)
    assert ours.weight.grad is None
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, atol=1e-6, rtol=1e-6)


def test_output_is_not_a_view(switch_on):
    # Rotary rotates q and k of the qkv projection in place; autograd forbids that on a view made inside
    # a custom Function.
    ours, _ = _pair(8, 12, True)
    x = _randn((2, 3, 8), 7).requires_grad_()
    with backend("torch"):
        y = ours(x)
        y[..., :4].mul_(2.0)
        y.sum().backward()
    assert x.grad is not None


def test_backward_inside_autocast_keeps_the_forward_dtype(switch_on):
    # An fp32 forward whose backward runs in a bf16 autocast region: the gradient GEMMs must not be cast.
    ours, ref = _pair(16, 24, True)
    x, g = _randn((6, 16), 22), _randn((6, 24), 23)
    with backend("torch"):
        y = ours(x.requires_grad_())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y.backward(g)
    ref(x.detach()).backward(g)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.bias.grad, ref.bias.grad, atol=1e-5, rtol=1e-5)


def test_switch_off_is_nn_linear(switch_off):
    ours, ref = _pair(8, 12, True)
    x = _randn((4, 8), 8)
    y = ours(x)
    assert type(y.grad_fn).__name__ == type(ref(x).grad_fn).__name__ == "AddmmBackward0"
    assert _linear_nodes(y) == 0


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_cpu_autocast_matches_plain_up_to_rounding(switch_on, autocast_dtype):
    # CPU has no fp32-output GEMM: the weight gradient is the half GEMM + cast, as in nn.Linear (equal);
    # the bias gradient is summed in fp32 (nn.Linear rounds it to half first).
    ours, ref = _pair(32, 48, True)
    x, g = _randn((4, 9, 32), 9), _randn((4, 9, 48), 10)
    with backend("torch"):
        y, grads = _grads(ours, x, g, autocast_dtype)
    y_ref, grads_ref = _grads(ref, x, g, autocast_dtype)
    assert y.dtype == autocast_dtype
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    assert all(a.dtype == torch.float32 for a in grads)
    torch.testing.assert_close(grads[0], grads_ref[0], atol=0, rtol=0)
    torch.testing.assert_close(grads[1], grads_ref[1], atol=0, rtol=0)
    exact = g.to(autocast_dtype).double().reshape(-1, 48).sum(0)
    assert (grads[2].double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    # nn.Linear's bias gradient is that sum rounded to half: within half a unit of its last place.
    half_ulp = torch.finfo(autocast_dtype).eps * exact.abs().max() / 2
    assert (grads_ref[2].double() - grads[2].double()).abs().max() <= half_ulp * 1.01


def test_weight_grad_fp32_gemm_feature_detection(monkeypatch):
    a, b = _randn((6, 5), 11, dtype=torch.bfloat16), _randn((6, 3), 12, dtype=torch.bfloat16)
    plain = torch.mm(a.t(), b).float()
    calls = []

    def fake_mm(x, y):
        calls.append(1)
        return torch.mm(x.float(), y.float())

    monkeypatch.setattr(L, "_wants_fp32_gemm", lambda t, dtype: True)
    monkeypatch.setattr(L, "_mm_out_dtype_ok", None)
    monkeypatch.setattr(L, "_mm_fp32", fake_mm)
    out = L.weight_grad(a, b, torch.float32)
    assert calls and L._mm_out_dtype_ok is True and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.mm(a.t().float(), b.float()))

    def missing(x, y):
        calls.append(2)
        raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(L, "_mm_out_dtype_ok", None)
    monkeypatch.setattr(L, "_mm_fp32", missing)
    out = L.weight_grad(a, b, torch.float32)
    assert L._mm_out_dtype_ok is False and out.dtype == torch.float32
    torch.testing.assert_close(out, plain, atol=0, rtol=0)  # the old GEMM + cast
    n = len(calls)
    L.weight_grad(a, b, torch.float32)
    assert len(calls) == n  # not tried again

    def fails(x, y):
        raise torch.OutOfMemoryError("CUDA out of memory")

    # Once the op has worked, or on the first try when memory runs out, errors are not fallbacks.
    for state in (True, None):
        monkeypatch.setattr(L, "_mm_out_dtype_ok", state)
        monkeypatch.setattr(L, "_mm_fp32", fails)
        with pytest.raises(torch.OutOfMemoryError):
            L.weight_grad(a, b, torch.float32)
        assert L._mm_out_dtype_ok is state


def test_bias_grad_torch_switch(switch_on):
    d = _randn((33, 10), 13)
    switch_on(OVERRIDES="linear.wgrad_bias=torch")
    torch.testing.assert_close(L.bias_grad(d, torch.float32), d.sum(0), atol=0, rtol=0)


def test_bias_grad_gemm_switch(switch_on, monkeypatch):
    d = _randn((33, 10), 14, dtype=torch.bfloat16)
    exact = d.double().sum(0)
    switch_on(OVERRIDES="linear.wgrad_bias=gemm")
    # No fp32-output GEMM on CPU: torch's fp32 sum.
    torch.testing.assert_close(L.bias_grad(d, torch.float32), d.sum(0, dtype=torch.float32), atol=0, rtol=0)
    calls = []

    def fake_mm(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return torch.mm(a.double(), b.double()).float()

    monkeypatch.setattr(L, "_wants_fp32_gemm", lambda t, dtype: True)
    monkeypatch.setattr(L, "_mm_out_dtype_ok", None)
    monkeypatch.setattr(L, "_mm_fp32", fake_mm)
    db = L.bias_grad(d, torch.float32)
    assert calls == [((1, 33), (33, 10))] and db.shape == (10,) and db.dtype == torch.float32
    torch.testing.assert_close(db.double(), exact, atol=1e-5, rtol=1e-6)


# ------------------------------------------------------------------------- models are wired through it
def _gpt(**kw):
    from transformers import GPT2Config

    from flash_attn.models.gpt import GPTLMHeadModel

    config = GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", **kw)
    torch.manual_seed(0)
    return GPTLMHeadModel(config)


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_gpt_runs_every_linear_through_it(switch_on, fused_mlp):
    # 4 Linears a layer (Wqkv, out_proj, fc1, fc2) plus the LM head; a switch that stopped taking effect,
    # or a layer built as plain nn.Linear, changes the count.
    model = _gpt(fused_mlp=fused_mlp)
    ids = torch.randint(0, 97, (2, 16))
    with backend("torch"):
        logits = model(ids).logits
    assert _linear_nodes(logits) == 4 * 2 + 1
    switch_on(FP32_WGRAD="0")
    with backend("torch"):
        assert _linear_nodes(model(ids).logits) == 0


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_gpt_cpu_autocast_gradients_match_plain(switch_on, fused_mlp):
    model = _gpt(fused_mlp=fused_mlp)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(on):
        switch_on(FP32_WGRAD="1" if on else "0")
        model.zero_grad(set_to_none=True)
        with backend("torch"), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids).logits.float().flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_on, on = grads(True)
    loss_off, off = grads(False)
    assert loss_on == loss_off  # the forward is the same computation
    for name, g in on.items():
        scale = off[name].abs().max().item()
        # Only the bias gradients' bf16 rounding differs (weights: the same bf16 GEMM + cast on CPU).
        tol = 0.0 if name.endswith("weight") else torch.finfo(torch.bfloat16).eps * scale
        assert (g - off[name]).abs().max().item() <= tol, name


# ------------------------------------------------------------------------------------------ cast cache
class _CopyCount(TorchDispatchMode):
    """Counts dtype-converting copies (autocast's casts, .to) of tensors shaped like a parameter of
    _train_model, and foreach copies."""

    SHAPES = {(32, 16), (32,), (8, 32), (8,)}

    def __init__(self):
        super().__init__()
        self.casts = 0
        self.foreach = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_to_copy" and tuple(args[0].shape) in self.SHAPES:
            self.casts += 1
        elif name == "_foreach_copy_":
            self.foreach += 1
        return func(*args, **(kwargs or {}))


def _train_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(L.Linear(16, 32), torch.nn.GELU(), L.Linear(32, 8))
    return model


def _step(model, x, autocast=True):
    with backend("torch"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(x).float().square().mean()


def test_cast_cache_batches_and_reuses(switch_on):
    switch_on(WEIGHT_CAST_CACHE="1")
    model = _train_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # does not bump parameter versions
    x = _randn((5, 16), 14)
    _step(model, x).backward()  # first forward: each parameter cached on its first use
    r0 = L._cast_cache.refreshes
    with _CopyCount() as count:
        loss2 = _step(model, x)  # a second micro-step: nothing is cast
    assert count.casts == 0 and count.foreach == 0 and L._cast_cache.refreshes == r0
    loss2.backward()
    opt.step()
    with _CopyCount() as count:
        loss3 = _step(model, x)  # after the step: one batched refresh of all four tensors
    assert count.foreach == 1 and count.casts == 0 and L._cast_cache.refreshes == r0 + 1
    for p in model.parameters():
        torch.testing.assert_close(L._cast_cache.entries[p].copy, p.detach().bfloat16(), atol=0, rtol=0)
    # The same values as without the cache.
    switch_on(WEIGHT_CAST_CACHE="0")
    torch.testing.assert_close(loss3, _step(model, x), atol=0, rtol=0)


def test_cast_cache_sees_version_bumps_and_keeps_old_graphs(switch_on):
    switch_on(WEIGHT_CAST_CACHE="1")
    model = _train_model()
    x = _randn((5, 16), 15)
    loss_a = _step(model, x)  # graph A holds the copies of the current weights
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model[0].weight.add_(0.5)  # an in-place op: bumps the version counter
    loss_b = _step(model, x)
    assert L._cast_cache.entries[model[0].weight].copy.equal(model[0].weight.detach().bfloat16())
    loss_a.backward()  # still the values graph A's forward used (new buffer, not an in-place refresh)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = _train_model()
    ref.load_state_dict(snapshot)
    switch_on(WEIGHT_CAST_CACHE="0")
    _step(ref, x).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=0, rtol=0, msg=n)
    assert loss_b.item() != loss_a.item()


def test_no_function_without_autograd(switch_on, monkeypatch):
    # inference and generation take F.linear: the Function only changes what the backward writes
    lin = L.Linear(16, 8)
    x = _randn((5, 16), 16)

    def refuse(*args):
        raise AssertionError("LinearFn used without autograd")

    monkeypatch.setattr(L.LinearFn, "apply", refuse)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), atol=0, rtol=0)
    with pytest.raises(AssertionError, match="without autograd"):
        lin(x)


def test_cast_cache_skips_inference_mode(switch_on):
    switch_on(WEIGHT_CAST_CACHE="1")
    model = _train_model()
    x = _randn((5, 16), 17)
    with torch.inference_mode():
        _step(model, x)
    assert len(L._cast_cache.entries) == 0
    _step(model, x).backward()  # would fail on inference-tensor copies saved for backward
    assert len(L._cast_cache.entries) == 4


def test_cast_cache_off_without_fp32_wgrad(switch_off):
    switch_off(WEIGHT_CAST_CACHE="1")
    model = _train_model()
    with _CopyCount() as count:
        _step(model, _randn((5, 16), 16))
    assert count.foreach == 0 and count.casts == 4  # autocast's own casts


# ------------------------------------------------------------------------------- column-sum kernel
@pytest.fixture
def interp():
    if not triton_runs_on("cpu"):
        pytest.skip("needs triton with TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N", [(1000, 300), (1, 7), (64, 256), (33, 513), (0, 5)])
def test_colsum_interpreter(interp, dtype, M, N):
    from flash_attn.ops.triton import colsum as cs

    x = _randn((M, N), 17, dtype=dtype, scale=3.0)
    part = torch.empty((cs.partial_programs(M, N, x.device), N), dtype=torch.float32)
    out = torch.full((N,), float("nan"), dtype=torch.float32)
    cs.colsum(x, part, out)
    ref = x.double().sum(0)
    pt = x.float().sum(0)
    assert_close_to_ref(out, ref, pt, name="colsum", fp32_ulps=8)
    out2 = torch.empty_like(out)
    cs.colsum(x, torch.empty_like(part), out2)
    assert torch.equal(out, out2)  # no atomics: bitwise reproducible


def test_colsum_interpreter_strided_rows_and_several_programs(interp):
    from flash_attn.ops.triton import colsum as cs

    base = _randn((300, 80), 18)
    x = base[:, 5:70]  # row stride 80, unit column stride
    M, N = x.shape
    programs = cs.partial_programs(M, N, x.device)
    assert programs > 1  # the fixed-order second pass has something to add
    out = torch.empty(N)
    cs.colsum(x, torch.empty((programs, N)), out)
    assert_close_to_ref(out, x.double().sum(0), x.sum(0), name="colsum", fp32_ulps=8)


def test_bias_grad_interpreter_fp16_into_fp32(interp, switch_on):
    d = _randn((129, 40), 19, dtype=torch.float16)
    db = L.bias_grad(d, torch.float32)
    assert db.dtype == torch.float32
    assert_close_to_ref(db, d.double().sum(0), d.float().sum(0), name="db", fp32_ulps=8)


# ------------------------------------------------------------------------------- backward op census
class _BackwardOps(TorchDispatchMode):
    """(op name, input dtypes, output dtype, output shape) of every op."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        o = out if isinstance(out, torch.Tensor) else None
        self.ops.append((str(func), ins, None if o is None else o.dtype, None if o is None else tuple(o.shape)))
        return out


def _census_gpt(device, **kw):
    from transformers import GPT2Config

    from flash_attn.models.gpt import GPTLMHeadModel

    config = GPT2Config(n_embd=256, n_head=4, n_layer=2, vocab_size=1000, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", **kw)
    torch.manual_seed(0)
    model = GPTLMHeadModel(config, device=device, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(std=0.1)
    return model


def _cuda_gpt(**kw):
    return _census_gpt("cuda", **kw)


_FUSED = dict(fused_mlp=True, fused_dropout_add_ln=True, use_flash_attn=True)


def _squeezed(shape):
    return tuple(d for d in shape if d != 1)


def _backward_census(model, set_env, device):
    """{"off": ..., "on": ...} of (casts, bf16 bias sums, fp32-output GEMMs) in one bf16-autocast backward of
    ``model`` with FLASH_ATTN_FP32_WGRAD off / on, and the number of nn.Linear modules.

    casts: bf16 -> fp32 ``_to_copy`` with a Linear parameter's exact shape (autograd casts a gradient after
    reducing it to the parameter's shape). bias sums: bf16 ``aten.sum`` whose result is a Linear bias' shape
    up to size-1 dims: autograd reduces a broadcast bias' gradient (addmm's bias) with at::sum_to, which
    sums with keepdim=True, (M, N) -> (1, N), and only then views it as (N,)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    bias_shapes = {tuple(m.bias.shape) for m in linears if m.bias is not None}
    shapes = bias_shapes | {tuple(m.weight.shape) for m in linears}
    ids = torch.randint(0, 1000, (2, 256), device=device, generator=torch.Generator(device).manual_seed(1))

    def census(on):
        set_env(FP32_WGRAD="1" if on else "0")
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(ids).logits.float().square().mean()
        with _BackwardOps() as rec:
            loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        casts = [o for o in rec.ops if "_to_copy" in o[0] and o[1] == (torch.bfloat16,)
                 and o[2] == torch.float32 and o[3] in shapes]
        bf16_sums = [o for o in rec.ops if o[0].startswith("aten.sum") and o[2] == torch.bfloat16
                     and _squeezed(o[3]) in bias_shapes]
        mm_fp32 = [o for o in rec.ops if o[0] == "aten.mm.dtype"]
        return casts, bf16_sums, mm_fp32

    return {"off": census(False), "on": census(True)}, len(linears)


def _check_census(result, n_weights):
    # n_weights counts every nn.Linear: Wqkv, out_proj, FusedMLP's fc1 / fc2 per layer and the tied LM head.
    casts, sums, mms = result["off"]
    assert len(casts) >= n_weights, ("switch off: too few gradient casts seen", casts)
    assert len(sums) > 0, "switch off: no bf16 bias reduction seen"
    assert not mms, ("switch off: fp32-output GEMMs", mms)
    casts, sums, mms = result["on"]
    assert casts == [], ("switch on: gradient casts", casts)
    assert sums == [], ("switch on: bf16 bias reductions", sums)
    assert len(mms) == n_weights, ("switch on: fp32-output GEMMs", len(mms), n_weights, mms)


@pytest.fixture
def cpu_mm_dtype(monkeypatch):
    """A CPU kernel for aten::mm.dtype (bf16/fp16 inputs, fp32 output: CUDA-only in torch), and linear's
    feature test admitting CPU tensors: the CPU runs the code path the switch takes on CUDA, and a
    dispatch mode sees the same op. The kernel accumulates in fp32 as cuBLAS does."""
    one = torch.ones((1, 1), dtype=torch.bfloat16)
    lib = None
    try:
        torch.mm(one, one, out_dtype=torch.float32)  # a torch whose CPU build has the kernel: use it
    except TypeError:
        pytest.skip("torch.mm has no out_dtype (torch < 2.8)")
    except NotImplementedError:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm.dtype", lambda a, b, out_dtype: torch.mm(a.float(), b.float()).to(out_dtype), "CPU")
    monkeypatch.setattr(L, "_wants_fp32_gemm", lambda a, dtype: dtype == torch.float32 and a.dtype in L._HALF)
    monkeypatch.setattr(L, "_mm_out_dtype_ok", None)
    try:
        yield
    finally:
        if lib is not None:
            lib._destroy()


def test_no_gradient_casts_or_bf16_bias_reductions_cpu(switch_on, cpu_mm_dtype):
    # The GPU test's census on CPU (PyTorch LayerNorm, attention and bias kernels instead of Triton / CuTeDSL;
    # those add no bf16 sums or casts of parameter shapes). With the switch off, the bf16 bias reductions
    # come out of at::sum_to as (1, N) on any device: a filter on (N,) outputs sees none, so the switch-off
    # check fails (on the GPU too: this reduction is device-independent autograd code) and the switch-on
    # check could not fail.
    model = _census_gpt("cpu", **_FUSED)
    with backend("torch"):
        result, n_weights = _backward_census(model, switch_on, "cpu")
    assert n_weights == 9
    _check_census(result, n_weights)
    assert all(o[3][0] == 1 for o in result["off"][1])  # keepdim reductions: the case the filter must cover
    assert L._mm_out_dtype_ok is True


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("bias_method", ["triton", "gemm", "torch"])
@pytest.mark.parametrize("in_f,out_f,bias", [(1024, 3072, True), (4096, 1024, True), (1024, 4096, False)])
def test_gpu_linear_bf16_within_plain_error(switch_on, in_f, out_f, bias, bias_method):
    switch_on(OVERRIDES=f"linear.wgrad_bias={bias_method}")
    ours, ref = _pair(in_f, out_f, bias, device="cuda")
    ref64 = torch.nn.Linear(in_f, out_f, bias=bias, device="cuda", dtype=torch.float64)
    ref64.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    x, g = _randn((4, 1024, in_f), 20, "cuda"), _randn((4, 1024, out_f), 21, "cuda")
    y, grads = _grads(ours, x, g, torch.bfloat16)
    y_pt, grads_pt = _grads(ref, x, g, torch.bfloat16)
    _, grads64 = _grads(ref64, x.double(), g.bfloat16().double())
    assert L._mm_out_dtype_ok is True  # the fp32-output GEMM ran (torch >= 2.8 on CUDA)
    torch.testing.assert_close(y, y_pt, atol=0, rtol=0)
    for name, a, b, c in zip(("x", "weight", "bias"), grads, grads64, grads_pt):
        assert a.dtype == c.dtype
        assert_close_to_ref(a, b, c, name=name)


@pytest.mark.gpu
def test_gpu_no_gradient_casts_or_bf16_bias_reductions(switch_on):
    # The point of the switch: in the backward, no bf16 -> fp32 copy of any Linear parameter's gradient
    # and no bf16 bias reduction; the weight gradients come from aten::mm.dtype. The same count with the
    # switch off shows the test sees those copies and reductions.
    model = _cuda_gpt(**_FUSED)
    result, n_weights = _backward_census(model, switch_on, "cuda")
    _check_census(result, n_weights)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [False, True])
def test_gpu_gpt_gradients_within_plain_error(switch_on, cache):
    from flash_attn.models.gpt import GPTLMHeadModel

    model = _cuda_gpt(**_FUSED)
    config = copy.deepcopy(model.config)
    config.fused_mlp = config.fused_dropout_add_ln = config.use_flash_attn = False
    ref64 = GPTLMHeadModel(config)
    ref64.load_state_dict(model.state_dict())
    ref64 = ref64.cuda().double()
    ids = torch.randint(0, 1000, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def grads(m, on, autocast):
        switch_on(FP32_WGRAD="1" if on else "0")
        switch_on(WEIGHT_CAST_CACHE="1" if cache else "0")
        m.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = m(ids).logits
        F.cross_entropy(logits.double().flatten(0, 1), ids.flatten()).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    ref = grads(ref64, False, False)
    pt = grads(model, False, True)
    for _ in range(2):  # with the cache the second pass reuses the copies
        out = grads(model, True, True)
        for name, g in out.items():
            assert g.dtype == torch.float32
            assert_close_to_ref(g, ref[name], pt[name], name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(16384, 1024), (16384, 3072), (1000, 4099)])
def test_gpu_colsum_bf16(M, N):
    from flash_attn.ops.triton import colsum as cs

    x = _randn((M, N), 22, "cuda", torch.bfloat16, scale=3.0)
    part = torch.empty((cs.partial_programs(M, N, x.device), N), device="cuda")
    out = torch.empty(N, device="cuda")
    cs.colsum(x, part, out)
    assert_close_to_ref(out, x.double().sum(0), x.sum(0, dtype=torch.float32), name="colsum", fp32_ulps=16)
    again = torch.empty_like(out)
    cs.colsum(x, part, again)
    assert torch.equal(out, again)


_AOT_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from flash_attn.ops.triton import colsum as cs

target = GPUTarget("cuda", 90, 32)
backend = triton.compiler.make_backend(target)
fn = cs._colsum_part_kernel
names = fn.arg_names
sig = {"X": "*bf16", "PART": "*fp32", "M": "i32", "N": "i32", "rows_per_program": "i32", "stride_x": "i32",
       "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
# contiguous bf16 gradients of GPT-2 medium: every pointer and integer divisible by 16
attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n] != "constexpr"}
src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=dict(BLOCK_M=cs.BLOCK_M, BLOCK_N=cs.BLOCK_N),
                                attrs=attrs)
k = triton.compile(src, target=target, options=backend.parse_options({"num_warps": 4}).__dict__)
ptx = k.asm["ptx"]
print(json.dumps(dict(loads=re.findall(r"ld\.global[.\w]*", ptx), local=len(re.findall(r"\.local", ptx)))))
"""


def test_colsum_compiles_to_16_byte_loads_for_sm90(tmp_path):
    """The column-sum kernel of a bf16 gradient compiles for sm_90 (no GPU: the interpreter never runs
    Triton's code generator) to 16-byte global loads only, 8 per thread and tile, no local memory."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    from flash_attn.ops.triton import colsum as cs

    # 32 x 256 bf16 over 128 threads: 64 elements = 8 x 16 bytes each.
    assert row["loads"] == ["ld.global.v4.b32"] * (cs.BLOCK_M * cs.BLOCK_N * 2 // 16 // 128), row
    assert row["local"] == 0, row
