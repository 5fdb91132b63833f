"""Backend selection: priority order, forcing through the environment or a context manager, clear
errors when a forced backend cannot serve a call, and the backward fallback."""
import sys
import types

import pytest
import torch

import flash_attn
from flash_attn import dispatch, flash_attn_func, reference, settings


def _fake_backend(name, supports, calls):
    """A backend that serves what ``supports`` allows by delegating to the reference (and records it)."""
    mod = types.ModuleType(f"_fake_backend_{name}")
    mod.NAME = name
    mod.unavailable_reason = lambda: None
    mod.unsupported_reason = lambda call: None if supports(call) else f"{name} says no"

    def fwd(*a, **kw):
        calls.append((name, "fwd"))
        return reference.fwd(*a, **kw)

    def bwd(*a, **kw):
        calls.append((name, "bwd"))
        return reference.bwd(*a, **kw)

    mod.fwd, mod.bwd = fwd, bwd
    return mod


@pytest.fixture
def registry(monkeypatch):
    calls = []
    fast = _fake_backend("fast", lambda c: not c.causal and not c.backward, calls)
    mid = _fake_backend("mid", lambda c: True, calls)
    monkeypatch.setitem(sys.modules, fast.__name__, fast)
    monkeypatch.setitem(sys.modules, mid.__name__, mid)
    monkeypatch.setattr(dispatch, "BACKENDS", {"fast": fast.__name__, "mid": mid.__name__,
                                               "torch": "flash_attn.reference"})
    for cache in ("_modules", "_unavailable", "_choice"):
        monkeypatch.setattr(dispatch, cache, {})
    monkeypatch.setattr(settings, "current", settings.current)  # restored at the test's end
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    settings.reload()
    return calls


def _qkv():
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    return q, q.detach().clone().requires_grad_(), q.detach().clone().requires_grad_()


def test_first_supporting_backend_serves(registry):
    q, k, v = _qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, causal=True)
    assert registry == [("fast", "fwd"), ("mid", "fwd")]


def test_backward_goes_to_a_backend_that_supports_it(registry):
    q, k, v = _qkv()
    flash_attn_func(q, k, v).sum().backward()
    assert registry == [("fast", "fwd"), ("mid", "bwd")]


def test_backward_keeps_the_backend_its_forward_was_forced_onto(registry):
    # autograd may run the backward on another thread, outside the forward's use_backend context: the forward's
    # forced backend travels with it (each API entry: the common call, the general one, packed qkv)
    for run in (lambda q, k, v: flash_attn_func(q, k, v),
                lambda q, k, v: flash_attn_func(q, k, v, return_attn_probs=True)[0],
                lambda q, k, v: flash_attn.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2))):
        q, k, v = _qkv()
        del registry[:]
        with flash_attn.use_backend("mid"):
            out = run(q, k, v)
        out.sum().backward()
        assert registry == [("mid", "fwd"), ("mid", "bwd")]
        del registry[:]
        run(q, k, v).sum().backward()  # nothing forced: the backward's own choice
        assert registry == [("fast", "fwd"), ("mid", "bwd")]


def test_use_backend_forces_and_restores(registry):
    q, k, v = _qkv()
    with flash_attn.use_backend("torch"):
        flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    assert registry == [("fast", "fwd")]


def test_use_backend_nests_and_restores_on_errors():
    from flash_attn import dispatch

    assert dispatch.forced_backend() is None
    with flash_attn.use_backend("torch"):
        with pytest.raises(RuntimeError), flash_attn.use_backend("triton"):
            assert dispatch.forced_backend() == "triton"
            raise RuntimeError("inside")
        assert dispatch.forced_backend() == "torch"
    assert dispatch.forced_backend() is None
    with pytest.raises(ValueError, match="backend"):
        flash_attn.use_backend("nonesuch")


def test_env_var_forces(registry, fa_env):
    fa_env(BACKEND="mid")
    q, k, v = _qkv()
    flash_attn_func(q, k, v)
    assert registry == [("mid", "fwd")]


def test_forced_backend_that_cannot_serve_raises_with_reason(registry):
    q, k, v = _qkv()
    with flash_attn.use_backend("fast"), pytest.raises(NotImplementedError, match="'fast' cannot serve"
                                                                                  ".*fast says no"):
        flash_attn_func(q, k, v, causal=True)


def test_forced_backend_falls_back_for_backward(registry):
    q, k, v = _qkv()
    with flash_attn.use_backend("fast"):
        flash_attn_func(q, k, v).sum().backward()
    assert registry == [("fast", "fwd"), ("mid", "bwd")]


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="unknown flash_attn backend 'cuda'"):
        with flash_attn.use_backend("cuda"):
            pass


def test_missing_backend_reports_not_installed(monkeypatch):
    monkeypatch.setattr(dispatch, "BACKENDS", {"ghost": "flash_attn.ghost.backend", **dispatch.BACKENDS})
    monkeypatch.setattr(dispatch, "_unavailable", {})
    assert "not installed" in dispatch.unavailable_reason("ghost")
    with flash_attn.use_backend("ghost"), pytest.raises(NotImplementedError, match="not installed"):
        q = torch.randn(1, 4, 1, 8)
        flash_attn_func(q, q, q)


def test_package_without_backend_module_says_so(monkeypatch):
    monkeypatch.setattr(dispatch, "BACKENDS", {"testing": "flash_attn.testing.backend", **dispatch.BACKENDS})
    monkeypatch.setattr(dispatch, "_unavailable", {})
    assert dispatch.unavailable_reason("testing") == ("flash_attn.testing has no dispatcher module "
                                                      "(flash_attn.testing.backend) yet")


def test_reference_serves_every_feature_on_cpu():
    call = dispatch.Call("cpu", torch.float32, 72, 40, None, varlen=True, paged=True, causal=True,
                         window_left=8, softcap=30.0, alibi=True, dropout_p=0.1, return_probs=True,
                         kvcache=True, backward=True, deterministic=True)
    assert dispatch.explain(call)["torch"] is None


def test_info_lists_every_backend(capsys):
    from flash_attn import cli
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    for name in dispatch.BACKENDS:
        assert f"  {name} " in text
    assert "torch   available" in text


def test_backend_setting_not_cached_per_call(registry, fa_env):
    # the per-call selection is cached, but not across a change of FLASH_ATTN_BACKEND (settings.reload)
    q, k, v = _qkv()
    flash_attn_func(q, k, v)
    fa_env(BACKEND="mid")
    flash_attn_func(q, k, v)
    fa_env(BACKEND=None)
    flash_attn_func(q, k, v)
    assert registry == [("fast", "fwd"), ("mid", "fwd"), ("fast", "fwd")]


def test_calls_without_gradient_skip_autograd_but_agree(registry):
    # Without anything to differentiate the op runs outside the autograd.Function; same result.
    q, k, v = _qkv()
    with_grad = flash_attn_func(q, k, v, causal=True)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        no_grad = flash_attn_func(q, k, v, causal=True)
    detached = flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
    assert no_grad.grad_fn is None and not no_grad.requires_grad
    assert detached.grad_fn is None and not detached.requires_grad
    assert torch.equal(no_grad, with_grad) and torch.equal(detached, with_grad)
    # only k requiring grad still builds the graph
    out = flash_attn_func(q.detach(), k, v.detach())
    out.sum().backward()
    assert k.grad is not None and q.grad is None


def test_lse_scratch_only_where_lse_is_dropped(monkeypatch):
    """A backend that declares LSE_SCRATCH gets lse_scratch=True exactly for the calls whose lse nobody keeps
    (no gradient, no lse returned), dense (the common call and the general one: a window) and varlen; one that does
    not declare it never gets the keyword."""
    seen = []
    mod = types.ModuleType("_fake_backend_scratch")
    mod.NAME = "scratch"
    mod.LSE_SCRATCH = True
    mod.unavailable_reason = lambda: None
    mod.unsupported_reason = lambda call: None

    def fwd(*a, **kw):
        seen.append(kw.get("lse_scratch", False))
        return reference.fwd(*a)

    mod.fwd, mod.bwd = fwd, reference.bwd
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(dispatch.BACKENDS, "scratch", mod.__name__)
    for cache in ("_modules", "_unavailable", "_choice"):
        monkeypatch.setattr(dispatch, cache, {})
    q, k, v = _qkv()
    with dispatch.use_backend("scratch"):
        out = flash_attn_func(q.detach(), k.detach(), v.detach())
        torch.testing.assert_close(out, flash_attn_func(q, k, v).detach())  # (with a gradient: a kept lse)
        flash_attn.flash_attn_qkvpacked_func(torch.stack([q.detach(), k.detach(), v.detach()], 2))
        flash_attn_func(q.detach(), k.detach(), v.detach(), return_attn_probs=True)  # lse returned
        with torch.no_grad():
            flash_attn_func(q, k, v)
        flash_attn_func(q.detach(), k.detach(), v.detach(), window_size=(3, 2))  # the general entry
        B, S = q.shape[:2]
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
        flat = [t.detach().reshape(B * S, *t.shape[2:]) for t in (q, k, v)]
        flash_attn.flash_attn_varlen_func(*flat, cu, cu, S, S)
        flash_attn.flash_attn_varlen_func(*flat, cu, cu, S, S, return_attn_probs=True)
        flash_attn.flash_attn_varlen_func(flat[0].requires_grad_(), *flat[1:], cu, cu, S, S)
    assert seen == [True, False, True, False, True, True, True, False, False]
    del mod.LSE_SCRATCH  # the keyword is the module's to declare
    seen.clear()
    for cache in (dispatch._modules, dispatch._unavailable, dispatch._choice):
        cache.clear()
    with dispatch.use_backend("scratch"):
        flash_attn_func(q.detach(), k.detach(), v.detach())
    assert seen == [False]
