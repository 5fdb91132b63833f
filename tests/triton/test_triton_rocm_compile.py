"""The Triton attention backend and the fused ops on AMD GPUs, checked without one: every kernel a ROCm device
would be asked to run (the host code with the configs ROCm gets) compiles for gfx942 (MI300) and gfx90a (MI200)
within their 64 KiB of LDS and without register spills (benchmarks/tools/triton_rocm_compile.py), and a ROCm device
selects those configs. Numbers are not checked: no AMD GPU here (the README says AMD is untested)."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.backends.amd.compiler")

from flash_attn.triton import _configs, backend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = {"_attn_fwd_kernel", "_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_kvcache_prep_kernel",
           "_kvcache_attn_kernel", "_kvcache_combine_kernel",
           # the fused ops (flash_attn.ops.triton)
           "_ln_fwd_kernel", "_ln_bwd_kernel", "_ln_bwd_reduce_kernel", "_rotary_kernel", "_ce_partial_kernel",
           "_ce_finish_kernel", "_ce_bwd_flat_kernel", "_bias_act_fwd_kernel", "_bias_act_bwd_kernel",
           "_gated_fwd_kernel", "_gated_bwd_kernel", "_colsum_part_kernel", "_colsum_final_kernel"}


def test_rocm_device_takes_the_hip_configs(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4.0", raising=False)
    assert backend._arch(torch.device("cuda", 0)) == _configs.HIP_ARCH  # asks the device nothing
    assert backend._arch(torch.device("cpu")) is None
    for d in (32, 64, 128, 256):
        for causal in (False, True):
            fwd, bwd = (_configs.fwd_config(_configs.HIP_ARCH, d, causal, False, torch.bfloat16),
                        _configs.bwd_config(_configs.HIP_ARCH, d, causal, False, torch.bfloat16))
            assert fwd is _configs._FWD[("hip", d, False)] and bwd is _configs._BWD[("hip", d, False)]
        # never the sm_90-only paths (TMA descriptors, warp specialization)
        assert _configs.fwd_variant_config(_configs.HIP_ARCH, d, True, (3, 128)) is _configs._FWD[("hip", d, False)]
        assert _configs.bwd_ws_config(_configs.HIP_ARCH, d, True) is None
    monkeypatch.setattr(backend, "_INTERPRET", False)
    assert not backend._tma_supported_uncached(torch.device("cuda", 0), torch.bfloat16, 128, 128)


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check for CPU machines")
def test_every_kernel_compiles_for_mi300_and_mi200_within_lds_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "packages", "flash-attn-triton"), ROOT,
                                           env.get("PYTHONPATH", "")]))
    archs = ("gfx942", "gfx90a")
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.tools.triton_rocm_compile", "--arch", arch,
                               "--json"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for arch in archs]
    for arch, p in zip(archs, procs):
        out, err = p.communicate(timeout=900)
        # exit status 1 with the faults on stderr: more LDS than 64 KiB, or scratch
        assert p.returncode == 0, err[-3000:]
        rows = json.loads(out.strip().splitlines()[-1])
        assert {r["arch"] for r in rows} == {arch}
        assert {r["kernel"] for r in rows} == KERNELS
        assert len({r["case"] for r in rows}) == 25
        for r in rows:
            assert r["lds"] <= 65536 and r["scratch"] == 0 and r["vgpr"] <= 512 and r["warps"] <= 16, r


def test_rocm_layer_norm_backward_without_register_cap(monkeypatch):
    # Triton's AMD backend has no maxnreg launch option (a launch with it raises KeyError), and a workgroup holds
    # at most 16 warps of 64 lanes: the LayerNorm backward's plan leaves the cap out and its warps at 16 there.
    from flash_attn.ops.triton import layer_norm as ln

    for hip in (False, True):
        monkeypatch.setattr(ln, "_HIP", hip)
        ln._bwd_plan.cache_clear()
        cfg = ln._bwd_config(64, 16384, "cpu", 1)
        assert cfg.num_warps == (16 if hip else 32)
        meta = ln._bwd_plan(*(False,) * 10, *cfg[2:])[1]
        assert ("maxnreg" in meta) == (not hip) and meta["num_warps"] == cfg.num_warps
    ln._bwd_plan.cache_clear()
