"""benchmarks/tools/precompile_gpu_tests.py: the kernels it builds are the ones forward() / forward_varlen() ask
fwd_kernel for in the GPU tests' calls (checked by making those calls on CPU tensors with fwd_kernel recording), and each has a
config."""
import os
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

from benchmarks.tools import precompile_gpu_tests as pg  # noqa: E402
from flash_attn.cute import kernels, launch, plan  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cute"))
from _cute_table import swap_kernels  # noqa: E402  (tests/cute's helper: on the path when this file runs alone too)


def test_requests_cover_the_new_kernels():
    todo = pg.requests()
    kinds = {k for _, _, _, kw in todo for k in ("pack", "dv", "paged", "varlen", "split")
             if (kw[k] > 1 if k == "pack" else kw[k])}
    assert kinds == {"pack", "dv", "paged", "varlen", "split"} and 40 < len(todo) < 130
    for dtype, d, causal, kw in todo:
        kernels.fwd_config(dtype, d, causal, "sm_90a", **kw)  # a config exists (paged: its block and box)


@pytest.mark.parametrize("req", [
    dict(dtype=torch.bfloat16, d=128, causal=False, pack=8, seqlen_k=500),
    dict(dtype=torch.bfloat16, d=64, causal=True, seqlen_k=9000),
    dict(dtype=torch.bfloat16, d=128, causal=False, seqlen_k=500),
    dict(dtype=torch.float16, d=192, dv=128, causal=True, window=(100, -1), softcap=30.0, sink=True, seqlen_k=300),
    dict(dtype=torch.bfloat16, d=128, causal=True, window=(100, -1), pack=4, varlen=True, paged=16),
    dict(dtype=torch.bfloat16, d=64, causal=False, window=(40, 8), sink=True, varlen=True),
    dict(dtype=torch.bfloat16, d=128, causal=True, sink=True, split=True, pack=4, seqlen_k=2000),
    dict(dtype=torch.bfloat16, d=192, dv=128, causal=False, window=(64, 0), softcap=20.0, split=True, seqlen_k=77),
    dict(dtype=torch.bfloat16, d=128, causal=True, sink=True, split=True, pack=4, varlen=True),
    dict(dtype=torch.bfloat16, d=192, dv=128, causal=False, window=(64, 0), split=True, varlen=True, paged=64)])
def test_kernel_args_are_what_the_calls_ask_for(monkeypatch, req):
    asked = []

    def record(*args, **kw):
        asked.append((args, kw))
        return lambda *a: None

    monkeypatch.setattr(launch, "fwd_kernel", record)
    swap_kernels(monkeypatch, {})  # the in-memory table (empty: every call asks fwd_kernel)
    dtype, d, dv, H, Hk = req["dtype"], req["d"], req.get("dv") or req["d"], 4 * req.get("pack", 1), 4
    sink = torch.zeros(H) if req.get("sink") else None
    window = [plan._UNBOUNDED if w < 0 else w for w in req.get("window", (-1, -1))]  # (-1: no limit)
    common = dict(window_left=window[0], window_right=window[1], softcap=req.get("softcap", 0.0), sink=sink,
                  pack=req.get("pack", 1), splits=3 if req.get("split") else 1)
    if req.get("varlen"):
        q = torch.zeros(5, H, d, dtype=dtype)
        cu = torch.tensor([0, 5], dtype=torch.int32)
        if req.get("paged"):
            k, v = torch.zeros(2, req["paged"], Hk, d, dtype=dtype), torch.zeros(2, req["paged"], Hk, dv, dtype=dtype)
            launch.forward_varlen(q, k, v, cu, None, torch.tensor([7], dtype=torch.int32), 5, 0.1, req["causal"],
                                  page_table=torch.zeros(1, 2, dtype=torch.int32), **common)
        else:
            k, v = torch.zeros(7, Hk, d, dtype=dtype), torch.zeros(7, Hk, dv, dtype=dtype)
            launch.forward_varlen(q, k, v, cu, cu, None, 5, 0.1, req["causal"], **common)
    else:
        q = torch.zeros(1, 3, H, d, dtype=dtype)
        k = torch.zeros(1, req["seqlen_k"], Hk, d, dtype=dtype)
        v = torch.zeros(1, req["seqlen_k"], Hk, dv, dtype=dtype)
        launch.forward(q, k, v, 0.1, req["causal"], **common)
    (args, kw), = asked
    if kw.get("dv") == d:  # forward passes v's head dim always; fwd_kernel drops it when it is q's
        kw["dv"] = None
    want = pg.kernel_args(**req)
    assert args == want[:3] + ("sm_90a",)
    defaults = dict(local=False, softcap=False, varlen=False, sink=False, short=False, long=False, pack=1, dv=None,
                    paged=0, split=False)
    assert {**defaults, **kw} == want[3]
