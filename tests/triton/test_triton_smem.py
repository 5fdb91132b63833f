"""The Triton attention kernels' configurations fit the shared memory of the NVIDIA GPU they are chosen for: the
forward (head dims 64-256) and the backward's dK/dV and dQ kernels (128, 256: the largest tiles), compiled on the
CPU (no GPU) for sm_86 (RTX 30, 99 KiB a block) and sm_120 (RTX 50, 99 KiB). A config past that fails every launch
on such a device."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = r"""
import json
from benchmarks.tools import triton_bwd_compile as b
from benchmarks.tools import triton_fwd_compile as f
from flash_attn.triton import _configs
rows = []
for arch in (86, 120):
    cap = (arch // 10, arch % 10)
    for d in (64, 128, 256):
        cfg = _configs.fwd_config(cap, d, True, False, None)
        rows.append(("fwd", arch, d, f.compile_fwd(d, True, cfg, arch=arch)[0].metadata.shared,
                     _configs.SMEM_BYTES[_configs.family(cap)]))
        if d == 64:
            continue
        bcfg = _configs.bwd_config(cap, d, False, False, None)
        for name, fn in (("dkdv", b.dkdv), ("dq", b.dq)):
            rows.append((name, arch, d, fn(d, False, bcfg, arch=arch).metadata.shared,
                         _configs.SMEM_BYTES[_configs.family(cap)]))
print("JSON" + json.dumps(rows))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="compile check for CPU machines")
def test_every_config_fits_its_gpus_shared_memory():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (compiled, not interpreted)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "packages", "flash-attn-triton"), ROOT,
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.split("JSON", 1)[1])
    assert len(rows) == 14
    over = [row for row in rows if row[3] > row[4]]
    assert not over, over  # (kernel, arch, head dim, shared bytes, the family's limit)


def test_table_families():
    from flash_attn.triton import _configs

    assert [_configs.family(a) for a in ((9, 0), (10, 0), (8, 0), (8, 7), (8, 6), (8, 9), (12, 0), (12, 1))] == \
        [9, 9, 8, 8, "small", "small", "small", "small"]
    assert _configs.family(_configs.HIP_ARCH) == "hip" and _configs.family(None) == 8
