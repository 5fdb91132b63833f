"""flash_attn.call and flash_attn.dispatch, function by function: the window's one encoding and its errors, the
description's defaults, the device facts and choice caches (bounded, reused), the forced-backend setting and the
reasons the dispatcher gives when nothing serves a call or a backend does not import."""
import sys
import types

import pytest
import torch

from flash_attn import call as fa_call
from flash_attn import dispatch, settings


# ----------------------------------------------------------------------------------------------------
# call.window


@pytest.mark.parametrize("window_size,causal,want", [
    ((-1, -1), False, (-1, -1)),
    ((-1, -1), True, (-1, 0)),
    ([-1, -1], False, (-1, -1)),      # a list is a pair too
    ((-1, 3), False, (-1, 3)),
    ((5, -1), False, (5, -1)),
    ((0, 0), False, (0, 0)),
    ((4, 7), True, (4, 0)),
    ((2.0, 3), False, (2, 3)),
    ((1, -1), False, (1, -1)),        # one step from the default on either side
    ((-1, 1), False, (-1, 1)),
])
def test_window(window_size, causal, want):
    got = fa_call.window(window_size, causal)
    assert got == want and all(type(x) is int for x in got)


@pytest.mark.parametrize("window_size", [(-2, 0), (0, -2), (-2, -2), (-5, 3), (-2, -1), (-1, -2)])
def test_window_entries_below_minus_one(window_size):
    with pytest.raises(ValueError, match=r"^window_size entries must be >= -1 \(-1: unbounded\), got "
                                         + rf"\({window_size[0]}, {window_size[1]}\)$"):
        fa_call.window(window_size, False)


@pytest.mark.parametrize("window_size", [3, (1, 2, 3), ("a", 1), None])
def test_window_not_a_pair(window_size):
    with pytest.raises(ValueError, match=r"^window_size must be a pair of ints \(left, right\), got "):
        fa_call.window(window_size, False)


# ----------------------------------------------------------------------------------------------------
# describe, dense, for_backward


def test_describe_defaults():
    q, v = torch.zeros(1, 3, 2, 16, dtype=torch.float16), torch.zeros(1, 3, 2, 8, dtype=torch.float16)
    c = fa_call.describe(q, v)
    assert c == fa_call.AttnCall("cpu", torch.float16, 16, 8, None, False, False, False, -1, -1, 0.0, False, 0.0,
                                 False, False, False, False, 0.25)
    assert not c.local and not c.bounded and not c.dropout and c.softmax_scale == 0.25


def test_describe_takes_every_keyword():
    q = torch.zeros(1, 3, 2, 16)
    c = fa_call.describe(q, q, varlen=1, paged=1, causal=1, window_left=4, window_right=9, softcap=2, alibi=1,
                         dropout_p=0.5, return_probs=1, kvcache=1, backward=1, deterministic=1, scale=3, sink=1)
    assert c == fa_call.AttnCall("cpu", torch.float32, 16, 16, None, True, True, True, 4, 0, 2.0, True, 0.5, True,
                                 True, True, True, 3.0, True)
    assert c.local and c.bounded and c.dropout


def test_dense_equals_describe():
    q = torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16)
    for causal, ws, det, scale in [(False, (-1, -1), False, None), (True, (3, -1), True, 0.5), (False, (2, 5), 0, 1)]:
        left, right = fa_call.window(ws, causal)
        assert fa_call.dense(q, 16, 16, scale, causal, ws, det) == fa_call.describe(
            q, q, causal=causal, window_left=left, window_right=right, deterministic=det, scale=scale)


def test_for_backward():
    q = torch.zeros(1, 3, 2, 16)
    c = fa_call.for_backward(fa_call.describe(q, q, return_probs=True, dropout_p=0.1))
    assert c.backward is True and c.return_probs is False and c.dropout_p == 0.1


def test_device_facts_are_cached_per_device(monkeypatch):
    monkeypatch.setattr(fa_call, "_arch", {})
    assert fa_call.device_facts(torch.device("cpu")) == ("cpu", None)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for _ in range(3):
        assert fa_call.device_facts(torch.device("cuda", 1)) == ("cuda", (9, 0))
    assert asked == [1]
    assert fa_call.device_facts(torch.device("cuda")) == ("cuda", (9, 0))  # no index: the current device's
    assert asked == [1, 3]
    q = torch.empty(1, 2, 1, 8, device="meta")
    monkeypatch.setitem(fa_call._arch, q.device, ("meta", (1, 2)))  # dense() reads the cache first
    assert fa_call.dense(q, 8, 8, None, False, (-1, -1), False).arch == (1, 2)


# ----------------------------------------------------------------------------------------------------
# dispatch: the forced backend, the choice cache, the reasons


@pytest.fixture
def clean(monkeypatch):
    for cache in ("_modules", "_unavailable", "_choice"):
        monkeypatch.setattr(dispatch, cache, {})
    monkeypatch.setattr(settings, "current", settings.current)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    settings.reload()


def _call(**kw):
    q = torch.zeros(1, 3, 2, 16)
    return fa_call.describe(q, q, **kw)


def test_forced_backend_reads_the_setting_when_no_context_forces(clean, monkeypatch):
    assert dispatch.forced_backend() is None
    monkeypatch.setenv(dispatch.ENV_VAR, "torch")
    settings.reload()
    assert dispatch.forced_backend() == "torch"
    with dispatch.use_backend("triton"):
        assert dispatch.forced_backend() == "triton"


def test_select_caches_its_choice(clean, monkeypatch):
    chosen = []
    real = dispatch._choose
    monkeypatch.setattr(dispatch, "_choose", lambda c, f: chosen.append(c) or real(c, f))
    c = _call()
    assert dispatch.select(c) is dispatch.select(c)
    assert len(chosen) == 1 and dispatch._choice[(c, None)] is dispatch.select(c)


def test_choice_cache_is_bounded(clean, monkeypatch):
    monkeypatch.setattr(dispatch, "_MAX_CHOICES", 3)
    calls = [_call(scale=s) for s in (1.0, 2.0, 3.0, 4.0)]
    for c in calls[:3]:
        dispatch.select(c)
    assert len(dispatch._choice) == 3
    dispatch.select(calls[3])  # full: cleared, then this one kept
    assert list(dispatch._choice) == [(calls[3], None)]


def test_nothing_serves_names_every_backend_and_its_reason(clean, monkeypatch):
    mods = {}
    for name in ("a", "b"):
        mod = types.ModuleType(f"_fake_{name}")
        mod.unavailable_reason = lambda: None
        mod.unsupported_reason = lambda c, name=name: f"{name} refuses"
        mods[name] = mod
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(dispatch, "BACKENDS", {n: m.__name__ for n, m in mods.items()})
    with pytest.raises(NotImplementedError,
                       match=r"^no flash_attn backend serves this call: a: a refuses; b: b refuses$"):
        dispatch.select(_call())


def test_gpu_backends_are_not_chosen_for_cpu_tensors_unless_forced(clean, monkeypatch):
    mod = types.ModuleType("_fake_gpu")
    mod.unavailable_reason = lambda: None
    mod.unsupported_reason = lambda c: None
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(dispatch, "BACKENDS", {"triton": mod.__name__})
    with pytest.raises(NotImplementedError, match=r"^no flash_attn backend serves this call: triton: cpu tensors "
                                                  r"run on GPU backends \(interpreted\) only when forced$"):
        dispatch.select(_call())
    with dispatch.use_backend("triton"):
        assert dispatch.select(_call()) is mod


def test_a_backend_that_fails_to_import_gives_the_error(clean, monkeypatch):
    broken = "_fa_test_broken_backend"
    monkeypatch.setattr(dispatch, "BACKENDS", {"cute": broken, "torch": "flash_attn.reference"})

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == broken:
                raise RuntimeError("the driver is too old")
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert dispatch.unavailable_reason("cute") == "import failed: RuntimeError: the driver is too old"
    assert dispatch.select(_call()).NAME == "torch"


def test_a_backend_missing_a_dependency_names_it(clean, monkeypatch):
    mod_name = "_fa_test_needs_numpyx"
    monkeypatch.setattr(dispatch, "BACKENDS", {"triton": mod_name})

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == mod_name:
                raise ModuleNotFoundError("No module named 'numpyx'", name="numpyx")
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert dispatch.unavailable_reason("triton") == "import failed: No module named 'numpyx'"


def test_a_missing_top_level_module_is_not_called_not_installed(clean, monkeypatch):
    # a dependency with no dot in its name (numpy, triton) that happens to prefix the backend's module path
    monkeypatch.setattr(dispatch, "BACKENDS", {"triton": "tri.backend"})

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == "tri.backend":
                raise ModuleNotFoundError("No module named 'tri'", name="tri")
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert dispatch.unavailable_reason("triton") == "import failed: No module named 'tri'"


def test_not_installed_reason_gives_the_install_hint(clean, monkeypatch):
    monkeypatch.setattr(dispatch, "BACKENDS", {"cute": "flash_attn.ghost_cute.backend", "x": "flash_attn.ghost_x.b"})
    assert dispatch.unavailable_reason("cute") == ("not installed (pip install flash-attn-4 (or "
                                                   "./packages/flash-attn-4))")
    assert dispatch.unavailable_reason("x") == "not installed (x)"


def test_a_module_not_found_error_without_a_name(clean, monkeypatch):
    mod_name = "_fa_test_nameless"
    monkeypatch.setattr(dispatch, "BACKENDS", {"triton": mod_name})

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name == mod_name:
                raise ModuleNotFoundError("something is missing")
            return None

    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert dispatch.unavailable_reason("triton") == "import failed: something is missing"


# ----------------------------------------------------------------------------------------------------
# the core's launcher service: the Triton backend's launcher through the registry, Triton's own launch otherwise


def _fake_backend(monkeypatch, name, **attrs):
    mod = types.ModuleType(f"_fa_test_{name}_backend")
    mod.unavailable_reason = lambda: None
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(dispatch, "BACKENDS", {**dispatch.BACKENDS, name: mod.__name__})
    return mod


def test_triton_launcher_takes_the_backends_launcher(clean, monkeypatch):
    from flash_attn import backends

    made = []
    _fake_backend(monkeypatch, "triton", launcher=lambda kernel: made.append(kernel) or ("fast", kernel))
    assert backends.triton_launcher("k") == ("fast", "k") and made == ["k"]


def test_triton_launcher_falls_back_to_tritons_own_launch(clean, monkeypatch):
    from flash_attn import backends

    _fake_backend(monkeypatch, "triton")  # a backend module without the optional entry
    launch = backends.triton_launcher("k")
    assert isinstance(launch, backends.TritonLaunch) and launch.kernel == "k"
    _fake_backend(monkeypatch, "triton", launcher=lambda kernel: 1 / 0)
    dispatch._modules.clear(), dispatch._unavailable.clear()
    sys.modules[dispatch.BACKENDS["triton"]].unavailable_reason = lambda: "no CUDA device"
    assert isinstance(backends.triton_launcher("k"), backends.TritonLaunch)  # an unavailable backend is not asked

    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((grid, args, meta))

    backends.TritonLaunch(Kernel())((2, 1), (7, 8), {"BLOCK": 16}, "plan")
    assert seen == [((2, 1), (7, 8), {"BLOCK": 16})]


def test_the_triton_backend_offers_its_launcher():
    pytest.importorskip("triton")
    from flash_attn.triton import backend
    from flash_attn.triton._launch import Launcher

    assert isinstance(backend.launcher(lambda: None), Launcher)
