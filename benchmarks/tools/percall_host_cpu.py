"""Host-path cost per call on the CPU: the Python work of a call with the kernel replaced by a Python no-op (CPU
tensors, b1 s128 h16 d128 bf16). ``--api cute``: flash_attn.cute.flash_attn_func with its kernels stubbed and the
device check bypassed, and with q, k, v requiring gradients ("common, grad": through the root package's differentiable
op, the cute backend stood in for); ``--api root``: flash_attn.flash_attn_func with a no-op backend forced ("nop", registered
here), with and without autograd, and through the cute backend module (``(cute backend)``: flash_attn.cute.backend's
fwd and launch with the same stubbed kernels, the root API's path on a Hopper GPU). For comparing the per-call path before and after a change (run it on both
checkouts, alternating, on a quiet machine; the GPU per-call figure is bench_cute_overhead's). ``--api kvcache``:
flash_attn.flash_attn_with_kvcache on a decoding shape (one query token, H 32, Hk 8, d 128, an 8k cache) with the
no-op backend, then through the Triton backend's fwd_kvcache with its launches replaced by no-ops, and through the
cute backend's (its kernels replaced by no-ops). ``--api decode``: the root flash_attn_func on that decoding shape (an
inference call: the lse dropped) through the cute backend, whose decoding plan (pack_gqa 4, 16 split-KV parts) is
fixed and whose split kernel and combine launch are no-ops, the root flash_attn_varlen_func on it (one query row per
sequence, as Hugging Face's padded decoding calls it), and flash_attn.cute.flash_attn_func(num_splits=0,
pack_gqa=True) on it (its own split rule, an H200's 132 SMs) (fp16: the combine's host path serves CPU tensors only in
Triton's interpreter, and not bf16 there). ``--api paged``: flash_attn.cute.flash_attn_varlen_func's paged decoding
call (batch 1 and 32, an 8k cache in 64-row pages) with forward_varlen stubbed: the API's checks and their one copy.

    python -m benchmarks.tools.percall_host_cpu [--api cute|root|both|kvcache|decode|paged] [--rounds 15] [--calls 2000]
"""
import argparse
import sys
import time

import torch

SHAPE = (1, 128, 16, 128)


def _stub_cute():
    from flash_attn.cute import interface, kernels, launch

    def nop(*args):
        return None

    for causal in (False, True):
        for local in (False, True):
            for extra in ((), ("short",), ("long",)):
                kernels._kernels[(torch.bfloat16, 128, causal, "sm_90a", local, False) + extra] = nop
    interface._device_arch = launch._device_arch = lambda q, k, v: "sm_90a"
    return interface.flash_attn_func


class _NopBackend:
    """A backend (the contract of flash_attn/backends/__init__.py) whose forward returns preallocated tensors."""

    NAME = "nop"

    def __init__(self):
        B, S, H, D = SHAPE
        self.out = torch.empty(SHAPE, dtype=torch.bfloat16)
        self.lse = torch.empty((B, H, S), dtype=torch.float32)

    def unavailable_reason(self):
        return None

    def unsupported_reason(self, call):
        return None

    def fwd(self, *args, **kwargs):
        return self.out, self.lse, None

    def fwd_kvcache(self, *args, **kwargs):
        return self.out, self.lse


def _stub_root():
    import flash_attn
    from flash_attn import dispatch

    sys.modules["_percall_nop_backend"] = _NopBackend()
    dispatch.BACKENDS["nop"] = "_percall_nop_backend"
    return flash_attn.flash_attn_func


class _CuteBackendStub:
    """flash_attn.cute.backend as the dispatcher sees it on a Hopper GPU: available, serving the call, its own fwd."""

    NAME = "cute"

    def __init__(self):
        from flash_attn.cute import backend

        self.fwd = backend.fwd
        for flag in ("BWD_OUT", "LSE_SCRATCH"):  # the contract's optional features, as the module declares them
            if hasattr(backend, flag):
                setattr(self, flag, getattr(backend, flag))

    def unavailable_reason(self):
        return None

    def unsupported_reason(self, call):
        return None


def _stub_root_cute():
    from flash_attn import dispatch

    _stub_cute()
    sys.modules["_percall_cute_backend"] = _CuteBackendStub()
    dispatch.BACKENDS["nop_cute"] = "_percall_cute_backend"


def _time(f, args, kw, rounds, calls):
    for _ in range(calls):  # warm: the plan's caches
        f(*args, **kw)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f(*args, **kw)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def measure(api="cute", rounds=15, calls=2000):
    """{case: us}: the fastest round's time per call of the common call and of a windowed one (root: also with
    q, k, v requiring gradients, the forward of a training step)."""
    q, k, v = (torch.randn(SHAPE, dtype=torch.bfloat16) for _ in range(3))
    cases = {"common": {}, "windowed": {"causal": True, "window_size": (64, 0)}}
    out = {}
    if api == "cute":
        f = _stub_cute()
        for name, kw in cases.items():
            out[name] = _time(f, (q, k, v), kw, rounds, calls)
        # with q, k, v requiring gradients: the root package's differentiable op with the forward forced onto the
        # cute backend (its stand-in: available, its own fwd on the stubbed kernels)
        from flash_attn import dispatch

        _stub_root_cute()
        dispatch.BACKENDS["cute"] = "_percall_cute_backend"
        dispatch._unavailable.pop("cute", None)
        dispatch._modules.pop("cute", None)
        dispatch._choice.clear()
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out["common, grad"] = _time(f, (qg, kg, vg), {}, rounds, calls)
        return out
    from flash_attn import dispatch

    f = _stub_root()
    with dispatch.use_backend("nop"):
        for name, kw in cases.items():
            out[name] = _time(f, (q, k, v), kw, rounds, calls)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out["common, grad"] = _time(f, (qg, kg, vg), {}, rounds, calls)
    _stub_root_cute()
    with dispatch.use_backend("nop_cute"):
        for name, kw in cases.items():
            out[f"{name} (cute backend)"] = _time(f, (q, k, v), kw, rounds, calls)
    return out


def measure_kvcache(rounds=15, calls=2000):
    """{case: us} of flash_attn_with_kvcache's decoding call: the front door alone (no-op backend) and with the
    Triton backend's host work (kernel launches stubbed)."""
    import flash_attn
    from flash_attn import dispatch

    B, Sk, H, Hk, D = 1, 8192, 32, 8, 128
    q = torch.randn(B, 1, H, D, dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, Sk, Hk, D, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), Sk, dtype=torch.int32)
    nop = _NopBackend()
    nop.out, nop.lse = torch.empty(B, 1, H, D, dtype=torch.bfloat16), torch.empty(B, H, 1)
    sys.modules["_percall_nop_backend"] = nop
    dispatch.BACKENDS["nop"] = "_percall_nop_backend"
    out = {}
    with dispatch.use_backend("nop"):
        out["front door"] = _time(flash_attn.flash_attn_with_kvcache, (q, kc, vc), {"cache_seqlens": lens}, rounds,
                                  calls)
    from flash_attn.triton import backend as tb, kvcache as tkv

    stubbed = {n: getattr(tkv, n) for n in dir(tkv) if n.startswith("_L_")}
    real_sms, real_arch = tkv._num_sms, tb._arch
    try:
        for n in stubbed:
            setattr(tkv, n, lambda *a, **k: None)
        tkv._num_sms = lambda device: 132
        tb._arch = lambda device: (9, 0)

        class _TritonStub(_NopBackend):
            def fwd_kvcache(self, call, *args, **kwargs):
                return tb.fwd_kvcache(call, *args, **kwargs)

        sys.modules["_percall_triton_kv"] = _TritonStub()
        dispatch.BACKENDS["nop_triton"] = "_percall_triton_kv"
        with dispatch.use_backend("nop_triton"):
            out["with the Triton backend"] = _time(flash_attn.flash_attn_with_kvcache, (q, kc, vc),
                                                   {"cache_seqlens": lens}, rounds, calls)
    finally:
        for n, f in stubbed.items():
            setattr(tkv, n, f)
        tkv._num_sms, tb._arch = real_sms, real_arch
    out["with the cute backend"] = _kvcache_cute(flash_attn.flash_attn_with_kvcache, (q, kc, vc), lens, rounds, calls)
    return out


def _kvcache_cute(f, args, lens, rounds, calls):
    """flash_attn_with_kvcache through flash_attn.cute's backend (kvcache.py and launch.forward_varlen's host work),
    its varlen kernels stubbed, the decoding plan fixed at pack_gqa 4, unsplit (the GPU's SM count is not asked)."""
    from flash_attn import dispatch
    from flash_attn.cute import backend as cb, kernels

    def nop(*a):
        return None

    for pack in ((), ("pack", 4)):
        kernels._kernels[(torch.bfloat16, 128, False, "sm_90a", False, False, True) + pack] = nop
    real_plan = cb._decode_plan
    cb._decode_plan = lambda *a: (4, 1)
    try:
        class _CuteKv(_NopBackend):
            def fwd_kvcache(self, call, *a, **kw):
                return cb.fwd_kvcache(call, *a, **kw)

        sys.modules["_percall_cute_kv"] = _CuteKv()
        dispatch.BACKENDS["nop_cute_kv"] = "_percall_cute_kv"
        with dispatch.use_backend("nop_cute_kv"):
            return _time(f, args, {"cache_seqlens": lens}, rounds, calls)
    finally:
        cb._decode_plan = real_plan


def measure_decode(rounds=15, calls=2000, splits=16):
    """{case: us} of the root flash_attn_func's decoding call (q 1 x 1 x 32 x 128, an 8k cache with 8 KV heads)
    through the cute backend's split-KV path, its kernel launches no-ops."""
    import flash_attn
    from flash_attn import dispatch
    from flash_attn.cute import backend as cb, combine, kernels

    _stub_root_cute()
    B, Sk, H, Hk, D = 1, 8192, 32, 8, 128
    dt = torch.float16
    q = torch.randn(B, 1, H, D, dtype=dt)
    kc, vc = (torch.randn(B, Sk, Hk, D, dtype=dt) for _ in range(2))

    def nop(*a):
        return None

    kernels._kernels[(dt, D, False, "sm_90a", False, False, "pack", 4, "split")] = nop
    kernels._kernels[(dt, D, False, "sm_90a", False, False, True, "pack", 4, "split")] = nop  # (varlen)
    saved = cb._decode_plan, combine._launch, combine._INTERPRET, combine._kernel
    cb._decode_plan = lambda *a: (4, splits)
    combine._launch, combine._INTERPRET, combine._kernel = (lambda *a: None), True, (lambda: nop)
    cb._decode_plans.clear()
    try:
        with dispatch.use_backend("nop_cute"), torch.inference_mode(False):
            out = {"root decode 1 x 8k (cute backend)": _time(flash_attn.flash_attn_func, (q, kc, vc), {}, rounds,
                                                              calls)}
            # Hugging Face's padded-batch decoding step: the root varlen call (one query row per sequence)
            cu_q = torch.arange(B + 1, dtype=torch.int32)
            cu_k = torch.arange(0, (B + 1) * Sk, Sk, dtype=torch.int32)
            out["root varlen decode 1 x 8k (cute backend)"] = _time(
                flash_attn.flash_attn_varlen_func, (q.view(B, H, D), kc.view(B * Sk, Hk, D), vc.view(B * Sk, Hk, D),
                                                    cu_q, cu_k, 1, Sk), {}, rounds, calls)
        # the FA4 API's own choice on the same call (num_splits=0, pack_gqa): its split rule and split path per call
        from flash_attn.cute import interface, plan
        saved_sms = plan._device_sms
        plan._device_sms = lambda t: 132
        try:
            out["cute decode 1 x 8k (num_splits=0, pack_gqa)"] = _time(
                interface.flash_attn_func, (q, kc, vc), {"num_splits": 0, "pack_gqa": True}, rounds, calls)
        finally:
            plan._device_sms = saved_sms
        return out
    finally:
        cb._decode_plan, combine._launch, combine._INTERPRET, combine._kernel = saved
        cb._decode_plans.clear()


def measure_paged(rounds=15, calls=2000):
    """{case: us} of flash_attn.cute.flash_attn_varlen_func's paged decoding call (one query token per sequence, H 32,
    Hk 8, d 128, 8k keys in 64-row pages, seqused_k): its argument and value checks, forward_varlen replaced by a stub
    that returns out and lse (so the figure is the API's own host work: the checks and their one copy)."""
    from benchmarks.attention.ab_cute_decode import _inputs
    from flash_attn.cute import flash_attn_varlen_func, interface

    saved = interface._device_arch, interface.forward_varlen
    interface._device_arch = lambda q, k, v: "sm_90a"
    interface.forward_varlen = lambda q, *a, **kw: (q, q.new_zeros(q.shape[1], q.shape[0]).float())
    try:
        out = {}
        for b in (1, 32):
            _, args, kw = _inputs((b, 1, 8192, 32, 8, 128), 64, torch.float16, device="cpu")
            out[f"paged {b} x 8k"] = _time(flash_attn_varlen_func, args, kw, rounds, calls)
        return out
    finally:
        interface._device_arch, interface.forward_varlen = saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("cute", "root", "both", "kvcache", "decode", "paged"), default="cute")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args(argv)
    for api in (("cute", "root") if a.api == "both" else (a.api,)):
        if api == "kvcache":
            res = measure_kvcache(a.rounds, a.calls)
        elif api == "decode":
            res = measure_decode(a.rounds, a.calls)
        elif api == "paged":
            res = measure_paged(a.rounds, a.calls)
        else:
            res = measure(api, a.rounds, a.calls)
        print(f"{api}: " + ", ".join(f"{k} {v:.2f} us" for k, v in res.items()))


if __name__ == "__main__":
    main()
