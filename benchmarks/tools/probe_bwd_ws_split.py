"""Which dK/dV launches of the warp-specialized Triton backward (_bwd_ws.py) compute right gradients on this
GPU: each config's dq/dk/dv (outputs pre-filled with NaN, so a launch that leaves rows unwritten shows) against
the FA2-style kernels' (the _BWD table's config), relative max |diff|. d256's all-warp-specialized split
(its dK launch needs 32-row steps) is wrong on the H200; this separates the split itself (d128 split) from the
32-row steps.

    python -m benchmarks.tools.probe_bwd_ws_split [all]

On the H200 (triton 3.6): 64-row steps are right with and without the dV / dK split (d128), 32-row steps give
NaN dK at d128 and d256 (16-row steps: misaligned address).
"""
import sys

import torch

from flash_attn.triton import _configs, backend as tb
from flash_attn.testing import backend_bwd, backend_fwd

W = _configs.BwdWsConfig
CASES = [
    (64, W(128, 128, 0, 0)),
    (64, W(64, 128, 0, 0)),
    (128, W(64, 128, 0, 0)),
    (256, _configs.BWD_WS_D256_FA2DK),  # dV warp-specialized, dK FA2-style (d256's default)
]
if len(sys.argv) > 1 and sys.argv[1] == "all":  # the split / 32-row cases (32-row steps: NaN dK)
    CASES += [(128, W(64, 128, 0, 0, split_dkdv=True, dk_block_m=64)),
              (128, W(64, 128, 0, 0, split_dkdv=True, dk_block_m=32)), (128, W(32, 128, 0, 0)),
              (256, W(64, 128, 0, 0, split_dkdv=True, dk_block_m=32))]
for B, S, H, Hk in [(2, 2048, 8, 8), (2, 2048, 8, 2), (3, 1000, 4, 2)]:
    for D, cfg in CASES:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(D + causal)
            q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            k, v = (torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=S, max_seqlen_k=S, block_table=None,
                      softmax_scale=D ** -0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                      softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None)
            out, lse, _ = backend_fwd(tb, q, k, v, return_probs=False, **kw)
            fa2 = _configs._lookup(_configs._BWD, (9, 0), _configs.padded_dim(D), causal)
            ref = backend_bwd(tb, do, q, k, v, out, lse, deterministic=False, config=fa2, **kw)
            grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
            try:
                got = backend_bwd(tb, do, q, k, v, out, lse, deterministic=False, config=cfg, grads=grads, **kw)
                errs = [((a.float() - r.float()).abs().max() / r.float().abs().max()).item() for a, r in zip(got, ref)]
                res = " ".join(f"{n} {e:.1e}" for n, e in zip(("dq", "dk", "dv"), errs))
                bad = any(not (e < 5e-2) for e in errs)
            except Exception as e:  # noqa: BLE001
                res, bad = f"FAILED {type(e).__name__}: {str(e)[:100]}", True
            print(f"B{B} S{S} H{H}/{Hk} d{D} causal={int(causal)} {cfg}: {res}{'  WRONG' if bad else ''}", flush=True)
