"""Which real backend (cute, triton, torch) the dispatcher picks, on faked device facts.

No GPU is needed: torch.cuda's availability and compute capability, and whether the cute / triton packages
can run here (their backends' ``unavailable_reason``), are monkeypatched; the calls are described by stand-ins
for q and v that carry only what flash_attn.dispatch reads (device, dtype, shape). The backends' own
``unsupported_reason`` runs unpatched, so these tests pin the priority order (CuTeDSL first, then Triton,
then the PyTorch reference) against what each backend really refuses, and that every field of the call's
description (flash_attn.call.AttnCall) is part of the dispatcher's cache key: two calls differing only in it, made
one after the other in either order, each get the backend a fresh lookup gives.
"""
import sys
import types

import pytest
import torch

from flash_attn import call as call_mod
from flash_attn import dispatch
from flash_attn.call import AttnCall



@pytest.fixture
def gpu(cute_env, monkeypatch):
    """A process with CUDA devices 0: Hopper (9, 0) and 1: Ampere (8, 0), cute and triton installed, and an
    empty dispatch cache. Returns a setter for the backends' availability."""
    cute_backend = pytest.importorskip("flash_attn.cute.backend")
    triton_backend = pytest.importorskip("flash_attn.triton.backend")

    caps = {0: (9, 0), 1: (8, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def capability(device=None):
        index = device if isinstance(device, int) else 0 if device is None else torch.device(device).index or 0
        return caps[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)  # (cute_env: no FLASH_ATTN_CUTE_DISABLE / _OVERRIDES)
    mods = {"cute": cute_backend, "triton": triton_backend}

    def available(**reasons):
        """available(cute="not installed") makes cute unavailable with that reason; None: available."""
        for name, mod in mods.items():
            monkeypatch.setattr(mod, "unavailable_reason", lambda why=reasons.get(name): why)
        for cache in ("_modules", "_unavailable", "_choice"):
            monkeypatch.setattr(dispatch, cache, {})
        monkeypatch.setattr(call_mod, "_arch", {})  # (device facts, cached per device)

    available()
    return available


def _t(device="cuda:0", dtype=torch.float16, d=64, shape=(2, 16, 4)):
    """What dispatch reads of a tensor: its device, dtype and last dim."""
    return types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(*shape, d))


# describe()'s arguments of a plain call: dense, no mask, fp16, head dim 64, forward
BASE = dict(device="cuda:0", dtype=torch.float16, d=64, dv=64, varlen=False, paged=False, causal=False,
            window_left=-1, window_right=-1, softcap=0.0, alibi=False, dropout_p=0.0, return_probs=False,
            kvcache=False, backward=False, deterministic=False, scale=None)


def _call(**kw):
    a = {**BASE, **kw}
    q = _t(a.pop("device"), a["dtype"], a.pop("d"))
    v = _t(q.device, a.pop("dtype"), a.pop("dv"))
    return call_mod.describe(q, v, **a)


def _select(**kw):
    return dispatch.select(_call(**kw)).NAME


# ----------------------------------------------------------------------------------------------------
# Which backend each kind of call reaches

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_dense_forward_runs_cute(gpu, dtype, d):
    assert _select(dtype=dtype, d=d, dv=d) == "cute"
    assert _select(dtype=dtype, d=d, dv=d, causal=True, window_right=0) == "cute"
    assert _select(dtype=dtype, d=d, dv=d, window_left=32, window_right=8, softcap=30.0) == "cute"
    assert _select(dtype=dtype, d=d, dv=d, varlen=True) == "cute"


def test_hopper_dense_backward_runs_cute(gpu):
    assert _select(backward=True) == "cute"
    assert _select(backward=True, causal=True, window_right=0, d=128, dv=128) == "cute"
    # sliding windows too (the plan rule bwd_window, on by default)
    assert _select(backward=True, window_left=16, window_right=0, causal=True) == "cute"
    assert _select(backward=True, window_left=16, window_right=8) == "cute"
    # varlen and softcap (plan rules bwd_varlen / bwd_softcap, on by default)
    assert _select(backward=True, varlen=True, causal=True) == "cute"
    assert _select(backward=True, softcap=30.0) == "cute"


@pytest.mark.parametrize("call", [
    dict(dropout_p=0.1), dict(alibi=True), dict(return_probs=True), dict(kvcache=True),
    dict(dtype=torch.float32), dict(d=72, dv=72), dict(d=64, dv=32), dict(device="cuda:1"),
    dict(backward=True, deterministic=True, d=192, dv=192),  # (plan rule bwd_deterministic "writer": d64-d128)
    dict(backward=True, d=256, dv=256),
], ids=lambda c: ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in c.items()))
def test_triton_where_cute_refuses(gpu, call):
    assert _select(**call) == "triton"


def test_deterministic_backward_on_cute_where_the_writer_warp_takes_the_turns(gpu):
    for d in (64, 96, 128):
        assert _select(d=d, dv=d, backward=True, deterministic=True) == "cute", d


def test_wide_head_dims_forward_on_cute_backward_by_the_rules(gpu):
    for d in (96, 192, 256):
        assert _select(d=d, dv=d) == "cute", d
    assert _select(d=192, dv=192, backward=True) == "cute"  # (plan rule bwd_wide_d)
    assert _select(d=192, dv=128, backward=True, causal=True) == "cute"  # the pair
    assert _select(d=256, dv=256, backward=True, causal=True) == "cute"  # (plan rule bwd_d256: causal)
    assert _select(d=256, dv=256, backward=True) == "triton"


def test_d96_backward_runs_cute(gpu):
    assert _select(d=96, dv=96, backward=True) == "cute"
    assert _select(d=96, dv=96, backward=True, causal=True, window_right=0) == "cute"
    assert _select(d=96, dv=96, backward=True, window_left=16, window_right=8) == "cute"
    assert _select(d=96, dv=96, backward=True, varlen=True, causal=True) == "cute"
    assert _select(d=96, dv=96, backward=True, softcap=30.0) == "cute"
    assert _select(d=96, dv=64, backward=True) == "triton"  # v's head dim must equal q's


def test_switches_move_calls_off_cute(gpu, cute_env):
    cute_env(DISABLE="bwd")
    assert _select(backward=True) == "triton"
    assert _select() == "cute"
    cute_env(DISABLE="d96")  # the d96 forward and backward
    assert _select(d=96, dv=96, backward=True) == "triton"
    assert _select(d=96, dv=96) == "triton"
    assert _select(d=128, dv=128, backward=True) == "cute"  # (a kind of call not chosen above: choices are cached)
    cute_env(DISABLE="bwd,d96,d192,d256")  # (before any d256 call: the dispatcher caches its choice per kind)
    assert _select(d=256, dv=256) == "triton"


def test_cute_not_installed_hopper_runs_triton(gpu):
    gpu(cute="not installed (pip install flash-attn-4)")
    assert _select() == "triton"
    assert _select(backward=True) == "triton"
    assert "not installed" in dispatch.explain(_call())["cute"]


def test_neither_gpu_backend_installed_runs_torch(gpu):
    gpu(cute="not installed", triton="triton is not installed")
    assert _select() == "torch"
    assert _select(backward=True) == "torch"


def test_paged_calls(gpu):
    # the cute paged kernel serves Hopper's paged forward; Triton has no paged attention outside the kv cache
    assert _select(varlen=True, paged=True) == "cute"
    assert _select(varlen=True, paged=True, device="cuda:1") == "torch"
    assert _select(varlen=True, paged=True, backward=True) == "torch"
    assert _select(paged=True, kvcache=True, device="cuda:1") == "triton"


def test_cpu_runs_torch(gpu):
    # even with the Triton interpreter on (tests/conftest.py) and every backend importable
    for kw in (dict(), dict(backward=True), dict(dtype=torch.float32, d=72, dv=72), dict(dropout_p=0.1)):
        assert _select(device="cpu", **kw) == "torch", kw


def test_priority_order_is_cute_triton_torch(gpu):
    assert list(dispatch.BACKENDS) == ["cute", "triton", "torch"]
    call = _call(d=128, dv=128)
    assert dispatch.explain(call) == {"cute": None, "triton": None, "torch": None}
    assert dispatch.select(call).NAME == "cute"


# ----------------------------------------------------------------------------------------------------
# Every attribute that changes the choice is in the cache keys

# (name, the plain call's changes, the same call with only that attribute changed, expected backends)
PAIRS = [
    ("softcap", dict(backward=True), dict(backward=True, softcap=30.0), ("cute", "triton")),
    ("deterministic", dict(backward=True, d=192, dv=192), dict(backward=True, d=192, dv=192, deterministic=True),
     ("cute", "triton")),  # (bwd_deterministic "writer": d64-d128 only)
    ("dropout", dict(), dict(dropout_p=0.1), ("cute", "triton")),
    ("alibi", dict(), dict(alibi=True), ("cute", "triton")),
    ("return_probs", dict(), dict(return_probs=True), ("cute", "triton")),
    ("kvcache", dict(), dict(kvcache=True), ("cute", "triton")),
    ("varlen", dict(backward=True), dict(backward=True, varlen=True), ("cute", "triton")),
    ("paged", dict(varlen=True, backward=True), dict(varlen=True, backward=True, paged=True), ("cute", "torch")),
    ("head_dim", dict(), dict(d=72), ("cute", "triton")),
    ("head_dim_v", dict(), dict(dv=32), ("cute", "triton")),
    ("dtype", dict(), dict(dtype=torch.float32), ("cute", "triton")),
    ("device", dict(), dict(device="cpu"), ("cute", "torch")),
    ("arch", dict(), dict(device="cuda:1"), ("cute", "triton")),
    ("local", dict(backward=True), dict(backward=True, window_left=16), ("cute", "triton")),  # (bwd_window off)
    # causal with the same window (-1, 0): causal, or a window reaching to the diagonal (a local call)
    ("causal", dict(backward=True, causal=True, window_right=0), dict(backward=True, window_right=0),
     ("cute", "triton")),
    ("backward", dict(softcap=30.0), dict(softcap=30.0, backward=True), ("cute", "triton")),
]


@pytest.mark.parametrize("name,a,b,expect", PAIRS, ids=[p[0] for p in PAIRS])
def test_cache_key_holds_every_attribute(gpu, cute_env, name, a, b, expect):
    # windowed, soft-capped and varlen backward calls leave cute only with their plan rules off
    rule_off = {"local": "bwd_window", "causal": "bwd_window", "softcap": "bwd_softcap", "backward": "bwd_softcap",
                "varlen": "bwd_varlen"}
    if name in rule_off:
        cute_env(OVERRIDES=f"plan.{rule_off[name]}=0")
    assert (_select(**a), _select(**b)) == expect
    gpu()  # empty cache: the other order
    assert (_select(**b), _select(**a)) == expect[::-1]
    # and once more from the warm cache
    assert (_select(**a), _select(**b)) == expect


def test_dense_lane_describes_the_call_as_describe_does(gpu):
    # flash_attn_func's common call builds its description with call.dense(): the same description (and so the
    # same cached choice) as the general builder's
    for kw in (dict(), dict(causal=True), dict(window_left=8, window_right=8), dict(causal=True, window_left=8),
               dict(d=256, dv=128), dict(deterministic=True), dict(device="cpu"), dict(device="cuda:1"),
               dict(scale=0.3), dict(dtype=torch.bfloat16)):
        a = {**BASE, **kw}
        q = _t(a["device"], a["dtype"], a["d"])
        lane = call_mod.dense(q, a["d"], a["dv"], a["scale"], a["causal"], (a["window_left"], a["window_right"]),
                              a["deterministic"])
        full = _call(**kw)
        assert lane == full and hash(lane) == hash(full), kw
        assert type(lane) is call_mod.AttnCall


def test_forced_backend_is_in_the_cache_key(gpu):
    assert _select() == "cute"
    with dispatch.use_backend("triton"):
        assert _select() == "triton"
    with dispatch.use_backend("torch"):
        assert _select() == "torch"
    assert _select() == "cute"


# A backend first in line that refuses whatever differs from the plain call in one field of the description: with the real
# backends some fields change the choice only together with others (causal only through local, today), but
# the contract lets any backend refuse on any field, so each must reach the cache keys on its own.
# field -> (describe() changes that leave every other field as the plain call has it)
FIELDS = {
    "device_type": dict(device="cpu"),
    "dtype": dict(dtype=torch.float32),
    "head_dim": dict(d=72),
    "head_dim_v": dict(dv=32),
    "arch": dict(device="cuda:1"),
    "varlen": dict(varlen=True),
    "paged": dict(paged=True),
    "causal": dict(causal=True),
    "window_left": dict(window_left=16),
    "window_right": dict(window_right=8),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi=True),
    "dropout_p": dict(dropout_p=0.1),
    "return_probs": dict(return_probs=True),
    "kvcache": dict(kvcache=True),
    "backward": dict(backward=True),
    "deterministic": dict(deterministic=True),
    "scale": dict(scale=0.5),
    "sink": dict(sink=True),
}


def test_fields_cover_the_call():
    assert set(FIELDS) == set(dispatch.Call._fields) and dispatch.Call is AttnCall


@pytest.fixture
def picky(gpu, monkeypatch):
    plain = _call()

    def install(field):
        mod = types.ModuleType("_picky_backend")
        mod.NAME = "picky"
        mod.unavailable_reason = lambda: None
        mod.unsupported_reason = lambda call: (None if getattr(call, field) == getattr(plain, field)
                                               else f"picky about {field}")
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        monkeypatch.setattr(dispatch, "BACKENDS", {"picky": mod.__name__, **dispatch.BACKENDS})
        gpu()

    return install


@pytest.mark.parametrize("field", FIELDS)
def test_select_key_holds_every_call_field(picky, field):
    picky(field)
    for _ in range(2):  # a cold cache, then a warm one
        assert _select() == "picky"
        assert _select(**FIELDS[field]) != "picky"
    picky(field)  # the other order
    assert _select(**FIELDS[field]) != "picky"
    assert _select() == "picky"
